// Fast element-wise kernels: activations and their derivatives, broadcast
// binary ops, scale and sum_to.
#include <vector>

#include "meshtrain/tensor/backends/fast/fast_common.h"
#include "meshtrain/tensor/backends/fast/fast_kernels.h"
#include "meshtrain/tensor/backends/fast/simd.h"

namespace mt::fast {

namespace {

constexpr float kGeluC = 0.044715f;
constexpr float kSqrt2OverPi = 0.7978845608028654f;

// The activations are written so that no intermediate cancels: gelu uses
// 0.5 (1 + tanh u) = sigmoid(2u), and the derivatives use e^{-|x|} forms.
// Forced inline: with a loop per storage type, GCC would otherwise call these
// out of line, passing vectors through memory (about 2x slower).
template <UnaryOp OP>
[[gnu::always_inline]] inline VecF unary_value(VecF x) {
  const VecF one = VecF::set1(1.0f);
  if constexpr (OP == UnaryOp::relu) {
    return select(lt(x, VecF::zero()), VecF::zero(), x);
  } else if constexpr (OP == UnaryOp::gelu) {
    const VecF u = VecF::set1(kSqrt2OverPi) * x * fma(VecF::set1(kGeluC), x * x, one);
    return x / (one + exp(VecF::set1(-2.0f) * u));
  } else if constexpr (OP == UnaryOp::tanh) {
    return tanh(x);
  } else {
    return sigmoid(x);
  }
}

template <UnaryOp OP>
[[gnu::always_inline]] inline VecF unary_derivative(VecF x) {
  const VecF one = VecF::set1(1.0f);
  if constexpr (OP == UnaryOp::relu) {
    return select(gt(x, VecF::zero()), one, VecF::zero());
  } else if constexpr (OP == UnaryOp::gelu) {
    // Beyond |x| = 10 gelu' is 0 or 1 to float precision; clamping there keeps
    // x^2 finite. (x - x) + 1 is 1, or NaN for an infinite x, whose derivative
    // the reference's formula makes NaN (inf * 0).
    const VecF xc = min_nan(VecF::set1(10.0f), max_nan(VecF::set1(-10.0f), x));
    const VecF x2 = xc * xc;
    const VecF u = VecF::set1(kSqrt2OverPi) * xc * fma(VecF::set1(kGeluC), x2, one);
    const VecF du = VecF::set1(kSqrt2OverPi) * fma(VecF::set1(3.0f * kGeluC), x2, one);
    // s = sigmoid(2u) = 0.5 (1 + tanh u) and e s = 1 - s.
    const VecF e = exp(VecF::set1(-2.0f) * u);
    const VecF s = one / (one + e);
    const VecF d = s * fma((xc + xc) * (e * s), du, one);
    return d * ((x - x) + one);
  } else if constexpr (OP == UnaryOp::tanh) {
    // 1 - tanh^2 = 4 e / (1 + e)^2 with e = e^{-2|x|}.
    const VecF ax = abs(x);
    const VecF e = exp(VecF::zero() - (ax + ax));
    const VecF d = one + e;
    return VecF::set1(4.0f) * e / (d * d);
  } else {
    // sigmoid' = e s^2 with e = e^{-|x|}, s = 1 / (1 + e) (symmetric in x).
    const VecF e = exp(VecF::zero() - abs(x));
    const VecF s = one / (one + e);
    return e * s * s;
  }
}

template <class F>
void dispatch_unary(UnaryOp op, F&& f) {
  switch (op) {
    case UnaryOp::relu:
      f(std::integral_constant<UnaryOp, UnaryOp::relu>{});
      return;
    case UnaryOp::gelu:
      f(std::integral_constant<UnaryOp, UnaryOp::gelu>{});
      return;
    case UnaryOp::tanh:
      f(std::integral_constant<UnaryOp, UnaryOp::tanh>{});
      return;
    case UnaryOp::sigmoid:
      f(std::integral_constant<UnaryOp, UnaryOp::sigmoid>{});
      return;
  }
  MT_CHECK(false, "unknown UnaryOp {}", static_cast<int>(op));
}

template <BinaryOp OP>
[[gnu::always_inline]] inline VecF binary_value(VecF a, VecF b) {
  if constexpr (OP == BinaryOp::add) return a + b;
  if constexpr (OP == BinaryOp::sub) return a - b;
  if constexpr (OP == BinaryOp::mul) return a * b;
  if constexpr (OP == BinaryOp::div) return a / b;
}

template <class F>
void dispatch_binary(BinaryOp op, F&& f) {
  switch (op) {
    case BinaryOp::add:
      f(std::integral_constant<BinaryOp, BinaryOp::add>{});
      return;
    case BinaryOp::sub:
      f(std::integral_constant<BinaryOp, BinaryOp::sub>{});
      return;
    case BinaryOp::mul:
      f(std::integral_constant<BinaryOp, BinaryOp::mul>{});
      return;
    case BinaryOp::div:
      f(std::integral_constant<BinaryOp, BinaryOp::div>{});
      return;
  }
  MT_CHECK(false, "unknown BinaryOp {}", static_cast<int>(op));
}

// Rows of this many elements are summed in f32 before being added to the f64
// totals: vector speed, with rounding error bounded by the block length.
constexpr int64_t kSumBlockRows = 64;

}  // namespace

namespace {

// x is f32, bf16 or f16 (the storage types these kernels load and store; they
// compute in f32), `like` has its dtype and shape.
void require_storage(const char* kernel, const char* name, const Tensor& t) {
  require_defined(kernel, name, t);
  if (t.dtype() != DType::f32 && t.dtype() != DType::bf16 && t.dtype() != DType::f16) {
    fail(kernel, "{} {} has an unsupported dtype (expected f32, bf16 or f16)", name, t.desc());
  }
}
void require_like(const char* kernel, const char* name, const Tensor& t, const char* ref_name,
                  const Tensor& ref) {
  require_defined(kernel, name, t);
  require_same_dtype(kernel, ref_name, ref, name, t);
  require_same_shape(kernel, ref_name, ref, name, t);
}

inline float to_float(float v) {
  return v;
}
inline float to_float(bf16 v) {
  return bf16_to_f32(v);
}
inline float to_float(f16 v) {
  return f16_to_f32(v);
}

// Calls f(float{}), f(bf16{}) or f(f16{}) for an f32 / bf16 / f16 dtype
// (checked earlier).
template <class F>
void visit_storage(DType t, F&& f) {
  if (t == DType::bf16) {
    f(bf16{});
  } else if (t == DType::f16) {
    f(f16{});
  } else {
    f(float{});
  }
}

}  // namespace

void unary(UnaryOp op, const Tensor& x, Tensor& y, int threads) {
  const char* K = "unary";
  require_storage(K, "x", x);
  require_like(K, "y", y, "x", x);
  visit_storage(x.dtype(), [&](auto st) {
    using T = decltype(st);
    const T* px = x.data<T>();
    T* py = y.data<T>();
    dispatch_unary(op, [&](auto tag) {
      parallel_for(x.numel(), kMinElemsPerThread, threads, [&](int64_t b, int64_t e) {
        vec_loop(e - b, [&](int64_t i, int64_t n) {
          unary_value<decltype(tag)::value>(VecF::load(px + b + i, n)).store(py + b + i, n);
        });
      });
    });
  });
}

void unary_backward(UnaryOp op, const Tensor& x, const Tensor& y, const Tensor& dy, Tensor& dx,
                    int threads) {
  const char* K = "unary_backward";
  require_storage(K, "x", x);
  if (y.defined()) require_like(K, "y", y, "x", x);
  require_like(K, "dy", dy, "x", x);
  require_like(K, "dx", dx, "x", x);
  visit_storage(x.dtype(), [&](auto st) {
    using T = decltype(st);
    const T* px = x.data<T>();
    const T* pdy = dy.data<T>();
    T* pdx = dx.data<T>();
    dispatch_unary(op, [&](auto tag) {
      parallel_for(x.numel(), kMinElemsPerThread, threads, [&](int64_t b, int64_t e) {
        vec_loop(e - b, [&](int64_t i, int64_t n) {
          const VecF d = unary_derivative<decltype(tag)::value>(VecF::load(px + b + i, n));
          (VecF::load(pdy + b + i, n) * d).store(pdx + b + i, n);
        });
      });
    });
  });
}

void binary(BinaryOp op, const Tensor& a, const Tensor& b, Tensor& c, int threads) {
  const char* K = "binary";
  require_storage(K, "a", a);
  require_defined(K, "b", b);
  if (b.dtype() != a.dtype()) fail(K, "dtypes differ: a {} vs b {}", a.desc(), b.desc());
  require_like(K, "c", c, "a", a);
  const int64_t nb = b.numel();
  if (nb != 1 && !is_suffix(b.shape(), a.shape())) {
    fail(K, "b {} is neither a scalar nor a suffix of a {}", b.desc(), a.desc());
  }
  const int64_t n = a.numel();
  if (n == 0) return;
  visit_storage(a.dtype(), [&](auto st) {
    using T = decltype(st);
    const T* pa = a.data<T>();
    const T* pb = b.data<T>();
    T* pc = c.data<T>();
    dispatch_binary(op, [&](auto tag) {
      constexpr BinaryOp OP = decltype(tag)::value;
      if (nb == 1 || nb == n) {
        // A scalar b is read once, before any write: c may alias b.
        const VecF b0 = VecF::set1(to_float(pb[0]));
        parallel_for(n, kMinElemsPerThread, threads, [&](int64_t lo, int64_t hi) {
          vec_loop(hi - lo, [&](int64_t i, int64_t cnt) {
            const VecF bv = nb == 1 ? b0 : VecF::load(pb + lo + i, cnt);
            binary_value<OP>(VecF::load(pa + lo + i, cnt), bv).store(pc + lo + i, cnt);
          });
        });
        return;
      }
      // b is a suffix of a's shape: a is [rows, nb] and b broadcasts over rows.
      parallel_for(n / nb, row_grain(nb), threads, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const T* ar = pa + r * nb;
          T* cr = pc + r * nb;
          vec_loop(nb, [&](int64_t i, int64_t cnt) {
            binary_value<OP>(VecF::load(ar + i, cnt), VecF::load(pb + i, cnt)).store(cr + i, cnt);
          });
        }
      });
    });
  });
}

