#include "meshtrain/sync/compressed_reduce_scatter.h"

#include <algorithm>
#include <numeric>

#include <fmt/format.h>

#include "meshtrain/base/error.h"
#include "meshtrain/comm/algorithms.h"

namespace mt {

CompressedReduceScatter::CompressedReduceScatter(Communicator& comm, std::string name,
                                                 std::vector<size_t> counts,
                                                 CompressedAllReduceOptions options)
    : comm_(comm),
      name_(std::move(name)),
      counts_(std::move(counts)),
      options_(std::move(options)) {
  const CodecSpec& spec = options_.codec;
  MT_CHECK_EQ(counts_.size(), static_cast<size_t>(comm_.size()));
  if (spec.kind == CodecKind::none || spec.kind == CodecKind::powersgd) {
    throw ConfigError(fmt::format(
        "sync.codec = \"{}\" under ZeRO (dist.zero_stage > 0): the compressed reduce-scatter "
        "encodes each rank's chunk of a flat gradient bucket, and {} has no such payload; use "
        "f16, bf16, topk, randk, qsgd or sign, or dist.zero_stage = 0",
        spec.to_string(),
        spec.kind == CodecKind::none ? "\"none\""
                                     : "PowerSGD (a low-rank "
                                       "view of a whole matrix)"));
  }
  numel_ = std::accumulate(counts_.begin(), counts_.end(), size_t{0});
  const auto n = counts_.size();
  const auto me = static_cast<size_t>(comm_.rank());
  encoders_.resize(n);
  send_counts_.assign(n, 0);
  for (size_t q = 0; q < n; ++q) {
    if (counts_[q] == 0) continue;
    spec.check_fits(counts_[q],
                    fmt::format("{} chunk of rank {} ({} elements)", name_, q, counts_[q]));
    encoders_[q] =
        std::make_unique<FeedbackEncoder>(make_payload_codec(spec, counts_[q]), spec.error_feedback,
                                          contraction_factor(spec, counts_[q]));
    send_counts_[q] = encoders_[q]->codec().payload_bytes();
  }
  recv_counts_.assign(n, send_counts_[me]);
  send_.resize(std::accumulate(send_counts_.begin(), send_counts_.end(), size_t{0}));
  recv_.resize(send_counts_[me] * n);
}

CompressedReduceScatter::~CompressedReduceScatter() = default;

std::vector<float> CompressedReduceScatter::residual() const {
  std::vector<float> r;
  r.reserve(numel_);
  for (const auto& e : encoders_) {
    if (e) r.insert(r.end(), e->residual().begin(), e->residual().end());
  }
  return r;
}

size_t CompressedReduceScatter::state_numel() const {
  size_t n = 0;
  for (const auto& e : encoders_) {
    if (e) n += e->residual().size() + e->state().size();
  }
  return n;
}

void CompressedReduceScatter::save_state(std::span<float> out) const {
  MT_CHECK_EQ(out.size(), state_numel());
  auto at = out.begin();
  for (const auto& e : encoders_) {
    if (!e) continue;
    at = std::copy(e->residual().begin(), e->residual().end(), at);
    at = std::copy(e->state().begin(), e->state().end(), at);
  }
}

void CompressedReduceScatter::load_state(std::span<const float> in, uint64_t steps) {
  MT_CHECK_EQ(in.size(), state_numel());
  size_t at = 0;
  for (const auto& e : encoders_) {
    if (!e) continue;
    const size_t r = e->residual().size(), s = e->state().size();
    e->set_residual(in.subspan(at, r));
    e->set_state(in.subspan(at + r, s));
    at += r + s;
  }
  step_ = steps;
}

CodecTraffic CompressedReduceScatter::predicted_traffic() const {
  CodecTraffic t;
  const int n = comm_.size();
  const CollectiveOptions& opts = options_.collective;
  const size_t bytes = std::accumulate(send_counts_.begin(), send_counts_.end(), size_t{0});
  const CommAlgorithm a = opts.algorithm == CommAlgorithm::automatic
                              ? comm_.choose_algorithm(Collective::all_to_allv, bytes)
                              : opts.algorithm;
  if (a == CommAlgorithm::pairwise) {
    const CollectiveCost c =
        comm::pairwise_all_to_allv_cost(n, comm_.rank(), send_counts_, recv_counts_, 1);
    t.bytes_sent = c.bytes_sent;
    t.bytes_received = c.bytes_received;
  }
  if (opts.handshake.value_or(comm_.options().handshake) && n > 1) {
    t.handshake_bytes_sent = t.handshake_bytes_received = 48 * static_cast<uint64_t>(n - 1);
  }
  t.calls = 1;
  return t;
}

void CompressedReduceScatter::run(std::span<const float> in, std::span<float> out) {
  const auto me = static_cast<size_t>(comm_.rank());
  if (in.size() != numel_ || out.size() != counts_[me]) {
    throw ShapeError(fmt::format(
        "compressed reduce-scatter of {} ({} elements, codec {}): got {} elements in and {} out "
        "(rank {}'s chunk is {})",
        name_, numel_, options_.codec.to_string(), in.size(), out.size(), me, counts_[me]));
  }
  const auto n = counts_.size();
  const uint64_t base = step_ * n;
  size_t at = 0, sent = 0;
  for (size_t q = 0; q < n; ++q) {  // every chunk encoded before out is written
    if (encoders_[q]) {
      encoders_[q]->encode(in.subspan(at, counts_[q]),
                           codec_seed(options_.codec.seed, comm_.rank(), base + q),
                           std::span<std::byte>(send_).subspan(sent, send_counts_[q]));
    }
    at += counts_[q];
    sent += send_counts_[q];
  }
  comm_.all_to_allv(send_.data(), send_counts_, recv_.data(), recv_counts_, DType::u8,
                    options_.collective);
  std::fill(out.begin(), out.end(), 0.0f);
  if (encoders_[me]) {
    const size_t b = send_counts_[me];
    for (size_t q = 0; q < n; ++q) {  // rank order: the same bits on every rank
      encoders_[me]->codec().decode_add(std::span<const std::byte>(recv_).subspan(q * b, b),
                                        encoders_[me]->scale(), out);
    }
  }
  ++step_;
}

}  // namespace mt
