// Shows training progress on stderr: a redrawn progress bar when stderr is a
// terminal, plain periodic lines otherwise (logs, CI). Both show the step,
// the epoch, loss, samples/s (and tokens/s for text models), the learning
// rate and the estimated time to the end of the run. Owned by the trainer;
// not thread-safe.
#pragma once

#include <cstdint>
#include <string>

#include "meshtrain/base/timer.h"

namespace mt {

// What one finished step reports.
struct ProgressUpdate {
  int64_t step = 0;    // optimizer steps completed in the run (1-based)
  int64_t epoch = 0;   // the epoch this step belongs to (1-based)
  int64_t epochs = 0;  // epochs in the run (0: unknown)
  double loss = 0;
  double samples_per_s = 0;
  double tokens_per_s = 0;  // 0: not a text model (not shown)
  double lr = 0;
};

class Progress {
 public:
  // total_steps may be 0 if unknown. every: plain-mode line interval (steps).
  // terminal: draw the bar although stderr is not a terminal here (a rank
  // whose stderr mpirun forwards to the user's terminal).
  Progress(int64_t total_steps, int64_t every, bool enabled = true, bool terminal = false);
  void update(const ProgressUpdate& u);
  // Prints a line that must not be overwritten by the bar (e.g. evaluation).
  void message(const std::string& text);
  void finish();

  // The text after the bar (terminal) or the whole line (plain mode);
  // eta_s < 0: not known yet. Pure, for tests.
  static std::string describe(const ProgressUpdate& u, int64_t total_steps, double eta_s);
  // "42s", "3:05", "1:02:03"; "?" for a negative or non-finite value.
  static std::string format_duration(double seconds);

 private:
  // Seconds to the end of the run from the mean wall time per step since
  // the first update (evaluation and checkpoints included, so the estimate
  // covers them); -1 until two steps have been seen.
  double eta_seconds(int64_t step);

  int64_t total_;
  int64_t every_;
  bool enabled_;
  bool tty_;
  bool bar_drawn_ = false;
  Stopwatch clock_;          // started at the first update
  int64_t first_step_ = -1;  // step of the first update
};

}  // namespace mt
