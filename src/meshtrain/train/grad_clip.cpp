#include "meshtrain/train/grad_clip.h"

#include <cmath>

namespace mt {

double global_grad_norm(std::span<const ParamRef> params, const NormReducer& reducer) {
  double sq = 0;
  for (const ParamRef& p : params) {
    if (p.grad.dtype() != DType::f32) {
      throw ShapeError(fmt::format("gradient norm: gradient of '{}' must be f32, got {}", p.name,
                                   p.grad.desc()));
    }
    if (p.counted) sq += sum_squares(p.grad.data<float>(), p.grad.numel());
  }
  if (reducer) reducer(std::span<double>(&sq, 1));
  return std::sqrt(sq);
}

double clip_grad_norm(std::span<ParamRef> params, double max_norm, const NormReducer& reducer) {
  if (!std::isfinite(max_norm) || max_norm <= 0) {
    throw ConfigError(
        fmt::format("gradient clipping: max_norm must be finite and > 0, got {}", max_norm));
  }
  const double norm = global_grad_norm(params, reducer);
  if (!std::isfinite(norm)) return norm;
  // The 1e-6 keeps the clipped norm just under max_norm, as PyTorch does.
  const double coef = max_norm / (norm + 1e-6);
  if (coef >= 1.0) return norm;
  const auto f = static_cast<float>(coef);
  for (ParamRef& p : params) {
    float* d = p.grad.data<float>();
    const int64_t n = p.grad.numel();
    for (int64_t i = 0; i < n; ++i) d[i] *= f;
  }
  return norm;
}

}  // namespace mt
