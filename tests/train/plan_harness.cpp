#include "train/plan_harness.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <utility>

#include "meshtrain/spmd/lower.h"
#include "meshtrain/tensor/box.h"
#include "meshtrain/train/pipeline_training.h"
#include "sync/dp_harness.h"
#include "train/mpi_world.h"

namespace mt::test {
namespace {

std::shared_ptr<const Dataset> or_synthetic(std::shared_ptr<const Dataset> data,
                                            const ModelSpec& spec) {
  return data != nullptr ? std::move(data) : std::make_shared<SyntheticData>(spec, 96, 5);
}

}  // namespace

ModelSpec plan_gpt(int64_t layers) {
  ModelSpec s;
  s.kind = "gpt";
  s.layers = layers;
  s.d_model = 24;
  s.heads = 6;
  s.seq_len = 8;
  s.vocab = 36;
  return s;
}

TrainerOptions plan_adamw_options(int steps) {
  TrainerOptions o;
  o.batch_size = 8;
  o.max_steps = steps;
  o.epochs = 1;
  o.progress = false;
  o.eval = false;
  o.seed = 3;
  o.exec.backend = "reference";
  o.optimizer = "adamw";
  o.optim.adamw.weight_decay = 0.01;
  o.schedule.lr = 0.003;
  o.schedule.kind = LrScheduleKind::cosine;
  o.clip_grad_norm = 0.5;
  return o;
}

Reference single_run(const ModelSpec& spec, const TrainerOptions& o,
                     std::shared_ptr<const Dataset> data,
                     std::shared_ptr<const Dataset> test_data) {
  Trainer t(spec, or_synthetic(std::move(data), spec), std::move(test_data), o, nullptr);
  const TrainResult r = t.run();
  Reference ref;
  ref.losses = r.losses;
  ref.test_loss = r.test_loss;
  for (const auto& e : t.params().entries()) ref.params[e.name] = e.value.clone();
  return ref;
}

PieceDiff compare_pieces(Trainer& t, const Reference& ref) {
  std::vector<std::pair<std::string, Tensor>> held;
  const LoweredProgram* lp = nullptr;
  if (PipelineTraining* p = t.pipeline()) {
    p->gather_params();  // ZeRO-3: whole from the dp group's shards; a no-op otherwise
    for (const std::string& n : p->param_names()) held.emplace_back(n, p->param(n));
    lp = p->lowered();
  } else {
    for (const auto& e : t.params().entries()) held.emplace_back(e.name, e.value);
    lp = t.lowered_program();
  }
  PieceDiff out;
  EXPECT_FALSE(held.empty());
  for (const auto& [name, got] : held) {
    const auto w = ref.params.find(name);
    EXPECT_NE(w, ref.params.end()) << name << " is not a parameter of the reference";
    if (w == ref.params.end()) continue;
    const Tensor& whole = w->second;
    const LoweredParam* bp = lp != nullptr ? lp->param(name) : nullptr;
    out.split |= bp != nullptr && !bp->axis.empty();
    const Box b = bp != nullptr ? bp->box : Box::whole(whole.shape());
    Tensor want = Tensor::empty(b.shape(), DType::f32);
    copy_box_out(whole, b, want);
    EXPECT_EQ(got.numel(), want.numel()) << name;
    if (got.numel() != want.numel()) continue;
    double diff = 0, mag = 1e-3;
    for (int64_t k = 0; k < want.numel(); ++k) {
      const double wk = want.data<float>()[k];
      diff = std::max(diff, std::abs(static_cast<double>(got.data<float>()[k]) - wk));
      mag = std::max(mag, std::abs(wk));
    }
    if (diff / mag > out.worst) out.worst = diff / mag, out.where = name;
  }
  return out;
}

PlanRun run_plan(const ModelSpec& spec, const TrainerOptions& o, const Reference* ref,
                 PlanRunChecks checks, std::shared_ptr<const Dataset> data,
                 std::shared_ptr<const Dataset> test_data) {
  Trainer t(spec, or_synthetic(std::move(data), spec), std::move(test_data), o, &mpi_world());
  const TrainResult r = t.run();
  PlanRun out;
  out.losses = r.losses;
  out.test_loss = r.test_loss;
  out.steps = r.steps;
  out.allocated = r.allocated;
  if (PipelineTraining* p = t.pipeline()) {
    p->gather_params();  // ZeRO-3: whole again (collective); a no-op otherwise
    for (const std::string& n : p->param_names()) out.param_numels.push_back(p->param(n).numel());
  } else {
    for (const auto& e : t.params().entries()) out.param_numels.push_back(e.value.numel());
  }
  if (ref == nullptr) return out;
  if (checks.pipeline_bytes) {
    if (PipelineTraining* p = t.pipeline()) {
      // The boundaries' and the shared gradients' bytes, as planned.
      EXPECT_EQ(p->pipeline_bytes_sent(), p->pipeline_bytes_predicted())
          << "rank " << mpi_world().rank();
    }
  }
  const PieceDiff d = compare_pieces(t, *ref);
  out.worst_param = d.worst;
  out.where = d.where;
  out.split = d.split;
  return out;
}

double worst_loss(const std::vector<double>& got, const Reference& ref, size_t first,
                  std::string* where) {
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double want = ref.losses.at(first + i);
    const double d = std::abs(got[i] - want) / std::abs(want);
    if (d > worst) worst = d, *where = "loss of step " + std::to_string(first + i);
  }
  return worst;
}

