#include "meshtrain/spmd/plan.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "meshtrain/base/error.h"
#include "meshtrain/models/model.h"
#include "meshtrain/spmd/cross_mesh.h"
#include "meshtrain/spmd/shorthand.h"

namespace mt {
namespace {

ModelGraph small_gpt(int64_t batch = 8) {
  ModelSpec s;
  s.kind = "gpt";
  s.layers = 2;
  s.d_model = 32;
  s.heads = 4;
  s.seq_len = 8;
  return build_model(s, batch);
}

ModelGraph mlp(int64_t batch = 8) {
  ModelSpec s;
  s.kind = "mlp";
  s.hidden = {64, 32};
  return build_model(s, batch);
}

std::string error_of(const std::string& json, const Graph& g, int world, int64_t batch = 8) {
  try {
    const Plan p = plan_from_json(json, "p.json");
    validate_plan(p, g, world, batch, "plan p.json");
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "no error";
}

TEST(Plan, JsonRoundTrip) {
  Plan p;
  p.mesh = Mesh({{"pp", 2}, {"dp", 1}, {"tp", 2}});
  p.model = "gpt";
  p.set_spec("x", ShardingSpec{{DimSharding::over("dp")}, {}});
  p.set_spec("block0.attn.q.w", ShardingSpec{{DimSharding{}, DimSharding{"tp", {2, 1}, 8}}, {}});
  p.set_spec("block1.proj.w", ShardingSpec{{DimSharding::over("tp")}, {"dp"}});
  p.stages = {{{"wte", "wpe", "block0"}, {0, 1}}, {{"block1", "ln_f"}, {2, 3}}};
  p.microbatches = 4;
  p.schedule = ScheduleKind::zero_bubble;
  p.sequence_parallel = true;
  const std::string text = plan_to_json(p);
  const Plan q = plan_from_json(text, "mem");
  EXPECT_EQ(q, p);
  EXPECT_EQ(plan_to_json(q), text);
  validate_plan(q, small_gpt().graph, 4, 8, "plan");
  EXPECT_EQ(q.pipeline_stages(), 2);
}

// docs/plan.md's example parses and fits the MLP of configs/mlp_fashion.toml
// on 4 ranks, and is exactly what the shorthand expands to (the docs say so).
TEST(Plan, DocumentedExampleIsValid) {
  std::ifstream in(MT_SOURCE_DIR "/docs/plan.md");
  ASSERT_TRUE(in);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string doc = ss.str();
  const auto begin = doc.find("```json\n");
  ASSERT_NE(begin, std::string::npos);
  const auto end = doc.find("```", begin + 8);
  const std::string json = doc.substr(begin + 8, end - begin - 8);
  const Plan p = plan_from_json(json, "docs/plan.md");
  ModelSpec s;  // configs/mlp_fashion.toml: 784-512-512-10, batch 128
  const ModelGraph m = build_model(s, 128);
  validate_plan(p, m.graph, 4, 128, "docs/plan.md");
  EXPECT_EQ(plan_to_json(p), json);
  EXPECT_FALSE(p.data_parallel_only(m.graph));
  const std::string text = describe_plan(p, m.graph);
  EXPECT_NE(text.find("rank 1: pp=0 dp=0 tp=1; groups: pp [1, 3]; dp [1]; tp [0, 1]"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("rank 1: [784, 171] [0:784, 341:512] 536256 B"), std::string::npos) << text;
  EXPECT_NE(text.find("idle fraction 0.2000"), std::string::npos) << text;
  // It is what the shorthand the docs name expands to.
  ParallelShorthand sh;
  sh.tp = 2;
  sh.pp = 2;
  sh.microbatches = 4;
  sh.tp_ratios = {2, 1};
  EXPECT_EQ(plan_to_json(expand_shorthand(sh, {"mlp", 1}, m.graph, 4)), json);
}

TEST(Plan, DataParallelOnly) {
  const ModelGraph m = mlp();
  Plan p;
  p.mesh = Mesh({{"dp", 2}});
  p.set_spec("x", ShardingSpec{{DimSharding::over("dp")}, {}});
  EXPECT_FALSE(p.data_parallel_only(m.graph));  // y replicated: both ranks read all labels
  p.set_spec("y", ShardingSpec{{DimSharding::over("dp")}, {}});
  EXPECT_TRUE(p.data_parallel_only(m.graph));
  p.set_spec("fc1.w", ShardingSpec{{DimSharding::over("dp")}, {}});
  EXPECT_FALSE(p.data_parallel_only(m.graph));
  Plan q;
  q.mesh = Mesh({{"dp", 2}});
  q.microbatches = 2;
  EXPECT_FALSE(q.data_parallel_only(m.graph));
  // Replicated parameters over a second axis: two ranks would read the same
  // examples, which is not what data parallelism does.
  Plan r;
  r.mesh = Mesh({{"dp", 2}, {"tp", 2}});
  r.set_spec("x", ShardingSpec{{DimSharding::over("dp")}, {}});
  r.set_spec("y", ShardingSpec{{DimSharding::over("dp")}, {}});
  EXPECT_FALSE(r.data_parallel_only(m.graph));
  r.mesh = Mesh({{"dp", 2}, {"tp", 1}});
  EXPECT_TRUE(r.data_parallel_only(m.graph));
  // A pp axis without stages is an error naming the mismatch.
  Plan s;
  s.mesh = Mesh({{"pp", 2}});
  try {
    validate_plan(s, m.graph, 2, 8, "plan");
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(),
                 "plan: stages: the mesh's pp axis has size 2 but the plan lists 0 stages "
                 "(expected 2: pp x virtual_stages)");
  }
}

TEST(Plan, BadPlansAreRejectedNamingKeyAndExpectation) {
  const Graph& g = small_gpt().graph;
  const std::string mesh22 = R"("mesh": [{"name": "dp", "size": 2}, {"name": "tp", "size": 2}])";
  // A mesh larger than the world.
  EXPECT_EQ(error_of("{" + mesh22 + "}", g, 2),
            "plan p.json: mesh: mesh dp=2 x tp=2 has 4 devices but the job has 2 ranks (the mesh "
            "must cover the job's ranks exactly; start 4 ranks, e.g. --nproc 4)");
  // An unknown value name.
  EXPECT_EQ(
      error_of("{" + mesh22 + R"(, "values": {"block0.attn.qq.w": {"dims": [null, "tp"]}}})", g, 4),
      "plan p.json: values.block0.attn.qq.w: the model's graph has no value of that name "
      "(did you mean 'block0.attn.q.w'?) (`meshtrain inspect` lists the parameters)");
  // An axis that does not divide a dimension, without ratios (4 heads over 3).
  EXPECT_EQ(error_of(R"({"mesh": [{"name": "tp", "size": 3}], "values": {"block0.attn.q.w":
                       {"dims": [null, {"axis": "tp", "unit": 8}]}}})",
                     g, 3),
            "tensor block0.attn.q.w: dimension 1 (size 32) = 4 units of 8 is split evenly over "
            "axis tp of size 3, which does not divide it (expected a multiple of 3, or ratios for "
            "an uneven split)");
  // Ratios that do not match the axis size.
  EXPECT_EQ(error_of("{" + mesh22 + R"(, "values": {"block0.fc.w":
                       {"dims": [null, {"axis": "tp", "ratios": [2, 1, 1]}]}}})",
                     g, 4),
            "tensor block0.fc.w: dimension 1 (size 128) is split over axis tp of size 2 by 3 "
            "ratios [2:1:1] (expected 2 ratios, one per rank of the axis)");
  // A stage with no layers.
  EXPECT_EQ(error_of(R"({"mesh": [{"name": "pp", "size": 2}], "microbatches": 2, "stages": [
                       {"layers": ["wte", "wpe", "block0", "block1", "ln_f"]}, {"layers": []}]})",
                     g, 2),
            "plan p.json: stages[1]: stage 1 has no layers (expected at least one of the model's "
            "layers: wte, wpe, block0, block1, ln_f)");
  // A schedule that needs more micro-batches than given.
  const std::string two_stages =
      R"({"mesh": [{"name": "pp", "size": 2}], "stages": [{"layers": ["wte", "wpe", "block0"]},
          {"layers": ["block1", "ln_f"]}], )";
  EXPECT_EQ(error_of(two_stages + R"("microbatches": 1, "schedule": "1f1b"})", g, 2),
            "plan p.json.microbatches: schedule 1f1b with 2 stages needs at least 2 "
            "micro-batches (one per stage to fill the pipeline), got 1");
  EXPECT_EQ(error_of(two_stages + R"("microbatches": 3, "schedule": "gpipe"})", g, 2),
            "plan p.json: microbatches: the global batch of 8 (train.batch_size) does not divide "
            "into 3 micro-batches");
  EXPECT_EQ(error_of(two_stages + R"("microbatches": 2, "schedule": "gpipe"})", g, 2), "no error");
  // Layers: unknown, out of order, missing, twice.
  EXPECT_EQ(error_of(R"({"mesh": [{"name": "pp", "size": 2}], "microbatches": 2, "stages": [
                       {"layers": ["wte", "wpe", "blok0"]}, {"layers": ["block1", "ln_f"]}]})",
                     g, 2),
            "plan p.json: stages[0]: unknown layer 'blok0' (did you mean 'block0'?) (layers: wte, "
            "wpe, block0, block1, ln_f)");
  EXPECT_EQ(error_of(R"({"mesh": [{"name": "pp", "size": 2}], "microbatches": 2, "stages": [
                       {"layers": ["wte", "wpe", "block1"]}, {"layers": ["block0", "ln_f"]}]})",
                     g, 2),
            "plan p.json: stages[0]: layer block1 comes out of model order (expected block0 next; "
            "stages hold consecutive layers)");
  EXPECT_EQ(error_of(R"({"mesh": [{"name": "pp", "size": 2}], "microbatches": 2, "stages": [
                       {"layers": ["wte", "wpe", "block0"]}, {"layers": ["block1"]}]})",
                     g, 2),
            "plan p.json: stages: layer ln_f is in no stage (every layer must be in one)");
  EXPECT_EQ(error_of(R"({"mesh": [{"name": "dp", "size": 2}], "microbatches": 2, "stages": [
                       {"layers": ["wte", "wpe", "block0"]}, {"layers": ["block1", "ln_f"]}]})",
                     g, 2),
            "plan p.json: stages[0]: no ranks (give \"ranks\", or a mesh axis pp of size 2)");
  EXPECT_EQ(error_of(R"({"mesh": [{"name": "dp", "size": 2}], "microbatches": 2, "stages": [
                       {"layers": ["wte", "wpe", "block0"], "ranks": [0, 1]},
                       {"layers": ["block1", "ln_f"], "ranks": [1]}]})",
                     g, 2),
            "plan p.json: stages[1]: rank 1 already runs physical stage 0 (a rank runs one stage)");
}

