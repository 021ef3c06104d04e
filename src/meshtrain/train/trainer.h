// The training loop: builds the model's training graph (forward + backward),
// owns the parameters (ParamStore), the optimizer, the LR schedule, the data
// loaders and the executors, and runs epochs of steps with periodic
// evaluation, metrics (JSON lines), progress output and checkpoints.
//
// Determinism: with the same options and seed, two runs produce bitwise
// identical losses and parameters (parameters are initialised from streams
// derived from the seed, batches come from the seeded DataLoader, kernels are
// deterministic for a fixed thread count). Resuming from a checkpoint written
// at step s continues exactly as the uninterrupted run would.
//
// run() blocks until training ends. One Trainer per process (rank).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/data/dataset.h"
#include "meshtrain/exec/executor.h"
#include "meshtrain/models/model.h"
#include "meshtrain/spmd/plan.h"
#include "meshtrain/sync/data_parallel.h"
#include "meshtrain/sync/replica_sync.h"
#include "meshtrain/tensor/memory_stats.h"
#include "meshtrain/train/export.h"
#include "meshtrain/train/loss_scaler.h"
#include "meshtrain/train/lr_schedule.h"
#include "meshtrain/train/optimizer.h"

namespace mt {

// How data-parallel ranks cooperate (ignored at world size 1 except for
// accumulation and bucket settings, which then still apply).
struct DistOptions {
  DataParallelOptions dp;  // ZeRO stage, bucket size, overlap, accumulation steps
  // Per-rank integer shares of each global batch (e.g. {2, 1} for a device
  // twice as fast as the other); empty = equal. Gradients are weighted so the
  // result equals the even global batch.
  std::vector<int64_t> batch_shares;
  // Every K steps, replicas compare checksums of their parameters and stop
  // with an error naming the first tensor that differs (0 = never).
  int64_t consistency_every = 100;
  // Report ranks persistently slower than the others (median step time over
  // a window of steps, threshold x the others' median).
  bool straggler_report = true;
  double straggler_threshold = 1.2;
  // Emulated device speed: rank r's compute is stretched by slowdown[r]
  // (e.g. {1, 2}: rank 1 behaves like a device half as fast). Empty = none.
  std::vector<double> slowdown;
  // Fault injection for tests and drills: called on every rank after each
  // optimizer step with the step count (the CLI uses it to kill or stall a
  // rank on purpose).
  std::function<void(int64_t step, int rank)> after_step;
  // Chrome-trace JSON of every rank's operators, collectives and waits,
  // merged into one file by rank 0 (empty = no trace).
  std::string trace_path;
  // The parallel plan (spmd/plan.h) when it goes beyond data parallelism:
  // its tensor axes are lowered into every rank's graph (spmd/lower.h), its
  // "dp" axis is the data-parallel group everything above applies to (the
  // batch split, DataParallel and ZeRO, batch_shares over the dp ranks).
  // null: data parallelism over all ranks.
  std::shared_ptr<const Plan> plan;
  // How the data-parallel replicas agree ([sync]): all-reduce (with ZeRO
  // per `dp`), local SGD, DiLoCo or gossip (sync/replica_sync.h).
  SyncOptions sync;
};

struct TrainerOptions {
  int64_t epochs = 1;
  int64_t max_steps = 0;  // > 0: the run is this many optimizer steps in total
  // > 0: stop this invocation after this many steps without changing the
  // run's length (and so its LR schedule); resume later from the checkpoint.
  // For time-limited jobs.
  int64_t halt_after = 0;
  int64_t batch_size = 128;
  int64_t eval_batch_size = 1000;
  uint64_t seed = 1;
  int threads = 1;
  DType precision = DType::f32;  // f32, bf16 (mixed) or f16 (mixed, dynamic loss scaling)
  // train.precision = "auto": measure f32 and bf16 matmuls on the model's
  // shapes at start-up and pick the faster (train/precision.h); `precision`
  // is then ignored. bf16 is measured too, to warn when it is slower here.
  bool precision_auto = false;
  // train.precision = "bf16_storage" (precision f32): f32 compute, the
  // activations the backward reads kept in bf16 between forward and
  // backward (graph/bf16_stash.h). "auto" may set it.
  bool bf16_storage = false;
  // Test hooks: scale the measured bf16 matmul rate and the measured cost of
  // the bf16 storage casts (1 outside tests).
  double bf16_rate_factor_for_testing = 1.0;
  double storage_cost_factor_for_testing = 1.0;
  bool eval = true;  // evaluate on the test split after each epoch
  // > 0 (with eval): also evaluate every this-many optimizer steps (the
  // time-to-accuracy figures of bench/run sync); 0 = after epochs only.
  int64_t eval_every = 0;
  // > 0: evaluate on only the first this-many test batches of
  // eval_batch_size (the split in file order, so the same examples every
  // time, on every rank); 0 = the whole test split.
  int64_t eval_batches = 0;
  // Training batches from a seeded permutation per epoch (seed + epoch);
  // false: file order every epoch.
  bool shuffle = true;
  int64_t log_every = 50;       // steps between metrics lines
  bool progress = true;         // progress bar / lines on stderr
  bool progress_tty = false;    // the bar although stderr is a pipe
  std::string metrics_path;     // JSON lines; empty: none
  std::string tensorboard_dir;  // TensorBoard event file in this directory; empty: none
  std::string checkpoint_path;  // written at the end (and every checkpoint_every steps)
  int64_t checkpoint_every = 0;
  // Start a new run from the weights of a PyTorch-layout safetensors file
  // (train/export.h): every rank reads it. Not applied when resuming (the
  // checkpoint holds the parameters). init_partial: load what matches by
  // name and shape, leave the rest at its seeded initial values.
  std::string init_path;
  bool init_partial = false;
  // > 0: checkpoint_path is a directory of step-numbered checkpoints
  // (<checkpoint_path>/step_00000120, see step_checkpoints.h) of which the
  // newest this many are kept; 0: every save replaces checkpoint_path.
  int64_t checkpoint_keep = 0;
  // Continue from this checkpoint (a .safetensors file or a sharded
  // directory), which must hold exactly this model's parameters. "auto": the
  // newest valid checkpoint under checkpoint_path (damaged ones skipped with
  // a notice), or a fresh start if there is none.
  std::string resume_path;
  // Stop request, set by a signal handler the caller installs (library code
  // installs none): once it holds a non-zero signal number on any rank, every
  // rank finishes the current step, all stop after the same step (the flag
  // travels with the step's loss all-reduce), the checkpoint is written (if
  // checkpoint_path is set) and run() returns with TrainResult::stop_signal
  // set. nullptr: no stop requests.
  const std::atomic<int>* stop_signal = nullptr;
  // Notices for the user (which checkpoint a run resumed from, damaged
  // checkpoints skipped), called on rank 0 only; empty: discarded.
  std::function<void(const std::string&)> on_notice;
  // > 0: bytes this rank may use. The Trainer plans its memory first
  // (train/training_plan.h) and refuses, with a ConfigError naming the config
  // values that make the plan big, a run that needs more, before allocating
  // parameters or activations. 0: no check.
  int64_t memory_limit = 0;

