#include "meshtrain/spmd/pipeline_stage.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>

#include "meshtrain/base/error.h"
#include "meshtrain/graph/autodiff.h"
#include "meshtrain/graph/collective.h"

namespace mt {

int64_t StageBoundary::bytes() const {
  return shape.numel() * static_cast<int64_t>(dtype_size(dtype));
}

namespace {

size_t ix(int32_t v) {
  return static_cast<size_t>(v);
}

std::string layer_of(const std::string& name) {
  return name.substr(0, name.find('.'));
}

// Appends a copy of src's node n to dst (inputs through `map`); its outputs
// keep their names in src.
void copy_node(const Graph& src, const Node& n, Graph& dst, std::vector<ValueId>& map) {
  std::vector<ValueId> ins;
  for (ValueId v : n.inputs) {
    MT_CHECK(map[ix(v)] != kNoValue, "cut_pipeline: node '{}' reads '{}' before it exists", n.name,
             src.value(v).name);
    ins.push_back(map[ix(v)]);
  }
  // The node's own name unless a value of dst already holds one of the
  // default output names (autodiff renames values after creating them).
  std::string name = n.name;
  if (dst.find(name)) name = dst.unique_name("copy/" + n.name);
  std::vector<ValueId> outs;
  try {
    outs = dst.add_node(n.op, name, ins, n.attrs, n.backward);
  } catch (const ConfigError&) {  // an extra output's default name is taken
    outs = dst.add_node(n.op, dst.unique_name("copy/" + n.name), ins, n.attrs, n.backward);
  }
  MT_CHECK(outs.size() == n.outputs.size(), "cut_pipeline: copy of '{}' has {} outputs, not {}",
           n.name, outs.size(), n.outputs.size());
  for (size_t k = 0; k < outs.size(); ++k) {
    dst.rename_value(outs[k], src.value(n.outputs[k]).name);
    map[ix(n.outputs[k])] = outs[k];
  }
}

// The nodes `nodes` of src (in order) as a graph of their own: values they
// read but do not produce become graph inputs (parameters stay parameters),
// and a parameter gradient they produce is recorded as such. `reads` gets
// the names of the non-parameter inputs.
Graph extract(const Graph& src, const std::vector<NodeId>& nodes, std::vector<std::string>& reads) {
  Graph dst;
  std::vector<ValueId> map(ix(src.num_values()), kNoValue);
  for (NodeId i : nodes) {
    const Node& n = src.node(i);
    for (ValueId v : n.inputs) {
      if (map[ix(v)] != kNoValue) continue;
      const Value& val = src.value(v);
      if (val.role == ValueRole::param) {
        map[ix(v)] = dst.add_param(val.name, val.shape, val.dtype, val.init);
      } else {
        map[ix(v)] = dst.add_input(val.name, val.shape, val.dtype);
        reads.push_back(val.name);
      }
    }
    copy_node(src, n, dst, map);
  }
  for (const auto& [p, gv] : src.grads()) {
    if (map[ix(gv)] == kNoValue) continue;  // produced by another pass
    if (map[ix(p)] == kNoValue) {
      const Value& val = src.value(p);
      map[ix(p)] = dst.add_param(val.name, val.shape, val.dtype, val.init);
    }
    dst.set_grad(map[ix(p)], map[ix(gv)]);
  }
  return dst;
}

bool produced_by(const Graph& g, const std::string& name, const std::vector<NodeId>& nodes) {
  const auto v = g.find(name);
  if (!v) return false;
  const NodeId p = g.value(*v).producer;
  return p != kNoNode && std::find(nodes.begin(), nodes.end(), p) != nodes.end();
}

void add_unique(std::vector<std::string>& out, const std::string& s) {
  if (std::find(out.begin(), out.end(), s) == out.end()) out.push_back(s);
}

}  // namespace

PipelineCut cut_pipeline(const Graph& forward, ValueId loss, const std::vector<StagePlan>& plan,
                         const CutOptions& options) {
  const int n = static_cast<int>(plan.size());
  if (n < 1) throw ConfigError("cut_pipeline: the plan has no stages");
  for (const Node& node : forward.nodes()) {
    if (node.backward) {
      throw InternalError(
          fmt::format("cut_pipeline: expected a forward graph, got backward node '{}'", node.name));
    }
  }
  MT_CHECK(loss >= 0 && loss < forward.num_values(), "cut_pipeline: loss id {} is not a value",
           loss);

  // Layer -> stage.
  std::map<std::string, int> layer_stage;
  for (int s = 0; s < n; ++s) {
    for (const std::string& l : plan[ix(s)].layers) {
      if (!layer_stage.emplace(l, s).second) {
        throw ConfigError(fmt::format("pipeline stages: layer '{}' is in stage {} and stage {}", l,
                                      layer_stage[l], s));
      }
    }
  }
  std::vector<int> value_stage(ix(forward.num_values()), -1);
  for (ValueId p : forward.params()) {
    const std::string& name = forward.value(p).name;
    auto it = layer_stage.find(layer_of(name));
    if (it == layer_stage.end()) {
      throw ConfigError(fmt::format(
          "pipeline stages: layer '{}' (of parameter '{}') is in no stage", layer_of(name), name));
    }
    value_stage[ix(p)] = it->second;
  }
  for (const auto& [l, s] : layer_stage) {
    bool found = false;
    for (ValueId p : forward.params()) found = found || layer_of(forward.value(p).name) == l;
    if (!found) {
      throw ConfigError(
          fmt::format("pipeline stages: stages[{}] lists layer '{}', which the model does not "
                      "have",
                      s, l));
    }
  }

  // Node -> stage: the latest of its parameters' and activation inputs' stages.
  const int num_nodes = forward.num_nodes();
  std::vector<int> node_stage(ix(num_nodes), -1);
  for (NodeId i = 0; i < num_nodes; ++i) {
    int s = -1;
    for (ValueId v : forward.node(i).inputs) s = std::max(s, value_stage[ix(v)]);
    node_stage[ix(i)] = s;
    for (ValueId o : forward.node(i).outputs) value_stage[ix(o)] = s;
  }
  // Nodes reading only graph inputs: the first stage reading their output.
  for (NodeId i = num_nodes - 1; i >= 0; --i) {
    if (node_stage[ix(i)] >= 0) continue;
    int s = n;
    for (NodeId j = i + 1; j < num_nodes; ++j) {
      for (ValueId v : forward.node(j).inputs) {
        for (ValueId o : forward.node(i).outputs) {
          if (v == o) s = std::min(s, node_stage[ix(j)] < 0 ? n : node_stage[ix(j)]);
        }
      }
    }
    node_stage[ix(i)] = s == n ? n - 1 : s;
    for (ValueId o : forward.node(i).outputs) value_stage[ix(o)] = node_stage[ix(i)];
  }
  // Narrowing casts of parameters: the first stage reading the copy
  // (CutOptions::param_casts_join_consumers).
  if (options.param_casts_join_consumers) {
    for (NodeId i = num_nodes - 1; i >= 0; --i) {
      const Node& nd = forward.node(i);
      if (nd.op != OpKind::cast || nd.inputs.size() != 1 || nd.outputs.size() != 1) continue;
      const Value& in = forward.value(nd.inputs.front());
      const Value& out = forward.value(nd.outputs.front());
      if (in.role != ValueRole::param || dtype_size(out.dtype) >= dtype_size(in.dtype)) continue;
      int first = n;
      for (NodeId j = i + 1; j < num_nodes; ++j) {
        for (ValueId v : forward.node(j).inputs) {
          if (v == nd.outputs.front()) first = std::min(first, node_stage[ix(j)]);
        }
      }
      if (first == n || first <= node_stage[ix(i)]) continue;
      node_stage[ix(i)] = first;
      value_stage[ix(nd.outputs.front())] = first;
    }
  }
  // Stages on different meshes: a collective the lowering inserted runs
  // with its first consumer (so a stage's inputs and outputs are the values
  // themselves, in the layouts its mesh gives them; the boundary moves them).
  if (options.collectives_join_consumers) {
    std::vector<std::vector<NodeId>> readers(ix(forward.num_values()));
    for (NodeId j = 0; j < num_nodes; ++j) {
      for (ValueId v : forward.node(j).inputs) readers[ix(v)].push_back(j);
    }
    for (NodeId i = num_nodes - 1; i >= 0; --i) {
      if (!is_group_op(forward.node(i).op)) continue;
      int first = n;
      for (ValueId o : forward.node(i).outputs) {
        for (NodeId j : readers[ix(o)]) first = std::min(first, node_stage[ix(j)]);
      }
      if (first == n || first <= node_stage[ix(i)]) continue;
      node_stage[ix(i)] = first;
      for (ValueId o : forward.node(i).outputs) value_stage[ix(o)] = first;
    }
  }
  const NodeId loss_node = forward.value(loss).producer;
  if (loss_node == kNoNode || node_stage[ix(loss_node)] != n - 1) {
    throw ConfigError(fmt::format(
        "pipeline stages: the loss '{}' is computed in stage {}, not in the last stage {} (its "
        "last layers must be in the last stage)",
        forward.value(loss).name, loss_node == kNoNode ? -1 : node_stage[ix(loss_node)], n - 1));
  }

  // Boundaries: an activation produced in stage s and read up to stage t
  // enters stages s+1..t.
  std::vector<int> last_reader(ix(forward.num_values()), -1);
  for (NodeId i = 0; i < num_nodes; ++i) {
    for (ValueId v : forward.node(i).inputs) {
      last_reader[ix(v)] = std::max(last_reader[ix(v)], node_stage[ix(i)]);
    }
  }
  PipelineCut cut;
  cut.stages.resize(ix(n));
  for (ValueId v = 0; v < forward.num_values(); ++v) {
    const Value& val = forward.value(v);
    if (val.role != ValueRole::activation) continue;
    for (int t = value_stage[ix(v)] + 1; t <= last_reader[ix(v)]; ++t) {
      StageBoundary b{val.name, val.shape, val.dtype, false};
      cut.stages[ix(t)].inputs.push_back(b);
      cut.stages[ix(t - 1)].outputs.push_back(b);
    }
  }
  // Shared parameters.
  std::map<ValueId, std::set<int>> param_users;
  for (NodeId i = 0; i < num_nodes; ++i) {
    for (ValueId v : forward.node(i).inputs) {
      if (forward.value(v).role == ValueRole::param) param_users[v].insert(node_stage[ix(i)]);
    }
  }
  for (ValueId p : forward.params()) {
    const auto& users = param_users[p];
    if (users.size() > 1) {
      cut.shared_params.emplace_back(forward.value(p).name,
                                     std::vector<int>(users.begin(), users.end()));
    }
  }

  // Each stage's forward graph, then (last stage first, since a stage seeds
  // only the outputs its successor sends gradients for) its backward passes.
  for (int t = n - 1; t >= 0; --t) {
    PipelineStage& st = cut.stages[ix(t)];
    st.index = t;
    st.layers = plan[ix(t)].layers;
    st.recompute = plan[ix(t)].recompute;
    Graph g;
    std::vector<ValueId> map(ix(forward.num_values()), kNoValue);
    std::vector<ValueId> wrt;
    for (const StageBoundary& b : st.inputs) {
      const ValueId id = g.add_input(b.name, b.shape, b.dtype);
      map[ix(*forward.find(b.name))] = id;
      wrt.push_back(id);
    }
    for (NodeId i = 0; i < num_nodes; ++i) {
      if (node_stage[ix(i)] != t) continue;
      const Node& node = forward.node(i);
      for (ValueId v : node.inputs) {
        if (map[ix(v)] != kNoValue) continue;
        const Value& val = forward.value(v);
        if (val.role == ValueRole::param) {
          map[ix(v)] = g.add_param(val.name, val.shape, val.dtype, val.init);
        } else {
          MT_CHECK(val.role == ValueRole::input,
                   "cut_pipeline: stage {} reads '{}' from stage {} without receiving it", t,
                   val.name, value_stage[ix(v)]);
          map[ix(v)] = g.add_input(val.name, val.shape, val.dtype);
        }
      }
      copy_node(forward, node, g, map);
    }
    for (ValueId p : g.params()) st.params.push_back(g.value(p).name);
    for (ValueId v : g.inputs()) {
      const std::string& name = g.value(v).name;
      const auto orig = forward.find(name);
      if (orig && forward.value(*orig).role == ValueRole::input) st.data_inputs.push_back(name);
    }
    if (t == n - 1) st.loss = forward.value(loss).name;

    // The backward: seeds are the outputs the next stage returns gradients
    // for (already decided: it was built first), or the loss.
    Graph full = g;
    std::vector<BackwardSeed> seeds;
    if (t == n - 1) {
      seeds.push_back({*full.find(st.loss), kNoValue});
    } else {
      const PipelineStage& next = cut.stages[ix(t + 1)];
      for (size_t k = 0; k < st.outputs.size(); ++k) {
        st.outputs[k].has_grad = next.inputs[k].has_grad;
        if (!st.outputs[k].has_grad) continue;
        const StageBoundary& b = st.outputs[k];
        const ValueId seed = full.add_input("dout/" + b.name, b.shape, b.dtype);
        seeds.push_back({*full.find(b.name), seed});
      }
    }
    const std::vector<ValueId> din = build_backward(full, seeds, wrt);
    for (size_t k = 0; k < st.inputs.size(); ++k) {
      st.inputs[k].has_grad = din[k] != kNoValue;
      if (din[k] != kNoValue) st.input_grads.push_back(full.value(din[k]).name);
    }

    std::vector<NodeId> all, fwd;
    for (NodeId i = 0; i < full.num_nodes(); ++i) {
      (full.node(i).backward ? all : fwd).push_back(i);
    }
    std::vector<ValueId> din_present;
    for (ValueId d : din) {
      if (d != kNoValue) din_present.push_back(d);
    }
    const BackwardSplit split = split_backward(full, din_present);
    std::vector<std::string> reads_b, reads_i, reads_w;
    st.backward.graph = extract(full, all, reads_b);
    st.backward_input.graph = extract(full, split.input_part, reads_i);
    st.backward_weight.graph = extract(full, split.weight_part, reads_w);
    st.backward.stash = st.input_grads;
    st.backward_input.stash = st.input_grads;
    for (const std::string& r : reads_w) {
      if (produced_by(full, r, split.input_part)) add_unique(st.backward_input.stash, r);
    }

    // The forward keeps what it sends, the loss, and what the backward reads.
    st.forward.graph = std::move(g);
    for (const StageBoundary& b : st.outputs) {
      if (produced_by(full, b.name, fwd)) add_unique(st.forward.stash, b.name);
    }
    if (!st.loss.empty()) add_unique(st.forward.stash, st.loss);
    std::vector<std::string> reads = reads_b;
    for (const auto* r : {&reads_i, &reads_w}) {
      for (const std::string& s : *r) add_unique(reads, s);
    }
    for (const std::string& r : reads) {
      if (produced_by(full, r, fwd)) add_unique(st.forward.stash, r);
    }
    for (const std::string& r : reads_b) {
      const bool received = std::any_of(st.inputs.begin(), st.inputs.end(),
                                        [&](const StageBoundary& b) { return b.name == r; });
      if (received || produced_by(full, r, fwd)) {
        const Value& val = full.value(*full.find(r));
        st.stash_bytes += val.shape.numel() * static_cast<int64_t>(dtype_size(val.dtype));
      }
    }
    for (const StageBoundary& b : st.inputs) st.recompute_stash_bytes += b.bytes();
  }
  return cut;
}

int64_t planned_stash_bytes(const PipelineCut& cut, const PipelineSchedule& sched, int rank) {
  const ScheduleSimulation sim = simulate(sched);
  int64_t kept = 0, whole = 0;
  bool any_recompute = false;
  for (const PipelineStage& st : cut.stages) {
    if (sched.owner(st.index) != rank) continue;
    whole = std::max(whole, st.stash_bytes);
    kept = std::max(kept, st.recompute ? st.recompute_stash_bytes : st.stash_bytes);
    any_recompute = any_recompute || st.recompute;
  }
  const int64_t held = sim.peak_in_flight[static_cast<size_t>(rank)];
  return held * kept + (any_recompute ? whole : 0);
}

std::string describe_stash(const PipelineCut& cut, const PipelineSchedule& sched) {
  std::string out;
  for (const PipelineStage& st : cut.stages) {
    out += fmt::format("  stage {}: stash per micro-batch {} bytes{}\n", st.index, st.stash_bytes,
                       st.recompute
                           ? fmt::format(", recomputed: keeps {} bytes", st.recompute_stash_bytes)
                           : std::string());
  }
  const ScheduleSimulation sim = simulate(sched);
  for (int r = 0; r < sched.stages; ++r) {
    out +=
        fmt::format("  rank {}: planned peak stash {} bytes ({} micro-batch chunks in flight)\n", r,
                    planned_stash_bytes(cut, sched, r), sim.peak_in_flight[static_cast<size_t>(r)]);
  }
  return out;
}

}  // namespace mt
