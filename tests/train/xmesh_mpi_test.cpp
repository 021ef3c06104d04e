// Pipelines whose stages run on different meshes, through the Trainer under
// mpirun at 3 ranks (docs/plan.md, "Stages on different meshes"): stage 0
// tensor-parallel on ranks {0, 1} and stage 1 on rank 2, and the reverse
// (stage 0 on rank 0, stage 1 tensor-parallel on {1, 2}), the boundary
// tensors moved by the reshard plans (spmd/cross_mesh.h). Each is checked
// against the single-process run on the same global batch: the loss of
// every step, the test loss, and every rank's piece of every parameter it
// holds against the same box of the single-process parameter; and the bytes
// each rank's pipeline runtime sent per step equal the plans' prediction and
// a closed form of the boundary's size.
//
// Tolerance: 1e-4 relative, as tp_mpi_test.cpp derives it (f32 sums the
// plan re-associates, carried by the optimizer over 12 steps); a wrong
// boundary (a half not sent, a gradient not returned) is off by far more.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/spmd/lower.h"
#include "meshtrain/spmd/plan.h"
#include "meshtrain/train/param_store.h"
#include "meshtrain/train/pipeline_training.h"
#include "meshtrain/train/trainer.h"
#include "sync/dp_harness.h"
#include "train/mpi_world.h"

