// Reference sparse (CSR) kernels: the obvious loops, accumulating in double.
// Semantics: backend.h's "sparse" section.
#include <cmath>
#include <vector>

#include "meshtrain/tensor/backends/reference/reference_backend.h"
#include "meshtrain/tensor/backends/reference/reference_util.h"

namespace mt {

using namespace reference;

namespace {

// The dense operand x [rows, F]: f32/f64, rank 2.
void require_dense(const char* kernel, const char* name, const Tensor& x) {
  require_f32_f64(kernel, name, x);
  require_rank(kernel, name, x, 2);
}

}  // namespace

void ReferenceBackend::spmm(const Tensor& row_ptr, const Tensor& col_idx, const Tensor& w,
                            const Tensor& x, Tensor& y) {
  const char* K = "spmm";
  require_dense(K, "x", x);
  const CsrDims d = check_csr(K, row_ptr, col_idx, w, x.shape()[0], x.dtype());
  const int64_t f = x.shape()[1];
  require_defined(K, "y", y);
  require_same_dtype(K, "x", x, "y", y);
  require_shape(K, "y", y, Shape{d.n, f});
  const int32_t* rp = row_ptr.data<int32_t>();
  const int32_t* ci = col_idx.data<int32_t>();
  dispatch_f32_f64(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    const T* pw = w.defined() ? w.data<T>() : nullptr;
    T* py = y.data<T>();
    std::vector<double> acc(static_cast<size_t>(f));
    for (int64_t i = 0; i < d.n; ++i) {
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t e = rp[i]; e < rp[i + 1]; ++e) {
        const double we = pw ? static_cast<double>(pw[e]) : 1.0;
        for (int64_t j = 0; j < f; ++j) acc[static_cast<size_t>(j)] += we * px[ci[e] * f + j];
      }
      for (int64_t j = 0; j < f; ++j) py[i * f + j] = static_cast<T>(acc[static_cast<size_t>(j)]);
    }
  });
}

void ReferenceBackend::spmm_transposed(const Tensor& row_ptr, const Tensor& col_idx,
                                       const Tensor& w, const Tensor& dy, Tensor& dx) {
  const char* K = "spmm_transposed";
  require_dense(K, "dy", dy);
  require_dense(K, "dx", dx);
  require_same_dtype(K, "dy", dy, "dx", dx);
  const CsrDims d = check_csr(K, row_ptr, col_idx, w, dx.shape()[0], dy.dtype());
  const int64_t f = dy.shape()[1];
  require_shape(K, "dy", dy, Shape{d.n, f});
  require_shape(K, "dx", dx, Shape{d.m, f});
  const int32_t* rp = row_ptr.data<int32_t>();
  const int32_t* ci = col_idx.data<int32_t>();
  dispatch_f32_f64(dy.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* pdy = dy.data<T>();
    const T* pw = w.defined() ? w.data<T>() : nullptr;
    std::vector<double> acc(static_cast<size_t>(d.m * f), 0.0);
    for (int64_t i = 0; i < d.n; ++i) {
      for (int64_t e = rp[i]; e < rp[i + 1]; ++e) {
        const double we = pw ? static_cast<double>(pw[e]) : 1.0;
        for (int64_t j = 0; j < f; ++j) {
          acc[static_cast<size_t>(ci[e] * f + j)] += we * pdy[i * f + j];
        }
      }
    }
    T* pdx = dx.data<T>();
    for (int64_t k = 0; k < d.m * f; ++k) pdx[k] = static_cast<T>(acc[static_cast<size_t>(k)]);
  });
}

void ReferenceBackend::sddmm(const Tensor& row_ptr, const Tensor& col_idx, const Tensor& a,
                             const Tensor& b, Tensor& out) {
  const char* K = "sddmm";
  require_dense(K, "a", a);
  require_dense(K, "b", b);
  require_same_dtype(K, "a", a, "b", b);
  const CsrDims d = check_csr(K, row_ptr, col_idx, Tensor(), b.shape()[0], a.dtype());
  const int64_t f = a.shape()[1];
  require_shape(K, "a", a, Shape{d.n, f});
  require_shape(K, "b", b, Shape{d.m, f});
  require_defined(K, "out", out);
  require_same_dtype(K, "a", a, "out", out);
  require_shape(K, "out", out, Shape{d.e});
  const int32_t* rp = row_ptr.data<int32_t>();
  const int32_t* ci = col_idx.data<int32_t>();
  dispatch_f32_f64(a.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* pa = a.data<T>();
    const T* pb = b.data<T>();
    T* po = out.data<T>();
    for (int64_t i = 0; i < d.n; ++i) {
      for (int64_t e = rp[i]; e < rp[i + 1]; ++e) {
        double s = 0;
        for (int64_t j = 0; j < f; ++j) s += static_cast<double>(pa[i * f + j]) * pb[ci[e] * f + j];
        po[e] = static_cast<T>(s);
      }
    }
  });
}

