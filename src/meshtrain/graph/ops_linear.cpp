// Matrix multiplication (plain, transposed, batched, mixed precision) and the
// embedding lookup with its scatter-add backward.
#include <fmt/format.h>

#include "meshtrain/graph/op_registry.h"

namespace mt {

namespace {

// ---- matmul ----

struct MatmulDims {
  int64_t batch = 1, m = 0, k = 0, n = 0;
  bool batched = false;
};

// 16-bit inputs accumulate into an f32 output.
DType matmul_out_dtype(DType in) {
  return (in == DType::bf16 || in == DType::f16) ? DType::f32 : in;
}

MatmulDims matmul_dims(const InferContext& c) {
  const bool ta = c.attrs().b_or("trans_a", false);
  const bool tb = c.attrs().b_or("trans_b", false);
  const Shape& a = c.shape(0);
  const Shape& b = c.shape(1);
  auto shown = [&] {
    return fmt::format("{}{} @ {}{}", c.desc(0), ta ? "^T" : "", c.desc(1), tb ? "^T" : "");
  };
  if (c.dtype(0) != c.dtype(1)) c.fail_shown("operands differ in dtype: " + shown());
  if (!is_float(c.dtype(0))) c.fail_shown("operands must be float tensors: " + shown());
  MatmulDims d;
  if (a.rank() == 3 && (b.rank() == 3 || b.rank() == 2)) {
    d.batched = true;
    d.batch = a[0];
    if (b.rank() == 3 && b[0] != a[0]) c.fail_shown("batch dimensions differ: " + shown());
  } else if (a.rank() != 2 || b.rank() != 2) {
    c.fail_shown("operands must be rank 2, or rank 3 @ rank 3 or 2 (batched): " + shown());
  }
  const int64_t a0 = a[-2], a1 = a[-1], b0 = b[-2], b1 = b[-1];
  d.m = ta ? a1 : a0;
  d.k = ta ? a0 : a1;
  const int64_t kb = tb ? b1 : b0;
  d.n = tb ? b0 : b1;
  if (d.k != kb) c.fail_shown("inner dimensions differ: " + shown());
  return d;
}

// Optional attr out_dtype: 16-bit inputs may give a product of their own type
// (accumulated in f32, rounded once) instead of f32.
std::vector<ValueType> infer_matmul(const InferContext& c) {
  MatmulDims d = matmul_dims(c);
  Shape out = d.batched ? Shape{d.batch, d.m, d.n} : Shape{d.m, d.n};
  DType t = matmul_out_dtype(c.dtype(0));
  if (c.attrs().has("out_dtype")) {
    DType want = t;
    try {
      want = parse_dtype(c.attrs().s("out_dtype"));
    } catch (const ConfigError& e) {
      c.fail(e.what());
    }
    if (want != t && want != c.dtype(0)) {
      c.fail(fmt::format("out_dtype {} must be f32 or the inputs' dtype ({})", dtype_name(want),
                         c.desc(0)));
    }
    t = want;
  }
  return {{out, t}};
}

double flops_matmul(const Graph& g, const Node& n) {
  const Shape& c = g.value(n.outputs[0]).shape;
  const Shape& a = g.value(n.inputs[0]).shape;
  const int64_t k = n.attrs.b_or("trans_a", false) ? a[-2] : a[-1];
  return 2.0 * static_cast<double>(c.numel()) * static_cast<double>(k);
}

Attrs mm_attrs(bool ta, bool tb) {
  Attrs a;
  a.set("trans_a", ta).set("trans_b", tb);
  return a;
}

// op(a) @ op(b) as a backward node named `name`, of dtype `dtype`: the
// matmul's natural output type (f32 for 16-bit inputs), or the inputs' own
// 16-bit type (the product rounded once).
ValueId mm(GradContext& c, const std::string& name, ValueId a, ValueId b, bool ta, bool tb,
           DType dtype) {
  Attrs attrs = mm_attrs(ta, tb);
  if (matmul_out_dtype(c.value(a).dtype) != dtype) {
    attrs.set("out_dtype", std::string(dtype_name(dtype)));
  }
  return c.emit(OpKind::matmul, name, {a, b}, attrs);
}

// With C = op_a(A) @ op_b(B):  dop_a(A) = dC @ op_b(B)^T,  dop_b(B) = op_a(A)^T @ dC.
void grad_matmul(GradContext& c) {
  const bool ta = c.attrs().b_or("trans_a", false);
  const bool tb = c.attrs().b_or("trans_b", false);
  ValueId a = c.x(0), b = c.x(1), dy = c.dy();
  // Copies: emitting nodes may move the graph's values.
  const Shape a_shape = c.value(a).shape;
  const Shape b_shape = c.value(b).shape;
  const DType in = c.value(a).dtype;
  if (c.value(dy).dtype != in) {
    dy = c.emit(OpKind::cast, c.node_name("dy_" + std::string(dtype_name(in))), {dy},
                Attrs().set("dtype", std::string(dtype_name(in))));
  }
  const bool shared_b = a_shape.rank() == 3 && b_shape.rank() == 2;
  // Operands that are 16-bit copies of f32 values get f32 gradients (no
  // rounding of the f32 product; see GradContext::grad_dtype).
  const DType ga = c.grad_dtype(0), gb = c.grad_dtype(1);

  if (c.wants(0)) {
    if (!ta) {
      c.give(0, mm(c, c.name(0), dy, b, false, !tb, ga));
    } else if (!shared_b) {
      c.give(0, mm(c, c.name(0), b, dy, tb, true, ga));
    } else {
      // dA^T per batch entry; a rank-2 left operand cannot be batched, so transpose after.
      ValueId t = mm(c, c.name(0) + ".t", dy, b, false, !tb, ga);
      c.give(0, c.emit(OpKind::permute, c.name(0), {t},
                       Attrs().set("perm", std::vector<int64_t>{0, 2, 1})));
    }
  }
  if (c.wants(1)) {
    if (!shared_b) {
      if (!tb) {
        c.give(1, mm(c, c.name(1), a, dy, !ta, false, gb));
      } else {
        c.give(1, mm(c, c.name(1), dy, a, true, ta, gb));
      }
    } else {
      // b is shared across the batch: its gradient sums over it, which is one
      // matmul over the batch folded into the rows.
      ValueId ae = a;
      if (ta)
        ae = c.emit(OpKind::permute, c.name(1) + ".a", {a},
                    Attrs().set("perm", std::vector<int64_t>{0, 2, 1}));
      const Shape ys = c.value(dy).shape;
      const int64_t rows = ys[0] * ys[1];
      const int64_t kdim = c.value(ae).shape[2];
      ValueId a2 = c.emit(OpKind::reshape, c.name(1) + ".a2", {ae}, shape_attrs(Shape{rows, kdim}));
      ValueId d2 =
          c.emit(OpKind::reshape, c.name(1) + ".dy2", {dy}, shape_attrs(Shape{rows, ys[2]}));
      c.give(1, tb ? mm(c, c.name(1), d2, a2, true, false, gb)
                   : mm(c, c.name(1), a2, d2, true, false, gb));
    }
  }
}

// ---- embedding ----

// A vocabulary-parallel table (attrs offset, vocab): rows [offset, offset +
// rows) of a vocabulary of `vocab`; ids of other rows look up zeros.
void check_vocab_range(const InferContext& c, int64_t rows) {
  const bool off = c.attrs().has("offset"), voc = c.attrs().has("vocab");
  if (!off && !voc) return;
  if (!off || !voc) c.fail("offset and vocab come together (a vocabulary-parallel table)");
  const int64_t o = c.attrs().i("offset"), v = c.attrs().i("vocab");
  if (o < 0 || o + rows > v) {
    c.fail(fmt::format("rows [{}, {}) of the table are not inside the vocabulary of {}", o,
                       o + rows, v));
  }
}

Attrs vocab_range(const Attrs& a) {
  Attrs r;
  if (a.has("offset")) r.set("offset", a.i("offset"));
  if (a.has("vocab")) r.set("vocab", a.i("vocab"));
  return r;
}

std::vector<ValueType> infer_embedding(const InferContext& c) {
  c.expect_rank(0, 2, "table");
  c.expect_float(0, "table");
  c.expect_dtype(1, DType::i32, "ids");
  check_vocab_range(c, c.shape(0)[0]);
  std::vector<int64_t> dims = c.shape(1).dims();
  dims.push_back(c.shape(0)[1]);
  return {{Shape(dims), c.dtype(0)}};
}

void grad_embedding(GradContext& c) {
  Attrs a = vocab_range(c.attrs());
  a.set("shape", dims_of(c.value(c.x(0)).shape));
  c.give(0, c.emit(OpKind::embedding_grad, c.name(0), {c.dy(), c.x(1)}, std::move(a)));
}

std::vector<ValueType> infer_embedding_grad(const InferContext& c) {
  Shape table = c.shape_attr("shape");
  if (table.rank() != 2) c.fail(fmt::format("table shape {} must have rank 2", table.str()));
  check_vocab_range(c, table[0]);
  c.expect_float(0, "dy");
  c.expect_dtype(1, DType::i32, "ids");
  std::vector<int64_t> want = c.shape(1).dims();
  want.push_back(table[1]);
  if (c.shape(0) != Shape(want)) {
    c.fail(fmt::format("dy must be ids' shape + [{}] = {}", table[1], Shape(want).str()));
  }
  return {{table, c.dtype(0)}};
}

double no_flops(const Graph&, const Node&) {
  return 0;
}
double flops_embedding_grad(const Graph& g, const Node& n) {
  return numel_of(g, n.inputs[0]);
}

}  // namespace

void register_linear_ops(std::vector<OpDef>& t) {
  OpDef mm_def;
  mm_def.op = OpKind::matmul;
  mm_def.name = "matmul";
  mm_def.min_inputs = mm_def.max_inputs = 2;
  mm_def.infer = infer_matmul;
  mm_def.flops = flops_matmul;
  mm_def.grad = grad_matmul;
  t.push_back(mm_def);

  OpDef emb;
  emb.op = OpKind::embedding;
  emb.name = "embedding";
  emb.min_inputs = emb.max_inputs = 2;
  emb.infer = infer_embedding;
  emb.flops = no_flops;
  emb.grad = grad_embedding;
  t.push_back(emb);

  OpDef emb_grad;
  emb_grad.op = OpKind::embedding_grad;
  emb_grad.name = "embedding_grad";
  emb_grad.min_inputs = emb_grad.max_inputs = 2;
  emb_grad.infer = infer_embedding_grad;
  emb_grad.flops = flops_embedding_grad;
  t.push_back(emb_grad);
}

}  // namespace mt
