// Operators that move or convert data without arithmetic (reshape, permute,
// cast, broadcast_to, fill) and the one reduction the others need (sum_to).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "meshtrain/graph/op_registry.h"

namespace mt {

namespace {

double no_flops(const Graph&, const Node&) {
  return 0;
}

// ---- reshape ----

std::vector<ValueType> infer_reshape(const InferContext& c) {
  std::vector<int64_t> dims = c.attrs().ints("shape");
  int infer_at = -1;
  int64_t known = 1;
  for (size_t i = 0; i < dims.size(); ++i) {
    if (dims[i] == -1 && infer_at < 0) {
      infer_at = static_cast<int>(i);
    } else if (dims[i] < 0) {
      c.fail(fmt::format("bad target shape [{}]: at most one -1 and no other negative dimension",
                         fmt::join(dims, ", ")));
    } else {
      known *= dims[i];
    }
  }
  const int64_t n = c.shape(0).numel();
  if (infer_at >= 0) {
    if (known == 0 || n % known != 0) {
      c.fail(fmt::format("cannot reshape {} to [{}]", c.desc(0), fmt::join(dims, ", ")));
    }
    dims[static_cast<size_t>(infer_at)] = n / known;
    known = n;
  }
  if (known != n) {
    c.fail_shown(fmt::format("cannot reshape {} ({} elements) to [{}] ({} elements)", c.desc(0), n,
                             fmt::join(dims, ", "), known));
  }
  return {{Shape(dims), c.dtype(0)}};
}

void grad_reshape(GradContext& c) {
  c.give(0, c.emit(OpKind::reshape, c.name(0), {c.dy()}, shape_attrs(c.value(c.x(0)).shape)));
}

// ---- permute ----

std::vector<ValueType> infer_permute(const InferContext& c) {
  const std::vector<int64_t>& perm = c.attrs().ints("perm");
  const Shape& x = c.shape(0);
  std::vector<bool> seen(perm.size(), false);
  bool ok = static_cast<int>(perm.size()) == x.rank();
  for (int64_t p : perm) {
    if (!ok) break;
    ok = p >= 0 && p < x.rank() && !seen[static_cast<size_t>(p)];
    if (ok) seen[static_cast<size_t>(p)] = true;
  }
  if (!ok) {
    c.fail(fmt::format("perm [{}] is not a permutation of the {} axes of x", fmt::join(perm, ", "),
                       x.rank()));
  }
  std::vector<int64_t> dims;
  for (int64_t p : perm) dims.push_back(x.dims()[static_cast<size_t>(p)]);
  return {{Shape(dims), c.dtype(0)}};
}

void grad_permute(GradContext& c) {
  const std::vector<int64_t>& perm = c.attrs().ints("perm");
  std::vector<int64_t> inv(perm.size());
  for (size_t i = 0; i < perm.size(); ++i)
    inv[static_cast<size_t>(perm[i])] = static_cast<int64_t>(i);
  c.give(0, c.emit(OpKind::permute, c.name(0), {c.dy()}, Attrs().set("perm", inv)));
}

// ---- cast ----

std::vector<ValueType> infer_cast(const InferContext& c) {
  DType to = DType::f32;
  try {
    to = parse_dtype(c.attrs().s("dtype"));
  } catch (const ConfigError& e) {
    c.fail(e.what());
  }
  if (!is_float(c.dtype(0)) || !is_float(to)) {
    c.fail(fmt::format("casts only between float dtypes: {} to {}", c.desc(0), dtype_name(to)));
  }
  return {{c.shape(0), to}};
}

// The gradient arrives in x's dtype already when it was carried wide (see
// GradContext::grad_dtype); then it passes through unchanged.
void grad_cast(GradContext& c) {
  const DType x = c.value(c.x(0)).dtype;
  if (c.value(c.dy()).dtype == x) {
    c.give(0, c.dy());
    return;
  }
  c.give(0, c.emit(OpKind::cast, c.name(0), {c.dy()},
                   Attrs().set("dtype", std::string(dtype_name(x)))));
}

// ---- sum_to / broadcast_to ----

// Optional attr dtype: a 16-bit x may sum into an f32 output (a gradient kept
// wide, see GradContext::grad_dtype).
std::vector<ValueType> infer_sum_to(const InferContext& c) {
  Shape to = c.shape_attr("shape");
  c.expect_float(0, "x");
  if (!is_suffix(to, c.shape(0))) {
    c.fail(fmt::format("target shape {} is not a suffix of x's shape", to.str()));
  }
  DType out = c.dtype(0);
  if (c.attrs().has("dtype")) {
    try {
      out = parse_dtype(c.attrs().s("dtype"));
    } catch (const ConfigError& e) {
      c.fail(e.what());
    }
    const bool half = c.dtype(0) == DType::bf16 || c.dtype(0) == DType::f16;
    if (out != c.dtype(0) && !(half && out == DType::f32)) {
      c.fail(fmt::format("output dtype {} must be x's ({}) or f32 for a 16-bit x", dtype_name(out),
                         c.desc(0)));
    }
  }
  return {{to, out}};
}

double flops_sum_to(const Graph& g, const Node& n) {
  return numel_of(g, n.inputs[0]);
}

void grad_sum_to(GradContext& c) {
  const Value& x = c.value(c.x(0));
  const DType xt = x.dtype;
  if (c.value(c.dy()).dtype == xt) {
    c.give(0, c.emit(OpKind::broadcast_to, c.name(0), {c.dy()}, shape_attrs(x.shape)));
    return;
  }
  ValueId wide = c.emit(OpKind::broadcast_to, c.name(0) + ".wide", {c.dy()}, shape_attrs(x.shape));
  c.give(0, c.emit(OpKind::cast, c.name(0), {wide},
                   Attrs().set("dtype", std::string(dtype_name(xt)))));
}

std::vector<ValueType> infer_broadcast_to(const InferContext& c) {
  Shape to = c.shape_attr("shape");
  if (!is_suffix(c.shape(0), to)) {
    c.fail(fmt::format("x's shape is not a suffix of the target shape {}", to.str()));
  }
  return {{to, c.dtype(0)}};
}

void grad_broadcast_to(GradContext& c) {
  c.give(0, c.emit(OpKind::sum_to, c.name(0), {c.dy()}, shape_attrs(c.value(c.x(0)).shape)));
}

// ---- fill ----

std::vector<ValueType> infer_fill(const InferContext& c) {
  Shape s = c.shape_attr("shape");
  (void)c.attrs().f("value");
  try {
    return {{s, parse_dtype(c.attrs().s("dtype"))}};
  } catch (const ConfigError& e) {
    c.fail(e.what());
  }
}

OpDef def(OpKind op, std::string_view name, std::vector<ValueType> (*infer)(const InferContext&),
          double (*flops)(const Graph&, const Node&), void (*grad)(GradContext&)) {
  OpDef d;
  d.op = op;
  d.name = name;
  d.infer = infer;
  d.flops = flops;
  d.grad = grad;
  return d;
}

}  // namespace

void register_shape_ops(std::vector<OpDef>& t) {
  OpDef reshape = def(OpKind::reshape, "reshape", infer_reshape, no_flops, grad_reshape);
  reshape.view = true;
  reshape.recomputable = true;
  t.push_back(reshape);
  OpDef permute = def(OpKind::permute, "permute", infer_permute, no_flops, grad_permute);
  permute.recomputable = true;
  t.push_back(permute);
  OpDef cast = def(OpKind::cast, "cast", infer_cast, no_flops, grad_cast);
  cast.recomputable = true;
  t.push_back(cast);
  t.push_back(def(OpKind::sum_to, "sum_to", infer_sum_to, flops_sum_to, grad_sum_to));
  OpDef bcast =
      def(OpKind::broadcast_to, "broadcast_to", infer_broadcast_to, no_flops, grad_broadcast_to);
  bcast.recomputable = true;
  t.push_back(bcast);
  OpDef fill = def(OpKind::fill, "fill", infer_fill, no_flops, nullptr);
  fill.min_inputs = fill.max_inputs = 0;
  fill.recomputable = true;
  t.push_back(fill);
}

}  // namespace mt
