#include "meshtrain/comm/reduce.h"

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "meshtrain/base/error.h"

namespace mt::comm {
namespace {

// The conversions are inline here (not dtype.cpp's out-of-line ones) so the
// loops below vectorise; the rounding is the same: nearest-even, NaN kept.
inline float load_bf16(uint16_t bits) {
  return std::bit_cast<float>(uint32_t{bits} << 16);
}
inline uint16_t store_bf16(float v) {
  const uint32_t u = std::bit_cast<uint32_t>(v);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x40u;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}
inline float load_f16(uint16_t bits) {
  return static_cast<float>(std::bit_cast<_Float16>(bits));
}
inline uint16_t store_f16(float v) {
  return std::bit_cast<uint16_t>(static_cast<_Float16>(v));
}

// Storage type S is combined in accumulator type A. Integer sums use the
// unsigned type of the same width so that overflow wraps instead of being UB.
template <DType D>
struct Traits;
template <>
struct Traits<DType::f32> {
  using S = float;
  using A = float;
  static A load(S v) { return v; }
  static S store(A v) { return v; }
};
template <>
struct Traits<DType::f64> {
  using S = double;
  using A = double;
  static A load(S v) { return v; }
  static S store(A v) { return v; }
};
template <>
struct Traits<DType::bf16> {
  using S = uint16_t;
  using A = float;
  static A load(S v) { return load_bf16(v); }
  static S store(A v) { return store_bf16(v); }
};
template <>
struct Traits<DType::f16> {
  using S = uint16_t;
  using A = float;
  static A load(S v) { return load_f16(v); }
  static S store(A v) { return store_f16(v); }
};
template <>
struct Traits<DType::i32> {
  using S = int32_t;
  using A = int32_t;
  static A load(S v) { return v; }
  static S store(A v) { return v; }
};
template <>
struct Traits<DType::i64> {
  using S = int64_t;
  using A = int64_t;
  static A load(S v) { return v; }
  static S store(A v) { return v; }
};
template <>
struct Traits<DType::u8> {
  using S = uint8_t;
  using A = uint8_t;
  static A load(S v) { return v; }
  static S store(A v) { return v; }
};

template <class A, ReduceOp Op>
inline A apply(A x, A y) {
  if constexpr (Op == ReduceOp::max) {
    return x < y ? y : x;
  } else if constexpr (Op == ReduceOp::min) {
    return y < x ? y : x;
  } else if constexpr (std::is_integral_v<A>) {
    using U = std::make_unsigned_t<A>;
    return static_cast<A>(static_cast<U>(x) + static_cast<U>(y));
  } else {
    return x + y;
  }
}

template <DType D, ReduceOp Op>
void reduce_typed(void* dst_v, const void* const* srcs_v, int nsrc, size_t count, int divisor,
                  void* dst2_v) {
  using T = Traits<D>;
  using S = typename T::S;
  using A = typename T::A;
  S* dst = static_cast<S*>(dst_v);
  S* __restrict dst2 = static_cast<S*>(dst2_v);
  const A div = static_cast<A>(divisor);
  const bool divide_result = divisor > 1;
  if (nsrc == 2) {
    // The hot case of every algorithm: one fused pass. With a second
    // destination (the shared-memory all-reduce's copy for its peers), copy
    // each block while it is still in L1: a loop storing to both vectorises
    // poorly because the first destination may alias the first source.
    const S* a = static_cast<const S*>(srcs_v[0]);
    const S* __restrict b = static_cast<const S*>(srcs_v[1]);
    constexpr size_t kCopyBlock = 2048;
    for (size_t base = 0; base < count; base += kCopyBlock) {
      const size_t m = std::min(kCopyBlock, count - base);
      S* d = dst + base;
      const S* x = a + base;
      const S* __restrict y = b + base;
      if (divide_result) {
        for (size_t i = 0; i < m; ++i)
          d[i] = T::store(apply<A, Op>(T::load(x[i]), T::load(y[i])) / div);
      } else {
        for (size_t i = 0; i < m; ++i) d[i] = T::store(apply<A, Op>(T::load(x[i]), T::load(y[i])));
      }
      if (dst2 != nullptr) std::memcpy(dst2 + base, d, m * sizeof(S));
    }
    return;
  }
  // Blocked so the accumulator stays in L1 and 16-bit inputs round only once.
  constexpr size_t kBlock = 512;
  A acc[kBlock];
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t m = std::min(kBlock, count - base);
    const S* s0 = static_cast<const S*>(srcs_v[0]) + base;
    for (size_t i = 0; i < m; ++i) acc[i] = T::load(s0[i]);
    for (int k = 1; k < nsrc; ++k) {
      const S* __restrict sk = static_cast<const S*>(srcs_v[k]) + base;
      for (size_t i = 0; i < m; ++i) acc[i] = apply<A, Op>(acc[i], T::load(sk[i]));
    }
    if (divide_result) {
      for (size_t i = 0; i < m; ++i) acc[i] = acc[i] / div;
    }
    S* d = dst + base;
    for (size_t i = 0; i < m; ++i) d[i] = T::store(acc[i]);
    if (dst2 != nullptr) std::memcpy(dst2 + base, d, m * sizeof(S));
  }
}

template <DType D>
void reduce_dtype(void* dst, const void* const* srcs, int nsrc, size_t count, ReduceOp op,
                  int divisor, void* dst2) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg:
      return reduce_typed<D, ReduceOp::sum>(dst, srcs, nsrc, count, divisor, dst2);
    case ReduceOp::max:
      return reduce_typed<D, ReduceOp::max>(dst, srcs, nsrc, count, divisor, dst2);
    case ReduceOp::min:
      return reduce_typed<D, ReduceOp::min>(dst, srcs, nsrc, count, divisor, dst2);
  }
}

