#include "meshtrain/sync/codecs.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include <fmt/format.h>

#include "meshtrain/base/error.h"
#include "meshtrain/base/random.h"
#include "meshtrain/tensor/dtype.h"

namespace mt {
namespace {

size_t ceil_div(size_t a, size_t b) {
  return (a + b - 1) / b;
}

float load_f32(const std::byte* p) {
  float v;
  std::memcpy(&v, p, 4);
  return v;
}
void store_f32(std::byte* p, float v) {
  std::memcpy(p, &v, 4);
}

// Chunks of `chunk` elements (0: one chunk of all); none for numel 0.
size_t chunk_count(size_t numel, size_t chunk) {
  if (numel == 0) return 0;
  return chunk == 0 ? 1 : ceil_div(numel, chunk);
}

// ---- f16 / bf16

// f32 -> bf16 bits, round to nearest even, NaN kept quiet: f32_to_bf16 bit
// for bit (tests/sync/codecs_test.cpp checks it), inline so the loops below
// vectorize instead of calling across translation units per element.
inline uint16_t bf16_bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline float bf16_value(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float v;
  std::memcpy(&v, &u, 4);
  return v;
}

class CastCodec final : public PayloadCodec {
 public:
  CastCodec(size_t numel, bool half) : PayloadCodec(numel), half_(half) {}
  size_t payload_bytes() const override { return 2 * numel_; }
  void encode(std::span<const float> e, uint64_t, std::span<std::byte> payload) const override {
    auto* out = reinterpret_cast<uint16_t*>(payload.data());
    if (!half_) {
      for (size_t i = 0; i < numel_; ++i) out[i] = bf16_bits(e[i]);
      return;
    }
    // Saturate rather than overflow to inf: the excess stays in the residual.
    constexpr float kMax = 65504.0f;
    size_t i = 0;
#if defined(__F16C__)
    // vcvtps2ph rounds to nearest even with exact subnormals, as f32_to_f16.
    const __m256 lo = _mm256_set1_ps(-kMax), hi = _mm256_set1_ps(kMax);
    for (; i + 8 <= numel_; i += 8) {
      // max/min return the second operand for a NaN: put e second to keep it.
      const __m256 x = _mm256_max_ps(lo, _mm256_min_ps(hi, _mm256_loadu_ps(e.data() + i)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                       _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
#endif
    for (; i < numel_; ++i) out[i] = f32_to_f16(std::clamp(e[i], -kMax, kMax)).bits;
  }
  void decode_add(std::span<const std::byte> payload, float scale,
                  std::span<float> out) const override {
    const auto* in = reinterpret_cast<const uint16_t*>(payload.data());
    if (!half_) {
      for (size_t i = 0; i < numel_; ++i) out[i] += scale * bf16_value(in[i]);
      return;
    }
    size_t i = 0;
#if defined(__F16C__)
    const __m256 s = _mm256_set1_ps(scale);
    for (; i + 8 <= numel_; i += 8) {
      const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i)));
      _mm256_storeu_ps(out.data() + i,
                       _mm256_add_ps(_mm256_loadu_ps(out.data() + i), _mm256_mul_ps(s, x)));
    }
#endif
    for (; i < numel_; ++i) out[i] += scale * f16_to_f32(f16{in[i]});
  }

