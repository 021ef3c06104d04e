// Synchronous data parallelism with ZeRO stages 0-3, as PyTorch DDP,
// DeepSpeed ZeRO and FSDP users know them.
//
// Every rank of a data-parallel group runs the same model graph on its own
// part of the global batch. DataParallel keeps the replicas equivalent to one
// process training on the whole batch:
//
//   stage 0  plain DP: gradients all-reduced (summed) in buckets; every rank
//            holds full parameters, gradients and optimizer state.
//   stage 1  + optimizer state sharded: gradients all-reduced, each rank
//            updates only its shard of the parameters, then the parameters
//            are all-gathered.
//   stage 2  + gradients sharded: buckets are reduce-scattered, each rank
//            keeps only the reduced gradient of its shard.
//   stage 3  + parameters sharded: each rank stores only its shard; a bucket
//            of full parameters is all-gathered just before a node reads one
//            of them and freed after their last use in forward, gathered
//            again for backward and freed after (the next bucket is
//            prefetched).
//
// Buckets and shards are described in sync/buckets.h: contiguous ranges of
// the flat parameter order, formed in reverse, about bucket_bytes each; rank
// r owns chunk r of every bucket. With overlap on, a bucket's collective
// starts (asynchronously) as soon as all its gradients are ready during
// backward; buckets are always issued in bucket order, so every rank issues
// the same collectives in the same order.
//
// Gradients: the caller passes its gradient weight w_r = n_r / N_global (its
// share of the global batch; its graph computes the mean loss over its own
// n_r examples) before each backward; gradients are scaled by w_r and SUMMED
// across ranks (and micro-steps), so the result is the gradient of the mean
// loss over the global batch, whatever the split. With accumulation_steps K,
// nothing is communicated until the K-th micro-step.
//
// Usage, per optimizer step (the trainer adapts Optimizer/ParamRef to the
// plain pieces here; ParamSlice maps one-to-one onto ParamRef):
//
//   DataParallel dp(comm, layout, store.flat_values(), options);
//   dp.attach(exec, graph);                 // once per executor
//   for (k = 0; k < K; ++k) {
//     dp.begin_micro_step(n_rk / N_global);
//     exec.run();                           // on_grad_ready drives the buckets
//     dp.end_micro_step();                  // the K-th waits for the sync
//   }
//   dp.step([&](std::span<ParamSlice> s) {  // this rank's slices, same names
//     refs = to_param_refs(s);              // and order on every rank
//     clip_grad_norm(refs, max, dp.norm_reducer());
//     optimizer.step(refs, lr);             // with set_norm_reducer(dp.norm_reducer())
//   });                                     // stages 1/2 all-gather after
//
// A mixed-precision caller that skips steps on overflow must agree on the
// decision across ranks when gradients are sharded: reduce its found-inf
// flag through norm_reducer() as well.
//
// Memory: stages 0-2 use the caller's flat parameter buffer in place
// (replicated); stage 3 copies this rank's shard out of it at construction,
// after which the caller may drop the full buffer (gather_params() gives
// whole parameters back, e.g. for a single-file checkpoint). Gradients live
// in buffers DataParallel owns: full (stages 0-1) or shard-sized (2-3); the
// caller binds no parameter gradients itself, attach() does. Stages 0-1 with
// K = 1 let the executor write gradients straight into the full buffer
// (scaled in place). Otherwise the executor is switched to transient
// gradients (exec/executor.h) and each is scaled into its bucket as soon as
// it is ready, so stages 2-3 never hold a full gradient: bucket staging
// buffers are reused, at most about two busy at a time with overlap on
// (with overlap off every bucket waits in staging until backward ends: a
// full gradient's worth). With K > 1 stages 2-3 keep one full-size
// accumulation buffer, since nothing may be sent before the last micro-step.
//
// ZeRO-3 gathers inside every run() and run_forward() of an attached
// executor, evaluation included: all ranks must run the same passes on
// executors attached to the same DataParallel (a rank without evaluation
// examples still runs the forward, e.g. on a dummy batch).
//
// Ownership and threading: keeps a reference to the communicator (which must
// outlive it) and to the executors it is attached to (it must outlive their
// run() calls; the executor callbacks point back to it). Not thread-safe:
// every call, and the executor's run(), come from the rank's one thread.
// Blocking: end_micro_step() of the last micro-step, step(), gather_params()
// and norm_reducer() calls are collective over the group and block, each
// wait bounded by the collective timeout; stage 3 runs block while a bucket
// they need is gathered. Errors: a failed or timed-out collective throws the
// comm layer's CommError / TimeoutError / MismatchError, its message prefixed
// with the step, the bucket and its parameters; the group is then unusable.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/exec/executor.h"
#include "meshtrain/graph/graph.h"
#include "meshtrain/sync/buckets.h"
#include "meshtrain/tensor/box.h"
#include "meshtrain/tensor/tensor.h"

