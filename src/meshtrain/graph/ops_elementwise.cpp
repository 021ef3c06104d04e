// Element-wise operators: binary arithmetic with suffix/scalar broadcasting,
// scale, the unary activations and their shared backward operator.
//
// FLOP conventions (per output element): add/sub/mul/scale/relu 1; tanh and
// sigmoid 4 (one exp-like evaluation counted as 3 plus the arithmetic); gelu 8
// (tanh approximation: cube, two multiply-adds, tanh, final multiply). Their
// backward passes count the arithmetic of the derivative in the same way.
#include <optional>

#include <fmt/format.h>

#include "meshtrain/graph/op_registry.h"

namespace mt {

namespace {

// ---- binary ----

std::vector<ValueType> infer_binary(const InferContext& c) {
  const char* sym = c.node().op == OpKind::add ? "+" : c.node().op == OpKind::sub ? "-" : "*";
  if (c.dtype(0) != c.dtype(1)) {
    c.fail_shown(fmt::format("operands differ in dtype: {} {} {}", c.desc(0), sym, c.desc(1)));
  }
  if (!is_float(c.dtype(0))) {
    c.fail_shown(
        fmt::format("operands must be float tensors: {} {} {}", c.desc(0), sym, c.desc(1)));
  }
  if (!broadcasts_to(c.shape(1), c.shape(0))) {
    c.fail_shown(fmt::format("b must have a's shape, a suffix of it, or one element: {} {} {}",
                             c.desc(0), sym, c.desc(1)));
  }
  return {{c.shape(0), c.dtype(0)}};
}

double flops_per_output(const Graph& g, const Node& n) {
  return numel_of(g, n.outputs[0]);
}

// Reduces gradient `gv` (shaped like the output) to `target`, the shape of a
// broadcast operand, summing into `out` (gv's dtype, or f32 for a 16-bit gv
// whose operand takes a wide gradient). Returns gv itself when no reduction
// is needed.
ValueId reduce_to(GradContext& c, ValueId gv, const Shape target, const std::string& name,
                  std::optional<DType> out = std::nullopt) {
  const Shape s = c.value(gv).shape;
  if (s == target) return gv;
  Attrs a = shape_attrs(is_suffix(target, s) ? target : Shape{});
  if (out && *out != c.value(gv).dtype) a.set("dtype", std::string(dtype_name(*out)));
  if (is_suffix(target, s)) return c.emit(OpKind::sum_to, name, {gv}, a);
  // A one-element b that is not a suffix (e.g. [1] against [4, 3]).
  ValueId total = c.emit(OpKind::sum_to, name + ".sum", {gv}, a);
  return c.emit(OpKind::reshape, name, {total}, shape_attrs(target));
}

void grad_add(GradContext& c) {
  c.give(0, c.dy());
  if (c.wants(1)) {
    c.give(1, reduce_to(c, c.dy(), c.value(c.x(1)).shape, c.name(1), c.grad_dtype(1)));
  }
}

void grad_sub(GradContext& c) {
  c.give(0, c.dy());
  if (c.wants(1)) {
    const Shape bs = c.value(c.x(1)).shape;  // a copy: emit() may move values
    ValueId r = reduce_to(c, c.dy(), bs, c.name(1) + ".sum");
    c.give(1, c.emit(OpKind::scale, c.name(1), {r}, Attrs().set("alpha", -1.0)));
  }
}

void grad_mul(GradContext& c) {
  if (c.wants(0)) c.give(0, c.emit(OpKind::mul, c.name(0), {c.dy(), c.x(1)}));
  if (c.wants(1)) {
    const Shape bs = c.value(c.x(1)).shape;  // a copy: emit() may move values
    if (bs == c.value(c.x(0)).shape) {
      c.give(1, c.emit(OpKind::mul, c.name(1), {c.dy(), c.x(0)}));
    } else {
      ValueId prod = c.emit(OpKind::mul, c.name(1) + ".full", {c.dy(), c.x(0)});
      c.give(1, reduce_to(c, prod, bs, c.name(1)));
    }
  }
}

// ---- scale ----

std::vector<ValueType> infer_same_float(const InferContext& c) {
  c.expect_float(0, "x");
  return {{c.shape(0), c.dtype(0)}};
}

std::vector<ValueType> infer_scale(const InferContext& c) {
  (void)c.attrs().f("alpha");  // validates that the attribute is present
  return infer_same_float(c);
}

void grad_scale(GradContext& c) {
  c.give(0, c.emit(OpKind::scale, c.name(0), {c.dy()}, Attrs().set("alpha", c.attrs().f("alpha"))));
}

// ---- unary ----

UnaryOp unary_of(OpKind op) {
  switch (op) {
    case OpKind::relu:
      return UnaryOp::relu;
    case OpKind::gelu:
      return UnaryOp::gelu;
    case OpKind::tanh:
      return UnaryOp::tanh;
    default:
      return UnaryOp::sigmoid;
  }
}

double unary_cost(UnaryOp u) {
  switch (u) {
    case UnaryOp::relu:
      return 1;
    case UnaryOp::gelu:
      return 8;
    case UnaryOp::tanh:
      return 4;
    case UnaryOp::sigmoid:
      return 4;
  }
  return 1;
}

double flops_unary(const Graph& g, const Node& n) {
  return unary_cost(unary_of(n.op)) * numel_of(g, n.outputs[0]);
}

void grad_unary(GradContext& c) {
  c.give(0, c.emit(OpKind::unary_grad, c.name(0), {c.x(0), c.y(), c.dy()},
                   Attrs().set("unary", static_cast<int64_t>(unary_of(c.node().op)))));
}

std::vector<ValueType> infer_unary_grad(const InferContext& c) {
  const int64_t u = c.attrs().i("unary");
  if (u < 0 || u > static_cast<int64_t>(UnaryOp::sigmoid)) {
    c.fail(fmt::format("unknown unary operator #{}", u));
  }
  for (int i = 0; i < 3; ++i) {
    if (c.shape(i) != c.shape(0) || c.dtype(i) != c.dtype(0)) {
      c.fail("x, y and dy must have equal shapes and dtypes");
    }
  }
  c.expect_float(0, "x");
  return {{c.shape(0), c.dtype(0)}};
}

double flops_unary_grad(const Graph& g, const Node& n) {
  // The derivative costs about as much as the function, plus the multiply by dy.
  return (unary_cost(static_cast<UnaryOp>(n.attrs.i("unary"))) + 1) * numel_of(g, n.outputs[0]);
}

OpDef binary(OpKind op, std::string_view name, void (*grad)(GradContext&)) {
  OpDef d;
  d.op = op;
  d.name = name;
  d.min_inputs = d.max_inputs = 2;
  d.infer = infer_binary;
  d.flops = flops_per_output;
  d.grad = grad;
  d.recomputable = true;
  return d;
}

OpDef unary(OpKind op, std::string_view name) {
  OpDef d;
  d.op = op;
  d.name = name;
  d.infer = infer_same_float;
  d.flops = flops_unary;
  d.grad = grad_unary;
  d.recomputable = true;
  return d;
}

}  // namespace

void register_elementwise_ops(std::vector<OpDef>& t) {
  t.push_back(binary(OpKind::add, "add", grad_add));
  t.push_back(binary(OpKind::sub, "sub", grad_sub));
  t.push_back(binary(OpKind::mul, "mul", grad_mul));
  {
    OpDef d;
    d.op = OpKind::scale;
    d.name = "scale";
    d.infer = infer_scale;
    d.flops = flops_per_output;
    d.grad = grad_scale;
    d.recomputable = true;
    t.push_back(d);
  }
  t.push_back(unary(OpKind::relu, "relu"));
  t.push_back(unary(OpKind::gelu, "gelu"));
  t.push_back(unary(OpKind::tanh, "tanh"));
  t.push_back(unary(OpKind::sigmoid, "sigmoid"));
  {
    OpDef d;
    d.op = OpKind::unary_grad;
    d.name = "unary_grad";
    d.min_inputs = d.max_inputs = 3;
    d.infer = infer_unary_grad;
    d.flops = flops_unary_grad;
    t.push_back(d);
  }
}

}  // namespace mt