 private:
  bool half_;
};

// ---- top-k / rand-k: k u32 indices, then k f32 values; or compact: k bf16
// values, then the indices Elias-Fano coded

// bf16 bits of v, a finite v that would round to inf saturating at the
// largest finite bf16 (the excess stays in the residual, as f16 does).
inline uint16_t bf16_bits_saturated(float v) {
  uint16_t b = bf16_bits(v);
  if ((b & 0x7fffu) == 0x7f80u && std::isfinite(v))
    b = static_cast<uint16_t>((b & 0x8000u) | 0x7f7fu);
  return b;
}

// ORs the `width` (<= 32) low bits of v into buf at bit `pos` (LSB first).
void or_bits(std::byte* buf, size_t pos, uint32_t v, int width) {
  for (int b = 0; b < width;) {
    const int off = static_cast<int>((pos + static_cast<size_t>(b)) % 8);
    const int take = std::min(8 - off, width - b);
    const uint32_t part = (v >> b) & ((1u << take) - 1u);
    buf[(pos + static_cast<size_t>(b)) / 8] |= static_cast<std::byte>(part << off);
    b += take;
  }
}
uint32_t read_bits(const std::byte* buf, size_t pos, int width) {
  uint32_t v = 0;
  for (int b = 0; b < width;) {
    const int off = static_cast<int>((pos + static_cast<size_t>(b)) % 8);
    const int take = std::min(8 - off, width - b);
    const auto byte = static_cast<uint32_t>(buf[(pos + static_cast<size_t>(b)) / 8]);
    v |= ((byte >> off) & ((1u << take) - 1u)) << b;
    b += take;
  }
  return v;
}

class SparseCodec final : public PayloadCodec {
 public:
  SparseCodec(size_t numel, size_t k, bool random, bool compact)
      : PayloadCodec(numel),
        k_(k),
        random_(random),
        compact_(compact),
        // floor(log2(numel / k)): the Elias-Fano split minimizing the bound
        // k * (2 + log2(numel / k)) bits.
        low_(k == 0 ? 0 : std::bit_width(numel / k) - 1) {}
  size_t payload_bytes() const override {
    if (!compact_) return 8 * k_;
    // The high part: k ones and (numel - 1) >> low zeros at most (the
    // unary gaps of index >> low); its bound, not the data, sizes the
    // payload, so every rank's payload has the same size.
    const size_t high = k_ == 0 ? 0 : k_ + ((numel_ - 1) >> low_);
    return 2 * k_ + ceil_div(k_ * static_cast<size_t>(low_) + high, 8);
  }
  void encode(std::span<const float> e, uint64_t seed,
              std::span<std::byte> payload) const override {
    if (k_ == 0) return;  // an empty tensor (memcpy from a null pointer is undefined)
    const std::vector<uint32_t> idx = random_ ? random_indices(seed) : top_k_indices(e, k_);
    if (compact_) {
      encode_compact(e, idx, payload);
      return;
    }
    std::memcpy(payload.data(), idx.data(), 4 * k_);
    std::byte* values = payload.data() + 4 * k_;
    for (size_t j = 0; j < k_; ++j) store_f32(values + 4 * j, e[idx[j]]);
  }
  void decode_add(std::span<const std::byte> payload, float scale,
                  std::span<float> out) const override {
    if (compact_) {
      decode_add_compact(payload, scale, out);
      return;
    }
    const std::byte* values = payload.data() + 4 * k_;
    for (size_t j = 0; j < k_; ++j) {
      uint32_t i;
      std::memcpy(&i, payload.data() + 4 * j, 4);
      check_index(i, j);
      out[i] += scale * load_f32(values + 4 * j);
    }
  }

 private:
  // A payload from a peer that disagrees on the tensor must not write out
  // of bounds (the handshake checks sizes, not contents).
  void check_index(uint64_t i, size_t j) const {
    if (i >= numel_) {
      throw CommError(
          fmt::format("sparse codec payload: index {} of entry {} is outside "
                      "the tensor's {} elements (ranks disagree on the tensor?)",
                      i, j, numel_));
    }
  }

  // Layout: k bf16 values (index order), then one bit stream (LSB first):
  // k fields of `low_` bits (index & (2^low - 1)), then the high part, where
  // entry j sets bit (index_j >> low) + j; zero bits pad it to the bound.
  void encode_compact(std::span<const float> e, const std::vector<uint32_t>& idx,
                      std::span<std::byte> payload) const {
    std::byte* bits = payload.data() + 2 * k_;
    std::memset(bits, 0, payload_bytes() - 2 * k_);
    const uint32_t mask = low_ == 0 ? 0u : static_cast<uint32_t>((uint64_t{1} << low_) - 1);
    const size_t high_at = k_ * static_cast<size_t>(low_);
    for (size_t j = 0; j < k_; ++j) {
      const uint16_t v = bf16_bits_saturated(e[idx[j]]);
      std::memcpy(payload.data() + 2 * j, &v, 2);
      or_bits(bits, j * static_cast<size_t>(low_), idx[j] & mask, low_);
      const size_t h = high_at + (static_cast<size_t>(idx[j]) >> low_) + j;
      bits[h / 8] |= static_cast<std::byte>(1u << (h % 8));
    }
  }
  void decode_add_compact(std::span<const std::byte> payload, float scale,
                          std::span<float> out) const {
    MT_CHECK_GE(payload.size(), payload_bytes());
    const std::byte* bits = payload.data() + 2 * k_;
    size_t pos = k_ * static_cast<size_t>(low_);
    const size_t end = (payload_bytes() - 2 * k_) * 8;
    uint64_t high = 0;
    for (size_t j = 0; j < k_; ++j) {
      while (pos < end && (static_cast<unsigned>(bits[pos / 8]) >> (pos % 8) & 1u) == 0) {
        ++pos;
        ++high;
      }
      if (pos >= end) {
        throw CommError(
            fmt::format("sparse codec payload: the index stream ends before entry {} of {} "
                        "(ranks disagree on the tensor?)",
                        j, k_));
      }
      ++pos;
      const uint64_t i = (high << low_) | read_bits(bits, j * static_cast<size_t>(low_), low_);
      check_index(i, j);
      uint16_t v;
      std::memcpy(&v, payload.data() + 2 * j, 2);
      out[i] += scale * bf16_value(v);
    }
  }

