// Gradient codecs on one rank (sync/codec_spec.h, sync/codecs.h): the spec
// parser and its errors; top-k keeps exactly the k largest magnitudes;
// error-feedback residual + what was sent == the input (bitwise for the
// sparse codecs); QSGD is unbiased; sign sends the mean magnitude; the
// PowerSGD algebra (exactness on rank-r matrices is in
// compressed_all_reduce_test.cpp, where the whole exchange runs).
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "meshtrain/base/error.h"
#include "meshtrain/base/random.h"
#include "meshtrain/sync/codec_spec.h"
#include "meshtrain/sync/codecs.h"
#include "meshtrain/tensor/dtype.h"

namespace mt {
namespace {

std::vector<float> normal_vector(size_t n, uint64_t seed, double scale = 1.0) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(scale * rng.normal());
  return v;
}

std::vector<float> decode(const PayloadCodec& c, std::span<const std::byte> payload) {
  std::vector<float> out(c.numel(), 0.0f);
  c.decode_add(payload, 1.0f, out);
  return out;
}

// The message of the ConfigError `f` throws ("" when it does not throw).
template <class F>
std::string config_error(F&& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

// ---- spec

TEST(CodecSpec, ParsesEveryCodecAndRoundTrips) {
  struct Case {
    const char* text;
    CodecKind kind;
  };
  for (const Case& c :
       {Case{"none", CodecKind::none}, Case{"f16", CodecKind::f16}, Case{"bf16", CodecKind::bf16},
        Case{"topk:0.01", CodecKind::topk}, Case{"topk:100", CodecKind::topk},
        Case{"randk:0.25", CodecKind::randk}, Case{"randk:1e-3", CodecKind::randk},
        Case{"qsgd:4", CodecKind::qsgd}, Case{"qsgd:8:0", CodecKind::qsgd},
        Case{"sign", CodecKind::sign}, Case{"sign:256", CodecKind::sign},
        Case{"powersgd:4", CodecKind::powersgd}, Case{"topk:0.01:compact", CodecKind::topk},
        Case{"randk:50:compact", CodecKind::randk}}) {
    SCOPED_TRACE(c.text);
    const CodecSpec s = parse_codec_spec(c.text);
    EXPECT_EQ(s.kind, c.kind);
    const CodecSpec back = parse_codec_spec(s.to_string());
    EXPECT_EQ(back.kind, s.kind);
    EXPECT_EQ(back.k_fraction, s.k_fraction);
    EXPECT_EQ(back.k_count, s.k_count);
    EXPECT_EQ(back.bits, s.bits);
    EXPECT_EQ(back.chunk, s.chunk);
    EXPECT_EQ(back.compact, s.compact);
    EXPECT_EQ(s.compact, std::string(c.text).ends_with(":compact"));
    EXPECT_EQ(back.rank, s.rank);
  }
  EXPECT_EQ(parse_codec_spec("topk:0.01").k_fraction, 0.01);
  EXPECT_EQ(parse_codec_spec("topk:100").k_count, 100u);
  EXPECT_EQ(parse_codec_spec("topk:1").k_count, 1u);        // an integer is a count
  EXPECT_EQ(parse_codec_spec("topk:1.0").k_fraction, 1.0);  // a '.' makes it a fraction
  EXPECT_EQ(parse_codec_spec("qsgd:4").chunk, CodecSpec::kQsgdDefaultBucket);
  EXPECT_EQ(parse_codec_spec("qsgd:3:64").chunk, 64u);
  EXPECT_EQ(parse_codec_spec("sign").chunk, 0u);
  EXPECT_EQ(parse_codec_spec("powersgd:2").rank, 2);
  EXPECT_FALSE(parse_codec_spec("none").error_feedback);
  EXPECT_TRUE(parse_codec_spec("topk:5").error_feedback);
  // k from a fraction rounds up, so a non-empty tensor never gets k = 0.
  EXPECT_EQ(parse_codec_spec("topk:0.01").k_for(1000), 10u);
  EXPECT_EQ(parse_codec_spec("topk:0.01").k_for(50), 1u);
}

TEST(CodecSpec, BadTextIsAConfigErrorNamingTheKeyAndWhatWasExpected) {
  struct Case {
    const char* text;
    const char* says;
  };
  for (const Case& c : {
           Case{"zip", "unknown codec \"zip\"; expected one of none, f16"},
           Case{"", "unknown codec \"\""},
           Case{"topk",
                "expected topk:K[:compact] with K a fraction in (0, 1] or an element count"},
           Case{"randk:0.01:bf16",
                "the third field must be \"compact\" (bf16 values, "
                "Elias-Fano indices), got \"bf16\""},
           Case{"topk:0.01:compact:x", "expected topk:K[:compact]"},
           Case{"topk:0",
                "k must be a fraction in (0, 1] (such as 0.01) or an element count >= "
                "1, got \"0\""},
           Case{"topk:0.0", "got \"0.0\""},
           Case{"randk:1.5", "k must be a fraction in (0, 1]"},
           Case{"topk:-3", "got \"-3\""},
           Case{"topk:ten", "got \"ten\""},
           Case{"qsgd:1", "bits must be an integer from 2 to 8 (sign + level), got \"1\""},
           Case{"qsgd:9", "bits must be an integer from 2 to 8"},
           Case{"qsgd:4:-1", "the bucket must be an element count >= 1, or 0"},
           Case{"qsgd", "expected qsgd:BITS or qsgd:BITS:BUCKET"},
           Case{"sign:x", "the chunk must be an element count"},
           Case{"powersgd:0", "the rank must be an integer >= 1, got \"0\""},
           Case{"powersgd", "expected powersgd:RANK"},
           Case{"f16:2", "expected \"f16\" without parameters"},
       }) {
    SCOPED_TRACE(c.text);
    const std::string msg = config_error([&] { parse_codec_spec(c.text); });
    EXPECT_NE(msg.find(fmt::format("sync.codec: \"{}\": ", c.text)), std::string::npos) << msg;
    EXPECT_NE(msg.find(c.says), std::string::npos) << msg;
  }
}

TEST(CodecSpec, KThatDoesNotFitTheTensorIsRejected) {
  const CodecSpec big = parse_codec_spec("topk:5000");
  const std::string msg = config_error([&] { big.check_fits(1000, "tensor 'fc1.weight'"); });
  EXPECT_EQ(msg,
            "sync.codec: \"topk:5000\": k = 5000 does not fit tensor 'fc1.weight' (1000 "
            "elements); expected k from 1 to 1000");
  EXPECT_EQ(config_error([&] { big.check_fits(5000, "t"); }), "");
  CodecSpec zero;  // built by hand with neither k set
  zero.kind = CodecKind::randk;
  EXPECT_NE(config_error([&] { zero.check_fits(10, "t"); }).find("got neither"), std::string::npos);
  CodecSpec bits;
  bits.kind = CodecKind::qsgd;
  bits.bits = 12;
  EXPECT_NE(config_error([&] { bits.check_fits(10, "t"); }).find("bits must be from 2 to 8"),
            std::string::npos);
  CodecSpec rank;
  rank.kind = CodecKind::powersgd;
  rank.rank = 0;
  EXPECT_NE(config_error([&] { rank.check_fits(10, "t"); }).find("the rank must be >= 1, got 0"),
            std::string::npos);
  EXPECT_NE(config_error([&] { make_payload_codec(big, 100); }).find("k = 5000"),
            std::string::npos);
}

// ---- top-k

TEST(TopK, KeepsExactlyTheKLargestMagnitudes) {
  for (size_t n : {1u, 7u, 1000u, 4099u}) {
    for (size_t k : {size_t{1}, n / 3 + 1, n}) {
      SCOPED_TRACE(fmt::format("n {} k {}", n, k));
      std::vector<float> e = normal_vector(n, 11 + n);
      // Ties everywhere (k falls inside a group of equal magnitudes, both
      // signs): multiples of 0.5, so the lower index must win.
      for (float& x : e) x = std::round(2 * x) / 2;
      std::vector<uint32_t> want(n);
      std::iota(want.begin(), want.end(), 0u);
      std::stable_sort(want.begin(), want.end(),
                       [&](uint32_t a, uint32_t b) { return std::fabs(e[a]) > std::fabs(e[b]); });
      want.resize(k);
      std::sort(want.begin(), want.end());
      EXPECT_EQ(top_k_indices(e, k), want);

      // The payload carries those indices and e's exact values there.
      CodecSpec s;
      s.kind = CodecKind::topk;
      s.k_count = k;
      auto codec = make_payload_codec(s, n);
      ASSERT_EQ(codec->payload_bytes(), 8 * k);
      std::vector<std::byte> payload(codec->payload_bytes());
      codec->encode(e, 0, payload);
      std::vector<uint32_t> idx(k);
      std::memcpy(idx.data(), payload.data(), 4 * k);
      EXPECT_EQ(idx, want);
      const std::vector<float> d = decode(*codec, payload);
      for (size_t i = 0; i < n; ++i) {
        const bool kept = std::binary_search(want.begin(), want.end(), static_cast<uint32_t>(i));
        EXPECT_EQ(d[i], kept ? e[i] : 0.0f) << i;
      }
    }
  }
}

// Large tensors with small k take the sampled-threshold path of
// top_k_indices: the same exact answer, also when the strided sample holds
// all the largest values (threshold too high: fallback) or none of them.
TEST(TopK, LargeTensorsSmallKAreExact) {
  const size_t n = 100'003;
  const size_t stride = n / 4096;
  for (int layout = 0; layout < 3; ++layout) {
    std::vector<float> e = normal_vector(n, 500 + layout);
    for (float& x : e) x = std::round(8 * x) / 8;  // ties
    if (layout == 1) {
      for (size_t j = 0; j < 4096; ++j) e[j * stride] = 100.0f + static_cast<float>(j % 50);
    } else if (layout == 2) {
      for (size_t j = 0; j < 4096; ++j) e[j * stride] = 0.0f;
      for (size_t j = 0; j < 300; ++j) e[j * stride + 1] = -50.0f;
    }
    std::vector<uint32_t> order(n);
    std::iota(order.begin(), order.end(), 0u);
    std::stable_sort(order.begin(), order.end(),
                     [&](uint32_t a, uint32_t b) { return std::fabs(e[a]) > std::fabs(e[b]); });
    for (size_t k : {size_t{1}, size_t{37}, size_t{1000}, size_t{6000}}) {
      std::vector<uint32_t> want(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k));
      std::sort(want.begin(), want.end());
      EXPECT_EQ(top_k_indices(e, k), want) << "layout " << layout << " k " << k;
    }
  }
}

TEST(TopK, APayloadIndexOutsideTheTensorIsACommError) {
  auto big = make_payload_codec(parse_codec_spec("topk:1"), 100);
  auto small = make_payload_codec(parse_codec_spec("topk:1"), 50);
  std::vector<float> e(100, 0.0f);
  e[99] = 1.0f;
  std::vector<std::byte> p(8);
  big->encode(e, 0, p);
  std::vector<float> out(50, 0.0f);
  try {
    small->decode_add(p, 1.0f, out);
    FAIL() << "decoded index 99 into 50 elements";
  } catch (const CommError& err) {
    EXPECT_NE(std::string(err.what()).find("index 99 of entry 0 is outside the tensor's 50"),
              std::string::npos)
        << err.what();
  }
}

// ---- the compact sparse format (bf16 values, Elias-Fano indices)

// e with value v(j) at idx[j] and zero elsewhere, so top-k with k =
// idx.size() keeps exactly idx.
std::vector<float> spikes(size_t n, const std::vector<uint32_t>& idx) {
  std::vector<float> e(n, 0.0f);
  for (size_t j = 0; j < idx.size(); ++j) {
    // Not representable in bf16 (rounding happens), distinct, both signs.
    e[idx[j]] = static_cast<float>((j % 2 ? -1.0 : 1.0) * (1.0 + 0.0013 * static_cast<double>(j)));
  }
  return e;
}

// Encodes spikes(n, idx) with topk:K:compact and checks the decoded tensor:
// exactly the indices, each value bf16-rounded (nearest even).
void expect_compact_round_trip(size_t n, const std::vector<uint32_t>& idx) {
  SCOPED_TRACE(fmt::format("n {} k {} first {} last {}", n, idx.size(), idx.front(), idx.back()));
  const std::vector<float> e = spikes(n, idx);
  auto codec = make_payload_codec(parse_codec_spec(fmt::format("topk:{}:compact", idx.size())), n);
  // Garbage in the buffer must not leak into the payload (it is reused).
  std::vector<std::byte> p(codec->payload_bytes(), std::byte{0xa5});
  codec->encode(e, 0, p);
  const std::vector<float> out = decode(*codec, p);
  size_t nonzero = 0;
  for (size_t i = 0; i < n; ++i) {
    const float want = e[i] == 0.0f ? 0.0f : bf16_to_f32(f32_to_bf16(e[i]));
    ASSERT_EQ(out[i], want) << "element " << i;
    nonzero += out[i] != 0.0f;
  }
  EXPECT_EQ(nonzero, idx.size());
  // The size is the Elias-Fano bound: 2 bytes a value, L + 1 bits an index
  // plus (n - 1) >> L bits of high part, L = floor(log2(n / k)).
  const size_t k = idx.size();
  size_t L = 0;
  while ((size_t{2} << L) <= n / k) ++L;
  EXPECT_EQ(codec->payload_bytes(), 2 * k + (k * (L + 1) + ((n - 1) >> L) + 7) / 8);
}

TEST(CompactSparse, RoundTripsIndicesExactlyAndValuesRoundedToBf16) {
  // Gaps 1..127 (one byte as a varint would be), 128, and beyond 2^14 and
  // 2^21; index 0 and index n - 1; k = n; k = 1; a run at the very end.
  std::vector<uint32_t> small_gaps = {0};
  for (uint32_t g = 1; g <= 127; ++g) small_gaps.push_back(small_gaps.back() + g);
  expect_compact_round_trip(small_gaps.back() + 1, small_gaps);
  expect_compact_round_trip(100000, small_gaps);
  std::vector<uint32_t> gap128;
  for (uint32_t i = 0; i < 50; ++i) gap128.push_back(128 * i);
  expect_compact_round_trip(128 * 49 + 1, gap128);
  expect_compact_round_trip(10000, gap128);
  const uint32_t n_big = 5'000'000;
  expect_compact_round_trip(
      n_big, {0, (1u << 14) + 1, (1u << 14) + 2 + (1u << 21), (1u << 22) + 7, n_big - 1});
  expect_compact_round_trip(n_big, {n_big - 1});  // one index, at the end: L = 22
  expect_compact_round_trip(n_big, {0});
  expect_compact_round_trip(1, {0});
  expect_compact_round_trip(2, {1});
  std::vector<uint32_t> all(1000);
  std::iota(all.begin(), all.end(), 0u);
  expect_compact_round_trip(1000, all);  // k == n: L = 0, every gap 0
  expect_compact_round_trip(1000, {995, 996, 997, 998, 999});
  // Random index sets at densities from 0.05% to 90%.
  Rng rng(77);
  for (double density : {0.0005, 0.01, 0.1, 0.5, 0.9}) {
    const size_t n = 100003;
    std::vector<uint32_t> idx;
    for (uint32_t i = 0; i < n; ++i) {
      if (rng.uniform() < density) idx.push_back(i);
    }
    expect_compact_round_trip(n, idx);
  }
}

TEST(CompactSparse, KeepsTheKLargestAndSendsUnderFourBytesAnElementAtOnePercent) {
  const size_t n = 1 << 20;
  std::vector<float> e = normal_vector(n, 8);
  for (size_t i = 0; i < n; i += 97) e[i] = 2.5f;  // ties, broken toward the lower index
  const CodecSpec spec = parse_codec_spec("topk:0.01:compact");
  auto codec = make_payload_codec(spec, n);
  const size_t k = spec.k_for(n);
  std::vector<std::byte> p(codec->payload_bytes());
  codec->encode(e, 0, p);
  const std::vector<float> out = decode(*codec, p);
  std::vector<uint32_t> got;
  for (size_t i = 0; i < n; ++i) {
    if (out[i] != 0.0f) {
      got.push_back(static_cast<uint32_t>(i));
      ASSERT_EQ(out[i], bf16_to_f32(f32_to_bf16(e[i])));
    }
  }
  EXPECT_EQ(got, top_k_indices(e, k));
  // 2 bytes of value + (L + 2) / 8 bytes of index, L = 6: 3.07 (the
  // uncompact format sends 8).
  const double per = static_cast<double>(codec->payload_bytes()) / static_cast<double>(k);
  std::printf("topk:0.01:compact on %zu elements: %.3f bytes per kept element\n", n, per);
  EXPECT_LT(per, 3.1);
  // randk shares the format: same size, its own draw, the same bits for
  // the same seed.
  auto rk = make_payload_codec(parse_codec_spec("randk:0.01:compact"), n);
  ASSERT_EQ(rk->payload_bytes(), codec->payload_bytes());
  std::vector<std::byte> a(p.size()), b(p.size());
  rk->encode(e, 3, a);
  rk->encode(e, 3, b);
  EXPECT_EQ(a, b);
  const std::vector<float> ra = decode(*rk, a);
  EXPECT_EQ(
      static_cast<size_t>(std::count_if(ra.begin(), ra.end(), [](float v) { return v != 0; })), k);
}

TEST(CompactSparse, SaturatesAtTheLargestBf16AndKeepsTheExcess) {
  FeedbackEncoder enc(make_payload_codec(parse_codec_spec("topk:3:compact"), 4), true);
  std::vector<std::byte> payload(enc.codec().payload_bytes());
  const float big = std::numeric_limits<float>::max();
  const std::vector<float> g = {big, -big, 1.0f + 0x1p-12f, 0.0f};
  enc.encode(g, 0, payload);
  const std::vector<float> sent = decode(enc.codec(), payload);
  const float bf16_max = bf16_to_f32(bf16{0x7f7f});
  EXPECT_EQ(sent, (std::vector<float>{bf16_max, -bf16_max, 1.0f, 0.0f}));
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(enc.residual()[i] + sent[i], g[i]) << i;
  EXPECT_EQ(enc.residual()[2], 0x1p-12f);
}

TEST(CompactSparse, AMalformedIndexStreamIsACommError) {
  // n 100, k 1: L = 6, one value (2 bytes), then 6 low bits and a 2-bit
  // high part in one byte.
  auto codec = make_payload_codec(parse_codec_spec("topk:1:compact"), 100);
  ASSERT_EQ(codec->payload_bytes(), 3u);
  std::vector<float> out(100, 0.0f);
  auto message = [&](std::byte bits) {
    const std::vector<std::byte> p = {std::byte{0x80}, std::byte{0x3f}, bits};
    try {
      codec->decode_add(p, 1.0f, out);
    } catch (const CommError& err) {
      return std::string(err.what());
    }
    return std::string();
  };
  // No high bit set: the stream ends before the entry.
  EXPECT_NE(message(std::byte{0x3f}).find("the index stream ends before entry 0 of 1"),
            std::string::npos);
  // Low 63, high 1: index 127 of a 100-element tensor.
  EXPECT_NE(message(std::byte{0xbf}).find("index 127 of entry 0 is outside the tensor's 100"),
            std::string::npos);
  // Low 35, high 1 (bit 7): index 99, value 1.0.
  EXPECT_EQ(message(std::byte{0xa3}), "");
  EXPECT_EQ(out[99], 1.0f);
}

TEST(RandK, DrawsKDistinctIndicesDependingOnTheSeed) {
  const size_t n = 1000;
  const std::vector<float> e = normal_vector(n, 3);
  for (const char* text : {"randk:10", "randk:0.5", "randk:1.0"}) {
    auto codec = make_payload_codec(parse_codec_spec(text), n);
    const size_t k = codec->payload_bytes() / 8;
    std::vector<std::byte> a(codec->payload_bytes()), b(a.size()), c(a.size());
    codec->encode(e, 1, a);
    codec->encode(e, 1, b);
    codec->encode(e, 2, c);
    EXPECT_EQ(a, b) << text;  // a function of (e, seed)
    if (k < n) {              // k == n: every index, whatever the seed
      EXPECT_NE(a, c) << text;
    }
    std::vector<uint32_t> idx(k);
    std::memcpy(idx.data(), a.data(), 4 * k);
    EXPECT_TRUE(std::is_sorted(idx.begin(), idx.end()));
    EXPECT_EQ(std::adjacent_find(idx.begin(), idx.end()), idx.end()) << "repeated index";
    EXPECT_LT(idx.back(), n);
  }
  // Every index is about equally likely: over 2000 draws of 10 from 100,
  // each index is drawn 200 times on average (binomial sd ~13.4).
  auto small = make_payload_codec(parse_codec_spec("randk:10"), 100);
  std::vector<int> hits(100, 0);
  std::vector<std::byte> p(small->payload_bytes());
  const std::vector<float> e100 = normal_vector(100, 4);
  for (uint64_t s = 0; s < 2000; ++s) {
    small->encode(e100, codec_seed(9, 0, s), p);
    for (size_t j = 0; j < 10; ++j) {
      uint32_t i;
      std::memcpy(&i, p.data() + 4 * j, 4);
      ++hits[i];
    }
  }
  for (int h : hits) EXPECT_NEAR(h, 200, 6 * 13.4);
}

// ---- error feedback

TEST(ErrorFeedback, ResidualPlusWhatWasSentIsTheInput) {
  const size_t n = 3001;
  for (const char* text :
       {"topk:0.01", "topk:1", "randk:0.05", "f16", "bf16", "qsgd:4", "qsgd:2:0", "sign", "sign:64",
        "topk:0.01:compact", "topk:1:compact", "randk:0.05:compact"}) {
    SCOPED_TRACE(text);
    const CodecSpec spec = parse_codec_spec(text);
    const bool exact = spec.kind == CodecKind::topk || spec.kind == CodecKind::randk ||
                       spec.kind == CodecKind::f16 || spec.kind == CodecKind::bf16;
    FeedbackEncoder enc(make_payload_codec(spec, n), true);
    std::vector<std::byte> payload(enc.codec().payload_bytes());
    std::vector<float> residual(n, 0.0f);
    for (uint64_t step = 0; step < 4; ++step) {
      std::vector<float> g = normal_vector(n, 100 + step, 0.01);
      g[step] = 1e6f;  // beyond f16's range: saturated, the excess kept
      std::vector<float> e(n);
      for (size_t i = 0; i < n; ++i) e[i] = g[i] + residual[i];
      enc.encode(g, codec_seed(5, 0, step), payload);
      const std::vector<float> sent = decode(enc.codec(), payload);
      const std::span<const float> r = enc.residual();
      size_t kept = 0;
      for (size_t i = 0; i < n; ++i) {
        if (exact) {
          // Bitwise: sparse codecs send e's own values and zero them in the
          // residual; e - cast(e) is exact in f32 (Sterbenz).
          ASSERT_EQ(r[i] + sent[i], e[i]) << "step " << step << " element " << i;
        } else {
          // One f32 rounding of e - sent (sent may be far larger than e).
          ASSERT_NEAR(r[i] + sent[i], e[i], 2.4e-7 * (std::fabs(e[i]) + std::fabs(sent[i])))
              << "step " << step << " element " << i;
        }
        kept += r[i] != 0.0f;
      }
      EXPECT_GT(kept, 0u);  // every codec here holds something back
      residual.assign(r.begin(), r.end());
    }
  }
}

TEST(ErrorFeedback, F16SaturatesAndKeepsTheExcess) {
  FeedbackEncoder enc(make_payload_codec(parse_codec_spec("f16"), 3), true);
  std::vector<std::byte> payload(6);
  const std::vector<float> g = {1e6f, -7e4f, 1.0f};
  enc.encode(g, 0, payload);
  EXPECT_EQ(decode(enc.codec(), payload), (std::vector<float>{65504.0f, -65504.0f, 1.0f}));
  EXPECT_EQ(enc.residual()[0], 1e6f - 65504.0f);
  EXPECT_EQ(enc.residual()[1], -7e4f + 65504.0f);
  EXPECT_EQ(enc.residual()[2], 0.0f);
  // Without error feedback nothing is kept.
  FeedbackEncoder plain(make_payload_codec(parse_codec_spec("f16"), 3), false);
  plain.encode(g, 0, payload);
  EXPECT_EQ(plain.residual()[0], 0.0f);
}

// The casts' vectorized loops round exactly as tensor/dtype.h's converters:
// nearest even, subnormals exact, f16 saturated at 65504 (NaN stays NaN).
TEST(Casts, RoundExactlyAsTheDtypeConverters) {
  std::vector<float> e = normal_vector(1003, 31, 3.0);
  const float specials[] = {0.0f,    -0.0f,          1e-40f,          -1e-42f,
                            6e-8f,   3e-8f,          1e-5f,           65504.f,
                            65519.f, 65520.f,        -7e4f,           1e30f,
                            3.4e38f, 1.0f + 0x1p-8f, 1.0f + 0x1p-11f, 1.0f + 3 * 0x1p-11f};
  for (size_t i = 0; i < std::size(specials); ++i) e[7 * i + 1] = specials[i];
  e[500] = std::numeric_limits<float>::quiet_NaN();
  for (const char* text : {"f16", "bf16"}) {
    SCOPED_TRACE(text);
    auto codec = make_payload_codec(parse_codec_spec(text), e.size());
    std::vector<std::byte> p(codec->payload_bytes());
    codec->encode(e, 0, p);
    const std::vector<float> d = decode(*codec, p);
    for (size_t i = 0; i < e.size(); ++i) {
      uint16_t got;
      std::memcpy(&got, p.data() + 2 * i, 2);
      if (std::isnan(e[i])) {
        EXPECT_TRUE(std::isnan(d[i]));
        continue;
      }
      const uint16_t want = std::string(text) == "f16"
                                ? f32_to_f16(std::clamp(e[i], -65504.0f, 65504.0f)).bits
                                : f32_to_bf16(e[i]).bits;
      EXPECT_EQ(got, want) << "element " << i << " = " << e[i];
      EXPECT_EQ(d[i], std::string(text) == "f16" ? f16_to_f32(f16{want}) : bf16_to_f32(bf16{want}));
    }
  }
}

// ---- QSGD

// The decoded value of each element, averaged over `trials` seeds, is within
// 6 standard deviations of the input. Each decoded element takes one of two
// adjacent levels norm*l/s apart by norm/s, so its variance is at most
// (norm/s)^2/4 and the mean of `trials` independent draws has a standard
// deviation at most norm / (2 s sqrt(trials)). Six of them: a correct
// quantizer fails an element with probability ~2e-9 (normal tail; the
// seeds are fixed, so the test is deterministic), while a biased rounding
// (always down, or a level off by one) misses by ~norm/s/2, i.e. ~100 of
// those standard deviations at 40000 trials.
TEST(Qsgd, IsUnbiased) {
  const size_t n = 48;
  const int trials = 40000;
  for (const char* text : {"qsgd:2:0", "qsgd:4:16", "qsgd:8:0"}) {
    SCOPED_TRACE(text);
    const CodecSpec spec = parse_codec_spec(text);
    auto codec = make_payload_codec(spec, n);
    std::vector<float> e = normal_vector(n, 77);
    e[5] = 0.0f;
    e[6] = -0.0f;
    std::vector<std::byte> payload(codec->payload_bytes());
    std::vector<double> sum(n, 0.0);
    std::vector<float> d(n);
    for (int t = 0; t < trials; ++t) {
      codec->encode(e, codec_seed(1, 0, static_cast<uint64_t>(t)), payload);
      std::fill(d.begin(), d.end(), 0.0f);
      codec->decode_add(payload, 1.0f, d);
      for (size_t i = 0; i < n; ++i) sum[i] += d[i];
    }
    const double s = (1 << (spec.bits - 1)) - 1;
    const size_t bucket = spec.chunk == 0 ? n : spec.chunk;
    for (size_t i = 0; i < n; ++i) {
      double sq = 0;
      for (size_t j = i / bucket * bucket; j < std::min(n, (i / bucket + 1) * bucket); ++j) {
        sq += static_cast<double>(e[j]) * e[j];
      }
      const double sd = std::sqrt(sq) / (2 * s * std::sqrt(static_cast<double>(trials)));
      EXPECT_NEAR(sum[i] / trials, e[i], 6 * sd + 1e-6 * std::fabs(e[i])) << "element " << i;
    }
    EXPECT_EQ(sum[5], 0.0);  // zero stays zero
  }
}

TEST(Qsgd, PayloadSizeAndLevels) {
  // 1000 elements, 4 bits, buckets of 512: 2 norms + 500 bytes of codes.
  auto codec = make_payload_codec(parse_codec_spec("qsgd:4"), 1000);
  EXPECT_EQ(codec->payload_bytes(), 2 * 4 + 500u);
  auto whole = make_payload_codec(parse_codec_spec("qsgd:3:0"), 1001);
  EXPECT_EQ(whole->payload_bytes(), 4 + 376u);  // ceil(3003 / 8)
  // Every decoded value is a level of its bucket: sign * norm * j / s.
  const std::vector<float> e = normal_vector(1000, 8);
  std::vector<std::byte> p(codec->payload_bytes());
  codec->encode(e, 3, p);
  const std::vector<float> d = decode(*codec, p);
  float norm0;
  std::memcpy(&norm0, p.data(), 4);
  for (size_t i = 0; i < 512; ++i) {
    const double level = std::fabs(d[i]) / (norm0 / 7.0);
    EXPECT_NEAR(level, std::round(level), 1e-4) << i;
    EXPECT_LE(std::fabs(d[i] - e[i]), norm0 / 7.0 * (1 + 1e-6)) << i;
    if (d[i] != 0) {
      EXPECT_EQ(std::signbit(d[i]), std::signbit(e[i])) << i;
    }
  }
}

// ---- sign

TEST(Sign, SendsTheSignTimesTheMeanMagnitudePerChunk) {
  const std::vector<float> e = {1, -2, 3, -4, 0.5f, 0.5f, -1};
  for (size_t chunk : {size_t{0}, size_t{3}}) {
    CodecSpec s;
    s.kind = CodecKind::sign;
    s.chunk = chunk;
    auto codec = make_payload_codec(s, e.size());
    EXPECT_EQ(codec->payload_bytes(), (chunk == 0 ? 4u : 12u) + 1u);
    std::vector<std::byte> p(codec->payload_bytes());
    codec->encode(e, 0, p);
    const std::vector<float> d = decode(*codec, p);
    if (chunk == 0) {
      const float m = 12.0f / 7.0f;
      EXPECT_EQ(d, (std::vector<float>{m, -m, m, -m, m, m, -m}));
    } else {
      const float m = 5.0f / 3.0f;  // |-4| + 0.5 + 0.5 over 3
      EXPECT_EQ(d, (std::vector<float>{2, -2, 2, -m, m, m, -1}));
    }
  }
}

// ---- PowerSGD algebra

TEST(PowerSgdAlgebra, OrthogonalizesAndDropsDependentColumns) {
  const size_t rows = 20;
  std::vector<float> p = normal_vector(rows * 3, 21);
  for (size_t i = 0; i < rows; ++i) p[i * 3 + 2] = 2 * p[i * 3 + 0] - p[i * 3 + 1];
  orthogonalize_columns(p, rows, 3);
  for (int a = 0; a < 2; ++a) {
    for (int b = 0; b < 2; ++b) {
      double dot = 0;
      for (size_t i = 0; i < rows; ++i) dot += static_cast<double>(p[i * 3 + a]) * p[i * 3 + b];
      EXPECT_NEAR(dot, a == b ? 1.0 : 0.0, 1e-6);
    }
  }
  for (size_t i = 0; i < rows; ++i) EXPECT_EQ(p[i * 3 + 2], 0.0f);
  EXPECT_TRUE(powersgd_compresses(100, 50, 4));
  EXPECT_FALSE(powersgd_compresses(100, 1, 1));  // a vector
  EXPECT_FALSE(powersgd_compresses(8, 8, 4));    // (8 + 8) * 4 == 64
}

TEST(PowerSgdAlgebra, ProjectionsAreMatrixProducts) {
  const size_t rows = 5, cols = 4;
  const int r = 2;
  const std::vector<float> m = normal_vector(rows * cols, 1), q = normal_vector(cols * r, 2);
  std::vector<float> p(rows * r), qt(cols * r), out(rows * cols);
  powersgd_project(m, rows, cols, q, r, p);
  powersgd_back_project(m, rows, cols, p, r, qt);
  powersgd_expand(p, qt, rows, cols, r, out);
  for (size_t i = 0; i < rows; ++i) {
    for (int c = 0; c < r; ++c) {
      double want = 0;
      for (size_t j = 0; j < cols; ++j) want += double{m[i * cols + j]} * q[j * r + c];
      EXPECT_NEAR(p[i * r + c], want, 1e-5);
    }
  }
  for (size_t j = 0; j < cols; ++j) {
    for (int c = 0; c < r; ++c) {
      double want = 0;
      for (size_t i = 0; i < rows; ++i) want += double{m[i * cols + j]} * p[i * r + c];
      EXPECT_NEAR(qt[j * r + c], want, 1e-4);
    }
  }
  for (size_t i = 0; i < rows; ++i) {
    for (size_t j = 0; j < cols; ++j) {
      double want = 0;
      for (int c = 0; c < r; ++c) want += double{p[i * r + c]} * qt[j * r + c];
      EXPECT_NEAR(out[i * cols + j], want, 1e-4);
    }
  }
}

}  // namespace
}  // namespace mt
