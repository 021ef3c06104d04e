// Hierarchical all-reduce for ranks on several nodes: reduce-scatter inside
// each node (shared memory where the node's ranks really share it, else its
// point-to-point algorithms), all-reduce of each chunk across the nodes (ring
// or halving-doubling over the transport, all ranks at once, one chunk each),
// all-gather inside each node. The inter-node links carry 2 (k-1)/k of B / m
// per rank (k nodes of m ranks) instead of the flat ring's 2 (n-1)/n B, and
// every rank of a node uses its own share of them.
#include <algorithm>

#include "meshtrain/base/error.h"
#include "meshtrain/comm/algorithms.h"
#include "meshtrain/comm/communicator.h"
#include "meshtrain/comm/reduce.h"

namespace mt::comm {

std::vector<size_t> hier_chunk_counts(size_t count, int per_node, size_t elem_bytes) {
  // Cache-line multiples, so that the node's shared-memory chunks start aligned.
  return balanced_counts(count, per_node, std::max<size_t>(1, 64 / elem_bytes));
}

namespace {

// Runs fn (one call on `sub`) and counts the bytes it moved on ctx, per
// peer of the calling communicator.
template <class Fn>
void counted(CollectiveContext& ctx, Communicator& sub, const std::vector<int>& members, Fn&& fn) {
  sub.reset_counters();
  fn();
  const CommCounters c = sub.counters();
  for (size_t q = 0; q < c.by_peer.size(); ++q) {
    if (c.by_peer[q].bytes_sent > 0) ctx.count_sent(members[q], c.by_peer[q].bytes_sent);
    if (c.by_peer[q].bytes_received > 0) {
      ctx.count_received(members[q], c.by_peer[q].bytes_received);
    }
  }
}

CollectiveCost sub_cost(Collective c, CommAlgorithm a, int n, int rank,
                        std::span<const size_t> counts, size_t count, size_t elem, size_t slot) {
  switch (c) {
    case Collective::reduce_scatterv:
      if (a == CommAlgorithm::ring) return ring_reduce_scatterv_cost(n, rank, counts, elem);
      if (a == CommAlgorithm::halving_doubling) {
        return hd_reduce_scatterv_cost(n, rank, counts, elem);
      }
      if (a == CommAlgorithm::shared_memory) {
        return shm_reduce_scatterv_cost(n, rank, counts, elem, slot);
      }
      break;
    case Collective::all_gatherv:
      if (a == CommAlgorithm::ring) return ring_all_gatherv_cost(n, rank, counts, elem);
      if (a == CommAlgorithm::halving_doubling) return hd_all_gatherv_cost(n, rank, counts, elem);
      if (a == CommAlgorithm::shared_memory) {
        return shm_all_gatherv_cost(n, rank, counts, elem, slot);
      }
      break;
    case Collective::all_reduce:
      if (a == CommAlgorithm::ring) return ring_all_reduce_cost(n, rank, count, elem);
      if (a == CommAlgorithm::halving_doubling) return hd_all_reduce_cost(n, rank, count, elem);
      break;
    default:
      break;
  }
  throw ConfigError(fmt::format("hierarchical all_reduce: no cost model for its {} with {}",
                                collective_name(c), algorithm_name(a)));
}

}  // namespace

void hier_all_reduce(CollectiveContext& ctx, HierGroups& g, const void* send, void* recv,
                     size_t count, DType dtype, ReduceOp op) {
  const size_t elem = dtype_size(dtype);
  const std::vector<size_t> counts = hier_chunk_counts(count, g.per_node, elem);
  const int local = g.node->rank();
  const size_t mine = counts[static_cast<size_t>(local)];
  std::byte* chunk = ctx.scratch(mine * elem, 0);
  // avg: sums all the way, one division by the whole group at the end.
  const ReduceOp inner = op == ReduceOp::avg ? ReduceOp::sum : op;
  auto sub_opts = [&] {
    CollectiveOptions o;
    o.handshake = false;
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(ctx.deadline() - CommClock::now());
    o.timeout = std::max(left, std::chrono::milliseconds(1));
    return o;
  };
  ctx.set_step(0, 3);
  counted(ctx, *g.node, g.node_members,
          [&] { g.node->reduce_scatterv(send, chunk, counts, dtype, inner, sub_opts()); });
  ctx.set_step(1, 3);
  counted(ctx, *g.cross, g.cross_members,
          [&] { g.cross->all_reduce(chunk, chunk, mine, dtype, inner, sub_opts()); });
  ctx.set_step(2, 3);
  counted(ctx, *g.node, g.node_members,
          [&] { g.node->all_gatherv(chunk, recv, counts, dtype, sub_opts()); });
  if (op == ReduceOp::avg) divide(recv, count, dtype, ctx.size());
}

CollectiveCost hier_all_reduce_cost(int nodes, int per_node, int node_index, int local,
                                    size_t count, size_t elem_bytes, const HierAlgorithms& a) {
  const std::vector<size_t> counts = hier_chunk_counts(count, per_node, elem_bytes);
  const size_t mine = counts[static_cast<size_t>(local)];
  CollectiveCost total;
  for (const CollectiveCost& c :
       {sub_cost(Collective::reduce_scatterv, a.intra_reduce_scatter, per_node, local, counts, 0,
                 elem_bytes, a.intra_slot_bytes),
        sub_cost(Collective::all_reduce, a.inter_all_reduce, nodes, node_index, {}, mine,
                 elem_bytes, 0),
        sub_cost(Collective::all_gatherv, a.intra_all_gather, per_node, local, counts, 0,
                 elem_bytes, a.intra_slot_bytes)}) {
    total.steps += c.steps;
    total.bytes_sent += c.bytes_sent;
    total.bytes_received += c.bytes_received;
  }
  return total;
}

std::vector<size_t> hier_group_counts(const HierGroups& g, std::span<const size_t> counts) {
  std::vector<size_t> out(static_cast<size_t>(g.per_node), 0);
  for (int j = 0; j < g.per_node; ++j) {
    for (int i = 0; i < g.nodes; ++i) {
      out[static_cast<size_t>(j)] +=
          counts[static_cast<size_t>(g.grid[static_cast<size_t>(i * g.per_node + j)])];
    }
  }
  return out;
}

std::vector<size_t> hier_cross_counts(const HierGroups& g, int local,
                                      std::span<const size_t> counts) {
  std::vector<size_t> out;
  for (int i = 0; i < g.nodes; ++i) {
    out.push_back(counts[static_cast<size_t>(g.grid[static_cast<size_t>(i * g.per_node + local)])]);
  }
  return out;
}

namespace {

// Copies between rank order (`flat`, blocks by rank) and the packed order
// (for each local index j, the blocks of grid(0, j), grid(1, j), ...).
void repack(const HierGroups& g, std::span<const size_t> counts, size_t elem, const void* from,
            void* to, bool to_packed) {
  const std::vector<size_t> offs = prefix_offsets(counts);
  size_t packed = 0;
  for (int j = 0; j < g.per_node; ++j) {
    for (int i = 0; i < g.nodes; ++i) {
      const size_t r = static_cast<size_t>(g.grid[static_cast<size_t>(i * g.per_node + j)]);
      const size_t bytes = counts[r] * elem;
      const size_t flat = offs[r] * elem;
      if (to_packed) {
        copy_bytes(static_cast<std::byte*>(to) + packed, static_cast<const std::byte*>(from) + flat,
                   bytes);
      } else {
        copy_bytes(static_cast<std::byte*>(to) + flat, static_cast<const std::byte*>(from) + packed,
                   bytes);
      }
      packed += bytes;
    }
  }
}

CollectiveOptions sub_options(const CollectiveContext& ctx) {
  CollectiveOptions o;
  o.handshake = false;
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(ctx.deadline() - CommClock::now());
  o.timeout = std::max(left, std::chrono::milliseconds(1));
  return o;
}

size_t total(std::span<const size_t> c) {
  size_t t = 0;
  for (size_t x : c) t += x;
  return t;
}

}  // namespace

void hier_reduce_scatterv(CollectiveContext& ctx, HierGroups& g, const void* send, void* recv,
                          std::span<const size_t> counts, DType dtype, ReduceOp op) {
  const size_t elem = dtype_size(dtype);
  const int local = g.node->rank();
  const std::vector<size_t> groups = hier_group_counts(g, counts);
  const std::vector<size_t> cross = hier_cross_counts(g, local, counts);
  std::byte* packed = ctx.scratch(total(counts) * elem, 0);
  std::byte* mine = ctx.scratch(groups[static_cast<size_t>(local)] * elem, 1);
  const ReduceOp inner = op == ReduceOp::avg ? ReduceOp::sum : op;
  repack(g, counts, elem, send, packed, true);
  ctx.set_step(0, 2);
  counted(ctx, *g.node, g.node_members,
          [&] { g.node->reduce_scatterv(packed, mine, groups, dtype, inner, sub_options(ctx)); });
  ctx.set_step(1, 2);
  counted(ctx, *g.cross, g.cross_members,
          [&] { g.cross->reduce_scatterv(mine, recv, cross, dtype, inner, sub_options(ctx)); });
  if (op == ReduceOp::avg) {
    divide(recv, counts[static_cast<size_t>(ctx.rank())], dtype, ctx.size());
  }
}

void hier_all_gatherv(CollectiveContext& ctx, HierGroups& g, const void* send, void* recv,
                      std::span<const size_t> counts, DType dtype) {
  const size_t elem_bytes = dtype_size(dtype);
  const int local = g.node->rank();
  const std::vector<size_t> groups = hier_group_counts(g, counts);
  const std::vector<size_t> cross = hier_cross_counts(g, local, counts);
  std::byte* packed = ctx.scratch(total(counts) * elem_bytes, 0);
  // The cross group's gather lands where this group's part of the packed
  // buffer is, so the node's gather runs in place.
  const std::vector<size_t> group_offs = prefix_offsets(groups);
  std::byte* mine = packed + group_offs[static_cast<size_t>(local)] * elem_bytes;
  ctx.set_step(0, 2);
  counted(ctx, *g.cross, g.cross_members,
          [&] { g.cross->all_gatherv(send, mine, cross, dtype, sub_options(ctx)); });
  ctx.set_step(1, 2);
  counted(ctx, *g.node, g.node_members,
          [&] { g.node->all_gatherv(mine, packed, groups, dtype, sub_options(ctx)); });
  repack(g, counts, elem_bytes, packed, recv, false);
}

CollectiveCost hier_reduce_scatterv_cost(const HierGroups& g, int node_index, int local,
                                         std::span<const size_t> counts, size_t elem_bytes,
                                         const HierAlgorithms& a) {
  const std::vector<size_t> groups = hier_group_counts(g, counts);
  const std::vector<size_t> cross = hier_cross_counts(g, local, counts);
  CollectiveCost t;
  for (const CollectiveCost& c :
       {sub_cost(Collective::reduce_scatterv, a.intra_reduce_scatter, g.per_node, local, groups, 0,
                 elem_bytes, a.intra_slot_bytes),
        sub_cost(Collective::reduce_scatterv, a.inter_all_reduce, g.nodes, node_index, cross, 0,
                 elem_bytes, 0)}) {
    t.steps += c.steps;
    t.bytes_sent += c.bytes_sent;
    t.bytes_received += c.bytes_received;
  }
  return t;
}

CollectiveCost hier_all_gatherv_cost(const HierGroups& g, int node_index, int local,
                                     std::span<const size_t> counts, size_t elem_bytes,
                                     const HierAlgorithms& a) {
  const std::vector<size_t> groups = hier_group_counts(g, counts);
  const std::vector<size_t> cross = hier_cross_counts(g, local, counts);
  CollectiveCost t;
  for (const CollectiveCost& c : {sub_cost(Collective::all_gatherv, a.inter_all_reduce, g.nodes,
                                           node_index, cross, 0, elem_bytes, 0),
                                  sub_cost(Collective::all_gatherv, a.intra_all_gather, g.per_node,
                                           local, groups, 0, elem_bytes, a.intra_slot_bytes)}) {
    t.steps += c.steps;
    t.bytes_sent += c.bytes_sent;
    t.bytes_received += c.bytes_received;
  }
  return t;
}

}  // namespace mt::comm
