// The lowering pass (spmd/lower.h) against the single-process run: the
// shipped models, expanded from the [parallel] shorthand, lowered for each
// rank, differentiated, and run with local threads as ranks for 10 SGD steps
// beside the unlowered model on the same batches. Checked every step: the
// loss; at the end: every parameter's piece against the same box of the
// single-process parameter; and the tensor-parallel group's byte counters
// against the sum of the runner's cost_of() over the lowered graph's
// collectives (forward and backward).
//
// Tolerance. Both runs compute in f32 on the reference backend; they differ
// in the association of sums that the lowering splits over ranks (row-parallel
// contractions added by g, f's backward all-reduces, gradients of split
// parameters in different blocks). Re-associating a sum of K f32 terms moves
// it by at most about K u relative to the summed magnitudes (u = 2^-24,
// K <= 128 here: 8e-6), inherited downstream and carried by SGD from step to
// step; after 10 steps 1e-4 of the largest magnitude bounds it with room. A
// wrong rule (a missing reduction, a wrong piece, a doubled gradient) is off
// by O(1) of the values.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/base/error.h"
#include "meshtrain/base/random.h"
#include "meshtrain/comm/backends/local/local_world.h"
#include "meshtrain/exec/executor.h"
#include "meshtrain/graph/autodiff.h"
#include "meshtrain/graph/collective.h"
#include "meshtrain/models/model.h"
#include "meshtrain/spmd/collective_runner.h"
#include "meshtrain/spmd/lower.h"
#include "meshtrain/spmd/shorthand.h"

