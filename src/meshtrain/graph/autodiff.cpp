#include "meshtrain/graph/autodiff.h"

#include <algorithm>
#include <string_view>

#include <fmt/format.h>

#include "meshtrain/base/error.h"
#include "meshtrain/graph/op_registry.h"

namespace mt {

namespace {

// One backward pass under construction. Gradient contributions are counted
// before any node is emitted, so each value's gradient is summed (and, for a
// parameter, recorded) the moment its last contribution arrives: a
// parameter's gradient is then produced as early as the reverse order allows,
// which is when data-parallel sync may start on it.
class BackwardBuilder {
 public:
  // seeds: (value, gradient value or kNoValue for d value = 1); wrt: graph
  // inputs whose gradients are wanted besides the parameters'.
  BackwardBuilder(Graph& g, std::vector<BackwardSeed> seeds, std::vector<ValueId> wrt)
      : g_(g),
        seeds_(std::move(seeds)),
        wrt_(std::move(wrt)),
        forward_nodes_(g.num_nodes()),
        needs_(static_cast<size_t>(g.num_values()), false),
        count_(static_cast<size_t>(g.num_values()), 0),
        contribs_(static_cast<size_t>(g.num_values())),
        grad_(static_cast<size_t>(g.num_values()), kNoValue),
        owned_(static_cast<size_t>(g.num_values()), false),
        shared_contrib_(static_cast<size_t>(g.num_values()), false),
        active_(static_cast<size_t>(g.num_nodes()), false) {}

  void run() {
    mark_needs();
    bool any = false;  // does a parameter or wanted input reach a seed?
    for (const BackwardSeed& s : seeds_) any = any || needs_[idx(s.value)];
    if (!any) return;
    count_contributions();
    for (const BackwardSeed& s : seeds_) {
      if (!needs_[idx(s.value)]) continue;
      if (s.grad != kNoValue) {
        // A given gradient is a graph input: shared, never renamed.
        add_contribution(s.value, s.grad, false);
        continue;
      }
      Attrs seed_attrs;
      seed_attrs.set("shape", g_.value(s.value).shape.dims())
          .set("dtype", std::string(dtype_name(g_.value(s.value).dtype)))
          .set("value", 1.0);
      ValueId seed =
          g_.add_node(OpKind::fill, g_.unique_name(contrib_name(s.value, 0)), {}, seed_attrs, true)
              .front();
      add_contribution(s.value, seed, true);
    }
    for (NodeId i = forward_nodes_ - 1; i >= 0; --i) {
      if (active_[idx(i)]) differentiate(i);
    }
  }

  // Per wrt input: its gradient, kNoValue when none reaches it.
  std::vector<ValueId> wrt_grads() const {
    std::vector<ValueId> out;
    for (ValueId v : wrt_) out.push_back(idx(v) < grad_.size() ? grad_[idx(v)] : kNoValue);
    return out;
  }

 private:
  static size_t idx(int32_t v) { return static_cast<size_t>(v); }

  // needs_[v]: v is a float value that depends on a parameter.
  void mark_needs() {
    for (ValueId p : g_.params()) needs_[idx(p)] = is_float(g_.value(p).dtype);
    for (ValueId v : wrt_) needs_[idx(v)] = is_float(g_.value(v).dtype);
    for (NodeId i = 0; i < forward_nodes_; ++i) {
      const Node& n = g_.node(i);
      bool any = false;
      for (ValueId v : n.inputs) any = any || needs_[idx(v)];
      if (!any) continue;
      const int diff = std::min<int>(op_def(n.op).diff_outputs, static_cast<int>(n.outputs.size()));
      for (int k = 0; k < diff; ++k) {
        ValueId out = n.outputs[idx(k)];
        needs_[idx(out)] = is_float(g_.value(out).dtype);
      }
    }
  }

  // A node is active if one of its differentiable outputs gets a gradient;
  // each of its inputs that needs a gradient then receives one contribution.
  void count_contributions() {
    std::vector<bool> has_grad(needs_.size(), false);
    for (const BackwardSeed& s : seeds_) {
      has_grad[idx(s.value)] = true;
      count_[idx(s.value)] = 1;  // the seed
    }
    for (NodeId i = forward_nodes_ - 1; i >= 0; --i) {
      const Node& n = g_.node(i);
      const OpDef& def = op_def(n.op);
      bool active = false;
      const int diff = std::min<int>(def.diff_outputs, static_cast<int>(n.outputs.size()));
      for (int k = 0; k < diff; ++k) {
        ValueId out = n.outputs[idx(k)];
        active = active || (has_grad[idx(out)] && needs_[idx(out)]);
      }
      if (!active) continue;
      if (def.grad == nullptr) {
        throw InternalError(fmt::format(
            "build_backward: operator {} (node '{}') lies between a parameter and the loss but "
            "has no gradient rule",
            def.name, n.name));
      }
      active_[idx(i)] = true;
      for (ValueId v : n.inputs) {
        if (!needs_[idx(v)]) continue;
        ++count_[idx(v)];
        has_grad[idx(v)] = true;
      }
    }
  }

