// Asynchronous pipelining (parallel.async) through the Trainer under
// mpirun at 4 ranks:
//   - PipeDream's hybrid: dp 2 x pp 2 async, each stage replicated over dp
//     and the replicas' gradients of each micro-batch averaged before the
//     stage's update, equals pp 2 async on one replica whose micro-batch i
//     is the dp replicas' micro-batches i concatenated (the same global
//     batch, reordered): every step's loss and every parameter at the end.
//     Asynchrony is deterministic given the schedule, so this is an
//     equality within float tolerance, for the MLP and for the GPT (whose
//     tied wte the first stage updates with the last stage's part added);
//   - the test of the test: the pp run on the batch in its loader's order
//     (micro-batches that mix the replicas' rows differently) differs by
//     far more than the tolerance.
//
// Tolerance: 1e-4 relative, as the other pipeline tests: the dp average
// of two half-micro-batch gradients against one micro-batch's gradient
// re-associates f32 sums (~1e-7), carried through the steps' updates.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/spmd/lower.h"
#include "meshtrain/spmd/shorthand.h"
#include "meshtrain/tensor/box.h"
#include "meshtrain/train/pipeline_training.h"
#include "meshtrain/train/trainer.h"
#include "sync/dp_harness.h"
#include "train/mpi_world.h"

namespace mt {
namespace {

constexpr double kRel = 1e-4;
constexpr int kSteps = 6;
constexpr int64_t kBatch = 8;
constexpr int kMicro = 2;

Communicator& world() {
  return test::mpi_world();
}

ModelSpec spec_of(const std::string& kind) {
  ModelSpec s;
  s.kind = kind;
  if (kind == "gpt") {
    s.layers = 2;
    s.d_model = 24;
    s.heads = 6;
    s.seq_len = 8;
    s.vocab = 36;
  } else {
    s.image_channels = 1;
    s.image_size = 6;
    s.hidden = {16, 12};
    s.classes = 5;
  }
  return s;
}

// The examples of another dataset at permuted positions.
class Permuted : public Dataset {
 public:
  Permuted(std::shared_ptr<const Dataset> d, std::vector<int64_t> at)
      : d_(std::move(d)), at_(std::move(at)) {}
  int64_t size() const override { return d_->size(); }
  Batch gather(std::span<const int64_t> indices) const override {
    std::vector<int64_t> idx;
    for (int64_t i : indices) idx.push_back(at_.at(static_cast<size_t>(i)));
    return d_->gather(idx);
  }
  std::string describe() const override { return "permuted"; }