namespace mt {
namespace {

constexpr int kSteps = 10;
constexpr double kLr = 0.1;
constexpr double kRel = 1e-4;

struct Case {
  std::string label;
  ModelSpec spec;
  int64_t batch = 4;
  ParallelShorthand sh;
};

ModelSpec gpt_spec() {
  ModelSpec s;
  s.kind = "gpt";
  s.layers = 2;
  s.d_model = 24;
  s.heads = 6;
  s.seq_len = 8;
  s.vocab = 32;
  return s;
}

ModelSpec image_spec(const std::string& kind) {
  ModelSpec s;
  s.kind = kind;
  s.image_size = 8;
  s.hidden = {24, 12};
  s.conv_channels = {2, 4};
  s.fc = 12;
  return s;
}

Tensor random_like(const Shape& s, DType t, Rng& rng, double scale, int64_t modulo) {
  Tensor x = Tensor::empty(s, t);
  for (int64_t i = 0; i < x.numel(); ++i) {
    x.set_item(i, modulo > 0 ? static_cast<double>(rng.next() % static_cast<uint64_t>(modulo))
                             : scale * (2 * rng.uniform() - 1));
  }
  return x;
}

// The box of a whole tensor, copied out.
Tensor box_of(const Tensor& t, const Box& b) {
  const Shape bs = b.shape();
  Tensor out = Tensor::empty(bs, t.dtype());
  const int r = t.rank();
  std::vector<int64_t> idx(static_cast<size_t>(r), 0);
  for (int64_t i = 0; i < out.numel(); ++i) {
    int64_t rem = i, flat = 0;
    for (int d = r - 1; d >= 0; --d) {
      idx[static_cast<size_t>(d)] = rem % bs[d];
      rem /= bs[d];
    }
    for (int d = 0; d < r; ++d) {
      flat = flat * t.shape()[d] + b.begin[static_cast<size_t>(d)] + idx[static_cast<size_t>(d)];
    }
    out.set_item(i, t.item(flat));
  }
  return out;
}

double max_abs(const Tensor& t) {
  double m = 0;
  for (int64_t i = 0; i < t.numel(); ++i) m = std::max(m, std::abs(t.item(i)));
  return m;
}

void sgd(Executor& ex, const Graph& g) {
  for (ValueId p : g.params()) {
    Tensor w = ex.get(p);
    const Tensor gr = ex.get(g.grad_of(p));
    for (int64_t i = 0; i < w.numel(); ++i) w.set_item(i, w.item(i) - kLr * gr.item(i));
  }
}

Plan plan_for(const Case& c, const ModelGraph& m, int world) {
  ShorthandModel sm{c.spec.kind, c.spec.kind == "gpt" ? c.spec.d_model / c.spec.heads : 1};
  Plan p = expand_shorthand(c.sh, sm, m.graph, world);
  validate_plan(p, m.graph, world, c.batch, "parallel");
  return p;
}

void check_case(const Case& c, Communicator& world) {
  const int rank = world.rank();
  ModelGraph single = build_model(c.spec, c.batch);
  ModelGraph model = build_model(c.spec, c.batch);
  const Plan plan = plan_for(c, model, world.size());
  LoweredProgram prog = lower(model.graph, plan, rank, {model.loss});
  Graph& lg = prog.graph;
  const ValueId loss = prog[model.loss];
  build_backward(lg, loss);
  build_backward(single.graph, single.loss);

  ExecOptions o;
  o.backend = "reference";
  o.profile = false;
  Executor ex_single(single.graph, o);
  auto runner = std::make_shared<CommCollectiveRunner>(world, prog.groups);
  o.collectives = runner;
  Executor ex(lg, o);

  // Parameters: the same seeded values, each rank its box.
  Rng init(7);
  std::vector<Tensor> whole, piece;
  for (ValueId p : single.graph.params()) {
    const Value& v = single.graph.value(p);
    Tensor t = random_like(v.shape, DType::f32, init, 0.3, 0);
    const LoweredParam* lp = prog.param(v.name);
    ASSERT_NE(lp, nullptr) << v.name;
    Tensor mine = box_of(t, lp->box);
    ex_single.bind(p, t);
    ex.bind(*lg.find(v.name), mine);
    whole.push_back(t);
    piece.push_back(mine);
  }
  for (auto& [id, t] : single.constants) ex_single.bind(id, t);
  for (auto& [id, t] : model.constants) ex.bind(prog[id], t);

  const Value& xv = single.graph.value(single.x);
  const Value& yv = single.graph.value(single.y);
  const int64_t classes = c.spec.kind == "gpt" ? c.spec.vocab : c.spec.classes;
  for (int step = 0; step < kSteps; ++step) {
    Rng data(Rng::derive(99, fmt::format("step{}", step)));
    Tensor x = random_like(xv.shape, xv.dtype, data, 1.0, xv.dtype == DType::i32 ? classes : 0);
    Tensor y = random_like(yv.shape, yv.dtype, data, 1.0, classes);
    ex_single.bind(single.x, x);
    ex_single.bind(single.y, y);
    ex.bind(prog[model.x], x);
    ex.bind(prog[model.y], y);
    ex_single.run();
    ex.run();
    const double want = ex_single.get(single.loss).item();
    const double got = ex.get(loss).item();
    ASSERT_LE(std::abs(got - want), kRel * std::abs(want))
        << c.label << " rank " << rank << " step " << step << ": loss " << got << " vs " << want;
    sgd(ex_single, single.graph);
    sgd(ex, lg);
  }
  for (size_t i = 0; i < whole.size(); ++i) {
    const std::string& name = single.graph.value(single.graph.params()[i]).name;
    const Tensor want = box_of(whole[i], prog.param(name)->box);
    const double mag = max_abs(want);
    double diff = 0;
    for (int64_t k = 0; k < want.numel(); ++k) {
      diff = std::max(diff, std::abs(piece[i].item(k) - want.item(k)));
    }
    EXPECT_LE(diff, kRel * std::max(mag, 1e-3)) << c.label << " rank " << rank << " " << name;
  }

  // Bytes: the group communicator against the runner's cost functions.
  uint64_t sent = 0, calls = 0;
  for (const Node& n : lg.nodes()) {
    if (!communicates(n.op)) continue;
    ++calls;
    sent += runner->cost_of(lg, n).bytes_sent;
  }
  uint64_t counted = 0, counted_calls = 0;
  for (const auto& [axis, gid] : prog.group_of_axis) {
    const CommCounters k = runner->comm_of(gid)->counters();
    for (const auto& [kind, cc] : k.by_collective) {
      if (kind == "handshake") continue;
      counted += cc.bytes_sent;
      counted_calls += cc.calls;
    }
  }
  EXPECT_GT(calls, 0u) << c.label;
  EXPECT_EQ(counted_calls, kSteps * calls) << c.label;
  EXPECT_EQ(counted, kSteps * sent) << c.label << " rank " << rank;
}

void run_case(const Case& c, int ranks) {
  SCOPED_TRACE(c.label);
  LocalWorldOptions o;
  o.size = ranks;
  o.shm_bytes_per_rank = size_t{1} << 20;
  o.comm.timeout = std::chrono::milliseconds(60'000);
  LocalWorld::run(o, [&](Communicator& world) { check_case(c, world); });
}

TEST(Lower, MlpTensorParallelMatchesSingleProcess) {
  Case c{"mlp tp=2", image_spec("mlp"), 4, {}};
  c.sh.tp = 2;
  run_case(c, 2);
  c.label = "mlp tp=2 ratios 2:1";
  c.sh.tp_ratios = {2, 1};
  run_case(c, 2);
}

TEST(Lower, CnnClassifierTensorParallelMatchesSingleProcess) {
  Case c{"cnn tp=2", image_spec("cnn"), 4, {}};
  c.sh.tp = 2;
  run_case(c, 2);
}

TEST(Lower, GptTensorParallelMatchesSingleProcess) {
  Case c{"gpt tp=2", gpt_spec(), 2, {}};
  c.sh.tp = 2;
  run_case(c, 2);
  c.label = "gpt tp=2 ratios 2:1";
  c.sh.tp_ratios = {2, 1};
  run_case(c, 2);
  c.label = "gpt tp=3";
  c.spec.vocab = 36;
  c.sh.tp = 3;
  c.sh.tp_ratios = {};
  run_case(c, 3);
}

TEST(Lower, GptSequenceParallelMatchesSingleProcess) {
  Case c{"gpt tp=2 sp", gpt_spec(), 2, {}};
  c.sh.tp = 2;
  c.sh.sp = true;
  run_case(c, 2);
  // Megatron-SP's collectives: reduce-scatter into the row-split residual
  // stream, all-gather before the column-parallel layers (once for q, k, v),
  // no all-reduce inside the blocks. The stream is split at the first
  // residual add, so block 0's attention reads the replicated embedding (one
  // all-gather fewer) and the tied head reads the split stream (one more).
  // Two g remain outside the blocks: the vocabulary-parallel embedding's sum
  // (Megatron-SP reduce-scatters it; here the [B, T, C] lookup is reduced
  // whole) and the vocabulary-parallel loss's [N, 2] statistics.
  ModelGraph m = build_model(c.spec, c.batch);
  const LoweredProgram p = lower(m.graph, plan_for(c, m, 2), 0, {m.loss});
  std::map<OpKind, int> ops;
  std::string listing;
  for (const InsertedCollective& ic : p.inserted) {
    ++ops[ic.op];
    listing += fmt::format("{} {} ({})\n", op_name(ic.op), ic.value, ic.why);
  }
  SCOPED_TRACE(listing);
  EXPECT_EQ(ops[OpKind::reduce_scatter], 2 * c.spec.layers);
  EXPECT_EQ(ops[OpKind::all_gather], 2 * c.spec.layers);
  EXPECT_EQ(ops[OpKind::reduce_from_group], 2);
  EXPECT_EQ(ops[OpKind::all_reduce_max], 1);
  EXPECT_EQ(ops[OpKind::gather_from_group], 0);
}

// What the pass inserts for Megatron's transformer block: f before q/k/v and
// fc, g after the row-parallel projections, no collective inside attention.
TEST(Lower, GptBlockGetsMegatronCollectives) {
  ModelSpec s = gpt_spec();
  s.layers = 1;
  ModelGraph m = build_model(s, 2);
  Case c{"gpt", s, 2, {}};
  c.sh.tp = 2;
  const Plan plan = plan_for(c, m, 2);
  const LoweredProgram p = lower(m.graph, plan, 1, {m.loss});
  // {operator, the converted value's name up to its automatic number}.
  std::vector<std::string> got;
  for (const InsertedCollective& ic : p.inserted) {
    got.push_back(fmt::format("{} {}", op_name(ic.op), ic.value.substr(0, ic.value.rfind('_'))));
  }
  const std::vector<std::string> want = {
      "reduce_from_group embedding",                // g: the vocabulary-parallel lookup's sum
      "copy_to_group block0.layer_norm",            // f before q, k, v (once for the three)
      "reduce_from_group block0.attn.proj.matmul",  // g after the row-parallel projection
      "copy_to_group block0.layer_norm",            // f before fc
      "reduce_from_group block0.proj.matmul",       // g after the MLP's row-parallel proj
      "copy_to_group layer_norm",                   // f before the tied (vocabulary-split) head
      "all_reduce_max matmul",     // vocabulary-parallel loss: the logits' row maxima
      "reduce_from_group matmul",  // and the [N, 2] sums of exponentials / labels' logits
  };
  EXPECT_EQ(got, want) << fmt::format("{}", fmt::join(got, "\n"));
  // Local shapes: rank 1 of tp=2 holds 3 of the 6 heads.
  EXPECT_EQ(p.graph.value(*p.graph.find("block0.attn.q.w")).shape, (Shape{24, 12}));
  EXPECT_EQ(p.graph.value(*p.graph.find("block0.attn.proj.w")).shape, (Shape{12, 24}));
  EXPECT_EQ(p.graph.value(*p.graph.find("wte")).shape, (Shape{16, 24}));
  EXPECT_EQ(p.param("block0.attn.q.w")->box.begin, (std::vector<int64_t>{0, 12}));
  // Rank 1 looks up rows [16, 32) of the vocabulary and holds those columns
  // of the logits; no value of the program has the whole vocabulary.
  const int64_t n = 2 * s.seq_len;
  int lookups = 0;
  for (const Node& node : p.graph.nodes()) {
    for (ValueId v : node.outputs) {
      const Shape& vs = p.graph.value(v).shape;
      EXPECT_FALSE(vs.rank() == 2 && vs[1] == s.vocab && vs[0] >= n) << p.graph.value(v).name;
      EXPECT_FALSE(vs.rank() == 2 && vs[0] == s.vocab) << p.graph.value(v).name;
    }
    if (node.op == OpKind::embedding && node.attrs.has("offset")) {
      ++lookups;
      EXPECT_EQ(node.attrs.i("offset"), 16);
      EXPECT_EQ(node.attrs.i("vocab"), 32);
    }
    if (node.op == OpKind::vocab_ce_stats) {
      EXPECT_EQ(node.attrs.i("offset"), 16);
      EXPECT_EQ(p.graph.value(node.inputs[0]).shape, (Shape{n, 16}));
    }
  }
  EXPECT_EQ(lookups, 1);
}

// Uneven ratios: each rank's rows of the tied table and columns of the
// logits are its own range (2:1 over 32 rows: [0, 21) and [21, 32)); the
// training run of GptTensorParallelMatchesSingleProcess checks the numbers.
TEST(Lower, GptVocabularyRangesFollowTheRatios) {
  ModelSpec s = gpt_spec();
  s.layers = 1;
  ModelGraph m = build_model(s, 2);
  Case c{"gpt", s, 2, {}};
  c.sh.tp = 2;
  c.sh.tp_ratios = {2, 1};
  const Plan plan = plan_for(c, m, 2);
  for (int rank = 0; rank < 2; ++rank) {
    const LoweredProgram p = lower(m.graph, plan, rank, {m.loss});
    const int64_t begin = p.param("wte")->box.begin[0], end = p.param("wte")->box.end[0];
    EXPECT_EQ(begin, rank == 0 ? 0 : 21);
    EXPECT_EQ(end, rank == 0 ? 21 : 32);
    int seen = 0;
    for (const Node& node : p.graph.nodes()) {
      if (node.op == OpKind::embedding || node.op == OpKind::vocab_ce_stats) {
        if (!node.attrs.has("offset")) continue;
        ++seen;
        EXPECT_EQ(node.attrs.i("offset"), begin) << node.name;
        const int64_t rows =
            p.graph.value(node.inputs[0]).shape[node.op == OpKind::embedding ? 0 : 1];
        EXPECT_EQ(rows, end - begin) << node.name;
      }
    }
    EXPECT_EQ(seen, 2) << "rank " << rank;
  }
}

// Planned activation memory of rank 0's training program (forward and
// backward, the loss the only output, as the Trainer lowers it) at tp=2,
// with the vocabulary-parallel embedding and loss and with the split table
// and logits gathered instead (LowerOptions), for the core GPT
// (configs/gpt_text.toml) and gpt_medium shapes, at this project's
// byte-level vocabulary (256) and at GPT-2's (50257). Gathering keeps the
// whole [N, V] logits and their gradient alive around the loss; the
// vocabulary-parallel loss only this rank's columns.
TEST(Lower, VocabularyParallelPlansLessActivationMemory) {
  struct Shape_ {
    const char* name;
    int64_t layers, d_model, heads, seq_len, batch;
  };
  for (const Shape_& sh :
       {Shape_{"gpt_text", 4, 256, 4, 128, 16}, Shape_{"gpt_medium", 12, 768, 12, 256, 8}}) {
    for (int64_t vocab : {int64_t{256}, int64_t{50257}}) {
      ModelSpec s;
      s.kind = "gpt";
      s.layers = sh.layers;
      s.d_model = sh.d_model;
      s.heads = sh.heads;
      s.seq_len = sh.seq_len;
      s.vocab = vocab;
      ModelGraph m = build_model(s, sh.batch);
      Case c{sh.name, s, sh.batch, {}};
      c.sh.tp = 2;
      if (vocab % 2 != 0) c.sh.tp_ratios = {1, 1};  // 50257 rows: 25128 and 25129
      const Plan plan = plan_for(c, m, 2);
      int64_t arena[2] = {0, 0};
      for (int fused = 0; fused < 2; ++fused) {
        LowerOptions lo;
        lo.vocab_parallel = fused == 1;
        LoweredProgram p = lower(m.graph, plan, 0, {m.loss}, lo);
        build_backward(p.graph, p[m.loss]);
        arena[fused] = plan_memory(p.graph, ExecOptions{}, GradMemory::kept).arena_bytes;
      }
      const int64_t logits = sh.batch * sh.seq_len * vocab * 4;  // one whole [N, V] in f32
      std::printf(
          "%s vocab %lld tp=2: planned activations %.2f MiB gathered, %.2f MiB "
          "vocabulary-parallel (whole logits %.2f MiB)\n",
          sh.name, static_cast<long long>(vocab), arena[0] / 1048576.0, arena[1] / 1048576.0,
          logits / 1048576.0);
      EXPECT_LE(arena[1], arena[0]) << sh.name << " vocab " << vocab;
      if (vocab > 256) {
        // One whole [N, V] less (two were alive around the loss), but for
        // the loss's [N, 2] statistics and [N] maxima.
        const int64_t stats = 4 * sh.batch * sh.seq_len * 4;
        EXPECT_LE(arena[1], arena[0] - logits + stats) << sh.name << " vocab " << vocab;
      }
    }
  }
}

TEST(Lower, RejectsWhatItCannotLower) {
  ModelSpec s = image_spec("mlp");
  ModelGraph m = build_model(s, 4);
  Plan plan;
  plan.mesh = Mesh({{"tp", 2}});
  ShardingSpec both;
  both.dims = {DimSharding::over("tp"), DimSharding::over("tp")};
  plan.set_spec("fc1.w", both);
  try {
    lower(m.graph, plan, 0, {m.loss});
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("fc1.w"), std::string::npos) << e.what();
  }
  Plan partial;
  partial.mesh = Mesh({{"tp", 2}});
  ShardingSpec ps;
  ps.partial = {"tp"};
  partial.set_spec("fc1.b", ps);
  EXPECT_THROW(lower(m.graph, partial, 0, {m.loss}), ConfigError);
  EXPECT_THROW(lower(m.graph, partial, 2, {m.loss}), ConfigError);  // outside the mesh
}

}  // namespace
}  // namespace mt
