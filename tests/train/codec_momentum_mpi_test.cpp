// Deep Gradient Compression's momentum correction (SyncOptions::
// codec_momentum, sync/compressed_sync.cpp) through the Trainer under mpirun
// (2 ranks), on the MLP with SGD (the optimizer's own momentum 0: the
// correction carries it):
// - topk:1.0 without masking equals all-reduce DP with SGD momentum 0.9
//   (heavy ball and Nesterov) step by step (losses and final parameters
//   within 1e-5 relative): the velocity is linear in the gradient, so the
//   average of the ranks' velocities is the velocity of the average;
// - topk:1.0 with momentum factor masking zeroes every velocity after each
//   step: plain SGD without momentum (heavy ball), within 1e-5;
// - topk:0.1 with masking learns, differs from the run without masking, and
//   sends exactly the compressed all-reduce's predicted bytes;
// - refused under another scheme, another codec and ZeRO, naming the key;
// - the sparsity warm-up (codec_warmup_steps): stages whose density is the
//   target's are bitwise the run without warm-up (the residual handed from
//   stage to stage whole); with 50% -> 10% over 8 steps the bytes are
//   exactly each stage's steps x its predicted exchange, more than without
//   warm-up, and the run learns.
// - PowerSGD batched (powersgd_batched): every tensor's P (and the vectors
//   sent whole) in one all-reduce, every Q in another: equals the
//   per-tensor exchange step by step within 1e-5 relative, and the bytes
//   are exactly those two all-reduces' prediction per step.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/base/error.h"
#include "meshtrain/sync/codecs.h"
#include "meshtrain/sync/compressed_all_reduce.h"
#include "meshtrain/sync/replica_sync.h"
#include "meshtrain/train/param_store.h"
#include "meshtrain/train/trainer.h"
#include "sync/dp_harness.h"
#include "train/mpi_world.h"
#include "train/sync_scheme_harness.h"