// Plan::devices: which world rank runs each mesh rank. Round trip, and a
// list that is no permutation of the job's ranks named with its entry.
TEST(Plan, DevicesArePermutationsOfTheRanks) {
  const Graph& g = small_gpt().graph;
  const std::string mesh22 = R"("mesh": [{"name": "dp", "size": 2}, {"name": "tp", "size": 2}])";
  const Plan p = plan_from_json("{" + mesh22 + R"(, "devices": [0, 2, 1, 3]})", "p.json");
  EXPECT_EQ(p.devices, (std::vector<int>{0, 2, 1, 3}));
  EXPECT_EQ(p.device_of(1), 2);
  EXPECT_FALSE(p.devices_in_order());
  EXPECT_EQ(plan_from_json(plan_to_json(p), "mem"), p);
  EXPECT_EQ(error_of("{" + mesh22 + R"(, "devices": [0, 2, 1, 3]})", g, 4), "no error");
  EXPECT_EQ(error_of("{" + mesh22 + R"(, "devices": [0, 2, 2, 3]})", g, 4),
            "plan p.json: devices[2]: world rank 2 already runs mesh rank 1 (a permutation of "
            "the job's ranks: each once)");
  EXPECT_EQ(error_of("{" + mesh22 + R"(, "devices": [0, 4, 1, 3]})", g, 4),
            "plan p.json: devices[1]: world rank 4 is not in [0, 4) (a permutation of the job's "
            "ranks)");
  EXPECT_EQ(error_of("{" + mesh22 + R"(, "devices": [0, 1, 2]})", g, 4),
            "plan p.json: devices: 3 entries for 4 ranks (one world rank per mesh position, a "
            "permutation of 0..3)");
  EXPECT_EQ(error_of("{" + mesh22 + R"(, "devices": [0, -1, 2, 3]})", g, 4),
            "plan p.json: devices[1]: expected an integer >= 0, got -1");
}

