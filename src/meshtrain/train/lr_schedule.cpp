#include "meshtrain/train/lr_schedule.h"

#include <cmath>
#include <numbers>

#include "meshtrain/base/error.h"

namespace mt {

LrScheduleKind parse_lr_schedule_kind(std::string_view name) {
  if (name == "constant") return LrScheduleKind::constant;
  if (name == "cosine") return LrScheduleKind::cosine;
  throw ConfigError(
      fmt::format("unknown lr schedule '{}' (expected one of constant, cosine)", name));
}

LrSchedule::LrSchedule(const LrScheduleOptions& o) : o_(o) {
  if (!std::isfinite(o.lr) || o.lr < 0) {
    throw ConfigError(fmt::format("lr schedule: lr must be finite and >= 0, got {}", o.lr));
  }
  if (o.warmup_steps < 0) {
    throw ConfigError(
        fmt::format("lr schedule: warmup_steps must be >= 0, got {}", o.warmup_steps));
  }
  if (o.kind == LrScheduleKind::cosine) {
    if (!std::isfinite(o.min_lr) || o.min_lr < 0 || o.min_lr > o.lr) {
      throw ConfigError(
          fmt::format("lr schedule: min_lr must be in [0, lr = {}], got {}", o.lr, o.min_lr));
    }
    if (o.total_steps <= o.warmup_steps) {
      throw ConfigError(
          fmt::format("lr schedule: cosine needs total_steps > warmup_steps, got "
                      "total_steps {} and warmup_steps {}",
                      o.total_steps, o.warmup_steps));
    }
  }
}

double LrSchedule::lr_at(int64_t step) const {
  MT_CHECK(step >= 0, "lr schedule asked for step {}", step);
  if (step < o_.warmup_steps) {
    return o_.lr * static_cast<double>(step + 1) / static_cast<double>(o_.warmup_steps);
  }
  if (o_.kind == LrScheduleKind::constant) return o_.lr;
  if (step >= o_.total_steps) return o_.min_lr;
  const double progress = static_cast<double>(step - o_.warmup_steps) /
                          static_cast<double>(o_.total_steps - o_.warmup_steps);
  return o_.min_lr + (o_.lr - o_.min_lr) * 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
}

}  // namespace mt
