// Collective operators (graph/collective.h): shape inference, gradient rules
// and the typed attributes. They do no arithmetic the FLOP count sees (the
// reduction inside a collective is comm's cost); what they move is in
// collective_payload_bytes() and, per algorithm, in comm's cost functions.
#include <algorithm>
#include <numeric>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "meshtrain/graph/collective.h"
#include "meshtrain/graph/op_registry.h"

namespace mt {

namespace {

bool pieces_op(OpKind op) {
  return op == OpKind::all_gather || op == OpKind::reduce_scatter || op == OpKind::all_to_all ||
         op == OpKind::gather_from_group || op == OpKind::split_to_group;
}

double no_flops(const Graph&, const Node&) {
  return 0;
}

int64_t sum_of(const std::vector<int64_t>& v) {
  return std::accumulate(v.begin(), v.end(), int64_t{0});
}

// Checks group, and for all_gather / reduce_scatter dim, sizes and rank
// against x; returns the attributes.
CollectiveAttrs checked_attrs(const InferContext& c) {
  c.expect_float(0, "x");
  const CollectiveAttrs a = CollectiveAttrs::of(c.node());
  if (a.group < 0) c.fail(fmt::format("group {} is negative", a.group));
  if (!pieces_op(c.node().op)) return a;
  const Shape& x = c.shape(0);
  if (a.dim < 0 || a.dim >= x.rank()) {
    c.fail(fmt::format("dim {} is not a dimension of x", a.dim));
  }
  if (a.sizes.empty()) c.fail("sizes is empty: one piece size per group rank is needed");
  for (int64_t s : a.sizes) {
    if (s < 0) c.fail(fmt::format("sizes [{}] has a negative piece", fmt::join(a.sizes, ", ")));
  }
  if (a.rank < 0 || a.rank >= a.group_size()) {
    c.fail(fmt::format("rank {} is not a position in a group of {} (sizes [{}])", a.rank,
                       a.group_size(), fmt::join(a.sizes, ", ")));
  }
  return a;
}

std::vector<ValueType> infer_same(const InferContext& c) {
  checked_attrs(c);
  return {{c.shape(0), c.dtype(0)}};
}

std::vector<ValueType> infer_all_gather(const InferContext& c) {
  const CollectiveAttrs a = checked_attrs(c);
  std::vector<int64_t> dims = c.shape(0).dims();
  const auto d = static_cast<size_t>(a.dim);
  const int64_t mine = a.sizes[static_cast<size_t>(a.rank)];
  if (dims[d] != mine) {
    c.fail(fmt::format("x has {} along dim {}, but sizes [{}] give rank {} a piece of {}", dims[d],
                       a.dim, fmt::join(a.sizes, ", "), a.rank, mine));
  }
  dims[d] = sum_of(a.sizes);
  return {{Shape(dims), c.dtype(0)}};
}

std::vector<ValueType> infer_reduce_scatter(const InferContext& c) {
  const CollectiveAttrs a = checked_attrs(c);
  std::vector<int64_t> dims = c.shape(0).dims();
  const auto d = static_cast<size_t>(a.dim);
  if (dims[d] != sum_of(a.sizes)) {
    c.fail(fmt::format("x has {} along dim {}, but sizes [{}] add up to {}", dims[d], a.dim,
                       fmt::join(a.sizes, ", "), sum_of(a.sizes)));
  }
  dims[d] = a.sizes[static_cast<size_t>(a.rank)];
  return {{Shape(dims), c.dtype(0)}};
}

// Even pieces, or uneven ones with the received sizes stated (recv_sizes):
// a rank's received shape depends on the other ranks' graphs, so it cannot
// be inferred from this rank's alone.
std::vector<ValueType> infer_all_to_all(const InferContext& c) {
  const CollectiveAttrs a = checked_attrs(c);
  std::vector<int64_t> dims = c.shape(0).dims();
  if (a.concat_dim < 0 || a.concat_dim >= c.shape(0).rank()) {
    c.fail(fmt::format("concat_dim {} is not a dimension of x", a.concat_dim));
  }
  const auto d = static_cast<size_t>(a.dim);
  if (!a.recv_sizes.empty()) {
    if (a.concat_dim != a.dim) {
      c.fail(fmt::format("uneven pieces (recv_sizes) need concat_dim == dim, got {} and {}",
                         a.concat_dim, a.dim));
    }
    if (a.recv_sizes.size() != a.sizes.size()) {
      c.fail(fmt::format("recv_sizes [{}] and sizes [{}] differ in length",
                         fmt::join(a.recv_sizes, ", "), fmt::join(a.sizes, ", ")));
    }
    for (int64_t s : a.recv_sizes) {
      if (s < 0)
        c.fail(fmt::format("recv_sizes [{}] has a negative piece", fmt::join(a.recv_sizes, ", ")));
    }
    if (dims[d] != sum_of(a.sizes)) {
      c.fail(fmt::format("x has {} along dim {}, but sizes [{}] add up to {}", dims[d], a.dim,
                         fmt::join(a.sizes, ", "), sum_of(a.sizes)));
    }
    dims[d] = sum_of(a.recv_sizes);
    return {{Shape(dims), c.dtype(0)}};
  }
  for (int64_t s : a.sizes) {
    if (s != a.sizes[0]) {
      c.fail(fmt::format("sizes [{}] are uneven; all_to_all takes even pieces only",
                         fmt::join(a.sizes, ", ")));
    }
  }
  if (dims[d] != sum_of(a.sizes)) {
    c.fail(fmt::format("x has {} along dim {}, but sizes [{}] add up to {}", dims[d], a.dim,
                       fmt::join(a.sizes, ", "), sum_of(a.sizes)));
  }
  dims[d] = a.sizes[0];
  dims[static_cast<size_t>(a.concat_dim)] *= a.group_size();
  return {{Shape(dims), c.dtype(0)}};
}

// Each rule emits the transposed collective over the same group (and pieces).
void emit_transpose(GradContext& c, OpKind op) {
  const CollectiveAttrs a = CollectiveAttrs::of(c.node());
  c.give(0, c.emit(op, c.name(0), {c.dy()}, a.to_attrs(op)));
}

void grad_all_reduce(GradContext& c) {
  emit_transpose(c, OpKind::all_reduce);
}
void grad_all_gather(GradContext& c) {
  emit_transpose(c, OpKind::reduce_scatter);
}
void grad_reduce_scatter(GradContext& c) {
  emit_transpose(c, OpKind::all_gather);
}
// dy is split along the forward's concat_dim (rank q's piece goes back to
// rank q) and the pieces join along the forward's dim.
void grad_all_to_all(GradContext& c) {
  CollectiveAttrs a = CollectiveAttrs::of(c.node());
  if (!a.recv_sizes.empty()) {
    std::swap(a.sizes, a.recv_sizes);
    c.give(0, c.emit(OpKind::all_to_all, c.name(0), {c.dy()}, a.to_attrs(OpKind::all_to_all)));
    return;
  }
  a.dim = std::exchange(a.concat_dim, a.dim);
  const int64_t n = std::max<int64_t>(a.group_size(), 1);
  const int64_t along = c.value(c.dy()).shape.dims()[static_cast<size_t>(a.dim)];
  a.sizes.assign(static_cast<size_t>(n), along / n);
  c.give(0, c.emit(OpKind::all_to_all, c.name(0), {c.dy()}, a.to_attrs(OpKind::all_to_all)));
}

void grad_copy_to_group(GradContext& c) {
  emit_transpose(c, OpKind::reduce_from_group);
}
void grad_reduce_from_group(GradContext& c) {
  emit_transpose(c, OpKind::copy_to_group);
}
void grad_gather_from_group(GradContext& c) {
  emit_transpose(c, OpKind::split_to_group);
}
void grad_split_to_group(GradContext& c) {
  emit_transpose(c, OpKind::gather_from_group);
}

OpDef def(OpKind op, std::string_view name, std::vector<ValueType> (*infer)(const InferContext&),
          void (*grad)(GradContext&)) {
  OpDef d;
  d.op = op;
  d.name = name;
  d.infer = infer;
  d.flops = no_flops;
  d.grad = grad;
  return d;
}

}  // namespace

Attrs CollectiveAttrs::to_attrs(OpKind op) const {
  Attrs a;
  a.set("group", group);
  if (pieces_op(op)) a.set("dim", dim).set("sizes", sizes).set("rank", rank);
  if (op == OpKind::all_to_all) {
    a.set("concat_dim", concat_dim);
    if (!recv_sizes.empty()) a.set("recv_sizes", recv_sizes);
  }
  return a;
}

CollectiveAttrs CollectiveAttrs::of(const Node& n) {
  CollectiveAttrs a;
  a.group = n.attrs.i("group");
  if (pieces_op(n.op)) {
    a.dim = n.attrs.i("dim");
    a.sizes = n.attrs.ints("sizes");
    a.rank = n.attrs.i("rank");
  }
  if (n.op == OpKind::all_to_all) {
    a.concat_dim = n.attrs.i("concat_dim");
    if (n.attrs.has("recv_sizes")) a.recv_sizes = n.attrs.ints("recv_sizes");
  }
  return a;
}

bool is_group_op(OpKind op) {
  switch (op) {
    case OpKind::all_reduce:
    case OpKind::all_gather:
    case OpKind::reduce_scatter:
    case OpKind::copy_to_group:
    case OpKind::reduce_from_group:
    case OpKind::all_to_all:
    case OpKind::gather_from_group:
    case OpKind::split_to_group:
    case OpKind::all_reduce_max:
      return true;
    default:
      return false;
  }
}

bool communicates(OpKind op) {
  return is_group_op(op) && op != OpKind::copy_to_group && op != OpKind::split_to_group;
}

double collective_payload_bytes(const Graph& g, const Node& n) {
  auto bytes = [&](ValueId v) {
    return numel_of(g, v) * static_cast<double>(dtype_size(g.value(v).dtype));
  };
  switch (n.op) {
    case OpKind::all_reduce:
    case OpKind::all_reduce_max:
    case OpKind::reduce_from_group:
    case OpKind::reduce_scatter:
    case OpKind::all_to_all:
      return bytes(n.inputs[0]);
    case OpKind::all_gather:
    case OpKind::gather_from_group:
      return bytes(n.outputs[0]);
    default:
      return 0;
  }
}

void register_collective_ops(std::vector<OpDef>& t) {
  t.push_back(def(OpKind::all_reduce, "all_reduce", infer_same, grad_all_reduce));
  t.push_back(def(OpKind::all_gather, "all_gather", infer_all_gather, grad_all_gather));
  t.push_back(
      def(OpKind::reduce_scatter, "reduce_scatter", infer_reduce_scatter, grad_reduce_scatter));
  // f's forward is the identity: a view of x (a copy only into caller memory).
  OpDef f = def(OpKind::copy_to_group, "copy_to_group", infer_same, grad_copy_to_group);
  f.view = true;
  t.push_back(f);
  t.push_back(
      def(OpKind::reduce_from_group, "reduce_from_group", infer_same, grad_reduce_from_group));
  t.push_back(def(OpKind::all_to_all, "all_to_all", infer_all_to_all, grad_all_to_all));
  t.push_back(def(OpKind::gather_from_group, "gather_from_group", infer_all_gather,
                  grad_gather_from_group));
  // A local copy of this rank's piece (exec/kernel_table.cpp).
  t.push_back(
      def(OpKind::split_to_group, "split_to_group", infer_reduce_scatter, grad_split_to_group));
  // The max a softmax subtracts for range: the result does not depend on it,
  // so no gradient flows through (no differentiable output: autodiff treats
  // y as a constant).
  OpDef mx = def(OpKind::all_reduce_max, "all_reduce_max", infer_same, nullptr);
  mx.diff_outputs = 0;
  t.push_back(mx);
}

}  // namespace mt
