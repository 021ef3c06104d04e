// The real Fashion-MNIST from the Debian package dataset-fashion-mnist
// (installed by scripts/setup): sizes, class balance, and that the
// normalisation constants match the training set's statistics.
#include <cmath>
#include <vector>

#include <gtest/gtest.h>

#include "meshtrain/data/fashion_mnist.h"

namespace mt {
namespace {

TEST(FashionMnistReal, TrainSplitHas60000BalancedExamples) {
  const FashionMnist ds;  // the default directory
  ASSERT_EQ(ds.size(), 60000);
  std::vector<int64_t> hist(10, 0);
  for (uint8_t l : ds.labels()) hist[l]++;
  for (int c = 0; c < 10; ++c) EXPECT_EQ(hist[static_cast<size_t>(c)], 6000) << "class " << c;

  // The published mean/std are those of this split, scaled to [0, 1].
  double sum = 0, sum2 = 0;
  for (uint8_t p : ds.pixels()) {
    const double v = p / 255.0;
    sum += v;
    sum2 += v * v;
  }
  const double n = static_cast<double>(ds.pixels().size());
  const double mean = sum / n;
  EXPECT_NEAR(mean, kFashionMnistMean, 5e-4);
  EXPECT_NEAR(std::sqrt(sum2 / n - mean * mean), kFashionMnistStd, 5e-4);
}

TEST(FashionMnistReal, TestSplitHas10000BalancedExamples) {
  FashionMnistOptions o;
  o.split = DataSplit::test;
  const FashionMnist ds(o);
  ASSERT_EQ(ds.size(), 10000);
  std::vector<int64_t> hist(10, 0);
  for (uint8_t l : ds.labels()) hist[l]++;
  for (int c = 0; c < 10; ++c) EXPECT_EQ(hist[static_cast<size_t>(c)], 1000) << "class " << c;
}

TEST(FashionMnistReal, LimitedReadMatchesThePrefixOfTheFullRead) {
  FashionMnistOptions o;
  o.split = DataSplit::test;
  o.limit = 100;
  const FashionMnist part(o);
  o.limit = -1;
  const FashionMnist full(o);
  ASSERT_EQ(part.size(), 100);
  const std::vector<int64_t> idx = {0, 57, 99};
  const Batch a = part.gather(idx);
  const Batch b = full.gather(idx);
  ASSERT_EQ(a.x.shape(), (Shape{3, 1, 28, 28}));
  for (int64_t i = 0; i < a.x.numel(); ++i) ASSERT_EQ(a.x.item(i), b.x.item(i)) << i;
  for (int64_t i = 0; i < 3; ++i) EXPECT_EQ(a.y.item(i), b.y.item(i));
  // Normalised values lie between those of pixel 0 and pixel 255.
  for (int64_t i = 0; i < a.x.numel(); ++i) {
    ASSERT_GE(a.x.item(i), -kFashionMnistMean / kFashionMnistStd - 1e-5);
    ASSERT_LE(a.x.item(i), (1 - kFashionMnistMean) / kFashionMnistStd + 1e-5);
  }
}

}  // namespace
}  // namespace mt
