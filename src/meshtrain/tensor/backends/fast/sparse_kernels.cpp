// The fast backend's sparse (CSR) kernels. Rows are split over threads in
// contiguous blocks holding about equal numbers of entries (graphs with skewed
// degrees would leave one thread with the hubs under an even split of rows);
// each row's features are processed with VecF. The transposed product is a
// scatter-add whose threads own disjoint column slices of the output, so no
// two threads write one element and each element's sum runs in entry order.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "meshtrain/tensor/backends/fast/fast_common.h"
#include "meshtrain/tensor/backends/fast/fast_kernels.h"
#include "meshtrain/tensor/backends/fast/simd.h"

namespace mt::fast {

namespace {

void require_dense(const char* kernel, const char* name, const Tensor& x) {
  require_dtype(kernel, name, x, DType::f32);
  require_rank(kernel, name, x, 2);
}

// Calls f(row_begin, row_end) over [0, n) in at most `threads` blocks of about
// equal work, a row costing (its entries + 1) * cols.
template <class F>
void parallel_rows(const int32_t* rp, int64_t n, int64_t cols, int threads, F&& f) {
  if (n <= 0) return;
  const int64_t work = (static_cast<int64_t>(rp[n]) + n) * std::max<int64_t>(cols, 1);
  const int64_t chunks =
      std::min<int64_t>({threads, n, std::max<int64_t>(1, work / kMinElemsPerThread)});
  if (chunks <= 1) {
    f(int64_t{0}, n);
    return;
  }
  // Block c starts at the first row whose prefix work reaches c / chunks of the total.
  std::vector<int64_t> start(static_cast<size_t>(chunks + 1), n);
  start[0] = 0;
  int64_t row = 0;
  for (int64_t c = 1; c < chunks; ++c) {
    const int64_t target = (static_cast<int64_t>(rp[n]) + n) * c / chunks;
    while (row < n && static_cast<int64_t>(rp[row]) + row < target) ++row;
    start[static_cast<size_t>(c)] = row;
  }
#pragma omp parallel for num_threads(static_cast <int>(chunks)) schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t lo = start[static_cast<size_t>(c)], hi = start[static_cast<size_t>(c + 1)];
    if (lo < hi) f(lo, hi);
  }
}

}  // namespace

void spmm(const Tensor& row_ptr, const Tensor& col_idx, const Tensor& w, const Tensor& x, Tensor& y,
          int threads) {
  const char* K = "spmm";
  require_dense(K, "x", x);
  const CsrDims d = check_csr(K, row_ptr, col_idx, w, x.shape()[0], DType::f32);
  const int64_t f = x.shape()[1];
  require_dtype(K, "y", y, DType::f32);
  require_shape(K, "y", y, Shape{d.n, f});
  const int32_t* rp = row_ptr.data<int32_t>();
  const int32_t* ci = col_idx.data<int32_t>();
  const float* px = x.data<float>();
  const float* pw = w.defined() ? w.data<float>() : nullptr;
  float* py = y.data<float>();
  parallel_rows(rp, d.n, f, threads, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      float* out = py + i * f;
      const int32_t e0 = rp[i], e1 = rp[i + 1];
      // Features in blocks of four vectors held in registers across the row's
      // entries: y is written once per row and x rows stream through.
      constexpr int64_t kBlock = 4 * VecF::kWidth;
      for (int64_t j0 = 0; j0 < f; j0 += kBlock) {
        const int64_t len = std::min(kBlock, f - j0);
        VecF acc[4] = {VecF::zero(), VecF::zero(), VecF::zero(), VecF::zero()};
        for (int32_t e = e0; e < e1; ++e) {
          const float* src = px + static_cast<int64_t>(ci[e]) * f + j0;
          const VecF we = VecF::set1(pw ? pw[e] : 1.0f);
          for (int64_t v = 0; v < 4; ++v) {
            const int64_t off = v * VecF::kWidth;
            if (off >= len) break;
            acc[v] = fma(we, VecF::load(src + off, std::min(VecF::kWidth, len - off)), acc[v]);
          }
        }
        for (int64_t v = 0; v < 4; ++v) {
          const int64_t off = v * VecF::kWidth;
          if (off >= len) break;
          acc[v].store(out + j0 + off, std::min(VecF::kWidth, len - off));
        }
      }
    }
  });
}

