#include "meshtrain/train/trainer.h"

#include <sys/resource.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "meshtrain/base/timer.h"
#include "meshtrain/data/loader.h"
#include "meshtrain/graph/autodiff.h"
#include "meshtrain/graph/builder.h"
#include "meshtrain/tensor/kernels.h"
#include "meshtrain/train/grad_clip.h"
#include "meshtrain/train/metrics.h"
#include "meshtrain/train/param_store.h"
#include "meshtrain/train/progress.h"
#include "meshtrain/train/train_state.h"

namespace mt {

namespace {

// Steps at the start of a run whose timings are left out of the median
// (first-touch page faults, primitive creation, cache warm-up).
constexpr int64_t kWarmupSteps = 5;

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int64_t peak_rss_bytes() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<int64_t>(ru.ru_maxrss) * 1024;
}

// A forward-only copy of the model at one batch size, sharing the trainer's
// parameters, for evaluation.
struct EvalModel {
  ModelGraph model;
  std::unique_ptr<Executor> exec;
};

}  // namespace

struct Trainer::Impl {
  ModelSpec spec;
  TrainerOptions o;
  std::shared_ptr<const Dataset> train_data, test_data;

  ModelGraph model;
  ValueId loss_scale_in = kNoValue;  // f16 only: the scalar the loss is multiplied by
  Tensor loss_scale;
  std::unique_ptr<Executor> exec;
  std::unique_ptr<ParamStore> store;
  std::vector<ParamRef> refs;
  std::unique_ptr<DataLoader> loader;
  std::unique_ptr<Optimizer> optimizer;
  std::unique_ptr<LrSchedule> schedule;
  DynamicLossScaler scaler;
  std::map<int64_t, EvalModel> eval_models;
  int64_t total_steps = 0;
  int64_t step = 0;  // optimizer steps completed

  Impl(const ModelSpec& s, std::shared_ptr<const Dataset> tr, std::shared_ptr<const Dataset> te,
       TrainerOptions opts)
      : spec(s),
        o(std::move(opts)),
        train_data(std::move(tr)),
        test_data(std::move(te)),
        scaler(o.loss_scaler) {
    if (o.precision != DType::f32 && o.precision != DType::bf16 && o.precision != DType::f16) {
      throw ConfigError(fmt::format("train.precision: expected f32, bf16 or f16, got {}",
                                    dtype_name(o.precision)));
    }
    if (o.threads < 1)
      throw ConfigError(fmt::format("train.threads: must be >= 1, got {}", o.threads));
    kernels(o.exec.backend).set_num_threads(o.threads);
    spec.compute = o.precision;

    model = build_model(spec, o.batch_size);
    ValueId objective = model.loss;
    if (o.precision == DType::f16) {
      Builder b(model.graph);
      loss_scale_in = b.input("loss_scale", {}, DType::f32);
      objective = b.mul(model.loss, loss_scale_in);
      loss_scale = Tensor::full({}, DType::f32, scaler.scale());
    }
    build_backward(model.graph, objective);
    ExecOptions eo = o.exec;
    eo.outputs.push_back(model.loss);  // the unscaled loss, for metrics
    exec = std::make_unique<Executor>(model.graph, eo);
    store = std::make_unique<ParamStore>(model.graph, o.seed);
    store->bind(*exec, model.graph, /*with_grads=*/true);
    for (auto& [id, t] : model.constants) exec->bind(id, t);
    if (loss_scale_in != kNoValue) exec->bind(loss_scale_in, loss_scale);
    for (auto& e : store->entries()) refs.push_back(ParamRef{e.name, e.value, e.grad});

    LoaderOptions lo;
    lo.batch_size = o.batch_size;
    lo.seed = o.seed;
    loader = std::make_unique<DataLoader>(*train_data, lo);
    total_steps = o.epochs * loader->steps_per_epoch();
    if (o.max_steps > 0) total_steps = std::min(total_steps, o.max_steps);
    if (total_steps <= 0) {
      throw ConfigError(
          fmt::format("train.epochs / train.steps: the run has no steps (epochs {}, "
                      "steps {}, {} steps per epoch)",
                      o.epochs, o.max_steps, loader->steps_per_epoch()));
    }
    LrScheduleOptions so = o.schedule;
    so.total_steps = std::max<int64_t>(total_steps, so.warmup_steps + 1);
    schedule = std::make_unique<LrSchedule>(so);
    optimizer = make_optimizer(o.optimizer, o.optim);
    if (!o.resume_path.empty()) resume(o.resume_path);
  }

