// Shared by the comm tests (local grid and MPI): deterministic per-rank
// inputs whose reductions are exact small integers, and checks that throw
// with the first wrong element (so a failing rank thread stops its world).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <fmt/format.h>

#include "meshtrain/comm/options.h"
#include "meshtrain/tensor/tensor.h"

namespace mt::test {

// Rank r's element i: small integers (exact in every dtype and in sums of up
// to 8 ranks), negative ones included. 16-bit floats stay within +-10.
inline double input_value(DType t, int r, size_t i, size_t salt = 0) {
  if (t == DType::bf16 || t == DType::f16) {
    return static_cast<double>(static_cast<int64_t>((r * 3 + i + salt) % 16) - 5);
  }
  return static_cast<double>(static_cast<int64_t>((r * 131 + i * 7 + salt) % 1021) - 300);
}

inline std::vector<std::byte> make_buffer(DType t, size_t count) {
  return std::vector<std::byte>(count * dtype_size(t) + 1);  // +1: never a null data()
}

// Calls f(T{}) with the storage type of `t` (tensor/dtype.h).
template <class F>
void visit_storage(DType t, F&& f) {
  visit_dtype(t, std::forward<F>(f));
}

template <class T>
inline T to_storage(double v) {
  if constexpr (std::is_same_v<T, bf16>)
    return f32_to_bf16(static_cast<float>(v));
  else if constexpr (std::is_same_v<T, f16>)
    return f32_to_f16(static_cast<float>(v));
  else
    return static_cast<T>(v);
}

template <class T>
inline double from_storage(T v) {
  if constexpr (std::is_same_v<T, bf16>)
    return bf16_to_f32(v);
  else if constexpr (std::is_same_v<T, f16>)
    return f16_to_f32(v);
  else
    return static_cast<double>(v);
}

inline void fill_input(std::vector<std::byte>& buf, DType t, size_t count, int r,
                       size_t first_index = 0, size_t salt = 0) {
  visit_storage(t, [&](auto tag) {
    using T = decltype(tag);
    T* p = reinterpret_cast<T*>(buf.data());
    for (size_t i = 0; i < count; ++i)
      p[i] = to_storage<T>(input_value(t, r, first_index + i, salt));
  });
}

inline double read_value(const std::vector<std::byte>& buf, DType t, size_t i) {
  double v = 0;
  visit_storage(t, [&](auto tag) {
    using T = decltype(tag);
    v = from_storage(reinterpret_cast<const T*>(buf.data())[i]);
  });
  return v;
}

// The reduction over ranks 0..n-1 of input_value(t, r, i, salt).
inline double reduced_value(DType t, ReduceOp op, int n, size_t i, size_t salt = 0) {
  double acc = input_value(t, 0, i, salt);
  for (int r = 1; r < n; ++r) {
    const double v = input_value(t, r, i, salt);
    if (op == ReduceOp::max)
      acc = std::max(acc, v);
    else if (op == ReduceOp::min)
      acc = std::min(acc, v);
    else
      acc += v;
  }
  if (op == ReduceOp::avg) {
    if (t == DType::i32 || t == DType::i64 || t == DType::u8) {
      acc = static_cast<double>(static_cast<int64_t>(acc) / n);  // truncation toward zero
    } else {
      acc /= n;
    }
  }
  return acc;
}

// Relative tolerance of one rounding to `t` (exact dtypes: 0).
inline double tolerance(DType t) {
  switch (t) {
    case DType::f32:
      return 1e-6;
    case DType::f64:
      return 1e-12;
    case DType::bf16:
      return 1.0 / 128;
    case DType::f16:
      return 1.0 / 1024;
    default:
      return 0;
  }
}

// Throws std::runtime_error naming `what` and the first element that is off.
template <class Expected>
void check_values(const std::string& what, const std::vector<std::byte>& buf, DType t, size_t count,
                  Expected&& expected, double rel_tol = -1) {
  const double tol = rel_tol >= 0 ? rel_tol : tolerance(t);
  visit_storage(t, [&](auto tag) {
    using T = decltype(tag);
    const T* p = reinterpret_cast<const T*>(buf.data());
    for (size_t i = 0; i < count; ++i) {
      const double want = expected(i);
      const double got = from_storage(p[i]);
      if (std::abs(got - want) > tol * std::max(1.0, std::abs(want))) {
        throw std::runtime_error(
            fmt::format("{}: element {} of {} is {}, expected {}", what, i, count, got, want));
      }
    }
  });
}

}  // namespace mt::test