void scale(const Tensor& x, Tensor& y, double alpha, double beta, int threads) {
  const char* K = "scale";
  require_dtype(K, "x", x, DType::f32);
  require_f32_like(K, "y", y, "x", x);
  const float* px = x.data<float>();
  float* py = y.data<float>();
  const VecF va = VecF::set1(static_cast<float>(alpha));
  const VecF vb = VecF::set1(static_cast<float>(beta));
  parallel_for(x.numel(), kMinElemsPerThread, threads, [&](int64_t lo, int64_t hi) {
    vec_loop(hi - lo, [&](int64_t i, int64_t n) {
      const VecF xv = VecF::load(px + lo + i, n);
      // beta == 0 means y is write-only: garbage in y must not leak in.
      const VecF r = beta == 0.0 ? va * xv : fma(va, xv, vb * VecF::load(py + lo + i, n));
      r.store(py + lo + i, n);
    });
  });
}

void sum_to(const Tensor& x, Tensor& y, int threads) {
  const char* K = "sum_to";
  require_storage(K, "x", x);
  require_storage(K, "y", y);
  // y has x's dtype, or is f32 for a 16-bit x (a bias gradient kept wide).
  if (y.dtype() != x.dtype() && y.dtype() != DType::f32) {
    fail(K, "dtypes differ: x {} vs y {} (y must be x's dtype or f32)", x.desc(), y.desc());
  }
  const int64_t ny = y.numel();
  if (ny != 1 && !is_suffix(y.shape(), x.shape())) {
    fail(K, "y {} is neither a scalar nor a suffix of x {}", y.desc(), x.desc());
  }
  if (ny == 0) return;
  visit_storage(x.dtype(), [&](auto st) {
    using T = decltype(st);
    const T* px = x.data<T>();
    // A scalar y sums x viewed as rows of kWidth * 64 elements (then across the
    // row); otherwise x is [rows, ny].
    const int64_t n = x.numel();
    const int64_t cols =
        ny == 1 ? std::min<int64_t>(std::max<int64_t>(n, 1), VecF::kWidth * 64) : ny;
    const int64_t rows = n / cols;
    const int64_t rest = n - rows * cols;  // only for a scalar y
    const int chunks =
        static_cast<int>(std::min<int64_t>(threads, std::max<int64_t>(1, rows / row_grain(cols))));
    std::vector<double> partial(static_cast<size_t>(chunks * cols), 0.0);
    parallel_for(chunks, 1, chunks, [&](int64_t c0, int64_t c1) {
      std::vector<float> block(static_cast<size_t>(cols));
      for (int64_t c = c0; c < c1; ++c) {
        double* acc = partial.data() + c * cols;
        const int64_t r_end = rows * (c + 1) / chunks;
        for (int64_t r = rows * c / chunks; r < r_end; r += kSumBlockRows) {
          const int64_t r_stop = std::min(r_end, r + kSumBlockRows);
          vec_loop(cols, [&](int64_t j, int64_t cnt) {
            VecF s = VecF::zero();
            for (int64_t q = r; q < r_stop; ++q) s = s + VecF::load(px + q * cols + j, cnt);
            s.store(block.data() + j, cnt);
          });
          for (int64_t j = 0; j < cols; ++j) acc[j] += block[static_cast<size_t>(j)];
        }
      }
    });
    std::vector<float> totals(static_cast<size_t>(ny));
    if (ny == 1) {
      double total = 0.0;
      for (double v : partial) total += v;
      for (int64_t i = n - rest; i < n; ++i) total += to_float(px[i]);
      totals[0] = static_cast<float>(total);
    } else {
      for (int64_t j = 0; j < ny; ++j) {
        double total = 0.0;
        for (int c = 0; c < chunks; ++c) total += partial[static_cast<size_t>(c * ny + j)];
        totals[static_cast<size_t>(j)] = static_cast<float>(total);
      }
    }
    visit_storage(y.dtype(), [&](auto yt) {
      using Y = decltype(yt);
      Y* py = y.data<Y>();
      vec_loop(ny, [&](int64_t j, int64_t cnt) {
        VecF::load(totals.data() + j, cnt).store(py + j, cnt);
      });
    });
  });
}

}  // namespace mt::fast
