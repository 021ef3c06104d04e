// Gradient codecs: what one rank sends for one f32 tensor, and the
// error-feedback residual that keeps what it did not send.
//
// A PayloadCodec turns a vector e of `numel` f32 values into a byte payload
// of a size fixed by (spec, numel) alone, equal on every rank, and adds a
// payload's decoded values into an f32 vector. They are pure: no state, no
// communication; randomness comes from the `seed` argument, so a payload is
// a function of (e, seed). Layouts (little-endian, as this machine stores
// them; every rank of a job runs on the same architecture):
//
//   f16 / bf16  numel 16-bit floats, rounded to nearest even. f16 saturates
//               at +-65504 (a larger magnitude is sent as 65504 and the rest
//               stays in the residual) instead of overflowing to inf.
//   topk        k u32 indices (ascending), then the k f32 values e[index]
//               exactly. The k indices of largest |e| (NaN counts as larger
//               than everything); ties go to the lower index, so the choice
//               is a function of e alone.
//   randk       same layout; k distinct indices drawn uniformly without
//               replacement from Rng(seed) (Floyd's algorithm), values not
//               rescaled (error feedback keeps the rest; an unbiased d/k
//               rescaling would blow up the residual).
//   topk / randk with `compact` (the same k indices): k bf16 values
//               (e[index] rounded to nearest even, a finite value beyond
//               bf16's range saturating at +-3.39e38), then one bit stream
//               (LSB first) of the ascending indices, Elias-Fano coded with
//               L = floor(log2(numel / k)): k fields of L bits (index mod
//               2^L), then a high part in which entry j sets bit
//               (index_j >> L) + j, padded with zeros to its bound of k +
//               ((numel - 1) >> L) bits. So the size is fixed by (numel, k),
//               equal on every rank (no size exchange), and at most 2k + k(L
//               + 2) / 8 + 1 bytes: at 1% (L = 6) about 3.07 bytes per
//               element instead of 8.
//   qsgd:b      one f32 L2 norm per bucket, then numel codes of b bits
//               packed LSB first (bit 0 sign, bits 1..b-1 the level in
//               0..s, s = 2^(b-1) - 1). Level = floor(l) + Bernoulli(l -
//               floor(l)) with l = |e_i| / norm * s, so the decoded value
//               sign * norm * level / s has expectation e_i (unbiased: QSGD,
//               Alistarh et al. 2017) and variance at most (norm / s)^2 / 4.
//   sign        one f32 scale per chunk (mean |e| over the chunk, as
//               EF-signSGD, Karimireddy et al. 2019), then numel bits (1:
//               e_i >= 0, decoded +scale; 0: decoded -scale).
//
// FeedbackEncoder wraps a PayloadCodec with the residual r (zero at first):
// e = grad + r; payload = encode(e); r = e - decode(payload). So r + decoded
// == e: exactly (bitwise) for topk and randk, whose sent values are e's own
// and whose residual is e with those entries zeroed; for compact topk/randk
// too (the residual keeps e - bf16(e) at the sent entries, exact in f32, and
// adding bf16(e) back gives e); for f16/bf16 within
// rounding (e - cast(e) is exact in f32 unless f16 saturates); for qsgd and
// sign within one f32 rounding of the subtraction.
//
// PowerSGD (Vogels et al. 2019) over an all-reduce is not a payload: it
// interleaves two all-reduces with local algebra, so it lives in
// sync/compressed_all_reduce.h; the algebra (a tensor viewed as a rows x
// cols matrix, row-major) is here, and so is make_low_rank_payload_codec(),
// one sender's own factors as a payload (parameter-server pushes).
//
// Threading: PayloadCodecs are immutable after construction (callable from
// any thread); a FeedbackEncoder is one tensor's state, used by one thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "meshtrain/sync/codec_spec.h"

namespace mt {

class PayloadCodec {
 public:
  virtual ~PayloadCodec() = default;
  size_t numel() const { return numel_; }
  // Bytes of one payload; equal on every rank.
  virtual size_t payload_bytes() const = 0;
  // Writes e's payload (payload.size() == payload_bytes()).
  virtual void encode(std::span<const float> e, uint64_t seed,
                      std::span<std::byte> payload) const = 0;
  // out[i] += scale * decoded[i] for every element the payload carries.
  virtual void decode_add(std::span<const std::byte> payload, float scale,
                          std::span<float> out) const = 0;
  // Floats a FeedbackEncoder keeps for this codec from one encode to the
  // next (the low-rank codec's warm-started Q); 0 for the pure codecs.
  virtual size_t state_numel() const { return 0; }
  // encode() with that state, read and updated in place (state.size() ==
  // state_numel()); the pure codecs ignore it.
  virtual void encode_with_state(std::span<const float> e, uint64_t seed,
                                 std::span<std::byte> payload, std::span<float> state) const {
    (void)state;
    encode(e, seed, payload);
  }

