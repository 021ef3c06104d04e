#include "meshtrain/train/trainer.h"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <thread>

#include "meshtrain/base/timer.h"
#include "meshtrain/comm/backends/self/self_transport.h"
#include "meshtrain/data/loader.h"
#include "meshtrain/graph/autodiff.h"
#include "meshtrain/graph/builder.h"
#include "meshtrain/sync/consistency.h"
#include "meshtrain/sync/straggler.h"
#include "meshtrain/tensor/kernels.h"
#include "meshtrain/train/grad_clip.h"
#include "meshtrain/train/metrics.h"
#include "meshtrain/train/param_store.h"
#include "meshtrain/train/progress.h"
#include "meshtrain/train/sharded_checkpoint.h"
#include "meshtrain/train/timeline.h"
#include "meshtrain/train/train_state.h"
#include "meshtrain/train/training_plan.h"

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

// Rows [begin, begin + n) of a batch tensor, as a view (the batch outlives it).
Tensor rows(const Tensor& t, int64_t begin, int64_t n) {
  std::vector<int64_t> dims = t.shape().dims();
  const int64_t row = t.shape().prod(1, t.rank()) * static_cast<int64_t>(dtype_size(t.dtype()));
  dims[0] = n;
  auto* base = static_cast<char*>(const_cast<void*>(t.raw()));
  return Tensor::wrap(base + begin * row, Shape(dims), t.dtype());
}

ParamLayout layout_of(const ParamStore& store) {
  ParamLayout l;
  for (const auto& e : store.entries()) l.push_back(ParamLayoutEntry{e.name, e.shape, e.offset});
  return l;
}

