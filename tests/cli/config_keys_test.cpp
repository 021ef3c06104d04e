// The key catalogue behind `meshtrain config --list`, `--print-config` and
// README.md's key list: every key read_run_config() reads has a meaning,
// every meaning names a key that is read, the getters record type, default
// and allowed values, and the effective config loads back to the same run.
#include <algorithm>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "meshtrain/cli/commands.h"
#include "meshtrain/cli/config_keys.h"
#include "meshtrain/cli/run_config.h"

namespace mt {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

const KeyInfo* find_key(const std::vector<KeyInfo>& keys, const std::string& k) {
  auto it = std::find_if(keys.begin(), keys.end(), [&](const KeyInfo& i) { return i.key == k; });
  return it == keys.end() ? nullptr : &*it;
}

TEST(ConfigKeys, EveryKeyReadHasAMeaning) {
  const std::vector<KeyInfo> keys = known_keys();
  ASSERT_GT(keys.size(), 40u);
  for (const KeyInfo& k : keys) {
    EXPECT_FALSE(key_meaning(k.key).empty())
        << k.key << " is read by read_run_config but has no meaning in config_keys.cpp";
  }
}

TEST(ConfigKeys, EveryMeaningNamesAKeyThatIsRead) {
  const std::vector<KeyInfo> keys = known_keys();
  std::set<std::string_view> seen;
  for (const KeyMeaning& m : key_meanings()) {
    EXPECT_NE(find_key(keys, std::string(m.key)), nullptr)
        << m.key << " has a meaning in config_keys.cpp but read_run_config never reads it";
    EXPECT_TRUE(seen.insert(m.key).second) << m.key << " appears twice in the table";
  }
}

TEST(ConfigKeys, ConditionallyUsedKeysAreListed) {
  // data.path matters only for text, data.dir only for fashion_mnist, the
  // Adam betas only for adamw/lamb: all are listed from the empty config.
  const std::vector<KeyInfo> keys = known_keys();
  for (const char* k : {"data.dir", "data.path", "data.test_fraction", "optim.beta1", "optim.beta2",
                        "optim.trust_coefficient", "model.seq_len"}) {
    EXPECT_NE(find_key(keys, k), nullptr) << k;
  }
  EXPECT_EQ(find_key(keys, "optim.betas"), nullptr);
}

TEST(ConfigKeys, GettersRecordTypeDefaultAndAllowedValues) {
  Config c = Config::parse("[a]\nx = 3\n", "t.toml");
  c.get_int("a.x", 7, Bounds<int64_t>::in(1, 8));
  c.get_double("a.lr", 0.5, Bounds<double>::positive());
  c.get_double("a.one", 1.0);
  c.get_string("a.opt", "sgd", {"sgd", "adamw"});
  c.get_bool("a.flag", true);
  c.get_int_list("a.list", {2, 1});
  c.get_string("a.path", "");
  c.require_int("a.x");  // asked again: the first description stays
  EXPECT_THROW(c.require_string("a.needed"), ConfigError);
  const std::vector<KeyInfo>& k = c.catalogue();
  ASSERT_EQ(k.size(), 8u);
  EXPECT_EQ(k[0].key, "a.x");
  EXPECT_EQ(k[0].type, "integer");
  EXPECT_EQ(k[0].def, "7");
  EXPECT_EQ(k[0].allowed, "in [1, 8]");
  EXPECT_FALSE(k[0].required);
  EXPECT_EQ(k[1].type, "number");
  EXPECT_EQ(k[1].def, "0.5");
  EXPECT_EQ(k[1].allowed, "> 0");
  EXPECT_EQ(k[2].def, "1.0");  // stays a TOML float
  EXPECT_EQ(k[2].allowed, "");
  EXPECT_EQ(k[3].def, "\"sgd\"");
  EXPECT_EQ(k[3].allowed, "sgd | adamw");
  EXPECT_EQ(k[4].type, "boolean");
  EXPECT_EQ(k[4].def, "true");
  EXPECT_EQ(k[5].type, "list of integers");
  EXPECT_EQ(k[5].def, "[2, 1]");
  EXPECT_EQ(k[6].def, "\"\"");
  EXPECT_EQ(k[7].key, "a.needed");
  EXPECT_TRUE(k[7].required);
}

TEST(ConfigKeys, ListShowsEveryKeyWithItsDefault) {
  const std::string list = format_key_list();
  for (const KeyInfo& k : known_keys()) EXPECT_THAT(list, HasSubstr(k.key + " "));
  EXPECT_THAT(list, HasSubstr("optim.beta2"));
  EXPECT_THAT(list, HasSubstr("0.999"));
  EXPECT_THAT(list, HasSubstr("sgd | adamw | lars | lamb"));
  EXPECT_THAT(list, Not(HasSubstr("(no description)")));
}

TEST(ConfigKeys, EffectiveConfigLoadsBackToTheSameRun) {
  Config c = Config::load(std::string(MT_SOURCE_DIR) + "/configs/mlp_fashion.toml");
  c.set_all({"optim.name=adamw", "train.steps=7"});
  const RunConfig rc = read_run_config(c);
  const std::string text = format_effective_config(c);
  EXPECT_THAT(text, HasSubstr("[optim]\nname = \"adamw\"\n"));
  EXPECT_THAT(text, HasSubstr("steps = 7\n"));
  EXPECT_THAT(text, HasSubstr("weight_decay = 0.0005\n"));
  // Defaults that depend on other keys are the effective ones, marked.
  EXPECT_THAT(text, HasSubstr("beta1 = 0.9  # default\n"));
  EXPECT_THAT(text, HasSubstr("eps = 1e-08  # default\n"));

  Config back = Config::parse(text, "effective.toml");
  const RunConfig rb = read_run_config(back);  // no unknown keys either
  EXPECT_EQ(rb.model.hidden, rc.model.hidden);
  EXPECT_EQ(rb.train.max_steps, 7);
  EXPECT_EQ(rb.train.optimizer, "adamw");
  EXPECT_DOUBLE_EQ(rb.train.optim.adamw.weight_decay, rc.train.optim.adamw.weight_decay);
  EXPECT_DOUBLE_EQ(rb.train.schedule.lr, rc.train.schedule.lr);
  EXPECT_EQ(rb.data.dir, rc.data.dir);
  EXPECT_EQ(rb.train.epochs, rc.train.epochs);
  EXPECT_EQ(rb.train.dist.dp.bucket_bytes, rc.train.dist.dp.bucket_bytes);
}

TEST(ConfigKeys, ReadmeKeyTableMatchesTheCode) {
  std::ifstream in(std::string(MT_SOURCE_DIR) + "/README.md");
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string readme = ss.str();
  const std::string begin =
      "<!-- config keys: generated by `meshtrain config --list --markdown` -->\n";
  const std::string end = "<!-- end of config keys -->";
  const size_t b = readme.find(begin), e = readme.find(end);
  ASSERT_NE(b, std::string::npos) << "README.md lacks the marker line " << begin;
  ASSERT_NE(e, std::string::npos) << "README.md lacks the marker " << end;
  EXPECT_EQ(readme.substr(b + begin.size(), e - b - begin.size()), format_key_markdown())
      << "README.md's key table is stale: replace it with the output of "
         "`build/meshtrain config --list --markdown`";
}

TEST(ConfigKeys, EmptySourceIsRecognised) {
  EXPECT_TRUE(Config::parse("", "e.toml").source_empty());
  EXPECT_TRUE(Config::parse("# nothing here\n\n[train]\n", "e.toml").source_empty());
  EXPECT_FALSE(Config::parse("[train]\nsteps = 1\n", "e.toml").source_empty());
  Config c = Config::parse("", "e.toml");
  c.set("train.steps=3");
  EXPECT_TRUE(c.source_empty());  // --set does not fill the file
}

TEST(ConfigKeys, UnknownCommandIsNamed) {
  const std::vector<std::string> cmds = {"train", "inspect", "config"};
  auto m = unknown_command_message("trian", cmds);
  ASSERT_TRUE(m.has_value());
  EXPECT_THAT(*m, HasSubstr("unknown command 'trian'"));
  EXPECT_THAT(*m, HasSubstr("did you mean 'train'?"));
  EXPECT_THAT(*m, HasSubstr("train, inspect, config"));
  m = unknown_command_message("frobnicate", cmds);
  ASSERT_TRUE(m.has_value());
  EXPECT_THAT(*m, Not(HasSubstr("did you mean")));
  EXPECT_FALSE(unknown_command_message("inspect", cmds).has_value());
  EXPECT_FALSE(unknown_command_message("--help", cmds).has_value());
}

}  // namespace
}  // namespace mt
