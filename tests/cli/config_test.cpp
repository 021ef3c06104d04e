// The TOML config reader: typed getters and their errors, --set overrides,
// lists, bounds, enum-like strings, and the unknown-key check.
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "meshtrain/base/error.h"
#include "meshtrain/cli/config.h"

namespace mt {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

// Writes `text` to a file named `name` in a fresh scratch directory.
class ConfigFile {
 public:
  ConfigFile(const std::string& name, const std::string& text) {
    dir_ = std::filesystem::temp_directory_path() /
           ("meshtrain-config-" + std::to_string(::getpid()) + "-" + std::to_string(counter_++));
    std::filesystem::create_directories(dir_);
    path_ = (dir_ / name).string();
    std::ofstream(path_) << text;
  }
  ~ConfigFile() {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  ConfigFile(const ConfigFile&) = delete;
  ConfigFile& operator=(const ConfigFile&) = delete;
  const std::string& path() const { return path_; }

 private:
  static inline int counter_ = 0;
  std::filesystem::path dir_;
  std::string path_;
};

template <class E, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an exception";
  return "";
}

constexpr const char* kExample = R"(
[train]
epochs = 7
lr = 0.05
batch_size = 64
shuffle = false
optimizer = "adamw"
shares = [2, 1]
betas = [0.9, 0.999]
warmup = 3

[data]
name = "fashion-mnist"
files = ["a", "b"]
)";

TEST(Config, LoadsTypedValuesAndDefaults) {
  ConfigFile f("x.toml", kExample);
  const Config c = Config::load(f.path());
  EXPECT_EQ(c.source(), f.path());
  EXPECT_EQ(c.get_int("train.epochs", 5), 7);
  EXPECT_DOUBLE_EQ(c.get_double("train.lr", 0.1), 0.05);
  EXPECT_FALSE(c.get_bool("train.shuffle", true));
  EXPECT_EQ(c.get_string("train.optimizer", "sgd"), "adamw");
  EXPECT_EQ(c.get_int_list("train.shares", {}), (std::vector<int64_t>{2, 1}));
  EXPECT_EQ(c.get_double_list("train.betas", {}), (std::vector<double>{0.9, 0.999}));
  EXPECT_EQ(c.get_string_list("data.files", {}), (std::vector<std::string>{"a", "b"}));
  // Integers are accepted as floats.
  EXPECT_DOUBLE_EQ(c.get_double("train.warmup", 0), 3.0);
  EXPECT_EQ(c.get_double_list("train.shares", {}), (std::vector<double>{2.0, 1.0}));
  // Absent keys and sections give the defaults.
  EXPECT_EQ(c.get_int("train.seed", 42), 42);
  EXPECT_EQ(c.get_string("model.kind", "mlp"), "mlp");
  EXPECT_EQ(c.get_int_list("model.hidden", {128, 64}), (std::vector<int64_t>{128, 64}));
  EXPECT_TRUE(c.has("train.lr"));
  EXPECT_FALSE(c.has("train.nope"));
  EXPECT_FALSE(c.has("train.lr.x"));
}

TEST(Config, MissingFileIsAFileErrorNamingThePath) {
  const std::string path = "/nonexistent/meshtrain/x.toml";
  EXPECT_THAT(error_of<FileError>([&] { Config::load(path); }),
              AllOf(HasSubstr(path), HasSubstr("not found")));
}

TEST(Config, ParseErrorNamesPathLineAndColumn) {
  ConfigFile f("bad.toml", "[train]\nepochs = 5\nlr = = 3\n");
  EXPECT_THAT(error_of<ConfigError>([&] { Config::load(f.path()); }),
              AllOf(HasSubstr("config " + f.path()), HasSubstr("parse error"),
                    HasSubstr("line 3, column 6")));
}

TEST(Config, WrongTypeNamesSourceKeyAndValue) {
  ConfigFile f("x.toml", "[train]\nlr = \"fast\"\nepochs = 2.5\nshuffle = 1\nname = 3\n");
  const Config c = Config::load(f.path());
  EXPECT_THAT(error_of<ConfigError>([&] { c.get_double("train.lr", 0.1); }),
              AllOf(HasSubstr("config " + f.path() +
                              ": train.lr: expected a number, got string "
                              "\"fast\""),
                    HasSubstr("line 2")));
  EXPECT_THAT(error_of<ConfigError>([&] { c.get_int("train.epochs", 1); }),
              HasSubstr(": train.epochs: expected an integer, got float 2.5"));
  EXPECT_THAT(error_of<ConfigError>([&] { c.get_bool("train.shuffle", true); }),
              HasSubstr(": train.shuffle: expected a boolean (true or false), got integer 1"));
  EXPECT_THAT(error_of<ConfigError>([&] { c.get_string("train.name", ""); }),
              HasSubstr(": train.name: expected a string, got integer 3"));
  EXPECT_THAT(error_of<ConfigError>([&] { c.get_int("train.lr.x", 1); }),
              HasSubstr("train.lr.x: train.lr is string \"fast\", not a table"));
}