// Of the time this rank spent in gradient collectives, the fraction that ran
// while it was computing (hidden behind forward/backward): from the timeline.
double hidden_comm_fraction(const std::vector<TimelineEvent>& events) {
  std::vector<std::pair<int64_t, int64_t>> compute, comm;
  for (const TimelineEvent& e : events) {
    const std::pair<int64_t, int64_t> iv{e.start_ns, e.start_ns + e.duration_ns};
    if (e.lane == Timeline::kCompute && (e.category == "forward" || e.category == "backward")) {
      compute.push_back(iv);
    } else if (e.lane == Timeline::kComm) {
      comm.push_back(iv);
    }
  }
  std::sort(compute.begin(), compute.end());
  double total = 0, hidden = 0;
  for (auto [b, e] : comm) {
    total += static_cast<double>(e - b);
    // Compute spans on one lane do not overlap each other.
    auto it = std::lower_bound(compute.begin(), compute.end(), std::make_pair(b, int64_t{0}));
    if (it != compute.begin()) --it;
    for (; it != compute.end() && it->first < e; ++it) {
      const int64_t lo = std::max(b, it->first), hi = std::min(e, it->second);
      if (hi > lo) hidden += static_cast<double>(hi - lo);
    }
  }
  return total > 0 ? hidden / total : 0.0;
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
  std::unique_ptr<Communicator> own_comm;  // world size 1 when no group is given
  Communicator* comm = nullptr;
  int rank = 0, world = 1;

  ModelGraph model;
  ValueId loss_scale_in = kNoValue;  // f16 only: the scalar the loss is multiplied by
  Tensor loss_scale;
  std::unique_ptr<Executor> exec;
  std::unique_ptr<ParamStore> store;
  std::unique_ptr<DataParallel> dp;
  std::unique_ptr<DataLoader> loader;
  std::unique_ptr<Optimizer> optimizer;
  std::unique_ptr<LrSchedule> schedule;
  DynamicLossScaler scaler;
  std::map<int64_t, EvalModel> eval_models;
  Timeline timeline;
  std::unique_ptr<ConsistencyChecker> consistency;
  std::unique_ptr<StragglerDetector> straggler;
  TrainingPlan plan;        // this rank's memory, planned before allocating
  int64_t local_batch = 0;  // this rank's share of each global batch
  int64_t micro_batch = 0;  // local_batch / accumulation steps
  int64_t total_steps = 0;
  int64_t step = 0;              // optimizer steps completed
  OptimizerState pending_state;  // single-file resume: whole tensors until sliced
  int64_t pending_updates = 0;   // sharded resume: optimizer updates so far

  Impl(const ModelSpec& s, std::shared_ptr<const Dataset> tr, std::shared_ptr<const Dataset> te,
       TrainerOptions opts, Communicator* group)
      : spec(s),
        o(std::move(opts)),
        train_data(std::move(tr)),
        test_data(std::move(te)),
        scaler(o.loss_scaler),
        timeline(TimelineOptions{!o.dist.trace_path.empty()}) {
    if (o.precision != DType::f32 && o.precision != DType::bf16 && o.precision != DType::f16) {
      throw ConfigError(fmt::format("train.precision: expected f32, bf16 or f16, got {}",
                                    dtype_name(o.precision)));
    }
    if (o.threads < 1) {
      throw ConfigError(fmt::format("train.threads: must be >= 1, got {}", o.threads));
    }
    if (group == nullptr) {
      own_comm = make_self_communicator();
      group = own_comm.get();
    }
    comm = group;
    rank = comm->rank();
    world = comm->size();
    kernels(o.exec.backend, o.exec.fast).set_num_threads(o.threads);
    spec.compute = o.precision;

    // This rank's slice of every global batch, split into micro-batches.
    LoaderOptions lo;
    lo.batch_size = o.batch_size;
    lo.seed = o.seed;
    lo.rank = rank;
    lo.world_size = world;
    lo.shares = o.dist.batch_shares;
    loader = std::make_unique<DataLoader>(*train_data, lo);
    const BatchSplit split = split_batch(o, rank, world);
    MT_CHECK_EQ(split.local_batch,
                loader->local_range(o.batch_size).second - loader->local_range(o.batch_size).first);
    local_batch = split.local_batch;
    micro_batch = split.micro_batch;

    // The graph and its memory plan come from training_plan.h, which
    // `meshtrain inspect` prints; nothing large is allocated before the plan
    // is checked against the memory this rank may use.
    TrainingGraph tg = build_training_graph(spec, o, micro_batch);
    plan = plan_training(tg, spec, o, split, rank, world, test_data ? test_data->size() : -1);
    if (o.memory_limit > 0) check_memory_fits(plan, spec, o, o.memory_limit);
    model = std::move(tg.model);
    loss_scale_in = tg.loss_scale_in;
    if (loss_scale_in != kNoValue) loss_scale = Tensor::full({}, DType::f32, scaler.scale());
    exec = std::make_unique<Executor>(model.graph, tg.exec);
    store = std::make_unique<ParamStore>(model.graph, o.seed);
    for (auto& [id, t] : model.constants) exec->bind(id, t);
    if (loss_scale_in != kNoValue) exec->bind(loss_scale_in, loss_scale);

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
    // Parameters (and optimizer state) must be final before DataParallel
    // copies its shard out of them (ZeRO-3).
    if (!o.resume_path.empty()) resume_params(o.resume_path);

    dp = std::make_unique<DataParallel>(*comm, layout_of(*store), store->flat_values(), o.dist.dp);
    dp->attach(*exec, model.graph);
    MT_CHECK_EQ(exec->memory_plan().arena_bytes, plan.activations.arena_bytes);
    optimizer->set_norm_reducer(dp->norm_reducer());
    if (!o.resume_path.empty()) resume_optimizer(o.resume_path);

    if (timeline.enabled()) {
      timeline.align(*comm);
      comm->set_call_observer([this](const CallEvent& e) {
        timeline.add(fmt::format("{} #{}", collective_name(e.kind), e.seq), "comm", e.start_ns,
                     e.end_ns, Timeline::kComm,
                     {{"bytes", e.bytes},
                      {"algorithm", std::string(algorithm_name(e.algorithm))},
                      {"ok", e.ok}});
      });
      exec->on_node_done(
          [this](const std::string& name, OpKind op, bool backward, int64_t t0, int64_t t1) {
            timeline.add(name, backward ? "backward" : "forward", t0, t1, Timeline::kCompute,
                         {{"op", std::string(op_name(op))}});
          });
    }
    if (world > 1 && o.dist.consistency_every > 0 && o.dist.dp.stage < 3) {
      ConsistencyChecker::NamedTensors named;
      for (auto& e : store->entries()) named.emplace_back(e.name, e.value);
      ConsistencyOptions co;
      co.every_steps = o.dist.consistency_every;
      consistency = std::make_unique<ConsistencyChecker>(*comm, std::move(named), co);
    }
    if (world > 1 && o.dist.straggler_report) {
      StragglerOptions so2;
      so2.threshold = o.dist.straggler_threshold;
      straggler = std::make_unique<StragglerDetector>(*comm, so2);
    }
  }

  bool leader() const { return rank == 0; }

  // Whole parameters into the store's flat buffer (a no-op but for ZeRO-3,
  // where the store's copy is stale after construction).
  void sync_store() {
    if (o.dist.dp.stage == 3) dp->gather_params(store->flat_values());
  }

  // Checkpoints. A path ending in ".safetensors" written by one process is a
  // single checksummed safetensors file; anything else is a sharded
  // checkpoint directory (every rank writes its part, an index ties them
  // together) that loads at any world size under any ZeRO stage.
  bool single_file(const std::string& path) const {
    return world == 1 && path.size() > 12 && path.ends_with(".safetensors");
  }

  std::map<std::string, std::string> state_metadata() const {
    std::map<std::string, std::string> m;
    m["optimizer"] = std::string(optimizer->name());
    m["step"] = std::to_string(step);
    m["epoch"] = std::to_string(step / loader->steps_per_epoch());
    m["lr_step"] = std::to_string(step);
    m["loss_scale"] = fmt::format("{}", scaler.state().scale);
    m["loss_scale_good_steps"] = std::to_string(scaler.state().good_steps);
    int64_t updates = 0;  // every parameter has been updated equally often
    for (const auto& [name, n] : optimizer->state().steps) updates = std::max(updates, n);
    m["optimizer_updates"] = std::to_string(updates);
    m["model"] = spec.kind;
    m["seed"] = std::to_string(o.seed);
    return m;
  }

  void save(const std::string& path) {
    if (single_file(path)) {
      sync_store();
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
      save_train_state(path, st);
      return;
    }
    std::vector<ShardPiece> pieces;
    for (ShardPiece p : dp->param_pieces(PieceUse::save)) {
      p.name = "param/" + p.name;
      pieces.push_back(std::move(p));
    }
    for (ShardPiece p : dp->state_pieces(optimizer->state().tensors, PieceUse::save)) {
      p.name = "optim/" + p.name;
      pieces.push_back(std::move(p));
    }
    SaveShardedOptions so;
    so.mode = o.dist.dp.stage == 0 ? "dp" : fmt::format("zero{}", o.dist.dp.stage);
    so.collective = o.dist.dp.collective;
    save_sharded(comm, path, pieces, state_metadata(), so);
  }

  static int64_t meta_int(const std::map<std::string, std::string>& m, const std::string& key,
                          const std::string& path) {
    auto it = m.find(key);
    try {
      if (it != m.end()) return std::stoll(it->second);
    } catch (const std::exception&) {
    }
    throw CheckpointError(
        fmt::format("checkpoint {}: metadata '{}' is missing or not a number", path, key));
  }

  // Whole parameters into the store (every rank), before DataParallel takes
  // its shard; scalars of the run. The optimizer state follows once the
  // slices are known (resume_optimizer).
  void resume_params(const std::string& path) {
    if (!is_sharded_checkpoint(path)) {
      TrainState st;
      for (auto& e : store->entries()) st.params[e.name] = e.value;
      st.optimizer = std::string(optimizer->name());
      load_train_state(path, st);
      pending_state = st.optimizer_state;
      scaler.load_state(st.loss_scaler);
      step = st.step;
      return;
    }
    std::vector<ShardPiece> wanted;
    for (auto& e : store->entries()) wanted.push_back(full_piece("param/" + e.name, e.value));
    LoadShardedOptions lo;
    lo.collective = o.dist.dp.collective;
    ShardedIndex idx = load_sharded(comm, path, wanted, lo);
    const auto& m = idx.metadata;
    auto opt = m.find("optimizer");
    if (opt == m.end() || opt->second != optimizer->name()) {
      throw CheckpointError(
          fmt::format("checkpoint {}: written with optimizer '{}' but this run uses '{}'", path,
                      opt == m.end() ? "?" : opt->second, optimizer->name()));
    }
    step = meta_int(m, "step", path);
    LossScalerState ls;
    ls.scale = std::stod(m.count("loss_scale") ? m.at("loss_scale") : "65536");
    ls.good_steps = meta_int(m, "loss_scale_good_steps", path);
    scaler.load_state(ls);
    pending_updates = meta_int(m, "optimizer_updates", path);
  }

  // This rank's slices of the optimizer state.
  void resume_optimizer(const std::string& path) {
    const std::vector<std::string> kinds = optimizer->state_kinds();
    OptimizerState st;
    if (!is_sharded_checkpoint(path)) {
      // A single file holds whole tensors: cut out this rank's slices.
      for (const ParamSlice& sl : dp->slices()) {
        if (sl.end == sl.begin) continue;
        for (const std::string& kind : kinds) {
          const std::string key = sl.name + "." + kind;
          auto it = pending_state.tensors.find(key);
          if (it == pending_state.tensors.end()) continue;
          Tensor part = Tensor::empty(sl.param.shape(), DType::f32);
          std::memcpy(part.raw(), it->second.data<float>() + sl.begin,
                      static_cast<size_t>(sl.end - sl.begin) * sizeof(float));
          st.tensors[key] = part;
        }
        auto n = pending_state.steps.find(sl.name);
        if (n != pending_state.steps.end()) st.steps[sl.name] = n->second;
      }
    } else {
      std::vector<ShardPiece> wanted = dp->new_state_pieces(kinds);
      for (ShardPiece& p : wanted) p.name = "optim/" + p.name;
      LoadShardedOptions lo;
      lo.collective = o.dist.dp.collective;
      load_sharded(comm, path, wanted, lo);
      for (ShardPiece& p : wanted) st.tensors[p.name.substr(6)] = p.data;
      if (pending_updates > 0) {
        for (const ParamSlice& sl : dp->slices()) {
          if (sl.end > sl.begin) st.steps[sl.name] = pending_updates;
        }
      }
    }
    optimizer->load_state(st);
    pending_state = {};
  }

  EvalModel& eval_model(int64_t batch) {
    auto it = eval_models.find(batch);
    if (it != eval_models.end()) return it->second;
    EvalModel em;
    em.model = build_model(spec, batch);
    ExecOptions eo = o.exec;
    eo.outputs = {em.model.logits, em.model.loss};
    eo.recompute = false;
    em.exec = std::make_unique<Executor>(em.model.graph, eo);
    // Evaluation reads the store's whole parameters (gathered first under
    // ZeRO-3 by evaluate()), so ranks may run different numbers of batches.
    store->bind(*em.exec, em.model.graph, /*with_grads=*/false);
    for (auto& [id, t] : em.model.constants) em.exec->bind(id, t);
    return eval_models.emplace(batch, std::move(em)).first->second;
  }

  // Each rank evaluates a contiguous slice of every test batch; sums are
  // combined across ranks.
  std::pair<double, double> evaluate() {
    sync_store();
    LoaderOptions lo;
    lo.batch_size = std::min<int64_t>(o.eval_batch_size, test_data->size());
    lo.shuffle = false;
    lo.drop_last = false;
    lo.rank = rank;
    lo.world_size = world;
    DataLoader tl(*test_data, lo);
    double sums[3] = {0, 0, 0};  // loss * rows, correct, rows
    for (int64_t s = 0; s < tl.steps_per_epoch(); ++s) {
      Batch b = tl.batch(0, s);
      const int64_t n = b.size();
      if (n == 0) continue;
      EvalModel& em = eval_model(n);
      const Graph& g = em.model.graph;
      em.exec->bind(em.model.x, b.x.reshape(g.value(em.model.x).shape));
      em.exec->bind(em.model.y, b.y);
      em.exec->run_forward();
      Tensor logits = em.exec->get(em.model.logits);
      const int64_t rws = logits.shape()[0], classes = logits.shape()[1];
      sums[0] += em.exec->get(em.model.loss).item() * static_cast<double>(rws);
      const float* l = logits.data<float>();
      const int32_t* y = b.y.data<int32_t>();
      for (int64_t r = 0; r < rws; ++r) {
        const float* row = l + r * classes;
        const int64_t arg = std::max_element(row, row + classes) - row;
        sums[1] += arg == y[r] ? 1 : 0;
      }
      sums[2] += static_cast<double>(rws);
    }
    comm->all_reduce(sums, sums, 3, DType::f64);
    return {sums[0] / sums[2], sums[1] / sums[2]};
  }

  // One optimizer step over K micro-batches; returns the mean loss over the
  // global batch (the same number on every rank).
  double train_step(int64_t epoch, int64_t s) {
    Batch b = loader->batch(epoch, s);
    const int k = o.dist.dp.accumulation_steps;
    // Each micro-batch's share of the global batch: the gradients of the
    // per-micro-batch mean losses, weighted by it and summed over ranks and
    // micro-steps, are the gradient of the global mean loss.
    const double weight = static_cast<double>(micro_batch) / static_cast<double>(o.batch_size);
    const int64_t y_per_example = b.y.numel() / local_batch;  // 1, or T for text
    double loss = 0;
    for (int m = 0; m < k; ++m) {
      auto span = timeline.span("forward+backward", "step");
      exec->bind(model.x,
                 rows(b.x, m * micro_batch, micro_batch).reshape(model.graph.value(model.x).shape));
      exec->bind(model.y, rows(b.y, m * micro_batch * y_per_example, micro_batch * y_per_example));
      if (loss_scale_in != kNoValue) loss_scale.fill(scaler.scale());
      dp->begin_micro_step(weight);
      exec->run();
      loss += weight * exec->get(model.loss).item();
      span.end();
      auto wait = timeline.span("gradient sync", "wait", Timeline::kWait);
      dp->end_micro_step();
    }
    comm->all_reduce(&loss, &loss, 1, DType::f64);
    if (!std::isfinite(loss) && o.precision != DType::f16) {
      throw Error(
          fmt::format("training diverged: loss is {} at step {} (epoch {}); lower "
                      "optim.lr or enable optim.clip_grad_norm",
                      loss, step, epoch));
    }
    const double lr = schedule->lr_at(step);
    auto span = timeline.span("optimizer", "optimizer");
    dp->step([&](std::span<ParamSlice> slices) {
      std::vector<ParamRef> refs;
      refs.reserve(slices.size());
      for (ParamSlice& p : slices) refs.push_back(ParamRef{p.name, p.param, p.grad, p.full_rank()});
      bool apply = true;
      if (o.precision == DType::f16) {
        apply = scaler.update(scaler.unscale_and_check(refs, dp->norm_reducer()));
      }
      if (!apply) return;
      if (o.clip_grad_norm > 0) clip_grad_norm(refs, o.clip_grad_norm, dp->norm_reducer());
      optimizer->step(refs, lr);
    });
    return loss;
  }

  TrainResult run() {
    MetricsWriter metrics(leader() ? o.metrics_path : std::string());
    Progress progress(total_steps, o.log_every, o.progress && leader());
    TrainResult r;
    std::vector<double> rates;
    const int64_t spe = loader->steps_per_epoch();
    const int64_t first = step;
    bool evaluated_last = false;
    const int64_t stop =
        o.halt_after > 0 ? std::min(total_steps, first + o.halt_after) : total_steps;
    for (; step < stop;) {
      const int64_t epoch = step / spe, s = step % spe;
      const double lr = schedule->lr_at(step);
      const double wait_before = dp->stats().wait_seconds;
      Stopwatch sw;
      const double loss = train_step(epoch, s);
      if (rank < static_cast<int>(o.dist.slowdown.size()) && o.dist.slowdown[rank] > 1.0) {
        // Stand in for a slower device: stretch this step's compute.
        const double compute = sw.seconds() - (dp->stats().wait_seconds - wait_before);
        std::this_thread::sleep_for(
            std::chrono::duration<double>(std::max(0.0, compute) * (o.dist.slowdown[rank] - 1.0)));
      }
      const double dt = sw.seconds();
      const double rate = static_cast<double>(o.batch_size) / dt;
      if (step - first >= kWarmupSteps) rates.push_back(rate);
      if (step - first == kWarmupSteps) {
        exec->reset_profile();
        dp->reset_stats();
      }
      r.losses.push_back(loss);
      r.final_loss = loss;
      ++step;
      evaluated_last = false;
      nlohmann::json line = {{"step", step}, {"loss", loss}, {"samples_per_s", rate}, {"lr", lr}};
      if (straggler) {
        const double compute = dt - (dp->stats().wait_seconds - wait_before);
        StragglerReport rep = straggler->report(step, compute);
        if (rep.exchanged && !rep.seconds.empty()) line["rank_step_s"] = rep.seconds.back();
        for (const std::string& msg : rep.messages) {
          progress.message("meshtrain: " + msg);
          metrics.write({{"step", step}, {"straggler", msg}});
        }
      }
      if (consistency) consistency->maybe_check(step);
      if (o.dist.after_step) o.dist.after_step(step, rank);
      if (step % o.log_every == 0 || step == stop) metrics.write(line);
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
    sync_store();
    double hidden = -1;
    if (timeline.enabled()) {
      hidden = hidden_comm_fraction(timeline.events());
      comm->set_call_observer({});  // the merge's own messages stay out of the trace
      timeline.merge_and_write(*comm, o.dist.trace_path);
    }

    r.steps = step;
    r.samples_per_s = median(rates);
    double mm_flops = 0, mm_ns = 0;
    int64_t runs = 0;  // executor runs (micro-batches) in this process
    for (const OpProfile& p : exec->profile()) {
      if (p.op == OpKind::matmul) {
        mm_flops += p.flops * static_cast<double>(p.calls);
        mm_ns += static_cast<double>(p.total_ns);
        runs = std::max(runs, p.calls);
      }
    }
    r.matmul_gflops = mm_ns > 0 ? mm_flops / mm_ns : 0.0;
    r.matmul_s_per_step =
        runs > 0 ? mm_ns * 1e-9 / static_cast<double>(runs) * o.dist.dp.accumulation_steps : 0.0;
    r.planned_arena_bytes = exec->memory_plan().arena_bytes;
    r.memory = dp->memory(static_cast<int>(optimizer->state_kinds().size()));
    const DataParallelStats st = dp->stats();
    nlohmann::json summary = {
        {"summary", true},
        {"steps", r.steps},
        {"final_loss", r.final_loss},
        {"samples_per_s", r.samples_per_s},
        {"matmul_gflops", r.matmul_gflops},
        {"matmul_s_per_step", r.matmul_s_per_step},
        {"planned_arena_bytes", r.planned_arena_bytes},
        {"allocated_arena_bytes", exec->allocated_arena_bytes()},
        {"param_bytes", store->numel() * 4},
        {"peak_rss_bytes", peak_rss_bytes()},
        {"threads", o.threads},
        {"world_size", world},
        {"zero_stage", o.dist.dp.stage},
        {"comm_wait_s_per_step",
         st.steps > 0 ? st.wait_seconds / static_cast<double>(st.steps) : 0.0},
        {"dp_param_bytes", r.memory.param_bytes},
        {"dp_grad_bytes", r.memory.grad_bytes},
        {"dp_optimizer_bytes", r.memory.optimizer_bytes},
        {"dp_buffer_bytes", r.memory.buffer_bytes()},
        {"precision", std::string(dtype_name(o.precision))}};
    if (hidden >= 0) summary["comm_hidden_fraction"] = hidden;
    if (o.eval) {
      summary["test_loss"] = r.test_loss;
      summary["test_accuracy"] = r.test_accuracy;
    }
    metrics.write(summary);
    return r;
  }
};

Trainer::Trainer(const ModelSpec& model, std::shared_ptr<const Dataset> train_data,
                 std::shared_ptr<const Dataset> test_data, TrainerOptions options,
                 Communicator* comm)
    : impl_(std::make_unique<Impl>(model, std::move(train_data), std::move(test_data),
                                   std::move(options), comm)) {}
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
  impl_->sync_store();
  return *impl_->store;
}
Tensor Trainer::gather_params() {
  impl_->sync_store();
  return impl_->store->flat_values();
}
DataParallel& Trainer::data_parallel() {
  return *impl_->dp;
}

}  // namespace mt
