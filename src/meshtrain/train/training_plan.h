// The training graph a Trainer runs and the memory one rank will need for
// it, computed without data and without allocating: the Trainer builds its
// graph and executor options here and checks the plan against the memory it
// may use before allocating anything, and `meshtrain inspect` prints the same
// plan, so both report one number from one piece of code.
//
// Pure functions of the options (no communicator: rank and world size are
// passed in); they throw ConfigError for options the Trainer would refuse.
#pragma once

#include <cstdint>
#include <string>

#include "meshtrain/exec/executor.h"
#include "meshtrain/graph/bf16_stash.h"
#include "meshtrain/models/model.h"
#include "meshtrain/spmd/lower.h"
#include "meshtrain/sync/data_parallel.h"
#include "meshtrain/train/trainer.h"

namespace mt {

// This rank's share of each global batch and the micro-batch the graph is
// built for (local_batch / dist.accumulation_steps).
struct BatchSplit {
  int64_t local_batch = 0;
  int64_t micro_batch = 0;
};
// ConfigError when the accumulation steps do not divide the rank's share.
// rank / world: the data-parallel ones (data_parallel_place()).
BatchSplit split_batch(const TrainerOptions& o, int rank, int world);

// Where a rank sits in the run's data parallelism: without a plan (or one
// with nothing to lower) every rank is a data-parallel rank; under a plan
// with tensor axes, its coordinate on the "dp" axis and that axis's size.
struct DataParallelPlace {
  int rank = 0, world = 1;
  bool lowered = false;  // the plan's tensor axes are lowered into the graph
};
DataParallelPlace data_parallel_place(const TrainerOptions& o, int rank, int world);

// The model at `batch` as world rank `rank` runs it: the model itself, or,
// under a plan with tensor axes, its lowering for this rank (the program's
// groups and parameter boxes in *lowered; its graph moved into the result,
// whose x, y, logits, loss and constants are the local ones). Under a
// lowering the logits are gathered whole (replicated) only with
// `whole_logits` (evaluation reads them); training programs leave them
// split (the vocabulary-parallel loss needs no whole logits) and their
// `logits` is kNoValue then.
ModelGraph build_rank_model(const ModelSpec& spec, int64_t batch, const TrainerOptions& o, int rank,
                            LoweredProgram* lowered = nullptr, bool whole_logits = true);

// The forward + backward graph at the micro-batch, as the Trainer runs it.
struct TrainingGraph {
  ModelGraph model;
  LoweredProgram lowered;            // under a plan with tensor axes (its graph is model.graph)
  ValueId objective = kNoValue;      // what backward differentiates
  ValueId loss_scale_in = kNoValue;  // f16 only: the scalar the loss is multiplied by
  ExecOptions exec;                  // the training executor's options
  Bf16StashReport stash;             // o.bf16_storage: what the bf16 stash pass did
};
// `spec.compute` is taken from o.precision. With o.bf16_storage (f32 only) the
// graph's stash is kept in bf16 (graph/bf16_stash.h); ConfigError with
// exec.recompute (a recomputed value is not stashed: pick one).
TrainingGraph build_training_graph(const ModelSpec& spec, const TrainerOptions& o,
                                   int64_t micro_batch, int rank = 0);

// Per-rank memory of a run, in bytes.
struct TrainingPlan {
  int rank = 0, world = 1;
  BatchSplit batch;
  int64_t eval_batch = 0;  // this rank's evaluation batch (0 without evaluation)
  int64_t param_count = 0;
  MemoryPlan activations;        // the training executor's plan (arena_bytes: its arena)
  int64_t eval_arena_bytes = 0;  // the evaluation executor's arena
  // Parameters, gradients, optimizer state and buffers of data parallelism
  // under the configured ZeRO stage (the expected_* fields). That is all the
  // model state a rank holds while training: the trainer's parameter store
  // is DataParallel's parameter buffer below stage 3 and holds nothing at
  // stage 3 (whole parameters exist only while a single-file checkpoint is
  // written, or after resuming / train.init until the shard is taken).
  DataParallelMemory state;
  std::string largest_activation;  // "name f32[..]" of the largest activation
  int64_t largest_activation_bytes = 0;

  int64_t model_state_bytes() const;  // state (expected), buffers included
  int64_t total_bytes() const;        // everything above
  // Several lines: each part with its size, and the total.
  std::string describe() const;
};

// Plans from a graph built by build_training_graph. eval_examples: the test
// split's size when known (evaluation batches are min(eval_batch_size, it)),
// -1 when not.
TrainingPlan plan_training(const TrainingGraph& tg, const ModelSpec& spec, const TrainerOptions& o,
                           const BatchSplit& split, int rank, int world,
                           int64_t eval_examples = -1);
// Builds the graph itself.
TrainingPlan plan_training(const ModelSpec& spec, const TrainerOptions& o, int rank, int world,
                           int64_t eval_examples = -1);

// Memory this process can still use: MemAvailable from /proc/meminfo, else
// the physical memory.
int64_t available_memory_bytes();

// ConfigError when the plan needs more than `available` bytes, naming the
// config values that size its largest part, e.g. "planned memory per rank
// 412.3 GiB (activations 410.0 GiB at train.batch_size=16, model.seq_len=
// 100000, ...) exceeds available memory 23.1 GiB".
void check_memory_fits(const TrainingPlan& plan, const ModelSpec& spec, const TrainerOptions& o,
                       int64_t available);

// "1.50 MiB", "412.3 GiB": bytes in binary units.
std::string format_bytes(int64_t bytes);

}  // namespace mt
