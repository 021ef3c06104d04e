#include "meshtrain/train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <thread>
#include <tuple>

#include "meshtrain/base/output_path.h"
#include "meshtrain/base/plural.h"
#include "meshtrain/base/timer.h"
#include "meshtrain/comm/backends/self/self_transport.h"
#include "meshtrain/data/loader.h"
#include "meshtrain/graph/autodiff.h"
#include "meshtrain/graph/builder.h"
#include "meshtrain/graph/collective.h"
#include "meshtrain/spmd/collective_runner.h"
#include "meshtrain/sync/codec_spec.h"
#include "meshtrain/sync/consistency.h"
#include "meshtrain/sync/replica_sync.h"
#include "meshtrain/sync/straggler.h"
#include "meshtrain/tensor/kernels.h"
#include "meshtrain/tensor/machine.h"
#include "meshtrain/tensor/memory_stats.h"
#include "meshtrain/train/checkpoint_match.h"
#include "meshtrain/train/grad_clip.h"
#include "meshtrain/train/memory_report.h"
#include "meshtrain/train/metrics.h"
#include "meshtrain/train/param_store.h"
#include "meshtrain/train/pipeline_training.h"
#include "meshtrain/train/precision.h"
#include "meshtrain/train/progress.h"
#include "meshtrain/train/sharded_checkpoint.h"
#include "meshtrain/train/step_checkpoints.h"
#include "meshtrain/train/tensorboard.h"
#include "meshtrain/train/timeline.h"
#include "meshtrain/train/train_state.h"
#include "meshtrain/train/training_plan.h"

namespace mt {

namespace {

namespace fs = std::filesystem;

// Steps at the start of a run whose timings are left out of the median
// (first-touch page faults, primitive creation, cache warm-up).
constexpr int64_t kWarmupSteps = 5;

// A measured value, or JSON null where nothing was measured (never 0).
nlohmann::json or_null(const std::optional<double>& v) {
  return v ? nlohmann::json(*v) : nlohmann::json(nullptr);
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
  // The data-parallel group: the world, or under a plan with tensor axes the
  // ranks that share this rank's tensor coordinates (data_parallel_place()).
  std::unique_ptr<Communicator> own_dp_comm;
  Communicator* dp_comm = nullptr;
  // Under tensor parallelism, one communicator per tensor axis for the norm
  // reductions of the optimizer step, apart from the graph's collectives
  // (whose byte counters then hold exactly what the lowering predicts).
  std::vector<std::unique_ptr<Communicator>> norm_comms;
  int dp_rank = 0, dp_world = 1;
  // Under a plan with tensor axes: this rank's program (parameter boxes,
  // groups) and the runner its collective operators go through.
  LoweredProgram lowered;
  bool tensor_parallel = false;
  bool ps_server = false;        // sync.scheme = "ps": this rank serves parameters
  double loss_wait_seconds = 0;  // ps in lock step: in the loss all-reduce
  std::shared_ptr<CommCollectiveRunner> runner;
  uint64_t tensor_bytes_in_steps = 0;  // sent by this rank's tensor groups inside train_step
  int64_t tensor_steps = 0;

  ModelGraph model;
  ValueId loss_scale_in = kNoValue;  // f16 only: the scalar the loss is multiplied by
  Tensor loss_scale;
  std::unique_ptr<Executor> exec;
  std::unique_ptr<ParamStore> store;
  // How the data-parallel replicas agree (sync/replica_sync.h): all-reduce
  // data parallelism with ZeRO, or a local-steps scheme.
  std::unique_ptr<ReplicaSync> dp;
  // Local-steps schemes get their own communicator, so its byte counters
  // hold only the scheme's traffic (all-reduce DP keeps the dp group's).
  std::unique_ptr<Communicator> sync_comm;
  std::unique_ptr<DataLoader> loader;
  std::unique_ptr<DataLoader> eval_loader;  // the test split, unshuffled; built when first needed
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
  int64_t step = 0;                          // optimizer steps completed
  OptimizerState pending_state;              // single-file resume: whole tensors until sliced
  int64_t pending_updates = 0;               // sharded resume: optimizer updates so far
  std::set<std::string> stored_state_kinds;  // sharded resume: optimizer state kinds saved
  int64_t saved_step = -1;                   // the step of the last checkpoint written
  bool stop_requested = false;               // a stop request reached every rank this step
  std::optional<TorchLoadReport> init_report;
  PrecisionDecision precision;  // decided once at start-up
  // Time in the optimizer step (gradient sync included) since the profile
  // was last reset, for the summary's op_profile.
  double optimizer_seconds = 0;
  // The optimizer's update alone (its slowdown's sleep included), for the
  // summary's per-rank compute_s_per_step.
  double update_seconds = 0;
  double update_cpu_seconds = 0;  // its thread CPU time x slowdown
  int64_t optimizer_steps = 0;

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
    join_data_parallel_group();
    check_outputs();
    kernels(o.exec.backend, o.exec.fast).set_num_threads(o.threads);
    spec.compute = o.precision;

    // This rank's slice of every global batch, split into micro-batches.
    LoaderOptions lo;
    lo.batch_size = o.batch_size;
    lo.seed = o.seed;
    lo.rank = dp_rank;
    lo.world_size = dp_world;
    lo.shares = o.dist.batch_shares;
    lo.shuffle = o.shuffle;
    if (train_data->size() < o.batch_size) {
      throw ConfigError(
          fmt::format("train.batch_size: a batch of {} is more than the {} (data.limit_train)",
                      o.batch_size, train_data->describe()));
    }
    loader = std::make_unique<DataLoader>(*train_data, lo);
    if (o.eval_batches < 0) {
      throw ConfigError(
          fmt::format("train.eval_batches: must be >= 0 (0 = all), got {}", o.eval_batches));
    }
    if (o.eval) eval_loader = make_eval_loader();
    const BatchSplit split = split_batch(o, dp_rank, dp_world);
    MT_CHECK_EQ(split.local_batch,
                loader->local_range(o.batch_size).second - loader->local_range(o.batch_size).first);
    local_batch = split.local_batch;
    micro_batch = split.micro_batch;

    // The graph and its memory plan come from training_plan.h, which
    // `meshtrain inspect` prints; nothing large is allocated before the plan
    // is checked against the memory this rank may use.
    decide_precision_once();
    TrainingGraph tg = build_training_graph(spec, o, micro_batch, rank);
    if (o.bf16_storage) notice(tg.stash.describe());
    plan = plan_training(tg, spec, o, split, rank, world, test_data ? test_data->size() : -1);
    if (o.memory_limit > 0) check_memory_fits(plan, spec, o, o.memory_limit);
    model = std::move(tg.model);
    // A stand-in for a slower device (dist.slowdown): the training
    // executor's kernels and the optimizer's update take `slowdown` times
    // as long; communication does not.
    tg.exec.slowdown = slowdown();
    if (tensor_parallel) {
      lowered = std::move(tg.lowered);
      runner = std::make_shared<CommCollectiveRunner>(*comm, lowered.groups, o.dist.dp.collective);
      tg.exec.collectives = runner;
    }
    loss_scale_in = tg.loss_scale_in;
    if (loss_scale_in != kNoValue) loss_scale = Tensor::full({}, DType::f32, scaler.scale());
    exec = std::make_unique<Executor>(model.graph, tg.exec);
    for (auto& [id, t] : model.constants) exec->bind(id, t);
    if (loss_scale_in != kNoValue) exec->bind(loss_scale_in, loss_scale);

    total_steps = o.epochs * loader->steps_per_epoch();
    if (o.max_steps > 0) total_steps = std::min(total_steps, o.max_steps);
    if (total_steps <= 0) {
      throw ConfigError(
          fmt::format("train.epochs / train.steps: the run has no steps (epochs {}, "
                      "steps {}, {} per epoch)",
                      o.epochs, o.max_steps, plural(loader->steps_per_epoch(), "step")));
    }
    LrScheduleOptions so = o.schedule;
    so.total_steps = std::max<int64_t>(total_steps, so.warmup_steps + 1);
    schedule = std::make_unique<LrSchedule>(so);
    optimizer = make_optimizer(o.optimizer, o.optim);
    if (o.checkpoint_keep > 0 && o.checkpoint_path.empty()) {
      throw ConfigError(
          "train.checkpoint_keep: needs train.checkpoint, the directory of step checkpoints");
    }
    if (o.checkpoint_keep > 0 && o.checkpoint_path.ends_with(".safetensors")) {
      throw ConfigError(
          fmt::format("train.checkpoint_keep = {}: train.checkpoint must name a directory of step "
                      "checkpoints, not a single file ('{}')",
                      o.checkpoint_keep, o.checkpoint_path));
    }
    // Settings whose work would be lost without a checkpoint: said before
    // the first step, not discovered after the run.
    if (o.checkpoint_path.empty() && o.halt_after > 0 && o.halt_after < total_steps) {
      notice(fmt::format(
          "warning: train.halt_after = {} stops this invocation early, but train.checkpoint is "
          "empty: nothing will be saved to resume from",
          o.halt_after));
    }
    if (o.checkpoint_path.empty() && o.checkpoint_every > 0) {
      notice(fmt::format(
          "warning: train.checkpoint_every = {} has no effect: train.checkpoint is empty",
          o.checkpoint_every));
    }
    if (o.resume_path == "auto") {
      o.resume_path = resolve_auto_resume(o.checkpoint_path, *comm, o.dist.dp.collective,
                                          [&](const std::string& m) { notice(m); });
    }
    // A fresh ZeRO-3 run never holds whole parameters: DataParallel's shard
    // is drawn one parameter at a time below. Resuming and train.init read
    // whole tensors into the store first (then it is dropped).
    const bool shard_init =
        o.dist.dp.stage == 3 && o.resume_path.empty() && o.init_path.empty() && !tensor_parallel;
    store = std::make_unique<ParamStore>(model.graph, o.seed, /*with_grads=*/false,
                                         /*with_values=*/!shard_init);
    // Tensor parallelism: each split parameter starts as its box of the
    // whole parameter's initial value, so the run starts where the unsplit
    // one does.
    for (size_t i = 0; tensor_parallel && i < store->entries().size(); ++i) {
      const LoweredParam* lp = lowered.param(store->entries()[i].name);
      MT_CHECK(lp != nullptr, "parameter '{}' is not in the lowered program",
               store->entries()[i].name);
      if (!lp->axis.empty()) store->initial_box(i, lp->global, lp->box.begin);
    }
    // Parameters (and optimizer state) must be final before DataParallel
    // copies its shard out of them (ZeRO-3).
    if (!o.resume_path.empty()) {
      resume_params(o.resume_path);
      notice(fmt::format("resumed from step {} ({})", step, o.resume_path));
      if (!o.init_path.empty()) {
        notice(fmt::format("train.init ({}) is not applied: the checkpoint holds the parameters",
                           o.init_path));
      }
      if (step >= total_steps) {
        notice(
            fmt::format("the run is {} steps long (train.epochs, train.steps): nothing is left "
                        "to train",
                        total_steps));
      }
    } else if (!o.init_path.empty()) {
      init_params(o.init_path);
    }

    Communicator* replicas = dp_comm;
    if (o.dist.sync.scheme != "allreduce" || o.dist.sync.codec != "none") {
      sync_comm = o.dist.sync.scheme == "ps"
                      ? comm->split(0, rank, "ps", o.dist.dp.collective)
                      : dp_comm->split(0, dp_rank, "sync", o.dist.dp.collective);
      replicas = sync_comm.get();
    }
    dp = make_replica_sync(o.dist.sync, *replicas, layout_of(*store),
                           shard_init ? Tensor::wrap(nullptr, {store->flat_numel()}, DType::f32)
                                      : store->flat_values(),
                           o.dist.dp,
                           static_cast<double>(local_batch) / static_cast<double>(o.batch_size));
    if (shard_init) init_shard();
    // ZeRO-3: DataParallel now holds this rank's shard; the full copy is
    // allocated again only while something needs whole parameters (a
    // single-file checkpoint, params() / gather_params()). Evaluation
    // gathers per bucket like training does.
    if (o.dist.dp.stage == 3) store->drop_values();
    dp->attach(*exec, model.graph);
    MT_CHECK_EQ(exec->memory_plan().arena_bytes, plan.activations.arena_bytes);
    optimizer->set_norm_reducer(norm_reducer());
    if (!o.resume_path.empty()) {
      resume_optimizer(o.resume_path);
      resume_sync_state(o.resume_path);
    }

    if (timeline.enabled()) {
      timeline.align(*comm);
      auto observe = [this](const CallEvent& e) {
        timeline.add(fmt::format("{} #{}", collective_name(e.kind), e.seq), "comm", e.start_ns,
                     e.end_ns, Timeline::kComm,
                     {{"bytes", e.bytes},
                      {"algorithm", std::string(algorithm_name(e.algorithm))},
                      {"ok", e.ok}});
      };
      // The replicas' collectives may run on a group of their own.
      for (Communicator* c : {comm, dp_comm, sync_comm.get()}) {
        if (c != nullptr) c->set_call_observer(observe);
      }
      exec->on_node_done(
          [this](const std::string& name, OpKind op, bool backward, int64_t t0, int64_t t1) {
            timeline.add(name, backward ? "backward" : "forward", t0, t1, Timeline::kCompute,
                         {{"op", std::string(op_name(op))}});
          });
    }
    if (dp_world > 1 && o.dist.consistency_every > 0 && !dp->replicas_identical()) {
      notice(fmt::format(
          "dist.consistency_every = {}: replica checksums are not compared under sync.scheme = "
          "\"{}\": replicas hold different parameters between synchronizations (the summary "
          "reports their consensus distance instead)",
          o.dist.consistency_every, dp->name()));
    } else if (dp_world > 1 && o.dist.consistency_every > 0 && o.dist.dp.stage < 3) {
      // Replicas are the ranks of the data-parallel group (under tensor
      // parallelism each holds the same pieces as its dp peers).
      ConsistencyChecker::NamedTensors named;
      for (auto& e : store->entries()) named.emplace_back(e.name, e.value);
      ConsistencyOptions co;
      co.every_steps = o.dist.consistency_every;
      consistency = std::make_unique<ConsistencyChecker>(*dp_comm, std::move(named), co);
    } else if (dp_world > 1 && o.dist.consistency_every > 0) {
      // Under ZeRO-3 no two ranks hold the same parameter values, so there
      // is nothing to compare; say so rather than skip the check silently.
      notice(fmt::format(
          "dist.consistency_every = {}: replica checksums are not compared under ZeRO-3 "
          "(dist.zero_stage = 3): each rank holds a different shard of the parameters, so "
          "there are no replicas to compare",
          o.dist.consistency_every));
    }
    if (world > 1 && o.dist.straggler_report) {
      StragglerOptions so2;
      so2.threshold = o.dist.straggler_threshold;
      so2.every_steps = dp->agreement_period();
      // Parameter servers compute nothing: the workers compare themselves.
      if (o.dist.sync.scheme != "ps") {
        straggler = std::make_unique<StragglerDetector>(*comm, so2);
      } else if (!ps_server && dp_world > 1) {
        straggler = std::make_unique<StragglerDetector>(*dp_comm, so2);
      }
    }
  }

