#include "meshtrain/exec/executor.h"

#include <cstring>

#include <fmt/format.h>

#include "meshtrain/base/error.h"
#include "meshtrain/base/timer.h"
#include "meshtrain/exec/exec_plan.h"
#include "meshtrain/exec/kernel_table.h"
#include "meshtrain/graph/cost.h"
#include "meshtrain/tensor/kernels.h"

namespace mt {

namespace {
size_t idx(int v) {
  return static_cast<size_t>(v);
}

std::string type_of(const Value& v) {
  return fmt::format("{}{}", dtype_name(v.dtype), v.shape.str());
}

const char* role_name(ValueRole r) {
  switch (r) {
    case ValueRole::input:
      return "input";
    case ValueRole::param:
      return "parameter";
    case ValueRole::activation:
      return "activation";
    case ValueRole::grad:
      return "gradient";
  }
  return "value";
}
}  // namespace

struct Executor::Impl {
  Graph g;
  ExecOptions opts;
  KernelBackend* backend = nullptr;

  std::vector<bool> is_bound;    // per ValueId: the caller bound memory
  std::vector<Tensor> bound;     // per ValueId
  std::vector<bool> grad_value;  // per ValueId: some parameter's gradient
  std::vector<KernelFn> kernel;  // per NodeId

  ExecPlan plan;
  bool plan_dirty = true;
  Tensor arena;
  int64_t arena_bytes = 0;
  bool tensors_dirty = true;
  std::vector<Tensor> slot_tensor;
  std::vector<std::vector<Tensor>> step_in, step_out;
  std::vector<std::vector<ValueId>> ready_params;  // per step: params whose grad it finishes
  std::vector<bool> kept_value;                    // per ValueId, for get()
  bool ran = false;
  bool backward_ran = false;  // false after run_forward(): it may reuse backward memory

  std::function<void(ValueId)> grad_cb;
  std::vector<OpProfile> prof;

  // Bound values are outside the arena; which gradients are bound changes
  // the plan, so the plan is rebuilt lazily after such a bind.
  void ensure_plan() {
    if (!plan_dirty) return;
    PlanRequest req;
    req.recompute = opts.recompute;
    req.bound.assign(idx(g.num_values()), false);
    for (ValueId v : g.inputs()) req.bound[idx(v)] = true;
    for (ValueId v : g.params()) req.bound[idx(v)] = true;
    for (ValueId v = 0; v < g.num_values(); ++v) {
      if (grad_value[idx(v)] && is_bound[idx(v)]) req.bound[idx(v)] = true;
    }
    if (g.loss() != kNoValue) req.kept.push_back(g.loss());
    // A forward result nothing reads (e.g. the loss of a forward-only graph)
    // is what the caller ran the graph for.
    std::vector<bool> read(idx(g.num_values()), false);
    for (const Node& n : g.nodes()) {
      for (ValueId v : n.inputs) read[idx(v)] = true;
    }
    for (const Node& n : g.nodes()) {
      if (!n.backward && !read[idx(n.outputs[0])]) req.kept.push_back(n.outputs[0]);
    }
    for (ValueId v : opts.outputs) req.kept.push_back(v);
    for (const auto& [param, grad] : g.grads()) {
      if (!req.bound[idx(grad)]) req.kept.push_back(grad);
    }
    kept_value.assign(idx(g.num_values()), false);
    for (ValueId v : req.kept) kept_value[idx(v)] = true;

    const size_t old_steps = plan.steps.size();
    plan = make_exec_plan(g, req);
    plan_dirty = false;
    tensors_dirty = true;
    ran = false;  // the new layout holds nothing computed yet
    backward_ran = false;

    ready_params.assign(plan.steps.size(), {});
    for (size_t s = 0; s < plan.steps.size(); ++s) {
      const PlanStep& st = plan.steps[s];
      if (st.recompute) continue;
      for (ValueId out : g.node(st.node).outputs) {
        for (const auto& [param, grad] : g.grads()) {
          if (grad == out) ready_params[s].push_back(param);
        }
      }
    }
    if (old_steps != plan.steps.size()) {
      prof.clear();
      for (const PlanStep& st : plan.steps) {
        const Node& n = g.node(st.node);
        OpProfile p;
        p.name = st.recompute ? "recompute/" + n.name : n.name;
        p.op = n.op;
        p.flops = op_cost(g, n).flops;
        prof.push_back(p);
      }
    }
  }