TEST(Config, WrongTypeFromAnOverrideNamesSet) {
  Config c = Config::parse("[train]\nlr = 0.1\n", "configs/x.toml");
  c.set("train.lr=fast");
  EXPECT_THAT(error_of<ConfigError>([&] { c.get_double("train.lr", 0.1); }),
              AllOf(HasSubstr("config --set: train.lr: expected a number, got string \"fast\""),
                    Not(HasSubstr("line"))));
}

TEST(Config, OverridesWinOverTheFileAndParseAsToml) {
  ConfigFile f("x.toml", kExample);
  Config c = Config::load(f.path());
  c.set_all({"train.epochs=11", "train.lr=1e-3", "train.shuffle=true", "train.optimizer=sgd",
             "train.shares=[1, 3]", "model.kind = \"cnn\"", "model.width=0.5",
             "model.name=hello world"});
  EXPECT_EQ(c.get_int("train.epochs", 5), 11);
  EXPECT_DOUBLE_EQ(c.get_double("train.lr", 0), 1e-3);
  EXPECT_TRUE(c.get_bool("train.shuffle", false));
  EXPECT_EQ(c.get_string("train.optimizer", ""), "sgd");
  EXPECT_EQ(c.get_int_list("train.shares", {}), (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(c.get_string("model.kind", ""), "cnn");
  EXPECT_DOUBLE_EQ(c.get_double("model.width", 1), 0.5);
  EXPECT_EQ(c.get_string("model.name", ""), "hello world");
  // Untouched keys keep their file values; the dump shows the merged result.
  EXPECT_EQ(c.get_int("train.batch_size", 1), 64);
  EXPECT_THAT(c.dump(), AllOf(HasSubstr("epochs = 11"), HasSubstr("kind = 'cnn'")));
}

TEST(Config, MalformedOverridesAreErrors) {
  Config c;
  EXPECT_THAT(error_of<ConfigError>([&] { c.set("train.epochs"); }),
              HasSubstr("--set train.epochs: expected section.key=value"));
  EXPECT_THAT(error_of<ConfigError>([&] { c.set("train..lr=1"); }), HasSubstr("bad key"));
  EXPECT_THAT(error_of<ConfigError>([&] { c.set("=1"); }), HasSubstr("bad key"));
  EXPECT_THAT(error_of<ConfigError>([&] { c.set("train.lr="); }), HasSubstr("empty value"));
  EXPECT_THAT(error_of<ConfigError>([&] { c.set("train.shares=[2,1"); }),
              AllOf(HasSubstr("--set train.shares=[2,1"), HasSubstr("cannot parse [2,1")));
  c.set("train.lr=0.1");
  EXPECT_THAT(error_of<ConfigError>([&] { c.set("train.lr.x=1"); }),
              HasSubstr("train.lr is float 0.1 (from --set), not a table"));
}

TEST(Config, BoundsAreChecked) {
  const Config c = Config::parse("lr = -0.1\nepochs = 0\nshares = [2, 0]\nfrac = 1.5\nok = 3\n",
                                 "configs/b.toml");
  EXPECT_THAT(error_of<ConfigError>([&] { c.get_double("lr", 0.1, Bounds<double>::positive()); }),
              HasSubstr("config configs/b.toml: lr: must be > 0, got -0.1"));
  EXPECT_THAT(error_of<ConfigError>([&] { c.get_int("epochs", 1, Bounds<int64_t>::at_least(1)); }),
              HasSubstr("epochs: must be >= 1, got 0"));
  EXPECT_THAT(
      error_of<ConfigError>([&] { c.get_int_list("shares", {}, Bounds<int64_t>::positive()); }),
      HasSubstr("shares[1]: must be > 0, got 0"));
  EXPECT_THAT(error_of<ConfigError>([&] { c.get_double("frac", 0, Bounds<double>::in(0, 1)); }),
              HasSubstr("frac: must be in [0, 1], got 1.5"));
  EXPECT_EQ(c.get_int("ok", 0, Bounds<int64_t>::in(1, 8)), 3);
  EXPECT_FALSE(Bounds<double>::positive().contains(std::nan("")));
  EXPECT_EQ(Bounds<int64_t>::non_negative().describe(), ">= 0");
}

TEST(Config, ListElementsOfTheWrongType) {
  const Config c = Config::parse("a = [1, \"x\"]\nb = 5\nc = [1.5]\n", "l.toml");
  EXPECT_THAT(error_of<ConfigError>([&] { c.get_int_list("a", {}); }),
              HasSubstr("config l.toml: a[1]: expected an integer, got string \"x\""));
  EXPECT_THAT(error_of<ConfigError>([&] { c.get_double_list("b", {}); }),
              HasSubstr("b: expected an array of numbers, got integer 5"));
  EXPECT_THAT(error_of<ConfigError>([&] { c.get_int_list("c", {}); }),
              HasSubstr("c[0]: expected an integer, got float 1.5"));
  EXPECT_THAT(error_of<ConfigError>([&] { c.get_string_list("a", {}); }),
              HasSubstr("a[0]: expected a string, got integer 1"));
}

TEST(Config, EnumLikeStringListsAllowedValues) {
  const Config c = Config::parse("[optim]\nname = \"adamx\"\nother = \"sgd\"\n", "o.toml");
  const std::vector<std::string> allowed = {"sgd", "adam", "adamw"};
  EXPECT_THAT(error_of<ConfigError>([&] { c.get_string("optim.name", "sgd", allowed); }),
              HasSubstr("config o.toml: optim.name: unknown value \"adamx\"; allowed: sgd, adam, "
                        "adamw (did you mean \"adam\"?)"));
  EXPECT_EQ(c.get_string("optim.other", "adam", allowed), "sgd");
  EXPECT_EQ(c.get_string("optim.absent", "adamw", allowed), "adamw");
}

TEST(Config, RequiredKeys) {
  const Config c = Config::parse("[a]\nx = 1\n", "r.toml");
  EXPECT_EQ(c.require_int("a.x"), 1);
  EXPECT_THAT(error_of<ConfigError>([&] { c.require_string("a.y"); }),
              HasSubstr("config r.toml: a.y: required key is missing"));
  EXPECT_THAT(error_of<ConfigError>([&] { c.require_double("b.z"); }),
              HasSubstr("b.z: required key is missing"));
}

TEST(Config, UnknownKeysAreListedWithSuggestions) {
  ConfigFile f("u.toml",
               "[train]\nepochs = 3\nlearning_rat = 0.1\n\n[trian]\nbatch_size = 8\n\n"
               "[model]\nlr = 1\nzzz = true\n");
  Config c = Config::load(f.path());
  c.set("train.seedd=3");
  c.get_int("train.epochs", 1);
  c.get_double("train.learning_rate", 0.1);
  c.get_int("train.batch_size", 1);
  c.get_double("train.lr", 0.1);
  c.get_int("train.seed", 0);
  EXPECT_EQ(c.unused_keys(),
            (std::vector<std::string>{"model.lr", "model.zzz", "train.learning_rat", "train.seedd",
                                      "trian.batch_size"}));
  const std::string msg = error_of<ConfigError>([&] { c.check_all_used(); });
  EXPECT_THAT(msg, HasSubstr("config " + f.path() + ": 5 unknown keys (present but never read)"));
  EXPECT_THAT(msg, HasSubstr("train.learning_rat (line 3, did you mean \"train.learning_rate\"?)"));
  EXPECT_THAT(msg, HasSubstr("trian.batch_size (line 6, did you mean \"train.batch_size\"?)"));
  EXPECT_THAT(msg, HasSubstr("train.seedd (from --set, did you mean \"train.seed\"?)"));
  EXPECT_THAT(msg, HasSubstr("model.lr (line 9, did you mean \"train.lr\"?)"));
  EXPECT_THAT(msg, HasSubstr("model.zzz (line 10)\n"));

  // Reading the rest (or claiming a section) makes the check pass.
  c.mark_used("model");
  c.get_double("train.learning_rat", 0);
  c.get_int("train.seedd", 0);
  c.get_int("trian.batch_size", 0);
  EXPECT_NO_THROW(c.check_all_used());
}

TEST(Config, EmptySectionsAndEmptyConfig) {
  Config c = Config::parse("[train]\n[unused]\n", "e.toml");
  c.get_int("train.epochs", 1);
  EXPECT_EQ(c.unused_keys(), (std::vector<std::string>{"unused"}));
  const Config empty;
  EXPECT_EQ(empty.get_int("a.b", 4), 4);
  EXPECT_NO_THROW(empty.check_all_used());
}

TEST(Config, EditDistance) {
  EXPECT_EQ(edit_distance("", ""), 0u);
  EXPECT_EQ(edit_distance("abc", ""), 3u);
  EXPECT_EQ(edit_distance("kitten", "sitting"), 3u);
  EXPECT_EQ(edit_distance("trian", "train"), 2u);
}

}  // namespace
}  // namespace mt
