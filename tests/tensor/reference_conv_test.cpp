// The reference backend's convolution and max pooling against hand-computed
// values (NCHW data, OIHW weights).
#include <gtest/gtest.h>

#include <limits>

#include "meshtrain/tensor/kernels.h"
#include "reference_test_util.h"

namespace mt {
namespace {

using testing::kRefFloatTypes;
using testing::make;
using testing::near;
using testing::shape_error_of;

KernelBackend& ref() {
  return kernels("reference");
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// x = [[1,2,3],[4,5,6],[7,8,9]] as [1, 1, 3, 3].
const std::vector<double> k3x3 = {1, 2, 3, 4, 5, 6, 7, 8, 9};

// ---- conv2d ----

TEST(ReferenceConv2d, DiagonalDifferenceKernel) {
  for (DType t : kRefFloatTypes) {
    // w = [[1,0],[0,-1]]: y[i][j] = x[i][j] - x[i+1][j+1] = -4 everywhere.
    Tensor x = make({1, 1, 3, 3}, t, k3x3), w = make({1, 1, 2, 2}, t, {1, 0, 0, -1});
    Tensor y = Tensor::empty({1, 1, 2, 2}, t);
    ref().conv2d(x, w, Tensor(), y, {});
    EXPECT_TRUE(near(y, {-4, -4, -4, -4}, 0));
    ref().conv2d(x, w, make({1}, t, {0.5}), y, {});
    EXPECT_TRUE(near(y, {-3.5, -3.5, -3.5, -3.5}, 0));
  }
}

TEST(ReferenceConv2d, StrideAndZeroPadding) {
  for (DType t : kRefFloatTypes) {
    // 2x2 box filter, stride 2, pad 1: OH = (3 + 2 - 2) / 2 + 1 = 2. Windows
    // cover rows {-1,0} / {1,2} and the same columns; padding adds zero.
    Tensor x = make({1, 1, 3, 3}, t, k3x3), w = Tensor::full({1, 1, 2, 2}, t, 1.0);
    Tensor y = Tensor::empty({1, 1, 2, 2}, t);
    const Conv2dParams p{.stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1};
    ref().conv2d(x, w, Tensor(), y, p);
    EXPECT_TRUE(near(y, {1, 2 + 3, 4 + 7, 5 + 6 + 8 + 9}, 0));
    // Non-square: stride 1x2, pad 0x1, 1x3 kernel [1, 10, 100] over a 2x4 input.
    Tensor x2 = make({1, 1, 2, 4}, t, {1, 2, 3, 4, 5, 6, 7, 8});
    Tensor w2 = make({1, 1, 1, 3}, t, {1, 10, 100});
    Tensor y2 = Tensor::empty({1, 1, 2, 2}, t);  // OW = (4 + 2 - 3) / 2 + 1 = 2
    ref().conv2d(x2, w2, Tensor(), y2, {.stride_w = 2, .pad_w = 1});
    EXPECT_TRUE(near(y2, {0 + 10 + 200, 2 + 30 + 400, 0 + 50 + 600, 6 + 70 + 800}, 0));
  }
}

TEST(ReferenceConv2d, ChannelsAndBatch) {
  for (DType t : kRefFloatTypes) {
    // 1x1 convolution mixing 2 channels: w = [[1, 1], [1, -1]], bias [0, 10].
    // Batch 0 has channels (1, 2), batch 1 has (3, 5), each over a 1x2 plane.
    Tensor x = make({2, 2, 1, 2}, t, {1, 1, 2, 2, 3, 3, 5, 5});
    Tensor w = make({2, 2, 1, 1}, t, {1, 1, 1, -1}), b = make({2}, t, {0, 10});
    Tensor y = Tensor::empty({2, 2, 1, 2}, t);
    ref().conv2d(x, w, b, y, {});
    EXPECT_TRUE(near(y, {3, 3, 9, 9, 8, 8, 8, 8}, 0));
    // An empty batch runs.
    Tensor e = Tensor::empty({0, 2, 1, 2}, t);
    ref().conv2d(Tensor::empty({0, 2, 1, 2}, t), w, b, e, {});
  }
}

TEST(ReferenceConv2d, BackwardDataIsTheTransposedScatter) {
  for (DType t : kRefFloatTypes) {
    // dy = ones with w = [[1,0],[0,-1]]: each output adds +1 at its top-left
    // input and -1 at its bottom-right one.
    Tensor dy = Tensor::full({1, 1, 2, 2}, t, 1.0), w = make({1, 1, 2, 2}, t, {1, 0, 0, -1});
    Tensor dx = Tensor::full({1, 1, 3, 3}, t, 7.0);
    ref().conv2d_backward_data(dy, w, dx, {});
    EXPECT_TRUE(near(dx, {1, 1, 0, 1, 0, -1, 0, -1, -1}, 0));
    // Stride 2 over a 5-row input: OH = 2 as for 4 rows, and dx's last row
    // (never read by the forward) gets zero. Box kernel 2x1, dy = [1, 2].
    Tensor dy2 = make({1, 1, 2, 1}, t, {1, 2}), w2 = Tensor::full({1, 1, 2, 1}, t, 1.0);
    Tensor dx2 = Tensor::full({1, 1, 5, 1}, t, 7.0);
    ref().conv2d_backward_data(dy2, w2, dx2, {.stride_h = 2});
    EXPECT_TRUE(near(dx2, {1, 1, 2, 2, 0}, 0));
  }
}

TEST(ReferenceConv2d, BackwardWeightAndBias) {
  for (DType t : kRefFloatTypes) {
    // dy = ones: dw[i][j] = sum of the 2x2 block of x starting at (i, j);
    // dbias = number of outputs.
    Tensor dy = Tensor::full({1, 1, 2, 2}, t, 1.0), x = make({1, 1, 3, 3}, t, k3x3);
    Tensor dw = Tensor::empty({1, 1, 2, 2}, t), db = Tensor::empty({1}, t);
    ref().conv2d_backward_weight(dy, x, dw, db, {});
    EXPECT_TRUE(near(dw, {12, 16, 24, 28}, 0));
    EXPECT_TRUE(near(db, {4}, 0));
    // With padding 1 and a 3x3 kernel (OH = 3), dy = one-hot at the centre:
    // dw is x itself; without a bias tensor dbias stays undefined.
    Tensor dyc = make({1, 1, 3, 3}, t, {0, 0, 0, 0, 1, 0, 0, 0, 0});
    Tensor dw3 = Tensor::empty({1, 1, 3, 3}, t), none;
    ref().conv2d_backward_weight(dyc, x, dw3, none, {.pad_h = 1, .pad_w = 1});
    EXPECT_TRUE(near(dw3, k3x3, 0));
    // An empty batch gives zero gradients.
    Tensor e = Tensor::empty({0, 1, 2, 2}, t), ex = Tensor::empty({0, 1, 3, 3}, t);
    dw.fill(5.0);
    db.fill(5.0);
    ref().conv2d_backward_weight(e, ex, dw, db, {});
    EXPECT_TRUE(near(dw, {0, 0, 0, 0}, 0));
    EXPECT_TRUE(near(db, {0}, 0));
  }
}

TEST(ReferenceConv2d, ShapeErrorsNameKernelAndShapes) {
  Tensor x = Tensor::zeros({1, 3, 5, 5}, DType::f32), w = Tensor::zeros({4, 2, 3, 3}, DType::f32);
  Tensor y = Tensor::zeros({1, 4, 3, 3}, DType::f32);
  std::string msg = shape_error_of([&] { ref().conv2d(x, w, Tensor(), y, {}); });
  EXPECT_TRUE(contains(msg,
                       "conv2d: channels differ: x f32[1, 3, 5, 5] has 3 input channels but "
                       "w f32[4, 2, 3, 3] expects 2"))
      << msg;
  Tensor w3 = Tensor::zeros({4, 3, 3, 3}, DType::f32),
         y_bad = Tensor::zeros({1, 4, 5, 5}, DType::f32);
  msg = shape_error_of([&] { ref().conv2d(x, w3, Tensor(), y_bad, {}); });
  EXPECT_TRUE(contains(msg, "conv2d: y is f32[1, 4, 5, 5], expected shape [1, 4, 3, 3]")) << msg;
  msg = shape_error_of([&] { ref().conv2d(x, w3, Tensor::zeros({3}, DType::f32), y, {}); });
  EXPECT_TRUE(contains(msg, "conv2d: bias is f32[3], expected shape [4]")) << msg;
  msg = shape_error_of([&] { ref().conv2d(x, w3, Tensor(), y, {.stride_h = 0}); });
  EXPECT_TRUE(contains(msg, "conv2d: invalid parameters (stride 0x1, pad 0x0)")) << msg;
  Tensor big = Tensor::zeros({4, 3, 7, 7}, DType::f32);
  EXPECT_THROW(ref().conv2d(x, big, Tensor(), y, {}), ShapeError);
}

// ---- max pooling ----

TEST(ReferenceMaxPool2d, MaxAndArgmax) {
  for (DType t : kRefFloatTypes) {
    // 4x4 input, 2x2 windows with stride 2; ties pick the first element in
    // row-major window order (the window [7, 7; 7, 7]).
    Tensor x = make({1, 1, 4, 4}, t, {1, 5, 2, 0, 3, 4, 9, 1, 7, 7, -1, -2, 7, 7, -3, -4});
    Tensor y = Tensor::empty({1, 1, 2, 2}, t), am = Tensor::empty({1, 1, 2, 2}, DType::i32);
    ref().max_pool2d(x, y, am, {});
    EXPECT_TRUE(near(y, {5, 9, 7, -1}, 0));
    EXPECT_TRUE(near(am, {1, 6, 8, 10}, 0));
  }
}

TEST(ReferenceMaxPool2d, PaddingIsMinusInfinity) {
  for (DType t : kRefFloatTypes) {
    // All-negative 2x2 input with pad 1: each 2x2 window holds one real
    // element, which must win over the padding.
    Tensor x = make({1, 1, 2, 2}, t, {-1, -2, -3, -4});
    Tensor y = Tensor::empty({1, 1, 2, 2}, t), am = Tensor::empty({1, 1, 2, 2}, DType::i32);
    ref().max_pool2d(x, y, am, {.pad_h = 1, .pad_w = 1});
    EXPECT_TRUE(near(y, {-1, -2, -3, -4}, 0));
    EXPECT_TRUE(near(am, {0, 1, 2, 3}, 0));
  }
}

TEST(ReferenceMaxPool2d, NaNWinsAndPlanesAreIndependent) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  // Two channels of 1x3 with a 1x3 window: channel 0 holds a NaN (it wins),
  // channel 1's argmax is relative to its own plane.
  Tensor x = make({1, 2, 1, 3}, DType::f64, {1, nan, 5, 0, 8, 2});
  Tensor y = Tensor::empty({1, 2, 1, 1}, DType::f64), am = Tensor::empty({1, 2, 1, 1}, DType::i32);
  ref().max_pool2d(x, y, am, {.kernel_h = 1, .kernel_w = 3, .stride_h = 1, .stride_w = 3});
  EXPECT_TRUE(near(y, {nan, 8}, 0));
  EXPECT_TRUE(near(am, {1, 1}, 0));
}

TEST(ReferenceMaxPool2d, BackwardRoutesToArgmaxAndAddsOverlaps) {
  for (DType t : kRefFloatTypes) {
    // 2x3 input with its maximum in the middle of row 0; 2x2 windows with
    // stride 1 both pick it, so dx there is dy[0] + dy[1].
    Tensor x = make({1, 1, 2, 3}, t, {0, 5, 0, 1, 0, 1});
    Tensor y = Tensor::empty({1, 1, 1, 2}, t), am = Tensor::empty({1, 1, 1, 2}, DType::i32);
    ref().max_pool2d(x, y, am, {.stride_h = 1, .stride_w = 1});
    EXPECT_TRUE(near(am, {1, 1}, 0));
    Tensor dy = make({1, 1, 1, 2}, t, {1, 2}), dx = Tensor::full({1, 1, 2, 3}, t, 9.0);
    ref().max_pool2d_backward(dy, am, dx);
    EXPECT_TRUE(near(dx, {0, 3, 0, 0, 0, 0}, 0));
  }
  Tensor dy = Tensor::zeros({1, 1, 1, 2}, DType::f32), dx = Tensor::zeros({1, 1, 2, 3}, DType::f32);
  const std::string msg = shape_error_of([&] {
    ref().max_pool2d_backward(dy, make({1, 1, 1, 2}, DType::i32, {0, 6}), dx);
  });
  EXPECT_TRUE(contains(msg,
                       "max_pool2d_backward: argmax 6 at flat position 1 is outside the input "
                       "plane of dx f32[1, 1, 2, 3]"))
      << msg;
}

TEST(ReferenceMaxPool2d, ShapeErrors) {
  Tensor x = Tensor::zeros({1, 1, 4, 4}, DType::f32), y = Tensor::zeros({1, 1, 3, 3}, DType::f32);
  Tensor am = Tensor::zeros({1, 1, 3, 3}, DType::i32);
  std::string msg = shape_error_of([&] { ref().max_pool2d(x, y, am, {}); });
  EXPECT_TRUE(contains(msg, "max_pool2d: y is f32[1, 1, 3, 3], expected shape [1, 1, 2, 2]"))
      << msg;
  Tensor y2 = Tensor::zeros({1, 1, 2, 2}, DType::f32),
         am2 = Tensor::zeros({1, 1, 2, 2}, DType::f32);
  msg = shape_error_of([&] { ref().max_pool2d(x, y2, am2, {}); });
  EXPECT_TRUE(contains(msg, "max_pool2d: argmax f32[1, 1, 2, 2] must be i32")) << msg;
  Tensor am3 = Tensor::zeros({1, 1, 2, 2}, DType::i32);
  msg = shape_error_of([&] { ref().max_pool2d(x, y2, am3, {.pad_h = 2}); });
  EXPECT_TRUE(contains(msg, "max_pool2d: invalid parameters (kernel 2x2, stride 2x2, pad 2x0)"))
      << msg;
}

}  // namespace
}  // namespace mt
