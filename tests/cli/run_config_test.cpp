// The config -> options mapping: every error names the key and what was
// expected; unknown keys are caught with a suggestion.
#include <gtest/gtest.h>

#include "meshtrain/cli/run_config.h"

namespace mt {
namespace {

std::string error_of(const std::string& toml) {
  try {
    Config c = Config::parse(toml, "test.toml");
    RunConfig rc = read_run_config(c);
    open_dataset(rc.data, rc.model, DataSplit::train);
    build_model(rc.model, rc.train.batch_size);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(RunConfig, ShippedConfigsAreValid) {
  for (const char* name : {"mlp_fashion", "cnn_fashion", "gpt_text"}) {
    Config c = Config::load(std::string(MT_SOURCE_DIR) + "/configs/" + name + ".toml");
    EXPECT_NO_THROW(read_run_config(c)) << name;
  }
}

TEST(RunConfig, UnknownKeyIsNamedWithSuggestion) {
  const std::string e = error_of("[train]\nepochz = 3\n");
  EXPECT_NE(e.find("train.epochz"), std::string::npos) << e;
  EXPECT_NE(e.find("train.epochs"), std::string::npos) << e;
}

TEST(RunConfig, WrongTypeAndRangeAreNamed) {
  std::string e = error_of("[optim]\nlr = \"fast\"\n");
  EXPECT_NE(e.find("optim.lr"), std::string::npos) << e;
  EXPECT_NE(e.find("expected a number"), std::string::npos) << e;
  e = error_of("[train]\nbatch_size = 0\n");
  EXPECT_NE(e.find("train.batch_size"), std::string::npos) << e;
  e = error_of("[optim]\nname = \"adamx\"\n");
  EXPECT_NE(e.find("optim.name"), std::string::npos) << e;
}

TEST(RunConfig, LauncherKeysAreRead) {
  Config c = Config::parse("[dist]\nnproc = 4\nstop_grace_s = 3\n", "test.toml");
  const RunConfig rc = read_run_config(c);
  EXPECT_EQ(rc.nproc, 4);
  EXPECT_EQ(rc.stop_grace_s, 3);
  std::string e = error_of("[dist]\nstop_grace_s = 0\n");
  EXPECT_NE(e.find("dist.stop_grace_s"), std::string::npos) << e;
  e = error_of("[dist]\nnproc = 1025\n");
  EXPECT_NE(e.find("dist.nproc"), std::string::npos) << e;
}

TEST(RunConfig, KernelChoicesMapAndAreChecked) {
  Config c = Config::parse("[exec]\nmatmul = \"onednn\"\nconv_layout = \"plain\"\n", "t.toml");
  RunConfig rc = read_run_config(c);
  EXPECT_EQ(rc.train.exec.fast.f32_matmul, MatmulEngineChoice::onednn);
  EXPECT_EQ(rc.train.exec.fast.conv_layout, ConvLayoutChoice::plain);
  std::string e = error_of("[exec]\nmatmul = \"cublas\"\n");
  EXPECT_NE(e.find("exec.matmul"), std::string::npos) << e;
  EXPECT_NE(e.find("openblas"), std::string::npos) << e;
  e = error_of("[exec]\nconv_layout = \"nhwc\"\n");
  EXPECT_NE(e.find("exec.conv_layout"), std::string::npos) << e;
}

TEST(RunConfig, ModelAndDataMustFit) {
  std::string e = error_of("[model]\nkind = \"mlp\"\n[data]\nkind = \"text\"\n");
  EXPECT_NE(e.find("data.kind"), std::string::npos) << e;
  e = error_of("[model]\nkind = \"gpt\"\nd_model = 10\nheads = 3\n");
  EXPECT_NE(e.find("model.heads"), std::string::npos) << e;
}

TEST(RunConfig, MissingDatasetNamesPathAndPackage) {
  const std::string e = error_of("[data]\ndir = \"/nonexistent/fmnist\"\n");
  EXPECT_NE(e.find("/nonexistent/fmnist"), std::string::npos) << e;
  EXPECT_NE(e.find("dataset-fashion-mnist"), std::string::npos) << e;
}

}  // namespace
}  // namespace mt
