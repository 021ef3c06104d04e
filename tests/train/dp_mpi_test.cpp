// Data-parallel training under mpirun (2 and 4 ranks): every ZeRO stage, with
// and without overlap, even and uneven batch shares and gradient
// accumulation, matches the single-process run on the same global batch step
// by step (the loss of every step) and in the final parameters, within 1e-5
// relative. Each rank computes the single-process reference itself.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <optional>

#include <unistd.h>

#include "meshtrain/comm/backends/mpi/mpi_communicator.h"
#include "meshtrain/data/fashion_mnist.h"
#include "meshtrain/train/trainer.h"

namespace mt {
namespace {

Communicator& world() {
  static std::unique_ptr<Communicator> comm = [] {
    CommOptions o;
    o.timeout = std::chrono::milliseconds(60'000);
    return make_mpi_communicator(o);
  }();
  return *comm;
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

}  // namespace
}  // namespace mt

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  mt::world();  // initialise MPI before any test
  const int rc = RUN_ALL_TESTS();
  return rc;
}
