// Argument checks and dtype dispatch shared by the reference backend's source
// files (internal to src/meshtrain/tensor/backends/reference). Every check
// throws mt::ShapeError whose message starts with the kernel's name and shows
// the offending tensors as dtype[shape].
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>

#include "meshtrain/base/error.h"
#include "meshtrain/tensor/tensor.h"

namespace mt::reference {

template <class... Args>
[[noreturn]] void fail(const char* kernel, fmt::format_string<Args...> f, Args&&... args) {
  throw ShapeError(std::string(kernel) + ": " + fmt::format(f, std::forward<Args>(args)...));
}

inline void require_defined(const char* kernel, const char* name, const Tensor& t) {
  if (!t.defined()) fail(kernel, "{} is undefined", name);
}

// f32 or f64: the dtypes every reference float kernel computes in.
inline void require_f32_f64(const char* kernel, const char* name, const Tensor& t) {
  require_defined(kernel, name, t);
  if (t.dtype() != DType::f32 && t.dtype() != DType::f64) {
    fail(kernel, "{} {} has an unsupported dtype (expected f32 or f64)", name, t.desc());
  }
}

inline void require_i32(const char* kernel, const char* name, const Tensor& t) {
  require_defined(kernel, name, t);
  if (t.dtype() != DType::i32) fail(kernel, "{} {} must be i32", name, t.desc());
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

// Checks that `t` is f32/f64, has `ref`'s dtype and `ref`'s shape.
inline void require_like(const char* kernel, const char* name, const Tensor& t,
                         const char* ref_name, const Tensor& ref) {
  require_defined(kernel, name, t);
  require_same_dtype(kernel, ref_name, ref, name, t);
  require_same_shape(kernel, ref_name, ref, name, t);
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

// Calls f(float{}) or f(double{}) for an f32/f64 dtype (checked earlier).
template <class F>
void dispatch_f32_f64(DType t, F&& f) {
  if (t == DType::f64) {
    f(double{});
  } else {
    MT_CHECK(t == DType::f32, "reference kernel dispatched on {}", dtype_name(t));
    f(float{});
  }
}

// Element i of a float buffer as double, for every float storage type.
template <class T>
double load(const T* p, int64_t i) {
  if constexpr (std::is_same_v<T, bf16>) {
    return bf16_to_f32(p[i]);
  } else if constexpr (std::is_same_v<T, f16>) {
    return f16_to_f32(p[i]);
  } else {
    return static_cast<double>(p[i]);
  }
}

}  // namespace mt::reference
