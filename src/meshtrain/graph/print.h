// Human-readable dumps of a Graph (used by `meshtrain inspect` and in test
// failure messages).
#pragma once

#include <string>

#include "meshtrain/graph/graph.h"

namespace mt {

// A header line (node, parameter and FLOP totals), the graph inputs and
// parameters, then one line per node: name, op, output types, the number of
// parameter elements the node reads, and its FLOPs. Backward nodes are marked.
std::string describe(const Graph& g);

// "1.23 GFLOP"-style formatting of a FLOP count (also used for bytes with unit "B").
std::string human_count(double n, const char* unit);

}  // namespace mt
