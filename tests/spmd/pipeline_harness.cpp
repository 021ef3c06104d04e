// Pipeline-parallel training against the single-process run.
//
// Every rank builds the model twice: at the global batch B (the single-
// process reference, differentiated by build_backward and run whole) and at
// the micro-batch B/m (cut into the plan's stages and run by the pipeline
// runtime). Both start from the same parameters (drawn per name from a fixed
// seed), see the same batches (drawn per step; micro-batch i is rows
// [i B/m, (i+1) B/m) of the global one) and take plain SGD steps.
//
// Tolerance. Both compute in f32 on the reference backend with the same
// operators; they differ only in the order of sums: a parameter gradient is
// one contraction over the B rows in the reference and m contractions over
// B/m rows averaged in the pipeline (the mean 1/B as 1/m x 1/(B/m)), the
// loss likewise, and the tied embedding's two parts are added in another
// order. Re-associating a sum of n f32 terms moves it by at most n u
// sum|terms| (u = 2^-24, n <= 16 rows or tokens here): ~2e-6 relative to the
// magnitudes summed; SGD carries each step's difference into the next, so
// after 10 steps about 2e-5. Checked: |pipe - single| <= 5e-5 x
// max(|single| over the tensor, 1e-3) per parameter, and 5e-5 x |loss| per
// step. A wrong gradient (a missing part of the tied embedding, a micro-
// batch counted twice, a lost 1/m) is off by O(1) of the values.
#include "pipeline_harness.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/base/random.h"
#include "meshtrain/exec/executor.h"
#include "meshtrain/graph/autodiff.h"
#include "meshtrain/models/model.h"
#include "meshtrain/spmd/pipeline_runtime.h"
#include "meshtrain/spmd/pipeline_stage.h"
#include "meshtrain/spmd/shorthand.h"

