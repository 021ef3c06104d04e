// Normalisations and losses over the last axis: softmax, log_softmax,
// layer_norm, cross_entropy, and their backward operators.
//
// FLOP conventions (per element of the normalised tensor): softmax 5 (max,
// subtract, exp, sum, divide), its backward 4; log_softmax 5, backward 3;
// layer_norm 8 (mean, variance, normalise, scale and shift), backward 14;
// cross_entropy 5 (a log-softmax plus the pick), backward 4; the
// vocabulary-parallel pieces: row_max 1, vocab_ce_stats 3, its backward 4,
// vocab_ce_loss and its backward 3 per element of their [N, 2] input.
#include <fmt/format.h>

#include "meshtrain/graph/op_registry.h"

namespace mt {

namespace {

// Saved statistics are f64 for f64 inputs and f32 otherwise (backend.h).
DType stat_dtype(DType x) {
  return x == DType::f64 ? DType::f64 : DType::f32;
}

template <int PerElement>
double flops_in0(const Graph& g, const Node& n) {
  return PerElement * numel_of(g, n.inputs[0]);
}

// ---- softmax / log_softmax ----

std::vector<ValueType> infer_softmax(const InferContext& c) {
  c.expect_float(0, "x");
  const Shape& x = c.shape(0);
  if (x.rank() < 1) c.fail("x must have rank >= 1");
  if (c.attrs().b_or("causal", false)) {
    if (x.rank() < 2) c.fail("causal softmax needs x of shape [..., T, S]");
    if (x[-2] > x[-1]) {
      c.fail(fmt::format("causal softmax needs T <= S (rows {} > columns {})", x[-2], x[-1]));
    }
  }
  return {{x, c.dtype(0)}};
}

std::vector<ValueType> infer_y_dy(const InferContext& c) {
  c.expect_float(0, "y");
  if (c.shape(0) != c.shape(1) || c.dtype(0) != c.dtype(1)) {
    c.fail("y and dy must have equal shapes and dtypes");
  }
  return {{c.shape(0), c.dtype(0)}};
}

void grad_softmax(GradContext& c) {
  c.give(0, c.emit(OpKind::softmax_grad, c.name(0), {c.y(), c.dy()}));
}

void grad_log_softmax(GradContext& c) {
  c.give(0, c.emit(OpKind::log_softmax_grad, c.name(0), {c.y(), c.dy()}));
}

// ---- layer_norm ----

std::vector<ValueType> infer_layer_norm(const InferContext& c) {
  (void)c.attrs().f("eps");
  c.expect_float(0, "x");
  const Shape& x = c.shape(0);
  if (x.rank() < 1) c.fail("x must have rank >= 1");
  const Shape feat{x[-1]};
  for (int i = 1; i <= 2; ++i) {
    if (c.shape(i) != feat || c.dtype(i) != c.dtype(0)) {
      c.fail(fmt::format("gamma and beta must be {}{} (x's last dimension)", dtype_name(c.dtype(0)),
                         feat.str()));
    }
  }
  const Shape rows{x.prod(0, x.rank() - 1)};
  return {{x, c.dtype(0)}, {rows, stat_dtype(c.dtype(0))}, {rows, stat_dtype(c.dtype(0))}};
}

void grad_layer_norm(GradContext& c) {
  std::vector<ValueId> outs =
      c.emit_multi(OpKind::layer_norm_grad, c.name(0), {c.dy(), c.x(0), c.x(1), c.y(1), c.y(2)});
  for (int i = 0; i < 3; ++i) {
    if (!c.wants(i)) continue;
    if (i > 0) c.graph().rename_value(outs[static_cast<size_t>(i)], c.name(i));
    c.give(i, outs[static_cast<size_t>(i)]);
  }
}

std::vector<ValueType> infer_layer_norm_grad(const InferContext& c) {
  // inputs: dy, x, gamma, mean, rstd
  c.expect_float(1, "x");
  const Shape& x = c.shape(1);
  if (x.rank() < 1) c.fail("x must have rank >= 1");
  if (c.shape(0) != x || c.dtype(0) != c.dtype(1)) c.fail("dy must match x");
  if (c.shape(2) != Shape{x[-1]} || c.dtype(2) != c.dtype(1)) c.fail("gamma must match x[-1]");
  const Shape rows{x.prod(0, x.rank() - 1)};
  for (int i = 3; i <= 4; ++i) {
    if (c.shape(i) != rows || c.dtype(i) != stat_dtype(c.dtype(1))) {
      c.fail(fmt::format("mean and rstd must be {}{}", dtype_name(stat_dtype(c.dtype(1))),
                         rows.str()));
    }
  }
  return {{x, c.dtype(1)}, {c.shape(2), c.dtype(2)}, {c.shape(2), c.dtype(2)}};
}

// ---- cross_entropy ----

std::vector<ValueType> infer_cross_entropy(const InferContext& c) {
  c.expect_rank(0, 2, "logits");
  c.expect_float(0, "logits");
  c.expect_dtype(1, DType::i32, "labels");
  if (c.shape(1) != Shape{c.shape(0)[0]}) {
    c.fail(fmt::format("labels must be i32[{}] (one per row of logits)", c.shape(0)[0]));
  }
  return {{Shape{}, stat_dtype(c.dtype(0))}};
}

void grad_cross_entropy(GradContext& c) {
  c.give(0, c.emit(OpKind::cross_entropy_grad, c.name(0), {c.x(0), c.x(1), c.dy()}));
}

std::vector<ValueType> infer_cross_entropy_grad(const InferContext& c) {
  c.expect_rank(0, 2, "logits");
  c.expect_float(0, "logits");
  c.expect_dtype(1, DType::i32, "labels");
  if (c.shape(1) != Shape{c.shape(0)[0]}) c.fail("labels must have one entry per row of logits");
  if (c.shape(2).numel() != 1 || c.dtype(2) != stat_dtype(c.dtype(0))) {
    c.fail("dloss must be a scalar of the loss's dtype");
  }
  return {{c.shape(0), c.dtype(0)}};
}

// ---- vocabulary-parallel cross-entropy (Megatron's) ----
//
// Over logits split by vocabulary, rank r holding columns [offset, offset +
// V_r): m = all_reduce_max(row_max(logits)) (a stop-gradient: the loss does
// not depend on the shift), stats = vocab_ce_stats(logits, labels, m) summed
// over the group by g into tot, loss = vocab_ce_loss(tot, m). Each operator's
// gradient is its own (checked against finite differences in
// tests/graph/grad_check_test.cpp); composed through g's identity backward
// they give each rank softmax(logits) - onehot(labels) on its own columns,
// over N.

void expect_f32_f64(const InferContext& c, int i, const char* what) {
  if (c.dtype(i) != DType::f32 && c.dtype(i) != DType::f64) {
    c.fail(fmt::format("{} must be f32 or f64", what));
  }
}

std::vector<ValueType> infer_row_max(const InferContext& c) {
  c.expect_rank(0, 2, "x");
  expect_f32_f64(c, 0, "x");
  return {{Shape{c.shape(0)[0]}, c.dtype(0)}};
}

// attrs offset, vocab: the logits are columns [offset, offset + V) of a
// vocabulary of `vocab` (labels outside [0, vocab) are bad input).
void check_vocab_columns(const InferContext& c) {
  const int64_t off = c.attrs().i("offset"), vocab = c.attrs().i("vocab");
  if (off < 0 || off + c.shape(0)[1] > vocab) {
    c.fail(fmt::format("columns [{}, {}) (offset, offset + V) are not inside the vocabulary of {}",
                       off, off + c.shape(0)[1], vocab));
  }
}

// logits [N, V], labels i32 [N], m [N] of the logits' dtype.
void expect_logits_labels_max(const InferContext& c) {
  c.expect_rank(0, 2, "logits");
  expect_f32_f64(c, 0, "logits");
  c.expect_dtype(1, DType::i32, "labels");
  const int64_t n = c.shape(0)[0];
  if (c.shape(1) != Shape{n}) c.fail(fmt::format("labels must be i32[{}]", n));
  if (c.shape(2) != Shape{n} || c.dtype(2) != c.dtype(0)) {
    c.fail(fmt::format("m must be {}[{}] (one maximum per row)", dtype_name(c.dtype(0)), n));
  }
  check_vocab_columns(c);
}

std::vector<ValueType> infer_vocab_ce_stats(const InferContext& c) {
  expect_logits_labels_max(c);
  return {{Shape{c.shape(0)[0], 2}, c.dtype(0)}};
}

std::vector<ValueType> infer_vocab_ce_stats_grad(const InferContext& c) {
  expect_logits_labels_max(c);
  if (c.shape(3) != Shape{c.shape(0)[0], 2} || c.dtype(3) != c.dtype(0)) {
    c.fail(fmt::format("dy must be {}[{}, 2]", dtype_name(c.dtype(0)), c.shape(0)[0]));
  }
  return {{c.shape(0), c.dtype(0)}, {c.shape(2), c.dtype(0)}};
}

void grad_vocab_ce_stats(GradContext& c) {
  std::vector<ValueId> d =
      c.emit_multi(OpKind::vocab_ce_stats_grad, c.name(0), {c.x(0), c.x(1), c.x(2), c.dy()},
                   Attrs().set("offset", c.attrs().i("offset")).set("vocab", c.attrs().i("vocab")));
  c.give(0, d[0]);
  c.give(2, d[1]);
}

void expect_totals(const InferContext& c) {
  c.expect_rank(0, 2, "tot");
  expect_f32_f64(c, 0, "tot");
  if (c.shape(0)[1] != 2) c.fail("tot must be [N, 2] (sum of exponentials, the label's logit)");
}

std::vector<ValueType> infer_vocab_ce_loss(const InferContext& c) {
  expect_totals(c);
  if (c.shape(1) != Shape{c.shape(0)[0]} || c.dtype(1) != c.dtype(0)) {
    c.fail(fmt::format("m must be {}[{}]", dtype_name(c.dtype(0)), c.shape(0)[0]));
  }
  return {{Shape{}, c.dtype(0)}};
}

std::vector<ValueType> infer_vocab_ce_loss_grad(const InferContext& c) {
  expect_totals(c);
  if (c.shape(1).numel() != 1 || c.dtype(1) != c.dtype(0)) {
    c.fail("dloss must be a scalar of tot's dtype");
  }
  return {{c.shape(0), c.dtype(0)}};
}

// d/dtot = [1 / (N tot0), -1 / N] dloss; d/dm = dloss / N on every row.
void grad_vocab_ce_loss(GradContext& c) {
  c.give(0, c.emit(OpKind::vocab_ce_loss_grad, c.name(0), {c.x(0), c.dy()}));
  if (!c.wants(1)) return;
  const int64_t n = c.value(c.x(0)).shape[0];
  ValueId b = c.emit(OpKind::broadcast_to, c.name(1) + ".rows", {c.dy()}, shape_attrs(Shape{n}));
  c.give(1, c.emit(OpKind::scale, c.name(1), {b},
                   Attrs().set("alpha", n == 0 ? 0.0 : 1.0 / static_cast<double>(n))));
}

double flops_rows(const Graph& g, const Node& n) {
  return 3 * numel_of(g, n.inputs[0]);
}

OpDef def(OpKind op, std::string_view name, int nin,
          std::vector<ValueType> (*infer)(const InferContext&),
          double (*flops)(const Graph&, const Node&), void (*grad)(GradContext&)) {
  OpDef d;
  d.op = op;
  d.name = name;
  d.min_inputs = d.max_inputs = nin;
  d.infer = infer;
  d.flops = flops;
  d.grad = grad;
  return d;
}

}  // namespace

void register_norm_ops(std::vector<OpDef>& t) {
  OpDef sm = def(OpKind::softmax, "softmax", 1, infer_softmax, flops_in0<5>, grad_softmax);
  sm.recomputable = true;
  t.push_back(sm);
  t.push_back(def(OpKind::softmax_grad, "softmax_grad", 2, infer_y_dy, flops_in0<4>, nullptr));
  OpDef lsm =
      def(OpKind::log_softmax, "log_softmax", 1, infer_softmax, flops_in0<5>, grad_log_softmax);
  lsm.recomputable = true;
  t.push_back(lsm);
  t.push_back(
      def(OpKind::log_softmax_grad, "log_softmax_grad", 2, infer_y_dy, flops_in0<3>, nullptr));

  OpDef ln =
      def(OpKind::layer_norm, "layer_norm", 3, infer_layer_norm, flops_in0<8>, grad_layer_norm);
  ln.extra_output_names = {"mean", "rstd"};
  ln.recomputable = true;
  t.push_back(ln);
  OpDef lng = def(OpKind::layer_norm_grad, "layer_norm_grad", 5, infer_layer_norm_grad,
                  flops_in0<14>, nullptr);
  lng.extra_output_names = {"dgamma", "dbeta"};
  t.push_back(lng);

  t.push_back(def(OpKind::cross_entropy, "cross_entropy", 2, infer_cross_entropy, flops_in0<5>,
                  grad_cross_entropy));
  t.push_back(def(OpKind::cross_entropy_grad, "cross_entropy_grad", 3, infer_cross_entropy_grad,
                  flops_in0<4>, nullptr));

  OpDef rm = def(OpKind::row_max, "row_max", 1, infer_row_max, flops_in0<1>, nullptr);
  rm.diff_outputs = 0;  // a stop-gradient (see above)
  t.push_back(rm);
  // exp, subtract, add per element of the local logits
  t.push_back(def(OpKind::vocab_ce_stats, "vocab_ce_stats", 3, infer_vocab_ce_stats, flops_in0<3>,
                  grad_vocab_ce_stats));
  OpDef sg = def(OpKind::vocab_ce_stats_grad, "vocab_ce_stats_grad", 4, infer_vocab_ce_stats_grad,
                 flops_in0<4>, nullptr);
  sg.extra_output_names = {"dm"};
  t.push_back(sg);
  t.push_back(def(OpKind::vocab_ce_loss, "vocab_ce_loss", 2, infer_vocab_ce_loss, flops_rows,
                  grad_vocab_ce_loss));
  t.push_back(def(OpKind::vocab_ce_loss_grad, "vocab_ce_loss_grad", 2, infer_vocab_ce_loss_grad,
                  flops_rows, nullptr));
}

}  // namespace mt
