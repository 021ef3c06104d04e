// DataLoader: deterministic per-epoch shuffles, batch counts, and
// data-parallel sharding whose rank slices reassemble the single-process
// global batch for every world size, share vector and batch size.
#include <algorithm>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "meshtrain/base/error.h"
#include "meshtrain/data/loader.h"

namespace mt {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// Example i is x = f32 [i, -i], y = i, so a batch shows which examples it holds.
class IotaDataset : public Dataset {
 public:
  explicit IotaDataset(int64_t n) : n_(n) {}
  int64_t size() const override { return n_; }
  Batch gather(std::span<const int64_t> indices) const override {
    const auto b = static_cast<int64_t>(indices.size());
    Batch out;
    out.x = Tensor::empty({b, 2}, DType::f32);
    out.y = Tensor::empty({b}, DType::i32);
    for (int64_t i = 0; i < b; ++i) {
      const auto v = static_cast<double>(indices[static_cast<size_t>(i)]);
      out.x.set_item(2 * i, v);
      out.x.set_item(2 * i + 1, -v);
      out.y.set_item(i, v);
    }
    return out;
  }
  std::string describe() const override { return "iota(" + std::to_string(n_) + ")"; }

 private:
  int64_t n_;
};

template <class F>
std::string config_error_of(F&& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a ConfigError";
  return "";
}

TEST(Loader, StepsPerEpochAndLastBatch) {
  const IotaDataset ds(10);
  LoaderOptions o;
  o.batch_size = 3;
  EXPECT_EQ(DataLoader(ds, o).steps_per_epoch(), 3);
  o.drop_last = false;
  const DataLoader keep(ds, o);
  EXPECT_EQ(keep.steps_per_epoch(), 4);
  EXPECT_EQ(keep.global_batch_size(3), 1);
  EXPECT_EQ(keep.batch(0, 3).size(), 1);
}

TEST(Loader, EveryEpochIsAPermutationAndBatchesTileIt) {
  const IotaDataset ds(23);
  LoaderOptions o;
  o.batch_size = 5;
  o.drop_last = false;
  o.seed = 7;
  const DataLoader dl(ds, o);
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    std::vector<int64_t> seen;
    for (int64_t s = 0; s < dl.steps_per_epoch(); ++s) {
      const Batch b = dl.batch(epoch, s);
      EXPECT_EQ(b.epoch, epoch);
      EXPECT_EQ(b.step, s);
      for (int64_t i = 0; i < b.size(); ++i) seen.push_back(static_cast<int64_t>(b.y.item(i)));
    }
    std::vector<int64_t> sorted = seen;
    std::sort(sorted.begin(), sorted.end());
    std::vector<int64_t> all(23);
    std::iota(all.begin(), all.end(), int64_t{0});
    EXPECT_EQ(sorted, all) << "epoch " << epoch;
    EXPECT_NE(seen, all) << "epoch " << epoch << " was not shuffled";
  }
}

TEST(Loader, SameSeedSameBatchesOtherEpochOrSeedOtherOrder) {
  const IotaDataset ds(100);
  LoaderOptions o;
  o.batch_size = 10;
  o.seed = 1234;
  const DataLoader a(ds, o);
  const DataLoader b(ds, o);
  // Visit b's epochs in another order: the result must not depend on history.
  const std::vector<int64_t> b1 = b.global_indices(1, 4);
  const std::vector<int64_t> b0 = b.global_indices(0, 4);
  EXPECT_EQ(a.global_indices(0, 4), b0);
  EXPECT_EQ(a.global_indices(1, 4), b1);
  EXPECT_NE(a.order(0), a.order(1));
  o.seed = 1235;
  EXPECT_NE(DataLoader(ds, o).order(0), a.order(0));
  // seed + epoch: epoch 1 of seed 1234 is epoch 0 of seed 1235.
  EXPECT_EQ(DataLoader(ds, o).order(0), a.order(1));
}

TEST(Loader, NoShuffleKeepsFileOrder) {
  const IotaDataset ds(7);
  LoaderOptions o;
  o.batch_size = 3;
  o.shuffle = false;
  o.drop_last = false;
  const DataLoader dl(ds, o);
  EXPECT_EQ(dl.global_indices(5, 1), (std::vector<int64_t>{3, 4, 5}));
  EXPECT_EQ(dl.global_indices(5, 2), (std::vector<int64_t>{6}));
}

