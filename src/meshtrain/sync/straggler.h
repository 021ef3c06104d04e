// Straggler detection: which rank computes its steps consistently slower than
// the others.
//
// Every rank reports its step compute time (seconds, waits for peers
// excluded) to report(step, seconds). Every `every_steps` steps the ranks
// all-gather the times buffered since the last exchange (one double per rank
// per step) and keep the last `window` steps per rank. Once the window is
// full, a rank is a straggler when the median of its window exceeds
// `threshold` times the median of the other ranks' window medians. A
// straggler is announced once; it is announced again only after it recovered
// (its ratio fell to `recover_threshold` or below) and relapsed. Because every
// rank sees the same gathered times, every rank computes the same report.
//
// Ownership: keeps a reference to the communicator (which must outlive it).
// Blocking: report() is collective on the steps where it exchanges (every
// rank calls it once per step, with the same step numbers) and blocks for one
// all-gather bounded by the collective timeout; on other steps it only
// buffers. Not thread-safe. Units: seconds in the data, milliseconds in the
// messages.
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/comm/options.h"

namespace mt {

struct StragglerOptions {
  int64_t every_steps = 1;  // exchange every this many steps (>= 1)
  int window = 20;          // steps per rank the medians are taken over (>= 1)
  double threshold = 1.2;   // straggler when median > threshold x others' median
  // A reported straggler counts as recovered when its ratio is at or below
  // this (default: halfway between 1 and threshold), so a rank hovering at
  // the threshold is not announced every few steps.
  double recover_threshold = 0;  // 0: 1 + (threshold - 1) / 2
  CollectiveOptions collective;  // timeout and tag of the all-gathers
};

// What one call of report() found.
struct StragglerReport {
  bool exchanged = false;  // false on steps that only buffered
  // Steps gathered by this exchange and their times: seconds[i][r] is rank
  // r's compute time at steps[i] (for the metrics log).
  std::vector<int64_t> steps;
  std::vector<std::vector<double>> seconds;
  // Per rank, once the window is full (else empty): the median of the window
  // and its ratio to the median of the other ranks' medians.
  std::vector<double> window_median;
  std::vector<double> ratio;
  std::vector<int> stragglers;        // ranks over the threshold now (announced or not)
  std::vector<int> new_stragglers;    // announced by this report
  std::vector<int> recovered;         // announced earlier, recovered now
  std::vector<std::string> messages;  // one line per new straggler or recovery
};

class StragglerDetector {
 public:
  // Throws ConfigError for out-of-range options, naming the option and value.
  StragglerDetector(Communicator& comm, StragglerOptions options = {});

  // Records this rank's compute time for `step` (seconds >= 0, finite, else
  // ConfigError) and, when (number of reports so far) is a multiple of
  // every_steps, exchanges with the other ranks.
  StragglerReport report(int64_t step, double compute_seconds);

  const StragglerOptions& options() const { return options_; }
  // Ranks announced and not recovered since.
  const std::vector<bool>& flagged() const { return flagged_; }

 private:
  void exchange(StragglerReport& out);
  void judge(StragglerReport& out);

  Communicator& comm_;
  StragglerOptions options_;
  std::vector<int64_t> pending_steps_;
  std::vector<double> pending_seconds_;
  std::vector<std::deque<double>> window_;  // per rank, newest last
  std::vector<bool> flagged_;
  int64_t reports_ = 0;
};

// Median of a non-empty list (mean of the two middle values for even sizes).
double median_of(std::vector<double> values);

}  // namespace mt
