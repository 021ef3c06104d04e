// The planner's view of a cluster: what each rank's device can compute and
// hold, and the links between ranks. The cost model, the simulator and the
// plan search read this one description; the CLI builds it from a cluster
// file (docs/cluster.md) or `meshtrain calibrate` writes one for this
// machine. Links and node layout are the comm layer's own ClusterLayout, so
// what the planner assumes and what the link emulation does are one record.
#pragma once

#include <array>
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
  // Seconds the runtime spends per kernel besides the kernel itself (the
  // executor's dispatch and bookkeeping between two operators; a GPU's
  // launch overhead), added once per kernel run: per operator, per fused
  // run under fused_elementwise. Not scaled by a rank's slowdown (the
  // emulation stretches kernels only). `meshtrain calibrate` measures it.
  double op_overhead_s = 0;
  // Bytes/s at which a matmul moves the operand that does not scale with
  // the batch -- the weights it reads and the weight gradient it writes
  // (weight_values in planner/cost_model.h) -- in addition to its FLOP
  // time: on this machine's CPU that traffic does not overlap the FLOPs
  // (i12-traffic, docs/planner.md). 0 = it overlaps, as every other byte:
  // the matmul costs max(FLOP time, byte time). `meshtrain calibrate`
  // writes the measured memory bandwidth.
  double weight_bandwidth = 0;
  // Bytes of last-level cache the ranks of a node on this device share (a
  // CPU's L3). A rank whose weights and their gradients (2 x its parameters'
  // f32 bytes) fit its share (cache_bytes / the node's ranks) keeps them in
  // cache between their uses: no weight traffic is priced for it. 0 = no
  // cache: the traffic is priced whenever weight_bandwidth is set.
  double cache_bytes = 0;
  // Relative standard deviation of a rank's compute time between two
  // synchronisations (run-to-run and rank-to-rank variation on this
  // device). Ranks of equal programs then reach a collective at different
  // times and the call waits for the last: the simulator starts each
  // collective of n members E[max of n standard normals] x compute_jitter
  // x (the compute since the members' previous synchronisation) after the
  // predicted arrival. 0 = ranks arrive together. `meshtrain calibrate`
  // measures it (ranks running the same work at once, started together).
  double compute_jitter = 0;
  // Fraction of peak an operator kind reaches, measured (`meshtrain
  // calibrate`) or from published figures, keyed by the graph's operator
  // name (e.g. "matmul", "softmax"); operators not listed use
  // default_efficiency.
  std::map<std::string, double> efficiency;
  double default_efficiency = 0.5;
  // Tile and wave quantization of matmuls (wave_efficiency in
  // planner/cost_model.h): the device's parallel compute units (an A100's
  // 108 SMs) and the matmul library's output tile (rows, columns); 0 = not
  // modelled (every matmul at its efficiency).
  int64_t compute_units = 0;
  std::array<int64_t, 2> matmul_tile{0, 0};
  std::string source;  // where the numbers come from, for the report
  // The runtime the cost model prices on this device (cluster file
  // [devices.NAME.runtime]). Both false: meshtrain's own executor -- every
  // operator its own pass over memory, each value at its graph dtype (under
  // bf16 the matmul inputs and some activations are 16-bit, the residual
  // stream, scores and normalisations f32).
  //   half_activations: under a bf16 / f16 run, floating-point activations
  //     are priced at 2 bytes per element (between operators, in tensor-
  //     parallel collectives and pipeline sends) and weights have a 16-bit
  //     copy the optimizer writes once per step (its casts cost nothing in
  //     a pass) -- fp16 mixed precision as Megatron-LM runs it;
  //   fused_elementwise: each run of consecutive element-wise operators
  //     (add, sub, mul, scale, activations and their gradients, softmax and
  //     its gradient, casts) between two other operators is one kernel: it
  //     reads the run's inputs and writes the values read after it once,
  //     intermediates stay on chip (Megatron-LM's fused bias+GeLU,
  //     bias+dropout+add and scaled masked softmax; a fusing compiler).
  //   attention_dropout: each softmax's output (the attention
  //     probabilities) goes through a dropout kernel of its own after the
  //     softmax: the forward reads the probabilities and writes them and a
  //     1-byte mask, the backward (at the softmax's gradient) reads the
  //     gradient and the mask and writes the gradient -- Megatron-LM's
  //     attention dropout, outside its fused scale-mask-softmax kernel;
  //   blocking_p2p: a pipeline stage's sends occupy its compute lane (the
  //     stage computes on only once its send has been transferred) instead
  //     of the communication lane -- Megatron-LM's 2021 p2p exchange
  //     (batch_isend_irecv, every request waited, then a device synchronize).
  bool half_activations = false;
  bool fused_elementwise = false;
  bool attention_dropout = false;
  bool blocking_p2p = false;
  std::string runtime_source;  // which runtime, and where that comes from
};

struct ClusterModel {
  std::string source;  // the file, or "calibrated on <cpu>", for messages
  std::vector<DeviceKind> kinds;
  std::vector<int> kind_of;      // per world rank: index into kinds
  std::vector<double> slowdown;  // per world rank (>= 1); empty = none
  // Per node (layout's index): how many ranks share each of its CPU cores,
  // ranks / cores where the ranks outnumber the cores (cluster file
  // `[[nodes]] cores`, `meshtrain calibrate` writes it); empty or 1 = a
  // core (a device) per rank. A rank's kernels take this much longer: the
  // ranks time-share the cores.
  std::vector<double> node_core_sharing;
  ClusterLayout layout;  // nodes, sites and links (comm/cluster.h)
  // Measured latency / bandwidth of one collective algorithm over one link
  // kind, keyed "ALGORITHM/LINK_KIND" (e.g. "ring/intra_node",
  // "shared_memory/intra_node"); where absent the link's own spec is used.
  std::map<std::string, LinkSpec> algorithm_links;

  int world() const { return static_cast<int>(kind_of.size()); }
  const DeviceKind& device(int rank) const {
    return kinds.at(static_cast<size_t>(kind_of.at(static_cast<size_t>(rank))));
  }
  // The rank's emulated slowdown (dist.slowdown, the file's ranks.slowdown)
  // times its node's core sharing: how much longer its kernels take.
  double slowdown_of(int rank) const {
    double s = slowdown.empty() ? 1.0 : slowdown.at(static_cast<size_t>(rank));
    if (!node_core_sharing.empty()) {
      s *= node_core_sharing.at(static_cast<size_t>(layout.node_of.at(static_cast<size_t>(rank))));
    }
    return s;
  }
};

}  // namespace mt::planner
