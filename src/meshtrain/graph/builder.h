// The API models are written in. Each call appends one operator to a Graph
// and returns its output value; names are prefixed by the current scope
// ("block0.attn.q") so the graph dump and checkpoints read like the model.
//
//   Graph g; Builder b(g);
//   ValueId x = b.input("x", {128, 784});
//   ValueId w = b.param("fc1.w", {784, 512}, ParamInit{ParamInit::Kind::normal, 0.05});
//   ValueId h = b.relu(b.matmul(x, w));
#pragma once

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

  ValueId matmul(ValueId a, ValueId b, bool trans_a = false, bool trans_b = false);
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
  ValueId reshape(ValueId x, const Shape& shape);
  ValueId permute(ValueId x, const std::vector<int>& perm);
  ValueId cast(ValueId x, DType dtype);

  const Shape& shape(ValueId v) const { return g_.value(v).shape; }

 private:
  std::string scoped(const std::string& name) const;
  std::string auto_name(OpKind op);

  Graph& g_;
  std::vector<std::string> scopes_;
  int counter_ = 0;
};

}  // namespace mt
