// GNNPipe's hybrid of layer pipelining with graph parallelism under mpirun
// (gnn.graph_parts = 2: at 4 ranks 2 stages x 2 graph parts, at 2 ranks 1
// stage x 2 parts):
//   - one chunk equals the single-process run step by step (loss of every
//     epoch, final parameters by name) for GCN, GraphSAGE (mean) and the
//     residual GCN, with clipping over the stages;
//   - several chunks on a graph whose vertices read only their own and
//     earlier chunks (of any part) equal it too: this checks the chunk
//     exchange and the gradient each chunk's backward sends back for the
//     received halo rows later chunks read from the buffer;
//   - with staleness (CSBM, 4 locality chunks per part) the run trains and
//     reports its accuracy (not asserted equal);
//   - the bytes each rank sends per epoch, as its communicators counted
//     them, equal the analytic volume exactly: between stages 2 (S-1) n h
//     floats over the ranks (n_part h per boundary per direction), halo
//     rows x width x 3 per layer (forward, forward again in the
//     recomputing backward, gradients back), the gradient all-reduce as the
//     runner's cost function predicts;
//   - combinations the hybrid cannot run are refused naming the key.
// Tolerance as in layer_pipeline_mpi_test.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <string>

#include <fmt/format.h>

#include "meshtrain/base/error.h"
#include "meshtrain/data/graph_partition.h"
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

constexpr int64_t kParts = 2;

Communicator& world() {
  return test::mpi_world();
}

int stages() {
  return world().size() / static_cast<int>(kParts);
}

GraphParallelOptions hybrid(int64_t chunks, int64_t startup) {
  GraphParallelOptions p;
  p.mode = GnnParallel::layer;
  p.graph_parts = kParts;
  p.chunks = chunks;
  p.startup_epochs = startup;
  p.partition.method = PartitionMethod::contiguous;
  return p;
}

HybridBlocks blocks(const GraphData& g, const GraphParallelOptions& p, int64_t chunks) {
  return hybrid_blocks(g.adj, p.partition, kParts, chunks);
}

// Only the entries (v <- u) with chunk(u) <= chunk(v): every vertex reads
// its own and earlier chunks of every part, never a historical message.
GraphData earlier_chunks_only(GraphData g, const HybridBlocks& b) {
  Csr a;
  a.rows = a.cols = g.adj.rows;
  a.row_ptr.assign(1, 0);
  for (int64_t v = 0; v < g.adj.rows; ++v) {
    const auto r = static_cast<size_t>(v);
    for (int32_t e = g.adj.row_ptr[r]; e < g.adj.row_ptr[r + 1]; ++e) {
      const int32_t u = g.adj.col_idx[static_cast<size_t>(e)];
      if (b.chunk_of[static_cast<size_t>(u)] <= b.chunk_of[r]) a.col_idx.push_back(u);
    }
    a.row_ptr.push_back(static_cast<int32_t>(a.col_idx.size()));
  }
  g.adj = a;
  return g;
}

double sum_over_ranks(double v) {
  Tensor t = Tensor::full(Shape{1}, DType::f64, v);
  world().all_reduce(t);
  return t.item(0);
}

