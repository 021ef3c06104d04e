// DataLoader: turns a Dataset into the deterministic sequence of batches one
// rank trains on. Owned by whoever runs the training loop (one per rank and
// data set); it borrows the Dataset, which must outlive it. Not thread-safe
// (it caches the current epoch's permutation); gather() of the data set itself
// may be called from anywhere.
//
// Determinism: the order of epoch e is a Fisher-Yates shuffle of 0..N-1 driven
// by std::mt19937_64(seed + e) with our own unbiased bounded draw, so it is
// identical across standard libraries. Step s of epoch e uses positions
// [s*B, s*B + B) of that order (B = global batch size); that is the *global*
// batch, the same on every rank.
//
// Data-parallel sharding: rank r gets the contiguous slice
// [bounds[r], bounds[r+1]) of each global batch, with bounds from shard_bounds()
// (proportional to per-rank integer shares, equal by default). The ranks'
// micro-batches, concatenated in rank order, are exactly the global batch that
// a single process (world_size 1) sees at the same step.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <utility>
#include <vector>

#include "meshtrain/data/dataset.h"

namespace mt {

// Rows [begin, begin + n) along dim 0 of a batch tensor, as a view of its
// memory (which must outlive it): a micro-batch of a loader's batch.
Tensor batch_rows(const Tensor& t, int64_t begin, int64_t n);

struct LoaderOptions {
  int64_t batch_size = 64;  // global batch size: all ranks together
  uint64_t seed = 0;
  bool shuffle = true;    // false: examples in file order every epoch (evaluation)
  bool drop_last = true;  // drop a final partial batch (training); false keeps it (evaluation)
  int rank = 0;
  int world_size = 1;
  // Per-rank positive integer weights, e.g. {2, 1}: rank 0 gets 2/3 of each
  // global batch. Empty means equal shares. Size must equal world_size.
  std::vector<int64_t> shares;
};

class DataLoader {
 public:
  // Throws ConfigError for inconsistent options (rank outside the world, wrong
  // number of shares, a non-positive share, a full global batch that leaves a
  // rank with no examples, a data set smaller than one batch with drop_last).
  DataLoader(const Dataset& data, LoaderOptions options);

  const LoaderOptions& options() const { return options_; }
  const Dataset& dataset() const { return data_; }
  int64_t steps_per_epoch() const { return steps_; }
  // Examples in the global batch at `step` (B, or fewer for a kept last batch).
  int64_t global_batch_size(int64_t step) const;
  // This rank's slice [begin, end) of a global batch of n examples.
  std::pair<int64_t, int64_t> local_range(int64_t n) const;

  // The permutation of example indices that epoch `epoch` walks through (a copy).
  std::vector<int64_t> order(int64_t epoch) const { return cached_order(epoch); }
  // Example indices of the global batch at (epoch, step): every rank's together.
  std::vector<int64_t> global_indices(int64_t epoch, int64_t step) const;
  // Example indices of this rank's micro-batch at (epoch, step).
  std::vector<int64_t> local_indices(int64_t epoch, int64_t step) const;

  // This rank's micro-batch; step in [0, steps_per_epoch()).
  Batch batch(int64_t epoch, int64_t step) const;
  // The whole global batch (what world_size 1 gets), e.g. to compare against.
  Batch global_batch(int64_t epoch, int64_t step) const;

 private:
  // The epoch's permutation, computed once per epoch; invalidated by a call
  // for another epoch.
  const std::vector<int64_t>& cached_order(int64_t epoch) const;

  const Dataset& data_;
  LoaderOptions options_;
  int64_t steps_ = 0;
  mutable int64_t cached_epoch_ = -1;
  mutable std::vector<int64_t> order_;
};

// Boundaries (size shares.size() + 1, first 0, last n) that split n items into
// contiguous slices proportional to `shares`: slice r is
// [floor(n*S_r/S), floor(n*S_{r+1}/S)) with S_r the sum of the first r shares.
// Equal shares give slices that differ by at most one item.
std::vector<int64_t> shard_bounds(int64_t n, std::span<const int64_t> shares);

// A uniform integer in [0, bound) from `rng` by rejection (unbiased; the same
// sequence on every platform, unlike std::uniform_int_distribution).
uint64_t uniform_below(std::mt19937_64& rng, uint64_t bound);
// In-place Fisher-Yates shuffle driven by std::mt19937_64(seed).
void shuffle_indices(std::vector<int64_t>& v, uint64_t seed);

}  // namespace mt
