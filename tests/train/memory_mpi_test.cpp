// Memory per rank under mpirun (2 and 4 ranks), as the allocator counts it
// (tensor/memory_stats.h): each ZeRO stage holds what the training plan
// says, the model state under ZeRO-3 is (P+G+O)/N within 10%, and a ZeRO-3
// rank never holds the whole parameters, evaluation included (it gathers per
// bucket; a rank without examples in an evaluation batch still takes part,
// and the test loss equals the single-process one).
#include <gtest/gtest.h>

#include <cmath>

#include "meshtrain/comm/backends/mpi/mpi_communicator.h"
#include "meshtrain/data/fashion_mnist.h"
#include "meshtrain/train/param_store.h"
#include "meshtrain/train/trainer.h"
#include "meshtrain/train/training_plan.h"
#include "train/mpi_world.h"

namespace mt {
namespace {

Communicator& world() {
  return test::mpi_world();
}

struct RunSetup {
  ModelSpec spec;
  std::shared_ptr<const Dataset> train, test;
  TrainerOptions opts;
};

RunSetup setup(int stage) {
  RunSetup s;
  s.spec.kind = "mlp";
  s.spec.hidden = {256, 128};
  FashionMnistOptions d;
  d.flatten = true;
  d.limit = 512;
  s.train = std::make_shared<FashionMnist>(d);
  d.split = DataSplit::test;
  d.limit = 130;  // batches of 64, 64 and 2: at 4 ranks two ranks have no example in the last
  s.test = std::make_shared<FashionMnist>(d);
  s.opts.batch_size = 32;
  s.opts.eval_batch_size = 64;
  s.opts.max_steps = 3;
  s.opts.progress = false;
  s.opts.optimizer = "adamw";
  s.opts.schedule.lr = 0.003;
  s.opts.exec.backend = "reference";
  s.opts.dist.dp.stage = stage;
  s.opts.dist.dp.bucket_bytes = 64 << 10;  // several buckets
  return s;
}

int64_t state(const MemoryCounters& c) {
  return c.live_of(MemoryCategory::params) + c.live_of(MemoryCategory::grads) +
         c.live_of(MemoryCategory::optimizer);
}

TEST(MemoryMpi, EachStageHoldsWhatThePlanSays) {
  const int rank = world().rank(), n = world().size();
  std::optional<double> ref_loss;
  {
    RunSetup s = setup(0);
    Trainer t(s.spec, s.train, s.test, s.opts);
    ref_loss = t.run().test_loss;
  }
  ASSERT_TRUE(ref_loss.has_value());
  for (int stage = 0; stage <= 3; ++stage) {
    RunSetup s = setup(stage);
    const TrainingPlan plan = plan_training(s.spec, s.opts, rank, n, s.test->size());
    const MemoryCounters before = memory_counters();
    reset_memory_peaks();
    TrainResult r;
    int64_t tensors = 0;
    {
      Trainer t(s.spec, s.train, s.test, s.opts, &world());
      tensors = static_cast<int64_t>(t.train_graph().params().size());
      r = t.run();
    }
    const std::string what = fmt::format("stage {}, rank {} of {}", stage, rank, n);
    auto live = [&](MemoryCategory c) { return r.allocated.live_of(c) - before.live_of(c); };
    auto peak = [&](MemoryCategory c) { return r.allocated.peak_of(c) - before.live_of(c); };
    const int64_t slack = 64 * (tensors + 1);
    EXPECT_NEAR(live(MemoryCategory::params), plan.state.expected_param_bytes, slack) << what;
    EXPECT_NEAR(live(MemoryCategory::grads), plan.state.expected_grad_bytes, slack) << what;
    EXPECT_NEAR(live(MemoryCategory::optimizer), plan.state.expected_optimizer_bytes, 2 * slack)
        << what;
    // Buffers: staging and gathered buckets, at most one bucket more than
    // planned (a prefetched bucket can be in flight while two are in use).
    EXPECT_LE(live(MemoryCategory::comm),
              plan.state.expected_buffer_bytes + s.opts.dist.dp.bucket_bytes + slack)
        << what;
    ASSERT_TRUE(r.test_loss.has_value()) << what;
    EXPECT_NEAR(*r.test_loss, *ref_loss, 1e-5 * std::abs(*ref_loss)) << what;
    if (stage == 3) {
      const int64_t P = plan.param_count * 4;
      const double per_rank = 4.0 * static_cast<double>(P) / n;  // (P + G + 2P) / N, AdamW
      const int64_t got = state(r.allocated) - state(before);
      EXPECT_LE(std::abs(static_cast<double>(got) - per_rank), 0.1 * per_rank)
          << what << ": model state " << got << " bytes";
      // Never the whole parameters: the shard is drawn in place (no whole
      // copy first, not even of one tensor), and evaluation gathers per
      // bucket into the planned buffers (two staging, two gathered buckets).
      EXPECT_NEAR(peak(MemoryCategory::params), plan.state.expected_param_bytes, slack) << what;
      EXPECT_LE(peak(MemoryCategory::comm), plan.state.expected_buffer_bytes + slack) << what;
    }
  }
}

}  // namespace
}  // namespace mt

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  mt::world();
  const int rc = RUN_ALL_TESTS();
  return rc;
}