  bool leader() const { return rank == 0; }

  double slowdown() const {
    return rank < static_cast<int>(o.dist.slowdown.size()) ? o.dist.slowdown[rank] : 1.0;
  }

  // Under a plan with tensor axes: this rank's data-parallel coordinate and
  // group (the ranks with the same tensor coordinates), split off the world.
  // What tensor parallelism does not carry yet is refused here, before any
  // step, on every rank alike.
  void join_data_parallel_group() {
    validate_sync_options(o.dist.sync);
    if (o.dist.sync.scheme != "allreduce") {
      // Checkpoints hold every rank's own state (docs/sync.md
      // "Checkpoints"), but AD-PSGD's pairs average at any moment: there is
      // no point at which every rank's state belongs to the same step.
      for (const auto& [key, value] : {std::pair{"train.checkpoint", o.checkpoint_path},
                                       std::pair{"train.resume", o.resume_path}}) {
        if (value.empty()) continue;
        if (o.dist.sync.scheme == "adpsgd") {
          throw ConfigError(fmt::format(
              "{}: not available with sync.scheme = \"adpsgd\" (pairs average asynchronously, "
              "so the ranks' states never belong to one step); set it to \"\" or use "
              "sync.scheme = \"gossip\"",
              key));
        }
        if (key == std::string("train.checkpoint") && world == 1 &&
            value.ends_with(".safetensors")) {
          throw ConfigError(fmt::format(
              "train.checkpoint = \"{}\": sync.scheme = \"{}\" keeps state per rank, which a "
              "single .safetensors file does not hold; name a directory (a sharded checkpoint)",
              value, o.dist.sync.scheme));
        }
      }
      if (o.dist.sync.scheme == "ps" && !o.checkpoint_path.empty() && o.checkpoint_every > 0) {
        throw ConfigError(fmt::format(
            "train.checkpoint_every = {}: not available with sync.scheme = \"ps\": the servers "
            "hold the parameters and serve until every worker is done, so the checkpoint is "
            "written when an invocation ends (its last step, train.halt_after or a stop signal); "
            "set it to 0",
            o.checkpoint_every));
      }
      if (o.dist.plan && needs_lowering(*o.dist.plan)) {
        throw ConfigError(fmt::format(
            "sync.scheme = \"{}\": local-step schemes run over data parallelism only, not "
            "with a plan's tensor axes (mesh {}) yet",
            o.dist.sync.scheme, o.dist.plan->mesh.describe()));
      }
    }
    if (o.dist.sync.scheme == "ps") {
      join_parameter_server();
      return;
    }
    const DataParallelPlace place = data_parallel_place(o, rank, world);
    dp_rank = place.rank;
    dp_world = place.world;
    tensor_parallel = place.lowered;
    if (!tensor_parallel) {
      dp_comm = comm;
      return;
    }
    const Mesh& mesh = o.dist.plan->mesh;
    own_dp_comm = axis_communicator(*comm, mesh, "dp", "dp", o.dist.dp.collective);
    dp_comm = own_dp_comm.get();
    for (const std::string& axis : lowered_axes(mesh)) {
      norm_comms.push_back(
          axis_communicator(*comm, mesh, axis, axis + ".norms", o.dist.dp.collective));
    }
    auto refuse = [&](bool bad, const std::string& what) {
      if (!bad) return;
      throw ConfigError(fmt::format(
          "{}: not available under tensor parallelism yet (mesh {}); checkpoint directories "
          "are (sharded, N-d pieces: they load under any other plan)",
          what, mesh.describe()));
    };
    std::error_code ec;
    refuse(!o.resume_path.empty() && o.resume_path != "auto" &&
               !std::filesystem::is_directory(o.resume_path, ec),
           "train.resume from one .safetensors file (whole tensors)");
  }

  // sync.scheme = "ps" (sync/param_server.h): the last sync.servers ranks
  // serve; the data is split over the other ranks, the workers, whose group
  // is the data-parallel one (evaluation, the loss while in lock step, the
  // straggler report). Servers build the same model (their parameters are
  // the initial values of their shard) but run no step.
  void join_parameter_server() {
    const int64_t servers = o.dist.sync.servers;
    if (servers >= world) {
      throw ConfigError(fmt::format(
          "sync.servers = {}: needs at least one worker besides the servers, but the job has {} "
          "ranks",
          servers, world));
    }
    auto refuse = [&](bool bad, const std::string& what) {
      if (!bad) return;
      throw ConfigError(fmt::format(
          "{}: not available with sync.scheme = \"ps\" yet (the optimizer runs on the servers, "
          "shard by shard)",
          what));
    };
    refuse(o.clip_grad_norm > 0, "optim.clip_grad_norm (a global norm across servers)");
    refuse(o.precision == DType::f16, "train.precision = f16 (the loss scaler's skipped steps)");
    refuse(!o.dist.trace_path.empty(), "dist.trace (the merged timeline)");
    refuse(o.dist.dp.stage != 0, fmt::format("dist.zero_stage = {}", o.dist.dp.stage));
    ps_server = rank >= world - static_cast<int>(servers);
    own_dp_comm = comm->split(ps_server ? 1 : 0, rank, ps_server ? "ps-servers" : "ps-workers",
                              o.dist.dp.collective);
    dp_comm = own_dp_comm.get();
    dp_rank = ps_server ? 0 : rank;
    dp_world = world - static_cast<int>(servers);
  }

