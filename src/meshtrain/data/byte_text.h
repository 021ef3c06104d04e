// A byte-level language-modelling data set over any text: the vocabulary is
// the 256 byte values, an example is a window of seq_len+1 consecutive bytes,
// x = its first seq_len bytes and y = the seq_len bytes that follow each one.
// The default corpus is the plain-text fortune files of the Debian package
// `fortunes` (/usr/share/games/fortunes), concatenated in name order.
//
// Train/test split is by position and deterministic: the first
// (1 - test_fraction) of the bytes are the train split, the rest the test
// split, so no window straddles the two. The constructor reads the files
// (blocking); the object is immutable afterwards.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "meshtrain/data/dataset.h"

namespace mt {

inline constexpr const char* kFortunesDefaultDir = "/usr/share/games/fortunes";

struct ByteTextOptions {
  // A text file, or a directory whose regular, non-binary files (no NUL byte;
  // symlinks skipped) are concatenated in name order.
  std::string path = kFortunesDefaultDir;
  int64_t seq_len = 64;  // T, bytes per input
  // Bytes between the starts of consecutive windows; 0 means seq_len
  // (non-overlapping inputs, every byte predicted once per epoch).
  int64_t stride = 0;
  DataSplit split = DataSplit::train;
  double test_fraction = 0.1;  // in [0, 1)
  // Keep only the first `limit` windows (for tests and quick runs); -1 = all.
  int64_t limit = -1;
};

class ByteText : public Dataset {
 public:
  static constexpr int kVocabSize = 256;

  // Throws FileError for a missing, empty or too-short corpus (naming the path
  // and the length needed), ConfigError for bad options.
  explicit ByteText(ByteTextOptions options = {});

  int64_t size() const override { return windows_; }
  // x: i32 [B, seq_len] byte values; y: i32 [B * seq_len], y[b*T + t] = x[b, t+1]
  // within the window (the last one is the byte after the window's inputs).
  Batch gather(std::span<const int64_t> indices) const override;
  std::string describe() const override;

  const ByteTextOptions& options() const { return options_; }
  int64_t stride() const { return stride_; }
  // The bytes of this split, and the files they came from.
  const std::string& text() const { return text_; }
  const std::vector<std::string>& files() const { return files_; }

 private:
  ByteTextOptions options_;
  int64_t stride_ = 0;
  int64_t windows_ = 0;
  std::string text_;
  std::vector<std::string> files_;
};

}  // namespace mt
