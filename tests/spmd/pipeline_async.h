// Asynchronous pipelining (PipelineOptions::async) against a sequential
// reference, for local threads and mpirun alike (pipeline_async.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/spmd/schedule.h"

namespace mt::test {

// A small MLP under 1F1B with comm.size() stages (stage_layers: layers per
// stage; one stage holds all of them on one rank), m micro-batches per
// step, 4 steps without the flush and the drain, each stage's plain SGD
// applied after every micro-batch's backward. Checked against a reference
// that runs the whole model one micro-batch at a time at the weights the
// mode prescribes: micro-batch k of the run meets stage r's weights of
// version k - g (g = min(k, p-1-r): the version gap), PipeDream's stashed
// version, or for
// spectrain that version minus g times the smoothed change; each stage's
// update of micro-batch k applies to its version k. The loss of every step
// (on the last stage) and every parameter at the end agree within 2e-5
// relative (pipeline_async.cpp says why). kind "gpt": a tiny GPT whose
// tied wte is held by the first and the last stage; the reference gives it
// the first stage's versions (the owner's) and the whole model's gradient
// (the sum of both uses), as the runtime's owner applies it.
void check_async_matches_reference(Communicator& comm, AsyncMode mode,
                                   const std::vector<int64_t>& stage_layers, int microbatches,
                                   const std::string& kind = "mlp");

}  // namespace mt::test
