// Reverse-mode automatic differentiation on the IR.
#pragma once

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

}  // namespace mt