  std::string contrib_name(ValueId v, int k) const {
    const std::string base = "grad/" + g_.value(v).name;
    return count_[idx(v)] <= 1 ? base : fmt::format("{}.{}", base, k);
  }

  void differentiate(NodeId i) {
    Node n = g_.node(i);  // copied: emitting nodes may reallocate g's storage
    const OpDef& def = op_def(n.op);
    std::vector<ValueId> dys(n.outputs.size(), kNoValue);
    bool any = false;
    for (int k = 0; k < std::min<int>(def.diff_outputs, static_cast<int>(n.outputs.size())); ++k) {
      dys[idx(k)] = grad_[idx(n.outputs[idx(k)])];
      any = any || dys[idx(k)] != kNoValue;
    }
    MT_CHECK(any, "node '{}' is active but none of its outputs has a gradient", n.name);

    std::vector<bool> wants(n.inputs.size());
    std::vector<std::string> names(n.inputs.size());
    for (size_t j = 0; j < n.inputs.size(); ++j) {
      ValueId v = n.inputs[j];
      wants[j] = needs_[idx(v)];
      if (!wants[j]) {
        names[j] = fmt::format("grad/{}.in{}", n.name, j);
        continue;
      }
      int k = static_cast<int>(contribs_[idx(v)].size());
      for (size_t e = 0; e < j; ++e) k += (n.inputs[e] == v) ? 1 : 0;
      names[j] = contrib_name(v, k);
    }
    const NodeId first_emitted = g_.num_nodes();
    GradContext ctx(g_, n, dys, wants, std::move(names));
    def.grad(ctx);
    // A contribution is exclusive when nothing else holds it: emitted by this
    // rule, or an exclusive output gradient passed through (cast, add), and
    // handed to one input only.
    auto exclusive = [&](ValueId gv) {
      if (std::count(ctx.given().begin(), ctx.given().end(), gv) != 1) return false;
      if (g_.value(gv).producer >= first_emitted) return true;
      for (size_t k = 0; k < dys.size(); ++k) {
        if (dys[k] == gv && idx(gv) < owned_.size() && owned_[idx(gv)]) return true;
      }
      return false;
    };
    for (size_t j = 0; j < n.inputs.size(); ++j) {
      if (!wants[j]) continue;
      ValueId gv = ctx.given()[j];
      if (gv == kNoValue) {
        throw InternalError(
            fmt::format("gradient rule of {} (node '{}') gave no gradient for input "
                        "{} ('{}')",
                        def.name, n.name, j, g_.value(n.inputs[j]).name));
      }
      add_contribution(n.inputs[j], gv, exclusive(gv));
    }
  }

  void add_contribution(ValueId v, ValueId c, bool exclusive) {
    auto& cs = contribs_[idx(v)];
    cs.push_back(c);
    if (!exclusive) shared_contrib_[idx(v)] = true;
    if (static_cast<int>(cs.size()) == count_[idx(v)]) finalize(v);
  }

  void finalize(ValueId v) {
    std::vector<ValueId> cs = contribs_[idx(v)];
    const std::string name = "grad/" + g_.value(v).name;
    const bool is_param = g_.value(v).role == ValueRole::param;
    // A wanted input's gradient is named and copied like a parameter's.
    const bool is_target = is_param || std::find(wrt_.begin(), wrt_.end(), v) != wrt_.end();
    // Contributions carried wide (GradContext::grad_dtype) and narrow ones
    // meet in the wide dtype.
    const DType wide = wide_grad_dtype(g_, v);
    ValueId r = cs.front();
    bool owned = false;
    if (cs.size() == 1) {
      owned = !shared_contrib_[idx(v)];
      // A pass-through gradient (e.g. add's dy) may be shared with other
      // values; a parameter gets its own copy so it can be bound separately.
      // One nobody else holds is renamed instead.
      if (is_target && g_.value(r).name != name) {
        if (owned) {
          g_.rename_value(r, g_.unique_name(name));
        } else {
          r = g_.add_node(OpKind::scale, g_.unique_name(name), {r}, Attrs().set("alpha", 1.0), true)
                  .front();
          owned = true;
        }
      }
    } else {
      for (ValueId& c : cs) {
        if (g_.value(c).dtype == wide) continue;
        c = g_.add_node(OpKind::cast,
                        g_.unique_name(fmt::format("{}.{}", g_.value(c).name, dtype_name(wide))),
                        {c}, Attrs().set("dtype", std::string(dtype_name(wide))), true)
                .front();
      }
      r = cs.front();
      for (size_t k = 1; k < cs.size(); ++k) {
        std::string nm = k + 1 == cs.size() ? name : fmt::format("{}.sum{}", name, k);
        r = g_.add_node(OpKind::add, g_.unique_name(nm), {r, cs[k]}, {}, true).front();
      }
      owned = true;
    }
    grad_[idx(v)] = r;
    if (idx(r) >= owned_.size()) owned_.resize(idx(g_.num_values()), false);
    owned_[idx(r)] = owned;
    if (is_param) g_.set_grad(v, r);
  }

