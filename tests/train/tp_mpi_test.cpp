// Tensor, sequence and pipeline parallelism through the Trainer under mpirun
// (2 and 4 ranks): plans from the [parallel] shorthand (TP, TP with 2:1
// ratios, SP, DP x TP with ZeRO 0-3 on the dp axis; PP=2 under GPipe, 1F1B,
// interleaved and zero-bubble, and DP x PP) against the single-process run on the
// same global batch: the loss of every step and, at the end, every rank's
// piece of every parameter against the same box of the single-process
// parameter. Each rank computes the single-process reference itself.
//
// Tolerance: 1e-4 relative (of the step's loss; of the largest element of a
// parameter). The runs compute in f32 on the reference backend and differ in
// the association of the sums the plan splits (row-parallel contractions
// added by an all-reduce, gradients of replicated values summed over ranks,
// data-parallel gradient sums); each re-association moves a sum of K f32
// terms by about K u relative (u = 2^-24, K <= 128 here), carried by the
// optimizer from step to step over 12 steps. A wrong rule (a missing
// reduction, a doubled gradient, a norm counted twice) is off by 1e-3 or
// more from the first steps, as the test of the test below shows.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>

#include <fmt/format.h>
#include <unistd.h>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/spmd/lower.h"
#include "meshtrain/spmd/shorthand.h"
#include "meshtrain/train/param_store.h"
#include "meshtrain/train/pipeline_training.h"
#include "meshtrain/train/trainer.h"
#include "sync/dp_harness.h"
#include "train/mpi_world.h"

