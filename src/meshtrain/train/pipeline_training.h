// Training under a plan with pipeline stages: what the Trainer runs when
// TrainerOptions::dist.plan has pp > 1.
//
// The model is built at the micro-batch (each data-parallel rank's share of
// the global batch divided by the plan's micro-batches), cut into the plan's
// stages (spmd/pipeline_stage.h) and run by the pipeline runtime
// (spmd/pipeline_runtime.h) over the ranks of this rank's "pp" group, in the
// plan's schedule. Each rank holds only its stages' parameters, drawn from
// the same seeded initial values as the unpipelined model. After each step
// the gradients (means over the step's micro-batches) are averaged over the
// "dp" group, clipped by the global norm (summed over the pipeline, a tied
// parameter counted once) and handed to the configured optimizer and
// learning-rate schedule; the step's loss comes from the last stage.
//
// Tensor axes inside the pipeline (TP x PP, DP x TP x PP): the micro-batch
// model is lowered for the rank (spmd/lower.h) before it is cut, the
// stages' executors run its collectives over the tensor groups, parameters
// start as their boxes, and norms also sum over the tensor groups
// (replicated parameters counted once).
//
// Evaluation (after each epoch and at the end) runs the whole model on every
// rank of a model replica: the replica's ranks join their parameter pieces
// into whole parameters first (one all-reduce of the model's size).
//
// Checkpoints (train.checkpoint, checkpoint_every / keep, train.resume
// including "auto", halt_after) are the unpipelined trainer's sharded
// directories (train/sharded_checkpoint.h) with the same tensor names and
// metadata: each rank writes its parameters' boxes and their optimizer
// state (a replicated or shared parameter once, spread over the dp
// replicas), and reads back the boxes it holds, so a checkpoint written
// under any plan (DP, ZeRO, TP, PP, their mixes) resumes under any other.
// train.init reads a PyTorch-layout file into each rank's boxes (export.h).
//
// parallel.async (pipedream / spectrain, docs/plan.md): the optimizer runs
// after each micro-batch's backward on each stage, micro-batches stay in
// flight across steps, and the runtime drains after the run's last step;
// with a dp axis each micro-batch's gradients are averaged over the stage's
// replicas before its update (PipeDream's hybrid), tensor axes run as
// they do synchronously; GPT's tied wte is updated by the first stage and
// mirrored by the last (the runtime). Not with stages on meshes of their
// own, clipping, f16 or ZeRO.
//
// Stages on different meshes (StagePlan::has_mesh, e.g. stage 0 tensor-
// parallel on ranks {0, 1}, stage 1 on rank 2): each stage's layers lowered
// on its own mesh, the boundary tensors moved by spmd/cross_mesh.h's reshard
// plans inside the runtime; norms sum over the model replica, LARS / LAMB's
// per-parameter norms over the stage's tensor groups. A parameter two
// stages hold (GPT's tied wte) has its gradient summed across their meshes
// by reshard plans. A dp axis runs model replicas (the stages list one
// replica's ranks; each replica's pipeline runs over a communicator of its
// own), gradients averaged (ZeRO: sharded) over dp. Checkpoints, train.init
// and f16 as for other plans. Virtual stages: each chunk on its stage's
// mesh (the chunks of one rank group share it), a rank's parameters in the
// layouts of the chunks holding them.
//
// ZeRO on the dp axis (dist.zero_stage 1, 2, 3): each stage's parameters
// move into one flat buffer that sync/DataParallel shards over the stage's
// dp group, the same sharded optimizer step and collectives as the
// unpipelined trainer; the runtime hands it the step's gradients (summed
// over the micro-batches) with add_grad(). Stage 1 all-reduces them in the
// runtime's own accumulators, stage 2 reduce-scatters them into a shard
// (the micro-batches still accumulate a full gradient first). Optimizer
// state is 1/dp per rank; checkpoints hold each rank's shard of it.
// Stage 3 (as torchtitan runs FSDP inside a pipeline stage, without
// resharding after forward): between steps a rank holds only its shard of
// its stage's parameters, gradients and optimizer state; each step
// all-gathers the stage's whole parameters once (gather_params()), all its
// micro-batches read them and accumulate a whole gradient, which is
// reduce-scattered as at stage 2; after the shard's update both whole
// copies are freed. Checkpoints and evaluation gather the whole
// parameters for their duration.
//
// train.precision f16: dynamic loss scaling (train/loss_scaler.h); each
// micro-batch's loss is multiplied by scale / (micro-batches x dp), so
// backward tensors have the single-process run's magnitudes, and the
// skip-on-overflow decision is agreed over every rank (pipeline, tensor and
// ZeRO dp groups; under stage meshes the whole job).
//
// sync.codec: each stage's gradients go over the dp axis through the
// exchanges plain DP uses: at dist.zero_stage 0 the compressed all-reduce
// (sync/compressed_all_reduce.h), one per parameter this rank holds; under
// ZeRO 1-3 a compressed reduce-scatter per bucket (DataParallel's
// reduce_bucket hook, sync/compressed_reduce_scatter.h); error feedback
// unless sync.codec_error_feedback is off; topk:1.0 is the uncompressed
// exchange. Refused: sync.codec_momentum,
// sync.codec_warmup_steps, sync.powersgd_batched, and on a mesh without a
// dp axis. Each rank's codec state is its row of the checkpoint's
// "sync/pp.codec.state", resumed under the same codec and plan (metadata
// "pp.codec.layout"), else afresh.
//
// train.precision bf16_storage: the runtime stashes each forward's f32
// activations for the backward in bf16 (PipelineOptions::bf16_stash), every
// pass computing in f32; unlike the single-process stash pass it is always
// kept (the stash is per micro-batch in flight, so halving it always lowers
// the peak). auto: decided once for the job by rank 0 on the whole model's
// micro-batch graph (train/precision.h), every rank following it.
//
// Not yet (each refused with a ConfigError naming the key, before any step):
// dist.batch_shares, accumulation steps (micro-batches are the pipeline's).
//
// Collective over the world communicator; one per process.
#pragma once