 private:
  std::shared_ptr<const Dataset> d_;
  std::vector<int64_t> at_;
};

// Position q of the pp run's batch t = micro-batch i, replica d's part of
// it, row k; it holds the dp run's row of replica d's micro-batch i (the
// loader gives replica d rows [d B/dp, (d+1) B/dp) of each batch, unshuffled).
std::vector<int64_t> concatenated_replicas(int64_t n, int dp) {
  std::vector<int64_t> at(static_cast<size_t>(n));
  const int64_t per = kBatch / (dp * kMicro);
  for (int64_t q = 0; q < n; ++q) {
    const int64_t t = q / kBatch, r = q % kBatch;
    const int64_t i = r / (kBatch / kMicro), d = (r % (kBatch / kMicro)) / per, k = r % per;
    at[static_cast<size_t>(q)] = t * kBatch + d * (kBatch / dp) + i * per + k;
  }
  return at;
}

TrainerOptions options(const ModelSpec& spec, AsyncMode mode, int dp, int world_size, int tp = 1) {
  TrainerOptions o;
  o.batch_size = kBatch;
  o.max_steps = kSteps;
  o.epochs = 1;
  o.progress = false;
  o.eval = false;
  o.shuffle = false;
  o.seed = 3;
  o.exec.backend = "reference";
  o.optimizer = "adamw";
  o.optim.adamw.weight_decay = 0.01;
  o.schedule.lr = 0.003;
  ParallelShorthand sh;
  sh.pp = 2;
  sh.dp = dp;
  sh.tp = tp;
  sh.microbatches = kMicro;
  sh.schedule = ScheduleKind::one_f_one_b;
  sh.async = mode;
  const ModelGraph m = build_model(spec, kBatch);
  const ShorthandModel sm{spec.kind, spec.kind == "gpt" ? spec.d_model / spec.heads : 1};
  Plan p = expand_shorthand(sh, sm, m.graph, world_size);
  validate_plan(p, m.graph, world_size, kBatch, "parallel");
  o.dist.plan = std::make_shared<const Plan>(std::move(p));
  return o;
}

struct Run {
  std::vector<double> losses;
  std::map<std::string, Tensor> params;  // this rank's stage's (its pieces under tp)
  std::map<std::string, Box> boxes;      // tp: each split piece's box in the whole
  int stage = 0;
};

Run train(const ModelSpec& spec, std::shared_ptr<const Dataset> data, const TrainerOptions& o,
          Communicator& comm) {
  Trainer t(spec, std::move(data), nullptr, o, &comm);
  Run r;
  r.losses = t.run().losses;
  PipelineTraining* p = t.pipeline();
  EXPECT_NE(p, nullptr);
  for (const std::string& n : p->param_names()) {
    r.params[n] = p->param(n).clone();
    const LoweredProgram* lp = p->lowered();
    const LoweredParam* q = lp != nullptr ? lp->param(n) : nullptr;
    if (q != nullptr && !q->axis.empty()) r.boxes.emplace(n, q->box);
  }
  r.stage = o.dist.plan->mesh.coord(comm.rank(), "pp");
  return r;
}

// Worst relative difference over the losses and the parameters.
double worst(const Run& a, const Run& b, std::string* where) {
  double w = 0;
  EXPECT_EQ(a.losses.size(), b.losses.size());
  for (size_t i = 0; i < std::min(a.losses.size(), b.losses.size()); ++i) {
    const double d = std::abs(a.losses[i] - b.losses[i]) / std::abs(b.losses[i]);
    if (d > w) w = d, *where = fmt::format("loss of step {}", i + 1);
  }
  EXPECT_EQ(a.params.size(), b.params.size());
  for (const auto& [n, whole] : b.params) {
    const Tensor& got = a.params.at(n);
    Tensor want = whole;
    if (auto it = a.boxes.find(n); it != a.boxes.end()) {
      want = Tensor::empty(it->second.shape(), DType::f32);
      copy_box_out(whole, it->second, want);
    }
    EXPECT_EQ(got.numel(), want.numel()) << n;
    if (got.numel() != want.numel()) continue;
    double diff = 0, mag = 1e-3;
    for (int64_t k = 0; k < want.numel(); ++k) {
      diff = std::max(diff, std::abs(got.item(k) - want.item(k)));
      mag = std::max(mag, std::abs(want.item(k)));
    }
    if (diff / mag > w) w = diff / mag, *where = n;
  }
  return w;
}

void check_hybrid_equals_concatenated(const std::string& kind, AsyncMode mode) {
  ASSERT_EQ(world().size(), 4);
  const ModelSpec spec = spec_of(kind);
  auto data = std::make_shared<test::SyntheticData>(spec, 96, 5);
  const TrainerOptions dp_o = options(spec, mode, 2, 4);
  const Run hybrid = train(spec, data, dp_o, world());

  // The pp run: each dp replica's ranks, in the same stage order, train on
  // their own (both replicas alike).
  const Mesh& mesh = dp_o.dist.plan->mesh;
  auto replica =
      world().split(mesh.coord(world().rank(), "dp"), mesh.coord(world().rank(), "pp"), "replica");
  const TrainerOptions pp_o = options(spec, mode, 1, 2);
  const Run concat =
      train(spec, std::make_shared<Permuted>(data, concatenated_replicas(data->size(), 2)), pp_o,
            *replica);
  ASSERT_EQ(concat.stage, hybrid.stage);
  std::string where;
  const double w = worst(hybrid, concat, &where);
  EXPECT_LE(w, kRel) << kind << " " << async_name(mode) << ": worst at " << where << " on rank "
                     << world().rank();
  if (world().rank() == 0) {
    std::printf("%s %s: dp2 x pp2 against pp2 on the concatenated batches: worst %.2g (%s)\n",
                kind.c_str(), std::string(async_name(mode)).c_str(), w, where.c_str());
  }

  // The test of the test: the same pp run on the batches in loader order.
  const Run plain = train(spec, data, pp_o, *replica);
  std::string where2;
  double w2 = worst(plain, concat, &where2);
  world().all_reduce(&w2, &w2, 1, DType::f64, ReduceOp::max);
  EXPECT_GT(w2, 100 * kRel) << kind << ": the micro-batches' grouping changed nothing";
  if (world().rank() == 0) {
    std::printf("%s %s: pp2 on the batches in loader order against it: %.2g\n", kind.c_str(),
                std::string(async_name(mode)).c_str(), w2);
  }
}

// Tensor parallelism inside the stages changes no micro-batch: tp 2 x pp 2
// async equals pp 2 async on the same batches, each rank's pieces the same
// boxes of the pp run's parameters.
void check_tensor_parallel_equals_pp(const std::string& kind, AsyncMode mode) {
  ASSERT_EQ(world().size(), 4);
  const ModelSpec spec = spec_of(kind);
  auto data = std::make_shared<test::SyntheticData>(spec, 96, 5);
  const TrainerOptions tp_o = options(spec, mode, 1, 4, 2);
  const Run tensor = train(spec, data, tp_o, world());
  const Mesh& mesh = tp_o.dist.plan->mesh;
  auto group =
      world().split(mesh.coord(world().rank(), "tp"), mesh.coord(world().rank(), "pp"), "pp_of_tp");
  const Run plain = train(spec, data, options(spec, mode, 1, 2), *group);
  ASSERT_EQ(plain.stage, tensor.stage);
  EXPECT_FALSE(tensor.boxes.empty()) << "no parameter is split over tp";
  std::string where;
  const double w = worst(tensor, plain, &where);
  EXPECT_LE(w, kRel) << kind << " " << async_name(mode) << ": worst at " << where << " on rank "
                     << world().rank();
  if (world().rank() == 0) {
    std::printf("%s %s: tp2 x pp2 against pp2: worst %.2g (%s)\n", kind.c_str(),
                std::string(async_name(mode)).c_str(), w, where.c_str());
  }
}

TEST(PipelineAsyncHybrid, GptPipeDreamTp2xPp2EqualsPp2) {
  check_tensor_parallel_equals_pp("gpt", AsyncMode::pipedream);
}

TEST(PipelineAsyncHybrid, GptSpecTrainTp2xPp2EqualsPp2) {
  check_tensor_parallel_equals_pp("gpt", AsyncMode::spectrain);
}

TEST(PipelineAsyncHybrid, MlpPipeDreamDp2xPp2EqualsPp2OnConcatenatedReplicas) {
  check_hybrid_equals_concatenated("mlp", AsyncMode::pipedream);
}

TEST(PipelineAsyncHybrid, GptPipeDreamDp2xPp2EqualsPp2OnConcatenatedReplicas) {
  check_hybrid_equals_concatenated("gpt", AsyncMode::pipedream);
}

TEST(PipelineAsyncHybrid, GptSpecTrainDp2xPp2EqualsPp2OnConcatenatedReplicas) {
  check_hybrid_equals_concatenated("gpt", AsyncMode::spectrain);
}

}  // namespace
}  // namespace mt

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  mt::world();  // initialise MPI before any test
  return RUN_ALL_TESTS();
}
