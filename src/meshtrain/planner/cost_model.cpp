// Rank programs from the trainer's own graphs (planner/cost_model.h).
#include "meshtrain/planner/cost_model.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <set>
#include <tuple>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "meshtrain/base/error.h"
#include "meshtrain/graph/collective.h"
#include "meshtrain/graph/cost.h"
#include "meshtrain/graph/op_registry.h"
#include "meshtrain/planner/simulator.h"
#include "meshtrain/spmd/pipeline_stage.h"
#include "meshtrain/spmd/schedule.h"
#include "meshtrain/sync/buckets.h"
#include "meshtrain/sync/codec_spec.h"
#include "meshtrain/train/optimizer.h"
#include "meshtrain/train/param_store.h"
#include "meshtrain/train/pipeline_training.h"
#include "meshtrain/train/training_plan.h"

namespace mt::planner {

namespace {

bool half(DType t) {
  return t == DType::bf16 || t == DType::f16;
}

}  // namespace

double wave_efficiency(const DeviceKind& kind, const Graph& g, const Node& n) {
  if (n.op != OpKind::matmul || kind.compute_units <= 0 || kind.matmul_tile[0] <= 0 ||
      kind.matmul_tile[1] <= 0) {
    return 1.0;
  }
  const Shape& c = g.value(n.outputs.at(0)).shape;
  if (c.rank() < 2 || c.numel() <= 0) return 1.0;
  const int64_t M = c[-2], N = c[-1];
  const int64_t batch = c.numel() / (M * N);
  auto fill = [&](int64_t tm, int64_t tn) {
    const int64_t tiles = batch * ((M + tm - 1) / tm) * ((N + tn - 1) / tn);
    const int64_t waves = (tiles + kind.compute_units - 1) / kind.compute_units;
    return static_cast<double>(c.numel()) /
           (static_cast<double>(waves) * static_cast<double>(kind.compute_units) *
            static_cast<double>(tm * tn));
  };
  return std::max(fill(kind.matmul_tile[0], kind.matmul_tile[1]),
                  fill(kind.matmul_tile[1], kind.matmul_tile[0]));
}

namespace {

// The FLOP-bound time of node `n` (no slowdown).
double flop_seconds(const DeviceKind& kind, const Graph& g, const Node& n, double flops) {
  if (flops <= 0) return 0.0;
  bool low = false;
  for (ValueId v : n.inputs) low = low || half(g.value(v).dtype);
  const double peak = low && kind.peak_flops_bf16 > 0 ? kind.peak_flops_bf16 : kind.peak_flops_f32;
  auto it = kind.efficiency.find(std::string(op_name(n.op)));
  const double eff = (it != kind.efficiency.end() ? it->second : kind.default_efficiency) *
                     wave_efficiency(kind, g, n);
  return peak > 0 && eff > 0 ? flops / (peak * eff) : 0.0;
}

}  // namespace

std::vector<char> weight_values(const Graph& g) {
  const auto V = static_cast<size_t>(g.num_values());
  std::vector<char> w(V, 0);
  for (ValueId v : g.params()) w[static_cast<size_t>(v)] = 1;
  // Forward: what is computed from weights alone (nodes come in order).
  for (NodeId i = 0; i < g.num_nodes(); ++i) {
    const Node& n = g.node(i);
    if (n.op == OpKind::matmul || is_group_op(n.op) || n.inputs.empty()) continue;
    bool all = true;
    for (ValueId v : n.inputs) all = all && w[static_cast<size_t>(v)];
    if (all) {
      for (ValueId v : n.outputs) w[static_cast<size_t>(v)] = 1;
    }
  }
  // Backward from the gradients: the partial sums and conversions feeding them.
  for (const auto& [param, grad] : g.grads()) {
    if (grad >= 0) w[static_cast<size_t>(grad)] = 1;
  }
  for (NodeId i = g.num_nodes() - 1; i >= 0; --i) {
    const Node& n = g.node(i);
    if (n.outputs.size() != 1 || !w[static_cast<size_t>(n.outputs[0])]) continue;
    if (n.op != OpKind::add && n.op != OpKind::cast && !op_def(n.op).view) continue;
    const int64_t numel = g.value(n.outputs[0]).shape.numel();
    for (ValueId v : n.inputs) {
      if (g.value(v).shape.numel() == numel) w[static_cast<size_t>(v)] = 1;
    }
  }
  return w;
}

namespace {

// The bytes of a matmul's operands and output that `weights` marks.
double weight_bytes(const Pricing& pricing, const Graph& g, const Node& n,
                    const std::vector<char>& weights) {
  double bytes = 0;
  for (ValueId v : n.inputs) {
    if (weights.at(static_cast<size_t>(v))) bytes += value_bytes(pricing, g.value(v));
  }
  for (ValueId v : n.outputs) {
    if (weights.at(static_cast<size_t>(v))) bytes += value_bytes(pricing, g.value(v));
  }
  return bytes;
}

}  // namespace

double weight_traffic_seconds(const DeviceKind& kind, const Pricing& pricing, const Graph& g,
                              const Node& n, const std::vector<char>& weights, double slowdown) {
  if (n.op != OpKind::matmul || kind.weight_bandwidth <= 0) return 0.0;
  return weight_bytes(pricing, g, n, weights) / kind.weight_bandwidth * slowdown;
}

DeviceKind rank_device(const ClusterModel& cluster, int r, const Graph& g) {
  DeviceKind k = cluster.device(r);
  if (k.weight_bandwidth <= 0 || k.cache_bytes <= 0) return k;
  const std::vector<int>& node_of = cluster.layout.node_of;
  const int node = node_of.at(static_cast<size_t>(r));
  const auto on_node = std::count(node_of.begin(), node_of.end(), node);
  double bytes = 0;
  for (ValueId v : g.params()) bytes += 2.0 * static_cast<double>(g.value(v).shape.numel()) * 4;
  if (bytes <= k.cache_bytes / static_cast<double>(std::max<int64_t>(1, on_node))) {
    k.weight_bandwidth = 0;
  }
  return k;
}

namespace {

// A kernel of `flops` and `bytes` (read + written, under `pricing`): the
// larger of its FLOP and byte times, or for a matmul under
// DeviceKind::weight_bandwidth its weights' bytes apart, added.
double kernel_seconds(const DeviceKind& kind, const Pricing& pricing, const Graph& g, const Node& n,
                      double flops, double bytes, double slowdown,
                      const std::vector<char>* weights) {
  double traffic = 0;
  if (n.op == OpKind::matmul && kind.weight_bandwidth > 0) {
    std::vector<char> own;
    if (weights == nullptr) weights = &(own = weight_values(g));
    const double wb = weight_bytes(pricing, g, n, *weights);
    traffic = wb / kind.weight_bandwidth * slowdown;
    bytes -= wb;  // priced apart, not also in the overlapped part
  }
  const double t_bytes =
      kind.memory_bandwidth > 0 ? std::max(0.0, bytes) / kind.memory_bandwidth : 0.0;
  return std::max(flop_seconds(kind, g, n, flops), t_bytes) * slowdown + traffic +
         kind.op_overhead_s;
}

}  // namespace

double op_seconds(const DeviceKind& kind, const Graph& g, const Node& n, double slowdown,
                  const std::vector<char>* weights) {
  if (is_group_op(n.op)) return 0.0;
  const OpCost c = op_cost(g, n);
  if (c.flops <= 0 && c.bytes <= 0) return 0.0;
  return kernel_seconds(kind, Pricing{}, g, n, c.flops, c.bytes, slowdown, weights);
}

Pricing Pricing::of(const DeviceKind& kind, DType precision) {
  Pricing p;
  p.half = kind.half_activations && (precision == DType::bf16 || precision == DType::f16);
  p.fused = kind.fused_elementwise;
  return p;
}

double value_bytes(const Pricing& pricing, const Value& v) {
  return static_cast<double>(v.shape.numel()) *
         static_cast<double>(element_bytes(pricing, v.dtype));
}

size_t element_bytes(const Pricing& pricing, DType t) {
  const size_t z = dtype_size(t);
  return pricing.half && is_float(t) ? std::min<size_t>(z, 2) : z;
}

bool fusable_elementwise(OpKind op) {
  switch (op) {
    case OpKind::add:
    case OpKind::sub:
    case OpKind::mul:
    case OpKind::scale:
    case OpKind::relu:
    case OpKind::gelu:
    case OpKind::tanh:
    case OpKind::sigmoid:
    case OpKind::softmax:
    case OpKind::cast:
    case OpKind::unary_grad:
    case OpKind::softmax_grad:
    case OpKind::broadcast_to:
      return true;
    default:
      return false;
  }
}

double optimizer_bytes_per_element(const Pricing& pricing, int state_kinds) {
  return 4.0 * 2.0 * (2 + state_kinds) + (pricing.half ? 2.0 : 0.0);
}

namespace {

bool free_cast(const Pricing& pricing, const Graph& g, const Node& n) {
  return pricing.half && n.op == OpKind::cast && is_float(g.value(n.inputs.at(0)).dtype) &&
         is_float(g.value(n.outputs.at(0)).dtype);
}

}  // namespace

double dropout_seconds(const DeviceKind& kind, const Pricing& pricing, const Graph& g,
                       const Node& n, double slowdown) {
  if (!kind.attention_dropout || kind.memory_bandwidth <= 0) return 0.0;
  if (n.op != OpKind::softmax && n.op != OpKind::softmax_grad) return 0.0;
  // Forward: read p, write the dropped p and a 1-byte mask; backward: read
  // the gradient and the mask, write the gradient. Both 2 x element + 1.
  const Value& v = g.value(n.outputs.at(0));
  const double per = 2.0 * static_cast<double>(element_bytes(pricing, v.dtype)) + 1.0;
  return static_cast<double>(v.shape.numel()) * per / kind.memory_bandwidth * slowdown;
}

namespace {

std::vector<double> node_seconds_no_dropout(const DeviceKind& kind, const Graph& g, DType precision,
                                            double slowdown, const std::vector<std::string>* kept,
                                            const std::vector<char>& weights) {
  const Pricing pricing = Pricing::of(kind, precision);
  const auto N = static_cast<size_t>(g.num_nodes());
  std::vector<double> out(N, 0.0);
  const double bw = kind.memory_bandwidth;
  // One operator on its own.
  auto single = [&](const Node& n) {
    if (is_group_op(n.op)) return 0.0;
    if (!pricing.half) return op_seconds(kind, g, n, slowdown, &weights);
    if (free_cast(pricing, g, n)) return 0.0;
    const OpDef& def = op_def(n.op);
    const double flops = def.flops(g, n);
    double bytes = 0;
    if (!def.view) {
      for (ValueId v : n.inputs) bytes += value_bytes(pricing, g.value(v));
      for (ValueId v : n.outputs) bytes += value_bytes(pricing, g.value(v));
    }
    if (flops <= 0 && (bw <= 0 || bytes <= 0)) return 0.0;
    return kernel_seconds(kind, pricing, g, n, flops, bytes, slowdown, &weights);
  };
  if (!pricing.fused) {
    for (size_t i = 0; i < N; ++i) out[i] = single(g.node(static_cast<NodeId>(i)));
    return out;
  }
  // Readers of each value (node ids, ascending), and the values read later.
  std::vector<std::vector<NodeId>> readers(static_cast<size_t>(g.num_values()));
  for (NodeId i = 0; i < g.num_nodes(); ++i) {
    for (ValueId v : g.node(i).inputs) readers[static_cast<size_t>(v)].push_back(i);
  }
  std::vector<char> keep(static_cast<size_t>(g.num_values()), 0);
  if (kept != nullptr) {
    for (const std::string& name : *kept) {
      if (auto v = g.find(name)) keep[static_cast<size_t>(*v)] = 1;
    }
  }
  std::vector<char> member(N, 0);
  std::vector<char> produced(static_cast<size_t>(g.num_values()), 0);
  std::vector<NodeId> run;        // the current run's members, in order
  auto close = [&](NodeId end) {  // nodes >= end are outside the run
    if (run.empty()) return;
    double t_flops = 0, bytes = 0;
    std::set<ValueId> read;
    NodeId last = -1;
    for (NodeId i : run) {
      const Node& n = g.node(i);
      if (op_def(n.op).view) continue;
      last = i;
      t_flops += flop_seconds(kind, g, n, op_def(n.op).flops(g, n));
      for (ValueId v : n.inputs) {
        if (!produced[static_cast<size_t>(v)] && read.insert(v).second) {
          bytes += value_bytes(pricing, g.value(v));
        }
      }
      for (ValueId v : n.outputs) {
        const auto& rd = readers[static_cast<size_t>(v)];
        // Written when read after the run (a view of it inside the run is
        // itself a member: its readers count through its own output).
        bool later = keep[static_cast<size_t>(v)] || rd.empty();
        for (NodeId r : rd) {
          if (r >= end || !member[static_cast<size_t>(r)]) later = true;
          if (member[static_cast<size_t>(r)] && op_def(g.node(r).op).view) {
            const ValueId w = g.node(r).outputs.at(0);
            const auto& rw = readers[static_cast<size_t>(w)];
            if (keep[static_cast<size_t>(w)] || rw.empty()) later = true;
            for (NodeId q : rw) later = later || q >= end || !member[static_cast<size_t>(q)];
          }
        }
        if (later) bytes += value_bytes(pricing, g.value(v));
      }
    }
    if (last >= 0) {
      const double t_bytes = bw > 0 ? bytes / bw : 0.0;
      out[static_cast<size_t>(last)] = std::max(t_flops, t_bytes) * slowdown + kind.op_overhead_s;
    }
    for (NodeId i : run) {
      member[static_cast<size_t>(i)] = 0;
      for (ValueId v : g.node(i).outputs) produced[static_cast<size_t>(v)] = 0;
    }
    run.clear();
  };
  for (NodeId i = 0; i < g.num_nodes(); ++i) {
    const Node& n = g.node(i);
    const bool view = op_def(n.op).view;
    bool joins = fusable_elementwise(n.op) && !free_cast(pricing, g, n);
    if (view) {
      joins = !n.inputs.empty() && produced[static_cast<size_t>(n.inputs[0])];
      if (!joins) continue;  // a view of an outside value: transparent
    } else if (free_cast(pricing, g, n)) {
      // The same 16-bit tensor on both sides: an alias, like a view.
      joins = produced[static_cast<size_t>(n.inputs[0])];
      if (!joins) continue;
    }
    if (!joins) {
      close(i);
      out[static_cast<size_t>(i)] = single(n);
      continue;
    }
    run.push_back(i);
    member[static_cast<size_t>(i)] = 1;
    for (ValueId v : n.outputs) produced[static_cast<size_t>(v)] = 1;
  }
  close(g.num_nodes());
  return out;
}

}  // namespace

std::vector<double> node_seconds(const DeviceKind& kind, const Graph& g, DType precision,
                                 double slowdown, const std::vector<std::string>* kept,
                                 std::vector<double>* traffic) {
  const std::vector<char> weights =
      kind.weight_bandwidth > 0 ? weight_values(g) : std::vector<char>();
  std::vector<double> out = node_seconds_no_dropout(kind, g, precision, slowdown, kept, weights);
  const Pricing pricing = Pricing::of(kind, precision);
  if (traffic != nullptr) {
    traffic->assign(out.size(), 0.0);
    if (kind.weight_bandwidth > 0) {
      for (NodeId i = 0; i < g.num_nodes(); ++i) {
        (*traffic)[static_cast<size_t>(i)] =
            weight_traffic_seconds(kind, pricing, g, g.node(i), weights, slowdown);
      }
    }
  }
  if (!kind.attention_dropout) return out;
  for (NodeId i = 0; i < g.num_nodes(); ++i) {
    out[static_cast<size_t>(i)] += dropout_seconds(kind, pricing, g, g.node(i), slowdown);
  }
  return out;
}

int64_t zero1_shard_elements(int64_t numel, int dp) {
  const std::vector<size_t> c = even_counts(numel, dp);
  return c.empty() ? 0 : static_cast<int64_t>(c.front());
}

std::vector<size_t> even_counts(int64_t numel, int n) {
  std::vector<size_t> c;
  if (n < 1 || numel < 0) return c;
  const auto base = static_cast<size_t>(numel / n);
  const auto extra = static_cast<size_t>(numel % n);
  for (size_t i = 0; i < static_cast<size_t>(n); ++i) c.push_back(base + (i < extra ? 1 : 0));
  return c;
}

int64_t pipeline_stage_memory(const PipelineStageMemory& m) {
  const int zdp = std::max(1, m.zero_dp);
  const int64_t state = m.param_bytes * 2 + m.param_bytes * m.state_kinds / zdp +
                        (m.zero_stage >= 2 && zdp > 1 ? m.param_bytes / zdp : 0) +
                        (m.zero_stage >= 3 && zdp > 1 ? m.param_bytes / zdp : 0);
  return state + m.kept_bytes * m.in_flight + (m.recompute ? m.stash_bytes : 0) + m.arena_bytes;
}

comm::CommCostModel comm_model(const ClusterModel& cluster) {
  comm::CommCostModel m;
  m.layout = cluster.layout;
  m.algorithm_links = cluster.algorithm_links;
  return m;
}

// A pipeline's stage passes for one tensor coordinate, with each virtual
// stage's largest pass arena (what does not depend on the schedule, the
// device or the slowdown).
struct PipelineBuilt {
  PipelineCut cut;
  LoweredProgram lowered;
  std::vector<int64_t> arena;  // per virtual stage
};

int64_t StepEstimate::max_peak_memory_bytes() const {
  int64_t m = 0;
  for (const RankEstimate& r : ranks) m = std::max(m, r.peak_memory_bytes);
  return m;
}

uint64_t StepEstimate::max_bytes_sent() const {
  uint64_t m = 0;
  for (const RankEstimate& r : ranks) m = std::max(m, r.bytes_sent);
  return m;
}

namespace {

// Global group ids: one per distinct list of world ranks.
struct GroupTable {
  std::map<std::vector<int>, int> ids;
  std::vector<std::vector<int>> list;
  int id(const std::vector<int>& ranks) {
    auto [it, fresh] = ids.emplace(ranks, static_cast<int>(list.size()));
    if (fresh) list.push_back(ranks);
    return it->second;
  }
};

// The shape of a collective node's call, as the CollectiveRunner makes it.
// Under Pricing::half a floating-point payload moves at 2 bytes per element.
comm::CollectiveShape node_shape(const Graph& g, const Node& n, int group_size,
                                 const Pricing& pricing = {}) {
  comm::CollectiveShape s;
  const CollectiveAttrs a = CollectiveAttrs::of(n);
  const DType t = g.value(n.inputs.at(0)).dtype;
  s.elem_bytes = dtype_size(t);
  const size_t total = static_cast<size_t>(collective_payload_bytes(g, n)) / s.elem_bytes;
  s.elem_bytes = element_bytes(pricing, t);
  const int nranks = std::max(1, group_size);
  auto split = [&](std::vector<int64_t> sizes) {
    if (sizes.empty()) sizes.assign(static_cast<size_t>(nranks), 1);
    const int64_t sum = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
    std::vector<size_t> counts;
    for (int64_t z : sizes) {
      counts.push_back(sum > 0 ? static_cast<size_t>(static_cast<double>(total) * z / sum) : 0);
    }
    return counts;
  };
  switch (n.op) {
    case OpKind::all_gather:
    case OpKind::gather_from_group:
      s.kind = Collective::all_gatherv;
      s.counts = split(a.sizes);
      break;
    case OpKind::reduce_scatter:
      s.kind = Collective::reduce_scatterv;
      s.counts = split(a.sizes);
      break;
    case OpKind::all_to_all:
      s.kind = Collective::all_to_all;
      s.count = total / static_cast<size_t>(nranks);
      break;
    default:  // all_reduce, reduce_from_group
      s.kind = Collective::all_reduce;
      s.count = total;
      break;
  }
  return s;
}

// The mesh axis whose group (for `rank`) is `ranks`, or "" when none is.
std::string axis_of_group(const Mesh& mesh, int rank, const std::vector<int>& ranks) {
  for (const MeshAxis& ax : mesh.axes()) {
    if (mesh.group(rank, ax.name) == ranks) return ax.name;
  }
  return "";
}

// Builds one Program's tasks.
struct ProgramBuilder {
  Program p;
  std::map<std::string, int> slot_index;
  std::map<int, int64_t> seq;  // per group slot: calls so far