namespace mt {
namespace {

constexpr double kRel = 1e-4;
constexpr int kSteps = 12;
constexpr int64_t kBatch = 8, kMicro = 4;

Communicator& world() {
  return test::mpi_world();
}

ModelSpec mlp() {
  ModelSpec s;
  s.kind = "mlp";
  s.image_size = 8;
  s.classes = 6;
  s.hidden = {24, 18};
  return s;
}

TrainerOptions options(const std::string& optimizer) {
  TrainerOptions o;
  o.batch_size = kBatch;
  o.max_steps = kSteps;
  o.epochs = 1;
  o.progress = false;
  o.eval = true;
  o.eval_batch_size = 20;
  o.seed = 3;
  o.exec.backend = "reference";
  o.optimizer = optimizer;
  o.optim.sgd.momentum = 0.9;
  o.optim.sgd.weight_decay = 1e-4;
  o.optim.lamb.weight_decay = 0.01;
  o.schedule.lr = optimizer == "sgd" ? 0.05 : 0.003;
  o.clip_grad_norm = 0.5;  // clips: the norm over both stages' pieces counts
  return o;
}

// Elements of box `b` of whole tensor t, row-major.
std::vector<float> box_of(const Tensor& t, const Box& b) {
  const Shape bs = b.shape();
  const int r = t.rank();
  std::vector<float> out;
  std::vector<int64_t> idx(static_cast<size_t>(r));
  for (int64_t i = 0; i < bs.numel(); ++i) {
    int64_t rest = i, flat = 0;
    for (int d = r - 1; d >= 0; --d) {
      idx[static_cast<size_t>(d)] = rest % bs[d];
      rest /= bs[d];
    }
    for (int d = 0; d < r; ++d) {
      flat = flat * t.shape()[d] + b.begin[static_cast<size_t>(d)] + idx[static_cast<size_t>(d)];
    }
    out.push_back(t.data<float>()[flat]);
  }
  return out;
}

struct XCase {
  std::string label;
  std::string optimizer;
  ScheduleKind schedule;
  std::string plan;  // JSON
  // Bytes of one micro-batch's boundary value [kMicro, width] f32 each rank
  // sends per step, forward and backward (closed form, per rank).
  std::vector<uint64_t> bytes;
};

void PrintTo(const XCase& c, std::ostream* os) {
  *os << c.label;
}

class StageMeshesMpi : public ::testing::TestWithParam<XCase> {};

TEST_P(StageMeshesMpi, MatchesTheSingleProcessRunEveryStep) {
  const XCase c = GetParam();
  if (world().size() != 3) GTEST_SKIP() << "runs at 3 ranks";
  const ModelSpec spec = mlp();
  TrainerOptions o = options(c.optimizer);
  struct Ref {
    std::vector<double> losses;
    std::optional<double> test_loss;
    std::vector<std::pair<std::string, Tensor>> params;
  };
  const Ref ref = [&] {
    auto data = std::make_shared<test::SyntheticData>(spec, 96, 5);
    auto test_data = std::make_shared<test::SyntheticData>(spec, 30, 6);
    Trainer t(spec, data, test_data, o, nullptr);
    Ref out;
    const TrainResult res = t.run();
    out.losses = res.losses;
    out.test_loss = res.test_loss;
    for (const auto& e : t.params().entries()) out.params.emplace_back(e.name, e.value.clone());
    return out;
  }();
  Plan plan = plan_from_json(c.plan, c.label);
  plan.schedule = c.schedule;
  const ModelGraph m = build_model(spec, o.batch_size);
  validate_plan(plan, m.graph, 3, o.batch_size, c.label);
  o.dist.plan = std::make_shared<const Plan>(std::move(plan));
  auto data = std::make_shared<test::SyntheticData>(spec, 96, 5);
  auto test_data = std::make_shared<test::SyntheticData>(spec, 30, 6);
  Trainer t(spec, data, test_data, o, &world());
  ASSERT_NE(t.pipeline(), nullptr);
  const TrainResult res = t.run();
  ASSERT_EQ(res.losses.size(), ref.losses.size());
  ASSERT_TRUE(res.test_loss && ref.test_loss);
  EXPECT_NEAR(*res.test_loss, *ref.test_loss, kRel * std::abs(*ref.test_loss)) << c.label;
  double worst = 0;
  std::string where;
  for (size_t i = 0; i < res.losses.size(); ++i) {
    const double d = std::abs(res.losses[i] - ref.losses[i]) / std::abs(ref.losses[i]);
    if (d > worst) worst = d, where = "loss of step " + std::to_string(i);
  }
  const PipelineTraining& pt = *t.pipeline();
  const std::vector<std::string> held = pt.param_names();
  ASSERT_FALSE(held.empty());
  const LoweredProgram* lp = pt.lowered();
  ASSERT_NE(lp, nullptr);
  bool split_here = false;
  for (const std::string& name : held) {
    const auto w = std::ranges::find_if(ref.params, [&](const auto& p) { return p.first == name; });
    ASSERT_NE(w, ref.params.end()) << name;
    const Tensor got = pt.param(name);
    const LoweredParam* bp = lp->param(name);
    ASSERT_NE(bp, nullptr) << name;
    split_here |= !bp->axis.empty();
    const std::vector<float> want = box_of(w->second, bp->box);
    ASSERT_EQ(static_cast<size_t>(got.numel()), want.size()) << name;
    double diff = 0, mag = 1e-3;
    for (int64_t k = 0; k < got.numel(); ++k) {
      const double wk = want[static_cast<size_t>(k)];
      diff = std::max(diff, std::abs(static_cast<double>(got.data<float>()[k]) - wk));
      mag = std::max(mag, std::abs(wk));
    }
    if (diff / mag > worst) worst = diff / mag, where = "parameter " + name;
  }
  // The tensor-parallel stage's ranks hold halves, the other stage's rank whole tensors.
  const auto& stages = o.dist.plan->stages;
  const int me = world().rank();
  const bool in_tp_stage = std::ranges::any_of(stages, [&](const StagePlan& st) {
    return st.mesh.size() > 1 && std::ranges::find(st.ranks, me) != st.ranks.end();
  });
  EXPECT_EQ(split_here, in_tp_stage) << c.label << " rank " << me;
  EXPECT_EQ(pt.pipeline_bytes_sent(), pt.pipeline_bytes_predicted()) << c.label << " rank " << me;
  EXPECT_EQ(pt.pipeline_bytes_sent(), c.bytes[static_cast<size_t>(me)])
      << c.label << " rank " << me;
  std::printf(
      "%s rank %d: %llu boundary bytes per step (predicted %llu); worst relative error "
      "%.3g at %s\n",
      c.label.c_str(), me, static_cast<unsigned long long>(pt.pipeline_bytes_sent()),
      static_cast<unsigned long long>(pt.pipeline_bytes_predicted()), worst, where.c_str());
  EXPECT_LE(worst, kRel) << c.label << " rank " << me << ": " << where;
}

// The model's layers: fc1 (64 -> 24), fc2 (24 -> 18), head (18 -> 6); the
// plan's specs split fc1 by columns and fc2 by rows over tp (Megatron's
// pair), head replicated. Micro-batches of kMicro = 2 examples (8 / 4).
const char* kPlanTp2ToTp1 = R"({
  "mesh": [{"name": "world", "size": 3}],
  "values": {"fc1.w": {"dims": [null, "tp"]}, "fc1.b": {"dims": ["tp"]},
             "fc2.w": {"dims": ["tp"]}},
  "stages": [
    {"layers": ["fc1"], "ranks": [0, 1], "mesh": [{"name": "tp", "size": 2}]},
    {"layers": ["fc2", "head"], "ranks": [2], "mesh": [{"name": "tp", "size": 1}]}
  ],
  "microbatches": 4
})";
// Stage 0 holds fc1 and fc2 (their all-reduce inside it), stage 1 the head.
const char* kPlanTp2BothToTp1 = R"({
  "mesh": [{"name": "world", "size": 3}],
  "values": {"fc1.w": {"dims": [null, "tp"]}, "fc1.b": {"dims": ["tp"]},
             "fc2.w": {"dims": ["tp"]}},
  "stages": [
    {"layers": ["fc1", "fc2"], "ranks": [0, 1], "mesh": [{"name": "tp", "size": 2}]},
    {"layers": ["head"], "ranks": [2], "mesh": []}
  ],
  "microbatches": 4
})";
// The reverse: stage 0 whole on rank 0, stage 1 (fc2 row-, head column-
// parallel by its own values) on ranks {2, 1} (mesh rank 0 is world rank 2).
const char* kPlanTp1ToTp2 = R"({
  "mesh": [{"name": "world", "size": 3}],
  "stages": [
    {"layers": ["fc1"], "ranks": [0], "mesh": []},
    {"layers": ["fc2", "head"], "ranks": [2, 1], "mesh": [{"name": "tp", "size": 2}],
     "values": {"fc2.w": {"dims": ["tp"]}, "head.w": {"dims": [null, "tp"]},
                "head.b": {"dims": ["tp"]}}}
  ],
  "microbatches": 4
})";

