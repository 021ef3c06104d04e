// Layer pipelining (GNNPipe) of full-graph GNN training under mpirun (2, 3
// and 4 ranks, one stage each):
//   - one chunk equals the single-process run step by step (loss of every
//     epoch, final parameters by name) for GCN, GraphSAGE (mean) and the
//     residual GCN, with clipping over the stages;
//   - several chunks on a graph whose vertices read only earlier chunks
//     (no historical embedding is ever read) equal it too: this checks the
//     chunked forward and the gradient each chunk's backward adds into the
//     earlier chunks' messages (drop that and the parameters move in the
//     third digit);
//   - with staleness (a CSBM graph, 4 chunks) the run trains and reports
//     its accuracy (not asserted equal);
//   - the bytes each rank sends per epoch, as its communicator counted
//     them, equal 2 (P-1) n h floats over the ranks exactly;
//   - models and sizes the scheme cannot run are refused on every rank.
// Tolerance as in graph_parallel_mpi_test.cpp (2e-5 relative on losses,
// 1e-4 on parameters after 8 AdamW steps): the pipeline sums each
// aggregation in two parts (outside and inside the chunk) and the
// parameter gradients over chunks, in another order than one process.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>

#include <fmt/format.h>

#include "meshtrain/base/error.h"
#include "meshtrain/train/full_graph.h"
#include "meshtrain/train/layer_pipeline.h"
#include "train/layer_pipeline_harness.h"
#include "train/mpi_world.h"

namespace mt {
namespace {

using test::expect_equivalent;
using test::small_csbm;

TrainerOptions options() {
  return test::gnn_options();
}

ModelSpec gnn(const std::string& kind, int64_t layers) {
  return test::gnn_spec(kind, layers);
}

Communicator& world() {
  return test::mpi_world();
}

// Only the entries (v <- u) with u <= v: with contiguous chunks a vertex
// reads its own and earlier chunks only.
GraphData lower_triangular(GraphData g) {
  Csr a;
  a.rows = a.cols = g.adj.rows;
  a.row_ptr.assign(1, 0);
  for (int64_t v = 0; v < g.adj.rows; ++v) {
    const auto r = static_cast<size_t>(v);
    for (int32_t e = g.adj.row_ptr[r]; e < g.adj.row_ptr[r + 1]; ++e) {
      const int32_t u = g.adj.col_idx[static_cast<size_t>(e)];
      if (u <= v) a.col_idx.push_back(u);
    }
    a.row_ptr.push_back(static_cast<int32_t>(a.col_idx.size()));
  }
  g.adj = a;
  return g;
}

GraphParallelOptions layer(int64_t chunks, int64_t startup) {
  GraphParallelOptions p;
  p.mode = GnnParallel::layer;
  p.chunks = chunks;
  p.startup_epochs = startup;
  p.partition.method = PartitionMethod::contiguous;
  return p;
}

void expect_bytes(const FullGraphResult& r, const ModelSpec& spec, int64_t n,
                  const std::string& what) {
  const int p = world().size(), s = world().rank();
  EXPECT_EQ(r.pipeline_bytes_sent_per_epoch,
            static_cast<uint64_t>(layer_pipeline_bytes_per_epoch(spec, n, s, p)))
      << what << " rank " << s;
  Tensor total =
      Tensor::full(Shape{1}, DType::f64, static_cast<double>(r.pipeline_bytes_sent_per_epoch));
  world().all_reduce(total);
  EXPECT_EQ(total.item(0), static_cast<double>(2 * (p - 1) * n * spec.gnn_hidden * 4)) << what;
}

struct Case {
  std::string kind;
  int64_t layers;
};

class LayerPipelineMpi : public ::testing::TestWithParam<Case> {};

TEST_P(LayerPipelineMpi, OneChunkEqualsTheSingleProcessRun) {
  const Case c = GetParam();
  const ModelSpec spec = gnn(c.kind, std::max<int64_t>(c.layers, world().size()));
  const GraphData g = small_csbm();
  const FullGraphResult single = train_full_graph(spec, g, options());
  const FullGraphResult pipe = train_full_graph(spec, g, options(), {}, layer(1, 0), &world());
  const std::string what =
      fmt::format("{} x{} one chunk np{}", c.kind, spec.gnn_layers, world().size());
  expect_equivalent(single, pipe, what);
  expect_bytes(pipe, spec, g.num_vertices(), what);
  EXPECT_NEAR(pipe.test_acc, single.test_acc, 1e-9) << what;
}

TEST_P(LayerPipelineMpi, ChunksThatReadOnlyEarlierChunksEqualTheSingleProcessRun) {
  const Case c = GetParam();
  const ModelSpec spec = gnn(c.kind, std::max<int64_t>(c.layers, world().size()));
  const GraphData g = lower_triangular(small_csbm());
  const FullGraphResult single = train_full_graph(spec, g, options());
  const FullGraphResult pipe = train_full_graph(spec, g, options(), {}, layer(3, 0), &world());
  const std::string what =
      fmt::format("{} x{} 3 chunks, no stale reads np{}", c.kind, spec.gnn_layers, world().size());
  expect_equivalent(single, pipe, what);
  expect_bytes(pipe, spec, g.num_vertices(), what);
}

INSTANTIATE_TEST_SUITE_P(Models, LayerPipelineMpi,
                         ::testing::Values(Case{"gcn", 2}, Case{"sage", 3}, Case{"resgcn", 4}),
                         [](const auto& p) { return p.param.kind; });

TEST(LayerPipelineMpiStale, HistoricalEmbeddingsTrainAndTheBytesStayTheSame) {
  const ModelSpec spec = gnn("resgcn", 4);
  const GraphData g = small_csbm();
  TrainerOptions t = options();
  t.epochs = 30;
  GraphParallelOptions p = layer(4, 2);
  p.partition.method = PartitionMethod::locality;
  const FullGraphResult single = train_full_graph(spec, g, t);
  const FullGraphResult pipe = train_full_graph(spec, g, t, {}, p, &world());
  // Startup epochs run as one chunk: equal to the single process.
  for (size_t e = 0; e < 2; ++e) {
    EXPECT_NEAR(pipe.epochs[e].loss, single.epochs[e].loss, 2e-5 * single.epochs[e].loss);
  }
  EXPECT_LT(pipe.final_loss, 0.5 * pipe.epochs.front().loss);
  EXPECT_GT(pipe.test_acc, 0.6);  // chance is 0.25
  expect_bytes(pipe, spec, g.num_vertices(), "resgcn x4, 4 chunks");
  if (world().rank() == 0) {
    std::printf("30 epochs, 4 locality chunks: test accuracy %.3f (one process %.3f)\n",
                pipe.test_acc, single.test_acc);
  }
}

TEST(LayerPipelineMpiEdges, WhatItCannotRunIsRefusedOnEveryRank) {
  const GraphData g = small_csbm();
  auto refused = [&](const ModelSpec& spec, const GraphParallelOptions& p, const std::string& key) {
    try {
      train_full_graph(spec, g, options(), {}, p, &world());
      ADD_FAILURE() << key << ": no error";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << e.what();
    }
  };
  refused(gnn("gat", 4), layer(1, 0), "gnn.parallel = \"layer\": model.kind gat");
  refused(gnn("gcn", world().size() - 1), layer(1, 0), "model.gnn_layers");
  refused(gnn("gcn", 4), layer(0, 0), "gnn.chunks = 0");
  refused(gnn("gcn", 4), layer(401, 0), "401");
}

}  // namespace
}  // namespace mt

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  mt::world();  // MPI up before any test
  return RUN_ALL_TESTS();
}
