// The real Fashion-MNIST from the Debian package dataset-fashion-mnist
// (installed by scripts/setup): sizes, class balance, and that the
// normalisation constants match the training set's statistics.
#include <cmath>
#include <vector>

#include <gtest/gtest.h>

#include "meshtrain/base/error.h"
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

// data.normalize: the default is (x/255 - mean) / std with the training
// set's statistics; "none" gives x/255; explicit numbers are used as given.
TEST(FashionMnistReal, NormalisationIsAnOption) {
  FashionMnistOptions o;
  o.split = DataSplit::test;
  o.limit = 8;
  o.flatten = true;
  const std::vector<int64_t> idx = {0, 3, 7};
  struct Case {
    bool normalize;
    float mean, std;
  };
  for (const Case c : {Case{true, kFashionMnistMean, kFashionMnistStd}, Case{false, 0.f, 1.f},
                       Case{true, 0.5f, 0.25f}}) {
    o.normalize = c.normalize;
    o.mean = c.mean;
    o.std = c.std;
    const FashionMnist ds(o);
    const Batch b = ds.gather(idx);
    ASSERT_EQ(b.x.shape(), (Shape{3, 784}));
    for (int64_t i = 0; i < 3; ++i) {
      const uint8_t* px = ds.pixels().data() + idx[static_cast<size_t>(i)] * 784;
      for (int64_t p = 0; p < 784; ++p) {
        const float x = static_cast<float>(px[p]) / 255.0f;
        const float want = c.normalize ? (x - c.mean) / c.std : x;
        ASSERT_FLOAT_EQ(b.x.item(i * 784 + p), want)
            << "normalize " << c.normalize << " mean " << c.mean << " std " << c.std;
      }
    }
  }
  o.normalize = true;
  o.std = 0;
  EXPECT_THROW(FashionMnist{o}, ConfigError);
}

}  // namespace
}  // namespace mt
