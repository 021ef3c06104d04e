// Discrete-event simulation of one optimizer step over every rank's program
// (planner/cost_model.h's Programs): each rank runs its tasks lane by lane
// in order; a compute task takes its time; a collective starts when every
// member of its group has reached it (the same group, the same call number)
// and ends for all of them after the cost model's time; a send occupies the
// sender's lane for the transfer and its message arrives when it ends; a
// receive ends when its message has arrived. Tasks may also wait for
// earlier tasks of their rank (a gradient bucket's all-reduce waits for the
// backward operator that completes it; the optimizer waits for the last
// bucket), which is how communication overlaps backward.
//
// Every start time is the latest of the times it depends on, and lanes keep
// their order, so the result is the same as an event-queue simulation
// processed in time order, and deterministic. Work: O(ranks x tasks per
// program). Memory: the distinct programs once, plus per rank its binding
// (group ids, peers) and one finish time per task while simulating.
//
// Output: the StepEstimate (step time, per-rank compute / comm / idle,
// utilisation, MFU, peak memory and bytes from the programs) and,
// optionally, a Chrome-trace timeline in the runtime's format
// (train/timeline.h: pid = rank, lanes compute / comm / wait), so a
// predicted and a measured trace open side by side in Perfetto.
#pragma once

#include <string>

#include "meshtrain/planner/cluster_model.h"
#include "meshtrain/planner/cost_model.h"

namespace mt::planner {

struct SimulationOptions {
  std::string trace_path;  // empty: no trace
  int trace_ranks = 64;    // the first this-many ranks go into the trace (0 = all)
};

// E[max of n independent standard normal variables]: 0 for n = 1, 0.564
// for 2, 1.029 for 4, 1.424 for 8. A collective of n members whose compute
// since their last synchronisation jitters by a relative standard
// deviation j (DeviceKind::compute_jitter) starts this x j x that compute
// after their predicted (equal) arrival.
double expected_max_normal(int n);

// Throws InternalError naming the stuck ranks and tasks when the programs
// deadlock (a collective some member never reaches, a receive without its
// send).
StepEstimate simulate(const Programs& programs, const ClusterModel& cluster,
                      const SimulationOptions& options = {});

}  // namespace mt::planner
