#include "meshtrain/sync/buckets.h"

#include <algorithm>
#include <set>

#include <fmt/format.h>

#include "meshtrain/base/error.h"

namespace mt {

namespace {
size_t idx(int64_t i) {
  return static_cast<size_t>(i);
}
}  // namespace

BucketPlan::BucketPlan(const ParamLayout& layout, int64_t flat_numel, int64_t bucket_bytes,
                       int world_size, int rank)
    : layout_(layout), flat_numel_(flat_numel), world_size_(world_size), rank_(rank) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    throw ConfigError(fmt::format("data-parallel buckets: rank {} outside a group of {} ranks",
                                  rank, world_size));
  }
  if (bucket_bytes <= 0) {
    throw ConfigError(
        fmt::format("data-parallel buckets: bucket_bytes must be > 0, got {}", bucket_bytes));
  }
  std::set<std::string> names;
  int64_t prev_end = 0;
  for (size_t i = 0; i < layout_.size(); ++i) {
    const ParamLayoutEntry& e = layout_[i];
    if (e.name.empty()) {
      throw ConfigError(fmt::format("data-parallel layout: parameter #{} has no name", i));
    }
    if (!names.insert(e.name).second) {
      throw ConfigError(fmt::format("data-parallel layout: parameter '{}' appears twice", e.name));
    }
    if (e.offset < prev_end) {
      throw ConfigError(
          fmt::format("data-parallel layout: parameter '{}' starts at element {}, inside the "
                      "previous parameter (which ends at {}); offsets must increase",
                      e.name, e.offset, prev_end));
    }
    prev_end = e.offset + e.shape.numel();
    param_numel_ += e.shape.numel();
  }
  if (prev_end > flat_numel_) {
    throw ConfigError(
        fmt::format("data-parallel layout: parameters end at element {} but the flat buffer has {}",
                    prev_end, flat_numel_));
  }

  // Reverse order: bucket 0 holds the last parameters, whose gradients are
  // ready first.
  const int n = static_cast<int>(layout_.size());
  bucket_of_.assign(idx(n), -1);
  int hi = n - 1;
  while (hi >= 0) {
    int lo = hi;
    int64_t bytes = layout_[idx(lo)].shape.numel() * 4;
    while (bytes < bucket_bytes && lo > 0) {
      --lo;
      bytes += layout_[idx(lo)].shape.numel() * 4;
    }
    BucketInfo b;
    b.first_param = lo;
    b.last_param = hi;
    b.begin = layout_[idx(lo)].offset;
    b.end = layout_[idx(hi)].offset + layout_[idx(hi)].shape.numel();
    for (int p = lo; p <= hi; ++p) bucket_of_[idx(p)] = static_cast<int>(buckets_.size());
    buckets_.push_back(std::move(b));
    hi = lo - 1;
  }

  const auto ws = static_cast<int64_t>(world_size_);
  for (BucketInfo& b : buckets_) {
    const int64_t len = b.numel();
    int64_t at = b.begin;
    for (int64_t r = 0; r < ws; ++r) {
      const int64_t c = len / ws + (r < len % ws ? 1 : 0);
      b.counts.push_back(static_cast<size_t>(c));
      b.chunk_begin.push_back(at);
      at += c;
    }
    b.shard_offset = shard_numel_;
    shard_numel_ += static_cast<int64_t>(b.counts[idx(rank_)]);
    max_bucket_numel_ = std::max(max_bucket_numel_, len);
  }

  owned_.resize(idx(n));
  for (int p = 0; p < n; ++p) {
    const ParamLayoutEntry& e = layout_[idx(p)];
    const BucketInfo& b = buckets_[idx(bucket_of_[idx(p)])];
    const int64_t cb = b.chunk_begin[idx(rank_)];
    const int64_t ce = cb + static_cast<int64_t>(b.counts[idx(rank_)]);
    const int64_t lo = std::max(cb, e.offset);
    const int64_t hi_e = std::min(ce, e.offset + e.shape.numel());
    OwnedRange& o = owned_[idx(p)];
    o.bucket = bucket_of_[idx(p)];
    if (lo < hi_e) {
      o.begin = lo - e.offset;
      o.end = hi_e - e.offset;
      o.shard_offset = b.shard_offset + (lo - cb);
    } else {
      // Nothing owned: an empty range placed where the parameter would start
      // or end inside the shard, so views stay in bounds.
      const int64_t at_e = std::clamp(e.offset, cb, ce);
      o.begin = o.end = e.offset >= ce ? e.shape.numel() : 0;
      o.shard_offset = b.shard_offset + (at_e - cb);
    }
  }
}

int BucketPlan::find(const std::string& name) const {
  for (size_t i = 0; i < layout_.size(); ++i) {
    if (layout_[i].name == name) return static_cast<int>(i);
  }
  return -1;
}

std::string BucketPlan::bucket_params(int bucket) const {
  const BucketInfo& b = buckets_.at(idx(bucket));
  constexpr int kShown = 4;
  std::string s;
  int shown = 0;
  for (int p = b.first_param; p <= b.last_param && shown < kShown; ++p, ++shown) {
    s += (s.empty() ? "" : ", ") + layout_[idx(p)].name;
  }
  const int rest = b.last_param - b.first_param + 1 - shown;
  if (rest > 0) s += fmt::format(" and {} more", rest);
  return s;
}

}  // namespace mt