// Bytes against the analytic volume, from the blocks written out above.
void expect_bytes(const FullGraphResult& r, const ModelSpec& spec, const GraphData& g,
                  const HybridBlocks& b, const std::string& what) {
  const int s_count = stages(), rank = world().rank();
  const int stage = rank % s_count;
  const int64_t part = rank / s_count, n = g.num_vertices();
  const int64_t hid = spec.gnn_hidden, f = g.feature_dim(), c = g.classes;
  auto part_of = [&](int32_t v) { return static_cast<int64_t>(b.part_of[static_cast<size_t>(v)]); };
  // Between stages: this part's rows, forward and backward.
  int64_t rows = 0;
  for (int32_t v = 0; v < n; ++v) rows += part_of(v) == part ? 1 : 0;
  EXPECT_EQ(r.pipeline_bytes_sent_per_epoch,
            static_cast<uint64_t>(layer_pipeline_bytes_per_epoch(spec, rows, stage, s_count)))
      << what << " rank " << rank;
  EXPECT_EQ(sum_over_ranks(static_cast<double>(r.pipeline_bytes_sent_per_epoch)),
            static_cast<double>(2 * (s_count - 1) * n * hid * 4))
      << what;
  // Halo rows: distinct (reading part, vertex of another part) pairs.
  std::set<std::pair<int64_t, int32_t>> reads;
  for (int32_t v = 0; v < n; ++v) {
    for (int32_t e = g.adj.row_ptr[static_cast<size_t>(v)];
         e < g.adj.row_ptr[static_cast<size_t>(v) + 1]; ++e) {
      const int32_t u = g.adj.col_idx[static_cast<size_t>(e)];
      if (part_of(u) != part_of(v)) reads.insert({part_of(v), u});
    }
  }
  int64_t sent = 0, received = 0;
  for (const auto& [p, u] : reads) {
    sent += part_of(u) == part ? 1 : 0;
    received += p == part ? 1 : 0;
  }
  const auto ranges = layer_pipeline_stages(spec.gnn_layers, s_count);
  const auto [first, last] = ranges[static_cast<size_t>(stage)];
  EXPECT_EQ(r.halo_vertices, received) << what;
  EXPECT_EQ(r.halo_bytes_sent_per_epoch, static_cast<uint64_t>(hybrid_halo_bytes_per_epoch(
                                             spec, sent, received, first, last, f, c)))
      << what << " rank " << rank;
  // Over all ranks: halo rows x width x 3 per layer (gcn, resgcn).
  if (spec.kind != "sage") {
    int64_t widths = 0;
    for (int64_t l = 0; l < spec.gnn_layers; ++l) widths += gnn_message_width(spec, l, f, c);
    EXPECT_EQ(sum_over_ranks(static_cast<double>(r.halo_bytes_sent_per_epoch)),
              static_cast<double>(static_cast<int64_t>(reads.size()) * widths * 3 * 4))
        << what;
  }
  // The stage's gradient all-reduce: counted = the runner's cost function,
  // and at least every parameter of the stage once per chunk.
  EXPECT_EQ(r.allreduce_bytes_sent_per_epoch, r.expected_allreduce_bytes_per_epoch)
      << what << " rank " << rank;
  EXPECT_GT(r.allreduce_bytes_sent_per_epoch, 0u) << what;
}

// Parts first, then chunks inside each part, by the same partitioner:
// contiguous halves, each cut into contiguous thirds; with locality the cut
// between the parts is the partitioner's two-part cut, not that of a
// grouping of finer blocks.
TEST(HybridBlocks, PartsThenChunksInsideEachPart) {
  const GraphData g = small_csbm();
  const HybridBlocks b = blocks(g, hybrid(3, 0), 3);
  for (int32_t v = 0; v < 400; ++v) {
    const int32_t at = v % 200;  // 200 a part: chunks of 67, 67, 66
    ASSERT_EQ(b.part_of[static_cast<size_t>(v)], v / 200) << v;
    ASSERT_EQ(b.chunk_of[static_cast<size_t>(v)], at < 67 ? 0 : at < 134 ? 1 : 2) << v;
  }
  GraphParallelOptions p = hybrid(4, 0);
  p.partition.method = PartitionMethod::locality;
  PartitionOptions two = p.partition;
  two.parts = 2;
  EXPECT_EQ(blocks(g, p, 4).part_of, partition_graph(g.adj, two).owner);
}

struct Case {
  std::string kind;
  int64_t layers;
};

class HybridMpi : public ::testing::TestWithParam<Case> {};

TEST_P(HybridMpi, OneChunkEqualsTheSingleProcessRun) {
  const Case c = GetParam();
  const ModelSpec spec = gnn(c.kind, std::max<int64_t>(c.layers, stages()));
  const GraphData g = small_csbm();
  const GraphParallelOptions p = hybrid(1, 0);
  const FullGraphResult single = train_full_graph(spec, g, options());
  const FullGraphResult hyb = train_full_graph(spec, g, options(), {}, p, &world());
  const std::string what = fmt::format("{} x{} one chunk, {} stages x {} parts", c.kind,
                                       spec.gnn_layers, stages(), kParts);
  expect_equivalent(single, hyb, what);
  expect_bytes(hyb, spec, g, blocks(g, p, 1), what);
  EXPECT_NEAR(hyb.test_acc, single.test_acc, 1e-9) << what;
}

