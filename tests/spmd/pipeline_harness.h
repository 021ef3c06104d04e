// Pipeline-parallel training checked against the single-process run
// (pipeline_harness.cpp), for local threads and mpirun alike.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/spmd/schedule.h"

namespace mt::test {

struct PipeCase {
  std::string model = "mlp";  // "mlp" or "gpt" (tiny sizes)
  ScheduleKind schedule = ScheduleKind::gpipe;
  int microbatches = 4;
  int virtual_stages = 1;
  std::vector<int64_t> stage_layers;  // per virtual stage; empty: balanced by the shorthand
  bool recompute = false;             // every stage recomputes its activations
  int warmup_extra = 0;               // 1f1b's extra warm-up forwards
};

// What a rank's pipeline held (bytes): its peak of stashed tensors in the
// last step, and one micro-batch's stash as the cut plans it.
struct PipeMemory {
  int64_t peak_stash = 0;
  int64_t planned_per_microbatch = 0;
  int64_t planned_per_microbatch_recomputed = 0;  // what recomputation keeps
  int64_t copied = 0;                  // copied out of the arenas into the stash, last step
  int64_t outputs_per_microbatch = 0;  // the stage's boundary outputs, one micro-batch
  int64_t planned_peak = 0;            // planned_stash_bytes(): the rank's planned peak
  // Over the rank's virtual stages, one micro-batch: outputs, their
  // gradients and input gradients (the tensors in transit).
  int64_t boundary_per_microbatch = 0;
};

// 10 SGD steps under the pipeline (comm.size() stages) and in one process
// with the same global batch: the loss of every step (on the last stage's
// rank) and every parameter a rank holds at the end agree within the
// tolerance pipeline_harness.cpp derives; each rank's bytes sent per step
// equal the boundary tensors' bytes in closed form.
PipeMemory check_pipeline_matches_single(Communicator& comm, const PipeCase& c);

// GPipe on a wider MLP (fast backend, one thread): the median over steps of
// the measured idle fraction, 1 - sum(compute) / (p * makespan) from the
// runtime's spans on every rank, is not below the formula (p-1)/(m+p-1)
// (the spans and the clock are right) and, on a machine that is not
// oversubscribed, below (p-1)/p (the stages overlap); printed beside the
// formula.
void check_gpipe_idle_fraction(Communicator& comm, int microbatches);

}  // namespace mt::test
