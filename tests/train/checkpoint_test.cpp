// Checkpoints: checksums catch tampered data, shapes and metadata; truncated
// files and model mismatches are named; saving is atomic (a failed save,
// forced with a file-size limit or a throwing producer, leaves the previous
// checkpoint intact and no temporary behind); a training state round-trips.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "meshtrain/train/checkpoint.h"
#include "meshtrain/train/train_state.h"

#include "common/temp_dir.h"

namespace mt {
namespace {

namespace fs = std::filesystem;

class Checkpoint : public ::testing::Test {
 protected:
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  std::vector<std::string> files() const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(dir_)) out.push_back(e.path().filename());
    std::sort(out.begin(), out.end());
    return out;
  }

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

Tensor ramp(const Shape& shape, DType dtype, double start) {
  Tensor t = Tensor::empty(shape, dtype);
  for (int64_t i = 0; i < t.numel(); ++i) t.set_item(i, start + 0.25 * static_cast<double>(i));
  return t;
}

std::map<std::string, Tensor> sample() {
  return {{"fc.w", ramp({2, 3}, DType::f32, 1)},
          {"fc.b", ramp({3}, DType::f32, -1)},
          {"steps", ramp({2}, DType::i64, 7)}};
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

void expect_has(const std::string& msg, std::initializer_list<std::string> parts) {
  for (const std::string& p : parts) {
    EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' in: " << msg;
  }
}

// Byte offset in the file of a tensor's data.
uint64_t data_offset(const std::string& path, const std::string& name) {
  SafetensorsReader r(path);
  return r.header().data_start + r.header().find(name)->begin;
}

TEST_F(Checkpoint, RoundTripsTensorsAndMetadata) {
  const auto t = sample();
  save_checkpoint(path("c"), t, {{"step", "12"}, {"model", "mlp"}});
  const CheckpointContents c = load_checkpoint(path("c"));
  EXPECT_EQ(c.metadata, (std::map<std::string, std::string>{{"step", "12"}, {"model", "mlp"}}));
  ASSERT_EQ(c.tensors.size(), 3u);
  for (const auto& [name, want] : t) {
    const Tensor& got = c.tensors.at(name);
    EXPECT_EQ(got.desc(), want.desc()) << name;
    EXPECT_EQ(std::memcmp(got.raw(), want.raw(), want.nbytes()), 0) << name;
  }
  // The file is plain safetensors: any reader sees the tensors and checksums.
  SafetensorsReader plain(path("c"));
  EXPECT_TRUE(plain.header().metadata.contains("crc32/fc.w"));
  EXPECT_EQ(files(), std::vector<std::string>{"c"}) << "no temporary left behind";
}

TEST_F(Checkpoint, TamperedDataByteIsNamedByTensor) {
  save_checkpoint(path("c"), sample());
  std::string bytes = slurp(path("c"));
  bytes[data_offset(path("c"), "fc.b") + 5] ^= 0x10;
  spit(path("c"), bytes);
  CheckpointReader r(path("c"));  // structure is intact
  EXPECT_NO_THROW(r.read("fc.w"));
  expect_has(error_of([&] { r.read("fc.b"); }), {path("c"), "'fc.b'", "checksum"});
  EXPECT_THROW(load_checkpoint(path("c")), CheckpointError);
}

TEST_F(Checkpoint, TamperedShapeWithSameSizeIsCaught) {
  save_checkpoint(path("c"), sample());
  std::string bytes = slurp(path("c"));
  const size_t at = bytes.find("\"shape\":[2,3]");
  ASSERT_NE(at, std::string::npos);
  bytes.replace(at, 13, "\"shape\":[3,2]");
  spit(path("c"), bytes);
  CheckpointReader r(path("c"));
  expect_has(error_of([&] { r.read("fc.w"); }), {"'fc.w'", "f32[3, 2]", "checksum"});
}

TEST_F(Checkpoint, TamperedMetadataIsCaught) {
  save_checkpoint(path("c"), sample(), {{"step", "12"}});
  std::string bytes = slurp(path("c"));
  const size_t at = bytes.find("\"step\":\"12\"");
  ASSERT_NE(at, std::string::npos);
  bytes[at + 9] = '9';
  spit(path("c"), bytes);
  expect_has(error_of([&] { CheckpointReader r(path("c")); }),
             {path("c"), "metadata checksum mismatch"});
}

TEST_F(Checkpoint, TruncatedFileNamesPathAndSizes) {
  save_checkpoint(path("c"), sample());
  const std::string bytes = slurp(path("c"));
  spit(path("c"), bytes.substr(0, bytes.size() - 4));
  expect_has(error_of([&] { CheckpointReader r(path("c")); }),
             {path("c"), "truncated", fmt::format("{} bytes in all", bytes.size() - 4)});
}

TEST_F(Checkpoint, RejectsFilesThatAreNotMeshtrainCheckpoints) {
  save_safetensors(path("plain"), sample());
  expect_has(error_of([&] { CheckpointReader r(path("plain")); }),
             {path("plain"), "not a meshtrain checkpoint"});
  EXPECT_THROW(CheckpointReader(path("absent")), FileError);
}

TEST_F(Checkpoint, ReservedMetadataKeysAreRefused) {
  EXPECT_THROW(save_checkpoint(path("c"), sample(), {{"crc32/fc.w", "0"}}), ConfigError);
  EXPECT_THROW(save_checkpoint(path("c"), sample(), {{"meshtrain/format", "x"}}), ConfigError);
  EXPECT_FALSE(fs::exists(path("c")));
}

TEST_F(Checkpoint, LoadIntoChecksNamesShapesAndDtypes) {
  save_checkpoint(path("c"), {{"m/fc.w", ramp({2, 3}, DType::f32, 1)},
                              {"m/fc.b", ramp({3}, DType::f32, -1)},
                              {"other", ramp({1}, DType::f32, 0)}});
  CheckpointReader r(path("c"));

  std::map<std::string, Tensor> ok = {{"fc.w", Tensor::zeros({2, 3}, DType::f32)},
                                      {"fc.b", Tensor::zeros({3}, DType::f32)}};
  r.load_into(ok, "m/");
  EXPECT_EQ(ok.at("fc.w").item(5), 2.25);
  EXPECT_EQ(ok.at("fc.b").item(0), -1.0);

  std::map<std::string, Tensor> missing = ok;
  missing["fc.extra"] = Tensor::zeros({1}, DType::f32);
  expect_has(error_of([&] { r.load_into(missing, "m/"); }), {"'m/fc.extra'", "missing"});

  std::map<std::string, Tensor> extra = {{"fc.w", Tensor::zeros({2, 3}, DType::f32)}};
  expect_has(error_of([&] { r.load_into(extra, "m/"); }), {"'m/fc.b'", "not expected"});

  std::map<std::string, Tensor> shaped = {{"fc.w", Tensor::zeros({3, 2}, DType::f32)},
                                          {"fc.b", Tensor::zeros({3}, DType::f32)}};
  expect_has(error_of([&] { r.load_into(shaped, "m/"); }), {"'m/fc.w'", "f32[2, 3]", "f32[3, 2]"});

  std::map<std::string, Tensor> typed = {{"fc.w", Tensor::zeros({2, 3}, DType::f32)},
                                         {"fc.b", Tensor::zeros({3}, DType::bf16)}};
  expect_has(error_of([&] { r.load_into(typed, "m/"); }), {"'m/fc.b'", "bf16[3]"});
}

TEST_F(Checkpoint, LoadIntoIsAllOrNothing) {
  save_checkpoint(path("c"), sample());
  std::string bytes = slurp(path("c"));
  bytes[data_offset(path("c"), "steps")] ^= 1;  // the last target in name order
  spit(path("c"), bytes);
  std::map<std::string, Tensor> targets = {{"fc.w", Tensor::zeros({2, 3}, DType::f32)},
                                           {"fc.b", Tensor::zeros({3}, DType::f32)},
                                           {"steps", Tensor::zeros({2}, DType::i64)}};
  CheckpointReader r(path("c"));
  EXPECT_THROW(r.load_into(targets), CheckpointError);
  EXPECT_EQ(targets.at("fc.b").item(0), 0.0) << "nothing written before the failure was known";
  EXPECT_EQ(targets.at("fc.w").item(0), 0.0);
}

// --- atomic saves -----------------------------------------------------------

// Sets RLIMIT_FSIZE for the scope, so writes past `bytes` fail with EFBIG:
// a disk that fills up mid-save, without needing a full disk (or non-root).
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    old_handler_ = std::signal(SIGXFSZ, SIG_IGN);
    ::getrlimit(RLIMIT_FSIZE, &old_);
    rlimit lim = old_;
    lim.rlim_cur = bytes;
    ::setrlimit(RLIMIT_FSIZE, &lim);
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &old_);
    std::signal(SIGXFSZ, old_handler_);
  }

 private:
  rlimit old_{};
  void (*old_handler_)(int) = nullptr;
};

