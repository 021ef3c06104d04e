// Full-graph GNN training (train/full_graph.h) and the graph file
// (train/graph_file.h): every model learns a CSBM graph well above chance,
// the fast and reference backends train alike, the file round-trips and bad
// files get errors naming the file and the field.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "common/temp_dir.h"
#include "meshtrain/base/error.h"
#include "meshtrain/train/full_graph.h"
#include "meshtrain/train/graph_file.h"

namespace mt {
namespace {

GraphData small_csbm() {
  CsbmOptions o;
  o.vertices = 600;
  o.classes = 4;
  o.avg_degree = 8;
  o.homophily = 0.85;
  o.features = 16;
  o.feature_signal = 0.7;  // features alone are weak: the graph has to help
  o.train_fraction = 0.2;
  o.val_fraction = 0.1;
  return make_csbm(o);
}

TrainerOptions options(int64_t epochs, const std::string& backend = "fast") {
  TrainerOptions t;
  t.epochs = epochs;
  t.optimizer = "adamw";
  t.schedule.lr = 0.01;
  t.optim.adamw.weight_decay = 5e-4;
  t.threads = 1;
  t.log_every = 0;
  t.exec.backend = backend;
  t.exec.profile = false;
  return t;
}

// "gat4h": GAT with 4 heads.
ModelSpec gnn(const std::string& kind, int64_t layers = 2) {
  ModelSpec s;
  s.kind = kind == "gat4h" ? "gat" : kind;
  if (kind == "gat4h") s.gat_heads = 4;
  s.gnn_hidden = 32;
  s.gnn_layers = layers;
  return s;
}

class EveryGnn : public ::testing::TestWithParam<std::string> {};

TEST_P(EveryGnn, LearnsACsbmGraphWellAboveChance) {
  const GraphData g = small_csbm();
  const FullGraphResult r =
      train_full_graph(gnn(GetParam(), GetParam() == "resgcn" ? 4 : 2), g, options(60));
  ASSERT_EQ(r.epochs.size(), 60u);
  EXPECT_LT(r.final_loss, r.epochs.front().loss);
  // Chance is 0.25 with 4 balanced classes.
  EXPECT_GT(r.test_acc, 0.6) << GetParam() << ": test accuracy " << r.test_acc;
  EXPECT_GT(r.val_acc, 0.6) << GetParam();
}

TEST_P(EveryGnn, FastAndReferenceBackendsTrainAlike) {
  const GraphData g = small_csbm();
  const ModelSpec s = gnn(GetParam(), GetParam() == "resgcn" ? 3 : 2);
  const FullGraphResult fast = train_full_graph(s, g, options(5, "fast"));
  const FullGraphResult ref = train_full_graph(s, g, options(5, "reference"));
  for (size_t e = 0; e < fast.epochs.size(); ++e) {
    EXPECT_NEAR(fast.epochs[e].loss, ref.epochs[e].loss, 1e-4 * std::fabs(ref.epochs[e].loss))
        << GetParam() << " epoch " << e + 1;
  }
  EXPECT_NEAR(fast.final_loss, ref.final_loss, 1e-4 * std::fabs(ref.final_loss)) << GetParam();
}

INSTANTIATE_TEST_SUITE_P(Models, EveryGnn,
                         ::testing::Values("gcn", "sage", "gat", "gat4h", "resgcn"),
                         [](const auto& p) { return p.param; });

TEST(FullGraph, SageWithMaxAggregationLearnsAndMatchesTheReference) {
  const GraphData g = small_csbm();
  ModelSpec s = gnn("sage");
  s.sage_aggregation = "max";
  const FullGraphResult r = train_full_graph(s, g, options(60));
  EXPECT_GT(r.test_acc, 0.6) << "test accuracy " << r.test_acc;
  const FullGraphResult fast = train_full_graph(s, g, options(5, "fast"));
  const FullGraphResult ref = train_full_graph(s, g, options(5, "reference"));
  for (size_t e = 0; e < fast.epochs.size(); ++e) {
    EXPECT_NEAR(fast.epochs[e].loss, ref.epochs[e].loss, 1e-4 * std::fabs(ref.epochs[e].loss))
        << "epoch " << e + 1;
  }
}

TEST(FullGraph, MultiHeadGatHasOneSetOfWeightsPerHeadAndChecksTheWidth) {
  // 16 features, hidden 32 over 4 heads of 8, 4 classes averaged over 4 heads.
  ModelSpec s = gnn("gat4h");
  Csr ring;
  ring.rows = ring.cols = 3;
  ring.row_ptr = {0, 1, 2, 3};
  ring.col_idx = {1, 2, 0};
  GnnGraph g{&ring, 16, 4, {0, 1}, nullptr};
  const ModelGraph m = build_gnn(s, g);
  const int64_t first = 4 * (16 * 8 + 8 + 8) + 32, last = 4 * (32 * 4 + 4 + 4) + 4;
  EXPECT_EQ(m.graph.param_count(), first + last);
  s.gat_heads = 3;  // does not divide 32
  try {
    build_gnn(s, g);
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("model.gat_heads = 3"), std::string::npos) << e.what();
  }
}

TEST(FullGraph, TheGraphBeatsTheFeaturesAlone) {
  // The same features on a graph without edges (every vertex isolated) give
  // what the features alone can; GCN on the real graph must do clearly better.
  const GraphData g = small_csbm();
  GraphData bare = g;
  bare.adj.col_idx.clear();
  bare.adj.row_ptr.assign(g.adj.row_ptr.size(), 0);
  const double with_graph = train_full_graph(gnn("gcn"), g, options(60)).test_acc;
  const double without = train_full_graph(gnn("gcn"), bare, options(60)).test_acc;
  EXPECT_GT(with_graph, without + 0.1) << "graph " << with_graph << " vs features " << without;
}

TEST(FullGraph, RefusesWhatItDoesNotSupportNamingTheKey) {
  const GraphData g = small_csbm();
  TrainerOptions t = options(1);
  t.precision = DType::bf16;
  try {
    train_full_graph(gnn("gcn"), g, t);
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("train.precision"), std::string::npos) << e.what();
  }
  EXPECT_THROW(train_full_graph(gnn("mlp"), g, options(1)), ConfigError);
}

