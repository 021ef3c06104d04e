// Resuming is strict and long jobs can stop and continue: a checkpoint that
// does not hold exactly the model's parameters is refused with every
// difference listed (single file and sharded alike); single-file saves
// create their directories as sharded ones do; step-numbered checkpoints keep
// the newest N; train.resume = "auto" finds the newest valid one; a stop
// request finishes the step, writes the checkpoint and resumes.
#include <gtest/gtest.h>

#include <csignal>
#include <filesystem>

#include "common/temp_dir.h"
#include "meshtrain/comm/backends/local/local_world.h"
#include "meshtrain/data/byte_text.h"
#include "meshtrain/data/fashion_mnist.h"
#include "meshtrain/train/checkpoint_match.h"
#include "meshtrain/train/sharded_checkpoint.h"
#include "meshtrain/train/step_checkpoints.h"
#include "meshtrain/train/trainer.h"

namespace mt {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

struct Job {
  ModelSpec spec;
  std::shared_ptr<const Dataset> train, test;
  TrainerOptions opts;
  std::vector<std::string> notices;

  TrainResult go(Communicator* comm = nullptr) {
    opts.on_notice = [this](const std::string& m) { notices.push_back(m); };
    Trainer t(spec, train, test, opts, comm);
    return t.run();
  }
  bool noticed(const std::string& part) const {
    for (const auto& n : notices) {
      if (n.find(part) != std::string::npos) return true;
    }
    return false;
  }
};

Job mlp(std::vector<int64_t> hidden) {
  Job r;
  r.spec.kind = "mlp";
  r.spec.hidden = std::move(hidden);
  FashionMnistOptions d;
  d.flatten = true;
  d.limit = 256;
  r.train = std::make_shared<FashionMnist>(d);
  d.split = DataSplit::test;
  d.limit = 64;
  r.test = std::make_shared<FashionMnist>(d);
  r.opts.batch_size = 32;
  r.opts.max_steps = 3;
  r.opts.progress = false;
  r.opts.eval = false;
  return r;
}

Job gpt(int64_t layers) {
  Job r;
  r.spec.kind = "gpt";
  r.spec.layers = layers;
  r.spec.d_model = 16;
  r.spec.heads = 2;
  r.spec.seq_len = 8;
  ByteTextOptions d;
  d.seq_len = 8;
  d.limit = 64;
  r.train = std::make_shared<ByteText>(d);
  d.split = DataSplit::test;
  d.limit = 8;
  r.test = std::make_shared<ByteText>(d);
  r.opts.batch_size = 8;
  r.opts.max_steps = 2;
  r.opts.progress = false;
  r.opts.eval = false;
  r.opts.optimizer = "adamw";
  return r;
}

std::string resume_error(Job r, const std::string& path) {
  r.opts.resume_path = path;
  try {
    r.go();
  } catch (const CheckpointError& e) {
    return e.what();
  }
  ADD_FAILURE() << "resuming from " << path << " did not fail";
  return "";
}

void expect_has(const std::string& msg, std::initializer_list<std::string> parts) {
  for (const std::string& p : parts) {
    EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in:\n" << msg;
  }
}

// Both checkpoint forms: a single .safetensors file, a sharded directory.
class ResumeMismatch : public ::testing::TestWithParam<const char*> {
 protected:
  std::string path(const TempDir& dir) const { return dir.file(GetParam()); }
};

TEST_P(ResumeMismatch, FewerLayersAreRefusedNamingTheExtraTensors) {
  TempDir dir;
  Job two = mlp({32, 32});
  two.opts.checkpoint_path = path(dir);
  two.go();
  const std::string msg = resume_error(mlp({32}), path(dir));
  expect_has(msg, {path(dir), "does not fit", "model.hidden: checkpoint [32, 32], this run [32]",
                   "in the checkpoint that this model does not have (2): fc2.b f32[32], fc2.w "
                   "f32[32, 32]",
                   "train.init"});
  EXPECT_EQ(msg.find("lacks"), std::string::npos) << msg;
}

TEST_P(ResumeMismatch, OtherWidthsAreRefusedNamingTheShapes) {
  TempDir dir;
  Job a = mlp({32, 32});
  a.opts.checkpoint_path = path(dir);
  a.go();
  const std::string msg = resume_error(mlp({32, 16}), path(dir));
  expect_has(msg, {"model.hidden: checkpoint [32, 32], this run [32, 16]",
                   "another shape or dtype (3): fc2.b: checkpoint f32[32], this run f32[16]",
                   "fc2.w: checkpoint f32[32, 32], this run f32[32, 16]",
                   "head.w: checkpoint f32[32, 10], this run f32[16, 10]"});
}

TEST_P(ResumeMismatch, MoreLayersAreRefusedNamingTheMissingTensors) {
  TempDir dir;
  Job a = mlp({32});
  a.opts.checkpoint_path = path(dir);
  a.go();
  const std::string msg = resume_error(mlp({32, 32}), path(dir));
  expect_has(msg,
             {"model.hidden: checkpoint [32], this run [32, 32]",
              "this model has but the checkpoint lacks (2): fc2.b f32[32], fc2.w f32[32, 32]"});
  EXPECT_EQ(msg.find("head."), std::string::npos) << msg;  // same shape: not a difference
}

TEST_P(ResumeMismatch, LongListsAreCapped) {
  TempDir dir;
  Job two = gpt(2);
  two.opts.checkpoint_path = path(dir);
  two.go();
  const std::string msg = resume_error(gpt(1), path(dir));
  expect_has(msg, {"model.layers: checkpoint 2, this run 1",
                   "in the checkpoint that this model does not have (", ", ... and "});
  EXPECT_NE(msg.find("block1."), std::string::npos) << msg;  // the second layer's tensors
}

TEST_P(ResumeMismatch, TheSameModelResumesAndSaysFromWhichStep) {
  TempDir dir;
  Job a = mlp({32});
  a.opts.checkpoint_path = path(dir);
  a.go();
  Job b = mlp({32});
  b.opts.resume_path = path(dir);
  b.opts.max_steps = 5;
  EXPECT_EQ(b.go().steps, 5);
  EXPECT_TRUE(b.noticed("resumed from step 3 (" + path(dir) + ")"));
}

INSTANTIATE_TEST_SUITE_P(BothForms, ResumeMismatch,
                         ::testing::Values("ckpt.safetensors", "ckpt_dir"));

TEST(ResumeMismatchMessage, NamesAnotherModelKind) {
  TensorSignatures cnn = {{"conv1.w", {DType::f32, Shape({32, 1, 3, 3})}}};
  TensorSignatures mlp = {{"fc1.w", {DType::f32, Shape({784, 32})}}};
  ModelSpec spec;
  spec.hidden = {32};
  try {
    require_same_params("x.safetensors", {{"model", "cnn"}}, model_settings(spec), cnn, mlp);
    FAIL() << "no error";
  } catch (const CheckpointError& e) {
    expect_has(e.what(), {"model.kind: checkpoint cnn, this run mlp", "conv1.w", "fc1.w"});
  }
  // Settings an older checkpoint did not record are not compared.
  EXPECT_NO_THROW(require_same_params("x", {}, model_settings(spec), mlp, mlp));
}

TEST(SingleFileCheckpoint, SaveCreatesMissingDirectoriesAsShardedDoes) {
  TempDir dir;
  for (const std::string p : {"a/b/ckpt.safetensors", "c/d/ckpt_dir"}) {
    Job r = mlp({16});
    r.opts.checkpoint_path = dir.file(p);
    EXPECT_EQ(r.go().checkpoint, dir.file(p));
    EXPECT_TRUE(fs::exists(dir.file(p))) << p;
  }
  // A parent that cannot be a directory is named, before the first step
  // (the save itself names it too: checkpoint_test).
  std::string blocker = dir.write("file", "x");
  Job r = mlp({16});
  r.opts.checkpoint_path = blocker + "/ckpt.safetensors";
  try {
    r.go();
    FAIL() << "no error";
  } catch (const FileError& e) {
    expect_has(e.what(), {"train.checkpoint", blocker, "is not a directory"});
  }
}

TEST(StepCheckpoints, KeepTheNewestNAndResumeAutoFindsTheNewestValid) {
  TempDir dir;
  const std::string root = dir.file("steps");
  Job a = mlp({16});
  a.opts.checkpoint_path = root;
  a.opts.checkpoint_every = 2;
  a.opts.checkpoint_keep = 2;
  a.opts.max_steps = 7;
  EXPECT_EQ(a.go().checkpoint, step_checkpoint_path(root, 7));
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(root)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"step_00000006", "step_00000007"}));

  // The directory of step checkpoints is not itself one: the error says what to do.
  Job root_resume = mlp({16});
  root_resume.opts.resume_path = root;
  try {
    root_resume.go();
    ADD_FAILURE() << "resuming from the root did not fail";
  } catch (const FileError& e) {
    expect_has(e.what(), {root, "a directory of step checkpoints (step_00000006 to step_00000007)",
                          "train.resume = \"auto\""});
  }

  // The newest lost its index (a save cut short): auto skips it, saying why.
  fs::remove(sharded_index_path(step_checkpoint_path(root, 7)));
  Job b = mlp({16});
  b.opts.checkpoint_path = root;
  b.opts.checkpoint_keep = 2;
  b.opts.resume_path = "auto";
  b.opts.max_steps = 8;
  EXPECT_EQ(b.go().steps, 8);
  EXPECT_TRUE(b.noticed("warning: skipping checkpoint " + step_checkpoint_path(root, 7) +
                        ": no index.json -- the save did not complete"));
  EXPECT_TRUE(b.noticed("resumed from step 6 (" + step_checkpoint_path(root, 6) + ")"));
  // Step 8 written and 6 kept (keep = 2); the incomplete 7 was a leftover.
  EXPECT_TRUE(is_sharded_checkpoint(step_checkpoint_path(root, 8)));
  EXPECT_TRUE(is_sharded_checkpoint(step_checkpoint_path(root, 6)));
  EXPECT_FALSE(fs::exists(step_checkpoint_path(root, 7)));
}

