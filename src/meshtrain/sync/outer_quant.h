// The 4-bit quantizer of Streaming DiLoCo's outer exchange (sync.outer_bits
// = 4, sync/local_steps.h): a per-chunk-scaled, sign + magnitude, 4-bit
// linear quantizer with stochastic rounding. (The paper sends E3M0-like
// 4-bit floats; this is the simpler linear variant, with an error bound
// that does not depend on the exponent range.)
//
// Layout of one payload for n values, chunk c = kChunk elements (the last
// chunk may be shorter), little-endian:
//   ceil(n / c) f32 scales (scale_k = max |x_i| over chunk k), then
//   ceil(n / 2) bytes of 4-bit codes, element i in the low nibble of byte
//   i / 2 when i is even, the high nibble when odd: bit 3 the sign (1:
//   negative), bits 0-2 the level in 0..7.
// Decoded value: sign * scale_k * level / 7.
// Rounding: l = |x_i| / scale_k * 7, level = floor(l) + Bernoulli(l -
// floor(l)) from a generator seeded by `seed`, so E[decoded] = x_i
// (unbiased) and |decoded - x_i| < scale_k / 7 for every element (the two
// levels it can go to are adjacent). A chunk of zeros has scale 0 and
// decodes to zeros; NaN or infinite input (a diverged replica) throws
// mt::Error "training diverged: ..." naming the element.
//
// Pure functions of (x, seed); callable from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace mt {

struct Int4Quantizer {
  static constexpr size_t kChunk = 64;
  static constexpr int kLevels = 7;
  // Bytes of the payload of n values.
  static size_t payload_bytes(size_t n);
  // Writes x's payload (payload.size() == payload_bytes(x.size())).
  static void encode(std::span<const float> x, uint64_t seed, std::span<std::byte> payload);
  // out[i] += decoded[i] (out.size() == n).
  static void decode_add(std::span<const std::byte> payload, std::span<float> out);
};

}  // namespace mt