  // Sums over the ranks that hold pieces of the same parameters: the
  // data-parallel group where ZeRO shards them (DataParallel's reducer), and
  // under tensor parallelism each tensor group (split parameters' pieces;
  // replicated ones count once through ParamRef::counted).
  NormReducer norm_reducer() {
    NormReducer dpr = dp->norm_reducer();
    if (!tensor_parallel) return dpr;
    std::vector<Communicator*> groups;
    for (const auto& c : norm_comms) groups.push_back(c.get());
    const CollectiveOptions co = o.dist.dp.collective;
    return [dpr, groups, co](std::span<double> v) {
      if (dpr) dpr(v);
      for (Communicator* g : groups) {
        g->all_reduce(v.data(), v.data(), v.size(), DType::f64, ReduceOp::sum, co);
      }
    };
  }

  // Under tensor parallelism: where each split parameter (and its optimizer
  // state) lies in the whole tensor, for checkpoint pieces.
  std::map<std::string, TensorPlace> tensor_places() const {
    std::map<std::string, TensorPlace> places;
    if (!tensor_parallel) return places;
    for (const LoweredParam& lp : lowered.params) {
      if (lp.axis.empty()) continue;
      places[lp.name] = {lp.global, lp.box};
      for (const std::string& k : optimizer->state_kinds()) {
        places[lp.name + "." + k] = {lp.global, lp.box};
      }
    }
    return places;
  }

  // Checkpoint pieces of this rank in the whole tensors' coordinates: split
  // parameters' boxes; a replicated one written by the first rank of its
  // tensor group only (the others name it with an empty piece).
  std::vector<ShardPiece> whole_pieces(std::vector<ShardPiece> pieces, bool state) const {
    if (!tensor_parallel) return pieces;
    pieces = in_boxes(std::move(pieces), tensor_places());
    for (ShardPiece& p : pieces) {
      std::string param = p.name;
      if (state) param = param.substr(0, param.rfind('.'));
      if (!p.box.begin.empty() || counted(param)) continue;
      p = ShardPiece{p.name, p.full_shape, 0, 0, Tensor()};
    }
    return pieces;
  }

  // Whether this rank counts parameter `name` in sums over its tensor
  // groups: split parameters always (disjoint pieces), replicated ones on
  // the groups' first rank only.
  bool counted(const std::string& name) const {
    if (!tensor_parallel) return true;
    const LoweredParam* lp = lowered.param(name);
    for (const std::string& a : lowered.axes) {
      if (lp != nullptr && lp->axis == a) continue;
      if (o.dist.plan->mesh.coord(rank, a) != 0) return false;
    }
    return true;
  }

  // Bytes this rank's tensor groups have sent (the communicators' own
  // counters, agreement handshakes left out).
  uint64_t tensor_bytes_sent() const {
    uint64_t n = 0;
    for (const auto& [axis, id] : lowered.group_of_axis) {
      for (const auto& [kind, c] : runner->comm_of(id)->counters().by_collective) {
        if (kind != "handshake") n += c.bytes_sent;
      }
    }
    return n;
  }

  // What the lowered training graph's collectives send per step, by the
  // runner's cost functions (the counters above must agree).
  uint64_t predicted_tensor_bytes_per_step() const {
    uint64_t n = 0;
    for (const Node& node : model.graph.nodes()) {
      if (communicates(node.op)) n += runner->cost_of(model.graph, node).bytes_sent;
    }
    return n * static_cast<uint64_t>(o.dist.dp.accumulation_steps);
  }

  // The first rank of its tensor groups (all ranks without tensor axes):
  // the one whose loss counts in sums over the world.
  bool tensor_leader() const {
    if (!tensor_parallel) return true;
    for (const std::string& a : lowered.axes) {
      if (o.dist.plan->mesh.coord(rank, a) != 0) return false;
    }
    return true;
  }

  // ZeRO-3, fresh run: this rank's shard of each parameter's initial value
  // (the same numbers as a replicated store), drawn straight into it.
  void init_shard() {
    std::map<std::string, size_t> index;
    for (size_t i = 0; i < store->entries().size(); ++i) index[store->entries()[i].name] = i;
    for (ShardPiece& piece : dp->param_pieces(PieceUse::load)) {
      store->initial_range(index.at(piece.name), piece.begin, piece.end, piece.data.data<float>());
    }
  }

  // Probes every path this rank will write (rank 0: metrics, trace, the
  // TensorBoard directory, a single-file checkpoint; every rank: its shard of a checkpoint
  // directory) so a bad one fails now, not after training; the ranks agree
  // so that all of them stop. Then creates the missing parent directories.
  void check_outputs() {
    const bool ckpt_file = !o.checkpoint_path.empty() && single_file(o.checkpoint_path);
    std::exception_ptr err;
    try {
      if (leader()) {
        check_output_path(o.metrics_path, OutputKind::file, "--metrics");
        check_output_path(o.dist.trace_path, OutputKind::replaced_file, "dist.trace (--trace)");
        check_output_path(o.tensorboard_dir, OutputKind::directory,
                          "train.tensorboard (--tensorboard)");
        if (ckpt_file) {
          check_output_path(o.checkpoint_path, OutputKind::replaced_file, "train.checkpoint");
        }
      }
      if (!ckpt_file) {
        check_output_path(o.checkpoint_path, OutputKind::directory, "train.checkpoint");
      }
    } catch (...) {
      err = std::current_exception();
    }
    agree_on_failure(world > 1 ? comm : nullptr, err, o.dist.dp.collective);
    if (leader()) {
      create_output_parents(o.metrics_path, "--metrics");
      create_output_parents(o.dist.trace_path, "dist.trace (--trace)");
      if (ckpt_file) create_output_parents(o.checkpoint_path, "train.checkpoint");
    }
  }

  // The evaluation loader: the test split in file order, each batch of
  // eval_batch_size split over the ranks.
  std::unique_ptr<DataLoader> make_eval_loader() const {
    if (!test_data) {
      throw ConfigError("train.eval: no test split was given, so there is nothing to evaluate");
    }
    if (test_data->size() == 0) {
      throw ConfigError(fmt::format(
          "train.eval: the test split has no examples ({}; data.limit_test = 0?), so there is "
          "nothing to evaluate: set data.limit_test > 0 (-1 = all) or train.eval=false",
          test_data->describe()));
    }
    LoaderOptions lo;
    lo.batch_size = std::min<int64_t>(o.eval_batch_size, test_data->size());
    lo.shuffle = false;
    lo.drop_last = false;
    lo.rank = dp_rank;
    lo.world_size = dp_world;
    try {
      return std::make_unique<DataLoader>(*test_data, lo);
    } catch (const ConfigError& e) {
      throw ConfigError(fmt::format("train.eval_batch_size {} ({}, {} rank{}): {}",
                                    o.eval_batch_size, test_data->describe(), world,
                                    world > 1 ? "s" : "", e.what()));
    }
  }

  // Test batches one evaluation covers: the first eval_batches, or all.
  int64_t eval_steps() const {
    const int64_t all = eval_loader->steps_per_epoch();
    return o.eval_batches > 0 ? std::min(o.eval_batches, all) : all;
  }

  // Whole parameters into the store's flat buffer (a no-op but for ZeRO-3,
  // where the store holds nothing after construction: its buffer is
  // allocated again and gathered into; collective). The buffer stays until
  // drop_full_params().
  void sync_store() {
    if (o.dist.dp.stage == 3) dp->gather_params(store->ensure_values());
  }
  // ZeRO-3: frees the store's full copy again.
  void drop_full_params() {
    if (o.dist.dp.stage == 3) store->drop_values();
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
    m.merge(model_settings(spec));
    m["seed"] = std::to_string(o.seed);
    return m;
  }

  void save(const std::string& path) {
    if (single_file(path)) {
      const bool had_full = store->has_values();
      sync_store();
      TrainState st;
      for (auto& e : store->entries()) st.params[e.name] = e.value;
      st.optimizer = std::string(optimizer->name());
      st.optimizer_state = optimizer->state();
      st.step = step;
      st.epoch = step / loader->steps_per_epoch();
      st.lr_step = step;
      st.loss_scaler = scaler.state();
      st.extra = model_settings(spec);
      st.extra["seed"] = std::to_string(o.seed);
      save_train_state(path, st);
      st.params.clear();  // views of the store's buffer
      if (!had_full) drop_full_params();
      return;
    }
    std::vector<ShardPiece> pieces;
    std::map<std::string, std::string> meta = state_metadata();
    if (dp->rank_checkpoint() == ReplicaSync::RankCheckpoint::kServers) {
      // The optimizer ran on the servers: their count of updates.
      int64_t updates = 0;
      for (const auto& [name, n] : optimizer->state().steps) updates = std::max(updates, n);
      comm->all_reduce(&updates, &updates, 1, DType::i64, ReduceOp::max, o.dist.dp.collective);
      meta["optimizer_updates"] = std::to_string(updates);
    }
    Tensor mean;  // kReplicas: the replicas' mean, which the pieces view
    const ReplicaSync::RankCheckpoint per_rank = dp->rank_checkpoint();
    if (per_rank == ReplicaSync::RankCheckpoint::kReplicas) {
      // "param/": the replicas' mean (the model the run hands out, for
      // export and evaluation); every replica's own parameters and
      // optimizer state as row dp_rank of "replica/...".
      dp->prepare_checkpoint();
      mean = Tensor::empty({store->flat_numel()}, DType::f32);
      dp->average_into(mean);
      std::map<std::string, Tensor> views;
      for (const auto& e : store->entries()) {
        views[e.name] = Tensor::wrap(mean.data<float>() + e.offset, e.shape, DType::f32);
      }
      for (ShardPiece p : even_pieces(views, dp_rank, dp_world)) {
        p.name = "param/" + p.name;
        pieces.push_back(std::move(p));
      }
      for (ShardPiece p : dp->param_pieces(PieceUse::save)) {
        pieces.push_back(as_row(std::move(p), "replica/param/", dp_rank, dp_world));
      }
      for (ShardPiece p : dp->state_pieces(optimizer->state().tensors, PieceUse::save)) {
        pieces.push_back(as_row(std::move(p), "replica/optim/", dp_rank, dp_world));
      }
      // Each replica's loss scaler decides on its own gradients (f16).
      scaler_row = Tensor::empty({2}, DType::f64);
      scaler_row.data<double>()[0] = scaler.state().scale;
      scaler_row.data<double>()[1] = static_cast<double>(scaler.state().good_steps);
      pieces.push_back(
          as_row(full_piece("loss_scaler", scaler_row), "replica/", dp_rank, dp_world));
    } else {
      if (per_rank == ReplicaSync::RankCheckpoint::kServers ||
          per_rank == ReplicaSync::RankCheckpoint::kRanks) {
        dp->prepare_checkpoint();
      }
      for (ShardPiece p : whole_pieces(dp->param_pieces(PieceUse::save), false)) {
        p.name = "param/" + p.name;
        pieces.push_back(std::move(p));
      }
      for (ShardPiece p :
           whole_pieces(dp->state_pieces(optimizer->state().tensors, PieceUse::save), true)) {
        p.name = "optim/" + p.name;
        pieces.push_back(std::move(p));
      }
    }
    if (per_rank != ReplicaSync::RankCheckpoint::kNone) {
      for (const ReplicaSync::StatePiece& sp : dp->checkpoint_state()) {
        pieces.push_back(state_row(sp));
      }
      for (auto& [k, v] : sync_metadata()) meta[k] = v;
    }
    SaveShardedOptions so;
    so.mode = o.dist.dp.stage == 0 ? "dp" : fmt::format("zero{}", o.dist.dp.stage);
    if (tensor_parallel) so.mode += "+" + o.dist.plan->mesh.describe();
    // kRanks: whole tensors as all-reduce DP writes them (the mode says how
    // they are laid out), with each rank's codec rows beside them.
    if (per_rank == ReplicaSync::RankCheckpoint::kReplicas ||
        per_rank == ReplicaSync::RankCheckpoint::kServers) {
      so.mode = o.dist.sync.scheme;
    }
    so.collective = o.dist.dp.collective;
    save_sharded(comm, path, pieces, meta, so);
  }

