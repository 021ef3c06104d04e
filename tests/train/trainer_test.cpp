// Whole-model training tests: loss goes down on real data, runs are bitwise
// deterministic, resuming from a checkpoint continues exactly, and the first
// steps match a stored expectation.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "meshtrain/base/error.h"
#include "meshtrain/comm/backends/local/local_world.h"
#include "meshtrain/data/byte_text.h"
#include "meshtrain/data/fashion_mnist.h"
#include "meshtrain/tensor/kernels.h"
#include "meshtrain/train/param_store.h"
#include "meshtrain/train/precision.h"
#include "meshtrain/train/trainer.h"
#include "meshtrain/train/training_plan.h"

namespace mt {
namespace {

namespace fs = std::filesystem;

struct Fixture {
  ModelSpec spec;
  std::shared_ptr<const Dataset> train, test;
  TrainerOptions opts;
};

Fixture small_mlp(const std::string& backend = "fast") {
  Fixture f;
  f.spec.kind = "mlp";
  f.spec.hidden = {64};
  FashionMnistOptions d;
  d.flatten = true;
  d.limit = 2048;
  f.train = std::make_shared<FashionMnist>(d);
  d.split = DataSplit::test;
  d.limit = 500;
  f.test = std::make_shared<FashionMnist>(d);
  f.opts.batch_size = 64;
  f.opts.epochs = 2;
  f.opts.progress = false;
  f.opts.eval = false;
  f.opts.optimizer = "sgd";
  f.opts.optim.sgd.momentum = 0.9;
  f.opts.schedule.kind = LrScheduleKind::cosine;
  f.opts.schedule.lr = 0.05;
  f.opts.schedule.warmup_steps = 5;
  f.opts.exec.backend = backend;
  return f;
}

std::vector<float> params_of(Trainer& t) {
  Tensor& flat = t.params().flat_values();
  return std::vector<float>(flat.data<float>(), flat.data<float>() + flat.numel());
}

fs::path temp_dir(const std::string& name) {
  fs::path p = fs::temp_directory_path() / ("meshtrain_trainer_test_" + name);
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

TEST(Trainer, LossDecreasesAndAccuracyRisesOnFashionMnist) {
  Fixture f = small_mlp();
  f.opts.eval = true;
  Trainer t(f.spec, f.train, f.test, f.opts);
  TrainResult r = t.run();
  ASSERT_EQ(r.steps, 64);  // 2 epochs of 2048 / 64
  double first = 0, last = 0;
  for (int i = 0; i < 8; ++i) {
    first += r.losses[static_cast<size_t>(i)];
    last += r.losses[r.losses.size() - 1 - static_cast<size_t>(i)];
  }
  EXPECT_LT(last, 0.6 * first) << "mean of the first 8 losses " << first / 8 << ", last 8 "
                               << last / 8;
  ASSERT_TRUE(r.test_accuracy.has_value());
  EXPECT_GT(*r.test_accuracy, 0.70);
}

TEST(Trainer, SameSeedGivesBitwiseIdenticalRuns) {
  Fixture f = small_mlp();
  f.opts.max_steps = 20;
  Trainer a(f.spec, f.train, f.test, f.opts);
  Trainer b(f.spec, f.train, f.test, f.opts);
  TrainResult ra = a.run(), rb = b.run();
  ASSERT_EQ(ra.losses.size(), rb.losses.size());
  for (size_t i = 0; i < ra.losses.size(); ++i) EXPECT_EQ(ra.losses[i], rb.losses[i]) << i;
  std::vector<float> pa = params_of(a), pb = params_of(b);
  EXPECT_EQ(0, std::memcmp(pa.data(), pb.data(), pa.size() * sizeof(float)));

  f.opts.seed = 2;
  Trainer c(f.spec, f.train, f.test, f.opts);
  EXPECT_NE(c.run().losses[0], ra.losses[0]);
}

TEST(Trainer, ResumeFromCheckpointContinuesExactly) {
  fs::path dir = temp_dir("resume");
  for (const std::string optimizer : {"sgd", "adamw"}) {
    Fixture f = small_mlp();
    f.opts.optimizer = optimizer;
    f.opts.max_steps = 24;
    Trainer whole(f.spec, f.train, f.test, f.opts);
    TrainResult rw = whole.run();

    TrainerOptions first = f.opts;
    first.halt_after = 10;  // interrupted after step 10 (of 24)
    first.checkpoint_path = (dir / (optimizer + ".safetensors")).string();
    Trainer a(f.spec, f.train, f.test, first);
    TrainResult ra = a.run();
    ASSERT_EQ(ra.steps, 10);

    TrainerOptions second = f.opts;
    second.resume_path = first.checkpoint_path;
    Trainer b(f.spec, f.train, f.test, second);
    TrainResult rb = b.run();
    ASSERT_EQ(rb.steps, 24);
    ASSERT_EQ(rb.losses.size(), 14u);
    for (size_t i = 0; i < rb.losses.size(); ++i) {
      EXPECT_EQ(rb.losses[i], rw.losses[10 + i]) << optimizer << " step " << 10 + i;
    }
    std::vector<float> pw = params_of(whole), pb = params_of(b);
    EXPECT_EQ(0, std::memcmp(pw.data(), pb.data(), pw.size() * sizeof(float))) << optimizer;
  }
}

TEST(Trainer, TamperedCheckpointIsRejectedOnResume) {
  fs::path dir = temp_dir("tamper");
  Fixture f = small_mlp();
  f.opts.max_steps = 4;
  f.opts.checkpoint_path = (dir / "ck.safetensors").string();
  Trainer(f.spec, f.train, f.test, f.opts).run();
  {
    std::fstream io(f.opts.checkpoint_path, std::ios::in | std::ios::out | std::ios::binary);
    io.seekg(-16, std::ios::end);
    char c = 0;
    io.read(&c, 1);
    io.seekp(-16, std::ios::end);
    c = static_cast<char>(c ^ 0x5a);
    io.write(&c, 1);
  }
  TrainerOptions again = f.opts;
  again.resume_path = f.opts.checkpoint_path;
  again.checkpoint_path.clear();
  try {
    Trainer t(f.spec, f.train, f.test, again);
    FAIL() << "a tampered checkpoint was accepted";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("ck.safetensors"), std::string::npos) << e.what();
  }
}

// The first losses of a fixed run on the reference backend. A change here
// means the model, initialisation, data order or a kernel's numerics changed:
// update the numbers only after understanding why.
TEST(Trainer, FirstStepsMatchStoredExpectation) {
  Fixture f = small_mlp("reference");
  f.opts.max_steps = 4;
  Trainer t(f.spec, f.train, f.test, f.opts);
  TrainResult r = t.run();
  const std::vector<double> expected = {2.3046999, 2.30731773, 2.15758204, 2.01368737};
  ASSERT_EQ(r.losses.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_NEAR(r.losses[i], expected[i], 1e-5) << i << ": " << fmt::format("{:.9g}", r.losses[i]);
  }
}

TEST(Trainer, MixedPrecisionTrains) {
  for (DType p : {DType::bf16, DType::f16}) {
    Fixture f = small_mlp();
    f.opts.precision = p;
    f.opts.max_steps = 40;
    Trainer t(f.spec, f.train, f.test, f.opts);
    TrainResult r = t.run();
    EXPECT_LT(r.losses.back(), 0.75 * r.losses.front()) << dtype_name(p);
  }
}

// The summary line of a run's metrics file.
nlohmann::json summary_of(const fs::path& metrics) {
  std::ifstream in(metrics);
  std::string line, last;
  while (std::getline(in, line)) {
    if (!line.empty()) last = line;
  }
  nlohmann::json j = nlohmann::json::parse(last);
  EXPECT_TRUE(j.value("summary", false)) << last;
  return j;
}

TEST(Trainer, PrecisionAutoKeepsF32WhenBf16MatmulsMeasureSlower) {
  // The test hook halves the measured bf16 rate, as on an Intel CPU whose bf16
  // dot product has half the FMA ports; auto then keeps f32 and says why.
  const fs::path dir = temp_dir("precision_auto");
  for (double factor : {0.25, 100.0}) {
    Fixture f = small_mlp();
    f.opts.precision_auto = true;
    f.opts.bf16_rate_factor_for_testing = factor;
    // bf16 activation storage made too costly here (its test is below).
    f.opts.storage_cost_factor_for_testing = 1e9;
    f.opts.max_steps = 2;
    f.opts.metrics_path = (dir / "m.jsonl").string();
    std::vector<std::string> notices;
    f.opts.on_notice = [&](const std::string& m) { notices.push_back(m); };
    Trainer t(f.spec, f.train, f.test, f.opts);
    t.run();
    const nlohmann::json s = summary_of(dir / "m.jsonl");
    const nlohmann::json& d = s.at("precision_decision");
    const bool slower = factor < 1.0;
    EXPECT_EQ(s.at("precision"), slower ? "f32" : "bf16") << d.dump();
    EXPECT_EQ(d.at("requested"), "auto");
    EXPECT_EQ(d.at("chosen"), slower ? "f32" : "bf16");
    EXPECT_GT(d.at("f32_matmul_gflops_1t").get<double>(), 0.0);
    EXPECT_EQ(d.at("bf16_over_f32").get<double>() < 1.1, slower) << d.dump();
    const std::string want = slower ? "train.precision = \"auto\" chose f32: bf16 matmuls run at"
                                    : "train.precision = \"auto\" chose bf16";
    ASSERT_FALSE(notices.empty());
    EXPECT_NE(notices[0].find(want), std::string::npos) << notices[0];
    if (slower) {
      EXPECT_NE(notices[0].find("matmuls stay f32"), std::string::npos) << notices[0];
    }
    // The machine and the engines are named beside it.
    EXPECT_FALSE(s.at("cpu").get<std::string>().empty());
    EXPECT_FALSE(s.at("isa").get<std::string>().empty());
    EXPECT_FALSE(s.at("matmul_engines").at("openblas_core").get<std::string>().empty());
  }
  // bf16 as configured keeps its meaning, with a warning when it is slower.
  Fixture f = small_mlp();
  f.opts.precision = DType::bf16;
  f.opts.bf16_rate_factor_for_testing = 0.25;
  f.opts.max_steps = 2;
  f.opts.metrics_path = (dir / "m.jsonl").string();
  std::vector<std::string> notices;
  f.opts.on_notice = [&](const std::string& m) { notices.push_back(m); };
  Trainer t(f.spec, f.train, f.test, f.opts);
  t.run();
  EXPECT_EQ(summary_of(dir / "m.jsonl").at("precision"), "bf16");
  ASSERT_FALSE(notices.empty());
  EXPECT_NE(notices[0].find("warning:"), std::string::npos) << notices[0];
  EXPECT_NE(notices[0].find("slower than f32"), std::string::npos) << notices[0];
}

TEST(PrecisionPolicy, InjectedRatesDecideAndTheReasonSaysWhy) {
  // The pure policy on rates a test chooses: Intel without AMX (bf16 at
  // 0.65x f32), a near tie below the gain that pays for the casts, and a
  // CPU where bf16 runs twice as fast (AVX512_BF16 here, AMX elsewhere).
  struct Case {
    std::string requested;
    double f32, bf16;
    bool amx, cpu_amx;
    DType want;
    std::vector<std::string> says;
  };
  const std::vector<Case> cases = {
      {"auto",
       115,
       75,
       false,
       false,
       DType::f32,
       {"chose f32", "0.65x f32", "matmuls stay f32", "no AMX on this CPU"}},
      {"auto", 100, 105, false, false, DType::f32, {"chose f32", "below the 1.10x"}},
      {"auto", 100, 200, false, false, DType::bf16, {"chose bf16", "2.00x f32"}},
      {"auto", 100, 400, true, true, DType::bf16, {"chose bf16", "AMX)"}},
      {"auto", 100, 90, false, true, DType::f32, {"AMX on the CPU but not used by oneDNN"}},
      {"bf16", 115, 75, false, false, DType::bf16, {"warning:", "slower than f32"}},
      {"bf16", 100, 200, false, false, DType::bf16, {"bf16 as configured"}},
      {"f32", 100, 200, false, false, DType::f32, {"f32 as configured"}},
  };
  for (const Case& c : cases) {
    PrecisionDecision d;
    d.requested = c.requested;
    d.measured = true;
    d.f32_gflops = c.f32;
    d.bf16_gflops = c.bf16;
    d.amx = c.amx;
    d.cpu_amx = c.cpu_amx;
    d.isa = c.amx ? "avx512_core_amx" : "avx512_core_bf16";
    apply_precision_policy(d);
    EXPECT_EQ(d.chosen, c.want) << c.requested << " " << c.f32 << " " << c.bf16 << ": " << d.reason;
    for (const std::string& w : c.says) {
      EXPECT_NE(d.reason.find(w), std::string::npos) << "'" << w << "' not in: " << d.reason;
    }
  }
  // Nothing measured (not the fast backend): auto is f32.
  PrecisionDecision none;
  none.requested = "auto";
  apply_precision_policy(none);
  EXPECT_EQ(none.chosen, DType::f32);
  EXPECT_NE(none.reason.find("nothing measured"), std::string::npos) << none.reason;
  PrecisionDecision bad;
  bad.requested = "fp8";
  EXPECT_THROW(apply_precision_policy(bad), ConfigError);
}

bool has_bf16_values(const Graph& g) {
  for (int v = 0; v < g.num_values(); ++v) {
    if (g.value(v).dtype == DType::bf16) return true;
  }
  return false;
}

TEST(Trainer, PrecisionAutoRanksFollowRankZerosMeasurement) {
  // Rank 1's hook would make it keep f32 on its own; the graphs must agree,
  // so every rank takes rank 0's decision (bf16 here).
  std::vector<int> bf16(2, -1);
  LocalWorld::run(2, [&](Communicator& c) {
    Fixture f = small_mlp();
    f.opts.precision_auto = true;
    f.opts.bf16_rate_factor_for_testing = c.rank() == 0 ? 100.0 : 0.01;
    f.opts.max_steps = 2;
    Trainer t(f.spec, f.train, f.test, f.opts, &c);
    t.run();
    bf16[static_cast<size_t>(c.rank())] = has_bf16_values(t.train_graph()) ? 1 : 0;
  });
  EXPECT_EQ(bf16[0], 1);
  EXPECT_EQ(bf16[1], 1);
}

Fixture small_gpt() {
  Fixture f;
  f.spec.kind = "gpt";
  f.spec.layers = 2;
  f.spec.d_model = 32;
  f.spec.heads = 2;
  f.spec.seq_len = 16;
  ByteTextOptions d;
  d.seq_len = 16;
  d.limit = 256;
  f.train = std::make_shared<ByteText>(d);
  d.split = DataSplit::test;
  d.limit = 16;
  f.test = std::make_shared<ByteText>(d);
  f.opts.batch_size = 8;
  f.opts.progress = false;
  f.opts.eval = false;
  f.opts.optimizer = "adamw";
  return f;
}

TEST(Trainer, Bf16StorageTrainsNearItsF32Twin) {
  // f32 compute with the stash in bf16: the MLP and a GPT train, step by
  // step near the all-f32 run (only the backward reads rounded values), and
  // the log and summary name the mode.
  const fs::path dir = temp_dir("bf16_storage");
  for (const char* model : {"mlp", "gpt"}) {
    std::vector<std::vector<double>> losses;
    for (bool storage : {false, true}) {
      Fixture f = std::string(model) == "mlp" ? small_mlp() : small_gpt();
      // Three hidden layers: with one, the backward widens its values
      // again right at the boundary and the pass is not kept (below).
      if (std::string(model) == "mlp") f.spec.hidden = {128, 128, 128};
      f.opts.bf16_storage = storage;
      f.opts.max_steps = 30;
      f.opts.metrics_path = (dir / "m.jsonl").string();
      std::vector<std::string> notices;
      f.opts.on_notice = [&](const std::string& m) { notices.push_back(m); };
      Trainer t(f.spec, f.train, f.test, f.opts);
      losses.push_back(t.run().losses);
      EXPECT_EQ(has_bf16_values(t.train_graph()), storage) << model;
      const nlohmann::json s = summary_of(dir / "m.jsonl");
      EXPECT_EQ(s.at("precision"), storage ? "bf16_storage" : "f32") << model;
      if (storage) {
        EXPECT_EQ(s.at("precision_decision").at("chosen"), "bf16_storage");
        bool said = false;
        for (const auto& n : notices) said |= n.find("bf16 activation storage: ") == 0;
        EXPECT_TRUE(said) << model;
      }
    }
    const auto& l32 = losses[0];
    const auto& l = losses[1];
    ASSERT_EQ(l.size(), l32.size());
    EXPECT_LT(l.back(), 0.9 * l.front()) << model;
    // The first forward is the f32 one (up to the engine trials' rounding);
    // later steps drift by the bf16-rounded gradients (under 2% in 30 steps).
    EXPECT_NEAR(l[0], l32[0], 1e-5 * l32[0]) << model;
    for (size_t i = 0; i < l.size(); ++i) {
      EXPECT_NEAR(l[i], l32[i], 0.02 * l32[i]) << model << " step " << i;
    }
  }
  // One hidden layer: the stash would not lower the planned peak, so the
  // graph stays f32 and the log says why.
  Fixture f = small_mlp();
  f.opts.bf16_storage = true;
  f.opts.max_steps = 1;
  std::vector<std::string> notices;
  f.opts.on_notice = [&](const std::string& m) { notices.push_back(m); };
  Trainer t(f.spec, f.train, f.test, f.opts);
  t.run();
  EXPECT_FALSE(has_bf16_values(t.train_graph()));
  // With recomputation (the other way to shrink the stash) it is refused.
  TrainerOptions both = f.opts;
  both.exec.recompute = true;
  try {
    Trainer bad(f.spec, f.train, f.test, both);
    ADD_FAILURE() << "bf16_storage with exec.recompute";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("exec.recompute = true: "), std::string::npos) << e.what();
  }
  bool said = false;
  for (const auto& n : notices)
    said |= n.find("would not lower the planned activation peak") != std::string::npos;
  EXPECT_TRUE(said);
}

TEST(Trainer, Bf16StorageDataParallelMatchesOneProcess) {
  // The stash pass runs on every rank's graph alike: 2 local ranks with half
  // the batch each follow the one-process run step by step (the reference
  // backend, so a sample's activations -- and their bf16 roundings -- do not
  // depend on the split; only the gradient sums' order differs).
  auto setup = [] {
    Fixture f = small_mlp("reference");
    f.spec.hidden = {128, 128, 128};
    f.opts.bf16_storage = true;
    f.opts.max_steps = 8;
    return f;
  };
  Fixture one = setup();
  Trainer t(one.spec, one.train, one.test, one.opts);
  const std::vector<double> ref = t.run().losses;
  ASSERT_TRUE(has_bf16_values(t.train_graph()));
  std::vector<std::vector<double>> got(2);
  LocalWorld::run(2, [&](Communicator& c) {
    Fixture f = setup();
    Trainer r(f.spec, f.train, f.test, f.opts, &c);
    got[static_cast<size_t>(c.rank())] = r.run().losses;
  });
  for (const auto& l : got) {
    ASSERT_EQ(l.size(), ref.size());
    for (size_t i = 0; i < ref.size(); ++i) {
      EXPECT_NEAR(l[i], ref[i], 1e-5 * std::abs(ref[i])) << "step " << i;
    }
  }
}

TEST(Trainer, PrecisionAutoPicksBf16StorageWhereBf16MatmulsAreSlower) {
  // Intel-like rates (the hook quarters the measured bf16 rate: about 0.5x
  // f32 on this machine, where bf16 runs near 2x; Intel without AMX: 0.65x): auto keeps
  // matmuls in f32 and stores the stash in bf16 when the casts measure
  // cheap (their cost scaled to 0 here), and keeps f32 throughout when they
  // would cost more than the step can hide (scaled up).
  const fs::path dir = temp_dir("precision_auto_storage");
  for (double cost : {0.0, 1e9}) {
    Fixture f = small_mlp();
    f.spec.hidden = {256, 256, 256};
    f.opts.precision_auto = true;
    f.opts.bf16_rate_factor_for_testing = 0.25;
    f.opts.storage_cost_factor_for_testing = cost;
    f.opts.max_steps = 2;
    f.opts.metrics_path = (dir / "m.jsonl").string();
    std::vector<std::string> notices;
    f.opts.on_notice = [&](const std::string& m) { notices.push_back(m); };
    Trainer t(f.spec, f.train, f.test, f.opts);
    t.run();
    const bool storage = cost == 0.0;
    const nlohmann::json s = summary_of(dir / "m.jsonl");
    const nlohmann::json& d = s.at("precision_decision");
    EXPECT_EQ(s.at("precision"), storage ? "bf16_storage" : "f32") << d.dump();
    EXPECT_EQ(d.at("chosen"), storage ? "bf16_storage" : "f32") << d.dump();
    EXPECT_EQ(d.at("bf16_storage"), storage) << d.dump();
    EXPECT_GT(d.at("stash_elements").get<int64_t>(), 0) << d.dump();
    EXPECT_EQ(has_bf16_values(t.train_graph()), storage);
    ASSERT_FALSE(notices.empty());
    const std::string want = storage ? "train.precision = \"auto\" chose bf16_storage: bf16 matmuls"
                                     : "train.precision = \"auto\" chose f32: bf16 matmuls";
    EXPECT_EQ(notices[0].find(want), 0u) << notices[0];
    EXPECT_NE(notices[0].find("matmuls stay f32"), std::string::npos) << notices[0];
    EXPECT_NE(notices[0].find(storage ? "stored in bf16" : "activations stay f32"),
              std::string::npos)
        << notices[0];
  }
  // Casts as measured (however costly), but a memory limit between the two
  // runs' plans: auto stores the stash in bf16 so that the run fits.
  Fixture f = small_mlp();
  f.spec.hidden = {256, 256, 256};
  f.opts.precision_auto = true;
  f.opts.bf16_rate_factor_for_testing = 0.25;
  f.opts.storage_cost_factor_for_testing = 1e9;
  f.opts.max_steps = 2;
  TrainerOptions storage_o = f.opts;
  storage_o.precision_auto = false;
  storage_o.bf16_storage = true;
  const int64_t f32_plan = plan_training(f.spec, f.opts, 0, 1).total_bytes();
  const int64_t storage_plan = plan_training(f.spec, storage_o, 0, 1).total_bytes();
  ASSERT_LT(storage_plan, f32_plan);
  f.opts.memory_limit = (f32_plan + storage_plan) / 2;
  f.opts.metrics_path = (dir / "m.jsonl").string();
  Trainer t(f.spec, f.train, f.test, f.opts);
  t.run();
  const nlohmann::json d = summary_of(dir / "m.jsonl").at("precision_decision");
  EXPECT_EQ(d.at("chosen"), "bf16_storage") << d.dump();
  EXPECT_EQ(d.at("f32_plan_bytes").get<int64_t>(), f32_plan) << d.dump();
  EXPECT_NE(d.at("reason").get<std::string>().find("exceeds this rank's"), std::string::npos)
      << d.dump();
}

TEST(PrecisionPolicy, AutoWeighsTheStorageCastsAgainstTheMatmuls) {
  // Intel without AMX (bf16 at 0.65x f32): bf16 storage when its casts take
  // at most 2% of the step's f32 matmul time, f32 when more or nothing to stash.
  struct Case {
    int64_t stash;
    double cast_s;
    bool want_storage;
    std::string says;
  };
  const std::vector<Case> cases = {{1000000, 0.001, true, "casts cost 1.0%"},
                                   {1000000, 0.0019, true, "chose bf16_storage"},
                                   {1000000, 0.005, false, "would cost 5.0%"},
                                   {0, 0.0, false, "would not lower the planned activation peak"}};
  for (const Case& c : cases) {
    PrecisionDecision d;
    d.requested = "auto";
    d.measured = true;
    d.f32_gflops = 115;
    d.bf16_gflops = 75;
    d.f32_matmul_s = 0.1;
    d.storage_cast_s = c.cast_s;
    d.stash_elements = c.stash;
    apply_precision_policy(d);
    EXPECT_EQ(d.chosen, DType::f32) << d.reason;
    EXPECT_EQ(d.bf16_storage, c.want_storage) << d.reason;
    EXPECT_EQ(d.mode(), c.want_storage ? "bf16_storage" : "f32");
    EXPECT_NE(d.reason.find(c.says), std::string::npos)
        << "'" << c.says << "' not in: " << d.reason;
    EXPECT_NE(d.reason.find("sync.codec"), std::string::npos) << d.reason;
  }
  // Casts too costly, but the f32 plan does not fit the rank's memory and the
  // storage plan does: storage (else the run could not start); not when
  // neither fits.
  for (int64_t storage_plan : {int64_t{120} << 20, int64_t{160} << 20}) {
    PrecisionDecision d;
    d.requested = "auto";
    d.measured = true;
    d.f32_gflops = 115;
    d.bf16_gflops = 75;
    d.f32_matmul_s = 0.1;
    d.storage_cast_s = 0.005;
    d.stash_elements = 1000000;
    d.memory_limit = int64_t{150} << 20;
    d.f32_plan_bytes = int64_t{200} << 20;
    d.storage_plan_bytes = storage_plan;
    apply_precision_policy(d);
    const bool fits = storage_plan <= d.memory_limit;
    EXPECT_EQ(d.bf16_storage, fits) << d.reason;
    EXPECT_NE(d.reason.find(fits ? "exceeds this rank's 150.0 MiB" : "would cost 5.0%"),
              std::string::npos)
        << d.reason;
  }
  // Where bf16 matmuls pay, auto takes bf16 whatever the stash costs.
  PrecisionDecision fast;
  fast.requested = "auto";
  fast.measured = true;
  fast.f32_gflops = 100;
  fast.bf16_gflops = 200;
  fast.f32_matmul_s = 0.1;
  fast.stash_elements = 1000;
  apply_precision_policy(fast);
  EXPECT_EQ(fast.mode(), "bf16");
  // As configured, nothing measured.
  PrecisionDecision asked;
  asked.requested = "bf16_storage";
  apply_precision_policy(asked);
  EXPECT_EQ(asked.mode(), "bf16_storage");
  EXPECT_EQ(asked.chosen, DType::f32);
}

TEST(Trainer, RunsPinnedToEachMatmulEngineGiveTheSameLosses) {
  // The MLP (2-D matmuls) and a GPT (attention's batched matmuls, transposed
  // operands, a shared weight in the tied head).
  const fs::path dir = temp_dir("pinned_engines");
  for (const char* model : {"mlp", "gpt"}) {
    std::vector<std::vector<double>> losses;
    for (MatmulEngineChoice e : {MatmulEngineChoice::onednn, MatmulEngineChoice::openblas}) {
      Fixture f = std::string(model) == "mlp" ? small_mlp() : small_gpt();
      f.opts.exec.fast.f32_matmul = e;
      f.opts.max_steps = 12;
      f.opts.metrics_path = (dir / "m.jsonl").string();
      Trainer t(f.spec, f.train, f.test, f.opts);
      losses.push_back(t.run().losses);
      // Every f32 signature ran on the pinned engine, and the summary says so.
      const nlohmann::json eng = summary_of(dir / "m.jsonl").at("matmul_engines").at("f32");
      ASSERT_FALSE(eng.empty()) << model;
      for (const auto& [sig, name] : eng.items()) {
        EXPECT_EQ(name, e == MatmulEngineChoice::onednn ? "onednn" : "openblas") << model << sig;
      }
    }
    ASSERT_EQ(losses[0].size(), losses[1].size());
    for (size_t i = 0; i < losses[0].size(); ++i) {
      EXPECT_NEAR(losses[0][i], losses[1][i], 1e-4 * std::abs(losses[0][i]))
          << model << " step " << i;
    }
  }
}

}  // namespace
}  // namespace mt