void spmm_transposed(const Tensor& row_ptr, const Tensor& col_idx, const Tensor& w,
                     const Tensor& dy, Tensor& dx, int threads) {
  const char* K = "spmm_transposed";
  require_dense(K, "dy", dy);
  require_dense(K, "dx", dx);
  const CsrDims d = check_csr(K, row_ptr, col_idx, w, dx.shape()[0], DType::f32);
  const int64_t f = dy.shape()[1];
  require_shape(K, "dy", dy, Shape{d.n, f});
  require_shape(K, "dx", dx, Shape{d.m, f});
  const int32_t* rp = row_ptr.data<int32_t>();
  const int32_t* ci = col_idx.data<int32_t>();
  const float* pdy = dy.data<float>();
  const float* pw = w.defined() ? w.data<float>() : nullptr;
  float* pdx = dx.data<float>();
  if (dx.numel() > 0) std::memset(pdx, 0, dx.nbytes());
  const int64_t col_blocks = (f + VecF::kWidth - 1) / VecF::kWidth;
  const int64_t per_block = (d.e + d.n) * VecF::kWidth;
  parallel_for(col_blocks,
               std::max<int64_t>(1, kMinElemsPerThread / std::max<int64_t>(per_block, 1)), threads,
               [&](int64_t b0, int64_t b1) {
                 const int64_t j0 = b0 * VecF::kWidth, j1 = std::min(f, b1 * VecF::kWidth);
                 for (int64_t i = 0; i < d.n; ++i) {
                   const float* g = pdy + i * f;
                   for (int32_t e = rp[i]; e < rp[i + 1]; ++e) {
                     float* out = pdx + static_cast<int64_t>(ci[e]) * f;
                     const VecF we = VecF::set1(pw ? pw[e] : 1.0f);
                     vec_loop(j1 - j0, [&](int64_t j, int64_t cnt) {
                       fma(we, VecF::load(g + j0 + j, cnt), VecF::load(out + j0 + j, cnt))
                           .store(out + j0 + j, cnt);
                     });
                   }
                 }
               });
}

void sddmm(const Tensor& row_ptr, const Tensor& col_idx, const Tensor& a, const Tensor& b,
           Tensor& out, int threads) {
  const char* K = "sddmm";
  require_dense(K, "a", a);
  require_dense(K, "b", b);
  const CsrDims d = check_csr(K, row_ptr, col_idx, Tensor(), b.shape()[0], DType::f32);
  const int64_t f = a.shape()[1];
  require_shape(K, "a", a, Shape{d.n, f});
  require_shape(K, "b", b, Shape{d.m, f});
  require_dtype(K, "out", out, DType::f32);
  require_shape(K, "out", out, Shape{d.e});
  const int32_t* rp = row_ptr.data<int32_t>();
  const int32_t* ci = col_idx.data<int32_t>();
  const float* pa = a.data<float>();
  const float* pb = b.data<float>();
  float* po = out.data<float>();
  parallel_rows(rp, d.n, f, threads, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const float* ra = pa + i * f;
      for (int32_t e = rp[i]; e < rp[i + 1]; ++e) {
        const float* rb = pb + static_cast<int64_t>(ci[e]) * f;
        VecF s = VecF::zero();
        vec_loop(f, [&](int64_t j, int64_t cnt) {
          s = fma(VecF::load(ra + j, cnt), VecF::load(rb + j, cnt), s);
        });
        po[e] = s.reduce_add();
      }
    }
  });
}

void spmm_max(const Tensor& row_ptr, const Tensor& col_idx, const Tensor& x, Tensor& y,
              Tensor& argmax, int threads) {
  const char* K = "spmm_max";
  require_dense(K, "x", x);
  const CsrDims d = check_csr(K, row_ptr, col_idx, Tensor(), x.shape()[0], DType::f32);
  const int64_t f = x.shape()[1];
  require_dtype(K, "y", y, DType::f32);
  require_shape(K, "y", y, Shape{d.n, f});
  require_dtype(K, "argmax", argmax, DType::i32);
  require_shape(K, "argmax", argmax, Shape{d.n, f});
  const int32_t* rp = row_ptr.data<int32_t>();
  const int32_t* ci = col_idx.data<int32_t>();
  const float* px = x.data<float>();
  float* py = y.data<float>();
  int32_t* pa = argmax.data<int32_t>();
  parallel_rows(rp, d.n, f, threads, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      float* yr = py + i * f;
      int32_t* ar = pa + i * f;
      const int32_t e0 = rp[i], e1 = rp[i + 1];
      if (e0 == e1) {
        std::fill(yr, yr + f, 0.0f);
        std::fill(ar, ar + f, -1);
        continue;
      }
      std::memcpy(yr, px + static_cast<int64_t>(ci[e0]) * f, static_cast<size_t>(f) * 4);
      std::fill(ar, ar + f, ci[e0]);
      for (int32_t e = e0 + 1; e < e1; ++e) {
        const float* src = px + static_cast<int64_t>(ci[e]) * f;
        const int32_t c = ci[e];
        // Branch-free so the compiler vectorises it; a NaN already chosen
        // stays (the comparison with it is false) and a new NaN wins over a
        // number, as in the reference.
        for (int64_t j = 0; j < f; ++j) {
          const bool take = src[j] > yr[j] || (src[j] != src[j] && yr[j] == yr[j]);
          yr[j] = take ? src[j] : yr[j];
          ar[j] = take ? c : ar[j];
        }
      }
    }
  });
}

