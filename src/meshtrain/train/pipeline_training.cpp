#include "meshtrain/train/pipeline_training.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <optional>

#include "meshtrain/base/error.h"
#include "meshtrain/base/output_path.h"
#include "meshtrain/base/plural.h"
#include "meshtrain/base/timer.h"
#include "meshtrain/data/loader.h"
#include "meshtrain/graph/autodiff.h"
#include "meshtrain/graph/bf16_stash.h"
#include "meshtrain/graph/builder.h"
#include "meshtrain/spmd/collective_runner.h"
#include "meshtrain/spmd/cross_mesh.h"
#include "meshtrain/spmd/lower.h"
#include "meshtrain/spmd/pipeline_runtime.h"
#include "meshtrain/spmd/pipeline_stage.h"
#include "meshtrain/spmd/schedule.h"
#include "meshtrain/sync/codec_spec.h"
#include "meshtrain/sync/compressed_all_reduce.h"
#include "meshtrain/sync/compressed_reduce_scatter.h"
#include "meshtrain/sync/data_parallel.h"
#include "meshtrain/sync/replica_sync.h"
#include "meshtrain/sync/straggler.h"
#include "meshtrain/tensor/box.h"
#include "meshtrain/tensor/kernels.h"
#include "meshtrain/tensor/machine.h"
#include "meshtrain/tensor/memory_stats.h"
#include "meshtrain/train/checkpoint_match.h"
#include "meshtrain/train/export.h"
#include "meshtrain/train/grad_clip.h"
#include "meshtrain/train/loss_scaler.h"
#include "meshtrain/train/memory_report.h"
#include "meshtrain/train/metrics.h"
#include "meshtrain/train/param_store.h"
#include "meshtrain/train/precision.h"
#include "meshtrain/train/progress.h"
#include "meshtrain/train/sharded_checkpoint.h"
#include "meshtrain/train/step_checkpoints.h"
#include "meshtrain/train/timeline.h"
#include "meshtrain/train/training_plan.h"

namespace mt {

namespace {

constexpr int64_t kWarmupSteps = 5;

}  // namespace

void check_pipeline_options(const TrainerOptions& o) {
  auto refuse = [](bool bad, const std::string& what) {
    if (!bad) return;
    throw ConfigError(fmt::format(
        "{}: not available under pipeline parallelism yet; the trainer runs pipeline plans "
        "without it (docs/plan.md, \"Pipeline runtime\")",
        what));
  };
  if (o.bf16_storage && o.exec.recompute) {
    throw ConfigError(
        "train.precision = \"bf16_storage\" with exec.recompute = true: both shrink the "
        "activations the backward reads (one stores them in bf16, the other recomputes them); "
        "pick one");
  }
  refuse(!o.dist.batch_shares.empty(), "dist.batch_shares");
  refuse(o.dist.dp.accumulation_steps != 1,
         "dist.accumulation_steps (the pipeline's micro-batches accumulate)");
  refuse(o.dist.sync.scheme != "allreduce", "sync.scheme other than allreduce");
  // sync.codec: each stage's dp-axis gradients go through plain DP's
  // exchanges (a CompressedAllReduce per parameter, under ZeRO a
  // CompressedReduceScatter per bucket); its ZeRO-0 extras are not here.
  if (parse_codec_spec(o.dist.sync.codec).kind != CodecKind::none) {
    refuse(o.dist.sync.codec_momentum > 0, "sync.codec_momentum");
    refuse(o.dist.sync.codec_warmup_steps > 0, "sync.codec_warmup_steps");
    refuse(o.dist.sync.powersgd_batched, "sync.powersgd_batched");
  }
  if (o.dist.plan && o.dist.plan->async != AsyncMode::none) {
    const std::string_view mode = async_name(o.dist.plan->async);
    auto refuse_async = [&](bool bad, const std::string& what) {
      if (!bad) return;
      throw ConfigError(fmt::format(
          "parallel.async: {} updates each stage on its own after every micro-batch; {} is "
          "not supported with it",
          mode, what));
    };
    refuse_async(o.dist.plan->stage_meshes(), "stages on meshes of their own");
    refuse_async(o.clip_grad_norm > 0,
                 "optim.clip_grad_norm (a global norm would synchronize the stages)");
    refuse_async(o.precision == DType::f16,
                 "train.precision = f16 (the last stage scales each micro-batch's loss, but an "
                 "overflow may show up only on an earlier stage, after the later stages applied "
                 "that micro-batch's update and scaled the ones behind it: a skip cannot be "
                 "agreed per micro-batch without synchronizing the stages)");
    refuse_async(o.dist.dp.stage > 0,
                 "dist.zero_stage > 0 (ZeRO shards a step's update over the dp axis)");
    refuse_async(parse_codec_spec(o.dist.sync.codec).kind != CodecKind::none,
                 "sync.codec (the replicas average each micro-batch's gradients in the runtime, "
                 "uncompressed)");
    refuse_async(o.precision_auto || o.bf16_storage,
                 "train.precision auto / bf16_storage (the bf16 activation stash is not checked "
                 "against weight stashing yet)");
  }
}

bool pipeline_plan(const TrainerOptions& o) {
  return o.dist.plan && o.dist.plan->pipeline_stages() > 1;
}

struct PipelineTraining::Impl {
  ModelSpec spec;
  TrainerOptions o;
  std::shared_ptr<const Dataset> data, test_data;
  Communicator& world;
  const Plan& plan;
  int rank = 0, p = 1, dp_rank = 0, dp_world = 1;
  std::unique_ptr<Communicator> pp_comm, dp_comm, norm_comm;
  // sync.codec (ZeRO 0, dp > 1): one compressed all-reduce of each of this
  // rank's parameters over the dp group (runtime's order), error-feedback
  // state across steps; empty without a codec. Under ZeRO 1-3 one
  // compressed reduce-scatter per bucket of DataParallel's plan instead
  // (its reduce_bucket hook), as plain ZeRO with a codec.
  std::vector<std::unique_ptr<CompressedAllReduce>> dp_codecs;
  std::vector<std::unique_ptr<CompressedReduceScatter>> zero_codecs;
  uint64_t dp_bytes_in_steps = 0;  // dp_comm's bytes during the steps (not evaluations)
  // Checkpoints of the codecs' state (residuals, PowerSGD's Q): row `rank`
  // of "sync/pp.codec.state" ([world, codec_row]), this rank's states one
  // after another, zero-padded to the longest rank's.
  int64_t codec_row = 0;
  Tensor codec_buf;
  std::unique_ptr<DataLoader> loader;
  int64_t local_batch = 0, micro_batch = 0, total_steps = 0;
  ModelGraph model;
  std::map<std::string, Tensor> constants;  // by input name
  PipelineCut cut;
  PipelineSchedule schedule;
  std::unique_ptr<PipelineRuntime> runtime;
  std::unique_ptr<Optimizer> optimizer;
  std::unique_ptr<LrSchedule> lr;
  std::map<std::string, bool> counted;  // per parameter held here: counts in norms
  LoweredProgram lowered;               // tensor axes: this rank's program
  bool tensor_parallel = false;
  std::shared_ptr<CommCollectiveRunner> runner;
  std::vector<std::unique_ptr<Communicator>> tensor_norm_comms;
  // Stages on different meshes (plan.stage_meshes()): the mesh of this
  // rank's tensor axes and its rank in it (the plan's mesh and the world
  // rank otherwise), its physical stage, every stage's collective runner.
  bool xmesh = false;
  const Mesh* tmesh = nullptr;
  int trank = 0, my_stage = 0;
  std::unique_ptr<Communicator> stage_comm;
  std::vector<std::shared_ptr<CommCollectiveRunner>> stage_runners;
  // Stages on different meshes with a dp axis: each model replica's ranks
  // (the world ranks of one dp coordinate, in order) run the stages' ranks
  // as listed, over this communicator of the replica (the whole job at dp 1).
  std::unique_ptr<Communicator> replica_comm;
  // dist.zero_stage 1-2: this rank's stage parameters in one flat buffer,
  // sharded over the dp group by DataParallel (its optimizer state, and at
  // stage 2 its reduced gradients), the runtime's passes reading the buffer.
  // Stage 3: DataParallel holds the parameters' shard; zero_params (and
  // zero_grads, the runtime's accumulators) exist only during a step (or a
  // checkpoint, an evaluation), gathered whole at its start.
  Tensor zero_params;
  std::unique_ptr<DataParallel> zero;
  bool zero3 = false;
  Tensor zero_grads;
  ParamLayout zero_layout;
  // train.precision f16: dynamic loss scaling. Each micro-batch's loss is
  // multiplied by loss_scale (an input of the last stage), the scaler's
  // scale / (micro-batches x dp), so every backward tensor has the
  // magnitude it has in the single-process run at the scaler's scale;
  // overflow is agreed over the pipeline, tensor and (ZeRO) dp groups.
  DynamicLossScaler scaler;
  Tensor loss_scale;
  // train.precision: what ran, and for auto (and bf16) rank 0's measurement.
  PrecisionDecision precision;
  int64_t step = 0;          // optimizer steps completed (a resumed run starts later)
  int64_t current_step = 0;  // the step running (its learning rate)
  int64_t saved_step = -1;   // the step of the last checkpoint written
  std::optional<TorchLoadReport> init_report;
  // dist.trace: each micro-batch's passes, the waits on peers and the
  // stage-to-stage transfers, per rank.
  Timeline timeline;

