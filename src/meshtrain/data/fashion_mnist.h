// Fashion-MNIST (28x28 grey-scale clothing images, 10 classes) as provided by
// the Debian package `dataset-fashion-mnist`. The constructor reads and
// validates the gzip'd IDX files (blocking; ~0.3 s for the full training set)
// and keeps the raw bytes (47 MB for the training split); gather() normalises
// pixels to f32 (x/255 - mean)/std on the fly (or x/255 with normalize off). Immutable after
// construction.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "meshtrain/data/dataset.h"

namespace mt {

inline constexpr const char* kFashionMnistDefaultDir = "/usr/share/datasets/fashion-mnist";
inline constexpr int kFashionMnistRows = 28;
inline constexpr int kFashionMnistCols = 28;
inline constexpr int kFashionMnistClasses = 10;
// Per-pixel mean and standard deviation of the training set after scaling to [0, 1].
inline constexpr float kFashionMnistMean = 0.2860f;
inline constexpr float kFashionMnistStd = 0.3530f;

struct FashionMnistOptions {
  std::string dir = kFashionMnistDefaultDir;
  DataSplit split = DataSplit::train;
  // Read only the first `limit` examples (for tests and quick runs); -1 = all.
  // A limited read skips the check that the file ends where its header says.
  int64_t limit = -1;
  // false: x is f32 [B, 1, 28, 28] (for convolutions); true: x is f32 [B, 784].
  bool flatten = false;
  // true: pixels are (x/255 - mean) / std; false: x/255 in [0, 1].
  bool normalize = true;
  float mean = kFashionMnistMean;
  float std = kFashionMnistStd;  // > 0
};

class FashionMnist : public Dataset {
 public:
  // Throws FileError for missing or malformed files (naming the path and, for
  // a missing file, the Debian package), ConfigError for a bad limit or a
  // std that is not a positive finite number.
  explicit FashionMnist(FashionMnistOptions options = {});

  int64_t size() const override { return static_cast<int64_t>(labels_.size()); }
  Batch gather(std::span<const int64_t> indices) const override;
  std::string describe() const override;

  const FashionMnistOptions& options() const { return options_; }
  // Raw pixels, u8 row-major [size(), 28, 28], and labels in 0..9.
  const std::vector<uint8_t>& pixels() const { return pixels_; }
  const std::vector<uint8_t>& labels() const { return labels_; }

  // File paths of a split inside `dir`, e.g. ".../train-images-idx3-ubyte.gz".
  static std::string images_path(const std::string& dir, DataSplit split);
  static std::string labels_path(const std::string& dir, DataSplit split);

 private:
  FashionMnistOptions options_;
  std::vector<uint8_t> pixels_;
  std::vector<uint8_t> labels_;
};

// View a batch's images f32 [B, 1, 28, 28] as [B, 784] (same memory).
Tensor flatten_images(const Tensor& images);

}  // namespace mt
