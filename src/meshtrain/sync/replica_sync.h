// How data-parallel replicas agree: the interface the trainer drives, one
// implementation per synchronization scheme.
//
//   allreduce  (sync/data_parallel.h) every step's gradients summed across
//              replicas, ZeRO 0-3: replicas stay identical
//   local_sgd  (sync/local_steps.h) each replica steps on its own
//              gradients; parameters are averaged every `period` steps
//              (post-local: synchronous for the first steps)
//   diloco     (sync/local_steps.h) as local_sgd with the trainer's
//              optimizer as the inner one; every `period` steps the averaged
//              pseudo-gradient (start - local) takes an outer Nesterov step
//   allreduce with a codec (sync/compressed_sync.cpp): every step's
//              gradients compressed (sync/codecs.h, error feedback) and
//              averaged by sync/compressed_all_reduce.h: replicas stay
//              identical
//   gossip     (sync/local_steps.h) D-PSGD: after each local step every replica
//              averages its parameters with its neighbours on a graph
//   adpsgd     (sync/local_steps.h) AD-PSGD: after each local step an active
//              (even) rank averages with one random passive (odd)
//              neighbour, whose server thread answers at once; no barrier
//   partial    (sync/local_steps.h) layer-wise partial synchronization: step
//              t averages layer group (t - 1) % period asynchronously; the
//              average lands before the next forward reads that layer
//
// The calling sequence is DataParallel's (see its header for the contract):
// attach() once per executor; per optimizer step begin_micro_step(w),
// the executor's run(), end_micro_step() for each micro-step, then
// step(update) with the optimizer inside `update`. Schemes that let replicas
// drift apart say so (replicas_identical() false); average_into() then gives
// the replicas' mean parameters for evaluation and checkpoints, without
// changing any replica's training state.
//
// Ownership, threading and blocking as DataParallel: one thread per rank;
// the calls that communicate are collective over the group and bounded by
// the collective timeout; errors are comm's CommError / TimeoutError.
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
#include "meshtrain/sync/data_parallel.h"

