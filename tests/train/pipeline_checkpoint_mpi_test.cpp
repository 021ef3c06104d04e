// Checkpoints and train.init across plans under mpirun (2, 4 and 8 ranks):
// a run checkpointed halfway under one plan (PP, TP x PP, DP x PP,
// DP x TP x PP, DP with ZeRO) and resumed under another continues exactly as the uninterrupted
// single-process run: the loss of every resumed step and every parameter
// piece each rank holds at the end. And a PyTorch-layout weights file
// (train.init) loads into each rank's boxes under TP and PP plans: the run
// then matches the single-process run started from the same file.
//
// Tolerance: 1e-4 relative, as tp_mpi_test.cpp explains (f32 sums
// re-associated by the plans, carried over 12 steps). A resume that lost
// the optimizer state, a box loaded into the wrong place or a step counted
// twice is off by far more from the first resumed step (the test of the
// test at the end shows a resume without optimizer state is caught).
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/base/error.h"
#include "meshtrain/models/torch_names.h"
#include "meshtrain/spmd/lower.h"
#include "meshtrain/spmd/shorthand.h"
#include "meshtrain/train/export.h"
#include "meshtrain/train/param_store.h"
#include "meshtrain/train/pipeline_training.h"
#include "meshtrain/train/safetensors.h"
#include "meshtrain/train/trainer.h"
#include "sync/dp_harness.h"
#include "train/mpi_world.h"
#include "train/plan_harness.h"

