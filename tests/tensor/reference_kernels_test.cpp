// The reference backend against closed-form values: matmul, element-wise and
// layout kernels, the softmax family, layer norm, cross entropy, embeddings,
// and the kernels() registry. Convolution and pooling: reference_conv_test.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <numbers>

#include "meshtrain/tensor/backends/reference/reference_backend.h"
#include "meshtrain/tensor/kernels.h"
#include "reference_test_util.h"

namespace mt {
namespace {

using testing::kRefFloatTypes;
using testing::make;
using testing::near;
using testing::shape_error_of;
using testing::tol;

const double kNaN = std::numeric_limits<double>::quiet_NaN();
const double kInf = std::numeric_limits<double>::infinity();

KernelBackend& ref() {
  return kernels("reference");
}

// ---- registry ----

TEST(KernelRegistry, ReturnsOneInstancePerName) {
  EXPECT_EQ(ref().name(), "reference");
  EXPECT_EQ(&kernels("reference"), &kernels("reference"));
  EXPECT_EQ(&kernels("fast"), &kernels("fast"));
  EXPECT_EQ(kernels("fast").name(), "fast");
  const auto names = kernel_backend_names();
  ASSERT_EQ(names.size(), 2u);
  EXPECT_EQ(names[0], "reference");
  EXPECT_EQ(names[1], "fast");
  EXPECT_THROW(ref().set_num_threads(0), ConfigError);
  ref().set_num_threads(4);
}

TEST(KernelRegistry, UnknownNameIsAConfigErrorListingTheValidNames) {
  try {
    kernels("cuda");
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'cuda'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("reference, fast"), std::string::npos) << msg;
  }
}

// ---- matmul ----

// a = [[1,2,3],[4,5,6]], b = [[7,8],[9,10],[11,12]], a @ b = [[58,64],[139,154]].
const std::vector<double> kA = {1, 2, 3, 4, 5, 6}, kAT = {1, 4, 2, 5, 3, 6};
const std::vector<double> kB = {7, 8, 9, 10, 11, 12}, kBT = {7, 9, 11, 8, 10, 12};
const std::vector<double> kAB = {58, 64, 139, 154};

TEST(ReferenceMatmul, AllTransposeCombinations) {
  for (DType t : kRefFloatTypes) {
    for (bool ta : {false, true}) {
      for (bool tb : {false, true}) {
        SCOPED_TRACE(::testing::Message() << dtype_name(t) << " ta=" << ta << " tb=" << tb);
        Tensor a = ta ? make({3, 2}, t, kAT) : make({2, 3}, t, kA);
        Tensor b = tb ? make({2, 3}, t, kBT) : make({3, 2}, t, kB);
        Tensor c = Tensor::empty({2, 2}, t);
        ref().matmul(a, b, c, {.trans_a = ta, .trans_b = tb});
        EXPECT_TRUE(near(c, kAB, 0));
      }
    }
  }
}

TEST(ReferenceMatmul, AlphaAndBetaAccumulateAndBetaZeroIgnoresC) {
  for (DType t : kRefFloatTypes) {
    Tensor a = make({2, 3}, t, kA), b = make({3, 2}, t, kB);
    Tensor c = Tensor::full({2, 2}, t, 1.0);
    ref().matmul(a, b, c, {.alpha = 2.0f, .beta = 0.5f});
    EXPECT_TRUE(near(c, {116.5, 128.5, 278.5, 308.5}, 0));
    c.fill(kNaN);  // beta == 0: c's old contents must not leak in
    ref().matmul(a, b, c, {.alpha = -1.0f});
    EXPECT_TRUE(near(c, {-58, -64, -139, -154}, 0));
  }
}

TEST(ReferenceMatmul, BatchedWithOwnAndSharedB) {
  for (DType t : kRefFloatTypes) {
    // Batch 1 of a is batch 0 times 2.
    Tensor a = make({2, 2, 3}, t, {1, 2, 3, 4, 5, 6, 2, 4, 6, 8, 10, 12});
    Tensor shared = make({3, 2}, t, kB);
    Tensor c = Tensor::empty({2, 2, 2}, t);
    ref().matmul(a, shared, c, {});
    EXPECT_TRUE(near(c, {58, 64, 139, 154, 116, 128, 278, 308}, 0));
    // Own b per batch entry: batch 1 is the identity-like [[1,0],[0,1],[0,0]].
    Tensor b = make({2, 3, 2}, t, {7, 8, 9, 10, 11, 12, 1, 0, 0, 1, 0, 0});
    ref().matmul(a, b, c, {});
    EXPECT_TRUE(near(c, {58, 64, 139, 154, 2, 4, 8, 10}, 0));
    // Shared b transposed, a transposed per batch entry.
    Tensor at = make({2, 3, 2}, t, {1, 4, 2, 5, 3, 6, 2, 8, 4, 10, 6, 12});
    ref().matmul(at, make({2, 3}, t, kBT), c, {.trans_a = true, .trans_b = true});
    EXPECT_TRUE(near(c, {58, 64, 139, 154, 116, 128, 278, 308}, 0));
  }
}

TEST(ReferenceMatmul, EdgeShapes) {
  for (DType t : kRefFloatTypes) {
    Tensor c11 = Tensor::empty({1, 1}, t);
    ref().matmul(make({1, 1}, t, {3}), make({1, 1}, t, {-4}), c11, {});
    EXPECT_EQ(c11.item(), -12.0);
    // K = 0: the product is an empty sum, so c = beta * c.
    Tensor c = Tensor::full({2, 3}, t, 4.0);
    ref().matmul(Tensor::empty({2, 0}, t), Tensor::empty({0, 3}, t), c, {.beta = 0.5f});
    EXPECT_TRUE(near(c, std::vector<double>(6, 2.0), 0));
    // Empty batch and M = 0 run and write nothing.
    Tensor e = Tensor::empty({0, 2, 2}, t);
    ref().matmul(Tensor::empty({0, 2, 3}, t), make({3, 2}, t, kB), e, {});
    Tensor m0 = Tensor::empty({0, 2}, t);
    ref().matmul(Tensor::empty({0, 3}, t), make({3, 2}, t, kB), m0, {});
    // Row vector times matrix (non-square, N > M).
    Tensor r = Tensor::empty({1, 2}, t);
    ref().matmul(make({1, 3}, t, {1, 0, -1}), make({3, 2}, t, kB), r, {});
    EXPECT_TRUE(near(r, {-4, -4}, 0));
  }
}

TEST(ReferenceMatmul, HalfPrecisionInputsGiveF32OrTheirOwnTypeOutput) {
  for (DType in : {DType::bf16, DType::f16}) {
    // Small integers are exact in bf16 and f16.
    Tensor a = make({2, 3}, DType::f32, kA).to(in), b = make({3, 2}, DType::f32, kB).to(in);
    Tensor c = Tensor::empty({2, 2}, DType::f32);
    ref().matmul(a, b, c, {});
    EXPECT_TRUE(near(c, kAB, 0)) << dtype_name(in);
    Tensor c16 = Tensor::empty({2, 2}, in);
    ref().matmul(a, b, c16, {});
    EXPECT_TRUE(near(c16.to(DType::f32), kAB, 0)) << dtype_name(in);
    // Any other output type is refused.
    Tensor c64 = Tensor::empty({2, 2}, DType::f64);
    const std::string msg = shape_error_of([&] { ref().matmul(a, b, c64, {}); });
    EXPECT_NE(msg.find("must be f32"), std::string::npos) << msg;
  }
}

TEST(ReferenceMatmul, MnistSizedProductIsExactAndQuick) {
  // 128x784 @ 784x512 with entries that are multiples of 1/8: every partial
  // sum is exact in double, and the result fits f32's mantissa.
  const int64_t m = 128, k = 784, n = 512;
  Tensor a = Tensor::empty({m, k}, DType::f32), b = Tensor::empty({k, n}, DType::f32);
  auto av = [](int64_t i, int64_t j) { return static_cast<double>((i * 7 + j * 3) % 11 - 5) / 8; };
  auto bv = [](int64_t i, int64_t j) { return static_cast<double>((i * 5 + j * 2) % 13 - 6) / 8; };
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < k; ++j) a.set_item(i * k + j, av(i, j));
  for (int64_t i = 0; i < k; ++i)
    for (int64_t j = 0; j < n; ++j) b.set_item(i * n + j, bv(i, j));
  Tensor c = Tensor::empty({m, n}, DType::f32);
  ref().matmul(a, b, c, {});
  for (auto [i, j] : {std::pair<int64_t, int64_t>{0, 0}, {127, 511}, {63, 200}, {5, 77}}) {
    double want = 0;
    for (int64_t q = 0; q < k; ++q) want += av(i, q) * bv(q, j);
    EXPECT_EQ(c.item(i * n + j), want) << i << "," << j;
  }
}