Divergence divergence(const PlanRun& got, const Reference& ref) {
  Divergence d;
  d.worst = worst_loss(got.losses, ref, 0, &d.where);
  if (got.worst_param > d.worst) d.worst = got.worst_param, d.where = "parameter " + got.where;
  return d;
}

void expect_within(const Divergence& d, double tol, const std::string& label) {
  if (mpi_world().rank() == 0) {
    std::printf("%s: worst relative error %.3g at %s\n", label.c_str(), d.worst, d.where.c_str());
  }
  EXPECT_LE(d.worst, tol) << label << " rank " << mpi_world().rank() << ": " << d.where;
}

std::string shared_tmp_dir(const char* what) {
  std::string dir = fmt::format("/tmp/mt-{}-{:010d}", what, ::getpid());  // same length everywhere
  mpi_world().broadcast(dir.data(), dir.size(), DType::u8, 0);
  std::filesystem::create_directories(dir);
  return dir;
}

void remove_shared_tmp_dir(const std::string& dir) {
  mpi_world().barrier();
  if (mpi_world().rank() == 0) std::filesystem::remove_all(dir);
}

void run_handover(const ModelSpec& spec, TrainerOptions first, TrainerOptions second, int steps,
                  const Reference& ref, const std::string& dir, Handover* out,
                  PlanRunChecks checks) {
  const int half = steps / 2;
  first.checkpoint_path = dir + "/ck";
  first.halt_after = half;
  second.resume_path = dir + "/ck";
  out->a = run_plan(spec, first, nullptr, checks);
  ASSERT_EQ(out->a.steps, half);
  out->b = run_plan(spec, second, &ref, checks);
  ASSERT_EQ(out->b.losses.size(), static_cast<size_t>(steps - half));  // the resumed steps
  EXPECT_EQ(out->b.steps, steps);
  Divergence& r = out->resumed;
  r.worst = worst_loss(out->b.losses, ref, static_cast<size_t>(half), &r.where);
  if (out->b.worst_param > r.worst) {
    r.worst = out->b.worst_param, r.where = "parameter " + out->b.where;
  }
  Divergence& w = out->worst;
  w.worst = worst_loss(out->a.losses, ref, 0, &w.where);
  if (r.worst > w.worst) w = r;
}

}  // namespace mt::test
