#include "meshtrain/graph/cost.h"

#include "meshtrain/graph/collective.h"
#include "meshtrain/graph/op_registry.h"

namespace mt {

namespace {
double nbytes(const Value& v) {
  return static_cast<double>(v.shape.numel()) * static_cast<double>(dtype_size(v.dtype));
}
}  // namespace

OpCost op_cost(const Graph& g, const Node& n) {
  const OpDef& def = op_def(n.op);
  OpCost c;
  c.flops = def.flops(g, n);
  // A view moves no data; everything else reads each input and writes each output once.
  if (!def.view) {
    for (ValueId v : n.inputs) c.bytes += nbytes(g.value(v));
    for (ValueId v : n.outputs) c.bytes += nbytes(g.value(v));
  }
  c.comm_bytes = collective_payload_bytes(g, n);
  return c;
}

OpCost graph_cost(const Graph& g) {
  OpCost total;
  for (const Node& n : g.nodes()) {
    OpCost c = op_cost(g, n);
    total.flops += c.flops;
    total.bytes += c.bytes;
    total.comm_bytes += c.comm_bytes;
  }
  return total;
}

}  // namespace mt
