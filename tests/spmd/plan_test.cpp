#include "meshtrain/spmd/plan.h"

#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "meshtrain/base/error.h"
#include "meshtrain/models/model.h"
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