  // Builds the Tensor handle of every slot and every step's argument lists,
  // so run() itself only calls kernels.
  void ensure_tensors() {
    ensure_plan();
    if (arena_bytes != plan.memory.arena_bytes || !arena.defined()) {
      arena = Tensor::empty(Shape{plan.memory.arena_bytes}, DType::u8);
      arena_bytes = plan.memory.arena_bytes;
      tensors_dirty = true;
    }
    if (!tensors_dirty) return;
    auto* base = static_cast<char*>(arena.raw());
    slot_tensor.assign(plan.slots.size(), Tensor());
    // Roots first (bound or arena), then views of them.
    for (size_t s = 0; s < plan.slots.size(); ++s) {
      const PlanSlot& slot = plan.slots[s];
      const Value& v = g.value(slot.value);
      if (slot.bound) {
        if (is_bound[idx(slot.value)]) slot_tensor[s] = bound[idx(slot.value)];
      } else if (slot.view_of < 0 && slot.offset >= 0) {
        slot_tensor[s] = Tensor::wrap(base + slot.offset, v.shape, v.dtype);
      }
    }
    for (size_t s = 0; s < plan.slots.size(); ++s) {
      const PlanSlot& slot = plan.slots[s];
      if (slot.view_of < 0) continue;
      const Tensor& root = slot_tensor[idx(plan.root(static_cast<int>(s)))];
      if (root.raw() != nullptr || root.numel() == 0) {
        slot_tensor[s] = root.reshape(g.value(slot.value).shape);
      }
    }
    step_in.assign(plan.steps.size(), {});
    step_out.assign(plan.steps.size(), {});
    for (size_t s = 0; s < plan.steps.size(); ++s) {
      for (int in : plan.steps[s].in) step_in[s].push_back(slot_tensor[idx(in)]);
      for (int out : plan.steps[s].out) step_out[s].push_back(slot_tensor[idx(out)]);
    }
    tensors_dirty = false;
  }

  void check_bound(bool forward_only) const {
    std::vector<bool> needed(idx(g.num_values()), false);
    for (const PlanStep& st : plan.steps) {
      if (forward_only && (st.recompute || g.node(st.node).backward)) continue;
      for (int in : st.in) {
        const ValueId v = plan.slots[idx(in)].value;
        const ValueRole r = g.value(v).role;
        if (r == ValueRole::input || r == ValueRole::param) needed[idx(v)] = true;
      }
    }
    std::string missing;
    for (ValueId v = 0; v < g.num_values(); ++v) {
      if (!needed[idx(v)] || is_bound[idx(v)]) continue;
      const Value& val = g.value(v);
      missing += fmt::format("{}{} '{}' ({})", missing.empty() ? "" : ", ", role_name(val.role),
                             val.name, type_of(val));
    }
    if (!missing.empty()) {
      throw ConfigError(
          fmt::format("executor: unbound {}; bind() every input and parameter "
                      "before running",
                      missing));
    }
  }

  void execute(bool forward_only) {
    ensure_plan();
    check_bound(forward_only);
    ensure_tensors();
    // Set first so that on_grad_ready callbacks may get() finished gradients.
    ran = true;
    backward_ran = !forward_only;
    for (size_t s = 0; s < plan.steps.size(); ++s) {
      const PlanStep& st = plan.steps[s];
      const Node& n = g.node(st.node);
      if (forward_only && (st.recompute || n.backward)) continue;
      const int64_t t0 = opts.profile ? now_ns() : 0;
      if (!st.view) {
        try {
          kernel[idx(st.node)](*backend, n, step_in[s], step_out[s]);
        } catch (const ShapeError& e) {
          throw ShapeError(fmt::format("node '{}' ({}): {}", n.name, op_name(n.op), e.what()));
        } catch (const InternalError& e) {
          throw InternalError(fmt::format("node '{}' ({}): {}", n.name, op_name(n.op), e.what()));
        }
      }
      if (opts.profile) {
        prof[s].total_ns += now_ns() - t0;
        ++prof[s].calls;
      }
      if (!forward_only && grad_cb) {
        for (ValueId p : ready_params[s]) grad_cb(p);
      }
    }
  }
};

Executor::Executor(const Graph& g, ExecOptions opts) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.g = g;
  m.opts = std::move(opts);
  m.backend = &kernels(m.opts.backend);
  if (m.opts.num_threads > 0) m.backend->set_num_threads(m.opts.num_threads);
  const auto nv = idx(g.num_values());
  m.is_bound.assign(nv, false);
  m.bound.assign(nv, Tensor());
  m.grad_value.assign(nv, false);
  for (const auto& [param, grad] : g.grads()) m.grad_value[idx(grad)] = true;
  for (ValueId v : m.opts.outputs) {
    if (v < 0 || v >= g.num_values()) {
      throw ConfigError(fmt::format("executor: output id {} is not a value of the graph", v));
    }
  }
  for (const Node& n : g.nodes()) m.kernel.push_back(kernel_for(n.op));
  m.ensure_plan();
}

