// Graph parallelism for full-graph GNN training, CAGNET's 1D and 1.5D
// schemes made sparsity-aware. 1D: a partition (data/graph_partition.h) gives every rank a
// set of vertices; the rank holds their features, computes their rows of
// every layer, and before each aggregation receives, from each other rank,
// only the rows its own vertices read (the halo), not whole blocks. Backward
// sends the halo rows' gradients back to their owners (the exchange's
// gradient, graph/collective.h). Parameters are replicated and their
// gradients all-reduced. 1.5D (replication c): the graph is partitioned
// into P / c row blocks, each held by c ranks; every replica receives only
// the halo parts assigned to it (replica_of) from the same replica of the
// other blocks, computes its share of each aggregation, and the shares are
// all-reduced over the block's c ranks. Halo traffic per rank shrinks
// (fewer, larger blocks cut fewer edges, and each block pair is served by
// one replica) at the price of that all-reduce and of dense work done c
// times.
//
// make_graph_shard() is pure: every rank computes its own shard from the
// whole graph and the partition (so the send and receive lists of every
// pair of ranks agree by construction, with no message to set them up).
#pragma once

#include <cstdint>
#include <vector>

#include "meshtrain/data/graph_data.h"
#include "meshtrain/data/graph_partition.h"
#include "meshtrain/models/model.h"

namespace mt {

struct GraphShard {
  GnnShard shard;                                    // the model's view (models/model.h)
  std::vector<int32_t> local_vertices;               // global id of local row i, ascending
  std::vector<int32_t> halo_vertices;                // global id of halo row i (by owner, then id)
  std::vector<int32_t> loss_vertices;                // local rows in the training mask, ascending
  std::vector<int32_t> val_vertices, test_vertices;  // local rows, ascending
};

// ConfigError unless graph parallelism with replication c can run spec's
// model, naming gnn.replication and model.kind: every GNN runs 1D; GAT and
// sage with max aggregation need a row's whole neighbourhood in one place,
// which 1.5D (c > 1) splits over the replicas.
void check_graph_parallel_model(const ModelSpec& spec, int64_t replication);
bool graph_parallel_supports(const ModelSpec& spec, int64_t replication);

// The collective groups of graph parallelism over `ranks` ranks with
// replication c, as CommCollectiveRunner takes them: group 0 is every rank
// (parameters); with c > 1, groups 1 .. c are the exchange groups (rank
// k * c + j for every row block k, for each j) and groups c + 1 .. c + P/c
// the replica groups (ranks i * c .. i * c + c - 1 hold row block i).
std::vector<std::vector<int>> graph_parallel_groups(int ranks, int replication);

// Which replica (0 .. c-1) computes the terms of rows of part recv_part
// that read part src_part: the local block recv_part mod c, the others
// (recv_part + src_part) mod c -- a round robin that spreads both.
int64_t replica_of(int64_t recv_part, int64_t src_part, int64_t replication);

// Rank `rank`'s shard of g under partition p: p.parts row blocks, each held
// by `replication` ranks (rank = block x replication + replica; 1D when
// replication is 1), for the adjacency spec's model aggregates over
// (gnn_adjacency). ConfigError for a model graph parallelism does not
// support (gat, sage with max).
GraphShard make_graph_shard(const GraphData& g, const ModelSpec& spec, const Partition& p,
                            int64_t rank, int64_t replication = 1);

// The halo's order, given `from[q]`, the vertices this rank reads from
// part q (any order): each list sorted, recv_counts[q] its length, and the
// halo rows numbered part by part (halo_id[u] = u's row in halo_vertices,
// which the lists are appended to).
void number_halo_rows(std::vector<std::vector<int32_t>>& from, std::vector<int64_t>& recv_counts,
                      std::vector<int32_t>& halo_id, std::vector<int32_t>& halo_vertices);

// The gathered rows of `features` (f32 [n, F]) for `vertices`, in order.
Tensor gather_rows(const Tensor& features, const std::vector<int32_t>& vertices);

// Bytes this rank sends in halo exchanges per epoch (one forward and
// backward pass), f32 rows: for every aggregation, forward the rows other
// ranks read from it (sum of send_counts) and backward the gradients of the
// halo rows it read (sum of recv_counts), times the width aggregated; no
// backward when the aggregated value has no gradient (gcn: every layer's
// h W; resgcn: every block's; sage: every layer's message,
// gnn_message_width's -- its input, or h W_neigh where that is narrower --
// the features at layer 0 having no gradient). Over all ranks: halo rows x
// width x aggregations x 2 (gcn, resgcn).
int64_t halo_bytes_per_epoch(const ModelSpec& spec, const GnnShard& s, int64_t features,
                             int64_t classes);

}  // namespace mt
