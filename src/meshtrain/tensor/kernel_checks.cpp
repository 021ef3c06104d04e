// Shared kernel argument checks (see kernel_checks.h).
#include "meshtrain/tensor/kernel_checks.h"

#include <fmt/ranges.h>

namespace mt {

MatmulDims matmul_dims(const Tensor& a, const Tensor& b, const MatmulParams& p) {
  const char* K = "matmul";
  MatmulDims d;
  if (a.rank() == 2) {
    if (b.rank() != 2) {
      fail(K, "a {} is rank 2 but b {} is rank {} (expected 2)", a.desc(), b.desc(), b.rank());
    }
  } else if (a.rank() == 3) {
    if (b.rank() != 2 && b.rank() != 3) {
      fail(K, "a {} is rank 3 but b {} is rank {} (expected 2 or 3)", a.desc(), b.desc(), b.rank());
    }
    d.batch = a.shape()[0];
    d.shared_b = b.rank() == 2;
    if (!d.shared_b && b.shape()[0] != d.batch) {
      fail(K, "batch sizes differ: a {} vs b {}", a.desc(), b.desc());
    }
  } else {
    fail(K, "a {} must have rank 2 or 3", a.desc());
  }
  const Shape& as = a.shape();
  const Shape& bs = b.shape();
  d.m = p.trans_a ? as[-1] : as[-2];
  d.k = p.trans_a ? as[-2] : as[-1];
  const int64_t kb = p.trans_b ? bs[-1] : bs[-2];
  d.n = p.trans_b ? bs[-2] : bs[-1];
  if (d.k != kb) {
    fail(K, "inner dimensions differ: a {} (trans_a={}) vs b {} (trans_b={})", a.desc(),
         int{p.trans_a}, b.desc(), int{p.trans_b});
  }
  return d;
}

MatmulDims check_matmul(const Tensor& a, const Tensor& b, const Tensor& c, const MatmulParams& p) {
  const MatmulDims d = matmul_dims(a, b, p);
  const Shape want = a.rank() == 3 ? Shape{d.batch, d.m, d.n} : Shape{d.m, d.n};
  if (!(c.shape() == want)) {
    fail("matmul", "c is {}, expected shape {} for a {} (trans_a={}) and b {} (trans_b={})",
         c.desc(), want.str(), a.desc(), int{p.trans_a}, b.desc(), int{p.trans_b});
  }
  return d;
}

std::string conv2d_params_str(const Conv2dParams& p) {
  return fmt::format("stride {}x{}, pad {}x{}", p.stride_h, p.stride_w, p.pad_h, p.pad_w);
}

Conv2dDims check_conv2d(const char* kernel, const Tensor& x, const char* x_name, const Tensor& w,
                        const char* w_name, const Conv2dParams& p) {
  require_rank(kernel, x_name, x, 4);
  require_rank(kernel, w_name, w, 4);
  if (p.stride_h < 1 || p.stride_w < 1 || p.pad_h < 0 || p.pad_w < 0) {
    fail(kernel, "invalid parameters ({}): strides must be >= 1 and pads >= 0 ({} {}, {} {})",
         conv2d_params_str(p), x_name, x.desc(), w_name, w.desc());
  }
  Conv2dDims g{};
  g.n = x.shape()[0];
  g.ci = x.shape()[1];
  g.h = x.shape()[2];
  g.w = x.shape()[3];
  g.co = w.shape()[0];
  g.kh = w.shape()[2];
  g.kw = w.shape()[3];
  if (w.shape()[1] != g.ci) {
    fail(kernel, "channels differ: {} {} has {} input channels but {} {} expects {}", x_name,
         x.desc(), g.ci, w_name, w.desc(), w.shape()[1]);
  }
  if (g.h + 2 * p.pad_h < g.kh || g.w + 2 * p.pad_w < g.kw) {
    fail(kernel, "kernel of {} {} is larger than the padded input {} {} ({})", w_name, w.desc(),
         x_name, x.desc(), conv2d_params_str(p));
  }
  g.oh = window_out_extent(g.h, g.kh, p.stride_h, p.pad_h);
  g.ow = window_out_extent(g.w, g.kw, p.stride_w, p.pad_w);
  return g;
}

void check_permute(const Tensor& x, const Tensor& y, const std::vector<int>& perm) {
  const char* K = "permute";
  require_defined(K, "x", x);
  require_defined(K, "y", y);
  require_same_dtype(K, "x", x, "y", y);
  const int rank = x.rank();
  const std::string perm_str = fmt::format("[{}]", fmt::join(perm, ", "));
  if (static_cast<int>(perm.size()) != rank) {
    fail(K, "perm {} has {} entries for x {} of rank {}", perm_str, perm.size(), x.desc(), rank);
  }
  std::vector<bool> seen(static_cast<size_t>(rank), false);
  for (int a : perm) {
    if (a < 0 || a >= rank || seen[static_cast<size_t>(a)]) {
      fail(K, "perm {} is not a permutation of the axes of x {}", perm_str, x.desc());
    }
    seen[static_cast<size_t>(a)] = true;
  }
  std::vector<int64_t> want(static_cast<size_t>(rank));
  for (int i = 0; i < rank; ++i) {
    want[static_cast<size_t>(i)] = x.shape()[perm[static_cast<size_t>(i)]];
  }
  if (!(y.shape() == Shape(want))) {
    fail(K, "y is {}, expected shape {} for x {} and perm {}", y.desc(), Shape(want).str(),
         x.desc(), perm_str);
  }
}

std::string pool2d_params_str(const Pool2dParams& p) {
  return fmt::format("kernel {}x{}, stride {}x{}, pad {}x{}", p.kernel_h, p.kernel_w, p.stride_h,
                     p.stride_w, p.pad_h, p.pad_w);
}

Shape max_pool2d_out_shape(const Tensor& x, const Pool2dParams& p) {
  const char* K = "max_pool2d";
  if (p.kernel_h < 1 || p.kernel_w < 1 || p.stride_h < 1 || p.stride_w < 1 || p.pad_h < 0 ||
      p.pad_w < 0 || p.pad_h >= p.kernel_h || p.pad_w >= p.kernel_w) {
    fail(K, "invalid parameters ({}) for x {}: need kernel, stride >= 1 and 0 <= pad < kernel",
         pool2d_params_str(p), x.desc());
  }
  const int64_t n = x.shape()[0], c = x.shape()[1], h = x.shape()[2], w = x.shape()[3];
  if (h + 2 * p.pad_h < p.kernel_h || w + 2 * p.pad_w < p.kernel_w) {
    fail(K, "window ({}) is larger than the padded input x {}", pool2d_params_str(p), x.desc());
  }
  return Shape{n, c, window_out_extent(h, p.kernel_h, p.stride_h, p.pad_h),
               window_out_extent(w, p.kernel_w, p.stride_w, p.pad_w)};
}

void check_pool2d_output(const Tensor& x, const Tensor& y, const Shape& want,
                         const Pool2dParams& p) {
  if (!(y.shape() == want)) {
    fail("max_pool2d", "y is {}, expected shape {} for x {} ({})", y.desc(), want.str(), x.desc(),
         pool2d_params_str(p));
  }
}

int64_t check_row_ptr(const char* kernel, const Tensor& row_ptr, int64_t e) {
  require_defined(kernel, "row_ptr", row_ptr);
  if (row_ptr.dtype() != DType::i32) fail(kernel, "row_ptr {} must be i32", row_ptr.desc());
  require_rank(kernel, "row_ptr", row_ptr, 1);
  const int64_t n = row_ptr.shape()[0] - 1;
  if (n < 0) fail(kernel, "row_ptr {} must have at least one entry (rows + 1)", row_ptr.desc());
  const int32_t* rp = row_ptr.data<int32_t>();
  if (rp[0] != 0) fail(kernel, "row_ptr[0] is {}, expected 0", rp[0]);
  for (int64_t i = 0; i < n; ++i) {
    if (rp[i + 1] < rp[i]) {
      fail(kernel, "row_ptr decreases at row {}: row_ptr[{}] = {} < row_ptr[{}] = {}", i, i + 1,
           rp[i + 1], i, rp[i]);
    }
  }
  if (rp[n] != e) fail(kernel, "row_ptr[{}] = {} but there are {} entries", n, rp[n], e);
  return n;
}

CsrDims check_csr(const char* kernel, const Tensor& row_ptr, const Tensor& col_idx, const Tensor& w,
                  int64_t m, DType value_dtype) {
  require_defined(kernel, "col_idx", col_idx);
  if (col_idx.dtype() != DType::i32) fail(kernel, "col_idx {} must be i32", col_idx.desc());
  require_rank(kernel, "col_idx", col_idx, 1);
  CsrDims d;
  d.m = m;
  d.e = col_idx.shape()[0];
  d.n = check_row_ptr(kernel, row_ptr, d.e);
  const int32_t* ci = col_idx.data<int32_t>();
  for (int64_t k = 0; k < d.e; ++k) {
    if (ci[k] < 0 || ci[k] >= m) {
      fail(kernel, "col_idx[{}] = {} is out of range [0, {})", k, ci[k], m);
    }
  }
  if (w.defined()) {
    require_shape(kernel, "w", w, Shape{d.e});
    if (w.dtype() != value_dtype) {
      fail(kernel, "w {} must have the dense operand's dtype {}", w.desc(),
           dtype_name(value_dtype));
    }
  }
  return d;
}

}  // namespace mt