TEST(ReferenceMatmul, ShapeErrorsNameKernelAndShapes) {
  Tensor a = Tensor::zeros({4, 3}, DType::f32), b = Tensor::zeros({5, 2}, DType::f32);
  Tensor c = Tensor::zeros({4, 2}, DType::f32);
  std::string msg = shape_error_of([&] { ref().matmul(a, b, c, {}); });
  EXPECT_NE(msg.find("matmul: inner dimensions differ: a f32[4, 3] (trans_a=0) vs b f32[5, 2]"),
            std::string::npos)
      << msg;
  Tensor b2 = Tensor::zeros({3, 2}, DType::f32), wrong_c = Tensor::zeros({2, 4}, DType::f32);
  msg = shape_error_of([&] { ref().matmul(a, b2, wrong_c, {}); });
  EXPECT_NE(msg.find("matmul: c is f32[2, 4], expected shape [4, 2]"), std::string::npos) << msg;
  msg = shape_error_of([&] { ref().matmul(a, b2.to(DType::f64), c, {}); });
  EXPECT_NE(msg.find("matmul: dtypes differ: a f32[4, 3] vs b f64[3, 2]"), std::string::npos)
      << msg;
  Tensor a3 = Tensor::zeros({2, 4, 3}, DType::f32), b3 = Tensor::zeros({3, 3, 2}, DType::f32);
  Tensor c3 = Tensor::zeros({2, 4, 2}, DType::f32);
  msg = shape_error_of([&] { ref().matmul(a3, b3, c3, {}); });
  EXPECT_NE(msg.find("batch sizes differ: a f32[2, 4, 3] vs b f32[3, 3, 2]"), std::string::npos)
      << msg;
  EXPECT_THROW(ref().matmul(a, b3, c, {}), ShapeError);  // rank-2 a with rank-3 b
}

