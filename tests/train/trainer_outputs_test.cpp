// What a run writes and reports: every output path and data / evaluation
// setting is checked before the first step (on every rank that writes it,
// and every rank stops when one cannot), values a run did not measure are
// absent instead of 0, evaluation can be bounded to the first batches, and
// the training order can be file order.
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <mutex>
#include <numeric>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/temp_dir.h"
#include "meshtrain/base/output_path.h"
#include "meshtrain/comm/backends/local/local_world.h"
#include "meshtrain/data/fashion_mnist.h"
#include "meshtrain/train/param_store.h"
#include "meshtrain/train/trainer.h"

namespace mt {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

struct Fixture {
  ModelSpec spec;
  std::shared_ptr<const Dataset> train, test;
  TrainerOptions opts;
};

std::shared_ptr<const Dataset> fashion(DataSplit split, int64_t limit) {
  FashionMnistOptions d;
  d.flatten = true;
  d.split = split;
  d.limit = limit;
  return std::make_shared<FashionMnist>(d);
}

// 512 training examples in batches of 64: 8 steps per epoch.
Fixture small_mlp() {
  Fixture f;
  f.spec.kind = "mlp";
  f.spec.hidden = {32};
  f.train = fashion(DataSplit::train, 512);
  f.test = fashion(DataSplit::test, 300);
  f.opts.batch_size = 64;
  f.opts.eval_batch_size = 100;
  f.opts.progress = false;
  f.opts.eval = false;
  f.opts.schedule.lr = 0.05;
  return f;
}

LocalWorldOptions world(int size) {
  LocalWorldOptions o;
  o.size = size;
  o.comm.timeout = std::chrono::milliseconds(20'000);
  return o;
}

std::vector<nlohmann::json> read_lines(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Runs fn, expects an exception of type E, returns its message.
template <class E, class Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "no exception of the expected type";
  return "";
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

TEST(OutputPath, ProbesWithoutCreatingAnything) {
  TempDir d;
  const std::string file = d.write("f", "x");
  // Missing parents that can be created pass, and probing creates nothing.
  const std::string deep = d.file("new/sub/x.jsonl");
  check_output_path(deep, OutputKind::file, "--metrics");
  check_output_path(d.file("new/ck"), OutputKind::directory, "train.checkpoint");
  EXPECT_FALSE(fs::exists(d.file("new")));
  EXPECT_EQ(std::distance(fs::directory_iterator(d.str()), fs::directory_iterator()), 1);
  check_output_path(file, OutputKind::file, "--metrics");  // an existing writable file
  check_output_path(file, OutputKind::replaced_file, "train.checkpoint");
  check_output_path("", OutputKind::file, "--metrics");  // nothing to write

  std::string m =
      error_of<FileError>([&] { check_output_path(d.str(), OutputKind::file, "--metrics"); });
  EXPECT_TRUE(contains(m, "--metrics " + d.str()) && contains(m, "is a directory")) << m;
  m = error_of<FileError>([&] {
    check_output_path(file + "/sub/ck.safetensors", OutputKind::replaced_file, "train.checkpoint");
  });
  EXPECT_TRUE(contains(m, "train.checkpoint " + file + "/sub/ck.safetensors") &&
              contains(m, file + " is not a directory"))
      << m;
  m = error_of<FileError>(
      [&] { check_output_path(file, OutputKind::directory, "train.checkpoint"); });
  EXPECT_TRUE(contains(m, "exists and is not a directory")) << m;

  // Permissions (root may write anywhere, so only checked for other users).
  if (::geteuid() != 0) {
    const std::string ro = d.file("ro");
    fs::create_directory(ro);
    ::chmod(ro.c_str(), 0555);
    m = error_of<FileError>(
        [&] { check_output_path(ro + "/a/b.json", OutputKind::file, "dist.trace"); });
    EXPECT_TRUE(contains(m, "directory " + ro + " is not writable")) << m;
    ::chmod(ro.c_str(), 0755);
  }

  create_output_parents(deep, "--metrics");
  EXPECT_TRUE(fs::is_directory(d.file("new/sub")));
  EXPECT_FALSE(fs::exists(deep));
}

// Each bad output path stops the trainer's construction, before any step,
// with an error naming the setting and the path.
TEST(TrainerOutputs, BadOutputPathsFailBeforeTheFirstStep) {
  TempDir d;
  const std::string file = d.write("f", "x");
  struct Case {
    std::string key;
    std::function<void(TrainerOptions&)> set;
    std::string path;
  };
  const std::vector<Case> cases = {
      {"--metrics", [&](TrainerOptions& o) { o.metrics_path = file + "/m.jsonl"; },
       file + "/m.jsonl"},
      {"dist.trace (--trace)", [&](TrainerOptions& o) { o.dist.trace_path = d.str(); }, d.str()},
      {"train.checkpoint",
       [&](TrainerOptions& o) { o.checkpoint_path = file + "/c/ck.safetensors"; },
       file + "/c/ck.safetensors"},
      {"train.checkpoint", [&](TrainerOptions& o) { o.checkpoint_path = file; },
       file},  // a directory
  };
  for (const Case& c : cases) {
    Fixture f = small_mlp();
    f.opts.max_steps = 2;
    int steps = 0;
    f.opts.dist.after_step = [&](int64_t, int) { ++steps; };
    c.set(f.opts);
    const std::string m =
        error_of<FileError>([&] { Trainer(f.spec, f.train, f.test, f.opts).run(); });
    EXPECT_TRUE(contains(m, c.key + " " + c.path)) << m;
    EXPECT_EQ(steps, 0) << m;
  }
}

TEST(TrainerOutputs, MissingParentDirectoriesOfOutputsAreCreated) {
  TempDir d;
  Fixture f = small_mlp();
  f.opts.max_steps = 2;
  f.opts.metrics_path = d.file("m/run.jsonl");
  f.opts.dist.trace_path = d.file("t/trace.json");
  f.opts.checkpoint_path = d.file("c/d/ck.safetensors");
  Trainer(f.spec, f.train, f.test, f.opts).run();
  EXPECT_TRUE(fs::is_regular_file(f.opts.metrics_path));
  EXPECT_TRUE(fs::is_regular_file(f.opts.dist.trace_path));
  EXPECT_TRUE(fs::is_regular_file(f.opts.checkpoint_path));
}

// Rank 0 alone writes the metrics; when it cannot, rank 1 stops too, with
// the same error, instead of waiting in the first collective. A sharded
// checkpoint is written by every rank and checked on every rank.
TEST(TrainerOutputs, EveryRankStopsWhenOneCannotWrite) {
  TempDir d;
  const std::string file = d.write("f", "x");
  for (const bool metrics : {true, false}) {
    Fixture f = small_mlp();
    f.opts.max_steps = 2;
    f.opts.dist.dp.collective.timeout = std::chrono::milliseconds(20'000);
    if (metrics) {
      f.opts.metrics_path = file + "/m.jsonl";
    } else {
      f.opts.checkpoint_path = file;  // a sharded checkpoint directory at 2 ranks
    }
    const auto errors = LocalWorld::run_collect(world(2), [&](Communicator& comm) {
      Trainer(f.spec, f.train, f.test, f.opts, &comm).run();
    });
    ASSERT_EQ(errors.size(), 2u);
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(errors[static_cast<size_t>(r)]) << "rank " << r << " did not fail";
      const std::string m =
          error_of<FileError>([&] { std::rethrow_exception(errors[static_cast<size_t>(r)]); });
      EXPECT_TRUE(contains(m, metrics ? "--metrics" : "train.checkpoint"))
          << "rank " << r << ": " << m;
    }
  }
}

TEST(TrainerOutputs, EvaluationWithoutTestExamplesIsAConfigError) {
  Fixture f = small_mlp();
  f.test = fashion(DataSplit::test, 0);
  f.opts.eval = true;
  const std::string m = error_of<ConfigError>([&] { Trainer(f.spec, f.train, f.test, f.opts); });
  EXPECT_TRUE(contains(m, "train.eval") && contains(m, "data.limit_test")) << m;
  f.opts.eval = false;  // nothing to evaluate is fine when nothing is evaluated
  f.opts.max_steps = 1;
  EXPECT_EQ(Trainer(f.spec, f.train, f.test, f.opts).run().steps, 1);
  Trainer no_test(f.spec, f.train, nullptr, f.opts);  // nor is no test split at all
  EXPECT_EQ(no_test.run().steps, 1);
  const std::string m2 = error_of<ConfigError>([&] { no_test.evaluate(); });
  EXPECT_TRUE(contains(m2, "no test split")) << m2;
}

TEST(TrainerOutputs, BatchLargerThanTheTrainingSplitNamesTheKeys) {
  Fixture f = small_mlp();
  f.opts.batch_size = 1024;
  const std::string m = error_of<ConfigError>([&] { Trainer(f.spec, f.train, f.test, f.opts); });
  EXPECT_TRUE(contains(m, "train.batch_size") && contains(m, "data.limit_train")) << m;
}

// At 2 ranks an evaluation batch of 1 leaves a rank nothing: caught when the
// trainer is built, not after the first epoch.
TEST(TrainerOutputs, EvalBatchTooSmallForTheRanksFailsAtConstruction) {
  Fixture f = small_mlp();
  f.opts.eval = true;
  f.opts.eval_batch_size = 1;
  f.opts.dist.dp.collective.timeout = std::chrono::milliseconds(20'000);
  const auto errors = LocalWorld::run_collect(
      world(2), [&](Communicator& comm) { Trainer(f.spec, f.train, f.test, f.opts, &comm); });
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(errors[static_cast<size_t>(r)]) << "rank " << r;
    const std::string m =
        error_of<ConfigError>([&] { std::rethrow_exception(errors[static_cast<size_t>(r)]); });
    EXPECT_TRUE(contains(m, "train.eval_batch_size 1")) << m;
  }
}

// train.eval_batches = K evaluates the first K batches of the test split in
// file order: the same numbers as a test split cut to those examples.
TEST(TrainerOutputs, EvalBatchesCoverTheFirstBatchesOnly) {
  Fixture f = small_mlp();
  f.opts.eval = true;
  f.opts.max_steps = 3;
  f.opts.eval_batches = 2;  // of 3 batches of 100
  Trainer limited(f.spec, f.train, f.test, f.opts);
  const TrainResult a = limited.run();
  ASSERT_TRUE(a.test_loss && a.test_accuracy);
  EXPECT_EQ(a.test_examples, 200);
  EXPECT_EQ(limited.evaluate(), std::make_pair(*a.test_loss, *a.test_accuracy));  // repeatable

  Fixture g = small_mlp();
  g.test = fashion(DataSplit::test, 200);
  g.opts = f.opts;
  g.opts.eval_batches = 0;
  const TrainResult b = Trainer(g.spec, g.train, g.test, g.opts).run();
  EXPECT_EQ(b.test_examples, 200);
  EXPECT_EQ(*a.test_loss, *b.test_loss);
  EXPECT_EQ(*a.test_accuracy, *b.test_accuracy);

  f.opts.eval_batches = 10;  // more than there are: the whole split
  EXPECT_EQ(Trainer(f.spec, f.train, f.test, f.opts).run().test_examples, 300);
}

// On 3 ranks each of the first K batches is split over the ranks: the same
// examples, and so the same loss and accuracy, as one process.
TEST(TrainerOutputs, EvalBatchesAreTheSameExamplesOnEveryWorldSize) {
  Fixture f = small_mlp();
  f.opts.eval = true;
  f.opts.max_steps = 2;
  f.opts.eval_batches = 2;
  f.opts.batch_size = 63;  // divisible by 3 ranks
  const TrainResult one = Trainer(f.spec, f.train, f.test, f.opts).run();
  ASSERT_TRUE(one.test_loss && one.test_accuracy);
  std::vector<TrainResult> results(3);
  LocalWorld::run(world(3), [&](Communicator& comm) {
    results[static_cast<size_t>(comm.rank())] =
        Trainer(f.spec, f.train, f.test, f.opts, &comm).run();
  });
  for (const TrainResult& r : results) {
    ASSERT_TRUE(r.test_loss && r.test_accuracy);
    EXPECT_EQ(r.test_examples, 200);
    EXPECT_NEAR(*r.test_loss, *one.test_loss, 1e-5 * *one.test_loss);
    // Parameters agree to float rounding: at most a near-tie may flip.
    EXPECT_NEAR(*r.test_accuracy, *one.test_accuracy, 1.0 / 200 + 1e-12);
  }
}

// Stopped by halt_after before any evaluation: no test results, not 0; a
// run of 5 steps or fewer reports its rate from all steps, flagged.
TEST(TrainerOutputs, HaltBeforeEvaluationLeavesTestResultsAbsent) {
  TempDir d;
  Fixture f = small_mlp();
  f.opts.eval = true;
  f.opts.halt_after = 3;
  f.opts.metrics_path = d.file("m.jsonl");
  const TrainResult r = Trainer(f.spec, f.train, f.test, f.opts).run();
  EXPECT_EQ(r.steps, 3);
  EXPECT_FALSE(r.test_loss.has_value());
  EXPECT_FALSE(r.test_accuracy.has_value());
  ASSERT_TRUE(r.final_loss.has_value());
  EXPECT_EQ(*r.final_loss, r.losses.back());
  ASSERT_TRUE(r.samples_per_s.has_value());
  EXPECT_GT(*r.samples_per_s, 0);
  EXPECT_TRUE(r.samples_per_s_includes_warmup);
  const nlohmann::json summary = read_lines(f.opts.metrics_path).back();
  ASSERT_TRUE(summary.value("summary", false)) << summary.dump();
  EXPECT_TRUE(summary["test_accuracy"].is_null()) << summary.dump();
  EXPECT_TRUE(summary["test_loss"].is_null()) << summary.dump();
  EXPECT_EQ(summary["samples_per_s_includes_warmup"], true) << summary.dump();
}

TEST(TrainerOutputs, RunsLongerThanTheWarmupLeaveItOut) {
  Fixture f = small_mlp();
  f.opts.max_steps = 8;
  const TrainResult r = Trainer(f.spec, f.train, f.test, f.opts).run();
  ASSERT_TRUE(r.samples_per_s.has_value());
  EXPECT_FALSE(r.samples_per_s_includes_warmup);
}

// Resuming a run that has already finished runs no step: no loss, no rate.
TEST(TrainerOutputs, ResumingAFinishedRunMeasuresNothing) {
  TempDir d;
  Fixture f = small_mlp();
  f.opts.max_steps = 3;
  f.opts.checkpoint_path = d.file("ck.safetensors");
  Trainer(f.spec, f.train, f.test, f.opts).run();
  TrainerOptions again = f.opts;
  again.resume_path = f.opts.checkpoint_path;
  again.checkpoint_path.clear();
  again.metrics_path = d.file("m.jsonl");
  const TrainResult r = Trainer(f.spec, f.train, f.test, again).run();
  EXPECT_EQ(r.steps, 3);
  EXPECT_EQ(r.steps_run, 0);
  EXPECT_FALSE(r.final_loss.has_value());
  EXPECT_FALSE(r.samples_per_s.has_value());
  EXPECT_FALSE(r.matmul_gflops.has_value());
  const nlohmann::json summary = read_lines(again.metrics_path).back();
  EXPECT_TRUE(summary["final_loss"].is_null()) << summary.dump();
  EXPECT_TRUE(summary["samples_per_s"].is_null()) << summary.dump();
  EXPECT_EQ(summary["steps_run"], 0) << summary.dump();
}

// Evaluation lines carry `epoch` as a float (steps / steps per epoch) both
// at an epoch's end and for a final partial epoch, plus the step.
TEST(TrainerOutputs, EvaluationLinesHaveAFloatEpoch) {
  TempDir d;
  Fixture f = small_mlp();
  f.opts.eval = true;
  f.opts.epochs = 2;
  f.opts.max_steps = 12;  // one epoch of 8 steps and half of the next
  f.opts.metrics_path = d.file("m.jsonl");
  Trainer(f.spec, f.train, f.test, f.opts).run();
  std::vector<std::pair<int64_t, double>> evals;
  for (const nlohmann::json& l : read_lines(f.opts.metrics_path)) {
    if (!l.contains("test_loss") || l.contains("summary")) continue;
    ASSERT_TRUE(l["epoch"].is_number_float()) << l.dump();
    evals.emplace_back(l["step"].get<int64_t>(), l["epoch"].get<double>());
    EXPECT_EQ(l["test_examples"], 300) << l.dump();
  }
  const std::vector<std::pair<int64_t, double>> want = {{8, 1.0}, {12, 1.5}};
  EXPECT_EQ(evals, want);
  EXPECT_TRUE(contains(slurp(f.opts.metrics_path), "\"epoch\":1.0")) << "1.0, not 1";
}

// Records which examples were asked for, to see the order training reads.
class RecordingDataset : public Dataset {
 public:
  explicit RecordingDataset(std::shared_ptr<const Dataset> inner) : inner_(std::move(inner)) {}
  int64_t size() const override { return inner_->size(); }
  Batch gather(std::span<const int64_t> indices) const override {
    std::lock_guard lock(mu_);
    calls_.emplace_back(indices.begin(), indices.end());
    return inner_->gather(indices);
  }
  std::string describe() const override { return "recorded " + inner_->describe(); }
  std::vector<std::vector<int64_t>> calls() const {
    std::lock_guard lock(mu_);
    return calls_;
  }

 private:
  std::shared_ptr<const Dataset> inner_;
  mutable std::mutex mu_;
  mutable std::vector<std::vector<int64_t>> calls_;
};

TEST(TrainerOutputs, ShuffleOffTrainsInFileOrder) {
  for (const bool shuffle : {false, true}) {
    Fixture f = small_mlp();
    auto rec = std::make_shared<RecordingDataset>(f.train);
    f.train = rec;
    f.opts.shuffle = shuffle;
    f.opts.max_steps = 3;
    Trainer(f.spec, f.train, f.test, f.opts).run();
    const auto calls = rec->calls();
    ASSERT_EQ(calls.size(), 3u);
    for (size_t s = 0; s < calls.size(); ++s) {
      std::vector<int64_t> file_order(64);
      std::iota(file_order.begin(), file_order.end(), static_cast<int64_t>(s) * 64);
      if (shuffle) {
        EXPECT_NE(calls[s], file_order) << "step " << s;
      } else {
        EXPECT_EQ(calls[s], file_order) << "step " << s;
      }
    }
  }
}

// The replica consistency check cannot apply under ZeRO-3 (no two ranks hold
// the same parameter values): the run says so once, on rank 0, instead of
// leaving the check off silently; under stages 0-2 it checks and says
// nothing, and with dist.consistency_every = 0 the user turned it off.
TEST(TrainerOutputs, ConsistencyCheckSaysWhenZero3MakesItInapplicable) {
  struct Case {
    int stage;
    int64_t every;
    bool notice;
  };
  for (const Case c : {Case{3, 2, true}, Case{2, 2, false}, Case{0, 2, false}, Case{3, 0, false}}) {
    Fixture f = small_mlp();
    f.opts.max_steps = 2;
    f.opts.exec.backend = "reference";
    f.opts.dist.dp.stage = c.stage;
    f.opts.dist.consistency_every = c.every;
    std::mutex mu;
    std::vector<std::pair<int, std::string>> notices;
    LocalWorld::run(world(2), [&](Communicator& comm) {
      TrainerOptions o = f.opts;
      o.on_notice = [&, rank = comm.rank()](const std::string& m) {
        std::lock_guard<std::mutex> lock(mu);
        notices.emplace_back(rank, m);
      };
      Trainer(f.spec, f.train, f.test, o, &comm).run();
    });
    const std::string what = fmt::format("stage {}, consistency_every {}", c.stage, c.every);
    if (!c.notice) {
      EXPECT_TRUE(notices.empty()) << what << ": " << notices.front().second;
      continue;
    }
    ASSERT_EQ(notices.size(), 1u) << what;
    EXPECT_EQ(notices[0].first, 0) << what;
    EXPECT_EQ(notices[0].second,
              "dist.consistency_every = 2: replica checksums are not compared under ZeRO-3 "
              "(dist.zero_stage = 3): each rank holds a different shard of the parameters, so "
              "there are no replicas to compare")
        << what;
  }
}

// ... and under stage 0 the check does run inside training: one float
// changed on rank 1 after step 1 stops both ranks at the next check (step 2)
// with the error naming the tensor.
TEST(TrainerOutputs, ConsistencyCheckCatchesADivergedReplicaInTraining) {
  Fixture f = small_mlp();
  f.opts.max_steps = 4;
  f.opts.exec.backend = "reference";
  f.opts.dist.consistency_every = 2;
  const auto errors = LocalWorld::run_collect(world(2), [&](Communicator& comm) {
    TrainerOptions o = f.opts;
    Trainer* self = nullptr;
    o.dist.after_step = [&](int64_t step, int rank) {
      if (step == 1 && rank == 1) self->params().flat_values().data<float>()[3] += 1e-3f;
    };
    Trainer t(f.spec, f.train, f.test, o, &comm);
    self = &t;
    t.run();
  });
  ASSERT_EQ(errors.size(), 2u);
  for (const std::exception_ptr& e : errors) {
    ASSERT_TRUE(e) << "a rank finished although the replicas differ";
    try {
      std::rethrow_exception(e);
    } catch (const MismatchError& m) {
      EXPECT_NE(std::string(m.what()).find("parameter divergence at step 2: 'fc1.w'"),
                std::string::npos)
          << m.what();
    }
  }
}

}  // namespace
}  // namespace mt
