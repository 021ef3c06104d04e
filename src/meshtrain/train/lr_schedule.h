// Learning-rate schedules: the learning rate to use at each optimizer step.
//
// Steps are 0-based: lr_at(0) is the rate for the first optimizer step. With
// W = warmup_steps, T = total_steps, P = peak lr and M = min_lr:
//   s < W            : P * (s + 1) / W          (linear warm-up; reaches P at s = W - 1)
//   constant, s >= W : P
//   cosine, W <= s < T: M + (P - M) * (1 + cos(pi * (s - W) / (T - W))) / 2
//                       (P at s = W, approaching M as s -> T)
//   cosine, s >= T   : M
// A value type; immutable after construction, safe to share between threads.
#pragma once

#include <cstdint>
#include <string_view>

namespace mt {

enum class LrScheduleKind { constant, cosine };

// Parses "constant" or "cosine"; ConfigError otherwise.
LrScheduleKind parse_lr_schedule_kind(std::string_view name);

struct LrScheduleOptions {
  LrScheduleKind kind = LrScheduleKind::constant;
  double lr = 1e-3;          // peak learning rate P
  double min_lr = 0.0;       // M (cosine only)
  int64_t warmup_steps = 0;  // W
  int64_t total_steps = 0;   // T (cosine only; must exceed W)
};

class LrSchedule {
 public:
  // Throws ConfigError naming the field for a negative or non-finite lr,
  // min_lr outside [0, lr], negative warm-up, or (cosine) T <= W.
  explicit LrSchedule(const LrScheduleOptions& options);

  // The learning rate at 0-based optimizer step `step` (>= 0).
  double lr_at(int64_t step) const;
  const LrScheduleOptions& options() const { return o_; }

 private:
  LrScheduleOptions o_;
};

}  // namespace mt
