#include "meshtrain/graph/op_registry.h"

#include <fmt/format.h>

#include "meshtrain/base/error.h"

namespace mt {

namespace {

std::vector<OpDef> build_table() {
  std::vector<OpDef> unordered;
  register_elementwise_ops(unordered);
  register_linear_ops(unordered);
  register_norm_ops(unordered);
  register_conv_ops(unordered);
  register_shape_ops(unordered);
  register_collective_ops(unordered);
  register_sparse_ops(unordered);
  size_t n = 0;
  for (const OpDef& d : unordered) n = std::max(n, static_cast<size_t>(d.op) + 1);
  std::vector<OpDef> table(n);
  for (OpDef& d : unordered) {
    auto k = static_cast<size_t>(d.op);
    MT_CHECK(table[k].infer == nullptr, "operator {} registered twice", d.name);
    MT_CHECK(d.infer != nullptr && d.flops != nullptr, "operator {} lacks infer or flops", d.name);
    table[k] = std::move(d);
  }
  return table;
}

const std::vector<OpDef>& table() {
  static const std::vector<OpDef> t = build_table();
  return t;
}

}  // namespace

OpDef make_op_def(OpKind op, std::string_view name, int min_inputs, int max_inputs,
                  std::vector<ValueType> (*infer)(const InferContext&),
                  double (*flops)(const Graph&, const Node&), void (*grad)(GradContext&)) {
  OpDef d;
  d.op = op;
  d.name = name;
  d.min_inputs = min_inputs;
  d.max_inputs = max_inputs;
  d.infer = infer;
  d.flops = flops;
  d.grad = grad;
  return d;
}

const OpDef& op_def(OpKind op) {
  const auto& t = table();
  auto k = static_cast<size_t>(op);
  if (k >= t.size() || t[k].infer == nullptr) {
    throw InternalError(fmt::format("operator #{} has no registry entry", k));
  }
  return t[k];
}

std::vector<OpKind> all_ops() {
  std::vector<OpKind> ops;
  for (const OpDef& d : table()) {
    if (d.infer != nullptr) ops.push_back(d.op);
  }
  return ops;
}

// ---- InferContext ----

std::string InferContext::desc(int i) const {
  return fmt::format("{}{}", dtype_name(dtype(i)), shape(i).str());
}

void InferContext::fail_shown(const std::string& msg) const {
  throw ShapeError(fmt::format("node '{}' ({}): {}", n_.name, op_name(n_.op), msg));
}

void InferContext::fail(const std::string& msg) const {
  std::string ins;
  for (int i = 0; i < num_inputs(); ++i) ins += (i ? ", " : "") + desc(i);
  fail_shown(fmt::format("{} (inputs: {})", msg, ins.empty() ? "none" : ins));
}

void InferContext::expect_rank(int i, int rank, const char* what) const {
  if (shape(i).rank() != rank) {
    fail(fmt::format("{} must have rank {}, got {}", what, rank, desc(i)));
  }
}

void InferContext::expect_float(int i, const char* what) const {
  if (!is_float(dtype(i))) fail(fmt::format("{} must be a float tensor, got {}", what, desc(i)));
}

void InferContext::expect_dtype(int i, DType t, const char* what) const {
  if (dtype(i) != t) fail(fmt::format("{} must be {}, got {}", what, dtype_name(t), desc(i)));
}

void InferContext::expect_same_dtype(int i, int j) const {
  if (dtype(i) != dtype(j)) {
    fail(fmt::format("inputs {} and {} differ in dtype: {} vs {}", i, j, desc(i), desc(j)));
  }
}

Shape InferContext::shape_attr(const std::string& key) const {
  Shape s(attrs().ints(key));
  for (int64_t d : s.dims()) {
    if (d < 0) fail(fmt::format("attribute {} = {} has a negative dimension", key, s.str()));
  }
  return s;
}

// ---- GradContext ----

GradContext::GradContext(Graph& g, Node n, std::vector<ValueId> dys, std::vector<bool> wants,
                         std::vector<std::string> names)
    : g_(g),
      n_(std::move(n)),
      dys_(std::move(dys)),
      wants_(std::move(wants)),
      names_(std::move(names)),
      given_(n_.inputs.size(), kNoValue) {}

std::string GradContext::node_name(const std::string& suffix) const {
  return fmt::format("grad/{}.{}", n_.name, suffix);
}

std::vector<ValueId> GradContext::emit_multi(OpKind op, const std::string& name,
                                             std::vector<ValueId> inputs, Attrs attrs) {
  return g_.add_node(op, g_.unique_name(name), std::move(inputs), std::move(attrs), true);
}

ValueId GradContext::emit(OpKind op, const std::string& name, std::vector<ValueId> inputs,
                          Attrs attrs) {
  return emit_multi(op, name, std::move(inputs), std::move(attrs)).front();
}

DType wide_grad_dtype(const Graph& g, ValueId v) {
  const Value& val = g.value(v);
  if (val.producer == kNoNode) return val.dtype;
  const Node& p = g.node(val.producer);
  if (p.op != OpKind::cast || p.backward) return val.dtype;
  const DType src = g.value(p.inputs.front()).dtype;
  return dtype_size(src) > dtype_size(val.dtype) ? src : val.dtype;
}

DType GradContext::grad_dtype(int i) const {
  return wide_grad_dtype(g_, x(i));
}

void GradContext::give(int i, ValueId grad) {
  if (!wants(i)) return;
  const Value& in = g_.value(x(i));
  const Value& gv = g_.value(grad);
  MT_CHECK(gv.shape == in.shape && (gv.dtype == in.dtype || gv.dtype == grad_dtype(i)),
           "gradient rule of {} ('{}') gave {}{} for input {} of type {}{}", op_name(n_.op),
           n_.name, dtype_name(gv.dtype), gv.shape.str(), i, dtype_name(in.dtype), in.shape.str());
  given_.at(static_cast<size_t>(i)) = grad;
}

// ---- helpers ----

double numel_of(const Graph& g, ValueId v) {
  return static_cast<double>(g.value(v).shape.numel());
}

bool is_suffix(const Shape& s, const Shape& of) {
  if (s.rank() > of.rank()) return false;
  const int off = of.rank() - s.rank();
  for (int i = 0; i < s.rank(); ++i) {
    if (s.dims()[static_cast<size_t>(i)] != of.dims()[static_cast<size_t>(off + i)]) return false;
  }
  return true;
}

bool broadcasts_to(const Shape& b, const Shape& a) {
  return is_suffix(b, a) || b.numel() == 1;
}

std::vector<int64_t> dims_of(const Shape& s) {
  return s.dims();
}

Attrs shape_attrs(const Shape& s) {
  return Attrs().set("shape", s.dims());
}

}  // namespace mt
