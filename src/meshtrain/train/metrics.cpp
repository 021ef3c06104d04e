#include "meshtrain/train/metrics.h"

#include <cerrno>
#include <cstring>

#include "meshtrain/base/error.h"

namespace mt {

MetricsWriter::MetricsWriter(const std::string& path) : path_(path) {
  if (path.empty()) return;
  file_ = std::fopen(path.c_str(), "w");
  if (file_ == nullptr) {
    throw FileError(
        fmt::format("metrics file {}: cannot open for writing: {}", path, std::strerror(errno)));
  }
}

MetricsWriter::~MetricsWriter() {
  if (file_ != nullptr) std::fclose(file_);
}

void MetricsWriter::write(const nlohmann::json& line) {
  if (file_ == nullptr) return;
  const std::string s = line.dump() + "\n";
  if (std::fwrite(s.data(), 1, s.size(), file_) != s.size() || std::fflush(file_) != 0) {
    throw FileError(fmt::format("metrics file {}: write failed: {}", path_, std::strerror(errno)));
  }
}

}  // namespace mt