#include <memory>
#include <string>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/data/dataset.h"
#include "meshtrain/models/model.h"
#include "meshtrain/train/trainer.h"

namespace mt {

class PipelineTraining {
 public:
  PipelineTraining(const ModelSpec& model, std::shared_ptr<const Dataset> train_data,
                   std::shared_ptr<const Dataset> test_data, TrainerOptions options,
                   Communicator& world);
  ~PipelineTraining();
  PipelineTraining(const PipelineTraining&) = delete;
  PipelineTraining& operator=(const PipelineTraining&) = delete;

  TrainResult run();

  // This rank's parameters (its stages'), by name, and their values. Under
  // dist.zero_stage 3 the values exist only after gather_params() (until
  // the next step); param() throws ConfigError otherwise.
  std::vector<std::string> param_names() const;
  Tensor param(const std::string& name) const;
  // dist.zero_stage 3: gathers this rank's stage parameters whole from the
  // dp group's shards (collective over the world: every rank calls it); a
  // no-op under the other stages.
  void gather_params();
  // train.precision f16: this rank's dynamic loss scale now (every rank
  // agrees on it); 1 otherwise.
  double loss_scale() const;
  // Under tensor axes, this rank's program (which box of each parameter it
  // holds); nullptr otherwise.
  const struct LoweredProgram* lowered() const;
  // The bytes this rank's pipeline runtime sent in the last step (its
  // boundary tensors, counted by its communicators) and what the cut (and,
  // for stages on different meshes, the boundaries' reshard plans) predicts.
  uint64_t pipeline_bytes_sent() const;
  uint64_t pipeline_bytes_predicted() const;
  // train.precision as it runs on this rank ("f32", "bf16", "f16" or
  // "bf16_storage"; auto's choice, the same on every rank).
  std::string precision_mode() const;
  // bf16_storage: the elements the last step's forwards on this rank
  // stashed in bf16 (0 otherwise), and the last step's peak of stashed bytes.
  int64_t bf16_stashed_elements() const;
  int64_t peak_stash_bytes() const;
  // sync.codec on the dp axis: the bytes this rank's compressed exchanges
  // sent over the run's steps (the dp communicator's counters, handshakes
  // not counted), and what the codecs' plans predict for one step (0
  // without a codec).
  uint64_t dp_codec_bytes_sent() const;
  uint64_t dp_codec_bytes_predicted_per_step() const;
  // What train.init loaded (nullptr without train.init, or when resuming).
  const struct TorchLoadReport* init_report() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// True when the options' plan has pipeline stages.
bool pipeline_plan(const TrainerOptions& o);
// Throws ConfigError naming the key for what pipelined training does not
// carry yet (the list above); PipelineTraining checks it too.
void check_pipeline_options(const TrainerOptions& o);

}  // namespace mt
