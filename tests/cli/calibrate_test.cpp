// calibrate's alpha-beta fit (cli/calibrate.h) recovers a known latency and
// bandwidth from exact and noisy times, and keeps latency >= 0.
#include <gtest/gtest.h>

#include "meshtrain/base/error.h"
#include "meshtrain/cli/calibrate.h"

namespace mt {
namespace {

TEST(CalibrateFit, RecoversLatencyAndBandwidth) {
  // Ring all-reduce on 4 ranks: 6 steps, 1.5 x B bytes; L = 20 us, W = 1 GB/s.
  std::vector<double> steps, bytes, t;
  for (double b : {4e3, 64e3, 1e6, 8e6}) {
    steps.push_back(6);
    bytes.push_back(1.5 * b);
    t.push_back(6 * 20e-6 + 1.5 * b / 1e9);
  }
  // A second algorithm shape (fewer steps) separates latency from bandwidth.
  steps.push_back(2), bytes.push_back(1e6), t.push_back(2 * 20e-6 + 1e6 / 1e9);
  const CalibrationFit f = fit_alpha_beta(steps, bytes, t);
  EXPECT_NEAR(f.latency_s, 20e-6, 1e-9);
  EXPECT_NEAR(f.bandwidth_bytes_s, 1e9, 1e3);
  EXPECT_LT(f.rms_rel_error, 1e-9);
  // 5% noise: within 10% of both.
  for (size_t k = 0; k < t.size(); ++k) t[k] *= (k % 2 ? 1.05 : 0.95);
  const CalibrationFit g = fit_alpha_beta(steps, bytes, t);
  EXPECT_NEAR(g.latency_s, 20e-6, 2e-6);
  EXPECT_NEAR(g.bandwidth_bytes_s, 1e9, 1e8);
  EXPECT_GT(g.rms_rel_error, 0.01);
}

TEST(CalibrateFit, NegativeLatencyIsClampedAndNoBytesIsAnError) {
  // Times that a free fit would explain with L < 0: L = 0, W from bytes alone.
  const CalibrationFit f = fit_alpha_beta({1, 1}, {1e6, 2e6}, {0.5e-3, 1.5e-3});
  EXPECT_EQ(f.latency_s, 0);
  EXPECT_GT(f.bandwidth_bytes_s, 0);
  EXPECT_THROW(fit_alpha_beta({1, 1}, {0, 0}, {1e-3, 1e-3}), ConfigError);
}

}  // namespace
}  // namespace mt