  // The first rank of its tensor groups (every rank without tensor axes).
  bool tensor_leader() const {
    for (const std::string& axis : lowered.axes) {
      if (tmesh->coord(trank, axis) != 0) return false;
    }
    return true;
  }

  // Evaluation: the whole model on every rank of a model replica (the ranks
  // that share a dp coordinate), its parameters joined from the pieces the
  // replica's ranks hold; each replica evaluates its slice of the test batches.
  std::unique_ptr<Communicator> model_comm;
  std::unique_ptr<ParamStore> whole_params;
  std::map<int64_t, std::pair<ModelGraph, std::unique_ptr<Executor>>> eval_models;

  Impl(const ModelSpec& s, std::shared_ptr<const Dataset> d, std::shared_ptr<const Dataset> test,
       TrainerOptions opts, Communicator& w)
      : spec(s),
        o(std::move(opts)),
        data(std::move(d)),
        test_data(std::move(test)),
        world(w),
        plan(*o.dist.plan),
        timeline(TimelineOptions{!o.dist.trace_path.empty()}) {
    check_pipeline_options(o);
    rank = world.rank();
    plan.mesh.check_world(world.size(), "the plan's mesh");
    p = plan.pipeline_stages();
    dp_rank = plan.mesh.coord(rank, "dp");
    dp_world = plan.mesh.axis_size("dp");
    const CollectiveOptions& co = o.dist.dp.collective;
    xmesh = plan.stage_meshes();
    tmesh = &plan.mesh;
    trank = rank;
    if (xmesh) {
      // The pipeline is the model replica: its stages' ranks are listed (as
      // ranks of the replica), not an axis.
      replica_comm = world.split(dp_rank, rank, "xreplica", co);
      pp_comm = replica_comm->split(0, replica_comm->rank(), "pp", co);
      norm_comm = replica_comm->split(0, replica_comm->rank(), "pp.norms", co);
    } else {
      pp_comm = axis_communicator(world, plan.mesh, "pp", "pp", co);
      norm_comm = axis_communicator(world, plan.mesh, "pp", "pp.norms", co);
    }
    dp_comm = axis_communicator(world, plan.mesh, "dp", "dp", co);
    model_comm = world.split(dp_rank, rank, "replica", co);
    if (o.eval && (!test_data || test_data->size() == 0)) {
      throw ConfigError("train.eval: no test examples to evaluate (data.limit_test = 0?)");
    }
    kernels(o.exec.backend, o.exec.fast).set_num_threads(o.threads);
    spec.compute = o.precision;

    LoaderOptions lo;
    lo.batch_size = o.batch_size;
    lo.seed = o.seed;
    lo.rank = dp_rank;
    lo.world_size = dp_world;
    lo.shuffle = o.shuffle;
    loader = std::make_unique<DataLoader>(*data, lo);
    const auto [lb, le] = loader->local_range(o.batch_size);
    local_batch = le - lb;
    if (local_batch % plan.microbatches != 0) {
      throw ConfigError(fmt::format(
          "parallel.microbatches: data-parallel rank {} gets {} of each global batch of {} "
          "(train.batch_size over {}), which {} micro-batches cannot split evenly",
          dp_rank, local_batch, o.batch_size, plural(dp_world, "data-parallel rank"),
          plan.microbatches));
    }
    micro_batch = local_batch / plan.microbatches;
    total_steps = o.epochs * loader->steps_per_epoch();
    if (o.max_steps > 0) total_steps = std::min(total_steps, o.max_steps);
    if (total_steps <= 0) throw ConfigError("train.epochs / train.steps: the run has no steps");

    decide_precision_once();

    // Tensor axes inside the pipeline: the micro-batch model is lowered for
    // this rank first (spmd/lower.h), then cut; the stages' executors run
    // its collectives over the tensor groups.
    const ModelGraph whole = build_model(spec, micro_batch);
    PipelineOptions po;
    po.exec = o.exec;
    po.bf16_stash = o.bf16_storage;
    po.exec.slowdown =
        rank < static_cast<int>(o.dist.slowdown.size()) ? o.dist.slowdown[rank] : 1.0;
    // Asynchronous pipelining: the optimizer steps after each micro-batch's
    // backward, on this stage's parameters, at the step's learning rate;
    // with a dp axis on the micro-batch's gradients averaged over the
    // stage's replicas first (PipeDream's hybrid).
    po.async = plan.async;
    if (plan.async != AsyncMode::none) po.update = [this](int) { async_update(); };
    schedule = plan_schedule(plan);
    if (xmesh) {
      // Every stage lowered on its own mesh, the boundaries' reshard plans
      // (spmd/cross_mesh.h); the data and constants are read by name, as
      // the unlowered model names them.
      // Under f16 the loss is scaled before the lowering: every stage's
      // program is lowered from the same graph, and the last stage reads
      // loss_scale (replicated over its mesh) as the input it is.
      ModelGraph scaled;
      ValueId objective = whole.loss;
      if (o.precision == DType::f16) {
        scaled = build_model(spec, micro_batch);
        scaler = DynamicLossScaler(o.loss_scaler);
        Builder bld(scaled.graph);
        const ValueId in = bld.input("loss_scale", {}, DType::f32);
        objective = bld.mul(scaled.loss, in);
        loss_scale = Tensor::full({}, DType::f32, 1.0);
      }
      CrossMeshPipeline xp = plan_cross_mesh(o.precision == DType::f16 ? scaled.graph : whole.graph,
                                             objective, plan, replica_comm->rank());
      model = build_model(spec, micro_batch);
      lowered = std::move(xp.lowered);
      tensor_parallel = true;
      cut = std::move(xp.cut);
      my_stage = xp.stage;
      trank = xp.mesh_rank;
      tmesh = &plan.stages[static_cast<size_t>(my_stage)].mesh;
      CrossMeshExchange ex;
      // One rank set per physical stage (virtual stage q < p runs on q).
      for (int q = 0; q < p; ++q)
        ex.stage_ranks.push_back(plan.stages[static_cast<size_t>(q)].ranks);
      for (const auto& bs : xp.boundaries) {
        std::vector<BoundaryReshard> plans;
        for (const CrossMeshBoundary& b : bs) plans.push_back(b.plans);
        ex.boundaries.push_back(std::move(plans));
      }
      for (const CrossMeshPipeline::Shared& sh : xp.shared) ex.shared.push_back(sh.plans);
      po.cross_mesh = std::move(ex);
      for (size_t q = 0; q < xp.groups.size(); ++q) {
        stage_runners.push_back(
            std::make_shared<CommCollectiveRunner>(*replica_comm, xp.groups[q], co));
      }
      runner = stage_runners[static_cast<size_t>(my_stage)];
      po.exec.collectives = runner;
      stage_comm = replica_comm->split(my_stage, trank, "stage", co);
      for (const std::string& axis : lowered.axes) {
        tensor_norm_comms.push_back(
            axis_communicator(*stage_comm, *tmesh, axis, axis + ".norms", co));
      }
    } else {
      model = build_rank_model(spec, micro_batch, o, rank, &lowered, /*whole_logits=*/false);
      tensor_parallel = needs_lowering(plan);
      ValueId objective = model.loss;
      if (o.precision == DType::f16) {
        scaler = DynamicLossScaler(o.loss_scaler);
        Builder bld(model.graph);
        const ValueId in = bld.input("loss_scale", {}, DType::f32);
        objective = bld.mul(model.loss, in);
        loss_scale = Tensor::full({}, DType::f32, 1.0);
      }
      CutOptions cut_options;
      cut_options.param_casts_join_consumers = plan.async == AsyncMode::none;
      cut = cut_pipeline(model.graph, objective, plan.stages, cut_options);
      my_stage = plan.mesh.coord(rank, "pp");
    }
    for (auto& [id, t] : model.constants) constants[model.graph.value(id).name] = t;
    if (loss_scale.defined())
      constants["loss_scale"] = loss_scale;  // a handle: set before each step
    if (tensor_parallel && !xmesh) {
      runner = std::make_shared<CommCollectiveRunner>(world, lowered.groups, co);
      po.exec.collectives = runner;
      for (const std::string& axis : lowered.axes) {
        tensor_norm_comms.push_back(axis_communicator(world, plan.mesh, axis, axis + ".norms", co));
      }
    }
    runtime =
        std::make_unique<PipelineRuntime>(xmesh ? *replica_comm : *pp_comm, cut, schedule, po);
    if (timeline.enabled()) {
      if (rank == 0) {
        check_output_path(o.dist.trace_path, OutputKind::replaced_file, "dist.trace (--trace)");
        create_output_parents(o.dist.trace_path, "dist.trace (--trace)");
      }
      timeline.align(world);
      runtime->set_call_observer([this](const CallEvent& e) {
        timeline.add(fmt::format("{} {}B", collective_name(e.kind), e.bytes), "comm", e.start_ns,
                     e.end_ns, Timeline::kComm, {{"bytes", e.bytes}});
      });
    }

    // The same initial values as the unpipelined model: each parameter from
    // its name's seeded stream, drawn only where it is held (its box of the
    // whole parameter under tensor parallelism).
    const ParamStore layout(whole.graph, o.seed, /*with_grads=*/false, /*with_values=*/false);
    for (const std::string& name : runtime->param_names()) {
      size_t i = 0;
      while (layout.entries()[i].name != name) ++i;
      const ParamStore::Entry& e = layout.entries()[i];
      Tensor t = Tensor::empty(e.shape, DType::f32);
      layout.initial_range(i, 0, e.shape.numel(), t.data<float>());
      const LoweredParam* lp = tensor_parallel ? lowered.param(name) : nullptr;
      if (lp != nullptr && !lp->axis.empty()) {
        Tensor piece = Tensor::empty(lp->box.shape(), DType::f32);
        copy_box_out(t, lp->box, piece);
        runtime->set_param(name, piece);
      } else {
        runtime->set_param(name, t);
      }
      // Norms: a piece of a split parameter always counts; a replicated one
      // on the first rank of each tensor group only.
      bool count = true;
      for (const std::string& axis : lowered.axes) {
        if ((lp == nullptr || lp->axis != axis) && tmesh->coord(trank, axis) != 0) count = false;
      }
      counted[name] = count;
    }
    // A parameter held by several stages counts on the first holder only.
    for (const auto& [name, holders] : cut.shared_params) {
      if (!counted.count(name)) continue;
      const int first =
          stage_owner(plan.schedule, p, *std::min_element(holders.begin(), holders.end()));
      counted[name] = counted[name] && first == my_stage;
    }

    if (o.dist.dp.stage > 0) attach_zero();
    attach_codecs();

    // A parameter is whole on each rank that holds it (a shared one
    // identical on its holders), or under tensor axes split over its tensor
    // group, whose ranks hold the same stages, or under ZeRO split over the
    // dp group: LARS / LAMB norms sum over the tensor and (ZeRO) dp groups;
    // the global clipping norm also over the pipeline.
    optimizer = make_optimizer(o.optimizer, o.optim);
    if (tensor_parallel || zero) {
      std::vector<Communicator*> groups;
      for (const auto& c : tensor_norm_comms) groups.push_back(c.get());
      const CollectiveOptions c2 = co;
      optimizer->set_norm_reducer([groups, c2, dpr = zero_reducer()](std::span<double> v) {
        if (dpr) dpr(v);
        for (Communicator* g : groups) {
          g->all_reduce(v.data(), v.data(), v.size(), DType::f64, ReduceOp::sum, c2);
        }
      });
    }
    LrScheduleOptions so = o.schedule;
    so.total_steps = std::max<int64_t>(total_steps, so.warmup_steps + 1);
    lr = std::make_unique<LrSchedule>(so);

    if (o.resume_path == "auto") {
      o.resume_path = resolve_auto_resume(o.checkpoint_path, world, o.dist.dp.collective,
                                          [&](const std::string& m) { notice(m); });
    }
    if (!o.resume_path.empty()) {
      resume(o.resume_path);
      notice(fmt::format("resumed from step {} ({})", step, o.resume_path));
      if (!o.init_path.empty()) {
        notice(fmt::format("train.init ({}) is not applied: the checkpoint holds the parameters",
                           o.init_path));
      }
    } else if (!o.init_path.empty()) {
      init_from(o.init_path);
    }
    if (zero3) {
      scatter_whole();
      drop_whole();
    }
  }

