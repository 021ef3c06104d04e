#include "meshtrain/data/graph_data.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include <fmt/format.h>

#include "meshtrain/base/error.h"
#include "meshtrain/base/random.h"

namespace mt {

std::vector<int32_t> GraphData::members(const std::vector<uint8_t>& mask) {
  std::vector<int32_t> v;
  for (size_t i = 0; i < mask.size(); ++i) {
    if (mask[i] != 0) v.push_back(static_cast<int32_t>(i));
  }
  return v;
}

void GraphData::validate(const std::string& where) const {
  auto bad = [&](const std::string& field, const std::string& msg) {
    throw ConfigError(fmt::format("{}: field '{}': {}", where, field, msg));
  };
  const int64_t n = adj.rows;
  if (adj.cols != n) bad("row_ptr", fmt::format("adjacency is {}x{}, not square", n, adj.cols));
  if (static_cast<int64_t>(adj.row_ptr.size()) != n + 1 || adj.row_ptr.front() != 0) {
    bad("row_ptr", fmt::format("must have vertices + 1 = {} entries starting at 0", n + 1));
  }
  for (int64_t i = 0; i < n; ++i) {
    if (adj.row_ptr[static_cast<size_t>(i) + 1] < adj.row_ptr[static_cast<size_t>(i)]) {
      bad("row_ptr", fmt::format("decreases at vertex {}", i));
    }
  }
  if (adj.row_ptr.back() != adj.nnz()) {
    bad("row_ptr",
        fmt::format("ends at {} but col_idx has {} entries", adj.row_ptr.back(), adj.nnz()));
  }
  for (size_t e = 0; e < adj.col_idx.size(); ++e) {
    if (adj.col_idx[e] < 0 || adj.col_idx[e] >= n) {
      bad("col_idx", fmt::format("entry {} is vertex id {}, out of range [0, {}) (vertex count)", e,
                                 adj.col_idx[e], n));
    }
  }
  if (!features.defined() || features.dtype() != DType::f32 || features.rank() != 2) {
    bad("features", "must be an f32 matrix [vertices, features]");
  }
  if (features.shape()[0] != n) {
    bad("features",
        fmt::format("has {} rows but the graph has {} vertices", features.shape()[0], n));
  }
  if (static_cast<int64_t>(labels.size()) != n) {
    bad("labels", fmt::format("has {} entries but the graph has {} vertices", labels.size(), n));
  }
  if (classes < 1) bad("classes", fmt::format("must be >= 1, got {}", classes));
  for (size_t i = 0; i < labels.size(); ++i) {
    if (labels[i] < 0 || labels[i] >= classes) {
      bad("labels", fmt::format("vertex {} has label {}, outside [0, {})", i, labels[i], classes));
    }
  }
  const std::pair<const char*, const std::vector<uint8_t>*> masks[] = {
      {"train_mask", &train_mask}, {"val_mask", &val_mask}, {"test_mask", &test_mask}};
  for (const auto& [field, m] : masks) {
    if (static_cast<int64_t>(m->size()) != n) {
      bad(field, fmt::format("has {} entries but the graph has {} vertices", m->size(), n));
    }
    for (size_t i = 0; i < m->size(); ++i) {
      if ((*m)[i] > 1) bad(field, fmt::format("entry {} is {}, expected 0 or 1", i, (*m)[i]));
    }
  }
}

std::string GraphData::describe() const {
  auto count = [](const std::vector<uint8_t>& m) { return std::count(m.begin(), m.end(), 1); };
  return fmt::format("{}: {} vertices, {} edges, {} features, {} classes, split {}/{}/{}", name,
                     num_vertices(), adj.nnz(), feature_dim(), classes, count(train_mask),
                     count(val_mask), count(test_mask));
}

namespace {

void check(bool ok, const char* gen, const char* field, double v, const char* want) {
  if (!ok) throw ConfigError(fmt::format("{}: {} must be {}, got {}", gen, field, want, v));
}

// A random split: a permutation's first train_fraction * n vertices train, the
// next val_fraction * n validation, the rest test.
void split(GraphData& g, double train_fraction, double val_fraction, Rng& rng) {
  const int64_t n = g.num_vertices();
  std::vector<int32_t> perm(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) perm[static_cast<size_t>(i)] = static_cast<int32_t>(i);
  for (int64_t i = n - 1; i > 0; --i) {
    std::swap(perm[static_cast<size_t>(i)], perm[rng.next() % static_cast<uint64_t>(i + 1)]);
  }
  const auto nt = static_cast<int64_t>(std::llround(train_fraction * static_cast<double>(n)));
  const auto nv = static_cast<int64_t>(std::llround(val_fraction * static_cast<double>(n)));
  g.train_mask.assign(static_cast<size_t>(n), 0);
  g.val_mask.assign(static_cast<size_t>(n), 0);
  g.test_mask.assign(static_cast<size_t>(n), 0);
  for (int64_t k = 0; k < n; ++k) {
    auto& m = k < nt ? g.train_mask : (k < nt + nv ? g.val_mask : g.test_mask);
    m[static_cast<size_t>(perm[static_cast<size_t>(k)])] = 1;
  }
}

// The seed of one chunk's stream: hashed, not base + chunk, because SplitMix
// streams from nearby states overlap (state advances by a constant per draw).
uint64_t chunk_seed(uint64_t seed, const char* what, int64_t chunk) {
  return Rng(Rng::derive(seed, what) ^ static_cast<uint64_t>(chunk)).next();
}

void check_split(const char* gen, double t, double v) {
  check(t > 0 && t < 1, gen, "train_fraction", t, "in (0, 1)");
  check(v >= 0 && t + v < 1, gen, "val_fraction", v, "in [0, 1 - train_fraction)");
}

}  // namespace

Csr simple_undirected(int64_t n, const std::vector<std::pair<int32_t, int32_t>>& pairs) {
  // Counting sort by row (both directions of every pair), then each row
  // sorted and deduplicated in place; rows are independent, so threads
  // share them out (the result does not depend on the thread count).
  std::vector<int64_t> start(static_cast<size_t>(n) + 1, 0);
  for (auto [u, v] : pairs) {
    if (u == v) continue;
    if (u < 0 || u >= n || v < 0 || v >= n) {
      throw ShapeError(
          fmt::format("simple_undirected: edge ({}, {}) outside [0, {}) (vertex count)", u, v, n));
    }
    ++start[static_cast<size_t>(u) + 1];
    ++start[static_cast<size_t>(v) + 1];
  }
  for (size_t i = 1; i < start.size(); ++i) start[i] += start[i - 1];
  if (start.back() > std::numeric_limits<int32_t>::max()) {
    throw ShapeError(
        fmt::format("simple_undirected: {} entries exceed the i32 index range of the graph format",
                    start.back()));
  }
  std::vector<int32_t> cols(static_cast<size_t>(start.back()));
  {
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (auto [u, v] : pairs) {
      if (u == v) continue;
      cols[static_cast<size_t>(next[static_cast<size_t>(u)]++)] = v;
      cols[static_cast<size_t>(next[static_cast<size_t>(v)]++)] = u;
    }
  }
  std::vector<int64_t> kept(static_cast<size_t>(n), 0);
#pragma omp parallel for schedule(dynamic, 4096)
  for (int64_t i = 0; i < n; ++i) {
    auto b = cols.begin() + start[static_cast<size_t>(i)];
    auto e = cols.begin() + start[static_cast<size_t>(i) + 1];
    std::sort(b, e);
    kept[static_cast<size_t>(i)] = std::unique(b, e) - b;
  }
  Csr out;
  out.rows = out.cols = n;
  out.row_ptr.assign(static_cast<size_t>(n) + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    out.row_ptr[static_cast<size_t>(i) + 1] =
        out.row_ptr[static_cast<size_t>(i)] + static_cast<int32_t>(kept[static_cast<size_t>(i)]);
  }
  out.col_idx.resize(static_cast<size_t>(out.row_ptr.back()));
#pragma omp parallel for schedule(dynamic, 4096)
  for (int64_t i = 0; i < n; ++i) {
    std::copy_n(cols.begin() + start[static_cast<size_t>(i)], kept[static_cast<size_t>(i)],
                out.col_idx.begin() + out.row_ptr[static_cast<size_t>(i)]);
  }
  return out;
}

GraphData make_csbm(const CsbmOptions& o) {
  const char* G = "csbm";
  check(o.vertices >= 2 && o.vertices <= (int64_t{1} << 30), G, "vertices",
        static_cast<double>(o.vertices), "in [2, 2^30]");
  check(o.classes >= 1 && o.classes <= o.vertices, G, "classes", static_cast<double>(o.classes),
        "in [1, vertices]");
  check(o.avg_degree >= 0 && o.avg_degree < static_cast<double>(o.vertices), G, "avg_degree",
        o.avg_degree, "in [0, vertices)");
  check(o.homophily >= 0 && o.homophily <= 1, G, "homophily", o.homophily, "in [0, 1]");
  check(o.features >= 1, G, "features", static_cast<double>(o.features), ">= 1");
  check(o.feature_signal >= 0, G, "feature_signal", o.feature_signal, ">= 0");
  check_split(G, o.train_fraction, o.val_fraction);
  Rng rng(o.seed);
  const int64_t n = o.vertices, k = o.classes;
  GraphData g;
  g.name = fmt::format("csbm(n={}, classes={}, degree={:g}, homophily={:g}, signal={:g}, seed={})",
                       n, k, o.avg_degree, o.homophily, o.feature_signal, o.seed);
  g.classes = k;
  g.labels.resize(static_cast<size_t>(n));
  std::vector<std::vector<int32_t>> by_class(static_cast<size_t>(k));
  for (int64_t i = 0; i < n; ++i) {
    g.labels[static_cast<size_t>(i)] = static_cast<int32_t>(i % k);
    by_class[static_cast<size_t>(i % k)].push_back(static_cast<int32_t>(i));
  }
  // Each vertex starts avg_degree / 2 edges (both ends count towards degree).
  std::vector<std::pair<int32_t, int32_t>> pairs;
  const auto per_vertex = o.avg_degree / 2;
  for (int64_t u = 0; u < n; ++u) {
    int64_t m = static_cast<int64_t>(per_vertex);
    if (rng.uniform() < per_vertex - static_cast<double>(m)) ++m;
    const int32_t cu = g.labels[static_cast<size_t>(u)];
    for (int64_t t = 0; t < m; ++t) {
      int32_t v;
      if (k == 1 || rng.uniform() < o.homophily) {
        const auto& same = by_class[static_cast<size_t>(cu)];
        v = same[rng.next() % same.size()];
      } else {
        int32_t cv = static_cast<int32_t>(rng.next() % static_cast<uint64_t>(k - 1));
        if (cv >= cu) ++cv;
        const auto& other = by_class[static_cast<size_t>(cv)];
        v = other[rng.next() % other.size()];
      }
      pairs.emplace_back(static_cast<int32_t>(u), v);
    }
  }
  g.adj = simple_undirected(n, pairs);
  // Class means: random directions scaled to feature_signal.
  const int64_t f = o.features;
  std::vector<double> means(static_cast<size_t>(k * f));
  for (int64_t c = 0; c < k; ++c) {
    double norm = 0;
    for (int64_t j = 0; j < f; ++j) {
      const double z = rng.normal();
      means[static_cast<size_t>(c * f + j)] = z;
      norm += z * z;
    }
    norm = std::sqrt(std::max(norm, 1e-12));
    for (int64_t j = 0; j < f; ++j)
      means[static_cast<size_t>(c * f + j)] *= o.feature_signal / norm;
  }
  g.features = Tensor::empty(Shape{n, f}, DType::f32);
  float* px = g.features.data<float>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t c = g.labels[static_cast<size_t>(i)];
    for (int64_t j = 0; j < f; ++j) {
      px[i * f + j] = static_cast<float>(means[static_cast<size_t>(c * f + j)] + rng.normal());
    }
  }
  split(g, o.train_fraction, o.val_fraction, rng);
  return g;
}

