// Writes scalars as a TensorBoard event file, without TensorFlow: the file is
// a sequence of TFRecords (uint64 length, masked CRC-32C of the length, the
// data, masked CRC-32C of the data), each holding one serialized Event
// protobuf (wall_time = 1 double, step = 2 int64, file_version = 3 string,
// summary = 5 Summary { repeated Value value = 1 { tag = 1 string,
// simple_value = 2 float } }). The first record is the file_version event.
//
// Owned by the trainer (rank 0); every write is flushed, so a crashed run
// keeps what it logged. Not thread-safe. Throws FileError naming the path when
// the directory or file cannot be created or written.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace mt {

// CRC-32C (Castagnoli, as TFRecord uses) and TFRecord's masked form of it.
uint32_t crc32c(const void* data, size_t n);
uint32_t masked_crc32c(const void* data, size_t n);

// The protobuf wire encoding the Event message needs.
class ProtoWriter {
 public:
  void varint(uint64_t v);
  void tag(int field, int wire_type);
  void field_double(int field, double v);               // wire type 1 (fixed64)
  void field_float(int field, float v);                 // wire type 5 (fixed32)
  void field_int64(int field, int64_t v);               // wire type 0 (varint)
  void field_bytes(int field, std::string_view bytes);  // wire type 2
  const std::string& bytes() const { return out_; }

 private:
  void fixed(uint64_t v, int n);
  std::string out_;
};

// One serialized Event holding scalar values.
std::string scalar_event(double wall_time, int64_t step,
                         const std::vector<std::pair<std::string, float>>& values);
// One TFRecord around `data`.
std::string tf_record(std::string_view data);

class TensorBoardWriter {
 public:
  TensorBoardWriter() = default;  // disabled
  // Creates `dir` (and parents) and events.out.tfevents.<unix time>.<host>
  // in it, and writes the file_version event. Empty dir: disabled.
  explicit TensorBoardWriter(const std::string& dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  bool enabled() const { return file_ != nullptr; }
  const std::string& path() const { return path_; }
  // One event at `step` with these (tag, value) scalars.
  void scalars(int64_t step, const std::vector<std::pair<std::string, float>>& values);

 private:
  void write_record(std::string_view data);
  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace mt
