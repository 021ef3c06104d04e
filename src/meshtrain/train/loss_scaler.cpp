#include "meshtrain/train/loss_scaler.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace mt {

namespace {

// Counts inf and NaN by their all-ones exponent: a branch-free integer test
// that vectorises, and is immune to -ffast-math's assumptions about NaN.
int64_t count_non_finite(const float* x, int64_t n) {
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, &x[i], 4);
    bad += (u & 0x7f800000u) == 0x7f800000u;
  }
  return bad;
}

void check_f32_grad(const ParamRef& p, std::string_view what) {
  if (p.grad.dtype() != DType::f32) {
    throw ShapeError(
        fmt::format("{}: gradient of '{}' must be f32, got {}", what, p.name, p.grad.desc()));
  }
}

}  // namespace

bool grads_finite(std::span<const ParamRef> params, const NormReducer& reducer) {
  double bad = 0;
  for (const ParamRef& p : params) {
    check_f32_grad(p, "non-finite check");
    bad += static_cast<double>(count_non_finite(p.grad.data<float>(), p.grad.numel()));
  }
  if (reducer) reducer(std::span<double>(&bad, 1));
  return bad == 0;
}

DynamicLossScaler::DynamicLossScaler(const LossScalerOptions& o) : o_(o) {
  auto need = [](bool ok, std::string_view field, double v, std::string_view want) {
    if (!ok) throw ConfigError(fmt::format("loss scaler: {} must be {}, got {}", field, want, v));
  };
  need(std::isfinite(o.growth_factor) && o.growth_factor > 1, "growth_factor", o.growth_factor,
       "finite and > 1");
  need(o.backoff_factor > 0 && o.backoff_factor < 1, "backoff_factor", o.backoff_factor,
       "in (0, 1)");
  need(o.growth_interval >= 1, "growth_interval", static_cast<double>(o.growth_interval), ">= 1");
  need(std::isfinite(o.min_scale) && o.min_scale > 0, "min_scale", o.min_scale, "finite and > 0");
  need(std::isfinite(o.max_scale) && o.max_scale >= o.min_scale, "max_scale", o.max_scale,
       "finite and >= min_scale");
  need(o.init_scale >= o.min_scale && o.init_scale <= o.max_scale, "init_scale", o.init_scale,
       "in [min_scale, max_scale]");
  state_.scale = o.init_scale;
}

bool DynamicLossScaler::unscale_and_check(std::span<ParamRef> params,
                                          const NormReducer& reducer) const {
  const auto inv = static_cast<float>(1.0 / state_.scale);
  for (ParamRef& p : params) {
    check_f32_grad(p, "loss scaler");
    float* g = p.grad.data<float>();
    const int64_t n = p.grad.numel();
    for (int64_t i = 0; i < n; ++i) g[i] *= inv;
  }
  return grads_finite(params, reducer);
}

bool DynamicLossScaler::update(bool finite) {
  if (!finite) {
    state_.scale = std::max(state_.scale * o_.backoff_factor, o_.min_scale);
    state_.good_steps = 0;
    return false;
  }
  if (++state_.good_steps >= o_.growth_interval) {
    state_.scale = std::min(state_.scale * o_.growth_factor, o_.max_scale);
    state_.good_steps = 0;
  }
  return true;
}

void DynamicLossScaler::load_state(const LossScalerState& s) {
  if (!std::isfinite(s.scale) || s.scale <= 0) {
    throw CheckpointError(
        fmt::format("loss scaler: saved scale must be finite and > 0, got {}", s.scale));
  }
  if (s.good_steps < 0) {
    throw CheckpointError(
        fmt::format("loss scaler: saved good_steps must be >= 0, got {}", s.good_steps));
  }
  state_ = s;
}

}  // namespace mt