// ---- element-wise ----

TEST(ReferenceUnary, ClosedFormValues) {
  const std::vector<double> xs = {-2, -1, 0, 1, 2};
  for (DType t : kRefFloatTypes) {
    SCOPED_TRACE(dtype_name(t));
    Tensor x = make({5}, t, xs), y = Tensor::empty({5}, t);
    ref().unary(UnaryOp::relu, x, y);
    EXPECT_TRUE(near(y, {0, 0, 0, 1, 2}, 0));
    ref().unary(UnaryOp::tanh, x, y);
    EXPECT_TRUE(
        near(y, {std::tanh(-2.0), std::tanh(-1.0), 0, std::tanh(1.0), std::tanh(2.0)}, tol(t)));
    ref().unary(UnaryOp::sigmoid, x, y);
    const double e = std::numbers::e;
    EXPECT_TRUE(
        near(y, {1 / (1 + e * e), 1 / (1 + e), 0.5, e / (1 + e), e * e / (1 + e * e)}, tol(t)));
    // GPT-2's tanh-approximated GELU, the formula evaluated in double
    // elsewhere; gelu(-2) = gelu(2) - 2 since gelu(x) - gelu(-x) = x.
    ref().unary(UnaryOp::gelu, x, y);
    EXPECT_TRUE(near(
        y,
        {1.954597694087775 - 2.0, -0.15880800939172324, 0, 0.8411919906082768, 1.954597694087775},
        tol(t)));
  }
}

TEST(ReferenceUnary, InPlaceAndNaNPropagation) {
  for (DType t : kRefFloatTypes) {
    Tensor x = make({2, 2}, t, {-1, kNaN, 3, -0.5});
    ref().unary(UnaryOp::relu, x, x);
    EXPECT_TRUE(near(x, {0, kNaN, 3, 0}, 0));
    Tensor big = make({2}, t, {-1000, 1000});
    ref().unary(UnaryOp::sigmoid, big, big);
    EXPECT_TRUE(near(big, {0, 1}, 0));
  }
}

