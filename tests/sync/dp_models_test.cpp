// Data-parallel equivalence beyond the plain MLP: a small GPT (embedding
// tied to the output head, layer norms) with AdamW, LAMB (whole-parameter
// trust ratios through the norm reducer) and global-norm clipping, also with
// activation recomputation (backward re-reads the layer-norm gains, so ZeRO-3
// gathers them again); uneven batch shares [2,1] and [1,2,1]; gradient
// accumulation over K = 2 and 3 micro-steps, alone and with uneven shares.
// Every run matches the single-process run on the same global batch step by
// step, parameters within 1e-5 relative.
#include <gtest/gtest.h>

#include <cstdio>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "dp_harness.h"

namespace mt::test {
namespace {

constexpr double kRtol = 1e-5;

void expect_matches(const TrainSetup& s, const Trajectory& want, DpRun run,
                    const std::string& what) {
  run.local.comm.timeout = std::chrono::milliseconds(20'000);
  const DpResult got = run_data_parallel(s, run);
  const Divergence d = compare(s, got.params, want);
  std::printf("%s, world %d, stage %d, K %d: max relative difference %.3g\n", what.c_str(),
              run.world, run.dp.stage, run.dp.accumulation_steps, d.worst);
  EXPECT_LE(d.worst, kRtol) << what << " (world " << run.world << ", stage " << run.dp.stage
                            << ", K " << run.dp.accumulation_steps << "): max relative "
                            << "difference " << d.worst << " at " << d.where;
}

TrainSetup gpt_setup(const std::string& optimizer) {
  TrainSetup s;
  s.spec = small_gpt();
  s.global_batch = 6;
  s.steps = 20;
  s.optimizer = optimizer;
  s.lr = optimizer == "lamb" ? 0.02 : 0.003;
  // The attention key bias has a gradient that is zero in exact arithmetic
  // (softmax ignores a per-query constant); with eps = 1e-8 Adam would turn
  // its roundoff into full-size steps of random sign, in any two runs whose
  // sums differ in order. A larger eps keeps such noise small.
  s.optim.adamw.eps = 1e-5;
  s.optim.lamb.eps = 1e-5;
  return s;
}

TEST(DataParallelModels, GptTiedEmbeddingAdamW) {
  const TrainSetup s = gpt_setup("adamw");
  const Trajectory want = run_reference(s);
  for (int world : {2, 3}) {
    for (int stage = 0; stage <= 3; ++stage) {
      DpRun run;
      run.world = world;
      run.dp.stage = stage;
      run.dp.bucket_bytes = 1024;
      expect_matches(s, want, run, "gpt adamw");
    }
  }
}

TEST(DataParallelModels, GptLambWithClippingThroughTheNormReducer) {
  TrainSetup s = gpt_setup("lamb");
  s.clip = 0.5;  // small enough to clip most steps
  const Trajectory want = run_reference(s);
  for (int stage = 0; stage <= 3; ++stage) {
    DpRun run;
    run.world = 3;
    run.dp.stage = stage;
    run.dp.bucket_bytes = 700;
    expect_matches(s, want, run, "gpt lamb + clip");
  }
}

TEST(DataParallelModels, GptWithRecomputationEveryStage) {
  TrainSetup s = gpt_setup("adamw");
  s.recompute = true;
  s.steps = 10;
  const Trajectory want = run_reference(s);
  for (int stage = 0; stage <= 3; ++stage) {
    DpRun run;
    run.world = 2;
    run.dp.stage = stage;
    run.dp.bucket_bytes = 512;
    expect_matches(s, want, run, "gpt recompute");
  }
}

TrainSetup mlp_sgd() {
  TrainSetup s;
  s.spec = small_mlp();
  s.global_batch = 12;
  s.steps = 20;
  s.optimizer = "sgd";
  s.optim.sgd.momentum = 0.9;
  s.lr = 0.05;
  return s;
}

TEST(DataParallelModels, UnevenShares) {
  const TrainSetup s = mlp_sgd();
  const Trajectory want = run_reference(s);
  for (const std::vector<int64_t>& shares :
       {std::vector<int64_t>{2, 1}, std::vector<int64_t>{1, 2, 1}}) {
    for (int stage = 0; stage <= 3; ++stage) {
      DpRun run;
      run.world = static_cast<int>(shares.size());
      run.shares = shares;
      run.dp.stage = stage;
      run.dp.bucket_bytes = 256;
      expect_matches(s, want, run, fmt::format("shares [{}]", fmt::join(shares, ",")));
    }
  }
}

TEST(DataParallelModels, GradientAccumulation) {
  const TrainSetup s = mlp_sgd();
  const Trajectory want = run_reference(s);
  for (int K : {2, 3}) {
    for (int world : {1, 2}) {
      for (int stage = 0; stage <= 3; ++stage) {
        DpRun run;
        run.world = world;
        run.dp.stage = stage;
        run.dp.accumulation_steps = K;
        run.dp.bucket_bytes = 256;
        run.dp.overlap = stage % 2 == 0;
        expect_matches(s, want, run, "accumulation");
      }
    }
  }
}

TEST(DataParallelModels, GradientAccumulationWithUnevenSharesAndAdamW) {
  TrainSetup s = mlp_sgd();
  s.optimizer = "adamw";
  s.lr = 0.01;
  const Trajectory want = run_reference(s);
  for (int stage = 0; stage <= 3; ++stage) {
    DpRun run;
    run.world = 2;
    run.shares = {1, 2};
    run.dp.stage = stage;
    run.dp.accumulation_steps = 2;
    run.dp.bucket_bytes = 512;
    expect_matches(s, want, run, "accumulation + shares [1,2]");
  }
}

// The comparison itself must notice a wrong weighting: equal weights 1/N on
// an uneven split are not the global-batch gradient.
TEST(DataParallelModels, WrongWeightsAreDetected) {
  const TrainSetup s = mlp_sgd();
  const Trajectory want = run_reference(s);
  DpRun run;
  run.world = 2;
  run.shares = {2, 1};
  run.local.comm.timeout = std::chrono::milliseconds(20'000);
  TrainSetup wrong = s;
  wrong.equal_weights = true;
  const DpResult got = run_data_parallel(wrong, run);
  EXPECT_GT(compare(s, got.params, want).worst, 1e-3);
}

}  // namespace
}  // namespace mt::test
