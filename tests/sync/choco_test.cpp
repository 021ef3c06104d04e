// sync/choco.h, the codec of compressed gossip (CHOCO-SGD), without
// communication:
// - every codec it builds is a contraction on x - xhat (what CHOCO needs):
//   ||e - C(e)|| < ||e|| for random e, for the casts, top-k, rand-k, sign,
//   QSGD scaled by 1 / (1 + omega), and the local low-rank codec;
// - unscaled QSGD is not (its variance exceeds ||e||^2 at 4 bits), which is
//   why choco_factor scales it (the test of the test);
// - the local low-rank codec is exact on a matrix of rank <= r, sends f32
//   where the factors would not shrink, and its payload is (rows + cols) r
//   floats;
// - encode / decode_add cover the flat layout's offsets (padding untouched)
//   and payload_bytes is the sum of the parameters' payloads.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <string>
#include <vector>

#include "meshtrain/base/error.h"
#include "meshtrain/base/random.h"
#include "meshtrain/sync/choco.h"

namespace mt {
namespace {

std::vector<float> random_vector(size_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(rng.normal());
  return v;
}

double norm(const std::vector<float>& v) {
  double s = 0;
  for (float x : v) s += static_cast<double>(x) * x;
  return std::sqrt(s);
}

// ||e - factor * decode(encode(e))|| / ||e||, the mean over `trials` draws.
double relative_error(const CodecSpec& spec, const Shape& shape, int trials, float factor) {
  auto codec = make_choco_payload_codec(spec, shape, "t");
  const auto n = static_cast<size_t>(shape.numel());
  std::vector<std::byte> payload(codec->payload_bytes());
  double sum = 0;
  for (int t = 0; t < trials; ++t) {
    std::vector<float> e = random_vector(n, 100 + static_cast<uint64_t>(t));
    codec->encode(e, codec_seed(7, 0, static_cast<uint64_t>(t)), payload);
    std::vector<float> err = e;
    codec->decode_add(payload, -factor, err);
    sum += norm(err) / norm(e);
  }
  return sum / trials;
}

TEST(ChocoCodec, EveryCodecIsAContractionOnTheDifference) {
  const Shape shape({32, 64});
  for (const std::string text : {"f16", "bf16", "topk:0.1", "randk:0.1", "topk:0.05:compact",
                                 "sign", "qsgd:4", "qsgd:2", "powersgd:2", "powersgd:8"}) {
    const CodecSpec spec = parse_codec_spec(text);
    const float factor = choco_factor(spec, static_cast<size_t>(shape.numel()));
    const double r = relative_error(spec, shape, 20, factor);
    EXPECT_LT(r, 1.0) << text;
    EXPECT_GE(r, 0.0) << text;
  }
  // QSGD at 4 bits unscaled: unbiased, but its error exceeds the input.
  const CodecSpec q = parse_codec_spec("qsgd:4");
  EXPECT_GT(relative_error(q, shape, 20, 1.0F), 1.0);
  EXPECT_LT(choco_factor(q, 2048), 1.0F);
  EXPECT_EQ(choco_factor(parse_codec_spec("topk:0.1"), 2048), 1.0F);
}

TEST(ChocoCodec, LocalLowRankIsExactOnALowRankMatrix) {
  const size_t rows = 24, cols = 40;
  // A rank-2 matrix u1 v1^T + u2 v2^T.
  const std::vector<float> u = random_vector(2 * rows, 1), v = random_vector(2 * cols, 2);
  std::vector<float> m(rows * cols, 0.0F);
  for (size_t i = 0; i < rows; ++i) {
    for (size_t j = 0; j < cols; ++j) {
      m[i * cols + j] = u[i] * v[j] + u[rows + i] * v[cols + j];
    }
  }
  for (int r : {2, 3}) {
    auto codec = make_choco_payload_codec(
        parse_codec_spec(fmt::format("powersgd:{}", r)),
        Shape({static_cast<int64_t>(rows), static_cast<int64_t>(cols)}), "m");
    EXPECT_EQ(codec->payload_bytes(), 4 * (rows + cols) * static_cast<size_t>(r));
    std::vector<std::byte> payload(codec->payload_bytes());
    codec->encode(m, 99, payload);
    std::vector<float> err = m;
    codec->decode_add(payload, -1.0F, err);
    EXPECT_LT(norm(err), 1e-4 * norm(m)) << "rank " << r;
  }
  // A vector (cols 1) is not worth factors: f32, exact.
  auto vec = make_choco_payload_codec(parse_codec_spec("powersgd:2"), Shape({10}), "b");
  EXPECT_EQ(vec->payload_bytes(), 40u);
  const std::vector<float> b = random_vector(10, 3);
  std::vector<std::byte> payload(vec->payload_bytes());
  vec->encode(b, 1, payload);
  std::vector<float> out(10, 0.0F);
  vec->decode_add(payload, 1.0F, out);
  EXPECT_EQ(out, b);
}

TEST(ChocoCodec, EncodesEveryParameterAtItsOffset) {
  // Two parameters with padding between them (offsets 0 and 8).
  ParamLayout layout = {{"a", Shape({6}), 0}, {"b", Shape({4, 3}), 8}};
  ChocoCodec c(parse_codec_spec("topk:1.0"), layout);
  EXPECT_EQ(c.payload_bytes(), 8u * 6 + 8u * 12);
  EXPECT_EQ(c.part_bytes(), (std::vector<size_t>{48, 96}));
  const std::vector<float> x = random_vector(20, 5);
  const std::vector<float> hat = random_vector(20, 6);
  std::vector<std::byte> payload(c.payload_bytes());
  c.encode(x, hat, 0, 0, payload);
  std::vector<float> out = hat;
  c.decode_add(payload, 1.0F, out);
  for (size_t i = 0; i < 20; ++i) {
    const bool padding = i >= 6 && i < 8;
    if (padding) {
      EXPECT_EQ(out[i], hat[i]) << i;  // untouched
    } else {
      EXPECT_NEAR(out[i], x[i], 1e-6) << i;  // hat + (x - hat)
    }
  }
  EXPECT_THROW(ChocoCodec(parse_codec_spec("topk:7"), layout), ConfigError);  // k > 6
}

}  // namespace
}  // namespace mt
