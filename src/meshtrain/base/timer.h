// Clocks: the monotonic wall clock for per-operator timing and metrics, the
// calling thread's CPU time, and the clock that measured choices (engine
// trials, train.precision = "auto") time their trials on.
#pragma once

#include <chrono>
#include <cstdint>

namespace mt {

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Seconds since construction; not thread-safe, cheap to copy.
class Stopwatch {
 public:
  Stopwatch() : start_(now_ns()) {}
  void reset() { start_ = now_ns(); }
  double seconds() const { return static_cast<double>(now_ns() - start_) * 1e-9; }

 private:
  int64_t start_;
};

// CPU time of the calling thread, in nanoseconds.
int64_t thread_cpu_ns();

// Whether the calling thread's CPU clock advances in steps of at most 20 us.
// Some virtual machines advance it only at the scheduler's tick (1-10 ms),
// where a trial of tens of microseconds reads 0. Probed once per process.
bool thread_cpu_clock_is_fine();

// A clock in seconds for timing alternative ways to do the same work: with
// one thread the work runs on the calling thread, whose CPU time ignores
// preemption by other processes on a shared machine (where that clock is
// fine); otherwise the wall clock, since helpers' time counts too.
double trial_clock_s(int threads);

}  // namespace mt
