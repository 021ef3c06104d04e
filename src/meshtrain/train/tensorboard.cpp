#include "meshtrain/train/tensorboard.h"

#include <unistd.h>

#include <array>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <system_error>

#include <fmt/format.h>

#include "meshtrain/base/error.h"

namespace mt {

namespace {

// Reflected CRC-32C table (polynomial 0x1EDC6F41, reversed 0x82F63B78).
constexpr std::array<uint32_t, 256> make_crc_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    t[i] = c;
  }
  return t;
}
constexpr std::array<uint32_t, 256> kCrcTable = make_crc_table();

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

uint32_t crc32c(const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) c = kCrcTable[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xA282EAD8u;
}

void ProtoWriter::varint(uint64_t v) {
  while (v >= 0x80) {
    out_.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out_.push_back(static_cast<char>(v));
}

void ProtoWriter::fixed(uint64_t v, int n) {
  for (int i = 0; i < n; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

void ProtoWriter::tag(int field, int wire_type) {
  varint((static_cast<uint64_t>(field) << 3) | static_cast<uint64_t>(wire_type));
}

void ProtoWriter::field_double(int field, double v) {
  tag(field, 1);
  fixed(std::bit_cast<uint64_t>(v), 8);
}

void ProtoWriter::field_float(int field, float v) {
  tag(field, 5);
  fixed(std::bit_cast<uint32_t>(v), 4);
}

void ProtoWriter::field_int64(int field, int64_t v) {
  tag(field, 0);
  varint(static_cast<uint64_t>(v));  // negative int64: ten bytes, as protobuf does
}

void ProtoWriter::field_bytes(int field, std::string_view bytes) {
  tag(field, 2);
  varint(bytes.size());
  out_.append(bytes);
}

std::string scalar_event(double wall_time, int64_t step,
                         const std::vector<std::pair<std::string, float>>& values) {
  ProtoWriter summary;
  for (const auto& [name, v] : values) {
    ProtoWriter value;
    value.field_bytes(1, name);
    value.field_float(2, v);
    summary.field_bytes(1, value.bytes());
  }
  ProtoWriter event;
  event.field_double(1, wall_time);
  event.field_int64(2, step);
  event.field_bytes(5, summary.bytes());
  return event.bytes();
}

std::string tf_record(std::string_view data) {
  std::string out;
  const uint64_t n = data.size();
  char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  const uint32_t len_crc = masked_crc32c(len, 8);
  const uint32_t data_crc = masked_crc32c(data.data(), data.size());
  out.append(len, 8);
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((len_crc >> (8 * i)) & 0xFF));
  out.append(data);
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((data_crc >> (8 * i)) & 0xFF));
  return out;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  if (dir.empty()) return;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec || !std::filesystem::is_directory(dir)) {
    throw FileError(fmt::format("tensorboard directory {}: cannot create it: {}", dir,
                                ec ? ec.message() : "exists and is not a directory"));
  }
  char host[256] = "localhost";
  if (gethostname(host, sizeof host) != 0) std::strcpy(host, "localhost");
  host[sizeof host - 1] = '\0';
  const double now = unix_seconds();
  path_ = (std::filesystem::path(dir) /
           fmt::format("events.out.tfevents.{}.{}", static_cast<int64_t>(now), host))
              .string();
  file_ = std::fopen(path_.c_str(), "wb");
  if (file_ == nullptr) {
    throw FileError(fmt::format("tensorboard event file {}: cannot open for writing: {}", path_,
                                std::strerror(errno)));
  }
  ProtoWriter version;
  version.field_double(1, now);
  version.field_int64(2, 0);
  version.field_bytes(3, "brain.Event:2");
  write_record(version.bytes());
}

TensorBoardWriter::~TensorBoardWriter() {
  if (file_ != nullptr) std::fclose(file_);
}

void TensorBoardWriter::scalars(int64_t step,
                                const std::vector<std::pair<std::string, float>>& values) {
  if (file_ == nullptr || values.empty()) return;
  write_record(scalar_event(unix_seconds(), step, values));
}

void TensorBoardWriter::write_record(std::string_view data) {
  const std::string rec = tf_record(data);
  if (std::fwrite(rec.data(), 1, rec.size(), file_) != rec.size() || std::fflush(file_) != 0) {
    throw FileError(
        fmt::format("tensorboard event file {}: write failed: {}", path_, std::strerror(errno)));
  }
}

}  // namespace mt