TEST(StepCheckpoints, PruneCountsOnlyCompleteOnesAndNeverTheNewSave) {
  TempDir dir;
  const std::string root = dir.file("r");
  const Tensor a = Tensor::full({2}, DType::f32, 1);  // a piece points into it
  for (int s : {1, 2, 3, 5}) {
    const std::vector<ShardPiece> pieces = {full_piece("param/a", a)};
    save_sharded(nullptr, step_checkpoint_path(root, s), pieces, {{"step", std::to_string(s)}});
  }
  fs::create_directories(step_checkpoint_path(root, 4));  // incomplete, older than the new one
  fs::create_directories(step_checkpoint_path(root, 9));  // incomplete, newer: left alone
  const auto removed = prune_step_checkpoints(root, 2, step_checkpoint_path(root, 5));
  EXPECT_EQ(removed.size(), 3u);
  for (int s : {3, 5, 9}) EXPECT_TRUE(fs::exists(step_checkpoint_path(root, s))) << s;
  for (int s : {1, 2, 4}) EXPECT_FALSE(fs::exists(step_checkpoint_path(root, s))) << s;
  EXPECT_EQ(parse_step_name("step_00000012"), 12);
  EXPECT_EQ(parse_step_name("step_"), -1);
  EXPECT_EQ(parse_step_name("step_12x"), -1);
}

