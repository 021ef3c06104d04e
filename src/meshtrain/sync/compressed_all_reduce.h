// CompressedAllReduce: one tensor's gradient averaged over a communicator's
// ranks through a codec (sync/codec_spec.h, sync/codecs.h), with the codec's
// error-feedback state kept across steps.
//
// run(grad, out) leaves in `out` the AVERAGE over the ranks of what each rank
// sent, decoded -- (1/n) sum_r decode(encode(grad_r + residual_r)) -- bitwise
// identical on every rank, and keeps residual_r = (grad_r + residual_r) -
// decode(what rank r sent) for the next call. How each codec travels:
//
//   none        all_reduce(avg) of the f32 tensor: a plain all-reduce.
//   f16, bf16   CastExchange::all_reduce (default): all_reduce(avg) in the
//               16-bit dtype (the comm layer widens to f32 to combine and
//               rounds once per combine; docs/comm.md "Numerics"), or
//               CastExchange::all_gather: all_gather of the 16-bit tensors,
//               summed in f32 in rank order, divided by n. Measured on this
//               machine (bench/comm/codec_bench.cpp, docs/codecs.md): the
//               all-reduce is faster in 11 of 12 cases (256K-4M elements,
//               2 and 4 ranks; 1.2-2.3x at 1M and 4M) and sends ~2(n-1)/n B
//               instead of (n-1) B, so it is the default; the all-gather
//               rounds only once (the exact f32 sum of the cast values)
//               and stays as an option. With f16 the ring and
//               halving-doubling algorithms forward partial sums in f16,
//               so sums beyond 65504 overflow to inf there (the all-gather
//               sums in f32 and does not).
//   topk, randk SparseExchange::all_gather (default): all_gather of each
//               rank's k (u32 index, f32 value) pairs (8k bytes; every rank
//               sends the same k), or with `compact` of its bf16 values and
//               Elias-Fano-coded indices (a size fixed by (numel, k), so
//               still equal blocks), then a local f32 sum in rank order, / n.
//               Never a silent dense all-reduce: SparseExchange::dense_
//               all_reduce (the densified k values, all_reduce(avg) in f32)
//               exists for the measured comparison and only when asked for.
//               Measured on this machine (2 shared cores; docs/codecs.md,
//               bench/run codec; 256K-4M elements, 2 and 4 ranks): the
//               all-gather is faster up to 3% density (1.1-7x), the two
//               are even around 10%, and the densified all-reduce is
//               faster from 20% on at 1M-4M elements (1.04-1.4x). By bytes
//               the crossover is at density 1/n.
//   qsgd, sign  all_gather of the packed payloads, decoded and summed in f32
//               in rank order, / n. With error feedback QSGD's decoded
//               payloads (and so the residual's) are scaled by
//               contraction_factor() (sync/codecs.h), which makes it a
//               contraction; unscaled its residual grows without bound.
//   powersgd    M = tensor as shape[0] x (numel / shape[0]), Q (cols x r)
//               warm-started from the previous step (the first from a
//               normal draw of the spec's seed, equal on every rank):
//               P = M Q; all_reduce(avg) P; orthonormalize P's columns;
//               Q = M^T P; all_reduce(avg) Q; out = P Q^T. The residual is M
//               minus that average approximation, as in PyTorch's
//               PowerSGD hook. Tensors the factors would not shrink
//               (powersgd_compresses() false: vectors, r >= min(rows,
//               cols)) go as one plain f32 all_reduce(avg), residual zero.
//
// Bytes: plan() lists the collectives one run() issues (kind, count, dtype),
// a pure function of (codec, shape, exchanges); predict_traffic() turns a
// plan into the bytes this rank sends and receives over a communicator,
// with the algorithms its policy picks (Communicator::cost), and the
// handshake's 48 (n - 1) bytes per collective. The communicator's counters
// report exactly those numbers (tests/sync/compressed_all_reduce_test.cpp
// and compressed_all_reduce_mpi_test.cpp check it, byte for byte). The
// engine's native collectives report no bytes, and neither does the
// prediction for them.
//
// Randomness (randk indices, qsgd rounding) comes from codec_seed(spec.seed,
// rank, step): reproducible, different on every rank and step.
//
// Ownership and threading: keeps a reference to the communicator (which must
// outlive it); one tensor's state, used from the rank's one thread. run() is
// collective over the communicator and blocks (the collective options'
// timeout); every rank must construct it with the same codec and shape and
// call run() in the same order as its other collectives.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/sync/codec_spec.h"
#include "meshtrain/sync/codecs.h"
#include "meshtrain/tensor/shape.h"