namespace mt {
namespace {

constexpr int kSteps = 12;

Communicator& world() {
  return test::mpi_world();
}

using Outcome = test::SyncOutcome;

Outcome train(const SyncOptions& sync, double momentum, bool nesterov, int zero = 0) {
  TrainerOptions o = test::sync_options(sync, {.steps = kSteps});
  o.dist.consistency_every = 0;
  o.optim.sgd.momentum = momentum;
  o.optim.sgd.nesterov = nesterov;
  o.dist.dp.stage = zero;
  return test::train_sync(o);
}

using test::divergence;
using test::predicted_exchange;

SyncOptions corrected(const std::string& codec, bool nesterov, bool masking) {
  SyncOptions s;
  s.codec = codec;
  s.codec_momentum = 0.9;
  s.codec_nesterov = nesterov;
  s.codec_momentum_masking = masking;
  return s;
}

TEST(CodecMomentumMpi, FullTopKWithoutMaskingEqualsMomentumSgd) {
  for (const bool nesterov : {false, true}) {
    SCOPED_TRACE(nesterov ? "nesterov" : "heavy ball");
    const Outcome dp = train(SyncOptions{}, 0.9, nesterov);
    const Outcome c = train(corrected("topk:1.0", nesterov, false), 0.0, false);
    ASSERT_EQ(c.losses.size(), static_cast<size_t>(kSteps));
    const double d = divergence(dp, c);
    if (world().rank() == 0) {
      std::printf("topk:1.0 + momentum correction (%s) vs DP SGD momentum 0.9: %.3g\n",
                  nesterov ? "nesterov" : "heavy ball", d);
    }
    EXPECT_LE(d, 1e-5);
    EXPECT_EQ(c.bytes, kSteps * predicted_exchange(c.entries, "topk:1.0"));
  }
}

TEST(CodecMomentumMpi, FullTopKWithMaskingEqualsPlainSgd) {
  const Outcome plain = train(SyncOptions{}, 0.0, false);
  const Outcome masked = train(corrected("topk:1.0", false, true), 0.0, false);
  const double d = divergence(plain, masked);
  if (world().rank() == 0) std::printf("topk:1.0 + correction + masking vs SGD: %.3g\n", d);
  EXPECT_LE(d, 1e-5);
  // Not the momentum run: masking is what removed the momentum.
  EXPECT_GT(divergence(train(SyncOptions{}, 0.9, false), masked), 1e-3);
}

TEST(CodecMomentumMpi, SparseTopKLearnsAndSendsThePredictedBytes) {
  const Outcome masked = train(corrected("topk:0.1", true, true), 0.0, false);
  const Outcome unmasked = train(corrected("topk:0.1", true, false), 0.0, false);
  for (const Outcome* o : {&masked, &unmasked}) {
    EXPECT_EQ(o->bytes, kSteps * predicted_exchange(o->entries, "topk:0.1"));
    const auto& v = o->losses;
    EXPECT_LT(v[kSteps - 1] + v[kSteps - 2] + v[kSteps - 3], v[0] + v[1] + v[2]);
  }
  EXPECT_GT(divergence(unmasked, masked), 1e-4);
  const Outcome compact = train(corrected("topk:0.1:compact", true, true), 0.0, false);
  EXPECT_EQ(compact.bytes, kSteps * predicted_exchange(compact.entries, "topk:0.1:compact"));
}

TEST(CodecMomentumMpi, RefusedOutsideAllReduceTopK) {
  auto message = [](const SyncOptions& s, int zero) {
    try {
      train(s, 0.0, false, zero);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  SyncOptions local = corrected("topk:0.1", false, true);
  local.scheme = "local_sgd";
  EXPECT_NE(message(local, 0).find("sync.codec_momentum"), std::string::npos);
  EXPECT_NE(message(corrected("bf16", false, true), 0).find("sync.codec_momentum"),
            std::string::npos);
  const std::string zero = message(corrected("topk:0.1", false, true), 2);
  EXPECT_NE(zero.find("sync.codec_momentum"), std::string::npos) << zero;
  EXPECT_NE(zero.find("dist.zero_stage"), std::string::npos) << zero;
}

TEST(CodecMomentumMpi, SparsityWarmUp) {
  SyncOptions w;
  w.codec = "topk:0.1";
  w.codec_warmup_steps = 8;
  w.codec_warmup_density = 0.5;
  // Stages of 2 steps: 0.5, 0.5 (0.2)^(1/4), ..., then 0.1.
  EXPECT_EQ(codec_warmup_fraction(w, 0.1, 0), 0.5);
  EXPECT_EQ(codec_warmup_fraction(w, 0.1, 1), 0.5);
  EXPECT_NEAR(codec_warmup_fraction(w, 0.1, 2), 0.5 * std::pow(0.2, 0.25), 1e-12);
  EXPECT_NEAR(codec_warmup_fraction(w, 0.1, 7), 0.5 * std::pow(0.2, 0.75), 1e-12);
  EXPECT_EQ(codec_warmup_fraction(w, 0.1, 8), 0.1);
  // Stages at the target's density: the same bits as without warm-up.
  SyncOptions plain;
  plain.codec = "topk:0.1";
  SyncOptions same = plain;
  same.codec_warmup_steps = 8;
  same.codec_warmup_density = 0.1;
  const Outcome a = train(plain, 0.9, true);
  const Outcome b = train(same, 0.9, true);
  EXPECT_EQ(a.losses, b.losses);
  EXPECT_EQ(a.params, b.params);
  EXPECT_EQ(a.bytes, b.bytes);
  // 50% -> 10%: each stage's bytes as predicted.
  const Outcome c = train(w, 0.9, true);
  uint64_t want = 0;
  for (int64_t step = 0; step < kSteps; ++step) {
    CompressedAllReduceOptions co;
    co.codec = parse_codec_spec("topk:0.1");
    co.codec.k_fraction = codec_warmup_fraction(w, 0.1, step);
    for (const ParamStore::Entry& e : c.entries) {
      want += predict_traffic(world(), compressed_all_reduce_plan(co, e.shape)).bytes_sent;
    }
  }
  EXPECT_EQ(c.bytes, want);
  EXPECT_GT(c.bytes, a.bytes);
  EXPECT_LT(c.losses[kSteps - 1] + c.losses[kSteps - 2], c.losses[0] + c.losses[1]);
  // With momentum correction too (the velocity and the warm-up compose).
  SyncOptions both = w;
  both.codec_momentum = 0.9;
  both.codec_nesterov = true;
  const Outcome d = train(both, 0.0, false);
  EXPECT_EQ(d.bytes, want);
  // Refused where it does not apply.
  SyncOptions count = w;
  count.codec = "topk:5";
  EXPECT_THROW(train(count, 0.0, false), ConfigError);
  EXPECT_THROW(train(w, 0.0, false, 1), ConfigError);
}

TEST(CodecMomentumMpi, PowerSgdBatchedEqualsPerTensor) {
  SyncOptions per;
  per.codec = "powersgd:2";
  SyncOptions batched = per;
  batched.powersgd_batched = true;
  const Outcome a = train(per, 0.9, true);
  const Outcome b = train(batched, 0.9, true);
  const double d = divergence(a, b);
  if (world().rank() == 0) std::printf("powersgd:2 batched vs per tensor: %.3g\n", d);
  EXPECT_LE(d, 1e-5);
  // Each tensor's own plan: P then Q (low rank), or the tensor whole.
  size_t first = 0, second = 0;
  int low_rank = 0;
  CompressedAllReduceOptions co;
  co.codec = parse_codec_spec("powersgd:2");
  for (const ParamStore::Entry& e : b.entries) {
    const std::vector<PlannedCollective> own = compressed_all_reduce_plan(co, e.shape);
    first += own.front().count;
    if (own.size() == 2) {
      second += own.back().count;
      ++low_rank;
    }
  }
  ASSERT_GT(low_rank, 0);
  const std::vector<PlannedCollective> plan = {{Collective::all_reduce, first, DType::f32},
                                               {Collective::all_reduce, second, DType::f32}};
  EXPECT_EQ(b.bytes, kSteps * predict_traffic(world(), plan).bytes_sent);
  SyncOptions wrong = batched;
  wrong.codec = "topk:0.1";
  EXPECT_THROW(train(wrong, 0.0, false), ConfigError);
}

}  // namespace
}  // namespace mt

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  mt::world();  // initialise MPI before any test
  return RUN_ALL_TESTS();
}