  // k distinct uniform indices, ascending: Floyd's algorithm (exactly k
  // draws, each index equally likely) over a bitmap of the tensor, which
  // then yields the indices in order in one pass over numel / 64 words.
  std::vector<uint32_t> random_indices(uint64_t seed) const {
    Rng rng(seed);
    std::vector<uint64_t> taken((numel_ + 63) / 64, 0);
    auto test_and_set = [&](size_t i) {
      uint64_t& w = taken[i / 64];
      const uint64_t bit = uint64_t{1} << (i % 64);
      const bool was = (w & bit) != 0;
      w |= bit;
      return was;
    };
    for (size_t j = numel_ - k_; j < numel_; ++j) {
      auto t = static_cast<size_t>(rng.uniform() * static_cast<double>(j + 1));
      if (t > j) t = j;
      if (test_and_set(t)) test_and_set(j);  // j is new: every index below j was drawn before
    }
    std::vector<uint32_t> idx;
    idx.reserve(k_);
    for (size_t w = 0; w < taken.size(); ++w) {
      for (uint64_t bits = taken[w]; bits != 0; bits &= bits - 1) {
        idx.push_back(static_cast<uint32_t>(w * 64 + static_cast<size_t>(__builtin_ctzll(bits))));
      }
    }
    return idx;
  }

  size_t k_;
  bool random_;
  bool compact_;
  int low_;
};

// ---- bit streams for qsgd and sign (LSB first)

class BitWriter {
 public:
  explicit BitWriter(std::byte* out) : out_(out) {}
  void put(uint32_t code, int bits) {
    acc_ |= static_cast<uint64_t>(code) << n_;
    n_ += bits;
    while (n_ >= 8) {
      *out_++ = static_cast<std::byte>(acc_ & 0xff);
      acc_ >>= 8;
      n_ -= 8;
    }
  }
  void flush() {
    if (n_ > 0) *out_++ = static_cast<std::byte>(acc_ & 0xff);
    acc_ = 0;
    n_ = 0;
  }

 private:
  std::byte* out_;
  uint64_t acc_ = 0;
  int n_ = 0;
};

class BitReader {
 public:
  explicit BitReader(const std::byte* in) : in_(in) {}
  uint32_t get(int bits) {
    while (n_ < bits) {
      acc_ |= static_cast<uint64_t>(*in_++) << n_;
      n_ += 8;
    }
    const auto v = static_cast<uint32_t>(acc_ & ((uint64_t{1} << bits) - 1));
    acc_ >>= bits;
    n_ -= bits;
    return v;
  }