  void notice(const std::string& msg) const {
    if (rank == 0 && o.on_notice) o.on_notice(msg);
  }

  // train.precision auto (and bf16, which warns when slower): decided once
  // for the job, not per stage, so every stage runs the same mode and the
  // pipeline matches the single-process run's choice. Rank 0 measures the
  // whole model's f32 and bf16 matmuls on its micro-batch training graph
  // and the casts of what the single-process stash pass would keep in bf16
  // (train/precision.h), and every rank follows its decision (broadcast
  // over the world). The memory-limit clause of auto is not applied here
  // (no per-rank plan of the pipeline's memory yet).
  void decide_precision_once() {
    const std::string requested = o.precision_auto ? std::string("auto")
                                  : o.bf16_storage ? std::string("bf16_storage")
                                                   : std::string(dtype_name(o.precision));
    const bool measure = o.precision_auto || o.precision == DType::bf16;
    std::vector<MatmulUse> uses;
    std::vector<int64_t> stash_sizes;
    if (measure && rank == 0) {
      ModelSpec f32_spec = spec;
      f32_spec.compute = DType::f32;
      ModelGraph m = build_model(f32_spec, micro_batch);
      build_backward(m.graph, m.loss);
      uses = matmul_uses(m.graph);
      if (o.precision_auto && !o.exec.recompute) {
        Graph g = m.graph;
        const Bf16StashReport st = stash_in_bf16(g);
        for (ValueId v : st.stashed) stash_sizes.push_back(g.value(v).shape.numel());
      }
    }
    precision = decide_precision(requested, uses, o.exec.backend, o.exec.fast,
                                 o.bf16_rate_factor_for_testing, stash_sizes,
                                 o.storage_cost_factor_for_testing);
    if (measure && world.size() > 1) follow_rank0_precision(world, precision);
    o.precision = precision.chosen;
    o.bf16_storage = precision.bf16_storage;
    spec.compute = precision.chosen;
    if (measure) notice(precision.reason);
  }

  // sync.codec on the dp axis (ZeRO 0; check_pipeline_options refuses the
  // rest): the exchange plain DP runs (sync/compressed_all_reduce.h), per
  // parameter this rank holds, in the runtime's order on every rank of the
  // dp group (its ranks hold the same stages and pieces).
  void attach_codecs() {
    CompressedAllReduceOptions co;
    co.codec = parse_codec_spec(o.dist.sync.codec);
    if (co.codec.kind == CodecKind::none) return;
    if (dp_world == 1) {
      throw ConfigError(fmt::format(
          "sync.codec = \"{}\": the plan's mesh ({}) has no dp axis, so no gradients are "
          "exchanged to compress; drop sync.codec or add a dp axis",
          o.dist.sync.codec, plan.mesh.describe()));
    }
    co.codec.error_feedback = o.dist.sync.codec_error_feedback;
    co.collective = o.dist.dp.collective;
    for (const std::string& name : runtime->param_names()) {
      if (zero) break;  // the reduce-scatters of attach_zero()
      const Tensor t = runtime->param(name);
      dp_codecs.push_back(std::make_unique<CompressedAllReduce>(
          *dp_comm, fmt::format("{} (dp axis, stage {})", name, my_stage), t.shape(), co));
    }
    int64_t n = 0;
    for_each_codec([&](const auto& c) { n += static_cast<int64_t>(c.state_numel()); });
    world.all_reduce(&n, &codec_row, 1, DType::i64, ReduceOp::max, o.dist.dp.collective);
    codec_buf = Tensor::zeros({std::max<int64_t>(1, codec_row)}, DType::f32);
  }

  // What a checkpoint's codec rows must match to be this run's: the codec,
  // the mesh and every stage's layers (so each rank holds the same
  // parameters), the row length. The same on every rank.
  std::string codec_layout() const {
    std::string s =
        fmt::format("{} {} zero {} row {}", parse_codec_spec(o.dist.sync.codec).to_string(),
                    plan.mesh.describe(), o.dist.dp.stage, codec_row);
    for (const StagePlan& st : plan.stages)
      s += " [" + fmt::format("{}", fmt::join(st.layers, ",")) + "]";
    return s;
  }

  ShardPiece codec_piece() {
    const int64_t row = std::max<int64_t>(1, codec_row);
    return ShardPiece{"sync/pp.codec.state", Shape({world.size(), row}), rank * row,
                      (rank + 1) * row, codec_buf};
  }

