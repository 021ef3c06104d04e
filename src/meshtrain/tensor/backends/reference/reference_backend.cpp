// Reference kernels: matmul and the element-wise / layout kernels.
#include "meshtrain/tensor/backends/reference/reference_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numbers>
#include <vector>

#include "meshtrain/tensor/backends/reference/reference_util.h"

namespace mt {

using namespace reference;

void ReferenceBackend::set_num_threads(int n) {
  if (n < 1) {
    throw ConfigError(fmt::format("reference backend: set_num_threads({}): need at least 1", n));
  }
}

// ---- matmul ----

namespace {

// The reference's dtype rules (f32/f64 in -> same out, bf16/f16 in -> f32
// out; a 16-bit out is handled by matmul() around this), then the shape checks
// every backend shares.
MatmulDims check_matmul_args(const Tensor& a, const Tensor& b, const Tensor& c,
                             const MatmulParams& p) {
  const char* K = "matmul";
  require_defined(K, "a", a);
  require_defined(K, "b", b);
  require_defined(K, "c", c);
  require_same_dtype(K, "a", a, "b", b);
  const DType in = a.dtype();
  if (!is_float(in)) fail(K, "a {} and b {} must be floating point", a.desc(), b.desc());
  const DType want_c = (in == DType::bf16 || in == DType::f16) ? DType::f32 : in;
  if (c.dtype() != want_c) {
    fail(K, "c {} must be {} for inputs a {} and b {}", c.desc(), dtype_name(want_c), a.desc(),
         b.desc());
  }
  return check_matmul(a, b, c, p);
}

// Copies op(src) of one batch entry into a row-major double matrix [rows, cols].
template <class T>
void load_operand(const T* src, bool trans, int64_t rows, int64_t cols, std::vector<double>& dst) {
  dst.resize(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t q = 0; q < cols; ++q) {
      dst[static_cast<size_t>(r * cols + q)] = load(src, trans ? q * rows + r : r * cols + q);
    }
  }
}

template <class In, class Out>
void matmul_typed(const Tensor& a, const Tensor& b, Tensor& c, const MatmulParams& p,
                  const MatmulDims& d) {
  const In* pa = static_cast<const In*>(a.raw());
  const In* pb = static_cast<const In*>(b.raw());
  Out* pc = static_cast<Out*>(c.raw());
  std::vector<double> am, bm, acc(static_cast<size_t>(d.n));
  for (int64_t bi = 0; bi < d.batch; ++bi) {
    load_operand(pa + bi * d.m * d.k, p.trans_a, d.m, d.k, am);
    if (bi == 0 || !d.shared_b) {
      load_operand(pb + (d.shared_b ? 0 : bi * d.k * d.n), p.trans_b, d.k, d.n, bm);
    }
    Out* cb = pc + bi * d.m * d.n;
    for (int64_t i = 0; i < d.m; ++i) {
      std::fill(acc.begin(), acc.end(), 0.0);
      // i-k-j order: the innermost loop runs along contiguous rows of bm.
      for (int64_t kk = 0; kk < d.k; ++kk) {
        const double aik = am[static_cast<size_t>(i * d.k + kk)];
        const double* brow = bm.data() + kk * d.n;
        for (int64_t j = 0; j < d.n; ++j) acc[static_cast<size_t>(j)] += aik * brow[j];
      }
      Out* crow = cb + i * d.n;
      for (int64_t j = 0; j < d.n; ++j) {
        double v = double{p.alpha} * acc[static_cast<size_t>(j)];
        // beta == 0 must not read c: it may hold uninitialised memory.
        if (p.beta != 0.0f) v += double{p.beta} * static_cast<double>(crow[j]);
        crow[j] = static_cast<Out>(v);
      }
    }
  }
}

}  // namespace

void ReferenceBackend::matmul(const Tensor& a, const Tensor& b, Tensor& c, const MatmulParams& p) {
  if (a.defined() && c.defined() && c.dtype() == a.dtype() &&
      (c.dtype() == DType::bf16 || c.dtype() == DType::f16)) {
    // A 16-bit product: accumulated in f32 as usual, rounded once at the end.
    Tensor wide = p.beta != 0.0f ? c.to(DType::f32) : Tensor::empty(c.shape(), DType::f32);
    matmul(a, b, wide, p);
    convert(wide, c);
    return;
  }
  const MatmulDims d = check_matmul_args(a, b, c, p);
  switch (a.dtype()) {
    case DType::f32:
      matmul_typed<float, float>(a, b, c, p, d);
      break;
    case DType::f64:
      matmul_typed<double, double>(a, b, c, p, d);
      break;
    case DType::bf16:
      matmul_typed<bf16, float>(a, b, c, p, d);
      break;
    case DType::f16:
      matmul_typed<f16, float>(a, b, c, p, d);
      break;
    default:
      MT_CHECK(false, "matmul: dtype {} passed the checks", dtype_name(a.dtype()));
  }
}