 private:
  const std::byte* in_;
  uint64_t acc_ = 0;
  int n_ = 0;
};

// ---- QSGD

class QsgdCodec final : public PayloadCodec {
 public:
  QsgdCodec(size_t numel, int bits, size_t bucket)
      : PayloadCodec(numel),
        bits_(bits),
        levels_((1u << (bits - 1)) - 1),
        bucket_(bucket == 0 ? std::max<size_t>(numel, 1) : bucket),
        buckets_(chunk_count(numel, bucket)) {}
  size_t payload_bytes() const override { return 4 * buckets_ + ceil_div(numel_ * bits_, 8); }
  void encode(std::span<const float> e, uint64_t seed,
              std::span<std::byte> payload) const override {
    Rng rng(seed);
    BitWriter w(payload.data() + 4 * buckets_);
    const double s = levels_;
    for (size_t b = 0; b < buckets_; ++b) {
      const size_t lo = b * bucket_, hi = std::min(numel_, lo + bucket_);
      double sq = 0;
      for (size_t i = lo; i < hi; ++i) sq += static_cast<double>(e[i]) * e[i];
      // The norm as sent: levels are drawn against it, so decoding is
      // unbiased with respect to the very value the receiver multiplies by.
      const float norm = static_cast<float>(std::sqrt(sq));
      store_f32(payload.data() + 4 * b, norm);
      for (size_t i = lo; i < hi; ++i) {
        uint32_t level = 0;
        if (norm > 0) {
          const double l = std::fabs(static_cast<double>(e[i])) / norm * s;
          if (std::isfinite(l)) {
            const double fl = std::floor(l);
            level = static_cast<uint32_t>(fl) + (rng.uniform() < l - fl ? 1u : 0u);
            level = std::min(level, levels_);
          } else {
            level = levels_;  // an inf or NaN in the bucket: its norm is not finite
          }
        }
        const uint32_t sign = std::signbit(e[i]) ? 1u : 0u;
        w.put(sign | (level << 1), bits_);
      }
    }
    w.flush();
  }
  void decode_add(std::span<const std::byte> payload, float scale,
                  std::span<float> out) const override {
    BitReader rd(payload.data() + 4 * buckets_);
    for (size_t b = 0; b < buckets_; ++b) {
      const size_t lo = b * bucket_, hi = std::min(numel_, lo + bucket_);
      const float unit = load_f32(payload.data() + 4 * b) / static_cast<float>(levels_);
      for (size_t i = lo; i < hi; ++i) {
        const uint32_t code = rd.get(bits_);
        // Branch-free: random signs would mispredict a branch half the time.
        const float sign = 1.0f - 2.0f * static_cast<float>(code & 1u);
        out[i] += scale * (sign * (unit * static_cast<float>(code >> 1)));
      }
    }
  }

 private:
  int bits_;
  uint32_t levels_;
  size_t bucket_;
  size_t buckets_;
};

// ---- sign with a mean-magnitude scale

class SignCodec final : public PayloadCodec {
 public:
  SignCodec(size_t numel, size_t chunk)
      : PayloadCodec(numel),
        chunk_(chunk == 0 ? std::max<size_t>(numel, 1) : chunk),
        chunks_(chunk_count(numel, chunk)) {}
  size_t payload_bytes() const override { return 4 * chunks_ + ceil_div(numel_, 8); }
  void encode(std::span<const float> e, uint64_t, std::span<std::byte> payload) const override {
    BitWriter w(payload.data() + 4 * chunks_);
    for (size_t c = 0; c < chunks_; ++c) {
      const size_t lo = c * chunk_, hi = std::min(numel_, lo + chunk_);
      double sum = 0;
      for (size_t i = lo; i < hi; ++i) sum += std::fabs(static_cast<double>(e[i]));
      store_f32(payload.data() + 4 * c, static_cast<float>(sum / static_cast<double>(hi - lo)));
      size_t i = lo;
      for (; i + 8 <= hi; i += 8) {
        uint32_t byte = 0;
        for (int b = 0; b < 8; ++b) byte |= (std::signbit(e[i + b]) ? 0u : 1u) << b;
        w.put(byte, 8);
      }
      for (; i < hi; ++i) w.put(std::signbit(e[i]) ? 0u : 1u, 1);
    }
    w.flush();
  }
  void decode_add(std::span<const std::byte> payload, float scale,
                  std::span<float> out) const override {
    BitReader rd(payload.data() + 4 * chunks_);
    for (size_t c = 0; c < chunks_; ++c) {
      const size_t lo = c * chunk_, hi = std::min(numel_, lo + chunk_);
      const float m = scale * load_f32(payload.data() + 4 * c);
      size_t i = lo;
      for (; i + 8 <= hi; i += 8) {
        // Branch-free (random signs would mispredict a branch half the time).
        const uint32_t byte = rd.get(8);
        for (int b = 0; b < 8; ++b) {
          out[i + b] += m * (2.0f * static_cast<float>((byte >> b) & 1u) - 1.0f);
        }
      }
      for (; i < hi; ++i) out[i] += m * (2.0f * static_cast<float>(rd.get(1)) - 1.0f);
    }
  }

