// ZeRO-1 / 2 / 3 on the dp axis of pipeline plans under mpirun (4 ranks:
// dp 2 x pp 2; 8 ranks: dp 2 x tp 2 x pp 2), through the Trainer:
//   - 10 steps equal the single-process run: the loss of every step and
//     every parameter piece each rank holds at the end;
//   - the optimizer state and gradients each rank allocates (the allocator's
//     counters, not a component's report) are what the sharding predicts
//     against the same plan without ZeRO; under ZeRO-3 the parameters too,
//     after every step (only the shard is held between steps);
//   - a checkpoint written under dp x pp with ZeRO resumes under another
//     plan (and one written elsewhere resumes under dp x pp with ZeRO), the
//     resumed steps continuing the uninterrupted single-process run.
//
// Tolerance: 1e-4 relative, as the other pipeline tests (tp_mpi_test.cpp
// explains: f32 sums re-associated by the plans, carried over the steps).
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/base/error.h"
#include "meshtrain/spmd/lower.h"
#include "meshtrain/spmd/shorthand.h"
#include "meshtrain/tensor/memory_stats.h"
#include "meshtrain/train/pipeline_training.h"
#include "meshtrain/train/sharded_checkpoint.h"
#include "meshtrain/train/trainer.h"
#include "sync/dp_harness.h"
#include "train/mpi_world.h"
#include "train/plan_harness.h"

