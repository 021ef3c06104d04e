// The training plan that `meshtrain inspect` prints and the Trainer checks:
// its activation arena is the trainer's executor's, for every ZeRO stage,
// accumulation and precision; its model state follows the ZeRO stage and
// world size; a plan that cannot fit is refused naming the config values.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "meshtrain/data/fashion_mnist.h"
#include "meshtrain/train/trainer.h"
#include "meshtrain/train/training_plan.h"

namespace mt {
namespace {

using ::testing::HasSubstr;

struct Fixture {
  ModelSpec spec;
  std::shared_ptr<const Dataset> train, test;
  TrainerOptions opts;
};

Fixture small(const std::string& kind) {
  Fixture f;
  f.spec.kind = kind;
  f.spec.hidden = {64, 32};
  f.spec.conv_channels = {4, 8};
  f.spec.fc = 16;
  FashionMnistOptions d;
  d.flatten = kind == "mlp";
  d.limit = 256;
  f.train = std::make_shared<FashionMnist>(d);
  d.split = DataSplit::test;
  d.limit = 100;
  f.test = std::make_shared<FashionMnist>(d);
  f.opts.batch_size = 32;
  f.opts.progress = false;
  f.opts.optimizer = "adamw";
  return f;
}

TEST(TrainingPlan, ActivationArenaIsTheTrainers) {
  for (const char* kind : {"mlp", "cnn"}) {
    for (DType precision : {DType::f32, DType::bf16, DType::f16}) {
      for (int stage : {0, 2, 3}) {
        for (int accumulation : {1, 2}) {
          Fixture f = small(kind);
          f.opts.precision = precision;
          f.opts.dist.dp.stage = stage;
          f.opts.dist.dp.accumulation_steps = accumulation;
          const TrainingPlan p = plan_training(f.spec, f.opts, 0, 1, f.test->size());
          Trainer t(f.spec, f.train, f.test, f.opts);
          EXPECT_EQ(p.activations.arena_bytes, t.memory_plan().arena_bytes)
              << kind << " " << dtype_name(precision) << " stage " << stage << " accumulation "
              << accumulation;
          EXPECT_EQ(p.batch.micro_batch, 32 / accumulation);
          EXPECT_GT(p.eval_arena_bytes, 0);
        }
      }
    }
  }
}

TEST(TrainingPlan, ModelStateFollowsStageAndWorldSize) {
  Fixture f = small("mlp");
  const TrainingPlan one = plan_training(f.spec, f.opts, 0, 1);
  const int64_t P = one.param_count * 4;
  EXPECT_EQ(one.state.expected_param_bytes, P);
  EXPECT_EQ(one.state.expected_grad_bytes, P);
  EXPECT_EQ(one.state.expected_optimizer_bytes, 2 * P);  // AdamW: two moments
  f.opts.dist.dp.stage = 2;
  const TrainingPlan one2 = plan_training(f.spec, f.opts, 0, 1);
  const TrainingPlan four = plan_training(f.spec, f.opts, 1, 4);
  EXPECT_EQ(four.batch.local_batch, 8);
  EXPECT_EQ(four.state.expected_param_bytes, P);
  EXPECT_EQ(four.state.expected_grad_bytes, P / 4);
  EXPECT_EQ(four.state.expected_optimizer_bytes, 2 * P / 4);
  EXPECT_LT(four.activations.arena_bytes, one2.activations.arena_bytes);  // batch 8, not 32
  EXPECT_THAT(four.describe(), HasSubstr("rank 1 of 4, ZeRO stage 2, micro-batch 8"));
}

// The plan is what the allocator counts: after training steps, the live
// bytes per category (tensor/memory_stats.h) of one trainer equal the plan's
// parts within the allocator's 64-byte rounding and the layout's padding
// (64 bytes per parameter tensor, per kind), for every ZeRO stage and
// optimizer state size; nothing else of the model is allocated (no gradient
// buffer in the parameter store, no full copy under ZeRO-3).
TEST(TrainingPlan, PlanEqualsAllocatorCountersAfterSteps) {
  for (const char* optimizer : {"adamw", "sgd"}) {
    for (int stage : {0, 1, 2, 3}) {
      for (int accumulation : {1, 2}) {
        Fixture f = small("mlp");
        f.opts.optimizer = optimizer;
        f.opts.optim.sgd.momentum = 0.9;
        f.opts.eval = false;
        f.opts.max_steps = 2;
        f.opts.dist.dp.stage = stage;
        f.opts.dist.dp.accumulation_steps = accumulation;
        const TrainingPlan p = plan_training(f.spec, f.opts, 0, 1, f.test->size());
        const MemoryCounters before = memory_counters();
        TrainResult r;
        int64_t tensors = 0;
        {
          Trainer t(f.spec, f.train, f.test, f.opts);
          tensors = static_cast<int64_t>(t.train_graph().params().size());
          r = t.run();
        }
        auto live = [&](MemoryCategory c) { return r.allocated.live_of(c) - before.live_of(c); };
        const std::string what =
            fmt::format("{} stage {} accumulation {}", optimizer, stage, accumulation);
        const int64_t slack = 64 * (tensors + 1);
        EXPECT_NEAR(live(MemoryCategory::params), p.state.expected_param_bytes, slack) << what;
        EXPECT_NEAR(live(MemoryCategory::grads), p.state.expected_grad_bytes, slack) << what;
        EXPECT_NEAR(live(MemoryCategory::optimizer), p.state.expected_optimizer_bytes, 2 * slack)
            << what;
        EXPECT_NEAR(live(MemoryCategory::activations), p.activations.arena_bytes, 64) << what;
        EXPECT_EQ(live(MemoryCategory::comm), p.state.expected_buffer_bytes) << what;
        // Measured optimizer state is what the optimizer allocated (its
        // tensors' sizes; the allocator rounds each up to 64 bytes).
        EXPECT_NEAR(r.memory.optimizer_bytes, live(MemoryCategory::optimizer), 2 * slack) << what;
        // Everything the plan counts (evaluation is off), and no more.
        int64_t sum = 0;
        for (MemoryCategory c :
             {MemoryCategory::params, MemoryCategory::grads, MemoryCategory::optimizer,
              MemoryCategory::activations, MemoryCategory::comm}) {
          sum += live(c);
        }
        EXPECT_NEAR(sum, p.total_bytes(), 5 * slack) << what;
      }
    }
  }
}

TEST(TrainingPlan, TooBigIsRefusedNamingTheValues) {
  ModelSpec spec;
  spec.kind = "gpt";
  spec.seq_len = 100000;
  TrainerOptions o;
  o.batch_size = 16;
  o.eval_batch_size = 64;
  o.eval = false;
  // Planning a 100000-token context allocates nothing large.
  const TrainingPlan p = plan_training(spec, o, 0, 1);
  EXPECT_GT(p.activations.arena_bytes, int64_t{1} << 40);
  try {
    check_memory_fits(p, spec, o, int64_t{16} << 30);
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    const std::string m = e.what();
    EXPECT_THAT(m, HasSubstr("exceeds available memory 16.0 GiB"));
    EXPECT_THAT(m, HasSubstr("training activations"));
    EXPECT_THAT(m, HasSubstr("train.batch_size=16"));
    EXPECT_THAT(m, HasSubstr("model.seq_len=100000"));
    EXPECT_THAT(m, HasSubstr("f32[64, 100000, 100000]"));
  }
  EXPECT_NO_THROW(check_memory_fits(p, spec, o, p.total_bytes()));
  // With evaluation at a larger batch, that part dominates and is named.
  o.eval = true;
  const TrainingPlan pe = plan_training(spec, o, 0, 1);
  try {
    check_memory_fits(pe, spec, o, int64_t{16} << 30);
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr(": evaluation activations"));
    EXPECT_THAT(std::string(e.what()), HasSubstr("train.eval_batch_size=64"));
  }
}

TEST(TrainingPlan, TrainerRefusesARunThatDoesNotFit) {
  Fixture f = small("mlp");
  f.opts.memory_limit = 64 * 1024;
  try {
    Trainer t(f.spec, f.train, f.test, f.opts);
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr("planned memory per rank"));
    EXPECT_THAT(std::string(e.what()), HasSubstr("model.hidden=[64, 32]"));
  }
  f.opts.memory_limit = plan_training(f.spec, f.opts, 0, 1, f.test->size()).total_bytes();
  EXPECT_NO_THROW(Trainer(f.spec, f.train, f.test, f.opts));
}

}  // namespace
}  // namespace mt
