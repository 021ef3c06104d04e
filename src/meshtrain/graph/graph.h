// The IR: a graph of operators over values with known shapes and dtypes.
//
// A Graph is built once (by models through Builder), differentiated once
// (autodiff.h appends the backward nodes), then handed to the executor, the
// SPMD lowering or the planner. Nodes are stored in a valid execution order:
// every node's inputs are produced by earlier nodes or are graph inputs /
// parameters. Values and nodes are addressed by dense integer ids.
// Not thread-safe; owned by whoever builds it.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "meshtrain/tensor/backend.h"
#include "meshtrain/tensor/dtype.h"
#include "meshtrain/tensor/shape.h"

namespace mt {

using ValueId = int32_t;
using NodeId = int32_t;
constexpr ValueId kNoValue = -1;
constexpr NodeId kNoNode = -1;

enum class OpKind : uint16_t {
  // forward
  matmul,  // attrs: trans_a, trans_b
  add,
  sub,
  mul,    // b may broadcast as a suffix of a's shape or be a scalar
  scale,  // attrs: alpha
  relu,
  gelu,
  tanh,
  sigmoid,
  softmax,  // attrs: causal
  log_softmax,
  layer_norm,     // inputs x, gamma, beta; outputs y, mean, rstd; attrs: eps
  cross_entropy,  // inputs logits [N,C], labels i32 [N]; output scalar f32
  embedding,      // inputs table [V,C], ids i32; optional attrs offset, vocab: the table is
                  // rows [offset, offset+V) of a vocabulary of `vocab` rows, ids outside give 0
  conv2d,         // inputs x, w[, b]; attrs: stride_h/w, pad_h/w
  max_pool2d,     // outputs y, argmax; attrs: kernel_h/w, stride_h/w, pad_h/w
  reshape,        // attrs: shape (a view: no copy)
  permute,        // attrs: perm
  cast,           // attrs: dtype
  sum_to,         // attrs: shape (reduce leading dims)
  // backward-only
  unary_grad,          // inputs x, y, dy; attrs: unary (UnaryOp as int)
  softmax_grad,        // inputs y, dy
  log_softmax_grad,    // inputs y, dy
  layer_norm_grad,     // inputs dy, x, gamma, mean, rstd; outputs dx, dgamma, dbeta
  cross_entropy_grad,  // inputs logits, labels, dloss
  embedding_grad,      // inputs dy, ids; attrs: shape (of the table)[, offset, vocab as embedding]
  conv2d_grad_data,    // inputs dy, w; attrs as conv2d + shape (of x)
  conv2d_grad_weight,  // inputs dy, x; outputs dw[, db]; attrs as conv2d + has_bias
  max_pool2d_grad,     // inputs dy, argmax; attrs: shape (of x)
  // added after the first skeleton (appended so existing values keep their numbers)
  fill,          // no inputs; attrs: shape, dtype (name), value. Seeds d loss = 1.
  broadcast_to,  // attrs: shape (x's shape is a suffix of it, or x is a scalar); backward of sum_to
  // collectives over the ranks of a group (graph/collective.h; exec runs them
  // through a CollectiveRunner). attrs: group, and for all_gather /
  // reduce_scatter also dim, sizes (per group rank), rank (position in the group)
  all_reduce,         // y = sum of x over the group
  all_gather,         // y = x of every group rank, joined along dim
  reduce_scatter,     // y = this rank's piece (along dim) of the sum over the group
  copy_to_group,      // Megatron's f: y = x; backward all-reduces (x is replicated)
  reduce_from_group,  // Megatron's g: y = sum over the group, replicated; backward identity
  all_to_all,  // piece q of x along dim goes to rank q; the received pieces join along concat_dim
  // sparse (CSR) operators, graph neural networks (ops_sparse.cpp). The sparse
  // matrix is carried as i32 inputs row_ptr [N+1] and col_idx [E] (graph
  // inputs bound once, as model constants); see tensor/backend.h.
  spmm,          // inputs row_ptr, col_idx, x [M,F][, w [E]] -> y [N,F] = A @ x
  spmm_max,      // inputs row_ptr, col_idx, x [M,F] -> y [N,F], argmax i32 [N,F]
  edge_softmax,  // inputs row_ptr, x [E] -> y [E] (softmax over each row's entries)
  // sparse backward-only
  spmm_t,             // inputs row_ptr, col_idx, dy [N,F][, w]; attrs: rows (M) -> A^T @ dy
  sddmm,              // inputs row_ptr, col_idx, a [N,F], b [M,F] -> [E] (d spmm / d w)
  spmm_max_grad,      // inputs dy, argmax; attrs: shape (of x)
  edge_softmax_grad,  // inputs row_ptr, y, dy
  // collectives with a replicated side (graph/collective.h), as f and g are
  // for all_reduce. attrs as all_gather.
  gather_from_group,  // y = x of every group rank joined along dim, replicated; backward: own piece
  split_to_group,     // x replicated, y = this rank's piece along dim (local); backward: gather
  // Megatron's vocabulary-parallel cross-entropy (the spmd lowering emits
  // them for logits split by vocabulary; ops_norm.cpp). N rows, this rank's
  // V_local columns of the vocabulary starting at attr `offset`.
  all_reduce_max,       // y = elementwise max of x over the group; no gradient (a stop-gradient)
  row_max,              // x [N, V] -> y [N] = max over each row; no gradient (a stop-gradient)
  vocab_ce_stats,       // inputs logits [N,Vl], labels i32 [N], m [N]; attrs: offset, vocab
                        // -> [N, 2]: sum_j exp(logit_j - m), the label's logit where owned else 0
  vocab_ce_loss,        // inputs tot [N, 2] (the stats summed over the group), m [N]
                        // -> scalar mean_n log tot[n,0] + m[n] - tot[n,1]
  vocab_ce_stats_grad,  // inputs logits, labels, m, dy [N,2]; attrs as stats -> dlogits, dm
  vocab_ce_loss_grad,   // inputs tot, dloss -> dtot [N, 2]
};

// activation: produced by a forward node; grad: produced by a backward node.
enum class ValueRole : uint8_t { input, param, activation, grad };

// How a parameter is initialised (the trainer draws it from the run's seed).
struct ParamInit {
  enum class Kind : uint8_t { zeros, ones, normal, uniform } kind = Kind::zeros;
  double scale = 0.0;  // std for normal, bound for uniform
};

struct Value {
  std::string name;
  Shape shape;
  DType dtype = DType::f32;
  ValueRole role = ValueRole::activation;
  NodeId producer = kNoNode;
  ParamInit init;  // params only
};

using AttrValue = std::variant<int64_t, double, bool, std::vector<int64_t>, std::string>;

class Attrs {
 public:
  Attrs& set(const std::string& key, AttrValue v) {
    values_[key] = std::move(v);
    return *this;
  }
  bool has(const std::string& key) const { return values_.count(key) != 0; }
  int64_t i(const std::string& key) const;
  double f(const std::string& key) const;
  bool b(const std::string& key) const;
  const std::vector<int64_t>& ints(const std::string& key) const;
  const std::string& s(const std::string& key) const;
  // The value if present, `dflt` otherwise (a present value of another type still throws).
  int64_t i_or(const std::string& key, int64_t dflt) const;
  double f_or(const std::string& key, double dflt) const;
  bool b_or(const std::string& key, bool dflt) const;
  const std::map<std::string, AttrValue>& all() const { return values_; }