// ---- element-wise ----

namespace {

bool is_half(DType t) {
  return t == DType::bf16 || t == DType::f16;
}

// 16-bit floats: the kernel runs on f32 copies and each output is rounded
// once, which is the contract of the fast kernels too.
Tensor widened(const Tensor& t) {
  return t.defined() ? t.to(DType::f32) : Tensor();
}

// Runs f(w) with an f32 stand-in w for `out`, then rounds w into out.
template <class F>
void into_rounded(Tensor& out, F&& f) {
  Tensor w = Tensor::empty(out.shape(), DType::f32);
  f(w);
  convert(w, out);
}

constexpr double kGeluC = 0.044715;
const double kSqrt2OverPi = std::sqrt(2.0 / std::numbers::pi);

double unary_value(UnaryOp op, double x) {
  switch (op) {
    case UnaryOp::relu:
      return x < 0.0 ? 0.0 : x;
    case UnaryOp::gelu:
      return 0.5 * x * (1.0 + std::tanh(kSqrt2OverPi * (x + kGeluC * x * x * x)));
    case UnaryOp::tanh:
      return std::tanh(x);
    case UnaryOp::sigmoid:
      return 1.0 / (1.0 + std::exp(-x));
  }
  MT_CHECK(false, "unknown UnaryOp {}", static_cast<int>(op));
  return 0.0;
}

double unary_derivative(UnaryOp op, double x) {
  switch (op) {
    case UnaryOp::relu:
      return x > 0.0 ? 1.0 : 0.0;
    case UnaryOp::gelu: {
      const double t = std::tanh(kSqrt2OverPi * (x + kGeluC * x * x * x));
      const double du = kSqrt2OverPi * (1.0 + 3.0 * kGeluC * x * x);
      return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du;
    }
    case UnaryOp::tanh: {
      const double t = std::tanh(x);
      return 1.0 - t * t;
    }
    case UnaryOp::sigmoid: {
      const double s = 1.0 / (1.0 + std::exp(-x));
      return s * (1.0 - s);
    }
  }
  MT_CHECK(false, "unknown UnaryOp {}", static_cast<int>(op));
  return 0.0;
}

double binary_value(BinaryOp op, double a, double b) {
  switch (op) {
    case BinaryOp::add:
      return a + b;
    case BinaryOp::sub:
      return a - b;
    case BinaryOp::mul:
      return a * b;
    case BinaryOp::div:
      return a / b;
  }
  MT_CHECK(false, "unknown BinaryOp {}", static_cast<int>(op));
  return 0.0;
}

}  // namespace

void ReferenceBackend::unary(UnaryOp op, const Tensor& x, Tensor& y) {
  const char* K = "unary";
  if (x.defined() && is_half(x.dtype())) {
    require_like(K, "y", y, "x", x);
    into_rounded(y, [&](Tensor& w) { unary(op, widened(x), w); });
    return;
  }
  require_f32_f64(K, "x", x);
  require_like(K, "y", y, "x", x);
  dispatch_f32_f64(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    T* py = y.data<T>();
    for (int64_t i = 0; i < x.numel(); ++i) {
      py[i] = static_cast<T>(unary_value(op, static_cast<double>(px[i])));
    }
  });
}

void ReferenceBackend::unary_backward(UnaryOp op, const Tensor& x, const Tensor& y,
                                      const Tensor& dy, Tensor& dx) {
  const char* K = "unary_backward";
  if (x.defined() && is_half(x.dtype())) {
    if (y.defined()) require_like(K, "y", y, "x", x);
    require_like(K, "dy", dy, "x", x);
    require_like(K, "dx", dx, "x", x);
    into_rounded(dx,
                 [&](Tensor& w) { unary_backward(op, widened(x), widened(y), widened(dy), w); });
    return;
  }
  require_f32_f64(K, "x", x);
  if (y.defined()) require_like(K, "y", y, "x", x);
  require_like(K, "dy", dy, "x", x);
  require_like(K, "dx", dx, "x", x);
  dispatch_f32_f64(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    const T* pdy = dy.data<T>();
    T* pdx = dx.data<T>();
    for (int64_t i = 0; i < x.numel(); ++i) {
      const double g =
          static_cast<double>(pdy[i]) * unary_derivative(op, static_cast<double>(px[i]));
      pdx[i] = static_cast<T>(g);
    }
  });
}