  TrainState make_state() {
    TrainState st;
    for (auto& e : store->entries()) st.params[e.name] = e.value;
    st.optimizer = std::string(optimizer->name());
    st.optimizer_state = optimizer->state();
    st.step = step;
    st.epoch = step / loader->steps_per_epoch();
    st.lr_step = step;
    st.loss_scaler = scaler.state();
    st.extra["model"] = spec.kind;
    st.extra["seed"] = std::to_string(o.seed);
    return st;
  }

  void save(const std::string& path) { save_train_state(path, make_state()); }

  void resume(const std::string& path) {
    TrainState st;
    for (auto& e : store->entries()) st.params[e.name] = e.value;
    st.optimizer = std::string(optimizer->name());
    load_train_state(path, st);
    optimizer->load_state(st.optimizer_state);
    scaler.load_state(st.loss_scaler);
    step = st.step;
  }

  EvalModel& eval_model(int64_t batch) {
    auto it = eval_models.find(batch);
    if (it != eval_models.end()) return it->second;
    EvalModel em;
    em.model = build_model(spec, batch);
    ExecOptions eo = o.exec;
    eo.outputs = {em.model.logits};
    eo.recompute = false;
    em.exec = std::make_unique<Executor>(em.model.graph, eo);
    store->bind(*em.exec, em.model.graph, /*with_grads=*/false);
    for (auto& [id, t] : em.model.constants) em.exec->bind(id, t);
    return eval_models.emplace(batch, std::move(em)).first->second;
  }

  std::pair<double, double> evaluate() {
    LoaderOptions lo;
    lo.batch_size = std::min<int64_t>(o.eval_batch_size, test_data->size());
    lo.shuffle = false;
    lo.drop_last = false;
    DataLoader tl(*test_data, lo);
    double loss_sum = 0;
    int64_t correct = 0, count = 0;
    for (int64_t s = 0; s < tl.steps_per_epoch(); ++s) {
      Batch b = tl.batch(0, s);
      const int64_t n = b.size();
      EvalModel& em = eval_model(n);
      const Graph& g = em.model.graph;
      em.exec->bind(em.model.x, b.x.reshape(g.value(em.model.x).shape));
      em.exec->bind(em.model.y, b.y);
      em.exec->run_forward();
      Tensor logits = em.exec->get(em.model.logits);
      const int64_t rows = logits.shape()[0], classes = logits.shape()[1];
      loss_sum += em.exec->get(em.model.loss).item() * static_cast<double>(rows);
      const float* l = logits.data<float>();
      const int32_t* y = b.y.data<int32_t>();
      for (int64_t r = 0; r < rows; ++r) {
        const float* row = l + r * classes;
        const int64_t arg = std::max_element(row, row + classes) - row;
        correct += arg == y[r] ? 1 : 0;
      }
      count += rows;
    }
    return {loss_sum / static_cast<double>(count),
            static_cast<double>(correct) / static_cast<double>(count)};
  }

