// Kernel argument checks shared by every KernelBackend implementation (the
// reference and fast backends), so one kernel rejects bad arguments with the
// same ShapeError text whichever backend runs it. Each check throws
// mt::ShapeError whose message starts with the kernel's name and shows the
// offending tensors as dtype[shape]. Checks of dtype rules that differ
// between backends stay in the backends. Stateless; never blocks.
#pragma once

#include <compare>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/base/error.h"
#include "meshtrain/tensor/backend.h"
#include "meshtrain/tensor/tensor.h"

namespace mt {

template <class... Args>
[[noreturn]] void fail(const char* kernel, fmt::format_string<Args...> f, Args&&... args) {
  throw ShapeError(std::string(kernel) + ": " + fmt::format(f, std::forward<Args>(args)...));
}

inline void require_defined(const char* kernel, const char* name, const Tensor& t) {
  if (!t.defined()) fail(kernel, "{} is undefined", name);
}

inline void require_same_dtype(const char* kernel, const char* na, const Tensor& a, const char* nb,
                               const Tensor& b) {
  if (a.dtype() != b.dtype()) {
    fail(kernel, "dtypes differ: {} {} vs {} {}", na, a.desc(), nb, b.desc());
  }
}

inline void require_same_shape(const char* kernel, const char* na, const Tensor& a, const char* nb,
                               const Tensor& b) {
  if (!(a.shape() == b.shape())) {
    fail(kernel, "shapes differ: {} {} vs {} {}", na, a.desc(), nb, b.desc());
  }
}

inline void require_shape(const char* kernel, const char* name, const Tensor& t,
                          const Shape& want) {
  if (!(t.shape() == want)) {
    fail(kernel, "{} is {}, expected shape {}", name, t.desc(), want.str());
  }
}

inline void require_rank(const char* kernel, const char* name, const Tensor& t, int rank) {
  if (t.rank() != rank) fail(kernel, "{} {} must have rank {}", name, t.desc(), rank);
}

// True when b's shape equals the trailing b.rank() dims of a's shape.
inline bool is_suffix(const Shape& b, const Shape& a) {
  if (b.rank() > a.rank()) return false;
  const int off = a.rank() - b.rank();
  for (int i = 0; i < b.rank(); ++i) {
    if (b[i] != a[off + i]) return false;
  }
  return true;
}

// Sizes of one matmul c = op(a) op(b): op(a) is [m, k] (batch of them when
// a is rank 3), op(b) [k, n]; shared_b when a rank-2 b serves every batch entry.
struct MatmulDims {
  int64_t batch = 1, m = 0, n = 0, k = 0;
  bool shared_b = false;
};

// Validates a's and b's ranks, batch sizes and inner dimensions.
MatmulDims matmul_dims(const Tensor& a, const Tensor& b, const MatmulParams& p);

// matmul_dims plus c's shape. Callers check dtypes (their rules differ) first.
MatmulDims check_matmul(const Tensor& a, const Tensor& b, const Tensor& c, const MatmulParams& p);

// Sizes of one convolution: x [n, ci, h, w], w [co, ci, kh, kw], y [n, co, oh, ow].
struct Conv2dDims {
  int64_t n, ci, h, w, co, kh, kw, oh, ow;
  auto operator<=>(const Conv2dDims&) const = default;
};

// "stride SHxSW, pad PHxPW", for messages.
std::string conv2d_params_str(const Conv2dParams& p);

// Output extent of a window of `k` sliding over `in` padded by `pad` on both sides.
inline int64_t window_out_extent(int64_t in, int64_t k, int64_t stride, int64_t pad) {
  return (in + 2 * pad - k) / stride + 1;
}

// Validates a convolution's data and weight shapes and parameters; x/w are
// whichever tensors carry the data ([N,Ci,H,W]) and weight ([O,Ci,KH,KW])
// shapes in the calling kernel, x_name/w_name their names there.
Conv2dDims check_conv2d(const char* kernel, const Tensor& x, const char* x_name, const Tensor& w,
                        const char* w_name, const Conv2dParams& p);

// Validates permute(x, y, perm): both defined with one dtype, perm a
// permutation of x's axes and y shaped as x's dims taken in perm's order.
void check_permute(const Tensor& x, const Tensor& y, const std::vector<int>& perm);

// "kernel 2x2, stride 2x2, pad 0x0"
std::string pool2d_params_str(const Pool2dParams& p);
// max_pool2d: validates the window parameters against x [N, C, H, W] (rank
// already checked) and returns the output shape [N, C, OH, OW]. The caller
// checks dtypes and compares y / argmax with the result (check_pool2d_output).
Shape max_pool2d_out_shape(const Tensor& x, const Pool2dParams& p);
// y must have shape `want` (ShapeError naming x and the window otherwise).
void check_pool2d_output(const Tensor& x, const Tensor& y, const Shape& want,
                         const Pool2dParams& p);

// Sizes of one sparse (CSR) operand A [n, m] with e entries.
struct CsrDims {
  int64_t n = 0, m = 0, e = 0;
};

// Validates a CSR operand (backend.h's "sparse" section): row_ptr i32 [n+1]
// starting at 0, non-decreasing and ending at e; col_idx i32 [e] with every
// entry in [0, m); w undefined or [e] of dtype `value_dtype`. Throws
// ShapeError naming the kernel, the field and the first bad position.
CsrDims check_csr(const char* kernel, const Tensor& row_ptr, const Tensor& col_idx, const Tensor& w,
                  int64_t m, DType value_dtype);
// row_ptr alone (for kernels over edge values only): returns the row count n.
int64_t check_row_ptr(const char* kernel, const Tensor& row_ptr, int64_t e);

}  // namespace mt