namespace mt {
namespace {

constexpr double kRel = 1e-4;
constexpr int kSteps = 12;

Communicator& world() {
  return test::mpi_world();
}

struct TpCase {
  std::string label;
  std::string model = "mlp";
  std::string optimizer = "sgd";
  ParallelShorthand sh;
  int zero = 0;
  int ranks = 2;  // the world size the case needs
  // Plan::devices: mesh rank m on world rank devices[m] (empty: in order).
  std::vector<int> devices;
};

void PrintTo(const TpCase& c, std::ostream* os) {
  *os << c.label;
}

ModelSpec spec_of(const TpCase& c) {
  ModelSpec s;
  s.kind = c.model;
  if (c.model == "gpt") {
    s.layers = 2;
    s.d_model = 24;
    s.heads = 6;
    s.seq_len = 8;
    s.vocab = 36;
  } else {
    s.image_size = 8;
    s.classes = 6;
    s.hidden = {24, 18};
    s.conv_channels = {2, 4};
    s.fc = 12;
  }
  return s;
}

TrainerOptions options_of(const TpCase& c) {
  TrainerOptions o;
  o.batch_size = 8;
  o.max_steps = kSteps;
  o.epochs = 1;
  o.progress = false;
  o.eval = true;
  o.eval_batch_size = 20;
  o.seed = 3;
  o.exec.backend = "reference";
  o.optimizer = c.optimizer;
  o.optim.sgd.momentum = 0.9;
  o.optim.sgd.weight_decay = 1e-4;
  o.optim.adamw.weight_decay = 0.01;
  o.optim.lamb.weight_decay = 0.01;
  o.schedule.lr = c.optimizer == "sgd" ? 0.05 : 0.003;
  o.clip_grad_norm = 0.5;  // clips: the norm over split and replicated parameters counts
  o.dist.dp.stage = c.zero;
  o.dist.dp.bucket_bytes = 1 << 10;
  o.dist.consistency_every = 4;
  return o;
}

struct Outcome {
  std::vector<double> losses;
  std::optional<double> test_loss;
  std::vector<std::pair<std::string, Tensor>> params;  // this rank's pieces
  std::vector<LoweredParam> boxes;                     // under a plan
  std::optional<double> bytes_sent;
  uint64_t bytes_predicted = 0;
};

Outcome train(const TpCase& c, const TrainerOptions& o, Communicator* comm) {
  const ModelSpec spec = spec_of(c);
  auto data = std::make_shared<test::SyntheticData>(spec, 96, 5);
  auto test_data = std::make_shared<test::SyntheticData>(spec, 30, 6);
  Trainer t(spec, data, test_data, o, comm);
  Outcome out;
  const TrainResult r = t.run();
  out.losses = r.losses;
  out.test_loss = r.test_loss;
  out.bytes_sent = r.tensor_bytes_sent_per_step;
  out.bytes_predicted = r.tensor_bytes_predicted_per_step;
  for (const auto& e : t.params().entries()) out.params.emplace_back(e.name, e.value.clone());
  if (const LoweredProgram* p = t.lowered_program()) out.boxes = p->params;
  return out;
}

std::shared_ptr<const Plan> plan_for(const TpCase& c, int ranks) {
  const ModelSpec spec = spec_of(c);
  const ModelGraph m = build_model(spec, options_of(c).batch_size);
  const ShorthandModel sm{spec.kind, spec.kind == "gpt" ? spec.d_model / spec.heads : 1};
  Plan p = expand_shorthand(c.sh, sm, m.graph, ranks);
  p.devices = c.devices;
  validate_plan(p, m.graph, ranks, options_of(c).batch_size, "parallel");
  return std::make_shared<const Plan>(std::move(p));
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

// The largest relative difference of the losses and of any parameter piece.
double divergence(const Outcome& want, const Outcome& got, std::string* where) {
  double worst = 0;
  for (size_t i = 0; i < want.losses.size() && i < got.losses.size(); ++i) {
    const double d = std::abs(got.losses[i] - want.losses[i]) / std::abs(want.losses[i]);
    if (d > worst) {
      worst = d;
      *where = "loss of step " + std::to_string(i);
    }
  }
  for (const auto& [name, piece] : got.params) {
    const auto w =
        std::ranges::find_if(want.params, [&](const auto& p) { return p.first == name; });
    const auto b = std::ranges::find_if(got.boxes, [&](const auto& p) { return p.name == name; });
    if (w == want.params.end() || b == got.boxes.end()) {
      *where = "parameter " + name + " missing";
      return 1e9;
    }
    const std::vector<float> ref = box_of(w->second, b->box);
    if (static_cast<int64_t>(ref.size()) != piece.numel()) {
      *where = "parameter " + name + " has the wrong size";
      return 1e9;
    }
    double diff = 0, mag = 1e-3;
    for (size_t k = 0; k < ref.size(); ++k) {
      diff = std::max(diff, std::abs(static_cast<double>(piece.data<float>()[k]) - ref[k]));
      mag = std::max(mag, std::abs(static_cast<double>(ref[k])));
    }
    if (diff / mag > worst) {
      worst = diff / mag;
      *where = "parameter " + name;
    }
  }
  return worst;
}

class TensorParallelMpi : public ::testing::TestWithParam<TpCase> {};

TEST_P(TensorParallelMpi, MatchesTheSingleProcessRunEveryStep) {
  const TpCase c = GetParam();
  if (world().size() != c.ranks) GTEST_SKIP() << "needs " << c.ranks << " ranks";
  TrainerOptions single = options_of(c);
  single.dist.dp.stage = 0;
  const Outcome want = train(c, single, nullptr);
  TrainerOptions o = options_of(c);
  o.dist.plan = plan_for(c, world().size());
  const Outcome got = train(c, o, &world());
  ASSERT_EQ(got.losses.size(), want.losses.size());
  ASSERT_FALSE(got.boxes.empty()) << "the run was not lowered";
  std::string where;
  const double worst = divergence(want, got, &where);
  if (world().rank() == 0) {
    std::printf("%s, %d ranks, %d steps: worst relative error %.3g at %s\n", c.label.c_str(),
                world().size(), kSteps, worst, where.c_str());
  }
  EXPECT_LE(worst, kRel) << c.label << " rank " << world().rank() << ": " << where;
  if (!c.devices.empty()) {
    // This process ran the mesh rank the plan gave it: its first linear
    // layer's columns are those of its mesh rank's tensor coordinate.
    const int mesh_rank =
        static_cast<int>(std::ranges::find(c.devices, world().rank()) - c.devices.begin());
    const auto b = std::ranges::find_if(got.boxes, [](const auto& p) { return p.name == "fc1.w"; });
    ASSERT_NE(b, got.boxes.end());
    EXPECT_EQ(b->box.begin[1] == 0, o.dist.plan->mesh.coord(mesh_rank, "tp") == 0)
        << "world rank " << world().rank() << " should run mesh rank " << mesh_rank;
  }
  // The tensor groups sent exactly what the lowering's collectives predict.
  ASSERT_TRUE(got.bytes_sent.has_value());
  EXPECT_GT(got.bytes_predicted, 0u);
  EXPECT_EQ(*got.bytes_sent, static_cast<double>(got.bytes_predicted)) << c.label;
  ASSERT_TRUE(want.test_loss && got.test_loss);
  EXPECT_NEAR(*got.test_loss, *want.test_loss, kRel * std::abs(*want.test_loss)) << c.label;
}

std::vector<TpCase> cases() {
  std::vector<TpCase> v;
  auto add = [&](std::string label, std::string model, std::string opt, int tp, int ranks,
                 std::vector<int64_t> ratios = {}, bool sp = false, int zero = 0) {
    TpCase c;
    c.label = std::move(label);
    c.model = std::move(model);
    c.optimizer = std::move(opt);
    c.sh.tp = tp;
    c.sh.tp_ratios = std::move(ratios);
    c.sh.sp = sp;
    c.zero = zero;
    c.ranks = ranks;
    v.push_back(std::move(c));
  };
  add("mlp_tp2_sgd", "mlp", "sgd", 2, 2);
  add("mlp_tp2_ratios_2to1_lamb", "mlp", "lamb", 2, 2, {2, 1});
  add("cnn_tp2_adamw", "cnn", "adamw", 2, 2);
  add("gpt_tp2_adamw", "gpt", "adamw", 2, 2);
  add("gpt_tp2_sp_sgd", "gpt", "sgd", 2, 2, {}, true);
  add("gpt_tp2_ratios_2to1_adamw", "gpt", "adamw", 2, 2, {2, 1});  // uneven vocabulary ranges
  add("mlp_dp2_tp2_lamb", "mlp", "lamb", 2, 4);
  for (int zero = 1; zero <= 3; ++zero) {
    add("gpt_dp2_tp2_zero" + std::to_string(zero), "gpt", "adamw", 2, 4, {}, false, zero);
  }
  add("gpt_tp4_ratios_sgd", "gpt", "sgd", 4, 4, {1, 2, 2, 1});
  // Which process runs which mesh rank (Plan::devices, as `meshtrain plan`
  // writes it for unequal devices): world rank 0 runs mesh rank 3 (dp 1,
  // tp 1), world rank 1 mesh rank 0, ...
  add("mlp_dp2_tp2_devices_permuted_sgd", "mlp", "sgd", 2, 4);
  v.back().devices = {1, 2, 3, 0};
  return v;
}

INSTANTIATE_TEST_SUITE_P(Plans, TensorParallelMpi, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<TpCase>& p) { return p.param.label; });

// Checkpoints carry N-d pieces: a run checkpointed under TP=2 (split
// parameters stored as column / row boxes) resumes under data parallelism
// with ZeRO-2, and one checkpointed under DP with ZeRO-2 resumes under TP=2;
// both continue exactly as the uninterrupted single-process run (loss of
// every later step, final parameters), within the tolerance above.
TEST(TensorParallelMpiCheckpoint, ResumesUnderAnotherPlan) {
  if (world().size() != 2) GTEST_SKIP() << "runs at 2 ranks";
  TpCase c;
  c.label = "gpt";
  c.model = "gpt";
  c.optimizer = "adamw";
  c.sh.tp = 2;
  TrainerOptions base = options_of(c);
  base.eval = false;
  const Outcome want = train(c, base, nullptr);
  std::string dir = fmt::format("/tmp/mt-tp-ckpt-{:010d}", ::getpid());  // same length everywhere
  world().broadcast(dir.data(), dir.size(), DType::u8, 0);
  for (int direction = 0; direction < 2; ++direction) {
    const std::string ck = dir + (direction == 0 ? "/tp" : "/dp");
    TrainerOptions first = base, second = base;
    first.checkpoint_path = second.checkpoint_path = ck;
    first.halt_after = kSteps / 2;
    second.resume_path = ck;
    (direction == 0 ? first : second).dist.plan = plan_for(c, 2);
    (direction == 0 ? second : first).dist.dp.stage = 2;
    train(c, first, &world());
    const Outcome got = train(c, second, &world());
    ASSERT_EQ(got.losses.size(), static_cast<size_t>(kSteps / 2));  // the resumed steps
    for (int i = kSteps / 2; i < kSteps; ++i) {
      EXPECT_NEAR(got.losses[static_cast<size_t>(i - kSteps / 2)],
                  want.losses[static_cast<size_t>(i)],
                  kRel * std::abs(want.losses[static_cast<size_t>(i)]))
          << (direction == 0 ? "TP -> DP" : "DP -> TP") << " step " << i;
    }
    Outcome cmp = got;
    if (cmp.boxes.empty()) {  // whole tensors
      for (const auto& [name, t] : cmp.params) {
        LoweredParam lp;
        lp.name = name;
        lp.global = t.shape();
        lp.box.begin.assign(static_cast<size_t>(t.rank()), 0);
        lp.box.end = t.shape().dims();
        cmp.boxes.push_back(lp);
      }
    }
    cmp.losses = want.losses;  // compared above, from the resumed step on
    std::string where;
    const double worst = divergence(want, cmp, &where);
    EXPECT_LE(worst, kRel) << (direction == 0 ? "TP -> DP" : "DP -> TP") << ": " << where;
    if (world().rank() == 0) {
      std::printf("checkpoint %s: worst relative error %.3g at %s\n",
                  direction == 0 ? "TP=2 -> DP ZeRO-2" : "DP ZeRO-2 -> TP=2", worst, where.c_str());
    }
  }
  world().barrier();
  if (world().rank() == 0) std::filesystem::remove_all(dir);
}

// Pipeline plans through the Trainer (train/pipeline_training.h): every
// schedule, and DP x PP, against the single-process run: the loss of every
// step and every parameter each rank holds (whole tensors; GPT's tied wte on
// the first and last stage), same tolerance and reasoning as above.
struct PpCase {
  std::string label;
  std::string model = "mlp";
  std::string optimizer = "sgd";
  ScheduleKind schedule = ScheduleKind::one_f_one_b;
  int virtual_stages = 1;
  int ranks = 2;
  int dp = 1;
  int tp = 1;
  bool recompute = false;         // parallel.recompute = true
  std::vector<int> devices = {};  // Plan::devices (empty: in order)
};

void PrintTo(const PpCase& c, std::ostream* os) {
  *os << c.label;
}

class PipelineMpi : public ::testing::TestWithParam<PpCase> {};

TEST_P(PipelineMpi, MatchesTheSingleProcessRunEveryStep) {
  const PpCase c = GetParam();
  if (world().size() != c.ranks) GTEST_SKIP() << "needs " << c.ranks << " ranks";
  TpCase tc;
  tc.model = c.model;
  tc.optimizer = c.optimizer;
  TrainerOptions o = options_of(tc);  // evaluation on: the whole model, joined per replica
  o.dist.consistency_every = 0;
  ModelSpec spec = spec_of(tc);
  if (c.model == "mlp") spec.hidden = {24, 18, 12};  // four layers: 2 stages x 2 chunks
  const Outcome ref = [&] {
    auto data = std::make_shared<test::SyntheticData>(spec, 96, 5);
    auto test_data = std::make_shared<test::SyntheticData>(spec, 30, 6);
    Trainer t(spec, data, test_data, o, nullptr);
    Outcome out;
    const TrainResult res = t.run();
    out.losses = res.losses;
    out.test_loss = res.test_loss;
    for (const auto& e : t.params().entries()) out.params.emplace_back(e.name, e.value.clone());
    return out;
  }();
  ParallelShorthand sh;
  sh.pp = 2;
  sh.dp = c.dp;
  sh.tp = c.tp;
  sh.microbatches = 4;
  sh.schedule = c.schedule;
  sh.virtual_stages = c.virtual_stages;
  sh.recompute = c.recompute;
  const ModelGraph m = build_model(spec, o.batch_size);
  const ShorthandModel sm{spec.kind, spec.kind == "gpt" ? spec.d_model / spec.heads : 1};
  Plan plan = expand_shorthand(sh, sm, m.graph, c.ranks);
  plan.devices = c.devices;
  validate_plan(plan, m.graph, c.ranks, o.batch_size, "parallel");
  // The pipeline stage this process runs: its mesh rank's (Plan::devices).
  const int mesh_rank =
      c.devices.empty()
          ? world().rank()
          : static_cast<int>(std::ranges::find(c.devices, world().rank()) - c.devices.begin());
  const int want_stage = plan.mesh.coord(mesh_rank, "pp");
  o.dist.plan = std::make_shared<const Plan>(std::move(plan));
  auto data = std::make_shared<test::SyntheticData>(spec, 96, 5);
  auto test_data = std::make_shared<test::SyntheticData>(spec, 30, 6);
  Trainer t(spec, data, test_data, o, &world());
  ASSERT_NE(t.pipeline(), nullptr);
  const TrainResult res = t.run();
  const std::vector<double> losses = res.losses;
  ASSERT_TRUE(res.test_loss && ref.test_loss);
  EXPECT_NEAR(*res.test_loss, *ref.test_loss, kRel * std::abs(*ref.test_loss)) << c.label;
  ASSERT_EQ(losses.size(), ref.losses.size());
  double worst = 0;
  std::string where;
  for (size_t i = 0; i < losses.size(); ++i) {
    const double d = std::abs(losses[i] - ref.losses[i]) / std::abs(ref.losses[i]);
    if (d > worst) worst = d, where = "loss of step " + std::to_string(i);
  }
  const std::vector<std::string> held = t.pipeline()->param_names();
  ASSERT_FALSE(held.empty());
  if (c.model == "gpt") {  // wpe joins the first stage only
    EXPECT_EQ(std::ranges::find(held, "wpe") != held.end(), want_stage == 0)
        << c.label << ": world rank " << world().rank() << " should run stage " << want_stage;
  }
  for (const std::string& name : held) {
    const auto w = std::ranges::find_if(ref.params, [&](const auto& p) { return p.first == name; });
    ASSERT_NE(w, ref.params.end()) << name;
    const Tensor got = t.pipeline()->param(name);
    // Under tensor axes this rank holds a box of the parameter.
    const LoweredProgram* lp = t.pipeline()->lowered();
    std::vector<float> ref_vals(w->second.data<float>(),
                                w->second.data<float>() + w->second.numel());
    if (lp != nullptr && lp->param(name) != nullptr) {
      ref_vals = box_of(w->second, lp->param(name)->box);
    }
    ASSERT_EQ(static_cast<size_t>(got.numel()), ref_vals.size()) << name;
    double diff = 0, mag = 1e-3;
    for (int64_t k = 0; k < got.numel(); ++k) {
      const double want_k = ref_vals[static_cast<size_t>(k)];
      diff = std::max(diff, std::abs(static_cast<double>(got.data<float>()[k]) - want_k));
      mag = std::max(mag, std::abs(want_k));
    }
    if (diff / mag > worst) worst = diff / mag, where = "parameter " + name;
  }
  if (world().rank() == 0) {
    std::printf("%s, %d ranks, %d steps: worst relative error %.3g at %s\n", c.label.c_str(),
                world().size(), kSteps, worst, where.c_str());
  }
  EXPECT_LE(worst, kRel) << c.label << " rank " << world().rank() << ": " << where;
}

INSTANTIATE_TEST_SUITE_P(
    Schedules, PipelineMpi,
    ::testing::Values(
        PpCase{"mlp_gpipe_sgd", "mlp", "sgd", ScheduleKind::gpipe},
        PpCase{"mlp_interleaved_lamb", "mlp", "lamb", ScheduleKind::interleaved, 2},
        PpCase{"gpt_1f1b_adamw", "gpt", "adamw", ScheduleKind::one_f_one_b},
        PpCase{"gpt_zero_bubble_sgd", "gpt", "sgd", ScheduleKind::zero_bubble},
        PpCase{"mlp_zbv_adamw", "mlp", "adamw", ScheduleKind::zbv, 2},
        PpCase{"mlp_dualpipev_adamw", "mlp", "adamw", ScheduleKind::dualpipev, 2},
        PpCase{"gpt_1f1b_recompute_adamw", "gpt", "adamw", ScheduleKind::one_f_one_b, 1, 2, 1, 1,
               true},
        PpCase{"gpt_dp2_pp2_1f1b_adamw", "gpt", "adamw", ScheduleKind::one_f_one_b, 1, 4, 2},
        PpCase{"gpt_tp2_pp2_gpipe_sgd", "gpt", "sgd", ScheduleKind::gpipe, 1, 4, 1, 2},
        PpCase{"mlp_tp2_pp2_1f1b_lamb", "mlp", "lamb", ScheduleKind::one_f_one_b, 1, 4, 1, 2},
        // World rank 3 runs mesh rank 0 (stage 0), world rank 0 mesh rank 3.
        PpCase{"gpt_dp2_pp2_1f1b_devices_permuted_sgd",
               "gpt",
               "sgd",
               ScheduleKind::one_f_one_b,
               1,
               4,
               2,
               1,
               false,
               {3, 1, 2, 0}}),
    [](const ::testing::TestParamInfo<PpCase>& p) { return p.param.label; });

// Test of the test: the same comparison catches a run whose learning rate
// is 1% off (an error far smaller than a wrong rule makes).
TEST(TensorParallelMpiHarness, CatchesAnUpdateThatIsSlightlyOff) {
  TpCase c;
  c.label = "mlp_tp2";
  c.sh.tp = 2;
  if (world().size() != 2) GTEST_SKIP() << "runs at 2 ranks";
  const Outcome want = train(c, options_of(c), nullptr);
  TrainerOptions o = options_of(c);
  o.schedule.lr *= 1.01;
  o.dist.plan = plan_for(c, 2);
  const Outcome got = train(c, o, &world());
  std::string where;
  const double off = divergence(want, got, &where);
  if (world().rank() == 0) std::printf("learning rate 1%% off: %.3g at %s\n", off, where.c_str());
  EXPECT_GT(off, 3 * kRel) << where;
}

}  // namespace
}  // namespace mt

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  mt::world();  // initialise MPI before any test
  return RUN_ALL_TESTS();
}
