#include "meshtrain/sync/codec_spec.h"

#include <charconv>
#include <cmath>
#include <vector>

#include <fmt/format.h>

#include "meshtrain/base/error.h"

namespace mt {
namespace {

constexpr std::string_view kKey = "sync.codec";
constexpr std::string_view kExpected =
    "one of none, f16, bf16, topk:K[:compact], randk:K[:compact], qsgd:BITS[:BUCKET], "
    "sign[:CHUNK], powersgd:RANK "
    "(K a fraction in (0, 1] such as 0.01 or an element count >= 1)";

[[noreturn]] void bad(std::string_view text, const std::string& why) {
  throw ConfigError(fmt::format("{}: \"{}\": {}", kKey, text, why));
}

std::vector<std::string_view> split_fields(std::string_view s) {
  std::vector<std::string_view> out;
  size_t start = 0;
  while (true) {
    const size_t colon = s.find(':', start);
    out.push_back(s.substr(start, colon == std::string_view::npos ? s.npos : colon - start));
    if (colon == std::string_view::npos) return out;
    start = colon + 1;
  }
}

bool parse_int(std::string_view s, int64_t& v) {
  if (s.empty()) return false;
  const auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  return ec == std::errc{} && p == s.data() + s.size();
}

// An integer field in [lo, hi]; `what` is e.g. "bits must be an integer from 2 to 8".
int64_t int_field(std::string_view text, std::string_view field, int64_t lo, int64_t hi,
                  const std::string& what) {
  int64_t v = 0;
  if (!parse_int(field, v) || v < lo || v > hi)
    bad(text, fmt::format("{}, got \"{}\"", what, field));
  return v;
}

void parse_k(std::string_view text, std::string_view field, CodecSpec& spec) {
  const std::string what = "k must be a fraction in (0, 1] (such as 0.01) or an element count >= 1";
  if (field.find_first_of(".eE") != std::string_view::npos) {
    double f = 0;
    const auto [p, ec] = std::from_chars(field.data(), field.data() + field.size(), f);
    if (ec != std::errc{} || p != field.data() + field.size() || !(f > 0) || f > 1) {
      bad(text, fmt::format("{}, got \"{}\"", what, field));
    }
    spec.k_fraction = f;
    return;
  }
  int64_t v = 0;
  if (!parse_int(field, v) || v < 1) bad(text, fmt::format("{}, got \"{}\"", what, field));
  spec.k_count = static_cast<size_t>(v);
}

}  // namespace

std::string_view codec_kind_name(CodecKind kind) {
  switch (kind) {
    case CodecKind::none:
      return "none";
    case CodecKind::f16:
      return "f16";
    case CodecKind::bf16:
      return "bf16";
    case CodecKind::topk:
      return "topk";
    case CodecKind::randk:
      return "randk";
    case CodecKind::qsgd:
      return "qsgd";
    case CodecKind::sign:
      return "sign";
    case CodecKind::powersgd:
      return "powersgd";
  }
  return "?";
}

CodecSpec parse_codec_spec(std::string_view text) {
  const std::vector<std::string_view> f = split_fields(text);
  const std::string_view name = f[0];
  CodecSpec spec;
  auto want_fields = [&](size_t lo, size_t hi, const char* form) {
    if (f.size() < lo || f.size() > hi) bad(text, fmt::format("expected {}", form));
  };
  if (name == "none" || name == "f16" || name == "bf16") {
    want_fields(1, 1, fmt::format("\"{}\" without parameters", name).c_str());
    spec.kind = name == "none" ? CodecKind::none : name == "f16" ? CodecKind::f16 : CodecKind::bf16;
    spec.error_feedback = spec.kind != CodecKind::none;
  } else if (name == "topk" || name == "randk") {
    want_fields(2, 3,
                fmt::format("{}:K[:compact] with K a fraction in (0, 1] or an element count", name)
                    .c_str());
    spec.kind = name == "topk" ? CodecKind::topk : CodecKind::randk;
    parse_k(text, f[1], spec);
    if (f.size() == 3) {
      if (f[2] != "compact") {
        bad(text, fmt::format("the third field must be \"compact\" (bf16 values, Elias-Fano "
                              "indices), got \"{}\"",
                              f[2]));
      }
      spec.compact = true;
    }
  } else if (name == "qsgd") {
    want_fields(2, 3, "qsgd:BITS or qsgd:BITS:BUCKET");
    spec.kind = CodecKind::qsgd;
    spec.bits = static_cast<int>(
        int_field(text, f[1], 2, 8, "bits must be an integer from 2 to 8 (sign + level)"));
    spec.chunk = CodecSpec::kQsgdDefaultBucket;
    if (f.size() == 3) {
      spec.chunk = static_cast<size_t>(
          int_field(text, f[2], 0, int64_t{1} << 40,
                    "the bucket must be an element count >= 1, or 0 for one bucket per tensor"));
    }
  } else if (name == "sign") {
    want_fields(1, 2, "sign or sign:CHUNK");
    spec.kind = CodecKind::sign;
    if (f.size() == 2) {
      spec.chunk = static_cast<size_t>(
          int_field(text, f[1], 0, int64_t{1} << 40,
                    "the chunk must be an element count >= 1, or 0 for one scale per tensor"));
    }
  } else if (name == "powersgd") {
    want_fields(2, 2, "powersgd:RANK");
    spec.kind = CodecKind::powersgd;
    spec.rank =
        static_cast<int>(int_field(text, f[1], 1, 1 << 16, "the rank must be an integer >= 1"));
  } else {
    bad(text, fmt::format("unknown codec \"{}\"; expected {}", name, kExpected));
  }
  return spec;
}

size_t CodecSpec::k_for(size_t numel) const {
  if (k_count > 0) return k_count;
  return static_cast<size_t>(std::ceil(k_fraction * static_cast<double>(numel)));
}

void CodecSpec::check_fits(size_t numel, std::string_view what) const {
  if (kind == CodecKind::topk || kind == CodecKind::randk) {
    if (k_count == 0 && !(k_fraction > 0 && k_fraction <= 1)) {
      throw ConfigError(
          fmt::format("{}: \"{}\": k must be a fraction in (0, 1] or an element "
                      "count >= 1, got neither",
                      kKey, to_string()));
    }
    const size_t k = k_for(numel);
    if (numel > 0 && (k == 0 || k > numel)) {
      throw ConfigError(
          fmt::format("{}: \"{}\": k = {} does not fit {} ({} elements); expected k from 1 to {}",
                      kKey, to_string(), k, what, numel, numel));
    }
    if (numel > uint64_t{0xffffffff}) {
      throw ConfigError(
          fmt::format("{}: \"{}\": {} has {} elements; sparse codecs index with "
                      "32 bits (at most 4294967295 elements)",
                      kKey, to_string(), what, numel));
    }
  }
  if (kind == CodecKind::qsgd && (bits < 2 || bits > 8)) {
    throw ConfigError(
        fmt::format("{}: \"{}\": bits must be from 2 to 8, got {}", kKey, to_string(), bits));
  }
  if (kind == CodecKind::powersgd && rank < 1) {
    throw ConfigError(
        fmt::format("{}: \"{}\": the rank must be >= 1, got {}", kKey, to_string(), rank));
  }
}

std::string CodecSpec::to_string() const {
  switch (kind) {
    case CodecKind::topk:
    case CodecKind::randk: {
      const std::string_view tail = compact ? ":compact" : "";
      if (k_count > 0) return fmt::format("{}:{}{}", codec_kind_name(kind), k_count, tail);
      // A fraction keeps a '.' or an exponent, so it parses back as one.
      std::string f = fmt::format("{}", k_fraction);
      if (f.find_first_of(".eE") == std::string::npos) f += ".0";
      return fmt::format("{}:{}{}", codec_kind_name(kind), f, tail);
    }
    case CodecKind::qsgd:
      return chunk == kQsgdDefaultBucket ? fmt::format("qsgd:{}", bits)
                                         : fmt::format("qsgd:{}:{}", bits, chunk);
    case CodecKind::sign:
      return chunk == 0 ? "sign" : fmt::format("sign:{}", chunk);
    case CodecKind::powersgd:
      return fmt::format("powersgd:{}", rank);
    default:
      return std::string(codec_kind_name(kind));
  }
}

}  // namespace mt