// Stages on different meshes: the mlp's fc1 (64 units) tensor-parallel on
// ranks {0, 1}, fc2 and head on rank 2.
std::string xmesh_plan(const std::string& stage0_mesh, const std::string& stage1_mesh,
                       const std::string& stage1_extra = "", const std::string& ranks0 = "[0, 1]") {
  return R"({"mesh": [{"name": "world", "size": 3}],
    "values": {"fc1.w": {"dims": [null, "tp"]}, "fc1.b": {"dims": ["tp"]},
               "fc2.w": {"dims": ["tp"]}},
    "stages": [
      {"layers": ["fc1"], "ranks": )" +
         ranks0 + R"(, "mesh": )" + stage0_mesh + R"(},
      {"layers": ["fc2", "head"], "ranks": [2], "mesh": )" +
         stage1_mesh + stage1_extra + R"(}],
    "microbatches": 2})";
}

TEST(Plan, StageMeshesAreReadWrittenAndValidatedNamingTheStage) {
  const Graph& g = mlp().graph;
  const std::string tp2 = R"([{"name": "tp", "size": 2}])", tp1 = R"([{"name": "tp", "size": 1}])";
  const Plan p = plan_from_json(xmesh_plan(tp2, tp1), "p.json");
  ASSERT_EQ(p.stages.size(), 2u);
  EXPECT_TRUE(p.stage_meshes());
  EXPECT_TRUE(p.stages[0].has_mesh);
  EXPECT_EQ(p.stages[0].mesh.axis_size("tp"), 2);
  EXPECT_EQ(plan_from_json(plan_to_json(p), "mem"), p);
  EXPECT_EQ(error_of(xmesh_plan(tp2, tp1), g, 3), "no error");
  // The stage's view: its own parameters' specs on its own mesh.
  const Plan v1 = stage_view(p, 1);
  EXPECT_EQ(v1.mesh.axis_size("tp"), 1);
  EXPECT_TRUE(v1.spec("fc1.w").replicated());
  EXPECT_FALSE(v1.spec("fc2.w").replicated());
  // Overrides, round trip.
  const std::string over = R"(, "values": {"fc2.w": {"dims": [null]}})";
  const Plan po = plan_from_json(xmesh_plan(tp2, tp1, over), "p.json");
  EXPECT_TRUE(stage_view(po, 1).spec("fc2.w").replicated());
  EXPECT_EQ(plan_from_json(plan_to_json(po), "mem"), po);

  EXPECT_EQ(error_of(xmesh_plan(R"([{"name": "tp", "size": 3}])", tp1), g, 3),
            "plan p.json: stages[0].mesh: tp=3 has 3 devices but the stage has 2 ranks (0, 1); "
            "expected a mesh of 2");
  EXPECT_EQ(error_of(xmesh_plan(tp2, "[]"), g, 3),
            "plan p.json: stages[1]: values.fc2.w (a parameter of its layers): tensor fc2.w: "
            "dimension 0 (size 64) names mesh axis 'tp', which the mesh (no axes: 1 device) lacks "
            "(axes: none) (give the stage's mesh that axis, or override fc2.w in "
            "stages[1].values)");
  EXPECT_EQ(error_of(xmesh_plan(tp2, "[]", R"(, "values": {"fc2.w": {"dims": [null]}})"), g, 3),
            "no error");
  EXPECT_EQ(error_of(xmesh_plan(tp2, tp1, R"(, "values": {"fc2.ww": {"dims": [null]}})"), g, 3),
            "plan p.json: stages[1].values.fc2.ww: the model's graph has no value of that name "
            "(did you mean 'fc2.w'?) (`meshtrain inspect` lists the parameters)");
  EXPECT_EQ(error_of(xmesh_plan(tp2, tp1, R"(, "values": {"fc2.b": {"dims": ["tq"]}})"), g, 3),
            "plan p.json: stages[1]: its values.fc2.b (the stage's override): tensor fc2.b: "
            "dimension 0 (size 32) names mesh axis 'tq', which the mesh tp=1 lacks (axes: tp)");
  EXPECT_EQ(error_of(xmesh_plan(R"([{"name": "dp", "size": 2}])", tp1), g, 3),
            "plan p.json: stages[0].mesh: axis dp of size 2: a stage's mesh holds tensor axes only "
            "(the pipeline is the stages; data parallelism is a dp axis of the plan's mesh, over "
            "whole model replicas)");
  // A dp axis of the plan's mesh: the stages list one replica's ranks.
  std::string dp2 = xmesh_plan(tp2, tp1);
  dp2.replace(dp2.find(R"([{"name": "world", "size": 3}])"),
              std::string(R"([{"name": "world", "size": 3}])").size(),
              R"([{"name": "dp", "size": 2}, {"name": "world", "size": 3}])");
  EXPECT_EQ(error_of(dp2, g, 6), "no error");
  EXPECT_EQ(error_of(xmesh_plan(tp2, tp1, "", "[0, 3]"), g, 3),
            "plan p.json: stages[0]: rank 3 outside the job's 3 ranks");
  std::string dp2_far = xmesh_plan(tp2, tp1, "", "[0, 3]");
  dp2_far.replace(dp2_far.find(R"([{"name": "world", "size": 3}])"),
                  std::string(R"([{"name": "world", "size": 3}])").size(),
                  R"([{"name": "dp", "size": 2}, {"name": "world", "size": 3}])");
  EXPECT_EQ(error_of(dp2_far, g, 6),
            "plan p.json: stages[0]: rank 3 outside a model replica's 3 ranks (the job's 6 ranks "
            "over dp = 2; stages list the ranks of one replica)");
  // A stage without a mesh beside one with.
  std::string mixed = xmesh_plan(tp2, tp1);
  mixed.replace(mixed.rfind(R"(, "mesh": )"), std::string(R"(, "mesh": )").size() + tp1.size(), "");
  EXPECT_EQ(error_of(mixed, g, 3),
            "plan p.json: stages[1]: no \"mesh\", but stages[0] has one (in a plan whose stages "
            "carry meshes every stage gives its own, e.g. [{\"name\": \"tp\", \"size\": 1}])");
  // Values need the stage's mesh.
  EXPECT_EQ(error_of(R"({"mesh": [{"name": "pp", "size": 2}], "stages": [
      {"layers": ["fc1"], "values": {"fc1.w": {"dims": [null]}}},
      {"layers": ["fc2", "head"]}]})",
                     g, 2),
            "plan p.json: stages[0].values: spec overrides need the stage's own \"mesh\" (they "
            "refer to it)");
}