namespace mt {

struct DataParallelOptions {
  int stage = 0;                      // ZeRO stage: 0, 1, 2 or 3
  int64_t bucket_bytes = 25ll << 20;  // bucket size, as DDP's bucket_cap_mb (25 MiB)
  bool overlap = true;                // start buckets during backward
  int accumulation_steps = 1;         // micro-steps per optimizer step (K >= 1)
  bool prefetch = true;               // stage 3: gather the next bucket ahead
  CollectiveOptions collective;       // timeout, algorithm and tag of every collective
  // One-rank groups only (a parameter server's worker pushes per bucket):
  // called with a bucket's index once its gradients for the optimizer step
  // are final, in bucket index order, on the thread that runs the executor:
  // during the last micro-step's backward (during_backward true) with
  // overlap, else from end_micro_step().
  std::function<void(int bucket, bool during_backward)> on_bucket_final;
  // Stages 1-3, world size > 1: replaces every bucket's gradient collective
  // (run synchronously where the all-reduce / reduce-scatter would start).
  // Given the bucket's weighted gradient (all its elements, this rank's
  // contribution) it writes into `chunk` this rank's chunk of the SUM over
  // the ranks: stage 1 into its place in the full gradient buffer (chunk
  // lies inside grad there; the rest of that buffer is then not read),
  // stages 2-3 into the shard. sync/compressed_sync.cpp puts a compressed
  // reduce-scatter here. step_cost() does not count what it sends.
  std::function<void(int bucket, std::span<const float> grad, std::span<float> chunk)>
      reduce_bucket;
};

// This rank's part of one parameter, for the optimizer: `param` is updated
// in place, `grad` holds the synchronised gradient. Whole parameters (stage
// 0) keep their shape; shards are flat f32 [end - begin]; a rank that holds
// nothing of a parameter gets empty f32 [0] tensors (begin == end), so the
// list has the same names in the same order on every rank, as NormReducer
// needs. Maps onto ParamRef{name, param, grad, full_shape.rank()}.
struct ParamSlice {
  std::string name;
  Shape full_shape;
  int64_t begin = 0;  // element range within the whole parameter
  int64_t end = 0;
  Tensor param;
  Tensor grad;

  int full_rank() const { return full_shape.rank(); }
  bool whole() const { return begin == 0 && end == full_shape.numel(); }
};

// One piece of a checkpointed tensor `name` (shape full_shape): elements
// [begin, end) of the row-major flattening of `box`, an N-d box of the whole
// tensor (tensor/box.h; empty = the whole tensor, so [begin, end) indexes
// the whole tensor's flattening), held in `data` (end - begin elements in
// that order: f32 [end - begin], or the box's shape for whole boxes). A
// column shard of a matrix is one piece (box [0:R, c0:c1], range [0, R *
// (c1 - c0))); a ZeRO range of it is a sub-range of the same box. Pieces
// from DataParallel are views of live memory with an empty box (its
// tensors are whole as it sees them): saving reads them, loading writes
// into them; train/sharded_checkpoint.h's in_box() re-anchors them when
// those tensors are boxes of larger ones.
struct ShardPiece {
  std::string name;
  Shape full_shape;
  int64_t begin = 0;
  int64_t end = 0;
  Tensor data;
  Box box = {};  // empty: the whole tensor
};

enum class PieceUse {
  save,  // what this rank writes: about 1/N of every tensor, disjoint across ranks
  load,  // what this rank holds and must read: whole tensors when replicated
};

// Per-rank memory of the data-parallel state, in bytes: what is allocated
// (or, for stages 0-2, the caller's replicated parameter buffer in use) next
// to the analytic expectation. P, G, O are the full model's parameter,
// gradient and optimizer-state bytes, N the group size: stage 0 expects
// P+G+O, 1: P+G+O/N, 2: P+G/N+O/N, 3: (P+G+O)/N, each plus buffers.
struct DataParallelMemory {
  int stage = 0;
  int world_size = 1;
  int64_t param_bytes = 0;
  int64_t grad_bytes = 0;
  int64_t optimizer_bytes = 0;
  int64_t staging_bytes = 0;   // gradient bucket staging / accumulation buffers (allocated peak)
  int64_t gathered_bytes = 0;  // stage 3: gathered-parameter buffers (allocated peak)
  int64_t expected_param_bytes = 0;
  int64_t expected_grad_bytes = 0;
  int64_t expected_optimizer_bytes = 0;
  // Two buckets of staging (2-3; the flat size with overlap off or K > 1)
  // and of gathered parameters (3), each the largest bucket's size; one
  // bucket's when the model fits in one.
  int64_t expected_buffer_bytes = 0;

