// BucketPlan: buckets are contiguous, parameter-aligned ranges of the flat
// order formed from the last parameter backwards, about bucket_bytes each;
// every bucket's chunks split it evenly (uneven counts differ by one) and,
// over the ranks, cover each parameter element exactly once; each rank's
// shard is about 1/N of the flat buffer; bad layouts are ConfigErrors.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

#include "meshtrain/base/error.h"
#include "meshtrain/sync/buckets.h"

namespace mt {
namespace {

// Parameters of the given sizes, each starting on a 16-element boundary as in ParamStore.
ParamLayout aligned_layout(const std::vector<int64_t>& sizes, int64_t* flat) {
  ParamLayout l;
  int64_t at = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    l.push_back({fmt::format("p{}", i), Shape{sizes[i]}, at});
    at += (sizes[i] + 15) / 16 * 16;
  }
  *flat = at;
  return l;
}

TEST(BucketPlan, ReverseOrderParamAlignedAboutBucketBytes) {
  int64_t flat = 0;
  const ParamLayout l = aligned_layout({100, 7, 300, 50, 50, 1000, 3}, &flat);
  const BucketPlan p(l, flat, /*bucket_bytes=*/400 * 4, 1, 0);
  // From the back: {3, 1000} reaches 400 elements; {50, 50, 300}; {7, 100}.
  ASSERT_EQ(p.buckets().size(), 3u);
  EXPECT_EQ(p.buckets()[0].first_param, 5);
  EXPECT_EQ(p.buckets()[0].last_param, 6);
  EXPECT_EQ(p.buckets()[1].first_param, 2);
  EXPECT_EQ(p.buckets()[1].last_param, 4);
  EXPECT_EQ(p.buckets()[2].first_param, 0);
  EXPECT_EQ(p.buckets()[2].last_param, 1);
  for (const BucketInfo& b : p.buckets()) {
    EXPECT_EQ(b.begin, l[static_cast<size_t>(b.first_param)].offset);
    const ParamLayoutEntry& last = l[static_cast<size_t>(b.last_param)];
    EXPECT_EQ(b.end, last.offset + last.shape.numel());
  }
  for (int q = 0; q < 7; ++q) {
    const BucketInfo& b = p.buckets()[static_cast<size_t>(p.bucket_of(q))];
    EXPECT_GE(q, b.first_param);
    EXPECT_LE(q, b.last_param);
  }
  EXPECT_EQ(p.param_numel(), 1510);
  EXPECT_EQ(p.bucket_params(1), "p2, p3, p4");
}

TEST(BucketPlan, TinyBucketsHoldOneParameterEach) {
  int64_t flat = 0;
  const ParamLayout l = aligned_layout({10, 20, 30}, &flat);
  const BucketPlan p(l, flat, 1, 1, 0);
  ASSERT_EQ(p.buckets().size(), 3u);
  for (int b = 0; b < 3; ++b) EXPECT_EQ(p.buckets()[static_cast<size_t>(b)].first_param, 2 - b);
}

TEST(BucketPlan, ChunksCoverEveryElementOnceForEveryWorldSize) {
  int64_t flat = 0;
  const ParamLayout l = aligned_layout({1, 17, 64, 5, 130, 2, 0, 33}, &flat);
  for (int world = 1; world <= 8; ++world) {
    for (int64_t bucket_bytes : {int64_t{4}, int64_t{200}, int64_t{1} << 20}) {
      std::vector<int> owners(static_cast<size_t>(flat), 0);
      int64_t shards = 0;
      for (int r = 0; r < world; ++r) {
        const BucketPlan p(l, flat, bucket_bytes, world, r);
        shards += p.shard_numel();
        for (const BucketInfo& b : p.buckets()) {
          const size_t total = std::accumulate(b.counts.begin(), b.counts.end(), size_t{0});
          EXPECT_EQ(static_cast<int64_t>(total), b.numel());
          const auto [lo, hi] = std::minmax_element(b.counts.begin(), b.counts.end());
          EXPECT_LE(*hi - *lo, 1u) << "chunks of a bucket differ by at most one element";
          EXPECT_EQ(b.chunk_begin[0], b.begin);
        }
        for (size_t q = 0; q < l.size(); ++q) {
          const OwnedRange& o = p.owned(static_cast<int>(q));
          EXPECT_LE(0, o.begin);
          EXPECT_LE(o.begin, o.end);
          EXPECT_LE(o.end, l[q].shape.numel());
          EXPECT_LE(o.shard_offset + o.numel(), p.shard_numel());
          for (int64_t i = o.begin; i < o.end; ++i) ++owners[static_cast<size_t>(l[q].offset + i)];
        }
      }
      int64_t bucketed = 0;
      const BucketPlan rank0(l, flat, bucket_bytes, world, 0);
      for (const BucketInfo& b : rank0.buckets()) bucketed += b.numel();
      EXPECT_EQ(shards, bucketed) << "the shards of all ranks are the buckets";
      for (size_t q = 0; q < l.size(); ++q) {
        for (int64_t i = 0; i < l[q].shape.numel(); ++i) {
          ASSERT_EQ(owners[static_cast<size_t>(l[q].offset + i)], 1)
              << "world " << world << ", bucket_bytes " << bucket_bytes << ": element " << i
              << " of " << l[q].name;
        }
      }
    }
  }
}

TEST(BucketPlan, ShardIsAboutOneNth) {
  int64_t flat = 0;
  const ParamLayout l = aligned_layout({4096, 4096, 512, 4096, 64}, &flat);
  for (int world : {2, 3, 4, 7}) {
    for (int r = 0; r < world; ++r) {
      const BucketPlan p(l, flat, 4096 * 4, world, r);
      const double ideal = static_cast<double>(flat) / world;
      EXPECT_LE(static_cast<double>(p.shard_numel()),
                ideal + static_cast<double>(p.buckets().size()));
    }
  }
}

TEST(BucketPlan, BadLayoutsAreConfigErrors) {
  const ParamLayout overlapping = {{"a", Shape{10}, 0}, {"b", Shape{10}, 5}};
  EXPECT_THROW(BucketPlan(overlapping, 100, 64, 1, 0), ConfigError);
  const ParamLayout twice = {{"a", Shape{10}, 0}, {"a", Shape{10}, 16}};
  EXPECT_THROW(BucketPlan(twice, 100, 64, 1, 0), ConfigError);
  const ParamLayout fine = {{"a", Shape{10}, 0}, {"b", Shape{10}, 16}};
  EXPECT_THROW(BucketPlan(fine, 20, 64, 1, 0), ConfigError);  // flat buffer too small
  EXPECT_THROW(BucketPlan(fine, 26, 0, 1, 0), ConfigError);
  EXPECT_THROW(BucketPlan(fine, 26, 64, 2, 2), ConfigError);
  try {
    BucketPlan(overlapping, 100, 64, 1, 0);
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("'b'"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace mt
