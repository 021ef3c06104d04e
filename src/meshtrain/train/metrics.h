// Writes training metrics as JSON lines (one object per line) to a file.
// Owned by the trainer; each write is flushed so a crashed run keeps what it
// logged. An empty path disables writing. Not thread-safe.
#pragma once

#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

namespace mt {

class MetricsWriter {
 public:
  MetricsWriter() = default;
  // Throws FileError naming the path if it cannot be opened for writing.
  explicit MetricsWriter(const std::string& path);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  bool enabled() const { return file_ != nullptr; }
  void write(const nlohmann::json& line);

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace mt
