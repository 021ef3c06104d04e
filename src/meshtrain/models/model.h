// The models meshtrain ships, written once against the graph Builder.
//
// build_model() returns the forward graph of one model for a given batch
// size: the inputs the trainer feeds (x, y), the logits and the scalar loss.
// Training differentiates it (graph/autodiff.h); evaluation runs it forward.
// Mixed precision: with compute = bf16 or f16 every matmul reads its operands
// in that dtype (parameters stay f32 masters and are cast) and accumulates in
// f32. Under bf16, activations that flow from one matmul to the next -- hidden
// layers with their bias and activation function, attention's q, k, v and
// output -- stay in bf16; logits, the residual stream, layer norm, softmax,
// the loss and convolutions are f32 (and under f16 every activation is).
// Parameter gradients are f32.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/graph/graph.h"
#include "meshtrain/tensor/sparse.h"
#include "meshtrain/tensor/tensor.h"

namespace mt {

struct ModelSpec {
  std::string kind = "mlp";  // "mlp", "cnn", "gpt", or a GNN: "gcn", "sage", "gat", "resgcn"
  DType compute = DType::f32;
  // Images (mlp, cnn): channels x height x width, classes.
  int64_t image_channels = 1, image_size = 28, classes = 10;
  std::vector<int64_t> hidden = {512, 512};       // mlp hidden widths
  std::vector<int64_t> conv_channels = {32, 64};  // cnn: one conv-relu-pool block each
  int64_t fc = 128;                               // cnn classifier hidden width
  // gpt
  int64_t layers = 4, d_model = 256, heads = 4, seq_len = 128, vocab = 256;
  // Graph neural networks (gcn, sage, gat, resgcn): hidden width and number of
  // graph convolutions (resgcn: residual blocks between an input and an
  // output linear layer).
  int64_t gnn_hidden = 64, gnn_layers = 2;
  std::string sage_aggregation = "mean";  // sage: "mean" or "max" over in-neighbours
  int64_t gat_heads = 1;  // gat: attention heads (hidden layers concatenate, the last averages)
};

struct ModelGraph {
  Graph graph;
  ValueId x = kNoValue;       // f32 images [B, C, H, W] / [B, C*H*W], or i32 tokens [B, T]
  ValueId y = kNoValue;       // i32 labels [B] or next tokens [B*T]
  ValueId logits = kNoValue;  // f32 [B, classes] or [B*T, vocab]
  ValueId loss = kNoValue;    // f32 scalar, mean cross-entropy
  // Inputs with fixed contents (e.g. GPT position ids) the trainer binds once.
  std::vector<std::pair<ValueId, Tensor>> constants;
  int64_t batch = 0;
  int64_t samples_per_batch() const { return batch; }
};

// The graph a GNN is built for: its structure (row i = vertex i's
// in-neighbours), feature width, class count, and the vertices whose labels
// the loss sees (the train mask's members, ascending).
struct GnnShard;

struct GnnGraph {
  const Csr* adj = nullptr;
  int64_t features = 0, classes = 0;
  std::vector<int32_t> loss_vertices;
  // Graph parallelism (1D): this rank's share of the graph. adj is then
  // ignored; x, logits and loss_vertices are the shard's local rows.
  const GnnShard* shard = nullptr;
};

// The adjacency a GNN aggregates over, with its edge values: gcn / resgcn:
// A + I with D^-1/2 (A + I) D^-1/2; sage mean: A with 1 / in-degree; sage
// max: A, no values; gat: A + I, no values (attention computes them).
struct GnnAdjacency {
  Csr a;
  std::vector<float> values;  // one per entry, or empty
};
GnnAdjacency gnn_adjacency(const ModelSpec& spec, const Csr& adj);

// One rank's share of a graph under 1D graph parallelism (built by
// train/graph_parallel.h from a partition). The rank owns `local` vertices
// (rows 0 .. local-1 of x and of the logits) and reads halo vertices other
// ranks own: the rows of gnn_adjacency() for its vertices are split into a
// local part (columns = local rows) and a halo part (columns = halo rows,
// ordered by owner rank, then global id). Each aggregation's input is
// exchanged: rows send_rows (grouped by destination rank, send_counts[q] for
// rank q) go out, recv_counts[q] halo rows come in from rank q, by one
// uneven all_to_all over collective group `group`; the aggregation is
// local part x local rows + halo part x received rows. Parameters are
// replicated: each enters through copy_to_group (Megatron's f), so autodiff
// all-reduces their gradients. The loss is this rank's share of the global
// mean: sum of its loss vertices' cross-entropy / loss_total, so the sum
// over ranks is the single-process loss. GAT's edge softmax and sage's max
// aggregation need a row's whole neighbourhood in one place: they run on the
// joined rows [local; halo] (placed by two selection products, no new
// operator) with the row's local and halo entries in one adjacency, 1D only.
//
// 1.5D (replication > 1, CAGNET's replication factor c): `replication`
// ranks hold the same rows (a replica group, collective group
// replica_group); each computes its part of every aggregation -- the local
// part and the halo parts the round-robin assigned to it (the others are
// empty) -- and the parts are all-reduced over the replica group. The halo
// exchange runs over exchange_group (the ranks with the same position in
// their replica groups, one per row block; this rank is exchange_rank
// there, and send / recv counts are per exchange_group rank). The loss is
// divided by replication (every replica computes it).
struct GnnShard {
  int64_t group = 0, rank = 0, ranks = 1;  // parameters: replicated over `group`
  int64_t exchange_group = 0, exchange_rank = 0, exchange_ranks = 1;
  int64_t replica_group = -1, replication = 1;
  int64_t local = 0, halo = 0;
  Csr local_adj, halo_adj;                       // [local, local], [local, halo]
  std::vector<float> local_values, halo_values;  // empty when the adjacency has none
  std::vector<int32_t> send_rows;
  std::vector<int64_t> send_counts, recv_counts;
  int64_t loss_total = 0;  // loss vertices over all ranks
};

// Full-graph node classification: x = f32 features [N, F] and y = i32
// labels of loss_vertices [T] are inputs; logits are [N, classes] for every
// vertex; loss = mean cross-entropy over loss_vertices (their logits
// gathered by an embedding lookup, whose backward scatters into the rest).
// constants holds the adjacency (row_ptr, col_idx, edge values) and
// loss_vertices as i32 / f32 tensors to bind once. batch = T.
//   gcn:    h' = A_hat (h W) + b, A_hat = D^-1/2 (A + I) D^-1/2, relu between
//   sage:   h' = h W_self + mean_{in-neighbours}(h) W_neigh + b (or the
//           feature-wise max, sage_aggregation = "max"; 0 for no neighbours);
//           the mean aggregates h W_neigh instead where that is narrower
//           (sage_projects_first: the same sum, fewer bytes to gather)
//   gat:    per head k: z = h W_k, e_ij = leaky_relu_0.2(a_dst_k.z_i +
//           a_src_k.z_j) over A + I, alpha = edge_softmax(e), sum_j alpha z_j;
//           hidden layers concatenate the gat_heads heads (gnn_hidden /
//           gat_heads columns each), the last averages them (PyG's GATConv
//           with concat=True / False); + b
//   resgcn: h = x W_in; gnn_layers times h = h + gcn(relu(layer_norm(h)));
//           logits = relu(layer_norm(h)) W_out + b
// With a shard: logits [local, classes], loss as GnnShard says.
// Throws ConfigError for an unknown kind or a GnnGraph that does not fit.
ModelGraph build_gnn(const ModelSpec& spec, const GnnGraph& g);
bool is_gnn(const std::string& kind);
// GAT's edge softmax and sage's max aggregation see a row's entries together
// (not as a sum of parts), so graph parallelism joins a row's halo to it.
bool gnn_needs_whole_rows(const ModelSpec& spec);

// GNNPipe's unit of work (train/layer_pipeline.h): graph layers
// [first_layer, last_layer) of a gcn, resgcn or sage (mean) model -- with
// resgcn's input linear when first_layer == 0 and the head and loss when
// last_layer == gnn_layers -- for one chunk of vertices. Each layer splits
// into a message m = M(h) per vertex (gcn: act(h) W, resgcn:
// relu(layer_norm(h)) W, sage: act(h), or act(h) W_neigh where it projects
// first; act = relu after the first layer) and an update of the chunk's
// rows from the aggregation over their in-neighbours' messages (gcn: agg +
// b, resgcn: h + agg + b, sage: act(h) W_self + agg W_neigh + b, or agg in
// place of agg W_neigh). The neighbours' messages come from
// two places: the chunk's own rows (computed here, entries adj_in with
// chunk-local columns) and `messages_other[l]`, a graph input [vertices,
// width] read through entries adj_out (columns outside the chunk, global
// ids), which the runtime fills with this epoch's messages where they exist
// and the previous epoch's (historical embeddings) elsewhere. With one chunk
// adj_out is empty and the layer is build_gnn's. Parameter names and
// initialisation are build_gnn's, so the stages together hold its model.
struct GnnLayerChunk {
  int64_t first_layer = 0, last_layer = 0;
  int64_t vertices = 0;       // of the whole graph
  std::vector<int32_t> rows;  // the chunk's vertex ids
  // The chunk's rows of gnn_adjacency(), split by column: inside the chunk
  // ([rows, rows], chunk-local columns) and outside ([rows, vertices]).
  Csr adj_in, adj_out;
  std::vector<float> values_in, values_out;
  std::vector<int32_t> loss_rows;  // last stage: chunk rows in the training mask (chunk-local)
  int64_t loss_total = 0;          // training vertices over all chunks
  // The hybrid with graph parallelism (gnn.graph_parts > 1): the chunk is
  // one graph part's share of a chunk, and its rows also read halo rows
  // that other parts computed for the same chunk, brought in by graph
  // parallelism's exchange (GnnShard: send_rows / counts over the stage's
  // group, halo_adj [rows, halo]; local_adj is ignored, adj_in is the local
  // part). Parameters then enter through copy_to_group(shard->group), so
  // their gradients are all-reduced over the stage's graph parts. nullptr:
  // no exchange.
  const GnnShard* shard = nullptr;
};

struct GnnChunkGraph {
  Graph graph;
  ValueId h_in = kNoValue;   // [rows, width in]: x's rows, or the previous stage's output
  ValueId h_out = kNoValue;  // [rows, hidden] to the next stage (not in the last)
  ValueId y = kNoValue, logits = kNoValue, loss = kNoValue;  // the last stage
  // Per layer of the range: the other rows' messages (input) and the
  // chunk's own (output, [rows, width]).
  std::vector<ValueId> messages_other, messages;
  // With a shard: per layer, the halo rows the exchange received ([halo,
  // width], the other parts' messages of this chunk), else kNoValue.
  std::vector<ValueId> halo_in;
  std::vector<std::pair<ValueId, Tensor>> constants;
};

// sage with mean aggregation: whether a layer of widths in -> out
// aggregates h W_neigh (out < in: mean(h) W = mean(h W), fewer columns to
// gather, and under graph or layer parallelism fewer to send) rather than h.
bool sage_projects_first(int64_t in, int64_t out);
// Message width of layer l (what messages_other[l] holds per vertex; under
// graph parallelism the width of its halo rows).
int64_t gnn_message_width(const ModelSpec& spec, int64_t layer, int64_t features, int64_t classes);
// Whether layer l's message carries a gradient back to its vertex (all but
// sage's layer 0 when that aggregates the input features themselves).
bool gnn_message_has_grad(const ModelSpec& spec, int64_t layer, int64_t features, int64_t classes);
// Throws ConfigError for a model kind layer pipelining does not split (gat,
// sage max: a message depends on both ends of an edge or is not a sum).
void check_layer_chunk_model(const ModelSpec& spec);
GnnChunkGraph build_gnn_layer_chunk(const ModelSpec& spec, const GnnLayerChunk& c, int64_t features,
                                    int64_t classes);

// Throws ConfigError for an unknown kind or an impossible spec (e.g. d_model
// not divisible by heads), naming the field.
ModelGraph build_model(const ModelSpec& spec, int64_t batch);

ModelGraph build_mlp(const ModelSpec& spec, int64_t batch);
ModelGraph build_cnn(const ModelSpec& spec, int64_t batch);
ModelGraph build_gpt(const ModelSpec& spec, int64_t batch);

}  // namespace mt
