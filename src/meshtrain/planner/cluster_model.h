// The planner's view of a cluster: what each rank's device can compute and
// hold, and the links between ranks. The cost model, the simulator and the
// plan search read this one description; the CLI builds it from a cluster
// file (docs/cluster.md) or `meshtrain calibrate` writes one for this
// machine. Links and node layout are the comm layer's own ClusterLayout, so
// what the planner assumes and what the link emulation does are one record.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "meshtrain/comm/cluster.h"

namespace mt::planner {

// One kind of device (an A100 80GB, this machine's CPU, ...).
struct DeviceKind {
  std::string name;
  double peak_flops_f32 = 0;    // FLOP/s, dense f32 (or TF32 where that is the f32 path)
  double peak_flops_bf16 = 0;   // FLOP/s, dense bf16 / f16; 0 = same as f32
  double memory_bytes = 0;      // usable device memory
  double memory_bandwidth = 0;  // bytes/s, for memory-bound operators; 0 = unknown
  // Fraction of peak an operator kind reaches, measured (`meshtrain
  // calibrate`) or from published figures, keyed by the graph's operator
  // name (e.g. "matmul", "softmax"); operators not listed use
  // default_efficiency.
  std::map<std::string, double> efficiency;
  double default_efficiency = 0.5;
  std::string source;  // where the numbers come from, for the report
};

struct ClusterModel {
  std::string source;  // the file, or "calibrated on <cpu>", for messages
  std::vector<DeviceKind> kinds;
  std::vector<int> kind_of;      // per world rank: index into kinds
  std::vector<double> slowdown;  // per world rank (>= 1); empty = none
  ClusterLayout layout;          // nodes, sites and links (comm/cluster.h)
  // Measured latency / bandwidth of one collective algorithm over one link
  // kind, keyed "ALGORITHM/LINK_KIND" (e.g. "ring/intra_node",
  // "shared_memory/intra_node"); where absent the link's own spec is used.
  std::map<std::string, LinkSpec> algorithm_links;

  int world() const { return static_cast<int>(kind_of.size()); }
  const DeviceKind& device(int rank) const {
    return kinds.at(static_cast<size_t>(kind_of.at(static_cast<size_t>(rank))));
  }
  double slowdown_of(int rank) const {
    return slowdown.empty() ? 1.0 : slowdown.at(static_cast<size_t>(rank));
  }
};

}  // namespace mt::planner