  std::string optimizer = "sgd";
  OptimizerOptions optim;
  LrScheduleOptions schedule;   // total_steps is filled in from the run length
  double clip_grad_norm = 0.0;  // 0: no clipping
  LossScalerOptions loss_scaler;
  ExecOptions exec;
  DistOptions dist;
};

// What a run measured. A value that was not measured in this invocation is
// absent (nullopt), never 0: no steps ran (resuming a finished run), no
// evaluation ran (train.eval off, or train.halt_after stopped first).
struct TrainResult {
  int64_t steps = 0;                    // optimizer steps completed, earlier invocations included
  int64_t steps_run = 0;                // of which this invocation ran
  std::optional<double> final_loss;     // training loss of the last step
  std::optional<double> test_loss;      // of the last evaluation
  std::optional<double> test_accuracy;  // fraction in [0, 1]; next-token accuracy for text
  int64_t test_examples = 0;            // examples the last evaluation covered
  // Median over the steps after the first 5 (warm-up: page faults, kernel
  // selection); a run of 5 steps or fewer falls back to the median of all
  // its steps and says so in samples_per_s_includes_warmup.
  std::optional<double> samples_per_s;
  bool samples_per_s_includes_warmup = false;
  // Text models: samples_per_s x tokens per sample; absent for other models.
  std::optional<double> tokens_per_s;
  // Matmul FLOPs / matmul time inside training steps, and matmul time per
  // step (mean), over the steps after the warm-up (all steps in a short run).
  std::optional<double> matmul_gflops;
  std::optional<double> matmul_s_per_step;
  int64_t planned_arena_bytes = 0;
  std::vector<double> losses;  // per step: mean loss over the global batch
  DataParallelMemory memory;   // per-rank parameter / gradient / optimizer bytes
  // This process's allocator counters by category at the end of the run
  // (live) and over it (peak; tensor/memory_stats.h), and its peak RSS.
  MemoryCounters allocated;
  int64_t peak_rss_bytes = 0;
  // Non-zero: the run stopped early on a stop request (TrainerOptions::
  // stop_signal), after `steps` steps; the highest signal number any rank saw.
  int stop_signal = 0;
  std::string checkpoint;  // the last checkpoint this run wrote ("" if none)
  // Under tensor parallelism: bytes this rank's tensor groups sent per
  // training step, as their communicators counted them, and as the lowered
  // graph's collectives predict (the two are equal).
  std::optional<double> tensor_bytes_sent_per_step;
  uint64_t tensor_bytes_predicted_per_step = 0;
};

class Trainer {
 public:
  // Builds the graphs and loaders; throws ConfigError / ShapeError /
  // FileError / CheckpointError for bad options, models or files.
  // Everything the run will write later (metrics, trace, checkpoint) and
  // every data / evaluation setting is checked here, before the first step
  // (collective: a path one rank cannot write fails on every rank); missing
  // parent directories of those outputs are then created.
  // comm: the data-parallel group (every rank constructs a Trainer with the
  // same options); nullptr trains in this process alone. test_data may be
  // null when options.eval is off (evaluate() then throws ConfigError).
  // A plan with `devices` (Plan::devices) runs mesh rank m on comm's rank
  // devices[m]: the trainer splits comm into the mesh's numbering (rank 0
  // of the run is then devices[0]) and gives each mesh rank its device's
  // dist.slowdown.
  Trainer(const ModelSpec& model, std::shared_ptr<const Dataset> train_data,
          std::shared_ptr<const Dataset> test_data, TrainerOptions options,
          Communicator* comm = nullptr);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  TrainResult run();

