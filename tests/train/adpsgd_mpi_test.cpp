// AD-PSGD (sync.scheme = "adpsgd", sync/local_steps.h) through the Trainer
// under mpirun (4 ranks: 0 and 2 active, 1 and 3 passive), MLP, plain SGD:
// - with one rank slowed 10x (dist.slowdown) the run ends (no deadlock) and
//   the other ranks train at least 1.5x faster than it (their own measured
//   samples/s), where synchronous D-PSGD on the same ring holds every rank
//   to the slow one's pace (the control that shows the measure can fail);
// - the consensus distance stays bounded (relative < 0.1) and the loss falls;
// - bytes are what the scheme predicts: an active rank sends n + 1 floats
//   per step (request, parameters) and one per passive neighbour at the end
//   ("done"); the passive ranks together send n floats per active step;
// - an active rank that stops sending (alive, but leaves its loop after step
//   3) is named by its passive neighbours within dist.timeout_s after their
//   own last step, not waited for without end (runs last: the stopped rank's
//   exchanges are left half done, and the closing collective fails).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "meshtrain/base/error.h"
#include "meshtrain/sync/replica_sync.h"
#include "meshtrain/train/param_store.h"
#include "meshtrain/train/trainer.h"
#include "sync/dp_harness.h"
#include "train/mpi_world.h"