TEST_P(HybridMpi, ChunksThatReadOnlyEarlierChunksEqualTheSingleProcessRun) {
  const Case c = GetParam();
  const ModelSpec spec = gnn(c.kind, std::max<int64_t>(c.layers, stages()));
  const GraphParallelOptions p = hybrid(3, 0);
  const GraphData base = small_csbm();
  const GraphData g = earlier_chunks_only(base, blocks(base, p, 3));
  const FullGraphResult single = train_full_graph(spec, g, options());
  const FullGraphResult hyb = train_full_graph(spec, g, options(), {}, p, &world());
  const std::string what = fmt::format("{} x{} 3 chunks, no stale reads, {} stages x {} parts",
                                       c.kind, spec.gnn_layers, stages(), kParts);
  expect_equivalent(single, hyb, what);
  expect_bytes(hyb, spec, g, blocks(g, p, 3), what);
}

INSTANTIATE_TEST_SUITE_P(Models, HybridMpi,
                         ::testing::Values(Case{"gcn", 2}, Case{"sage", 3}, Case{"resgcn", 4}),
                         [](const auto& p) { return p.param.kind; });

TEST(HybridMpiStale, HistoricalEmbeddingsTrainAndTheBytesStayExact) {
  const ModelSpec spec = gnn("resgcn", 4);
  const GraphData g = small_csbm();
  TrainerOptions t = options();
  t.epochs = 30;
  GraphParallelOptions p = hybrid(4, 2);
  p.partition.method = PartitionMethod::locality;
  const FullGraphResult single = train_full_graph(spec, g, t);
  const FullGraphResult hyb = train_full_graph(spec, g, t, {}, p, &world());
  // Startup epochs run as one chunk: equal to the single process.
  for (size_t e = 0; e < 2; ++e) {
    EXPECT_NEAR(hyb.epochs[e].loss, single.epochs[e].loss, 2e-5 * single.epochs[e].loss);
  }
  EXPECT_LT(hyb.final_loss, 0.5 * hyb.epochs.front().loss);
  EXPECT_GT(hyb.test_acc, 0.6);  // chance is 0.25
  expect_bytes(hyb, spec, g, blocks(g, p, 4), "resgcn x4, 4 locality chunks");
  if (world().rank() == 0) {
    std::printf(
        "30 epochs, %d stages x %lld parts, 4 locality chunks: test accuracy %.3f (one "
        "process %.3f)\n",
        stages(), static_cast<long long>(kParts), hyb.test_acc, single.test_acc);
  }
}

TEST(HybridMpiEdges, WhatItCannotRunIsRefusedOnEveryRank) {
  const GraphData g = small_csbm();
  auto refused = [&](const ModelSpec& spec, const GraphParallelOptions& p, const std::string& key) {
    try {
      train_full_graph(spec, g, options(), {}, p, &world());
      ADD_FAILURE() << key << ": no error";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << e.what();
    }
  };
  GraphParallelOptions p = hybrid(1, 0);
  refused(gnn("gat", 4), p, "gnn.parallel = \"layer\": model.kind gat");
  p.graph_parts = 3;  // divides neither 2 nor 4 ranks
  refused(gnn("gcn", 4), p, "gnn.graph_parts = 3");
  p.graph_parts = 2 * world().size();
  refused(gnn("gcn", 4), p, fmt::format("gnn.graph_parts = {}", 2 * world().size()));
  p = hybrid(1, 0);
  p.replication = 2;
  refused(gnn("gcn", 4), p, "gnn.replication = 2");
  p = hybrid(201, 0);  // 2 x 201 blocks for 400 vertices
  refused(gnn("gcn", 4), p, "gnn.chunks = 201 x gnn.graph_parts = 2");
  p = hybrid(1, 0);
  p.mode = GnnParallel::graph;
  refused(gnn("gcn", 4), p, "gnn.graph_parts = 2: only with gnn.parallel = \"layer\"");
  if (stages() > 1) refused(gnn("gcn", stages() - 1), hybrid(1, 0), "model.gnn_layers");
}

}  // namespace
}  // namespace mt

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  mt::world();  // MPI up before any test
  return RUN_ALL_TESTS();
}