// Pins the shuffle algorithm (mt19937_64 + rejection draw + Fisher-Yates from
// the top): changing it silently changes every run's data order and breaks
// resuming from checkpoints written by an older build.
TEST(Loader, ShuffleIsPinned) {
  std::vector<int64_t> v(10);
  std::iota(v.begin(), v.end(), int64_t{0});
  shuffle_indices(v, 42);
  // Recompute the same algorithm by hand from the standard-mandated generator.
  std::vector<int64_t> w(10);
  std::iota(w.begin(), w.end(), int64_t{0});
  std::mt19937_64 rng(42);
  for (size_t i = 10; i > 1; --i) {
    uint64_t r = rng();
    const uint64_t rem = (UINT64_MAX % i + 1) % i;
    while (r > UINT64_MAX - rem) r = rng();
    std::swap(w[i - 1], w[static_cast<size_t>(r % i)]);
  }
  EXPECT_EQ(v, w);
  // The 10000th output of a default mt19937_64 is fixed by the C++ standard.
  std::mt19937_64 std_rng;
  std_rng.discard(9999);
  EXPECT_EQ(std_rng(), 9981545732273789042ull);
}

TEST(Loader, UniformBelowStaysInRangeAndHitsEveryValue) {
  std::mt19937_64 rng(3);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(uniform_below(rng, 1), 0u);
  std::vector<int> hist(7, 0);
  for (int i = 0; i < 7000; ++i) {
    const uint64_t r = uniform_below(rng, 7);
    ASSERT_LT(r, 7u);
    hist[r]++;
  }
  for (int h : hist) EXPECT_NEAR(h, 1000, 150);
}

TEST(Loader, ShardBoundsAreProportionalAndContiguous) {
  const std::vector<int64_t> equal4 = {1, 1, 1, 1};
  EXPECT_EQ(shard_bounds(10, equal4), (std::vector<int64_t>{0, 2, 5, 7, 10}));
  EXPECT_EQ(shard_bounds(8, equal4), (std::vector<int64_t>{0, 2, 4, 6, 8}));
  const std::vector<int64_t> two_one = {2, 1};
  EXPECT_EQ(shard_bounds(9, two_one), (std::vector<int64_t>{0, 6, 9}));
  EXPECT_EQ(shard_bounds(0, two_one), (std::vector<int64_t>{0, 0, 0}));
}

// The heart of data parallelism: for every world size, share vector, batch
// size and drop_last, the ranks' micro-batches concatenated in rank order are
// exactly the global batch a single process sees at the same step.
TEST(Loader, ShardsReassembleTheGlobalBatch) {
  const IotaDataset ds(50);
  const std::vector<std::vector<int64_t>> share_sets = {
      {}, {2, 1}, {1, 3}, {1, 2, 3}, {3, 1, 1, 2}, {1, 1, 1, 1}, {5, 1, 1}};
  int checked = 0;
  for (int world = 1; world <= 4; ++world) {
    for (const auto& shares : share_sets) {
      if (!shares.empty() && static_cast<int>(shares.size()) != world) continue;
      for (int64_t batch : {7, 8, 10, 13}) {
        for (bool drop_last : {true, false}) {
          LoaderOptions g;
          g.batch_size = batch;
          g.seed = 99;
          g.drop_last = drop_last;
          const DataLoader global(ds, g);
          std::vector<DataLoader> ranks;
          for (int r = 0; r < world; ++r) {
            LoaderOptions o = g;
            o.rank = r;
            o.world_size = world;
            o.shares = shares;
            ranks.emplace_back(ds, o);
          }
          for (int64_t epoch = 0; epoch < 2; ++epoch) {
            for (int64_t s = 0; s < global.steps_per_epoch(); ++s) {
              const Batch want = global.global_batch(epoch, s);
              std::vector<double> xs, ys;
              int64_t offset = 0;
              for (int r = 0; r < world; ++r) {
                EXPECT_EQ(ranks[static_cast<size_t>(r)].steps_per_epoch(),
                          global.steps_per_epoch());
                const Batch b = ranks[static_cast<size_t>(r)].batch(epoch, s);
                EXPECT_EQ(b.global_size, want.size());
                EXPECT_EQ(b.global_offset, offset);
                offset += b.size();
                for (int64_t i = 0; i < b.x.numel(); ++i) xs.push_back(b.x.item(i));
                for (int64_t i = 0; i < b.y.numel(); ++i) ys.push_back(b.y.item(i));
                // Proportional: within one example of the share's fraction.
                const int64_t share = shares.empty() ? 1 : shares[static_cast<size_t>(r)];
                const int64_t total =
                    shares.empty() ? world
                                   : std::accumulate(shares.begin(), shares.end(), int64_t{0});
                EXPECT_NEAR(static_cast<double>(b.size()),
                            static_cast<double>(want.size() * share) / static_cast<double>(total),
                            1.0);
              }
              ASSERT_EQ(static_cast<int64_t>(xs.size()), want.x.numel());
              for (int64_t i = 0; i < want.x.numel(); ++i)
                ASSERT_EQ(xs[static_cast<size_t>(i)], want.x.item(i))
                    << "world " << world << " batch " << batch << " step " << s;
              ASSERT_EQ(static_cast<int64_t>(ys.size()), want.y.numel());
              for (int64_t i = 0; i < want.y.numel(); ++i)
                ASSERT_EQ(ys[static_cast<size_t>(i)], want.y.item(i));
              ++checked;
            }
          }
        }
      }
    }
  }
  EXPECT_GT(checked, 500);
}

