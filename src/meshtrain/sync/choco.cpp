#include "meshtrain/sync/choco.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "meshtrain/base/error.h"
#include "meshtrain/base/random.h"

namespace mt {

namespace {

// powersgd:R on one tensor without an all-reduce (choco.h): one power
// iteration from a Gaussian start drawn from the seed. Tensors the factors
// would not shrink travel as f32.
class LocalLowRankCodec : public PayloadCodec {
 public:
  LocalLowRankCodec(size_t numel, size_t rows, int rank)
      : PayloadCodec(numel),
        rows_(rows),
        cols_(rows == 0 ? 0 : numel / rows),
        r_(rank),
        low_rank_(numel > 0 && powersgd_compresses(rows_, cols_, rank)) {}

  size_t payload_bytes() const override {
    return sizeof(float) * (low_rank_ ? (rows_ + cols_) * static_cast<size_t>(r_) : numel_);
  }

  void encode(std::span<const float> e, uint64_t seed,
              std::span<std::byte> payload) const override {
    MT_CHECK(e.size() == numel_ && payload.size() == payload_bytes(), "low-rank encode sizes");
    if (!low_rank_) {
      std::memcpy(payload.data(), e.data(), numel_ * sizeof(float));
      return;
    }
    const auto R = static_cast<size_t>(r_);
    std::vector<float> g(cols_ * R), p(rows_ * R), q(cols_ * R);
    Rng rng(seed);
    for (float& x : g) x = static_cast<float>(rng.normal());
    powersgd_project(e, rows_, cols_, g, r_, p);
    orthogonalize_columns(p, rows_, r_);
    powersgd_back_project(e, rows_, cols_, p, r_, q);
    std::memcpy(payload.data(), p.data(), p.size() * sizeof(float));
    std::memcpy(payload.data() + p.size() * sizeof(float), q.data(), q.size() * sizeof(float));
  }

  void decode_add(std::span<const std::byte> payload, float scale,
                  std::span<float> out) const override {
    MT_CHECK(out.size() == numel_ && payload.size() == payload_bytes(), "low-rank decode sizes");
    if (!low_rank_) {
      std::vector<float> x(numel_);
      std::memcpy(x.data(), payload.data(), numel_ * sizeof(float));
      for (size_t i = 0; i < numel_; ++i) out[i] += scale * x[i];
      return;
    }
    const auto R = static_cast<size_t>(r_);
    std::vector<float> p(rows_ * R), q(cols_ * R);
    std::memcpy(p.data(), payload.data(), p.size() * sizeof(float));
    std::memcpy(q.data(), payload.data() + p.size() * sizeof(float), q.size() * sizeof(float));
    for (size_t i = 0; i < rows_; ++i) {
      for (size_t j = 0; j < cols_; ++j) {
        float s = 0;
        for (size_t c = 0; c < R; ++c) s += p[i * R + c] * q[j * R + c];
        out[i * cols_ + j] += scale * s;
      }
    }
  }

 private:
  size_t rows_, cols_;
  int r_;
  bool low_rank_;
};

}  // namespace

float choco_factor(const CodecSpec& spec, size_t numel) {
  return contraction_factor(spec, numel);
}

std::unique_ptr<PayloadCodec> make_choco_payload_codec(const CodecSpec& spec, const Shape& shape,
                                                       std::string_view what) {
  const auto numel = static_cast<size_t>(shape.numel());
  spec.check_fits(numel, what);
  if (spec.kind == CodecKind::powersgd) {
    const size_t rows = shape.rank() == 0 ? 1 : static_cast<size_t>(shape[0]);
    return std::make_unique<LocalLowRankCodec>(numel, rows, spec.rank);
  }
  return make_payload_codec(spec, numel);
}

ChocoCodec::ChocoCodec(const CodecSpec& spec, const ParamLayout& layout) : spec_(spec) {
  size_t widest = 0;
  for (const ParamLayoutEntry& e : layout) {
    Part p;
    p.offset = static_cast<size_t>(e.offset);
    p.numel = static_cast<size_t>(e.shape.numel());
    p.codec = make_choco_payload_codec(spec, e.shape, fmt::format("parameter {}", e.name));
    p.at = bytes_;
    p.bytes = p.codec->payload_bytes();
    p.factor = choco_factor(spec, p.numel);
    bytes_ += p.bytes;
    widest = std::max(widest, p.numel);
    parts_.push_back(std::move(p));
  }
  e_.resize(widest);
}

void ChocoCodec::encode(std::span<const float> x, std::span<const float> hat, int rank,
                        uint64_t draw, std::span<std::byte> payload) {
  MT_CHECK(payload.size() == bytes_, "CHOCO payload of {} bytes, expected {}", payload.size(),
           bytes_);
  for (size_t k = 0; k < parts_.size(); ++k) {
    const Part& p = parts_[k];
    for (size_t i = 0; i < p.numel; ++i) e_[i] = x[p.offset + i] - hat[p.offset + i];
    p.codec->encode({e_.data(), p.numel}, codec_seed(spec_.seed + k, rank, draw),
                    payload.subspan(p.at, p.bytes));
  }
}

void ChocoCodec::decode_add(std::span<const std::byte> payload, float scale,
                            std::span<float> out) const {
  MT_CHECK(payload.size() == bytes_, "CHOCO payload of {} bytes, expected {}", payload.size(),
           bytes_);
  for (const Part& p : parts_) {
    p.codec->decode_add(payload.subspan(p.at, p.bytes), scale * p.factor,
                        out.subspan(p.offset, p.numel));
  }
}

std::vector<size_t> ChocoCodec::part_bytes() const {
  std::vector<size_t> out;
  for (const Part& p : parts_) out.push_back(p.bytes);
  return out;
}

}  // namespace mt
