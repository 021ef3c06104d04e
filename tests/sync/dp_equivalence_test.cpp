// Data-parallel equivalence on a small MLP: for world sizes 1-4, ZeRO stages
// 0-3, overlap on and off, tiny buckets (one or two parameters each, uneven
// chunks) and one big bucket, SGD with momentum and AdamW, 20 steps of
// DataParallel training match the single-process run on the same global
// batch step by step (parameters within 1e-5 relative). World size 1 matches
// bitwise.
#include <gtest/gtest.h>

#include <cstdio>

#include <fmt/format.h>

#include "dp_harness.h"

namespace mt::test {
namespace {

constexpr double kRtol = 1e-5;

TrainSetup mlp_setup(const std::string& optimizer) {
  TrainSetup s;
  s.spec = small_mlp();
  s.global_batch = 12;
  s.steps = 20;
  s.optimizer = optimizer;
  if (optimizer == "sgd") {
    s.optim.sgd.momentum = 0.9;
    s.optim.sgd.weight_decay = 1e-4;
    s.lr = 0.05;
  } else {
    s.optim.adamw.weight_decay = 0.01;
    s.lr = 0.01;
  }
  return s;
}

struct Case {
  int world;
  int stage;
  bool overlap;
  int64_t bucket_bytes;
};

std::string name(const Case& c) {
  return fmt::format("world {} stage {} overlap {} bucket_bytes {}", c.world, c.stage,
                     c.overlap ? "on" : "off", c.bucket_bytes);
}

void check_cases(const std::string& optimizer, const std::vector<Case>& cases) {
  const TrainSetup s = mlp_setup(optimizer);
  const Trajectory want = run_reference(s);
  for (const Case& c : cases) {
    DpRun run;
    run.world = c.world;
    run.dp.stage = c.stage;
    run.dp.overlap = c.overlap;
    run.dp.bucket_bytes = c.bucket_bytes;
    run.local.comm.timeout = std::chrono::milliseconds(20'000);
    const DpResult got = run_data_parallel(s, run);
    const Divergence d = compare(s, got.params, want);
    std::printf("%s, %s: max relative difference %.3g\n", optimizer.c_str(), name(c).c_str(),
                d.worst);
    if (c.world == 1) {
      EXPECT_EQ(d.worst, 0.0) << optimizer << ", " << name(c) << ": world size 1 differs at "
                              << d.where;
    }
    EXPECT_LE(d.worst, kRtol) << optimizer << ", " << name(c) << ": max relative difference "
                              << d.worst << " at " << d.where;
  }
}

std::vector<Case> grid(bool overlap) {
  std::vector<Case> cases;
  for (int world = 1; world <= 4; ++world) {
    for (int stage = 0; stage <= 3; ++stage) {
      // 256 bytes: every parameter in a bucket of its own or with a neighbour.
      cases.push_back({world, stage, overlap, 256});
    }
  }
  return cases;
}

TEST(DataParallelEquivalence, SgdMomentumEveryStageAndWorldSizeOverlapOn) {
  check_cases("sgd", grid(true));
}

TEST(DataParallelEquivalence, SgdMomentumEveryStageAndWorldSizeOverlapOff) {
  check_cases("sgd", grid(false));
}

TEST(DataParallelEquivalence, AdamWEveryStageAndWorldSize) {
  check_cases("adamw", grid(true));
}

TEST(DataParallelEquivalence, OneBigBucket) {
  std::vector<Case> cases;
  for (int stage = 0; stage <= 3; ++stage) cases.push_back({3, stage, true, 25ll << 20});
  check_cases("adamw", cases);
}

}  // namespace
}  // namespace mt::test