void ReferenceBackend::spmm_max(const Tensor& row_ptr, const Tensor& col_idx, const Tensor& x,
                                Tensor& y, Tensor& argmax) {
  const char* K = "spmm_max";
  require_dense(K, "x", x);
  const CsrDims d = check_csr(K, row_ptr, col_idx, Tensor(), x.shape()[0], x.dtype());
  const int64_t f = x.shape()[1];
  require_defined(K, "y", y);
  require_same_dtype(K, "x", x, "y", y);
  require_shape(K, "y", y, Shape{d.n, f});
  require_i32(K, "argmax", argmax);
  require_shape(K, "argmax", argmax, Shape{d.n, f});
  const int32_t* rp = row_ptr.data<int32_t>();
  const int32_t* ci = col_idx.data<int32_t>();
  int32_t* pa = argmax.data<int32_t>();
  dispatch_f32_f64(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    T* py = y.data<T>();
    for (int64_t i = 0; i < d.n; ++i) {
      for (int64_t j = 0; j < f; ++j) {
        int32_t best = -1;
        T bv = T(0);
        for (int64_t e = rp[i]; e < rp[i + 1]; ++e) {
          const T v = px[ci[e] * f + j];
          if (best >= 0 && std::isnan(bv)) break;  // the first NaN wins
          if (best < 0 || v > bv || std::isnan(v)) {
            best = ci[e];
            bv = v;
          }
        }
        py[i * f + j] = bv;
        pa[i * f + j] = best;
      }
    }
  });
}

void ReferenceBackend::spmm_max_backward(const Tensor& dy, const Tensor& argmax, Tensor& dx) {
  const char* K = "spmm_max_backward";
  require_dense(K, "dy", dy);
  require_dense(K, "dx", dx);
  require_same_dtype(K, "dy", dy, "dx", dx);
  require_i32(K, "argmax", argmax);
  require_same_shape(K, "dy", dy, "argmax", argmax);
  const int64_t n = dy.shape()[0], f = dy.shape()[1], m = dx.shape()[0];
  if (dx.shape()[1] != f) fail(K, "dx {} must have dy {}'s columns", dx.desc(), dy.desc());
  const int32_t* pa = argmax.data<int32_t>();
  for (int64_t k = 0; k < n * f; ++k) {
    if (pa[k] < -1 || pa[k] >= m) {
      fail(K, "argmax entry {} = {} is out of range [-1, {})", k, pa[k], m);
    }
  }
  dispatch_f32_f64(dy.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* pdy = dy.data<T>();
    std::vector<double> acc(static_cast<size_t>(m * f), 0.0);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < f; ++j) {
        const int32_t src = pa[i * f + j];
        if (src >= 0) acc[static_cast<size_t>(src * f + j)] += pdy[i * f + j];
      }
    }
    T* pdx = dx.data<T>();
    for (int64_t k = 0; k < m * f; ++k) pdx[k] = static_cast<T>(acc[static_cast<size_t>(k)]);
  });
}

void ReferenceBackend::edge_softmax(const Tensor& row_ptr, const Tensor& x, Tensor& y) {
  const char* K = "edge_softmax";
  require_f32_f64(K, "x", x);
  require_rank(K, "x", x, 1);
  require_like(K, "y", y, "x", x);
  const CsrDims d{check_row_ptr(K, row_ptr, x.shape()[0]), 0, x.shape()[0]};
  const int32_t* rp = row_ptr.data<int32_t>();
  dispatch_f32_f64(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    T* py = y.data<T>();
    for (int64_t i = 0; i < d.n; ++i) {
      if (rp[i] == rp[i + 1]) continue;
      double mx = px[rp[i]];
      for (int64_t e = rp[i]; e < rp[i + 1]; ++e) mx = std::max<double>(mx, px[e]);
      double s = 0;
      for (int64_t e = rp[i]; e < rp[i + 1]; ++e) s += std::exp(px[e] - mx);
      for (int64_t e = rp[i]; e < rp[i + 1]; ++e) py[e] = static_cast<T>(std::exp(px[e] - mx) / s);
    }
  });
}

void ReferenceBackend::edge_softmax_backward(const Tensor& row_ptr, const Tensor& y,
                                             const Tensor& dy, Tensor& dx) {
  const char* K = "edge_softmax_backward";
  require_f32_f64(K, "y", y);
  require_rank(K, "y", y, 1);
  require_like(K, "dy", dy, "y", y);
  require_like(K, "dx", dx, "y", y);
  const CsrDims d{check_row_ptr(K, row_ptr, y.shape()[0]), 0, y.shape()[0]};
  const int32_t* rp = row_ptr.data<int32_t>();
  dispatch_f32_f64(y.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* py = y.data<T>();
    const T* pdy = dy.data<T>();
    T* pdx = dx.data<T>();
    for (int64_t i = 0; i < d.n; ++i) {
      double s = 0;
      for (int64_t e = rp[i]; e < rp[i + 1]; ++e) s += static_cast<double>(pdy[e]) * py[e];
      for (int64_t e = rp[i]; e < rp[i + 1]; ++e) pdx[e] = static_cast<T>(py[e] * (pdy[e] - s));
    }
  });
}

}  // namespace mt
