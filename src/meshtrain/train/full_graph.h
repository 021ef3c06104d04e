// Full-graph training of a graph neural network in one process: every epoch
// is one forward and backward pass over the whole graph (the loss over the
// training mask's vertices) and one optimizer step; accuracy on the train,
// validation and test masks comes from the same pass's logits (the
// parameters before that epoch's step) and, at the end, from a forward pass
// with the final parameters.
//
// Why not the Trainer: it is built around batches of examples drawn from a
// Dataset, sharded over data-parallel ranks, with evaluation on a separate
// test split. Full-graph training has no batches (the whole graph is one
// "example"), the split is a vertex mask inside the same graph, and the
// distributed schemes it will grow (halo exchange, 1.5D, layer pipelining)
// partition the graph, not a batch. This small path shares the Trainer's
// pieces (ParamStore, optimizers, LR schedule, executor, metrics lines) and
// reads the same TrainerOptions; options it does not support are refused.
//
// Blocks for the whole run; single-threaded apart from the kernels' threads
// (and, under graph parallelism, the communicator's progress thread).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/data/graph_data.h"
#include "meshtrain/data/graph_partition.h"
#include "meshtrain/models/model.h"
#include "meshtrain/train/trainer.h"

namespace mt {

// How full-graph training spreads over the ranks of a communicator.
enum class GnnParallel : uint8_t {
  none,   // one process (the communicator, if any, must have one rank)
  graph,  // 1D graph parallelism: rows partitioned, halo rows exchanged per layer
  layer,  // layer pipelining (GNNPipe): consecutive layers per rank, vertex chunks flow
};

struct GraphParallelOptions {
  GnnParallel mode = GnnParallel::none;
  PartitionOptions partition;  // parts is set to ranks / replication
  // CAGNET's replication factor c: 1 = 1D; c > 1 = 1.5D (P / c row blocks,
  // each held by c ranks; must divide the ranks).
  int64_t replication = 1;
  // Layer pipelining (train/layer_pipeline.h): vertex chunks (partition by
  // `partition` into `chunks` parts) and the first epochs run as one chunk
  // (no historical embeddings).
  int64_t chunks = 4;
  int64_t startup_epochs = 1;
  // The hybrid of layer pipelining with graph parallelism (mode layer):
  // the ranks form ranks / graph_parts stages x graph_parts parts; each
  // graph part's vertices go through the stages on their own column of
  // ranks, and a stage's parts exchange halo rows every layer. 1 = pure
  // layer pipelining.
  int64_t graph_parts = 1;
};

struct GraphEpoch {
  int64_t epoch = 0;  // 1-based
  double loss = 0;    // training loss before this epoch's step
  double train_acc = 0, val_acc = 0, test_acc = 0;
  double seconds = 0;  // forward + backward + optimizer step
};

struct FullGraphResult {
  std::vector<GraphEpoch> epochs;
  // With the final parameters (one more forward pass).
  double final_loss = 0;
  double train_acc = 0, val_acc = 0, test_acc = 0;
  double median_epoch_seconds = 0;
  int64_t params = 0;
  // The final parameters by name (every rank holds the same under graph
  // parallelism).
  std::vector<std::pair<std::string, Tensor>> final_params;
  // Graph parallelism, this rank: vertices owned and halo rows read; bytes
  // it sent per training epoch as the communicator counted them (halo
  // exchanges: all_to_allv; gradient all-reduces: all_reduce) and the halo
  // bytes halo_bytes_per_epoch() predicts.
  int64_t local_vertices = 0, halo_vertices = 0;
  uint64_t halo_bytes_sent_per_epoch = 0, allreduce_bytes_sent_per_epoch = 0;
  int64_t expected_halo_bytes_per_epoch = 0;
  // 1.5D: bytes of the all-reduces of partial aggregations over the
  // replica group, counted and as the runner's cost function predicts.
  uint64_t replica_bytes_sent_per_epoch = 0, expected_replica_bytes_per_epoch = 0;
  // Layer pipelining, this rank: its layers [first, last), and the bytes it
  // sent to its neighbour stages per training epoch, counted and predicted.
  int64_t first_layer = 0, last_layer = 0;
  uint64_t pipeline_bytes_sent_per_epoch = 0;
  int64_t expected_pipeline_bytes_per_epoch = 0;
  // The hybrid (graph_parts > 1) also fills local_vertices (its part's),
  // halo_vertices, halo_bytes_sent_per_epoch and
  // expected_halo_bytes_per_epoch (hybrid_halo_bytes_per_epoch), and the
  // stage group's gradient all-reduce: counted, and as the runner's cost
  // function predicts for the graphs run.
  uint64_t expected_allreduce_bytes_per_epoch = 0;
};

// Fraction of `vertices` whose argmax over logits [N, C] equals its label
// (0 for an empty set).
double masked_accuracy(const Tensor& logits, const std::vector<int32_t>& labels,
                       const std::vector<int32_t>& vertices);

class MetricsWriter;
// The end of a full-graph run (every path: one process, graph parallel,
// layer pipeline): the final pass's loss and accuracies into r, the median
// epoch time, and the final metrics line.
void finish_full_graph(FullGraphResult& r, const GraphEpoch& final_pass, MetricsWriter& metrics);

// Uses opts.epochs, seed, threads, exec, optimizer/optim, schedule (lr,
// warm-up, cosine over `epochs` steps), clip_grad_norm, log_every (epochs
// between metrics lines and log calls), metrics_path. Throws ConfigError for
// options this path does not support (mixed precision, data parallelism,
// checkpoints, resume, max_steps) naming the key, and whatever the model
// builder and executor throw. `log` gets one line per logged epoch.
//
// par.mode = graph: every rank of `comm` calls this with the same graph and
// options; the graph is partitioned over comm's ranks (par.partition) and
// trained with 1D graph parallelism (train/graph_parallel.h). Losses and
// accuracies are the global ones (summed over ranks), on every rank; rank 0
// alone writes metrics and logs. It equals the single-process run up to
// float rounding: aggregations sum the same terms in another order (local
// part, then halo part) and gradients are summed over ranks. ConfigError
// when par.mode = graph has no communicator, or mode none gets one of
// several ranks.
FullGraphResult train_full_graph(const ModelSpec& spec, const GraphData& g,
                                 const TrainerOptions& opts,
                                 const std::function<void(const std::string&)>& log = {},
                                 const GraphParallelOptions& par = {},
                                 Communicator* comm = nullptr);

}  // namespace mt
