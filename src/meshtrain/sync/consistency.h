// Silent-divergence check for data-parallel replicas.
//
// Replicated parameters of a synchronous data-parallel run must stay bitwise
// identical on every replica; a bug in a sync scheme, a nondeterministic
// kernel or a flipped bit makes them drift apart silently. ConsistencyChecker
// hashes every replicated tensor's raw bytes (a 64-bit checksum, see
// checksum_bytes), all-gathers the checksum vectors over the replicas'
// communicator and, when any rank differs, throws the same MismatchError on
// every rank naming the step, the first tensor (in list order) that differs
// and which ranks hold which checksum, e.g.
//   parameter divergence at step 40: 'block0.attn.q.w' (f32[64, 64]) differs:
//   ranks 0,2 have 9f3a61c2d0e4b718, rank 1 has 11c2...; 1 of 12 tensors differ
// Before comparing checksums the ranks also agree on the list itself (names,
// dtypes, shapes), so replicas built from different models fail with a
// message naming the first entry that differs, not with a wrong comparison.
//
// Ownership: the checker keeps a reference to the communicator (which must
// outlive it) and Tensor handles to the parameters (views that share memory,
// so it always hashes the current values). Blocking: check() is collective
// over the communicator (every rank calls it at the same step) and blocks for
// two or three gathers, each bounded by the collective timeout. Not
// thread-safe. Comparison is bitwise: -0.0 and +0.0, or two NaNs with other
// payloads, count as different, which is what replicas must not be.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/comm/options.h"
#include "meshtrain/tensor/tensor.h"

namespace mt {

// 64-bit checksum of n raw bytes. Any change of a single aligned 8-byte word
// changes the result (every step of the mix is a bijection); other changes
// collide with probability about 2^-64. Runs at several GB/s per core.
uint64_t checksum_bytes(const void* data, size_t n, uint64_t seed = 0);
// checksum_bytes over the tensor's contents (dtype and shape not included).
uint64_t tensor_fingerprint(const Tensor& t);

struct ConsistencyOptions {
  // maybe_check(step) checks when step % every_steps == 0; 0 never checks.
  int64_t every_steps = 100;
  // Timeout and tag of the gathers (the tag must not clash with concurrent
  // collectives the caller issues on the same communicator).
  CollectiveOptions collective;
};

class ConsistencyChecker {
 public:
  using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

  // Throws ConfigError for a negative every_steps.
  ConsistencyChecker(Communicator& comm, NamedTensors params, ConsistencyOptions options = {});

  // check(step) when step is a multiple of every_steps; returns whether it ran.
  bool maybe_check(int64_t step);
  // Collective. Throws MismatchError (on every rank alike) when the replicas'
  // lists or any checksums differ; CommError/TimeoutError from the gathers.
  void check(int64_t step);

  const NamedTensors& params() const { return params_; }
  // This rank's checksums from the last check, in list order.
  const std::vector<uint64_t>& last_checksums() const { return last_checksums_; }
  int64_t checks_done() const { return checks_done_; }
  // Wall time of the last check: hashing plus gathers.
  double last_seconds() const { return last_seconds_; }

 private:
  void agree_on_layout(int64_t step);

  Communicator& comm_;
  NamedTensors params_;
  ConsistencyOptions options_;
  std::string layout_;  // "name dtype[shape]\n" per tensor, compared across ranks
  uint64_t layout_hash_ = 0;
  std::vector<uint64_t> last_checksums_;
  int64_t checks_done_ = 0;
  double last_seconds_ = 0;
};

// "0", "0,2", "0-3,5": sorted ranks with runs of three or more collapsed.
std::string format_rank_list(std::span<const int> sorted_ranks);

}  // namespace mt
