// The reference backend's last-axis kernels (softmax, log_softmax,
// layer_norm, cross_entropy) and embeddings against closed-form values.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "meshtrain/tensor/kernels.h"
#include "reference_test_util.h"

namespace mt {
namespace {

using testing::kRefFloatTypes;
using testing::make;
using testing::near;
using testing::shape_error_of;
using testing::tol;

KernelBackend& ref() {
  return kernels("reference");
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// ---- softmax family ----

TEST(ReferenceSoftmax, RowsSumToOneAndAreShiftInvariant) {
  for (DType t : kRefFloatTypes) {
    SCOPED_TRACE(dtype_name(t));
    const double e = std::exp(1.0), z = 1 + e + e * e;
    // Row 1 is row 0 shifted by 1000: the max is subtracted, so no overflow.
    Tensor x = make({2, 3}, t, {0, 1, 2, 1000, 1001, 1002}), y = Tensor::empty({2, 3}, t);
    ref().softmax(x, y, false);
    EXPECT_TRUE(near(y, {1 / z, e / z, e * e / z, 1 / z, e / z, e * e / z}, tol(t)));
    Tensor u = Tensor::zeros({1, 4}, t);
    ref().softmax(u, u, false);  // in place
    EXPECT_TRUE(near(u, {0.25, 0.25, 0.25, 0.25}, tol(t)));
    Tensor one = make({3, 1}, t, {-5, 0, 7}), ones = Tensor::empty({3, 1}, t);
    ref().softmax(one, ones, false);
    EXPECT_TRUE(near(ones, {1, 1, 1}, 0));
    Tensor empty = Tensor::empty({0, 3}, t);
    ref().softmax(empty, empty, false);
  }
}

TEST(ReferenceSoftmax, CausalMaskZeroesTheFuture) {
  for (DType t : kRefFloatTypes) {
    SCOPED_TRACE(dtype_name(t));
    // Square T = S = 3, batch of 2 heads: row t sees columns 0..t.
    Tensor x = Tensor::zeros({2, 3, 3}, t), y = Tensor::empty({2, 3, 3}, t);
    x.set_item(1, 1e9);  // a huge masked entry must not matter
    ref().softmax(x, y, true);
    const double h = 0.5, th = 1.0 / 3;
    const std::vector<double> tri = {1, 0, 0, h, h, 0, th, th, th};
    std::vector<double> want = tri;
    want.insert(want.end(), tri.begin(), tri.end());
    EXPECT_TRUE(near(y, want, tol(t)));
    // T = 2 queries over S = 3 keys (one cached key): row t sees 0..t+1.
    Tensor x2 = Tensor::zeros({2, 3}, t), y2 = Tensor::empty({2, 3}, t);
    ref().softmax(x2, y2, true);
    EXPECT_TRUE(near(y2, {h, h, 0, th, th, th}, tol(t)));
  }
  Tensor x = Tensor::zeros({3, 2}, DType::f32);
  const std::string msg = shape_error_of([&] { ref().softmax(x, x, true); });
  EXPECT_TRUE(
      contains(msg, "softmax: causal mask needs x [..., T, S] with S >= T, got x f32[3, 2]"))
      << msg;
  Tensor v = Tensor::zeros({3}, DType::f32);
  EXPECT_THROW(ref().softmax(v, v, true), ShapeError);
}

TEST(ReferenceSoftmax, BackwardHandCase) {
  for (DType t : kRefFloatTypes) {
    // y = [1/2, 1/2, 0] (a masked entry), dy = [1, 0, 5]:
    // sum(dy * y) = 1/2, dx = y * (dy - 1/2) = [1/4, -1/4, 0].
    Tensor y = make({1, 3}, t, {0.5, 0.5, 0}), dy = make({1, 3}, t, {1, 0, 5});
    Tensor dx = Tensor::empty({1, 3}, t);
    ref().softmax_backward(y, dy, dx);
    EXPECT_TRUE(near(dx, {0.25, -0.25, 0}, tol(t)));
    ref().softmax_backward(y, dy, dy);  // dx may alias dy
    EXPECT_TRUE(near(dy, {0.25, -0.25, 0}, tol(t)));
  }
}

TEST(ReferenceLogSoftmax, ValuesAndBackward) {
  for (DType t : kRefFloatTypes) {
    SCOPED_TRACE(dtype_name(t));
    Tensor x = make({2, 4}, t, {0, 0, 0, 0, 0, 0, 0, 700}), y = Tensor::empty({2, 4}, t);
    ref().log_softmax(x, y);
    const double l4 = std::log(4.0), big = std::log1p(3 * std::exp(-700.0));
    EXPECT_TRUE(near(y, {-l4, -l4, -l4, -l4, -700, -700, -700, -big}, tol(t) * 700));
    // y = log(1/4) everywhere, dy = [1, 0, 0, 0]: dx = dy - exp(y) sum(dy).
    Tensor yu = Tensor::full({1, 4}, t, -l4), dy = make({1, 4}, t, {1, 0, 0, 0});
    Tensor dx = Tensor::empty({1, 4}, t);
    ref().log_softmax_backward(yu, dy, dx);
    EXPECT_TRUE(near(dx, {0.75, -0.25, -0.25, -0.25}, tol(t)));
  }
}

// ---- layer norm ----

TEST(ReferenceLayerNorm, NormalisesToZeroMeanUnitVariance) {
  for (DType t : kRefFloatTypes) {
    SCOPED_TRACE(dtype_name(t));
    const int64_t rows = 3, c = 5;
    Tensor x = Tensor::empty({rows, c}, t);
    for (int64_t i = 0; i < x.numel(); ++i) x.set_item(i, std::sin(1.7 * i) * (1 + i) + 3);
    Tensor g = Tensor::full({c}, t, 1.0), b = Tensor::zeros({c}, t);
    Tensor y = Tensor::empty({rows, c}, t), mean = Tensor::empty({rows}, t);
    Tensor rstd = Tensor::empty({rows}, t);
    ref().layer_norm(x, g, b, 0.0, y, mean, rstd);
    for (int64_t r = 0; r < rows; ++r) {
      double m = 0, v = 0, xm = 0;
      for (int64_t j = 0; j < c; ++j) m += y.item(r * c + j), xm += x.item(r * c + j);
      for (int64_t j = 0; j < c; ++j) v += y.item(r * c + j) * y.item(r * c + j);
      EXPECT_NEAR(m / c, 0.0, 10 * tol(t));
      EXPECT_NEAR(v / c, 1.0, 10 * tol(t));
      EXPECT_NEAR(mean.item(r), xm / c, 10 * tol(t) * std::abs(xm / c));
    }
  }
}

TEST(ReferenceLayerNorm, ForwardAndBackwardHandCase) {
  for (DType t : kRefFloatTypes) {
    SCOPED_TRACE(dtype_name(t));
    // Rows [0,1,2] and [5,6,7]: mean 1 and 6, variance 2/3; eps = 1/3 makes
    // rstd exactly 1 and xhat = [-1, 0, 1]. mean/rstd may take the leading
    // dims' shape ([1, 2] here).
    Tensor x = make({1, 2, 3}, t, {0, 1, 2, 5, 6, 7});
    Tensor g = make({3}, t, {1, 2, 3}), b = make({3}, t, {0.5, 0, -1});
    Tensor y = Tensor::empty({1, 2, 3}, t), mean = Tensor::empty({1, 2}, t);
    Tensor rstd = Tensor::empty({1, 2}, t);
    ref().layer_norm(x, g, b, 1.0 / 3.0, y, mean, rstd);
    EXPECT_TRUE(near(y, {-0.5, 0, 2, -0.5, 0, 2}, tol(t)));
    EXPECT_TRUE(near(mean, {1, 6}, tol(t) * 6));
    EXPECT_TRUE(near(rstd, {1, 1}, tol(t)));
    // With g = dy * gamma: dx = rstd (g - mean(g) - xhat mean(g xhat)).
    // Row 0: dy = [1,1,1], g = [1,2,3], mean(g) = 2, mean(g xhat) = 2/3
    //        -> dx = [-1/3, 0, 1/3].
    // Row 1: dy = [2,0,0], g = [2,0,0], mean(g) = 2/3, mean(g xhat) = -2/3
    //        -> dx = [2/3, -2/3, 0].
    // dgamma = sum dy xhat = [-1-2, 0, 1], dbeta = sum dy = [3, 1, 1].
    Tensor dy = make({1, 2, 3}, t, {1, 1, 1, 2, 0, 0});
    Tensor dx = Tensor::empty({1, 2, 3}, t), dg = Tensor::full({3}, t, 9.0);
    Tensor db = Tensor::full({3}, t, 9.0);
    ref().layer_norm_backward(dy, x, g, mean, rstd, dx, dg, db);
    EXPECT_TRUE(near(dx, {-1.0 / 3, 0, 1.0 / 3, 2.0 / 3, -2.0 / 3, 0}, 4 * tol(t)));
    EXPECT_TRUE(near(dg, {-3, 0, 1}, 4 * tol(t)));
    EXPECT_TRUE(near(db, {3, 1, 1}, 0));
  }
}

TEST(ReferenceLayerNorm, EdgeShapesAndErrors) {
  for (DType t : kRefFloatTypes) {
    // C = 1: every element equals its mean, so y = beta.
    Tensor x = make({2, 1}, t, {3, -4}), g = make({1}, t, {2}), b = make({1}, t, {0.25});
    Tensor y = Tensor::empty({2, 1}, t), m = Tensor::empty({2}, t), r = Tensor::empty({2}, t);
    ref().layer_norm(x, g, b, 1e-5, y, m, r);
    EXPECT_TRUE(near(y, {0.25, 0.25}, 0));
    // Empty batch.
    Tensor e = Tensor::empty({0, 4}, t), g4 = Tensor::full({4}, t, 1.0);
    Tensor b4 = Tensor::zeros({4}, t), m0 = Tensor::empty({0}, t), r0 = Tensor::empty({0}, t);
    ref().layer_norm(e, g4, b4, 1e-5, e, m0, r0);
    Tensor dg = Tensor::full({4}, t, 1.0), db = Tensor::full({4}, t, 1.0);
    ref().layer_norm_backward(e, e, g4, m0, r0, e, dg, db);
    EXPECT_TRUE(near(dg, {0, 0, 0, 0}, 0));
  }
  Tensor x = Tensor::zeros({2, 4}, DType::f32), y = Tensor::zeros({2, 4}, DType::f32);
  Tensor g = Tensor::zeros({3}, DType::f32), m = Tensor::zeros({2}, DType::f32);
  std::string msg = shape_error_of([&] { ref().layer_norm(x, g, g, 1e-5, y, m, m); });
  EXPECT_TRUE(contains(msg, "layer_norm: gamma is f32[3], expected shape [4]")) << msg;
  Tensor g4 = Tensor::zeros({4}, DType::f32), m3 = Tensor::zeros({3}, DType::f32);
  msg = shape_error_of([&] { ref().layer_norm(x, g4, g4, 1e-5, y, m3, m3); });
  EXPECT_TRUE(contains(msg, "layer_norm: mean is f32[3], expected shape [2] for x f32[2, 4]"))
      << msg;
}

// ---- cross entropy ----

TEST(ReferenceCrossEntropy, UniformLogitsGiveLogC) {
  for (DType t : kRefFloatTypes) {
    for (int64_t c : {1, 2, 10}) {
      Tensor logits = Tensor::full({3, c}, t, 0.7), loss = Tensor::empty({}, t);
      Tensor labels = make({3}, DType::i32, {0, static_cast<double>(c - 1), 0});
      ref().cross_entropy(logits, labels, loss);
      EXPECT_NEAR(loss.item(), std::log(static_cast<double>(c)), tol(t)) << c;
    }
  }
}

TEST(ReferenceCrossEntropy, HandCaseAndBackward) {
  for (DType t : kRefFloatTypes) {
    SCOPED_TRACE(dtype_name(t));
    // Row 0: softmax [1/4, 3/4], label 1 -> log(4/3). Row 1: softmax of
    // [0, 0, 0, 0] label 3 -> log 4 (padded to C = 4 below).
    const double l3 = std::log(3.0);
    Tensor logits = make({2, 4}, t, {0, l3, -1e30, -1e30, 0, 0, 0, 0});
    Tensor labels = make({2}, DType::i32, {1, 3});
    Tensor loss = Tensor::empty({1}, t);
    ref().cross_entropy(logits, labels, loss);
    EXPECT_NEAR(loss.item(), (std::log(4.0 / 3) + std::log(4.0)) / 2, tol(t));
    // dlogits = dloss (softmax - onehot) / N with dloss = 2, N = 2.
    Tensor dloss = make({}, t, {2}), dlogits = Tensor::empty({2, 4}, t);
    ref().cross_entropy_backward(logits, labels, dloss, dlogits);
    EXPECT_TRUE(near(dlogits, {0.25, -0.25, 0, 0, 0.25, 0.25, 0.25, -0.75}, tol(t)));
  }
  // Loss and dloss may be f64 for f32 logits (and vice versa).
  Tensor logits = Tensor::zeros({2, 2}, DType::f32), loss = Tensor::empty({}, DType::f64);
  ref().cross_entropy(logits, make({2}, DType::i32, {0, 1}), loss);
  EXPECT_DOUBLE_EQ(loss.item(), std::log(2.0));
}

TEST(ReferenceCrossEntropy, EmptyBatchAndBadLabels) {
  Tensor logits = Tensor::empty({0, 3}, DType::f64), labels = Tensor::empty({0}, DType::i32);
  Tensor loss = Tensor::full({}, DType::f64, 5.0), dlogits = Tensor::empty({0, 3}, DType::f64);
  ref().cross_entropy(logits, labels, loss);
  EXPECT_EQ(loss.item(), 0.0);
  ref().cross_entropy_backward(logits, labels, make({}, DType::f64, {1}), dlogits);

  Tensor l = Tensor::zeros({3, 5}, DType::f32), s = Tensor::empty({}, DType::f32);
  std::string msg = shape_error_of([&] {
    ref().cross_entropy(l, make({3}, DType::i32, {0, 7, 1}), s);
  });
  EXPECT_TRUE(contains(msg, "cross_entropy: label 7 at row 1 is out of range [0, 5)")) << msg;
  msg = shape_error_of([&] { ref().cross_entropy(l, make({3}, DType::i32, {0, 1, -1}), s); });
  EXPECT_TRUE(contains(msg, "label -1 at row 2")) << msg;
  Tensor d = Tensor::empty({3, 5}, DType::f32);
  msg = shape_error_of([&] {
    ref().cross_entropy_backward(l, make({3}, DType::i32, {5, 0, 0}), make({}, DType::f32, {1}), d);
  });
  EXPECT_TRUE(contains(msg, "cross_entropy_backward: label 5 at row 0")) << msg;
  msg = shape_error_of([&] { ref().cross_entropy(l, make({2}, DType::i32, {0, 1}), s); });
  EXPECT_TRUE(contains(msg, "cross_entropy: labels is i32[2], expected shape [3]")) << msg;
  msg = shape_error_of([&] { ref().cross_entropy(l, Tensor::zeros({3}, DType::f32), s); });
  EXPECT_TRUE(contains(msg, "cross_entropy: labels f32[3] must be i32")) << msg;
}

// ---- embeddings ----

TEST(ReferenceEmbedding, GathersRows) {
  for (DType t : kRefFloatTypes) {
    Tensor table = make({4, 2}, t, {0, 1, 10, 11, 20, 21, 30, 31});
    Tensor ids = make({2, 2}, DType::i32, {3, 0, 3, 1}), y = Tensor::empty({2, 2, 2}, t);
    ref().embedding(table, ids, y);
    EXPECT_TRUE(near(y, {30, 31, 0, 1, 30, 31, 10, 11}, 0));
    Tensor id0 = make({}, DType::i32, {2}), y0 = Tensor::empty({2}, t);  // rank-0 ids
    ref().embedding(table, id0, y0);
    EXPECT_TRUE(near(y0, {20, 21}, 0));
  }
  Tensor table = Tensor::zeros({4, 2}, DType::f32), y = Tensor::empty({2, 2}, DType::f32);
  const std::string msg = shape_error_of([&] {
    ref().embedding(table, make({2}, DType::i32, {1, 4}), y);
  });
  EXPECT_TRUE(contains(msg,
                       "embedding: id 4 at flat position 1 of ids i32[2] is out of range [0, "
                       "4) for table f32[4, 2]"))
      << msg;
  EXPECT_THROW(ref().embedding(table, make({2}, DType::i32, {-1, 0}), y), ShapeError);
}

TEST(ReferenceEmbedding, BackwardAccumulatesRepeatedIds) {
  for (DType t : kRefFloatTypes) {
    // ids [1, 1, 2]: row 1 gets dy rows 0 and 1, row 2 gets dy row 2, rows 0
    // and 3 are zeroed (dtable starts out full of garbage).
    Tensor dy = make({3, 2}, t, {1, 2, 3, 4, 5, 6}), ids = make({3}, DType::i32, {1, 1, 2});
    Tensor dtable = Tensor::full({4, 2}, t, 99.0);
    ref().embedding_backward(dy, ids, dtable);
    EXPECT_TRUE(near(dtable, {0, 0, 4, 6, 5, 6, 0, 0}, 0));
  }
  Tensor dtable = Tensor::zeros({4, 2}, DType::f64);
  const std::string msg = shape_error_of([&] {
    ref().embedding_backward(Tensor::zeros({3, 3}, DType::f64), make({3}, DType::i32, {0, 1, 2}),
                             dtable);
  });
  EXPECT_TRUE(contains(msg, "embedding_backward: dy is f64[3, 3], expected shape [3, 2]")) << msg;
}

}  // namespace
}  // namespace mt
