// What a collective costs in time, without a communicator: the algorithm the
// communicator's policy would pick for a group of ranks (a pure function
// the communicator itself calls, so the planner picks what the runtime
// runs), each algorithm's per-rank cost (the *_cost functions of
// algorithms.h, which the byte counters are checked against) and an
// alpha-beta time over the links the algorithm crosses:
//
//   time on rank r = steps_r x latency + max(bytes_sent_r, bytes_received_r) / bandwidth
//   time of the call = the largest over the group's ranks
//
// (full-duplex links: a rank sends and receives at once). Ring all-reduce of
// B bytes on n ranks with B divisible by n is then exactly
// 2(n-1)/n x B/W + 2(n-1) x L. The hierarchical algorithm adds its three
// phases, each over its own links (the node's, then the cross group's).
//
// Which link: a flat algorithm over a group is as fast as its slowest link
// (every step waits for the slowest pair), so it takes the worst link among
// the group's ranks: the intra-node link when the group sits on one node,
// else the slowest inter-node / inter-site link between its nodes (per node
// pair overrides included). A measured fit for ALGORITHM/LINK_KIND
// (`meshtrain calibrate`, e.g. "ring/intra_node") replaces the link's spec
// for that algorithm. A link with bandwidth 0 is unlimited (and latency 0
// instant), as in the link emulation. Pure; nothing here blocks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "meshtrain/comm/cluster.h"
#include "meshtrain/comm/options.h"

namespace mt::comm {

// What the algorithm choice depends on, for one group of ranks.
struct GroupTopology {
  int size = 1;
  bool shared_memory = false;  // the transport offers a node-shared window
  bool native = false;         // the engine's collectives can run the call
  // The ranks sit on several nodes with the same number (> 1) on each (the
  // communicator then has node and cross sub-groups: hierarchical applies).
  bool hierarchy = false;
  int nodes = 1;     // distinct nodes among the group's ranks
  int per_node = 0;  // ranks per node when every node holds the same number, else 0
};

// The topology of `ranks` (world ranks of `layout`) as a communicator over
// them would see it: shared memory when they all sit on one node and no link
// is emulated (the runtime then gets an arena), hierarchy as above, no
// native collectives (meshtrain's own algorithms).
GroupTopology group_topology(const ClusterLayout& layout, std::span<const int> ranks);

// What CommAlgorithm::automatic resolves to: hierarchical where it applies
// and the policy prefers it, else AlgorithmPolicy::choose. `bytes` as
// choose() takes them. The communicator calls this same function.
CommAlgorithm select_algorithm(const AlgorithmPolicy& policy, Collective c, size_t bytes,
                               const GroupTopology& t);

// One collective call's shape: `count` elements (all_reduce, broadcast: the
// buffer; all_gather / reduce_scatter / all_to_all: each rank's block) or,
// for the v-variants, `counts` per rank.
struct CollectiveShape {
  Collective kind = Collective::all_reduce;
  size_t count = 0;
  std::vector<size_t> counts;  // per rank; empty = `count` each
  size_t elem_bytes = 4;
  int root = 0;  // broadcast

  // Per-rank blocks for n ranks (counts, or n x count).
  std::vector<size_t> blocks(int n) const;
  // The bytes the policy chooses by: the buffer for all_reduce and
  // broadcast, the gathered total for all_gather / reduce_scatter.
  size_t policy_bytes(int n) const;
};

// Rank `rank`'s cost of one flat algorithm (ring, halving_doubling,
// shared_memory, tree, pairwise, dissemination) on n ranks: the *_cost
// function of algorithms.h for the call. Throws ConfigError for an
// algorithm that does not apply to the collective (or hierarchical: see
// CommCostModel).
CollectiveCost algorithm_cost(const CollectiveShape& s, CommAlgorithm a, int n, int rank,
                              size_t slot_bytes);

// Alpha-beta seconds of one rank's cost over one link (see the top).
double alpha_beta_s(const CollectiveCost& c, const LinkSpec& link);

// The default shared-memory slot (MpiOptions' 1 MiB per rank, two slots).
inline constexpr size_t kDefaultShmSlotBytes = 512 * 1024;

// A collective's predicted time and traffic on a group.
struct CollectiveEstimate {
  CommAlgorithm algorithm = CommAlgorithm::automatic;
  double seconds = 0;                    // the slowest rank's
  std::vector<double> rank_seconds;      // per group rank
  std::vector<uint64_t> bytes_sent;      // per group rank
  std::vector<uint64_t> bytes_received;  // per group rank
  int64_t steps = 0;                     // the largest over the group's ranks
};

// Times collectives and point-to-point messages over a cluster layout.
// Holds a copy of the layout; cheap to query (O(group size) per call, plus
// the algorithm's own cost function per rank).
struct CommCostModel {
  ClusterLayout layout;
  // Measured fits "ALGORITHM/LINK_KIND" (e.g. "ring/inter_node"); where
  // absent, the layout's link.
  std::map<std::string, LinkSpec> algorithm_links;
  AlgorithmPolicy policy;
  size_t shm_slot_bytes = kDefaultShmSlotBytes;

  // The link a flat algorithm over `ranks` runs at (see the top), and its kind.
  LinkSpec group_link(CommAlgorithm a, std::span<const int> ranks, LinkKind* kind = nullptr) const;
  // One call over `ranks` (world ranks, in group order), with `algorithm`
  // or, for automatic, what the runtime's policy picks.
  CollectiveEstimate collective(const CollectiveShape& s, std::span<const int> ranks,
                                CommAlgorithm algorithm = CommAlgorithm::automatic) const;
  // One message of `bytes` from world rank a to b: latency + bytes /
  // bandwidth over their link (fit "pairwise/LINK_KIND" where measured).
  double send_s(int a, int b, size_t bytes) const;
};

}  // namespace mt::comm