  // Row `row` of `rows` of a tensor named prefix + the piece's name, shaped
  // [rows, <the piece's tensor's shape>...]: one replica's piece.
  static ShardPiece as_row(ShardPiece p, const std::string& prefix, int row, int rows) {
    const int64_t numel = p.full_shape.numel();
    std::vector<int64_t> dims = {rows};
    for (int64_t d : p.full_shape.dims()) dims.push_back(d);
    p.name = prefix + p.name;
    p.full_shape = Shape(dims);
    p.begin += row * numel;
    p.end += row * numel;
    return p;
  }

  static ShardPiece state_row(const ReplicaSync::StatePiece& sp) {
    const int64_t n = sp.data.numel();
    return ShardPiece{"sync/" + sp.name, Shape({sp.rows, n}), sp.row * n, (sp.row + 1) * n,
                      sp.data};
  }

  // What a checkpoint with per-rank state records of its scheme, and must
  // find again to resume it (sync_resume()).
  std::map<std::string, std::string> sync_metadata() const {
    const SyncOptions& s = o.dist.sync;
    std::map<std::string, std::string> m = {
        {"sync.scheme", s.scheme},
        {"sync.per_rank", per_rank_name()},
        {"sync.ranks", std::to_string(s.scheme == "ps" ? world : dp_world)}};
    if (s.scheme == "ps") m["sync.servers"] = std::to_string(s.servers);
    m["sync.codec"] = parse_codec_spec(s.codec).to_string();
    // All-reduce codec rows: ZeRO 0's are per parameter, ZeRO's per bucket.
    if (dp->rank_checkpoint() == ReplicaSync::RankCheckpoint::kRanks) {
      m["sync.zero_stage"] = std::to_string(o.dist.dp.stage);
    }
    if (s.scheme == "diloco") {
      m["sync.fragments"] = std::to_string(s.fragments);
      m["sync.overlap_steps"] = std::to_string(s.overlap_steps);
    }
    return m;
  }