  int64_t buffer_bytes() const { return staging_bytes + gathered_bytes; }
  int64_t model_state_bytes() const { return param_bytes + grad_bytes + optimizer_bytes; }
  int64_t expected_model_state_bytes() const {
    return expected_param_bytes + expected_grad_bytes + expected_optimizer_bytes;
  }
  std::string to_string() const;  // one line per kind: measured vs expected
};

// Counters since construction (or reset_stats()).
struct DataParallelStats {
  int64_t steps = 0;  // optimizer steps completed
  int64_t micro_steps = 0;
  int64_t collectives = 0;  // collectives issued on the group
  int64_t gathers = 0;      // stage 3 bucket gathers (prefetched ones included)
  int64_t overlapped = 0;   // gradient collectives started during backward
  double wait_seconds = 0;  // blocked waiting for collectives (exposed communication)
  double copy_seconds = 0;  // scaling / copying gradients into buckets
};

class DataParallel {
 public:
  // `layout` describes `flat_params` (f32, 1-D, in the layout's order: e.g.
  // ParamStore's entries and flat_values()), whose contents must be
  // identical on every rank. Stage 3 also accepts a buffer without memory
  // (Tensor::wrap(nullptr, {flat numel}, f32)): the shard starts at zero and
  // the caller fills it through param_pieces(PieceUse::load), so no rank
  // ever holds the whole parameters. Throws ConfigError for a bad stage, bucket size,
  // accumulation count or layout, ShapeError for a flat buffer that is not
  // f32 or too small.
  DataParallel(Communicator& comm, ParamLayout layout, Tensor flat_params,
               DataParallelOptions options);
  // Waits for collectives still in flight (their buffers are freed here).
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  // Binds the parameters of `graph` (matched by name; ShapeError for a name
  // missing from the layout or a shape that differs) in `exec`, which runs
  // `graph`: views of the flat buffer (stages 0-2), or gathered on demand
  // through the executor's parameter hooks (stage 3). If the graph has
  // parameter gradients, also takes over the executor's gradients and its
  // on_grad_ready callback; forward-only graphs (evaluation) only get
  // parameters. Call once per executor, before its first run.
  void attach(Executor& exec, const Graph& graph);

  // Gradients from outside an executor (the pipeline runtime's accumulators,
  // summed over its micro-batches): instead of attaching a training
  // executor, declare once that every layout parameter's gradient is handed
  // over with add_grad() in each micro-step. Under stage 3 nothing gathers
  // parameters for the caller's passes: it gathers the whole parameters
  // itself with gather_params() (a pipeline stage: once per optimizer step,
  // kept through its micro-batches, freed after the update), and the
  // gradients are reduce-scattered into the shard as at stage 2.
  // ConfigError after attach() of a training executor.
  void use_external_grads();
  // During a micro-step, after use_external_grads(): `grad` (f32, the
  // layout's shape for `name`) scaled by the micro-step's weight into its
  // bucket; a bucket whose gradients are all in starts its collective (with
  // overlap on). Hand them over last parameter first, as backward makes
  // them. A `grad` that is full_grad(name) itself is scaled in place (no
  // copy; accumulation_steps 1). ConfigError for an unknown name, a shape
  // that differs, or a gradient given twice in one micro-step.
  void add_grad(const std::string& name, const Tensor& grad);
  // Stages 0-1: `name`'s place in the full gradient buffer the all-reduce
  // works on, so a caller that accumulates gradients itself can do so there
  // and pass the view to add_grad(); an empty tensor for stages 2-3.
  Tensor full_grad(const std::string& name);

