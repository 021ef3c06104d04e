// Cutting model graphs into pipeline stages (no communication), and the
// pipeline runtime on local threads as ranks (pipeline_harness.cpp; the
// same checks run under mpirun in pipeline_mpi_test.cpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <string>

#include "meshtrain/base/error.h"
#include "meshtrain/base/random.h"
#include "meshtrain/comm/backends/local/local_world.h"
#include "meshtrain/exec/executor.h"
#include "meshtrain/graph/autodiff.h"
#include "meshtrain/graph/builder.h"
#include "meshtrain/models/model.h"
#include "meshtrain/spmd/pipeline_runtime.h"
#include "meshtrain/spmd/pipeline_stage.h"
#include "pipeline_harness.h"

namespace mt {
namespace {

std::vector<StagePlan> stages(std::vector<std::vector<std::string>> layers) {
  std::vector<StagePlan> out;
  for (auto& l : layers) out.push_back(StagePlan{std::move(l), {}});
  return out;
}

ModelSpec small_mlp() {
  ModelSpec s;
  s.image_size = 4;
  s.hidden = {12, 10};
  s.classes = 5;
  return s;
}

TEST(PipelineCut, MlpStagesExchangeOneActivationAndItsGradient) {
  ModelGraph m = build_model(small_mlp(), 6);
  const PipelineCut cut = cut_pipeline(m.graph, m.loss, stages({{"fc1"}, {"fc2", "head"}}));
  ASSERT_EQ(cut.stages.size(), 2u);
  const PipelineStage& s0 = cut.stages[0];
  const PipelineStage& s1 = cut.stages[1];
  EXPECT_EQ(s0.params, (std::vector<std::string>{"fc1.w", "fc1.b"}));
  EXPECT_EQ(s1.params, (std::vector<std::string>{"fc2.w", "fc2.b", "head.w", "head.b"}));
  EXPECT_EQ(s0.data_inputs, (std::vector<std::string>{"x"}));
  EXPECT_EQ(s1.data_inputs, (std::vector<std::string>{"y"}));
  ASSERT_EQ(s0.outputs.size(), 1u);
  ASSERT_EQ(s1.inputs.size(), 1u);
  EXPECT_EQ(s0.outputs[0].name, s1.inputs[0].name);
  EXPECT_EQ(s1.inputs[0].shape, Shape({6, 12}));  // relu(fc1) of the micro-batch
  EXPECT_TRUE(s1.inputs[0].has_grad);
  EXPECT_TRUE(s0.outputs[0].has_grad);
  EXPECT_EQ(s1.input_grads, (std::vector<std::string>{"grad/" + s1.inputs[0].name}));
  EXPECT_TRUE(s0.inputs.empty());
  EXPECT_TRUE(s0.input_grads.empty());
  EXPECT_EQ(s1.loss, m.graph.value(m.loss).name);
  EXPECT_TRUE(s0.loss.empty());
  EXPECT_TRUE(cut.shared_params.empty());
  // The first stage has no input gradient: its whole backward is weight work.
  EXPECT_EQ(s0.backward_input.graph.num_nodes(), 0);
  EXPECT_EQ(s0.backward_weight.graph.num_nodes(), s0.backward.graph.num_nodes());
  EXPECT_GT(s1.backward_input.graph.num_nodes(), 0);
  EXPECT_GT(s1.backward_weight.graph.num_nodes(), 0);
  EXPECT_EQ(s1.backward_input.graph.num_nodes() + s1.backward_weight.graph.num_nodes(),
            s1.backward.graph.num_nodes());
  // Every parameter's gradient comes out of exactly one of the split passes.
  for (const PipelineStage* st : {&s0, &s1}) {
    EXPECT_EQ(st->backward.graph.grads().size(), st->params.size());
    EXPECT_EQ(st->backward_input.graph.grads().size() + st->backward_weight.graph.grads().size(),
              st->params.size());
  }
  EXPECT_GT(s1.stash_bytes, 0);
}

TEST(PipelineCut, GptSharesTheTiedEmbeddingBetweenFirstAndLastStage) {
  ModelSpec s;
  s.kind = "gpt";
  s.layers = 2;
  s.d_model = 16;
  s.heads = 2;
  s.seq_len = 4;
  s.vocab = 24;
  ModelGraph m = build_model(s, 2);
  const PipelineCut cut =
      cut_pipeline(m.graph, m.loss, stages({{"wte", "wpe", "block0"}, {"block1", "ln_f"}}));
  ASSERT_EQ(cut.shared_params.size(), 1u);
  EXPECT_EQ(cut.shared_params[0].first, "wte");
  EXPECT_EQ(cut.shared_params[0].second, (std::vector<int>{0, 1}));
  const PipelineStage& s1 = cut.stages[1];
  EXPECT_NE(std::find(s1.params.begin(), s1.params.end(), "wte"), s1.params.end());
  EXPECT_EQ(std::find(s1.params.begin(), s1.params.end(), "wpe"), s1.params.end());
  // One boundary: the residual stream [B*T, C].
  ASSERT_EQ(s1.inputs.size(), 1u);
  EXPECT_EQ(s1.inputs[0].shape, Shape({8, 16}));
  EXPECT_EQ(s1.inputs[0].bytes(), 8 * 16 * 4);
  std::vector<std::string> first_inputs = cut.stages[0].data_inputs;
  std::sort(first_inputs.begin(), first_inputs.end());
  EXPECT_EQ(first_inputs, (std::vector<std::string>{"pos", "x"}));
  EXPECT_EQ(s1.data_inputs, (std::vector<std::string>{"y"}));
}

TEST(PipelineCut, BadStagesAreRejectedNamingTheLayer) {
  ModelGraph m = build_model(small_mlp(), 6);
  auto message = [&](std::vector<std::vector<std::string>> layers) {
    try {
      cut_pipeline(m.graph, m.loss, stages(std::move(layers)));
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  EXPECT_NE(message({{"fc1"}, {"fc2"}}).find("layer 'head' (of parameter 'head.w') is in no stage"),
            std::string::npos);
  EXPECT_NE(
      message({{"fc1", "fc2"}, {"fc2", "head"}}).find("layer 'fc2' is in stage 0 and stage 1"),
      std::string::npos);
  EXPECT_NE(message({{"fc1", "fc2"}, {"head", "fc9"}}).find("lists layer 'fc9'"),
            std::string::npos);
  EXPECT_NE(message({{"fc1", "fc2", "head"}, {}}).find("loss"), std::string::npos);
}

// x -> a: h1 = tanh(x Wa) -> b: h2 = tanh(h1 Wb) -> c: logits = h2 Wc + h1 Vc:
// h1 skips stage 1, which receives it, passes it on, and returns the
// gradient stage 2 sent for it.
struct SkipModel {
  Graph g;
  ValueId x, y, loss;
};
SkipModel skip_model(int64_t batch) {
  SkipModel m;
  Builder b(m.g);
  m.x = b.input("x", {batch, 6});
  m.y = b.input("y", {batch}, DType::i32);
  const ParamInit init{ParamInit::Kind::normal, 0.5};
  ValueId h1 = b.tanh(b.matmul(m.x, b.param("a.w", {6, 5}, init)));
  ValueId h2 = b.tanh(b.matmul(h1, b.param("b.w", {5, 5}, init)));
  ValueId logits =
      b.add(b.matmul(h2, b.param("c.w", {5, 3}, init)), b.matmul(h1, b.param("c.v", {5, 3}, init)));
  m.loss = b.cross_entropy(logits, m.y);
  return m;
}

Tensor draw(const Shape& s, uint64_t seed, int classes = 0) {
  Rng rng(seed);
  Tensor t = Tensor::empty(s, classes ? DType::i32 : DType::f32);
  for (int64_t i = 0; i < t.numel(); ++i) {
    t.set_item(i, classes ? static_cast<double>(rng.next() % static_cast<uint64_t>(classes))
                          : 2 * rng.uniform() - 1);
  }
  return t;
}

TEST(PipelineLocal, AValueSkippingAStageIsPassedOnAndItsGradientReturned) {
  const int64_t B = 8;
  const int m = 2;
  SkipModel micro = skip_model(B / m);
  const PipelineCut cut = cut_pipeline(micro.g, micro.loss, stages({{"a"}, {"b"}, {"c"}}));
  const std::string h1 = cut.stages[0].outputs.at(0).name;
  ASSERT_EQ(cut.stages[1].inputs.size(), 1u);
  ASSERT_EQ(cut.stages[1].outputs.size(), 2u);  // h1 passed on, and h2
  EXPECT_EQ(cut.stages[1].outputs[0].name, h1);
  EXPECT_EQ(cut.stages[2].inputs.size(), 2u);
  EXPECT_TRUE(cut.stages[1].inputs[0].has_grad);

  // The single-process gradients at the global batch.
  SkipModel full = skip_model(B);
  build_backward(full.g, full.loss);
  const Tensor x = draw({B, 6}, 1), y = draw({B}, 2, 3);
  std::map<std::string, Tensor> params;
  ExecOptions o;
  o.backend = "reference";
  Executor ex(full.g, o);
  for (ValueId p : full.g.params()) {
    params[full.g.value(p).name] = draw(full.g.value(p).shape, 10 + static_cast<uint64_t>(p));
    ex.bind(p, params[full.g.value(p).name]);
  }
  ex.bind(full.x, x);
  ex.bind(full.y, y);
  ex.run();

  LocalWorldOptions lo;
  lo.size = 3;
  lo.comm.timeout = std::chrono::milliseconds(60'000);
  LocalWorld::run(lo, [&](Communicator& w) {
    PipelineOptions po;
    po.exec.backend = "reference";
    PipelineRuntime pipe(w, cut, make_schedule(ScheduleKind::gpipe, 3, m), po);
    for (const std::string& name : pipe.param_names()) pipe.set_param(name, params.at(name));
    pipe.run_step([&](int mb, const std::string& name) {
      const Tensor& t = name == "x" ? x : y;
      std::vector<int64_t> dims = t.shape().dims();
      dims[0] /= m;
      Tensor out = Tensor::empty(Shape(dims), t.dtype());
      std::memcpy(out.raw(), static_cast<const char*>(t.raw()) + out.nbytes() * mb, out.nbytes());
      return out;
    });
    for (const std::string& name : pipe.param_names()) {
      const Tensor want = ex.get(full.g.grad_of(*full.g.find(name)));
      for (int64_t i = 0; i < want.numel(); ++i) {
        EXPECT_NEAR(pipe.grad(name).item(i), want.item(i), 1e-6) << name << "[" << i << "]";
      }
    }
  });
}

void on_threads(const test::PipeCase& c, int ranks = 2) {
  LocalWorldOptions o;
  o.size = ranks;
  o.comm.timeout = std::chrono::milliseconds(60'000);
  LocalWorld::run(o, [&](Communicator& world) { test::check_pipeline_matches_single(world, c); });
}

TEST(PipelineLocal, Mlp1f1bMatchesTheSingleProcessRun) {
  on_threads(test::PipeCase{"mlp", ScheduleKind::one_f_one_b, 4, 1, {3, 2}});
}

TEST(PipelineLocal, GptZeroBubbleMatchesTheSingleProcessRun) {
  on_threads(test::PipeCase{"gpt", ScheduleKind::zero_bubble, 2, 1, {}});
}

TEST(PipelineLocal, GptZbvMatchesTheSingleProcessRun) {
  // The V: rank 0 holds blocks 0 and 3 (wte for the embedding and the head,
  // the loss), rank 1 blocks 1 and 2, handed over in memory at the turn.
  on_threads(test::PipeCase{"gpt", ScheduleKind::zbv, 4, 2, {1, 1, 1, 1}});
}

TEST(PipelineLocal, GptDualPipeVMatchesTheSingleProcessRun) {
  // The V of zbv, DualPipeV's order: whole backwards in the steady phase,
  // input / weight passes in the tail; m = 2p = 4.
  on_threads(test::PipeCase{"gpt", ScheduleKind::dualpipev, 4, 2, {1, 1, 1, 1}});
}

TEST(PipelineLocal, GptOneFOneBWithExtraWarmupMatchesTheSingleProcessRun) {
  on_threads(test::PipeCase{"gpt", ScheduleKind::one_f_one_b, 4, 1, {}, false, 1});
}

TEST(PipelineLocal, OneFOneBHoldsFewerMicroBatchesThanGpipe) {
  // m = 4 micro-batches of the GPT on 2 stages: GPipe runs every forward
  // before any backward, so stage 0 holds all four stashes at once; 1F1B
  // starts backward after p forwards and holds about two.
  std::vector<test::PipeMemory> gpipe(2), ofob(2);
  LocalWorldOptions o;
  o.size = 2;
  o.comm.timeout = std::chrono::milliseconds(60'000);
  LocalWorld::run(o, [&](Communicator& w) {
    gpipe[static_cast<size_t>(w.rank())] =
        test::check_pipeline_matches_single(w, {"gpt", ScheduleKind::gpipe, 4, 1, {}});
    ofob[static_cast<size_t>(w.rank())] =
        test::check_pipeline_matches_single(w, {"gpt", ScheduleKind::one_f_one_b, 4, 1, {}});
  });
  EXPECT_GE(gpipe[0].peak_stash, 4 * gpipe[0].planned_per_microbatch);
  EXPECT_LT(ofob[0].peak_stash, 3 * ofob[0].planned_per_microbatch);
  EXPECT_LT(ofob[0].peak_stash, gpipe[0].peak_stash);
  EXPECT_LT(ofob[1].peak_stash, gpipe[1].peak_stash);
  // Copies: 1F1B's first stage at p = 2 keeps its 2 micro-batches in
  // flight as views in its forward arenas and sends its activations
  // straight from them, so it copies nothing (its inputs need no
  // gradient); GPipe's 4 in flight outnumber the arenas, so it copies the
  // stash of those beyond them.
  EXPECT_GT(ofob[0].outputs_per_microbatch, 0);
  EXPECT_EQ(ofob[0].copied, 0);
  EXPECT_GT(gpipe[0].copied, 4 * gpipe[0].outputs_per_microbatch);
}

TEST(PipelineLocal, RecomputationMatchesAndHoldsOnlyTheStageInputs) {
  // GPT, 1F1B on 2 stages, every stage recomputing its forward before its
  // backward: the same losses and parameters. Stage 0 has two micro-batches
  // in flight: without recomputation it holds two whole stashes, with it
  // only what it keeps (nothing received: its input is the data) plus the
  // one stash rebuilt for the backward. Stage 1 runs each backward right
  // after its forward (1F1B's last stage holds one micro-batch), so
  // recomputation rebuilds at once what it dropped: no saving there.
  std::vector<test::PipeMemory> full(2), rec(2);
  LocalWorldOptions o;
  o.size = 2;
  o.comm.timeout = std::chrono::milliseconds(60'000);
  LocalWorld::run(o, [&](Communicator& w) {
    full[static_cast<size_t>(w.rank())] =
        test::check_pipeline_matches_single(w, {"gpt", ScheduleKind::one_f_one_b, 4, 1, {}});
    rec[static_cast<size_t>(w.rank())] =
        test::check_pipeline_matches_single(w, {"gpt", ScheduleKind::one_f_one_b, 4, 1, {}, true});
  });
  EXPECT_GE(full[0].peak_stash, 2 * full[0].planned_per_microbatch);
  EXPECT_LT(rec[0].peak_stash, 2 * rec[0].planned_per_microbatch);
  EXPECT_LE(rec[1].peak_stash, full[1].peak_stash);
  EXPECT_EQ(rec[0].planned_per_microbatch_recomputed, 0);  // stage 0 receives nothing
  EXPECT_GT(rec[1].planned_per_microbatch_recomputed, 0);  // the residual stream
  EXPECT_LT(rec[1].planned_per_microbatch_recomputed, rec[1].planned_per_microbatch);
}

TEST(PipelineLocal, RecomputationUnderTheVLowersTheMeasuredStash) {
  // GPT on 2 ranks, the V schedules (2 chunks a rank, the turn handed over
  // in memory on rank 1): recomputation keeps only the chunks' inputs
  // between forward and backward and rebuilds one stash at a time (the
  // whole backward at the input pass; a deferred weight pass held one
  // rebuilt stash per waiting micro-batch, as many as without
  // recomputation), so each rank's measured peak stash falls below the run
  // without it and stays within the plan, up to the boundary tensors in
  // transit the plan leaves out (pipeline_stage.h): each chunk's outputs,
  // their gradients and its input gradients for one micro-batch.
  for (ScheduleKind k : {ScheduleKind::zbv, ScheduleKind::dualpipev}) {
    std::vector<test::PipeMemory> full(2), rec(2);
    LocalWorldOptions o;
    o.size = 2;
    o.comm.timeout = std::chrono::milliseconds(60'000);
    LocalWorld::run(o, [&](Communicator& w) {
      full[static_cast<size_t>(w.rank())] =
          test::check_pipeline_matches_single(w, {"gpt", k, 4, 2, {1, 1, 1, 1}});
      rec[static_cast<size_t>(w.rank())] =
          test::check_pipeline_matches_single(w, {"gpt", k, 4, 2, {1, 1, 1, 1}, true});
    });
    for (size_t r = 0; r < 2; ++r) {
      std::printf(
          "%s rank %zu: peak stash %lld B (planned %lld), recomputed %lld B (planned %lld + "
          "%lld in transit)\n",
          std::string(schedule_name(k)).c_str(), r, static_cast<long long>(full[r].peak_stash),
          static_cast<long long>(full[r].planned_peak), static_cast<long long>(rec[r].peak_stash),
          static_cast<long long>(rec[r].planned_peak),
          static_cast<long long>(rec[r].boundary_per_microbatch));
      EXPECT_LT(rec[r].planned_peak, full[r].planned_peak) << "rank " << r;
      EXPECT_LT(rec[r].peak_stash, full[r].peak_stash) << "rank " << r;
      EXPECT_LE(rec[r].peak_stash, rec[r].planned_peak + rec[r].boundary_per_microbatch)
          << "rank " << r;
    }
  }
}

TEST(PipelineLocal, InterleavedChunksOnOneRankHandOverInMemory) {
  // One physical stage holding four model chunks: every boundary is local.
  on_threads(test::PipeCase{"gpt", ScheduleKind::interleaved, 2, 4, {1, 1, 1, 1}}, 1);
}

}  // namespace
}  // namespace mt
