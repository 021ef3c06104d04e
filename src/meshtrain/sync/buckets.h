// How data-parallel sync cuts the flat parameter buffer into buckets and
// shards, shared by DataParallel, checkpoints and the planner's cost model.
//
// The flat layout is the one ParamStore uses: every parameter is a contiguous
// range [offset, offset + numel) of one f32 buffer, in graph order, with
// increasing offsets (gaps between parameters are padding). Buckets are
// contiguous ranges of that order, parameter-aligned, formed from the LAST
// parameter backwards (gradients become ready from the last layer back, so
// bucket 0 is the first to be complete in backward): parameters are added to
// the current bucket until it holds at least bucket_bytes, then a new bucket
// starts. A bucket spans from its lowest parameter's offset to its highest
// parameter's end (interior padding included).
//
// ZeRO sharding: rank r of N owns chunk r of every bucket, an even split of
// the bucket's elements (the first len % N chunks one element longer), so
// each rank's shard is about 1/N of everything. A rank's shard buffer is the
// concatenation of its chunks in bucket order. Each parameter lies in one
// bucket, so the part of it a rank owns is one contiguous element range
// (possibly empty).
//
// BucketPlan is a plain value computed once; it does not allocate the
// buffers themselves. Units: elements of f32 unless a name says bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "meshtrain/tensor/shape.h"

namespace mt {

// One parameter's place in the flat buffers.
struct ParamLayoutEntry {
  std::string name;
  Shape shape;
  int64_t offset = 0;  // element offset in the flat buffers
};
using ParamLayout = std::vector<ParamLayoutEntry>;

struct BucketInfo {
  int first_param = 0;  // layout indices [first_param, last_param]
  int last_param = 0;
  int64_t begin = 0;  // flat element range [begin, end)
  int64_t end = 0;
  std::vector<size_t> counts;        // per-rank chunk lengths (sum = end - begin)
  std::vector<int64_t> chunk_begin;  // per-rank chunk start, flat element index
  int64_t shard_offset = 0;          // this rank's chunk inside its shard buffer

  int64_t numel() const { return end - begin; }
};

// The part of one parameter that this rank owns.
struct OwnedRange {
  int bucket = 0;
  int64_t begin = 0;  // element range within the parameter, [begin, end)
  int64_t end = 0;
  int64_t shard_offset = 0;  // where element `begin` sits in the shard buffer

  int64_t numel() const { return end - begin; }
};

class BucketPlan {
 public:
  // Throws ConfigError for an empty layout entry name, overlapping or
  // decreasing offsets, duplicate names, flat_numel too small for the
  // layout, bucket_bytes <= 0, or world_size / rank out of range.
  BucketPlan(const ParamLayout& layout, int64_t flat_numel, int64_t bucket_bytes, int world_size,
             int rank);

  const ParamLayout& layout() const { return layout_; }
  int64_t flat_numel() const { return flat_numel_; }
  int64_t param_numel() const { return param_numel_; }  // without padding
  int world_size() const { return world_size_; }
  int rank() const { return rank_; }

  const std::vector<BucketInfo>& buckets() const { return buckets_; }
  int bucket_of(int param) const { return bucket_of_[static_cast<size_t>(param)]; }
  const OwnedRange& owned(int param) const { return owned_[static_cast<size_t>(param)]; }
  int64_t shard_numel() const { return shard_numel_; }  // this rank's chunks together
  int64_t max_bucket_numel() const { return max_bucket_numel_; }
  // Index of the parameter named `name`, or -1.
  int find(const std::string& name) const;
  // "fc2.w, fc2.b" (at most a few names, then "and N more").
  std::string bucket_params(int bucket) const;

 private:
  ParamLayout layout_;
  int64_t flat_numel_ = 0;
  int64_t param_numel_ = 0;
  int world_size_ = 1;
  int rank_ = 0;
  std::vector<BucketInfo> buckets_;
  std::vector<int> bucket_of_;
  std::vector<OwnedRange> owned_;
  int64_t shard_numel_ = 0;
  int64_t max_bucket_numel_ = 0;
};

}  // namespace mt
