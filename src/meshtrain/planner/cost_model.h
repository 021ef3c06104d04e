// The planner's cost model: what one optimizer step of a run (a model, the
// trainer's options with their plan, a cluster) costs on every rank, without
// data and without allocating tensors (graphs hold shapes only).
//
// Pieces, each from the code the runtime runs:
//   compute   per operator from graph/cost.h's OpCost on the rank's device
//             kind: max(flops / (peak(dtype) x efficiency(op)),
//             bytes / memory bandwidth), times the rank's slowdown;
//   comm      per collective from comm/cost.h (the algorithm the
//             communicator's policy picks for the group, its alpha-beta
//             time over the links it crosses): tensor-parallel collectives
//             the lowering inserted (spmd/lower.h), data-parallel gradient
//             buckets (sync/buckets.h) or ZeRO's reduce-scatter / gathers,
//             pipeline sends between stages;
//   schedule  the pipeline schedule's own action lists (spmd/schedule.h);
//   memory    the trainer's own per-rank plan (train/training_plan.h, what
//             `inspect` prints); under pipeline plans the stage's
//             parameters, gradients, optimizer state, one activation stash
//             per micro-batch in flight (the schedule's peak) and the
//             largest pass's arena.
// The step time itself comes from the discrete-event simulator
// (planner/simulator.h) over the ranks' programs that build_programs makes;
// estimate_step() does both. See docs/planner.md for what is and is not
// modelled.
//
// Units: seconds, bytes, FLOPs. Pure functions of their arguments; they
// throw ConfigError (naming the key) for runs the trainer would refuse.
#pragma once

#include <cstdint>
#include <deque>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "meshtrain/comm/cost.h"
#include "meshtrain/graph/graph.h"
#include "meshtrain/models/model.h"
#include "meshtrain/planner/cluster_model.h"
#include "meshtrain/train/trainer.h"