TEST(ReferenceUnary, BackwardIsDyTimesDerivative) {
  for (DType t : kRefFloatTypes) {
    SCOPED_TRACE(dtype_name(t));
    Tensor x = make({4}, t, {-1, 0, 1, 2}), dy = make({4}, t, {2, 2, 2, -1});
    Tensor y = Tensor::empty({4}, t), dx = Tensor::empty({4}, t);
    ref().unary(UnaryOp::relu, x, y);
    ref().unary_backward(UnaryOp::relu, x, y, dy, dx);
    EXPECT_TRUE(near(dx, {0, 0, 2, -1}, 0));  // relu'(0) = 0
    // tanh' = 1 - tanh^2, sigmoid' = s (1 - s); y may be left undefined.
    ref().unary_backward(UnaryOp::tanh, x, Tensor(), dy, dx);
    auto dtanh = [](double v) { return 1 - std::tanh(v) * std::tanh(v); };
    EXPECT_TRUE(near(dx, {2 * dtanh(-1), 2, 2 * dtanh(1), -dtanh(2)}, tol(t)));
    ref().unary_backward(UnaryOp::sigmoid, x, Tensor(), dy, dx);
    auto dsig = [](double v) {
      const double s = 1 / (1 + std::exp(-v));
      return s * (1 - s);
    };
    EXPECT_TRUE(near(dx, {2 * dsig(-1), 0.5, 2 * dsig(1), -dsig(2)}, tol(t)));
    // gelu'(0) = 1/2; gelu'(-x) = 1 - gelu'(x) because gelu(x) - gelu(-x) = x.
    // gelu'(1) and gelu'(2) from the derivative of the tanh formula.
    ref().unary_backward(UnaryOp::gelu, x, Tensor(), dy, dx);
    EXPECT_TRUE(
        near(dx, {2 * (1 - 1.0829640838457826), 1.0, 2 * 1.0829640838457826, -1.0860992566236183},
             tol(t)));
  }
}

TEST(ReferenceBinary, SameShapeSuffixAndScalar) {
  for (DType t : kRefFloatTypes) {
    SCOPED_TRACE(dtype_name(t));
    Tensor a = make({2, 3}, t, {1, 2, 3, 4, 5, 6}), c = Tensor::empty({2, 3}, t);
    Tensor same = make({2, 3}, t, {1, 1, 2, 2, 4, 4});
    ref().binary(BinaryOp::add, a, same, c);
    EXPECT_TRUE(near(c, {2, 3, 5, 6, 9, 10}, 0));
    ref().binary(BinaryOp::sub, a, same, c);
    EXPECT_TRUE(near(c, {0, 1, 1, 2, 1, 2}, 0));
    ref().binary(BinaryOp::mul, a, same, c);
    EXPECT_TRUE(near(c, {1, 2, 6, 8, 20, 24}, 0));
    ref().binary(BinaryOp::div, a, same, c);
    EXPECT_TRUE(near(c, {1, 2, 1.5, 2, 1.25, 1.5}, 0));
    // A bias over the last axis.
    ref().binary(BinaryOp::add, a, make({3}, t, {10, 20, 30}), c);
    EXPECT_TRUE(near(c, {11, 22, 33, 14, 25, 36}, 0));
    // Scalars: rank 0, [1] and [1, 1].
    for (const Shape& s : {Shape{}, Shape{1}, Shape{1, 1}}) {
      ref().binary(BinaryOp::div, a, make(s, t, {2}), c);
      EXPECT_TRUE(near(c, {0.5, 1, 1.5, 2, 2.5, 3}, 0)) << s.str();
    }
    // A rank-2 suffix of a rank-3 tensor, computed in place into a.
    Tensor a3 = make({2, 2, 2}, t, {1, 2, 3, 4, 5, 6, 7, 8});
    ref().binary(BinaryOp::mul, a3, make({2, 2}, t, {1, 0, -1, 2}), a3);
    EXPECT_TRUE(near(a3, {1, 0, -3, 8, 5, 0, -7, 16}, 0));
    // Division by zero follows IEEE.
    Tensor z = Tensor::empty({2}, t);
    ref().binary(BinaryOp::div, make({2}, t, {1, -1}), make({}, t, {0}), z);
    EXPECT_TRUE(near(z, {kInf, -kInf}, 0));
  }
}

TEST(ReferenceBinary, RejectsNonSuffixB) {
  Tensor a = Tensor::zeros({2, 3}, DType::f32), c = Tensor::zeros({2, 3}, DType::f32);
  const std::string msg =
      shape_error_of([&] { ref().binary(BinaryOp::add, a, Tensor::zeros({2}, DType::f32), c); });
  EXPECT_NE(msg.find("binary: b f32[2] is neither a scalar nor a suffix of a f32[2, 3]"),
            std::string::npos)
      << msg;
  Tensor c_t = a.reshape({3, 2});
  EXPECT_THROW(ref().binary(BinaryOp::add, a, a, c_t), ShapeError);
}

TEST(ReferenceScale, AlphaBetaAndWriteOnlyY) {
  for (DType t : kRefFloatTypes) {
    Tensor x = make({3}, t, {1, -2, 4}), y = make({3}, t, {1, 1, 1});
    ref().scale(x, y, 2.0, 3.0);
    EXPECT_TRUE(near(y, {5, -1, 11}, 0));
    y.fill(kNaN);
    ref().scale(x, y, -0.5);
    EXPECT_TRUE(near(y, {-0.5, 1, -2}, 0));
    ref().scale(x, x, 3.0);  // in place
    EXPECT_TRUE(near(x, {3, -6, 12}, 0));
  }
}