 private:
  std::map<std::string, AttrValue> values_;
};

struct Node {
  OpKind op = OpKind::matmul;
  std::string name;
  std::vector<ValueId> inputs;
  std::vector<ValueId> outputs;
  Attrs attrs;
  bool backward = false;  // emitted by autodiff
};

class Graph {
 public:
  ValueId add_input(const std::string& name, const Shape& shape, DType dtype);
  ValueId add_param(const std::string& name, const Shape& shape, DType dtype, ParamInit init);
  // Appends a node, infers its outputs' shapes and dtypes (throws ShapeError
  // naming the node, the op and the input shapes), and returns the outputs.
  std::vector<ValueId> add_node(OpKind op, const std::string& name, std::vector<ValueId> inputs,
                                Attrs attrs = {}, bool backward = false);

  const Value& value(ValueId id) const { return values_.at(static_cast<size_t>(id)); }
  Value& value(ValueId id) { return values_.at(static_cast<size_t>(id)); }
  const Node& node(NodeId id) const { return nodes_.at(static_cast<size_t>(id)); }
  int num_values() const { return static_cast<int>(values_.size()); }
  int num_nodes() const { return static_cast<int>(nodes_.size()); }
  const std::vector<Node>& nodes() const { return nodes_; }
  const std::vector<ValueId>& inputs() const { return inputs_; }
  const std::vector<ValueId>& params() const { return params_; }
  std::optional<ValueId> find(const std::string& value_name) const;
  // Value names are unique within a graph (add_* throw ConfigError on a
  // duplicate). Renames keep find() in step; do not assign Value::name directly.
  void rename_value(ValueId v, const std::string& name);
  // Renames a node and its outputs ("<name>", "<name>.mean", ...).
  void rename_node(NodeId n, const std::string& name);
  // `base` if no value has that name yet, else `base#2`, `base#3`, ...
  std::string unique_name(const std::string& base) const;
  int num_forward_nodes() const;  // nodes with backward == false

  // Rewrites for passes that run after autodiff (graph/bf16_stash.h):
  // node n's input `slot` becomes v (same shape and dtype as the old one, or
  // ShapeError naming the node), and a new node order (a permutation of the
  // node ids, which are renumbered to it; value ids stay). The order must be
  // valid -- every input produced earlier -- or it throws, leaving g unchanged.
  void replace_input(NodeId n, int slot, ValueId v);
  void reorder_nodes(const std::vector<NodeId>& order);

  // Set by autodiff: the scalar loss and each parameter's gradient value.
  ValueId loss() const { return loss_; }
  void set_loss(ValueId v) { loss_ = v; }
  ValueId grad_of(ValueId param) const;  // kNoValue if none
  void set_grad(ValueId param, ValueId grad) { grads_[param] = grad; }
  const std::map<ValueId, ValueId>& grads() const { return grads_; }

  int64_t param_count() const;  // total elements over all params

 private:
  std::vector<Value> values_;
  std::vector<Node> nodes_;
  std::vector<ValueId> inputs_;
  std::vector<ValueId> params_;
  ValueId loss_ = kNoValue;
  std::map<ValueId, ValueId> grads_;
  std::map<std::string, ValueId> by_name_;

  ValueId new_value(Value v);
};

std::string_view op_name(OpKind op);

}  // namespace mt
