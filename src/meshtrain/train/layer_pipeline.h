// Layer pipelining for full-graph GNN training, after GNNPipe: the model's
// graph layers are cut into consecutive ranges, one per rank (a stage holds
// its layers' parameters and computes them for the whole graph), and the
// vertices into chunks that flow through the stages, so stage p computes
// chunk k while stage p-1 computes chunk k+1. What crosses between stages
// is a chunk's embedding rows forward and their gradient backward: 2 (P-1)
// n h floats per epoch over all ranks (n vertices, h the hidden width),
// independent of the number of layers -- graph parallelism moves halo rows
// at every layer instead.
//
// A layer's aggregation reads every in-neighbour's message
// (models/model.h, GnnLayerChunk). For chunk k, neighbours in chunks before
// k have this epoch's messages (computed already, on this stage); those in
// later chunks are not computed yet and stand in with their messages from
// the previous epoch: the historical embeddings. They are constants: no
// gradient flows into them. The first `startup_epochs` epochs (and the
// final evaluation) run as one chunk, with no staleness; with one chunk the
// run equals single-process training.
//
// Schedule per epoch, every stage: the forward of chunks 0..K-1 (receive
// the chunk's input rows, compute, send its output rows asynchronously),
// then the backward of chunks K-1..0. Backward in reverse chunk order makes
// the gradient exact for the chunked forward: chunk k's backward adds the
// gradients of the fresh messages of chunks j < k it read into their
// gradient buffers before chunk j's backward runs. Each backward recomputes
// its chunk's forward (the executor runs forward and backward together), so
// a stage computes 1.33x the FLOPs of its layers; activations are not
// stashed between the two passes.
//
// The hybrid with graph parallelism (par.graph_parts = G > 1): the ranks
// are stages x G, rank = part x stages + stage. The graph is cut into G
// parts and each part into chunks (hybrid_blocks); each part
// goes through the stages on its own column of ranks, as above with n_part
// rows, and a stage's G ranks exchange halo rows at every aggregation with
// graph parallelism's in-graph exchange (GnnLayerChunk::shard) and
// all-reduce their parameters' gradients (copy_to_group). Chunk k's
// exchange carries every row of chunk k another part reads, so the rule
// above holds across parts: earlier chunks fresh, later ones historical.
// docs/graph_format.md has the byte formulas and what GNNPipe does.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/data/graph_data.h"
#include "meshtrain/models/model.h"
#include "meshtrain/train/full_graph.h"
#include "meshtrain/train/trainer.h"

namespace mt {

// Graph layers [first, last) of each of `stages` stages: as even as the
// layer count allows, earlier stages taking the remainder. ConfigError
// when there are fewer layers than stages.
std::vector<std::pair<int64_t, int64_t>> layer_pipeline_stages(int64_t layers, int stages);

// Bytes stage `stage` of `stages` sends per training epoch: each vertex's
// output row (gnn_hidden floats) forward unless it is the last stage, its
// input row's gradient backward unless it is the first.
int64_t layer_pipeline_bytes_per_epoch(const ModelSpec& spec, int64_t vertices, int stage,
                                       int stages);

// The hybrid with graph parallelism: the number of pipeline stages for
// `ranks` ranks and par.graph_parts parts (ranks / graph_parts). ConfigError
// naming gnn.graph_parts unless it divides the ranks, and naming
// gnn.replication when graph_parts > 1 and replication != 1 (each stage is
// partitioned 1D).
int hybrid_stages(const GraphParallelOptions& par, int ranks);
// ConfigError naming gnn.graph_parts when it is not 1 outside gnn.parallel =
// "layer" (graph parallelism partitions over every rank already).
void check_graph_parts(const GraphParallelOptions& par);

// Which graph part and which chunk of it every vertex is in: the graph cut
// into `parts` parts by the partitioner, then each part's induced subgraph
// into `chunks` chunks by the same partitioner (so locality parts keep
// their small cut between parts, and locality chunks theirs inside a part).
// With one part the chunks are partition_graph(adj, chunks). ConfigError
// naming gnn.chunks / gnn.graph_parts when a part or chunk would be empty.
struct HybridBlocks {
  std::vector<int32_t> part_of, chunk_of;  // per vertex
};
HybridBlocks hybrid_blocks(const Csr& adj, PartitionOptions po, int64_t parts, int64_t chunks);

// Halo bytes a rank of the hybrid sends per training epoch for its stage's
// layers [first, last): its part's rows the other parts read (send_rows,
// summed over the parts) go out forward twice -- in the forward pass and
// again in the backward pass, which recomputes the chunk's forward -- and
// the gradients of the halo rows it read (recv_rows) go back once, for
// every layer whose message has a gradient (gnn_message_has_grad), at the
// layer's message width. The same for any number of chunks: chunk k's
// exchange carries exactly the rows of chunk k that other parts read.
int64_t hybrid_halo_bytes_per_epoch(const ModelSpec& spec, int64_t send_rows, int64_t recv_rows,
                                    int64_t first, int64_t last, int64_t features, int64_t classes);

// train_full_graph with par.mode == GnnParallel::layer: every rank of comm
// calls it with the same graph and options; rank r is stage r mod stages of
// graph part r / stages (stage r without the hybrid). Results
// (losses, accuracies, final parameters by name) are the same on every rank.
FullGraphResult train_layer_pipeline(const ModelSpec& spec, const GraphData& g,
                                     const TrainerOptions& opts,
                                     const std::function<void(const std::string&)>& log,
                                     const GraphParallelOptions& par, Communicator& comm);

}  // namespace mt
