// IDX parsing and Fashion-MNIST validation on small synthetic files written to
// a scratch directory: every malformed input must give a FileError naming the
// file, what was expected and what was found.
#include <zlib.h>

#include <cmath>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/temp_dir.h"
#include "meshtrain/base/error.h"
#include "meshtrain/data/fashion_mnist.h"
#include "meshtrain/data/idx.h"

namespace mt {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using testing::TempDir;

void put_u32(std::string& s, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) s.push_back(static_cast<char>((v >> shift) & 0xff));
}

std::string idx_bytes(uint32_t magic, const std::vector<uint32_t>& dims, const std::string& data) {
  std::string s;
  put_u32(s, magic);
  for (uint32_t d : dims) put_u32(s, d);
  return s + data;
}

void write_gz(const std::string& path, const std::string& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr) << path;
  ASSERT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())),
            static_cast<int>(bytes.size()));
  ASSERT_EQ(gzclose(f), Z_OK);
}

// n images whose pixel p of image i is (i * 7 + p) % 256, labels i % 10.
std::string image_data(uint32_t n, uint32_t rows = 28, uint32_t cols = 28) {
  std::string s;
  for (uint32_t i = 0; i < n; ++i) {
    for (uint32_t p = 0; p < rows * cols; ++p) s.push_back(static_cast<char>((i * 7 + p) % 256));
  }
  return s;
}
std::string label_data(uint32_t n) {
  std::string s;
  for (uint32_t i = 0; i < n; ++i) s.push_back(static_cast<char>(i % 10));
  return s;
}

// Writes a train split with the given raw (uncompressed) IDX contents.
void write_split(const TempDir& dir, const std::string& images, const std::string& labels) {
  write_gz(FashionMnist::images_path(dir.str(), DataSplit::train), images);
  write_gz(FashionMnist::labels_path(dir.str(), DataSplit::train), labels);
}

void write_good_split(const TempDir& dir, uint32_t n) {
  write_split(dir, idx_bytes(kIdxImagesMagic, {n, 28, 28}, image_data(n)),
              idx_bytes(kIdxLabelsMagic, {n}, label_data(n)));
}