TEST(ResumeAuto, StartsFreshWhenThereIsNothingAndNeedsACheckpointPath) {
  TempDir dir;
  Job a = mlp({16});
  a.opts.checkpoint_path = dir.file("none.safetensors");
  a.opts.resume_path = "auto";
  EXPECT_EQ(a.go().steps, 3);
  EXPECT_TRUE(
      a.noticed("no checkpoint under " + dir.file("none.safetensors") + "; starting fresh"));
  // The single file it wrote is found next time.
  Job b = mlp({16});
  b.opts.checkpoint_path = dir.file("none.safetensors");
  b.opts.resume_path = "auto";
  b.opts.max_steps = 4;
  EXPECT_EQ(b.go().steps, 4);
  EXPECT_TRUE(b.noticed("resumed from step 3"));
  // Resuming a run that is already as long as asked says there is nothing to do.
  Job b2 = mlp({16});
  b2.opts.checkpoint_path = dir.file("none.safetensors");
  b2.opts.resume_path = "auto";
  b2.opts.max_steps = 4;
  EXPECT_EQ(b2.go().steps, 4);
  EXPECT_TRUE(b2.noticed("resumed from step 4"));
  EXPECT_TRUE(b2.noticed("the run is 4 steps long (train.epochs, train.steps): nothing is left"));

  Job c = mlp({16});
  c.opts.resume_path = "auto";
  EXPECT_THROW(c.go(), ConfigError);
  Job d = mlp({16});
  d.opts.checkpoint_path = dir.file("x.safetensors");
  d.opts.checkpoint_keep = 2;
  EXPECT_THROW(d.go(), ConfigError);
}

