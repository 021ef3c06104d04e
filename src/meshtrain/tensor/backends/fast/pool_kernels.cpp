// Fast max pooling over NCHW planes.
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "meshtrain/tensor/backends/fast/fast_common.h"
#include "meshtrain/tensor/backends/fast/fast_kernels.h"

namespace mt::fast {

namespace {

int64_t out_extent(int64_t in, int64_t k, int64_t stride, int64_t pad) {
  return (in + 2 * pad - k) / stride + 1;
}

// Output columns per inner block: the running maxima stay in registers /
// L1 while the window's taps stream over the input row.
constexpr int64_t kCols = 64;

// One output row of one plane. The loop runs tap by tap (window row i,
// column j) over a block of output columns, so the inner loop is a strided
// load, a compare and two blends that the compiler vectorises. A tap replaces
// the running maximum under the reference's rule: nothing taken yet, or the
// maximum is not NaN and the tap is NaN or strictly greater (ties keep the
// first tap in row-major window order).
void pool_row(const float* plane, int64_t h, int64_t w, int64_t r, int64_t ow,
              const Pool2dParams& p, float* y, int32_t* arg) {
  for (int64_t c0 = 0; c0 < ow; c0 += kCols) {
    const int64_t c1 = std::min(ow, c0 + kCols);
    float best[kCols];
    int32_t idx[kCols];
    for (int64_t q = 0; q < c1 - c0; ++q) {
      best[q] = -std::numeric_limits<float>::infinity();
      idx[q] = -1;
    }
    for (int64_t i = 0; i < p.kernel_h; ++i) {
      const int64_t ih = r * p.stride_h - p.pad_h + i;
      if (ih < 0 || ih >= h) continue;
      const float* row = plane + ih * w;
      for (int64_t j = 0; j < p.kernel_w; ++j) {
        // Output columns whose tap column iw = q * stride - pad + j is inside the row.
        const int64_t off = j - p.pad_w;
        const int64_t q_lo = std::max(c0, off >= 0 ? 0 : (-off + p.stride_w - 1) / p.stride_w);
        const int64_t q_hi = std::min(c1, w - 1 - off < 0 ? 0 : (w - 1 - off) / p.stride_w + 1);
        const auto base = static_cast<int32_t>(ih * w + off);
        for (int64_t q = q_lo; q < q_hi; ++q) {
          const float v = row[q * p.stride_w + off];
          const float b = best[q - c0];
          const bool take = idx[q - c0] < 0 || (b == b && (v != v || v > b));
          best[q - c0] = take ? v : b;
          idx[q - c0] = take ? base + static_cast<int32_t>(q * p.stride_w) : idx[q - c0];
        }
      }
    }
    std::memcpy(y + c0, best, static_cast<size_t>(c1 - c0) * sizeof(float));
    std::memcpy(arg + c0, idx, static_cast<size_t>(c1 - c0) * sizeof(int32_t));
  }
}

}  // namespace

void max_pool2d(const Tensor& x, Tensor& y, Tensor& argmax, const Pool2dParams& p, int threads) {
  const char* K = "max_pool2d";
  require_dtype(K, "x", x, DType::f32);
  require_rank(K, "x", x, 4);
  const std::string params = fmt::format("kernel {}x{}, stride {}x{}, pad {}x{}", p.kernel_h,
                                         p.kernel_w, p.stride_h, p.stride_w, p.pad_h, p.pad_w);
  if (p.kernel_h < 1 || p.kernel_w < 1 || p.stride_h < 1 || p.stride_w < 1 || p.pad_h < 0 ||
      p.pad_w < 0 || p.pad_h >= p.kernel_h || p.pad_w >= p.kernel_w) {
    fail(K, "invalid parameters ({}) for x {}: need kernel, stride >= 1 and 0 <= pad < kernel",
         params, x.desc());
  }
  const int64_t n = x.shape()[0], c = x.shape()[1], h = x.shape()[2], w = x.shape()[3];
  if (h + 2 * p.pad_h < p.kernel_h || w + 2 * p.pad_w < p.kernel_w) {
    fail(K, "window ({}) is larger than the padded input x {}", params, x.desc());
  }
  const int64_t oh = out_extent(h, p.kernel_h, p.stride_h, p.pad_h);
  const int64_t ow = out_extent(w, p.kernel_w, p.stride_w, p.pad_w);
  const Shape want{n, c, oh, ow};
  require_dtype(K, "y", y, DType::f32);
  if (!(y.shape() == want)) {
    fail(K, "y is {}, expected shape {} for x {} ({})", y.desc(), want.str(), x.desc(), params);
  }
  require_dtype(K, "argmax", argmax, DType::i32);
  require_shape(K, "argmax", argmax, want);
  if (h * w > std::numeric_limits<int32_t>::max()) {
    fail(K, "input planes of x {} are too large for i32 argmax", x.desc());
  }
  const float* px = x.data<float>();
  float* py = y.data<float>();
  int32_t* pa = argmax.data<int32_t>();
  parallel_for(n * c, row_grain(h * w), threads, [&](int64_t lo, int64_t hi) {
    for (int64_t plane = lo; plane < hi; ++plane) {
      for (int64_t r = 0; r < oh; ++r) {
        pool_row(px + plane * h * w, h, w, r, ow, p, py + (plane * oh + r) * ow,
                 pa + (plane * oh + r) * ow);
      }
    }
  });
}

void max_pool2d_backward(const Tensor& dy, const Tensor& argmax, Tensor& dx, int threads) {
  const char* K = "max_pool2d_backward";
  require_dtype(K, "dy", dy, DType::f32);
  require_rank(K, "dy", dy, 4);
  require_dtype(K, "argmax", argmax, DType::i32);
  require_same_shape(K, "dy", dy, "argmax", argmax);
  require_dtype(K, "dx", dx, DType::f32);
  require_rank(K, "dx", dx, 4);
  if (dx.shape()[0] != dy.shape()[0] || dx.shape()[1] != dy.shape()[1]) {
    fail(K, "batch or channels differ: dy {} vs dx {}", dy.desc(), dx.desc());
  }
  const int64_t planes = dy.shape()[0] * dy.shape()[1];
  const int64_t out_size = dy.shape()[2] * dy.shape()[3];
  const int64_t in_size = dx.shape()[2] * dx.shape()[3];
  const int32_t* pa = argmax.data<int32_t>();
  for (int64_t i = 0; i < argmax.numel(); ++i) {
    if (pa[i] < 0 || pa[i] >= in_size) {
      fail(K, "argmax {} at flat position {} is outside the input plane of dx {}", pa[i], i,
           dx.desc());
    }
  }
  const float* pdy = dy.data<float>();
  float* pdx = dx.data<float>();
  // Planes are disjoint in dx, so threads split them without races.
  parallel_for(planes, row_grain(in_size), threads, [&](int64_t lo, int64_t hi) {
    for (int64_t plane = lo; plane < hi; ++plane) {
      float* d = pdx + plane * in_size;
      std::memset(d, 0, static_cast<size_t>(in_size) * sizeof(float));
      const float* g = pdy + plane * out_size;
      const int32_t* a = pa + plane * out_size;
      for (int64_t k = 0; k < out_size; ++k) d[a[k]] += g[k];
    }
  });
}

}  // namespace mt::fast