namespace mt::test {

namespace {

constexpr int kSteps = 10;
constexpr double kLr = 0.1;
constexpr double kRel = 5e-5;

ModelSpec spec_for(const PipeCase& c) {
  ModelSpec s;
  s.kind = c.model;
  if (c.model == "mlp") {
    s.image_channels = 1;
    s.image_size = 4;  // 16 inputs
    s.hidden = {12, 10, 8, 8};
    s.classes = 5;
  } else {
    s.layers = 4;
    s.d_model = 16;
    s.heads = 2;
    s.seq_len = 4;
    s.vocab = 24;
  }
  return s;
}

int64_t global_batch(const PipeCase& c) {
  return c.model == "mlp" ? 8 : 4;
}

Tensor init_param(const Value& v) {
  Rng rng(Rng::derive(2024, v.name));
  Tensor t = Tensor::empty(v.shape, v.dtype);
  const double scale = v.init.kind == ParamInit::Kind::ones ? 0.0 : 0.3;
  const double base = v.init.kind == ParamInit::Kind::ones ? 1.0 : 0.0;
  for (int64_t i = 0; i < t.numel(); ++i) t.set_item(i, base + scale * (2 * rng.uniform() - 1));
  return t;
}

// The global batch of one step: x (f32 images or i32 tokens) and y.
struct Batch {
  Tensor x, y;
};

Batch make_batch(const ModelSpec& s, const ModelGraph& m, int step) {
  Rng rng(Rng::derive(77, fmt::format("step{}", step)));
  Batch b;
  const Value& xv = m.graph.value(m.x);
  const Value& yv = m.graph.value(m.y);
  b.x = Tensor::empty(xv.shape, xv.dtype);
  b.y = Tensor::empty(yv.shape, yv.dtype);
  const int64_t x_high = s.kind == "gpt" ? s.vocab : 0;
  for (int64_t i = 0; i < b.x.numel(); ++i) {
    b.x.set_item(i, x_high ? static_cast<double>(rng.next() % static_cast<uint64_t>(x_high))
                           : 2 * rng.uniform() - 1);
  }
  const auto classes = static_cast<uint64_t>(s.kind == "gpt" ? s.vocab : s.classes);
  for (int64_t i = 0; i < b.y.numel(); ++i) {
    b.y.set_item(i, static_cast<double>(rng.next() % classes));
  }
  return b;
}

// Rows [i n/m, (i+1) n/m) along dim 0.
Tensor rows(const Tensor& t, int i, int m) {
  const int64_t n = t.shape()[0];
  std::vector<int64_t> dims = t.shape().dims();
  dims[0] = n / m;
  Tensor out = Tensor::empty(Shape(dims), t.dtype());
  const size_t bytes = out.nbytes();
  std::memcpy(out.raw(), static_cast<const char*>(t.raw()) + bytes * static_cast<size_t>(i), bytes);
  return out;
}

Plan pipeline_plan(const PipeCase& c, const ModelSpec& s, const Graph& g, int world) {
  if (world == 1) {
    // The shorthand wants pp > 1 for micro-batches; one rank holding every
    // chunk is written out: gpt blocks one per chunk, embeddings first,
    // ln_f last.
    Plan plan;
    const std::vector<std::string> layers = model_layers(g);
    for (const std::string& l : layers) {
      if (l.rfind("block", 0) == 0) plan.stages.push_back(StagePlan{{l}, {0}});
    }
    plan.stages.front().layers.insert(plan.stages.front().layers.begin(), {"wte", "wpe"});
    plan.stages.back().layers.push_back("ln_f");
    for (StagePlan& st : plan.stages) st.recompute = c.recompute;
    return plan;
  }
  ParallelShorthand sh;
  sh.pp = world;
  sh.microbatches = c.microbatches;
  sh.schedule = c.schedule;
  sh.virtual_stages = c.virtual_stages;
  sh.stage_layers = c.stage_layers;
  sh.recompute = c.recompute;
  sh.warmup_extra = c.warmup_extra;
  ShorthandModel model{s.kind, s.kind == "gpt" ? s.d_model / s.heads : 1};
  return expand_shorthand(sh, model, g, world);
}

double max_abs(const Tensor& t) {
  double m = 0;
  for (int64_t i = 0; i < t.numel(); ++i) m = std::max(m, std::abs(t.item(i)));
  return m;
}

}  // namespace

PipeMemory check_pipeline_matches_single(Communicator& comm, const PipeCase& c) {
  const ModelSpec s = spec_for(c);
  const int64_t B = global_batch(c);
  const int m = c.microbatches;
  ModelGraph single = build_model(s, B);
  build_backward(single.graph, single.loss);
  ModelGraph micro = build_model(s, B / m);

  const Plan plan = pipeline_plan(c, s, micro.graph, comm.size());
  const PipelineCut cut = cut_pipeline(micro.graph, micro.loss, plan.stages);
  check_schedule(c.schedule, comm.size(), m, c.virtual_stages, "test");
  PipelineOptions po;
  po.exec.backend = "reference";
  PipelineRuntime pipe(
      comm, cut, make_schedule(c.schedule, comm.size(), m, c.virtual_stages, c.warmup_extra), po);

  ExecOptions o;
  o.backend = "reference";
  Executor ex(single.graph, o);
  std::map<std::string, Tensor> params;
  for (ValueId p : single.graph.params()) {
    const Value& v = single.graph.value(p);
    params[v.name] = init_param(v);
    ex.bind(p, params[v.name]);
  }
  for (const auto& [id, t] : single.constants) ex.bind(id, t);
  for (const std::string& name : pipe.param_names()) {
    pipe.set_param(name, params.at(name));
  }
  std::map<std::string, Tensor> micro_constants;
  for (const auto& [id, t] : micro.constants) micro_constants[micro.graph.value(id).name] = t;

  // Closed-form bytes per step: every micro-batch's boundary activation one
  // way and its gradient the other; GPT also sends the tied embedding's
  // gradient part each way once.
  int64_t boundary_elems = 0;
  if (c.model == "mlp") {
    // A stage boundary after hidden layer k carries relu(fc_k) [B/m, hidden[k-1]].
    const int64_t k = c.stage_layers.empty() ? 2 : c.stage_layers[0];
    boundary_elems = (B / m) * s.hidden[static_cast<size_t>(k - 1)];
  } else {
    boundary_elems = (B / m) * s.seq_len * s.d_model;  // the residual stream
  }
  // Rank r sends the activations of its virtual stages but the last one and
  // the gradients of its virtual stages but the first: (2v - 1) m tensors.
  // ZBV's V (rank r holds r and 2p-1-r): its shallow chunk sends
  // activations unless r = p-1 (the turn stays on the rank) and gradients
  // unless r = 0; its deep chunk the other way round: 2 m per side that has
  // a neighbour. The tied embedding's two stages are both on rank 0 there.
  const bool v_shape = is_v_shaped(c.schedule);
  const int r = comm.rank(), ranks = comm.size();
  const int boundaries_sent = v_shape ? 2 * m * ((r < ranks - 1 ? 1 : 0) + (r > 0 ? 1 : 0))
                                      : m * (2 * c.virtual_stages - 1);
  uint64_t expected_bytes = static_cast<uint64_t>(boundaries_sent * boundary_elems * 4);
  if (c.model == "gpt" && !v_shape) {
    expected_bytes += static_cast<uint64_t>(s.vocab * s.d_model * 4);
  }
  if (comm.size() == 1) expected_bytes = 0;  // chunks on one rank hand tensors over in memory

  int64_t recv_buffers_first = 0;  // made in the first two steps
  for (int step = 0; step < kSteps; ++step) {
    const Batch b = make_batch(s, single, step);
    ex.bind(single.x, b.x);
    ex.bind(single.y, b.y);
    ex.run();
    const double want_loss = ex.get(single.loss).item();
    for (ValueId p : single.graph.params()) {
      Tensor& w = params[single.graph.value(p).name];
      const Tensor g = ex.get(single.graph.grad_of(p));
      for (int64_t i = 0; i < w.numel(); ++i) w.set_item(i, w.item(i) - kLr * g.item(i));
    }

    pipe.run_step([&](int mb, const std::string& name) -> Tensor {
      if (name == "x") return rows(b.x, mb, m);
      if (name == "y") return rows(b.y, mb, m);
      auto it = micro_constants.find(name);
      return it == micro_constants.end() ? Tensor() : it->second;
    });
    pipe.sgd_step(kLr);
    if (pipe.has_loss()) {
      EXPECT_NEAR(pipe.loss(), want_loss, kRel * std::abs(want_loss)) << "step " << step;
    }
    EXPECT_EQ(pipe.bytes_sent(), expected_bytes) << "step " << step << ", rank " << comm.rank();
    EXPECT_EQ(pipe.predicted_bytes_sent(), expected_bytes) << "rank " << comm.rank();
    if (step == 1) recv_buffers_first = pipe.recv_buffers_made();
  }
  // Receive buffers are kept and reused: the steps after the second make
  // none (a fresh one costs its page faults inside the receiver's copy; the
  // second step may still add those its executors held bound from the first).
  EXPECT_EQ(pipe.recv_buffers_made(), recv_buffers_first) << "rank " << comm.rank();
  if (comm.size() > 1) {
    EXPECT_GT(recv_buffers_first, 0) << "rank " << comm.rank();
  }
  EXPECT_EQ(pipe.has_loss(), comm.rank() == stage_owner(c.schedule, comm.size(),
                                                        comm.size() * c.virtual_stages - 1));
  // One span per compute action of this rank's list (a pass without nodes,
  // the first stage's input-gradient pass, runs nothing), in list order.
  {
    const PipelineSchedule sched =
        make_schedule(c.schedule, comm.size(), m, c.virtual_stages, c.warmup_extra);
    std::vector<PipelineSpan> want;
    for (const PipelineAction& a : sched.actions[static_cast<size_t>(comm.rank())]) {
      if (!a.is_compute()) continue;
      const PipelineStage& st = cut.stages[static_cast<size_t>(a.stage)];
      // A recomputing stage runs its whole backward at the input pass and
      // nothing at the weight pass.
      if (st.recompute && a.kind == ActionKind::backward_weight) continue;
      if (st.recompute && a.kind == ActionKind::backward_input) {
        want.push_back({a.stage, a.microbatch, ActionKind::backward});
        continue;
      }
      if (a.kind == ActionKind::backward_input && st.backward_input.graph.num_nodes() == 0) {
        continue;
      }
      want.push_back({a.stage, a.microbatch, a.kind});
    }
    // Recomputation adds a forward before each backward of a recomputing
    // stage; the others are the list's.
    std::vector<PipelineSpan> spans;
    size_t recomputed = 0;
    for (const PipelineSpan& sp : pipe.spans()) {
      if (!sp.recompute) {
        spans.push_back(sp);
        continue;
      }
      EXPECT_TRUE(c.recompute && sp.kind == ActionKind::forward);
      ++recomputed;
    }
    if (c.recompute) {
      EXPECT_EQ(recomputed, static_cast<size_t>(m * c.virtual_stages)) << "rank " << comm.rank();
    }
    EXPECT_EQ(spans.size(), want.size());
    for (size_t i = 0; i < std::min(want.size(), spans.size()); ++i) {
      const PipelineSpan& got = spans[i];
      EXPECT_TRUE(got.stage == want[i].stage && got.microbatch == want[i].microbatch &&
                  got.kind == want[i].kind)
          << "span " << i;
      EXPECT_LE(got.start_ns, got.end_ns);
      if (i > 0) {
        EXPECT_GE(got.start_ns, spans[i - 1].end_ns);
      }
    }
  }
  double worst_rel = 0;
  for (const std::string& name : pipe.param_names()) {
    const Tensor& want = params.at(name);
    const Tensor& got = pipe.param(name);
    const double tol = kRel * std::max(max_abs(want), 1e-3);
    double worst = 0;
    int64_t where = 0;
    for (int64_t i = 0; i < want.numel(); ++i) {
      const double d = std::abs(got.item(i) - want.item(i));
      if (d > worst) {
        worst = d;
        where = i;
      }
    }
    worst_rel = std::max(worst_rel, worst / std::max(max_abs(want), 1e-3));
    EXPECT_LE(worst, tol) << "rank " << comm.rank() << " parameter " << name << " element " << where
                          << ": pipeline " << got.item(where) << ", single " << want.item(where);
  }
  std::printf(
      "rank %d: %zu parameters, largest difference %.2e of the tensor's scale; peak "
      "stash %lld bytes (%lld per micro-batch planned)\n",
      comm.rank(), pipe.param_names().size(), worst_rel,
      static_cast<long long>(pipe.peak_stash_bytes()),
      static_cast<long long>(cut.stages[static_cast<size_t>(comm.rank())].stash_bytes));
  int64_t outputs = 0;
  for (const StageBoundary& b : cut.stages[static_cast<size_t>(comm.rank())].outputs) {
    outputs += b.shape.numel() * static_cast<int64_t>(dtype_size(b.dtype));
  }
  const PipelineSchedule sched =
      make_schedule(c.schedule, comm.size(), m, c.virtual_stages, c.warmup_extra);
  int64_t boundary = 0;
  for (const PipelineStage& st : cut.stages) {
    if (sched.owner(st.index) != comm.rank()) continue;
    for (const StageBoundary& b : st.outputs) boundary += b.bytes() * (b.has_grad ? 2 : 1);
    for (const StageBoundary& b : st.inputs) boundary += b.has_grad ? b.bytes() : 0;
  }
  return PipeMemory{pipe.peak_stash_bytes(),
                    cut.stages[static_cast<size_t>(comm.rank())].stash_bytes,
                    cut.stages[static_cast<size_t>(comm.rank())].recompute_stash_bytes,
                    pipe.stash_copied_bytes(),
                    outputs,
                    planned_stash_bytes(cut, sched, comm.rank()),
                    boundary};
}

void check_gpipe_idle_fraction(Communicator& comm, int microbatches) {
  // Four equal hidden layers, two per stage (stage 1 also runs the small
  // head and the loss; stage 0's first layer needs no input gradient, so
  // its backward is about a sixth lighter), wide enough that a micro-batch's
  // matmuls take milliseconds, so send / recv latency is small beside them.
  ModelSpec s;
  s.kind = "mlp";
  s.image_size = 32;  // 1024 inputs
  s.hidden = {1024, 1024, 1024, 1024};
  s.classes = 10;
  const int m = microbatches, p = comm.size();
  const int64_t mb = 128;
  ModelGraph micro = build_model(s, mb);
  const Plan plan =
      pipeline_plan(PipeCase{"mlp", ScheduleKind::gpipe, m, 1, {2, 3}}, s, micro.graph, p);
  const PipelineCut cut = cut_pipeline(micro.graph, micro.loss, plan.stages);
  PipelineOptions po;
  po.exec.num_threads = 1;
  PipelineRuntime pipe(comm, cut, make_schedule(ScheduleKind::gpipe, p, m), po);
  for (const std::string& name : pipe.param_names()) {
    Tensor t = pipe.param(name);
    Rng rng(Rng::derive(5, name));
    for (int64_t i = 0; i < t.numel(); ++i) t.set_item(i, 0.03 * (2 * rng.uniform() - 1));
  }
  Rng rng(11);
  Tensor x = Tensor::empty({mb, 1024}, DType::f32), y = Tensor::empty({mb}, DType::i32);
  for (int64_t i = 0; i < x.numel(); ++i) x.set_item(i, 2 * rng.uniform() - 1);
  for (int64_t i = 0; i < y.numel(); ++i) y.set_item(i, static_cast<double>(rng.next() % 10));

  // Per step, from every rank's spans: idle = 1 - sum(busy) / (p x makespan),
  // the makespan from the first compute start to the last compute end on
  // any rank (now_ns() is CLOCK_MONOTONIC, shared by the node's processes).
  // Also the share of the spans' wall time their thread spent on a CPU: on
  // an oversubscribed machine a pass is descheduled and a message waits for
  // its receiver to be scheduled, which the formula does not model.
  const double formula = formula_idle_fraction(ScheduleKind::gpipe, p, m, 1);
  std::vector<double> idle, cpu_share;
  for (int step = 0; step < 6; ++step) {
    pipe.run_step([&](int, const std::string& name) { return name == "x" ? x : y; });
    pipe.sgd_step(0.01);
    double mine[4] = {0, 1e300, -1e300, 0};  // busy, first start, last end, cpu (ns)
    for (const PipelineSpan& sp : pipe.spans()) {
      mine[0] += static_cast<double>(sp.end_ns - sp.start_ns);
      mine[1] = std::min(mine[1], static_cast<double>(sp.start_ns));
      mine[2] = std::max(mine[2], static_cast<double>(sp.end_ns));
      mine[3] += static_cast<double>(sp.cpu_ns);
    }
    std::vector<double> all(static_cast<size_t>(4 * p));
    comm.all_gather(mine, all.data(), 4, DType::f64);
    double busy = 0, first = 1e300, last = -1e300, cpu = 0;
    for (int r = 0; r < p; ++r) {
      busy += all[static_cast<size_t>(4 * r)];
      first = std::min(first, all[static_cast<size_t>(4 * r + 1)]);
      last = std::max(last, all[static_cast<size_t>(4 * r + 2)]);
      cpu += all[static_cast<size_t>(4 * r + 3)];
    }
    // MT_PIPE_DEBUG=1 prints one step's spans (ms from the first start).
    if (std::getenv("MT_PIPE_DEBUG") && step == 3) {
      for (const PipelineSpan& sp : pipe.spans()) {
        std::printf("rank %d %s%d %.2f..%.2f ms cpu %.2f\n", comm.rank(),
                    std::string(action_name(sp.kind)).c_str(), sp.microbatch,
                    (static_cast<double>(sp.start_ns) - first) * 1e-6,
                    (static_cast<double>(sp.end_ns) - first) * 1e-6, sp.cpu_ns * 1e-6);
      }
    }
    if (step == 0) continue;  // warm-up
    idle.push_back(1 - busy / (p * (last - first)));
    cpu_share.push_back(cpu / busy);
  }
  std::sort(idle.begin(), idle.end());
  std::sort(cpu_share.begin(), cpu_share.end());
  const double median = idle[idle.size() / 2];
  const double share = cpu_share[cpu_share.size() / 2];
  std::printf(
      "rank %d: GPipe p=%d m=%d idle fraction median %.3f (steps %.3f .. %.3f), formula "
      "%.3f; passes on a CPU %.0f%% of their wall time\n",
      comm.rank(), p, m, median, idle.front(), idle.back(), formula, 100 * share);
  // Idle below the formula means the spans or the clock are wrong, loaded or not.
  EXPECT_GE(median, formula - 0.05);
  // 95%: at 87% one run measured 0.49 (the progress threads that move the
  // messages were starved too, which the compute share does not show).
  if (share < 0.95) {
    GTEST_SKIP() << "the machine is oversubscribed (passes ran on a CPU " << 100 * share
                 << "% of their wall time): idle fraction " << median << " against the formula's "
                 << formula << " is not a measure of the schedule here";
  }
  // The stages overlap: run one after another they would idle (p-1)/p of
  // the time. How near the formula a step comes depends on the stages'
  // unequal costs and the messages' latency on the machine at hand, so that
  // is measured and reported (bench/run spmd's pipeline_idle_fraction next to
  // the formula), not asserted.
  EXPECT_LT(median, static_cast<double>(p - 1) / p)
      << "the stages did not overlap (formula " << formula << ")";
}

}  // namespace mt::test
