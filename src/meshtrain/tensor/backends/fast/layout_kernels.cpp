// Fast layout kernels: dtype casts and axis permutation.
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "meshtrain/tensor/backends/fast/fast_common.h"
#include "meshtrain/tensor/backends/fast/fast_kernels.h"

namespace mt::fast {

bool cast(const Tensor& x, Tensor& y, int threads) {
  const char* K = "cast";
  require_defined(K, "x", x);
  require_defined(K, "y", y);
  require_same_shape(K, "x", x, "y", y);
  const int64_t n = x.numel();
  if (x.dtype() == y.dtype()) {
    if (x.raw() != y.raw() && n > 0) std::memcpy(y.raw(), x.raw(), x.nbytes());
    return true;
  }
  if (x.dtype() == DType::f32 && y.dtype() == DType::bf16) {
    const auto* src = static_cast<const uint32_t*>(x.raw());
    auto* dst = static_cast<uint16_t*>(y.raw());
    parallel_for(n, kMinElemsPerThread, threads, [&](int64_t lo, int64_t hi) {
      // The bit-exact twin of f32_to_bf16 (round to nearest even, NaN kept
      // quiet), written branch-free so the compiler vectorises it.
      for (int64_t i = lo; i < hi; ++i) {
        const uint32_t u = src[i];
        const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
        const uint32_t nan = (u >> 16) | 0x40u;
        dst[i] = static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
      }
    });
    return true;
  }
  if (x.dtype() == DType::bf16 && y.dtype() == DType::f32) {
    const auto* src = static_cast<const uint16_t*>(x.raw());
    auto* dst = static_cast<uint32_t*>(y.raw());
    parallel_for(n, kMinElemsPerThread, threads, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) dst[i] = static_cast<uint32_t>(src[i]) << 16;
    });
    return true;
  }
#if defined(__AVX512F__)
  // f32 <-> f16 through the CPU's conversion instructions (IEEE round to
  // nearest even, subnormals and overflow to inf exact); NaN lanes take the
  // scalar conversion, so results are bit for bit f32_to_f16 / f16_to_f32's.
  if (x.dtype() == DType::f32 && y.dtype() == DType::f16) {
    const float* src = x.data<float>();
    auto* dst = static_cast<uint16_t*>(y.raw());
    parallel_for(n, kMinElemsPerThread, threads, [&](int64_t lo, int64_t hi) {
      int64_t i = lo;
      for (; i + 16 <= hi; i += 16) {
        const __m512 v = _mm512_loadu_ps(src + i);
        __m256i h = _mm512_maskz_cvtps_ph(0xffff, v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        if (nan != 0) {
          alignas(32) uint16_t buf[16];
          _mm256_store_si256(reinterpret_cast<__m256i*>(buf), h);
          for (int k = 0; k < 16; ++k) {
            if ((nan >> k) & 1) buf[k] = f32_to_f16(src[i + k]).bits;
          }
          h = _mm256_load_si256(reinterpret_cast<const __m256i*>(buf));
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), h);
      }
      for (; i < hi; ++i) dst[i] = f32_to_f16(src[i]).bits;
    });
    return true;
  }
  if (x.dtype() == DType::f16 && y.dtype() == DType::f32) {
    const auto* src = static_cast<const uint16_t*>(x.raw());
    float* dst = y.data<float>();
    parallel_for(n, kMinElemsPerThread, threads, [&](int64_t lo, int64_t hi) {
      int64_t i = lo;
      for (; i + 16 <= hi; i += 16) {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
        const __m512 v = _mm512_maskz_cvtph_ps(0xffff, h);
        _mm512_storeu_ps(dst + i, v);
        // The instruction quiets signalling NaNs; f16_to_f32 keeps the bits.
        const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        for (int k = 0; k < 16; ++k) {
          if ((nan >> k) & 1) dst[i + k] = f16_to_f32(f16{src[i + k]});
        }
      }
      for (; i < hi; ++i) dst[i] = f16_to_f32(f16{src[i]});
    });
    return true;
  }
#endif
  return false;
}

