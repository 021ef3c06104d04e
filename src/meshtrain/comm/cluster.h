// Where ranks are and what links join them: node groups (for hierarchical
// collectives) and, optionally, emulated links (latency and bandwidth per
// link kind) that the transport imposes on every message.
//
// A ClusterLayout is resolved for one world size: node_of[r] is rank r's
// node, site_of_node[k] node k's site. The CLI builds it from a cluster file
// (cli/cluster_file.h, docs/cluster.md) or from dist.node_size; tests build
// it directly. Giving one to CommOptions::cluster makes the communicator
// wrap its transport in a ClusterTransport (below): node groups then come
// from the layout, not from the machine, and with any constrained link every
// message is delayed as that link would deliver it.
//
// Link emulation is emulation: the delay is real time spent by the sender
// before it hands a message to the real transport (so the byte counters'
// seconds and the call observer's times include it), the real transport's
// own time comes on top, and it is meant for links much slower than the
// machine's (docs/cluster.md).
#pragma once

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/comm/transport.h"

namespace mt {

// One link: latency in seconds and bandwidth in bytes per second (0 =
// unlimited). Both 0: unconstrained, messages pass untouched.
struct LinkSpec {
  double latency_s = 0;
  double bandwidth_bytes_s = 0;

  bool constrained() const { return latency_s > 0 || bandwidth_bytes_s > 0; }
  // Seconds a message of `bytes` occupies the link (bytes / bandwidth).
  double transfer_s(size_t bytes) const {
    return bandwidth_bytes_s > 0 ? static_cast<double>(bytes) / bandwidth_bytes_s : 0.0;
  }
  // "1 Gbit/s, 1 ms" / "unconstrained"
  std::string describe() const;
};

enum class LinkKind : uint8_t { self, intra_node, inter_node, inter_site };

// What one emulated link is. rank_pair: every ordered pair of ranks has its
// own link (one network interface per rank). node_pair: the messages from
// all ranks of node A to all ranks of node B (A != B) share one link per
// direction, one message at a time in the order they were sent (one
// interface per node); links inside a node stay per rank pair.
enum class LinkSharing : uint8_t { rank_pair, node_pair };

struct ClusterLayout {
  std::vector<int> node_of;       // per world rank
  std::vector<int> site_of_node;  // per node (all 0 without sites)
  std::vector<std::string> node_names;
  std::string source;  // the cluster file, or "dist.node_size = 2", for messages
  LinkSpec intra_node;
  LinkSpec inter_node;
  LinkSpec inter_site;
  // Node pairs (lower index first) whose link differs from its kind's.
  std::map<std::pair<int, int>, LinkSpec> node_pairs;
  LinkSharing sharing = LinkSharing::rank_pair;

  // node_size ranks per node in rank order (the last node may hold fewer);
  // no emulated links.
  static ClusterLayout by_node_size(int world, int node_size);

  int world() const { return static_cast<int>(node_of.size()); }
  int nodes() const { return static_cast<int>(node_names.size()); }
  LinkKind kind(int a, int b) const;
  const LinkSpec& link(int a, int b) const;
  // Whether any link between distinct ranks is constrained.
  bool emulates() const;
  // "4 ranks on 2 nodes (2 + 2); inter-node 1 Gbit/s, 1 ms; ..." for logs.
  std::string describe() const;
  // Throws ConfigError naming `source` unless node_of covers ranks 0..n-1
  // with valid node indices and site_of_node one site per node.
  void validate() const;
};

std::string_view link_kind_name(LinkKind k);
std::string_view link_sharing_name(LinkSharing s);

// The messages a process sends over emulated links, per destination world
// rank: when each link is free again, and the sends that wait for their
// emulated arrival in FIFO order. Shared by a world transport and every
// transport split from it (they are the same process's links).
class LinkQueues;

// Wraps a transport with a layout. `world` maps this transport's ranks to
// the layout's world ranks. Offers the inner transport's arena only when all
// its ranks are on one node of the layout and no link is emulated (a
// shared-memory copy cannot be delayed per link), and its native collectives
// only without emulation; splits are wrapped too.
// With LinkSharing::node_pair and emulation, the ranks share a table of
// when each node pair's link is free again: a small file in /dev/shm whose
// name rank 0 sends to the others over `inner` before `deadline` (ranks of
// one node must run on one host to share it; a rank on another host gets
// its own table and shares only with the ranks there).
std::shared_ptr<Transport> make_cluster_transport(std::shared_ptr<Transport> inner,
                                                  std::shared_ptr<const ClusterLayout> layout,
                                                  Deadline deadline);

}  // namespace mt
