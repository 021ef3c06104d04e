// The API models are written in. Each call appends one operator to a Graph
// and returns its output value; names are prefixed by the current scope
// ("block0.attn.q") so the graph dump and checkpoints read like the model.
// Operators are named "<scope><op>_<n>" unless renamed with name().
// Shape errors throw ShapeError from Graph::add_node. Holds a reference to
// the graph, which must outlive it.
//
//   Graph g; Builder b(g);
//   ValueId x = b.input("x", {128, 784});
//   ValueId w = b.param("fc1.w", {784, 512}, ParamInit{ParamInit::Kind::normal, 0.05});
//   ValueId h = b.relu(b.matmul(x, w));
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "meshtrain/graph/graph.h"

namespace mt {

class Builder {
 public:
  explicit Builder(Graph& g) : g_(g) {}
  Graph& graph() { return g_; }

  // Scopes nest: push_scope("block0"); push_scope("attn") -> "block0.attn.".
  void push_scope(const std::string& s) { scopes_.push_back(s); }
  void pop_scope() { scopes_.pop_back(); }

  ValueId input(const std::string& name, const Shape& shape, DType dtype = DType::f32);
  ValueId param(const std::string& name, const Shape& shape, ParamInit init,
                DType dtype = DType::f32);

  // 16-bit a and b give an f32 product, or one of their own type when
  // out_dtype says so (accumulated in f32, rounded once).
  ValueId matmul(ValueId a, ValueId b, bool trans_a = false, bool trans_b = false,
                 std::optional<DType> out_dtype = std::nullopt);
  ValueId add(ValueId a, ValueId b);
  ValueId sub(ValueId a, ValueId b);
  ValueId mul(ValueId a, ValueId b);
  ValueId scale(ValueId x, double alpha);
  ValueId relu(ValueId x);
  ValueId gelu(ValueId x);
  ValueId tanh(ValueId x);
  ValueId sigmoid(ValueId x);
  ValueId softmax(ValueId x, bool causal = false);
  ValueId log_softmax(ValueId x);
  ValueId layer_norm(ValueId x, ValueId gamma, ValueId beta, double eps = 1e-5);
  ValueId cross_entropy(ValueId logits, ValueId labels);
  ValueId embedding(ValueId table, ValueId ids);
  // bias may be kNoValue.
  ValueId conv2d(ValueId x, ValueId w, ValueId bias, const Conv2dParams& p);
  ValueId max_pool2d(ValueId x, const Pool2dParams& p);
  // Sparse (CSR) operators; row_ptr i32 [N+1] and col_idx i32 [E] are graph
  // inputs (the adjacency, rows = destination vertices). w may be kNoValue
  // (every entry 1). spmm: y [N,F] = A @ x; spmm_max: the feature-wise max
  // over each row's entries (0 for an empty row); edge_softmax: softmax of
  // scores [E] over each row's entries.
  ValueId spmm(ValueId row_ptr, ValueId col_idx, ValueId x, ValueId w = kNoValue);
  ValueId spmm_max(ValueId row_ptr, ValueId col_idx, ValueId x);
  ValueId edge_softmax(ValueId row_ptr, ValueId scores);
  ValueId reshape(ValueId x, const Shape& shape);
  ValueId permute(ValueId x, const std::vector<int>& perm);
  // Casts are pure: casting the same value to the same dtype again returns the
  // first cast's output (so e.g. q, k and v share one bf16 copy of their input).
  // x itself when it already has that dtype.
  ValueId cast(ValueId x, DType dtype);
  // Sums x over leading dims down to `shape` (a suffix of x's shape; {} sums all).
  ValueId sum_to(ValueId x, const Shape& shape);
  // Repeats x over new leading dims up to `shape` (x's shape is a suffix of it).
  ValueId broadcast_to(ValueId x, const Shape& shape);
  // A constant tensor, refilled on every run.
  ValueId fill(const Shape& shape, DType dtype, double value);
  // Collectives over group `group` (graph/collective.h says what each means
  // and differentiates to). sizes: every group rank's piece along dim; rank:
  // this rank's position in the group.
  ValueId all_reduce(ValueId x, int64_t group);
  ValueId all_gather(ValueId x, int64_t group, int64_t dim, std::vector<int64_t> sizes,
                     int64_t rank);
  ValueId reduce_scatter(ValueId x, int64_t group, int64_t dim, std::vector<int64_t> sizes,
                         int64_t rank);
  // Even pieces: x's extent along dim is sizes[0] x the group size.
  ValueId all_to_all(ValueId x, int64_t group, int64_t dim, int64_t concat_dim,
                     std::vector<int64_t> sizes, int64_t rank);
  // Uneven pieces along dim: sizes[q] of x's rows go to group rank q,
  // recv_sizes[q] come from it (what rank q's graph sends this rank).
  ValueId all_to_allv(ValueId x, int64_t group, int64_t dim, std::vector<int64_t> sizes,
                      std::vector<int64_t> recv_sizes, int64_t rank);
  ValueId copy_to_group(ValueId x, int64_t group);      // Megatron's f
  ValueId reduce_from_group(ValueId x, int64_t group);  // Megatron's g
  // x's pieces joined along dim into one replicated value / this rank's piece
  // of a replicated x (no communication forward).
  ValueId gather_from_group(ValueId x, int64_t group, int64_t dim, std::vector<int64_t> sizes,
                            int64_t rank);
  ValueId split_to_group(ValueId x, int64_t group, int64_t dim, std::vector<int64_t> sizes,
                         int64_t rank);

  // Renames the operator that produced v (scoped), instead of its automatic
  // "<op>_<n>", and returns v:  ValueId logits = b.name(b.matmul(h, w), "logits");
  ValueId name(ValueId v, const std::string& name);

  const Shape& shape(ValueId v) const { return g_.value(v).shape; }

 private:
  std::string scoped(const std::string& name) const;
  std::string auto_name(OpKind op);
  ValueId append(OpKind kind, std::vector<ValueId> inputs, Attrs attrs = {});

  Graph& g_;
  std::vector<std::string> scopes_;
  int counter_ = 0;
  std::map<std::pair<ValueId, DType>, ValueId> casts_;
};

}  // namespace mt