namespace mt {

// The [sync] section of a run config: which scheme and its settings.
struct SyncOptions {
  // allreduce | local_sgd | diloco | gossip | adpsgd | partial | ps
  std::string scheme = "allreduce";
  // local_sgd / diloco: optimizer steps between synchronizations (H >= 1);
  // partial: the number of layer groups, each averaged once per period.
  int64_t period = 1;
  // local_sgd: post-local SGD, synchronous (averaging after every step) for
  // the first this-many steps, then every `period` steps.
  int64_t sync_until = 0;
  // diloco: the outer Nesterov step on the averaged pseudo-gradient.
  double outer_lr = 0.7;
  double outer_momentum = 0.9;
  // diloco, Streaming DiLoCo's refinements (Douillard et al. 2025; all off
  // by default, which is plain DiLoCo): the flat parameters cut into
  // `fragments` consecutive, element-balanced pieces, fragment f
  // synchronized every `period` steps at offset f * period / fragments;
  // its exchange overlapped with the next `overlap_steps` inner steps
  // (tau < period) and merged as merge_alpha * local + (1 - merge_alpha) *
  // global when it lands; the pseudo-gradients sent as `outer_bits` = 32
  // (f32 all-reduce) or 4 (sync/outer_quant.h, all-gathered, summed in f32).
  int64_t fragments = 1;
  int64_t overlap_steps = 0;
  double merge_alpha = 0.5;
  int64_t outer_bits = 32;
  // outer_bits = 4: "all_gather" (each rank's payload to every rank, summed
  // in f32 on each: one rounding) or "reduce_scatter" (piece r of every
  // rank's payload to rank r by all_to_all, summed there in f32,
  // re-quantized and all-gathered: 2 (N - 1) / N instead of N - 1 payloads
  // per rank, a second rounding).
  std::string outer_exchange = "all_gather";
  // gossip, adpsgd: ring | torus | exponential | complete (mixing weights in
  // gossip_neighbours(); adpsgd pairs only neighbours of opposite parity).
  std::string topology = "ring";
  // Steps between consensus-distance reports (0: only at the end).
  int64_t consensus_every = 0;
  // The codec on the exchange (sync/codec_spec.h: none | f16 | bf16 |
  // topk:K | randk:K | qsgd:BITS[:BUCKET] | sign[:CHUNK] | powersgd:RANK),
  // with error feedback unless codec_error_feedback is off: allreduce on
  // every step's gradients; local_sgd, diloco and partial on the
  // pseudo-gradient of each synchronization (the parameters' change since
  // the last one);
  // ps on the workers' gradient pushes (payload codecs only); gossip and
  // adpsgd on the difference between a replica's parameters and its public
  // copy (CHOCO-SGD, sync/choco.h).
  std::string codec = "none";
  bool codec_error_feedback = true;
  // allreduce (ZeRO stage 0) with a topk codec: Deep Gradient Compression's
  // momentum correction (Lin et al. 2018). With m = codec_momentum > 0 each
  // rank keeps a velocity u per parameter and, before the codec, turns its
  // gradient g into u = m u + g and the codec's input x = u (codec_nesterov:
  // x = g + m u), so the error-feedback residual accumulates velocity, not
  // gradients; with codec_momentum_masking, u is zeroed at the k coordinates
  // sent (momentum factor masking). The average that comes back is the
  // update direction: the optimizer must step without momentum (the CLI's
  // sync.codec_momentum moves optim.momentum / optim.nesterov here). Without
  // masking and with topk:1.0 this is DP with SGD momentum m (Nesterov as
  // torch.optim.SGD); with masking and topk:1.0, plain SGD (u = g each
  // step; with Nesterov x = (1 + m) g). 0: off (the default).
  double codec_momentum = 0;
  bool codec_nesterov = false;
  bool codec_momentum_masking = true;
  // allreduce (ZeRO stage 0) with a topk codec whose k is a fraction f:
  // Deep Gradient Compression's sparsity warm-up. The first
  // codec_warmup_steps steps run in kCodecWarmupStages equal stages (the
  // first ones one step longer when they do not divide) at densities
  // d0 (f / d0)^(s / kCodecWarmupStages), s = 0..3, d0 =
  // codec_warmup_density, exponentially down to f, which the rest of the
  // run uses; the error-feedback residual carries from stage to stage. The
  // warm-up's bytes count in the run's (bytes_sent). 0: off (the default).
  int64_t codec_warmup_steps = 0;
  double codec_warmup_density = 0.25;
  // allreduce (ZeRO stage 0) with powersgd: every tensor's P (and the
  // tensors sent whole) in one all-reduce per step, every Q in a second,
  // as PyTorch's PowerSGD hook does per bucket, instead of one or two
  // all-reduces per tensor (CompressedAllReduce::powersgd_project and its
  // phases). The same arithmetic; the sums in another order (within float
  // tolerance). false: per tensor (the default).
  bool powersgd_batched = false;
  // gossip, adpsgd with a codec (CHOCO-SGD, sync/choco.h): the consensus
  // step size gamma in (0, 1]: x_i += gamma sum_j w_ij (xhat_j - xhat_i).
  double gossip_gamma = 1.0;
  // ps (sync/param_server.h): the last `servers` ranks hold the parameter
  // shards; bsp | asp | ssp with staleness bound `staleness` (>= 0);
  // ps_switch "" | "after:N" (BSP for N steps, then ASP) | "straggler"
  // (BSP until a persistent straggler is reported, then ASP); staleness_lr
  // divides each asynchronous push's learning rate by its staleness.
  int64_t servers = 1;
  std::string ps_mode = "bsp";
  int64_t staleness = 2;
  std::string ps_switch;
  bool staleness_lr = false;
};

inline constexpr int kCodecWarmupStages = 4;
// The density of step `step` (0-based) under SyncOptions' sparsity warm-up
// for a target fraction f (f itself from codec_warmup_steps on).
double codec_warmup_fraction(const SyncOptions& o, double f, int64_t step);

// ConfigError naming the sync.* key and what was expected (period < 1, an
// unknown scheme or topology, outer_lr <= 0, momentum outside [0, 1),
// fragments < 1, overlap_steps outside [0, period), merge_alpha outside
// [0, 1], outer_bits not 32 or 4, a Streaming DiLoCo key under another
// scheme). fragments > the model's parameter count is refused where the
// model is known (make_replica_sync).
void validate_sync_options(const SyncOptions& o);

// gossip: the neighbours of `rank` among `n` on the topology (ascending, not
// including rank itself). Every topology is a regular undirected graph, so
// uniform weights 1 / (degree + 1) over a rank and its neighbours make the
// mixing matrix symmetric and doubly stochastic:
//   ring         r - 1, r + 1 (mod n)
//   torus        the 4 neighbours on an a x b grid (a the largest divisor of
//                n with a <= sqrt(n)), wrapping
//   exponential  r +- 2^k (mod n) for 2^k < n
//   complete     every other rank
std::vector<int> gossip_neighbours(const std::string& topology, int rank, int n);

class ReplicaSync {
 public:
  virtual ~ReplicaSync() = default;