  Graph& g_;
  std::vector<BackwardSeed> seeds_;
  std::vector<ValueId> wrt_;
  NodeId forward_nodes_;
  std::vector<bool> needs_;
  std::vector<int> count_;
  std::vector<std::vector<ValueId>> contribs_;
  std::vector<ValueId> grad_;
  // owned_[g]: gradient value g is held by one value only (may be renamed).
  // Indexed by value id; grows as backward values are emitted.
  std::vector<bool> owned_;
  std::vector<bool> shared_contrib_;  // per value: some contribution is shared
  std::vector<bool> active_;
};

}  // namespace

void build_backward(Graph& g, ValueId loss) {
  MT_CHECK(loss >= 0 && loss < g.num_values(), "build_backward: loss id {} is not a value", loss);
  const Value& lv = g.value(loss);
  if (lv.shape.numel() != 1 || !is_float(lv.dtype)) {
    throw ShapeError(fmt::format("build_backward: loss '{}' must be a float scalar, got {}{}",
                                 lv.name, dtype_name(lv.dtype), lv.shape.str()));
  }
  for (const Node& n : g.nodes()) {
    if (n.backward) {
      throw InternalError(
          fmt::format("build_backward: the graph already has backward nodes (e.g. '{}')", n.name));
    }
  }
  g.set_loss(loss);
  BackwardBuilder(g, {BackwardSeed{loss, kNoValue}}, {}).run();
}

namespace {

void check_no_backward(const Graph& g, std::string_view what) {
  for (const Node& n : g.nodes()) {
    if (n.backward) {
      throw InternalError(
          fmt::format("{}: the graph already has backward nodes (e.g. '{}')", what, n.name));
    }
  }
}

}  // namespace

std::vector<ValueId> build_backward(Graph& g, std::span<const BackwardSeed> seeds,
                                    std::span<const ValueId> wrt) {
  check_no_backward(g, "build_backward");
  std::vector<bool> seeded(static_cast<size_t>(g.num_values()), false);
  for (const BackwardSeed& s : seeds) {
    if (s.value < 0 || s.value >= g.num_values()) {
      throw ConfigError(fmt::format("build_backward: seed value id {} is not a value", s.value));
    }
    const Value& v = g.value(s.value);
    if (seeded[static_cast<size_t>(s.value)]) {
      throw ConfigError(fmt::format("build_backward: value '{}' is seeded twice", v.name));
    }
    seeded[static_cast<size_t>(s.value)] = true;
    if (!is_float(v.dtype)) {
      throw ShapeError(fmt::format("build_backward: seeded value '{}' is {}, not a float", v.name,
                                   dtype_name(v.dtype)));
    }
    if (s.grad == kNoValue) continue;
    if (s.grad < 0 || s.grad >= g.num_values() || g.value(s.grad).role != ValueRole::input) {
      throw ConfigError(
          fmt::format("build_backward: the gradient given for '{}' must be a graph input", v.name));
    }
    const Value& gv = g.value(s.grad);
    if (gv.shape != v.shape || gv.dtype != v.dtype) {
      throw ShapeError(fmt::format(
          "build_backward: the gradient '{}' given for '{}' is {}{}, expected {}{}", gv.name,
          v.name, dtype_name(gv.dtype), gv.shape.str(), dtype_name(v.dtype), v.shape.str()));
    }
  }
  for (ValueId v : wrt) {
    if (v < 0 || v >= g.num_values() || g.value(v).role != ValueRole::input) {
      throw ConfigError(fmt::format(
          "build_backward: gradients are taken with respect to graph inputs; value id {} ('{}') "
          "is not one",
          v, v >= 0 && v < g.num_values() ? g.value(v).name : std::string("?")));
    }
  }
  BackwardBuilder b(g, {seeds.begin(), seeds.end()}, {wrt.begin(), wrt.end()});
  b.run();
  return b.wrt_grads();
}

BackwardSplit split_backward(const Graph& g, std::span<const ValueId> input_grads) {
  // Backward nodes the input gradients depend on, found by walking producers.
  std::vector<bool> in_input_part(static_cast<size_t>(g.num_nodes()), false);
  std::vector<ValueId> todo;
  for (ValueId v : input_grads) {
    if (v != kNoValue) todo.push_back(v);
  }
  while (!todo.empty()) {
    const ValueId v = todo.back();
    todo.pop_back();
    const NodeId p = g.value(v).producer;
    if (p == kNoNode || !g.node(p).backward || in_input_part[static_cast<size_t>(p)]) continue;
    in_input_part[static_cast<size_t>(p)] = true;
    for (ValueId in : g.node(p).inputs) todo.push_back(in);
  }
  BackwardSplit out;
  for (NodeId i = 0; i < g.num_nodes(); ++i) {
    if (!g.node(i).backward) continue;
    (in_input_part[static_cast<size_t>(i)] ? out.input_part : out.weight_part).push_back(i);
  }
  return out;
}

}  // namespace mt
