// Dynamic loss scaling for f16 mixed-precision training.
//
// The loss is multiplied by scale() before backward so that small f16
// gradients do not flush to zero. After backward the trainer calls
// unscale_and_check(): the gradients are divided by the scale and scanned
// for inf/NaN. Then update(finite): an overflow multiplies the scale by
// backoff_factor (never below min_scale) and the caller must skip the
// optimizer step; growth_interval finite steps in a row multiply it by
// growth_factor. This is torch.cuda.amp.GradScaler's policy.
//
// Owned by the trainer; not thread-safe; blocks only inside the reducer.
#pragma once

#include <cstdint>
#include <span>

#include "meshtrain/train/optimizer.h"

namespace mt {

struct LossScalerOptions {
  double init_scale = 65536.0;  // 2^16
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;  // finite steps in a row before growing
  double min_scale = 1.0;
  double max_scale = 16777216.0;  // 2^24
};

// What a checkpoint keeps of a DynamicLossScaler.
struct LossScalerState {
  double scale = 65536.0;
  int64_t good_steps = 0;  // finite steps since the last growth or backoff
};

// True if every gradient element is finite on every rank. With gradients
// sharded across ranks, the reducer sums the count of non-finite values so
// that all ranks take the same decision. Throws ShapeError for a non-f32 grad.
bool grads_finite(std::span<const ParamRef> params, const NormReducer& reducer = {});

class DynamicLossScaler {
 public:
  // Throws ConfigError naming the field for factors, interval or bounds that
  // are not a sensible combination (growth > 1, 0 < backoff < 1, ...).
  explicit DynamicLossScaler(const LossScalerOptions& options = {});

  double scale() const { return state_.scale; }

  // Divides every gradient by scale() and reports grads_finite() of the
  // result (the scan runs on the unscaled values).
  bool unscale_and_check(std::span<ParamRef> params, const NormReducer& reducer = {}) const;

  // Records the outcome of one step and adjusts the scale; returns `finite`
  // (true: apply the optimizer step, false: skip it).
  bool update(bool finite);

  const LossScalerState& state() const { return state_; }
  // Throws CheckpointError for a scale that is not finite and > 0 or a
  // negative good_steps.
  void load_state(const LossScalerState& state);

 private:
  LossScalerOptions o_;
  LossScalerState state_;
};

}  // namespace mt
