// A parallel plan: how one model graph is spread over the ranks of a job.
// The device mesh (named axes), a sharding spec per value (parameters,
// inputs, activations, by the graph's value names; a value not named is
// replicated), the pipeline stages (which layers, which ranks), the number of
// micro-batches and the schedule that interleaves them.
//
// A plan is data: read from and written to JSON (docs/plan.md), expanded
// from the config's [parallel] shorthand (shorthand.h), validated against a
// graph and a world size before any step (validate_plan), and executed by
// the runtime (data-parallel plans today; tensor and pipeline parallelism
// come with the lowering pass). Pure functions, no communication.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "meshtrain/graph/graph.h"
#include "meshtrain/spmd/mesh.h"
#include "meshtrain/spmd/schedule.h"
#include "meshtrain/spmd/sharding.h"

namespace mt {

// One (virtual) pipeline stage: a contiguous run of the model's layers and
// the ranks (its sub-mesh) that run them.
struct StagePlan {
  std::vector<std::string> layers;
  std::vector<int> ranks;  // empty in a file: the ranks whose pp coordinate is the stage's
  // Activation recomputation: the stage keeps only its received inputs per
  // micro-batch in flight and runs its forward again before the backward.
  bool recompute = false;
  // Stages on different meshes (JSON "mesh" and "values" per stage): the
  // stage's own device mesh over `ranks` (stage mesh rank m is ranks[m]) and
  // spec overrides for its values. Without a mesh the stage uses the plan's
  // mesh and specs. The tensors crossing a boundary between stages on
  // different meshes move through spmd/reshard.h (docs/plan.md,
  // "Stages on different meshes").
  bool has_mesh = false;
  Mesh mesh{};
  std::vector<std::pair<std::string, ShardingSpec>> specs{};
  bool operator==(const StagePlan&) const = default;
};

struct Plan {
  Mesh mesh{};
  // Sharding specs by value name, in the order written (graph order when
  // expanded from the shorthand).
  std::vector<std::pair<std::string, ShardingSpec>> specs{};
  // The pipeline's virtual stages in order (p * virtual_stages of them;
  // virtual stage s runs on physical stage s % p). Empty: one stage holding
  // every layer on every rank.
  std::vector<StagePlan> stages;
  int microbatches = 1;
  ScheduleKind schedule = ScheduleKind::one_f_one_b;
  int virtual_stages = 1;
  // 1f1b: extra warm-up forwards per stage but the last (make_schedule).
  int warmup_extra = 0;
  // Asynchronous pipelining on 1f1b (schedule.h's AsyncMode): weight
  // updates after each micro-batch, PipeDream's stash or SpecTrain's
  // prediction. Not equivalent to the synchronous run.
  AsyncMode async = AsyncMode::none;
  // Megatron's sequence parallelism in the layer-norm regions over the tp
  // axis (reduce-scatter + all-gather instead of all-reduce); recorded for
  // the lowering pass.
  bool sequence_parallel = false;
  std::string model;  // the model kind it was written for; "" = not recorded
  // Which device (world rank: the process mpirun started, its cluster-file
  // place and dist.slowdown entry) takes each mesh position: mesh rank m
  // runs on world rank devices[m]. Empty: mesh rank = world rank. Lets a
  // plan group like devices into a tensor group or put the fast ones on a
  // chosen pipeline stage without renumbering the cluster.
  std::vector<int> devices;

  // The spec of `value` (replicated when the plan does not name it).
  const ShardingSpec& spec(std::string_view value) const;
  void set_spec(const std::string& value, ShardingSpec s);
  // Physical pipeline stages p (1 without stages).
  int pipeline_stages() const;
  // Whether the plan is plain data parallelism: no split parameter, no
  // partial sum, one stage, one micro-batch; only inputs split (on dim 0).
  bool data_parallel_only(const Graph& g) const;
  // The world rank running mesh rank `m` (devices[m], or m without devices).
  int device_of(int m) const;
  // Whether `devices` is empty or the identity.
  bool devices_in_order() const;
  // Whether the stages carry their own meshes (StagePlan::has_mesh).
  bool stage_meshes() const;
  bool operator==(const Plan&) const = default;
};

// The model's layers in order: the first component of each parameter's name
// ("block0" of "block0.attn.q.w", "fc1", "wte"), as stages list them.
std::vector<std::string> model_layers(const Graph& g);

// Throws ConfigError (naming `where`, the key or value and what was
// expected) unless the plan can run `g` (built at the global batch) on
// `world` ranks: the mesh covers the world; every named value exists in the
// graph and its spec fits its shape on the mesh; every stage has layers and
// ranks, every layer is in exactly one stage, in model order; the schedule
// can run this many stages, micro-batches and virtual stages; the global
// batch divides into the micro-batches; `devices`, when given, is a
// permutation of the world's ranks.
void validate_plan(const Plan& plan, const Graph& g, int world, int64_t global_batch,
                   std::string_view where);

// JSON (docs/plan.md). Reading throws ConfigError naming `source` and the
// key path ("plan p.json: values.block0.attn.q.w.dims[1].axis: expected a
// string, got 3"); unknown keys are errors. load_plan throws FileError for
// an unreadable file.
Plan plan_from_json(std::string_view text, const std::string& source);
Plan load_plan(const std::string& path);
std::string plan_to_json(const Plan& plan);
// Writes atomically enough for a user-edited file (FileError naming the path).
void write_plan(const Plan& plan, const std::string& path);

// What `meshtrain inspect --plan` prints: the mesh, each rank's coordinates
// and groups, every value's spec with its local shape and bytes per rank,
// the stages, the schedule's actions per stage and its idle fraction.
std::string describe_plan(const Plan& plan, const Graph& g);

// Stage s of a plan with stage meshes seen as a plan of its own, what the
// lowering pass takes: the stage's mesh, the plan's specs of the stage's
// parameters (the values whose first name component is one of its layers)
// overridden by the stage's own "values"; no stages, one micro-batch.
Plan stage_view(const Plan& plan, int s);

// The plan's pipeline schedule (its stages, micro-batches, kind, virtual
// stages and extra warm-up). Call validate_plan() first.
PipelineSchedule plan_schedule(const Plan& plan);

}  // namespace mt