  int slot(const std::string& name) {
    auto [it, fresh] = slot_index.emplace(name, static_cast<int>(p.groups.size()));
    if (fresh) p.groups.push_back(name);
    return it->second;
  }
  int compute(std::string name, std::string category, double seconds, double flops,
              std::vector<int> after = {}) {
    Task t;
    t.kind = Task::Kind::compute;
    t.name = std::move(name);
    t.category = std::move(category);
    t.seconds = seconds;
    t.flops = flops;
    t.after = std::move(after);
    p.flops += flops;
    p.tasks.push_back(std::move(t));
    return static_cast<int>(p.tasks.size()) - 1;
  }
  int collective(std::string name, const std::string& group, const comm::CollectiveShape& s,
                 int lane, std::vector<int> after = {}) {
    Task t;
    t.kind = Task::Kind::collective;
    t.lane = lane;
    t.name = std::move(name);
    t.category = "comm";
    t.group = slot(group);
    t.seq = seq[t.group]++;
    t.shape = static_cast<int>(p.shapes.size());
    p.shapes.push_back(s);
    t.after = std::move(after);
    p.tasks.push_back(std::move(t));
    return static_cast<int>(p.tasks.size()) - 1;
  }
  int p2p(Task::Kind kind, std::string name, int peer, int64_t tag, uint64_t bytes, int lane,
          std::vector<int> after = {}) {
    Task t;
    t.kind = kind;
    t.lane = lane;
    t.name = std::move(name);
    t.category = "p2p";
    t.peer = peer;
    t.tag = tag;
    t.bytes = bytes;
    t.after = std::move(after);
    p.tasks.push_back(std::move(t));
    return static_cast<int>(p.tasks.size()) - 1;
  }
};

// The optimizer's update of `numel` f32 elements: memory-bound, reading and
// writing the parameter, the gradient and each state tensor.
double optimizer_seconds(const DeviceKind& kind, int64_t numel, int state_kinds, double slowdown,
                         const Pricing& pricing) {
  const double bytes =
      static_cast<double>(numel) * optimizer_bytes_per_element(pricing, state_kinds);
  const double flops = static_cast<double>(numel) * (4.0 + 4.0 * state_kinds);
  const double t_bytes = kind.memory_bandwidth > 0 ? bytes / kind.memory_bandwidth : 0.0;
  const double t_flops =
      kind.peak_flops_f32 > 0 ? flops / (kind.peak_flops_f32 * kind.default_efficiency) : 0.0;
  return std::max(t_bytes, t_flops) * slowdown;
}

// Time of a collective node folded into a pass (pipeline passes), on the
// group of the rank the pass was built for.
double folded_collective_s(const comm::CommCostModel& cm, const Graph& g, const Node& n,
                           const std::vector<std::vector<int>>& groups, const Pricing& pricing) {
  if (!communicates(n.op)) return 0.0;
  const CollectiveAttrs a = CollectiveAttrs::of(n);
  const std::vector<int>& ranks = groups.at(static_cast<size_t>(a.group));
  return cm.collective(node_shape(g, n, static_cast<int>(ranks.size()), pricing), ranks).seconds;
}

// ---- data parallel / ZeRO / tensor parallel (no pipeline) --------------------

// What a data-parallel program depends on besides the rank's device.
struct DpKey {
  std::vector<int> lowered_coords;
  int64_t micro_batch;
  int kind;
  double slowdown;
  bool operator<(const DpKey& o) const {
    return std::tie(lowered_coords, micro_batch, kind, slowdown) <
           std::tie(o.lowered_coords, o.micro_batch, o.kind, o.slowdown);
  }
};

void build_data_parallel(const ModelSpec& spec, const TrainerOptions& o,
                         const ClusterModel& cluster, const comm::CommCostModel& cm, Programs& out,
                         GroupTable& groups) {
  const int world = cluster.world();
  const Plan* plan = o.dist.plan.get();
  const bool lowered = plan != nullptr && needs_lowering(*plan);
  const std::vector<std::string> axes =
      lowered ? lowered_axes(plan->mesh) : std::vector<std::string>{};
  const int kinds = static_cast<int>(make_optimizer(o.optimizer, o.optim)->state_kinds().size());
  const DataParallelOptions& dp = o.dist.dp;
  const int K = dp.accumulation_steps;

  // The graph (and its memory plan) per lowered coordinates and micro-batch.
  struct Built {
    TrainingGraph tg;
    TrainingPlan plan;
    int rank;
  };
  std::map<std::pair<std::vector<int>, int64_t>, std::unique_ptr<Built>> graphs;
  std::map<DpKey, int> programs;

  for (int r = 0; r < world; ++r) {
    const DataParallelPlace place = data_parallel_place(o, r, world);
    const BatchSplit split = split_batch(o, place.rank, place.world);
    std::vector<int> coords;
    for (const std::string& a : axes) coords.push_back(plan->mesh.coord(r, a));
    auto& built = graphs[{coords, split.micro_batch}];
    if (!built) {
      built = std::make_unique<Built>();
      built->rank = r;
      built->tg = build_training_graph(spec, o, split.micro_batch, r);
      built->plan = plan_training(built->tg, spec, o, split, r, world);
    }
    const DpKey key{coords, split.micro_batch, cluster.kind_of.at(static_cast<size_t>(r)),
                    cluster.slowdown_of(r)};
    auto [it, fresh] = programs.emplace(key, static_cast<int>(out.programs.size()));
    RankBinding bind;
    bind.program = it->second;
    if (fresh) {
      const Graph& g = built->tg.model.graph;
      const DeviceKind dev = rank_device(cluster, r, g);
      const double slow = cluster.slowdown_of(r);
      const Pricing pricing = Pricing::of(dev, o.precision);
      std::vector<double> traffic;
      const std::vector<double> seconds =
          node_seconds(dev, g, o.precision, slow, nullptr, &traffic);
      ProgramBuilder b;
      b.p.signature = fmt::format(
          "rank {}: {}micro-batch {}, device {}, slowdown {}", r,
          axes.empty()
              ? ""
              : fmt::format("{} coords [{}], ", fmt::join(axes, "/"), fmt::join(coords, ",")),
          split.micro_batch, dev.name, slow);
      // Buckets over the data-parallel group, and which backward node
      // completes each bucket's gradients.
      int64_t flat = 0;
      const ParamLayout layout = ParamStore::layout(g, &flat);
      const BucketPlan buckets(layout, flat, dp.bucket_bytes, place.world, place.rank);
      std::vector<NodeId> producer(static_cast<size_t>(g.num_values()), -1);
      for (NodeId i = 0; i < g.num_nodes(); ++i) {
        for (ValueId v : g.node(i).outputs) producer[static_cast<size_t>(v)] = i;
      }
      std::map<NodeId, std::vector<int>> completes;  // node -> buckets it completes
      for (size_t bi = 0; bi < buckets.buckets().size(); ++bi) {
        const BucketInfo& bk = buckets.buckets()[bi];
        NodeId last = -1;
        for (int pi = bk.first_param; pi <= bk.last_param; ++pi) {
          const auto pv = g.find(layout[static_cast<size_t>(pi)].name);
          const ValueId gv = pv ? g.grad_of(*pv) : kNoValue;
          if (gv != kNoValue) last = std::max(last, producer[static_cast<size_t>(gv)]);
        }
        completes[last].push_back(static_cast<int>(bi));
      }
      const int dp_world = place.world;
      const std::string dp_axis = lowered ? "dp" : "world";
      const LoweredProgram& lp = built->tg.lowered;
      const double recompute_s =
          built->plan.activations.recompute_flops > 0 && dev.peak_flops_f32 > 0
              ? built->plan.activations.recompute_flops /
                    (dev.peak_flops_f32 * dev.default_efficiency) * slow
              : 0.0;

      // ZeRO-3: the bucket holding each parameter value, gathered before
      // the first operator of a phase (forward, backward) that reads it.
      const bool zero3 = dp_world > 1 && dp.stage == 3;
      std::vector<int> bucket_of_value(static_cast<size_t>(g.num_values()), -1);
      for (ValueId v : g.params()) {
        const int pi = buckets.find(g.value(v).name);
        if (pi >= 0) bucket_of_value[static_cast<size_t>(v)] = buckets.bucket_of(pi);
      }
      std::vector<int> bucket_task(buckets.buckets().size(), -1);
      int last_backward = -1, last_forward = -1;
      std::vector<int> pending;  // gathers the next compute task waits for
      for (int k = 0; k < K; ++k) {
        const bool last_micro = k == K - 1;
        double run_s = 0, run_flops = 0, run_overhead = 0, run_traffic = 0;
        bool run_backward = false;
        auto flush = [&]() {
          if (run_s <= 0 && run_flops <= 0 && pending.empty()) return;
          const int t = b.compute(fmt::format("{} {}", run_backward ? "backward" : "forward", k),
                                  run_backward ? "backward" : "forward", run_s, run_flops, pending);
          b.p.tasks[static_cast<size_t>(t)].overhead_s = run_overhead;
          b.p.tasks[static_cast<size_t>(t)].traffic_s = run_traffic;
          pending.clear();
          (run_backward ? last_backward : last_forward) = t;
          run_s = 0;
          run_flops = 0;
          run_overhead = 0;
          run_traffic = 0;
        };
        std::vector<char> gathered(buckets.buckets().size(), 0);
        bool in_backward = false;
        for (NodeId i = 0; i < g.num_nodes(); ++i) {
          const Node& n = g.node(i);
          if (n.backward != in_backward) {
            flush();
            std::fill(gathered.begin(), gathered.end(), 0);
            in_backward = n.backward;
            if (in_backward && recompute_s > 0) {
              b.compute(fmt::format("recompute {}", k), "backward", recompute_s,
                        built->plan.activations.recompute_flops);
            }
          }
          run_backward = in_backward;
          if (zero3 && !is_group_op(n.op)) {
            for (ValueId v : n.inputs) {
              const int bi = bucket_of_value[static_cast<size_t>(v)];
              if (bi < 0 || gathered[static_cast<size_t>(bi)]) continue;
              if (run_s > 0 || run_flops > 0) flush();
              gathered[static_cast<size_t>(bi)] = 1;
              comm::CollectiveShape gs{Collective::all_gatherv, 0,
                                       buckets.buckets()[static_cast<size_t>(bi)].counts, 4, 0};
              // Backward gathers again after forward freed the bucket.
              std::vector<int> after;
              if (n.backward && last_forward >= 0) after.push_back(last_forward);
              pending.push_back(b.collective(fmt::format("all_gatherv params bucket {}", bi),
                                             dp_axis, gs, 2, after));
            }
          }
          if (communicates(n.op)) {
            flush();
            const CollectiveAttrs a = CollectiveAttrs::of(n);
            // The lowered graph's groups are the world ranks of the rank it
            // was built for (built->rank), which may be in another tensor
            // group than r (a slower rank, another device kind): the slot is
            // the mesh axis, bound below to each rank's own group.
            const std::vector<int>& ranks = lp.groups.at(static_cast<size_t>(a.group));
            const std::string axis = axis_of_group(plan->mesh, built->rank, ranks);
            if (axis.empty()) {
              throw InternalError(fmt::format(
                  "planner: collective '{}' of rank {} runs on ranks [{}], which are no mesh "
                  "axis's group",
                  n.name, built->rank, fmt::join(ranks, ", ")));
            }
            b.collective(fmt::format("{} {}", op_name(n.op), n.name), axis,
                         node_shape(g, n, static_cast<int>(ranks.size()), pricing), 0);
            continue;
          }
          run_s += seconds[static_cast<size_t>(i)];
          run_flops += op_cost(g, n).flops;
          // node_seconds charges each kernel's overhead once (a fused run's
          // to its last operator, 0 to the others).
          if (seconds[static_cast<size_t>(i)] > 0) run_overhead += dev.op_overhead_s;
          run_traffic += traffic[static_cast<size_t>(i)];
          auto c = completes.find(i);
          if (last_micro && c != completes.end() && dp_world > 1) {
            flush();
            for (int bi : c->second) bucket_task[static_cast<size_t>(bi)] = last_backward;
          }
        }
        flush();
      }
      // Gradient buckets, in bucket order on the comm lane (with overlap off,
      // all after backward).
      std::vector<int> synced;
      if (dp_world > 1) {
        for (size_t bi = 0; bi < buckets.buckets().size(); ++bi) {
          const BucketInfo& bk = buckets.buckets()[bi];
          const int ready = dp.overlap && bucket_task[bi] >= 0 ? bucket_task[bi] : last_backward;
          comm::CollectiveShape s;
          s.elem_bytes = 4;
          if (dp.stage >= 2) {
            s.kind = Collective::reduce_scatterv;
            s.counts = bk.counts;
          } else {
            s.kind = Collective::all_reduce;
            s.count = static_cast<size_t>(bk.numel());
          }
          synced.push_back(b.collective(fmt::format("{} bucket {}", collective_name(s.kind), bi),
                                        dp_axis, s, 1,
                                        ready >= 0 ? std::vector<int>{ready} : std::vector<int>{}));
        }
      }
      std::vector<int> before_opt = synced;
      if (last_backward >= 0) before_opt.push_back(last_backward);
      const int64_t opt_numel = dp.stage >= 1 ? buckets.shard_numel() : buckets.param_numel();
      const int opt =
          b.compute("optimizer", "optimizer",
                    optimizer_seconds(dev, opt_numel, kinds, slow, pricing), 0, before_opt);
      // Stages 1-2 gather the updated parameters; stage 3 gathers each
      // bucket before its use in forward and again in backward (modelled as
      // two gathers of every bucket per micro-step, on the comm lane).
      if (dp_world > 1 && (dp.stage == 1 || dp.stage == 2)) {
        for (size_t bi = 0; bi < buckets.buckets().size(); ++bi) {
          comm::CollectiveShape s{Collective::all_gatherv, 0, buckets.buckets()[bi].counts, 4, 0};
          b.collective(fmt::format("all_gatherv params bucket {}", bi), dp_axis, s, 1, {opt});
        }
      }
      if (zero3) {
        out.notes.push_back(
            "ZeRO-3: each bucket's parameters are gathered (on their own lane) before the first "
            "forward and the first backward operator that reads them, as far ahead as the "
            "lane allows (the runtime prefetches one bucket ahead)");
      }
      b.p.peak_memory_bytes = built->plan.total_bytes();
      b.p.memory_detail = built->plan.describe();
      out.programs.push_back(std::move(b.p));
    }
    // Bind the slots to this rank's groups.
    const Program& prog = out.programs[static_cast<size_t>(bind.program)];
    for (const std::string& slot : prog.groups) {
      std::vector<int> ranks;
      if (slot == "world") {
        ranks.resize(static_cast<size_t>(world));
        std::iota(ranks.begin(), ranks.end(), 0);
      } else {
        ranks = plan->mesh.group(r, slot);
      }
      bind.group_ids.push_back(groups.id(ranks));
    }
    out.ranks.push_back(std::move(bind));
  }
}

// ---- pipeline -------------------------------------------------------------------

struct PpKey {
  std::vector<int> lowered_coords;
  int stage;
  int kind;
  double slowdown;
  bool operator<(const PpKey& o) const {
    return std::tie(lowered_coords, stage, kind, slowdown) <
           std::tie(o.lowered_coords, o.stage, o.kind, o.slowdown);
  }
};

// A stage pass: its operators' time and FLOPs, and its tensor-parallel
// collectives' time (folded: timed on the group of the rank the pass was
// built for).
struct PassTime {
  double compute = 0, comm = 0, flops = 0;
};

PassTime pass_time(const DeviceKind& dev, double slow, const StagePass& pass,
                   const comm::CommCostModel& cm, const std::vector<std::vector<int>>& groups,
                   DType precision) {
  PassTime t;
  const Pricing pricing = Pricing::of(dev, precision);
  for (double s : node_seconds(dev, pass.graph, precision, slow, &pass.stash)) t.compute += s;
  for (const Node& n : pass.graph.nodes()) {
    t.comm += folded_collective_s(cm, pass.graph, n, groups, pricing);
    t.flops += op_cost(pass.graph, n).flops;
  }
  return t;
}

void build_pipeline(const ModelSpec& model_spec, const TrainerOptions& o,
                    const ClusterModel& cluster, const comm::CommCostModel& cm, Programs& out,
                    GroupTable& groups, BuildCache* cache) {
  // ZeRO-1 / 2 on the data-parallel axis of a pipeline, as the pipeline
  // runtime runs them (train/pipeline_training.h); stage 3 is refused there
  // (check_pipeline_options), so here too.
  check_pipeline_options(o);
  const int zero = o.dist.dp.stage;
  const int world = cluster.world();
  const Plan& plan = *o.dist.plan;
  plan.mesh.check_world(world, "the plan's mesh");
  const int p = plan.pipeline_stages();
  const int dp_world = plan.mesh.axis_size("dp");
  const std::vector<std::string> axes =
      needs_lowering(plan) ? lowered_axes(plan.mesh) : std::vector<std::string>{};
  const int kinds = static_cast<int>(make_optimizer(o.optimizer, o.optim)->state_kinds().size());
  ModelSpec spec = model_spec;
  spec.compute = o.precision;

  // Every data-parallel rank gets an equal share (no batch_shares here).
  const BatchSplit split = split_batch(o, 0, dp_world);
  if (split.local_batch % plan.microbatches != 0) {
    throw ConfigError(fmt::format(
        "parallel.microbatches: {} examples per data-parallel rank cannot be split into {} "
        "micro-batches",
        split.local_batch, plan.microbatches));
  }
  const int64_t micro = split.local_batch / plan.microbatches;
  const PipelineSchedule schedule =
      make_schedule(plan.schedule, p, plan.microbatches, plan.virtual_stages);
  const ScheduleSimulation unit = simulate(schedule);
  // Asynchronous pipelining (parallel.async, 1F1B only): no flush; a step
  // is a window of the endless stream (make_async_window), priced in its
  // steady state: every stage runs its m forwards and m backwards, each
  // backward followed by the stage's update (on a dp axis after the
  // all-reduce of that micro-batch's gradients, which blocks the compute
  // thread, as PipelineTraining's async_update does). The stream's messages
  // of one window pair up with the neighbour's across windows, so a
  // receive here waits on its own lane and holds no pass back: each stage
  // runs at its own pace, and the step is the slowest stage's m x (F + B +
  // update). Bytes are the window's, as PipelineRuntime::predicted_bytes_sent.
  const bool async = plan.async != AsyncMode::none;
  const PipelineSchedule steps =
      async ? make_async_window(p, plan.microbatches, 1, false) : schedule;

  // The cache key: the plan but its schedule and micro-batch count (the
  // cut does not depend on them), the micro-batch size, the coordinates.
  std::string plan_key;
  if (cache != nullptr) {
    Plan keyed = plan;
    keyed.schedule = ScheduleKind::one_f_one_b;
    keyed.microbatches = 1;
    keyed.warmup_extra = 0;
    // Which stages recompute does not change the cut's passes (only what a
    // micro-batch keeps, read from the plan below).
    for (StagePlan& st : keyed.stages) st.recompute = false;
    keyed.devices.clear();  // mesh coordinates, whichever device runs them
    plan_key = fmt::format("{}|micro {}|{}|recompute {}", plan_to_json(keyed), micro,
                           dtype_name(o.precision), o.exec.recompute);
  }
  auto make_built = [&](int r) {
    auto b = std::make_shared<PipelineBuilt>();
    const ModelGraph m = build_rank_model(spec, micro, o, r, &b->lowered, /*whole_logits=*/false);
    // Cut as the trainer cuts (train/pipeline_training.cpp): a parameter's
    // narrowing cast (GPT's f16 / bf16 copy of the tied wte) runs in the
    // stage that reads the copy, which then shares the parameter, so the
    // copy is no boundary tensor and the gradient exchange is counted.
    CutOptions co;
    co.param_casts_join_consumers = plan.async == AsyncMode::none;
    b->cut = cut_pipeline(m.graph, m.loss, plan.stages, co);
    for (const PipelineStage& ps : b->cut.stages) {
      int64_t arena = 0;
      for (const StagePass* sp : {&ps.forward, &ps.backward}) {
        ExecOptions eo = o.exec;
        arena = std::max(arena, plan_memory(sp->graph, eo, GradMemory::kept).arena_bytes);
      }
      b->arena.push_back(arena);
    }
    return std::shared_ptr<const PipelineBuilt>(std::move(b));
  };
  std::map<std::vector<int>, std::shared_ptr<const PipelineBuilt>> cuts;
  std::map<PpKey, int> programs;
  out.notes.push_back(fmt::format(
      "pipeline: tensor-parallel collectives inside a stage pass are folded into the pass's "
      "time on the group of the rank the pass was built for{}",
      async ? ""
            : "; data-parallel gradients are all-reduced per parameter after the pipeline, not "
              "overlapped (as the runtime does)"));
  if (async) {
    out.notes.push_back(fmt::format(
        "pipeline: parallel.async = {}: one window of the stream without flush in its steady "
        "state (each stage at its own pace: no warm-up, no wait on its neighbours' messages); "
        "an update after every micro-batch{}",
        async_name(plan.async),
        dp_world > 1 ? ", after that micro-batch's gradients are all-reduced over dp" : ""));
  }

  for (int r = 0; r < world; ++r) {
    std::vector<int> coords;
    for (const std::string& a : axes) coords.push_back(plan.mesh.coord(r, a));
    auto& built = cuts[coords];
    if (!built && cache != nullptr) {
      const std::string key = fmt::format("{}|coords {}", plan_key, fmt::join(coords, ","));
      std::shared_future<std::shared_ptr<const PipelineBuilt>> entry;
      std::promise<std::shared_ptr<const PipelineBuilt>> promise;
      bool mine = false;
      {
        std::lock_guard<std::mutex> hold(cache->mutex);
        auto it = cache->pipelines.find(key);
        if (it != cache->pipelines.end()) {
          entry = it->second;
          ++cache->hits;
        } else {
          // Claimed before it is built, so that a thread pricing the twin
          // candidate at the same time waits for it instead of building it too.
          mine = true;
          ++cache->misses;
          entry = promise.get_future().share();
          cache->pipelines.emplace(key, entry);
          cache->order.push_back(key);
          while (cache->order.size() > std::max<size_t>(1, cache->capacity)) {
            cache->pipelines.erase(cache->order.front());
            cache->order.pop_front();
          }
        }
      }
      if (mine) {
        try {
          promise.set_value(make_built(r));
        } catch (...) {
          promise.set_exception(std::current_exception());  // the waiters throw it too
        }
      }
      built = entry.get();
    } else if (!built) {
      built = make_built(r);
    }
    const int stage = plan.mesh.coord(r, "pp");
    const PpKey key{coords, stage, cluster.kind_of.at(static_cast<size_t>(r)),
                    cluster.slowdown_of(r)};
    auto [it, fresh] = programs.emplace(key, static_cast<int>(out.programs.size()));
    RankBinding bind;
    bind.program = it->second;
    const std::vector<int> pp_group = plan.mesh.group(r, "pp");
    if (fresh) {
      const DeviceKind& dev = cluster.device(r);
      const double slow = cluster.slowdown_of(r);
      const PipelineCut& cut = built->cut;
      ProgramBuilder b;
      b.p.signature = fmt::format(
          "rank {}: pipeline stage {}{}, device {}, slowdown {}", r, stage,
          axes.empty()
              ? ""
              : fmt::format(", {} coords [{}]", fmt::join(axes, "/"), fmt::join(coords, ",")),
          dev.name, slow);
      for (int q = 0; q < p; ++q) b.p.peers.push_back(fmt::format("pp{}", q));
      // Per virtual stage: pass times and boundary bytes.
      struct StageTimes {
        PassTime f, b, bi, bw;
        uint64_t act_bytes = 0, grad_bytes = 0;
        bool recompute = false;  // the forward runs again before the backward
      };
      std::vector<StageTimes> st(cut.stages.size());
      for (size_t s = 0; s < cut.stages.size(); ++s) {
        if (static_cast<int>(s) % p != stage) continue;
        const PipelineStage& ps = cut.stages[s];
        const auto& lg = built->lowered.groups;
        StageTimes& t = st[s];
        // The stage's weights in or out of the rank's cache share (its
        // forward pass reads them all).
        const DeviceKind sdev = rank_device(cluster, r, ps.forward.graph);
        t.f = pass_time(sdev, slow, ps.forward, cm, lg, o.precision);
        t.b = pass_time(sdev, slow, ps.backward, cm, lg, o.precision);
        t.bi = pass_time(sdev, slow, ps.backward_input, cm, lg, o.precision);
        t.bw = pass_time(sdev, slow, ps.backward_weight, cm, lg, o.precision);
        t.recompute = plan.stages.at(s).recompute;
        // Sent as the runtime keeps them (Pricing::half: 16-bit). A
        // weight's 16-bit copy crosses only under parallel.async (the cut
        // above keeps it in the reading stage otherwise, as Megatron-LM's
        // last stage keeps a replica of the embedding), and is sent then.
        const Pricing pricing = Pricing::of(dev, o.precision);
        auto sent = [&](const StageBoundary& sb) -> uint64_t {
          return static_cast<uint64_t>(sb.shape.numel()) * element_bytes(pricing, sb.dtype);
        };
        for (const StageBoundary& sb : ps.outputs) t.act_bytes += sent(sb);
        for (const StageBoundary& sb : ps.inputs) {
          if (sb.has_grad) t.grad_bytes += sent(sb);
        }
      }
      // A pass: its operators, then its folded tensor collectives (a
      // compute-lane task of category "comm"); returns the last task.
      auto pass = [&](const std::string& where, const char* category, const PassTime& t) {
        int last = b.compute(where, category, t.compute, t.flops);
        if (t.comm > 0) last = b.compute(where + " tensor collectives", "comm", t.comm, 0);
        return last;
      };
      // The schedule's actions, in order. Sends go on the comm lane once
      // the pass that produced them is done (under DeviceKind::blocking_p2p
      // on the compute lane: the stage computes on once the send is
      // transferred); receives wait on the compute lane.
      const int send_lane = dev.blocking_p2p ? 0 : 1;
      std::map<std::pair<int, int>, int> done;  // (microbatch, virtual stage) -> last compute task
      auto tag = [](int kind, int mb, int s) {
        return (static_cast<int64_t>(kind) << 40) | (static_cast<int64_t>(mb) << 20) | s;
      };
      // The stage's parameters (first holder of each name).
      int64_t param_numel = 0, param_bytes = 0;
      std::vector<std::pair<std::string, int64_t>> stage_params;  // name, elements
      {
        std::set<std::string> held;
        for (size_t s = 0; s < cut.stages.size(); ++s) {
          if (static_cast<int>(s) % p != stage) continue;
          const Graph& fg = cut.stages[s].forward.graph;
          for (ValueId v : fg.params()) {
            const Value& val = fg.value(v);
            if (!held.insert(val.name).second) continue;
            param_numel += val.shape.numel();
            param_bytes += val.shape.numel() * 4;
            stage_params.emplace_back(val.name, val.shape.numel());
          }
        }
      }
      const bool sharded = zero >= 1 && dp_world > 1;
      const int64_t opt_numel = sharded ? zero1_shard_elements(param_numel, dp_world) : param_numel;
      const double opt_s =
          optimizer_seconds(dev, opt_numel, kinds, slow, Pricing::of(dev, o.precision));
      // The parameters held by several stages (GPT's tied wte): the holders
      // (physical stages) and this stage's f32 bytes of each.
      struct Shared {
        std::vector<int> holders;
        uint64_t bytes = 0;
        int64_t id = 0;
      };
      std::vector<Shared> shared;
      for (const auto& [name, vstages] : cut.shared_params) {
        Shared sh;
        sh.id = static_cast<int64_t>(shared.size()) + 1;
        std::set<int> hs;
        for (int vs : vstages) hs.insert(vs % p);
        sh.holders.assign(hs.begin(), hs.end());
        for (int vs : vstages) {
          if (vs % p != stage) continue;
          const Graph& fg = cut.stages[static_cast<size_t>(vs)].forward.graph;
          if (auto v = fg.find(name))
            sh.bytes = static_cast<uint64_t>(fg.value(*v).shape.numel()) * 4;
        }
        shared.push_back(std::move(sh));
      }
      // Async: the stream's k-th message of a kind between two stages pairs
      // with the neighbour's k-th (tags by position, not micro-batch id);
      // receives on their own lane (2), waited on by nothing.
      const int recv_lane = async ? 2 : 0;
      int fwd_count = 0, bwd_count = 0;
      std::map<int, int> sent_count, recv_count;  // tag kind -> messages so far
      auto async_tag = [&](std::map<int, int>& count, int kind) {
        return tag(kind, count[kind]++, 0);
      };
      int last_update = -1;
      for (const PipelineAction& a : steps.actions[static_cast<size_t>(stage)]) {
        const StageTimes& t = st[static_cast<size_t>(a.stage)];
        const std::string where = describe(a);
        switch (a.kind) {
          case ActionKind::forward:
            if (async) {
              // The owner of a shared parameter sends its value to each
              // mirror before the forward; the mirror receives it.
              for (const Shared& sh : shared) {
                const std::vector<int>& h = sh.holders;
                if (h.size() < 2 || std::find(h.begin(), h.end(), stage) == h.end()) continue;
                const int64_t tg = (int64_t{3} << 40) | (sh.id << 20) | fwd_count;
                if (stage == h.front()) {
                  for (size_t k = 1; k < h.size(); ++k) {
                    std::vector<int> after;
                    if (last_update >= 0) after.push_back(last_update);
                    b.p2p(Task::Kind::send, "send shared value " + where, h[k], tg, sh.bytes,
                          send_lane, after);
                  }
                } else {
                  b.p2p(Task::Kind::recv, "recv shared value " + where, h.front(), tg, sh.bytes,
                        recv_lane);
                }
              }
              ++fwd_count;
            }
            done[{a.microbatch, a.stage}] = pass(where, "forward", t.f);
            break;
          case ActionKind::backward:
            if (t.recompute) pass("recompute " + where, "forward", t.f);
            done[{a.microbatch, a.stage}] = pass(where, "backward", t.b);
            if (async) {
              // The mirror's part of a shared gradient goes to the owner,
              // which adds it before its update.
              for (const Shared& sh : shared) {
                const std::vector<int>& h = sh.holders;
                if (h.size() < 2 || std::find(h.begin(), h.end(), stage) == h.end()) continue;
                const int64_t tg = (int64_t{4} << 40) | (sh.id << 20) | bwd_count;
                if (stage == h.front()) {
                  for (size_t k = 1; k < h.size(); ++k) {
                    b.p2p(Task::Kind::recv, "recv shared gradient " + where, h[k], tg, sh.bytes,
                          recv_lane);
                  }
                } else {
                  b.p2p(Task::Kind::send, "send shared gradient " + where, h.front(), tg, sh.bytes,
                        send_lane, {done.at({a.microbatch, a.stage})});
                }
              }
              ++bwd_count;
              // The micro-batch's gradients averaged over the stage's
              // replicas (one packed all-reduce), then the update.
              if (dp_world > 1) {
                comm::CollectiveShape cs{
                    Collective::all_reduce, static_cast<size_t>(param_numel), {}, 4, 0};
                b.collective("all_reduce grads " + where, "dp", cs, 0);
              }
              last_update = b.compute("optimizer " + where, "optimizer", opt_s, 0);
            }
            break;
          case ActionKind::backward_input:
            if (t.recompute) pass("recompute " + where, "forward", t.f);
            done[{a.microbatch, a.stage}] = pass(where, "backward", t.bi);
            break;
          case ActionKind::backward_weight:
            pass(where, "backward", t.bw);
            break;
          case ActionKind::send_activation:
            b.p2p(Task::Kind::send, where, a.peer,
                  async ? async_tag(sent_count, 0) : tag(0, a.microbatch, a.stage), t.act_bytes,
                  send_lane, {done.at({a.microbatch, a.stage})});
            break;
          case ActionKind::send_grad:
            b.p2p(Task::Kind::send, where, a.peer,
                  async ? async_tag(sent_count, 1) : tag(1, a.microbatch, a.stage), t.grad_bytes,
                  send_lane, {done.at({a.microbatch, a.stage})});
            break;
          case ActionKind::recv_activation:
            // The matching send is tagged with the sending (previous) stage.
            b.p2p(Task::Kind::recv, where, a.peer,
                  async ? async_tag(recv_count, 0) : tag(0, a.microbatch, a.stage - 1), 0,
                  recv_lane);
            break;
          case ActionKind::recv_grad:
            b.p2p(Task::Kind::recv, where, a.peer,
                  async ? async_tag(recv_count, 1) : tag(1, a.microbatch, a.stage + 1), 0,
                  recv_lane);
            break;
        }
      }
      // A parameter held by several stages (GPT's tied wte): after every
      // send has completed, the first holder receives each other holder's
      // gradient, sums, and sends the sum back (PipelineRuntime's
      // exchange_shared), on the compute lane.
      std::vector<int> sends;
      for (size_t i = 0; i < b.p.tasks.size(); ++i) {
        if (b.p.tasks[i].kind == Task::Kind::send) sends.push_back(static_cast<int>(i));
      }
      size_t shared_ix = 0;
      for (const auto& [name, vstages] : cut.shared_params) {
        const Shared& sh = shared[shared_ix++];
        const std::vector<int>& h = sh.holders;
        if (async || h.size() < 2 || std::find(h.begin(), h.end(), stage) == h.end()) continue;
        const uint64_t bytes = sh.bytes;
        const int64_t tg = (int64_t{2} << 40) | sh.id;
        const std::string what = fmt::format("shared gradient {}", name);
        if (stage == h.front()) {
          for (size_t k = 1; k < h.size(); ++k) {
            b.p2p(Task::Kind::recv, "recv " + what, h[k], tg, bytes, 0, sends);
            sends.clear();
          }
          for (size_t k = 1; k < h.size(); ++k) {
            b.p2p(Task::Kind::send, "send " + what, h[k], tg, bytes, 0);
          }
        } else {
          b.p2p(Task::Kind::send, "send " + what, h.front(), tg, bytes, 0, sends);
          sends.clear();
          b.p2p(Task::Kind::recv, "recv " + what, h.front(), tg, bytes, 0);
        }
      }
      // Gradients over dp, one all-reduce per parameter (lane 0, after the
      // pipeline's last pass), then the optimizer (async: done per
      // micro-batch above).
      for (const auto& [name, numel] : stage_params) {
        if (async) break;
        if (dp_world > 1 && zero >= 2) {
          comm::CollectiveShape cs{Collective::reduce_scatterv, 0, even_counts(numel, dp_world), 4,
                                   0};
          b.collective(fmt::format("reduce_scatterv grad {}", name), "dp", cs, 0);
        } else if (dp_world > 1) {
          comm::CollectiveShape cs{Collective::all_reduce, static_cast<size_t>(numel), {}, 4, 0};
          b.collective(fmt::format("all_reduce grad {}", name), "dp", cs, 0);
        }
      }
      // ZeRO-1 / 2: each dp rank updates its 1/dp of every parameter (its
      // reduced shard of the gradient at 2), then the updated parameters are
      // all-gathered. ZeRO-3 gathers the same bytes at the start of the
      // next step instead (one step's time is the same). Refused with
      // parallel.async (check_pipeline_options).
      if (!async) b.compute("optimizer", "optimizer", opt_s, 0);
      if (sharded) {
        for (const auto& [name, numel] : stage_params) {
          comm::CollectiveShape cs{Collective::all_gatherv, 0, even_counts(numel, dp_world), 4, 0};
          b.collective(fmt::format("all_gatherv param {}", name), "dp", cs, 0);
        }
      }

      // Memory (pipeline_stage_memory): parameters, gradients, optimizer
      // state of the stage's parameters; what each micro-batch chunk in
      // flight keeps at the schedule's peak; the largest pass's arena.
      PipelineStageMemory pm;
      pm.param_bytes = param_bytes;
      pm.state_kinds = kinds;
      pm.zero_dp = sharded ? dp_world : 1;
      pm.zero_stage = sharded ? zero : 0;
      pm.in_flight = unit.peak_in_flight.at(static_cast<size_t>(stage));
      for (size_t s = 0; s < cut.stages.size(); ++s) {
        if (static_cast<int>(s) % p != stage) continue;
        const bool rc = plan.stages.at(s).recompute;
        pm.stash_bytes = std::max(pm.stash_bytes, cut.stages[s].stash_bytes);
        pm.kept_bytes = std::max(
            pm.kept_bytes, rc ? cut.stages[s].recompute_stash_bytes : cut.stages[s].stash_bytes);
        pm.recompute = pm.recompute || rc;
        pm.arena_bytes = std::max(pm.arena_bytes, built->arena[s]);
      }
      // Async: PipeDream's stage r stashes up to p - 1 - r older versions of
      // its weights; SpecTrain keeps one smoothed change u beside them.
      const int64_t weight_copies = plan.async == AsyncMode::pipedream   ? p - 1 - stage
                                    : plan.async == AsyncMode::spectrain ? 1
                                                                         : 0;
      b.p.peak_memory_bytes = pipeline_stage_memory(pm) + weight_copies * param_bytes;
      b.p.memory_detail = fmt::format(
          "parameters + gradients {} B{}, optimizer state {} B{}, activations kept {} B x {} in "
          "flight{}, largest pass arena {} B",
          param_bytes * 2,
          pm.zero_stage >= 2 ? fmt::format(" + gradient shard {} B", param_bytes / pm.zero_dp)
                             : std::string(),
          param_bytes * kinds / pm.zero_dp,
          pm.zero_dp > 1 ? fmt::format(" (1/{}: ZeRO-{})", pm.zero_dp, pm.zero_stage)
                         : std::string(),
          pm.kept_bytes, pm.in_flight,
          pm.recompute ? fmt::format(" + one recomputed stash {} B", pm.stash_bytes)
                       : std::string(),
          pm.arena_bytes);
      if (weight_copies > 0) {
        b.p.memory_detail += fmt::format(", {} weight copies {} B ({})", weight_copies,
                                         weight_copies * param_bytes, async_name(plan.async));
      }
      out.programs.push_back(std::move(b.p));
    }
    const Program& prog = out.programs[static_cast<size_t>(bind.program)];
    for (const std::string& slot : prog.groups)
      bind.group_ids.push_back(groups.id(plan.mesh.group(r, slot)));
    for (int q = 0; q < p; ++q) bind.peer_ranks.push_back(pp_group[static_cast<size_t>(q)]);
    out.ranks.push_back(std::move(bind));
  }
}

}  // namespace

Programs build_programs(const ModelSpec& spec, const TrainerOptions& run_options,
                        const ClusterModel& cluster, BuildCache* cache) {
  // One training step: what a run writes or loads around it does not matter.
  TrainerOptions options = run_options;
  options.checkpoint_path.clear();
  options.checkpoint_every = 0;
  options.resume_path.clear();
  options.init_path.clear();
  const int world = cluster.world();
  if (world < 1) throw ConfigError(fmt::format("cluster {}: no ranks", cluster.source));
  if (options.dist.plan) options.dist.plan->mesh.check_world(world, "the plan's mesh");
  // A plan the runtime runs but the programs below do not describe:
  // refused rather than priced as something else (or crashed on).
  if (options.dist.plan) {
    const Plan& plan = *options.dist.plan;
    // Stages on meshes of their own: the pipeline programs read each rank's
    // stage and peers off the plan's pp axis, which such a plan has not.
    for (size_t s = 0; s < plan.stages.size(); ++s) {
      if (!plan.stages[s].has_mesh) continue;
      throw ConfigError(fmt::format(
          "plan: stages[{}].mesh: the cost model prices pipelines on the plan's mesh (a pp "
          "axis) only, not stages on meshes of their own (docs/planner.md); plan or simulate "
          "without stage meshes",
          s));
    }
  }
  // The programs exchange f32 gradients by all-reduce (or ZeRO's
  // reduce-scatter / all-gather); another scheme or a codec moves other
  // bytes at other times, which the model does not price: refused rather
  // than priced as if it were not there.
  if (options.dist.sync.scheme != "allreduce") {
    throw ConfigError(
        fmt::format("sync.scheme = \"{}\": the cost model prices the all-reduce exchange only "
                    "(docs/planner.md); plan or simulate with sync.scheme = \"allreduce\"",
                    options.dist.sync.scheme));
  }
  if (parse_codec_spec(options.dist.sync.codec).kind != CodecKind::none) {
    throw ConfigError(fmt::format(
        "sync.codec = \"{}\": the cost model prices uncompressed f32 gradient exchanges only "
        "(docs/planner.md); plan or simulate without it",
        options.dist.sync.codec));
  }
  Programs out;
  GroupTable groups;
  const comm::CommCostModel cm = comm_model(cluster);
  if (options.dist.plan && pipeline_plan(options)) {
    build_pipeline(spec, options, cluster, cm, out, groups, cache);
  } else {
    build_data_parallel(spec, options, cluster, cm, out, groups);
  }
  out.groups = groups.list;
  out.samples_per_step = options.batch_size;
  out.half_precision = options.precision == DType::bf16 || options.precision == DType::f16;
  for (const RankBinding& b : out.ranks) {
    out.model_flops_per_step += out.programs[static_cast<size_t>(b.program)].flops;
  }
  return out;
}

ClusterModel arrange_cluster(const ClusterModel& cluster, const std::vector<int>& devices) {
  if (devices.empty()) return cluster;
  const int world = cluster.world();
  if (static_cast<int>(devices.size()) != world) {
    throw ConfigError(
        fmt::format("plan: devices: {} entries for the cluster's {} ranks", devices.size(), world));
  }
  ClusterModel out = cluster;
  std::vector<bool> seen(static_cast<size_t>(world), false);
  for (int m = 0; m < world; ++m) {
    const int d = devices[static_cast<size_t>(m)];
    if (d < 0 || d >= world || seen[static_cast<size_t>(d)]) {
      throw ConfigError(fmt::format(
          "plan: devices[{}]: world rank {} is {} (a permutation of the cluster's {} ranks)", m, d,
          d < 0 || d >= world ? "out of range" : "given twice", world));
    }
    seen[static_cast<size_t>(d)] = true;
    out.kind_of[static_cast<size_t>(m)] = cluster.kind_of[static_cast<size_t>(d)];
    if (!cluster.slowdown.empty())
      out.slowdown[static_cast<size_t>(m)] = cluster.slowdown[static_cast<size_t>(d)];
    out.layout.node_of[static_cast<size_t>(m)] = cluster.layout.node_of[static_cast<size_t>(d)];
  }
  return out;
}

StepEstimate estimate_step(const ModelSpec& spec, const TrainerOptions& options,
                           const ClusterModel& cluster) {
  if (options.dist.plan && !options.dist.plan->devices_in_order()) {
    const ClusterModel arranged = arrange_cluster(cluster, options.dist.plan->devices);
    return simulate(build_programs(spec, options, arranged), arranged);
  }
  return simulate(build_programs(spec, options, cluster), cluster);
}

}  // namespace mt::planner