TEST_F(Checkpoint, FailedSaveKeepsThePreviousCheckpointAndLeavesNoTemporary) {
  save_checkpoint(path("c"), sample(), {{"step", "1"}});
  const std::string before = slurp(path("c"));
  std::map<std::string, Tensor> big = sample();
  big["big"] = Tensor::zeros({1 << 16}, DType::f32);  // 256 KiB
  {
    FileSizeLimit limit(64 << 10);
    try {
      save_checkpoint(path("c"), big, {{"step", "2"}});
      FAIL() << "expected FileError";
    } catch (const FileError& e) {
      expect_has(e.what(), {path("c"), "writing"});
    }
  }
  EXPECT_EQ(slurp(path("c")), before);
  EXPECT_EQ(files(), std::vector<std::string>{"c"});
  EXPECT_EQ(load_checkpoint(path("c")).metadata.at("step"), "1");
}

TEST_F(Checkpoint, ProducerExceptionKeepsThePreviousFile) {
  spit(path("f"), "old");
  EXPECT_THROW(write_file_atomically(path("f"),
                                     [](const ByteSink& sink) {
                                       sink("new", 3);
                                       throw ConfigError("injected");
                                     }),
               ConfigError);
  EXPECT_EQ(slurp(path("f")), "old");
  EXPECT_EQ(files(), std::vector<std::string>{"f"});
  write_file_atomically(path("f"), [](const ByteSink& sink) { sink("new", 3); });
  EXPECT_EQ(slurp(path("f")), "new");
}

