// 1D graph-parallel full-graph training under mpirun (2 and 3 ranks):
// GCN, GraphSAGE (mean) and the residual GCN, with each partitioner, 1D and
// 1.5D (replication 2, or the world at an odd size; 4 ranks too), equal
// the single-process run step by step (the loss of every epoch) and in the
// final parameters, which every rank holds bitwise alike; the halo bytes the
// communicator counted equal halo rows x width x (forward + backward) per
// aggregation; a rank without training vertices still trains; models the
// scheme cannot run are refused on every rank. Each rank computes the
// single-process reference itself.
//
// Tolerance: 2e-5 relative on the losses and 1e-4 relative (with a 2e-6
// absolute floor) on the parameters after 8 epochs. The distributed run
// sums the same terms in another order: each aggregation adds the local
// and the halo part separately, and each parameter gradient is a sum over
// ranks instead of one accumulation; f32 rounding of those sums is ~1e-7
// relative per operation, and 8 AdamW steps (whose update divides by
// sqrt(v), amplifying relative differences of small gradients) grow it to
// the 1e-6 .. 1e-5 seen. A wrong halo row or a missing gradient term moves
// the loss in the third digit.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "meshtrain/base/error.h"
#include "meshtrain/train/full_graph.h"
#include "meshtrain/train/graph_parallel.h"
#include "train/mpi_world.h"