TEST(Plan, StageMeshesGiveEachBoundaryItsReshardPlans) {
  const ModelGraph m = mlp(4);  // a micro-batch of 4
  const std::string tp2 = R"([{"name": "tp", "size": 2}])", tp1 = R"([{"name": "tp", "size": 1}])";
  const Plan p = plan_from_json(xmesh_plan(tp2, tp1), "p.json");
  for (int rank = 0; rank < 3; ++rank) {
    const CrossMeshPipeline x = plan_cross_mesh(m.graph, m.loss, p, rank);
    EXPECT_EQ(x.stage, rank < 2 ? 0 : 1);
    EXPECT_EQ(x.mesh_rank, rank < 2 ? rank : 0);
    ASSERT_EQ(x.boundaries.size(), 2u);
    ASSERT_EQ(x.boundaries[0].size(), 1u);
    const CrossMeshBoundary& b = x.boundaries[0][0];
    // fc1's output after its activation: [4, 64], split by columns on {0, 1}.
    EXPECT_EQ(b.shape, Shape({4, 64}));
    EXPECT_EQ(b.producer.describe(), "{0: [0:4, 0:32], 1: [0:4, 32:64]}");
    EXPECT_EQ(b.consumer.describe(), "{2: [0:4, 0:64]}");
    EXPECT_TRUE(b.has_grad);
    const uint64_t h = 4 * 64 * 4;
    EXPECT_EQ(b.plans.forward.bytes_sent(0), h / 2);
    EXPECT_EQ(b.plans.forward.bytes_sent(1), h / 2);
    EXPECT_EQ(b.plans.backward.bytes_sent(2), h);
    EXPECT_EQ(cross_mesh_bytes(x, rank, 2), rank < 2 ? h : 2 * h);
    // The cut's boundary tensors are the pieces each stage's ranks hold (a
    // column half on stage 0's ranks; rank 2 sees stage 0 at its mesh rank 0).
    EXPECT_EQ(x.cut.stages[0].outputs[0].shape, Shape({4, 32}));
    EXPECT_EQ(x.cut.stages[1].inputs[0].shape, Shape({4, 64}));
  }
  const std::string text = describe_cross_mesh(plan_cross_mesh(m.graph, m.loss, p, 0), p);
  EXPECT_NE(text.find("stage 0: mesh tp=2 on ranks 0,1"), std::string::npos) << text;
  EXPECT_NE(text.find("boundary bytes per rank per step: 0:1024 1:1024 2:2048"), std::string::npos)
      << text;
}

