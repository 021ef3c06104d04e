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

TEST(RunConfig, PrecisionAutoAndOpenBlasCoretypeAreReadAndChecked) {
  RunConfig rc = read_run_config(Config::parse("[train]\nprecision = \"auto\"\n", "t.toml"));
  EXPECT_TRUE(rc.train.precision_auto);
  EXPECT_EQ(rc.train.precision, DType::f32);  // planned as f32 until the trainer decides
  EXPECT_EQ(rc.openblas_coretype, "auto");
  rc = read_run_config(Config::parse(
      "[train]\nprecision = \"bf16\"\n[exec]\nopenblas_coretype = \"keep\"\n", "t.toml"));
  EXPECT_FALSE(rc.train.precision_auto);
  EXPECT_EQ(rc.train.precision, DType::bf16);
  EXPECT_EQ(rc.openblas_coretype, "keep");
  rc = read_run_config(Config::parse("[train]\nprecision = \"bf16_storage\"\n", "t.toml"));
  EXPECT_TRUE(rc.train.bf16_storage);
  EXPECT_FALSE(rc.train.precision_auto);
  EXPECT_EQ(rc.train.precision, DType::f32);  // f32 compute
  std::string e = error_of("[exec]\nopenblas_coretype = \"SkylakeX\"\n");
  EXPECT_NE(e.find("exec.openblas_coretype"), std::string::npos) << e;
  EXPECT_NE(e.find("best"), std::string::npos) << e;
  e = error_of("[train]\nprecision = \"fastest\"\n");
  EXPECT_NE(e.find("train.precision"), std::string::npos) << e;
  EXPECT_NE(e.find("auto"), std::string::npos) << e;
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

// Data order, normalisation and bounded evaluation map onto the options;
// settings that cannot work are errors naming the keys, before any data is read.
TEST(RunConfig, DataAndEvaluationSettings) {
  Config c = Config::parse(
      "[data]\nshuffle = false\nnormalize = \"mean_std\"\nmean = 0.5\nstd = 0.25\n"
      "[train]\neval_batches = 3\n",
      "t.toml");
  RunConfig rc = read_run_config(c);
  EXPECT_FALSE(rc.train.shuffle);
  EXPECT_EQ(rc.train.eval_batches, 3);
  EXPECT_TRUE(rc.data.normalize);
  EXPECT_EQ(rc.data.mean, 0.5);
  EXPECT_EQ(rc.data.std, 0.25);
  rc = read_run_config(Config::parse("[data]\nnormalize = \"none\"\n", "t.toml"));
  EXPECT_FALSE(rc.data.normalize);
  EXPECT_TRUE(rc.train.shuffle);

  std::string e = error_of("[data]\nlimit_test = 0\n");
  EXPECT_NE(e.find("data.limit_test = 0"), std::string::npos) << e;
  EXPECT_NE(e.find("train.eval"), std::string::npos) << e;
  EXPECT_EQ(error_of("[data]\nlimit_test = 0\n[train]\neval = false\n"), "");
  e = error_of("[model]\nkind = \"gpt\"\n[data]\ntest_fraction = 0\n");
  EXPECT_NE(e.find("data.test_fraction = 0 leaves no test split, but train.eval is on"),
            std::string::npos)
      << e;
  e = error_of("[train]\neval_batches = -1\n");
  EXPECT_NE(e.find("train.eval_batches"), std::string::npos) << e;
  e = error_of("[data]\nstd = 0\n");
  EXPECT_NE(e.find("data.std"), std::string::npos) << e;
  e = error_of("[data]\nnormalize = \"none\"\nmean = 0.1\n");
  EXPECT_NE(e.find("data.mean / data.std are set but data.normalize is \"none\""),
            std::string::npos)
      << e;
  // Like every model's and optimizer's keys, the image keys are validated
  // whatever data.kind says, so switching to text with --set keeps a config
  // valid; text ignores them.
  EXPECT_EQ(error_of("[model]\nkind = \"gpt\"\n[data]\nnormalize = \"none\"\n"), "");
}

}  // namespace
}  // namespace mt
