#include "meshtrain/exec/exec_plan.h"

#include <functional>

#include "meshtrain/base/error.h"
#include "meshtrain/exec/memory_planner.h"
#include "meshtrain/graph/collective.h"
#include "meshtrain/graph/cost.h"
#include "meshtrain/graph/op_registry.h"

namespace mt {

namespace {

size_t idx(int v) {
  return static_cast<size_t>(v);
}

int64_t value_bytes(const Value& v) {
  return v.shape.numel() * static_cast<int64_t>(dtype_size(v.dtype));
}

// Inserts, before each backward step, re-runs of the cheap forward nodes whose
// outputs it reads, so those outputs need not stay alive from forward to
// backward. A re-run's own cheap inputs are recomputed too (recursively), down
// to values that are kept anyway: outputs of expensive operators (matmul,
// convolution, ...), bound values, and kept outputs. Each value is recomputed
// at most once, right before its first backward reader.
std::vector<PlanStep> insert_recomputation(const Graph& g, const PlanRequest& req,
                                           const std::vector<bool>& kept,
                                           std::vector<PlanStep> base,
                                           std::vector<PlanSlot>& slots) {
  std::vector<int> rec(idx(g.num_values()), -1);
  auto eligible = [&](ValueId v) {
    const NodeId p = g.value(v).producer;
    if (p == kNoNode || g.node(p).backward) return false;
    return op_def(g.node(p).op).recomputable && !kept[idx(v)] && !req.bound[idx(v)];
  };
  std::function<int(ValueId, std::vector<PlanStep>&)> ensure = [&](ValueId v,
                                                                   std::vector<PlanStep>& pre) {
    if (rec[idx(v)] >= 0) return rec[idx(v)];
    const Node& n = g.node(g.value(v).producer);
    PlanStep st;
    st.node = g.value(v).producer;
    st.recompute = true;
    for (ValueId u : n.inputs) st.in.push_back(eligible(u) ? ensure(u, pre) : u);
    for (ValueId o : n.outputs) {
      PlanSlot s;
      s.value = o;
      s.recomputed = true;
      rec[idx(o)] = static_cast<int>(slots.size());
      st.out.push_back(rec[idx(o)]);
      slots.push_back(s);
    }
    pre.push_back(std::move(st));
    return rec[idx(v)];
  };

  std::vector<PlanStep> steps;
  for (PlanStep& st : base) {
    if (g.node(st.node).backward) {
      std::vector<PlanStep> pre;
      for (int& in : st.in) {
        if (eligible(in)) in = ensure(in, pre);
      }
      for (PlanStep& p : pre) steps.push_back(std::move(p));
    }
    steps.push_back(std::move(st));
  }
  return steps;
}

// Moves each collective up to just after the step that writes the last of
// its inputs (so communication starts as soon as it can), but never above
// an earlier collective: every rank must issue a group's collectives in the
// same order, and the graph's order is the one all ranks share.
std::vector<PlanStep> hoist_collectives(const Graph& g, std::vector<PlanStep> steps) {
  std::vector<PlanStep> out;
  size_t floor = 0;  // just past the last collective placed
  for (PlanStep& st : steps) {
    if (st.recompute || !communicates(g.node(st.node).op)) {
      out.push_back(std::move(st));
      continue;
    }
    size_t pos = floor;
    for (size_t k = out.size(); k-- > floor;) {
      bool writes = false;
      for (int o : out[k].out) {
        for (int in : st.in) writes = writes || o == in;
      }
      if (writes) {
        pos = k + 1;
        break;
      }
    }
    out.insert(out.begin() + static_cast<std::ptrdiff_t>(pos), std::move(st));
    floor = pos + 1;
  }
  return out;
}

// Splits each collective into a start step at its place and a wait step
// right before the first later step that reads an output (or a view of one),
// or at the end when nothing reads it. Runs after views are marked, so a
// reader of a view (whose in[] names the view's slot) is found by its root.
std::vector<PlanStep> split_collectives(const Graph& g, const ExecPlan& p,
                                        std::vector<PlanStep> steps) {
  std::vector<PlanStep> out;
  struct Pending {
    int start;  // index in `out`
    std::vector<int> outputs;
  };
  std::vector<Pending> pending;
  auto emit_wait = [&](const Pending& pd) {
    PlanStep w = out[idx(pd.start)];
    w.start = false;
    w.wait = true;
    w.started = pd.start;
    w.in.insert(w.in.end(), w.out.begin(), w.out.end());
    w.out.clear();
    out.push_back(std::move(w));
  };
  for (PlanStep& st : steps) {
    // Wait for every in-flight collective this step reads, in start order.
    for (size_t k = 0; k < pending.size();) {
      bool reads = false;
      for (int in : st.in) {
        for (int o : pending[k].outputs) reads = reads || p.root(in) == o;
      }
      if (reads) {
        emit_wait(pending[k]);
        pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(k));
      } else {
        ++k;
      }
    }
    const bool coll = !st.recompute && communicates(g.node(st.node).op);
    if (coll) st.start = true;
    out.push_back(std::move(st));
    if (coll) pending.push_back({static_cast<int>(out.size()) - 1, out.back().out});
  }
  for (const Pending& pd : pending) emit_wait(pd);
  return out;
}

}  // namespace

