// Small real graphs from a text edge list, for graphs that come without
// meshtrain's file (docs/graph_format.md, "Edge lists"): Zachary's karate
// club as networkx ships it, or any graph a user exports, e.g.
//
//   # comment
//   vertices 34 classes 2
//   label 0 0          (vertex 0 has class 0; every vertex once)
//   edge 0 1           (undirected; self-loops and duplicates dropped)
//   feature 5 0.5 1 3  (optional: vertex 5's feature vector)
//
// Without `feature` lines the features are one-hot vertex ids (n x n: the
// featureless setting of Kipf and Welling's karate-club example); with
// them every vertex needs one, all of one width. The train / validation /
// test split is drawn from `seed` with the given fractions
// (random_split).
//
// Plain function; throws ConfigError naming the file, the line and what was
// expected for anything malformed (an unknown keyword, a vertex id outside
// [0, vertices), a label outside [0, classes), a vertex labelled twice or
// never, a feature row of another width).
#pragma once

#include <cstdint>
#include <string>

#include "meshtrain/data/graph_data.h"

namespace mt {

struct EdgeListOptions {
  double train_fraction = 0.1, val_fraction = 0.1;
  uint64_t seed = 1;
};

GraphData read_edge_list(const std::string& path, const EdgeListOptions& o);

}  // namespace mt
