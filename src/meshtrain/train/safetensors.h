// The safetensors file format (https://huggingface.co/docs/safetensors):
//   8 bytes   little-endian u64 N, the header length
//   N bytes   JSON object: {"<name>": {"dtype": "F32", "shape": [2, 3],
//             "data_offsets": [begin, end]}, ..., "__metadata__": {"k": "v"}}
//   data      the tensors' bytes, row-major little-endian; offsets are
//             relative to the start of this section and cover it exactly.
// The writer emits keys sorted, pads the header with spaces so the data
// starts on an 8-byte boundary, and orders the data by descending element
// size, then name, so every tensor starts aligned to its element size.
// The reader checks everything (see parse_safetensors_header) and reads
// tensors one at a time, so a later sharded loader can read only what it
// needs. Reading or writing a file blocks on I/O; the reader is not
// thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "meshtrain/tensor/tensor.h"
#include "meshtrain/train/atomic_file.h"

namespace mt {

// "F32", "F64", "BF16", "F16", "I32", "I64", "U8".
std::string_view safetensors_dtype(DType t);
std::optional<DType> parse_safetensors_dtype(std::string_view name);

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::f32;
  Shape shape;
  uint64_t begin = 0;  // byte offsets into the data section
  uint64_t end = 0;
};

struct SafetensorsHeader {
  std::vector<SafetensorsEntry> entries;  // sorted by name
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;  // file offset of the data section (8 + N)

  const SafetensorsEntry* find(std::string_view name) const;
};

// Writes a complete safetensors file (tensors and metadata) through `sink`.
// Throws ConfigError for an empty tensor name or the reserved name
// "__metadata__", ShapeError for a tensor without storage.
void write_safetensors(const std::map<std::string, Tensor>& tensors,
                       const std::map<std::string, std::string>& metadata, const ByteSink& sink);
// Convenience: write_safetensors into `path` through write_file_atomically.
void save_safetensors(const std::string& path, const std::map<std::string, Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// Validates the JSON header `json` (the N bytes after the length) of a file
// of `file_size` bytes: the header is a JSON object; "__metadata__", if
// present, maps strings to strings; every other key has exactly "dtype" (a
// known name), "shape" (non-negative integers) and "data_offsets" ([begin,
// end], begin <= end); numel * element size == end - begin; the tensors
// cover the data section exactly, without gaps or overlap, and none ends
// past the end of the file. Throws CheckpointError naming `path` and the
// offending tensor.
SafetensorsHeader parse_safetensors_header(std::string_view path, std::string_view json,
                                           uint64_t file_size);

// An open safetensors file with a validated header. Throws FileError if the
// file cannot be opened or read, CheckpointError for malformed content
// (including a header length beyond the end of the file).
class SafetensorsReader {
 public:
  explicit SafetensorsReader(std::string path);
  ~SafetensorsReader();
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;
  SafetensorsReader(SafetensorsReader&& other) noexcept;
  SafetensorsReader& operator=(SafetensorsReader&&) = delete;

  const std::string& path() const { return path_; }
  const SafetensorsHeader& header() const { return header_; }
  uint64_t file_size() const { return file_size_; }

  // The tensor's bytes in a freshly allocated tensor. CheckpointError if
  // there is no such tensor.
  Tensor read(std::string_view name) const;
  // Reads into `dst`, which must have the stored dtype and shape
  // (CheckpointError otherwise).
  void read_into(std::string_view name, Tensor& dst) const;
  std::map<std::string, Tensor> read_all() const;
  // Reads bytes [offset, offset + n) of the tensor's data into `dst`: a range
  // read, so a sharded load reads only what it needs. CheckpointError if
  // there is no such tensor or the range runs past the tensor's end.
  void read_bytes(std::string_view name, uint64_t offset, uint64_t n, void* dst) const;

 private:
  const SafetensorsEntry& entry(std::string_view name) const;

  std::string path_;
  int fd_ = -1;
  uint64_t file_size_ = 0;
  SafetensorsHeader header_;
};

}  // namespace mt