// GPT's tied wte (embedding in the first stage, head in the last) is held
// on both meshes: vocabulary-parallel on stage 0's {0, 1}, whole on stage
// 1's {2}. Its gradient is summed by two plans: rank 2's whole gradient onto
// the halves of ranks 0 and 1 (each half once), and the sums back (each
// half from its holder); the bytes count once per step.
TEST(Plan, StageMeshesSumATiedParameterAcrossMeshes) {
  const ModelGraph m = small_gpt(4);
  const Plan p = plan_from_json(R"({"mesh": [{"name": "world", "size": 3}],
      "values": {"wte": {"dims": ["tp"]}}, "stages": [
      {"layers": ["wte", "wpe", "block0"], "ranks": [0, 1], "mesh": [{"name": "tp", "size": 2}]},
      {"layers": ["block1", "ln_f"], "ranks": [2], "mesh": []}], "microbatches": 2})",
                                "p.json");
  validate_plan(p, m.graph, 3, 4, "plan p.json");
  const Shape wte = m.graph.value(*m.graph.find("wte")).shape;
  const int64_t V = wte[0], D = wte[1];
  const uint64_t whole = static_cast<uint64_t>(V * D * 4);
  for (int rank = 0; rank < 3; ++rank) {
    const CrossMeshPipeline x = plan_cross_mesh(m.graph, m.loss, p, rank);
    ASSERT_EQ(x.cut.shared_params.size(), 1u);
    ASSERT_EQ(x.shared.size(), 1u);
    const CrossMeshPipeline::Shared& sh = x.shared[0];
    EXPECT_EQ(sh.plans.name, "wte");
    EXPECT_EQ(sh.plans.stages, (std::vector<int>{0, 1}));
    ASSERT_EQ(sh.layouts.size(), 2u);
    EXPECT_EQ(sh.layouts[0].describe(),
              fmt::format("{{0: [0:{0}, 0:{1}], 1: [{0}:{2}, 0:{1}]}}", V / 2, D, V));
    EXPECT_EQ(sh.layouts[1].describe(), fmt::format("{{2: [0:{}, 0:{}]}}", V, D));
    ASSERT_EQ(sh.plans.to_first.size(), 1u);
    EXPECT_EQ(sh.plans.to_first[0].bytes_sent(2), whole);
    EXPECT_EQ(sh.plans.from_first[0].bytes_sent(0), whole / 2);
    EXPECT_EQ(sh.plans.from_first[0].bytes_sent(1), whole / 2);
    EXPECT_EQ(sh.plans.bytes_sent(rank), rank == 2 ? whole : whole / 2);
  }
  const std::string text = describe_cross_mesh(plan_cross_mesh(m.graph, m.loss, p, 0), p);
  EXPECT_NE(text.find("shared parameter wte (stages 0, 1): its gradient summed over"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("boundary and shared-gradient bytes per rank per step:"), std::string::npos)
      << text;
}

