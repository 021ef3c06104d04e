#include "dp_harness.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>

#include <fmt/format.h>

#include "meshtrain/base/random.h"
#include "meshtrain/data/loader.h"
#include "meshtrain/exec/executor.h"
#include "meshtrain/graph/autodiff.h"
#include "meshtrain/train/grad_clip.h"
#include "meshtrain/train/param_store.h"

namespace mt::test {

namespace {

bool is_gpt(const ModelSpec& s) {
  return s.kind == "gpt";
}

int64_t image_numel(const ModelSpec& s) {
  return s.image_channels * s.image_size * s.image_size;
}

ExecOptions exec_options(bool recompute) {
  ExecOptions o;
  o.recompute = recompute;
  o.backend = "reference";  // the fast backend is process-wide, not for rank threads
  o.profile = false;
  return o;
}

// One model instance for `batch` examples: forward + backward graph and its executor.
struct Model {
  ModelGraph m;
  std::unique_ptr<Executor> exec;

  Model(const ModelSpec& spec, int64_t batch, bool recompute) : m(build_model(spec, batch)) {
    build_backward(m.graph, m.loss);
    exec = std::make_unique<Executor>(m.graph, exec_options(recompute));
    for (auto& [id, t] : m.constants) exec->bind(id, t);
  }
  void feed(const Batch& b) {
    exec->bind(m.x, b.x.reshape(m.graph.value(m.x).shape));
    exec->bind(m.y, b.y);
  }
};

std::vector<float> copy_flat(const Tensor& t) {
  const float* p = t.data<float>();
  return std::vector<float>(p, p + t.numel());
}

}  // namespace

SyntheticData::SyntheticData(const ModelSpec& spec, int64_t n, uint64_t seed) : spec_(spec), n_(n) {
  Rng rng(seed);
  if (is_gpt(spec)) {
    // Sequences with structure (token t+1 depends on token t) so the loss moves.
    tokens_.resize(static_cast<size_t>(n * (spec.seq_len + 1)));
    for (int64_t i = 0; i < n; ++i) {
      int32_t t = static_cast<int32_t>(rng.uniform(0, static_cast<double>(spec.vocab)));
      for (int64_t k = 0; k <= spec.seq_len; ++k) {
        tokens_[static_cast<size_t>(i * (spec.seq_len + 1) + k)] =
            t % static_cast<int32_t>(spec.vocab);
        t = (3 * t + 1 + static_cast<int32_t>(rng.uniform(0, 2))) %
            static_cast<int32_t>(spec.vocab);
      }
    }
  } else {
    const int64_t d = image_numel(spec);
    x_.resize(static_cast<size_t>(n * d));
    labels_.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      const int32_t c = static_cast<int32_t>(i % spec.classes);
      labels_[static_cast<size_t>(i)] = c;
      for (int64_t k = 0; k < d; ++k) {
        x_[static_cast<size_t>(i * d + k)] =
            static_cast<float>(rng.normal() * 0.5 + (k % spec.classes == c ? 1.0 : 0.0));
      }
    }
  }
}

Batch SyntheticData::gather(std::span<const int64_t> indices) const {
  const auto k = static_cast<int64_t>(indices.size());
  Batch b;
  if (is_gpt(spec_)) {
    const int64_t T = spec_.seq_len;
    b.x = Tensor::empty({k, T}, DType::i32);
    b.y = Tensor::empty({k * T}, DType::i32);
    for (int64_t i = 0; i < k; ++i) {
      const int32_t* seq = tokens_.data() + indices[static_cast<size_t>(i)] * (T + 1);
      std::memcpy(b.x.data<int32_t>() + i * T, seq, static_cast<size_t>(T) * 4);
      std::memcpy(b.y.data<int32_t>() + i * T, seq + 1, static_cast<size_t>(T) * 4);
    }
  } else {
    const int64_t d = image_numel(spec_);
    b.x = Tensor::empty({k, d}, DType::f32);
    b.y = Tensor::empty({k}, DType::i32);
    for (int64_t i = 0; i < k; ++i) {
      const int64_t j = indices[static_cast<size_t>(i)];
      std::memcpy(b.x.data<float>() + i * d, x_.data() + j * d, static_cast<size_t>(d) * 4);
      b.y.data<int32_t>()[i] = labels_[static_cast<size_t>(j)];
    }
  }
  return b;
}

}  // namespace mt::test