GraphData make_rmat(const RmatOptions& o) {
  const char* G = "rmat";
  check(o.scale >= 1 && o.scale <= 30, G, "scale", static_cast<double>(o.scale), "in [1, 30]");
  check(o.edge_factor >= 1, G, "edge_factor", static_cast<double>(o.edge_factor), ">= 1");
  check(o.a > 0 && o.b >= 0 && o.c >= 0 && o.a + o.b + o.c < 1, G, "a + b + c", o.a + o.b + o.c,
        "below 1 with a > 0 and b, c >= 0 (d = 1 - a - b - c)");
  check(o.features >= 1, G, "features", static_cast<double>(o.features), ">= 1");
  check(o.classes >= 1, G, "classes", static_cast<double>(o.classes), ">= 1");
  check_split(G, o.train_fraction, o.val_fraction);
  const int64_t n = int64_t{1} << o.scale;
  const int64_t m = o.edge_factor * n;
  // Edges are drawn in fixed chunks, each from its own stream seeded by
  // (seed, chunk), so threads can share the chunks out and the graph
  // depends on the seed alone, not on the thread count.
  constexpr int64_t kChunk = int64_t{1} << 16;
  std::vector<std::pair<int32_t, int32_t>> pairs(static_cast<size_t>(m));
  const double ab = o.a + o.b, abc = o.a + o.b + o.c;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t chunk = 0; chunk < (m + kChunk - 1) / kChunk; ++chunk) {
    Rng rng(chunk_seed(o.seed, "rmat.edges", chunk));
    for (int64_t e = chunk * kChunk; e < std::min(m, (chunk + 1) * kChunk); ++e) {
      int64_t u = 0, v = 0;
      for (int64_t bit = o.scale - 1; bit >= 0; --bit) {
        const double r = rng.uniform();
        if (r < o.a) {
        } else if (r < ab) {
          v |= int64_t{1} << bit;
        } else if (r < abc) {
          u |= int64_t{1} << bit;
        } else {
          u |= int64_t{1} << bit;
          v |= int64_t{1} << bit;
        }
      }
      pairs[static_cast<size_t>(e)] = {static_cast<int32_t>(u), static_cast<int32_t>(v)};
    }
  }
  GraphData g;
  g.name = fmt::format("rmat(scale={}, edge_factor={}, a={:g}, b={:g}, c={:g}, seed={})", o.scale,
                       o.edge_factor, o.a, o.b, o.c, o.seed);
  g.adj = simple_undirected(n, pairs);
  pairs = {};
  g.classes = o.classes;
  // Labels: degree buckets of equal width on a log scale.
  g.labels.resize(static_cast<size_t>(n));
  int64_t max_deg = 1;
  for (int64_t i = 0; i < n; ++i) {
    max_deg = std::max<int64_t>(
        max_deg, g.adj.row_ptr[static_cast<size_t>(i) + 1] - g.adj.row_ptr[static_cast<size_t>(i)]);
  }
  for (int64_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(g.adj.row_ptr[static_cast<size_t>(i) + 1] -
                                         g.adj.row_ptr[static_cast<size_t>(i)]);
    const double q = std::log1p(d) / std::log1p(static_cast<double>(max_deg));
    g.labels[static_cast<size_t>(i)] = static_cast<int32_t>(
        std::min<int64_t>(o.classes - 1, static_cast<int64_t>(q * static_cast<double>(o.classes))));
  }
  g.features = Tensor::empty(Shape{n, o.features}, DType::f32);
  float* px = g.features.data<float>();
  const int64_t f = o.features;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t chunk = 0; chunk < (n + kChunk - 1) / kChunk; ++chunk) {
    Rng rng(chunk_seed(o.seed, "rmat.features", chunk));
    for (int64_t i = chunk * kChunk * f; i < std::min(n, (chunk + 1) * kChunk) * f; ++i) {
      px[i] = static_cast<float>(rng.normal());
    }
  }
  Rng rng(Rng::derive(o.seed, "rmat.split"));
  split(g, o.train_fraction, o.val_fraction, rng);
  return g;
}

void random_split(GraphData& g, double train_fraction, double val_fraction, uint64_t seed,
                  const char* what) {
  check_split(what, train_fraction, val_fraction);
  Rng rng(Rng::derive(seed, std::string(what) + ".split"));
  split(g, train_fraction, val_fraction, rng);
}

}  // namespace mt