Executor::~Executor() = default;

void Executor::bind(ValueId v, Tensor t) {
  Impl& m = *impl_;
  if (v < 0 || v >= m.g.num_values()) {
    throw ConfigError(fmt::format("executor: bind: id {} is not a value of the graph", v));
  }
  const Value& val = m.g.value(v);
  const bool grad = m.grad_value[idx(v)];
  if (val.role != ValueRole::input && val.role != ValueRole::param && !grad) {
    throw ConfigError(
        fmt::format("executor: bind: '{}' is an {}; only inputs, parameters and "
                    "parameter gradients can be bound",
                    val.name, role_name(val.role)));
  }
  if (t.shape() != val.shape || t.dtype() != val.dtype) {
    throw ShapeError(
        fmt::format("executor: bind '{}': expected {}, got {}", val.name, type_of(val), t.desc()));
  }
  if (t.raw() == nullptr && t.numel() != 0) {
    throw ConfigError(fmt::format("executor: bind '{}': the tensor has no memory", val.name));
  }
  if (grad && !m.is_bound[idx(v)]) m.plan_dirty = true;
  m.is_bound[idx(v)] = true;
  m.bound[idx(v)] = std::move(t);
  m.tensors_dirty = true;
}

void Executor::on_grad_ready(std::function<void(ValueId param)> cb) {
  impl_->grad_cb = std::move(cb);
}

void Executor::run() {
  impl_->execute(false);
}
void Executor::run_forward() {
  impl_->execute(true);
}

Tensor Executor::get(ValueId v) const {
  Impl& m = *impl_;
  if (v < 0 || v >= m.g.num_values()) {
    throw ConfigError(fmt::format("executor: get: id {} is not a value of the graph", v));
  }
  const Value& val = m.g.value(v);
  if (m.is_bound[idx(v)]) return m.bound[idx(v)];
  if (val.role == ValueRole::input || val.role == ValueRole::param) {
    throw ConfigError(
        fmt::format("executor: get: {} '{}' is not bound", role_name(val.role), val.name));
  }
  m.ensure_plan();
  if (!m.kept_value[idx(v)]) {
    throw ConfigError(fmt::format(
        "executor: get: '{}' is not kept alive after run() (its memory is reused); add it to "
        "ExecOptions::outputs",
        val.name));
  }
  if (!m.ran) {
    throw ConfigError(fmt::format(
        "executor: get: '{}' has not been computed under the current memory plan; call run() first",
        val.name));
  }
  if (val.producer != kNoNode && m.g.node(val.producer).backward && !m.backward_ran) {
    throw ConfigError(fmt::format(
        "executor: get: '{}' is stale: run_forward() ran after the last run() and reused its "
        "memory",
        val.name));
  }
  return m.slot_tensor[idx(v)];
}

const MemoryPlan& Executor::memory_plan() const {
  impl_->ensure_plan();
  return impl_->plan.memory;
}

int64_t Executor::allocated_arena_bytes() const {
  return impl_->arena.defined() ? impl_->arena_bytes : 0;
}

const std::vector<OpProfile>& Executor::profile() const {
  impl_->ensure_plan();
  return impl_->prof;
}

void Executor::reset_profile() {
  for (OpProfile& p : impl_->prof) {
    p.total_ns = 0;
    p.calls = 0;
  }
}

}  // namespace mt
