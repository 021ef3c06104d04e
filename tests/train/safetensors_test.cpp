// safetensors: round trips for every dtype, the bytes checked by a minimal
// parser written here from the format's description, a file laid out by
// hand read back, and every kind of malformed file rejected with a message
// that names the path and the tensor.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "meshtrain/train/safetensors.h"

#include "common/temp_dir.h"

namespace mt {
namespace {

namespace fs = std::filesystem;

class Safetensors : public ::testing::Test {
 protected:
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  mt::testing::TempDir tmp_;
  fs::path dir_ = tmp_.str();
};

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

void spit(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A file from a header text and data bytes, laid out by hand.
std::string make_file(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>(n >> (8 * i));
  return out + header + data;
}

Tensor ramp(const Shape& shape, DType dtype, double start) {
  Tensor t = Tensor::empty(shape, dtype);
  for (int64_t i = 0; i < t.numel(); ++i) t.set_item(i, start + static_cast<double>(i % 100));
  return t;
}

std::map<std::string, Tensor> all_dtypes() {
  std::map<std::string, Tensor> m;
  m["a.f32"] = ramp({3, 4}, DType::f32, -5.5);
  m["b.f64"] = ramp({5}, DType::f64, 0.125);
  m["c.bf16"] = ramp({2, 3, 2}, DType::bf16, -3);
  m["d.f16"] = ramp({7}, DType::f16, 1.5);
  m["e.i32"] = ramp({1, 3}, DType::i32, -40);
  m["f.i64"] = ramp({}, DType::i64, 1234567);  // a scalar
  m["g.u8"] = ramp({9}, DType::u8, 3);         // odd size: tests alignment
  m["h.empty"] = Tensor::empty({0, 4}, DType::f32);
  return m;
}

void expect_same(const Tensor& a, const Tensor& b, const std::string& name) {
  EXPECT_EQ(a.dtype(), b.dtype()) << name;
  EXPECT_EQ(a.shape(), b.shape()) << name;
  ASSERT_EQ(a.nbytes(), b.nbytes()) << name;
  if (a.nbytes() > 0) {
    EXPECT_EQ(std::memcmp(a.raw(), b.raw(), a.nbytes()), 0) << name;
  }
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const CheckpointError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected CheckpointError";
  return "";
}

TEST_F(Safetensors, RoundTripsEveryDtypeWithMetadata) {
  const auto tensors = all_dtypes();
  const std::map<std::string, std::string> meta = {{"step", "42"}, {"note", "ünïcode \"q\""}};
  save_safetensors(path("x.safetensors"), tensors, meta);
  SafetensorsReader r(path("x.safetensors"));
  EXPECT_EQ(r.header().metadata, meta);
  const auto back = r.read_all();
  ASSERT_EQ(back.size(), tensors.size());
  for (const auto& [name, t] : tensors) expect_same(back.at(name), t, name);
  Tensor into = Tensor::zeros({3, 4}, DType::f32);
  r.read_into("a.f32", into);
  expect_same(into, tensors.at("a.f32"), "read_into");
  SafetensorsReader moved(std::move(r));
  expect_same(moved.read("d.f16"), tensors.at("d.f16"), "after a move");
}

TEST_F(Safetensors, BytesFollowTheFormatAsAnIndependentParserReadsThem) {
  const auto tensors = all_dtypes();
  save_safetensors(path("x.safetensors"), tensors, {{"k", "v"}});
  const std::string file = slurp(path("x.safetensors"));
  ASSERT_GE(file.size(), 8u);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(static_cast<uint8_t>(file[i])) << (8 * i);
  ASSERT_LE(8 + n, file.size());
  EXPECT_EQ((8 + n) % 8, 0u) << "data section starts 8-byte aligned";
  const std::string header = file.substr(8, n);
  EXPECT_EQ(header.front(), '{');
  const auto h = nlohmann::json::parse(header);
  EXPECT_EQ(h.at("__metadata__").at("k"), "v");

  // Keys appear sorted in the text.
  size_t last = 0;
  std::string prev;
  for (const auto& [name, t] : tensors) {
    const size_t at = header.find("\"" + name + "\"");
    ASSERT_NE(at, std::string::npos) << name;
    EXPECT_GT(at, last) << name << " after " << prev;
    last = at;
    prev = name;
  }

  const std::map<DType, std::string> names = {
      {DType::f32, "F32"}, {DType::f64, "F64"}, {DType::bf16, "BF16"}, {DType::f16, "F16"},
      {DType::i32, "I32"}, {DType::i64, "I64"}, {DType::u8, "U8"}};
  uint64_t covered = 0;
  for (const auto& [name, t] : tensors) {
    const auto& e = h.at(name);
    EXPECT_EQ(e.at("dtype"), names.at(t.dtype())) << name;
    EXPECT_EQ(e.at("shape").get<std::vector<int64_t>>(), t.shape().dims()) << name;
    const auto begin = e.at("data_offsets")[0].get<uint64_t>();
    const auto end = e.at("data_offsets")[1].get<uint64_t>();
    ASSERT_EQ(end - begin, t.nbytes()) << name;
    EXPECT_EQ((8 + n + begin) % dtype_size(t.dtype()), 0u) << name << " is aligned";
    EXPECT_EQ(std::memcmp(file.data() + 8 + n + begin, t.raw(), t.nbytes()), 0) << name;
    covered += end - begin;
  }
  EXPECT_EQ(8 + n + covered, file.size()) << "data is contiguous, no slack";
}

TEST_F(Safetensors, ExactBytesForOneTensor) {
  Tensor t = Tensor::empty({2}, DType::f32);
  t.set_item(0, 1.0);
  t.set_item(1, -2.0);
  save_safetensors(path("one.safetensors"), {{"w", t}});
  const std::string header = R"({"w":{"data_offsets":[0,8],"dtype":"F32","shape":[2]}})";
  std::string padded = header + std::string((8 - header.size() % 8) % 8, ' ');
  const char data[8] = {0, 0, '\x80', '\x3f', 0, 0, 0, '\xc0'};  // 1.0f, -2.0f little-endian
  EXPECT_EQ(slurp(path("one.safetensors")), make_file(padded, std::string(data, 8)));
}

TEST_F(Safetensors, ReadsAFileLaidOutByHand) {
  // Unpadded header, unsorted keys, metadata first: all legal.
  const std::string header =
      R"({"__metadata__":{"format":"pt"},"y":{"shape":[3],"dtype":"U8","data_offsets":[16,19]},)"
      R"("x":{"dtype":"I32","shape":[2,2],"data_offsets":[0,16]}})";
  std::string data;
  for (int32_t v : {1, -2, 3, 70000}) data.append(reinterpret_cast<const char*>(&v), 4);
  data += "\x07\x08\x09";
  spit(path("h.safetensors"), make_file(header, data));
  SafetensorsReader r(path("h.safetensors"));
  EXPECT_EQ(r.header().metadata.at("format"), "pt");
  Tensor x = r.read("x");
  EXPECT_EQ(x.shape(), Shape({2, 2}));
  EXPECT_EQ(x.item(1), -2);
  EXPECT_EQ(x.item(3), 70000);
  EXPECT_EQ(r.read("y").item(2), 9);
}

struct BadCase {
  std::string what;
  std::string header;
  size_t data_bytes;
  std::vector<std::string> message_has;
};

TEST_F(Safetensors, RejectsMalformedFilesNamingPathAndTensor) {
  const std::vector<BadCase> cases = {
      {"bad json", R"({"w":{"dtype":"F32",)", 0, {"not valid JSON"}},
      {"not an object", R"([1, 2])", 0, {"JSON object"}},
      {"unknown dtype",
       R"({"w":{"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]}})",
       2,
       {"'w'", "unsupported dtype 'F8_E4M3'"}},
      {"offsets past the end",
       R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})",
       8,
       {"'w'", "truncated", "16", "8 data bytes"}},
      {"size mismatch",
       R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})",
       8,
       {"'w'", "needs 3 x 4 bytes"}},
      {"overlap",
       R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
       R"("b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})",
       6,
       {"'b'", "overlaps a"}},
      {"gap",
       R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
       R"("b":{"dtype":"U8","shape":[2],"data_offsets":[4,6]}})",
       6,
       {"gap of 2 bytes", "'b'"}},
      {"trailing bytes",
       R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})",
       5,
       {"3 bytes after the last tensor"}},
      {"negative dim",
       R"({"a":{"dtype":"U8","shape":[-2],"data_offsets":[0,2]}})",
       2,
       {"'a'", "non-negative"}},
      {"backwards offsets",
       R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[2,0]}})",
       2,
       {"'a'", "backwards"}},
      {"missing field", R"({"a":{"dtype":"U8","shape":[2]}})", 2, {"'a'", "data_offsets"}},
      {"extra field",
       R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2],"x":1}})",
       2,
       {"'a'", "unknown field 'x'"}},
      {"duplicate name",
       R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
       R"("a":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}})",
       4,
       {"'a' twice"}},
      {"metadata not strings", R"({"__metadata__":{"step":3}})", 0, {"'step'", "not a string"}},
      {"overflowing shape",
       R"({"a":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,8]}})",
       8,
       {"'a'", "too large"}},
  };
  for (const BadCase& c : cases) {
    const std::string p = path("bad.safetensors");
    spit(p, make_file(c.header, std::string(c.data_bytes, '\0')));
    const std::string msg = error_of([&] { SafetensorsReader r(p); });
    EXPECT_NE(msg.find(p), std::string::npos) << c.what << ": " << msg;
    for (const std::string& part : c.message_has) {
      EXPECT_NE(msg.find(part), std::string::npos) << c.what << ": '" << part << "' in " << msg;
    }
  }
}