// Missing directories are created, as a sharded save creates its directory,
// so both checkpoint forms accept the same paths.
TEST_F(Checkpoint, SaveCreatesMissingDirectories) {
  save_checkpoint(path("no/such/dir/c"), sample());
  EXPECT_EQ(load_checkpoint(path("no/such/dir/c")).tensors.size(), sample().size());
}

TEST_F(Checkpoint, SaveUnderAFileIsAFileErrorNamingTheDirectory) {
  save_checkpoint(path("plain"), sample());
  try {
    save_checkpoint(path("plain/sub/c"), sample());
    FAIL() << "expected FileError";
  } catch (const FileError& e) {
    expect_has(e.what(), {path("plain/sub/c"), "cannot create directory", path("plain/sub")});
  }
}

// --- training state ---------------------------------------------------------

TrainState sample_state() {
  TrainState s;
  s.params = {{"fc.w", ramp({2, 3}, DType::f32, 1)}, {"fc.b", ramp({3}, DType::f32, -1)}};
  s.optimizer = "adamw";
  s.optimizer_state.tensors = {{"fc.w.exp_avg", ramp({6}, DType::f32, 0.5)},
                               {"fc.w.exp_avg_sq", ramp({6}, DType::f32, 2)},
                               {"fc.b.exp_avg", ramp({3}, DType::f32, 3)},
                               {"fc.b.exp_avg_sq", ramp({3}, DType::f32, 4)}};
  s.optimizer_state.steps = {{"fc.w", 17}, {"fc.b", 16}};
  s.step = 17;
  s.epoch = 2;
  s.rng_position = (1ull << 63) + 5;
  s.lr_step = 15;
  s.loss_scaler = {.scale = 0.1 + 1e-17 * 3, .good_steps = 1234};
  s.extra = {{"model", "mlp"}, {"seed", "7"}};
  return s;
}

