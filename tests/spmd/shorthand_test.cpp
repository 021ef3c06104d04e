#include "meshtrain/spmd/shorthand.h"

#include <gtest/gtest.h>

#include "meshtrain/base/error.h"
#include "meshtrain/models/model.h"

namespace mt {
namespace {

struct Model {
  ModelSpec spec;
  ModelGraph m;
  ShorthandModel sm;
};

Model gpt(int64_t layers = 4, int64_t heads = 4, int64_t d = 32) {
  Model r;
  r.spec.kind = "gpt";
  r.spec.layers = layers;
  r.spec.heads = heads;
  r.spec.d_model = d;
  r.spec.seq_len = 8;
  r.m = build_model(r.spec, 8);
  r.sm = {"gpt", d / heads};
  return r;
}

Model image(const std::string& kind) {
  Model r;
  r.spec.kind = kind;
  r.spec.hidden = {64, 32};
  r.spec.conv_channels = {4, 8};
  r.spec.fc = 16;
  r.m = build_model(r.spec, 8);
  r.sm = {kind, 1};
  return r;
}

Plan expand(const Model& md, const ParallelShorthand& sh, int world) {
  Plan p = expand_shorthand(sh, md.sm, md.m.graph, world);
  validate_plan(p, md.m.graph, world, 8, "parallel");
  return p;
}

std::string error_of(const Model& md, const ParallelShorthand& sh, int world) {
  try {
    expand(md, sh, world);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "no error";
}

TEST(Shorthand, GptMegatronSpecs) {
  const Model md = gpt();
  ParallelShorthand sh;
  sh.tp = 2;
  const Plan p = expand(md, sh, 4);
  EXPECT_EQ(p.mesh.describe(), "dp=2 x tp=2");
  const DimSharding heads{"tp", {}, 8};
  EXPECT_EQ(p.spec("block0.attn.q.w"), (ShardingSpec{{DimSharding{}, heads}, {}}));
  EXPECT_EQ(p.spec("block0.attn.v.b"), (ShardingSpec{{heads}, {}}));
  EXPECT_EQ(p.spec("block3.attn.proj.w"), (ShardingSpec{{heads}, {}}));
  EXPECT_TRUE(p.spec("block3.attn.proj.b").replicated());
  EXPECT_EQ(p.spec("block1.fc.w"), (ShardingSpec{{DimSharding{}, DimSharding::over("tp")}, {}}));
  EXPECT_EQ(p.spec("block1.fc.b"), (ShardingSpec{{DimSharding::over("tp")}, {}}));
  EXPECT_EQ(p.spec("block1.proj.w"), (ShardingSpec{{DimSharding::over("tp")}, {}}));
  EXPECT_TRUE(p.spec("block1.proj.b").replicated());
  EXPECT_EQ(p.spec("wte"), (ShardingSpec{{DimSharding::over("tp")}, {}}));  // vocabulary-parallel
  EXPECT_TRUE(p.spec("wpe").replicated());
  EXPECT_TRUE(p.spec("block0.ln1.g").replicated());
  EXPECT_EQ(p.spec("x"), (ShardingSpec{{DimSharding::over("dp")}, {}}));
  const Shape q = md.m.graph.value(*md.m.graph.find("block0.attn.q.w")).shape;
  EXPECT_EQ(local_box(q, p.spec("block0.attn.q.w"), p.mesh, 3), (Box{{0, 16}, {32, 32}}));
  EXPECT_FALSE(p.data_parallel_only(md.m.graph));
  EXPECT_TRUE(p.stages.empty());
}

TEST(Shorthand, UnevenHeadsAndBadRatios) {
  const Model md = gpt(2, 6, 48);  // 6 heads of 8
  ParallelShorthand sh;
  sh.tp = 2;
  sh.tp_ratios = {2, 1};
  const Plan p = expand(md, sh, 2);
  const Shape q = md.m.graph.value(*md.m.graph.find("block0.attn.k.w")).shape;
  EXPECT_EQ(local_shape(q, p.spec("block0.attn.k.w"), p.mesh, 0), (Shape{48, 32}));  // 4 heads
  EXPECT_EQ(local_shape(q, p.spec("block0.attn.k.w"), p.mesh, 1), (Shape{48, 16}));  // 2 heads
  sh.tp_ratios = {2, 1, 1};
  EXPECT_EQ(error_of(md, sh, 2),
            "parallel.tp_ratios: 3 ratios [2, 1, 1] for tp = 2 (expected 2, one per tp rank)");
  // 4 heads do not split evenly over 3 (the embedding's 256 rows neither:
  // the first spec in graph order is the one named).
  sh.tp_ratios = {};
  sh.tp = 3;
  EXPECT_EQ(error_of(gpt(2, 4, 32), sh, 3),
            "tensor wte: dimension 0 (size 256) is split evenly over axis tp of size 3, which "
            "does not divide it (expected a multiple of 3, or ratios for an uneven split)");
  sh.tp_ratios = {1, 1, 1};
  EXPECT_EQ(error_of(gpt(2, 4, 32), sh, 3), "no error");  // 2:1:1 heads, 86:85:85 rows
}

TEST(Shorthand, MlpAlternatesAndCnnSplitsTheClassifier) {
  ParallelShorthand sh;
  sh.tp = 2;
  const Plan m = expand(image("mlp"), sh, 2);
  const ShardingSpec col{{DimSharding{}, DimSharding::over("tp")}, {}};
  const ShardingSpec row{{DimSharding::over("tp")}, {}};
  EXPECT_EQ(m.spec("fc1.w"), col);
  EXPECT_EQ(m.spec("fc2.w"), row);
  EXPECT_EQ(m.spec("head.w"), col);
  EXPECT_EQ(m.spec("head.b"), (ShardingSpec{{DimSharding::over("tp")}, {}}));
  EXPECT_TRUE(m.spec("fc2.b").replicated());
  const Plan c = expand(image("cnn"), sh, 2);
  EXPECT_TRUE(c.spec("conv1.w").replicated());
  EXPECT_TRUE(c.spec("conv2.w").replicated());
  EXPECT_EQ(c.spec("fc1.w"), col);
  EXPECT_EQ(c.spec("head.w"), row);
}

TEST(Shorthand, StagesByLayersOrByFlops) {
  const Model md = gpt();
  ParallelShorthand sh;
  sh.pp = 2;
  sh.microbatches = 2;
  sh.stage_layers = {3, 1};
  Plan p = expand(md, sh, 2);
  ASSERT_EQ(p.stages.size(), 2u);
  EXPECT_EQ(p.stages[0], (StagePlan{{"wte", "wpe", "block0", "block1", "block2"}, {0}}));
  EXPECT_EQ(p.stages[1], (StagePlan{{"block3", "ln_f"}, {1}}));
  sh.stage_layers = {};
  p = expand(md, sh, 4);  // pp=2 x dp=2; equal blocks: 2 + 2
  EXPECT_EQ(p.mesh.describe(), "pp=2 x dp=2");
  EXPECT_EQ(p.stages[0], (StagePlan{{"wte", "wpe", "block0", "block1"}, {0, 1}}));
  EXPECT_EQ(p.stages[1], (StagePlan{{"block2", "block3", "ln_f"}, {2, 3}}));
  // The MLP 784-64-32-10: fc1 holds most of the FLOPs, so it stands alone.
  const Plan m = expand(image("mlp"), sh, 2);
  EXPECT_EQ(m.stages[0].layers, (std::vector<std::string>{"fc1"}));
  EXPECT_EQ(m.stages[1].layers, (std::vector<std::string>{"fc2", "head"}));
  // Interleaved: 4 virtual stages over 2 ranks.
  sh.schedule = ScheduleKind::interleaved;
  sh.virtual_stages = 2;
  p = expand(md, sh, 2);
  ASSERT_EQ(p.stages.size(), 4u);
  EXPECT_EQ(p.stages[2], (StagePlan{{"block2"}, {0}}));
  EXPECT_EQ(p.stages[3], (StagePlan{{"block3", "ln_f"}, {1}}));
}

TEST(Shorthand, ZbvFoldsTheStagesIntoAVAndRecomputeMarksStages) {
  const Model md = gpt();
  ParallelShorthand sh;
  sh.pp = 2;
  sh.microbatches = 2;
  sh.schedule = ScheduleKind::zbv;
  sh.virtual_stages = 2;
  sh.recompute_stages = {3};
  const Plan p = expand_shorthand(sh, md.sm, md.m.graph, 2);
  ASSERT_EQ(p.stages.size(), 4u);
  EXPECT_EQ(p.stages[0].ranks, std::vector<int>{0});
  EXPECT_EQ(p.stages[1].ranks, std::vector<int>{1});
  EXPECT_EQ(p.stages[2].ranks, std::vector<int>{1});
  EXPECT_EQ(p.stages[3].ranks, std::vector<int>{0});  // the loss on rank 0
  EXPECT_FALSE(p.stages[0].recompute);
  EXPECT_TRUE(p.stages[3].recompute);
  // The JSON plan keeps both (and reads them back).
  EXPECT_EQ(plan_from_json(plan_to_json(p), "t"), p);
}

TEST(Shorthand, BadShorthandNamesTheKey) {
  const Model md = gpt();
  ParallelShorthand sh;
  sh.pp = 2;
  sh.microbatches = 2;
  sh.stage_layers = {4, 0};
  EXPECT_EQ(error_of(md, sh, 2),
            "parallel.stage_layers: stage 1 gets 0 transformer blocks in [4, 0] (expected at "
            "least 1)");
  sh.stage_layers = {2, 1};
  EXPECT_EQ(error_of(md, sh, 2),
            "parallel.stage_layers: [2, 1] adds up to 3 but the gpt has 4 transformer blocks "
            "(block0, block1, block2, block3)");
  sh.stage_layers = {1, 1, 2};
  EXPECT_EQ(error_of(md, sh, 2),
            "parallel.stage_layers: 3 entries [1, 1, 2] for 2 stages (expected one per stage: "
            "pp = 2 x virtual_stages = 1)");
  sh.stage_layers = {};
  sh.recompute_stages = {0, 2};
  EXPECT_EQ(error_of(md, sh, 2),
            "parallel.recompute: stage 2 in [0, 2] (expected virtual stages 0 .. 1: pp = 2 x "
            "virtual_stages = 1)");
  sh.recompute_stages = {};
  sh.microbatches = 1;
  EXPECT_EQ(error_of(md, sh, 2),
            "parallel.microbatches: schedule 1f1b with 2 stages needs at least 2 micro-batches "
            "(one per stage to fill the pipeline), got 1");
  ParallelShorthand t;
  t.tp = 2;
  t.pp = 2;
  EXPECT_EQ(error_of(md, t, 6),
            "parallel: tp = 2 x pp = 2 = 4 does not divide the job's 6 ranks (set parallel.dp, or "
            "run a multiple of 4 ranks)");
  t.pp = 1;
  t.dp = 2;
  EXPECT_EQ(error_of(md, t, 2),
            "parallel: mesh: mesh dp=2 x tp=2 has 4 devices but the job has 2 ranks (the mesh "
            "must cover the job's ranks exactly; start 4 ranks, e.g. --nproc 4)");
  ParallelShorthand s;
  s.sp = true;
  EXPECT_EQ(error_of(md, s, 1),
            "parallel.sp: sequence parallelism splits the layer-norm regions over the tp axis, "
            "so it needs parallel.tp > 1");
  ParallelShorthand mb;
  mb.microbatches = 4;
  EXPECT_EQ(error_of(md, mb, 1),
            "parallel.microbatches: 4 micro-batches need a pipeline (parallel.pp > 1); "
            "data-parallel runs split a step with dist.accumulation_steps");
  ParallelShorthand deep;
  deep.pp = 4;
  deep.microbatches = 4;
  EXPECT_EQ(error_of(image("mlp"), deep, 4),
            "parallel.pp: 4 stages but the mlp has only 3 layers (expected at least one per "
            "stage)");
}

TEST(Shorthand, DataParallelOnlyByDefault) {
  for (const Model& md : {gpt(), image("mlp"), image("cnn")}) {
    const Plan p = expand(md, ParallelShorthand{}, 2);
    EXPECT_EQ(p.mesh.describe(), "dp=2");
    EXPECT_TRUE(p.data_parallel_only(md.m.graph));
  }
}

// The batch splits over dp exactly as the data loader splits it (equal
// shares rounded down, or dist.batch_shares), x and y at the same examples.
TEST(Shorthand, BatchSplitMatchesTheLoader) {
  const Model md = gpt();  // batch 8, seq_len 8
  const Graph& g = md.m.graph;
  const Shape xs = g.value(*g.find("x")).shape, ys = g.value(*g.find("y")).shape;
  ParallelShorthand sh;
  Plan p = expand(md, sh, 3);
  std::vector<int64_t> want = {2, 3, 3};  // shard_bounds(8, {1, 1, 1})
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(local_shape(xs, p.spec("x"), p.mesh, r)[0], want[static_cast<size_t>(r)]);
    EXPECT_EQ(local_shape(ys, p.spec("y"), p.mesh, r)[0], 8 * want[static_cast<size_t>(r)]);
  }
  sh.batch_shares = {3, 1};
  p = expand(md, sh, 2);
  EXPECT_EQ(local_box(xs, p.spec("x"), p.mesh, 1), (Box{{6, 0}, {8, 8}}));
  EXPECT_EQ(local_box(ys, p.spec("y"), p.mesh, 1), (Box{{48}, {64}}));
  sh.batch_shares = {3, 1, 1};
  EXPECT_EQ(error_of(md, sh, 2),
            "dist.batch_shares: 3 shares [3, 1, 1] for a data-parallel degree of 2 (one share "
            "per data-parallel rank)");
}

}  // namespace
}  // namespace mt
