#include "meshtrain/train/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include <fmt/format.h>

namespace mt {

Progress::Progress(int64_t total_steps, int64_t every, bool enabled, bool terminal)
    : total_(total_steps),
      every_(std::max<int64_t>(every, 1)),
      enabled_(enabled),
      tty_(terminal || isatty(STDERR_FILENO) != 0) {}

std::string Progress::format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const auto s = static_cast<int64_t>(std::llround(seconds));
  if (s < 60) return fmt::format("{}s", s);
  if (s < 3600) return fmt::format("{}:{:02}", s / 60, s % 60);
  return fmt::format("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60);
}

std::string Progress::describe(const ProgressUpdate& u, int64_t total_steps, double eta_s) {
  std::string text = fmt::format("step {}/{}", u.step, total_steps > 0 ? total_steps : u.step);
  if (u.epochs > 0) {
    text += fmt::format(" epoch {}/{}", u.epoch, u.epochs);
  } else if (u.epoch > 0) {
    text += fmt::format(" epoch {}", u.epoch);
  }
  text += fmt::format("  loss {:.4f}  {:.0f} samples/s", u.loss, u.samples_per_s);
  if (u.tokens_per_s > 0) text += fmt::format("  {:.0f} tokens/s", u.tokens_per_s);
  text += fmt::format("  lr {:.3g}", u.lr);
  if (total_steps > 0 && u.step >= total_steps) {
    text += "  done";
  } else if (total_steps > 0) {
    text += "  ETA " + (eta_s >= 0 ? format_duration(eta_s) : std::string("--"));
  }
  return text;
}

double Progress::eta_seconds(int64_t step) {
  if (first_step_ < 0) {
    first_step_ = step;
    clock_.reset();
    return -1;
  }
  if (step <= first_step_ || total_ <= 0) return -1;
  const double per_step = clock_.seconds() / static_cast<double>(step - first_step_);
  return per_step * static_cast<double>(std::max<int64_t>(total_ - step, 0));
}

void Progress::update(const ProgressUpdate& u) {
  if (!enabled_) return;
  const double eta = eta_seconds(u.step);
  if (tty_) {
    constexpr int kWidth = 30;
    const double frac =
        total_ > 0 ? std::min(1.0, static_cast<double>(u.step) / static_cast<double>(total_)) : 0.0;
    const int filled = static_cast<int>(frac * kWidth);
    std::string bar(static_cast<size_t>(filled), '#');
    bar.resize(kWidth, '.');
    // Clear to the end of the line: the text may have become shorter.
    fmt::print(stderr, "\r[{}] {}\x1b[K", bar, describe(u, total_, eta));
    std::fflush(stderr);
    bar_drawn_ = true;
  } else if (u.step % every_ == 0 || u.step == total_) {
    fmt::print(stderr, "{}\n", describe(u, total_, eta));
  }
}

void Progress::message(const std::string& text) {
  if (!enabled_) return;
  if (tty_ && bar_drawn_) fmt::print(stderr, "\n");
  bar_drawn_ = false;
  fmt::print(stderr, "{}\n", text);
}

void Progress::finish() {
  if (enabled_ && tty_ && bar_drawn_) fmt::print(stderr, "\n");
  bar_drawn_ = false;
}

}  // namespace mt
