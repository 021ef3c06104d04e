// The executor's interface to communication: how a collective node of a
// graph (graph/collective.h) is run, without exec knowing comm. The spmd
// layer implements it over a Communicator (spmd/collective_runner.h); tests
// may implement it over anything.
//
// The executor calls start() as soon as the node's inputs are written (in
// the graph's order of collectives, which every rank shares) and wait() right before the first step
// that reads one of its outputs (or at the end of the run), so communication overlaps the compute
// scheduled between the two. The memory plan keeps the node's input and output buffers alive from
// start() to wait(); the runner must not touch them after wait() returns. Every start() is followed
// by exactly one wait() with its handle before run() returns (also when a later step throws, so no
// call is left in flight over executor memory); waits may come in another
// order than the starts when the graph reads a later result first.
// Called from the executor's thread only.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "meshtrain/graph/collective.h"
#include "meshtrain/graph/graph.h"
#include "meshtrain/tensor/tensor.h"

namespace mt {

// What one collective node asks for. in/out are the executor's buffers
// (shapes and dtypes as inferred), valid until the matching wait() returns.
struct CollectiveCall {
  OpKind op = OpKind::all_reduce;
  std::string node;  // node name, for errors and timelines
  CollectiveAttrs attrs;
  std::vector<Tensor> in, out;
};

// Identifies one started call; meaningful to the runner that returned it.
struct CollectiveHandle {
  uint64_t id = 0;
};

class CollectiveRunner {
 public:
  virtual ~CollectiveRunner() = default;
  // Starts the call (may complete it at once). Throws ConfigError for a group
  // it does not know or arguments that do not fit the group.
  virtual CollectiveHandle start(const CollectiveCall& call) = 0;
  // Blocks until the call's outputs are complete (rethrows its error).
  virtual void wait(CollectiveHandle h) = 0;
};

}  // namespace mt
