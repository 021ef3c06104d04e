// Collective algorithms written against the point-to-point transport (and,
// for shared_memory, the node-shared arena), each beside the function that
// states its cost on one rank: latency-bound steps and exact bytes sent to /
// received from peers. The communicator's byte counters report the same
// numbers, which tests/comm checks; docs/comm.md tabulates them.
//
// Conventions: counts are elements of `dtype`; `counts` spans have one entry
// per rank (block r belongs to rank r, blocks are contiguous in rank order);
// `send` may equal `recv` for all-reduce (in place) and all-gather(v) (the
// rank's own block already in place); otherwise buffers do not overlap. Every
// function blocks until done or throws TimeoutError / CommError via ctx.
#pragma once

#include <cstddef>
#include <cstring>
#include <span>
#include <vector>

#include "meshtrain/comm/collective_context.h"
#include "meshtrain/comm/options.h"

namespace mt {
class Communicator;
}

namespace mt::comm {

class ShmChannel;

// memcpy that accepts null pointers with n == 0 (empty buffers may be null).
inline void copy_bytes(void* dst, const void* src, size_t n) {
  if (n > 0) std::memcpy(dst, src, n);
}

// Splits `count` elements into `parts` contiguous blocks whose sizes are
// multiples of `align` (except the last) and differ by at most `align`.
std::vector<size_t> balanced_counts(size_t count, int parts, size_t align = 1);
// Exclusive prefix sums: offsets[i] = counts[0] + ... + counts[i-1]; size n+1.
std::vector<size_t> prefix_offsets(std::span<const size_t> counts);

// ---- ring (ring.cpp) --------------------------------------------------------
void ring_all_reduce(CollectiveContext& ctx, const void* send, void* recv, size_t count,
                     DType dtype, ReduceOp op);
CollectiveCost ring_all_reduce_cost(int n, int rank, size_t count, size_t elem_bytes);
void ring_reduce_scatterv(CollectiveContext& ctx, const void* send, void* recv,
                          std::span<const size_t> counts, DType dtype, ReduceOp op);
CollectiveCost ring_reduce_scatterv_cost(int n, int rank, std::span<const size_t> counts,
                                         size_t elem_bytes);
void ring_all_gatherv(CollectiveContext& ctx, const void* send, void* recv,
                      std::span<const size_t> counts, size_t elem_bytes);
CollectiveCost ring_all_gatherv_cost(int n, int rank, std::span<const size_t> counts,
                                     size_t elem_bytes);

// ---- recursive halving / doubling (halving_doubling.cpp) --------------------
void hd_all_reduce(CollectiveContext& ctx, const void* send, void* recv, size_t count, DType dtype,
                   ReduceOp op);
CollectiveCost hd_all_reduce_cost(int n, int rank, size_t count, size_t elem_bytes);
void hd_reduce_scatterv(CollectiveContext& ctx, const void* send, void* recv,
                        std::span<const size_t> counts, DType dtype, ReduceOp op);
CollectiveCost hd_reduce_scatterv_cost(int n, int rank, std::span<const size_t> counts,
                                       size_t elem_bytes);
void hd_all_gatherv(CollectiveContext& ctx, const void* send, void* recv,
                    std::span<const size_t> counts, size_t elem_bytes);
CollectiveCost hd_all_gatherv_cost(int n, int rank, std::span<const size_t> counts,
                                   size_t elem_bytes);

// ---- tree, pairwise, dissemination, direct agreement (basic_algorithms.cpp) -
void tree_broadcast(CollectiveContext& ctx, void* buf, size_t bytes, int root);
CollectiveCost tree_broadcast_cost(int n, int rank, size_t bytes, int root);
void pairwise_all_to_allv(CollectiveContext& ctx, const void* send,
                          std::span<const size_t> send_counts, void* recv,
                          std::span<const size_t> recv_counts, size_t elem_bytes);
CollectiveCost pairwise_all_to_allv_cost(int n, int rank, std::span<const size_t> send_counts,
                                         std::span<const size_t> recv_counts, size_t elem_bytes);
void dissemination_barrier(CollectiveContext& ctx);
CollectiveCost dissemination_barrier_cost(int n, int rank);
// Every rank sends its `record_bytes` record to every other rank: all[r] is
// rank r's record. One step; used for the handshake when there is no arena.
void direct_exchange(CollectiveContext& ctx, const void* record, void* all, size_t record_bytes);
CollectiveCost direct_exchange_cost(int n, int rank, size_t record_bytes);

// ---- shared memory (shm_algorithms.cpp, arena layout in shm_channel.h) ------
// `staged`: a single-round call whose data the matching shm_stage_* wrote
// before the handshake, whose flag then also published it (one round trip
// fewer). Each shm_stage_* returns false, staging nothing, when the call needs
// several rounds.
void shm_all_reduce(CollectiveContext& ctx, ShmChannel& ch, const void* send, void* recv,
                    size_t count, DType dtype, ReduceOp op, bool staged = false);
CollectiveCost shm_all_reduce_cost(int n, int rank, size_t count, size_t elem_bytes,
                                   size_t slot_bytes);
bool shm_stage_all_reduce(CollectiveContext& ctx, ShmChannel& ch, const void* send, size_t count,
                          DType dtype);
void shm_reduce_scatterv(CollectiveContext& ctx, ShmChannel& ch, const void* send, void* recv,
                         std::span<const size_t> counts, DType dtype, ReduceOp op,
                         bool staged = false);
CollectiveCost shm_reduce_scatterv_cost(int n, int rank, std::span<const size_t> counts,
                                        size_t elem_bytes, size_t slot_bytes);
bool shm_stage_reduce_scatterv(CollectiveContext& ctx, ShmChannel& ch, const void* send,
                               std::span<const size_t> counts, DType dtype);
void shm_all_gatherv(CollectiveContext& ctx, ShmChannel& ch, const void* send, void* recv,
                     std::span<const size_t> counts, size_t elem_bytes, bool staged = false);
CollectiveCost shm_all_gatherv_cost(int n, int rank, std::span<const size_t> counts,
                                    size_t elem_bytes, size_t slot_bytes);
bool shm_stage_all_gatherv(CollectiveContext& ctx, ShmChannel& ch, const void* send,
                           std::span<const size_t> counts, size_t elem_bytes);
void shm_broadcast(CollectiveContext& ctx, ShmChannel& ch, void* buf, size_t bytes, int root,
                   bool staged = false);
CollectiveCost shm_broadcast_cost(int n, int rank, size_t bytes, int root, size_t slot_bytes);
bool shm_stage_broadcast(CollectiveContext& ctx, ShmChannel& ch, const void* buf, size_t bytes,
                         int root);
void shm_barrier(CollectiveContext& ctx, ShmChannel& ch);
CollectiveCost shm_barrier_cost(int n, int rank);
// The handshake over the arena: like direct_exchange, for records of at most
// ShmChannel::kRecordBytes.
void shm_exchange(CollectiveContext& ctx, ShmChannel& ch, const void* record, void* all,
                  size_t record_bytes);
CollectiveCost shm_exchange_cost(int n, int rank, size_t record_bytes);

// ---- hierarchical (hierarchical.cpp) -------------------------------------------
// Ranks grouped into `nodes` nodes of `per_node` ranks each. `node` is the
// communicator of this rank's node (local rank = index in the node),
// `cross` that of the ranks with the same local index on every node (rank =
// node index); node_members / cross_members map their ranks to ranks of the
// calling communicator. Local rank j owns chunk j (hier_chunk_counts): the
// node reduce-scatters into it, the cross group all-reduces it, the node
// all-gathers the chunks. Sub-calls run without their own handshake (the
// caller's agreed on the call) within ctx's deadline; their bytes are
// counted on ctx per peer of the calling communicator.
struct HierGroups {
  Communicator* node = nullptr;
  Communicator* cross = nullptr;
  std::vector<int> node_members;
  std::vector<int> cross_members;
  int nodes = 0;
  int per_node = 0;
  // grid[i * per_node + j]: the rank (of the calling communicator) with
  // local index j on node i.
  std::vector<int> grid;
};
// The collectives the hierarchical algorithm runs.
inline bool hierarchical_applies(Collective c) {
  return c == Collective::all_reduce || c == Collective::reduce_scatter ||
         c == Collective::reduce_scatterv || c == Collective::all_gather ||
         c == Collective::all_gatherv;
}
std::vector<size_t> hier_chunk_counts(size_t count, int per_node, size_t elem_bytes);
void hier_all_reduce(CollectiveContext& ctx, HierGroups& g, const void* send, void* recv,
                     size_t count, DType dtype, ReduceOp op);
// What the three sub-calls cost with the algorithms they run (as their
// communicators' policy picks them; `intra_slot_bytes` for shared_memory).
struct HierAlgorithms {
  CommAlgorithm intra_reduce_scatter = CommAlgorithm::ring;
  CommAlgorithm inter_all_reduce = CommAlgorithm::ring;
  CommAlgorithm intra_all_gather = CommAlgorithm::ring;
  size_t intra_slot_bytes = 0;
};
CollectiveCost hier_all_reduce_cost(int nodes, int per_node, int node_index, int local,
                                    size_t count, size_t elem_bytes, const HierAlgorithms& a);
// Reduce-scatter(v) and all-gather(v): the blocks are packed by local index
// (for each j, the blocks of the ranks with local index j, in node order);
// reduce-scatter: the node reduce-scatters the packed groups (local rank j
// gets its group's node sums), the cross group reduce-scatters that among
// the nodes (each rank its own block); all-gather: the cross group gathers
// its blocks, the node gathers the groups, and the result is unpacked into
// rank order. Inter-node bytes: (k-1)/k of B/m per rank instead of the flat
// ring's (n-1)/n of B. `intra` / `inter`: the sub-calls' algorithms (for
// reduce-scatter intra_reduce_scatter and inter_all_reduce stand for the
// node's and the cross group's reduce-scatter; for all-gather
// intra_all_gather and inter_all_reduce for the two gathers).
void hier_reduce_scatterv(CollectiveContext& ctx, HierGroups& g, const void* send, void* recv,
                          std::span<const size_t> counts, DType dtype, ReduceOp op);
void hier_all_gatherv(CollectiveContext& ctx, HierGroups& g, const void* send, void* recv,
                      std::span<const size_t> counts, DType dtype);
// The per-local-index group sizes (node sub-call counts) and this rank's
// cross-group block sizes, for `counts` over the whole communicator.
std::vector<size_t> hier_group_counts(const HierGroups& g, std::span<const size_t> counts);
std::vector<size_t> hier_cross_counts(const HierGroups& g, int local,
                                      std::span<const size_t> counts);
CollectiveCost hier_reduce_scatterv_cost(const HierGroups& g, int node_index, int local,
                                         std::span<const size_t> counts, size_t elem_bytes,
                                         const HierAlgorithms& a);
CollectiveCost hier_all_gatherv_cost(const HierGroups& g, int node_index, int local,
                                     std::span<const size_t> counts, size_t elem_bytes,
                                     const HierAlgorithms& a);

}  // namespace mt::comm
