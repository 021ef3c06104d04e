#include "meshtrain/data/knn_graph.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include <fmt/format.h>

#include "meshtrain/base/error.h"
#include "meshtrain/base/random.h"
#include "meshtrain/tensor/kernels.h"

namespace mt {

namespace {

// Query and candidate block rows: a 1024 x 4096 f32 score tile is 16 MiB,
// large enough for the GEMM to run near its peak, small enough to stay cheap.
constexpr int64_t kQueryBlock = 1024;
constexpr int64_t kCandidateBlock = 4096;

}  // namespace

std::vector<int32_t> nearest_neighbours(const Tensor& points, int64_t k, int threads) {
  if (!points.defined() || points.dtype() != DType::f32 || points.rank() != 2) {
    throw ConfigError("nearest_neighbours: points must be an f32 matrix [n, d]");
  }
  const int64_t n = points.shape()[0], d = points.shape()[1];
  if (k < 1 || k >= n) {
    throw ConfigError(fmt::format("knn: k must be in [1, n - 1] = [1, {}], got {}", n - 1, k));
  }
  KernelBackend& kb = kernels("fast");
  kb.set_num_threads(std::max(threads, 1));
  const float* x = points.data<float>();
  std::vector<float> sq(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    double s = 0;
    for (int64_t j = 0; j < d; ++j) s += static_cast<double>(x[i * d + j]) * x[i * d + j];
    sq[static_cast<size_t>(i)] = static_cast<float>(s);
  }
  std::vector<int32_t> best_idx(static_cast<size_t>(n * k), -1);
  std::vector<float> best_score(static_cast<size_t>(n * k), std::numeric_limits<float>::infinity());
  Tensor tile = Tensor::empty(Shape{kQueryBlock, kCandidateBlock}, DType::f32);
  for (int64_t q0 = 0; q0 < n; q0 += kQueryBlock) {
    const int64_t qn = std::min(kQueryBlock, n - q0);
    Tensor q = Tensor::wrap(const_cast<float*>(x + q0 * d), Shape{qn, d}, DType::f32);
    for (int64_t c0 = 0; c0 < n; c0 += kCandidateBlock) {
      const int64_t cn = std::min(kCandidateBlock, n - c0);
      Tensor c = Tensor::wrap(const_cast<float*>(x + c0 * d), Shape{cn, d}, DType::f32);
      Tensor s = Tensor::wrap(tile.data<float>(), Shape{qn, cn}, DType::f32);
      MatmulParams p;
      p.trans_b = true;
      kb.matmul(q, c, s, p);
      const float* ps = s.data<float>();
#pragma omp parallel for schedule(static) num_threads(std::max(threads, 1))
      for (int64_t i = 0; i < qn; ++i) {
        const int64_t qi = q0 + i;
        float* bs = best_score.data() + qi * k;
        int32_t* bi = best_idx.data() + qi * k;
        const float* row = ps + i * cn;
        float worst = bs[k - 1];
        for (int64_t j = 0; j < cn; ++j) {
          const float score = sq[static_cast<size_t>(c0 + j)] - 2.0f * row[j];
          // Strict: candidates come in ascending index, so ties keep the lower one.
          if (!(score < worst) || c0 + j == qi) continue;
          int64_t pos = k - 1;
          while (pos > 0 && score < bs[pos - 1]) {
            bs[pos] = bs[pos - 1];
            bi[pos] = bi[pos - 1];
            --pos;
          }
          bs[pos] = score;
          bi[pos] = static_cast<int32_t>(c0 + j);
          worst = bs[k - 1];
        }
      }
    }
  }
  return best_idx;
}

Csr knn_graph(const Tensor& points, int64_t k, int threads) {
  const std::vector<int32_t> nn = nearest_neighbours(points, k, threads);
  const int64_t n = points.shape()[0];
  std::vector<std::pair<int32_t, int32_t>> pairs;
  pairs.reserve(nn.size());
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t t = 0; t < k; ++t) {
      pairs.emplace_back(static_cast<int32_t>(i), nn[static_cast<size_t>(i * k + t)]);
    }
  }
  return simple_undirected(n, pairs);
}

GraphData make_fashion_knn(const FashionKnnOptions& o) {
  if (o.val_fraction < 0 || o.val_fraction >= 1) {
    throw ConfigError(fmt::format("knn: val_fraction must be in [0, 1), got {:g}", o.val_fraction));
  }
  FashionMnistOptions fo;
  fo.dir = o.dir;
  fo.flatten = true;
  fo.normalize = o.normalize;
  fo.mean = o.mean;
  fo.std = o.std;
  fo.split = DataSplit::train;
  fo.limit = o.limit_train;
  const FashionMnist train(fo);
  fo.split = DataSplit::test;
  fo.limit = o.limit_test;
  const FashionMnist test(fo);
  const int64_t nt = train.size(), ns = test.size(), n = nt + ns;
  constexpr int64_t f = int64_t{kFashionMnistRows} * kFashionMnistCols;
  GraphData g;
  g.name = fmt::format("fashion_knn(k={}, images={}+{}{})", o.k, nt, ns,
                       o.normalize ? "" : ", unnormalised");
  g.classes = kFashionMnistClasses;
  g.features = Tensor::empty(Shape{n, f}, DType::f32);
  g.labels.resize(static_cast<size_t>(n));
  const float scale = 1.0f / 255.0f;
  float* px = g.features.data<float>();
  const FashionMnist* parts[2] = {&train, &test};
  int64_t v = 0;
  for (const FashionMnist* part : parts) {
    const std::vector<uint8_t>& pix = part->pixels();
    for (int64_t i = 0; i < part->size(); ++i, ++v) {
      for (int64_t j = 0; j < f; ++j) {
        const float p = static_cast<float>(pix[static_cast<size_t>(i * f + j)]) * scale;
        px[v * f + j] = o.normalize ? (p - o.mean) / o.std : p;
      }
      g.labels[static_cast<size_t>(v)] = part->labels()[static_cast<size_t>(i)];
    }
  }
  g.adj = knn_graph(g.features, o.k, o.threads);
  g.train_mask.assign(static_cast<size_t>(n), 0);
  g.val_mask.assign(static_cast<size_t>(n), 0);
  g.test_mask.assign(static_cast<size_t>(n), 0);
  // Validation: a seeded random val_fraction of the training images.
  std::vector<int32_t> perm(static_cast<size_t>(nt));
  for (int64_t i = 0; i < nt; ++i) perm[static_cast<size_t>(i)] = static_cast<int32_t>(i);
  Rng rng(Rng::derive(o.seed, "fashion_knn.val"));
  for (int64_t i = nt - 1; i > 0; --i) {
    std::swap(perm[static_cast<size_t>(i)], perm[rng.next() % static_cast<uint64_t>(i + 1)]);
  }
  const auto nv = static_cast<int64_t>(std::llround(o.val_fraction * static_cast<double>(nt)));
  for (int64_t i = 0; i < nt; ++i) {
    (i < nv ? g.val_mask : g.train_mask)[static_cast<size_t>(perm[static_cast<size_t>(i)])] = 1;
  }
  for (int64_t i = nt; i < n; ++i) g.test_mask[static_cast<size_t>(i)] = 1;
  return g;
}

}  // namespace mt
