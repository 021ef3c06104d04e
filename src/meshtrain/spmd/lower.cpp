#include "meshtrain/spmd/lower.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <numeric>
#include <set>
#include <utility>

#include "meshtrain/base/error.h"
#include "meshtrain/graph/collective.h"
#include "meshtrain/graph/op_registry.h"

namespace mt {

namespace {

int64_t tail(const Shape& s, int d) {
  return s.prod(d + 1, s.rank());
}

// Where a split layout's unit sits in a shape: dimension `dim` seen as
// [outer, units, inner]; dim = -1 when the unit does not fall inside one
// dimension (a reshape cut through it).
struct FactorPos {
  int dim = -1;
  int64_t inner = 1, outer = 1;
};

FactorPos find_factor(const Shape& s, const Layout& l) {
  for (int d = s.rank() - 1; d >= 0; --d) {
    const int64_t p = tail(s, d);
    if (s[d] <= 1 || l.stride < p || l.stride >= p * s[d]) continue;
    FactorPos f;
    if (l.stride % p != 0) return f;
    const int64_t inner = l.stride / p;
    if (s[d] % (inner * l.units) != 0) return f;
    f.dim = d;
    f.inner = inner;
    f.outer = s[d] / (inner * l.units);
    return f;
  }
  return {};
}

bool is_float_value(const Graph& g, ValueId v) {
  return is_float(g.value(v).dtype);
}

}  // namespace

std::string Layout::describe() const {
  switch (kind) {
    case Kind::replicated:
      return "replicated";
    case Kind::partial:
      return fmt::format("partial({})", axis);
    case Kind::split:
      return fmt::format("split({}, {} unit{} of {})", axis, fmt::join(sizes, ":"),
                         units == 1 ? "" : "s", stride);
  }
  return "?";
}

const LoweredParam* LoweredProgram::param(const std::string& name) const {
  for (const LoweredParam& p : params) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

bool LoweredProgram::sharded() const {
  return std::any_of(params.begin(), params.end(),
                     [](const LoweredParam& p) { return !p.axis.empty(); });
}

std::vector<std::string> lowered_axes(const Mesh& mesh) {
  std::vector<std::string> out;
  for (const MeshAxis& a : mesh.axes()) {
    if (a.name != "dp" && a.name != "pp") out.push_back(a.name);
  }
  return out;
}

bool needs_lowering(const Plan& plan) {
  const std::vector<std::string> axes = lowered_axes(plan.mesh);
  auto lowered = [&](const std::string& a) {
    return std::find(axes.begin(), axes.end(), a) != axes.end() && plan.mesh.axis_size(a) > 1;
  };
  for (const auto& [name, spec] : plan.specs) {
    for (const DimSharding& d : spec.dims) {
      if (d.split() && lowered(d.axis)) return true;
    }
    for (const std::string& a : spec.partial) {
      if (lowered(a)) return true;
    }
  }
  return false;
}

namespace {

class Lowerer {
 public:
  Lowerer(const Graph& g, const Plan& plan, int rank, const LowerOptions& options)
      : g_(g), plan_(plan), options_(options) {
    p_.rank = rank;
    p_.axes = lowered_axes(plan.mesh);
    for (const std::string& a : p_.axes) {
      const std::vector<std::vector<int>> groups = plan.mesh.groups(a);
      p_.group_of_axis[a] = static_cast<int64_t>(p_.groups.size()) + plan.mesh.group_index(rank, a);
      p_.groups.insert(p_.groups.end(), groups.begin(), groups.end());
    }
    p_.local.assign(static_cast<size_t>(g.num_values()), kNoValue);
    p_.layout.assign(static_cast<size_t>(g.num_values()), Layout{});
  }

  LoweredProgram run(const std::vector<ValueId>& outputs) {
    for (ValueId v : g_.inputs()) add_input(v);
    for (ValueId v : g_.params()) add_param(v);
    for (NodeId id = 0; id < g_.num_nodes(); ++id) {
      const Node& n = g_.node(id);
      if (n.backward) {
        throw ConfigError(fmt::format(
            "lowering: node '{}' is a backward node; lower the forward graph, then differentiate",
            n.name));
      }
      if (is_group_op(n.op)) {
        throw ConfigError(fmt::format(
            "lowering: node '{}' ({}) is already a collective; the model graph must be written "
            "for one device",
            n.name, op_name(n.op)));
      }
      lower_node(n);
      for (ValueId v : n.outputs) apply_named_spec(v);
    }
    for (ValueId v : outputs) set(v, to_replicated(v, "an output of the program"), Layout{});
    return std::move(p_);
  }

 private:
  const Graph& g_;
  const Plan& plan_;
  const LowerOptions options_;
  LoweredProgram p_;
  std::map<std::pair<ValueId, std::string>, ValueId> f_cache_;
  std::map<ValueId, ValueId> replicated_cache_;
  std::map<ValueId, ValueId> gathered_cache_;  // all_gather copies for rank-local consumers

  Graph& out() { return p_.graph; }
  const Layout& lay(ValueId v) const { return p_.layout[static_cast<size_t>(v)]; }
  ValueId loc(ValueId v) const { return p_.local[static_cast<size_t>(v)]; }
  void set(ValueId v, ValueId local, Layout l) {
    p_.local[static_cast<size_t>(v)] = local;
    p_.layout[static_cast<size_t>(v)] = std::move(l);
  }
  const Shape& gshape(ValueId v) const { return g_.value(v).shape; }
  int coord(const std::string& axis) const { return plan_.mesh.coord(p_.rank, axis); }
  int64_t group(const std::string& axis) const { return p_.group_of_axis.at(axis); }
  bool lowered(const std::string& axis) const {
    return std::find(p_.axes.begin(), p_.axes.end(), axis) != p_.axes.end();
  }

  Shape local_shape(const Shape& s, const Layout& l) const {
    if (!l.split()) return s;
    const FactorPos f = find_factor(s, l);
    MT_CHECK(f.dim >= 0, "layout {} does not fit shape {}", l.describe(), s.str());
    std::vector<int64_t> d = s.dims();
    d[static_cast<size_t>(f.dim)] =
        s[f.dim] / l.units * l.sizes[static_cast<size_t>(coord(l.axis))];
    return Shape(d);
  }

  ValueId emit(OpKind op, const std::string& name, std::vector<ValueId> inputs, Attrs attrs = {}) {
    return out().add_node(op, out().unique_name(name), std::move(inputs), std::move(attrs))[0];
  }

  ValueId reshape_local(ValueId v, const Shape& s) {
    if (out().value(v).shape == s) return v;
    return emit(OpKind::reshape, out().value(v).name + ".view", {v}, shape_attrs(s));
  }

  void note(const std::string& node, OpKind op, const std::string& axis, ValueId v,
            std::string why) {
    p_.inserted.push_back(InsertedCollective{node, op, axis, g_.value(v).name, std::move(why)});
  }

  // The [outer, units, stride] view of a split value's global shape, with
  // this rank's units (local = true) or all of them.
  Shape factor_view(ValueId v, const Layout& l, bool local) const {
    const int64_t outer = gshape(v).numel() / (l.units * l.stride);
    return Shape{outer, local ? l.sizes[static_cast<size_t>(coord(l.axis))] : l.units, l.stride};
  }

  CollectiveAttrs pieces_attrs(const Layout& l) const {
    CollectiveAttrs a;
    a.group = group(l.axis);
    a.dim = 1;
    a.sizes = l.sizes;
    a.rank = coord(l.axis);
    return a;
  }

  // ---- conversions ----

  ValueId to_replicated(ValueId v, const std::string& why) {
    const Layout& l = lay(v);
    if (l.replicated()) return loc(v);
    if (auto it = replicated_cache_.find(v); it != replicated_cache_.end()) return it->second;
    ValueId r = kNoValue;
    const std::string name = g_.value(v).name;
    if (l.partial()) {
      r = emit(OpKind::reduce_from_group, name + ".g@" + l.axis, {loc(v)},
               CollectiveAttrs{group(l.axis), 0, {}, 0, 0}.to_attrs(OpKind::reduce_from_group));
      note(out().value(r).name, OpKind::reduce_from_group, l.axis, v, why);
    } else {
      ValueId x = reshape_local(loc(v), factor_view(v, l, true));
      const OpKind op = OpKind::gather_from_group;
      ValueId y = emit(op, name + ".gather@" + l.axis, {x}, pieces_attrs(l).to_attrs(op));
      note(out().value(y).name, op, l.axis, v, why);
      r = reshape_local(y, gshape(v));
    }
    replicated_cache_[v] = r;
    return r;
  }

  // A replicated value as this rank's piece of layout `l` (no communication).
  ValueId split_locally(ValueId v, const Layout& l, const std::string& why) {
    MT_CHECK(lay(v).replicated(), "split_locally of a non-replicated value");
    ValueId x = reshape_local(loc(v), factor_view(v, l, false));
    ValueId y = emit(OpKind::split_to_group, g_.value(v).name + ".split@" + l.axis, {x},
                     pieces_attrs(l).to_attrs(OpKind::split_to_group));
    note(out().value(y).name, OpKind::split_to_group, l.axis, v, why);
    return reshape_local(y, local_shape(gshape(v), l));
  }

  // Megatron's f on a replicated float value entering a rank-local partial
  // computation over `axis` (once per value and axis).
  ValueId f(ValueId v, const std::string& axis, const std::string& why) {
    MT_CHECK(lay(v).replicated(), "f of a non-replicated value");
    if (!is_float_value(g_, v)) return loc(v);
    auto key = std::make_pair(v, axis);
    if (auto it = f_cache_.find(key); it != f_cache_.end()) return it->second;
    ValueId y = emit(OpKind::copy_to_group, g_.value(v).name + ".f@" + axis, {loc(v)},
                     CollectiveAttrs{group(axis), 0, {}, 0, 0}.to_attrs(OpKind::copy_to_group));
    note(out().value(y).name, OpKind::copy_to_group, axis, v, why);
    f_cache_[key] = y;
    return y;
  }

  // ---- inputs, parameters and named specs ----

  Layout layout_of_spec(ValueId v, const ShardingSpec& spec, bool param) const {
    const Value& val = g_.value(v);
    Layout l;
    for (const std::string& a : spec.partial) {
      if (lowered(a)) {
        throw ConfigError(fmt::format(
            "plan: value '{}' is declared partial over '{}': only operators make partial sums; "
            "an input or parameter starts replicated or split",
            val.name, a));
      }
    }
    int found = -1;
    for (size_t d = 0; d < spec.dims.size(); ++d) {
      const DimSharding& ds = spec.dims[d];
      if (!ds.split()) continue;
      if (!lowered(ds.axis)) {
        if (param && ds.axis == "dp") {
          throw ConfigError(
              fmt::format("plan: parameter '{}' is split over 'dp': sharding parameters over the "
                          "data-parallel axis is ZeRO (dist.zero_stage), not a sharding spec",
                          val.name));
        }
        if (param) {
          throw ConfigError(fmt::format(
              "plan: parameter '{}' is split over '{}', which pipeline stages own; split "
              "parameters over a tensor axis",
              val.name, ds.axis));
        }
        continue;  // inputs split over dp: the loader's business
      }
      if (plan_.mesh.axis_size(ds.axis) == 1) continue;
      if (found >= 0) {
        throw ConfigError(fmt::format(
            "plan: value '{}' is split along dims {} and {}: the lowering takes one split per "
            "value",
            val.name, found, d));
      }
      found = static_cast<int>(d);
      const int parts = plan_.mesh.axis_size(ds.axis);
      const int64_t n = val.shape[static_cast<int>(d)];
      std::vector<int64_t> sizes = split_sizes(n, parts, ds.ratios, ds.unit);
      for (int64_t& s : sizes) s /= ds.unit;
      l.kind = Layout::Kind::split;
      l.axis = ds.axis;
      l.units = n / ds.unit;
      l.stride = ds.unit * tail(val.shape, static_cast<int>(d));
      l.sizes = std::move(sizes);
    }
    return l;
  }

  void add_input(ValueId v) {
    const Value& val = g_.value(v);
    const Layout l = layout_of_spec(v, plan_.spec(val.name), false);
    if (!l.replicated()) {
      throw ConfigError(fmt::format(
          "plan: input '{}' is split over '{}': inputs are split over the data-parallel axis "
          "only (every rank of a tensor-parallel group reads the same batch)",
          val.name, l.axis));
    }
    set(v, out().add_input(val.name, val.shape, val.dtype), l);
  }

  void add_param(ValueId v) {
    const Value& val = g_.value(v);
    const Layout l = layout_of_spec(v, plan_.spec(val.name), true);
    LoweredParam lp;
    lp.name = val.name;
    lp.global = val.shape;
    lp.box.begin.assign(static_cast<size_t>(val.shape.rank()), 0);
    lp.box.end = val.shape.dims();
    if (l.split()) {
      const FactorPos f = find_factor(val.shape, l);
      MT_CHECK(f.dim >= 0 && f.outer == 1, "parameter split layout");
      const int c = coord(l.axis);
      int64_t off = 0;
      for (int q = 0; q < c; ++q) off += l.sizes[static_cast<size_t>(q)];
      const auto d = static_cast<size_t>(f.dim);
      lp.box.begin[d] = off * f.inner;
      lp.box.end[d] = (off + l.sizes[static_cast<size_t>(c)]) * f.inner;
      lp.axis = l.axis;
    }
    const Shape s = local_shape(val.shape, l);
    set(v, out().add_param(val.name, s, val.dtype, val.init), l);
    p_.params.push_back(std::move(lp));
  }

  // A plan that names an activation fixes its layout: convert to it.
  void apply_named_spec(ValueId v) {
    const std::string& name = g_.value(v).name;
    bool named = false;
    for (const auto& [n, s] : plan_.specs) named = named || n == name;
    if (!named) return;
    const Layout want = layout_of_spec(v, plan_.spec(name), false);
    if (want == lay(v)) return;
    const std::string why = "the plan's spec for this value";
    ValueId r = to_replicated(v, why);
    set(v, r, Layout{});
    if (want.split()) {
      if (find_factor(gshape(v), want).dim < 0) {
        throw ConfigError(
            fmt::format("plan: value '{}' cannot be split as {}", name, want.describe()));
      }
      set(v, split_locally(v, want, why), want);
    }
  }

  // ---- rules ----

  void emit_like(const Node& n, std::vector<ValueId> inputs, std::vector<Layout> outs,
                 Attrs attrs) {
    std::vector<ValueId> got = out().add_node(n.op, n.name, std::move(inputs), std::move(attrs));
    MT_CHECK_EQ(got.size(), n.outputs.size());
    for (size_t i = 0; i < got.size(); ++i) set(n.outputs[i], got[i], outs[i]);
  }

  std::string at(const Node& n) const { return fmt::format("{} '{}'", op_name(n.op), n.name); }

  // Every input replicated, every output replicated.
  void lower_replicated(const Node& n) {
    std::vector<ValueId> in;
    for (ValueId v : n.inputs) in.push_back(to_replicated(v, "before " + at(n)));
    emit_like(n, std::move(in), std::vector<Layout>(n.outputs.size()), n.attrs);
  }

  void lower_node(const Node& n) {
    switch (n.op) {
      case OpKind::relu:
      case OpKind::gelu:
      case OpKind::tanh:
      case OpKind::sigmoid:
        return lower_unary(n, /*linear=*/false);
      case OpKind::scale:
      case OpKind::cast:
        return lower_unary(n, /*linear=*/true);
      case OpKind::softmax:
      case OpKind::log_softmax:
        return lower_softmax(n);
      case OpKind::add:
      case OpKind::sub:
      case OpKind::mul:
        return lower_binary(n);
      case OpKind::matmul:
        return lower_matmul(n);
      case OpKind::reshape:
        return lower_reshape(n);
      case OpKind::permute:
        return lower_permute(n);
      case OpKind::layer_norm:
        return lower_layer_norm(n);
      case OpKind::embedding:
        return lower_embedding(n);
      case OpKind::cross_entropy:
        return lower_cross_entropy(n);
      default:
        return lower_replicated(n);
    }
  }

  void lower_unary(const Node& n, bool linear) {
    ValueId x = n.inputs[0];
    if (lay(x).partial() && !linear) {
      emit_like(n, {to_replicated(x, "before " + at(n))}, {Layout{}}, n.attrs);
      return;
    }
    emit_like(n, {loc(x)}, {lay(x)}, n.attrs);
  }

  void lower_softmax(const Node& n) {
    ValueId x = n.inputs[0];
    const Layout& l = lay(x);
    const int keep = gshape(x).rank() - (n.attrs.b_or("causal", false) ? 2 : 1);
    const int dim = l.split() ? find_factor(gshape(x), l).dim : -1;
    if (dim >= 0 && dim < keep) {
      emit_like(n, {loc(x)}, {l}, n.attrs);
      return;
    }
    lower_replicated(n);
  }

  // The split layout of v, a suffix-broadcast operand of a value shaped
  // like `big` with layout l, if l's unit falls inside v's dimensions.
  static bool inside(const Shape& v, const Layout& l) {
    return l.stride * l.units <= v.numel() && find_factor(v, l).dim >= 0;
  }

  void lower_binary(const Node& n) {
    ValueId a = n.inputs[0], b = n.inputs[1];
    const std::string why = "before " + at(n);
    // Sums of partial values stay partial.
    if (lay(a).partial() && lay(b).partial() && lay(a).axis == lay(b).axis && n.op != OpKind::mul) {
      emit_like(n, {loc(a), loc(b)}, {lay(a)}, n.attrs);
      return;
    }
    // Sequence parallelism: a partial value meeting its bias or the residual
    // stream is reduce-scattered by rows instead of all-reduced.
    if (plan_.sequence_parallel && n.op == OpKind::add) {
      for (int side = 0; side < 2; ++side) {
        ValueId p = side == 0 ? a : b;
        if (lay(p).partial() && gshape(p) == g_.value(n.outputs[0]).shape &&
            gshape(p).rank() == 2) {
          rows_from_partial(p, why);
        }
      }
    }
    ValueId la = lay(a).partial() ? to_replicated(a, why) : loc(a);
    ValueId lb = lay(b).partial() ? to_replicated(b, why) : loc(b);
    Layout ya = lay(a).partial() ? Layout{} : lay(a);
    Layout yb = lay(b).partial() ? Layout{} : lay(b);
    if (ya.replicated() && yb.replicated()) {
      emit_like(n, {la, lb}, {Layout{}}, n.attrs);
      return;
    }
    const Shape& sb = gshape(b);
    if (ya.split() && yb.replicated()) {
      if (sb.numel() == 1 || !inside(sb, ya)) {
        lb = f(b, ya.axis, why);  // b broadcasts along the split
      } else {
        lb = split_locally(b, ya, why);
      }
      emit_like(n, {la, lb}, {ya}, n.attrs);
      return;
    }
    if (ya.replicated() && yb.split() && inside(sb, yb)) {
      la = split_locally(a, yb, why);
      emit_like(n, {la, lb}, {yb}, n.attrs);
      return;
    }
    if (ya.split() && yb.split() && ya == yb && inside(sb, ya)) {
      emit_like(n, {la, lb}, {ya}, n.attrs);
      return;
    }
    lower_replicated(n);
  }

  // Sequence parallelism: partial p becomes split by rows (dim 0, even)
  // through reduce_scatter, when the rows divide over the axis.
  void rows_from_partial(ValueId p, const std::string& why) {
    const Layout& l = lay(p);
    const Shape& s = gshape(p);
    const int parts = plan_.mesh.axis_size(l.axis);
    if (s[0] % parts != 0) return;
    Layout rows;
    rows.kind = Layout::Kind::split;
    rows.axis = l.axis;
    rows.units = s[0];
    rows.stride = tail(s, 0);
    rows.sizes.assign(static_cast<size_t>(parts), s[0] / parts);
    ValueId x = reshape_local(loc(p), factor_view(p, rows, false));
    ValueId y = emit(OpKind::reduce_scatter, g_.value(p).name + ".rs@" + l.axis, {x},
                     pieces_attrs(rows).to_attrs(OpKind::reduce_scatter));
    note(out().value(y).name, OpKind::reduce_scatter, l.axis, p, why + " (sequence parallel)");
    set(p, reshape_local(y, local_shape(s, rows)), rows);
  }

  // A replicated-per-rank copy of split v for a rank-local consumer: plain
  // all_gather, whose backward reduce-scatters (sequence parallelism).
  ValueId gather_for_local(ValueId v, const std::string& why) {
    if (auto it = gathered_cache_.find(v); it != gathered_cache_.end()) return it->second;
    const Layout& l = lay(v);
    ValueId x = reshape_local(loc(v), factor_view(v, l, true));
    ValueId y = emit(OpKind::all_gather, g_.value(v).name + ".ag@" + l.axis, {x},
                     pieces_attrs(l).to_attrs(OpKind::all_gather));
    note(out().value(y).name, OpKind::all_gather, l.axis, v, why);
    return gathered_cache_[v] = reshape_local(y, gshape(v));
  }

  enum class Role { none, batch, m, k, n, other };

  // Role of the split in a matmul operand (a: batch/m/k, b: batch/k/n).
  Role role_of(ValueId v, bool is_a, bool trans, const FactorPos& f) const {
    const int r = gshape(v).rank();
    if (f.dim < 0) return Role::other;
    if (r == 3 && f.dim == 0) return Role::batch;
    const bool first = f.dim == r - 2;  // rows of the stored matrix
    if (is_a) return (first != trans) ? Role::m : Role::k;
    return (first != trans) ? Role::k : Role::n;
  }

  void lower_matmul(const Node& n) {
    ValueId a = n.inputs[0], b = n.inputs[1];
    const bool ta = n.attrs.b_or("trans_a", false), tb = n.attrs.b_or("trans_b", false);
    const std::string why = "before " + at(n);
    if (lay(a).partial() || lay(b).partial()) return lower_replicated(n);
    const Layout la = lay(a), lb = lay(b);
    const FactorPos fa = la.split() ? find_factor(gshape(a), la) : FactorPos{};
    const FactorPos fb = lb.split() ? find_factor(gshape(b), lb) : FactorPos{};
    const Role ra = la.split() ? role_of(a, true, ta, fa) : Role::none;
    const Role rb = lb.split() ? role_of(b, false, tb, fb) : Role::none;
    const Shape& ys = g_.value(n.outputs[0]).shape;
    auto out_layout = [&](const Layout& from, const FactorPos& f, int out_dim) {
      Layout y = from;
      y.stride = f.inner * tail(ys, out_dim);
      return y;
    };
    const int yr = ys.rank();
    auto same_split = [&](const Layout& x, const FactorPos& px, const Layout& y,
                          const FactorPos& py) {
      return x.axis == y.axis && x.units == y.units && x.sizes == y.sizes && px.inner == py.inner &&
             px.outer == py.outer;
    };
    // Column-parallel: replicated x column-split.
    if (ra == Role::none && rb == Role::n) {
      emit_like(n, {f(a, lb.axis, why), loc(b)}, {out_layout(lb, fb, yr - 1)}, n.attrs);
      return;
    }
    // Row-split left operand, replicated right: rows stay split.
    if (ra == Role::m && rb == Role::none) {
      emit_like(n, {loc(a), f(b, la.axis, why)}, {out_layout(la, fa, yr - 2)}, n.attrs);
      return;
    }
    // Sequence parallelism: rows-split left x column-split right.
    if (ra == Role::m && rb == Role::n) {
      emit_like(n, {gather_for_local(a, why), loc(b)}, {out_layout(lb, fb, yr - 1)}, n.attrs);
      return;
    }
    // Row-parallel: contraction split on both sides.
    if (ra == Role::k && rb == Role::k && same_split(la, fa, lb, fb)) {
      Layout p;
      p.kind = Layout::Kind::partial;
      p.axis = la.axis;
      emit_like(n, {loc(a), loc(b)}, {p}, n.attrs);
      return;
    }
    // Contraction split on one side: split the replicated other locally.
    if (ra == Role::k && rb == Role::none && gshape(b).rank() == 2) {
      Layout want = la;
      want.stride = fa.inner * tail(gshape(b), tb ? 1 : 0);
      if (find_factor(gshape(b), want).dim >= 0) {
        Layout p;
        p.kind = Layout::Kind::partial;
        p.axis = la.axis;
        emit_like(n, {loc(a), split_locally(b, want, why)}, {p}, n.attrs);
        return;
      }
    }
    // Batched: both split along the batch, or the right one replicated.
    if (ra == Role::batch &&
        (rb == Role::none || (rb == Role::batch && same_split(la, fa, lb, fb)))) {
      ValueId bb = rb == Role::none ? f(b, la.axis, why) : loc(b);
      emit_like(n, {loc(a), bb}, {out_layout(la, fa, 0)}, n.attrs);
      return;
    }
    lower_replicated(n);
  }

  void lower_reshape(const Node& n) {
    ValueId x = n.inputs[0];
    const Layout& l = lay(x);
    const Shape& ys = g_.value(n.outputs[0]).shape;
    if (!l.split()) {
      emit_like(n, {loc(x)}, {l}, n.attrs);
      return;
    }
    if (find_factor(ys, l).dim < 0) return lower_replicated(n);
    emit_like(n, {loc(x)}, {l}, shape_attrs(local_shape(ys, l)));
  }

  void lower_permute(const Node& n) {
    ValueId x = n.inputs[0];
    const Layout& l = lay(x);
    if (!l.split()) {
      emit_like(n, {loc(x)}, {l}, n.attrs);
      return;
    }
    const FactorPos f = find_factor(gshape(x), l);
    if (f.dim < 0) return lower_replicated(n);
    const std::vector<int64_t>& perm = n.attrs.ints("perm");
    int to = -1;
    for (size_t i = 0; i < perm.size(); ++i) {
      if (perm[i] == f.dim) to = static_cast<int>(i);
    }
    Layout y = l;
    y.stride = f.inner * tail(g_.value(n.outputs[0]).shape, to);
    emit_like(n, {loc(x)}, {y}, n.attrs);
  }

  // The first element along dimension `dim` of this rank's piece of split
  // value v, when the piece is one contiguous range there (else -1).
  int64_t range_start(ValueId v, int dim) const {
    const Layout& l = lay(v);
    const FactorPos f = find_factor(gshape(v), l);
    if (f.dim != dim || f.outer != 1) return -1;
    int64_t off = 0;
    for (int q = 0; q < coord(l.axis); ++q) off += l.sizes[static_cast<size_t>(q)];
    return off * f.inner;
  }

  // Megatron's vocabulary-parallel embedding: each rank looks its ids up in
  // its own rows of the table (zeros for the others' ids), which makes the
  // sum over the ranks the lookup; the partial result is reduced by g where
  // a consumer needs it whole. Backward: each rank scatter-adds into its
  // own rows (g's backward is the identity).
  void lower_embedding(const Node& n) {
    ValueId table = n.inputs[0], ids = n.inputs[1];
    if (!options_.vocab_parallel || !lay(table).split() || !lay(ids).replicated()) {
      return lower_replicated(n);
    }
    const int64_t off = range_start(table, 0);
    if (off < 0) return lower_replicated(n);
    Attrs a = n.attrs;
    a.set("offset", off).set("vocab", gshape(table)[0]);
    Layout p;
    p.kind = Layout::Kind::partial;
    p.axis = lay(table).axis;
    emit_like(n, {loc(table), loc(ids)}, {p}, std::move(a));
  }

  // Megatron's vocabulary-parallel cross-entropy over logits split by
  // columns (the tied head's vocabulary): the row maxima all-reduced with
  // max (a stop-gradient), each rank's sum of exp(logit - max) and the
  // label's logit from the rank that holds it summed by g, then
  // loss = mean(log(sum) + max - label's logit), the same on every rank.
  // Only [N, 2] + [N] values cross the wire instead of the gathered [N, V]
  // logits, and each rank's gradient is its own columns' softmax - onehot.
  void lower_cross_entropy(const Node& n) {
    ValueId logits = n.inputs[0], labels = n.inputs[1];
    const DType dt = g_.value(logits).dtype;
    if (!options_.vocab_parallel || !lay(logits).split() || !lay(labels).replicated() ||
        (dt != DType::f32 && dt != DType::f64)) {
      return lower_replicated(n);
    }
    const int64_t off = range_start(logits, 1);
    if (off < 0) return lower_replicated(n);
    const std::string axis = lay(logits).axis;
    const std::string why = "vocabulary-parallel " + at(n);
    const CollectiveAttrs ga{group(axis), 0, {}, 0, 0};
    ValueId x = loc(logits);
    ValueId mloc = emit(OpKind::row_max, n.name + ".max", {x});
    ValueId m = emit(OpKind::all_reduce_max, n.name + ".max@" + axis, {mloc},
                     ga.to_attrs(OpKind::all_reduce_max));
    note(out().value(m).name, OpKind::all_reduce_max, axis, logits, why + ": row maxima");
    ValueId st = emit(OpKind::vocab_ce_stats, n.name + ".stats", {x, loc(labels), m},
                      Attrs().set("offset", off).set("vocab", gshape(logits)[1]));
    ValueId tot = emit(OpKind::reduce_from_group, n.name + ".stats.g@" + axis, {st},
                       ga.to_attrs(OpKind::reduce_from_group));
    note(out().value(tot).name, OpKind::reduce_from_group, axis, logits,
         why + ": sums of exponentials and the labels' logits");
    ValueId y = out().add_node(OpKind::vocab_ce_loss, n.name, {tot, m})[0];
    set(n.outputs[0], y, Layout{});
  }

  void lower_layer_norm(const Node& n) {
    ValueId x = n.inputs[0];
    const Layout& l = lay(x);
    const Shape& xs = gshape(x);
    const int dim = l.split() ? find_factor(xs, l).dim : -1;
    if (dim < 0 || dim >= xs.rank() - 1 || !lay(n.inputs[1]).replicated() ||
        !lay(n.inputs[2]).replicated()) {
      return lower_replicated(n);
    }
    const std::string why = "before " + at(n);
    Layout stats = l;
    stats.stride = l.stride / xs[-1];
    emit_like(n, {loc(x), f(n.inputs[1], l.axis, why), f(n.inputs[2], l.axis, why)},
              {l, stats, stats}, n.attrs);
  }
};

}  // namespace

LoweredProgram lower(const Graph& forward, const Plan& plan, int rank,
                     const std::vector<ValueId>& outputs, const LowerOptions& options) {
  if (rank < 0 || rank >= plan.mesh.size()) {
    throw ConfigError(fmt::format("lowering: rank {} is outside the mesh {} ({} ranks)", rank,
                                  plan.mesh.describe(), plan.mesh.size()));
  }
  return Lowerer(forward, plan, rank, options).run(outputs);
}

std::string describe_lowered(const LoweredProgram& p, const Graph& g) {
  std::string s = fmt::format("rank {}: {} operators\n", p.rank, g.num_nodes());
  for (const LoweredParam& lp : p.params) {
    if (lp.axis.empty()) continue;
    std::vector<std::string> box;
    for (size_t d = 0; d < lp.box.begin.size(); ++d) {
      box.push_back(fmt::format("{}:{}", lp.box.begin[d], lp.box.end[d]));
    }
    s += fmt::format("  param {} {} -> [{}] over {}\n", lp.name, lp.global.str(),
                     fmt::join(box, ", "), lp.axis);
  }
  double fwd = 0, bwd = 0;
  for (const Node& n : g.nodes()) {
    if (!is_group_op(n.op)) continue;
    const double bytes = collective_payload_bytes(g, n);
    (n.backward ? bwd : fwd) += bytes;
    s += fmt::format("  {} {} {} ({} bytes)\n", n.backward ? "backward" : "forward ", op_name(n.op),
                     n.name, static_cast<int64_t>(bytes));
  }
  s += fmt::format("  collective payload per step: forward {} bytes, backward {} bytes\n",
                   static_cast<int64_t>(fwd), static_cast<int64_t>(bwd));
  return s;
}

}  // namespace mt
