// Single-file checkpoints: a safetensors file whose __metadata__ also holds
// a format marker and a CRC-32 per tensor (over its dtype, shape and bytes)
// and one over the rest of the metadata, so a flipped byte anywhere in the
// data or metadata is reported instead of being trained on.
//
// save_checkpoint writes atomically (write_file_atomically), creating missing
// parent directories as a sharded save does; a failed save
// leaves the previous checkpoint at the path intact. CheckpointReader checks
// the format on open and each tensor's checksum when it is read, so a later
// sharded format (one such file per rank plus an index) can reuse it to read
// only the tensors a rank needs. Metadata keys beginning with "crc32/" or
// "meshtrain/" are reserved for the format.
//
// Blocking file I/O; a reader is not thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>

#include "meshtrain/train/safetensors.h"

namespace mt {

// Writes `tensors` and `metadata` to `path` (atomically, fsynced), creating
// missing parent directories. Throws ConfigError for a metadata key in a
// reserved namespace, FileError when the file or a directory cannot be
// written.
void save_checkpoint(const std::string& path, const std::map<std::string, Tensor>& tensors,
                     const std::map<std::string, std::string>& metadata = {});

// CRC-32 (zlib's polynomial) of a tensor's dtype, shape and bytes.
uint32_t tensor_checksum(const Tensor& t);

class CheckpointReader {
 public:
  // Opens and validates: safetensors structure, format marker, metadata
  // checksum, exactly one well-formed checksum per tensor. FileError if the
  // file cannot be opened, CheckpointError naming the path (and tensor) for
  // anything else.
  explicit CheckpointReader(std::string path);

  const std::string& path() const { return reader_.path(); }
  // The caller's metadata, without the reserved entries.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const SafetensorsHeader& header() const { return reader_.header(); }
  // The underlying file, for range reads (bytes are not verified there).
  const SafetensorsReader& file() const { return reader_; }

  // Reads one tensor and verifies its checksum (CheckpointError naming the
  // tensor on mismatch or if absent).
  Tensor read(std::string_view name) const;
  std::map<std::string, Tensor> read_all() const;

  // Loads the tensors whose names start with `prefix` into `targets`, keyed
  // by the name without the prefix. The destination tensors say what is
  // expected: a target missing from the file, a file tensor under the prefix
  // with no target, or a dtype or shape that differs is a CheckpointError
  // naming the tensor. All or nothing: everything is read and verified
  // before the first target is written (so it needs memory for one copy).
  void load_into(std::map<std::string, Tensor>& targets, std::string_view prefix = "") const;

 private:
  SafetensorsReader reader_;
  std::map<std::string, std::string> metadata_;
  std::map<std::string, uint32_t, std::less<>> checksums_;
};

// Everything in a checkpoint, read and verified.
struct CheckpointContents {
  std::map<std::string, Tensor> tensors;
  std::map<std::string, std::string> metadata;
};
CheckpointContents load_checkpoint(const std::string& path);

}  // namespace mt