  // Before each micro-step's backward: this rank's share of the global batch
  // for this micro-step (n_rk / N_global; the shares of all ranks and
  // micro-steps of one optimizer step sum to 1). ConfigError unless finite
  // and >= 0, or if the previous step's slices were not consumed by step().
  void begin_micro_step(double grad_weight);
  // After the micro-step's run(). On the last (K-th) micro-step: launches the
  // buckets not started yet and waits until every gradient is synchronised;
  // then slices() holds the gradients. ConfigError if a parameter gradient
  // never became ready (e.g. run_forward() instead of run()).
  void end_micro_step();
  // True between the last end_micro_step() and step()/finish_step().
  bool grads_ready() const;

  // This rank's slices, in layout order, identical names on every rank. The
  // gradients are valid while grads_ready(); the span stays valid for the
  // object's lifetime.
  std::span<ParamSlice> slices();
  // Sums doubles over the group in place (blocking, collective) for stages
  // 1-3 where slices are shards; an empty function for stage 0 and world
  // size 1, where every rank holds whole parameters. For clipping norms,
  // LARS/LAMB trust ratios and found-inf flags.
  std::function<void(std::span<double>)> norm_reducer();
  // After the optimizer updated slices() in place: stages 1-2 all-gather the
  // updated parameters into the replicated flat buffer (blocking); all
  // stages end the step. ConfigError unless grads_ready().
  void finish_step();
  // update(slices()) then finish_step().
  void step(const std::function<void(std::span<ParamSlice>)>& update);

  // Collective: writes the whole current parameters into `flat_out` (f32,
  // at least the layout's flat size; elements between parameters are
  // unspecified).
  void gather_params(Tensor& flat_out);

  // Checkpoints. Parameter pieces: save gives this rank's chunks (every rank
  // writes about 1/N); load gives what it holds: whole parameters (stages
  // 0-2, replicated) or its shard (stage 3). Parameters the rank holds none
  // of are left out.
  std::vector<ShardPiece> param_pieces(PieceUse use);
  // Optimizer-state pieces from the optimizer's state tensors, keyed
  // "<param>.<kind>" and sized like this rank's slice of the parameter (as
  // an optimizer stepped on slices() creates them): views, same ranges as
  // param_pieces(use). Other keys throw CheckpointError, as do sizes that do
  // not fit.
  std::vector<ShardPiece> state_pieces(const std::map<std::string, Tensor>& state,
                                       PieceUse use) const;
  // Freshly allocated zero tensors for loading optimizer state of the given
  // kinds: one "<param>.<kind>" per parameter this rank holds part of, shaped
  // like its slice. Fill them, then hand {name: data} to the optimizer.
  std::vector<ShardPiece> new_state_pieces(std::span<const std::string> kinds) const;

  // Memory per rank: parameters, gradients and buffers as allocated here;
  // optimizer_bytes is what the optimizer has allocated for its state (the
  // caller measures it: Optimizer::state_bytes()). The expectation assumes
  // `state_kinds` f32 tensors per slice (Optimizer::state_kinds().size(); 0
  // for plain SGD).
  DataParallelMemory memory(int state_kinds, int64_t optimizer_bytes) const;
  // The expected_* part of memory() for a bucket plan and options, before
  // anything is allocated (what a run will need per rank).
  static DataParallelMemory expected_memory(const BucketPlan& plan,
                                            const DataParallelOptions& options, int state_kinds);
  // Where attach() puts the executor's parameter gradients under `options`:
  // bound to the full gradient buffer (stages 0-1 without accumulation) or
  // transient (consumed into buckets as they become ready).
  static GradMemory grad_memory(const DataParallelOptions& options);
  // Bytes this rank sends and receives on the group per optimizer step
  // (stage 3: per micro-step's gathers times K; with external gradients one
  // gather_params() per step), by the communicator's own
  // cost functions for the algorithms it will pick; the byte counters must
  // agree.
  CollectiveCost step_cost() const;
  DataParallelStats stats() const;
  void reset_stats();

  const BucketPlan& plan() const;
  const DataParallelOptions& options() const;
  int world_size() const;
  int rank() const;
  int64_t step_count() const;  // optimizer steps completed

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace mt
