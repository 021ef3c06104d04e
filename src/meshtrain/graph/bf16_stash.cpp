// The bf16 stash pass (see bf16_stash.h).
#include "meshtrain/graph/bf16_stash.h"

#include <algorithm>
#include <map>

#include <fmt/format.h>

#include "meshtrain/base/error.h"

namespace mt {

namespace {

// The value whose memory v occupies: reshape outputs are views of their input.
ValueId storage_root(const Graph& g, ValueId v) {
  while (g.value(v).producer != kNoNode && g.node(g.value(v).producer).op == OpKind::reshape) {
    v = g.node(g.value(v).producer).inputs[0];
  }
  return v;
}

std::string mib(int64_t bytes) {
  return fmt::format("{:.2f} MiB", static_cast<double>(bytes) / (1 << 20));
}

}  // namespace

std::string Bf16StashReport::describe() const {
  if (kept_f32) {
    return fmt::format(
        "bf16 activation storage: nothing stashed: the bf16 copies would not lower the planned "
        "activation peak ({} in f32; the backward widens the last layers' values again at the "
        "boundary), so the graph stays f32",
        mib(arena_bytes_f32));
  }
  std::string plan;
  if (arena_bytes_f32 > 0) {
    plan = fmt::format("; planned activations {} -> {}", mib(arena_bytes_f32), mib(arena_bytes));
  }
  return fmt::format(
      "bf16 activation storage: {} stashed value(s), {} in f32 kept as {} in bf16 ({} too small, "
      "{} live to the end of the forward anyway){}",
      stashed.size(), mib(f32_bytes), mib(f32_bytes / 2), skipped_small, skipped_live, plan);
}

Bf16StashReport stash_in_bf16(Graph& g, const Bf16StashOptions& opts) {
  Bf16StashReport r;
  const int n = g.num_nodes();
  int first_bwd = n;
  for (NodeId i = 0; i < n; ++i) {
    if (g.node(i).backward) {
      first_bwd = i;
      break;
    }
  }
  if (first_bwd == n || first_bwd == 0) return r;
  // A graph whose forward goes on after its backward began is not one
  // build_backward makes: left as it is.
  for (NodeId i = first_bwd; i < n; ++i) {
    if (!g.node(i).backward) return r;
  }
  const NodeId last_fwd_node = first_bwd - 1;

  // Readers per value, in node order.
  std::vector<std::vector<NodeId>> readers(static_cast<size_t>(g.num_values()));
  for (NodeId i = 0; i < n; ++i) {
    for (ValueId v : g.node(i).inputs) {
      auto& rs = readers[static_cast<size_t>(v)];
      if (rs.empty() || rs.back() != i) rs.push_back(i);
    }
  }

  // Casts placed after / before an original node: after[i] runs right after
  // node i, before[i] right before it.
  std::map<NodeId, std::vector<NodeId>> after, before;
  const int original_values = g.num_values();
  for (ValueId v = 0; v < original_values; ++v) {
    const Value& val = g.value(v);
    if (val.role != ValueRole::activation || val.producer == kNoNode) continue;
    if (val.dtype != DType::f32) continue;
    const ValueRole root_role = g.value(storage_root(g, v)).role;
    if (root_role == ValueRole::input || root_role == ValueRole::param) continue;
    const auto& rs = readers[static_cast<size_t>(v)];
    const auto first_b =
        std::find_if(rs.begin(), rs.end(), [&](NodeId i) { return i >= first_bwd; });
    if (first_b == rs.end()) continue;  // the backward does not read it
    // (`val` refers into the graph's values, which add_node below may
    // reallocate: what is needed of it is read first.)
    const int64_t elements = val.shape.numel(), bytes = elements * 4;
    if (bytes < opts.min_bytes) {
      ++r.skipped_small;
      continue;
    }
    NodeId last_f = val.producer;
    for (auto it = rs.begin(); it != first_b; ++it) last_f = std::max(last_f, *it);
    if (last_f == last_fwd_node) {
      ++r.skipped_live;
      continue;
    }
    const std::string base = val.name;
    const std::string dtype_attr(dtype_name(DType::bf16));
    const ValueId low = g.add_node(OpKind::cast, g.unique_name("bf16_stash/" + base), {v},
                                   Attrs().set("dtype", dtype_attr), /*backward=*/false)[0];
    const ValueId back =
        g.add_node(OpKind::cast, g.unique_name("bf16_unstash/" + base), {low},
                   Attrs().set("dtype", std::string(dtype_name(DType::f32))), /*backward=*/true)[0];
    for (auto it = first_b; it != rs.end(); ++it) {
      const Node& reader = g.node(*it);
      for (int s = 0; s < static_cast<int>(reader.inputs.size()); ++s) {
        if (reader.inputs[static_cast<size_t>(s)] == v) g.replace_input(*it, s, back);
      }
    }
    after[last_f].push_back(g.value(low).producer);
    before[*first_b].push_back(g.value(back).producer);
    r.stashed.push_back(v);
    r.elements += elements;
    r.f32_bytes += bytes;
  }
  if (r.stashed.empty()) return r;

  std::vector<NodeId> order;
  order.reserve(static_cast<size_t>(g.num_nodes()));
  for (NodeId i = 0; i < n; ++i) {
    if (auto it = before.find(i); it != before.end()) {
      order.insert(order.end(), it->second.begin(), it->second.end());
    }
    order.push_back(i);
    if (auto it = after.find(i); it != after.end()) {
      order.insert(order.end(), it->second.begin(), it->second.end());
    }
  }
  g.reorder_nodes(order);
  return r;
}

}  // namespace mt