 protected:
  explicit PayloadCodec(size_t numel) : numel_(numel) {}
  size_t numel_;
};

// The payload codec of `spec` for tensors of `numel` elements (checks
// spec.check_fits). Throws ConfigError for "none" and "powersgd", which have
// no payload.
std::unique_ptr<PayloadCodec> make_payload_codec(const CodecSpec& spec, size_t numel);

// PowerSGD as one rank's payload, for exchanges where each sender's
// approximation is decoded on its own (a parameter server's pushes): the
// tensor as a rows x cols matrix M, one power iteration from the sender's
// own Q (cols x r; the state, warm-started from its previous encode, a
// zero column drawn afresh from the seed): P = M Q, P's columns
// orthonormalized, Q = M^T P; the payload is P (rows x r f32) then Q (cols
// x r f32) and decodes to P Q^T (exact when M has rank <= r). Where the
// factors would not be smaller (powersgd_compresses() false) the payload is
// the tensor in f32 (decoded exactly, no state). ConfigError unless
// spec.kind is powersgd.
std::unique_ptr<PayloadCodec> make_low_rank_payload_codec(const CodecSpec& spec, size_t rows,
                                                          size_t cols);

// The seed of one rank's draws at one step: a SplitMix64 mix of the three,
// so ranks and steps get independent streams from one base seed.
uint64_t codec_seed(uint64_t base, int rank, uint64_t step);

// The k largest-magnitude indices of e, ascending (ties to the lower index).
std::vector<uint32_t> top_k_indices(std::span<const float> e, size_t k);

// Error feedback needs a contraction, E||x - C(x)||^2 <= (1 - delta) ||x||^2
// (Stich et al. 2018; Karimireddy et al. 2019): top-k, rand-k (not
// rescaled), the casts and sign with its mean-magnitude scale are; QSGD is
// unbiased with variance up to omega ||x||^2, omega = min(b / s^2,
// sqrt(b) / s) for buckets of b elements and s levels, and becomes one when
// scaled by 1 / (1 + omega) (Koloskova et al. 2019, section 3; Beznosikov
// et al. 2020, lemma 1). This returns that factor for qsgd on tensors of
// `numel` elements, 1 for every other codec. Unscaled, QSGD's error grows
// through the residual until training diverges (qsgd:4 on the MLP: NaN
// near step 88).
float contraction_factor(const CodecSpec& spec, size_t numel);

class FeedbackEncoder {
 public:
  // error_feedback false: the residual stays zero (e = grad) and `scale` is
  // 1. With error feedback what is sent is `scale` x the decoded payload
  // (contraction_factor(): 1 but for QSGD); every decoder multiplies by
  // scale() as well.
  FeedbackEncoder(std::unique_ptr<PayloadCodec> codec, bool error_feedback, float scale = 1.0f);
  const PayloadCodec& codec() const { return *codec_; }
  // What a decoded payload is scaled by (above).
  float scale() const { return scale_; }
  // e = grad + residual; payload = encode(e, seed); residual = e - scale *
  // decoded.
  void encode(std::span<const float> grad, uint64_t seed, std::span<std::byte> payload);
  std::span<const float> residual() const { return residual_; }
  // Replaces the residual (e.g. restored from a checkpoint); size numel.
  void set_residual(std::span<const float> r);
  // The codec's own state between encodes (codec().state_numel() floats).
  std::span<const float> state() const { return state_; }
  void set_state(std::span<const float> s);

 private:
  std::unique_ptr<PayloadCodec> codec_;
  bool error_feedback_;
  float scale_ = 1.0f;
  std::vector<float> residual_;
  std::vector<float> e_;
  std::vector<float> state_;
};

// ---- PowerSGD algebra (row-major; m is rows x cols, p rows x r, q cols x r)

// Whether a rows x cols tensor is worth compressing at rank r: the two
// factors (rows + cols) * r are fewer elements than the tensor. When not
// (vectors, small matrices, r >= min(rows, cols)), the compressed all-reduce
// sends the tensor uncompressed, as PyTorch's PowerSGD hook does.
bool powersgd_compresses(size_t rows, size_t cols, int r);
// p = m q
void powersgd_project(std::span<const float> m, size_t rows, size_t cols, std::span<const float> q,
                      int r, std::span<float> p);
// q = m^T p
void powersgd_back_project(std::span<const float> m, size_t rows, size_t cols,
                           std::span<const float> p, int r, std::span<float> q);
// Orthonormalizes p's r columns in place (modified Gram-Schmidt in double).
// A column that is (numerically) dependent on the earlier ones becomes zero.
void orthogonalize_columns(std::span<float> p, size_t rows, int r);
// out = p q^T
void powersgd_expand(std::span<const float> p, std::span<const float> q, size_t rows, size_t cols,
                     int r, std::span<float> out);

}  // namespace mt
