#include "meshtrain/spmd/sharding.h"

#include <gtest/gtest.h>

#include <numeric>

#include "meshtrain/base/error.h"

namespace mt {
namespace {

std::string error_of(const std::string& tensor, const Shape& shape, const ShardingSpec& spec,
                     const Mesh& mesh) {
  try {
    validate_sharding(tensor, shape, spec, mesh);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "no error";
}

TEST(Sharding, SplitSizesEvenAndByRatios) {
  EXPECT_EQ(split_sizes(12, 3, {}, 1), (std::vector<int64_t>{4, 4, 4}));
  EXPECT_EQ(split_sizes(12, 2, {2, 1}, 1), (std::vector<int64_t>{8, 4}));
  // 4 heads of 16, 2:1: the boundary at 8/3 = 2.67 heads rounds down to 2.
  EXPECT_EQ(split_sizes(64, 2, {2, 1}, 16), (std::vector<int64_t>{32, 32}));
  EXPECT_EQ(split_sizes(256, 2, {2, 1}, 1), (std::vector<int64_t>{170, 86}));
  // Equal shares of an uneven count: as the data loader splits a batch.
  EXPECT_EQ(split_sizes(8, 3, {1, 1, 1}, 1), (std::vector<int64_t>{2, 3, 3}));
  EXPECT_EQ(split_sizes(768, 2, {2, 1}, 64), (std::vector<int64_t>{512, 256}));
  // Pieces always sum to n and are whole units, for many shapes and ratios.
  for (int64_t unit : {1, 3, 8}) {
    for (int64_t units = 4; units < 40; units += 3) {
      for (const std::vector<int64_t>& r : std::vector<std::vector<int64_t>>{
               {1, 1}, {2, 1}, {3, 1, 1}, {1, 2, 3, 4}, {5, 4, 3, 2}}) {
        const auto s = split_sizes(units * unit, static_cast<int>(r.size()), r, unit);
        EXPECT_EQ(std::accumulate(s.begin(), s.end(), int64_t{0}), units * unit);
        for (int64_t x : s) EXPECT_EQ(x % unit, 0);
      }
    }
  }
}

TEST(Sharding, BoxesTileTheTensorExactlyOnce) {
  const Mesh mesh({{"dp", 2}, {"tp", 3}});
  const Shape shape{10, 12};
  const ShardingSpec spec{{DimSharding{"dp", {3, 2}, 1}, DimSharding{"tp", {1, 2, 3}, 2}}, {}};
  validate_sharding("t", shape, spec, mesh);
  std::vector<int> count(120, 0);
  int64_t total = 0;
  for (int r = 0; r < mesh.size(); ++r) {
    const Box b = local_box(shape, spec, mesh, r);
    EXPECT_EQ(local_shape(shape, spec, mesh, r), b.shape());
    total += b.elements();
    for (int64_t i = b.begin[0]; i < b.end[0]; ++i)
      for (int64_t j = b.begin[1]; j < b.end[1]; ++j) ++count[static_cast<size_t>(i * 12 + j)];
  }
  EXPECT_EQ(total, 120);
  for (int c : count) EXPECT_EQ(c, 1);
  EXPECT_EQ(local_box(shape, spec, mesh, 0), (Box{{0, 0}, {6, 2}}));
  EXPECT_EQ(local_box(shape, spec, mesh, 5), (Box{{6, 6}, {10, 12}}));
}

TEST(Sharding, ReplicatedAndPartialHoldTheWholeTensor) {
  const Mesh mesh({{"dp", 2}, {"tp", 2}});
  const Shape shape{4, 6};
  EXPECT_EQ(local_box(shape, ShardingSpec{}, mesh, 3), (Box{{0, 0}, {4, 6}}));
  const ShardingSpec partial{{}, {"tp"}};
  validate_sharding("p", shape, partial, mesh);
  EXPECT_FALSE(partial.replicated());
  EXPECT_EQ(local_shape(shape, partial, mesh, 1), shape);
  EXPECT_EQ(partial.describe(), "partial(tp)");
  const ShardingSpec col{{DimSharding{}, DimSharding{"tp", {2, 1}, 64}}, {"dp"}};
  EXPECT_EQ(col.describe(), "[-, tp 2:1 unit 64] partial(dp)");
  EXPECT_EQ(ShardingSpec{}.describe(), "replicated");
}

TEST(Sharding, BadSpecsNameTensorDimensionAxisAndExpectation) {
  const Mesh mesh({{"dp", 2}, {"tp", 3}});
  EXPECT_EQ(
      error_of("block0.fc.w", Shape{64, 256}, {{DimSharding{}, DimSharding::over("tp")}, {}}, mesh),
      "tensor block0.fc.w: dimension 1 (size 256) is split evenly over axis tp of size 3, "
      "which does not divide it (expected a multiple of 3, or ratios for an uneven split)");
  EXPECT_EQ(error_of("block0.attn.q.w", Shape{256, 256},
                     {{DimSharding{}, DimSharding{"tp", {}, 64}}, {}}, mesh),
            "tensor block0.attn.q.w: dimension 1 (size 256) = 4 units of 64 is split evenly over "
            "axis tp of size 3, which does not divide it (expected a multiple of 3, or ratios for "
            "an uneven split)");
  EXPECT_EQ(error_of("w", Shape{12, 4}, {{DimSharding{"tp", {2, 1}, 1}}, {}}, mesh),
            "tensor w: dimension 0 (size 12) is split over axis tp of size 3 by 2 ratios [2:1] "
            "(expected 3 ratios, one per rank of the axis)");
  EXPECT_EQ(error_of("w", Shape{12, 4}, {{DimSharding::over("pp")}, {}}, mesh),
            "tensor w: dimension 0 (size 12) names mesh axis 'pp', which the mesh dp=2 x tp=3 "
            "lacks (axes: dp, tp)");
  EXPECT_EQ(error_of("w", Shape{12, 4}, {{}, {"sp"}}, mesh),
            "tensor w: partial names mesh axis 'sp', which the mesh dp=2 x tp=3 lacks (axes: dp, "
            "tp)");
  EXPECT_EQ(error_of("w", Shape{12, 4}, {{DimSharding{"tp", {1, 0, 1}, 1}}, {}}, mesh),
            "tensor w: dimension 0 (size 12) has ratio 0 in [1:0:1] over axis tp (expected "
            "positive integers)");
  EXPECT_EQ(
      error_of("w", Shape{12, 12}, {{DimSharding::over("tp"), DimSharding::over("tp")}, {}}, mesh),
      "tensor w: mesh axis tp splits two dimensions (each axis splits at most one)");
  EXPECT_EQ(error_of("w", Shape{12}, {{DimSharding{"tp", {}, 5}}, {}}, mesh),
            "tensor w: dimension 0 (size 12) is split in units of 5, which do not divide it");
  EXPECT_EQ(error_of("w", Shape{4}, {{DimSharding{"tp", {10, 1, 1}, 1}}, {}}, mesh),
            "tensor w: dimension 0 (size 4) split over axis tp by ratios [10:1:1] leaves "
            "coordinate 1 an empty piece (expected at least one unit each)");
  EXPECT_EQ(error_of("w", Shape{12}, {{DimSharding{}, DimSharding{}}, {}}, mesh),
            "tensor w: the sharding spec gives 2 dimensions but the tensor has 1 (shape [12])");
  EXPECT_EQ(error_of("w", Shape{12}, {{DimSharding::over("tp")}, {"tp"}}, mesh),
            "tensor w: mesh axis tp both splits a dimension and holds partial sums");
  EXPECT_EQ(error_of("w", Shape{12}, {{DimSharding{"", {2, 1}, 1}}, {}}, mesh),
            "tensor w: dimension 0 (size 12) is replicated but has ratios [2, 1] (ratios need an "
            "axis to split over)");
}

}  // namespace
}  // namespace mt
