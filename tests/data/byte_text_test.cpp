// Byte-level text: windows and targets, the positional train/test split,
// directory concatenation, and the errors for missing/empty/short corpora.
#include <filesystem>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/temp_dir.h"
#include "meshtrain/base/error.h"
#include "meshtrain/data/byte_text.h"

namespace mt {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using testing::TempDir;

std::string corpus(size_t n) {
  std::string s;
  for (size_t i = 0; i < n; ++i) s.push_back(static_cast<char>((i * 37 + i / 7) % 256));
  return s;
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

TEST(ByteText, TargetsAreInputsShiftedByOne) {
  TempDir dir;
  const std::string text = corpus(1000);
  ByteTextOptions o;
  o.path = dir.write("t.txt", text);
  o.seq_len = 8;
  const ByteText ds(o);
  // 900 train bytes, windows of 9 bytes starting every 8: (900 - 9) / 8 + 1.
  ASSERT_EQ(ds.size(), 112);
  const std::vector<int64_t> idx = {0, 5, 111};
  const Batch b = ds.gather(idx);
  ASSERT_EQ(b.x.shape(), (Shape{3, 8}));
  ASSERT_EQ(b.y.shape(), (Shape{24}));
  for (int64_t i = 0; i < 3; ++i) {
    const size_t start = static_cast<size_t>(idx[static_cast<size_t>(i)] * 8);
    for (int64_t t = 0; t < 8; ++t) {
      const auto at = [&](size_t k) { return static_cast<double>(static_cast<uint8_t>(text[k])); };
      EXPECT_EQ(b.x.item(i * 8 + t), at(start + static_cast<size_t>(t)));
      EXPECT_EQ(b.y.item(i * 8 + t), at(start + static_cast<size_t>(t) + 1));
      if (t + 1 < 8) {
        EXPECT_EQ(b.y.item(i * 8 + t), b.x.item(i * 8 + t + 1));
      }
    }
  }
}

TEST(ByteText, SplitIsPositionalAndCoversTheFile) {
  TempDir dir;
  const std::string text = corpus(1234);
  ByteTextOptions o;
  o.path = dir.write("t.txt", text);
  o.seq_len = 4;
  const ByteText train(o);
  o.split = DataSplit::test;
  const ByteText test(o);
  EXPECT_EQ(train.text().size(), 1110u);  // floor(1234 * 0.9)
  EXPECT_EQ(train.text() + test.text(), text);
  EXPECT_EQ(test.size(), (124 - 5) / 4 + 1);
}

TEST(ByteText, StrideAndLimit) {
  TempDir dir;
  ByteTextOptions o;
  o.path = dir.write("t.txt", corpus(200));
  o.seq_len = 10;
  o.stride = 1;
  o.test_fraction = 0;
  const ByteText dense(o);
  EXPECT_EQ(dense.size(), 190);
  const std::vector<int64_t> idx = {3};
  EXPECT_EQ(dense.gather(idx).x.item(0), static_cast<uint8_t>(corpus(200)[3]));
  o.limit = 7;
  EXPECT_EQ(ByteText(o).size(), 7);
}

TEST(ByteText, DirectoryConcatenatesPlainTextFilesInNameOrder) {
  TempDir dir;
  dir.write("b", "second file\n");
  dir.write("a", "first file\n");
  dir.write("a.dat", std::string("\0\0\0\2binary", 10));
  std::filesystem::create_symlink(dir.file("a"), dir.file("a.u8"));
  ByteTextOptions o;
  o.path = dir.str();
  o.seq_len = 3;
  o.test_fraction = 0;
  const ByteText ds(o);
  EXPECT_EQ(ds.text(), "first file\nsecond file\n");
  EXPECT_EQ(ds.files(), (std::vector<std::string>{dir.file("a"), dir.file("b")}));
}

TEST(ByteText, MissingFileNamesThePath) {
  TempDir dir;
  ByteTextOptions o;
  o.path = dir.file("nope.txt");
  const std::string msg = file_error_of([&] { ByteText{o}; });
  EXPECT_THAT(msg, AllOf(HasSubstr(o.path), HasSubstr("not found")));
  EXPECT_THAT(msg, ::testing::Not(HasSubstr("fortunes")));
}

TEST(ByteText, MissingDefaultCorpusNamesTheDebianPackage) {
  ByteTextOptions o;
  o.path = std::string(kFortunesDefaultDir) + "/no-such-fortune-file";
  EXPECT_THAT(file_error_of([&] { ByteText{o}; }),
              AllOf(HasSubstr(o.path), HasSubstr("Debian package `fortunes`"),
                    HasSubstr("apt-get install fortunes")));
}

TEST(ByteText, EmptyFileNamesTheNeededLength) {
  TempDir dir;
  ByteTextOptions o;
  o.path = dir.write("empty.txt", "");
  o.seq_len = 64;
  EXPECT_THAT(file_error_of([&] { ByteText{o}; }),
              AllOf(HasSubstr(o.path), HasSubstr("is empty"), HasSubstr("seq_len 64"),
                    HasSubstr("needs at least 65 bytes")));
}

TEST(ByteText, TooShortForTheTestSplit) {
  TempDir dir;
  ByteTextOptions o;
  o.path = dir.write("short.txt", corpus(300));
  o.seq_len = 32;
  o.split = DataSplit::test;
  EXPECT_THAT(file_error_of([&] { ByteText{o}; }),
              AllOf(HasSubstr(o.path), HasSubstr("too short"), HasSubstr("test split"),
                    HasSubstr("has 30 bytes"), HasSubstr("needs at least 33 bytes")));
}

TEST(ByteText, DirectoryWithoutTextFiles) {
  TempDir dir;
  dir.write("x.dat", std::string("\0\1", 2));
  ByteTextOptions o;
  o.path = dir.str();
  EXPECT_THAT(file_error_of([&] { ByteText{o}; }),
              AllOf(HasSubstr(dir.str()), HasSubstr("no non-empty plain-text files")));
}

TEST(ByteText, BadOptionsAreConfigErrors) {
  ByteTextOptions o;
  o.seq_len = 0;
  EXPECT_THROW(ByteText{o}, ConfigError);
  o = {};
  o.test_fraction = 1.0;
  EXPECT_THROW(ByteText{o}, ConfigError);
  o = {};
  o.stride = -1;
  EXPECT_THROW(ByteText{o}, ConfigError);
}

TEST(ByteText, DefaultFortunesCorpusLoads) {
  const ByteText ds;  // /usr/share/games/fortunes from the Debian package `fortunes`
  EXPECT_GT(ds.files().size(), 10u);
  for (const std::string& f : ds.files()) {
    EXPECT_FALSE(f.ends_with(".dat")) << f;
    EXPECT_FALSE(f.ends_with(".u8")) << f;
  }
  EXPECT_GT(ds.size(), 10000);
  EXPECT_EQ(ds.text().find('\0'), std::string::npos);
}

}  // namespace
}  // namespace mt