// Per micro-batch the boundary is [2, 24] f32 (relu of fc1 or its input
// layout): h = 2 * 24 * 4 = 192 bytes; per step x 4 micro-batches.
constexpr uint64_t kH24 = 2 * 24 * 4 * 4, kH18 = 2 * 18 * 4 * 4;

INSTANTIATE_TEST_SUITE_P(Plans, StageMeshesMpi,
                         ::testing::Values(
                             // Forward: each tp rank sends its column half (h/2); backward: rank 2
                             // sends each rank its half of the gradient (h).
                             XCase{"mlp_tp2_to_tp1_1f1b_sgd",
                                   "sgd",
                                   ScheduleKind::one_f_one_b,
                                   kPlanTp2ToTp1,
                                   {kH24 / 2, kH24 / 2, kH24}},
                             // Stage 0's output is replicated on {0, 1}: each sends half of it
                             // (load balance); the gradient enters the tp group once and is passed
                             // on inside it (rank 2: h, rank 0: h).
                             XCase{"mlp_tp2_both_to_tp1_gpipe_lamb",
                                   "lamb",
                                   ScheduleKind::gpipe,
                                   kPlanTp2BothToTp1,
                                   {kH18 / 2 + kH18, kH18 / 2, kH18}},
                             // Replicated {0} -> replicated {2, 1}: rank 0 sends h once into the
                             // group, rank 2 passes it on to rank 1; the gradient back: each of
                             // {2, 1} sends half.
                             XCase{"mlp_tp1_to_tp2_1f1b_sgd",
                                   "sgd",
                                   ScheduleKind::one_f_one_b,
                                   kPlanTp1ToTp2,
                                   {kH24, kH24 / 2, kH24 + kH24 / 2}}),
                         [](const ::testing::TestParamInfo<XCase>& p) { return p.param.label; });

}  // namespace
}  // namespace mt

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  mt::world();  // initialise MPI before any test
  return RUN_ALL_TESTS();
}