 private:
  size_t chunk_;
  size_t chunks_;
};

// One sender's PowerSGD factors (make_low_rank_payload_codec).
class LowRankCodec : public PayloadCodec {
 public:
  LowRankCodec(size_t rows, size_t cols, int r)
      : PayloadCodec(rows * cols),
        rows_(rows),
        cols_(cols),
        r_(r),
        low_(powersgd_compresses(rows, cols, r)) {}
  size_t payload_bytes() const override {
    return 4 * (low_ ? (rows_ + cols_) * static_cast<size_t>(r_) : numel_);
  }
  size_t state_numel() const override { return low_ ? cols_ * static_cast<size_t>(r_) : 0; }
  void encode(std::span<const float> e, uint64_t seed,
              std::span<std::byte> payload) const override {
    std::vector<float> q(state_numel(), 0.0f);  // no warm start: drawn
    encode_with_state(e, seed, payload, q);
  }
  void encode_with_state(std::span<const float> e, uint64_t seed, std::span<std::byte> payload,
                         std::span<float> q) const override {
    if (!low_) {
      std::memcpy(payload.data(), e.data(), numel_ * 4);
      return;
    }
    const auto R = static_cast<size_t>(r_);
    for (size_t c = 0; c < R; ++c) {  // a zero column (the first encode) is drawn
      bool zero = true;
      for (size_t j = 0; j < cols_ && zero; ++j) zero = q[j * R + c] == 0.0f;
      if (!zero) continue;
      Rng rng(codec_seed(seed, -1, c));
      for (size_t j = 0; j < cols_; ++j) q[j * R + c] = static_cast<float>(rng.normal());
    }
    std::vector<float> p(rows_ * R);
    powersgd_project(e, rows_, cols_, q, r_, p);
    orthogonalize_columns(p, rows_, r_);
    powersgd_back_project(e, rows_, cols_, p, r_, q);
    std::memcpy(payload.data(), p.data(), p.size() * 4);
    std::memcpy(payload.data() + p.size() * 4, q.data(), q.size() * 4);
  }
  void decode_add(std::span<const std::byte> payload, float scale,
                  std::span<float> out) const override {
    std::vector<float> x(numel_);
    if (low_) {
      const auto R = static_cast<size_t>(r_);
      std::vector<float> p(rows_ * R), q(cols_ * R);
      std::memcpy(p.data(), payload.data(), p.size() * 4);
      std::memcpy(q.data(), payload.data() + p.size() * 4, q.size() * 4);
      powersgd_expand(p, q, rows_, cols_, r_, x);
    } else {
      std::memcpy(x.data(), payload.data(), numel_ * 4);
    }
    for (size_t i = 0; i < numel_; ++i) out[i] += scale * x[i];
  }

