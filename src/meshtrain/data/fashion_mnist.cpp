#include "meshtrain/data/fashion_mnist.h"

#include <array>
#include <cmath>

#include <fmt/format.h>

#include "meshtrain/base/error.h"
#include "meshtrain/data/idx.h"

namespace mt {

namespace {

constexpr const char* kPackageHint =
    "Fashion-MNIST is provided by the Debian package `dataset-fashion-mnist` "
    "(apt-get install dataset-fashion-mnist)";

const char* split_prefix(DataSplit split) {
  return split == DataSplit::train ? "train" : "t10k";
}

}  // namespace

std::string FashionMnist::images_path(const std::string& dir, DataSplit split) {
  return fmt::format("{}/{}-images-idx3-ubyte.gz", dir, split_prefix(split));
}

std::string FashionMnist::labels_path(const std::string& dir, DataSplit split) {
  return fmt::format("{}/{}-labels-idx1-ubyte.gz", dir, split_prefix(split));
}

FashionMnist::FashionMnist(FashionMnistOptions options) : options_(std::move(options)) {
  if (options_.limit < -1) {
    throw ConfigError(
        fmt::format("fashion-mnist: limit must be -1 (all) or >= 0, got {}", options_.limit));
  }
  if (options_.normalize &&
      !(std::isfinite(options_.mean) && std::isfinite(options_.std) && options_.std > 0)) {
    throw ConfigError(fmt::format(
        "fashion-mnist: normalisation needs a finite mean and a positive std, got mean {} std {}",
        options_.mean, options_.std));
  }
  const std::string ipath = images_path(options_.dir, options_.split);
  const std::string lpath = labels_path(options_.dir, options_.split);

  IdxArray images = read_idx(ipath, kIdxImagesMagic, options_.limit, kPackageHint);
  if (images.dims[1] != kFashionMnistRows || images.dims[2] != kFashionMnistCols) {
    throw FileError(fmt::format("{}: expected {}x{} images, found {}x{}", ipath, kFashionMnistRows,
                                kFashionMnistCols, images.dims[1], images.dims[2]));
  }
  IdxArray labels = read_idx(lpath, kIdxLabelsMagic, options_.limit, kPackageHint);
  // Compare the declared counts, not the (possibly limited) records read, so a
  // mismatched pair of files is caught even on a quick run.
  if (images.dims[0] != labels.dims[0]) {
    throw FileError(fmt::format("{}: has {} labels, but {} has {} images; the counts must match",
                                lpath, labels.dims[0], ipath, images.dims[0]));
  }
  for (size_t i = 0; i < labels.data.size(); ++i) {
    if (labels.data[i] >= kFashionMnistClasses) {
      throw FileError(fmt::format("{}: label {} at index {} is out of range: expected 0..{}", lpath,
                                  labels.data[i], i, kFashionMnistClasses - 1));
    }
  }
  pixels_ = std::move(images.data);
  labels_ = std::move(labels.data);
}

Batch FashionMnist::gather(std::span<const int64_t> indices) const {
  constexpr int64_t kPixels = int64_t{kFashionMnistRows} * kFashionMnistCols;
  const auto b = static_cast<int64_t>(indices.size());
  Batch out;
  out.x = options_.flatten
              ? Tensor::empty({b, kPixels}, DType::f32)
              : Tensor::empty({b, 1, kFashionMnistRows, kFashionMnistCols}, DType::f32);
  out.y = Tensor::empty({b}, DType::i32);

  // One table lookup per pixel instead of a divide: 256 possible values.
  std::array<float, 256> lut{};
  for (int v = 0; v < 256; ++v) {
    const float x = static_cast<float>(v) / 255.0f;
    lut[static_cast<size_t>(v)] = options_.normalize ? (x - options_.mean) / options_.std : x;
  }
  float* x = out.x.data<float>();
  int32_t* y = out.y.data<int32_t>();
  for (int64_t i = 0; i < b; ++i) {
    const int64_t idx = indices[static_cast<size_t>(i)];
    MT_CHECK(idx >= 0 && idx < size(), "example index {} out of range [0, {})", idx, size());
    const uint8_t* src = pixels_.data() + idx * kPixels;
    float* dst = x + i * kPixels;
    for (int64_t p = 0; p < kPixels; ++p) dst[p] = lut[src[p]];
    y[i] = labels_[static_cast<size_t>(idx)];
  }
  return out;
}

std::string FashionMnist::describe() const {
  return fmt::format("fashion-mnist {} ({} examples from {})",
                     options_.split == DataSplit::train ? "train" : "test", size(), options_.dir);
}

Tensor flatten_images(const Tensor& images) {
  if (images.rank() < 2) {
    throw ShapeError(
        fmt::format("flatten_images: expected a batch of images [B, ...], got {}", images.desc()));
  }
  const int64_t b = images.shape()[0];
  return images.reshape({b, images.shape().prod(1, images.rank())});
}

}  // namespace mt
