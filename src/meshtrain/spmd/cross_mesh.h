// Pipelines whose stages run on different meshes (StagePlan::has_mesh):
// stage 0 tensor-parallel over ranks {0, 1}, stage 1 on rank 2, say.
//
// Every stage's layers are lowered with that stage's own mesh and specs
// (stage_view(), spmd/lower.h); the whole micro-batch model is lowered once
// per stage mesh and cut into the plan's stages, and stage s of the
// runtime's cut comes from the lowering on stage s's mesh. A value crossing
// the boundary between stage s and s + 1 has a layout in each lowering (the
// producer's: replicated, split along one dimension, or partial; the
// consumer's: replicated or split); the two, over the world ranks of the
// two stages, give the boundary's forward and backward ReshardPlan
// (plan_boundary, spmd/reshard.h), which the pipeline runtime runs in place
// of its plain send / recv (PipelineOptions::cross_mesh). With virtual
// stages the same holds per virtual stage; two consecutive ones on the same
// ranks (ZBV's turn) are a boundary inside that rank group. Pure: no
// communication.
#pragma once

#include <string>
#include <vector>

#include "meshtrain/graph/graph.h"
#include "meshtrain/spmd/lower.h"
#include "meshtrain/spmd/pipeline_stage.h"
#include "meshtrain/spmd/plan.h"
#include "meshtrain/spmd/reshard.h"

namespace mt {

struct CrossMeshBoundary {
  int stage = 0;      // the producing (virtual) stage; the consumer is stage + 1
  std::string value;  // its name in the model graph
  Shape shape;        // whole (global) shape
  DType dtype = DType::f32;
  bool has_grad = false;
  TensorLayout producer, consumer;  // over world ranks
  BoundaryReshard plans;
};

struct CrossMeshPipeline {
  int stage = -1;     // the (physical) stage `rank` runs: its first virtual stage
  int mesh_rank = 0;  // its rank in that stage's mesh
  // The virtual stages `rank` runs, in order (those stage_owner maps to
  // `stage`; one without virtual stages), all on one mesh (validate_plan).
  std::vector<int> chunks;
  // This rank's lowering on its stage's mesh (groups in world ranks); under
  // virtual stages each parameter in the layout of the chunk holding it.
  LoweredProgram lowered;
  // Every stage's collective groups, in world ranks, the same lists on every
  // rank (a CommCollectiveRunner per stage is built over them collectively;
  // stage s's lowered graphs name groups of groups[s]).
  std::vector<std::vector<std::vector<int>>> groups;
  // The stages, each from the lowering on its own mesh (this rank's own
  // stage at its own mesh rank); a boundary's outputs of stage s and inputs
  // of stage s + 1 are in the same order.
  PipelineCut cut;
  // boundaries[s][k]: output k of stage s.
  std::vector<std::vector<CrossMeshBoundary>> boundaries;
  // A parameter several stages hold (GPT's tied wte): its gradient summed
  // over the holders' layouts (one per holder stage, over world ranks).
  // Under virtual stages the holders on one rank group share one copy:
  // plans.stages (and layouts) keep the first holder of each.
  struct Shared {
    std::vector<int> holders;  // every (virtual) stage reading it
    std::vector<TensorLayout> layouts;
    SharedParamReshard plans;
  };
  std::vector<Shared> shared;
};

// `forward`: the whole model at the micro-batch size (forward only), `loss`
// its loss; `plan` validated, with stage meshes; `rank` a world rank.
// ConfigError naming the stage and value for a boundary whose layouts it
// cannot pair (a split that is not one dimension's, a value the stages'
// lowerings name differently). A parameter several stages share (GPT's
// tied embedding) gets the plans that sum its gradient over the holders'
// layouts (one-dimension splits or replicated, as boundaries); under
// virtual stages holders on the same ranks must hold it alike (ConfigError
// naming it, the stages and both layouts otherwise).
CrossMeshPipeline plan_cross_mesh(const Graph& forward, ValueId loss, const Plan& plan, int rank);

// For `meshtrain inspect`: each stage's mesh and ranks, and per boundary the
// two layouts, the routes and the bytes each rank sends per micro-batch
// forward and backward.
std::string describe_cross_mesh(const CrossMeshPipeline& p, const Plan& plan);

// For `meshtrain inspect`: per rank of one model replica, the virtual
// stages it runs and, per stage, its parameters' boxes and the collectives
// its forward and backward run inside the stage's mesh.
std::string describe_cross_mesh_programs(const Graph& forward, ValueId loss, const Plan& plan);

// The bytes rank `rank` sends per step for the boundaries (m micro-batches)
// and the shared parameters' gradients.
uint64_t cross_mesh_bytes(const CrossMeshPipeline& p, int rank, int microbatches);

}  // namespace mt