// Virtual stages on stage meshes (ZBV, p = 2, v = 2) on a four-layer MLP:
// ranks {0, 1} (tp = 2) run virtual stages 1 (fc2, column-parallel) and 2
// (fc3.w split by rows), rank 2 stages 0 and 3. Each rank's program holds
// every parameter in the layout of the chunk that holds it, and the turn
// of the V (1 -> 2) is resharded inside {0, 1}: each rank's column half
// to the other, the gradient kept where it is.
const char* kPlanV = R"({"mesh": [{"name": "world", "size": 3}],
    "values": {"fc2.w": {"dims": [null, "tp"]}, "fc2.b": {"dims": ["tp"]},
               "fc3.w": {"dims": ["tp"]}},
    "stages": [
      {"layers": ["fc1"], "ranks": [2], "mesh": []},
      {"layers": ["fc2"], "ranks": [0, 1], "mesh": [{"name": "tp", "size": 2}]},
      {"layers": ["fc3"], "ranks": [0, 1], "mesh": MESH2},
      {"layers": ["head"], "ranks": [2], "mesh": []}],
    "microbatches": 2, "virtual_stages": 2, "schedule": "zbv"})";

std::string v_plan(const std::string& mesh2) {
  std::string s = kPlanV;
  return s.replace(s.find("MESH2"), 5, mesh2);
}

