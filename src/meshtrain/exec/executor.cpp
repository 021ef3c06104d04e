#include "meshtrain/exec/executor.h"

#include <algorithm>
#include <chrono>
#include <ctime>
#include <thread>

#include <cstring>

#include <fmt/format.h>

#include "meshtrain/base/error.h"
#include "meshtrain/base/timer.h"
#include "meshtrain/exec/exec_plan.h"
#include "meshtrain/exec/kernel_table.h"
#include "meshtrain/graph/collective.h"
#include "meshtrain/graph/cost.h"
#include "meshtrain/tensor/kernels.h"
#include "meshtrain/tensor/memory_stats.h"

namespace mt {

namespace {
size_t idx(int v) {
  return static_cast<size_t>(v);
}

std::string type_of(const Value& v) {
  return fmt::format("{}{}", dtype_name(v.dtype), v.shape.str());
}

// What the plan must hold for a graph run with `opts`: inputs, parameters
// and bound gradients live in caller memory; the loss, requested outputs,
// forward results nobody reads and (unless transient) unbound gradients stay
// alive to the end. Shared by Executor and plan_memory() so both agree.
PlanRequest plan_request(const Graph& g, const ExecOptions& opts,
                         const std::vector<bool>& grad_bound, bool transient_grads) {
  PlanRequest req;
  req.recompute = opts.recompute;
  req.bound.assign(idx(g.num_values()), false);
  for (ValueId v : g.inputs()) req.bound[idx(v)] = true;
  for (ValueId v : g.params()) req.bound[idx(v)] = true;
  for (ValueId v = 0; v < g.num_values(); ++v) {
    if (grad_bound[idx(v)]) req.bound[idx(v)] = true;
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
    if (!req.bound[idx(grad)] && !transient_grads) req.kept.push_back(grad);
  }
  return req;
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
  int64_t slowdown_debt_ns = 0;  // ExecOptions::slowdown: sleep owed, not yet slept
  int64_t compute_ns = 0;        // kernels' wall time, sleeps included (compute_ns())
  double compute_cpu_ns = 0;     // kernels' thread CPU time x slowdown (compute_cpu_ns())

  // Stretches a kernel of `ns` by the slowdown factor: the extra time is
  // owed and slept once it reaches 0.2 ms (the sleep's own overshoot is
  // measured and counted as paid).
  void stretch(int64_t ns) {
    slowdown_debt_ns += static_cast<int64_t>(static_cast<double>(ns) * (opts.slowdown - 1.0));
    if (slowdown_debt_ns < 200'000) return;
    const int64_t t0 = now_ns();
    std::this_thread::sleep_for(std::chrono::nanoseconds(slowdown_debt_ns));
    slowdown_debt_ns -= now_ns() - t0;
  }

  std::vector<bool> is_bound;    // per ValueId: the caller bound memory
  std::vector<Tensor> bound;     // per ValueId
  std::vector<bool> grad_value;  // per ValueId: some parameter's gradient
  std::vector<bool> accumulate;  // per NodeId: a matmul adding into its bound output (beta = 1)
  std::vector<bool> read;        // per ValueId: some node reads it
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

  // Parameter residency (set_param_hooks) and transient gradients.
  ParamHooks hooks;
  bool transient_grads = false;
  bool running = false;
  ValueId announcing = kNoValue;  // the gradient whose on_grad_ready callback runs now
  NodeCallback node_cb;           // timeline observer, may be empty
  std::vector<std::vector<ValueId>> acquire_at, release_at;  // per step
  // Per slot of an input or parameter: the view slots rooted at it, and the
  // (step, input position) of every step argument that reads it or a view,
  // so that re-binding it patches those handles instead of rebuilding all.
  std::vector<std::vector<int>> views_of;
  std::vector<std::vector<std::pair<int, int>>> reads_of;

  bool step_backward(const PlanStep& st) const { return st.recompute || g.node(st.node).backward; }

  // First and last step of each phase that reads each parameter (through
  // views too); parameters are acquired and released there.
  void plan_param_uses() {
    const size_t ns = plan.steps.size();
    acquire_at.assign(ns, {});
    release_at.assign(ns, {});
    const size_t nv = idx(g.num_values());
    std::vector<int> first(2 * nv, -1), last(2 * nv, -1);
    for (size_t s = 0; s < ns; ++s) {
      const PlanStep& st = plan.steps[s];
      const size_t phase = step_backward(st) ? 1 : 0;
      for (int in : st.in) {
        const ValueId v = plan.slots[idx(plan.root(in))].value;
        if (g.value(v).role != ValueRole::param) continue;
        const size_t k = 2 * idx(v) + phase;
        if (first[k] < 0) first[k] = static_cast<int>(s);
        last[k] = static_cast<int>(s);
      }
    }
    for (size_t phase = 0; phase < 2; ++phase) {
      for (ValueId p : g.params()) {
        const size_t k = 2 * idx(p) + phase;
        if (first[k] < 0) continue;
        acquire_at[idx(first[k])].push_back(p);
        release_at[idx(last[k])].push_back(p);
      }
    }
  }

  // Re-points every handle of a re-bound input or parameter (and of its views).
  void refresh_bound(ValueId v) {
    const Tensor& t = bound[idx(v)];
    slot_tensor[idx(v)] = t;
    for (int w : views_of[idx(v)]) {
      slot_tensor[idx(w)] = t.reshape(g.value(plan.slots[idx(w)].value).shape);
    }
    for (const auto& [s, pos] : reads_of[idx(v)]) {
      step_in[idx(s)][idx(pos)] = slot_tensor[idx(plan.steps[idx(s)].in[idx(pos)])];
    }
  }

  // Bound values are outside the arena; which gradients are bound changes
  // the plan, so the plan is rebuilt lazily after such a bind.
  void ensure_plan() {
    if (!plan_dirty) return;
    std::vector<bool> grad_bound(idx(g.num_values()), false);
    for (ValueId v = 0; v < g.num_values(); ++v) {
      grad_bound[idx(v)] = grad_value[idx(v)] && is_bound[idx(v)];
    }
    const PlanRequest req = plan_request(g, opts, grad_bound, transient_grads);
    kept_value.assign(idx(g.num_values()), false);
    for (ValueId v : req.kept) kept_value[idx(v)] = true;

    const size_t old_steps = plan.steps.size();
    plan = make_exec_plan(g, req);
    plan_dirty = false;
    tensors_dirty = true;
    ran = false;  // the new layout holds nothing computed yet
    backward_ran = false;

    plan_param_uses();
    ready_params.assign(plan.steps.size(), {});
    for (size_t s = 0; s < plan.steps.size(); ++s) {
      const PlanStep& st = plan.steps[s];
      if (st.recompute || st.start) continue;  // a collective's result is ready at its wait
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
        p.name = st.recompute ? "recompute/" + n.name : st.wait ? n.name + "/wait" : n.name;
        p.op = n.op;
        p.flops = st.wait ? 0 : op_cost(g, n).flops;
        prof.push_back(p);
      }
    }
  }

  // Builds the Tensor handle of every slot and every step's argument lists,
  // so run() itself only calls kernels.
  void ensure_tensors() {
    ensure_plan();
    if (arena_bytes != plan.memory.arena_bytes || !arena.defined()) {
      MemoryScope tag(MemoryCategory::activations);
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
    views_of.assign(plan.slots.size(), {});
    reads_of.assign(plan.slots.size(), {});
    auto rebindable = [&](int slot) {
      const ValueRole r = g.value(plan.slots[idx(slot)].value).role;
      return plan.slots[idx(slot)].bound && (r == ValueRole::input || r == ValueRole::param);
    };
    for (size_t s = 0; s < plan.slots.size(); ++s) {
      const int root = plan.root(static_cast<int>(s));
      if (plan.slots[s].view_of >= 0 && rebindable(root)) {
        views_of[idx(root)].push_back(static_cast<int>(s));
      }
    }
    for (size_t s = 0; s < plan.steps.size(); ++s) {
      const std::vector<int>& in = plan.steps[s].in;
      for (size_t pos = 0; pos < in.size(); ++pos) {
        const int root = plan.root(in[pos]);
        if (rebindable(root)) {
          reads_of[idx(root)].emplace_back(static_cast<int>(s), static_cast<int>(pos));
        }
      }
    }
    tensors_dirty = false;
  }

  bool hooks_on() const { return hooks.acquire || hooks.release; }

  void check_bound(bool forward_only) const {
    std::vector<bool> needed(idx(g.num_values()), false);
    for (const PlanStep& st : plan.steps) {
      if (forward_only && (st.recompute || g.node(st.node).backward)) continue;
      for (int in : st.in) {
        const ValueId v = plan.slots[idx(in)].value;
        const ValueRole r = g.value(v).role;
        // With residency hooks, acquire binds parameters as they are needed.
        if (r == ValueRole::param && hooks_on()) continue;
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

  // Before any step runs: a collective without a runner is an error.
  void check_collectives(bool forward_only) const {
    if (opts.collectives) return;
    for (const PlanStep& st : plan.steps) {
      if (!st.start || (forward_only && step_backward(st))) continue;
      const Node& n = g.node(st.node);
      throw ConfigError(fmt::format(
          "executor: node '{}' ({}, group {}) is a collective, but no CollectiveRunner was given "
          "(ExecOptions::collectives)",
          n.name, op_name(n.op), n.attrs.i("group")));
    }
  }

  CollectiveCall collective_call(size_t s) const {
    const PlanStep& st = plan.steps[s];
    const Node& n = g.node(st.node);
    CollectiveCall c;
    c.op = n.op;
    c.node = n.name;
    c.attrs = CollectiveAttrs::of(n);
    c.in = step_in[s];
    c.out = step_out[s];
    return c;
  }

  void execute(bool forward_only) {
    ensure_plan();
    check_bound(forward_only);
    check_collectives(forward_only);
    ensure_tensors();
    // Started collectives, by start step; each is waited for exactly once,
    // also when a step throws (the runner must not outlive its buffers' use).
    struct InFlight {
      Impl& m;
      std::vector<std::pair<int, CollectiveHandle>> calls;
      explicit InFlight(Impl& impl) : m(impl) {}
      CollectiveHandle take(int start) {
        for (auto it = calls.begin(); it != calls.end(); ++it) {
          if (it->first != start) continue;
          CollectiveHandle h = it->second;
          calls.erase(it);
          return h;
        }
        MT_CHECK(false, "executor: no collective in flight from step {}", start);
        return {};
      }
      ~InFlight() {
        for (auto& [start, h] : calls) {
          try {
            m.opts.collectives->wait(h);
          } catch (...) {  // the step's own error is the one to report
          }
        }
      }
    } in_flight(*this);
    // Set first so that on_grad_ready callbacks may get() finished gradients.
    ran = true;
    backward_ran = !forward_only;
    struct Running {
      Impl& m;
      explicit Running(Impl& impl) : m(impl) { m.running = true; }
      ~Running() {
        m.running = false;
        m.announcing = kNoValue;
      }
    } running_scope(*this);
    const bool residency = hooks_on();
    for (size_t s = 0; s < plan.steps.size(); ++s) {
      const PlanStep& st = plan.steps[s];
      const Node& n = g.node(st.node);
      const bool bw = step_backward(st);
      if (forward_only && bw) continue;
      if (residency) {
        for (ValueId p : acquire_at[s]) {
          if (hooks.acquire) hooks.acquire(p, bw);
          if (!is_bound[idx(p)]) {
            throw ConfigError(fmt::format(
                "executor: parameter '{}' ({}) is unbound after its acquire hook, before node "
                "'{}'",
                g.value(p).name, type_of(g.value(p)), n.name));
          }
        }
      }
      const bool slowed = opts.slowdown > 1.0 && !st.start && !st.wait && !st.view;
      const bool timed = opts.profile || static_cast<bool>(node_cb) || slowed;
      const int64_t t0 = timed ? now_ns() : 0;
      const bool kernel_step = !st.start && !st.wait && !st.view;
      const int64_t c0 = timed && kernel_step ? thread_cpu_ns() : 0;
      if (st.start) {
        in_flight.calls.emplace_back(static_cast<int>(s),
                                     opts.collectives->start(collective_call(s)));
      } else if (st.wait) {
        opts.collectives->wait(in_flight.take(st.started));
      } else if (!st.view) {
        try {
          if (accumulate[idx(st.node)]) {
            MatmulParams p;
            p.trans_a = n.attrs.b_or("trans_a", false);
            p.trans_b = n.attrs.b_or("trans_b", false);
            p.beta = 1.0f;
            backend->matmul(step_in[s][0], step_in[s][1], step_out[s][0], p);
          } else {
            kernel[idx(st.node)](*backend, n, step_in[s], step_out[s]);
          }
        } catch (const ShapeError& e) {
          throw ShapeError(fmt::format("node '{}' ({}): {}", n.name, op_name(n.op), e.what()));
        } catch (const InternalError& e) {
          throw InternalError(fmt::format("node '{}' ({}): {}", n.name, op_name(n.op), e.what()));
        }
      }
      if (timed) {
        const int64_t t1 = now_ns();
        const int64_t c1 = kernel_step ? thread_cpu_ns() : 0;
        if (slowed) stretch(t1 - t0);
        if (kernel_step) {
          compute_ns += (slowed ? now_ns() : t1) - t0;
          compute_cpu_ns += static_cast<double>(c1 - c0) * std::max(1.0, opts.slowdown);
        }
        if (opts.profile) {
          prof[s].total_ns += t1 - t0;
          ++prof[s].calls;
        }
        if (node_cb && !st.view) node_cb(prof[s].name, n.op, bw, t0, t1);
      }
      if (!forward_only && grad_cb) {
        for (ValueId p : ready_params[s]) {
          announcing = g.grad_of(p);
          grad_cb(p);
          announcing = kNoValue;
        }
      }
      if (residency && hooks.release) {
        for (ValueId p : release_at[s]) hooks.release(p, bw);
      }
    }
  }
};

Executor::Executor(const Graph& g, ExecOptions opts) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.g = g;
  m.opts = std::move(opts);
  m.backend = &kernels(m.opts.backend, m.opts.fast);
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
  for (const Node& n : g.nodes()) {
    m.kernel.push_back(communicates(n.op) ? nullptr : kernel_for(n.op));
  }
  m.accumulate.assign(idx(g.num_nodes()), false);
  m.read.assign(nv, false);
  for (const Node& n : g.nodes()) {
    for (ValueId v : n.inputs) m.read[idx(v)] = true;
  }
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
  if (m.running && val.role != ValueRole::input && val.role != ValueRole::param) {
    throw ConfigError(fmt::format(
        "executor: bind '{}' during run(): only parameters and inputs can be re-bound while "
        "the graph runs",
        val.name));
  }
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
  if (!grad && !m.plan_dirty && !m.tensors_dirty) {
    m.refresh_bound(v);
  } else {
    m.tensors_dirty = true;
  }
}

void Executor::set_param_hooks(ParamHooks hooks) {
  impl_->hooks = std::move(hooks);
}

std::vector<ParamUse> Executor::param_uses(bool forward_only) const {
  Impl& m = *impl_;
  m.ensure_plan();
  std::vector<ParamUse> out;
  for (size_t s = 0; s < m.plan.steps.size(); ++s) {
    const bool bw = m.step_backward(m.plan.steps[s]);
    if (forward_only && bw) continue;
    for (ValueId p : m.acquire_at[s]) out.push_back({p, true, bw});
    for (ValueId p : m.release_at[s]) out.push_back({p, false, bw});
  }
  return out;
}

void Executor::set_transient_grads(bool transient) {
  Impl& m = *impl_;
  if (m.running) {
    throw ConfigError("executor: set_transient_grads() during run()");
  }
  if (m.transient_grads == transient) return;
  m.transient_grads = transient;
  m.plan_dirty = true;
}

void Executor::set_accumulate(ValueId grad, bool on) {
  Impl& m = *impl_;
  if (grad < 0 || grad >= m.g.num_values()) {
    throw ConfigError(
        fmt::format("executor: set_accumulate: id {} is not a value of the graph", grad));
  }
  const Value& val = m.g.value(grad);
  if (m.running) {
    throw ConfigError(fmt::format("executor: set_accumulate '{}' during run()", val.name));
  }
  if (!m.grad_value[idx(grad)] || !m.is_bound[idx(grad)]) {
    throw ConfigError(fmt::format(
        "executor: set_accumulate '{}': only a bound parameter gradient is added into", val.name));
  }
  const NodeId p = val.producer;
  const Node* n = p == kNoNode ? nullptr : &m.g.node(p);
  const bool f32_matmul =
      n != nullptr && n->op == OpKind::matmul && n->outputs.size() == 1 &&
      val.dtype == DType::f32 &&
      std::ranges::all_of(n->inputs, [&](ValueId v) { return m.g.value(v).dtype == DType::f32; });
  if (!f32_matmul) {
    throw ConfigError(fmt::format(
        "executor: set_accumulate '{}': its producer is not an f32 matmul (only a matmul adds "
        "into its output)",
        val.name));
  }
  if (m.read[idx(grad)]) {
    throw ConfigError(fmt::format(
        "executor: set_accumulate '{}': a node reads it (it would read the sum)", val.name));
  }
  m.accumulate[idx(p)] = on;
}

void Executor::on_node_done(NodeCallback cb) {
  impl_->node_cb = std::move(cb);
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
  if (!m.kept_value[idx(v)] && v != m.announcing) {
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

MemoryPlan plan_memory(const Graph& g, const ExecOptions& opts, GradMemory grads) {
  std::vector<bool> grad_bound(idx(g.num_values()), false);
  if (grads == GradMemory::bound) {
    for (const auto& [param, grad] : g.grads()) grad_bound[idx(grad)] = true;
  }
  return make_exec_plan(g, plan_request(g, opts, grad_bound, grads == GradMemory::transient))
      .memory;
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
  impl_->compute_ns = 0;
  impl_->compute_cpu_ns = 0;
}

int64_t Executor::compute_ns() const {
  return impl_->compute_ns;
}

int64_t Executor::compute_cpu_ns() const {
  return static_cast<int64_t>(impl_->compute_cpu_ns);
}

}  // namespace mt