namespace mt::planner {

struct Pricing;

// Seconds operator `n` of `g` takes on a device of `kind` at `slowdown`
// (collectives and free ops such as reshape: 0; their cost is comm's).
// dtype-aware: the peak is peak_flops_bf16 when the node's inputs are bf16
// or f16 (and that peak is set), else peak_flops_f32. Every operator that
// costs anything adds the device's op_overhead_s once (not slowed down).
// With DeviceKind::weight_bandwidth a matmul costs
//   max(FLOP time, (bytes - weight bytes) / memory_bandwidth) x slowdown
//   + weight_traffic_seconds + op_overhead_s.
// `weights`: weight_values(g), computed here when null.
double op_seconds(const DeviceKind& kind, const Graph& g, const Node& n, double slowdown = 1.0,
                  const std::vector<char>* weights = nullptr);

// Per value of `g` (indexed by ValueId), 1 where it does not scale with the
// batch: parameters; outputs of non-matmul, non-collective operators whose
// inputs all are (a parameter's 16-bit copy, its reshape); the parameters'
// gradients (Graph::grads) and, backwards from them through add, cast and
// view operators, the inputs of the same size they sum or convert (a tied
// weight's partial gradients).
std::vector<char> weight_values(const Graph& g);

// The weights' memory traffic of node `n` under DeviceKind::weight_bandwidth:
// for a matmul, the bytes (value_bytes under `pricing`) of its operands and
// output that weight_values marks / weight_bandwidth x slowdown; 0 for
// other operators or without the setting. It does not shrink with a
// replica's share of the batch: the LP's constant term with op_overhead_s.
double weight_traffic_seconds(const DeviceKind& kind, const Pricing& pricing, const Graph& g,
                              const Node& n, const std::vector<char>& weights,
                              double slowdown = 1.0);

// The fraction of a matmul's peak rate its tiling leaves (tile and wave
// quantization): with DeviceKind::compute_units C and matmul_tile (tm, tn),
// a matmul of output [..., M, N] (batch b) runs b * ceil(M/tm) * ceil(N/tn)
// tiles in ceil(tiles / C) waves of C tiles, so it reaches
// b*M*N / (waves * C * tm * tn) of the rate of full waves of full tiles --
// the better of the tile's two orientations. 1 for other operators and
// where the device states no compute_units or matmul_tile. op_seconds
// multiplies the operator's efficiency by it.
double wave_efficiency(const DeviceKind& kind, const Graph& g, const Node& n);

// How a device kind's runtime (DeviceKind::half_activations /
// fused_elementwise) runs the graphs of a run at `precision`.
struct Pricing {
  bool half = false;   // floating-point tensors at 2 bytes per element
  bool fused = false;  // consecutive element-wise operators as one pass
  static Pricing of(const DeviceKind& kind, DType precision);
};

// Bytes value `v` occupies as the runtime keeps it: its graph dtype's, or
// under Pricing::half 2 per element of a floating-point tensor.
double value_bytes(const Pricing& pricing, const Value& v);
// The element size a collective or a pipeline message of dtype `t` moves.
size_t element_bytes(const Pricing& pricing, DType t);

// Whether `op` joins a fused element-wise run (Pricing::fused): add, sub,
// mul, scale, relu, gelu, tanh, sigmoid, softmax, cast, unary_grad,
// softmax_grad, broadcast_to.
bool fusable_elementwise(OpKind op);

// Seconds of every node of `g` (indexed by NodeId) on `kind` at `slowdown`
// for a run at `precision`. With neither runtime setting: op_seconds of
// each node. Under Pricing::half a cast between floating-point types costs
// nothing (both sides are the same 16-bit tensor; weights' 16-bit copies
// are written by the optimizer, optimizer_bytes_per_element) and every
// other operator's bytes are value_bytes. Under Pricing::fused each
// maximal run of consecutive fusable operators (views of values the run
// produced join it; other views neither join nor end it; any other
// operator ends it) is one kernel: max(the sum of its operators' FLOP
// times, (the bytes of the distinct values it reads from outside + of the
// values it produces that are read after it, in `kept` or read by nothing)
// / bandwidth), charged to the run's last operator, 0 to the others.
// `kept`: names of values read after the graph (a pipeline pass's stash).
// With DeviceKind::attention_dropout each softmax and softmax_grad node
// also carries dropout_seconds (a kernel of its own, outside any fused run).
// The device as it prices world rank `r`'s graph `g` on `cluster`: its
// kind, with weight_bandwidth 0 where the rank's weights and gradients (2 x
// the f32 bytes of g's parameters) fit its share of the node's cache
// (DeviceKind::cache_bytes / the ranks on its node).
DeviceKind rank_device(const ClusterModel& cluster, int r, const Graph& g);

// `traffic`: when given, set to each node's weight_traffic_seconds (part of
// its seconds).
std::vector<double> node_seconds(const DeviceKind& kind, const Graph& g, DType precision,
                                 double slowdown = 1.0,
                                 const std::vector<std::string>* kept = nullptr,
                                 std::vector<double>* traffic = nullptr);

// The dropout kernel DeviceKind::attention_dropout adds at node `n`: for a
// softmax or softmax_grad node with output of E elements of dtype t,
// E x (2 x element_bytes(pricing, t) + 1) / memory_bandwidth x slowdown
// (forward: read the probabilities, write them dropped and a 1-byte mask;
// backward: read the gradient and the mask, write the gradient); 0 for
// other nodes, without the setting or without a memory bandwidth.
double dropout_seconds(const DeviceKind& kind, const Pricing& pricing, const Graph& g,
                       const Node& n, double slowdown = 1.0);

// Bytes per parameter element the optimizer step moves: parameter,
// gradient and `state_kinds` state tensors in f32, read and written; under
// Pricing::half also the write of the weights' 16-bit copy.
double optimizer_bytes_per_element(const Pricing& pricing, int state_kinds);

// Peak bytes of one pipeline rank (one physical stage), as the pipeline
// runtime plans them (spmd/pipeline_stage.h planned_stash_bytes): f32
// parameters and gradients, optimizer state (state_kinds tensors of the
// parameters' size, divided by zero_dp under ZeRO-1 / 2 / 3; ZeRO-2 adds
// the reduced gradient shard, 1/zero_dp of the gradients, to the full
// gradient the micro-batches accumulate into; ZeRO-3 also the parameter
// shard next to the whole parameters gathered for the step), kept_bytes per micro-batch chunk in
// flight (the whole stash, or under recomputation only the received
// inputs), plus one whole stash while a recomputed forward is live, plus
// the largest pass arena.

struct PipelineStageMemory {
  int64_t param_bytes = 0;  // f32 bytes of the stage's parameters
  int state_kinds = 0;      // optimizer state tensors per parameter (AdamW: 2)
  int zero_dp = 1;          // ZeRO-1 / 2 / 3: the data-parallel degree; else 1
  int zero_stage = 0;       // 2: gradients also keep the reduced shard; 3: parameters too
  int64_t kept_bytes = 0;   // per micro-batch chunk in flight
  int64_t in_flight = 0;    // the schedule's peak chunks in flight on the stage
  bool recompute = false;   // some stage of the rank recomputes
  int64_t stash_bytes = 0;  // one micro-batch's whole stash (largest stage)
  int64_t arena_bytes = 0;  // the largest forward / backward pass arena
};
int64_t pipeline_stage_memory(const PipelineStageMemory& m);

// `numel` elements split evenly over n ranks (the first numel % n ranks one
// more); zero1_shard_elements: the largest share.
std::vector<size_t> even_counts(int64_t numel, int n);
int64_t zero1_shard_elements(int64_t numel, int dp);

// The comm layer's cost model over the cluster's layout and fits.
comm::CommCostModel comm_model(const ClusterModel& cluster);

// One task of a rank program, the unit the simulator schedules. Tasks of a
// lane run in order; a task may also wait for earlier tasks of its rank
// (`after`). Collectives start when every member of the group has reached
// them (group + sequence number match them); sends and receives match by
// (sender, receiver, tag).
struct Task {
  enum class Kind : uint8_t { compute, collective, send, recv };
  Kind kind = Kind::compute;
  int lane = 0;          // 0 compute, 1 communication (trace lanes as Timeline's)
  std::string name;      // trace name: "forward F3@1", "all_reduce dp bucket 2", ...
  std::string category;  // "forward", "backward", "optimizer", "comm", "p2p"
  // compute: its duration. Collectives and sends are timed by the simulator
  // on the rank's own group / peer (links differ between groups): `shape`
  // indexes Program::shapes; a send carries `bytes`.
  double seconds = 0;
  int shape = -1;
  std::vector<int> after;  // indices of earlier tasks of this program it waits for
  // collective: which of the program's groups (Program::groups) and its
  // call number on that group; send / recv: the peer slot and a tag.
  int group = -1;
  int64_t seq = 0;
  int peer = -1;  // send / recv: index into Program::peers
  int64_t tag = 0;
  uint64_t bytes = 0;  // send / recv: the message's bytes
  double flops = 0;    // compute
  // compute: the part of `seconds` that is the runtime's own time per
  // kernel (DeviceKind::op_overhead_s x kernels), which does not grow with
  // the rank's share of the work.
  double overhead_s = 0;
  // compute: the part of `seconds` that is the weights' memory traffic
  // (weight_traffic_seconds), which does not grow with the share either.
  double traffic_s = 0;
};

// A rank program: what one rank does in one optimizer step. Ranks that do
// the same thing (same stage, same shard shapes, same device kind and
// slowdown) share one Program; per rank only the world ranks of its groups
// and peers differ (RankBinding).
struct Program {
  std::string signature;  // what made it distinct, for messages and dedup
  std::vector<Task> tasks;
  std::vector<comm::CollectiveShape> shapes;  // of the collective tasks
  std::vector<std::string> groups;            // group slots by name ("tp", "dp", ...)
  std::vector<std::string> peers;             // peer slots by name ("pp-next", "pp-prev")
  double flops = 0;                           // model FLOPs this rank computes per step
  int64_t peak_memory_bytes = 0;
  std::string memory_detail;  // the parts, for the report
};

// Which world ranks a rank's group and peer slots are.
struct RankBinding {
  int program = 0;              // index into Programs::programs
  std::vector<int> group_ids;   // per group slot: a global group id
  std::vector<int> peer_ranks;  // per peer slot: a world rank (-1: none)
};

struct Programs {
  std::vector<Program> programs;         // distinct programs
  std::vector<RankBinding> ranks;        // per world rank
  std::vector<std::vector<int>> groups;  // global group id -> world ranks
  double model_flops_per_step = 0;       // the whole model's (all ranks), for MFU
  int64_t samples_per_step = 0;          // global batch
  bool half_precision = false;           // bf16 / f16 runs: MFU against the bf16 peak
  std::vector<std::string> notes;        // simplifications taken, for the report
};

// What build_programs may reuse across the candidates of one plan search:
// a pipeline's lowered, cut stage passes and their arenas per (plan without
// its schedule and micro-batch count, micro-batch size, tensor coordinates,
// precision, recomputation) -- the same for 1F1B and GPipe, and for every
// device and slowdown. Valid only across calls whose model and options
// differ in nothing else (search_plans keeps one per search). Thread-safe.
struct PipelineBuilt;
// At most `capacity` entries are kept, the oldest stored dropped first (a
// 175B-shaped model's cut is tens of MB; candidates that share one are
// enumerated next to each other).
struct BuildCache {
  size_t capacity = 64;
  std::mutex mutex;
  // Built or being built (a thread that claimed the key fulfils it).
  std::map<std::string, std::shared_future<std::shared_ptr<const PipelineBuilt>>> pipelines;
  std::deque<std::string> order;  // keys, oldest first
  int64_t hits = 0, misses = 0;
};

// The programs of every rank of a run: the trainer's graph (or the
// pipeline's stage passes) for this plan, with each operator's time on the
// rank's device and each collective's time on its group. Throws ConfigError
// for options the trainer would refuse (as plan_training does), and when
// the cluster's world differs from the plan's.
Programs build_programs(const ModelSpec& spec, const TrainerOptions& options,
                        const ClusterModel& cluster, BuildCache* cache = nullptr);

// One rank's share of a predicted step.
struct RankEstimate {
  double compute_s = 0;  // busy computing
  double comm_s = 0;     // in collectives / sends on the critical lane (not hidden)
  double idle_s = 0;     // step - compute - comm (bubbles, waiting for peers)
  double forward_s = 0, backward_s = 0, optimizer_s = 0;  // compute by phase
  double overhead_s = 0;  // of compute_s: the runtime's per-kernel time (op_overhead_s)
  double traffic_s = 0;   // of compute_s: the weights' memory traffic (weight_traffic_seconds)
  int64_t peak_memory_bytes = 0;
  uint64_t bytes_sent = 0;  // per step
  double utilisation = 0;   // compute_s / step_s
};

struct StepEstimate {
  double step_s = 0;
  double samples_per_s = 0;
  // model FLOPs per step / (step_s x sum of the ranks' peak FLOP/s at the
  // run's precision: bf16 for bf16 / f16 runs where the device states it)
  double mfu = 0;
  std::vector<RankEstimate> ranks;  // per world rank
  int distinct_programs = 0;
  std::vector<std::string> notes;

  int64_t max_peak_memory_bytes() const;
  uint64_t max_bytes_sent() const;
};

// The cluster as a plan's mesh sees it: its rank m is world rank
// devices[m] (Plan::devices) -- that rank's device kind, slowdown and node
// -- so the cost model and the simulator, which number ranks by the mesh,
// price the devices the runtime will run each mesh rank on. Empty
// `devices`: the cluster as it is. Throws ConfigError unless `devices` is a
// permutation of the cluster's ranks.
ClusterModel arrange_cluster(const ClusterModel& cluster, const std::vector<int>& devices);

// build_programs + the simulator (planner/simulator.h), no trace; on the
// cluster arranged by the plan's devices (arrange_cluster), so the
// estimate's ranks are mesh ranks.
StepEstimate estimate_step(const ModelSpec& spec, const TrainerOptions& options,
                           const ClusterModel& cluster);

}  // namespace mt::planner