TEST(Plan, StageMeshesRunVirtualStagesEachChunkOnItsMesh) {
  ModelSpec spec;
  spec.kind = "mlp";
  spec.hidden = {64, 32, 16};
  const ModelGraph m = build_model(spec, 4);  // a micro-batch of 4
  const std::string tp2 = R"([{"name": "tp", "size": 2}])";
  EXPECT_EQ(error_of(v_plan(tp2), m.graph, 3, 8), "no error");
  const Plan p = plan_from_json(v_plan(tp2), "p.json");
  EXPECT_EQ(plan_from_json(plan_to_json(p), "mem"), p);  // --write-plan and back
  for (int rank = 0; rank < 3; ++rank) {
    const CrossMeshPipeline x = plan_cross_mesh(m.graph, m.loss, p, rank);
    EXPECT_EQ(x.stage, rank < 2 ? 1 : 0);
    EXPECT_EQ(x.chunks, (rank < 2 ? std::vector<int>{1, 2} : std::vector<int>{0, 3}));
    if (rank == 2) continue;
    const LoweredParam* w2 = x.lowered.param("fc2.w");
    const LoweredParam* w3 = x.lowered.param("fc3.w");
    ASSERT_TRUE(w2 != nullptr && w3 != nullptr);
    EXPECT_EQ(w2->box.str(), rank == 0 ? "[0:64, 0:16]" : "[0:64, 16:32]");  // columns
    EXPECT_EQ(w3->box.str(), rank == 0 ? "[0:16, 0:16]" : "[16:32, 0:16]");  // rows
    const CrossMeshBoundary& turn = x.boundaries[1][0];
    EXPECT_EQ(turn.producer.describe(), "{0: [0:4, 0:16], 1: [0:4, 16:32]}");
    EXPECT_EQ(turn.consumer.describe(), "{0: [0:4, 0:32], 1: [0:4, 0:32]}");
    const uint64_t h = 4 * 32 * 4;
    EXPECT_EQ(turn.plans.forward.bytes_sent(rank), h / 2);
    EXPECT_EQ(turn.plans.backward.bytes_sent(rank), 0u);
    // Its cut: stage 1's output a column half, stage 2's input whole.
    EXPECT_EQ(x.cut.stages[1].outputs[0].shape, Shape({4, 16}));
    EXPECT_EQ(x.cut.stages[2].inputs[0].shape, Shape({4, 32}));
  }
  const std::string text = describe_cross_mesh(plan_cross_mesh(m.graph, m.loss, p, 0), p);
  EXPECT_NE(text.find("boundary stage 1 -> 2: relu_5 [4, 32] f32 (inside ranks 0,1)"),
            std::string::npos)
      << text;
  // inspect's per-rank programs: each rank's chunks, with their boxes.
  const std::string programs = describe_cross_mesh_programs(m.graph, m.loss, p);
  for (const char* want :
       {"rank 0 (mesh rank 0 of tp=2): virtual stages 1, 2",
        "stage 2 (fc3): fc3.w [32, 16] -> [0:16, 0:16] over tp; fc3.b",
        "rank 1 (mesh rank 1 of tp=2): virtual stages 1, 2",
        "stage 1 (fc2): fc2.w [64, 32] -> [0:64, 16:32] over tp; fc2.b [32] -> [16:32] over tp",
        "rank 2 (mesh rank 0 of (no axes: 1 device)): virtual stages 0, 3"}) {
    EXPECT_NE(programs.find(want), std::string::npos) << want << "\n" << programs;
  }
  // The chunks of one physical stage share its mesh.
  EXPECT_EQ(error_of(v_plan(R"([{"name": "sp", "size": 2}])"), m.graph, 3, 8),
            "plan p.json: stages[2].mesh: sp=2, but virtual stage 2 runs on the ranks of "
            "stages[1], whose mesh is tp=2 (the virtual stages of one physical stage share its "
            "mesh; give them other values instead)");
  // GPT's tied wte read by two chunks of one rank group (the V's two ends):
  // they share the runtime's one copy, so they must hold it alike.
  const ModelGraph g = small_gpt(4);
  const std::string gv = R"({"mesh": [{"name": "world", "size": 3}],
      "values": {"wte": {"dims": ["tp"]}}, "stages": [
      {"layers": ["wte", "wpe"], "ranks": [0, 1], "mesh": [{"name": "tp", "size": 2}]},
      {"layers": ["block0"], "ranks": [2], "mesh": []},
      {"layers": ["block1"], "ranks": [2], "mesh": []},
      {"layers": ["ln_f"], "ranks": [0, 1], "mesh": [{"name": "tp", "size": 2}]LAST}],
      "microbatches": 2, "virtual_stages": 2, "schedule": "zbv"})";
  auto gpt_v = [&](const std::string& last) {
    std::string s = gv;
    return plan_from_json(s.replace(s.find("LAST"), 4, last), "p.json");
  };
  const Plan apart = gpt_v("");
  validate_plan(apart, g.graph, 3, 4, "plan p.json");
  try {
    plan_cross_mesh(g.graph, g.loss, apart, 0);
    ADD_FAILURE() << "two chunks of one rank group holding wte differently were accepted";
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()),
              "plan: parameter wte is read by stages 0 and 3, which run on the same ranks (0, 1) "
              "but hold it differently ({0: [0:128, 0:32], 1: [128:256, 0:32]} and {0: [0:256, "
              "0:32], 1: [0:256, 0:32]}); virtual stages of one physical stage share one copy of "
              "a parameter (give stages[3].values.wte the spec stage 0 uses)");
  }
  const Plan alike = gpt_v(R"(, "values": {"wte": {"dims": ["tp"]}})");
  validate_plan(alike, g.graph, 3, 4, "plan p.json");
  for (int rank = 0; rank < 3; ++rank) {
    const CrossMeshPipeline x = plan_cross_mesh(g.graph, g.loss, alike, rank);
    ASSERT_EQ(x.shared.size(), 1u);
    EXPECT_EQ(x.shared[0].holders, (std::vector<int>{0, 3}));
    EXPECT_EQ(x.shared[0].plans.stages, (std::vector<int>{0}));  // one copy: nothing to sum
    EXPECT_EQ(x.shared[0].plans.bytes_sent(rank), 0u);
  }
  const std::string gtext = describe_cross_mesh(plan_cross_mesh(g.graph, g.loss, alike, 0), alike);
  EXPECT_NE(gtext.find("shared parameter wte (stages 0, 3; stages on the same ranks hold one "
                       "copy): its gradient summed over"),
            std::string::npos)
      << gtext;
}