  // Every codec exchange of this rank: the compressed all-reduces (ZeRO 0)
  // or reduce-scatters (ZeRO 1-3), in order.
  template <typename F>
  void for_each_codec(F&& f) const {
    for (const auto& c : dp_codecs) f(*c);
    for (const auto& c : zero_codecs) f(*c);
  }

  // The bytes one step's codec exchanges send per their plans (0 without
  // a codec; under ZeRO not counting its f32 parameter all-gathers).
  uint64_t dp_codec_bytes_predicted() const {
    uint64_t n = 0;
    for_each_codec([&](const auto& c) { n += c.predicted_traffic().bytes_sent; });
    return n;
  }

  // ZeRO-1 / 2 over the dp group (sync/data_parallel.h), the same sharded
  // update the unpipelined trainer runs, over this stage's parameters: they
  // move into one flat buffer (in the runtime's order) that the passes read
  // and DataParallel updates in place. Stages 1: the runtime accumulates
  // its micro-batches' gradients straight into DataParallel's full gradient
  // buffer, all-reduced in place; 2: from the runtime's accumulators into
  // buckets that are reduce-scattered, each rank keeping its shard.
  //
  // Stage 3, as torchtitan composes FSDP with pipelining (FSDP's
  // reshard_after_forward off inside a stage): DataParallel keeps this
  // rank's shard of the stage's parameters (and of their gradients and
  // optimizer state); each step gathers the whole parameters once into a
  // fresh flat buffer that all the step's micro-batches read, the
  // runtime accumulates their gradients into another, which is
  // reduce-scattered as at stage 2, each rank updates its shard, and both
  // buffers are freed: between steps a rank holds only its shards.
  void attach_zero() {
    int64_t at = 0;
    for (const std::string& name : runtime->param_names()) {
      const Shape s = runtime->param(name).shape();
      zero_layout.push_back({name, s, at});
      at += s.numel();
    }
    {
      MemoryScope tag(MemoryCategory::params);
      zero_params = Tensor::zeros({at}, DType::f32);
    }
    DataParallelOptions dpo = o.dist.dp;
    dpo.accumulation_steps = 1;  // the pipeline's micro-batches accumulate
    zero3 = dpo.stage == 3;
    const bool codec = parse_codec_spec(o.dist.sync.codec).kind != CodecKind::none;
    if (codec && dp_world > 1) {
      dpo.reduce_bucket = [this](int bucket, std::span<const float> g, std::span<float> chunk) {
        zero_codecs[static_cast<size_t>(bucket)]->run(g, chunk);
      };
    }
    if (zero3) {
      // The runtime's initial values move into the flat buffer first;
      // DataParallel copies its shard out of it. The whole buffers stay
      // until the end of construction (train.resume / train.init write
      // whole parameters into them), then scatter_whole() and drop_whole().
      MemoryScope tag(MemoryCategory::grads);
      zero_grads = Tensor::zeros({at}, DType::f32);
      bind_whole(/*copy_values=*/true);
    }
    zero = std::make_unique<DataParallel>(*dp_comm, zero_layout, zero_params, dpo);
    zero->use_external_grads();
    if (dpo.reduce_bucket) {
      CompressedAllReduceOptions co;
      co.codec = parse_codec_spec(o.dist.sync.codec);
      co.codec.error_feedback = o.dist.sync.codec_error_feedback;
      co.collective = o.dist.dp.collective;
      const BucketPlan& bp = zero->plan();
      for (size_t b = 0; b < bp.buckets().size(); ++b) {
        zero_codecs.push_back(std::make_unique<CompressedReduceScatter>(
            *dp_comm,
            fmt::format("bucket {} ({}) of stage {}", b, bp.bucket_params(static_cast<int>(b)),
                        my_stage),
            bp.buckets()[b].counts, co));
      }
    }
    if (zero3) return;
    for (const ParamLayoutEntry& e : zero_layout) {
      runtime->bind_storage(e.name,
                            Tensor::wrap(zero_params.data<float>() + e.offset, e.shape, DType::f32),
                            zero->full_grad(e.name));
    }
  }

  // ZeRO-3: the runtime's passes read zero_params (and add into
  // zero_grads, when it exists).
  void bind_whole(bool copy_values) {
    const bool grads = zero_grads.raw() != nullptr;
    for (const ParamLayoutEntry& e : zero_layout) {
      runtime->bind_storage(
          e.name, Tensor::wrap(zero_params.data<float>() + e.offset, e.shape, DType::f32),
          grads ? Tensor::wrap(zero_grads.data<float>() + e.offset, e.shape, DType::f32) : Tensor(),
          copy_values);
    }
  }

  // ZeRO-3 (collective over the dp group): the stage's whole parameters
  // gathered from the shards into a fresh buffer the runtime reads, and
  // with `grads` a gradient buffer it accumulates into (zeroed by the
  // step); a no-op when they are there already or without ZeRO-3.
  void gather_whole(bool grads) {
    if (!zero3) return;
    const int64_t F = zero->plan().flat_numel();
    if (zero_params.raw() == nullptr) {
      MemoryScope tag(MemoryCategory::params);
      zero_params = Tensor::empty({F}, DType::f32);
      zero->gather_params(zero_params);
    }
    if (grads && zero_grads.raw() == nullptr) {
      MemoryScope tag(MemoryCategory::grads);
      zero_grads = Tensor::empty({F}, DType::f32);
    }
    bind_whole(/*copy_values=*/false);
  }

  // ZeRO-3: frees the whole copies; the runtime's handles on them are not
  // read until gather_whole() binds new ones.
  void drop_whole() {
    if (!zero3) return;
    zero_params = Tensor();
    zero_grads = Tensor();
  }

  // ZeRO-3: the whole parameters (as train.resume / train.init wrote them)
  // into this rank's shard.
  void scatter_whole() {
    for (ShardPiece pc : zero->param_pieces(PieceUse::load)) {
      const ParamLayoutEntry& e = zero_layout[static_cast<size_t>(zero->plan().find(pc.name))];
      std::copy_n(zero_params.data<float>() + e.offset + pc.begin, pc.end - pc.begin,
                  pc.data.data<float>());
    }
  }

  // Sums over every group whose ranks hold different pieces of the
  // gradients: the pipeline, the tensor groups and (ZeRO) the dp group.
  void reduce_over_pieces(std::span<double> v) {
    if (zero) {
      if (auto dpr = zero->norm_reducer()) dpr(v);
    }
    norm_comm->all_reduce(v.data(), v.data(), v.size(), DType::f64, ReduceOp::sum,
                          o.dist.dp.collective);
    for (const auto& c : tensor_norm_comms) {
      if (xmesh) break;  // norm_comm is the whole replica: every piece counted once
      c->all_reduce(v.data(), v.data(), v.size(), DType::f64, ReduceOp::sum, o.dist.dp.collective);
    }
  }

  // The factor the micro-batches' losses are multiplied by under f16.
  double micro_loss_scale() const {
    return scaler.scale() / static_cast<double>(plan.microbatches * dp_world);
  }

  // Sums over the dp group where slices are ZeRO shards; empty otherwise.
  std::function<void(std::span<double>)> zero_reducer() {
    return zero ? zero->norm_reducer() : std::function<void(std::span<double>)>();
  }

  // Checkpoints: the sharded directory format of the unpipelined trainer
  // (train/sharded_checkpoint.h, train_state.h's names "param/<name>" and
  // "optim/<name>.<kind>", the same metadata), so a checkpoint written here
  // loads under any other plan and the reverse. Each parameter (and its
  // optimizer state) lies in the whole tensor where this rank's box is (the
  // whole tensor when it is not split).
  TensorPlace place_of(const std::string& name) const {
    const LoweredParam* lp = tensor_parallel ? lowered.param(name) : nullptr;
    if (lp != nullptr && !lp->axis.empty()) return {lp->global, lp->box};
    const Shape s = runtime->param(name).shape();
    return {s, Box::whole(s)};
  }

  static ShardPiece piece_at(const std::string& key, const TensorPlace& pl, const Tensor& data) {
    return box_piece(key, pl.whole, pl.box, data);
  }

  // Rank r writes a parameter's elements when it counts it (the first
  // holder of a shared one, the first rank of its tensor groups for a
  // replicated one), each data-parallel replica 1/dp of them; the other
  // holders name the tensor with an empty piece.
  ShardPiece save_piece(const std::string& key, const std::string& param,
                        const Tensor& values) const {
    const TensorPlace pl = place_of(param);
    if (!counted.at(param)) return ShardPiece{key, pl.whole, 0, 0, Tensor()};
    ShardPiece pc = piece_at(key, pl, values);
    const auto [b, e] = even_range(pc.end - pc.begin, dp_rank, dp_world);
    if (b == e) return ShardPiece{key, pl.whole, 0, 0, Tensor()};
    pc.begin = b;
    pc.end = e;
    pc.data =
        Tensor::wrap(const_cast<float*>(values.data<float>()) + b, Shape({e - b}), DType::f32);
    return pc;
  }

