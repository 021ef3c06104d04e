// Options pipelines used to refuse, under mpirun at 4 ranks (dp 2 x pp 2,
// 1F1B, 2 micro-batches), through the Trainer:
//   - train.precision = "bf16_storage": the runtime stashes the forwards'
//     activations in bf16; the run follows the single-process bf16_storage
//     run within the tolerance of the single-process bf16_storage test
//     (trainer_test.cpp, Bf16StorageTrainsNearItsF32Twin: 2% of the loss
//     per step), its stash is smaller than the f32 pipeline's, and it is
//     not the f32 run;
//   - train.precision = "auto": one decision for the job, rank 0's, on every
//     rank, even when the other ranks' measurements would decide otherwise;
//   - sync.codec on the dp axis: topk:1.0 equals the uncompressed dp x pp
//     run step by step (losses and every parameter piece, 1e-5 relative, as
//     sync_mpi_test.cpp's plain-DP check); with a real codec (topk:0.1,
//     qsgd:4) the dp communicator's bytes equal the codecs' prediction
//     exactly, and the run differs from the uncompressed one; under ZeRO
//     1-3 the buckets' compressed reduce-scatters (topk:1.0 equal to ZeRO,
//     bytes as predicted); without a dp axis it is refused, naming the key;
//     a run stopped and resumed with a codec is bitwise the uninterrupted
//     one.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "meshtrain/base/error.h"
#include "meshtrain/spmd/shorthand.h"
#include "meshtrain/train/pipeline_training.h"
#include "meshtrain/train/trainer.h"
#include "sync/dp_harness.h"
#include "train/mpi_world.h"

