// Collective time from the algorithms' own cost functions (comm/cost.h).
#include "meshtrain/comm/cost.h"

#include <algorithm>
#include <numeric>

#include <fmt/format.h>

#include "meshtrain/base/error.h"
#include "meshtrain/comm/algorithms.h"

namespace mt::comm {

GroupTopology group_topology(const ClusterLayout& layout, std::span<const int> ranks) {
  GroupTopology t;
  t.size = static_cast<int>(ranks.size());
  std::map<int, int> per;  // node -> ranks of the group on it
  for (int r : ranks) ++per[layout.node_of.at(static_cast<size_t>(r))];
  t.nodes = static_cast<int>(per.size());
  t.per_node = per.empty() ? 0 : per.begin()->second;
  for (const auto& [node, k] : per) {
    if (k != t.per_node) t.per_node = 0;
  }
  t.shared_memory = t.nodes <= 1 && !layout.emulates();
  t.hierarchy = t.nodes > 1 && t.per_node > 1;
  return t;
}

CommAlgorithm select_algorithm(const AlgorithmPolicy& policy, Collective c, size_t bytes,
                               const GroupTopology& t) {
  if (hierarchical_applies(c) && t.hierarchy && policy.prefer_hierarchical) {
    return CommAlgorithm::hierarchical;
  }
  return policy.choose(c, bytes, t.size, t.shared_memory, t.native);
}

std::vector<size_t> CollectiveShape::blocks(int n) const {
  if (!counts.empty()) return counts;
  return std::vector<size_t>(static_cast<size_t>(n), count);
}

size_t CollectiveShape::policy_bytes(int n) const {
  switch (kind) {
    case Collective::all_reduce:
    case Collective::broadcast:
      return count * elem_bytes;
    default: {
      const std::vector<size_t> b = blocks(n);
      return std::accumulate(b.begin(), b.end(), size_t{0}) * elem_bytes;
    }
  }
}

CollectiveCost algorithm_cost(const CollectiveShape& s, CommAlgorithm a, int n, int rank,
                              size_t slot_bytes) {
  using A = CommAlgorithm;
  const size_t e = s.elem_bytes;
  switch (s.kind) {
    case Collective::all_reduce:
      if (a == A::ring) return ring_all_reduce_cost(n, rank, s.count, e);
      if (a == A::halving_doubling) return hd_all_reduce_cost(n, rank, s.count, e);
      if (a == A::shared_memory) return shm_all_reduce_cost(n, rank, s.count, e, slot_bytes);
      break;
    case Collective::all_gather:
    case Collective::all_gatherv:
    case Collective::split: {
      const std::vector<size_t> b = s.blocks(n);
      if (a == A::ring) return ring_all_gatherv_cost(n, rank, b, e);
      if (a == A::halving_doubling) return hd_all_gatherv_cost(n, rank, b, e);
      if (a == A::shared_memory) return shm_all_gatherv_cost(n, rank, b, e, slot_bytes);
      break;
    }
    case Collective::reduce_scatter:
    case Collective::reduce_scatterv: {
      const std::vector<size_t> b = s.blocks(n);
      if (a == A::ring) return ring_reduce_scatterv_cost(n, rank, b, e);
      if (a == A::halving_doubling) return hd_reduce_scatterv_cost(n, rank, b, e);
      if (a == A::shared_memory) return shm_reduce_scatterv_cost(n, rank, b, e, slot_bytes);
      break;
    }
    case Collective::broadcast:
      if (a == A::tree) return tree_broadcast_cost(n, rank, s.count * e, s.root);
      if (a == A::shared_memory)
        return shm_broadcast_cost(n, rank, s.count * e, s.root, slot_bytes);
      break;
    case Collective::all_to_all:
    case Collective::all_to_allv:
      if (a == A::pairwise) {
        const std::vector<size_t> b = s.blocks(n);
        return pairwise_all_to_allv_cost(n, rank, b, b, e);
      }
      break;
    case Collective::barrier:
      if (a == A::dissemination) return dissemination_barrier_cost(n, rank);
      if (a == A::shared_memory) return shm_barrier_cost(n, rank);
      break;
    default:
      break;
  }
  throw ConfigError(fmt::format("no cost model for {} with algorithm {}", collective_name(s.kind),
                                algorithm_name(a)));
}

double alpha_beta_s(const CollectiveCost& c, const LinkSpec& link) {
  const uint64_t bytes = std::max(c.bytes_sent, c.bytes_received);
  return static_cast<double>(c.steps) * link.latency_s + link.transfer_s(bytes);
}

namespace {

// The slower of two links: the larger latency, the smaller finite bandwidth.
LinkSpec worse(const LinkSpec& a, const LinkSpec& b) {
  LinkSpec w;
  w.latency_s = std::max(a.latency_s, b.latency_s);
  if (a.bandwidth_bytes_s <= 0) {
    w.bandwidth_bytes_s = b.bandwidth_bytes_s;
  } else if (b.bandwidth_bytes_s <= 0) {
    w.bandwidth_bytes_s = a.bandwidth_bytes_s;
  } else {
    w.bandwidth_bytes_s = std::min(a.bandwidth_bytes_s, b.bandwidth_bytes_s);
  }
  return w;
}

std::string fit_key(CommAlgorithm a, LinkKind k) {
  return fmt::format("{}/{}", algorithm_name(a), link_kind_name(k));
}

}  // namespace

LinkSpec CommCostModel::group_link(CommAlgorithm a, std::span<const int> ranks,
                                   LinkKind* kind_out) const {
  // The worst link between any two nodes of the group (or the node's own
  // link when there is one node).
  std::vector<int> nodes;
  nodes.reserve(ranks.size());
  for (int r : ranks) nodes.push_back(layout.node_of.at(static_cast<size_t>(r)));
  std::sort(nodes.begin(), nodes.end());
  nodes.erase(std::unique(nodes.begin(), nodes.end()), nodes.end());
  LinkKind kind = ranks.size() > 1 ? LinkKind::intra_node : LinkKind::self;
  LinkSpec link = ranks.size() > 1 ? layout.intra_node : LinkSpec{};
  if (nodes.size() > 1) {
    link = LinkSpec{};
    kind = LinkKind::inter_node;
    auto site = [&](int node) { return layout.site_of_node.at(static_cast<size_t>(node)); };
    if (layout.node_pairs.empty()) {
      // Every pair's link is its kind's: inter_node where some two nodes
      // share a site, inter_site where some two do not (linear, where the
      // pairs are quadratic: a data-parallel group of a thousand ranks).
      std::vector<int> sites;
      for (int nd : nodes) sites.push_back(site(nd));
      std::sort(sites.begin(), sites.end());
      const bool shared_site = std::adjacent_find(sites.begin(), sites.end()) != sites.end();
      const bool several_sites = sites.front() != sites.back();
      if (shared_site) link = worse(link, layout.inter_node);
      if (several_sites) {
        kind = LinkKind::inter_site;
        link = worse(link, layout.inter_site);
      }
    } else {
      for (size_t i = 0; i < nodes.size(); ++i) {
        for (size_t j = i + 1; j < nodes.size(); ++j) {
          const bool cross = site(nodes[i]) != site(nodes[j]);
          if (cross) kind = LinkKind::inter_site;
          const auto it = layout.node_pairs.find({nodes[i], nodes[j]});
          link = worse(link, it != layout.node_pairs.end()
                                 ? it->second
                                 : (cross ? layout.inter_site : layout.inter_node));
        }
      }
    }
  }
  if (kind_out != nullptr) *kind_out = kind;
  if (auto it = algorithm_links.find(fit_key(a, kind)); it != algorithm_links.end()) {
    return it->second;
  }
  return link;
}

CollectiveEstimate CommCostModel::collective(const CollectiveShape& s, std::span<const int> ranks,
                                             CommAlgorithm algorithm) const {
  const int n = static_cast<int>(ranks.size());
  const GroupTopology topo = group_topology(layout, ranks);
  CollectiveEstimate e;
  e.algorithm = algorithm == CommAlgorithm::automatic
                    ? select_algorithm(policy, s.kind, s.policy_bytes(n), topo)
                    : algorithm;
  e.rank_seconds.assign(static_cast<size_t>(n), 0.0);
  e.bytes_sent.assign(static_cast<size_t>(n), 0);
  e.bytes_received.assign(static_cast<size_t>(n), 0);
  if (n <= 1) return e;

  auto add = [&](size_t i, const CollectiveCost& c, const LinkSpec& link, int64_t* steps) {
    e.rank_seconds[i] += alpha_beta_s(c, link);
    e.bytes_sent[i] += c.bytes_sent;
    e.bytes_received[i] += c.bytes_received;
    *steps += c.steps;
  };

  if (e.algorithm != CommAlgorithm::hierarchical) {
    const LinkSpec link = group_link(e.algorithm, ranks);
    for (int r = 0; r < n; ++r) {
      const CollectiveCost c = algorithm_cost(s, e.algorithm, n, r, shm_slot_bytes);
      int64_t steps = 0;
      add(static_cast<size_t>(r), c, link, &steps);
      e.steps = std::max(e.steps, steps);
    }
  } else {
    if (!topo.hierarchy || !hierarchical_applies(s.kind)) {
      throw ConfigError(fmt::format(
          "hierarchical {} needs ranks on several nodes with the same number (> 1) on each",
          collective_name(s.kind)));
    }
    // The communicator's grid: nodes in order of first appearance, local
    // index = position among the node's ranks in group order.
    const int k = topo.nodes, m = topo.per_node;
    std::vector<int> node_order;
    std::vector<int> grid(static_cast<size_t>(n));
    std::vector<int> node_index(static_cast<size_t>(n)), local(static_cast<size_t>(n));
    std::map<int, int> filled;
    for (int r = 0; r < n; ++r) {
      const int node = layout.node_of.at(static_cast<size_t>(ranks[static_cast<size_t>(r)]));
      auto it = std::find(node_order.begin(), node_order.end(), node);
      const int i = static_cast<int>(it - node_order.begin());
      if (it == node_order.end()) node_order.push_back(node);
      const int j = filled[node]++;
      node_index[static_cast<size_t>(r)] = i;
      local[static_cast<size_t>(r)] = j;
      grid[static_cast<size_t>(i * m + j)] = r;
    }
    // The sub-groups as world ranks: node i, and cross group j.
    auto node_ranks = [&](int i) {
      std::vector<int> v;
      for (int j = 0; j < m; ++j) {
        v.push_back(ranks[static_cast<size_t>(grid[static_cast<size_t>(i * m + j)])]);
      }
      return v;
    };
    auto cross_ranks = [&](int j) {
      std::vector<int> v;
      for (int i = 0; i < k; ++i) {
        v.push_back(ranks[static_cast<size_t>(grid[static_cast<size_t>(i * m + j)])]);
      }
      return v;
    };
    const size_t e_bytes = s.elem_bytes;
    const std::vector<size_t> all_blocks = s.blocks(n);
    for (int r = 0; r < n; ++r) {
      const int i = node_index[static_cast<size_t>(r)], j = local[static_cast<size_t>(r)];
      const std::vector<int> nr = node_ranks(i), cr = cross_ranks(j);
      const GroupTopology nt = group_topology(layout, nr), ct = group_topology(layout, cr);
      int64_t steps = 0;
      // Each phase: (shape, group ranks, topology, rank in it).
      auto phase = [&](const CollectiveShape& ps, const std::vector<int>& g, const GroupTopology& t,
                       int rank_in) {
        const int gn = static_cast<int>(g.size());
        const CommAlgorithm a = select_algorithm(policy, ps.kind, ps.policy_bytes(gn), t);
        const CollectiveCost c = algorithm_cost(ps, a, gn, rank_in, shm_slot_bytes);
        add(static_cast<size_t>(r), c, group_link(a, g), &steps);
      };
      if (s.kind == Collective::all_reduce) {
        const std::vector<size_t> chunks = hier_chunk_counts(s.count, m, e_bytes);
        CollectiveShape rs{Collective::reduce_scatterv, 0, chunks, e_bytes, 0};
        CollectiveShape ar{Collective::all_reduce, chunks[static_cast<size_t>(j)], {}, e_bytes, 0};
        CollectiveShape ag{Collective::all_gatherv, 0, chunks, e_bytes, 0};
        // The node's policy sees the whole buffer for its reduce-scatter and
        // all-gather (as Communicator::cost passes count * elem).
        phase(rs, nr, nt, j);
        phase(ar, cr, ct, i);
        phase(ag, nr, nt, j);
      } else {
        HierGroups hg;
        hg.nodes = k;
        hg.per_node = m;
        hg.grid = grid;
        const std::vector<size_t> groups = hier_group_counts(hg, all_blocks);
        const std::vector<size_t> cross = hier_cross_counts(hg, j, all_blocks);
        const bool rs =
            s.kind == Collective::reduce_scatter || s.kind == Collective::reduce_scatterv;
        const Collective sub = rs ? Collective::reduce_scatterv : Collective::all_gatherv;
        CollectiveShape intra{sub, 0, groups, e_bytes, 0};
        CollectiveShape inter{sub, 0, cross, e_bytes, 0};
        if (rs) {
          phase(intra, nr, nt, j);
          phase(inter, cr, ct, i);
        } else {
          phase(inter, cr, ct, i);
          phase(intra, nr, nt, j);
        }
      }
      e.steps = std::max(e.steps, steps);
    }
  }
  e.seconds = *std::max_element(e.rank_seconds.begin(), e.rank_seconds.end());
  return e;
}

double CommCostModel::send_s(int a, int b, size_t bytes) const {
  if (a == b) return 0.0;
  const LinkKind kind = layout.kind(a, b);
  LinkSpec link = layout.link(a, b);
  if (auto it = algorithm_links.find(fit_key(CommAlgorithm::pairwise, kind));
      it != algorithm_links.end()) {
    link = it->second;
  }
  return link.latency_s + link.transfer_s(bytes);
}

}  // namespace mt::comm
