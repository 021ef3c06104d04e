// Per-operator cost facts: the executor's profile, `meshtrain inspect` and the
// planner's cost model all read these same numbers.
#pragma once

#include <cstdint>

#include "meshtrain/graph/graph.h"

namespace mt {

struct OpCost {
  double flops = 0;  // floating-point operations (a multiply-add is 2)
  double bytes = 0;  // bytes read + written, assuming no cache reuse
  // Collectives (graph/collective.h): the payload bytes handed to the
  // communicator (its `payload_bytes` counter); what goes over the wire per
  // rank depends on the algorithm (comm's cost functions). 0 for local ops.
  double comm_bytes = 0;
};

OpCost op_cost(const Graph& g, const Node& n);

// Sums over all nodes (forward + backward as present in g).
OpCost graph_cost(const Graph& g);

}  // namespace mt
