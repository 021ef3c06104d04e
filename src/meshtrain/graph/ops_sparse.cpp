// Sparse (CSR) operators for graph neural networks: the sparse-dense product
// (with its transposed product and sampled dense-dense product as gradients),
// max aggregation with argmax, and softmax over each row's entries.
//
// How the IR carries a sparse matrix: as two i32 inputs of the operator,
// row_ptr [N+1] and col_idx [E] (edge values, when there are any, are a float
// input [E] of their own, so they may be constants -- GCN's normalisation --
// or computed and differentiated -- GAT's attention). The graph structure is
// therefore data bound to the executor like any other input (models list it
// among ModelGraph::constants), and shape inference knows N, E and M from the
// inputs' shapes alone; the kernels validate the contents on every call.
#include <fmt/format.h>

#include "meshtrain/graph/op_registry.h"

namespace mt {

namespace {

// row_ptr i32 [N+1] at slot `rp`, col_idx i32 [E] at slot `ci` (if >= 0);
// returns {N, E}.
std::pair<int64_t, int64_t> csr_dims(const InferContext& c, int rp, int ci) {
  c.expect_dtype(rp, DType::i32, "row_ptr");
  c.expect_rank(rp, 1, "row_ptr");
  if (c.shape(rp)[0] < 1) c.fail("row_ptr must have at least one entry (rows + 1)");
  int64_t e = -1;
  if (ci >= 0) {
    c.expect_dtype(ci, DType::i32, "col_idx");
    c.expect_rank(ci, 1, "col_idx");
    e = c.shape(ci)[0];
  }
  return {c.shape(rp)[0] - 1, e};
}

void expect_f32_f64(const InferContext& c, int i, const char* what) {
  if (c.dtype(i) != DType::f32 && c.dtype(i) != DType::f64) {
    c.fail(fmt::format("{} must be f32 or f64 (sparse kernels have no 16-bit path)", what));
  }
}

// ---- spmm ----

std::vector<ValueType> infer_spmm(const InferContext& c) {
  auto [n, e] = csr_dims(c, 0, 1);
  c.expect_rank(2, 2, "x");
  expect_f32_f64(c, 2, "x");
  if (c.num_inputs() == 4) {
    c.expect_rank(3, 1, "w");
    c.expect_same_dtype(2, 3);
    if (c.shape(3)[0] != e) c.fail(fmt::format("w must have one value per entry ({})", e));
  }
  return {{Shape{n, c.shape(2)[1]}, c.dtype(2)}};
}

double flops_spmm(const Graph& g, const Node& n) {
  return 2.0 * numel_of(g, n.inputs[1]) * static_cast<double>(g.value(n.inputs[2]).shape[1]);
}

// y = A x:  dx = A^T dy,  dw[e] = dot(dy[row(e)], x[col(e)]).
void grad_spmm(GradContext& c) {
  const bool has_w = c.num_inputs() == 4;
  if (c.wants(2)) {
    std::vector<ValueId> in = {c.x(0), c.x(1), c.dy()};
    if (has_w) in.push_back(c.x(3));
    const int64_t rows = c.value(c.x(2)).shape[0];
    c.give(2, c.emit(OpKind::spmm_t, c.name(2), in, Attrs().set("rows", rows)));
  }
  if (has_w && c.wants(3)) {
    c.give(3, c.emit(OpKind::sddmm, c.name(3), {c.x(0), c.x(1), c.dy(), c.x(2)}));
  }
}

std::vector<ValueType> infer_spmm_t(const InferContext& c) {
  auto [n, e] = csr_dims(c, 0, 1);
  c.expect_rank(2, 2, "dy");
  expect_f32_f64(c, 2, "dy");
  if (c.shape(2)[0] != n) c.fail(fmt::format("dy must have one row per CSR row ({})", n));
  if (c.num_inputs() == 4) {
    c.expect_rank(3, 1, "w");
    c.expect_same_dtype(2, 3);
    if (c.shape(3)[0] != e) c.fail(fmt::format("w must have one value per entry ({})", e));
  }
  const int64_t rows = c.attrs().i("rows");
  if (rows < 0) c.fail(fmt::format("rows {} must be >= 0", rows));
  return {{Shape{rows, c.shape(2)[1]}, c.dtype(2)}};
}

std::vector<ValueType> infer_sddmm(const InferContext& c) {
  auto [n, e] = csr_dims(c, 0, 1);
  c.expect_rank(2, 2, "a");
  c.expect_rank(3, 2, "b");
  expect_f32_f64(c, 2, "a");
  c.expect_same_dtype(2, 3);
  if (c.shape(2)[0] != n) c.fail(fmt::format("a must have one row per CSR row ({})", n));
  if (c.shape(2)[1] != c.shape(3)[1]) c.fail("a and b must have the same number of columns");
  return {{Shape{e}, c.dtype(2)}};
}

double flops_sddmm(const Graph& g, const Node& n) {
  return 2.0 * numel_of(g, n.inputs[1]) * static_cast<double>(g.value(n.inputs[2]).shape[1]);
}

// ---- spmm_max ----

std::vector<ValueType> infer_spmm_max(const InferContext& c) {
  auto [n, e] = csr_dims(c, 0, 1);
  (void)e;
  c.expect_rank(2, 2, "x");
  expect_f32_f64(c, 2, "x");
  const Shape y{n, c.shape(2)[1]};
  return {{y, c.dtype(2)}, {y, DType::i32}};
}

double flops_spmm_max(const Graph& g, const Node& n) {
  return numel_of(g, n.inputs[1]) * static_cast<double>(g.value(n.inputs[2]).shape[1]);
}

void grad_spmm_max(GradContext& c) {
  c.give(2, c.emit(OpKind::spmm_max_grad, c.name(2), {c.dy(), c.y(1)},
                   shape_attrs(c.value(c.x(2)).shape)));
}

std::vector<ValueType> infer_spmm_max_grad(const InferContext& c) {
  const Shape x = c.shape_attr("shape");
  c.expect_rank(0, 2, "dy");
  expect_f32_f64(c, 0, "dy");
  c.expect_dtype(1, DType::i32, "argmax");
  if (c.shape(1) != c.shape(0)) c.fail("argmax must have dy's shape");
  if (x.rank() != 2 || x[1] != c.shape(0)[1]) {
    c.fail(fmt::format("x shape {} must be rank 2 with dy's columns", x.str()));
  }
  return {{x, c.dtype(0)}};
}

double flops_spmm_max_grad(const Graph& g, const Node& n) {
  return numel_of(g, n.inputs[0]);
}

// ---- edge_softmax ----

std::vector<ValueType> infer_edge_softmax(const InferContext& c) {
  csr_dims(c, 0, -1);
  c.expect_rank(1, 1, "x");
  expect_f32_f64(c, 1, "x");
  return {{c.shape(1), c.dtype(1)}};
}

double flops_edge_softmax(const Graph& g, const Node& n) {
  return 5.0 * numel_of(g, n.inputs[1]);
}

void grad_edge_softmax(GradContext& c) {
  c.give(1, c.emit(OpKind::edge_softmax_grad, c.name(1), {c.x(0), c.y(), c.dy()}));
}

std::vector<ValueType> infer_edge_softmax_grad(const InferContext& c) {
  csr_dims(c, 0, -1);
  c.expect_rank(1, 1, "y");
  expect_f32_f64(c, 1, "y");
  c.expect_same_dtype(1, 2);
  if (c.shape(2) != c.shape(1)) c.fail("dy must have y's shape");
  return {{c.shape(1), c.dtype(1)}};
}

double flops_edge_softmax_grad(const Graph& g, const Node& n) {
  return 4.0 * numel_of(g, n.inputs[1]);
}

}  // namespace

void register_sparse_ops(std::vector<OpDef>& t) {
  t.push_back(make_op_def(OpKind::spmm, "spmm", 3, 4, infer_spmm, flops_spmm, grad_spmm));
  t.push_back(make_op_def(OpKind::spmm_t, "spmm_t", 3, 4, infer_spmm_t, flops_spmm, nullptr));
  t.push_back(make_op_def(OpKind::sddmm, "sddmm", 4, 4, infer_sddmm, flops_sddmm, nullptr));
  OpDef mx = make_op_def(OpKind::spmm_max, "spmm_max", 3, 3, infer_spmm_max, flops_spmm_max,
                         grad_spmm_max);
  mx.extra_output_names = {"argmax"};
  t.push_back(mx);
  t.push_back(make_op_def(OpKind::spmm_max_grad, "spmm_max_grad", 2, 2, infer_spmm_max_grad,
                          flops_spmm_max_grad, nullptr));
  t.push_back(make_op_def(OpKind::edge_softmax, "edge_softmax", 2, 2, infer_edge_softmax,
                          flops_edge_softmax, grad_edge_softmax));
  t.push_back(make_op_def(OpKind::edge_softmax_grad, "edge_softmax_grad", 3, 3,
                          infer_edge_softmax_grad, flops_edge_softmax_grad, nullptr));
}

}  // namespace mt