  virtual void attach(Executor& exec, const Graph& graph) = 0;
  virtual void begin_micro_step(double grad_weight) = 0;
  virtual void end_micro_step() = 0;
  virtual std::span<ParamSlice> slices() = 0;
  virtual std::function<void(std::span<double>)> norm_reducer() = 0;
  virtual void step(const std::function<void(std::span<ParamSlice>)>& update) = 0;

  virtual void gather_params(Tensor& flat_out) = 0;
  virtual std::vector<ShardPiece> param_pieces(PieceUse use) = 0;
  virtual std::vector<ShardPiece> state_pieces(const std::map<std::string, Tensor>& state,
                                               PieceUse use) const = 0;
  virtual std::vector<ShardPiece> new_state_pieces(std::span<const std::string> kinds) const = 0;

  virtual DataParallelMemory memory(int state_kinds, int64_t optimizer_bytes) const = 0;
  virtual DataParallelStats stats() const = 0;
  virtual void reset_stats() = 0;

  // The scheme's name as the config writes it ("allreduce", "local_sgd", ...).
  virtual std::string name() const = 0;
  // False when replicas hold different parameters between synchronizations
  // (the replica consistency check does not apply).
  virtual bool replicas_identical() const { return true; }
  // Collective: the replicas' mean parameters into `flat_out` (the layout's
  // flat size), leaving every replica's own parameters as they are. For
  // schemes with identical replicas, gather_params().
  virtual void average_into(Tensor& flat_out) { gather_params(flat_out); }
  // Spread of the parameters across replicas (collective): the root mean
  // square over replicas of ||theta_r - mean||, and over the mean's norm.
  // 0 for identical replicas.
  struct Consensus {
    double distance = 0;
    double relative = 0;
  };
  virtual Consensus consensus() { return {}; }
  // Bytes this rank sent for synchronization so far (the communicator's
  // counters), for the summary's bytes per step.
  virtual uint64_t bytes_sent() const = 0;
  // sync.codec: what this rank's codecs hold back for their next exchange
  // (the error-feedback residual), at the parameters' flat offsets (the
  // layout's flat size; padding zero). Empty without a codec.
  virtual std::vector<float> codec_residual() const { return {}; }

