// LR schedule values at chosen steps, gradient clipping by global norm, and
// the dynamic loss scaler's growth and backoff.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <numbers>

#include "meshtrain/train/grad_clip.h"
#include "meshtrain/train/loss_scaler.h"
#include "meshtrain/train/lr_schedule.h"

namespace mt {
namespace {

// --- LR schedule ------------------------------------------------------------

TEST(LrSchedule, ConstantWithLinearWarmup) {
  LrSchedule s({.kind = LrScheduleKind::constant, .lr = 0.1, .warmup_steps = 4});
  EXPECT_DOUBLE_EQ(s.lr_at(0), 0.025);
  EXPECT_DOUBLE_EQ(s.lr_at(1), 0.05);
  EXPECT_DOUBLE_EQ(s.lr_at(3), 0.1);
  EXPECT_DOUBLE_EQ(s.lr_at(4), 0.1);
  EXPECT_DOUBLE_EQ(s.lr_at(1000000), 0.1);
  LrSchedule plain({.lr = 0.3});
  EXPECT_DOUBLE_EQ(plain.lr_at(0), 0.3);
}

TEST(LrSchedule, CosineAfterWarmupDecaysToMinLr) {
  LrSchedule s({.kind = LrScheduleKind::cosine,
                .lr = 1.0,
                .min_lr = 0.1,
                .warmup_steps = 10,
                .total_steps = 110});
  EXPECT_DOUBLE_EQ(s.lr_at(0), 0.1);   // 1 * 1/10
  EXPECT_DOUBLE_EQ(s.lr_at(4), 0.5);   // 1 * 5/10
  EXPECT_DOUBLE_EQ(s.lr_at(10), 1.0);  // decay starts at the peak
  EXPECT_NEAR(s.lr_at(35), 0.1 + 0.9 * 0.5 * (1 + std::cos(std::numbers::pi / 4)), 1e-12);
  EXPECT_NEAR(s.lr_at(60), 0.55, 1e-12);  // halfway: the mean of peak and floor
  EXPECT_NEAR(s.lr_at(109), 0.1 + 0.9 * 0.5 * (1 + std::cos(std::numbers::pi * 99 / 100)), 1e-12);
  EXPECT_DOUBLE_EQ(s.lr_at(110), 0.1);
  EXPECT_DOUBLE_EQ(s.lr_at(5000), 0.1);
  // Monotone after warm-up.
  for (int64_t i = 10; i < 110; ++i) EXPECT_GE(s.lr_at(i), s.lr_at(i + 1)) << i;
}

TEST(LrSchedule, CosineWithoutWarmupStartsAtPeak) {
  LrSchedule s({.kind = LrScheduleKind::cosine, .lr = 2.0, .total_steps = 4});
  EXPECT_DOUBLE_EQ(s.lr_at(0), 2.0);
  EXPECT_NEAR(s.lr_at(2), 1.0, 1e-12);
  EXPECT_DOUBLE_EQ(s.lr_at(4), 0.0);
}

TEST(LrSchedule, RejectsInconsistentOptions) {
  EXPECT_THROW(LrSchedule({.kind = LrScheduleKind::cosine, .warmup_steps = 5, .total_steps = 5}),
               ConfigError);
  EXPECT_THROW(
      LrSchedule({.kind = LrScheduleKind::cosine, .lr = 0.1, .min_lr = 0.2, .total_steps = 10}),
      ConfigError);
  EXPECT_THROW(LrSchedule({.lr = -1}), ConfigError);
  EXPECT_THROW(LrSchedule({.warmup_steps = -1}), ConfigError);
  EXPECT_EQ(parse_lr_schedule_kind("cosine"), LrScheduleKind::cosine);
  try {
    parse_lr_schedule_kind("linear");
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("'linear'"), std::string::npos) << e.what();
  }
}

// --- gradient clipping ------------------------------------------------------

struct Grads {
  Tensor a = Tensor::empty({2}, DType::f32);
  Tensor b = Tensor::empty({1}, DType::f32);
  std::vector<ParamRef> refs;
  Grads(float a0, float a1, float b0) {
    a.set_item(0, a0);
    a.set_item(1, a1);
    b.set_item(0, b0);
    refs = {{"a", a, a}, {"b", b, b}};  // the param is irrelevant here
  }
};

TEST(GradClip, ScalesDownToMaxNormAndReturnsThePreClipNorm) {
  Grads g(3, 4, 12);  // global norm 13
  EXPECT_DOUBLE_EQ(clip_grad_norm(g.refs, 6.5), 13.0);
  const double f = 6.5 / (13.0 + 1e-6);
  EXPECT_FLOAT_EQ(static_cast<float>(g.a.item(0)), static_cast<float>(3 * f));
  EXPECT_FLOAT_EQ(static_cast<float>(g.a.item(1)), static_cast<float>(4 * f));
  EXPECT_FLOAT_EQ(static_cast<float>(g.b.item(0)), static_cast<float>(12 * f));
  EXPECT_NEAR(global_grad_norm(g.refs), 6.5, 1e-5);
}

TEST(GradClip, LeavesSmallGradientsAlone) {
  Grads g(3, 4, 12);
  EXPECT_DOUBLE_EQ(clip_grad_norm(g.refs, 20.0), 13.0);
  EXPECT_EQ(g.a.item(0), 3.0);
  EXPECT_EQ(g.b.item(0), 12.0);
}

TEST(GradClip, ReportsNonFiniteNormWithoutTouchingGradients) {
  Grads g(3, std::numeric_limits<float>::quiet_NaN(), 12);
  EXPECT_TRUE(std::isnan(clip_grad_norm(g.refs, 1.0)));
  EXPECT_EQ(g.a.item(0), 3.0);
  Grads h(std::numeric_limits<float>::infinity(), 1, 1);
  EXPECT_TRUE(std::isinf(clip_grad_norm(h.refs, 1.0)));
  EXPECT_EQ(h.b.item(0), 1.0);
}

TEST(GradClip, ReducerMakesTheNormGlobalAcrossShards) {
  // This rank holds [3, 4] and [0]; another rank's shard contributes 12^2.
  Grads g(3, 4, 0);
  int calls = 0;
  NormReducer other_rank = [&](std::span<double> v) {
    ASSERT_EQ(v.size(), 1u);
    EXPECT_DOUBLE_EQ(v[0], 25.0);
    v[0] += 144.0;
    ++calls;
  };
  EXPECT_DOUBLE_EQ(clip_grad_norm(g.refs, 6.5, other_rank), 13.0);
  EXPECT_EQ(calls, 1);
  EXPECT_NEAR(g.a.item(1), 4 * 6.5 / 13.0, 1e-6);
}

TEST(GradClip, RejectsBadMaxNorm) {
  Grads g(1, 1, 1);
  EXPECT_THROW(clip_grad_norm(g.refs, 0.0), ConfigError);
  EXPECT_THROW(clip_grad_norm(g.refs, std::numeric_limits<double>::infinity()), ConfigError);
}

// --- loss scaler ------------------------------------------------------------

TEST(LossScaler, GrowsAfterIntervalOfGoodStepsAndBacksOffOnOverflow) {
  DynamicLossScaler s;
  EXPECT_EQ(s.scale(), 65536.0);
  for (int i = 0; i < 1999; ++i) EXPECT_TRUE(s.update(true));
  EXPECT_EQ(s.scale(), 65536.0);
  EXPECT_EQ(s.state().good_steps, 1999);
  EXPECT_TRUE(s.update(true));
  EXPECT_EQ(s.scale(), 131072.0);
  EXPECT_EQ(s.state().good_steps, 0);
  for (int i = 0; i < 1500; ++i) s.update(true);
  EXPECT_FALSE(s.update(false));  // skip this step
  EXPECT_EQ(s.scale(), 65536.0);
  EXPECT_EQ(s.state().good_steps, 0);  // the count restarts after an overflow
  for (int i = 0; i < 1999; ++i) s.update(true);
  EXPECT_EQ(s.scale(), 65536.0);
}

TEST(LossScaler, RespectsMinAndMaxScale) {
  DynamicLossScaler s({.init_scale = 4, .growth_interval = 1, .min_scale = 1, .max_scale = 16});
  s.update(false);
  s.update(false);
  s.update(false);
  EXPECT_EQ(s.scale(), 1.0);
  for (int i = 0; i < 10; ++i) s.update(true);
  EXPECT_EQ(s.scale(), 16.0);
}

TEST(LossScaler, UnscalesAndDetectsNonFiniteGradients) {
  DynamicLossScaler s({.init_scale = 1024});
  Grads g(512, -2048, 1);
  EXPECT_TRUE(s.unscale_and_check(g.refs));
  EXPECT_EQ(g.a.item(0), 0.5);
  EXPECT_EQ(g.a.item(1), -2.0);
  EXPECT_EQ(g.b.item(0), 1.0 / 1024);
  Grads bad(1, 1, std::numeric_limits<float>::infinity());
  EXPECT_FALSE(s.unscale_and_check(bad.refs));
  Grads nan(std::numeric_limits<float>::quiet_NaN(), 1, 1);
  EXPECT_FALSE(grads_finite(nan.refs));
}

TEST(LossScaler, AnOverflowOnAnotherRankIsSeenByAll) {
  Grads g(1, 2, 3);
  EXPECT_TRUE(grads_finite(g.refs, [](std::span<double> v) { v[0] += 0; }));
  EXPECT_FALSE(grads_finite(g.refs, [](std::span<double> v) { v[0] += 1; }));
}

TEST(LossScaler, StateRoundTripsAndRejectsNonsense) {
  DynamicLossScaler s;
  for (int i = 0; i < 7; ++i) s.update(true);
  s.update(false);
  s.update(true);
  DynamicLossScaler t;
  t.load_state(s.state());
  EXPECT_EQ(t.scale(), 32768.0);
  EXPECT_EQ(t.state().good_steps, 1);
  EXPECT_THROW(t.load_state({.scale = 0}), CheckpointError);
  EXPECT_THROW(t.load_state({.scale = std::nan("")}), CheckpointError);
  EXPECT_THROW(t.load_state({.scale = 2, .good_steps = -1}), CheckpointError);
  EXPECT_THROW(DynamicLossScaler({.growth_factor = 1.0}), ConfigError);
  EXPECT_THROW(DynamicLossScaler({.backoff_factor = 1.0}), ConfigError);
  EXPECT_THROW(DynamicLossScaler({.growth_interval = 0}), ConfigError);
}

}  // namespace
}  // namespace mt
