// k-nearest-neighbour graphs: exact brute-force neighbour search over the
// rows of a matrix (Euclidean distance), and the Fashion-MNIST graph built
// with it -- 70,000 real images as vertices, so a GNN's accuracy on it means
// something.
//
// The search is exact: for blocks of query rows against blocks of candidate
// rows, the dot products come from one matmul of the tensor layer's fast
// backend (OpenBLAS / oneDNN sgemm), and the ranking score |y|^2 - 2 x.y
// (the squared distance less the query's constant |x|^2) feeds a per-query
// top-k list. Ties go to the lower row index. Cost: 2 n^2 d FLOPs for the
// products plus n^2 comparisons; for Fashion-MNIST (n = 70,000, d = 784)
// that is 7.7 TFLOP, minutes on two cores, so write the graph once with
// `meshtrain graph-gen` and train from the file. Scores are f32, so two
// candidates whose distances differ by less than f32 rounding of the dot
// products may swap places against an exact f64 search.
//
// Pure functions of their inputs (and the thread count only for speed);
// they block, using `threads` kernel and OpenMP threads.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "meshtrain/data/fashion_mnist.h"
#include "meshtrain/data/graph_data.h"

namespace mt {

// Row i's k nearest other rows of points (f32 [n, d]), nearest first:
// n x k entries, row-major. ConfigError if k < 1 or k >= n.
std::vector<int32_t> nearest_neighbours(const Tensor& points, int64_t k, int threads = 1);

// The symmetrised kNN graph: i ~ j when j is among i's k nearest or i among
// j's (simple, undirected, rows sorted; degrees between k and n - 1).
Csr knn_graph(const Tensor& points, int64_t k, int threads = 1);

struct FashionKnnOptions {
  std::string dir = kFashionMnistDefaultDir;
  int64_t k = 10;
  // First images of each split only (tests, quick runs); -1 = all.
  int64_t limit_train = -1, limit_test = -1;
  // Pixels as FashionMnist gives them: (x/255 - mean) / std, or x/255.
  bool normalize = true;
  float mean = kFashionMnistMean, std = kFashionMnistStd;
  // Share of the training images held out as the validation mask (drawn
  // from seed); the rest are the training mask, the test images the test mask.
  double val_fraction = 0.1;
  uint64_t seed = 1;
  int threads = 1;
};

// Vertices: the training images (ids 0 .. T-1), then the test images
// (T .. T+S-1); features: the 784 pixels; labels: the 10 classes; masks from
// the data set's own split (see val_fraction). FileError for missing or bad
// files (FashionMnist's), ConfigError for bad options.
GraphData make_fashion_knn(const FashionKnnOptions& o);

}  // namespace mt
