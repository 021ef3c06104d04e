#include "meshtrain/data/loader.h"

#include <algorithm>
#include <numeric>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "meshtrain/base/error.h"

namespace mt {

Tensor batch_rows(const Tensor& t, int64_t begin, int64_t n) {
  std::vector<int64_t> dims = t.shape().dims();
  const int64_t row = t.shape().prod(1, t.rank()) * static_cast<int64_t>(dtype_size(t.dtype()));
  dims[0] = n;
  auto* base = static_cast<char*>(const_cast<void*>(t.raw()));
  return Tensor::wrap(base + begin * row, Shape(dims), t.dtype());
}

uint64_t uniform_below(std::mt19937_64& rng, uint64_t bound) {
  MT_CHECK(bound > 0, "uniform_below needs a positive bound");
  // Reject the top partial block of the 2^64 range so every residue is equally likely.
  const uint64_t limit = UINT64_MAX - (UINT64_MAX % bound + 1) % bound;
  uint64_t r = 0;
  do {
    r = rng();
  } while (r > limit);
  return r % bound;
}

void shuffle_indices(std::vector<int64_t>& v, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (size_t i = v.size(); i > 1; --i) {
    const auto j = static_cast<size_t>(uniform_below(rng, i));
    std::swap(v[i - 1], v[j]);
  }
}

std::vector<int64_t> shard_bounds(int64_t n, std::span<const int64_t> shares) {
  MT_CHECK(!shares.empty(), "shard_bounds needs at least one share");
  MT_CHECK(n >= 0, "shard_bounds of a negative count {}", n);
  int64_t total = 0;
  for (int64_t s : shares) {
    MT_CHECK(s > 0, "share {} is not positive", s);
    total += s;
  }
  std::vector<int64_t> bounds(shares.size() + 1, 0);
  int64_t cum = 0;
  for (size_t r = 0; r < shares.size(); ++r) {
    cum += shares[r];
    bounds[r + 1] = n * cum / total;
  }
  return bounds;
}

DataLoader::DataLoader(const Dataset& data, LoaderOptions options)
    : data_(data), options_(std::move(options)) {
  const LoaderOptions& o = options_;
  if (o.batch_size < 1) {
    throw ConfigError(fmt::format("data loader: batch size must be >= 1, got {}", o.batch_size));
  }
  if (o.world_size < 1 || o.rank < 0 || o.rank >= o.world_size) {
    throw ConfigError(
        fmt::format("data loader: rank {} is outside a world of size {}", o.rank, o.world_size));
  }
  if (o.shares.empty()) {
    options_.shares.assign(static_cast<size_t>(o.world_size), 1);
  } else if (static_cast<int64_t>(o.shares.size()) != o.world_size) {
    throw ConfigError(fmt::format("data loader: {} shares [{}] given for a world of size {}",
                                  o.shares.size(), fmt::join(o.shares, ", "), o.world_size));
  }
  for (int64_t s : options_.shares) {
    // The cap keeps n * cumulative share inside int64 in shard_bounds.
    if (s < 1 || s > (int64_t{1} << 20)) {
      throw ConfigError(fmt::format("data loader: shares [{}] must each be in 1..{}",
                                    fmt::join(options_.shares, ", "), int64_t{1} << 20));
    }
  }
  const std::vector<int64_t> full = shard_bounds(o.batch_size, options_.shares);
  for (size_t r = 0; r + 1 < full.size(); ++r) {
    if (full[r + 1] == full[r]) {
      throw ConfigError(fmt::format(
          "data loader: global batch size {} split by shares [{}] over {} ranks gives rank {} no "
          "examples; use a larger batch size",
          o.batch_size, fmt::join(options_.shares, ", "), o.world_size, r));
    }
  }

  const int64_t n = data_.size();
  steps_ = o.drop_last ? n / o.batch_size : (n + o.batch_size - 1) / o.batch_size;
  if (steps_ == 0) {
    throw ConfigError(fmt::format("data loader: {} has fewer examples than one batch of {}{}",
                                  data_.describe(), o.batch_size,
                                  o.drop_last ? " (drop_last is on)" : ""));
  }
}

int64_t DataLoader::global_batch_size(int64_t step) const {
  MT_CHECK(step >= 0 && step < steps_, "step {} outside [0, {})", step, steps_);
  return std::min(options_.batch_size, data_.size() - step * options_.batch_size);
}

std::pair<int64_t, int64_t> DataLoader::local_range(int64_t n) const {
  const std::vector<int64_t> b = shard_bounds(n, options_.shares);
  const auto r = static_cast<size_t>(options_.rank);
  return {b[r], b[r + 1]};
}

const std::vector<int64_t>& DataLoader::cached_order(int64_t epoch) const {
  MT_CHECK(epoch >= 0, "negative epoch {}", epoch);
  if (epoch != cached_epoch_) {
    order_.resize(static_cast<size_t>(data_.size()));
    std::iota(order_.begin(), order_.end(), int64_t{0});
    if (options_.shuffle) shuffle_indices(order_, options_.seed + static_cast<uint64_t>(epoch));
    cached_epoch_ = epoch;
  }
  return order_;
}

std::vector<int64_t> DataLoader::global_indices(int64_t epoch, int64_t step) const {
  const int64_t n = global_batch_size(step);
  const auto& ord = cached_order(epoch);
  const auto begin = ord.begin() + step * options_.batch_size;
  return std::vector<int64_t>(begin, begin + n);
}

std::vector<int64_t> DataLoader::local_indices(int64_t epoch, int64_t step) const {
  const int64_t n = global_batch_size(step);
  const auto [lo, hi] = local_range(n);
  const auto& ord = cached_order(epoch);
  const auto begin = ord.begin() + step * options_.batch_size;
  return std::vector<int64_t>(begin + lo, begin + hi);
}

Batch DataLoader::batch(int64_t epoch, int64_t step) const {
  const std::vector<int64_t> idx = local_indices(epoch, step);
  Batch b = data_.gather(idx);
  b.epoch = epoch;
  b.step = step;
  b.global_size = global_batch_size(step);
  b.global_offset = local_range(b.global_size).first;
  return b;
}

Batch DataLoader::global_batch(int64_t epoch, int64_t step) const {
  const std::vector<int64_t> idx = global_indices(epoch, step);
  Batch b = data_.gather(idx);
  b.epoch = epoch;
  b.step = step;
  b.global_size = static_cast<int64_t>(idx.size());
  b.global_offset = 0;
  return b;
}

}  // namespace mt
