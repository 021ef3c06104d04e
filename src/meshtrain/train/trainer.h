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

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/data/dataset.h"
#include "meshtrain/exec/executor.h"
#include "meshtrain/models/model.h"
#include "meshtrain/sync/data_parallel.h"
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
  bool eval = true;              // evaluate on the test split after each epoch
  int64_t log_every = 50;        // steps between metrics lines
  bool progress = true;          // progress bar / lines on stderr
  std::string metrics_path;      // JSON lines; empty: none
  std::string checkpoint_path;   // written at the end (and every checkpoint_every steps)
  int64_t checkpoint_every = 0;
  std::string resume_path;  // continue from this checkpoint
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

struct TrainResult {
  int64_t steps = 0;
  double final_loss = 0;  // training loss of the last step
  double test_loss = 0;
  double test_accuracy = 0;      // fraction in [0, 1]; next-token accuracy for text
  double samples_per_s = 0;      // median over steps after warm-up
  double matmul_gflops = 0;      // matmul FLOPs / matmul time inside training steps
  double matmul_s_per_step = 0;  // matmul time per training step (mean over the run)
  int64_t planned_arena_bytes = 0;
  std::vector<double> losses;  // per step: mean loss over the global batch
  DataParallelMemory memory;   // per-rank parameter / gradient / optimizer bytes
};

class Trainer {
 public:
  // Builds the graphs and loaders; throws ConfigError / ShapeError /
  // FileError / CheckpointError for bad options, models or files.
  // comm: the data-parallel group (every rank constructs a Trainer with the
  // same options); nullptr trains in this process alone.
  Trainer(const ModelSpec& model, std::shared_ptr<const Dataset> train_data,
          std::shared_ptr<const Dataset> test_data, TrainerOptions options,
          Communicator* comm = nullptr);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  TrainResult run();

  // Evaluates on the whole test split (each rank a slice, results
  // combined; collective): {loss, accuracy}.
  std::pair<double, double> evaluate();

  // The training graph (forward + backward) and its executor's memory plan.
  const Graph& train_graph() const;
  const MemoryPlan& memory_plan() const;
  class ParamStore& params();
  // The current whole parameters, flat (collective under ZeRO-3).
  Tensor gather_params();
  DataParallel& data_parallel();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mt
