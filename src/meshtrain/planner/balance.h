// Uneven shares of work for unequal devices: the linear program that HAP
// (the seed paper) solves for its sharding ratios, here in the one form the
// plan search needs. n devices (or pipeline stages) split `total` units of
// work (examples of a batch, attention heads, layers); device i takes x_i
// units and finishes after a_i * x_i + b_i seconds (a_i: its time per unit,
// b_i: its fixed time, e.g. a stage's embeddings); memory allows it at most
// max_i units (and the plan may need at least min_i). The program
//
//   minimise T  subject to  a_i x_i + b_i <= T,  sum_i x_i = total,
//                           min_i <= x_i <= max_i
//
// is solved by GLPK's simplex (libglpk, Debian's glpk 5.0); its optimum
// equalises the finish times of every device whose bounds do not bind.
// round_shares() then gives whole units: the floors of the LP solution, each
// remaining unit to the device that would finish it first, which keeps the
// sum and the bounds and is within one unit per device of the LP.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mt::planner {

struct BalanceProblem {
  std::vector<double> time_per_unit;  // a_i > 0, one per device
  std::vector<double> fixed_time;     // b_i >= 0; empty = all 0
  std::vector<double> max_units;      // empty = unbounded
  std::vector<double> min_units;      // empty = all 0
  double total = 0;                   // units to share out
  std::string what = "units";         // "examples", "layers": for messages
};

struct Balance {
  std::vector<double> units;  // x_i
  double time = 0;            // T: the slowest device's finish time
};

// The LP's optimum. Throws ConfigError when no split exists, saying which
// bound fails and by how much ("memory allows at most 12 examples in all,
// 4 short of the 16 to share").
Balance balance_lp(const BalanceProblem& p);

// Whole units summing to p.total within the bounds (the bounds rounded
// inwards), from the LP's solution.
std::vector<int64_t> round_shares(const BalanceProblem& p, const Balance& lp);

// max_i a_i x_i + b_i for integer shares.
double finish_time(const BalanceProblem& p, const std::vector<int64_t>& shares);

}  // namespace mt::planner
