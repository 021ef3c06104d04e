// The executor's dispatch table: one function per OpKind that unpacks the
// node's attributes and calls the matching KernelBackend method. Outputs are
// pre-allocated (arena views or bound tensors) with the inferred shapes.
#pragma once

#include <vector>

#include "meshtrain/graph/graph.h"
#include "meshtrain/tensor/backend.h"
#include "meshtrain/tensor/tensor.h"

namespace mt {

using KernelFn = void (*)(KernelBackend& k, const Node& n, const std::vector<Tensor>& in,
                          std::vector<Tensor>& out);

// Throws InternalError for an OpKind without a kernel (the collectives that
// communicate have none: the executor hands them to its CollectiveRunner).
KernelFn kernel_for(OpKind op);

}  // namespace mt
