// CodecSpec: which gradient codec a compressed exchange uses, and its knobs,
// parsed from the text a config file gives (the key `sync.codec`).
//
//   "none"            f32, uncompressed (a plain all-reduce)
//   "f16", "bf16"     cast to a 16-bit float
//   "topk:0.01"       the k largest magnitudes; k as a fraction of the
//   "topk:1000"       tensor's elements (a number with a '.' or an exponent,
//                     0 < f <= 1; k = ceil(f * numel)) or as a count (an
//                     integer >= 1, at most the tensor's element count)
//   "randk:0.01"      k elements drawn uniformly without replacement (k as for
//                     topk)
//   "topk:0.01:compact", "randk:K:compact"
//                     the same k elements in the compact wire format: values
//                     rounded to bf16 (error feedback keeps the rounding) and
//                     the ascending indices Elias-Fano coded, about 3 bytes
//                     per element at 1% instead of 8 (sync/codecs.h)
//   "qsgd:4"          QSGD stochastic quantization with 4 bits per element
//   "qsgd:4:1024"     (1 sign bit, bits-1 bits of level, 2 <= bits <= 8),
//                     one f32 L2 norm per bucket of 512 elements unless the
//                     third field says otherwise (0 = one bucket per tensor)
//   "sign"            1 bit per element with one f32 scale (mean magnitude)
//   "sign:256"        per tensor, or per chunk of this many elements
//   "powersgd:4"      PowerSGD rank-4 approximation (rank >= 1)
//
// Every codec except "none" carries an error-feedback residual by default
// (sync/codecs.h says what each one sends and keeps). Parsing checks what
// can be checked without the tensor; check_fits() the rest (k against the
// element count). Both throw ConfigError naming `sync.codec`, the text and
// what was expected.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace mt {

enum class CodecKind : uint8_t { none, f16, bf16, topk, randk, qsgd, sign, powersgd };

std::string_view codec_kind_name(CodecKind kind);

struct CodecSpec {
  CodecKind kind = CodecKind::none;
  // topk / randk: exactly one of the two is set (> 0).
  double k_fraction = 0;
  size_t k_count = 0;
  // topk / randk: the compact wire format (bf16 values, Elias-Fano indices)
  // instead of (u32 index, f32 value) pairs.
  bool compact = false;
  // qsgd: bits per element (sign + level), 2..8.
  int bits = 4;
  // qsgd: elements per bucket sharing one norm (0: the whole tensor);
  // sign: elements per chunk sharing one scale (0: the whole tensor).
  size_t chunk = 0;
  // powersgd: rank of the approximation.
  int rank = 0;
  // Keep what was not sent and add it to the next step's input.
  bool error_feedback = true;
  // Base seed of randk's index draws, QSGD's rounding and PowerSGD's first Q;
  // each rank and step derives its own stream from it (sync/codecs.h).
  uint64_t seed = 0;

  static constexpr size_t kQsgdDefaultBucket = 512;

  // k for a tensor of `numel` elements (topk / randk only).
  size_t k_for(size_t numel) const;
  // Throws ConfigError when the spec does not fit a tensor of `numel`
  // elements: k larger than the tensor (or 0 for a non-empty one). `what`
  // names the tensor in the message.
  void check_fits(size_t numel, std::string_view what) const;
  // The canonical text: parse_codec_spec(s.to_string()) == s (fields of
  // the kind only).
  std::string to_string() const;
  // Whether the codec draws random numbers (randk, qsgd).
  bool stochastic() const { return kind == CodecKind::randk || kind == CodecKind::qsgd; }
};

// Parses the text of `sync.codec`; throws ConfigError on anything else, e.g.
//   sync.codec: "qsgd:12": bits must be an integer from 2 to 8, got "12"
CodecSpec parse_codec_spec(std::string_view text);

}  // namespace mt
