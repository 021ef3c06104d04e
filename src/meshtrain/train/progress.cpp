#include "meshtrain/train/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include <fmt/format.h>

namespace mt {

Progress::Progress(int64_t total_steps, int64_t every, bool enabled, bool terminal)
    : total_(total_steps),
      every_(std::max<int64_t>(every, 1)),
      enabled_(enabled),
      tty_(terminal || isatty(STDERR_FILENO) != 0) {}

void Progress::update(int64_t step, double loss, double samples_per_s, double lr) {
  if (!enabled_) return;
  const int64_t done = step + 1;
  if (tty_) {
    constexpr int kWidth = 30;
    const double frac = total_ > 0 ? std::min(1.0, static_cast<double>(done) / total_) : 0.0;
    const int filled = static_cast<int>(frac * kWidth);
    std::string bar(static_cast<size_t>(filled), '#');
    bar.resize(kWidth, '.');
    fmt::print(stderr, "\r[{}] {:>6}/{} loss {:.4f}  {:.0f} samples/s  lr {:.3g}   ", bar, done,
               total_, loss, samples_per_s, lr);
    std::fflush(stderr);
    bar_drawn_ = true;
  } else if (done % every_ == 0 || done == total_) {
    fmt::print(stderr, "step {}/{} loss {:.4f} {:.0f} samples/s lr {:.3g}\n", done, total_, loss,
               samples_per_s, lr);
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
