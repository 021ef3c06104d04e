// CompressedReduceScatter: one bucket's gradient summed over a
// communicator's ranks through a payload codec, each rank receiving only its
// chunk of the sum -- the reduce-scatter of ZeRO stages 1-3 with a codec, as
// ZeRO++'s quantized gradients (qgZ) and DeepSpeed's compressed
// reduce-scatter do it.
//
// The bucket of numel = sum(counts) elements is cut into the ZeRO chunks
// (sync/buckets.h: chunk q, counts[q] elements, belongs to rank q). run(in,
// out) on rank r:
//   1. for every destination q: e_q = in[chunk q] + residual_q; payload_q =
//      encode(e_q); residual_q = e_q - decode(payload_q) (one error-feedback
//      residual per destination chunk: sync/codecs.h's FeedbackEncoder);
//   2. all_to_allv of the payloads: payload_q to rank q (its own stays
//      local), payload_size(counts[r]) bytes in from every rank;
//   3. out (counts[r] elements) = sum over q in rank order of decode(the
//      payload from q): the SUM of what every rank sent for chunk r.
// So every contribution goes through the codec once and is decoded once, by
// its owner; nothing is re-encoded. The other way -- a ring of n - 1
// reduce-scatter steps that decodes, adds its own chunk and re-encodes the
// partial sum -- sends the same bytes for a codec whose size depends only on
// the element count (n - 1 payloads of a chunk each; every codec here), but
// compounds n - 1 encodings of partial sums whose error no residual keeps
// (top-k of a partial sum also drops other ranks' entries), so the
// all-to-all is used. Bytes this rank sends per run(): sum over q != r of
// payload_bytes(counts[q]) (pairwise algorithm; the engine's native
// all-to-all reports none): predicted_traffic() gives exactly what the
// communicator counts.
//
// Codecs: f16, bf16, topk, randk (also compact), qsgd, sign -- the payload
// codecs (a size fixed by (spec, numel)). "none" and PowerSGD (a low-rank
// view of a whole matrix, not of a chunk of a flat bucket) are refused with
// ConfigError naming sync.codec; so is a top-k / rand-k count larger than a
// chunk. k given as a fraction applies to each chunk (k = ceil(f * chunk)).
//
// Memory: the residuals cover the whole bucket (every destination's chunk),
// so a rank keeps a full gradient's worth of residual across its buckets:
// ZeRO-2/3 with a codec still shard the optimizer state and the reduced
// gradient, not the error-feedback state (as ZeRO++'s qgZ with error
// feedback).
//
// Randomness: chunk q's draws at run s come from codec_seed(spec.seed, rank,
// s * size + q). Threading: one rank's thread; run() is collective and
// blocking over the communicator.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/sync/compressed_all_reduce.h"

namespace mt {

class CompressedReduceScatter {
 public:
  // counts: the chunk of every rank (size() == comm.size()). `name` appears
  // in error messages.
  CompressedReduceScatter(Communicator& comm, std::string name, std::vector<size_t> counts,
                          CompressedAllReduceOptions options);
  ~CompressedReduceScatter();
  CompressedReduceScatter(const CompressedReduceScatter&) = delete;
  CompressedReduceScatter& operator=(const CompressedReduceScatter&) = delete;

  // in: the whole bucket (numel); out: this rank's chunk (counts[rank]) of
  // the sum. out may lie inside in (ZeRO-1 reduces in place): every chunk
  // is encoded before out is written.
  void run(std::span<const float> in, std::span<float> out);

  size_t numel() const { return numel_; }
  const std::vector<size_t>& counts() const { return counts_; }
  // What this rank did not send yet, the whole bucket in chunk order (zeros
  // without error feedback).
  std::vector<float> residual() const;
  size_t residual_numel() const { return numel_; }
  uint64_t steps() const { return step_; }
  // Checkpoints: what run() carries to the next call on this rank besides
  // steps() (each chunk's residual and codec state), state_numel() floats.
  size_t state_numel() const;
  void save_state(std::span<float> out) const;
  void load_state(std::span<const float> in, uint64_t steps);
  // Payload bytes to rank q per run.
  size_t payload_bytes(int q) const { return send_counts_[static_cast<size_t>(q)]; }
  // This rank's bytes per run (and the handshake's), as the communicator
  // counts them.
  CodecTraffic predicted_traffic() const;

 private:
  Communicator& comm_;
  std::string name_;
  std::vector<size_t> counts_;
  size_t numel_ = 0;
  CompressedAllReduceOptions options_;
  uint64_t step_ = 0;
  std::vector<std::unique_ptr<FeedbackEncoder>> encoders_;  // per destination (null if empty)
  std::vector<size_t> send_counts_, recv_counts_;
  std::vector<std::byte> send_, recv_;
};

}  // namespace mt