  TrainResult run() {
    MetricsWriter metrics(o.metrics_path);
    Progress progress(total_steps, o.log_every, o.progress);
    TrainResult r;
    std::vector<double> rates;
    const int64_t spe = loader->steps_per_epoch();
    const int64_t first = step;
    bool evaluated_last = false;
    const int64_t stop =
        o.halt_after > 0 ? std::min(total_steps, first + o.halt_after) : total_steps;
    for (; step < stop;) {
      const int64_t epoch = step / spe, s = step % spe;
      Batch b = loader->batch(epoch, s);
      Stopwatch sw;
      exec->bind(model.x, b.x.reshape(model.graph.value(model.x).shape));
      exec->bind(model.y, b.y);
      if (loss_scale_in != kNoValue) loss_scale.fill(scaler.scale());
      exec->run();
      const double loss = exec->get(model.loss).item();
      if (!std::isfinite(loss) && o.precision != DType::f16) {
        throw Error(
            fmt::format("training diverged: loss is {} at step {} (epoch {}); lower "
                        "optim.lr or enable optim.clip_grad_norm",
                        loss, step, epoch));
      }
      bool apply = true;
      if (o.precision == DType::f16) apply = scaler.update(scaler.unscale_and_check(refs));
      const double lr = schedule->lr_at(step);
      if (apply) {
        if (o.clip_grad_norm > 0) clip_grad_norm(refs, o.clip_grad_norm);
        optimizer->step(refs, lr);
      }
      const double dt = sw.seconds();
      const double rate = static_cast<double>(b.size()) / dt;
      if (step - first >= kWarmupSteps) rates.push_back(rate);
      if (step - first == kWarmupSteps) exec->reset_profile();
      r.losses.push_back(loss);
      r.final_loss = loss;
      ++step;
      evaluated_last = false;
      if (step % o.log_every == 0 || step == stop) {
        metrics.write({{"step", step}, {"loss", loss}, {"samples_per_s", rate}, {"lr", lr}});
      }
      progress.update(step - 1, loss, rate, lr);
      if (o.eval && (step % spe == 0)) {
        auto [tl, ta] = evaluate();
        metrics.write({{"epoch", epoch + 1}, {"test_loss", tl}, {"test_accuracy", ta}});
        progress.message(fmt::format("epoch {}: test loss {:.4f}, test accuracy {:.2f}%", epoch + 1,
                                     tl, 100.0 * ta));
        r.test_loss = tl;
        r.test_accuracy = ta;
        evaluated_last = true;
      }
      if (o.checkpoint_every > 0 && step % o.checkpoint_every == 0 && !o.checkpoint_path.empty()) {
        save(o.checkpoint_path);
      }
    }
    progress.finish();
    if (o.eval && !evaluated_last && step == total_steps) {
      auto [tl, ta] = evaluate();
      metrics.write({{"epoch", static_cast<double>(step) / static_cast<double>(spe)},
                     {"test_loss", tl},
                     {"test_accuracy", ta}});
      r.test_loss = tl;
      r.test_accuracy = ta;
    }
    if (!o.checkpoint_path.empty()) save(o.checkpoint_path);

    r.steps = step;
    r.samples_per_s = median(rates);
    double mm_flops = 0, mm_ns = 0;
    for (const OpProfile& p : exec->profile()) {
      if (p.op == OpKind::matmul) {
        mm_flops += p.flops * static_cast<double>(p.calls);
        mm_ns += static_cast<double>(p.total_ns);
      }
    }
    r.matmul_gflops = mm_ns > 0 ? mm_flops / mm_ns : 0.0;
    r.planned_arena_bytes = exec->memory_plan().arena_bytes;
    nlohmann::json summary = {{"summary", true},
                              {"steps", r.steps},
                              {"final_loss", r.final_loss},
                              {"samples_per_s", r.samples_per_s},
                              {"matmul_gflops", r.matmul_gflops},
                              {"planned_arena_bytes", r.planned_arena_bytes},
                              {"param_bytes", store->numel() * 4},
                              {"peak_rss_bytes", peak_rss_bytes()},
                              {"threads", o.threads},
                              {"precision", std::string(dtype_name(o.precision))}};
    if (o.eval) {
      summary["test_loss"] = r.test_loss;
      summary["test_accuracy"] = r.test_accuracy;
    }
    metrics.write(summary);
    return r;
  }
};

Trainer::Trainer(const ModelSpec& model, std::shared_ptr<const Dataset> train_data,
                 std::shared_ptr<const Dataset> test_data, TrainerOptions options)
    : impl_(std::make_unique<Impl>(model, std::move(train_data), std::move(test_data),
                                   std::move(options))) {}
Trainer::~Trainer() = default;
TrainResult Trainer::run() {
  return impl_->run();
}
std::pair<double, double> Trainer::evaluate() {
  return impl_->evaluate();
}
const Graph& Trainer::train_graph() const {
  return impl_->model.graph;
}
const MemoryPlan& Trainer::memory_plan() const {
  return impl_->exec->memory_plan();
}
ParamStore& Trainer::params() {
  return *impl_->store;
}

}  // namespace mt