  // What TrainerOptions::init_path loaded, skipped and left at its initial
  // values; nullptr when no such file was loaded.
  const TorchLoadReport* init_report() const;

  // Evaluates on the test split, or its first eval_batches batches (each
  // rank a slice of every batch, results combined; collective):
  // {loss, accuracy}.
  std::pair<double, double> evaluate();

  // The training graph (forward + backward) and its executor's memory plan.
  const Graph& train_graph() const;
  const MemoryPlan& memory_plan() const;
  // The current whole parameters (collective under ZeRO-3, where this
  // allocates the store's full copy, which then stays: for tests and tools,
  // not for the training loop, which never holds whole parameters at stage 3).
  class ParamStore& params();
  // The current whole parameters, flat (as params()).
  Tensor gather_params();
  // How the data-parallel replicas agree (dist.sync; sync/replica_sync.h).
  class ReplicaSync& replica_sync();
  // Under a plan with tensor axes, this rank's program: which box of each
  // parameter params() holds. nullptr otherwise (params() are whole).
  const struct LoweredProgram* lowered_program() const;
  // Under a plan with pipeline stages (train/pipeline_training.h), what runs
  // it; nullptr otherwise. The methods above that need one whole model
  // (evaluate, params, ...) throw ConfigError then.
  class PipelineTraining* pipeline();

 private:
  struct Impl;
  std::unique_ptr<Communicator> mesh_comm_;  // under a plan's devices; outlives the rest
  std::unique_ptr<Impl> impl_;
  std::unique_ptr<class PipelineTraining> pipe_;
  void require_unpipelined(const char* what) const;
};

}  // namespace mt