TEST_F(Safetensors, RejectsTruncatedFiles) {
  save_safetensors(path("x.safetensors"), all_dtypes());
  const std::string file = slurp(path("x.safetensors"));
  const std::string p = path("cut.safetensors");

  spit(p, file.substr(0, file.size() - 3));
  std::string msg = error_of([&] { SafetensorsReader r(p); });
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
  EXPECT_NE(msg.find(p), std::string::npos) << msg;

  spit(p, file.substr(0, 40));  // inside the header
  msg = error_of([&] { SafetensorsReader r(p); });
  EXPECT_NE(msg.find("header length"), std::string::npos) << msg;

  spit(p, file.substr(0, 5));  // inside the length field
  msg = error_of([&] { SafetensorsReader r(p); });
  EXPECT_NE(msg.find("too short"), std::string::npos) << msg;

  std::string huge = make_file("{}", "");
  huge[6] = '\x01';  // claims a 2^48-byte header
  spit(p, huge);
  msg = error_of([&] { SafetensorsReader r(p); });
  EXPECT_NE(msg.find("header length"), std::string::npos) << msg;
}

TEST_F(Safetensors, ReportsMissingTensorsAndFiles) {
  save_safetensors(path("x.safetensors"), all_dtypes());
  SafetensorsReader r(path("x.safetensors"));
  std::string msg = error_of([&] { r.read("nope"); });
  EXPECT_NE(msg.find("'nope'"), std::string::npos) << msg;
  Tensor wrong = Tensor::zeros({4, 3}, DType::f32);
  msg = error_of([&] { r.read_into("a.f32", wrong); });
  EXPECT_NE(msg.find("'a.f32'"), std::string::npos) << msg;
  EXPECT_THROW(SafetensorsReader(path("absent.safetensors")), FileError);
}

TEST_F(Safetensors, RejectsReservedOrEmptyNamesOnWrite) {
  Tensor t = Tensor::zeros({1}, DType::f32);
  EXPECT_THROW(save_safetensors(path("x"), {{"__metadata__", t}}), ConfigError);
  EXPECT_THROW(save_safetensors(path("x"), {{"", t}}), ConfigError);
  EXPECT_FALSE(fs::exists(path("x")));
}

}  // namespace
}  // namespace mt