namespace mt {
namespace {

using test::divergence;
using test::Reference;
using test::remove_shared_tmp_dir;
using test::shared_tmp_dir;
using test::single_run;

constexpr double kRel = 1e-4;
constexpr int kSteps = 10;
constexpr double kF16Rel = 1e-2;

Communicator& world() {
  return test::mpi_world();
}

ModelSpec gpt_spec() {
  return test::plan_gpt(2);
}

TrainerOptions base_options() {
  return test::plan_adamw_options(kSteps);
}

// "dp_pp", "dp_tp_pp", "tp_pp" or "pp" with an optional "_zeroN" (ZeRO stage
// N on the dp axis); "dp_zeroN" is plain data parallelism with ZeRO.
TrainerOptions under(const std::string& kind, const ModelSpec& spec, TrainerOptions o) {
  const size_t z = kind.find("_zero");
  const std::string shape = z == std::string::npos ? kind : kind.substr(0, z);
  if (z != std::string::npos) o.dist.dp.stage = kind.back() - '0';
  if (shape == "dp") return o;
  ParallelShorthand sh;
  sh.pp = 2;
  if (shape == "dp_pp" || shape == "dp_tp_pp") sh.dp = 2;
  if (shape == "tp_pp" || shape == "dp_tp_pp") sh.tp = 2;
  sh.microbatches = 2;
  sh.schedule = ScheduleKind::one_f_one_b;
  const ModelGraph m = build_model(spec, o.batch_size);
  const ShorthandModel sm{spec.kind, spec.d_model / spec.heads};
  Plan p = expand_shorthand(sh, sm, m.graph, world().size());
  validate_plan(p, m.graph, world().size(), o.batch_size, "parallel");
  o.dist.plan = std::make_shared<const Plan>(std::move(p));
  return o;
}

// The loss scale a run ended with, from its checkpoint's metadata.
double checkpoint_scale(const std::string& path) {
  return std::stod(read_index(path).metadata.at("loss_scale"));
}

int ranks_of(const std::string& kind) {
  return kind.starts_with("dp_tp_pp") ? 8 : 4;
}

class PipelineZeroMpi : public ::testing::TestWithParam<std::string> {};

TEST_P(PipelineZeroMpi, MatchesTheSingleProcessRun) {
  const std::string kind = GetParam();
  if (world().size() != ranks_of(kind)) GTEST_SKIP() << "needs " << ranks_of(kind) << " ranks";
  const ModelSpec spec = gpt_spec();
  const TrainerOptions base = base_options();
  const Reference ref = single_run(spec, base);
  const test::PlanRun got = test::run_plan(spec, under(kind, spec, base), &ref);
  ASSERT_EQ(got.losses.size(), ref.losses.size());
  test::expect_within(divergence(got, ref), kRel,
                      fmt::format("{}, {} ranks, {} steps", kind, world().size(), kSteps));
}

INSTANTIATE_TEST_SUITE_P(Plans, PipelineZeroMpi,
                         ::testing::Values("dp_pp_zero1", "dp_pp_zero2", "dp_pp_zero3",
                                           "dp_tp_pp_zero1", "dp_tp_pp_zero2", "dp_tp_pp_zero3"),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

// Memory per rank, from the allocator's counters at the end of the run
// (live bytes by category), against what the sharding predicts: AdamW's two
// state tensors per parameter shrink to this rank's part of its ZeRO chunk
// (one bucket here: the stage's parameters, in the runtime's order, split
// evenly over dp 2) at stages 1 and 2; gradients stay one full copy at
// stage 1 (the runtime accumulates into the flat buffer that is all-reduced)
// and at stage 2 gain the reduced shard: the micro-batches still accumulate
// a full gradient before the reduce-scatter. At stage 3 the whole
// parameters and gradients exist only during a step: after each step (the
// trainer's after_step hook) the rank holds exactly its shard of the
// parameters, and its shard of the gradients, while the step's peak shows
// the whole parameters were gathered. Each allocation is counted rounded up
// to 64 bytes (tensor.cpp; an empty one as 64).
TEST(PipelineZeroMemoryMpi, OptimizerStateAndGradientsAsPredicted) {
  if (world().size() != 4) GTEST_SKIP() << "runs at 4 ranks";
  const ModelSpec spec = gpt_spec();
  TrainerOptions base = base_options();
  base.max_steps = 3;
  test::PlanRun by_stage[4];
  std::vector<int64_t> params_after_step, grads_after_step;
  int dp_rank = 0;
  for (int stage = 0; stage <= 3; ++stage) {
    TrainerOptions o = under(fmt::format("dp_pp_zero{}", stage), spec, base);
    dp_rank = o.dist.plan->mesh.coord(world().rank(), "dp");
    if (stage == 3) {
      o.dist.after_step = [&](int64_t, int) {
        const MemoryCounters c = memory_counters();
        params_after_step.push_back(c.live_of(MemoryCategory::params));
        grads_after_step.push_back(c.live_of(MemoryCategory::grads));
      };
    }
    by_stage[stage] = test::run_plan(spec, o, nullptr);
  }
  const std::vector<int64_t>& numels = by_stage[0].param_numels;
  ASSERT_FALSE(numels.empty());
  auto counted = [](int64_t elements) {
    return std::max<int64_t>(64, (4 * elements + 63) / 64 * 64);
  };
  int64_t P = 0;
  for (int64_t n : numels) P += n;
  // dp rank r owns elements [begin, end) of the flat buffer; the first P % 2
  // chunks are one element longer.
  const int64_t first = P / 2 + P % 2;
  const int64_t begin = dp_rank == 0 ? 0 : first, end = dp_rank == 0 ? first : P;
  int64_t opt_full = 0, opt_shard = 0, grads_full = 0, at = 0;
  for (int64_t n : numels) {
    opt_full += 2 * counted(n);
    opt_shard += 2 * counted(std::max<int64_t>(0, std::min(at + n, end) - std::max(at, begin)));
    grads_full += counted(n);
    at += n;
  }
  auto live = [&](int stage, MemoryCategory c) { return by_stage[stage].allocated.live_of(c); };
  if (world().rank() == 0) {
    std::printf(
        "rank 0, %lld parameters: optimizer %lld / %lld / %lld bytes, gradients %lld / %lld / "
        "%lld bytes (ZeRO 0 / 1 / 2)\n",
        static_cast<long long>(P), static_cast<long long>(live(0, MemoryCategory::optimizer)),
        static_cast<long long>(live(1, MemoryCategory::optimizer)),
        static_cast<long long>(live(2, MemoryCategory::optimizer)),
        static_cast<long long>(live(0, MemoryCategory::grads)),
        static_cast<long long>(live(1, MemoryCategory::grads)),
        static_cast<long long>(live(2, MemoryCategory::grads)));
  }
  // Nothing else holds optimizer state or gradients at the end of a run.
  EXPECT_EQ(live(0, MemoryCategory::optimizer), opt_full);
  EXPECT_EQ(live(0, MemoryCategory::grads), grads_full);
  for (int stage = 1; stage <= 3; ++stage) {
    EXPECT_EQ(live(stage, MemoryCategory::optimizer), opt_shard) << "ZeRO-" << stage;
  }
  EXPECT_EQ(live(1, MemoryCategory::grads), counted(P));
  EXPECT_EQ(live(2, MemoryCategory::grads), grads_full + counted(end - begin));
  // ZeRO-3: between steps only the shards; the whole copies (P elements
  // each of parameters and gradients) only during the step.
  if (world().rank() == 0) {
    std::printf(
        "rank 0 ZeRO-3: parameters %lld bytes after each step (shard %lld, ZeRO-2 %lld), peak "
        "%lld; gradients %lld after each step\n",
        static_cast<long long>(params_after_step.front()),
        static_cast<long long>(counted(end - begin)),
        static_cast<long long>(live(2, MemoryCategory::params)),
        static_cast<long long>(by_stage[3].allocated.peak_of(MemoryCategory::params)),
        static_cast<long long>(grads_after_step.front()));
  }
  ASSERT_EQ(params_after_step.size(), static_cast<size_t>(base.max_steps));
  for (size_t k = 0; k < params_after_step.size(); ++k) {
    EXPECT_EQ(params_after_step[k], counted(end - begin)) << "after step " << k + 1;
    EXPECT_EQ(grads_after_step[k], counted(end - begin)) << "after step " << k + 1;
  }
  EXPECT_EQ(live(3, MemoryCategory::params), counted(end - begin));
  EXPECT_EQ(live(3, MemoryCategory::grads), counted(end - begin));
  EXPECT_EQ(live(2, MemoryCategory::params), counted(P)) << "ZeRO-2 holds the whole parameters";
  EXPECT_GE(by_stage[3].allocated.peak_of(MemoryCategory::params),
            counted(P) + counted(end - begin))
      << "the step gathers the whole parameters next to the shard";
  // The state falls to about half (AdamW: 8 bytes an element).
  EXPECT_LT(std::abs(static_cast<double>(opt_shard) - 4.0 * static_cast<double>(P)),
            0.1 * 4.0 * static_cast<double>(P));
}

struct Handover {
  std::string from, to;
};

void PrintTo(const Handover& h, std::ostream* os) {
  *os << h.from << " -> " << h.to;
}

class PipelineZeroCheckpointMpi : public ::testing::TestWithParam<Handover> {};

// Checkpointed after half the steps under `from`, resumed under `to`.
TEST_P(PipelineZeroCheckpointMpi, ResumedRunContinuesTheUninterruptedOne) {
  const Handover h = GetParam();
  if (world().size() != 4) GTEST_SKIP() << "runs at 4 ranks";
  const ModelSpec spec = gpt_spec();
  const TrainerOptions base = base_options();
  const Reference ref = single_run(spec, base);
  const std::string dir = shared_tmp_dir("ppzero-ckpt");
  test::Handover r;
  ASSERT_NO_FATAL_FAILURE(test::run_handover(spec, under(h.from, spec, base),
                                             under(h.to, spec, base), kSteps, ref, dir, &r));
  test::expect_within(r.worst, kRel, h.from + " -> " + h.to);
  remove_shared_tmp_dir(dir);
}

INSTANTIATE_TEST_SUITE_P(
    Plans, PipelineZeroCheckpointMpi,
    ::testing::Values(Handover{"dp_pp_zero2", "tp_pp"}, Handover{"dp_pp_zero1", "dp_zero0"},
                      Handover{"dp_zero2", "dp_pp_zero1"}, Handover{"tp_pp", "dp_pp_zero2"},
                      Handover{"dp_pp_zero3", "dp_zero3"}, Handover{"tp_pp", "dp_pp_zero3"}),
    [](const ::testing::TestParamInfo<Handover>& p) { return p.param.from + "_to_" + p.param.to; });

// train.precision f16 under dp 2 x pp 2 (plain, ZeRO-1 and ZeRO-3), dynamic
// loss scaling from 2^10 doubling after every 3 good steps: the scale grows
// three times in 10 steps, as in the single-process f16 run, and the run
// equals that run within 1e-2 (f16 rounds activations and weight gradients
// to 2^-11 relative, per micro-batch here and per batch there; measured
// about 2e-3). The final scale comes from the checkpoint's metadata.
class PipelineF16Mpi : public ::testing::TestWithParam<std::string> {};

TrainerOptions f16_options(double init_scale) {
  TrainerOptions o = base_options();
  o.precision = DType::f16;
  o.loss_scaler.init_scale = init_scale;
  o.loss_scaler.growth_interval = 3;
  return o;
}

TEST_P(PipelineF16Mpi, MatchesTheSingleProcessRunAsTheScaleGrows) {
  const std::string kind = GetParam();
  if (world().size() != 4) GTEST_SKIP() << "runs at 4 ranks";
  const ModelSpec spec = gpt_spec();
  const TrainerOptions base = f16_options(1024.0);
  const Reference ref = single_run(spec, base);
  const std::string dir = shared_tmp_dir("ppf16");
  TrainerOptions o = under(kind, spec, base);
  o.checkpoint_path = dir + "/ck";
  const test::PlanRun got = test::run_plan(spec, o, &ref);
  ASSERT_EQ(got.losses.size(), ref.losses.size());
  const auto [worst, where] = divergence(got, ref);
  const double scale = checkpoint_scale(dir + "/ck");
  if (world().rank() == 0) {
    std::printf("f16 %s, %d steps: worst relative error %.3g at %s; final loss scale %g\n",
                kind.c_str(), kSteps, worst, where.c_str(), scale);
  }
  EXPECT_EQ(scale, 1024.0 * 8) << "three growths (every 3 good steps of 10)";
  EXPECT_LE(worst, kF16Rel) << kind << " rank " << world().rank() << ": " << where;
  remove_shared_tmp_dir(dir);
}

// From 2^24 the first steps overflow and are skipped: every rank must skip
// the same ones, or the copies of a parameter (its dp replicas; a
// parameter two stages share) drift apart. They stay bitwise equal, and
// the scale backed off.
TEST_P(PipelineF16Mpi, OverflowSkipsTheSameStepsOnEveryRank) {
  const std::string kind = GetParam();
  if (world().size() != 4) GTEST_SKIP() << "runs at 4 ranks";
  const ModelSpec spec = gpt_spec();
  const TrainerOptions base = f16_options(16777216.0);
  const std::string dir = shared_tmp_dir("ppf16-skip");
  TrainerOptions o = under(kind, spec, base);
  o.checkpoint_path = dir + "/ck";
  auto data = std::make_shared<test::SyntheticData>(spec, 96, 5);
  Trainer t(spec, data, nullptr, o, &world());
  const TrainResult r = t.run();
  ASSERT_TRUE(std::isfinite(r.losses.back()));
  PipelineTraining* p = t.pipeline();
  ASSERT_NE(p, nullptr);
  p->gather_params();  // ZeRO-3: whole from the shards (the shards are the copies' source)
  // Per parameter of the model, a checksum of its values' bit patterns on
  // every rank that holds it (dp replicas, and the tied wte's copies where
  // two stages hold it): equal iff the copies are bitwise equal (up to a
  // vanishing chance). Ranks that do not hold it contribute nothing.
  std::map<std::string, double> held;
  for (const std::string& n : p->param_names()) {
    const Tensor v = p->param(n);
    double s = 0;
    for (int64_t k = 0; k < v.numel(); ++k) {
      uint32_t bits = 0;
      std::memcpy(&bits, v.data<float>() + k, 4);
      s += static_cast<double>(bits) * static_cast<double>(k % 7 + 1);
    }
    held[n] = s;
  }
  const ModelGraph whole = build_model(spec, 1);
  std::vector<std::string> names;
  for (ValueId v : whole.graph.params()) names.push_back(whole.graph.value(v).name);
  std::vector<double> hi, neg_lo, count;
  for (const std::string& n : names) {
    auto it = held.find(n);
    hi.push_back(it != held.end() ? it->second : -1e300);
    neg_lo.push_back(it != held.end() ? -it->second : -1e300);
    count.push_back(it != held.end() ? 1.0 : 0.0);
  }
  world().all_reduce(hi.data(), hi.data(), hi.size(), DType::f64, ReduceOp::max);
  world().all_reduce(neg_lo.data(), neg_lo.data(), neg_lo.size(), DType::f64, ReduceOp::max);
  world().all_reduce(count.data(), count.data(), count.size(), DType::f64, ReduceOp::sum);
  int copies = 0;
  for (size_t i = 0; i < names.size(); ++i) {
    EXPECT_GE(count[i], 2.0) << names[i] << ": every parameter has a dp replica";
    EXPECT_EQ(hi[i], -neg_lo[i]) << names[i] << ": its " << count[i] << " copies differ";
    copies = std::max(copies, static_cast<int>(count[i]));
  }
  const double scale = checkpoint_scale(dir + "/ck");
  if (world().rank() == 0) {
    std::printf("f16 %s from 2^24: final loss scale %g; up to %d equal copies of a parameter\n",
                kind.c_str(), scale, copies);
  }
  EXPECT_LT(scale, base.loss_scaler.init_scale) << "no step overflowed: the test tests nothing";
  remove_shared_tmp_dir(dir);
}

// From 2^24 the first steps overflow: the pipeline skips exactly the
// single-process run's steps (the same scale each step: a step skipped in
// one run and applied in the other makes the next losses and the final
// parameters differ, and the final scales differ) and otherwise equals it
// within the f16 tolerance. Before the casts of parameters joined their
// readers' stage (CutOptions::param_casts_join_consumers), the tied wte's
// f16 copy crossed to the last stage as an activation and its gradient came
// back rounded to f16 per micro-batch: the pipeline first applied a step at
// 2^18, the single process at 2^22.
TEST_P(PipelineF16Mpi, OverflowBacksOffAsTheSingleProcessRun) {
  const std::string kind = GetParam();
  if (world().size() != 4) GTEST_SKIP() << "runs at 4 ranks";
  const ModelSpec spec = gpt_spec();
  const TrainerOptions base = f16_options(16777216.0);
  const std::string dir = shared_tmp_dir("ppf16-backoff");
  TrainerOptions single = base;
  single.checkpoint_path = dir + "/ref" + std::to_string(world().rank());
  const Reference ref = single_run(spec, single);
  const double ref_scale = checkpoint_scale(single.checkpoint_path);
  TrainerOptions o = under(kind, spec, base);
  o.checkpoint_path = dir + "/ck";
  const test::PlanRun got = test::run_plan(spec, o, &ref);
  ASSERT_EQ(got.losses.size(), ref.losses.size());
  const auto [worst, where] = divergence(got, ref);
  const double scale = checkpoint_scale(dir + "/ck");
  if (world().rank() == 0) {
    std::printf("f16 %s from 2^24, %d steps: worst relative error %.3g at %s; final scale %g\n",
                kind.c_str(), kSteps, worst, where.c_str(), scale);
  }
  EXPECT_LT(ref_scale, base.loss_scaler.init_scale) << "no step overflowed: the test tests nothing";
  EXPECT_EQ(scale, ref_scale) << kind << ": the pipeline backed off differently";
  EXPECT_LE(worst, kF16Rel) << kind << " rank " << world().rank() << ": " << where;
  remove_shared_tmp_dir(dir);
}

INSTANTIATE_TEST_SUITE_P(Plans, PipelineF16Mpi,
                         ::testing::Values("dp_pp", "dp_pp_zero1", "dp_pp_zero3"),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

// Under ZeRO-3 a rank holds only its shard between steps: reading a whole
// parameter then is a ConfigError naming the setting and the remedy, and
// after gather_params() it reads the values.
TEST(PipelineZeroMpiErrors, ZeroThreeParamNeedsGather) {
  if (world().size() != 4) GTEST_SKIP() << "runs at 4 ranks";
  const ModelSpec spec = gpt_spec();
  TrainerOptions o = under("dp_pp_zero3", spec, base_options());
  o.max_steps = 1;
  auto data = std::make_shared<test::SyntheticData>(spec, 96, 5);
  Trainer t(spec, data, nullptr, o, &world());
  t.run();
  PipelineTraining* p = t.pipeline();
  ASSERT_NE(p, nullptr);
  const std::string name = p->param_names().front();
  try {
    (void)p->param(name);
    ADD_FAILURE() << "param() read a parameter that is not held";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("dist.zero_stage 3"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("gather_params"), std::string::npos) << e.what();
  }
  p->gather_params();
  EXPECT_GT(p->param(name).numel(), 0);
}

}  // namespace
}  // namespace mt

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  mt::world();  // initialise MPI before any test
  return RUN_ALL_TESTS();
}