  // Parameter-server schemes (sync/param_server.h). A server rank computes
  // nothing: the trainer calls serve() instead of its step loop, and serve()
  // returns when every worker has finished (or, under ASP, stopped). Each
  // update gets the server's slices (gradients filled), the step whose
  // learning rate applies and a factor on that learning rate.
  using ServerUpdate = std::function<void(std::span<ParamSlice>, int64_t step, double lr_scale)>;
  virtual bool is_server() const { return false; }
  virtual void serve(const ServerUpdate& update);
  // True while the replicas move in lock step, so that per-step collectives
  // among them (the loss all-reduce, the straggler report) cannot stall one
  // on another's progress.
  virtual bool lock_step() const { return true; }
  // Steps between the trainer's own agreements among lock-step replicas
  // (the global mean loss, a stop request, the straggler report's times):
  // 1 where the scheme exchanges every step anyway; its period where it
  // exchanges only then (local_sgd, diloco), so that a slow link's latency
  // is paid once a period rather than by every step.
  virtual int64_t agreement_period() const { return 1; }
  // The straggler report saw a persistent straggler (ps_switch "straggler").
  virtual void persistent_straggler() {}
  // After the last step, before evaluation: a worker tells the servers it is
  // done and takes their final parameters.
  virtual void finish() {}
  // Lines for the run's log (a server going on without a stopped worker).
  virtual std::vector<std::string> notices() const { return {}; }

  // Checkpoints of schemes whose ranks hold state of their own (the
  // trainer's save / resume; docs/sync.md "Checkpoints"). kReplicas: every
  // replica's parameters and optimizer state differ, so each is saved as
  // its own row; kServers: the parameter servers' shards and optimizer
  // state are whole tensors (saved as all-reduce DP saves them), only the
  // scheme's counters are per rank. kRanks: identical replicas saved as
  // all-reduce DP saves them, plus each rank's own state rows (all-reduce
  // with a codec: its error-feedback residuals, PowerSGD's Q, DGC's
  // velocity); it resumes with that state under the same scheme, codec and
  // rank count, and afresh elsewhere. kNone: nothing of the scheme's own.
  enum class RankCheckpoint { kNone, kReplicas, kServers, kRanks };
  virtual RankCheckpoint rank_checkpoint() const { return RankCheckpoint::kNone; }
  // Collective over the scheme's group, before a save: lands or completes
  // what is in flight (a partial group's average, DiLoCo's exchanges:
  // their summed pseudo-gradients are then part of the state) and writes
  // the scheme's counters into the views checkpoint_state() returns.
  // Training goes on exactly as without it.
  virtual void prepare_checkpoint() {}
  // This rank's scheme state: views of its own buffers, each saved as row
  // `row` of `rows` of the tensor "sync/<name>" (shape [rows, numel]) and
  // loaded back into on resume.
  struct StatePiece {
    std::string name;
    int row = 0;
    int rows = 1;
    Tensor data;
  };
  virtual std::vector<StatePiece> checkpoint_state() { return {}; }
  // On resume, after the parameters and optimizer state are in place and
  // (with_state) checkpoint_state()'s views were loaded: takes the counters
  // back. Without state (a checkpoint of another scheme) the scheme starts
  // afresh at optimizer step `step` (its counters as if it had run `step`
  // steps in lock step: schedules, periods and learning rates continue).
  // CheckpointError when the loaded counters disagree with `step`.
  virtual void restore_checkpoint(int64_t /*step*/, bool /*with_state*/) {}
};

// Bytes `c` has sent (its counters, agreement handshakes left out).
uint64_t sync_bytes_sent(const Communicator& c);

// The scheme `o` names over `group` (the data-parallel ranks). layout /
// flat_params / dp as DataParallel's constructor takes them (allreduce uses
// all of dp; the other schemes step locally with dp's bucket and
// accumulation settings and refuse ZeRO stages > 0). local_share: this
// rank's share of the global batch (local schemes weigh averages by it).
// The scheme keeps a reference to `group`, which must outlive it.
std::unique_ptr<ReplicaSync> make_replica_sync(const SyncOptions& o, Communicator& group,
                                               ParamLayout layout, Tensor flat_params,
                                               DataParallelOptions dp, double local_share);

}  // namespace mt