TEST(Loader, UnevenSharesSplitTheBatch) {
  const IotaDataset ds(30);
  LoaderOptions o;
  o.batch_size = 9;
  o.world_size = 2;
  o.shares = {2, 1};
  const DataLoader r0(ds, o);
  o.rank = 1;
  const DataLoader r1(ds, o);
  EXPECT_EQ(r0.batch(0, 0).size(), 6);
  EXPECT_EQ(r1.batch(0, 0).size(), 3);
  EXPECT_EQ(r1.batch(0, 0).global_offset, 6);
}

TEST(Loader, ShortLastBatchMayLeaveARankEmpty) {
  const IotaDataset ds(9);
  LoaderOptions o;
  o.batch_size = 8;
  o.drop_last = false;
  o.world_size = 4;
  o.rank = 0;
  const DataLoader dl(ds, o);
  const Batch b = dl.batch(0, 1);  // the last batch has one example, for rank 3
  EXPECT_EQ(b.size(), 0);
  EXPECT_EQ(b.x.shape(), (Shape{0, 2}));
  EXPECT_EQ(b.global_size, 1);
}

TEST(Loader, BadOptionsAreConfigErrors) {
  const IotaDataset ds(20);
  LoaderOptions o;
  o.batch_size = 0;
  EXPECT_THAT(config_error_of([&] { DataLoader(ds, o); }), HasSubstr("batch size must be >= 1"));

  o = {};
  o.world_size = 2;
  o.rank = 2;
  EXPECT_THAT(config_error_of([&] { DataLoader(ds, o); }),
              HasSubstr("rank 2 is outside a world of size 2"));

  o = {};
  o.world_size = 2;
  o.shares = {1, 2, 3};
  EXPECT_THAT(config_error_of([&] { DataLoader(ds, o); }),
              HasSubstr("3 shares [1, 2, 3] given for a world of size 2"));

  o.shares = {1, 0};
  EXPECT_THAT(config_error_of([&] { DataLoader(ds, o); }), HasSubstr("shares [1, 0] must each"));

  o = {};
  o.batch_size = 3;
  o.world_size = 4;
  EXPECT_THAT(config_error_of([&] { DataLoader(ds, o); }),
              AllOf(HasSubstr("global batch size 3"), HasSubstr("over 4 ranks"),
                    HasSubstr("gives rank 0 no examples")));

  o = {};
  o.batch_size = 32;
  EXPECT_THAT(
      config_error_of([&] { DataLoader(ds, o); }),
      AllOf(HasSubstr("iota(20) has fewer examples than one batch of 32"), HasSubstr("drop_last")));
}

}  // namespace
}  // namespace mt
