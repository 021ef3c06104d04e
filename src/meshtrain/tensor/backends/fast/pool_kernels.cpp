// Fast max pooling over NCHW planes.
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "meshtrain/tensor/backends/fast/fast_common.h"
#include "meshtrain/tensor/backends/fast/fast_kernels.h"

namespace mt::fast {

namespace {

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

#if defined(__AVX512F__)
constexpr __mmask16 head16(int64_t n) {
  return static_cast<__mmask16>((1u << n) - 1u);
}

// 2x2 windows with stride 2 and no padding, the CNN's case: 16 outputs per
// step; each input row pair is split into even and odd columns, and the four
// taps are compared in row-major window order with the rule of pool_row.
void pool_row_2x2(const float* r0, int64_t w, int64_t ih0, int64_t ow, float* y, int32_t* arg) {
  const float* r1 = r0 + w;
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  const auto tw = static_cast<int32_t>(w);
  for (int64_t q0 = 0; q0 < ow; q0 += 16) {
    const int64_t cnt = std::min<int64_t>(16, ow - q0), n2 = 2 * cnt;
    const __mmask16 lo = head16(std::min<int64_t>(n2, 16)),
                    hi = head16(std::max<int64_t>(n2 - 16, 0));
    const float* p0 = r0 + 2 * q0;
    const float* p1 = r1 + 2 * q0;
    const __m512 a_lo = _mm512_maskz_loadu_ps(lo, p0), a_hi = _mm512_maskz_loadu_ps(hi, p0 + 16);
    const __m512 b_lo = _mm512_maskz_loadu_ps(lo, p1), b_hi = _mm512_maskz_loadu_ps(hi, p1 + 16);
    const __m512 taps[4] = {
        _mm512_permutex2var_ps(a_lo, even, a_hi), _mm512_permutex2var_ps(a_lo, odd, a_hi),
        _mm512_permutex2var_ps(b_lo, even, b_hi), _mm512_permutex2var_ps(b_lo, odd, b_hi)};
    const __m512i base =
        _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(ih0 * w + 2 * q0)), even);
    const int32_t offsets[4] = {0, 1, tw, tw + 1};
    __m512 best = taps[0];
    __m512i idx = base;
    for (int t = 1; t < 4; ++t) {
      const __m512 v = taps[t];
      const __mmask16 take =
          _mm512_cmp_ps_mask(best, best, _CMP_ORD_Q) &
          (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ));
      best = _mm512_mask_blend_ps(take, best, v);
      idx =
          _mm512_mask_blend_epi32(take, idx, _mm512_add_epi32(base, _mm512_set1_epi32(offsets[t])));
    }
    _mm512_mask_storeu_ps(y + q0, head16(cnt), best);
    _mm512_mask_storeu_epi32(arg + q0, head16(cnt), idx);
  }
}

// Backward of one plane of a 2x2 / stride 2 / no padding pool, written as one
// pass over dx: each dx element is its window's dy where the window's argmax
// points at it, else 0. Returns false when some argmax lies outside its own
// window (legal, since argmax is only an index into the plane); the caller
// then redoes the plane with the general scatter.
bool unpool_plane_2x2(const float* dy, const int32_t* arg, int64_t h, int64_t w, int64_t oh,
                      int64_t ow, float* dx) {
  const __m512i dup = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int64_t matched = 0;
  for (int64_t ih = 0; ih < h; ++ih) {
    float* row = dx + ih * w;
    const int64_t r = ih / 2;
    const int64_t covered = r < oh ? 2 * ow : 0;
    for (int64_t iw0 = 0; iw0 < covered; iw0 += 16) {
      const int64_t cnt = std::min<int64_t>(16, covered - iw0);
      const __mmask16 outs = head16((cnt + 1) / 2);
      const __m512 g = _mm512_maskz_permutexvar_ps(
          0xffff, dup, _mm512_maskz_loadu_ps(outs, dy + r * ow + iw0 / 2));
      const __m512i a = _mm512_maskz_permutexvar_epi32(
          0xffff, dup, _mm512_maskz_loadu_epi32(outs, arg + r * ow + iw0 / 2));
      const __m512i pos =
          _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(ih * w + iw0)), lane);
      const __mmask16 hit = _mm512_cmpeq_epi32_mask(a, pos) & head16(cnt);
      matched += __builtin_popcount(hit);
      _mm512_mask_storeu_ps(row + iw0, head16(cnt), _mm512_maskz_mov_ps(hit, g));
    }
    std::memset(row + covered, 0, static_cast<size_t>(w - covered) * sizeof(float));
  }
  return matched == oh * ow;
}
#endif

[[maybe_unused]] bool is_2x2_stride_2(const Pool2dParams& p) {
  return p.kernel_h == 2 && p.kernel_w == 2 && p.stride_h == 2 && p.stride_w == 2 && p.pad_h == 0 &&
         p.pad_w == 0;
}

}  // namespace

void max_pool2d(const Tensor& x, Tensor& y, Tensor& argmax, const Pool2dParams& p, int threads) {
  const char* K = "max_pool2d";
  require_dtype(K, "x", x, DType::f32);
  require_rank(K, "x", x, 4);
  const Shape want = max_pool2d_out_shape(x, p);
  const int64_t n = want[0], c = want[1], h = x.shape()[2], w = x.shape()[3];
  const int64_t oh = want[2], ow = want[3];
  require_dtype(K, "y", y, DType::f32);
  check_pool2d_output(x, y, want, p);
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
#if defined(__AVX512F__)
        if (is_2x2_stride_2(p)) {
          pool_row_2x2(px + (plane * h + 2 * r) * w, w, 2 * r, ow, py + (plane * oh + r) * ow,
                       pa + (plane * oh + r) * ow);
          continue;
        }
#endif
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
  for (int64_t i = 0, n = argmax.numel(); i < n; ++i) {
    if (pa[i] < 0 || pa[i] >= in_size) {
      fail(K, "argmax {} at flat position {} is outside the input plane of dx {}", pa[i], i,
           dx.desc());
    }
  }
  const float* pdy = dy.data<float>();
  float* pdx = dx.data<float>();
  const int64_t h = dx.shape()[2], w = dx.shape()[3], oh = dy.shape()[2], ow = dy.shape()[3];
  // The window parameters are not passed in; sizes that fit 2x2 / stride 2
  // try the one-pass path, which checks its own assumption (see
  // unpool_plane_2x2) and gives up for the rest of its chunk when it fails.
  const bool halves = oh == h / 2 && ow == w / 2 && oh > 0 && ow > 0;
  // Planes are disjoint in dx, so threads split them without races.
  parallel_for(planes, row_grain(in_size), threads, [&](int64_t lo, int64_t hi) {
    [[maybe_unused]] bool try_2x2 = halves;
    for (int64_t plane = lo; plane < hi; ++plane) {
      float* d = pdx + plane * in_size;
      const float* g = pdy + plane * out_size;
      const int32_t* a = pa + plane * out_size;
#if defined(__AVX512F__)
      if (try_2x2 && unpool_plane_2x2(g, a, h, w, oh, ow, d)) continue;
      try_2x2 = false;
#endif
      std::memset(d, 0, static_cast<size_t>(in_size) * sizeof(float));
      for (int64_t k = 0; k < out_size; ++k) d[a[k]] += g[k];
    }
  });
}

}  // namespace mt::fast
