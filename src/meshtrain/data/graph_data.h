// A graph for full-graph node classification: structure (CSR, row i = vertex
// i's in-neighbours), vertex features, labels and train / validation / test
// masks; and generators that make one from a seed, so no download is needed:
//
// - a contextual stochastic block model (CSBM): `classes` equal-sized blocks,
//   each vertex with about `avg_degree` undirected edges, a fraction
//   `homophily` of them inside its own class; features are the class's mean
//   vector (a random direction of length `feature_signal`) plus standard
//   normal noise, so both structure and features carry the label.
// - R-MAT (Chakrabarti et al.; a Kronecker graph with a 2x2 initiator, as
//   Graph500's generator): 2^scale vertices, edge_factor * 2^scale
//   undirected edges drawn by recursive quadrant choice with probabilities
//   (a, b, c, d = 1 - a - b - c); self-loops and duplicates removed. Edges
//   come in fixed chunks of 65,536 with one random stream per (seed, chunk),
//   drawn by as many threads as OpenMP gives, so the graph depends on the
//   seed alone. Skewed degrees, for timing; features are noise and labels
//   are the vertex's degree bucket (so a task exists, but accuracy means
//   little). Vertex ids are not permuted: low ids are the hubs.
// - a k-nearest-neighbour graph over Fashion-MNIST: data/knn_graph.h.
//
// Plain data: immutable after construction, safe to share between threads.
// The on-disk format (docs/graph_format.md) is read and written in
// train/graph_file.h, next to the safetensors code it uses.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/tensor/sparse.h"
#include "meshtrain/tensor/tensor.h"

namespace mt {

struct GraphData {
  std::string name;             // for logs, e.g. "csbm(n=2000, classes=4, h=0.80)"
  Csr adj;                      // [n, n], no edge values
  Tensor features;              // f32 [n, F]
  std::vector<int32_t> labels;  // n entries in [0, classes)
  int64_t classes = 0;
  std::vector<uint8_t> train_mask, val_mask, test_mask;  // n entries, 0 or 1

  int64_t num_vertices() const { return adj.rows; }
  int64_t feature_dim() const { return features.rank() == 2 ? features.shape()[1] : 0; }
  // Vertex ids whose mask entry is set, ascending.
  static std::vector<int32_t> members(const std::vector<uint8_t>& mask);
  // Throws ConfigError naming `where` and the field for any inconsistency:
  // CSR malformed or not n x n, features not [n, F] f32, a label count or
  // mask length other than n, a label outside [0, classes), a mask value
  // other than 0/1.
  void validate(const std::string& where) const;
  std::string describe() const;  // name, vertices, edges, features, classes, split sizes
};

struct CsbmOptions {
  int64_t vertices = 2000;
  int64_t classes = 4;
  double avg_degree = 10;
  double homophily = 0.8;  // in [0, 1]
  int64_t features = 32;
  double feature_signal = 1.0;                      // length of each class's mean feature vector
  double train_fraction = 0.1, val_fraction = 0.1;  // the rest is test
  uint64_t seed = 1;
};

struct RmatOptions {
  int64_t scale = 12;  // 2^scale vertices, <= 30
  int64_t edge_factor = 8;
  double a = 0.57, b = 0.19, c = 0.19;
  int64_t features = 32;
  int64_t classes = 4;
  double train_fraction = 0.1, val_fraction = 0.1;
  uint64_t seed = 1;
};

// The simple undirected CSR (n x n) of edge pairs: both directions of every
// pair, self-loops and duplicates dropped, rows sorted. ShapeError for an
// endpoint outside [0, n) or more entries than i32 indices hold.
Csr simple_undirected(int64_t n, const std::vector<std::pair<int32_t, int32_t>>& pairs);

// Fills g's masks with a random split drawn from `seed`: a permutation's
// first train_fraction * n vertices train, the next val_fraction * n
// validation, the rest test. ConfigError naming `what` for fractions
// outside (0, 1) / [0, 1 - train_fraction).
void random_split(GraphData& g, double train_fraction, double val_fraction, uint64_t seed,
                  const char* what);
// Throw ConfigError naming the bad option.
GraphData make_csbm(const CsbmOptions& o);
GraphData make_rmat(const RmatOptions& o);

}  // namespace mt
