// data/edge_list.h: a text edge list becomes a GraphData (CSR both ways, one-hot
// or given features, labels, a seeded split), and every malformed line is a
// ConfigError naming the file, the line and what was expected.
#include "meshtrain/data/edge_list.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "meshtrain/base/error.h"

namespace mt {
namespace {

std::string write(const std::string& name, const std::string& text) {
  const std::string path =
      (std::filesystem::temp_directory_path() / ("mt_edge_list_" + name)).string();
  std::ofstream(path) << text;
  return path;
}

std::string error_of(const std::string& text) {
  const std::string path = write("bad.edges", text);
  try {
    read_edge_list(path, {});
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    const auto at = what.find(path);
    return at == std::string::npos ? what : what.substr(at + path.size());
  }
  return "no error";
}

TEST(EdgeList, ReadsAPathWithOneHotFeatures) {
  const std::string path = write("path.edges",
                                 "# a path 0 - 1 - 2 - 3 and a duplicate, a self-loop\n"
                                 "vertices 4 classes 2\n"
                                 "label 0 0\nlabel 1 0\nlabel 2 1\nlabel 3 1\n"
                                 "edge 0 1\nedge 1 2  # comment\nedge 2 3\nedge 1 0\nedge 3 3\n");
  EdgeListOptions o;
  o.train_fraction = 0.5;
  o.val_fraction = 0.25;
  const GraphData g = read_edge_list(path, o);
  EXPECT_EQ(g.num_vertices(), 4);
  EXPECT_EQ(g.adj.nnz(), 6);  // three undirected edges, both ways
  EXPECT_EQ(g.classes, 2);
  EXPECT_EQ(g.labels, (std::vector<int32_t>{0, 0, 1, 1}));
  ASSERT_EQ(g.feature_dim(), 4);
  for (int64_t v = 0; v < 4; ++v) {
    for (int64_t j = 0; j < 4; ++j) EXPECT_EQ(g.features.data<float>()[v * 4 + j], v == j);
  }
  EXPECT_EQ(GraphData::members(g.train_mask).size(), 2u);
  EXPECT_EQ(GraphData::members(g.val_mask).size(), 1u);
  EXPECT_EQ(GraphData::members(g.test_mask).size(), 1u);
  // The split depends on the seed alone.
  EXPECT_EQ(read_edge_list(path, o).train_mask, g.train_mask);
}

TEST(EdgeList, ReadsGivenFeatures) {
  const std::string path = write("feat.edges",
                                 "vertices 2 classes 2\nlabel 0 0\nlabel 1 1\nedge 0 1\n"
                                 "feature 0 1 2.5\nfeature 1 -1 0\n");
  const GraphData g = read_edge_list(path, {0.5, 0.0, 1});
  ASSERT_EQ(g.feature_dim(), 2);
  EXPECT_FLOAT_EQ(g.features.data<float>()[1], 2.5F);
  EXPECT_FLOAT_EQ(g.features.data<float>()[2], -1.0F);
}

TEST(EdgeList, BadLinesNameTheLineAndWhatWasExpected) {
  const std::string head = "vertices 3 classes 2\nlabel 0 0\nlabel 1 1\nlabel 2 1\n";
  EXPECT_EQ(error_of(head + "edge 0 3\n"), ":5: endpoint '3' is not a vertex id in [0, 3)");
  EXPECT_EQ(error_of(head + "edge 0 x\n"), ":5: endpoint 'x' is not a vertex id in [0, 3)");
  EXPECT_EQ(error_of(head + "edge 0\n"), ":5: expected 'edge U V'");
  EXPECT_EQ(error_of(head + "label 1 0\n"), ":5: vertex 1 is labelled twice");
  EXPECT_EQ(error_of("vertices 3 classes 2\nlabel 0 2\n"), ":2: class 2 outside [0, 2)");
  EXPECT_EQ(error_of("vertices 3 classes 2\nlabel 0 0\nlabel 1 1\n"),
            ": vertex 2 has no 'label' line (every vertex of the 3 needs one)");
  EXPECT_EQ(error_of("edge 0 1\n"), ":1: 'edge' before the 'vertices N classes C' line");
  EXPECT_EQ(error_of(head + "node 1\n"),
            ":5: unknown keyword 'node' (expected vertices, label, edge or feature)");
  EXPECT_EQ(error_of("vertices 1 classes 1\n"),
            ":1: expected 'vertices N classes C' with 2 <= N <= 2^30 and 1 <= C <= N");
  EXPECT_EQ(error_of(head + "feature 0 1 2\nfeature 1 1\n"),
            ":6: 1 feature values, the rows before have 2");
  EXPECT_EQ(error_of(head + "feature 0 1\n"),
            ": 1 of 3 vertices have a 'feature' row (all or none)");
  EXPECT_EQ(error_of(""), ":0: no 'vertices N classes C' line");
  EXPECT_THROW(read_edge_list("/nonexistent/x.edges", {}), FileError);
}

}  // namespace
}  // namespace mt
