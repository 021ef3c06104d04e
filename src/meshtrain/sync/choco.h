// Compressed gossip (CHOCO-SGD: Koloskova, Stich and Jaggi 2019,
// "Decentralized Stochastic Optimization and Gossip Algorithms with
// Compressed Communication"): what a replica sends its neighbours when
// sync.scheme = gossip or adpsgd has a sync.codec.
//
// Every replica i keeps a public copy xhat_i of its parameters, which its
// neighbours hold too. After its local step it sends q_i = Q(x_i - xhat_i)
// (Q any codec of sync/codecs.h, per parameter tensor), and everyone who
// holds xhat_i adds the decoded q_i to it. The consensus step then moves x_i by
// gamma sum_j w_ij (xhat_j - xhat_i). x_i - xhat_i is what has not been sent yet: it
// plays the part of the error-feedback residual (there is no variant
// without it). Public copies start at zero, so every rank's copy of every
// xhat_j agrees from the first step whatever the replicas' parameters, and
// nothing but compressed differences is ever sent. With a codec that sends
// every element exactly (topk:1.0) and gamma 1, xhat_j = x_j after each
// exchange and the step is plain D-PSGD's (AD-PSGD's) mixing.
//
// ChocoCodec is the codec of one replica's whole flat parameters: one
// payload per parameter tensor (in layout order, concatenated), a size
// fixed by (spec, layout), equal on every rank. powersgd:R has no payload
// codec of its own (it all-reduces its factors among all ranks); here each
// matrix-shaped tensor M (shape[0] x rest) is sent as one local power
// iteration from a random start drawn from the seed: P = M G, P's columns
// orthonormalized, Q = M^T P, payload P then Q (f32), decoded as P Q^T (the
// projection of M on span(P), so never larger than M: a contraction, as
// CHOCO needs). No warm start (the encoder stays a pure function of (M,
// seed)); tensors the factors would not shrink go as f32, exactly.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "meshtrain/sync/buckets.h"
#include "meshtrain/sync/codec_spec.h"
#include "meshtrain/sync/codecs.h"

namespace mt {

// What the decoded payload of a tensor of `numel` elements is scaled by.
// CHOCO needs a contraction, E||x - C(x)||^2 <= (1 - delta) ||x||^2: top-k,
// rand-k (not rescaled), the casts, sign with its mean-magnitude scale and
// the projection below are; QSGD is unbiased with variance up to omega
// ||x||^2, omega = min(b / s^2, sqrt(b) / s) for buckets of b elements and
// s levels, and becomes one when scaled by 1 / (1 + omega) (Koloskova et
// al. 2019, section 3). 1 for every other codec.
float choco_factor(const CodecSpec& spec, size_t numel);

// The payload codec for one tensor of `shape` (powersgd: the local
// low-rank one above). ConfigError naming `what` when the spec does not fit.
std::unique_ptr<PayloadCodec> make_choco_payload_codec(const CodecSpec& spec, const Shape& shape,
                                                       std::string_view what);

class ChocoCodec {
 public:
  ChocoCodec(const CodecSpec& spec, const ParamLayout& layout);
  // Bytes of one payload (every parameter's).
  size_t payload_bytes() const { return bytes_; }
  // payload = Q(x - hat), each tensor with the seed codec_seed(spec.seed +
  // its index, rank, draw).
  void encode(std::span<const float> x, std::span<const float> hat, int rank, uint64_t draw,
              std::span<std::byte> payload);
  // out += scale * the decoded payload (flat, layout offsets).
  void decode_add(std::span<const std::byte> payload, float scale, std::span<float> out) const;
  // Each tensor's payload size, in layout order.
  std::vector<size_t> part_bytes() const;

 private:
  struct Part {
    size_t offset = 0, numel = 0, at = 0, bytes = 0;
    float factor = 1;  // choco_factor()
    std::unique_ptr<PayloadCodec> codec;
  };
  CodecSpec spec_;
  std::vector<Part> parts_;
  size_t bytes_ = 0;
  std::vector<float> e_;  // scratch: one tensor's x - hat
};

}  // namespace mt