template <class F>
std::string file_error_of(F&& f) {
  try {
    f();
  } catch (const FileError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a FileError";
  return "";
}

TEST(Idx, ReadsHeaderAndDataOfAGzipFile) {
  TempDir dir;
  const std::string path = dir.file("x.gz");
  write_gz(path, idx_bytes(kIdxImagesMagic, {3, 2, 4}, "abcdefghABCDEFGH01234567"));
  const IdxArray a = read_idx(path, kIdxImagesMagic);
  EXPECT_EQ(a.dims, (std::vector<int64_t>{3, 2, 4}));
  EXPECT_EQ(a.records, 3);
  EXPECT_EQ(std::string(a.data.begin(), a.data.end()), "abcdefghABCDEFGH01234567");
}

TEST(Idx, ReadsAnUncompressedFileToo) {
  TempDir dir;
  const std::string path = dir.write("labels", idx_bytes(kIdxLabelsMagic, {4}, "\1\2\3\4"));
  const IdxArray a = read_idx(path, kIdxLabelsMagic);
  EXPECT_EQ(a.records, 4);
  EXPECT_EQ(a.data, (std::vector<uint8_t>{1, 2, 3, 4}));
}

TEST(Idx, LimitReadsOnlyTheFirstRecords) {
  TempDir dir;
  const std::string path = dir.file("l.gz");
  write_gz(path, idx_bytes(kIdxLabelsMagic, {5}, "\5\6\7\10\11"));
  const IdxArray a = read_idx(path, kIdxLabelsMagic, 2);
  EXPECT_EQ(a.dims[0], 5);
  EXPECT_EQ(a.records, 2);
  EXPECT_EQ(a.data, (std::vector<uint8_t>{5, 6}));
}

TEST(Idx, WrongMagicNamesExpectedAndFound) {
  TempDir dir;
  const std::string path = dir.file("x.gz");
  write_gz(path, idx_bytes(kIdxLabelsMagic, {2}, "\1\2"));
  const std::string msg = file_error_of([&] { read_idx(path, kIdxImagesMagic); });
  EXPECT_THAT(msg, AllOf(HasSubstr(path), HasSubstr("expected magic 0x00000803"),
                         HasSubstr("found 0x00000801")));
}

TEST(Idx, EmptyFileIsTruncated) {
  TempDir dir;
  const std::string path = dir.write("empty", "");
  EXPECT_THAT(file_error_of([&] { read_idx(path, kIdxLabelsMagic); }),
              AllOf(HasSubstr(path), HasSubstr("truncated"), HasSubstr("found 0 bytes")));
}

TEST(Idx, TruncatedHeader) {
  TempDir dir;
  std::string bytes;
  put_u32(bytes, kIdxImagesMagic);
  put_u32(bytes, 10);
  const std::string path = dir.write("short", bytes);
  EXPECT_THAT(file_error_of([&] { read_idx(path, kIdxImagesMagic); }),
              AllOf(HasSubstr(path), HasSubstr("truncated header"), HasSubstr("expected 3"),
                    HasSubstr("found only 1")));
}

TEST(Idx, ImplausibleDimensionsAreRejectedBeforeAnyArithmetic) {
  TempDir dir;
  const std::string path =
      dir.write("huge", idx_bytes(kIdxImagesMagic, {0xffffffffu, 0xffffffffu, 0xffffffffu}, ""));
  EXPECT_THAT(file_error_of([&] { read_idx(path, kIdxImagesMagic); }),
              AllOf(HasSubstr(path), HasSubstr("implausible IDX header"),
                    HasSubstr("[4294967295, 4294967295, 4294967295]")));
}

TEST(Idx, DataShorterThanHeaderIsTruncated) {
  TempDir dir;
  const std::string path = dir.file("x.gz");
  write_gz(path, idx_bytes(kIdxImagesMagic, {5, 2, 2}, std::string(12, 'x')));
  EXPECT_THAT(file_error_of([&] { read_idx(path, kIdxImagesMagic); }),
              AllOf(HasSubstr(path), HasSubstr("truncated"), HasSubstr("declares 5 records of 4"),
                    HasSubstr("20 bytes of data"), HasSubstr("only 12 bytes")));
}

TEST(Idx, CutGzipStreamIsAnError) {
  TempDir dir;
  const std::string whole = dir.file("whole.gz");
  write_gz(whole, idx_bytes(kIdxImagesMagic, {50, 28, 28}, image_data(50)));
  std::string compressed;
  {
    std::ifstream in(whole, std::ios::binary);
    compressed.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  const std::string cut = dir.write("cut.gz", compressed.substr(0, compressed.size() / 2));
  const std::string msg = file_error_of([&] { read_idx(cut, kIdxImagesMagic); });
  EXPECT_THAT(msg, HasSubstr(cut));
  EXPECT_THAT(msg, ::testing::AnyOf(HasSubstr("truncated"), HasSubstr("corrupt")));
}

TEST(Idx, TrailingDataIsAnError) {
  TempDir dir;
  const std::string path = dir.file("x.gz");
  write_gz(path, idx_bytes(kIdxLabelsMagic, {2}, "\1\2\3\4\5"));
  EXPECT_THAT(file_error_of([&] { read_idx(path, kIdxLabelsMagic); }),
              AllOf(HasSubstr(path), HasSubstr("3 bytes of trailing data"),
                    HasSubstr("2 records of 1 bytes")));
}

TEST(Idx, MissingFileGivesTheHint) {
  TempDir dir;
  const std::string path = dir.file("nope.gz");
  EXPECT_THAT(file_error_of([&] { read_idx(path, kIdxLabelsMagic, -1, "try X"); }),
              AllOf(HasSubstr(path), HasSubstr("not found"), HasSubstr("try X")));
}

TEST(FashionMnistFiles, LoadsAndNormalisesASyntheticSplit) {
  TempDir dir;
  write_good_split(dir, 6);
  FashionMnistOptions o;
  o.dir = dir.str();
  const FashionMnist ds(o);
  ASSERT_EQ(ds.size(), 6);
  const std::vector<int64_t> idx = {4, 1};
  const Batch b = ds.gather(idx);
  ASSERT_EQ(b.x.shape(), (Shape{2, 1, 28, 28}));
  ASSERT_EQ(b.y.shape(), (Shape{2}));
  EXPECT_EQ(b.y.item(0), 4);
  EXPECT_EQ(b.y.item(1), 1);
  for (int64_t p : {int64_t{0}, int64_t{5}, int64_t{783}}) {
    const double raw = static_cast<double>((4 * 7 + p) % 256);
    EXPECT_NEAR(b.x.item(p), (raw / 255.0 - 0.2860) / 0.3530, 1e-5) << p;
  }

  o.flatten = true;
  const FashionMnist flat(o);
  const Batch f = flat.gather(idx);
  ASSERT_EQ(f.x.shape(), (Shape{2, 784}));
  for (int64_t i = 0; i < f.x.numel(); ++i) ASSERT_EQ(f.x.item(i), b.x.item(i)) << i;
  EXPECT_EQ(flatten_images(b.x).shape(), (Shape{2, 784}));
}

TEST(FashionMnistFiles, LimitKeepsTheFirstExamples) {
  TempDir dir;
  write_good_split(dir, 6);
  FashionMnistOptions o;
  o.dir = dir.str();
  o.limit = 3;
  const FashionMnist ds(o);
  EXPECT_EQ(ds.size(), 3);
  EXPECT_EQ(ds.labels(), (std::vector<uint8_t>{0, 1, 2}));
}

TEST(FashionMnistFiles, MissingFileNamesTheDebianPackage) {
  TempDir dir;
  FashionMnistOptions o;
  o.dir = dir.str();
  const std::string msg = file_error_of([&] { FashionMnist{o}; });
  EXPECT_THAT(msg, AllOf(HasSubstr(FashionMnist::images_path(dir.str(), DataSplit::train)),
                         HasSubstr("not found"), HasSubstr("dataset-fashion-mnist"),
                         HasSubstr("apt-get install dataset-fashion-mnist")));
}

TEST(FashionMnistFiles, WrongImageSize) {
  TempDir dir;
  write_split(dir, idx_bytes(kIdxImagesMagic, {2, 32, 32}, image_data(2, 32, 32)),
              idx_bytes(kIdxLabelsMagic, {2}, label_data(2)));
  FashionMnistOptions o;
  o.dir = dir.str();
  EXPECT_THAT(file_error_of([&] { FashionMnist{o}; }),
              AllOf(HasSubstr("train-images-idx3-ubyte.gz"), HasSubstr("expected 28x28 images"),
                    HasSubstr("found 32x32")));
}

TEST(FashionMnistFiles, LabelOutOfRange) {
  TempDir dir;
  write_split(dir, idx_bytes(kIdxImagesMagic, {4, 28, 28}, image_data(4)),
              idx_bytes(kIdxLabelsMagic, {4}, std::string("\1\2\12\3", 4)));
  FashionMnistOptions o;
  o.dir = dir.str();
  EXPECT_THAT(file_error_of([&] { FashionMnist{o}; }),
              AllOf(HasSubstr("train-labels-idx1-ubyte.gz"),
                    HasSubstr("label 10 at index 2 is out of range: expected 0..9")));
}

TEST(FashionMnistFiles, CountMismatchBetweenImagesAndLabels) {
  TempDir dir;
  write_split(dir, idx_bytes(kIdxImagesMagic, {5, 28, 28}, image_data(5)),
              idx_bytes(kIdxLabelsMagic, {4}, label_data(4)));
  FashionMnistOptions o;
  o.dir = dir.str();
  EXPECT_THAT(file_error_of([&] { FashionMnist{o}; }),
              AllOf(HasSubstr("train-labels-idx1-ubyte.gz: has 4 labels"),
                    HasSubstr("train-images-idx3-ubyte.gz has 5 images")));
  // The mismatch is found from the headers, also when only a prefix is read.
  o.limit = 2;
  EXPECT_THAT(file_error_of([&] { FashionMnist{o}; }), HasSubstr("has 4 labels"));
}

TEST(FashionMnistFiles, TruncatedImagesFile) {
  TempDir dir;
  write_split(dir, idx_bytes(kIdxImagesMagic, {5, 28, 28}, image_data(3)),
              idx_bytes(kIdxLabelsMagic, {5}, label_data(5)));
  FashionMnistOptions o;
  o.dir = dir.str();
  EXPECT_THAT(file_error_of([&] { FashionMnist{o}; }),
              AllOf(HasSubstr("train-images-idx3-ubyte.gz: truncated"),
                    HasSubstr("declares 5 records of 784 bytes"), HasSubstr("only 2352 bytes")));
}

TEST(FashionMnistFiles, BadLimitIsAConfigError) {
  FashionMnistOptions o;
  o.limit = -2;
  EXPECT_THROW(FashionMnist{o}, ConfigError);
}

}  // namespace
}  // namespace mt