  std::map<std::string, std::string> state_metadata() const {
    std::map<std::string, std::string> m;
    m["optimizer"] = std::string(optimizer->name());
    m["step"] = std::to_string(step);
    m["epoch"] = std::to_string(step / loader->steps_per_epoch());
    m["lr_step"] = std::to_string(step);
    const LossScalerState ls = scaler.state();  // f32 / bf16: unused
    m["loss_scale"] = fmt::format("{}", ls.scale);
    m["loss_scale_good_steps"] = std::to_string(ls.good_steps);
    double updates = 0;
    for (const auto& [name, n] : optimizer->state().steps) {
      updates = std::max(updates, static_cast<double>(n));
    }
    // Every rank records the same (rank 0's metadata is written).
    world.all_reduce(&updates, &updates, 1, DType::f64, ReduceOp::max, o.dist.dp.collective);
    m["optimizer_updates"] = std::to_string(static_cast<int64_t>(updates));
    m.merge(model_settings(spec));
    m["seed"] = std::to_string(o.seed);
    return m;
  }

  void save(const std::string& path) {
    gather_whole(false);  // ZeRO-3: the pieces below read whole parameters
    std::vector<ShardPiece> pieces;
    const OptimizerState st = optimizer->state();
    for (const std::string& name : runtime->param_names()) {
      pieces.push_back(save_piece("param/" + name, name, runtime->param(name)));
      for (const std::string& kind : optimizer->state_kinds()) {
        auto it = st.tensors.find(name + "." + kind);
        if (it != st.tensors.end() && !zero) {
          pieces.push_back(save_piece("optim/" + it->first, name, it->second));
        }
      }
    }
    if (zero) {
      // Each dp rank writes its shard of the optimizer state (the counting
      // holder's; the others name the tensor with an empty piece).
      for (ShardPiece pc : zero->state_pieces(st.tensors, PieceUse::save)) {
        const std::string param = pc.name.substr(0, pc.name.rfind('.'));
        const TensorPlace pl = place_of(param);
        pc = counted.at(param) ? in_box(std::move(pc), pl)
                               : ShardPiece{pc.name, pl.whole, 0, 0, Tensor()};
        pc.name = "optim/" + pc.name;
        pieces.push_back(std::move(pc));
      }
    }
    std::map<std::string, std::string> meta = state_metadata();
    if (codec_row > 0) {
      // Each rank's codec state as its row (resumed by the same plan and codec).
      float* x = codec_buf.data<float>();
      for_each_codec([&](const auto& c) {
        const size_t m = c.state_numel();
        c.save_state({x, m});
        x += m;
      });
      pieces.push_back(codec_piece());
      meta["pp.codec.layout"] = codec_layout();
    }
    SaveShardedOptions so;
    so.mode = "pp+" + plan.mesh.describe();
    so.collective = o.dist.dp.collective;
    save_sharded(&world, path, pieces, meta, so);
    drop_whole();
  }

