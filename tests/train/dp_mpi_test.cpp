// Data-parallel training under mpirun (2 and 4 ranks): every ZeRO stage, with
// and without overlap, even and uneven batch shares and gradient
// accumulation, matches the single-process run on the same global batch step
// by step (the loss of every step) and in the final parameters, within 1e-5
// relative. Each rank computes the single-process reference itself.
// GptCnn/ModelsMpi: the GPT and the CNN through the Trainer on the fast
// backend, AdamW and SGD + momentum, ZeRO 0-3, per tensor after every step,
// within a tolerance derived below (before ModelCase).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <optional>

#include <unistd.h>

#include "meshtrain/comm/backends/mpi/mpi_communicator.h"
#include "meshtrain/data/fashion_mnist.h"
#include "meshtrain/train/trainer.h"
#include "sync/dp_harness.h"
#include "train/mpi_world.h"

namespace mt {
namespace {

Communicator& world() {
  return test::mpi_world();
}

struct RunSetup {
  ModelSpec spec;
  std::shared_ptr<const Dataset> train, test;
  TrainerOptions opts;
};

RunSetup setup(const std::string& optimizer) {
  RunSetup s;
  s.spec.kind = "mlp";
  s.spec.hidden = {48, 32};
  FashionMnistOptions d;
  d.flatten = true;
  d.limit = 1536;
  s.train = std::make_shared<FashionMnist>(d);
  d.split = DataSplit::test;
  d.limit = 301;
  s.test = std::make_shared<FashionMnist>(d);
  s.opts.batch_size = 48;
  s.opts.max_steps = 20;
  s.opts.epochs = 1;
  s.opts.progress = false;
  s.opts.eval = true;  // 300 test examples: uneven per-rank slices at 4 ranks
  s.opts.optimizer = optimizer;
  s.opts.optim.sgd.momentum = 0.9;
  s.opts.optim.sgd.weight_decay = 1e-4;
  s.opts.optim.lamb.weight_decay = 0.01;
  s.opts.schedule.kind = LrScheduleKind::cosine;
  s.opts.schedule.lr = optimizer == "sgd" ? 0.05 : 0.003;
  s.opts.schedule.warmup_steps = 3;
  s.opts.clip_grad_norm = 5.0;
  s.opts.exec.backend = "reference";  // one kernel path, so only the split differs
  s.opts.dist.consistency_every = 5;
  s.opts.dist.dp.bucket_bytes = 16 << 10;  // several buckets
  return s;
}

struct Outcome {
  std::vector<double> losses;
  std::vector<float> params;
  std::optional<double> test_loss;  // with opts.eval, when the run evaluated
};

Outcome train(RunSetup s, Communicator* comm) {
  Trainer t(s.spec, s.train, s.test, s.opts, comm);
  Outcome o;
  TrainResult r = t.run();
  o.losses = r.losses;
  o.test_loss = r.test_loss;
  Tensor p = t.gather_params();
  o.params.assign(p.data<float>(), p.data<float>() + p.numel());
  return o;
}

void expect_equivalent(const Outcome& ref, const Outcome& got, const std::string& what) {
  ASSERT_EQ(ref.losses.size(), got.losses.size()) << what;
  for (size_t i = 0; i < ref.losses.size(); ++i) {
    EXPECT_NEAR(got.losses[i], ref.losses[i], 1e-5 * std::abs(ref.losses[i]))
        << what << ": loss of step " << i;
  }
  ASSERT_EQ(ref.params.size(), got.params.size()) << what;
  double max_diff = 0, max_abs = 0;
  size_t where = 0;
  for (size_t i = 0; i < ref.params.size(); ++i) {
    const double d = std::abs(static_cast<double>(ref.params[i]) - got.params[i]);
    if (d > max_diff) {
      max_diff = d;
      where = i;
    }
    max_abs = std::max(max_abs, std::abs(static_cast<double>(ref.params[i])));
  }
  EXPECT_EQ(got.test_loss.has_value(), ref.test_loss.has_value()) << what;
  if (ref.test_loss && got.test_loss) {
    EXPECT_NEAR(*got.test_loss, *ref.test_loss, 1e-5 * std::abs(*ref.test_loss)) << what;
  }
  EXPECT_LE(max_diff, 1e-5 * max_abs)
      << what << ": parameters differ by " << max_diff << " at flat index " << where
      << " (largest parameter " << max_abs << ", rank " << world().rank() << ")";
}

class DataParallelMpi : public ::testing::TestWithParam<std::string> {};

TEST_P(DataParallelMpi, EveryStageMatchesSingleProcess) {
  const std::string optimizer = GetParam();
  const Outcome ref = train(setup(optimizer), nullptr);
  for (int stage = 0; stage <= 3; ++stage) {
    for (bool overlap : {true, false}) {
      RunSetup s = setup(optimizer);
      s.opts.dist.dp.stage = stage;
      s.opts.dist.dp.overlap = overlap;
      expect_equivalent(ref, train(s, &world()),
                        fmt::format("{} stage {} overlap {} on {} ranks", optimizer, stage, overlap,
                                    world().size()));
    }
  }
}

TEST_P(DataParallelMpi, UnevenSharesAndAccumulationMatch) {
  const std::string optimizer = GetParam();
  const Outcome ref = train(setup(optimizer), nullptr);
  const int n = world().size();
  RunSetup s = setup(optimizer);
  s.opts.dist.batch_shares.assign(static_cast<size_t>(n), 1);
  s.opts.dist.batch_shares[0] = 2;  // rank 0 stands in for a device twice as fast
  for (int stage : {0, 2}) {
    s.opts.dist.dp.stage = stage;
    expect_equivalent(ref, train(s, &world()),
                      fmt::format("{} shares 2:1.. stage {}", optimizer, stage));
  }
  RunSetup a = setup(optimizer);
  a.opts.dist.dp.accumulation_steps = 2;
  for (int stage : {0, 3}) {
    a.opts.dist.dp.stage = stage;
    expect_equivalent(ref, train(a, &world()),
                      fmt::format("{} accumulation 2 stage {}", optimizer, stage));
  }
}

// A checkpoint written by N ranks under ZeRO-3 resumes on 2 ranks under plain
// DP, whose checkpoint resumes in one process; the stitched run equals the
// uninterrupted single-process run, step by step.
TEST_P(DataParallelMpi, CheckpointReshardsAcrossWorldSizesAndStages) {
  const std::string optimizer = GetParam();
  Communicator& w = world();
  const Outcome ref = train(setup(optimizer), nullptr);

  int64_t id = w.rank() == 0 ? static_cast<int64_t>(getpid()) : 0;
  w.broadcast(&id, 1, DType::i64, 0);
  const std::string base = fmt::format("/tmp/meshtrain_dp_ckpt_{}_{}", optimizer, id);
  const std::string dir_a = base + "_a", dir_b = base + "_b";

  RunSetup a = setup(optimizer);
  a.opts.dist.dp.stage = 3;
  a.opts.halt_after = 8;
  a.opts.checkpoint_path = dir_a;
  Outcome first = train(a, &w);
  ASSERT_EQ(first.losses.size(), 8u);

  const std::vector<int> pair = {0, 1};
  std::unique_ptr<Communicator> two = w.subgroup(pair, "two");
  Outcome second, third;
  if (two) {
    RunSetup b = setup(optimizer);
    b.opts.dist.dp.stage = 0;
    b.opts.resume_path = dir_a;
    b.opts.halt_after = 6;
    b.opts.checkpoint_path = dir_b;
    second = train(b, two.get());
    ASSERT_EQ(second.losses.size(), 6u);
  }
  w.barrier();
  if (w.rank() == 0) {
    RunSetup c = setup(optimizer);
    c.opts.resume_path = dir_b;
    third = train(c, nullptr);
    Outcome stitched;
    stitched.losses = first.losses;
    stitched.losses.insert(stitched.losses.end(), second.losses.begin(), second.losses.end());
    stitched.losses.insert(stitched.losses.end(), third.losses.begin(), third.losses.end());
    stitched.params = third.params;
    stitched.test_loss = third.test_loss;
    expect_equivalent(
        ref, stitched,
        fmt::format("{}: {} ranks ZeRO-3 -> 2 ranks DP -> 1 rank", optimizer, w.size()));
  }
  w.barrier();
  if (w.rank() == 0) {
    std::filesystem::remove_all(dir_a);
    std::filesystem::remove_all(dir_b);
  }
}

INSTANTIATE_TEST_SUITE_P(Optimizers, DataParallelMpi, ::testing::Values("sgd", "lamb"));

// ---------------------------------------------------------------------------
// The GPT and the CNN as users run them: the Trainer on the fast backend
// (oneDNN / OpenBLAS / AVX-512 kernels, one thread), AdamW and SGD with
// momentum, ZeRO stages 0-3, compared with the single-process run after
// EVERY step, tensor by tensor (test::compare: |got - want| / max(|want|,
// 0.1 x the tensor's largest |want|), the worst over all elements, steps and
// tensors, with the step, tensor and element where it occurs).
//
// Tolerance, derived. u = 2^-24 (f32 unit roundoff).
//  1. One step. Each gradient element is a sum of n contributions (examples
//     x positions). One process adds them in one order; N ranks add n/N each
//     and then the N partial sums in the collective's order (all-reduce under
//     ZeRO-0, reduce-scatter under 1-3: the stages differ from each other
//     too), and the fast kernels may block B/N rows differently from B --
//     or run on another engine: the fast backend picks OpenBLAS or oneDNN
//     per matmul shape (and a conv layout) by timing the first calls, which
//     alternate between them, so even two single-process runs in one
//     process can differ in the last bits (measured: 5.7e-6 here). Two
//     orders of an n-term sum differ by up to n u sum|c_i| (Higham, Accuracy
//     and Stability of Numerical Algorithms, 4.2), typically sqrt(n) u
//     sum|c_i| (independent roundings): a relative gradient difference
//     rho = 2 sqrt(n) u kappa, kappa = sum|c_i| / |sum c_i| (cancellation).
//  2. The update. SGD + momentum moves a parameter by lr (v + wd p), v a
//     momentum-weighted sum of gradients: a relative gradient error rho is a
//     relative error rho of the update. AdamW's update lr m^/(sqrt(v^) + eps)
//     is scale-free in g, so a relative gradient error rho is again about
//     a relative error rho of the update -- and where the gradient is near
//     zero (near-zero second moment; cancellation, kappa >> 1) rho is large,
//     which Adam does not shrink the way SGD's lr |g| does: the update stays
//     about lr in size. The derivative of the update in g is at most
//     lr / (sqrt(v^) + eps) <= lr / eps, so eps caps the amplification: a
//     gradient difference dg moves a coordinate by at most lr dg / eps.
//     The GPT has such gradients: the attention key bias (softmax ignores a
//     per-query constant, so its gradient is zero in exact arithmetic and
//     rounding noise in floats) and the layer-norm biases of its first steps
//     (|g| ~ 1e-6 from terms ~ 1e-2). The test sets eps = 1e-5 (users' 1e-8
//     is PyTorch's default): then |g| ~ eps for the noise-only coordinates
//     and they move by lr dg / eps, a relative error of the update ~ rho
//     again instead of O(1). Measured with eps = 1e-8 the worst error grows
//     about 2-4x (into block0.attn.k.b): within the bound below, but with a
//     margin that a larger model or more steps would not keep.
//  3. The metric. test::compare measures |got - want| / max(|want|, 0.1 x
//     the tensor's largest |want|). Biases start at zero, so their scale is
//     their own updates, and an update error rho shows as up to rho / 0.1.
//  4. Over steps. Parameter errors feed into later gradients; at these
//     learning rates and step counts the feedback factor (1 + lr L)^t is
//     about 1, so errors add up at most linearly: a factor t.
// tol = t x 10 x 2 sqrt(n) u (kappa taken as 1: cancellation is not bounded
// a priori, which the printed measurements check). n is the longest
// gradient sum: GPT B x seq_len = 48; CNN conv1's weight gradient sums over
// B x H x W = 512 positions. That is 6.6e-5 (GPT) and 2.2e-4 (CNN); the runs
// measure 3e-7 - 1e-5 (printed). A real fault (a shard applied twice, a stale
// or missing bucket, wrong weights) gives 1e-3 and more, and the test checks
// that the comparison catches far less: a learning rate 0.1% off.

struct ModelCase {
  std::string model;      // "gpt" or "cnn"
  std::string optimizer;  // "adamw" or "sgd"
};

std::string case_name(const ::testing::TestParamInfo<ModelCase>& i) {
  return i.param.model + "_" + i.param.optimizer;
}

constexpr int64_t kModelBatch = 8;  // divisible by 2 and 4 ranks
constexpr int kModelSteps = 8;

test::TrainSetup model_setup(const ModelCase& c) {
  test::TrainSetup s;  // only spec and seed are used (for test::compare's names)
  if (c.model == "gpt") {
    s.spec = test::small_gpt();
  } else {
    s.spec.kind = "cnn";
    s.spec.image_channels = 1;
    s.spec.image_size = 8;
    s.spec.classes = 5;
    s.spec.conv_channels = {4, 8};
    s.spec.fc = 16;
  }
  s.seed = 1;
  return s;
}

// Gradient sum length n of the largest reduction (see above).
int64_t terms_per_gradient(const ModelCase& c, const ModelSpec& spec) {
  return c.model == "gpt" ? kModelBatch * spec.seq_len
                          : kModelBatch * spec.image_size * spec.image_size;
}

double model_tolerance(const ModelCase& c, const ModelSpec& spec) {
  const double u = 0x1.0p-24;
  const double floor_fraction = 0.1;  // test::compare's default
  const double rho = 2 * std::sqrt(static_cast<double>(terms_per_gradient(c, spec))) * u;
  return kModelSteps * rho / floor_fraction;
}

TrainerOptions model_options(const ModelCase& c) {
  TrainerOptions o;
  o.batch_size = kModelBatch;
  o.max_steps = kModelSteps;
  o.epochs = 1;
  o.progress = false;
  o.eval = false;
  o.seed = 1;
  o.threads = 1;
  o.exec.backend = "fast";  // what users run
  o.optimizer = c.optimizer;
  if (c.optimizer == "sgd") {
    o.optim.sgd.momentum = 0.9;
    o.optim.sgd.weight_decay = 1e-4;
    o.schedule.lr = 0.05;
  } else {
    o.optim.adamw.weight_decay = 0.01;
    o.optim.adamw.eps = 1e-5;  // bounds Adam's amplification of gradient noise (see above)
    o.schedule.lr = c.model == "gpt" ? 0.003 : 0.01;
  }
  o.dist.dp.bucket_bytes = 1 << 10;  // several buckets, some parameters split across ranks
  o.dist.consistency_every = 4;
  return o;
}

struct Recorded {
  test::Trajectory params;  // whole flat parameters after each step
  std::vector<std::string> notices;
};

Recorded run_recorded(const test::TrainSetup& s, std::shared_ptr<const Dataset> data,
                      TrainerOptions o, Communicator* comm) {
  Recorded rec;
  Trainer* self = nullptr;
  o.on_notice = [&](const std::string& m) { rec.notices.push_back(m); };
  o.dist.after_step = [&](int64_t, int) {
    // Collective under ZeRO-3: every rank's hook runs after the same step.
    Tensor p = self->gather_params();
    rec.params.emplace_back(p.data<float>(), p.data<float>() + p.numel());
  };
  Trainer t(s.spec, std::move(data), nullptr, o, comm);
  self = &t;
  t.run();
  return rec;
}

class ModelsMpi : public ::testing::TestWithParam<ModelCase> {};

TEST_P(ModelsMpi, EveryStageMatchesSingleProcessEveryStepOnTheFastBackend) {
  const ModelCase c = GetParam();
  const test::TrainSetup s = model_setup(c);
  auto data = std::make_shared<test::SyntheticData>(s.spec, 256, 99);
  const Recorded want = run_recorded(s, data, model_options(c), nullptr);
  ASSERT_EQ(want.params.size(), static_cast<size_t>(kModelSteps));
  const double tol = model_tolerance(c, s.spec);
  {
    // Test of the test: every update 0.1% too large is caught.
    TrainerOptions o = model_options(c);
    o.schedule.lr *= 1.001;
    const test::Divergence off =
        test::compare(s, run_recorded(s, data, o, nullptr).params, want.params);
    if (world().rank() == 0) {
      std::printf("%s %s, one process, learning rate 0.1%% off: worst relative error %.3g\n",
                  c.model.c_str(), c.optimizer.c_str(), off.worst);
    }
    EXPECT_GT(off.worst, 3 * tol) << "learning rate 0.1% off: worst " << off.worst;
  }
  for (int stage = 0; stage <= 3; ++stage) {
    TrainerOptions o = model_options(c);
    o.dist.dp.stage = stage;
    const Recorded got = run_recorded(s, data, o, &world());
    const test::Divergence d = test::compare(s, got.params, want.params);
    if (world().rank() == 0) {
      std::printf(
          "%s %s, ZeRO-%d, %d ranks, %d steps: worst relative error %.3g (tolerance %.3g) at %s\n",
          c.model.c_str(), c.optimizer.c_str(), stage, world().size(), kModelSteps, d.worst, tol,
          d.where.c_str());
    }
    EXPECT_LE(d.worst, tol) << c.model << " " << c.optimizer << " ZeRO-" << stage << " on "
                            << world().size() << " ranks (rank " << world().rank()
                            << "): worst relative error " << d.worst << " at " << d.where;
    // The replica check runs under stages 0-2 and, where it cannot apply,
    // the run says so (rank 0 only receives notices).
    const bool said = std::ranges::any_of(got.notices, [](const std::string& m) {
      return m.find("not compared under ZeRO-3") != std::string::npos;
    });
    EXPECT_EQ(said, stage == 3 && world().rank() == 0) << "stage " << stage;
  }
}

INSTANTIATE_TEST_SUITE_P(GptCnn, ModelsMpi,
                         ::testing::Values(ModelCase{"gpt", "adamw"}, ModelCase{"gpt", "sgd"},
                                           ModelCase{"cnn", "adamw"}, ModelCase{"cnn", "sgd"}),
                         case_name);

}  // namespace
}  // namespace mt

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  mt::world();  // initialise MPI before any test
  const int rc = RUN_ALL_TESTS();
  return rc;
}