TEST(StopRequest, FinishesTheStepWritesTheCheckpointAndResumesExactly) {
  TempDir dir;
  // Uninterrupted reference.
  Job ref = mlp({16});
  ref.opts.max_steps = 6;
  const TrainResult full = ref.go();

  std::atomic<int> flag{0};
  Job a = mlp({16});
  a.opts.max_steps = 6;
  a.opts.checkpoint_path = dir.file("ckpt.safetensors");
  a.opts.stop_signal = &flag;
  // The request arrives after step 2: step 3 is finished, then the run stops.
  a.opts.dist.after_step = [&](int64_t step, int) {
    if (step == 2) flag = SIGTERM;
  };
  const TrainResult r = a.go();
  EXPECT_EQ(r.stop_signal, SIGTERM);
  EXPECT_EQ(r.steps, 3);
  EXPECT_EQ(r.checkpoint, dir.file("ckpt.safetensors"));

  Job b = mlp({16});
  b.opts.max_steps = 6;
  b.opts.resume_path = dir.file("ckpt.safetensors");
  const TrainResult rest = b.go();
  EXPECT_EQ(rest.stop_signal, 0);
  ASSERT_EQ(rest.losses.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(rest.losses[i], full.losses[3 + i]) << i;
}

TEST(StopRequest, WithoutACheckpointPathStopsAfterTheFirstStep) {
  std::atomic<int> flag{SIGINT};  // arrived before the run started
  Job a = mlp({16});
  a.opts.stop_signal = &flag;
  const TrainResult r = a.go();
  EXPECT_EQ(r.steps, 1);
  EXPECT_EQ(r.stop_signal, SIGINT);
  EXPECT_EQ(r.checkpoint, "");
}

TEST(StopRequest, RanksAgreeToStopAtTheSameStep) {
  TempDir dir;
  std::atomic<int> flags[2] = {0, 0};
  std::vector<TrainResult> results(2);
  LocalWorld::run(2, [&](Communicator& c) {
    Job a = mlp({16});
    a.opts.max_steps = 6;
    a.opts.checkpoint_path = dir.file("ckpt_dir");
    a.opts.stop_signal = &flags[c.rank()];
    // Only rank 1 is signalled.
    a.opts.dist.after_step = [&](int64_t step, int rank) {
      if (step == 1 && rank == 1) flags[1] = SIGINT;
    };
    results[static_cast<size_t>(c.rank())] = a.go(&c);
  });
  for (const TrainResult& r : results) {
    EXPECT_EQ(r.steps, 2);
    EXPECT_EQ(r.stop_signal, SIGINT);
  }
  EXPECT_EQ(read_index(dir.file("ckpt_dir")).metadata.at("step"), "2");
}

}  // namespace
}  // namespace mt