TrainState empty_like(const TrainState& s) {
  TrainState out;
  for (const auto& [name, t] : s.params) out.params[name] = Tensor::zeros(t.shape(), t.dtype());
  out.optimizer = s.optimizer;
  return out;
}

TEST_F(Checkpoint, TrainStateRoundTripsExactly) {
  const TrainState s = sample_state();
  save_train_state(path("t"), s);
  TrainState back = empty_like(s);
  const Tensor w_target = back.params.at("fc.w");
  load_train_state(path("t"), back);
  EXPECT_EQ(back.params.at("fc.w").raw(), w_target.raw()) << "loaded into the caller's tensor";
  for (const auto& [name, t] : s.params) {
    EXPECT_EQ(std::memcmp(back.params.at(name).raw(), t.raw(), t.nbytes()), 0) << name;
  }
  ASSERT_EQ(back.optimizer_state.tensors.size(), 4u);
  for (const auto& [name, t] : s.optimizer_state.tensors) {
    EXPECT_EQ(std::memcmp(back.optimizer_state.tensors.at(name).raw(), t.raw(), t.nbytes()), 0)
        << name;
  }
  EXPECT_EQ(back.optimizer_state.steps, s.optimizer_state.steps);
  EXPECT_EQ(back.optimizer, "adamw");
  EXPECT_EQ(back.step, 17);
  EXPECT_EQ(back.epoch, 2);
  EXPECT_EQ(back.rng_position, s.rng_position);
  EXPECT_EQ(back.lr_step, 15);
  EXPECT_EQ(back.loss_scaler.scale, s.loss_scaler.scale);  // bit-exact
  EXPECT_EQ(back.loss_scaler.good_steps, 1234);
  EXPECT_EQ(back.extra, s.extra);
}

TEST_F(Checkpoint, TrainStateMismatchesAreNamedAndLeaveTheStateAlone) {
  save_train_state(path("t"), sample_state());

  TrainState other_opt = empty_like(sample_state());
  other_opt.optimizer = "sgd";
  expect_has(error_of([&] { load_train_state(path("t"), other_opt); }), {"'adamw'", "'sgd'"});

  TrainState more = empty_like(sample_state());
  more.params["fc2.w"] = Tensor::zeros({2}, DType::f32);
  expect_has(error_of([&] { load_train_state(path("t"), more); }), {"'param/fc2.w'", "missing"});
  EXPECT_EQ(more.params.at("fc.w").item(0), 0.0) << "nothing loaded";
  EXPECT_EQ(more.step, 0);

  TrainState fewer = empty_like(sample_state());
  fewer.params.erase("fc.b");
  expect_has(error_of([&] { load_train_state(path("t"), fewer); }), {"fc.b"});

  TrainState shaped = empty_like(sample_state());
  shaped.params["fc.b"] = Tensor::zeros({4}, DType::f32);
  expect_has(error_of([&] { load_train_state(path("t"), shaped); }),
             {"'optim/fc.b.exp_avg'", "f32[4]"});
}

TEST_F(Checkpoint, TrainStateRefusesOptimizerStateWithoutItsParameter) {
  TrainState s = sample_state();
  s.optimizer_state.tensors["ghost.exp_avg"] = Tensor::zeros({1}, DType::f32);
  EXPECT_THROW(save_train_state(path("t"), s), ConfigError);
}

}  // namespace
}  // namespace mt
