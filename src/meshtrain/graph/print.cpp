#include "meshtrain/graph/print.h"

#include <cmath>

#include <fmt/format.h>

#include "meshtrain/graph/cost.h"

namespace mt {

namespace {
std::string type_of(const Value& v) {
  return fmt::format("{}{}", dtype_name(v.dtype), v.shape.str());
}
}  // namespace

std::string human_count(double n, const char* unit) {
  static const char* const kPrefix[] = {"", "K", "M", "G", "T", "P"};
  int p = 0;
  while (std::fabs(n) >= 1000.0 && p < 5) {
    n /= 1000.0;
    ++p;
  }
  if (p == 0) return fmt::format("{:.0f} {}", n, unit);
  return fmt::format("{:.3g} {}{}", n, kPrefix[p], unit);
}

std::string describe(const Graph& g) {
  double fwd = 0, bwd = 0;
  for (const Node& n : g.nodes()) (n.backward ? bwd : fwd) += op_cost(g, n).flops;
  std::string out = fmt::format(
      "graph: {} nodes ({} forward, {} backward), {} inputs, {} params ({} elements), "
      "{} forward, {} backward\n",
      g.num_nodes(), g.num_forward_nodes(), g.num_nodes() - g.num_forward_nodes(),
      g.inputs().size(), g.params().size(), g.param_count(), human_count(fwd, "FLOP"),
      human_count(bwd, "FLOP"));
  for (ValueId v : g.inputs()) {
    out += fmt::format("  input  {:<32} {}\n", g.value(v).name, type_of(g.value(v)));
  }
  for (ValueId v : g.params()) {
    out += fmt::format("  param  {:<32} {}  ({} elements)\n", g.value(v).name, type_of(g.value(v)),
                       g.value(v).shape.numel());
  }
  out += fmt::format("  {:<40} {:<20} {:<28} {:>10} {:>12}\n", "node", "op", "output", "params",
                     "flops");
  for (const Node& n : g.nodes()) {
    std::string types;
    for (size_t k = 0; k < n.outputs.size(); ++k) {
      types += (k ? ", " : "") + type_of(g.value(n.outputs[k]));
    }
    int64_t params = 0;
    for (ValueId v : n.inputs) {
      if (g.value(v).role == ValueRole::param) params += g.value(v).shape.numel();
    }
    out += fmt::format("{} {:<40} {:<20} {:<28} {:>10} {:>12}\n", n.backward ? "b" : " ", n.name,
                       op_name(n.op), types, params, human_count(op_cost(g, n).flops, "FLOP"));
  }
  return out;
}

}  // namespace mt