void spmm_max_backward(const Tensor& dy, const Tensor& argmax, Tensor& dx, int threads) {
  const char* K = "spmm_max_backward";
  require_dense(K, "dy", dy);
  require_dense(K, "dx", dx);
  require_dtype(K, "argmax", argmax, DType::i32);
  require_same_shape(K, "dy", dy, "argmax", argmax);
  const int64_t n = dy.shape()[0], f = dy.shape()[1], m = dx.shape()[0];
  if (dx.shape()[1] != f) fail(K, "dx {} must have dy {}'s columns", dx.desc(), dy.desc());
  const int32_t* pa = argmax.data<int32_t>();
  for (int64_t k = 0; k < n * f; ++k) {
    if (pa[k] < -1 || pa[k] >= m)
      fail(K, "argmax entry {} = {} is out of range [-1, {})", k, pa[k], m);
  }
  const float* pdy = dy.data<float>();
  float* pdx = dx.data<float>();
  if (dx.numel() > 0) std::memset(pdx, 0, dx.nbytes());
  // Threads own column slices (see spmm_transposed).
  parallel_for(f, std::max<int64_t>(1, kMinElemsPerThread / std::max<int64_t>(n, 1)), threads,
               [&](int64_t j0, int64_t j1) {
                 for (int64_t i = 0; i < n; ++i) {
                   for (int64_t j = j0; j < j1; ++j) {
                     const int32_t s = pa[i * f + j];
                     if (s >= 0) pdx[static_cast<int64_t>(s) * f + j] += pdy[i * f + j];
                   }
                 }
               });
}

void edge_softmax(const Tensor& row_ptr, const Tensor& x, Tensor& y, int threads) {
  const char* K = "edge_softmax";
  require_dtype(K, "x", x, DType::f32);
  require_rank(K, "x", x, 1);
  require_f32_like(K, "y", y, "x", x);
  const int64_t n = check_row_ptr(K, row_ptr, x.shape()[0]);
  const int32_t* rp = row_ptr.data<int32_t>();
  const float* px = x.data<float>();
  float* py = y.data<float>();
  parallel_rows(rp, n, 1, threads, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int32_t e0 = rp[i], e1 = rp[i + 1];
      if (e0 == e1) continue;
      float mx = px[e0];
      for (int32_t e = e0; e < e1; ++e) mx = std::max(mx, px[e]);
      double s = 0;
      for (int32_t e = e0; e < e1; ++e) {
        py[e] = std::exp(px[e] - mx);
        s += py[e];
      }
      const float inv = static_cast<float>(1.0 / s);
      for (int32_t e = e0; e < e1; ++e) py[e] *= inv;
    }
  });
}

void edge_softmax_backward(const Tensor& row_ptr, const Tensor& y, const Tensor& dy, Tensor& dx,
                           int threads) {
  const char* K = "edge_softmax_backward";
  require_dtype(K, "y", y, DType::f32);
  require_rank(K, "y", y, 1);
  require_f32_like(K, "dy", dy, "y", y);
  require_f32_like(K, "dx", dx, "y", y);
  const int64_t n = check_row_ptr(K, row_ptr, y.shape()[0]);
  const int32_t* rp = row_ptr.data<int32_t>();
  const float* py = y.data<float>();
  const float* pdy = dy.data<float>();
  float* pdx = dx.data<float>();
  parallel_rows(rp, n, 1, threads, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      double s = 0;
      for (int32_t e = rp[i]; e < rp[i + 1]; ++e) s += static_cast<double>(pdy[e]) * py[e];
      const float sf = static_cast<float>(s);
      for (int32_t e = rp[i]; e < rp[i + 1]; ++e) pdx[e] = py[e] * (pdy[e] - sf);
    }
  });
}

}  // namespace mt::fast