namespace mt {

enum class CastExchange : uint8_t { all_reduce, all_gather };
enum class SparseExchange : uint8_t { all_gather, dense_all_reduce };

struct CompressedAllReduceOptions {
  CodecSpec codec;
  CastExchange cast_exchange = CastExchange::all_reduce;
  SparseExchange sparse_exchange = SparseExchange::all_gather;
  CollectiveOptions collective;  // timeout, tag, algorithm of every call
};

// One collective of a run(): counts in elements of `dtype`.
struct PlannedCollective {
  Collective kind = Collective::all_reduce;
  size_t count = 0;  // all_reduce: the buffer; all_gather: one rank's block
  DType dtype = DType::f32;
};

// Bytes one rank moves for a plan (handshake records separately).
struct CodecTraffic {
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  uint64_t handshake_bytes_sent = 0;
  uint64_t handshake_bytes_received = 0;
  int calls = 0;
  uint64_t total_sent() const { return bytes_sent + handshake_bytes_sent; }
};

// The collectives one run() issues, in order (empty for an empty tensor).
std::vector<PlannedCollective> compressed_all_reduce_plan(const CompressedAllReduceOptions& options,
                                                          const Shape& shape);
// This rank's bytes for `plan` over `comm` (algorithms as its policy, or
// opts.algorithm, picks them; handshake per opts / the comm's options).
CodecTraffic predict_traffic(const Communicator& comm, std::span<const PlannedCollective> plan,
                             const CollectiveOptions& opts = {});
// The same without a communicator (a planner's question): rank `rank` of
// `world_size` ranks on one node with a shared window of `shm_slot_bytes`
// per slot (0: no shared memory, e.g. ranks on several nodes), algorithms as
// `policy` picks them (the engine's native ones are never assumed) unless
// `algorithm` names one. Equal to the communicator version for such a
// communicator (tests/sync/compressed_all_reduce_test.cpp).
CodecTraffic predict_traffic(std::span<const PlannedCollective> plan, int world_size, int rank,
                             size_t shm_slot_bytes, const AlgorithmPolicy& policy = {},
                             bool handshake = true,
                             CommAlgorithm algorithm = CommAlgorithm::automatic);

class CompressedAllReduce {
 public:
  // `name` appears in error messages; `shape` is the tensor's (PowerSGD
  // views it as shape[0] x rest). Throws ConfigError when the codec does
  // not fit the tensor (spec.check_fits).
  CompressedAllReduce(Communicator& comm, std::string name, Shape shape,
                      CompressedAllReduceOptions options);
  ~CompressedAllReduce();
  CompressedAllReduce(const CompressedAllReduce&) = delete;
  CompressedAllReduce& operator=(const CompressedAllReduce&) = delete;

  // out = average over ranks of the decoded codec outputs (see above);
  // grad.size() == out.size() == numel; they may be the same buffer.
  void run(std::span<const float> grad, std::span<float> out);

  // run() in two halves, for the codecs whose exchange is one collective
  // (can_start(): the payload codecs with their all-gather, or a cast's
  // all-reduce in its own dtype; not PowerSGD, "none" or the densified
  // sparse all-reduce): start() encodes (the residual updated, steps()
  // counted) and starts the collective asynchronously; finish() waits and
  // writes the same average run() would. grad may be reused once start()
  // returns. No other call on this object in between but wait(); every
  // rank starts in the same order as its other collectives.
  bool can_start() const;
  void start(std::span<const float> grad);
  void finish(std::span<float> out);
  // Waits for a started exchange without decoding it (finish() still
  // decodes); a no-op when none is in flight.
  void wait();
  bool started() const { return started_; }

  const CompressedAllReduceOptions& options() const { return options_; }
  size_t numel() const { return numel_; }
  // What this rank did not send yet: numel values (zero without error
  // feedback), or empty for "none", which holds nothing back.
  std::span<const float> residual() const;
  // Completed run() calls.
  uint64_t steps() const { return step_; }
  // Checkpoints: what run() carries from one call to the next on this
  // rank besides steps() (the residual, PowerSGD's Q), state_numel() floats.
  size_t state_numel() const;
  void save_state(std::span<float> out) const;
  void load_state(std::span<const float> in, uint64_t steps);
  const std::vector<PlannedCollective>& plan() const { return plan_; }

  // PowerSGD's run() in its three local phases, for exchanges that batch
  // several tensors' factors into one all-reduce each (CompressedSync with
  // SyncOptions::powersgd_batched): run() is exactly
  //   p = powersgd_project(grad); all_reduce(avg) p;
  //   if (low_rank()) { q = powersgd_back_project(); all_reduce(avg) q; }
  //   powersgd_expand(out); powersgd_count_step();
  // powersgd_project returns P = (grad + residual) Q (rows x r), or for a
  // tensor the factors would not shrink the tensor itself (grad +
  // residual), to be averaged in place; powersgd_back_project
  // orthonormalizes the averaged P and returns Q = E^T P, to be averaged in
  // place; powersgd_expand writes P Q^T (or the averaged tensor) and keeps
  // the residual. The spans are this object's buffers.
  bool low_rank() const { return low_rank_; }
  std::span<float> powersgd_project(std::span<const float> grad);
  std::span<float> powersgd_back_project();
  void powersgd_expand(std::span<float> out);
  void powersgd_count_step();
  CodecTraffic predicted_traffic() const;

 private:
  void run_powersgd(std::span<const float> grad, std::span<float> out);
  void run_payload(std::span<const float> grad, std::span<float> out);
  void decode_payloads(std::span<float> out);

  Communicator& comm_;
  std::string name_;
  Shape shape_;
  size_t numel_ = 0;
  CompressedAllReduceOptions options_;
  std::vector<PlannedCollective> plan_;
  uint64_t step_ = 0;
  // payload codecs
  std::unique_ptr<FeedbackEncoder> encoder_;
  std::vector<std::byte> payload_;   // own payload
  std::vector<std::byte> gathered_;  // n payloads (all-gather exchanges)
  CommHandle handle_;                // start() .. finish()
  bool started_ = false;
  // powersgd
  size_t rows_ = 0, cols_ = 0;
  bool low_rank_ = false;
  std::vector<float> residual_, e_, p_, q_;
};

}  // namespace mt
