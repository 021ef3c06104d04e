#include "meshtrain/data/byte_text.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include <fmt/format.h>

#include "meshtrain/base/error.h"

namespace mt {

namespace fs = std::filesystem;

namespace {

// Names the package only where it can help: for the default corpus.
std::string package_hint(const std::string& path) {
  const std::string dir = kFortunesDefaultDir;
  if (path.compare(0, dir.size(), dir) != 0) return "";
  return "; the default text corpus is provided by the Debian package `fortunes` "
         "(apt-get install fortunes)";
}

std::string read_whole(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw FileError(fmt::format("{}: cannot open: {}", p.string(), std::strerror(errno)));
  std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw FileError(fmt::format("{}: read error", p.string()));
  return s;
}

}  // namespace

ByteText::ByteText(ByteTextOptions options) : options_(std::move(options)) {
  const std::string& path = options_.path;
  if (options_.seq_len < 1) {
    throw ConfigError(fmt::format("byte text: seq_len must be >= 1, got {}", options_.seq_len));
  }
  if (options_.stride < 0) {
    throw ConfigError(
        fmt::format("byte text: stride must be >= 0 (0 = seq_len), got {}", options_.stride));
  }
  if (!(options_.test_fraction >= 0.0 && options_.test_fraction < 1.0)) {
    throw ConfigError(
        fmt::format("byte text: test_fraction must be in [0, 1), got {}", options_.test_fraction));
  }
  if (options_.limit < -1) {
    throw ConfigError(
        fmt::format("byte text: limit must be -1 (all) or >= 0, got {}", options_.limit));
  }
  stride_ = options_.stride == 0 ? options_.seq_len : options_.stride;

  std::error_code ec;
  const auto status = fs::status(path, ec);
  if (!fs::exists(status)) {
    throw FileError(
        fmt::format("{}: text file or directory not found{}", path, package_hint(path)));
  }
  std::string all;
  if (fs::is_directory(status)) {
    std::vector<fs::path> entries;
    for (const auto& e : fs::directory_iterator(path)) {
      if (e.is_regular_file() && !e.is_symlink()) entries.push_back(e.path());
    }
    std::sort(entries.begin(), entries.end());
    for (const auto& p : entries) {
      std::string s = read_whole(p);
      // Fortune directories hold binary index files (*.dat) beside the text.
      if (s.empty() || s.find('\0') != std::string::npos) continue;
      all += s;
      files_.push_back(p.string());
    }
    if (files_.empty()) {
      throw FileError(fmt::format("{}: directory has no non-empty plain-text files{}", path,
                                  package_hint(path)));
    }
  } else {
    all = read_whole(path);
    files_.push_back(path);
  }

  const auto total = static_cast<int64_t>(all.size());
  const auto cut =
      static_cast<int64_t>(std::floor(static_cast<double>(total) * (1.0 - options_.test_fraction)));
  const bool train = options_.split == DataSplit::train;
  text_ = train ? all.substr(0, static_cast<size_t>(cut)) : all.substr(static_cast<size_t>(cut));

  const int64_t need = options_.seq_len + 1;
  const auto have = static_cast<int64_t>(text_.size());
  if (have < need) {
    const std::string what =
        total == 0 ? std::string("is empty")
                   : fmt::format(
                         "is too short: its {} split ({} of {} bytes, test_fraction {}) "
                         "has {} bytes",
                         train ? "train" : "test", train ? "first" : "last", total,
                         options_.test_fraction, have);
    throw FileError(fmt::format("{}: {}; byte-level text with seq_len {} needs at least {} bytes{}",
                                path, what, options_.seq_len, need, package_hint(path)));
  }
  windows_ = (have - need) / stride_ + 1;
  if (options_.limit >= 0) windows_ = std::min(windows_, options_.limit);
}

Batch ByteText::gather(std::span<const int64_t> indices) const {
  const auto b = static_cast<int64_t>(indices.size());
  const int64_t t = options_.seq_len;
  Batch out;
  out.x = Tensor::empty({b, t}, DType::i32);
  out.y = Tensor::empty({b * t}, DType::i32);
  int32_t* x = out.x.data<int32_t>();
  int32_t* y = out.y.data<int32_t>();
  const auto* bytes = reinterpret_cast<const unsigned char*>(text_.data());
  for (int64_t i = 0; i < b; ++i) {
    const int64_t idx = indices[static_cast<size_t>(i)];
    MT_CHECK(idx >= 0 && idx < windows_, "window index {} out of range [0, {})", idx, windows_);
    const unsigned char* w = bytes + idx * stride_;
    for (int64_t j = 0; j < t; ++j) {
      x[i * t + j] = w[j];
      y[i * t + j] = w[j + 1];
    }
  }
  return out;
}

std::string ByteText::describe() const {
  return fmt::format("byte text {} ({} windows of {}+1 bytes, {} bytes from {} file(s) at {})",
                     options_.split == DataSplit::train ? "train" : "test", windows_,
                     options_.seq_len, text_.size(), files_.size(), options_.path);
}

}  // namespace mt
