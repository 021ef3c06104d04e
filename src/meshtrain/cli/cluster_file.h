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

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "meshtrain/comm/cluster.h"

namespace mt {

struct ClusterFile {
  std::string path;
  int node_size = 0;  // > 0: ranks k*size .. on node k (instead of `nodes`)
  struct Node {
    std::string name;
    std::vector<int> ranks;
    std::string device;  // a key of `devices`, or ""
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
  // Device kinds (issue 12, the planner, reads them; the transport does not).
  struct Device {
    std::optional<double> peak_tflops;
    std::optional<double> memory_gb;
  };
  std::map<std::string, Device> devices;
};

ClusterFile read_cluster_file(const std::string& path);
// Parses TOML text; `source` names it in messages.
ClusterFile parse_cluster_file(const std::string& text, const std::string& source);
// The layout for a job of `world` ranks: nodes must cover ranks 0..world-1,
// each rank once; the slowdown list must have one factor per rank.
ClusterLayout resolve_cluster(const ClusterFile& file, int world);

}  // namespace mt