namespace mt {
namespace {

constexpr int kSteps = 30;

Communicator& world() {
  return test::mpi_world();
}

ModelSpec spec() {
  ModelSpec s;
  s.kind = "mlp";
  s.image_size = 16;
  s.classes = 10;
  s.hidden = {256, 128};  // compute large enough for the slowdown to show
  return s;
}

struct Outcome {
  std::vector<double> rates;  // samples/s of every rank
  std::vector<double> losses;
  uint64_t bytes = 0;
  int64_t n = 0;  // parameters
  ReplicaSync::Consensus consensus;
};

// `steps` of plain SGD on a global batch of `batch`, replicas on a ring.
TrainerOptions options(const std::string& scheme, int64_t batch, int64_t steps) {
  TrainerOptions o;
  o.batch_size = batch;
  o.max_steps = steps;
  o.epochs = 1;
  o.progress = false;
  o.eval = false;
  o.seed = 7;
  o.exec.backend = "reference";
  o.optimizer = "sgd";
  o.optim.sgd.momentum = 0;
  o.optim.sgd.nesterov = false;
  o.schedule.lr = 0.1;
  o.dist.sync.scheme = scheme;
  o.dist.sync.topology = "ring";
  return o;
}

Outcome train(const std::string& scheme, std::vector<double> slowdown) {
  auto data = std::make_shared<test::SyntheticData>(spec(), 256 * kSteps, 3);
  // 64 per rank: compute well above the exchange.
  TrainerOptions o = options(scheme, 256, kSteps);
  o.dist.slowdown = std::move(slowdown);
  Trainer t(spec(), data, nullptr, o, &world());
  const TrainResult r = t.run();
  Outcome out;
  out.losses = r.losses;
  double rate = r.samples_per_s.value_or(0);
  out.rates.resize(static_cast<size_t>(world().size()));
  world().all_gather(&rate, out.rates.data(), 1, DType::f64);
  out.bytes = t.replica_sync().bytes_sent();
  out.n = t.params().flat_values().numel();
  out.consensus = t.replica_sync().consensus();
  return out;
}

double mean5(const std::vector<double>& v, size_t from) {
  double s = 0;
  for (size_t i = from; i < from + 5; ++i) s += v[i];
  return s / 5;
}

TEST(AdPsgdMpi, SlowRankDoesNotHoldTheOthersBack) {
  ASSERT_EQ(world().size(), 4);
  for (int slow : {0, 1}) {  // an active, then a passive rank slowed
    std::vector<double> slowdown(4, 1.0);
    slowdown[static_cast<size_t>(slow)] = 10.0;
    const Outcome a = train("adpsgd", slowdown);
    const Outcome g = train("gossip", slowdown);
    // The fast ranks' mean rate: one of them starved of CPU for a while on a
    // loaded machine should not decide the test.
    double fast_a = 0, fast_g = 0;
    for (int r = 0; r < 4; ++r) {
      if (r == slow) continue;
      fast_a += a.rates[static_cast<size_t>(r)] / 3;
      fast_g += g.rates[static_cast<size_t>(r)] / 3;
    }
    const double slow_a = a.rates[static_cast<size_t>(slow)];
    const double slow_g = g.rates[static_cast<size_t>(slow)];
    if (world().rank() == 0) {
      std::printf(
          "rank %d slowed 10x: adpsgd fast ranks (mean) %.0f samples/s vs slowed %.0f (%.2fx); "
          "gossip %.0f vs %.0f (%.2fx); adpsgd consensus %.3g (relative %.3g)\n",
          slow, fast_a, slow_a, fast_a / slow_a, fast_g, slow_g, fast_g / slow_g,
          a.consensus.distance, a.consensus.relative);
      for (int r = 0; r < 4; ++r) {
        std::printf("  rank %d: adpsgd %.0f, gossip %.0f samples/s\n", r,
                    a.rates[static_cast<size_t>(r)], g.rates[static_cast<size_t>(r)]);
      }
    }
    // Thresholds with room for a loaded 2-core machine (4 ranks, busy-polling
    // MPI receives): see docs/sync.md for the figures measured here.
    EXPECT_GT(fast_a, 1.5 * slow_a) << "slowed rank " << slow;
    EXPECT_LT(fast_g, 1.2 * slow_g) << "D-PSGD should be held to the slow rank's pace";
    EXPECT_GT(a.consensus.distance, 0.0);
    EXPECT_LT(a.consensus.relative, 0.1);
    EXPECT_LT(mean5(a.losses, a.losses.size() - 5), mean5(a.losses, 0));

    // Bytes: ring of 4, so each active rank has both passive ranks as
    // neighbours and each passive rank both active ones.
    const auto n = static_cast<uint64_t>(a.n);
    int64_t passive_bytes = world().rank() % 2 == 1 ? static_cast<int64_t>(a.bytes) : 0;
    world().all_reduce(&passive_bytes, &passive_bytes, 1, DType::i64);
    if (world().rank() % 2 == 0) {
      EXPECT_EQ(a.bytes, (kSteps * (n + 1) + 2) * 4) << "active rank " << world().rank();
    }
    EXPECT_EQ(static_cast<uint64_t>(passive_bytes), 2 * kSteps * n * 4);
  }
}

struct StopHere : std::runtime_error {
  using std::runtime_error::runtime_error;
};

TEST(AdPsgdMpi, PassiveRanksNameAStuckActiveRank) {
  constexpr int kStopper = 0, kTimeoutS = 2;
  auto data = std::make_shared<test::SyntheticData>(spec(), 64 * 12, 3);
  TrainerOptions o = options("adpsgd", 64, 12);
  o.dist.dp.collective.timeout = std::chrono::milliseconds(kTimeoutS * 1000);
  o.dist.after_step = [](int64_t step, int rank) {
    if (rank == kStopper && step == 3) throw StopHere("active rank stops");
  };
  std::string error;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    Trainer t(spec(), data, nullptr, o, &world());
    t.run();
  } catch (const StopHere&) {
    error = "stopped";
  } catch (const Error& e) {
    error = e.what();
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int me = world().rank();
  std::printf("rank %d after %.2f s: %s\n", me, seconds, error.c_str());
  if (me == kStopper) {
    EXPECT_EQ(error, "stopped");
  } else if (me % 2 == 0) {
    // The other active rank finishes its steps; the run's closing average
    // over all ranks then times out (the passive ranks are reporting rank 0),
    // which is an error, not a hang.
    EXPECT_TRUE(error.empty() || error.find("timed out") != std::string::npos) << error;
    EXPECT_LT(seconds, 60.0);
  } else {
    // Ring of 4: both passive ranks have rank 0 as a neighbour.
    EXPECT_NE(error.find("active rank(s) 0 sent neither"), std::string::npos) << error;
    EXPECT_NE(error.find("within 2 s (dist.timeout_s)"), std::string::npos) << error;
    EXPECT_LT(seconds, 60.0);  // its 12 steps, then the 2 s timeout; never a hang
  }
}

}  // namespace
}  // namespace mt

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  mt::world();  // initialise MPI before any test
  return RUN_ALL_TESTS();
}