namespace {

// One axis of a permutation after unit axes are dropped and axes that stay
// adjacent are merged: its extent and its stride in x (in elements).
struct Axis {
  int64_t size, in_stride;
};

// Offsets into x and y of the element whose index over `axes` is the
// row-major decomposition of `flat`; out_stride[i] is axis i's stride in y.
void offsets_of(int64_t flat, const std::vector<Axis>& axes, const std::vector<int64_t>& out_stride,
                int64_t& in_off, int64_t& out_off) {
  in_off = 0;
  out_off = 0;
  for (size_t i = axes.size(); i-- > 0;) {
    const int64_t idx = flat % axes[i].size;
    flat /= axes[i].size;
    in_off += idx * axes[i].in_stride;
    out_off += idx * out_stride[i];
  }
}

// y[q * oq + l] = x[q + l * sl] for q < nq, l < nl, in 16 x 16 tiles so the
// strided reads and the contiguous writes both stay in cache.
template <class T>
void transpose_band(const T* x, T* y, int64_t q0, int64_t q1, int64_t nl, int64_t sl, int64_t oq) {
  constexpr int64_t kTile = 16;
  for (int64_t l0 = 0; l0 < nl; l0 += kTile) {
    const int64_t l1 = std::min(nl, l0 + kTile);
    for (int64_t q = q0; q < q1; ++q) {
      T* yr = y + q * oq;
      const T* xc = x + q;
      for (int64_t l = l0; l < l1; ++l) yr[l] = xc[l * sl];
    }
  }
}

template <class F>
void dispatch_elem_size(size_t es, F&& f) {
  switch (es) {
    case 1:
      f(uint8_t{});
      return;
    case 2:
      f(uint16_t{});
      return;
    case 4:
      f(uint32_t{});
      return;
    case 8:
      f(uint64_t{});
      return;
    default:
      MT_CHECK(false, "permute: no element type of {} bytes", es);
  }
}

}  // namespace

void permute(const Tensor& x, Tensor& y, const std::vector<int>& perm, int threads) {
  check_permute(x, y, perm);
  const int rank = x.rank();
  const std::vector<int64_t>& want = y.shape().dims();
  if (x.numel() == 0) return;

  std::vector<int64_t> x_stride(static_cast<size_t>(rank), 1);
  for (int i = rank - 2; i >= 0; --i) {
    x_stride[static_cast<size_t>(i)] = x_stride[static_cast<size_t>(i + 1)] * x.shape()[i + 1];
  }
  // y's axes in order, simplified: an axis whose x-stride is the next axis's
  // stride times its size walks x contiguously with it, so the two merge.
  std::vector<Axis> axes;
  for (int i = 0; i < rank; ++i) {
    const int64_t size = want[static_cast<size_t>(i)];
    const int64_t st = x_stride[static_cast<size_t>(perm[static_cast<size_t>(i)])];
    if (size == 1) continue;
    if (!axes.empty() && axes.back().in_stride == st * size) {
      axes.back().size *= size;
      axes.back().in_stride = st;
    } else {
      axes.push_back({size, st});
    }
  }
  const size_t es = dtype_size(x.dtype());
  const auto* src = static_cast<const unsigned char*>(x.raw());
  auto* dst = static_cast<unsigned char*>(y.raw());
  if (axes.empty()) {  // one element
    std::memcpy(dst, src, es);
    return;
  }
  std::vector<int64_t> out_stride(axes.size(), 1);
  for (size_t i = axes.size() - 1; i-- > 0;) out_stride[i] = out_stride[i + 1] * axes[i + 1].size;

  if (axes.back().in_stride == 1) {
    // y's last axis is contiguous in x too: copy runs of `run` elements.
    const int64_t run = axes.back().size;
    std::vector<Axis> outer(axes.begin(), axes.end() - 1);
    std::vector<int64_t> outer_stride(out_stride.begin(), out_stride.end() - 1);
    const size_t run_bytes = static_cast<size_t>(run) * es;
    parallel_for(x.numel() / run, row_grain(run), threads, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        int64_t in_off = 0, out_off = 0;
        offsets_of(r, outer, outer_stride, in_off, out_off);
        std::memcpy(dst + static_cast<size_t>(out_off) * es, src + static_cast<size_t>(in_off) * es,
                    run_bytes);
      }
    });
    return;
  }
  // Otherwise transpose 2-D slices: axis q (contiguous in x) against y's last
  // axis l, for every index of the remaining axes.
  size_t q = 0;
  while (axes[q].in_stride != 1) ++q;
  const int64_t nq = axes[q].size, oq = out_stride[q];
  const int64_t nl = axes.back().size, sl = axes.back().in_stride;
  std::vector<Axis> rest;
  std::vector<int64_t> rest_stride;
  for (size_t i = 0; i + 1 < axes.size(); ++i) {
    if (i == q) continue;
    rest.push_back(axes[i]);
    rest_stride.push_back(out_stride[i]);
  }
  constexpr int64_t kBand = 16;
  const int64_t bands = (nq + kBand - 1) / kBand;
  const int64_t slices = x.numel() / (nq * nl);
  dispatch_elem_size(es, [&](auto tag) {
    using T = decltype(tag);
    const T* xs = static_cast<const T*>(x.raw());
    T* ys = static_cast<T*>(y.raw());
    parallel_for(slices * bands, row_grain(kBand * nl), threads, [&](int64_t lo, int64_t hi) {
      for (int64_t task = lo; task < hi; ++task) {
        int64_t in_off = 0, out_off = 0;
        offsets_of(task / bands, rest, rest_stride, in_off, out_off);
        const int64_t q0 = (task % bands) * kBand;
        transpose_band(xs + in_off, ys + out_off, q0, std::min(nq, q0 + kBand), nl, sl, oq);
      }
    });
  });
}

}  // namespace mt::fast
