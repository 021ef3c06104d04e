// Maps a Config (TOML file + --set overrides) onto the options of every
// component: the one place where config keys are known. Each getter names
// the key in its errors; after reading, unknown keys are reported.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "meshtrain/cli/cluster_file.h"
#include "meshtrain/cli/config.h"
#include "meshtrain/data/dataset.h"
#include "meshtrain/data/edge_list.h"
#include "meshtrain/data/graph_data.h"
#include "meshtrain/data/knn_graph.h"
#include "meshtrain/models/model.h"
#include "meshtrain/spmd/shorthand.h"
#include "meshtrain/train/full_graph.h"
#include "meshtrain/train/trainer.h"

namespace mt {

struct DataSpec {
  std::string kind = "fashion_mnist";  // or "text"
  std::string dir;                     // fashion_mnist: directory of the idx files
  std::string path;                    // text: file or directory
  int64_t limit_train = -1;            // examples (windows for text); -1 = all
  int64_t limit_test = -1;
  double test_fraction = 0.1;  // text only
  // fashion_mnist only: pixels become (x/255 - mean) / std when normalize,
  // x/255 in [0, 1] otherwise.
  bool normalize = true;
  double mean = 0.2860;
  double std = 0.3530;
  // graph (full-graph GNN training): a generator ("csbm", "rmat", "knn") or a file
  // in the format of docs/graph_format.md ("file", read from graph_file),
  // or a text edge list ("edges", data/edge_list.h).
  std::string graph = "csbm";
  std::string graph_file;
  CsbmOptions csbm;
  RmatOptions rmat;
  FashionKnnOptions knn;
  EdgeListOptions edges;
};

// Most ranks one job may have (dist.nproc, --nproc).
inline constexpr int kMaxRanks = 1024;

struct RunConfig {
  ModelSpec model;
  DataSpec data;
  TrainerOptions train;
  int nproc = 1;
  int64_t timeout_s = 300;  // every collective's deadline
  // --nproc launcher: seconds ranks get to stop after SIGINT / SIGTERM
  // before they are killed.
  int64_t stop_grace_s = 10;
  // Fault drill: "kill:RANK@STEP" (the rank dies abruptly after that step)
  // or "stall:RANK@STEP" (it stops responding); empty = none.
  std::string fault;
  // dist.cluster: the cluster file (node groups, emulated links, per-rank
  // slowdown; docs/cluster.md), read and checked when the config is read;
  // its slowdown is already in train.dist.slowdown. dist.node_size: node
  // groups of this many ranks without a file (0 = the machine's grouping).
  std::optional<ClusterFile> cluster;
  int node_size = 0;
  // dist.hierarchical: all-reduce hierarchically when the ranks span several
  // nodes of equal size (AlgorithmPolicy::prefer_hierarchical).
  bool hierarchical = true;
  // dist.algorithm_choice: "static" (AlgorithmPolicy's rules) or "measured"
  // (a probe when the communicator is created, comm/probe.h).
  std::string algorithm_choice = "static";
  // [parallel]: the plan shorthand (spmd/shorthand.h); `parallel_given`
  // when the config names any parallel.* key.
  ParallelShorthand parallel;
  bool parallel_given = false;
  // gnn.*: how full-graph GNN training spreads over the ranks (gnn.parallel)
  // and how the graph is partitioned (gnn.partition, gnn.imbalance; parts =
  // the ranks, random seeded by train.seed).
  GraphParallelOptions gnn;
  // exec.openblas_coretype: "auto", "best" or "keep" (tensor/machine.h,
  // advise_openblas_coretype); acted on by cmd_train before anything runs.
  std::string openblas_coretype = "auto";
};

// Reads every known key; throws ConfigError for wrong values and, at the end,
// for keys nobody read.
RunConfig read_run_config(const Config& config);

// The graph data.kind = "graph" names: generated, or read from its file.
GraphData open_graph(const DataSpec& spec);

// Opens the train and test splits the DataSpec names (FileError if missing).
std::shared_ptr<const Dataset> open_dataset(const DataSpec& spec, const ModelSpec& model,
                                            DataSplit split);

}  // namespace mt
