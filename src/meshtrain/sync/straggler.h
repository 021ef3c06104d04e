// Straggler detection: which rank computes its steps consistently slower than
// the others.
//
// Every rank reports its step compute time (seconds, waits for peers
// excluded) to report(step, seconds). Every `every_steps` steps the ranks
// all-gather the times buffered since the last exchange (one double per rank
// per step) and keep the last `window` steps per rank. Once the window is
// full, each exchange judges every rank: it is slow when the median of its
// window exceeds `threshold` times the median of the other ranks' window
// medians. A slow window or two is noise on a busy machine; a rank becomes a
// straggler only when it has been judged slow at every exchange from its
// first slow judgement through `persist_windows` more whole windows of steps
// (the sliding median turns when half a window is slow, so a burst of slow
// steps shorter than persist_windows windows is never reported), and
// recovers only when its ratio has stayed at or below `recover_threshold` as
// long. Announcements (becoming a
// straggler, recovering) are rate-limited: at most one per rank every
// `repeat_gap_steps` steps; a change inside the gap is announced when the gap
// ends if it still holds. summary() describes, at the end of a run, the ranks
// that were stragglers. Because every rank sees the same gathered times,
// every rank computes the same report.
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
  // Slow (or recovered) at every judgement for this many whole windows of
  // steps after the first such judgement before the state changes (>= 0;
  // 0: at the first judgement that says so).
  int persist_windows = 3;
  // At most one announcement per rank in this many steps (0: no limit;
  // -1: 10 x window).
  int64_t repeat_gap_steps = -1;
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
  std::vector<int> stragglers;        // ranks over the threshold now (persistent or not)
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
  // Ranks announced as stragglers and not announced recovered since.
  const std::vector<bool>& flagged() const { return flagged_; }
  // One line per rank that was a straggler at some point of the run (empty
  // when none was): for how many of the judged steps, and since which step
  // if it still is. Local (no communication); the same on every rank.
  std::vector<std::string> summary() const;

 private:
  // Per rank: the persistent state and the run of judgements that disagree
  // with it.
  struct RankState {
    bool straggler = false;        // persistent state (announced or not yet)
    int64_t change_since = -1;     // first step of the current disagreeing run; -1: none
    int64_t last_message = -1;     // step of the last announcement; -1: none
    int64_t straggler_steps = 0;   // judged steps spent in the straggler state
    int64_t straggler_since = -1;  // step the current straggler state began
    double last_ratio = 1.0;
  };

  void exchange(StragglerReport& out);
  void judge(StragglerReport& out);

  Communicator& comm_;
  StragglerOptions options_;
  std::vector<int64_t> pending_steps_;
  std::vector<double> pending_seconds_;
  std::vector<std::deque<double>> window_;  // per rank, newest last
  std::vector<bool> flagged_;
  std::vector<RankState> state_;
  int64_t reports_ = 0;
  int64_t judged_steps_ = 0;  // steps covered by judgements (window full)
  int64_t last_judged_ = -1;  // step of the last judgement
};

// Median of a non-empty list (mean of the two middle values for even sizes).
double median_of(std::vector<double> values);

}  // namespace mt
