#include "meshtrain/graph/builder.h"

#include "meshtrain/graph/collective.h"

#include <fmt/format.h>

namespace mt {

std::string Builder::scoped(const std::string& name) const {
  std::string s;
  for (const std::string& scope : scopes_) s += scope + ".";
  return s + name;
}

std::string Builder::auto_name(OpKind op) {
  // The counter keeps auto names unique even across scopes that repeat.
  return scoped(fmt::format("{}_{}", op_name(op), counter_++));
}

ValueId Builder::name(ValueId v, const std::string& name) {
  const NodeId n = g_.value(v).producer;
  if (n == kNoNode) {
    throw ConfigError(
        fmt::format("builder: cannot name '{}': it is not an operator's output", g_.value(v).name));
  }
  g_.rename_node(n, scoped(name));
  return v;
}

ValueId Builder::append(OpKind kind, std::vector<ValueId> inputs, Attrs attrs) {
  return g_.add_node(kind, auto_name(kind), std::move(inputs), std::move(attrs)).front();
}

ValueId Builder::input(const std::string& name, const Shape& shape, DType dtype) {
  return g_.add_input(scoped(name), shape, dtype);
}

ValueId Builder::param(const std::string& name, const Shape& shape, ParamInit init, DType dtype) {
  return g_.add_param(scoped(name), shape, dtype, init);
}

ValueId Builder::matmul(ValueId a, ValueId b, bool trans_a, bool trans_b,
                        std::optional<DType> out_dtype) {
  Attrs attrs;
  attrs.set("trans_a", trans_a).set("trans_b", trans_b);
  if (out_dtype) attrs.set("out_dtype", std::string(dtype_name(*out_dtype)));
  return append(OpKind::matmul, {a, b}, attrs);
}

ValueId Builder::add(ValueId a, ValueId b) {
  return append(OpKind::add, {a, b});
}
ValueId Builder::sub(ValueId a, ValueId b) {
  return append(OpKind::sub, {a, b});
}
ValueId Builder::mul(ValueId a, ValueId b) {
  return append(OpKind::mul, {a, b});
}

ValueId Builder::scale(ValueId x, double alpha) {
  return append(OpKind::scale, {x}, Attrs().set("alpha", alpha));
}

ValueId Builder::relu(ValueId x) {
  return append(OpKind::relu, {x});
}
ValueId Builder::gelu(ValueId x) {
  return append(OpKind::gelu, {x});
}
ValueId Builder::tanh(ValueId x) {
  return append(OpKind::tanh, {x});
}
ValueId Builder::sigmoid(ValueId x) {
  return append(OpKind::sigmoid, {x});
}

ValueId Builder::softmax(ValueId x, bool causal) {
  return append(OpKind::softmax, {x}, Attrs().set("causal", causal));
}

ValueId Builder::log_softmax(ValueId x) {
  return append(OpKind::log_softmax, {x});
}

ValueId Builder::layer_norm(ValueId x, ValueId gamma, ValueId beta, double eps) {
  return append(OpKind::layer_norm, {x, gamma, beta}, Attrs().set("eps", eps));
}

ValueId Builder::cross_entropy(ValueId logits, ValueId labels) {
  return append(OpKind::cross_entropy, {logits, labels});
}

ValueId Builder::embedding(ValueId table, ValueId ids) {
  return append(OpKind::embedding, {table, ids});
}

ValueId Builder::spmm(ValueId row_ptr, ValueId col_idx, ValueId x, ValueId w) {
  std::vector<ValueId> in = {row_ptr, col_idx, x};
  if (w != kNoValue) in.push_back(w);
  return append(OpKind::spmm, in);
}

ValueId Builder::spmm_max(ValueId row_ptr, ValueId col_idx, ValueId x) {
  return append(OpKind::spmm_max, {row_ptr, col_idx, x});
}

ValueId Builder::edge_softmax(ValueId row_ptr, ValueId scores) {
  return append(OpKind::edge_softmax, {row_ptr, scores});
}

ValueId Builder::conv2d(ValueId x, ValueId w, ValueId bias, const Conv2dParams& p) {
  std::vector<ValueId> in{x, w};
  if (bias != kNoValue) in.push_back(bias);
  return append(OpKind::conv2d, std::move(in),
                Attrs()
                    .set("stride_h", p.stride_h)
                    .set("stride_w", p.stride_w)
                    .set("pad_h", p.pad_h)
                    .set("pad_w", p.pad_w));
}

ValueId Builder::max_pool2d(ValueId x, const Pool2dParams& p) {
  return append(OpKind::max_pool2d, {x},
                Attrs()
                    .set("kernel_h", p.kernel_h)
                    .set("kernel_w", p.kernel_w)
                    .set("stride_h", p.stride_h)
                    .set("stride_w", p.stride_w)
                    .set("pad_h", p.pad_h)
                    .set("pad_w", p.pad_w));
}

ValueId Builder::reshape(ValueId x, const Shape& shape) {
  return append(OpKind::reshape, {x}, Attrs().set("shape", shape.dims()));
}

ValueId Builder::permute(ValueId x, const std::vector<int>& perm) {
  std::vector<int64_t> p(perm.begin(), perm.end());
  return append(OpKind::permute, {x}, Attrs().set("perm", p));
}

ValueId Builder::cast(ValueId x, DType dtype) {
  if (g_.value(x).dtype == dtype) return x;
  auto [it, fresh] = casts_.try_emplace({x, dtype}, kNoValue);
  if (fresh)
    it->second = append(OpKind::cast, {x}, Attrs().set("dtype", std::string(dtype_name(dtype))));
  return it->second;
}

ValueId Builder::sum_to(ValueId x, const Shape& shape) {
  return append(OpKind::sum_to, {x}, Attrs().set("shape", shape.dims()));
}

ValueId Builder::broadcast_to(ValueId x, const Shape& shape) {
  return append(OpKind::broadcast_to, {x}, Attrs().set("shape", shape.dims()));
}

ValueId Builder::fill(const Shape& shape, DType dtype, double value) {
  return append(OpKind::fill, {},
                Attrs()
                    .set("shape", shape.dims())
                    .set("dtype", std::string(dtype_name(dtype)))
                    .set("value", value));
}

namespace {
Attrs group_attrs(int64_t group, OpKind op) {
  CollectiveAttrs a;
  a.group = group;
  return a.to_attrs(op);
}
}  // namespace

ValueId Builder::all_reduce(ValueId x, int64_t group) {
  return append(OpKind::all_reduce, {x}, group_attrs(group, OpKind::all_reduce));
}

ValueId Builder::all_gather(ValueId x, int64_t group, int64_t dim, std::vector<int64_t> sizes,
                            int64_t rank) {
  CollectiveAttrs a{group, dim, std::move(sizes), rank, 0};
  return append(OpKind::all_gather, {x}, a.to_attrs(OpKind::all_gather));
}

ValueId Builder::reduce_scatter(ValueId x, int64_t group, int64_t dim, std::vector<int64_t> sizes,
                                int64_t rank) {
  CollectiveAttrs a{group, dim, std::move(sizes), rank, 0};
  return append(OpKind::reduce_scatter, {x}, a.to_attrs(OpKind::reduce_scatter));
}

ValueId Builder::all_to_all(ValueId x, int64_t group, int64_t dim, int64_t concat_dim,
                            std::vector<int64_t> sizes, int64_t rank) {
  CollectiveAttrs a{group, dim, std::move(sizes), rank, concat_dim};
  return append(OpKind::all_to_all, {x}, a.to_attrs(OpKind::all_to_all));
}

ValueId Builder::all_to_allv(ValueId x, int64_t group, int64_t dim, std::vector<int64_t> sizes,
                             std::vector<int64_t> recv_sizes, int64_t rank) {
  CollectiveAttrs a{group, dim, std::move(sizes), rank, dim, std::move(recv_sizes)};
  return append(OpKind::all_to_all, {x}, a.to_attrs(OpKind::all_to_all));
}

ValueId Builder::copy_to_group(ValueId x, int64_t group) {
  return append(OpKind::copy_to_group, {x}, group_attrs(group, OpKind::copy_to_group));
}

ValueId Builder::reduce_from_group(ValueId x, int64_t group) {
  return append(OpKind::reduce_from_group, {x}, group_attrs(group, OpKind::reduce_from_group));
}

ValueId Builder::gather_from_group(ValueId x, int64_t group, int64_t dim,
                                   std::vector<int64_t> sizes, int64_t rank) {
  CollectiveAttrs a{group, dim, std::move(sizes), rank, 0};
  return append(OpKind::gather_from_group, {x}, a.to_attrs(OpKind::gather_from_group));
}

ValueId Builder::split_to_group(ValueId x, int64_t group, int64_t dim, std::vector<int64_t> sizes,
                                int64_t rank) {
  CollectiveAttrs a{group, dim, std::move(sizes), rank, 0};
  return append(OpKind::split_to_group, {x}, a.to_attrs(OpKind::split_to_group));
}

}  // namespace mt