  void checkpoint_now(TrainResult& r) {
    if (o.checkpoint_path.empty() || saved_step == step) return;
    const std::string path =
        o.checkpoint_keep > 0 ? step_checkpoint_path(o.checkpoint_path, step) : o.checkpoint_path;
    save(path);
    saved_step = step;
    r.checkpoint = path;
    if (o.checkpoint_keep > 0 && rank == 0) {
      try {
        prune_step_checkpoints(o.checkpoint_path, o.checkpoint_keep, path);
      } catch (const Error& e) {
        notice(fmt::format("warning: {}", e.what()));
      }
    }
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

  // The index of a sharded checkpoint of exactly this model (strict resume,
  // checkpoint_match.h) written with this optimizer; every rank throws alike.
  ShardedIndex checked_index(const std::string& path) {
    ShardedIndex idx;
    std::exception_ptr err;
    try {
      std::error_code ec;
      if (!std::filesystem::is_directory(path, ec) && std::filesystem::exists(path, ec)) {
        throw ConfigError(fmt::format(
            "train.resume = \"{}\": a single-file checkpoint (whole tensors) does not resume "
            "under a pipeline plan yet; checkpoint directories do (any plan's)",
            path));
      }
      idx = read_index(path);
      TensorSignatures stored, expected;
      for (const auto& [name, t] : idx.tensors) {
        if (name.starts_with("param/")) stored[name.substr(6)] = {t.dtype, t.shape};
      }
      for (const ParamStore::Entry& e : whole_layout().entries()) {
        expected[e.name] = {DType::f32, e.shape};
      }
      std::map<std::string, std::string> recorded;
      for (const auto& [k, v] : idx.metadata) {
        if (k == "model" || k.starts_with("model.")) recorded[k] = v;
      }
      require_same_params(path, recorded, model_settings(spec), stored, expected);
      auto opt = idx.metadata.find("optimizer");
      if (opt == idx.metadata.end() || opt->second != optimizer->name()) {
        throw CheckpointError(
            fmt::format("checkpoint {}: written with optimizer '{}' but this run uses '{}'", path,
                        opt == idx.metadata.end() ? "?" : opt->second, optimizer->name()));
      }
      meta_int(idx.metadata, "step", path);
      meta_int(idx.metadata, "optimizer_updates", path);
    } catch (...) {
      err = std::current_exception();
    }
    agree_on_failure(&world, err, o.dist.dp.collective);
    return idx;
  }

  // This rank's boxes of its parameters and of their optimizer state (the
  // kinds the writer saved), read in one collective load; the run goes on
  // from the checkpoint's step.
  void resume(const std::string& path) {
    const ShardedIndex idx = checked_index(path);
    std::vector<ShardPiece> wanted;
    OptimizerState st;
    const int64_t updates = meta_int(idx.metadata, "optimizer_updates", path);
    // A kind the writer never created (no update yet, SGD without momentum) is not asked
    // for; load_sharded names a tensor that only some parameters lack.
    std::vector<std::string> stored_kinds;
    for (const std::string& kind : optimizer->state_kinds()) {
      bool stored_kind = false;
      for (const auto& [tname, t] : idx.tensors) {
        stored_kind |= tname.starts_with("optim/") && tname.ends_with("." + kind);
      }
      if (stored_kind) stored_kinds.push_back(kind);
    }
    for (const std::string& name : runtime->param_names()) {
      const TensorPlace pl = place_of(name);
      wanted.push_back(piece_at("param/" + name, pl, runtime->param(name)));
      for (const std::string& kind : stored_kinds) {
        if (zero) break;  // its shards, below
        const std::string key = name + "." + kind;
        MemoryScope tag(MemoryCategory::optimizer);
        Tensor t = Tensor::empty(pl.box.shape(), DType::f32);
        st.tensors[key] = t;
        wanted.push_back(piece_at("optim/" + key, pl, t));
      }
      if (updates > 0 && !zero) st.steps[name] = updates;
    }
    if (zero) {
      // This rank's ZeRO shard of each state tensor, in the whole tensor.
      for (ShardPiece pc : zero->new_state_pieces(stored_kinds)) {
        pc = in_box(std::move(pc), place_of(pc.name.substr(0, pc.name.rfind('.'))));
        pc.name = "optim/" + pc.name;
        wanted.push_back(std::move(pc));
      }
      for (const ParamSlice& sl : zero->slices()) {
        if (updates > 0 && sl.end > sl.begin) st.steps[sl.name] = updates;
      }
    }
    // The codecs' state where the checkpoint has this run's (same codec and
    // plan); otherwise it starts afresh (every rank decides alike, from the
    // metadata).
    bool codec_state = false;
    if (codec_row > 0) {
      auto it = idx.metadata.find("pp.codec.layout");
      codec_state = it != idx.metadata.end() && it->second == codec_layout();
      if (codec_state) {
        wanted.push_back(codec_piece());
      } else {
        notice(fmt::format(
            "sync.codec = \"{}\": checkpoint {} holds no codec state of this codec and plan; "
            "the residuals start at zero",
            o.dist.sync.codec, path));
      }
    }
    LoadShardedOptions lo;
    lo.collective = o.dist.dp.collective;
    load_sharded(&world, path, wanted, lo);
    for (const ShardPiece& pc : wanted) {
      if (zero && pc.name.starts_with("optim/")) st.tensors[pc.name.substr(6)] = pc.data;
    }
    optimizer->load_state(st);
    step = meta_int(idx.metadata, "step", path);
    if (codec_state) {
      const float* x = codec_buf.data<float>();
      // One run per step (every parameter, every bucket).
      for (const auto& c : dp_codecs) {
        const size_t m = c->state_numel();
        c->load_state({x, m}, static_cast<uint64_t>(step));
        x += m;
      }
      for (const auto& c : zero_codecs) {
        const size_t m = c->state_numel();
        c->load_state({x, m}, static_cast<uint64_t>(step));
        x += m;
      }
    }
    if (o.precision == DType::f16) {
      LossScalerState ls;
      auto it = idx.metadata.find("loss_scale");
      try {
        if (it != idx.metadata.end()) ls.scale = std::stod(it->second);
      } catch (const std::exception&) {
        throw CheckpointError(
            fmt::format("checkpoint {}: metadata 'loss_scale' is not a number", path));
      }
      ls.good_steps = meta_int(idx.metadata, "loss_scale_good_steps", path);
      scaler.load_state(ls);
    }
    if (step >= total_steps) {
      notice(fmt::format(
          "the run is {} steps long (train.epochs, train.steps): nothing is left to train",
          total_steps));
    }
  }

  // The whole model's parameter names and shapes (no values).
  const ParamStore& whole_layout() {
    if (!layout_of_whole) {
      layout_of_whole = std::make_unique<ParamStore>(build_model(spec, 1).graph, o.seed,
                                                     /*with_grads=*/false, /*with_values=*/false);
    }
    return *layout_of_whole;
  }
  std::unique_ptr<ParamStore> layout_of_whole;

  // train.init: this rank's boxes of its parameters from a PyTorch-layout
  // file (export.h); a rank that cannot read it fails the others too.
  void init_from(const std::string& path) {
    std::map<std::string, Tensor> held;
    std::map<std::string, TensorPlace> places;
    for (const std::string& name : runtime->param_names()) {
      held[name] = runtime->param(name);  // a handle: written in place
      const TensorPlace pl = place_of(name);
      if (!(pl.box == Box::whole(pl.whole))) places[name] = pl;
    }
    std::exception_ptr err;
    try {
      init_report =
          load_torch_weights_into_boxes(path, spec, held, places, TorchLoadOptions{o.init_partial});
    } catch (...) {
      err = std::current_exception();
    }
    agree_on_failure(&world, err, o.dist.dp.collective);
  }

  // One optimizer step: the pipeline's forward and backward over the
  // micro-batches, gradients averaged over dp, clipping, the update.
  double step_once(int64_t epoch, int64_t s, int64_t at) {
    current_step = at;
    const Batch b = loader->batch(epoch, s);
    const int64_t y_per = b.y.numel() / local_batch;
    const Shape xs = model.graph.value(model.x).shape;
    const bool f16 = o.precision == DType::f16;
    const double used_scale = f16 ? micro_loss_scale() : 1.0;
    if (f16) loss_scale.fill(used_scale);
    const uint64_t dp_before = codec_row > 0 ? sync_bytes_sent(*dp_comm) : 0;
    gather_whole(/*grads=*/true);  // ZeRO-3: once per step, for every micro-batch
    runtime->run_step([&](int i, const std::string& input) -> Tensor {
      if (input == model.graph.value(model.x).name) {
        return batch_rows(b.x, i * micro_batch, micro_batch).reshape(xs);
      }
      if (input == model.graph.value(model.y).name) {
        return batch_rows(b.y, i * micro_batch * y_per, micro_batch * y_per);
      }
      auto it = constants.find(input);
      return it != constants.end() ? it->second : Tensor();
    });
    std::vector<std::string> names = runtime->param_names();
    if (zero) {
      // Equal shares of the global batch; last parameter first, as buckets form.
      zero->begin_micro_step(1.0 / static_cast<double>(dp_world));
      for (auto it = names.rbegin(); it != names.rend(); ++it) {
        zero->add_grad(*it, runtime->grad(*it));
      }
      zero->end_micro_step();
      if (zero3) zero_grads = Tensor();  // reduce-scattered into DataParallel's shard
    } else if (!dp_codecs.empty() && plan.async == AsyncMode::none) {
      // The average over the dp group of what each rank's codec sent.
      for (size_t i = 0; i < names.size(); ++i) {
        Tensor g = runtime->grad(names[i]);
        const std::span<float> v(g.data<float>(), static_cast<size_t>(g.numel()));
        dp_codecs[i]->run(v, v);
      }
    } else if (dp_world > 1 && plan.async == AsyncMode::none) {
      for (const std::string& name : names) {
        Tensor g = runtime->grad(name);
        dp_comm->all_reduce(g, ReduceOp::sum, o.dist.dp.collective);
        float* d = g.data<float>();
        const auto inv = static_cast<float>(1.0 / static_cast<double>(dp_world));
        for (int64_t k = 0, n = g.numel(); k < n; ++k) d[k] *= inv;
      }
    }
    // The loss: the last stage of every dp replica, once per tensor group.
    double red[2] = {runtime->has_loss() && tensor_leader() ? runtime->loss() / dp_world : 0.0,
                     0.0};
    world.all_reduce(red, red, 2, DType::f64, ReduceOp::sum, o.dist.dp.collective);
    if (plan.async == AsyncMode::none) optimizer_step(at, used_scale);
    drop_whole();  // ZeRO-3: the shards were updated; the whole copy goes
    if (codec_row > 0) dp_bytes_in_steps += sync_bytes_sent(*dp_comm) - dp_before;
    return red[0] / used_scale;
  }

  // Async: after one micro-batch's backward (its gradients in the runtime,
  // a tied parameter's parts summed by its owner), averaged over the dp
  // replicas of this stage, which run the same micro-batch index of their
  // shares of the global batch; mirrors of a tied parameter stay as the
  // runtime set them (its owner updates it).
  // The replicas' average runs as one all-reduce of the stage's gradients
  // packed into one buffer (a collective per parameter and micro-batch
  // would pay its latency ~50 times per micro-batch for the GPT).
  void async_update() {
    std::vector<ParamRef> refs;
    int64_t total = 0;
    for (const std::string& name : runtime->param_names()) {
      if (runtime->async_mirrored(name)) continue;
      Tensor prm = runtime->param(name);
      Tensor g = runtime->grad(name);
      total += g.numel();
      refs.push_back(ParamRef{name, prm, g, prm.rank(), counted[name]});
    }
    if (dp_world > 1) {
      if (async_flat.raw() == nullptr || async_flat.numel() != total) {
        MemoryScope tag(MemoryCategory::grads);
        async_flat = Tensor::empty({total}, DType::f32);
      }
      float* f = async_flat.data<float>();
      for (const ParamRef& r : refs) f = std::copy_n(r.grad.data<float>(), r.grad.numel(), f);
      dp_comm->all_reduce(async_flat, ReduceOp::sum, o.dist.dp.collective);
      const auto inv = static_cast<float>(1.0 / static_cast<double>(dp_world));
      const float* from = async_flat.data<float>();
      for (ParamRef& r : refs) {
        float* d = r.grad.data<float>();
        for (int64_t k = 0, n = r.grad.numel(); k < n; ++k) d[k] = from[k] * inv;
        from += r.grad.numel();
      }
    }
    optimizer->step(refs, lr->lr_at(current_step));
  }
  Tensor async_flat;  // async with a dp axis: the stage's gradients, packed

  // Clipping and the optimizer on this rank's parameters with their
  // gradients in the runtime.
  // used_scale: what the gradients carry under f16 (1 otherwise).
  void optimizer_step(int64_t at, double used_scale = 1.0) {
    std::vector<ParamRef> refs;
    const bool f16 = o.precision == DType::f16;
    if (zero) {
      for (const ParamSlice& sl : zero->slices()) {
        refs.push_back(ParamRef{sl.name, sl.param, sl.grad, sl.full_rank(), counted[sl.name]});
      }
    } else {
      for (const std::string& name : runtime->param_names()) {
        Tensor prm = runtime->param(name);
        refs.push_back(ParamRef{name, prm, runtime->grad(name), prm.rank(), counted[name]});
      }
    }
    const auto over_pieces = [this](std::span<double> v) { reduce_over_pieces(v); };
    bool apply = true;
    if (f16) {
      // The gradients carry used_scale (the scaler's scale over the
      // micro-batches and replicas): divided by it, then checked; every
      // rank of the world takes the same decision.
      const auto inv = static_cast<float>(1.0 / used_scale);
      for (ParamRef& r : refs) {
        float* g = r.grad.data<float>();
        for (int64_t k = 0, n = r.grad.numel(); k < n; ++k) g[k] *= inv;
      }
      apply = scaler.update(grads_finite(refs, over_pieces));
    }
    if (apply) {
      if (o.clip_grad_norm > 0) clip_grad_norm(refs, o.clip_grad_norm, over_pieces);
      optimizer->step(refs, lr->lr_at(at));
    }
    if (zero) zero->finish_step();  // stages 1-2: all-gathers the updated shards
  }

  // Joins the whole parameters on every rank of this model replica: each
  // element written by exactly one rank (the `counted` one), then summed.
  void join_whole_params() {
    if (!whole_params) {
      whole_params = std::make_unique<ParamStore>(build_model(spec, 1).graph, o.seed, false, true);
    }
    whole_params->flat_values().fill(0.0);
    for (const std::string& name : runtime->param_names()) {
      if (!counted[name]) continue;
      const ParamStore::Entry* e = whole_params->find(name);
      Tensor whole = e->value;  // a handle on the store's memory
      const Tensor piece = runtime->param(name);
      const LoweredParam* lp = tensor_parallel ? lowered.param(name) : nullptr;
      if (lp == nullptr || lp->axis.empty()) {
        std::copy_n(piece.data<float>(), piece.numel(), whole.data<float>());
        continue;
      }
      copy_box_in(whole, lp->box, piece);
    }
    model_comm->all_reduce(whole_params->flat_values(), ReduceOp::sum, o.dist.dp.collective);
  }

  // {loss, accuracy, examples} on the test split (or its first eval_batches
  // batches), every data-parallel replica a slice of each batch.
  std::tuple<double, double, int64_t> evaluate() {
    gather_whole(false);
    join_whole_params();
    drop_whole();
    LoaderOptions lo;
    lo.batch_size = std::min<int64_t>(o.eval_batch_size, test_data->size());
    lo.shuffle = false;
    lo.drop_last = false;
    lo.rank = dp_rank;
    lo.world_size = dp_world;
    const DataLoader tl(*test_data, lo);
    const int64_t steps =
        o.eval_batches > 0 ? std::min(o.eval_batches, tl.steps_per_epoch()) : tl.steps_per_epoch();
    double sums[3] = {0, 0, 0};
    for (int64_t s = 0; s < steps; ++s) {
      const Batch b = tl.batch(0, s);
      const int64_t n = b.size();
      if (n == 0) continue;
      auto it = eval_models.find(n);
      if (it == eval_models.end()) {
        ModelGraph m = build_model(spec, n);
        ExecOptions eo = o.exec;
        eo.outputs = {m.logits, m.loss};
        eo.recompute = false;
        auto ex = std::make_unique<Executor>(m.graph, eo);
        whole_params->bind(*ex, m.graph, false);
        for (auto& [id, t] : m.constants) ex->bind(id, t);
        it = eval_models.emplace(n, std::make_pair(std::move(m), std::move(ex))).first;
      }
      ModelGraph& m = it->second.first;
      Executor& ex = *it->second.second;
      ex.bind(m.x, b.x.reshape(m.graph.value(m.x).shape));
      ex.bind(m.y, b.y);
      ex.run_forward();
      const Tensor logits = ex.get(m.logits);
      const int64_t rws = logits.shape()[0], classes = logits.shape()[1];
      sums[0] += ex.get(m.loss).item() * static_cast<double>(rws);
      const float* l = logits.data<float>();
      const int32_t* y = b.y.data<int32_t>();
      for (int64_t q = 0; q < rws; ++q) {
        const float* rowp = l + q * classes;
        sums[1] += (std::max_element(rowp, rowp + classes) - rowp) == y[q] ? 1 : 0;
      }
      sums[2] += static_cast<double>(rws);
    }
    dp_comm->all_reduce(sums, sums, 3, DType::f64);
    return {sums[0] / sums[2], sums[1] / sums[2], static_cast<int64_t>(sums[2])};
  }

  // The step's passes (lane "compute", category forward / backward, with
  // their CPU time and the runtime's overhead around them) and waits.
  void trace_step(int64_t at, int64_t t0, int64_t t1) {
    if (!timeline.enabled()) return;
    timeline.add(fmt::format("step {}", at + 1), "step", t0, t1, 3);
    for (const PipelineSpan& sp : runtime->spans()) {
      const bool fwd = sp.kind == ActionKind::forward;
      timeline.add(describe(PipelineAction{sp.kind, sp.microbatch, sp.stage, -1}),
                   fwd ? "forward" : "backward", sp.start_ns, sp.end_ns, Timeline::kCompute,
                   {{"cpu_ms", static_cast<double>(sp.cpu_ns) * 1e-6},
                    {"overhead_ms", static_cast<double>(sp.overhead_ns) * 1e-6}});
    }
    for (const PipelineSpan& w : runtime->waits()) {
      const std::string name = w.microbatch < 0 ? std::string("sends of the step")
                                                : fmt::format("wait {}{}@{}", action_name(w.kind),
                                                              w.microbatch, w.stage);
      timeline.add(name, "wait", w.start_ns, w.end_ns, Timeline::kWait);
    }
  }

  // 1 - (compute of all stages) / (p x the step's makespan), from every
  // rank's spans (collective over the pipeline group); also, over all
  // stages, the passes' CPU time / wall time (below 1: the core was shared)
  // and the runtime's overhead around the passes / the makespan x p.
  struct StepIdle {
    double idle = 0, cpu_ratio = 0, overhead = 0;
  };
  StepIdle idle_fraction() {
    double first = 1e300, last = -1e300;
    double v[3] = {0, 0, 0};  // busy, cpu, overhead
    for (const PipelineSpan& sp : runtime->spans()) {
      v[0] += static_cast<double>(sp.end_ns - sp.start_ns);
      v[1] += static_cast<double>(sp.cpu_ns);
      v[2] += static_cast<double>(sp.overhead_ns);
      first = std::min(first, static_cast<double>(sp.start_ns));
      last = std::max(last, static_cast<double>(sp.end_ns));
    }
    double ends[2] = {-first, last};
    // Stages on different meshes: one rank per stage counts its passes.
    if (xmesh && trank != 0) v[0] = v[1] = v[2] = 0;
    pp_comm->all_reduce(v, v, 3, DType::f64, ReduceOp::sum, o.dist.dp.collective);
    pp_comm->all_reduce(ends, ends, 2, DType::f64, ReduceOp::max, o.dist.dp.collective);
    const double makespan = ends[1] + ends[0];
    if (makespan <= 0) return {};
    const double cap = static_cast<double>(p) * makespan;
    return {1.0 - v[0] / cap, v[0] > 0 ? v[1] / v[0] : 0.0, v[2] / cap};
  }

  TrainResult run() {
    const bool leader = rank == 0;
    MetricsWriter metrics(leader ? o.metrics_path : std::string());
    Progress progress(total_steps, o.log_every, o.progress && leader, o.progress_tty);
    TrainResult r;
    std::vector<double> rates, warm, idle, cpu_ratio, overhead;
    const int64_t spe = loader->steps_per_epoch();
    const int64_t targets = model.graph.value(model.y).shape.numel() / micro_batch;
    const double tokens_per_sample = targets > 1 ? static_cast<double>(targets) : 0.0;
    uint64_t sent = 0;
    int64_t peak_stash = 0, peak_weight_stash = 0;
    int peak_weight_versions = 0;
    // This rank's passes' wall time (its compute, the slowdown's sleeps
    // included) over the steps after the warm-up.
    double compute_s = 0;
    double compute_cpu_s = 0;  // the passes' thread CPU time x slowdown
    const double slowdown =
        rank < static_cast<int>(o.dist.slowdown.size()) ? o.dist.slowdown[rank] : 1.0;
    int64_t compute_steps = 0;
    const int64_t first = step;
    const int64_t stop =
        o.halt_after > 0 ? std::min(total_steps, first + o.halt_after) : total_steps;
    for (; step < stop;) {
      const int64_t epoch = step / spe;
      Stopwatch sw;
      const int64_t t_start = now_ns();
      const double loss = step_once(epoch, step % spe, step);
      const double dt = sw.seconds();
      trace_step(step, t_start, now_ns());
      const double rate = static_cast<double>(o.batch_size) / dt;
      (step - first >= kWarmupSteps ? rates : warm).push_back(rate);
      const StepIdle si = idle_fraction();
      const double idle_now = si.idle;
      if (step - first >= kWarmupSteps || stop - first <= kWarmupSteps) {
        idle.push_back(idle_now);
        cpu_ratio.push_back(si.cpu_ratio);
        overhead.push_back(si.overhead);
        for (const PipelineSpan& sp : runtime->spans()) {
          compute_s += static_cast<double>(sp.end_ns - sp.start_ns) * 1e-9;
          compute_cpu_s += static_cast<double>(sp.cpu_ns) * 1e-9 * std::max(1.0, slowdown);
        }
        ++compute_steps;
      }
      sent += runtime->bytes_sent();
      peak_stash = std::max(peak_stash, runtime->peak_stash_bytes());
      peak_weight_stash = std::max(peak_weight_stash, runtime->peak_weight_stash_bytes());
      peak_weight_versions = std::max(peak_weight_versions, runtime->peak_weight_versions());
      // Async: micro-batches stay in flight across steps; the backwards
      // still owed run (and update) after the run's last step, before its
      // evaluation and checkpoint.
      if (step + 1 == stop) runtime->drain();
      if (!std::isfinite(loss) && o.precision != DType::f16) {
        throw Error(fmt::format("training diverged: loss is {} at step {}", loss, step));
      }
      r.losses.push_back(loss);
      r.final_loss = loss;
      nlohmann::json line = {{"step", step + 1},
                             {"loss", loss},
                             {"samples_per_s", rate},
                             {"lr", lr->lr_at(step)},
                             {"pipeline_idle_fraction", idle_now}};
      if (tokens_per_sample > 0) line["tokens_per_s"] = rate * tokens_per_sample;
      if ((step + 1) % o.log_every == 0 || step + 1 == total_steps) metrics.write(line);
      progress.update(ProgressUpdate{step + 1, epoch + 1, (total_steps + spe - 1) / spe, loss, rate,
                                     rate * tokens_per_sample, lr->lr_at(step)});
      // Evaluation after each whole epoch (and every train.eval_every steps)
      // and at the end of the run.
      if (o.eval && ((step + 1) % spe == 0 || step + 1 == total_steps ||
                     (o.eval_every > 0 && (step + 1) % o.eval_every == 0))) {
        const auto [tl, ta, n] = evaluate();
        metrics.write({{"step", step + 1},
                       {"epoch", static_cast<double>(step + 1) / static_cast<double>(spe)},
                       {"test_loss", tl},
                       {"test_accuracy", ta},
                       {"test_examples", n}});
        progress.message(fmt::format("step {}: test loss {:.4f}, test accuracy {:.2f}%", step + 1,
                                     tl, 100.0 * ta));
        r.test_loss = tl;
        r.test_accuracy = ta;
        r.test_examples = n;
      }
      if (o.dist.after_step) o.dist.after_step(step + 1, rank);
      ++step;
      if (o.checkpoint_every > 0 && step % o.checkpoint_every == 0) checkpoint_now(r);
    }
    progress.finish();
    checkpoint_now(r);
    r.steps = step;
    r.steps_run = step - first;
    r.samples_per_s = median_of(rates.empty() ? warm : rates);
    r.samples_per_s_includes_warmup = rates.empty();
    if (tokens_per_sample > 0) r.tokens_per_s = *r.samples_per_s * tokens_per_sample;
    r.allocated = memory_counters();
    r.peak_rss_bytes = peak_rss_bytes();
    // Every rank's memory and compute per step, for rank 0's summary.
    const double steps_done = static_cast<double>(std::max<int64_t>(1, compute_steps));
    const nlohmann::json ranks =
        memory_by_rank(world, r.peak_rss_bytes, r.allocated, o.dist.dp.collective, true,
                       {{"compute_s_per_step", compute_s / steps_done},
                        {"compute_cpu_s_per_step", compute_cpu_s / steps_done}});
    nlohmann::json summary = {
        {"summary", true},
        {"steps", r.steps},
        {"steps_run", r.steps_run},
        {"samples_per_s", *r.samples_per_s},
        {"samples_per_s_includes_warmup", r.samples_per_s_includes_warmup},
        {"peak_rss_bytes", r.peak_rss_bytes},
        {"mem_live_bytes", memory_by_category(r.allocated.live)},
        {"mem_peak_bytes", memory_by_category(r.allocated.peak)},
        {"mem_peak_total_bytes", r.allocated.peak_total},
        {"ranks", ranks},
        {"threads", o.threads},
        {"world_size", world.size()},
        {"ranks", ranks},
        {"cpu", fmt::format("{} {}", cpu_info().vendor, cpu_info().model)},
        {"isa", fmt::format("{}; onednn {}", cpu_info().isa_flags(), onednn_isa())},
        {"plan",
         {{"mesh", plan.mesh.describe()},
          {"schedule", std::string(schedule_name(plan.schedule))},
          {"microbatches", plan.microbatches},
          {"virtual_stages", plan.virtual_stages},
          {"pipeline_idle_fraction", median_of(idle)},
          {"pipeline_idle_fraction_formula",
           formula_idle_fraction(plan.schedule, p, plan.microbatches, plan.virtual_stages)},
          {"pipeline_pass_cpu_over_wall", median_of(cpu_ratio)},
          {"pipeline_overhead_fraction", median_of(overhead)},
          {"pipeline_bytes_sent_per_step",
           static_cast<double>(sent) / static_cast<double>(std::max<int64_t>(1, step - first))},
          {"pipeline_bytes_sent_per_step_predicted", runtime->predicted_bytes_sent()},
          {"bf16_stash_elements_per_step", runtime->bf16_stashed_elements()},
          {"dp_codec", o.dist.sync.codec},
          {"dp_codec_bytes_sent_per_step",
           static_cast<double>(dp_bytes_in_steps) /
               static_cast<double>(std::max<int64_t>(1, step - first))},
          {"dp_codec_bytes_sent_per_step_predicted", dp_codec_bytes_predicted()},
          {"peak_stash_bytes", peak_stash},
          {"async", std::string(async_name(plan.async))},
          {"peak_weight_stash_bytes", peak_weight_stash},
          {"peak_weight_versions", peak_weight_versions},
          {"planned_peak_stash_bytes", planned_stash_bytes(cut, schedule, my_stage)}}}};
    summary["precision"] = precision.mode();
    summary["precision_decision"] = {{"requested", precision.requested},
                                     {"chosen", precision.mode()},
                                     {"reason", precision.reason},
                                     {"decided", "once for the job, by rank 0"}};
    if (precision.measured) {
      summary["precision_decision"]["f32_matmul_gflops_1t"] = precision.f32_gflops;
      summary["precision_decision"]["bf16_matmul_gflops_1t"] = precision.bf16_gflops;
    }
    if (precision.stash_elements > 0) {
      summary["precision_decision"]["stash_elements"] = precision.stash_elements;
      summary["precision_decision"]["storage_cost_of_matmul_time"] = precision.storage_cost();
    }
    if (r.final_loss) summary["final_loss"] = *r.final_loss;
    if (tokens_per_sample > 0) summary["tokens_per_s"] = *r.tokens_per_s;
    if (r.test_loss) {
      summary["test_loss"] = *r.test_loss;
      summary["test_accuracy"] = *r.test_accuracy;
      summary["test_examples"] = r.test_examples;
    }
    metrics.write(summary);
    if (timeline.enabled()) timeline.merge_and_write(world, o.dist.trace_path);
    return r;
  }
};

PipelineTraining::PipelineTraining(const ModelSpec& model, std::shared_ptr<const Dataset> data,
                                   std::shared_ptr<const Dataset> test_data, TrainerOptions options,
                                   Communicator& world)
    : impl_(std::make_unique<Impl>(model, std::move(data), std::move(test_data), std::move(options),
                                   world)) {}

PipelineTraining::~PipelineTraining() = default;

TrainResult PipelineTraining::run() {
  return impl_->run();
}

std::vector<std::string> PipelineTraining::param_names() const {
  return impl_->runtime->param_names();
}

Tensor PipelineTraining::param(const std::string& name) const {
  if (impl_->zero3 && impl_->zero_params.raw() == nullptr) {
    throw ConfigError(fmt::format(
        "PipelineTraining::param('{}'): under dist.zero_stage 3 a rank holds only its shard "
        "between steps; call gather_params() first",
        name));
  }
  return impl_->runtime->param(name);
}

void PipelineTraining::gather_params() {
  impl_->gather_whole(false);
}

uint64_t PipelineTraining::pipeline_bytes_sent() const {
  return impl_->runtime->bytes_sent();
}

std::string PipelineTraining::precision_mode() const {
  return impl_->precision.mode();
}

int64_t PipelineTraining::bf16_stashed_elements() const {
  return impl_->runtime->bf16_stashed_elements();
}

int64_t PipelineTraining::peak_stash_bytes() const {
  return impl_->runtime->peak_stash_bytes();
}

uint64_t PipelineTraining::dp_codec_bytes_sent() const {
  return impl_->dp_bytes_in_steps;
}

uint64_t PipelineTraining::dp_codec_bytes_predicted_per_step() const {
  return impl_->dp_codec_bytes_predicted();
}

uint64_t PipelineTraining::pipeline_bytes_predicted() const {
  return impl_->runtime->predicted_bytes_sent();
}

double PipelineTraining::loss_scale() const {
  return impl_->o.precision == DType::f16 ? impl_->scaler.scale() : 1.0;
}

const TorchLoadReport* PipelineTraining::init_report() const {
  return impl_->init_report ? &*impl_->init_report : nullptr;
}

const LoweredProgram* PipelineTraining::lowered() const {
  return impl_->tensor_parallel ? &impl_->lowered : nullptr;
}

}  // namespace mt