void ReferenceBackend::binary(BinaryOp op, const Tensor& a, const Tensor& b, Tensor& c) {
  const char* K = "binary";
  if (a.defined() && is_half(a.dtype())) {
    require_defined(K, "b", b);
    require_same_dtype(K, "a", a, "b", b);
    require_like(K, "c", c, "a", a);
    into_rounded(c, [&](Tensor& w) { binary(op, widened(a), widened(b), w); });
    return;
  }
  require_f32_f64(K, "a", a);
  require_defined(K, "b", b);
  require_same_dtype(K, "a", a, "b", b);
  require_like(K, "c", c, "a", a);
  const int64_t nb = b.numel();
  if (nb != 1 && !is_suffix(b.shape(), a.shape())) {
    fail(K, "b {} is neither a scalar nor a suffix of a {}", b.desc(), a.desc());
  }
  dispatch_f32_f64(a.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* pa = a.data<T>();
    const T* pb = b.data<T>();
    T* pc = c.data<T>();
    // A suffix of a's shape repeats every nb elements of a's row-major order.
    for (int64_t i = 0; i < a.numel(); ++i) {
      pc[i] = static_cast<T>(
          binary_value(op, static_cast<double>(pa[i]), static_cast<double>(pb[i % nb])));
    }
  });
}

void ReferenceBackend::scale(const Tensor& x, Tensor& y, double alpha, double beta) {
  const char* K = "scale";
  require_f32_f64(K, "x", x);
  require_like(K, "y", y, "x", x);
  dispatch_f32_f64(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    T* py = y.data<T>();
    for (int64_t i = 0; i < x.numel(); ++i) {
      double v = alpha * static_cast<double>(px[i]);
      // As in matmul, beta == 0 means y is write-only.
      if (beta != 0.0) v += beta * static_cast<double>(py[i]);
      py[i] = static_cast<T>(v);
    }
  });
}

void ReferenceBackend::sum_to(const Tensor& x, Tensor& y) {
  const char* K = "sum_to";
  if (x.defined() && is_half(x.dtype())) {
    // y has x's dtype, or is f32 (a gradient kept wide).
    require_defined(K, "y", y);
    if (y.dtype() != x.dtype() && y.dtype() != DType::f32) {
      fail(K, "dtypes differ: x {} vs y {} (y must be x's dtype or f32)", x.desc(), y.desc());
    }
    into_rounded(y, [&](Tensor& w) { sum_to(widened(x), w); });
    return;
  }
  require_f32_f64(K, "x", x);
  require_defined(K, "y", y);
  require_same_dtype(K, "x", x, "y", y);
  const int64_t ny = y.numel();
  if (ny != 1 && !is_suffix(y.shape(), x.shape())) {
    fail(K, "y {} is neither a scalar nor a suffix of x {}", y.desc(), x.desc());
  }
  dispatch_f32_f64(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    T* py = y.data<T>();
    std::vector<double> acc(static_cast<size_t>(ny), 0.0);
    for (int64_t i = 0; i < x.numel(); ++i) acc[static_cast<size_t>(i % ny)] += px[i];
    for (int64_t j = 0; j < ny; ++j) py[j] = static_cast<T>(acc[static_cast<size_t>(j)]);
  });
}

void ReferenceBackend::cast(const Tensor& x, Tensor& y) {
  const char* K = "cast";
  require_defined(K, "x", x);
  require_defined(K, "y", y);
  require_same_shape(K, "x", x, "y", y);
  convert(x, y);
}

void ReferenceBackend::permute(const Tensor& x, Tensor& y, const std::vector<int>& perm) {
  check_permute(x, y, perm);
  const int rank = x.rank();
  const std::vector<int64_t>& want = y.shape().dims();
  if (x.numel() == 0) return;

  // Walk y in row-major order with a multi-index; src_stride[i] is the step in
  // x when y's index i grows by one.
  std::vector<int64_t> x_stride(static_cast<size_t>(rank), 1);
  for (int i = rank - 2; i >= 0; --i) {
    x_stride[static_cast<size_t>(i)] = x_stride[static_cast<size_t>(i + 1)] * x.shape()[i + 1];
  }
  std::vector<int64_t> src_stride(static_cast<size_t>(rank));
  for (int i = 0; i < rank; ++i) {
    src_stride[static_cast<size_t>(i)] =
        x_stride[static_cast<size_t>(perm[static_cast<size_t>(i)])];
  }
  const size_t es = dtype_size(x.dtype());
  const auto* src = static_cast<const unsigned char*>(x.raw());
  auto* dst = static_cast<unsigned char*>(y.raw());
  std::vector<int64_t> idx(static_cast<size_t>(rank), 0);
  int64_t off = 0;
  for (int64_t i = 0; i < y.numel(); ++i) {
    std::memcpy(dst + static_cast<size_t>(i) * es, src + static_cast<size_t>(off) * es, es);
    for (int d = rank - 1; d >= 0; --d) {
      const auto ud = static_cast<size_t>(d);
      if (++idx[ud] < want[ud]) {
        off += src_stride[ud];
        break;
      }
      off -= src_stride[ud] * (want[ud] - 1);
      idx[ud] = 0;
    }
  }
}

}  // namespace mt