ExecPlan make_exec_plan(const Graph& g, const PlanRequest& req) {
  MT_CHECK_EQ(req.bound.size(), idx(g.num_values()));
  ExecPlan p;
  const int nv = g.num_values();
  p.slots.resize(idx(nv));
  std::vector<bool> kept(idx(nv), false);
  for (ValueId v : req.kept) kept[idx(v)] = true;
  for (ValueId v = 0; v < nv; ++v) {
    p.slots[idx(v)].value = v;
    p.slots[idx(v)].bound = req.bound[idx(v)];
  }

  std::vector<PlanStep> base;
  for (NodeId i = 0; i < g.num_nodes(); ++i) {
    PlanStep st;
    st.node = i;
    st.in.assign(g.node(i).inputs.begin(), g.node(i).inputs.end());
    st.out.assign(g.node(i).outputs.begin(), g.node(i).outputs.end());
    base.push_back(std::move(st));
  }
  p.steps = req.recompute ? insert_recomputation(g, req, kept, std::move(base), p.slots)
                          : std::move(base);

  // A reshape writing into caller memory must copy; otherwise it is a view.
  for (PlanStep& st : p.steps) {
    if (op_def(g.node(st.node).op).view && !p.slots[idx(st.out[0])].bound) {
      st.view = true;
      p.slots[idx(st.out[0])].view_of = p.root(st.in[0]);
    }
  }
  p.steps = split_collectives(g, p, hoist_collectives(g, std::move(p.steps)));

  // Lifetimes: reads of a view keep its root alive.
  const int nsteps = static_cast<int>(p.steps.size());
  for (int pos = 0; pos < nsteps; ++pos) {
    const PlanStep& st = p.steps[idx(pos)];
    for (int s : st.out) {
      PlanSlot& slot = p.slots[idx(s)];
      MT_CHECK_EQ(slot.first, -1);
      slot.first = pos;
      slot.last = std::max(slot.last, pos);
    }
    for (int s : st.in) {
      PlanSlot& r = p.slots[idx(p.root(s))];
      r.last = std::max(r.last, pos);
    }
  }
  for (ValueId v = 0; v < nv; ++v) {
    if (!kept[idx(v)]) continue;
    PlanSlot& r = p.slots[idx(p.root(v))];
    r.kept = true;
    r.last = nsteps;  // past the final step
  }

  // Arena placement of every root slot that a step writes.
  std::vector<BufferLife> lives;
  std::vector<int> owner;
  for (size_t s = 0; s < p.slots.size(); ++s) {
    const PlanSlot& slot = p.slots[s];
    if (slot.bound || slot.view_of >= 0 || slot.first < 0) continue;
    lives.push_back({value_bytes(g.value(slot.value)), slot.first, slot.last});
    owner.push_back(static_cast<int>(s));
    if (!slot.recomputed) p.memory.unplanned_bytes += align_up(lives.back().bytes);
  }
  ArenaLayout layout = plan_arena(lives);
  for (size_t k = 0; k < owner.size(); ++k) p.slots[idx(owner[k])].offset = layout.offset[k];
  p.memory.arena_bytes = layout.peak;

  p.memory.offset.assign(idx(nv), -1);
  for (ValueId v = 0; v < nv; ++v) p.memory.offset[idx(v)] = p.slots[idx(p.root(v))].offset;
  for (ValueId v : g.params()) p.memory.param_bytes += value_bytes(g.value(v));
  for (const auto& [param, grad] : g.grads()) p.memory.grad_bytes += value_bytes(g.value(grad));
  for (const PlanStep& st : p.steps) {
    if (!st.recompute) continue;
    ++p.memory.recompute_steps;
    p.memory.recompute_flops += op_cost(g, g.node(st.node)).flops;
  }
  return p;
}

}  // namespace mt
