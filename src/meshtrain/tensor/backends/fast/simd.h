// A minimal f32 vector type for the fast backend's element-wise kernels (which
// also load and store bf16 and f16, computing in f32): 16
// lanes of AVX-512 when the compiler targets it (-march=native on this
// project's machines), otherwise one lane of plain float, so every kernel is
// written once and stays portable. exp/tanh are polynomial approximations on
// AVX-512 (relative error below 3e-7) and the C library functions otherwise.
// Internal to src/meshtrain/tensor/backends/fast.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "meshtrain/tensor/dtype.h"

namespace mt::fast {

#if defined(__AVX512F__)

// f32 -> bf16 bit patterns for VecF's bf16 stores, 16 lanes.

// Round to nearest even, NaN kept quiet: the bit-exact twin of f32_to_bf16.
inline __m256i to_bf16_bits(__m512i u) {
  constexpr __mmask16 all = 0xffff;  // see VecF::kAll
  const __m512i hi = _mm512_maskz_srli_epi32(all, u, 16);
  const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
  __m512i r = _mm512_maskz_srli_epi32(
      all, _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
  return _mm512_maskz_cvtepi32_epi16(all, r);
}

#if defined(__AVX512BF16__)
// One instruction: round to nearest even and NaN quieted as f32_to_bf16 does,
// but subnormal results flush to zero (as in oneDNN's bf16 outputs). Keeping
// them exact costs a third of a gelu's time.
inline __m256i bf16_bits(__m512 x) {
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
}
#else
inline __m256i bf16_bits(__m512 x) {
  return to_bf16_bits(_mm512_castps_si512(x));
}
#endif

struct VecF {
  static constexpr int64_t kWidth = 16;
  using Mask = __mmask16;
  // The all-lanes mask: maskz_ intrinsics with it avoid GCC 12's spurious
  // -Wmaybe-uninitialized on the unmasked forms' undefined pass-through.
  static constexpr Mask kAll = 0xffff;
  __m512 v;

  VecF() = default;
  explicit VecF(__m512 x) : v(x) {}
  static VecF set1(float x) { return VecF(_mm512_set1_ps(x)); }
  static VecF zero() { return VecF(_mm512_setzero_ps()); }
  static Mask head(int64_t n) { return static_cast<Mask>((1u << n) - 1u); }
  // Loads and stores of n <= kWidth elements (masked when n < kWidth; the
  // masked-off lanes read as 0 and are never touched in memory).
  static VecF load(const float* p, int64_t n = kWidth) {
    return n == kWidth ? VecF(_mm512_loadu_ps(p)) : VecF(_mm512_maskz_loadu_ps(head(n), p));
  }
  // As load(), with the lanes past n set to `fill`.
  static VecF load(const float* p, int64_t n, float fill) {
    return n == kWidth ? VecF(_mm512_loadu_ps(p))
                       : VecF(_mm512_mask_loadu_ps(_mm512_set1_ps(fill), head(n), p));
  }
  // This vector with the lanes past n zeroed.
  VecF keep_head(int64_t n) const {
    return n == kWidth ? *this : VecF(_mm512_maskz_mov_ps(head(n), v));
  }
  void store(float* p, int64_t n = kWidth) const {
    if (n == kWidth) {
      _mm512_storeu_ps(p, v);
    } else {
      _mm512_mask_storeu_ps(p, head(n), v);
    }
  }
  // bf16 storage: loads widen exactly; stores round to nearest even with NaN
  // kept quiet, bit for bit as f32_to_bf16 except that with AVX512_BF16 a
  // subnormal result becomes zero. Tails go through a small buffer (16-bit
  // masked moves would need AVX512BW/VL on top of AVX512F).

  [[gnu::always_inline]] static VecF load(const bf16* p, int64_t n = kWidth) {
    __m256i h;
    if (n == kWidth) {
      h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    } else {
      alignas(32) uint16_t buf[kWidth] = {};
      for (int64_t i = 0; i < n; ++i) buf[i] = p[i].bits;
      h = _mm256_load_si256(reinterpret_cast<const __m256i*>(buf));
    }
    return VecF(_mm512_castsi512_ps(
        _mm512_maskz_slli_epi32(kAll, _mm512_maskz_cvtepu16_epi32(kAll, h), 16)));
  }
  [[gnu::always_inline]] void store(bf16* p, int64_t n = kWidth) const {
    const __m256i h = bf16_bits(v);
    if (n == kWidth) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
    } else {
      alignas(32) uint16_t buf[kWidth];
      _mm256_store_si256(reinterpret_cast<__m256i*>(buf), h);
      for (int64_t i = 0; i < n; ++i) p[i].bits = buf[i];
    }
  }
  // f16 storage through AVX-512F's conversion instructions (vcvtph2ps /
  // vcvtps2ph): loads widen exactly, stores round to nearest even with
  // subnormals and overflow to inf exact, bit for bit as f16_to_f32 /
  // f32_to_f16 except for NaN payloads (a NaN stays a quiet NaN). Tails go
  // through a buffer, as for bf16.
  [[gnu::always_inline]] static VecF load(const f16* p, int64_t n = kWidth) {
    __m256i h;
    if (n == kWidth) {
      h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    } else {
      alignas(32) uint16_t buf[kWidth] = {};
      for (int64_t i = 0; i < n; ++i) buf[i] = p[i].bits;
      h = _mm256_load_si256(reinterpret_cast<const __m256i*>(buf));
    }
    return VecF(_mm512_maskz_cvtph_ps(kAll, h));
  }
  [[gnu::always_inline]] void store(f16* p, int64_t n = kWidth) const {
    const __m256i h = _mm512_maskz_cvtps_ph(kAll, v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    if (n == kWidth) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
    } else {
      alignas(32) uint16_t buf[kWidth];
      _mm256_store_si256(reinterpret_cast<__m256i*>(buf), h);
      for (int64_t i = 0; i < n; ++i) p[i].bits = buf[i];
    }
  }
  // Horizontal sum / maximum, halving the width each step (GCC 12's
  // _mm512_reduce_* trip -Wmaybe-uninitialized).
  float reduce_add() const {
    const __m256 a = _mm256_add_ps(half_<0>(), half_<1>());
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
  }
  float reduce_max() const {
    const __m256 a = _mm256_max_ps(half_<0>(), half_<1>());
    __m128 b = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    b = _mm_max_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_max_ss(b, _mm_movehdup_ps(b)));
  }
  template <int I>
  __m256 half_() const {
    return _mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(0xff, _mm512_castps_pd(v), I));
  }

  friend VecF operator+(VecF a, VecF b) { return VecF(_mm512_add_ps(a.v, b.v)); }
  friend VecF operator-(VecF a, VecF b) { return VecF(_mm512_sub_ps(a.v, b.v)); }
  friend VecF operator*(VecF a, VecF b) { return VecF(_mm512_mul_ps(a.v, b.v)); }
  friend VecF operator/(VecF a, VecF b) { return VecF(_mm512_div_ps(a.v, b.v)); }
  // a * b + c
  friend VecF fma(VecF a, VecF b, VecF c) { return VecF(_mm512_fmadd_ps(a.v, b.v, c.v)); }
  // max/min that return x when x is NaN (so NaN inputs propagate).
  friend VecF max_nan(VecF c, VecF x) { return VecF(_mm512_maskz_max_ps(kAll, c.v, x.v)); }
  friend VecF min_nan(VecF c, VecF x) { return VecF(_mm512_maskz_min_ps(kAll, c.v, x.v)); }
  friend VecF abs(VecF a) { return VecF(_mm512_abs_ps(a.v)); }
  friend Mask lt(VecF a, VecF b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_LT_OQ); }
  friend Mask gt(VecF a, VecF b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_GT_OQ); }
  // m ? a : b, lane by lane.
  friend VecF select(Mask m, VecF a, VecF b) { return VecF(_mm512_mask_blend_ps(m, b.v, a.v)); }
  // The sign bit of s applied to |a|.
  friend VecF copysign(VecF a, VecF s) {
    const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
    return VecF(_mm512_castsi512_ps(
        _mm512_ternarylogic_epi32(sign, _mm512_castps_si512(s.v), _mm512_castps_si512(a.v), 0xca)));
  }

  // e^x. Range reduction x = n ln2 + r with |r| <= ln2/2, then a degree-7
  // Taylor polynomial (truncation < 5e-9) and scalef for 2^n, which also
  // yields 0 for very negative x and inf beyond 88.73.
  [[gnu::always_inline]] friend VecF exp(VecF x) {
    const __m512 cx = _mm512_maskz_min_ps(kAll, _mm512_set1_ps(89.0f),
                                          _mm512_maskz_max_ps(kAll, _mm512_set1_ps(-104.0f), x.v));
    const __m512 n =
        _mm512_maskz_roundscale_ps(kAll, _mm512_mul_ps(cx, _mm512_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    // ln2 split in a part exact in float and the rest, so n * ln2_hi is exact.
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), cx);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    // NaN stays NaN through the clamps (max/min return their second operand).
    return VecF(_mm512_maskz_scalef_ps(kAll, p, n));
  }

  // tanh(x): the odd Taylor series through x^17 for |x| < 0.625 (truncation
  // < 1e-7 relative), else 1 - 2 / (e^{2|x|} + 1) with x's sign.
  [[gnu::always_inline]] friend VecF tanh(VecF x) {
    const VecF ax = abs(x);
    const VecF x2 = x * x;
    VecF p = set1(6404582.0f / 10854718875.0f);
    p = fma(p, x2, set1(-929569.0f / 638512875.0f));
    p = fma(p, x2, set1(21844.0f / 6081075.0f));
    p = fma(p, x2, set1(-1382.0f / 155925.0f));
    p = fma(p, x2, set1(62.0f / 2835.0f));
    p = fma(p, x2, set1(-17.0f / 315.0f));
    p = fma(p, x2, set1(2.0f / 15.0f));
    p = fma(p, x2, set1(-1.0f / 3.0f));
    const VecF small = fma(p * x2, x, x);
    const VecF e = exp(ax + ax);
    const VecF big = copysign(set1(1.0f) - set1(2.0f) / (e + set1(1.0f)), x);
    return select(lt(ax, set1(0.625f)), small, big);
  }
};