TEST(Plan, MalformedFilesNameTheKeyPath) {
  const Graph& g = small_gpt().graph;
  EXPECT_EQ(error_of(R"({"mesh": [{"name": "dp", "size": 2}], "stagse": []})", g, 2),
            "plan p.json: stagse: unknown key (did you mean 'stages'?) (known: format, model, "
            "mesh, values, stages, microbatches, schedule, virtual_stages, warmup_extra, async, "
            "sequence_parallel, devices)");
  EXPECT_EQ(error_of(R"({"mesh": [{"name": "dp", "size": "2"}]})", g, 2),
            "plan p.json: mesh[0].size: expected an integer, got string \"2\"");
  EXPECT_EQ(error_of(R"({"mesh": [{"name": "dp", "size": 2}], "values": {"wte":
                       {"dims": [{"axis": "dp", "ratios": [2, "1"]}]}}})",
                     g, 2),
            "plan p.json: values.wte.dims[0].ratios[1]: expected an integer, got string \"1\"");
  EXPECT_EQ(error_of(R"({"mesh": [{"name": "dp", "size": 2}], "values": {"wte":
                       {"dims": [3]}}})",
                     g, 2),
            "plan p.json: values.wte.dims[0]: expected null (replicated), an axis name or an "
            "object {\"axis\", \"ratios\", \"unit\"}, got number 3");
  EXPECT_EQ(error_of(R"({"mesh": [{"name": "dp", "size": 2}], "schedule": "1F1B"})", g, 2),
            "plan p.json: schedule: unknown schedule \"1F1B\" (expected gpipe, 1f1b, interleaved, "
            "zero_bubble, zbv or dualpipev)");
  EXPECT_EQ(error_of(R"({"values": {}})", g, 2),
            "plan p.json: mesh: missing (a list of {\"name\", \"size\"} axes)");
  EXPECT_EQ(error_of(R"({"mesh": [{"name": "dp", "size": 2}], "format": "v0"})", g, 2),
            "plan p.json: format: \"v0\" (expected \"meshtrain-plan-v1\")");
  EXPECT_NE(error_of(R"({"mesh": [)", g, 2).find("plan p.json: not valid JSON"), std::string::npos);
  EXPECT_THROW(load_plan("/nonexistent/plan.json"), FileError);
}

}  // namespace
}  // namespace mt
