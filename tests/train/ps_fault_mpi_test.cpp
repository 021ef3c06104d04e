// A parameter-server worker that stops (4 ranks: workers 0-2, server 3; the
// worker leaves its training loop after step 3 and sends nothing more):
// - ASP goes on without it: the other workers finish every step and the
//   server says it went on without worker rank 1;
// - BSP cannot: the server and the waiting workers fail with an error naming
//   worker rank 1 within dist.timeout_s (plus the 2 s the workers' own wait
//   adds), not a hang.
// The BSP case runs last: it leaves the run's communicators broken.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>

#include "meshtrain/base/error.h"
#include "meshtrain/sync/param_server.h"
#include "meshtrain/train/trainer.h"
#include "sync/dp_harness.h"
#include "train/mpi_world.h"

namespace mt {
namespace {

constexpr int kStopper = 1;
constexpr int kTimeoutS = 2;

ModelSpec spec() {
  ModelSpec s;
  s.kind = "mlp";
  s.image_size = 8;
  s.classes = 6;
  s.hidden = {32, 16};
  return s;
}

struct StopHere : std::runtime_error {
  using std::runtime_error::runtime_error;
};

TrainerOptions options(const std::string& mode) {
  TrainerOptions o;
  o.batch_size = 12;
  o.max_steps = 10;
  o.epochs = 100;
  o.progress = false;
  o.eval = false;
  o.seed = 5;
  o.exec.backend = "reference";
  o.optimizer = "sgd";
  o.schedule.lr = 0.05;
  o.dist.consistency_every = 0;
  o.dist.dp.collective.timeout = std::chrono::milliseconds(kTimeoutS * 1000);
  o.dist.sync.scheme = "ps";
  o.dist.sync.ps_mode = mode;
  o.dist.after_step = [](int64_t step, int rank) {
    if (rank == kStopper && step == 3) throw StopHere("worker stops");
  };
  return o;
}

struct Ran {
  std::string error;  // empty: finished
  double seconds = 0;
  int64_t steps = 0;
  std::vector<std::string> notices;
};

Ran run(const std::string& mode) {
  auto data = std::make_shared<test::SyntheticData>(spec(), 480, 9);
  Trainer t(spec(), data, nullptr, options(mode), &test::mpi_world());
  Ran r;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    r.steps = t.run().steps;
  } catch (const StopHere&) {
    r.error = "stopped";
  } catch (const Error& e) {
    r.error = e.what();
  }
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.notices = t.replica_sync().notices();
  return r;
}

TEST(ParamServerFaultMpi, AspGoesOnWithoutAStoppedWorker) {
  ASSERT_EQ(test::mpi_world().size(), 4);
  const int me = test::mpi_world().rank();
  const Ran r = run("asp");
  if (me == kStopper) {
    EXPECT_EQ(r.error, "stopped");
  } else if (me == 3) {
    EXPECT_EQ(r.error, "");
    ASSERT_EQ(r.notices.size(), 1u);
    EXPECT_NE(r.notices[0].find("goes on without worker rank 1"), std::string::npos)
        << r.notices[0];
  } else {
    EXPECT_EQ(r.error, "");
    EXPECT_EQ(r.steps, 10);
  }
  test::mpi_world().barrier();
}

TEST(ParamServerFaultMpi, BspNamesTheStoppedWorkerWithinTheTimeout) {
  const int me = test::mpi_world().rank();
  const Ran r = run("bsp");
  if (me == kStopper) {
    EXPECT_EQ(r.error, "stopped");
    return;
  }
  std::printf("rank %d after %.2f s: %s\n", me, r.seconds, r.error.c_str());
  EXPECT_NE(r.error.find("worker rank 1"), std::string::npos) << r.error;
  EXPECT_NE(r.error.find("within 2 s (dist.timeout_s)"), std::string::npos) << r.error;
  EXPECT_LT(r.seconds, kTimeoutS + 2 + 3.0);  // the timeout, the workers' margin, slack
}

}  // namespace
}  // namespace mt

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  mt::test::mpi_world();  // initialise MPI before any test
  return RUN_ALL_TESTS();
}
