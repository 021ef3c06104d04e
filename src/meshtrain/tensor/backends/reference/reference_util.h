// Reference-only argument checks (its f32/f64 dtype rules) and dtype dispatch
// shared by the reference backend's source files (internal to
// src/meshtrain/tensor/backends/reference). The checks every backend shares
// live in meshtrain/tensor/kernel_checks.h; these throw the same
// mt::ShapeError form.
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>

#include "meshtrain/base/error.h"
#include "meshtrain/tensor/kernel_checks.h"
#include "meshtrain/tensor/tensor.h"

namespace mt::reference {

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

// Checks that `t` is f32/f64, has `ref`'s dtype and `ref`'s shape.
inline void require_like(const char* kernel, const char* name, const Tensor& t,
                         const char* ref_name, const Tensor& ref) {
  require_defined(kernel, name, t);
  require_same_dtype(kernel, ref_name, ref, name, t);
  require_same_shape(kernel, ref_name, ref, name, t);
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