#else  // portable scalar fallback

struct VecF {
  static constexpr int64_t kWidth = 1;
  using Mask = bool;
  float v;

  VecF() = default;
  explicit VecF(float x) : v(x) {}
  static VecF set1(float x) { return VecF(x); }
  static VecF zero() { return VecF(0.0f); }
  static VecF load(const float* p, int64_t /*n*/ = 1) { return VecF(*p); }
  static VecF load(const float* p, int64_t /*n*/, float /*fill*/) { return VecF(*p); }
  VecF keep_head(int64_t /*n*/) const { return *this; }
  void store(float* p, int64_t /*n*/ = 1) const { *p = v; }
  static VecF load(const bf16* p, int64_t /*n*/ = 1) { return VecF(bf16_to_f32(*p)); }
  void store(bf16* p, int64_t /*n*/ = 1) const { *p = f32_to_bf16(v); }
  static VecF load(const f16* p, int64_t /*n*/ = 1) { return VecF(f16_to_f32(*p)); }
  void store(f16* p, int64_t /*n*/ = 1) const { *p = f32_to_f16(v); }
  float reduce_add() const { return v; }
  float reduce_max() const { return v; }

  friend VecF operator+(VecF a, VecF b) { return VecF(a.v + b.v); }
  friend VecF operator-(VecF a, VecF b) { return VecF(a.v - b.v); }
  friend VecF operator*(VecF a, VecF b) { return VecF(a.v * b.v); }
  friend VecF operator/(VecF a, VecF b) { return VecF(a.v / b.v); }
  friend VecF fma(VecF a, VecF b, VecF c) { return VecF(a.v * b.v + c.v); }
  friend VecF max_nan(VecF c, VecF x) { return VecF(x.v < c.v ? c.v : x.v); }
  friend VecF min_nan(VecF c, VecF x) { return VecF(x.v > c.v ? c.v : x.v); }
  friend VecF abs(VecF a) { return VecF(std::fabs(a.v)); }
  friend Mask lt(VecF a, VecF b) { return a.v < b.v; }
  friend Mask gt(VecF a, VecF b) { return a.v > b.v; }
  friend VecF select(Mask m, VecF a, VecF b) { return m ? a : b; }
  friend VecF copysign(VecF a, VecF s) { return VecF(std::copysign(a.v, s.v)); }
  friend VecF exp(VecF x) { return VecF(std::exp(x.v)); }
  friend VecF tanh(VecF x) { return VecF(std::tanh(x.v)); }
};

#endif

// Calls f(i, n) for consecutive blocks [i, i + n) of [0, count): full vectors
// (n == VecF::kWidth), then one shorter tail.
template <class F>
inline void vec_loop(int64_t count, F&& f) {
  int64_t i = 0;
  for (; i + VecF::kWidth <= count; i += VecF::kWidth) f(i, VecF::kWidth);
  if (i < count) f(i, count - i);
}

// 1 / (1 + e^-x).
[[gnu::always_inline]] inline VecF sigmoid(VecF x) {
  return VecF::set1(1.0f) / (VecF::set1(1.0f) + exp(VecF::zero() - x));
}

}  // namespace mt::fast
