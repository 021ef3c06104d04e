// TensorBoard event files: written by TensorBoardWriter, read back by a
// minimal reader written here independently (bitwise CRC-32C, its own
// varint and protobuf field parser), which checks both CRCs of every record
// and decodes the Event fields.
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <bit>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "common/temp_dir.h"
#include "meshtrain/base/error.h"
#include "meshtrain/train/tensorboard.h"

namespace mt {
namespace {

uint32_t crc_bitwise(const std::string& s) {
  uint32_t c = ~0u;
  for (unsigned char b : s) {
    c ^= b;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
  }
  return ~c;
}
uint32_t mask(uint32_t c) {
  return ((c >> 15) | (c << 17)) + 0xA282EAD8u;
}

uint64_t le(const std::string& s, size_t at, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; ++i)
    v |= static_cast<uint64_t>(static_cast<unsigned char>(s[at + i])) << (8 * i);
  return v;
}

// One decoded protobuf field.
struct Field {
  int number = 0, wire = 0;
  uint64_t integer = 0;  // varint, fixed64, fixed32
  std::string bytes;     // length-delimited
};

std::vector<Field> parse(const std::string& m) {
  std::vector<Field> out;
  size_t i = 0;
  auto varint = [&]() {
    uint64_t v = 0;
    for (int shift = 0;; shift += 7) {
      if (i >= m.size() || shift > 63) throw std::runtime_error("bad varint");
      const auto b = static_cast<unsigned char>(m[i++]);
      v |= static_cast<uint64_t>(b & 0x7F) << shift;
      if ((b & 0x80) == 0) return v;
    }
  };
  while (i < m.size()) {
    Field f;
    const uint64_t key = varint();
    f.number = static_cast<int>(key >> 3);
    f.wire = static_cast<int>(key & 7);
    if (f.wire == 0) {
      f.integer = varint();
    } else if (f.wire == 1 || f.wire == 5) {
      const int n = f.wire == 1 ? 8 : 4;
      if (i + n > m.size()) throw std::runtime_error("truncated fixed field");
      f.integer = le(m, i, n);
      i += n;
    } else if (f.wire == 2) {
      const uint64_t n = varint();
      if (i + n > m.size()) throw std::runtime_error("truncated bytes field");
      f.bytes = m.substr(i, n);
      i += n;
    } else {
      throw std::runtime_error("unexpected wire type");
    }
    out.push_back(std::move(f));
  }
  return out;
}

struct Event {
  double wall_time = 0;
  int64_t step = -1;
  std::string file_version;
  std::map<std::string, float> values;
};

// Reads every record, checking both CRCs; fails the test on any mismatch.
std::vector<Event> read_events(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  const std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<Event> events;
  size_t at = 0;
  while (at < data.size()) {
    EXPECT_LE(at + 12, data.size()) << "truncated record header at " << at;
    if (at + 12 > data.size()) break;
    const uint64_t n = le(data, at, 8);
    EXPECT_EQ(le(data, at + 8, 4), mask(crc_bitwise(data.substr(at, 8)))) << "length CRC at " << at;
    EXPECT_LE(at + 12 + n + 4, data.size()) << "truncated record at " << at;
    if (at + 12 + n + 4 > data.size()) break;
    const std::string body = data.substr(at + 12, n);
    EXPECT_EQ(le(data, at + 12 + n, 4), mask(crc_bitwise(body))) << "data CRC at " << at;
    at += 12 + n + 4;
    Event e;
    for (const Field& f : parse(body)) {
      if (f.number == 1 && f.wire == 1) e.wall_time = std::bit_cast<double>(f.integer);
      if (f.number == 2 && f.wire == 0) e.step = static_cast<int64_t>(f.integer);
      if (f.number == 3 && f.wire == 2) e.file_version = f.bytes;
      if (f.number == 5 && f.wire == 2) {
        for (const Field& v : parse(f.bytes)) {
          EXPECT_EQ(v.number, 1);
          EXPECT_EQ(v.wire, 2);
          std::string tag;
          float value = -1;
          for (const Field& g : parse(v.bytes)) {
            if (g.number == 1 && g.wire == 2) tag = g.bytes;
            if (g.number == 2 && g.wire == 5)
              value = std::bit_cast<float>(static_cast<uint32_t>(g.integer));
          }
          e.values[tag] = value;
        }
      }
    }
    events.push_back(std::move(e));
  }
  return events;
}

TEST(Crc32c, KnownValues) {
  // The CRC-32C check value, and RFC 3720's 32 zero bytes.
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
  const std::string zeros(32, '\0');
  EXPECT_EQ(crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
  EXPECT_EQ(crc32c("", 0), 0u);
  const std::string text = "meshtrain writes TensorBoard event files";
  EXPECT_EQ(crc32c(text.data(), text.size()), crc_bitwise(text));
  EXPECT_EQ(masked_crc32c(text.data(), text.size()), mask(crc_bitwise(text)));
}

TEST(ProtoWriter, WireEncoding) {
  ProtoWriter w;
  w.field_int64(2, 300);  // key 0x10, varint 300 = ac 02
  w.field_bytes(1, "ab");
  w.field_float(2, 1.0f);
  EXPECT_EQ(w.bytes(), std::string("\x10\xac\x02\x0a\x02"
                                   "ab\x15\x00\x00\x80\x3f",
                                   12));
  ProtoWriter neg;
  neg.field_int64(2, -1);  // ten bytes of varint, as protobuf encodes int64 -1
  EXPECT_EQ(neg.bytes().size(), 11u);
  EXPECT_EQ(static_cast<int64_t>(parse(neg.bytes())[0].integer), -1);
}

TEST(TensorBoardWriter, EventsReadBack) {
  testing::TempDir dir;
  const std::string logdir = dir.file("runs/a");  // parents are created
  std::string path;
  {
    TensorBoardWriter w(logdir);
    ASSERT_TRUE(w.enabled());
    path = w.path();
    w.scalars(10, {{"loss", 2.5f}, {"lr", 0.05f}, {"samples_per_s", 1234.0f}});
    w.scalars(20, {{"loss", 1.25f}, {"tokens_per_s", 5e4f}});
    w.scalars(20, {{"test_loss", 0.5f}, {"test_accuracy", 0.875f}});
    w.scalars(30, {});  // nothing to write
  }
  const std::string name = std::filesystem::path(path).filename().string();
  EXPECT_EQ(std::filesystem::path(path).parent_path(), std::filesystem::path(logdir));
  EXPECT_EQ(name.rfind("events.out.tfevents.", 0), 0u) << name;
  const auto events = read_events(path);
  ASSERT_EQ(events.size(), 4u);
  EXPECT_EQ(events[0].file_version, "brain.Event:2");
  EXPECT_TRUE(events[0].values.empty());
  EXPECT_GT(events[0].wall_time, 1.7e9);  // seconds since 1970, a recent date
  EXPECT_EQ(events[1].step, 10);
  EXPECT_EQ(events[1].values, (std::map<std::string, float>{
                                  {"loss", 2.5f}, {"lr", 0.05f}, {"samples_per_s", 1234.0f}}));
  EXPECT_GE(events[1].wall_time, events[0].wall_time);
  EXPECT_EQ(events[2].step, 20);
  EXPECT_EQ(events[2].values,
            (std::map<std::string, float>{{"loss", 1.25f}, {"tokens_per_s", 5e4f}}));
  EXPECT_EQ(events[3].values,
            (std::map<std::string, float>{{"test_loss", 0.5f}, {"test_accuracy", 0.875f}}));
}

TEST(TensorBoardWriter, ACorruptedByteFailsTheReader) {
  // The reader's CRC checks are real: flip one byte of a value.
  testing::TempDir dir;
  static std::string path;  // EXPECT_NONFATAL_FAILURE cannot see locals
  {
    TensorBoardWriter w(dir.str());
    path = w.path();
    w.scalars(1, {{"loss", 3.0f}});
  }
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(-6, std::ios::end);  // inside the float, before the data CRC
  f.put('\x7f');
  f.close();
  EXPECT_NONFATAL_FAILURE(read_events(path), "data CRC");
}

TEST(TensorBoardWriter, UnusablePathIsNamed) {
  testing::TempDir dir;
  const std::string file = dir.write("plain", "x");
  try {
    TensorBoardWriter w(file + "/sub");
    FAIL() << "no error";
  } catch (const FileError& e) {
    EXPECT_NE(std::string(e.what()).find(file), std::string::npos) << e.what();
  }
  TensorBoardWriter off("");
  EXPECT_FALSE(off.enabled());
}

}  // namespace
}  // namespace mt
