// Shows training progress on stderr: a redrawn progress bar when stderr is a
// terminal, plain periodic lines otherwise (logs, CI). Owned by the trainer;
// not thread-safe.
#pragma once

#include <cstdint>
#include <string>

namespace mt {

class Progress {
 public:
  // total_steps may be 0 if unknown. every: plain-mode line interval (steps).
  // terminal: draw the bar although stderr is not a terminal here (a rank
  // whose stderr mpirun forwards to the user's terminal).
  Progress(int64_t total_steps, int64_t every, bool enabled = true, bool terminal = false);
  void update(int64_t step, double loss, double samples_per_s, double lr);
  // Prints a line that must not be overwritten by the bar (e.g. evaluation).
  void message(const std::string& text);
  void finish();

 private:
  int64_t total_;
  int64_t every_;
  bool enabled_;
  bool tty_;
  bool bar_drawn_ = false;
};

}  // namespace mt