namespace mt {
namespace {

using test::Reference;
using test::remove_shared_tmp_dir;
using test::shared_tmp_dir;
using test::single_run;

constexpr double kRel = 1e-4;
constexpr int kSteps = 12;

Communicator& world() {
  return test::mpi_world();
}

// Four blocks: interleaved, 2 ranks x 2 virtual stages, a block each.
ModelSpec gpt_spec() {
  return test::plan_gpt(4);
}

TrainerOptions base_options() {
  return test::plan_adamw_options(kSteps);
}

// A plan of the [parallel] shorthand for the world, or none ("" or "dp":
// plain data parallelism).
std::shared_ptr<const Plan> plan_of(const std::string& kind, const ModelSpec& spec,
                                    const TrainerOptions& o) {
  if (kind.empty() || kind.starts_with("dp_zero")) return nullptr;
  ParallelShorthand sh;
  if (kind == "pp" || kind == "pp_interleaved") sh.pp = 2;
  if (kind == "tp_pp") sh.tp = sh.pp = 2;
  if (kind == "dp_pp") sh.dp = sh.pp = 2;
  if (kind == "dp_tp_pp") sh.dp = sh.tp = sh.pp = 2;
  if (kind == "tp") sh.tp = 2;
  sh.microbatches = sh.pp > 1 ? 2 : 1;
  sh.schedule = ScheduleKind::one_f_one_b;
  if (kind == "pp_interleaved") {  // each rank holds two virtual stages
    sh.schedule = ScheduleKind::interleaved;
    sh.virtual_stages = 2;
  }
  const ModelGraph m = build_model(spec, o.batch_size);
  const ShorthandModel sm{spec.kind, spec.d_model / spec.heads};
  Plan p = expand_shorthand(sh, sm, m.graph, world().size());
  validate_plan(p, m.graph, world().size(), o.batch_size, "parallel");
  return std::make_shared<const Plan>(std::move(p));
}

TrainerOptions under(const std::string& kind, const ModelSpec& spec, TrainerOptions o) {
  o.dist.plan = plan_of(kind, spec, o);
  if (kind.starts_with("dp_zero")) o.dist.dp.stage = kind.back() - '0';
  return o;
}

struct Handover {
  std::string from, to;
  int ranks = 2;
};

void PrintTo(const Handover& h, std::ostream* os) {
  *os << h.from << " -> " << h.to;
}

class PlanCheckpointMpi : public ::testing::TestWithParam<Handover> {};

// Checkpointed after half the steps under `from`, resumed under `to`.
TEST_P(PlanCheckpointMpi, ResumedRunContinuesTheUninterruptedOne) {
  const Handover h = GetParam();
  if (world().size() != h.ranks) GTEST_SKIP() << "needs " << h.ranks << " ranks";
  const ModelSpec spec = gpt_spec();
  const TrainerOptions base = base_options();
  const Reference ref = single_run(spec, base);
  const std::string dir = shared_tmp_dir("pp-ckpt");
  test::Handover r;
  ASSERT_NO_FATAL_FAILURE(test::run_handover(spec, under(h.from, spec, base),
                                             under(h.to, spec, base), kSteps, ref, dir, &r));
  test::expect_within(r.worst, kRel, fmt::format("{} -> {}, {} ranks", h.from, h.to, h.ranks));
  remove_shared_tmp_dir(dir);
}

INSTANTIATE_TEST_SUITE_P(
    Plans, PlanCheckpointMpi,
    ::testing::Values(Handover{"pp", "dp_zero0", 2}, Handover{"dp_zero1", "pp", 2},
                      Handover{"pp", "pp", 2}, Handover{"pp_interleaved", "dp_zero3", 2},
                      Handover{"dp_zero3", "pp_interleaved", 2}, Handover{"tp_pp", "dp_zero0", 4},
                      Handover{"dp_zero2", "tp_pp", 4}, Handover{"dp_pp", "tp_pp", 4},
                      Handover{"tp_pp", "pp", 2 * 2}, Handover{"dp_tp_pp", "dp_zero1", 8},
                      Handover{"dp_zero0", "dp_tp_pp", 8}),
    [](const ::testing::TestParamInfo<Handover>& p) {
      return p.param.from + "_to_" + p.param.to + "_np" + std::to_string(p.param.ranks);
    });

// Test of the test: a resumed half whose learning rate is 1% off (an error
// far smaller than a lost optimizer state or a misplaced box) is caught by
// the same comparison.
TEST(PlanCheckpointMpiHarness, CatchesAResumeThatIsSlightlyOff) {
  if (world().size() != 2) GTEST_SKIP() << "runs at 2 ranks";
  const ModelSpec spec = gpt_spec();
  const TrainerOptions base = base_options();
  const Reference ref = single_run(spec, base);
  const std::string dir = shared_tmp_dir("pp-ckpt-tt");
  TrainerOptions second = under("dp_zero0", spec, base);
  second.schedule.lr *= 1.01;
  test::Handover r;
  ASSERT_NO_FATAL_FAILURE(
      test::run_handover(spec, under("pp", spec, base), second, kSteps, ref, dir, &r));
  const double off = r.resumed.worst;
  if (world().rank() == 0) std::printf("resumed with the learning rate 1%% off: %.3g\n", off);
  EXPECT_GT(off, 3 * kRel);
  remove_shared_tmp_dir(dir);
}

// Step checkpoints under a pipeline: every 2 steps, the newest 2 kept; a
// data-parallel run with train.resume = "auto" picks the newest and
// continues the uninterrupted run.
TEST(PlanCheckpointMpiSteps, EveryKeepAndAutoResume) {
  if (world().size() != 2) GTEST_SKIP() << "runs at 2 ranks";
  const ModelSpec spec = gpt_spec();
  const TrainerOptions base = base_options();
  const Reference ref = single_run(spec, base);
  const std::string dir = shared_tmp_dir("pp-ckpt-steps");
  TrainerOptions first = under("pp", spec, base), second = under("dp_zero0", spec, base);
  first.checkpoint_path = second.checkpoint_path = dir + "/steps";
  first.checkpoint_every = 2;
  first.checkpoint_keep = second.checkpoint_keep = 2;
  first.halt_after = kSteps / 2;
  second.resume_path = "auto";
  const test::PlanRun a = test::run_plan(spec, first, nullptr);
  world().barrier();
  std::vector<std::string> kept;
  for (const auto& e : std::filesystem::directory_iterator(dir + "/steps")) {
    kept.push_back(e.path().filename().string());
  }
  std::ranges::sort(kept);
  EXPECT_EQ(kept, (std::vector<std::string>{"step_00000004", "step_00000006"}));
  world().barrier();
  const test::PlanRun b = test::run_plan(spec, second, &ref);
  ASSERT_EQ(b.losses.size(), static_cast<size_t>(kSteps / 2));
  std::string where;
  const double worst = std::max(b.worst_param, test::worst_loss(b.losses, ref, kSteps / 2, &where));
  EXPECT_LE(worst, kRel);
  EXPECT_EQ(a.steps, kSteps / 2);
  remove_shared_tmp_dir(dir);
}

// What a pipeline run cannot resume from is refused on every rank before
// any step, naming the file: a single-file checkpoint, and a directory
// written with another optimizer.
TEST(PlanCheckpointMpiErrors, RefusedBeforeAnyStepOnEveryRank) {
  if (world().size() != 2) GTEST_SKIP() << "runs at 2 ranks";
  const ModelSpec spec = gpt_spec();
  TrainerOptions base = base_options();
  base.max_steps = 2;
  const std::string dir = shared_tmp_dir("pp-ckpt-bad");
  TrainerOptions single = base;
  single.checkpoint_path = dir + fmt::format("/one{}.safetensors", world().rank());
  single_run(spec, single);
  TrainerOptions sgd = under("pp", spec, base);
  sgd.optimizer = "sgd";
  sgd.checkpoint_path = dir + "/sgd";
  test::run_plan(spec, sgd, nullptr);
  auto refused = [&](const std::string& resume, const std::string& expect) {
    TrainerOptions o = under("pp", spec, base);
    o.resume_path = resume;
    try {
      test::run_plan(spec, o, nullptr);
      ADD_FAILURE() << "resuming " << resume << " was not refused";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(expect), std::string::npos) << e.what();
    }
  };
  refused(single.checkpoint_path, "a single-file checkpoint (whole tensors) does not resume");
  refused(dir + "/sgd", "written with optimizer 'sgd' but this run uses 'adamw'");
  remove_shared_tmp_dir(dir);
}

// train.init under TP and PP plans: every rank loads its boxes of a
// PyTorch-layout file; the run then matches the single-process run from
// the same file (and differs from the seeded start, so the file mattered).
class InitUnderPlanMpi : public ::testing::TestWithParam<std::string> {};

TEST_P(InitUnderPlanMpi, MatchesTheSingleProcessRunFromTheSameFile) {
  const std::string param = GetParam();
  const bool bf16 = param.ends_with("_bf16");  // a file in bf16: converted while read
  const std::string kind = bf16 ? param.substr(0, param.size() - 5) : param;
  const int ranks = kind == "tp_pp" ? 4 : 2;
  if (world().size() != ranks) GTEST_SKIP() << "needs " << ranks << " ranks";
  const ModelSpec spec = gpt_spec();
  TrainerOptions base = base_options();
  base.max_steps = 6;
  const std::string dir = shared_tmp_dir("pp-init");
  // Weights other than the seeded start: the single-process model after 6 steps.
  const Reference trained = single_run(spec, base);
  const std::string weights = dir + fmt::format("/w{}.safetensors", world().rank());
  if (bf16) {
    std::map<std::string, Tensor> file;
    for (auto& [name, t] : to_torch(torch_name_map(spec), trained.params)) {
      file[name] = t.to(DType::bf16);
    }
    save_safetensors(weights, file,
                     {{"format", "pt"},
                      {"layout", std::string(kTorchLayout)},
                      {"naming", torch_name_map(spec).naming},
                      {"model", spec.kind}});
  } else {
    save_torch_weights(weights, spec, trained.params);
  }
  TrainerOptions o = base;
  o.init_path = weights;
  const Reference ref = single_run(spec, o);
  const test::PlanRun got = test::run_plan(spec, under(kind, spec, o), &ref);
  ASSERT_EQ(got.losses.size(), ref.losses.size());
  test::expect_within(test::divergence(got, ref), kRel,
                      fmt::format("train.init under {}, {} ranks", param, ranks));
  EXPECT_GT(std::abs(ref.losses[0] - trained.losses[0]), 100 * kRel * std::abs(ref.losses[0]))
      << "the file's weights should start elsewhere than the seeded ones";
  remove_shared_tmp_dir(dir);
}

INSTANTIATE_TEST_SUITE_P(Plans, InitUnderPlanMpi,
                         ::testing::Values("tp", "pp", "tp_pp", "tp_bf16", "tp_pp_bf16"),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

}  // namespace
}  // namespace mt

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  mt::world();  // initialise MPI before any test
  return RUN_ALL_TESTS();
}
