#include "meshtrain/sync/outer_quant.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "meshtrain/base/error.h"

namespace mt {

namespace {

size_t chunks(size_t n) {
  return (n + Int4Quantizer::kChunk - 1) / Int4Quantizer::kChunk;
}

// SplitMix64: a fast, well-mixed stream; 24 bits of each draw make the
// uniform in [0, 1).
struct SplitMix {
  uint64_t s;
  float uniform() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    z ^= z >> 31;
    return static_cast<float>(z >> 40) * (1.0F / 16777216.0F);
  }
};

}  // namespace

size_t Int4Quantizer::payload_bytes(size_t n) {
  return chunks(n) * sizeof(float) + (n + 1) / 2;
}

void Int4Quantizer::encode(std::span<const float> x, uint64_t seed, std::span<std::byte> payload) {
  const size_t n = x.size();
  MT_CHECK(payload.size() == payload_bytes(n), "4-bit payload of {} bytes for {} values",
           payload.size(), n);
  const size_t nc = chunks(n);
  auto* codes = reinterpret_cast<uint8_t*>(payload.data() + nc * sizeof(float));
  std::memset(codes, 0, (n + 1) / 2);
  SplitMix rng{seed};
  for (size_t k = 0; k < nc; ++k) {
    const size_t lo = k * kChunk, hi = std::min(n, lo + kChunk);
    float scale = 0;
    for (size_t i = lo; i < hi; ++i) {
      if (!std::isfinite(x[i])) {
        throw Error(fmt::format(
            "training diverged: sync.outer_bits = 4: a pseudo-gradient value is {} (element {} "
            "of a fragment); lower optim.lr or enable optim.clip_grad_norm",
            x[i], i));
      }
      scale = std::max(scale, std::abs(x[i]));
    }
    std::memcpy(payload.data() + k * sizeof(float), &scale, sizeof(float));
    const float to_level = scale > 0 ? static_cast<float>(kLevels) / scale : 0.0F;
    for (size_t i = lo; i < hi; ++i) {
      const float l = std::abs(x[i]) * to_level;
      auto level = static_cast<int>(l);  // floor, l >= 0
      if (level < kLevels && rng.uniform() < l - static_cast<float>(level)) ++level;
      level = std::min(level, kLevels);
      const auto code = static_cast<uint8_t>((x[i] < 0 ? 8 : 0) | level);
      codes[i / 2] |= static_cast<uint8_t>(i % 2 == 0 ? code : code << 4);
    }
  }
}

void Int4Quantizer::decode_add(std::span<const std::byte> payload, std::span<float> out) {
  const size_t n = out.size();
  MT_CHECK(payload.size() == payload_bytes(n), "4-bit payload of {} bytes for {} values",
           payload.size(), n);
  const size_t nc = chunks(n);
  const auto* codes = reinterpret_cast<const uint8_t*>(payload.data() + nc * sizeof(float));
  for (size_t k = 0; k < nc; ++k) {
    float scale = 0;
    std::memcpy(&scale, payload.data() + k * sizeof(float), sizeof(float));
    const float step = scale / static_cast<float>(kLevels);
    const size_t lo = k * kChunk, hi = std::min(n, lo + kChunk);
    for (size_t i = lo; i < hi; ++i) {
      const uint8_t code = i % 2 == 0 ? codes[i / 2] & 0xF : codes[i / 2] >> 4;
      const float v = step * static_cast<float>(code & 7);
      out[i] += (code & 8) ? -v : v;
    }
  }
}

}  // namespace mt