namespace mt::test {

ParamLayout layout_of(const ParamStore& store) {
  ParamLayout l;
  for (const ParamStore::Entry& e : store.entries()) l.push_back({e.name, e.shape, e.offset});
  return l;
}

std::vector<ParamRef> refs_of(std::span<ParamSlice> slices) {
  std::vector<ParamRef> refs;
  for (ParamSlice& s : slices) refs.push_back(ParamRef{s.name, s.param, s.grad, s.full_rank()});
  return refs;
}

ModelSpec small_mlp() {
  ModelSpec s;
  s.kind = "mlp";
  s.image_channels = 1;
  s.image_size = 4;
  s.classes = 5;
  s.hidden = {24, 16};
  return s;
}

ModelSpec small_gpt() {
  ModelSpec s;
  s.kind = "gpt";
  s.layers = 1;
  s.d_model = 16;
  s.heads = 2;
  s.seq_len = 6;
  s.vocab = 24;
  return s;
}

namespace {
constexpr int64_t kExamples = 512;
constexpr uint64_t kDataSeed = 99;
}  // namespace

Trajectory run_reference(const TrainSetup& s) {
  SyntheticData data(s.spec, kExamples, kDataSeed);
  LoaderOptions lo;
  lo.batch_size = s.global_batch;
  lo.seed = s.seed;
  DataLoader loader(data, lo);
  Model model(s.spec, s.global_batch, s.recompute);
  ParamStore store(model.m.graph, s.seed, /*with_grads=*/true);
  store.bind(*model.exec, model.m.graph, /*with_grads=*/true);
  std::unique_ptr<Optimizer> opt = make_optimizer(s.optimizer, s.optim);
  std::vector<ParamRef> refs;
  for (auto& e : store.entries()) refs.push_back(ParamRef{e.name, e.value, e.grad});
  Trajectory out;
  for (int step = 0; step < s.steps; ++step) {
    model.feed(loader.batch(0, step));
    model.exec->run();
    if (s.clip > 0) clip_grad_norm(refs, s.clip);
    opt->step(refs, s.lr);
    out.push_back(copy_flat(store.flat_values()));
  }
  return out;
}

RankTrainer::RankTrainer(Communicator& comm, const TrainSetup& setup, const DpRun& run)
    : s(setup),
      K(run.dp.accumulation_steps),
      data(std::make_unique<SyntheticData>(setup.spec, kExamples, kDataSeed)) {
  if (s.global_batch % K != 0) throw ConfigError("test: global batch not divisible by K");
  // Each micro-step's global batch is B/K examples; micro-step k of step t
  // is loader step t*K + k, so the K micro-batches of all ranks together
  // are exactly the reference's batch of step t.
  LoaderOptions lo;
  lo.batch_size = s.global_batch / K;
  lo.seed = s.seed;
  lo.rank = comm.rank();
  lo.world_size = comm.size();
  lo.shares = run.shares;
  loader = std::make_unique<DataLoader>(*data, lo);
  local_batch = loader->batch(0, 0).size();
  model = std::make_unique<ModelGraph>(build_model(s.spec, local_batch));
  build_backward(model->graph, model->loss);
  exec = std::make_unique<Executor>(model->graph, exec_options(s.recompute));
  for (auto& [id, t] : model->constants) exec->bind(id, t);
  store = std::make_unique<ParamStore>(model->graph, s.seed);
  dp = std::make_unique<DataParallel>(comm, layout_of(*store), store->flat_values(), run.dp);
  dp->attach(*exec, model->graph);
  opt = make_optimizer(s.optimizer, s.optim);
  opt->set_norm_reducer(dp->norm_reducer());
  world = comm.size();
}

RankTrainer::~RankTrainer() = default;

void RankTrainer::step() {
  for (int k = 0; k < K; ++k) {
    const Batch b = loader->batch(0, next_step * K + k);
    exec->bind(model->x, b.x.reshape(model->graph.value(model->x).shape));
    exec->bind(model->y, b.y);
    const double w = s.equal_weights
                         ? 1.0 / static_cast<double>(world * K)
                         : static_cast<double>(b.size()) / static_cast<double>(s.global_batch);
    dp->begin_micro_step(w);
    exec->run();
    dp->end_micro_step();
  }
  dp->step([&](std::span<ParamSlice> slices) {
    std::vector<ParamRef> refs = refs_of(slices);
    if (s.clip > 0) clip_grad_norm(refs, s.clip, dp->norm_reducer());
    opt->step(refs, s.lr);
  });
  ++next_step;
}

std::vector<float> RankTrainer::full_params() {
  Tensor full = Tensor::zeros({store->flat_values().numel()}, DType::f32);
  dp->gather_params(full);
  return copy_flat(full);
}

DpResult run_data_parallel(const TrainSetup& s, const DpRun& run) {
  DpResult result;
  result.memory.resize(static_cast<size_t>(run.world));
  result.stats.resize(static_cast<size_t>(run.world));
  result.step_cost.resize(static_cast<size_t>(run.world));
  result.counters.resize(static_cast<size_t>(run.world));
  result.buckets.resize(static_cast<size_t>(run.world));
  std::mutex mu;
  LocalWorldOptions lw = run.local;
  lw.size = run.world;
  LocalWorld::run(lw, [&](Communicator& comm) {
    const auto r = static_cast<size_t>(comm.rank());
    RankTrainer t(comm, s, run);
    Trajectory mine;
    for (int step = 0; step < s.steps; ++step) {
      if (step + 1 == s.steps) comm.reset_counters();
      t.step();
      if (step + 1 == s.steps) result.counters[r] = comm.counters();
      std::vector<float> full = t.full_params();
      if (r == 0) mine.push_back(std::move(full));
    }
    std::lock_guard<std::mutex> lock(mu);
    result.memory[r] =
        t.dp->memory(static_cast<int>(t.opt->state_kinds().size()), t.opt->state_bytes());
    result.stats[r] = t.dp->stats();
    result.step_cost[r] = t.dp->step_cost();
    result.buckets[r] = static_cast<int64_t>(t.dp->plan().buckets().size());
    if (r == 0) result.params = std::move(mine);
  });
  return result;
}

Divergence compare(const TrainSetup& s, const Trajectory& got, const Trajectory& want,
                   double floor_fraction) {
  Divergence d;
  if (got.size() != want.size()) {
    d.worst = INFINITY;
    d.where = fmt::format("{} steps recorded, want {}", got.size(), want.size());
    return d;
  }
  // Names per flat element, from a ParamStore of the same model.
  ModelGraph mg = build_model(s.spec, 1);
  ParamStore store(mg.graph, s.seed);
  for (size_t t = 0; t < got.size(); ++t) {
    if (got[t].size() != want[t].size()) {
      d.worst = INFINITY;
      d.where = fmt::format("step {}: {} elements, want {}", t, got[t].size(), want[t].size());
      return d;
    }
    for (const ParamStore::Entry& e : store.entries()) {
      double scale = 0;
      for (int64_t i = 0; i < e.shape.numel(); ++i) {
        scale = std::max(scale, std::abs(double{want[t][static_cast<size_t>(e.offset + i)]}));
      }
      const double floor = std::max(floor_fraction * scale, 1e-30);
      for (int64_t i = 0; i < e.shape.numel(); ++i) {
        const auto k = static_cast<size_t>(e.offset + i);
        const double a = got[t][k], b = want[t][k];
        const double err = std::abs(a - b) / std::max(std::abs(b), floor);
        if (!(err <= d.worst)) {
          d.worst = std::isnan(err) ? INFINITY : err;
          d.where = fmt::format(
              "step {}, '{}'[{}]: got {:.9g}, want {:.9g} (largest |value| of "
              "the tensor {:.3g})",
              t, e.name, i, a, b, scale);
        }
      }
    }
  }
  return d;
}

}  // namespace mt::test