TEST(GraphFile, RoundTrips) {
  mt::testing::TempDir dir;
  const GraphData g = small_csbm();
  const std::string path = dir.file("g.safetensors");
  save_graph(path, g);
  const GraphData h = load_graph(path);
  EXPECT_EQ(h.adj.row_ptr, g.adj.row_ptr);
  EXPECT_EQ(h.adj.col_idx, g.adj.col_idx);
  EXPECT_EQ(h.labels, g.labels);
  EXPECT_EQ(h.train_mask, g.train_mask);
  EXPECT_EQ(h.test_mask, g.test_mask);
  EXPECT_EQ(h.classes, g.classes);
  EXPECT_EQ(h.name, g.name);
  ASSERT_EQ(h.features.shape(), g.features.shape());
  for (int64_t i = 0; i < g.features.numel(); ++i)
    ASSERT_EQ(h.features.item(i), g.features.item(i));
}

TEST(GraphFile, BadContentsNameTheFileAndField) {
  mt::testing::TempDir dir;
  const GraphData good = small_csbm();
  auto expect_error = [&](const GraphData& g, const std::string& needle) {
    const std::string path = dir.file("bad.safetensors");
    save_graph(path, g);
    try {
      load_graph(path);
      ADD_FAILURE() << "no error, expected " << needle;
    } catch (const FileError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("graph file '" + path + "'"), std::string::npos) << msg;
      EXPECT_NE(msg.find(needle), std::string::npos) << msg;
    }
  };
  GraphData g = good;
  g.adj.col_idx[10] = 600;
  expect_error(g, "field 'col_idx': entry 10 is vertex id 600, out of range [0, 600)");
  g = good;
  g.features = Tensor::zeros({599, 16}, DType::f32);
  expect_error(g, "field 'features': has 599 rows but the graph has 600 vertices");
  g = good;
  g.labels.resize(601, 0);
  expect_error(g, "field 'labels': has 601 entries but the graph has 600 vertices");
}

TEST(GraphFile, AFlippedByteIsACheckpointError) {
  mt::testing::TempDir dir;
  const std::string path = dir.file("g.safetensors");
  save_graph(path, small_csbm());
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(std::filesystem::file_size(path) - 100));
    char c = 0;
    f.read(&c, 1);
    f.seekp(static_cast<std::streamoff>(std::filesystem::file_size(path) - 100));
    c = static_cast<char>(c ^ 0x40);
    f.write(&c, 1);
  }
  EXPECT_THROW(load_graph(path), CheckpointError);
  EXPECT_THROW(load_graph(dir.file("missing.safetensors")), FileError);
}

}  // namespace
}  // namespace mt