  // How this run's scheme keeps per-rank state in checkpoints: "replicas",
  // "servers", "ranks" (ReplicaSync::RankCheckpoint), or "" for none.
  std::string per_rank_name() const {
    switch (dp->rank_checkpoint()) {
      case ReplicaSync::RankCheckpoint::kReplicas:
        return "replicas";
      case ReplicaSync::RankCheckpoint::kServers:
        return "servers";
      case ReplicaSync::RankCheckpoint::kRanks:
        return "ranks";
      case ReplicaSync::RankCheckpoint::kNone:
        break;
    }
    return "";
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

  // Measures f32 against bf16 matmuls on this model's training shapes where
  // the configured precision asks for it (train/precision.h), and makes every
  // rank follow rank 0's choice.
  void decide_precision_once() {
    const std::string requested = o.precision_auto ? std::string("auto")
                                  : o.bf16_storage ? std::string("bf16_storage")
                                                   : std::string(dtype_name(o.precision));
    const bool measure = o.precision_auto || o.precision == DType::bf16;
    std::vector<MatmulUse> uses;
    std::vector<int64_t> stash_sizes;
    int64_t f32_plan = 0, storage_plan = 0;
    if (measure && rank == 0) {
      ModelSpec f32_spec = spec;
      f32_spec.compute = DType::f32;
      TrainerOptions f32_o = o;
      f32_o.precision = DType::f32;
      f32_o.bf16_storage = false;
      const TrainingGraph tg = build_training_graph(f32_spec, f32_o, micro_batch, rank);
      uses = matmul_uses(tg.model.graph);
      if (o.precision_auto && !o.exec.recompute) {
        // What the stash pass would keep in bf16, and both runs' planned
        // memory against this rank's limit.
        TrainerOptions storage_o = f32_o;
        storage_o.bf16_storage = true;
        const TrainingGraph st = build_training_graph(f32_spec, storage_o, micro_batch, rank);
        for (ValueId v : st.stash.stashed)
          stash_sizes.push_back(st.model.graph.value(v).shape.numel());
        if (o.memory_limit > 0) {
          const BatchSplit split{local_batch, micro_batch};
          const int64_t ev = test_data ? test_data->size() : -1;
          f32_plan = plan_training(tg, f32_spec, f32_o, split, rank, world, ev).total_bytes();
          storage_plan =
              plan_training(st, f32_spec, storage_o, split, rank, world, ev).total_bytes();
        }
      }
    }
    precision = decide_precision(requested, uses, o.exec.backend, o.exec.fast,
                                 o.bf16_rate_factor_for_testing, stash_sizes,
                                 o.storage_cost_factor_for_testing);
    if (o.precision_auto && o.memory_limit > 0 && rank == 0) {
      precision.memory_limit = o.memory_limit;
      precision.f32_plan_bytes = f32_plan;
      precision.storage_plan_bytes = storage_plan;
      apply_precision_policy(precision);
    }
    if (measure && world > 1) follow_rank0_precision(*comm, precision);
    o.precision = precision.chosen;
    o.bf16_storage = precision.bf16_storage;
    spec.compute = precision.chosen;
    if (measure) notice(precision.reason);
  }

  nlohmann::json precision_json() const;   // the summary's precision_decision
  nlohmann::json engines_json() const;     // the summary's matmul_engines
  nlohmann::json op_profile_json() const;  // the summary's op_profile_ms_per_step

  void notice(const std::string& msg) const {
    if (leader() && o.on_notice) o.on_notice(msg);
  }

  TensorSignatures expected_params() const {
    TensorSignatures t;
    for (const auto& e : store->entries()) {
      const LoweredParam* lp = tensor_parallel ? lowered.param(e.name) : nullptr;
      t[e.name] = {DType::f32, lp != nullptr ? lp->global : e.shape};
    }
    return t;
  }

  // Strict resume: the checkpoint holds exactly this model's parameters
  // (checkpoint_match.h), checked before anything is loaded.
  void check_single_file_fits(const std::string& path) const {
    const CheckpointReader r(path);
    TensorSignatures stored;
    for (const SafetensorsEntry& e : r.header().entries) {
      if (e.name.starts_with("param/")) stored[e.name.substr(6)] = {e.dtype, e.shape};
    }
    std::map<std::string, std::string> recorded;
    for (const auto& [k, v] : r.metadata()) {
      if (k == "extra/model" || k.starts_with("extra/model.")) recorded[k.substr(6)] = v;
    }
    require_same_params(path, recorded, model_settings(spec), stored, expected_params());
  }

  void check_sharded_fits(const std::string& path) const {
    std::exception_ptr err;
    try {
      if (!is_sharded_checkpoint(path)) {
        // The directory of step checkpoints itself, rather than one of them.
        const std::vector<FoundCheckpoint> steps = list_step_checkpoints(path);
        if (!steps.empty()) {
          throw FileError(fmt::format(
              "checkpoint {}: a directory of step checkpoints ({} to {}), not a checkpoint; "
              "resume from one of them, or set train.resume = \"auto\" (with train.checkpoint "
              "= \"{}\") for the newest",
              path, fs::path(steps.front().path).filename().string(),
              fs::path(steps.back().path).filename().string(), path));
        }
      }
      const ShardedIndex idx = read_index(path);
      TensorSignatures stored;
      for (const auto& [name, t] : idx.tensors) {
        if (name.starts_with("param/")) stored[name.substr(6)] = {t.dtype, t.shape};
      }
      std::map<std::string, std::string> recorded;
      for (const auto& [k, v] : idx.metadata) {
        if (k == "model" || k.starts_with("model.")) recorded[k] = v;
      }
      require_same_params(path, recorded, model_settings(spec), stored, expected_params());
      check_sync_fits(path, idx.metadata);
    } catch (...) {
      err = std::current_exception();
    }
    if (world == 1 && err) std::rethrow_exception(err);
    agree_on_failure(comm, err, o.dist.dp.collective);  // every rank throws alike
  }

  // A checkpoint with per-rank state (sync_metadata()) resumes only where
  // that state has a place: the same scheme over as many ranks (replicas:
  // each rank takes its own row; servers: the same shards). Checkpoints
  // without it (all-reduce DP, or a parameter server's whole tensors under
  // another scheme) resume under any scheme, whose own state starts afresh.
  void check_sync_fits(const std::string& path, const std::map<std::string, std::string>& m) const {
    const auto get = [&](const std::string& k) {
      auto it = m.find(k);
      return it == m.end() ? std::string() : it->second;
    };
    const std::string per = get("sync.per_rank");
    if (per.empty()) return;
    const std::string scheme = get("sync.scheme"), ranks = get("sync.ranks");
    const SyncOptions& s = o.dist.sync;
    if (per == "servers" && s.scheme != "ps") return;
    // All-reduce codec rows: whole tensors besides them, so any scheme, or
    // all-reduce without a codec, resumes afresh; the same codec resumes
    // each rank's state (the checks below).
    if (per == "ranks" && (s.scheme != scheme || parse_codec_spec(s.codec).kind == CodecKind::none))
      return;
    if (s.scheme != scheme) {
      throw CheckpointError(fmt::format(
          "checkpoint {}: sync.scheme = \"{}\" (this run) cannot resume it: it was written under "
          "sync.scheme = \"{}\" by {} replicas, each with its own parameters, optimizer state "
          "and scheme state (its param/ tensors are only their mean); resume with sync.scheme = "
          "\"{}\"",
          path, s.scheme, scheme, ranks, scheme));
    }
    const int have = s.scheme == "ps" ? world : dp_world;
    if (ranks != std::to_string(have)) {
      throw CheckpointError(fmt::format(
          "checkpoint {}: written by {} ranks under sync.scheme = \"{}\", this run has {}: each "
          "rank's own state (its row of the checkpoint's sync/ and replica/ tensors) has no "
          "place among another number of ranks; resume with {} ranks",
          path, ranks, scheme, have, ranks));
    }
    const auto same = [&](const std::string& key, int64_t value) {
      if (get(key) == std::to_string(value)) return;
      throw CheckpointError(fmt::format(
          "checkpoint {}: written with {} = {}, this run has {} = {}: the scheme's saved state "
          "(shards, fragments and the exchanges in flight) depends on it; resume with {} = {}",
          path, key, get(key), key, value, key, get(key)));
    };
    if (s.scheme == "ps") same("sync.servers", s.servers);
    // Each rank's codec state (residuals, PowerSGD's Q) is the saved codec's.
    const std::string codec = parse_codec_spec(s.codec).to_string();
    const std::string saved = get("sync.codec").empty() ? "none" : get("sync.codec");
    if (codec != saved) {
      throw CheckpointError(fmt::format(
          "checkpoint {}: written with sync.codec = \"{}\", this run has sync.codec = \"{}\": "
          "each rank's saved codec state (its error-feedback residual) belongs to that codec; "
          "resume with sync.codec = \"{}\"",
          path, saved, codec, saved));
    }
    if (s.scheme == "diloco") {
      same("sync.fragments", s.fragments);
      same("sync.overlap_steps", s.overlap_steps);
    }
    if (per == "ranks" && get("sync.zero_stage") != std::to_string(o.dist.dp.stage)) {
      throw CheckpointError(fmt::format(
          "checkpoint {}: written with dist.zero_stage = {} and sync.codec = \"{}\", this run "
          "has dist.zero_stage = {}: each rank's saved codec state is laid out for that stage "
          "(per parameter at 0, per bucket chunk under ZeRO); resume with dist.zero_stage = {}, "
          "or without sync.codec",
          path, get("sync.zero_stage"), saved, o.dist.dp.stage, get("sync.zero_stage")));
    }
  }

  // The kind of per-rank state checkpoint `path` holds ("", "replicas",
  // "servers"), read again after check_sharded_fits() accepted it.
  std::string resume_per_rank;
  Tensor scaler_row;  // kReplicas: this replica's loss scaler (scale, good steps)

  // Writes the run's checkpoint for the current step (once per step); with
  // checkpoint_keep, a new step directory, then the oldest beyond the kept
  // ones go.
  void checkpoint_now(TrainResult& r) {
    if (o.checkpoint_path.empty() || saved_step == step) return;
    const std::string path =
        o.checkpoint_keep > 0 ? step_checkpoint_path(o.checkpoint_path, step) : o.checkpoint_path;
    save(path);
    saved_step = step;
    r.checkpoint = path;
    if (o.checkpoint_keep > 0 && leader()) {
      try {
        prune_step_checkpoints(o.checkpoint_path, o.checkpoint_keep, path);
      } catch (const Error& e) {
        // The new checkpoint is complete; an old one left behind is no reason to fail.
        notice(fmt::format("warning: {}", e.what()));
      }
    }
  }

  // Whole parameters into the store (every rank), before DataParallel takes
  // its shard; scalars of the run. The optimizer state follows once the
  // slices are known (resume_optimizer).
  void resume_params(const std::string& path) {
    std::error_code ec;
    if (!std::filesystem::is_directory(path, ec)) {
      check_single_file_fits(path);
      TrainState st;
      for (auto& e : store->entries()) st.params[e.name] = e.value;
      st.optimizer = std::string(optimizer->name());
      load_train_state(path, st);
      pending_state = st.optimizer_state;
      scaler.load_state(st.loss_scaler);
      step = st.step;
      return;
    }
    check_sharded_fits(path);
    {
      const ShardedIndex idx = read_index(path);
      auto it = idx.metadata.find("sync.per_rank");
      resume_per_rank = it == idx.metadata.end() ? std::string() : it->second;
    }
    // A replica resumes from its own row.
    const bool own_row = resume_per_rank == "replicas";
    std::vector<ShardPiece> wanted;
    for (auto& e : store->entries()) {
      const LoweredParam* lp = tensor_parallel ? lowered.param(e.name) : nullptr;
      wanted.push_back(
          own_row ? as_row(full_piece(e.name, e.value), "replica/param/", dp_rank, dp_world)
          : lp != nullptr && !lp->axis.empty()
              ? box_piece("param/" + e.name, lp->global, lp->box, e.value)
              : full_piece("param/" + e.name, e.value));
    }
    LoadShardedOptions lo;
    lo.collective = o.dist.dp.collective;
    ShardedIndex idx = load_sharded(comm, path, wanted, lo);
    for (const auto& [name, t] : idx.tensors) {
      const size_t dot = name.rfind('.');
      if ((name.starts_with(own_row ? "replica/optim/" : "optim/")) && dot != std::string::npos) {
        stored_state_kinds.insert(name.substr(dot + 1));
      }
    }
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

  // A new run's whole parameters from a PyTorch-layout file, on every rank
  // (before DataParallel takes its shard); a rank that cannot read it fails
  // the others too instead of leaving them waiting.
  void init_params(const std::string& path) {
    std::map<std::string, Tensor> views;
    for (auto& e : store->entries()) views[e.name] = e.value;
    // Tensor parallelism: each rank keeps its boxes of the file's tensors.
    std::map<std::string, TensorPlace> places;
    for (const LoweredParam& lp : lowered.params) {
      if (tensor_parallel && !lp.axis.empty()) places[lp.name] = {lp.global, lp.box};
    }
    std::exception_ptr err;
    try {
      init_report = places.empty()
                        ? load_torch_weights(path, spec, views, TorchLoadOptions{o.init_partial})
                        : load_torch_weights_into_boxes(path, spec, views, places,
                                                        TorchLoadOptions{o.init_partial});
    } catch (...) {
      err = std::current_exception();
    }
    agree_on_failure(world > 1 ? comm : nullptr, err, o.dist.dp.collective);
  }

  // This rank's slices of the optimizer state.
  void resume_optimizer(const std::string& path) {
    const std::vector<std::string> kinds = optimizer->state_kinds();
    OptimizerState st;
    std::error_code ec;
    if (!std::filesystem::is_directory(path, ec)) {
      // A single file holds whole tensors: cut out this rank's slices.
      for (const ParamSlice& sl : dp->slices()) {
        if (sl.end == sl.begin) continue;
        for (const std::string& kind : kinds) {
          const std::string key = sl.name + "." + kind;
          auto it = pending_state.tensors.find(key);
          if (it == pending_state.tensors.end()) continue;
          MemoryScope tag(MemoryCategory::optimizer);
          Tensor part = Tensor::empty(sl.param.shape(), DType::f32);
          std::memcpy(part.raw(), it->second.data<float>() + sl.begin,
                      static_cast<size_t>(sl.end - sl.begin) * sizeof(float));
          st.tensors[key] = part;
        }
        auto n = pending_state.steps.find(sl.name);
        if (n != pending_state.steps.end()) st.steps[sl.name] = n->second;
      }
    } else {
      // A kind the writer never created (SGD without momentum has no
      // buffers) is not asked for; one that only some parameters have is
      // still an error of load_sharded's, as in a single file.
      std::vector<std::string> stored_kinds;
      for (const std::string& k : kinds) {
        if (stored_state_kinds.contains(k)) stored_kinds.push_back(k);
      }
      std::vector<ShardPiece> wanted =
          in_boxes(dp->new_state_pieces(stored_kinds), tensor_places());
      const bool own_row = resume_per_rank == "replicas";
      const std::string prefix = own_row ? "replica/optim/" : "optim/";
      for (ShardPiece& p : wanted) {
        p = own_row ? as_row(std::move(p), prefix, dp_rank, dp_world)
                    : ShardPiece{prefix + p.name, p.full_shape, p.begin, p.end, p.data, p.box};
      }
      LoadShardedOptions lo;
      lo.collective = o.dist.dp.collective;
      load_sharded(comm, path, wanted, lo);
      for (ShardPiece& p : wanted) st.tensors[p.name.substr(prefix.size())] = p.data;
      if (pending_updates > 0) {
        for (const ParamSlice& sl : dp->slices()) {
          if (sl.end > sl.begin) st.steps[sl.name] = pending_updates;
        }
      }
    }
    optimizer->load_state(st);
    pending_state = {};
  }

  // The scheme's own state, after parameters and optimizer state: each
  // rank's row of the checkpoint's sync/ tensors where the checkpoint has
  // them for this scheme (check_sync_fits() saw to that), else the scheme
  // starts afresh at the checkpoint's step.
  void resume_sync_state(const std::string& path) {
    const std::string per = per_rank_name();
    const bool with_state = !per.empty() && per == resume_per_rank;
    if (with_state) {
      std::vector<ShardPiece> wanted;
      if (per == "replicas") {
        scaler_row = Tensor::empty({2}, DType::f64);
        wanted.push_back(
            as_row(full_piece("loss_scaler", scaler_row), "replica/", dp_rank, dp_world));
      }
      for (const ReplicaSync::StatePiece& sp : dp->checkpoint_state()) {
        wanted.push_back(state_row(sp));
      }
      LoadShardedOptions lo;
      lo.collective = o.dist.dp.collective;
      load_sharded(comm, path, wanted, lo);
      if (per == "replicas") {
        LossScalerState ls;
        ls.scale = scaler_row.data<double>()[0];
        ls.good_steps = static_cast<int64_t>(scaler_row.data<double>()[1]);
        scaler.load_state(ls);
      }
    }
    dp->restore_checkpoint(step, with_state);
  }

  EvalModel& eval_model(int64_t batch) {
    auto it = eval_models.find(batch);
    if (it != eval_models.end()) return it->second;
    EvalModel em;
    em.model = build_rank_model(spec, batch, o, rank);
    ExecOptions eo = o.exec;
    eo.outputs = {em.model.logits, em.model.loss};
    eo.recompute = false;
    eo.collectives = runner;  // tensor parallelism: the same groups as training
    em.exec = std::make_unique<Executor>(em.model.graph, eo);
    // Evaluation reads the store's whole parameters, so ranks may run
    // different numbers of batches; under ZeRO-3 (no whole copy) it gathers
    // them per bucket like training, so every rank runs every pass.
    if (o.dist.dp.stage == 3) {
      dp->attach(*em.exec, em.model.graph);
    } else {
      store->bind(*em.exec, em.model.graph, /*with_grads=*/false);
    }
    for (auto& [id, t] : em.model.constants) em.exec->bind(id, t);
    return eval_models.emplace(batch, std::move(em)).first->second;
  }

  // Each rank evaluates a contiguous slice of every test batch; sums are
  // combined across ranks. Returns {loss, accuracy, examples}.
  std::tuple<double, double, int64_t> evaluate() {
    if (dp->replicas_identical()) return evaluate_current();
    // Replicas that drifted apart are evaluated as their (batch-weighted)
    // mean, as the model the run would hand out; each replica then goes on
    // training from its own parameters.
    Tensor own = store->flat_values().clone();
    dp->average_into(store->flat_values());
    auto result = evaluate_current();
    std::memcpy(store->flat_values().raw(), own.raw(), own.nbytes());
    return result;
  }

  std::tuple<double, double, int64_t> evaluate_current() {
    if (!eval_loader) eval_loader = make_eval_loader();
    const DataLoader& tl = *eval_loader;
    double sums[3] = {0, 0, 0};  // loss * rows, correct, rows
    for (int64_t s = 0; s < eval_steps(); ++s) {
      Batch b = tl.batch(0, s);
      const int64_t n = b.size();
      if (n == 0) {
        // ZeRO-3's gathers are collective: a rank with no examples in this
        // batch still runs a forward (on one zero example) and ignores it.
        if (o.dist.dp.stage == 3 && dp_world > 1) dummy_forward();
        continue;
      }
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
    dp_comm->all_reduce(sums, sums, 3, DType::f64);  // tensor peers saw the same examples
    return {sums[0] / sums[2], sums[1] / sums[2], static_cast<int64_t>(sums[2])};
  }

  void dummy_forward() {
    EvalModel& em = eval_model(1);
    const Graph& g = em.model.graph;
    const Value& xv = g.value(em.model.x);
    const Value& yv = g.value(em.model.y);
    em.exec->bind(em.model.x, Tensor::zeros(xv.shape, xv.dtype));
    em.exec->bind(em.model.y, Tensor::zeros(yv.shape, yv.dtype));
    em.exec->run_forward();
  }

  // One optimizer step over K micro-batches; returns the mean loss over the
  // global batch (the same number on every rank).
  double train_step(int64_t epoch, int64_t s) {
    const uint64_t sent_before = tensor_parallel ? tensor_bytes_sent() : 0;
    const double loss = train_step_inner(epoch, s);
    if (tensor_parallel) {
      tensor_bytes_in_steps += tensor_bytes_sent() - sent_before;
      ++tensor_steps;
    }
    return loss;
  }

  double train_step_inner(int64_t epoch, int64_t s) {
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
      exec->bind(
          model.x,
          batch_rows(b.x, m * micro_batch, micro_batch).reshape(model.graph.value(model.x).shape));
      exec->bind(model.y,
                 batch_rows(b.y, m * micro_batch * y_per_example, micro_batch * y_per_example));
      if (loss_scale_in != kNoValue) loss_scale.fill(scaler.scale());
      dp->begin_micro_step(weight);
      exec->run();
      loss += weight * exec->get(model.loss).item();
      span.end();
      auto wait = timeline.span("gradient sync", "wait", Timeline::kWait);
      dp->end_micro_step();
    }
    // A stop request rides along with the loss, so every rank learns of it
    // at the same step without a collective of its own.
    double reduced[2] = {tensor_leader() ? loss : 0.0,
                         o.stop_signal ? static_cast<double>(o.stop_signal->load()) : 0.0};
    if (o.dist.sync.scheme == "ps") return ps_worker_step(reduced, epoch);
    if (dp->lock_step() && (step + 1) % dp->agreement_period() == 0) {
      comm->all_reduce(reduced, reduced, 2, DType::f64);
      loss = reduced[0];
      stop_requested = reduced[1] > 0;
    } else {
      // Asynchronous replicas (sync.scheme = "adpsgd"), or a periodic
      // scheme between its agreements (local_sgd, diloco): no collective;
      // each rank reports the mean loss over its own examples, and a stop
      // request waits for the next agreement, where every rank sees it.
      loss = loss * static_cast<double>(o.batch_size) / static_cast<double>(local_batch);
      stop_requested = !dp->lock_step() && reduced[1] > 0;
    }
    if (!std::isfinite(loss) && o.precision != DType::f16) {
      throw Error(
          fmt::format("training diverged: loss is {} at step {} (epoch {}); lower "
                      "optim.lr or enable optim.clip_grad_norm",
                      loss, step, epoch));
    }
    const double lr = schedule->lr_at(step);
    auto span = timeline.span("optimizer", "optimizer");
    Stopwatch optimizer_sw;
    dp->step([&](std::span<ParamSlice> slices) {
      std::vector<ParamRef> refs;
      refs.reserve(slices.size());
      for (ParamSlice& p : slices) {
        refs.push_back(ParamRef{p.name, p.param, p.grad, p.full_rank(), counted(p.name)});
      }
      bool apply = true;
      if (o.precision == DType::f16) {
        apply = scaler.update(scaler.unscale_and_check(refs, norm_reducer()));
      }
      if (!apply) return;
      if (o.clip_grad_norm > 0) clip_grad_norm(refs, o.clip_grad_norm, norm_reducer());
      Stopwatch update_sw;
      const int64_t cpu0 = thread_cpu_ns();
      optimizer->step(refs, lr);
      update_cpu_seconds +=
          static_cast<double>(thread_cpu_ns() - cpu0) * 1e-9 * std::max(1.0, slowdown());
      if (slowdown() > 1.0) {
        std::this_thread::sleep_for(
            std::chrono::duration<double>(update_sw.seconds() * (slowdown() - 1.0)));
      }
      update_seconds += update_sw.seconds();
    });
    optimizer_seconds += optimizer_sw.seconds();
    ++optimizer_steps;
    return loss;
  }

  // A parameter server's run: answers the workers until they are done; the
  // optimizer steps on this server's shard with the pushing step's learning
  // rate (times the staleness factor the scheme passes).
  void serve_parameters(MetricsWriter& metrics) {
    dp->serve([&](std::span<ParamSlice> slices, int64_t at, double lr_scale) {
      std::vector<ParamRef> refs;
      refs.reserve(slices.size());
      for (ParamSlice& p : slices) {
        refs.push_back(ParamRef{p.name, p.param, p.grad, p.full_rank(), counted(p.name)});
      }
      Stopwatch update_sw;
      optimizer->step(refs, schedule->lr_at(std::min(at, total_steps - 1)) * lr_scale);
      if (slowdown() > 1.0) {
        std::this_thread::sleep_for(
            std::chrono::duration<double>(update_sw.seconds() * (slowdown() - 1.0)));
      }
    });
    for (const std::string& msg : dp->notices()) {
      notice("meshtrain: " + msg);
      metrics.write({{"step", step}, {"sync", msg}});
    }
  }

  // A parameter server's worker after its micro-steps: the push and pull
  // (the optimizer runs on the servers), then the loss: in lock step the
  // global batch's mean, as all-reduce DP has it (reduced after the
  // exchange, so that a stopped worker is named by the servers rather than
  // waited for here); asynchronous workers report their own mean loss.
  double ps_worker_step(double (&reduced)[2], int64_t epoch) {
    const bool lock = dp->lock_step();  // the mode this step's push is handled in
    Stopwatch optimizer_sw;
    dp->step([](std::span<ParamSlice>) {});
    optimizer_seconds += optimizer_sw.seconds();
    ++optimizer_steps;
    if (lock) {
      Stopwatch loss_sw;
      dp_comm->all_reduce(reduced, reduced, 2, DType::f64, ReduceOp::sum, o.dist.dp.collective);
      loss_wait_seconds += loss_sw.seconds();
    } else {
      reduced[0] *= static_cast<double>(o.batch_size) / static_cast<double>(local_batch);
    }
    stop_requested = reduced[1] > 0;
    if (!std::isfinite(reduced[0])) {
      throw Error(fmt::format("training diverged: loss is {} at step {} (epoch {}); lower optim.lr",
                              reduced[0], step, epoch));
    }
    return reduced[0];
  }

  // Evaluates and records the result (metrics line, result, and, after a
  // whole epoch, a progress message). `epoch` is in steps / steps per
  // epoch, a float: 1.0 after the first epoch, 0.25 a quarter into it.
  void record_eval(TrainResult& r, MetricsWriter& metrics, TensorBoardWriter& tensorboard,
                   Progress* progress, int64_t whole_epoch) {
    auto [tl, ta, n] = evaluate();
    const double epoch = static_cast<double>(step) / static_cast<double>(loader->steps_per_epoch());
    metrics.write({{"step", step},
                   {"epoch", epoch},
                   {"test_loss", tl},
                   {"test_accuracy", ta},
                   {"test_examples", n}});
    tensorboard.scalars(
        step, {{"test_loss", static_cast<float>(tl)}, {"test_accuracy", static_cast<float>(ta)}});
    if (progress != nullptr) {
      progress->message(fmt::format("epoch {}: test loss {:.4f}, test accuracy {:.2f}%{}",
                                    whole_epoch, tl, 100.0 * ta, eval_scope(n)));
    }
    r.test_loss = tl;
    r.test_accuracy = ta;
    r.test_examples = n;
  }

  // " (first N of M test examples)" when train.eval_batches limits it.
  std::string eval_scope(int64_t n) const {
    return n < test_data->size()
               ? fmt::format(" (first {} of {} test examples)", n, test_data->size())
               : std::string();
  }

  TrainResult run() {
    MetricsWriter metrics(leader() ? o.metrics_path : std::string());
    TensorBoardWriter tensorboard(leader() ? o.tensorboard_dir : std::string());
    Progress progress(total_steps, o.log_every, o.progress && leader(), o.progress_tty);
    TrainResult r;
    std::vector<double> rates, warmup_rates;
    const int64_t spe = loader->steps_per_epoch();
    const int64_t epochs = (total_steps + spe - 1) / spe;
    // Text models predict one token per position: their targets per sample
    // are the tokens each sample trains on (seq_len); images have one label.
    const int64_t targets = model.graph.value(model.y).shape.numel() / micro_batch;
    const double tokens_per_sample = targets > 1 ? static_cast<double>(targets) : 0.0;
    const int64_t first = step;
    bool evaluated_last = false;
    if (ps_server) serve_parameters(metrics);
    const int64_t stop = ps_server          ? first
                         : o.halt_after > 0 ? std::min(total_steps, first + o.halt_after)
                                            : total_steps;
    for (; step < stop;) {
      const int64_t epoch = step / spe, s = step % spe;
      const double lr = schedule->lr_at(step);
      const double wait_before = dp->stats().wait_seconds + loss_wait_seconds;
      Stopwatch sw;
      const double loss = train_step(epoch, s);
      // The straggler report's exchange is where a fast rank waits for a
      // slower one (a slowed rank sleeps after its step), so the step's time
      // is taken after it: every rank then measures the same period, the
      // throughput the job gets.
      std::optional<StragglerReport> rep;
      // (Under a parameter server only while the workers move in lock step.)
      if (straggler && dp->lock_step()) {
        const double compute =
            sw.seconds() - (dp->stats().wait_seconds + loss_wait_seconds - wait_before);
        rep = straggler->report(step + 1, compute);
        if (!rep->new_stragglers.empty()) dp->persistent_straggler();
      }
      const double dt = sw.seconds();
      const double rate = static_cast<double>(o.batch_size) / dt;
      (step - first >= kWarmupSteps ? rates : warmup_rates).push_back(rate);
      if (step - first == kWarmupSteps) {
        exec->reset_profile();
        dp->reset_stats();
        optimizer_seconds = 0;
        update_seconds = 0;
        update_cpu_seconds = 0;
        optimizer_steps = 0;
      }
      r.losses.push_back(loss);
      r.final_loss = loss;
      ++step;
      evaluated_last = false;
      nlohmann::json line = {{"step", step}, {"loss", loss}, {"samples_per_s", rate}, {"lr", lr}};
      if (tokens_per_sample > 0) line["tokens_per_s"] = rate * tokens_per_sample;
      if (rep) {
        if (rep->exchanged && !rep->seconds.empty()) line["rank_step_s"] = rep->seconds.back();
        for (const std::string& msg : rep->messages) {
          progress.message("meshtrain: " + msg);
          metrics.write({{"step", step}, {"straggler", msg}});
        }
      }
      if (consistency) consistency->maybe_check(step);
      if (!dp->replicas_identical() && o.dist.sync.consensus_every > 0 &&
          step % o.dist.sync.consensus_every == 0) {
        const ReplicaSync::Consensus c = dp->consensus();  // collective
        metrics.write({{"step", step},
                       {"consensus_distance", c.distance},
                       {"consensus_relative", c.relative}});
      }
      if (o.dist.after_step) o.dist.after_step(step, rank);
      if (step % o.log_every == 0 || step == stop) {
        metrics.write(line);
        std::vector<std::pair<std::string, float>> scalars = {
            {"loss", static_cast<float>(loss)},
            {"lr", static_cast<float>(lr)},
            {"samples_per_s", static_cast<float>(rate)}};
        if (tokens_per_sample > 0) {
          scalars.emplace_back("tokens_per_s", static_cast<float>(rate * tokens_per_sample));
        }
        tensorboard.scalars(step, scalars);
      }
      progress.update(
          ProgressUpdate{step, epoch + 1, epochs, loss, rate, rate * tokens_per_sample, lr});
      if (stop_requested && step < stop) {
        // Which signal: the highest any rank saw, so every rank reports alike
        // (a parameter server's worker: its own).
        double sig = o.stop_signal ? static_cast<double>(o.stop_signal->load()) : 0.0;
        if (o.dist.sync.scheme != "ps") {
          comm->all_reduce(&sig, &sig, 1, DType::f64, ReduceOp::max, o.dist.dp.collective);
        }
        r.stop_signal = std::max(1, static_cast<int>(sig));
        break;
      }
      if (o.eval && (step % spe == 0 || (o.eval_every > 0 && step % o.eval_every == 0))) {
        // (The progress message only after a whole epoch.)
        record_eval(r, metrics, tensorboard, step % spe == 0 ? &progress : nullptr, epoch + 1);
        evaluated_last = true;
      }
      if (o.checkpoint_every > 0 && step % o.checkpoint_every == 0) checkpoint_now(r);
    }
    if (straggler) {
      for (const std::string& msg : straggler->summary()) {
        progress.message("meshtrain: " + msg);
        metrics.write({{"step", step}, {"straggler", msg}});
      }
    }
    progress.finish();
    // An invocation that stops before the run's end checkpoints its
    // replicas before finish(), which lands exchanges still in flight:
    // saved in flight, they land where the uninterrupted run has them land.
    // (A parameter server's checkpoint needs finish(): the servers' state.)
    if (step < total_steps && o.dist.sync.scheme != "ps") checkpoint_now(r);
    if (!ps_server) dp->finish();  // ps: the servers' final parameters
    if (o.eval && !evaluated_last && step == total_steps && r.stop_signal == 0) {
      record_eval(r, metrics, tensorboard, nullptr, 0);
    }
    checkpoint_now(r);
    nlohmann::json sync_summary;
    {
      // How the replicas agreed: the scheme, its bytes per step (the
      // communicator's counters; for allreduce the dp group's, the step's
      // loss all-reduce included) and, for schemes whose replicas drift,
      // their spread at the end (collective).
      nlohmann::json sj = {{"scheme", dp->name()}};
      const int64_t ran = step - first;
      if (ran > 0) {
        sj["bytes_sent_per_step"] =
            static_cast<double>(dp->bytes_sent()) / static_cast<double>(ran);
      }
      if (!dp->replicas_identical()) {
        const ReplicaSync::Consensus c = dp->consensus();
        sj["consensus_distance"] = c.distance;
        sj["consensus_relative"] = c.relative;
      }
      if (o.dist.sync.scheme == "adpsgd" || o.dist.sync.scheme == "partial" ||
          o.dist.sync.scheme == "diloco") {
        // Rank 0's own account (exchanges and their waits, or the time spent
        // waiting for layer averages in flight).
        for (const std::string& msg : dp->notices()) {
          notice(msg);
          sj["notices"].push_back(msg);
        }
      }
      sync_summary = sj;
    }
    double hidden = -1;
    if (timeline.enabled()) {
      hidden = hidden_comm_fraction(timeline.events());
      for (Communicator* c : {comm, dp_comm, sync_comm.get()}) {
        if (c != nullptr) c->set_call_observer({});  // the merge's messages stay out of the trace
      }
      timeline.merge_and_write(*comm, o.dist.trace_path);
    }

    r.steps = step;
    r.steps_run = step - first;
    if (!rates.empty()) {
      r.samples_per_s = median_of(rates);
    } else if (!warmup_rates.empty()) {
      r.samples_per_s = median_of(warmup_rates);  // a short run: better than nothing, and flagged
      r.samples_per_s_includes_warmup = true;
    }
    if (r.samples_per_s && tokens_per_sample > 0)
      r.tokens_per_s = *r.samples_per_s * tokens_per_sample;
    double mm_flops = 0, mm_ns = 0;
    int64_t runs = 0;  // executor runs (micro-batches) in this process
    for (const OpProfile& p : exec->profile()) {
      if (p.op == OpKind::matmul) {
        mm_flops += p.flops * static_cast<double>(p.calls);
        mm_ns += static_cast<double>(p.total_ns);
        runs = std::max(runs, p.calls);
      }
    }
    if (mm_ns > 0) r.matmul_gflops = mm_flops / mm_ns;
    if (runs > 0) {
      r.matmul_s_per_step = mm_ns * 1e-9 / static_cast<double>(runs) * o.dist.dp.accumulation_steps;
    }
    r.planned_arena_bytes = exec->memory_plan().arena_bytes;
    r.memory =
        dp->memory(static_cast<int>(optimizer->state_kinds().size()), optimizer->state_bytes());
    r.allocated = memory_counters();
    r.peak_rss_bytes = peak_rss_bytes();
    // This rank's compute per step after the warm-up: its kernels' wall
    // time (the executor's, the slowdown's sleeps included) and the
    // optimizer's update, not waiting for collectives.
    const double compute_s_per_step =
        optimizer_steps > 0 ? (static_cast<double>(exec->compute_ns()) * 1e-9 + update_seconds) /
                                  static_cast<double>(optimizer_steps)
                            : 0.0;
    // The same from the CPU time the kernels and the update took on their
    // thread, times the slowdown: the rank's compute with a core of its own.
    const double compute_cpu_s_per_step =
        optimizer_steps > 0
            ? (static_cast<double>(exec->compute_cpu_ns()) * 1e-9 + update_cpu_seconds) /
                  static_cast<double>(optimizer_steps)
            : 0.0;
    // Every rank's figures, for rank 0's summary. (Not gathered under a
    // parameter server: a worker that stopped, which ASP goes on without,
    // would hold every rank here; the table has this rank only.)
    const nlohmann::json ranks = memory_by_rank(
        *comm, r.peak_rss_bytes, r.allocated, o.dist.dp.collective, o.dist.sync.scheme != "ps",
        {{"compute_s_per_step", compute_s_per_step},
         {"compute_cpu_s_per_step", compute_cpu_s_per_step},
         // Of those, the optimizer's update (after the gradient sync: a
         // rank's batch share does not move it).
         {"update_s_per_step",
          optimizer_steps > 0 ? update_seconds / static_cast<double>(optimizer_steps) : 0.0},
         {"update_cpu_s_per_step",
          optimizer_steps > 0 ? update_cpu_seconds / static_cast<double>(optimizer_steps) : 0.0}});
    const DataParallelStats st = dp->stats();
    nlohmann::json summary = {
        {"summary", true},
        {"steps", r.steps},
        {"steps_run", r.steps_run},
        {"final_loss", or_null(r.final_loss)},
        {"samples_per_s", or_null(r.samples_per_s)},
        {"samples_per_s_includes_warmup", r.samples_per_s_includes_warmup},
        {"matmul_gflops", or_null(r.matmul_gflops)},
        {"matmul_s_per_step", or_null(r.matmul_s_per_step)},
        {"planned_arena_bytes", r.planned_arena_bytes},
        {"allocated_arena_bytes", exec->allocated_arena_bytes()},
        {"param_bytes", store->numel() * 4},
        {"peak_rss_bytes", r.peak_rss_bytes},
        {"mem_live_bytes", memory_by_category(r.allocated.live)},
        {"mem_peak_bytes", memory_by_category(r.allocated.peak)},
        {"mem_peak_total_bytes", r.allocated.peak_total},
        {"ranks", ranks},
        {"threads", o.threads},
        {"world_size", world},
        {"zero_stage", o.dist.dp.stage},
        {"comm_wait_s_per_step",
         st.steps > 0 ? nlohmann::json(st.wait_seconds / static_cast<double>(st.steps))
                      : nlohmann::json(nullptr)},
        {"dp_param_bytes", r.memory.param_bytes},
        {"dp_grad_bytes", r.memory.grad_bytes},
        {"dp_optimizer_bytes", r.memory.optimizer_bytes},
        {"dp_buffer_bytes", r.memory.buffer_bytes()},
        {"dp_expected_buffer_bytes", r.memory.expected_buffer_bytes},
        {"precision",
         o.bf16_storage ? std::string("bf16_storage") : std::string(dtype_name(o.precision))},
        {"precision_decision", precision_json()},
        {"cpu", cpu_info().describe()},
        {"isa", fmt::format("{}; onednn {}", cpu_info().isa_flags(), onednn_isa())},
        {"matmul_engines", engines_json()},
        {"op_profile_ms_per_step", op_profile_json()}};
    if (tokens_per_sample > 0) summary["tokens_per_s"] = or_null(r.tokens_per_s);
    if (hidden >= 0) summary["comm_hidden_fraction"] = hidden;
    summary["sync"] = sync_summary;
    if (tensor_parallel && tensor_steps > 0) {
      r.tensor_bytes_sent_per_step =
          static_cast<double>(tensor_bytes_in_steps) / static_cast<double>(tensor_steps);
    }
    if (tensor_parallel) r.tensor_bytes_predicted_per_step = predicted_tensor_bytes_per_step();
    if (tensor_parallel) {
      // Rank 0's tensor-group traffic per training step: as counted, and as
      // the lowering's collectives predict it (the two agree exactly).
      summary["plan"] = {
          {"mesh", o.dist.plan->mesh.describe()},
          {"sequence_parallel", o.dist.plan->sequence_parallel},
          {"tensor_bytes_sent_per_step",
           tensor_steps > 0 ? nlohmann::json(static_cast<double>(tensor_bytes_in_steps) /
                                             static_cast<double>(tensor_steps))
                            : nlohmann::json(nullptr)},
          {"tensor_bytes_sent_per_step_predicted", predicted_tensor_bytes_per_step()}};
    }
    if (r.stop_signal != 0) summary["stopped_by_signal"] = r.stop_signal;
    if (o.eval) {
      summary["test_loss"] = or_null(r.test_loss);
      summary["test_accuracy"] = or_null(r.test_accuracy);
      summary["test_examples"] = r.test_examples;
    }
    metrics.write(summary);
    return r;
  }
};

nlohmann::json Trainer::Impl::precision_json() const {
  nlohmann::json j = {{"requested", precision.requested},
                      {"chosen", precision.mode()},
                      {"reason", precision.reason},
                      {"amx", precision.amx},
                      {"cpu_amx", precision.cpu_amx}};
  if (precision.bf16_storage || precision.stash_elements > 0) {
    j["bf16_storage"] = precision.bf16_storage;
  }
  if (precision.stash_elements > 0) {
    j["stash_elements"] = precision.stash_elements;
    j["storage_cast_ms_1t"] = precision.storage_cast_s * 1e3;
    j["storage_cost_of_matmul_time"] = precision.storage_cost();
  }
  if (precision.memory_limit > 0 && precision.f32_plan_bytes > 0) {
    j["memory_limit_bytes"] = precision.memory_limit;
    j["f32_plan_bytes"] = precision.f32_plan_bytes;
    j["bf16_storage_plan_bytes"] = precision.storage_plan_bytes;
  }
  if (precision.measured) {
    j["f32_matmul_gflops_1t"] = precision.f32_gflops;
    j["bf16_matmul_gflops_1t"] = precision.bf16_gflops;
    j["bf16_over_f32"] = precision.bf16_over_f32();
    j["measure_s"] = precision.seconds;
  }
  return j;
}

// Executor time per optimizer step by operator kind after warm-up (forward
// and backward together; batched matmuls -- attention's -- apart from the
// 2-D ones), and the optimizer step (with gradient sync and clipping).
nlohmann::json Trainer::Impl::op_profile_json() const {
  std::map<std::string, int> rank_of;  // node name -> rank of its first input
  for (const Node& n : model.graph.nodes()) {
    if (!n.inputs.empty()) rank_of[n.name] = model.graph.value(n.inputs[0]).shape.rank();
  }
  std::map<std::string, double> ns;
  int64_t runs = 0;
  for (const OpProfile& p : exec->profile()) {
    std::string kind(op_name(p.op));
    if (p.op == OpKind::matmul && rank_of[p.name] >= 3) kind = "matmul_batched";
    ns[kind] += static_cast<double>(p.total_ns);
    runs = std::max(runs, p.calls);
  }
  nlohmann::json j = nlohmann::json::object();
  if (runs == 0) return j;
  const double per_step = 1e-6 / static_cast<double>(runs) * o.dist.dp.accumulation_steps;
  for (const auto& [kind, t] : ns) j[kind] = t * per_step;
  if (optimizer_steps > 0) {
    j["optimizer"] = optimizer_seconds * 1e3 / static_cast<double>(optimizer_steps);
  }
  return j;
}

nlohmann::json Trainer::Impl::engines_json() const {
  const EngineReport r = kernels(o.exec.backend, o.exec.fast).engine_report();
  nlohmann::json shapes = nlohmann::json::object(), dropped = nlohmann::json::object();
  for (const auto& [sig, engine] : r.matmul) shapes[sig] = engine;
  for (const auto& [engine, why] : r.dropped) dropped[engine] = why;
  return {{"backend", o.exec.backend},
          {"openblas_core", r.blas_core},
          {"onednn_isa", onednn_isa()},
          {"f32", shapes},
          {"dropped", dropped}};
}

Trainer::Trainer(const ModelSpec& model, std::shared_ptr<const Dataset> train_data,
                 std::shared_ptr<const Dataset> test_data, TrainerOptions options,
                 Communicator* comm) {
  // Plan::devices: mesh rank m on comm's rank devices[m] (validate_plan has
  // checked it is a permutation of the world). The split keeps each
  // process's links (emulated per world rank); the slowdown is per device.
  if (comm != nullptr && options.dist.plan && !options.dist.plan->devices_in_order()) {
    const Plan& plan = *options.dist.plan;
    if (static_cast<int>(plan.devices.size()) != comm->size()) {
      throw ConfigError(
          fmt::format("plan: devices: {} entries for {} ranks", plan.devices.size(), comm->size()));
    }
    mesh_comm_ = comm->subgroup(plan.devices, "mesh");
    comm = mesh_comm_.get();
    if (!options.dist.slowdown.empty()) {
      std::vector<double> by_mesh(plan.devices.size(), 1.0);
      for (size_t m = 0; m < plan.devices.size(); ++m) {
        const auto d = static_cast<size_t>(plan.devices[m]);
        if (d < options.dist.slowdown.size()) by_mesh[m] = options.dist.slowdown[d];
      }
      options.dist.slowdown = std::move(by_mesh);
    }
  }
  if (pipeline_plan(options)) {
    if (comm == nullptr) {
      throw ConfigError("a plan with pipeline stages needs a communicator (one rank per stage)");
    }
    pipe_ = std::make_unique<PipelineTraining>(model, std::move(train_data), std::move(test_data),
                                               std::move(options), *comm);
    return;
  }
  impl_ = std::make_unique<Impl>(model, std::move(train_data), std::move(test_data),
                                 std::move(options), comm);
}
Trainer::~Trainer() = default;
TrainResult Trainer::run() {
  return pipe_ ? pipe_->run() : impl_->run();
}
PipelineTraining* Trainer::pipeline() {
  return pipe_.get();
}
void Trainer::require_unpipelined(const char* what) const {
  if (pipe_) {
    throw ConfigError(fmt::format(
        "Trainer::{}: not available under pipeline parallelism (use pipeline())", what));
  }
}
const TorchLoadReport* Trainer::init_report() const {
  if (pipe_) return pipe_->init_report();
  return impl_->init_report ? &*impl_->init_report : nullptr;
}
std::pair<double, double> Trainer::evaluate() {
  require_unpipelined("evaluate");
  auto [loss, accuracy, examples] = impl_->evaluate();
  return {loss, accuracy};
}
const Graph& Trainer::train_graph() const {
  require_unpipelined("train_graph");
  return impl_->model.graph;
}
const MemoryPlan& Trainer::memory_plan() const {
  require_unpipelined("memory_plan");
  return impl_->exec->memory_plan();
}
ParamStore& Trainer::params() {
  require_unpipelined("params");
  impl_->sync_store();
  return *impl_->store;
}
Tensor Trainer::gather_params() {
  require_unpipelined("gather_params");
  impl_->sync_store();
  if (!impl_->dp->replicas_identical()) {
    Tensor mean = impl_->store->flat_values().clone();
    impl_->dp->average_into(mean);
    return mean;
  }
  return impl_->store->flat_values();
}
ReplicaSync& Trainer::replica_sync() {
  require_unpipelined("replica_sync");
  return *impl_->dp;
}

const LoweredProgram* Trainer::lowered_program() const {
  return impl_ && impl_->tensor_parallel ? &impl_->lowered : nullptr;
}

}  // namespace mt