template <DType D>
void divide_typed(void* buf, size_t count, int divisor) {
  using T = Traits<D>;
  using S = typename T::S;
  using A = typename T::A;
  S* p = static_cast<S*>(buf);
  const A div = static_cast<A>(divisor);
  for (size_t i = 0; i < count; ++i) p[i] = T::store(T::load(p[i]) / div);
}

}  // namespace

void reduce_sources(void* dst, const void* const* srcs, int nsrc, size_t count, DType dtype,
                    ReduceOp op, int divisor, void* dst2) {
  MT_CHECK(nsrc >= 1, "reduce_sources needs at least one source, got {}", nsrc);
  if (count == 0) return;
  switch (dtype) {
    case DType::f32:
      return reduce_dtype<DType::f32>(dst, srcs, nsrc, count, op, divisor, dst2);
    case DType::f64:
      return reduce_dtype<DType::f64>(dst, srcs, nsrc, count, op, divisor, dst2);
    case DType::bf16:
      return reduce_dtype<DType::bf16>(dst, srcs, nsrc, count, op, divisor, dst2);
    case DType::f16:
      return reduce_dtype<DType::f16>(dst, srcs, nsrc, count, op, divisor, dst2);
    case DType::i32:
      return reduce_dtype<DType::i32>(dst, srcs, nsrc, count, op, divisor, dst2);
    case DType::i64:
      return reduce_dtype<DType::i64>(dst, srcs, nsrc, count, op, divisor, dst2);
    case DType::u8:
      return reduce_dtype<DType::u8>(dst, srcs, nsrc, count, op, divisor, dst2);
  }
}

void divide(void* buf, size_t count, DType dtype, int divisor) {
  if (divisor <= 1 || count == 0) return;
  switch (dtype) {
    case DType::f32:
      return divide_typed<DType::f32>(buf, count, divisor);
    case DType::f64:
      return divide_typed<DType::f64>(buf, count, divisor);
    case DType::bf16:
      return divide_typed<DType::bf16>(buf, count, divisor);
    case DType::f16:
      return divide_typed<DType::f16>(buf, count, divisor);
    case DType::i32:
      return divide_typed<DType::i32>(buf, count, divisor);
    case DType::i64:
      return divide_typed<DType::i64>(buf, count, divisor);
    case DType::u8:
      return divide_typed<DType::u8>(buf, count, divisor);
  }
}

}  // namespace mt::comm