namespace mt {
namespace {

Communicator& world() {
  return test::mpi_world();
}

GraphData small_csbm() {
  CsbmOptions o;
  o.vertices = 500;
  o.classes = 4;
  o.avg_degree = 8;
  o.homophily = 0.8;
  o.features = 12;
  o.feature_signal = 0.7;
  o.train_fraction = 0.3;
  o.val_fraction = 0.1;
  return make_csbm(o);
}

TrainerOptions options(const std::string& optimizer = "adamw") {
  TrainerOptions t;
  t.epochs = 8;
  t.optimizer = optimizer;
  t.schedule.lr = optimizer == "sgd" ? 0.2 : 0.01;
  t.optim.adamw.weight_decay = 5e-4;
  t.optim.sgd.momentum = 0.9;
  t.clip_grad_norm = 5;
  t.threads = 1;
  t.log_every = 0;
  t.exec.backend = "fast";
  t.exec.profile = false;
  return t;
}

// "sagemax": sage with max aggregation; "gat2h": GAT with 2 heads.
ModelSpec gnn(const std::string& kind) {
  ModelSpec s;
  s.kind = kind == "sagemax" ? "sage" : kind == "gat2h" ? "gat" : kind;
  if (kind == "sagemax") s.sage_aggregation = "max";
  if (kind == "gat2h") s.gat_heads = 2;
  s.gnn_hidden = 16;
  s.gnn_layers = kind == "resgcn" ? 3 : 2;
  return s;
}

GraphParallelOptions graph_parallel(PartitionMethod m) {
  GraphParallelOptions p;
  p.mode = GnnParallel::graph;
  p.partition.method = m;
  return p;
}

// Rank 0's parameters broadcast; true if this rank's are bitwise the same.
bool same_on_every_rank(const FullGraphResult& r) {
  int differ = 0;
  for (const auto& [name, t] : r.final_params) {
    Tensor mine = t.clone();
    Tensor root = t.clone();
    world().broadcast(root, 0);
    differ += std::memcmp(mine.raw(), root.raw(), static_cast<size_t>(t.nbytes())) != 0 ? 1 : 0;
  }
  Tensor d = Tensor::full(Shape{1}, DType::f64, differ);
  world().all_reduce(d);
  return d.item(0) == 0;
}

void expect_equivalent(const FullGraphResult& single, const FullGraphResult& dist,
                       const std::string& what) {
  ASSERT_EQ(single.epochs.size(), dist.epochs.size()) << what;
  double worst_loss = 0, worst_param = 0;
  for (size_t e = 0; e < single.epochs.size(); ++e) {
    const double a = single.epochs[e].loss, b = dist.epochs[e].loss;
    worst_loss = std::max(worst_loss, std::fabs(a - b) / std::fabs(a));
    EXPECT_NEAR(b, a, 2e-5 * std::fabs(a)) << what << " epoch " << e + 1;
  }
  EXPECT_NEAR(dist.final_loss, single.final_loss, 2e-5 * std::fabs(single.final_loss)) << what;
  ASSERT_EQ(single.final_params.size(), dist.final_params.size());
  for (size_t i = 0; i < single.final_params.size(); ++i) {
    const auto& [name, a] = single.final_params[i];
    const Tensor& b = dist.final_params[i].second;
    ASSERT_EQ(name, dist.final_params[i].first);
    ASSERT_EQ(a.numel(), b.numel()) << name;
    for (int64_t k = 0; k < a.numel(); ++k) {
      const double x = a.item(k), y = b.item(k);
      worst_param = std::max(worst_param, std::fabs(x - y) / std::max(std::fabs(x), 2e-2));
      ASSERT_NEAR(y, x, 1e-4 * std::fabs(x) + 2e-6) << what << " " << name << "[" << k << "]";
    }
  }
  if (world().rank() == 0) {
    std::printf("%s: largest relative difference loss %.2e, parameter %.2e\n", what.c_str(),
                worst_loss, worst_param);
  }
}

struct Case {
  std::string kind;
  PartitionMethod partition;
  std::string optimizer;
};

class GraphParallelMpi : public ::testing::TestWithParam<Case> {};

TEST_P(GraphParallelMpi, EqualsTheSingleProcessRunAndCountsTheHaloBytes) {
  const Case c = GetParam();
  const GraphData g = small_csbm();
  const ModelSpec spec = gnn(c.kind);
  const TrainerOptions t = options(c.optimizer);
  const FullGraphResult single = train_full_graph(spec, g, t);
  const FullGraphResult dist =
      train_full_graph(spec, g, t, {}, graph_parallel(c.partition), &world());
  const std::string what = fmt::format("{} {} {} np{}", c.kind, partition_method_name(c.partition),
                                       c.optimizer, world().size());
  expect_equivalent(single, dist, what);
  EXPECT_TRUE(same_on_every_rank(dist)) << what;
  EXPECT_NEAR(dist.test_acc, single.test_acc, 1e-9) << what;
  // Bytes: exactly the analytic halo volume, every rank; and the halo rows
  // received over all ranks are the partition's halo total.
  EXPECT_GT(dist.expected_halo_bytes_per_epoch, 0) << what;
  EXPECT_EQ(dist.halo_bytes_sent_per_epoch,
            static_cast<uint64_t>(dist.expected_halo_bytes_per_epoch))
      << what << " rank " << world().rank();
  EXPECT_GT(dist.allreduce_bytes_sent_per_epoch, 0u);
  Tensor rows = Tensor::full(Shape{2}, DType::f64, 0);
  rows.set_item(0, static_cast<double>(dist.halo_vertices));
  rows.set_item(1, static_cast<double>(dist.local_vertices));
  world().all_reduce(rows);
  PartitionOptions po;
  po.method = c.partition;
  po.parts = world().size();
  const PartitionStats stats = partition_stats(g.adj, partition_graph(g.adj, po));
  EXPECT_EQ(rows.item(0), static_cast<double>(stats.halo_total())) << what;
  EXPECT_EQ(rows.item(1), 500.0);
}

INSTANTIATE_TEST_SUITE_P(Models, GraphParallelMpi,
                         ::testing::Values(Case{"gcn", PartitionMethod::contiguous, "adamw"},
                                           Case{"gcn", PartitionMethod::random, "sgd"},
                                           Case{"gcn", PartitionMethod::locality, "adamw"},
                                           Case{"sage", PartitionMethod::random, "adamw"},
                                           Case{"sage", PartitionMethod::locality, "sgd"},
                                           Case{"resgcn", PartitionMethod::locality, "adamw"},
                                           Case{"gat", PartitionMethod::random, "adamw"},
                                           Case{"gat2h", PartitionMethod::locality, "adamw"},
                                           Case{"sagemax", PartitionMethod::random, "adamw"}),
                         [](const auto& p) {
                           return p.param.kind + "_" +
                                  std::string(partition_method_name(p.param.partition)) + "_" +
                                  p.param.optimizer;
                         });

// 1.5D: replication c = 2 when the world is even (at 4 ranks: 2 row
// blocks of 2 replicas), else c = the world (one block, no halo: the
// replicas only split the block's terms and all-reduce them).
class OnePointFiveDMpi : public ::testing::TestWithParam<Case> {};

TEST_P(OnePointFiveDMpi, EqualsTheSingleProcessRunAndCountsTheBytes) {
  const Case k = GetParam();
  const int n = world().size();
  const int64_t c = n % 2 == 0 ? 2 : n;
  const GraphData g = small_csbm();
  const ModelSpec spec = gnn(k.kind);
  const TrainerOptions t = options(k.optimizer);
  GraphParallelOptions par = graph_parallel(k.partition);
  par.replication = c;
  const FullGraphResult single = train_full_graph(spec, g, t);
  const FullGraphResult dist = train_full_graph(spec, g, t, {}, par, &world());
  const std::string what = fmt::format("1.5D c={} {} {} {} np{}", c, k.kind,
                                       partition_method_name(k.partition), k.optimizer, n);
  expect_equivalent(single, dist, what);
  EXPECT_TRUE(same_on_every_rank(dist)) << what;
  EXPECT_NEAR(dist.test_acc, single.test_acc, 1e-9) << what;
  EXPECT_EQ(dist.halo_bytes_sent_per_epoch,
            static_cast<uint64_t>(dist.expected_halo_bytes_per_epoch))
      << what << " rank " << world().rank();
  EXPECT_GT(dist.replica_bytes_sent_per_epoch, 0u) << what;
  EXPECT_EQ(dist.replica_bytes_sent_per_epoch, dist.expected_replica_bytes_per_epoch) << what;
  // Every block's rows are held by c ranks; with several blocks some halo
  // moves (a replica may serve no block pair: at 2 blocks of 2, replica 0
  // computes its local block only).
  Tensor sums = Tensor::full(Shape{2}, DType::f64, 0);
  sums.set_item(0, static_cast<double>(dist.local_vertices));
  sums.set_item(1, static_cast<double>(dist.halo_bytes_sent_per_epoch));
  world().all_reduce(sums);
  EXPECT_EQ(sums.item(0), 500.0 * static_cast<double>(c)) << what;
  if (n / c > 1) {
    EXPECT_GT(sums.item(1), 0) << what;
  }
}

INSTANTIATE_TEST_SUITE_P(Models, OnePointFiveDMpi,
                         ::testing::Values(Case{"gcn", PartitionMethod::random, "adamw"},
                                           Case{"gcn", PartitionMethod::locality, "sgd"},
                                           Case{"sage", PartitionMethod::contiguous, "adamw"},
                                           Case{"resgcn", PartitionMethod::random, "adamw"}),
                         [](const auto& p) {
                           return p.param.kind + "_" +
                                  std::string(partition_method_name(p.param.partition)) + "_" +
                                  p.param.optimizer;
                         });

TEST(GraphParallelMpiEdges, ARankWithoutTrainingVerticesStillTrainsAlike) {
  GraphData g = small_csbm();
  // Only the first 40 vertices train: under contiguous blocks the other
  // ranks own none of them.
  std::fill(g.train_mask.begin(), g.train_mask.end(), 0);
  for (int i = 0; i < 40; ++i) {
    g.train_mask[static_cast<size_t>(i)] = 1;
    g.val_mask[static_cast<size_t>(i)] = 0;
    g.test_mask[static_cast<size_t>(i)] = 0;
  }
  const ModelSpec spec = gnn("gcn");
  const FullGraphResult single = train_full_graph(spec, g, options());
  const FullGraphResult dist = train_full_graph(
      spec, g, options(), {}, graph_parallel(PartitionMethod::contiguous), &world());
  expect_equivalent(single, dist, fmt::format("gcn few-train np{}", world().size()));
}

TEST(GraphParallelMpiEdges, WholeRowModelsAreRefusedUnder1_5DOnEveryRank) {
  const GraphData g = small_csbm();
  if (world().size() % 2 == 0) {
    for (const std::string kind : {"gat", "sagemax"}) {
      GraphParallelOptions par = graph_parallel(PartitionMethod::random);
      par.replication = 2;
      try {
        train_full_graph(gnn(kind), g, options(), {}, par, &world());
        ADD_FAILURE() << kind << ": no error";
      } catch (const ConfigError& e) {
        EXPECT_NE(std::string(e.what()).find("gnn.replication = 2"), std::string::npos) << e.what();
      }
    }
  }
  // A graph smaller than the world cannot give every rank a vertex.
  CsbmOptions tiny;
  tiny.vertices = 2;
  tiny.classes = 1;
  tiny.avg_degree = 1;
  tiny.train_fraction = 0.5;
  tiny.val_fraction = 0;
  if (world().size() > 2) {
    EXPECT_THROW(train_full_graph(gnn("gcn"), make_csbm(tiny), options(), {},
                                  graph_parallel(PartitionMethod::contiguous), &world()),
                 ConfigError);
  }
}

}  // namespace
}  // namespace mt

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  mt::world();  // MPI up before any test
  return RUN_ALL_TESTS();
}
