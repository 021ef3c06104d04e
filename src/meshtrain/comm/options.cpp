#include "meshtrain/comm/options.h"

#include <fmt/format.h>

#include "meshtrain/base/error.h"

namespace mt {

std::string_view collective_name(Collective c) {
  switch (c) {
    case Collective::all_reduce:
      return "all_reduce";
    case Collective::all_gather:
      return "all_gather";
    case Collective::all_gatherv:
      return "all_gatherv";
    case Collective::reduce_scatter:
      return "reduce_scatter";
    case Collective::reduce_scatterv:
      return "reduce_scatterv";
    case Collective::broadcast:
      return "broadcast";
    case Collective::all_to_all:
      return "all_to_all";
    case Collective::all_to_allv:
      return "all_to_allv";
    case Collective::barrier:
      return "barrier";
    case Collective::split:
      return "split";
    case Collective::send:
      return "send";
    case Collective::recv:
      return "recv";
  }
  return "?";
}

std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return "sum";
    case ReduceOp::avg:
      return "avg";
    case ReduceOp::max:
      return "max";
    case ReduceOp::min:
      return "min";
  }
  return "?";
}

std::string_view algorithm_name(CommAlgorithm a) {
  switch (a) {
    case CommAlgorithm::automatic:
      return "automatic";
    case CommAlgorithm::ring:
      return "ring";
    case CommAlgorithm::halving_doubling:
      return "halving_doubling";
    case CommAlgorithm::shared_memory:
      return "shared_memory";
    case CommAlgorithm::native:
      return "native";
    case CommAlgorithm::tree:
      return "tree";
    case CommAlgorithm::pairwise:
      return "pairwise";
    case CommAlgorithm::dissemination:
      return "dissemination";
    case CommAlgorithm::hierarchical:
      return "hierarchical";
  }
  return "?";
}

CommAlgorithm parse_algorithm(std::string_view name) {
  for (auto a :
       {CommAlgorithm::automatic, CommAlgorithm::ring, CommAlgorithm::halving_doubling,
        CommAlgorithm::shared_memory, CommAlgorithm::native, CommAlgorithm::tree,
        CommAlgorithm::pairwise, CommAlgorithm::dissemination, CommAlgorithm::hierarchical}) {
    if (algorithm_name(a) == name) return a;
  }
  throw ConfigError(
      fmt::format("unknown collective algorithm '{}' (expected automatic, ring, halving_doubling, "
                  "shared_memory, native, tree, pairwise, dissemination or hierarchical)",
                  name));
}

ReduceOp parse_reduce_op(std::string_view name) {
  for (auto op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min}) {
    if (reduce_op_name(op) == name) return op;
  }
  throw ConfigError(fmt::format("unknown reduce op '{}' (expected sum, avg, max or min)", name));
}

namespace {

// The collective whose measured entry a call uses.
Collective measured_kind(Collective c) {
  switch (c) {
    case Collective::all_gatherv:
    case Collective::split:
      return Collective::all_gather;
    case Collective::reduce_scatterv:
      return Collective::reduce_scatter;
    default:
      return c;
  }
}

std::string bytes_label(size_t b) {
  if (b >= (size_t{1} << 20) && b % (size_t{1} << 20) == 0) return fmt::format("{} MiB", b >> 20);
  if (b >= 1024) return fmt::format("{} KiB", b / 1024);
  return fmt::format("{} B", b);
}

}  // namespace

CommAlgorithm MeasuredChoice::lookup(Collective c, size_t bytes) const {
  const Collective k = measured_kind(c);
  for (const Entry& e : entries) {
    if (e.collective != k || e.ranges.empty()) continue;
    for (const Range& r : e.ranges) {
      if (bytes <= r.max_bytes) return r.algorithm;
    }
    return e.ranges.back().algorithm;
  }
  return CommAlgorithm::automatic;
}

std::string MeasuredChoice::describe() const {
  std::string out;
  for (const Entry& e : entries) {
    if (!out.empty()) out += "; ";
    out += fmt::format("{}: ", collective_name(e.collective));
    for (size_t i = 0; i < e.ranges.size(); ++i) {
      const Range& r = e.ranges[i];
      if (i > 0) out += ", ";
      out += algorithm_name(r.algorithm);
      if (i + 1 < e.ranges.size()) {
        out += fmt::format(" up to {}", bytes_label(r.max_bytes));
      } else if (i > 0) {
        out += " above";
      }
    }
  }
  return out;
}

CommAlgorithm AlgorithmPolicy::choose(Collective c, size_t bytes, int size, bool has_shared_memory,
                                      bool has_native) const {
  if (measured && measured->size == size && measured->shared_memory == has_shared_memory) {
    const CommAlgorithm a = measured->lookup(c, bytes);
    const bool available = (a != CommAlgorithm::shared_memory || has_shared_memory) &&
                           (a != CommAlgorithm::native || has_native);
    if (a != CommAlgorithm::automatic && available) return a;
  }
  const bool shm = prefer_shared_memory && has_shared_memory;
  const bool native = prefer_native && has_native;
  switch (c) {
    case Collective::all_reduce:
    case Collective::reduce_scatter:
    case Collective::reduce_scatterv:
    case Collective::all_gather:
    case Collective::all_gatherv:
    case Collective::split:
      if (shm) return CommAlgorithm::shared_memory;
      if (native) return CommAlgorithm::native;
      // A power-of-two group has no fold steps, so halving-doubling keeps its
      // log2(n) advantage longer; elsewhere the fold costs a full extra copy.
      return bytes <= halving_doubling_max_bytes && size > 2 ? CommAlgorithm::halving_doubling
                                                             : CommAlgorithm::ring;
    case Collective::broadcast:
      if (shm) return CommAlgorithm::shared_memory;
      return native ? CommAlgorithm::native : CommAlgorithm::tree;
    case Collective::barrier:
      if (shm) return CommAlgorithm::shared_memory;
      return native ? CommAlgorithm::native : CommAlgorithm::dissemination;
    case Collective::all_to_all:
    case Collective::all_to_allv:
      return native ? CommAlgorithm::native : CommAlgorithm::pairwise;
    case Collective::send:
    case Collective::recv:
      return CommAlgorithm::pairwise;
  }
  return CommAlgorithm::ring;
}

}  // namespace mt
