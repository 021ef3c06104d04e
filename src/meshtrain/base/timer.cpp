#include "meshtrain/base/timer.h"

#include <time.h>

#include <algorithm>
#include <cstdint>

namespace mt {

int64_t thread_cpu_ns() {
  timespec ts{};
  if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) != 0) return now_ns();
  return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

bool thread_cpu_clock_is_fine() {
  // Spins until the clock has advanced five times (at most 50 ms of wall
  // time) and keeps the smallest step seen.
  static const bool fine = [] {
    constexpr int64_t kFineStepNs = 20'000;
    const int64_t deadline = now_ns() + 50'000'000;
    int64_t last = thread_cpu_ns(), smallest = INT64_MAX;
    for (int changes = 0; changes < 5 && now_ns() < deadline;) {
      const int64_t t = thread_cpu_ns();
      if (t != last) {
        smallest = std::min(smallest, t - last);
        last = t;
        ++changes;
      }
    }
    return smallest <= kFineStepNs;
  }();
  return fine;
}

double trial_clock_s(int threads) {
  const int64_t ns = threads == 1 && thread_cpu_clock_is_fine() ? thread_cpu_ns() : now_ns();
  return static_cast<double>(ns) * 1e-9;
}

}  // namespace mt
