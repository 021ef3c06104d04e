// The cluster file (TOML, docs/cluster.md): which ranks each node holds,
// the sites, the links by kind (and per node pair) with latency and
// bandwidth, per-rank compute slowdown, and device kinds for the planner.
//
// read_cluster_file() checks what it can without the world size (types,
// ranges, unknown keys, names); resolve_cluster() checks the file against
// the job's ranks and gives the comm layer's ClusterLayout. Every error is a
// ConfigError naming the file, the key and what was expected:
// `cluster file c.toml: links.inter_node.bandwidth_gbit_s: expected a number
// > 0, got -1`.
#pragma once

#include <array>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "meshtrain/comm/cluster.h"
#include "meshtrain/planner/cluster_model.h"

namespace mt {

struct ClusterFile {
  std::string path;
  int node_size = 0;  // > 0: ranks k*size .. on node k (instead of `nodes`)
  struct Node {
    std::string name;
    std::vector<int> ranks;
    std::string device;  // a key of `devices`, or ""
    // CPU cores the node's ranks share (`cores`); 0: a device per rank.
    int cores = 0;
  };
  std::vector<Node> nodes;
  struct Site {
    std::string name;
    std::vector<std::string> nodes;
  };
  std::vector<Site> sites;
  LinkSpec intra_node, inter_node, inter_site;
  LinkSharing sharing = LinkSharing::rank_pair;  // links.sharing
  struct Pair {
    std::string a, b;
    LinkSpec link;
  };
  std::vector<Pair> pairs;
  std::vector<double> slowdown;  // per rank, >= 1; empty = none
  // Device kinds (the planner reads them; the transport does not).
  struct Device {
    std::optional<double> peak_tflops;       // dense f32 (peak_tflops or peak_tflops_f32)
    std::optional<double> peak_tflops_tf32;  // dense TF32 tensor cores, where the f32 path has them
    std::optional<double> peak_tflops_bf16;  // dense bf16 / f16
    std::optional<double> memory_gb;
    std::optional<double> memory_bandwidth_gb_s;
    double weight_bandwidth_gb_s = 0;  // matmuls' weight traffic, added to their FLOPs; 0 = hidden
    double cache_mb = 0;               // last-level cache the node's ranks share; 0 = none
    double op_overhead_us = 0;         // the executor's time per kernel run
    double compute_jitter = 0;         // relative std. dev. of compute between syncs
    std::map<std::string, double> efficiency;  // operator name -> fraction of peak
    std::optional<double> default_efficiency;
    int64_t compute_units = 0;                 // 0: not given
    std::array<int64_t, 2> matmul_tile{0, 0};  // rows, columns; 0: not given
    std::string source;                        // where the numbers come from
    // [devices.NAME.runtime]: how the simulated runtime executes on this
    // device (planner::DeviceKind's fields of the same names).
    bool half_activations = false;
    bool fused_elementwise = false;
    bool attention_dropout = false;
    bool blocking_p2p = false;
    std::string runtime_source;
  };
  std::map<std::string, Device> devices;
  std::string device;  // top-level `device`: the kind of nodes that name none
  // Measured latency / bandwidth of a collective algorithm over a link kind
  // ([collectives.ALGORITHM.LINK_KIND], `meshtrain calibrate` writes them),
  // keyed "ALGORITHM/LINK_KIND".
  std::map<std::string, LinkSpec> collectives;

  // The number of ranks the nodes hold (0 with node_size: it depends on the job).
  int ranks() const;
};

ClusterFile read_cluster_file(const std::string& path);
// Parses TOML text; `source` names it in messages.
ClusterFile parse_cluster_file(const std::string& text, const std::string& source);
// The layout for a job of `world` ranks: nodes must cover ranks 0..world-1,
// each rank once; the slowdown list must have one factor per rank.
ClusterLayout resolve_cluster(const ClusterFile& file, int world);

// The planner's model of the cluster for `world` ranks (0: the file's own
// rank count, which a node_size file does not have). Every rank needs a
// device kind with peak_tflops (or peak_tflops_f32) and memory_gb: its node's
// `device`, else the top-level `device`, else the only kind defined.
// ConfigError naming the key otherwise.
planner::ClusterModel cluster_model(const ClusterFile& file, int world = 0);

}  // namespace mt
