// Element types. f64 exists for the reference backend, which the gradient
// checks run in double precision; fast kernels work in f32, bf16 and f16.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace mt {

enum class DType : uint8_t { f32, f64, bf16, f16, i32, i64, u8 };

size_t dtype_size(DType t);
std::string_view dtype_name(DType t);
// Parses "f32", "bf16", ...; throws ConfigError naming the text otherwise.
DType parse_dtype(std::string_view name);
inline bool is_float(DType t) {
  return t == DType::f32 || t == DType::f64 || t == DType::bf16 || t == DType::f16;
}

// 16-bit float storage types; arithmetic happens in f32 after conversion.
struct bf16 {
  uint16_t bits;
};
struct f16 {
  uint16_t bits;
};

float bf16_to_f32(bf16 v);
bf16 f32_to_bf16(float v);  // round to nearest even, NaN preserved
float f16_to_f32(f16 v);
f16 f32_to_f16(float v);  // round to nearest even, overflow to inf

template <class T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() {
  return DType::f32;
}
template <>
constexpr DType dtype_of<double>() {
  return DType::f64;
}
template <>
constexpr DType dtype_of<bf16>() {
  return DType::bf16;
}
template <>
constexpr DType dtype_of<f16>() {
  return DType::f16;
}
template <>
constexpr DType dtype_of<int32_t>() {
  return DType::i32;
}
template <>
constexpr DType dtype_of<int64_t>() {
  return DType::i64;
}
template <>
constexpr DType dtype_of<uint8_t>() {
  return DType::u8;
}

// Calls f(T{}) with the storage type of `t` (bf16 and f16 as mt::bf16 /
// mt::f16), for code that handles every dtype with one template.
template <class F>
void visit_dtype(DType t, F&& f) {
  switch (t) {
    case DType::f32:
      f(float{});
      return;
    case DType::f64:
      f(double{});
      return;
    case DType::bf16:
      f(bf16{});
      return;
    case DType::f16:
      f(f16{});
      return;
    case DType::i32:
      f(int32_t{});
      return;
    case DType::i64:
      f(int64_t{});
      return;
    case DType::u8:
      f(uint8_t{});
      return;
  }
}

}  // namespace mt