namespace mt {
namespace {

constexpr int kSteps = 8;

Communicator& world() {
  return test::mpi_world();
}

// Activations of 16 rows x 256 (a micro-batch of 16 at dp 2 x 2
// micro-batches) are 16 KiB: what both stash passes keep in bf16.
ModelSpec mlp_spec() {
  ModelSpec s;
  s.kind = "mlp";
  s.hidden = {256, 256, 256};
  return s;
}

TrainerOptions base_options() {
  TrainerOptions o;
  o.batch_size = 64;
  o.max_steps = kSteps;
  o.epochs = 1;
  o.progress = false;
  o.eval = false;
  o.seed = 3;
  o.exec.backend = "reference";
  o.optimizer = "sgd";
  o.optim.sgd.momentum = 0.9;
  o.schedule.lr = 0.05;
  return o;
}

// dp x pp (dp = world / pp) or pp alone over the whole world when dp == 1.
TrainerOptions pipelined(const ModelSpec& spec, TrainerOptions o, int dp = 2) {
  ParallelShorthand sh;
  sh.pp = world().size() / dp;
  sh.dp = dp;
  sh.microbatches = std::max(2, sh.pp);
  sh.schedule = ScheduleKind::one_f_one_b;
  const ModelGraph m = build_model(spec, o.batch_size);
  Plan p = expand_shorthand(sh, ShorthandModel{spec.kind, 1}, m.graph, world().size());
  validate_plan(p, m.graph, world().size(), o.batch_size, "parallel");
  o.dist.plan = std::make_shared<const Plan>(std::move(p));
  return o;
}

std::shared_ptr<test::SyntheticData> data_for(const ModelSpec& spec) {
  return std::make_shared<test::SyntheticData>(spec, 512, 5);  // 8 steps of 64
}

struct Outcome {
  std::vector<double> losses;
  std::map<std::string, std::vector<float>> params;  // the pieces this rank holds
  std::string precision;
  int64_t bf16_elements = 0, peak_stash = 0;
  uint64_t dp_bytes = 0, dp_predicted_per_step = 0;
};

Outcome run_pipeline(const ModelSpec& spec, const TrainerOptions& o) {
  Trainer t(spec, data_for(spec), nullptr, o, &world());
  PipelineTraining* p = t.pipeline();
  EXPECT_NE(p, nullptr);
  Outcome r;
  r.losses = t.run().losses;
  p->gather_params();  // ZeRO-3: whole again (collective); a no-op otherwise
  for (const std::string& n : p->param_names()) {
    const Tensor v = p->param(n);
    r.params[n].assign(v.data<float>(), v.data<float>() + v.numel());
  }
  r.precision = p->precision_mode();
  r.bf16_elements = p->bf16_stashed_elements();
  r.peak_stash = p->peak_stash_bytes();
  r.dp_bytes = p->dp_codec_bytes_sent();
  r.dp_predicted_per_step = p->dp_codec_bytes_predicted_per_step();
  return r;
}

std::string error_of(const ModelSpec& spec, const TrainerOptions& o) {
  try {
    Trainer t(spec, data_for(spec), nullptr, o, &world());
    t.run();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "no error";
}

// Worst relative difference of the losses and of every parameter piece.
double divergence(const Outcome& a, const Outcome& b) {
  double worst = 0;
  EXPECT_EQ(a.losses.size(), b.losses.size());
  for (size_t i = 0; i < std::min(a.losses.size(), b.losses.size()); ++i) {
    worst = std::max(worst, std::abs(a.losses[i] - b.losses[i]) / std::abs(b.losses[i]));
  }
  for (const auto& [name, va] : a.params) {
    const std::vector<float>& vb = b.params.at(name);
    double diff = 0, mag = 1e-3;
    for (size_t k = 0; k < va.size(); ++k) {
      diff = std::max(diff, std::abs(static_cast<double>(va[k]) - vb[k]));
      mag = std::max(mag, std::abs(static_cast<double>(vb[k])));
    }
    worst = std::max(worst, diff / mag);
  }
  return worst;
}

TEST(PipelineOptionsMpi, Bf16StorageFollowsTheSingleProcessRun) {
  const ModelSpec spec = mlp_spec();
  TrainerOptions single = base_options();
  single.bf16_storage = true;
  std::vector<double> ref;
  {
    Trainer t(spec, data_for(spec), nullptr, single, nullptr);
    ref = t.run().losses;
  }
  const Outcome f32 = run_pipeline(spec, pipelined(spec, base_options()));
  TrainerOptions o = pipelined(spec, base_options());
  o.bf16_storage = true;
  const Outcome bf = run_pipeline(spec, o);
  EXPECT_EQ(bf.precision, "bf16_storage");
  EXPECT_EQ(f32.precision, "f32");
  ASSERT_EQ(bf.losses.size(), ref.size());
  double worst = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    EXPECT_NEAR(bf.losses[i], ref[i], 0.02 * ref[i]) << "step " << i;
    worst = std::max(worst, std::abs(bf.losses[i] - ref[i]) / ref[i]);
  }
  // Every stage stashes activations in bf16, and holds fewer stashed
  // bytes at its peak than the f32 pipeline.
  EXPECT_GT(bf.bf16_elements, 0);
  EXPECT_EQ(f32.bf16_elements, 0);
  EXPECT_LT(bf.peak_stash, f32.peak_stash);
  // The rounding shows: not the f32 run.
  EXPECT_GT(divergence(bf, f32), 0.0);
  if (world().rank() == 0) {
    std::printf(
        "pipeline bf16_storage vs single-process bf16_storage: worst loss difference %.3g "
        "(bound 0.02); peak stash %lld bytes vs f32 %lld\n",
        worst, static_cast<long long>(bf.peak_stash), static_cast<long long>(f32.peak_stash));
  }
  // Refused with exec.recompute, as the single-process run refuses it.
  o.exec.recompute = true;
  EXPECT_NE(error_of(spec, o).find("exec.recompute = true"), std::string::npos)
      << error_of(spec, o);
}

TEST(PipelineOptionsMpi, AutoMakesOneDecisionOnEveryRank) {
  const ModelSpec spec = mlp_spec();
  const int me = world().rank();
  // bf16 matmuls made to look slower everywhere (so auto keeps f32
  // compute); the stash's casts free on rank 0 and ruinous elsewhere, or
  // the other way round: each rank measuring alone would decide
  // differently, so agreement means every rank took rank 0's decision.
  for (bool rank0_storage : {true, false}) {
    TrainerOptions o = pipelined(spec, base_options());
    o.max_steps = 2;
    o.precision_auto = true;
    o.exec.backend = "fast";  // the backend decide_precision measures
    o.bf16_rate_factor_for_testing = 0.5;
    o.storage_cost_factor_for_testing = (me == 0) == rank0_storage ? 0.0 : 1e9;
    const Outcome r = run_pipeline(spec, o);
    const std::string want = rank0_storage ? "bf16_storage" : "f32";
    EXPECT_EQ(r.precision, want) << "rank " << me;
    EXPECT_EQ(r.bf16_elements > 0, rank0_storage) << "rank " << me;
    int mine = r.precision == "bf16_storage" ? 1 : 0, sum = mine;
    world().all_reduce(&mine, &sum, 1, DType::i32, ReduceOp::sum);
    EXPECT_EQ(sum, rank0_storage ? world().size() : 0);
  }
}

TEST(PipelineOptionsMpi, CodecOnTheDpAxis) {
  const ModelSpec spec = mlp_spec();
  const Outcome plain = run_pipeline(spec, pipelined(spec, base_options()));
  EXPECT_EQ(plain.dp_bytes, 0u);
  TrainerOptions o = pipelined(spec, base_options());
  o.dist.sync.codec = "topk:1.0";
  const Outcome whole = run_pipeline(spec, o);
  const double d = divergence(whole, plain);
  if (world().rank() == 0) {
    std::printf("dp2 x pp2 topk:1.0 vs uncompressed: worst relative difference %.3g\n", d);
  }
  EXPECT_LE(d, 1e-5);
  EXPECT_EQ(whole.dp_bytes, whole.losses.size() * whole.dp_predicted_per_step);
  for (const char* codec : {"topk:0.1", "qsgd:4"}) {
    o.dist.sync.codec = codec;
    const Outcome c = run_pipeline(spec, o);
    EXPECT_GT(c.dp_predicted_per_step, 0u) << codec;
    EXPECT_EQ(c.dp_bytes, c.losses.size() * c.dp_predicted_per_step) << codec;
    EXPECT_LT(c.dp_predicted_per_step, whole.dp_predicted_per_step) << codec;
    EXPECT_GT(divergence(c, plain), 1e-4) << codec;  // the codec is used
    for (double l : c.losses) EXPECT_TRUE(std::isfinite(l)) << codec;
    if (world().rank() == 0) {
      std::printf("dp2 x pp2 %s: %llu dp bytes per step on rank 0 (topk:1.0 %llu)\n", codec,
                  static_cast<unsigned long long>(c.dp_predicted_per_step),
                  static_cast<unsigned long long>(whole.dp_predicted_per_step));
    }
  }
  // Refused on a mesh without a dp axis (no exchange to compress).
  TrainerOptions pp = pipelined(spec, base_options(), 1);
  pp.dist.sync.codec = "topk:0.1";
  const std::string pe = error_of(spec, pp);
  EXPECT_NE(pe.find("has no dp axis"), std::string::npos) << pe;
}

// ZeRO 1-3 on the dp axis with a codec: each bucket's reduce-scatter is
// plain ZeRO's compressed one. topk:1.0 equals ZeRO without a codec step by
// step (1e-5, as sync_mpi_test.cpp's plain-ZeRO check); the dp
// communicator's bytes of a bf16 and a topk:0.1 run differ by exactly the
// codecs' predicted difference (ZeRO's f32 parameter all-gathers are the
// same in both); both learn.
TEST(PipelineOptionsMpi, CodecUnderZero) {
  const ModelSpec spec = mlp_spec();
  for (int64_t stage : {1, 2, 3}) {
    TrainerOptions o = pipelined(spec, base_options());
    o.dist.dp.stage = stage;
    const Outcome plain = run_pipeline(spec, o);
    o.dist.sync.codec = "topk:1.0";
    const Outcome whole = run_pipeline(spec, o);
    const double d = divergence(whole, plain);
    if (world().rank() == 0) {
      std::printf("dp2 x pp2 ZeRO-%lld topk:1.0 vs ZeRO: worst relative difference %.3g\n",
                  static_cast<long long>(stage), d);
    }
    EXPECT_LE(d, 1e-5) << "ZeRO-" << stage;
    o.dist.sync.codec = "bf16";
    const Outcome half = run_pipeline(spec, o);
    o.dist.sync.codec = "topk:0.1";
    const Outcome tenth = run_pipeline(spec, o);
    const auto steps = static_cast<int64_t>(half.losses.size());
    EXPECT_EQ(static_cast<int64_t>(half.dp_bytes) - static_cast<int64_t>(tenth.dp_bytes),
              steps * (static_cast<int64_t>(half.dp_predicted_per_step) -
                       static_cast<int64_t>(tenth.dp_predicted_per_step)))
        << "ZeRO-" << stage;
    EXPECT_GT(half.dp_predicted_per_step, tenth.dp_predicted_per_step);
    if (world().rank() == 0) {
      std::printf("ZeRO-%lld: bf16 / topk:0.1 differ from ZeRO by %.3g / %.3g\n",
                  static_cast<long long>(stage), divergence(half, plain), divergence(tenth, plain));
    }
    for (const Outcome* r : {&half, &tenth}) {
      EXPECT_LT(r->losses.back(), r->losses.front()) << "ZeRO-" << stage;
      // The codec is used (bf16 with error feedback stays close: 3e-5).
      EXPECT_GT(divergence(*r, plain), 1e-6) << "ZeRO-" << stage;
    }
  }
}

// The codecs' residuals (and qsgd's seeds) are each rank's row of the
// checkpoint: stopped after step 5 and resumed, a dp2 x pp2 run with a codec
// is bitwise the uninterrupted one (the residuals held back at step 5 are
// sent later; restarted from zero the run differs).
TEST(PipelineOptionsMpi, CodecStateResumesExactly) {
  const ModelSpec spec = mlp_spec();
  for (const char* codec : {"topk:0.1", "qsgd:4", "zero2 topk:0.1"}) {
    TrainerOptions o = pipelined(spec, base_options());
    const std::string_view c = codec;
    o.dist.sync.codec = std::string(c.starts_with("zero2 ") ? c.substr(6) : c);
    if (c.starts_with("zero2 ")) o.dist.dp.stage = 2;
    const Outcome full = run_pipeline(spec, o);
    char tmpl[] = "/tmp/mt_pp_codec_XXXXXX";
    ASSERT_NE(world().rank() == 0 ? mkdtemp(tmpl) : tmpl, nullptr);
    std::string dir = tmpl;
    // Every rank writes into rank 0's directory.
    std::vector<char> buf(dir.size() + 1);
    std::copy(dir.c_str(), dir.c_str() + dir.size() + 1, buf.begin());
    world().broadcast(buf.data(), buf.size(), DType::u8, 0);
    dir = (std::string(buf.data()) + "/ck");
    TrainerOptions a = o;
    a.halt_after = 5;
    a.checkpoint_path = dir;
    const Outcome first = run_pipeline(spec, a);
    TrainerOptions b = o;
    b.resume_path = dir;
    const Outcome second = run_pipeline(spec, b);
    std::vector<double> stitched = first.losses;
    stitched.insert(stitched.end(), second.losses.begin(), second.losses.end());
    EXPECT_EQ(stitched, full.losses) << codec << ", rank " << world().rank();
    EXPECT_EQ(second.params, full.params) << codec << ", rank " << world().rank();
    EXPECT_NE(first.params, full.params) << codec;  // the run went on after the checkpoint
    world().barrier();
    if (world().rank() == 0) std::filesystem::remove_all(std::string(buf.data()));
  }
}

}  // namespace
}  // namespace mt

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  mt::world();  // initialise MPI before any test
  return RUN_ALL_TESTS();
}