TEST(ReferenceSumTo, ReducesLeadingDims) {
  for (DType t : kRefFloatTypes) {
    Tensor x = make({2, 2, 3}, t, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12});
    Tensor y3 = Tensor::empty({3}, t), y23 = Tensor::empty({2, 3}, t), s = Tensor::empty({}, t);
    ref().sum_to(x, y3);
    EXPECT_TRUE(near(y3, {22, 26, 30}, 0));
    ref().sum_to(x, y23);
    EXPECT_TRUE(near(y23, {8, 10, 12, 14, 16, 18}, 0));
    ref().sum_to(x, s);
    EXPECT_EQ(s.item(), 78);
    Tensor one = Tensor::empty({1}, t);  // numel 1 is a scalar whatever its rank
    ref().sum_to(x, one);
    EXPECT_EQ(one.item(), 78);
    Tensor same = Tensor::empty({2, 2, 3}, t);
    ref().sum_to(x, same);
    EXPECT_TRUE(near(same, testing::values(x), 0));
    Tensor e = Tensor::full({3}, t, 5.0);  // an empty batch sums to zero
    ref().sum_to(Tensor::empty({0, 3}, t), e);
    EXPECT_TRUE(near(e, {0, 0, 0}, 0));
  }
  const std::string msg = shape_error_of([] {
    Tensor y = Tensor::zeros({2}, DType::f64);
    ref().sum_to(Tensor::zeros({2, 3}, DType::f64), y);
  });
  EXPECT_NE(msg.find("sum_to: y f64[2] is neither a scalar nor a suffix of x f64[2, 3]"),
            std::string::npos)
      << msg;
}

TEST(ReferenceCast, EveryDtypePair) {
  const std::vector<DType> all = {DType::f32, DType::f64, DType::bf16, DType::f16,
                                  DType::i32, DType::i64, DType::u8};
  for (DType from : all) {
    for (DType to : all) {
      Tensor x = make({2, 2}, from, {0, 1, 2, 100});
      Tensor y = Tensor::empty({2, 2}, to);
      ref().cast(x, y);
      EXPECT_TRUE(near(y, {0, 1, 2, 100}, 0)) << dtype_name(from) << "->" << dtype_name(to);
    }
  }
  Tensor y = Tensor::empty({4}, DType::f32);
  EXPECT_THROW(ref().cast(Tensor::zeros({2, 2}, DType::f64), y), ShapeError);
}

TEST(ReferencePermute, TransposesAndReordersAnyDtype) {
  for (DType t : {DType::f32, DType::f64, DType::i32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(t));
    Tensor x = make({2, 3}, t, {1, 2, 3, 4, 5, 6}), y = Tensor::empty({3, 2}, t);
    ref().permute(x, y, {1, 0});
    EXPECT_TRUE(near(y, {1, 4, 2, 5, 3, 6}, 0));
    // x[i][j][k] = 100 i + 10 j + k with shape [2, 3, 2]; y = x.permute(2, 0, 1).
    std::vector<double> xv;
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 3; ++j)
        for (int k = 0; k < 2; ++k) xv.push_back(100 * i + 10 * j + k);
    Tensor x3 = make({2, 3, 2}, t == DType::bf16 ? DType::f32 : t, xv);
    Tensor y3 = Tensor::empty({2, 2, 3}, x3.dtype());
    ref().permute(x3, y3, {2, 0, 1});
    EXPECT_TRUE(near(y3, {0, 10, 20, 100, 110, 120, 1, 11, 21, 101, 111, 121}, 0));
  }
  Tensor s = make({}, DType::f64, {7}), s2 = Tensor::empty({}, DType::f64);
  ref().permute(s, s2, {});
  EXPECT_EQ(s2.item(), 7);
  Tensor x = Tensor::zeros({2, 3}, DType::f32), y = Tensor::zeros({3, 2}, DType::f32);
  std::string msg = shape_error_of([&] { ref().permute(x, y, {0, 0}); });
  EXPECT_NE(msg.find("permute: perm [0, 0] is not a permutation of the axes of x f32[2, 3]"),
            std::string::npos)
      << msg;
  msg = shape_error_of([&] { ref().permute(x, x, {1, 0}); });
  EXPECT_NE(msg.find("permute: y is f32[2, 3], expected shape [3, 2]"), std::string::npos) << msg;
}

}  // namespace
}  // namespace mt