 private:
  size_t rows_, cols_;
  int r_;
  bool low_;
};

}  // namespace

std::unique_ptr<PayloadCodec> make_low_rank_payload_codec(const CodecSpec& spec, size_t rows,
                                                          size_t cols) {
  if (spec.kind != CodecKind::powersgd) {
    throw ConfigError(fmt::format("sync.codec: \"{}\" is not a low-rank codec (powersgd:RANK)",
                                  spec.to_string()));
  }
  return std::make_unique<LowRankCodec>(rows, cols, spec.rank);
}

std::unique_ptr<PayloadCodec> make_payload_codec(const CodecSpec& spec, size_t numel) {
  spec.check_fits(numel, "the tensor");
  switch (spec.kind) {
    case CodecKind::f16:
      return std::make_unique<CastCodec>(numel, true);
    case CodecKind::bf16:
      return std::make_unique<CastCodec>(numel, false);
    case CodecKind::topk:
    case CodecKind::randk:
      return std::make_unique<SparseCodec>(numel, numel == 0 ? 0 : spec.k_for(numel),
                                           spec.kind == CodecKind::randk, spec.compact);
    case CodecKind::qsgd:
      return std::make_unique<QsgdCodec>(numel, spec.bits, spec.chunk);
    case CodecKind::sign:
      return std::make_unique<SignCodec>(numel, spec.chunk);
    case CodecKind::none:
    case CodecKind::powersgd:
      break;
  }
  throw ConfigError(
      fmt::format("sync.codec: \"{}\" has no payload codec (it is exchanged by "
                  "sync/compressed_all_reduce.h directly)",
                  spec.to_string()));
}

uint64_t codec_seed(uint64_t base, int rank, uint64_t step) {
  Rng a(base ^ (0x51ed270b27a3e5d1ull * (static_cast<uint64_t>(rank) + 1)));
  Rng b(a.next() ^ (0x9e3779b97f4a7c15ull * (step + 1)));
  return b.next();
}

std::vector<uint32_t> top_k_indices(std::span<const float> e, size_t k) {
  MT_CHECK_LE(k, e.size());
  const size_t n = e.size();
  std::vector<uint32_t> idx;
  if (k == 0) return idx;
  idx.reserve(k);
  if (k == n) {
    for (size_t i = 0; i < n; ++i) idx.push_back(static_cast<uint32_t>(i));
    return idx;
  }
  // The k-th largest magnitude (NaN counts as +inf) by nth_element over the
  // magnitudes alone; then one pass in index order takes everything above
  // it and, of the elements equal to it, the lowest indices until k. So the
  // result is exactly the k largest, ties to the lower index, ascending.
  auto mag = [](float v) {
    const float a = std::fabs(v);
    return std::isnan(a) ? std::numeric_limits<float>::infinity() : a;
  };
  std::vector<float> m(n);
  for (size_t i = 0; i < n; ++i) m[i] = mag(e[i]);
  // The candidates for the k-th largest: for small k, every magnitude at or
  // above a threshold t0 read off a strided sample (its (2q + 8)-th largest,
  // q = the sample's expected share of the top k, so t0 lies below the k-th
  // largest with a wide margin); if fewer than k reach t0, all of them.
  // Either way the candidates hold the k largest, so their k-th largest is
  // exact; the sample only saves selecting among all n.
  std::vector<float> cand;
  constexpr size_t kSample = 4096;
  if (n >= 4 * kSample && k * 16 < n) {
    const size_t stride = n / kSample;
    std::vector<float> sample(kSample);
    for (size_t j = 0; j < kSample; ++j) sample[j] = m[j * stride];
    const size_t r = std::min(kSample - 1, 2 * (k * kSample / n) + 8);
    std::nth_element(sample.begin(), sample.begin() + static_cast<std::ptrdiff_t>(r), sample.end(),
                     std::greater<float>());
    const float t0 = sample[r];
    for (size_t i = 0; i < n; ++i) {
      if (m[i] >= t0) cand.push_back(m[i]);
    }
  }
  if (cand.size() < k) cand = m;
  std::nth_element(cand.begin(), cand.begin() + static_cast<std::ptrdiff_t>(k - 1), cand.end(),
                   std::greater<float>());
  const float t = cand[k - 1];
  size_t above = 0;
  for (size_t i = 0; i < n; ++i) above += m[i] > t;
  size_t ties = k - above;
  for (size_t i = 0; i < n; ++i) {
    if (m[i] > t || (m[i] == t && ties > 0 && (--ties, true))) {
      idx.push_back(static_cast<uint32_t>(i));
    }
  }
  MT_CHECK_EQ(idx.size(), k);
  return idx;
}

float contraction_factor(const CodecSpec& spec, size_t numel) {
  if (spec.kind != CodecKind::qsgd || numel == 0) return 1.0F;
  const double b = static_cast<double>(spec.chunk == 0 ? numel : std::min(spec.chunk, numel));
  const double s = static_cast<double>((1u << (spec.bits - 1)) - 1);
  const double omega = std::min(b / (s * s), std::sqrt(b) / s);
  return static_cast<float>(1.0 / (1.0 + omega));
}

FeedbackEncoder::FeedbackEncoder(std::unique_ptr<PayloadCodec> codec, bool error_feedback,
                                 float scale)
    : codec_(std::move(codec)),
      error_feedback_(error_feedback),
      scale_(error_feedback ? scale : 1.0f),
      residual_(codec_->numel(), 0.0f),
      e_(codec_->numel()),
      state_(codec_->state_numel(), 0.0f) {}

void FeedbackEncoder::encode(std::span<const float> grad, uint64_t seed,
                             std::span<std::byte> payload) {
  const size_t n = codec_->numel();
  MT_CHECK_EQ(grad.size(), n);
  MT_CHECK_EQ(payload.size(), codec_->payload_bytes());
  if (!error_feedback_) {
    codec_->encode_with_state(grad, seed, payload, state_);
    return;
  }
  for (size_t i = 0; i < n; ++i) e_[i] = grad[i] + residual_[i];
  codec_->encode_with_state(e_, seed, payload, state_);
  // residual = e - scale * decoded: x + (-1) * x is exactly 0 where a
  // sparse codec sent e's own value.
  std::copy(e_.begin(), e_.end(), residual_.begin());
  codec_->decode_add(payload, -scale_, residual_);
}

void FeedbackEncoder::set_residual(std::span<const float> r) {
  MT_CHECK_EQ(r.size(), residual_.size());
  std::copy(r.begin(), r.end(), residual_.begin());
}

void FeedbackEncoder::set_state(std::span<const float> s) {
  MT_CHECK_EQ(s.size(), state_.size());
  std::copy(s.begin(), s.end(), state_.begin());
}

// ---- PowerSGD algebra

bool powersgd_compresses(size_t rows, size_t cols, int r) {
  return r >= 1 && (rows + cols) * static_cast<size_t>(r) < rows * cols;
}

void powersgd_project(std::span<const float> m, size_t rows, size_t cols, std::span<const float> q,
                      int r, std::span<float> p) {
  const auto R = static_cast<size_t>(r);
  std::vector<double> acc(R);
  for (size_t i = 0; i < rows; ++i) {
    std::fill(acc.begin(), acc.end(), 0.0);
    double* a = acc.data();
    const float* row = m.data() + i * cols;
    for (size_t j = 0; j < cols; ++j) {
      const double v = row[j];
      const float* qj = q.data() + j * R;
      for (size_t c = 0; c < R; ++c) a[c] += v * qj[c];
    }
    for (size_t c = 0; c < R; ++c) p[i * R + c] = static_cast<float>(a[c]);
  }
}

void powersgd_back_project(std::span<const float> m, size_t rows, size_t cols,
                           std::span<const float> p, int r, std::span<float> q) {
  const auto R = static_cast<size_t>(r);
  std::vector<double> acc(cols * R, 0.0);
  for (size_t i = 0; i < rows; ++i) {
    const float* row = m.data() + i * cols;
    const float* pi = p.data() + i * R;
    for (size_t j = 0; j < cols; ++j) {
      const double v = row[j];
      double* aj = acc.data() + j * R;
      for (size_t c = 0; c < R; ++c) aj[c] += v * pi[c];
    }
  }
  for (size_t t = 0; t < cols * R; ++t) q[t] = static_cast<float>(acc[t]);
}

void orthogonalize_columns(std::span<float> p, size_t rows, int r) {
  const auto R = static_cast<size_t>(r);
  std::vector<double> col(rows), done(rows * R, 0.0);
  for (size_t c = 0; c < R; ++c) {
    double norm0 = 0;
    for (size_t i = 0; i < rows; ++i) {
      col[i] = p[i * R + c];
      norm0 += col[i] * col[i];
    }
    norm0 = std::sqrt(norm0);
    for (size_t prev = 0; prev < c; ++prev) {
      double dot = 0;
      for (size_t i = 0; i < rows; ++i) dot += done[i * R + prev] * col[i];
      for (size_t i = 0; i < rows; ++i) col[i] -= dot * done[i * R + prev];
    }
    double norm = 0;
    for (size_t i = 0; i < rows; ++i) norm += col[i] * col[i];
    norm = std::sqrt(norm);
    // What is left after removing the earlier directions is rounding noise
    // when it is this small against the column itself: drop it.
    const bool dependent = !(norm > 1e-6 * norm0) || !(norm > 0) || !std::isfinite(norm);
    for (size_t i = 0; i < rows; ++i) {
      done[i * R + c] = dependent ? 0.0 : col[i] / norm;
      p[i * R + c] = static_cast<float>(done[i * R + c]);
    }
  }
}

void powersgd_expand(std::span<const float> p, std::span<const float> q, size_t rows, size_t cols,
                     int r, std::span<float> out) {
  const auto R = static_cast<size_t>(r);
  for (size_t i = 0; i < rows; ++i) {
    const float* pi = p.data() + i * R;
    float* row = out.data() + i * cols;
    for (size_t j = 0; j < cols; ++j) {
      const float* qj = q.data() + j * R;
      double acc = 0;
      for (size_t c = 0; c < R; ++c) acc += static_cast<double>(pi[c]) * qj[c];
      row[j] = static_cast<float>(acc);
    }
  }
}

}  // namespace mt
