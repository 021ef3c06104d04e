// Reverse-mode automatic differentiation on the IR.
#pragma once

#include <span>
#include <vector>

#include "meshtrain/graph/graph.h"

namespace mt {

// Appends the backward graph of scalar `loss` (d loss / d loss = 1) to g:
// walks the forward nodes in reverse, emits each operator's backward nodes
// (marked Node::backward), sums gradients of values used more than once
// (e.g. a tied embedding), and records every parameter's gradient with
// g.set_grad(). Parameters that do not reach the loss get no gradient.
// Throws ShapeError if loss is not a scalar, InternalError if an operator on
// the path has no gradient rule.
void build_backward(Graph& g, ValueId loss);

// Where a backward pass starts: `value` with incoming gradient `grad` (a
// graph input of value's shape and dtype, e.g. the gradient a pipeline
// stage receives for the activation it sent), or kNoValue for d value = 1
// (a scalar loss).
struct BackwardSeed {
  ValueId value = kNoValue;
  ValueId grad = kNoValue;
};

// The backward of a graph with several seeds (a pipeline stage's outputs),
// differentiating the parameters and also the graph inputs `wrt` (the
// activations a stage received). Appends backward nodes as the one-loss
// form does (which this generalises: it is build_backward(g, {{loss}}, {})
// plus g.set_loss), records parameter gradients with g.set_grad(), and
// returns, per wrt input, its gradient value ("grad/<name>"), or kNoValue
// when no seed depends on it (or it is not a float). Sets no loss. Throws
// ConfigError for a seed or wrt id that is not a value / graph input, a
// value seeded twice, or a gradient that is not a graph input; ShapeError
// when a gradient's shape or dtype differs from its value's; InternalError
// if the graph already has backward nodes.
std::vector<ValueId> build_backward(Graph& g, std::span<const BackwardSeed> seeds,
                                    std::span<const ValueId> wrt);

// The backward nodes of g in two parts, each in graph order, for
// zero-bubble schedules: input_part are those that `input_grads` depend on
// (the input-gradient pass, B), weight_part the rest (the weight-gradient
// pass, W, which nothing downstream waits for). Running input_part then
// weight_part computes what the whole backward does; weight_part may read
// values input_part produced, never the reverse. A node producing both an
// input and a weight gradient (layer_norm_grad) lies in input_part.
struct BackwardSplit {
  std::vector<NodeId> input_part;
  std::vector<NodeId> weight_part;
};
BackwardSplit split_backward(const Graph& g, std::span<const ValueId> input_grads);

}  // namespace mt
