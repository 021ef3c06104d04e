// The graph generators (CSBM, R-MAT), the CSR helpers GNNs derive edge
// values from, and GraphData's validation.
#include <gtest/gtest.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "meshtrain/base/error.h"
#include "meshtrain/base/random.h"
#include "meshtrain/data/graph_data.h"
#include "meshtrain/data/knn_graph.h"

namespace mt {
namespace {

// (i, j) present <=> (j, i) present; no self-loops; rows sorted without duplicates.
void expect_simple_undirected(const Csr& a) {
  std::set<std::pair<int32_t, int32_t>> edges;
  for (int64_t i = 0; i < a.rows; ++i) {
    for (int32_t e = a.row_ptr[i]; e < a.row_ptr[i + 1]; ++e) {
      EXPECT_NE(a.col_idx[e], i) << "self-loop at " << i;
      if (e > a.row_ptr[i]) {
        EXPECT_LT(a.col_idx[e - 1], a.col_idx[e]) << "row " << i;
      }
      edges.emplace(static_cast<int32_t>(i), a.col_idx[e]);
    }
  }
  for (auto [i, j] : edges) EXPECT_TRUE(edges.count({j, i})) << i << " -> " << j << " only";
}

TEST(Csbm, IsSeededSimpleUndirectedAndHasTheAskedDegreeAndHomophily) {
  CsbmOptions o;
  o.vertices = 4000;
  o.classes = 5;
  o.avg_degree = 12;
  o.homophily = 0.7;
  const GraphData g = make_csbm(o);
  g.validate("csbm");
  expect_simple_undirected(g.adj);
  const double degree = static_cast<double>(g.adj.nnz()) / static_cast<double>(o.vertices);
  EXPECT_NEAR(degree, 12, 0.6);  // duplicates removed: slightly below
  int64_t same = 0;
  for (int64_t i = 0; i < g.adj.rows; ++i) {
    for (int32_t e = g.adj.row_ptr[i]; e < g.adj.row_ptr[i + 1]; ++e) {
      same += g.labels[i] == g.labels[g.adj.col_idx[e]] ? 1 : 0;
    }
  }
  EXPECT_NEAR(static_cast<double>(same) / static_cast<double>(g.adj.nnz()), 0.7, 0.03);
  // The split partitions the vertices in the asked proportions.
  for (int64_t i = 0; i < o.vertices; ++i) {
    EXPECT_EQ(g.train_mask[i] + g.val_mask[i] + g.test_mask[i], 1) << "vertex " << i;
  }
  EXPECT_EQ(GraphData::members(g.train_mask).size(), 400u);
  EXPECT_EQ(GraphData::members(g.val_mask).size(), 400u);
  // Same seed, same graph; another seed, another one.
  const GraphData again = make_csbm(o);
  EXPECT_EQ(again.adj.col_idx, g.adj.col_idx);
  EXPECT_EQ(again.features.item(123), g.features.item(123));
  o.seed = 2;
  EXPECT_NE(make_csbm(o).adj.col_idx, g.adj.col_idx);
}

TEST(Csbm, FeaturesCarryTheClass) {
  // With a strong signal, the class means of the features are far apart
  // compared with the noise of a mean over ~1000 vertices.
  CsbmOptions o;
  o.classes = 2;
  o.feature_signal = 3.0;
  const GraphData g = make_csbm(o);
  const int64_t f = g.feature_dim();
  std::vector<double> mean(2 * f, 0.0);
  std::vector<int64_t> count(2, 0);
  for (int64_t i = 0; i < g.num_vertices(); ++i) {
    ++count[g.labels[i]];
    for (int64_t j = 0; j < f; ++j) mean[g.labels[i] * f + j] += g.features.item(i * f + j);
  }
  double dist = 0;
  for (int64_t j = 0; j < f; ++j) {
    const double d = mean[j] / count[0] - mean[f + j] / count[1];
    dist += d * d;
  }
  EXPECT_GT(std::sqrt(dist), 2.0);  // about |mu_0 - mu_1| ~ 3 sqrt(2)
}

TEST(Rmat, HasSkewedDegreesAndIsSimpleUndirected) {
  RmatOptions o;
  o.scale = 10;
  o.edge_factor = 8;
  const GraphData g = make_rmat(o);
  g.validate("rmat");
  EXPECT_EQ(g.num_vertices(), 1024);
  expect_simple_undirected(g.adj);
  int64_t max_deg = 0;
  for (int64_t i = 0; i < g.adj.rows; ++i) {
    max_deg = std::max<int64_t>(max_deg, g.adj.row_ptr[i + 1] - g.adj.row_ptr[i]);
  }
  const double mean_deg = static_cast<double>(g.adj.nnz()) / 1024.0;
  EXPECT_GT(static_cast<double>(max_deg), 8 * mean_deg) << "R-MAT should have hubs";
  EXPECT_EQ(make_rmat(o).adj.col_idx, g.adj.col_idx);
}

TEST(Rmat, QuadrantProbabilitiesShapeTheDegreesAndThreadsDoNotChangeTheGraph) {
  RmatOptions o;
  o.scale = 12;
  o.edge_factor = 8;
  auto max_degree = [](const Csr& a) {
    int64_t m = 0;
    for (int64_t i = 0; i < a.rows; ++i) m = std::max<int64_t>(m, a.row_ptr[i + 1] - a.row_ptr[i]);
    return m;
  };
  const GraphData skewed = make_rmat(o);
  o.a = o.b = o.c = 0.25;  // d = 0.25: every quadrant alike, an Erdos-Renyi-like graph
  const GraphData flat = make_rmat(o);
  expect_simple_undirected(flat.adj);
  EXPECT_GT(max_degree(skewed.adj), 5 * max_degree(flat.adj));
  // About edge_factor * 2^scale undirected edges survive (few duplicates when flat).
  EXPECT_GT(flat.adj.nnz(), 2 * 8 * 4096 * 95 / 100);
  // Chunks have their own streams: one thread or several give the same graph.
  const int before = omp_get_max_threads();
  omp_set_num_threads(1);
  const GraphData one = make_rmat(o);
  omp_set_num_threads(3);
  const GraphData three = make_rmat(o);
  omp_set_num_threads(before);
  EXPECT_EQ(one.adj.col_idx, three.adj.col_idx);
  EXPECT_EQ(one.adj.row_ptr, three.adj.row_ptr);
  EXPECT_EQ(one.features.item(4095 * 32 + 31), three.features.item(4095 * 32 + 31));
  EXPECT_EQ(one.train_mask, three.train_mask);
}

TEST(Knn, NearestNeighboursEqualAnExactF64SearchAndTheGraphIsSymmetric) {
  // Random points (no near-ties), several query and candidate blocks.
  const int64_t n = 5000, d = 12, k = 7;
  Tensor x = Tensor::empty(Shape{n, d}, DType::f32);
  Rng rng(3);
  for (int64_t i = 0; i < n * d; ++i) x.data<float>()[i] = static_cast<float>(rng.normal());
  const std::vector<int32_t> nn = nearest_neighbours(x, k, 2);
  ASSERT_EQ(nn.size(), static_cast<size_t>(n * k));
  const float* p = x.data<float>();
  auto dist = [&](int64_t i, int64_t j) {
    double s = 0;
    for (int64_t t = 0; t < d; ++t) {
      const double v = static_cast<double>(p[i * d + t]) - p[j * d + t];
      s += v * v;
    }
    return s;
  };
  for (int64_t i = 0; i < n; i += 97) {  // a sample of queries against every candidate
    std::vector<std::pair<double, int32_t>> all;
    for (int64_t j = 0; j < n; ++j) {
      if (j != i) all.emplace_back(dist(i, j), static_cast<int32_t>(j));
    }
    std::partial_sort(all.begin(), all.begin() + k, all.end());
    for (int64_t t = 0; t < k; ++t) {
      EXPECT_EQ(nn[static_cast<size_t>(i * k + t)], all[static_cast<size_t>(t)].second)
          << "query " << i << " rank " << t;
    }
  }
  const Csr g = knn_graph(x, k, 1);
  expect_simple_undirected(g);
  for (int64_t i = 0; i < n; ++i) EXPECT_GE(g.row_ptr[i + 1] - g.row_ptr[i], k) << "vertex " << i;
  EXPECT_THROW(nearest_neighbours(x, n, 1), ConfigError);
}

TEST(Knn, FashionMnistGraphHasTheDataSetsSplitAndLinksLikeImages) {
  FashionKnnOptions o;
  o.k = 8;
  o.limit_train = 1500;
  o.limit_test = 500;
  o.val_fraction = 0.2;
  const GraphData g = make_fashion_knn(o);
  g.validate("fashion_knn");
  EXPECT_EQ(g.num_vertices(), 2000);
  EXPECT_EQ(g.feature_dim(), 784);
  EXPECT_EQ(g.classes, 10);
  expect_simple_undirected(g.adj);
  EXPECT_EQ(GraphData::members(g.train_mask).size(), 1200u);
  EXPECT_EQ(GraphData::members(g.val_mask).size(), 300u);
  const std::vector<int32_t> test = GraphData::members(g.test_mask);
  ASSERT_EQ(test.size(), 500u);
  EXPECT_EQ(test.front(), 1500);  // test images come after the training images
  // Vertex 0 is the first training image (an ankle boot, class 9) and its
  // pixels are normalised as FashionMnist gives them.
  FashionMnistOptions fo;
  fo.limit = 1;
  fo.flatten = true;
  const FashionMnist first(fo);
  EXPECT_EQ(g.labels[0], first.labels()[0]);
  const Batch b = first.gather(std::vector<int64_t>{0});
  for (int64_t j = 0; j < 784; j += 41) EXPECT_FLOAT_EQ(g.features.item(j), b.x.item(j)) << j;
  // Neighbouring images mostly share their class (chance would be 0.1).
  int64_t same = 0;
  for (int64_t i = 0; i < g.adj.rows; ++i) {
    for (int32_t e = g.adj.row_ptr[i]; e < g.adj.row_ptr[i + 1]; ++e) {
      same += g.labels[i] == g.labels[g.adj.col_idx[e]] ? 1 : 0;
    }
  }
  EXPECT_GT(static_cast<double>(same) / static_cast<double>(g.adj.nnz()), 0.6);
}

TEST(Generators, RejectBadOptionsNamingThem) {
  CsbmOptions c;
  c.homophily = 1.5;
  EXPECT_THROW(make_csbm(c), ConfigError);
  try {
    CsbmOptions d;
    d.train_fraction = 0;
    make_csbm(d);
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("train_fraction"), std::string::npos) << e.what();
  }
  RmatOptions r;
  r.a = 0.9;
  EXPECT_THROW(make_rmat(r), ConfigError);
}

TEST(CsrHelpers, SelfLoopsGcnNormAndMeanValues) {
  // 0 - 1 - 2 path, undirected; vertex 3 isolated.
  Csr a = Csr::from_entries(4, 4, {0, 1, 1, 2}, {1, 0, 2, 1});
  a.validate("path");
  const Csr b = with_self_loops(a);
  EXPECT_EQ(b.row_ptr, (std::vector<int32_t>{0, 2, 5, 7, 8}));
  EXPECT_EQ(b.col_idx, (std::vector<int32_t>{0, 1, 0, 1, 2, 1, 2, 3}));
  // Degrees with self-loops: 2, 3, 2, 1.
  const std::vector<float> w = gcn_norm_values(b);
  const std::vector<double> want = {1.0 / 2,
                                    1 / std::sqrt(6.0),
                                    1 / std::sqrt(6.0),
                                    1.0 / 3,
                                    1 / std::sqrt(6.0),
                                    1 / std::sqrt(6.0),
                                    1.0 / 2,
                                    1.0};
  ASSERT_EQ(w.size(), want.size());
  for (size_t e = 0; e < w.size(); ++e) EXPECT_NEAR(w[e], want[e], 1e-7) << "entry " << e;
  const std::vector<float> m = mean_values(a);
  EXPECT_EQ(m, (std::vector<float>{1.0f, 0.5f, 0.5f, 1.0f}));
  EXPECT_EQ(entry_rows(b), (std::vector<int32_t>{0, 0, 1, 1, 1, 2, 2, 3}));
  // A self-loop already there is not added twice.
  EXPECT_EQ(with_self_loops(b).col_idx, b.col_idx);
}

TEST(GraphData, ValidateNamesTheField) {
  CsbmOptions o;
  o.vertices = 50;
  const GraphData good = make_csbm(o);
  auto expect_error = [](const GraphData& g, const std::string& needle) {
    try {
      g.validate("graph file 'x.safetensors'");
      ADD_FAILURE() << "no error, expected " << needle;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  GraphData g = good;
  g.adj.col_idx[3] = 50;
  expect_error(g,
               "graph file 'x.safetensors': field 'col_idx': entry 3 is vertex id 50, out of "
               "range [0, 50)");
  g = good;
  g.labels.pop_back();
  expect_error(g, "field 'labels': has 49 entries but the graph has 50 vertices");
  g = good;
  g.features = Tensor::zeros({49, 32}, DType::f32);
  expect_error(g, "field 'features': has 49 rows but the graph has 50 vertices");
  g = good;
  g.labels[7] = 9;
  expect_error(g, "field 'labels': vertex 7 has label 9");
  g = good;
  g.test_mask[1] = 2;
  expect_error(g, "field 'test_mask': entry 1 is 2");
}

}  // namespace
}  // namespace mt
