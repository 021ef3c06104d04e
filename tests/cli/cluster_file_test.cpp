// The cluster file (cli/cluster_file.h): the documented example parses and
// resolves to the layout it describes; node_size and the defaults; every
// kind of bad file is rejected with the file, the key and what was expected.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/temp_dir.h"
#include "meshtrain/base/error.h"
#include "meshtrain/cli/cluster_file.h"
#include "meshtrain/cli/run_config.h"

namespace mt {
namespace {

using ::testing::HasSubstr;

TEST(ClusterFile, TheDocumentedExampleResolves) {
  const ClusterFile f = read_cluster_file(MT_SOURCE_DIR "/configs/cluster/example.toml");
  ASSERT_EQ(f.nodes.size(), 4u);
  EXPECT_EQ(f.devices.at("cpu").peak_tflops, 2.0);
  EXPECT_EQ(f.nodes[0].device, "cpu");
  const ClusterLayout l = resolve_cluster(f, 8);
  EXPECT_EQ(l.node_of, (std::vector<int>{0, 0, 1, 1, 2, 2, 3, 3}));
  EXPECT_EQ(l.site_of_node, (std::vector<int>{0, 0, 1, 1}));
  EXPECT_EQ(l.kind(0, 1), LinkKind::intra_node);
  EXPECT_EQ(l.kind(0, 2), LinkKind::inter_node);
  EXPECT_EQ(l.kind(0, 4), LinkKind::inter_site);
  EXPECT_DOUBLE_EQ(l.link(0, 2).bandwidth_bytes_s, 1e9 / 8);
  EXPECT_DOUBLE_EQ(l.link(0, 2).latency_s, 1e-3);
  EXPECT_DOUBLE_EQ(l.link(1, 7).latency_s, 50e-3);
  EXPECT_DOUBLE_EQ(l.link(3, 4).latency_s, 20e-3);  // the b-c pair
  EXPECT_DOUBLE_EQ(l.link(4, 3).bandwidth_bytes_s, 0.5e9 / 8);
  EXPECT_EQ(f.slowdown, (std::vector<double>{1, 1, 1, 1, 1, 3, 1, 1}));
  EXPECT_TRUE(l.emulates());
}

TEST(ClusterFile, NodeSizeAndUnconstrainedDefaults) {
  const ClusterFile f = parse_cluster_file("node_size = 3\n", "t.toml");
  const ClusterLayout l = resolve_cluster(f, 7);
  EXPECT_EQ(l.node_of, (std::vector<int>{0, 0, 0, 1, 1, 1, 2}));
  EXPECT_EQ(l.node_names, (std::vector<std::string>{"node0", "node1", "node2"}));
  EXPECT_FALSE(l.emulates());
  // Generated names can be used by sites and pairs.
  const ClusterFile g = parse_cluster_file(
      "node_size = 1\n[[sites]]\nnodes = [\"node1\"]\n[links.inter_site]\nlatency_ms = 3\n", "t");
  const ClusterLayout lg = resolve_cluster(g, 3);
  EXPECT_EQ(lg.site_of_node, (std::vector<int>{0, 1, 0}));  // renumbered densely
  EXPECT_DOUBLE_EQ(lg.link(0, 1).latency_s, 3e-3);
  EXPECT_FALSE(lg.link(0, 2).constrained());
  EXPECT_EQ(lg.sharing, LinkSharing::rank_pair);
  const ClusterFile h =
      parse_cluster_file("node_size = 2\n[links]\nsharing = \"node_pair\"\n", "t");
  EXPECT_EQ(resolve_cluster(h, 4).sharing, LinkSharing::node_pair);
}

void expect_rejected(const std::string& text, int world, const std::string& message) {
  try {
    resolve_cluster(parse_cluster_file(text, "bad.toml"), world);
    ADD_FAILURE() << "accepted:\n" << text;
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("cluster file bad.toml: " + message)) << text;
  }
}

TEST(ClusterFile, BadFilesNameFileKeyAndExpectation) {
  expect_rejected("node_size = 2\n[links.inter_node]\nbandwidth_gbit_s = -1\n", 4,
                  "links.inter_node.bandwidth_gbit_s: expected a number > 0, got -1");
  expect_rejected("node_size = 2\n[links.inter_node]\nbandwidth_gbit_s = 0\n", 4,
                  "links.inter_node.bandwidth_gbit_s: expected a number > 0, got 0");
  expect_rejected("node_size = 2\n[links.inter_node]\nlatency_ms = -1\n", 4,
                  "links.inter_node.latency_ms: expected a number >= 0, got -1");
  expect_rejected("node_size = 2\n[links.inter_node]\nlatency_ms = \"1 ms\"\n", 4,
                  "links.inter_node.latency_ms: expected a number, got string \"1 ms\"");
  expect_rejected("[[nodes]]\nname = \"a\"\nranks = [0]\n[[link_pairs]]\nnodes = [\"a\", \"x\"]\n",
                  1, "link_pairs[0].nodes[1]: no node \"x\" (the nodes are \"a\")");
  expect_rejected("[[nodes]]\nranks = [0, 1]\n[[nodes]]\nranks = [1]\n", 2,
                  "nodes[1].ranks: rank 1 is already on node \"node0\"");
  expect_rejected("[[nodes]]\nranks = [0, 2]\n", 4,
                  "nodes: the nodes do not cover the job's 4 ranks: ranks 1, 3 are on no node");
  expect_rejected("[[nodes]]\nranks = [0, 5]\n", 4,
                  "nodes[0].ranks: rank 5 is not in the job, which has 4 ranks (0..3)");
  expect_rejected("[[nodes]]\nranks = []\n", 1, "nodes[0].ranks: expected at least one rank");
  expect_rejected("[links.inter_node]\nlatency_ms = 1\n", 1,
                  "nodes: required: either node_size = N or [[nodes]]");
  expect_rejected("node_size = 2\n[[nodes]]\nranks = [0]\n", 1,
                  "nodes: give either node_size or [[nodes]], not both");
  expect_rejected("node_size = 0\n", 1, "node_size: expected an integer >= 1, got 0");
  expect_rejected("node_size = 1\n[[sites]]\nnodes = [\"a\"]\n", 1,
                  "sites[0].nodes[0]: no node \"a\" (with node_size the nodes are node0, node1");
  expect_rejected("node_size = 1\n[[sites]]\nnodes = [\"node0\"]\n[[sites]]\nnodes = [\"node0\"]\n",
                  1, "sites[1].nodes[0]: node \"node0\" is already in site \"site0\"");
  expect_rejected("node_size = 1\n[[sites]]\nnodes = [\"node7\"]\n", 2,
                  "sites[0].nodes[0]: no node \"node7\" in a job of 2 ranks");
  expect_rejected("node_size = 1\n[ranks]\nslowdown = [1, 0.5]\n", 2,
                  "ranks.slowdown[1]: expected a number >= 1, got 0.5");
  expect_rejected("node_size = 1\n[ranks]\nslowdown = [1, 2, 3]\n", 2,
                  "ranks.slowdown: 3 factors given for 2 ranks");
  expect_rejected("node_size = 1\n[linkz]\n", 1, "linkz: unknown key (expected one of:");
  expect_rejected("[[nodes]]\nranks = [0]\ndevice = \"gpu\"\n", 1,
                  "nodes[0].device: unknown device kind \"gpu\" (expected a [devices.gpu] table");
  expect_rejected("node_size = 1\n[devices.cpu]\npeak_tflops = -2\n", 1,
                  "devices.cpu.peak_tflops: expected a number > 0, got -2");
  expect_rejected("node_size = 1\n[[link_pairs]]\nnodes = [\"node0\", \"node0\"]\n", 1,
                  "link_pairs[0].nodes: a link joins two different nodes");
  expect_rejected("node_size = 1\n[links]\nsharing = \"node\"\n", 1,
                  "links.sharing: expected \"rank_pair\" or \"node_pair\", got \"node\"");
  expect_rejected("node_size = [1\n", 1, "line 1");
}

void expect_model_rejected(const std::string& text, int world, const std::string& message) {
  try {
    cluster_model(parse_cluster_file(text, "bad.toml"), world);
    ADD_FAILURE() << "accepted:\n" << text;
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("cluster file bad.toml: " + message)) << text;
  }
}

// Device kinds, node groups given by count, measured collectives: the
// planner's ClusterModel from a file.
TEST(ClusterFile, DeviceKindsBecomeTheClusterModel) {
  const ClusterFile f = parse_cluster_file(R"(
[devices.big]
peak_tflops_f32 = 19.5
peak_tflops_tf32 = 156
peak_tflops_bf16 = 312
memory_gb = 80
memory_bandwidth_gb_s = 2039
default_efficiency = 0.4
op_overhead_us = 4.5
weight_bandwidth_gb_s = 30
cache_mb = 32
source = "datasheet"
[devices.big.efficiency]
matmul = 0.7
[devices.small]
peak_tflops = 15.7
memory_gb = 32
[[nodes]]
name = "a"
count = 2
ranks_per_node = 2
device = "big"
[[nodes]]
name = "v"
ranks_per_node = 3
device = "small"
[[sites]]
nodes = ["a"]
[links.inter_site]
bandwidth_gbit_s = 10
[collectives.ring.intra_node]
latency_ms = 0.01
bandwidth_gbit_s = 800
)",
                                           "t.toml");
  EXPECT_EQ(f.ranks(), 7);
  ASSERT_EQ(f.nodes.size(), 3u);
  EXPECT_EQ(f.nodes[1].name, "a-1");
  EXPECT_EQ(f.nodes[1].ranks, (std::vector<int>{2, 3}));
  EXPECT_EQ(f.nodes[2].ranks, (std::vector<int>{4, 5, 6}));
  const planner::ClusterModel m = cluster_model(f);
  ASSERT_EQ(m.world(), 7);
  EXPECT_EQ(m.device(0).name, "big");
  EXPECT_EQ(m.device(6).name, "small");
  EXPECT_DOUBLE_EQ(m.device(3).peak_flops_f32, 156e12);  // TF32 is the f32 path where given
  EXPECT_DOUBLE_EQ(m.device(3).peak_flops_bf16, 312e12);
  EXPECT_DOUBLE_EQ(m.device(3).memory_bytes, 80e9);
  EXPECT_DOUBLE_EQ(m.device(3).memory_bandwidth, 2039e9);
  EXPECT_DOUBLE_EQ(m.device(3).efficiency.at("matmul"), 0.7);
  EXPECT_DOUBLE_EQ(m.device(3).default_efficiency, 0.4);
  EXPECT_DOUBLE_EQ(m.device(3).op_overhead_s, 4.5e-6);
  EXPECT_EQ(m.device(5).op_overhead_s, 0.0);  // not given: none
  EXPECT_DOUBLE_EQ(m.device(3).weight_bandwidth, 30e9);
  EXPECT_DOUBLE_EQ(m.device(3).cache_bytes, 32e6);
  EXPECT_EQ(m.device(5).weight_bandwidth, 0.0);  // not given: the traffic overlaps the FLOPs
  EXPECT_EQ(m.device(0).source, "datasheet");
  EXPECT_DOUBLE_EQ(m.device(5).peak_flops_f32, 15.7e12);
  EXPECT_EQ(m.layout.kind(0, 2), LinkKind::inter_node);
  EXPECT_EQ(m.layout.kind(0, 4), LinkKind::inter_site);
  EXPECT_DOUBLE_EQ(m.layout.link(3, 4).bandwidth_bytes_s, 10e9 / 8);
  EXPECT_DOUBLE_EQ(m.algorithm_links.at("ring/intra_node").bandwidth_bytes_s, 100e9);
  EXPECT_DOUBLE_EQ(m.algorithm_links.at("ring/intra_node").latency_s, 1e-5);
  // A node_size file needs the world; the one kind is every rank's.
  const ClusterFile g = parse_cluster_file(
      "node_size = 2\n[devices.cpu]\npeak_tflops = 1\nmemory_gb = 8\n", "g.toml");
  EXPECT_EQ(cluster_model(g, 4).world(), 4);
  EXPECT_EQ(cluster_model(g, 4).kind_of, (std::vector<int>{0, 0, 0, 0}));
  EXPECT_THAT([&] { cluster_model(g); },
              ::testing::ThrowsMessage<ConfigError>(HasSubstr("g.toml: node_size:")));
}

TEST(ClusterFile, BadDeviceKindsNameTheKey) {
  expect_rejected("node_size = 1\n[devices.cpu]\nmemory_gb = 0\n", 1,
                  "devices.cpu.memory_gb: expected a number > 0, got 0");
  expect_rejected("node_size = 1\n[devices.cpu]\nmemory_bandwidth_gb_s = -5\n", 1,
                  "devices.cpu.memory_bandwidth_gb_s: expected a number > 0, got -5");
  expect_rejected("node_size = 1\n[devices.cpu]\nop_overhead_us = -1\n", 1,
                  "devices.cpu.op_overhead_us: expected a number >= 0, got -1");
  expect_rejected("node_size = 1\n[devices.cpu.efficiency]\nmatmul = 1.5\n", 1,
                  "devices.cpu.efficiency.matmul: expected a fraction of peak in (0, 1], got 1.5");
  expect_rejected("node_size = 1\ndevice = \"tpu\"\n[devices.cpu]\n", 1,
                  "device: unknown device kind \"tpu\" (expected a [devices.tpu] table; defined: "
                  "\"cpu\")");
  expect_rejected("node_size = 1\n[devices.cpu]\npeak_tflops = 1\npeak_tflops_f32 = 1\n", 1,
                  "devices.cpu.peak_tflops_f32: give peak_tflops or peak_tflops_f32");
  expect_rejected("node_size = 1\n[collectives.ring.between]\nlatency_ms = 1\n", 1,
                  "collectives.ring.between: unknown link kind");
  expect_rejected("node_size = 1\n[collectives.ring.intra_node]\nbandwidth_gbit_s = -1\n", 1,
                  "collectives.ring.intra_node.bandwidth_gbit_s: expected a number > 0, got -1");
  expect_rejected("[[nodes]]\nranks = [0]\nranks_per_node = 2\n", 1,
                  "nodes[0].ranks: give ranks, or count and ranks_per_node, not both");
  expect_rejected(
      "[[nodes]]\nname = \"g\"\ncount = 2\nranks_per_node = 1\n[[nodes]]\nname = "
      "\"h\"\nranks = [2]\n[[link_pairs]]\nnodes = [\"g\", \"h\"]\n",
      3, "link_pairs[0].nodes[0]: \"g\" names 2 nodes");
  expect_model_rejected("[[nodes]]\nranks = [0]\n", 0,
                        "nodes[0].device: node \"node0\" has no device kind and the file defines "
                        "no [devices.NAME] table");
  expect_model_rejected("[[nodes]]\nranks = [0]\n[devices.a]\nmemory_gb = 1\n", 0,
                        "devices.a.peak_tflops_f32: required by the planner");
  expect_model_rejected("[[nodes]]\nranks = [0]\n[devices.a]\npeak_tflops = 1\n", 0,
                        "devices.a.memory_gb: required by the planner");
  expect_model_rejected(
      "[[nodes]]\nranks = [0]\ndevice = \"a\"\n[devices.a]\npeak_tflops = "
      "1\nmemory_gb = 1\n[[nodes]]\nranks = [1]\n[devices.b]\n",
      0,
      "nodes[1].device: node \"node1\" has no device kind and the file "
      "defines several kinds");
}

// `[[nodes]] cores`: ranks that outnumber their node's cores time-share
// them, so each rank's kernels take ranks / cores as long (slowdown_of);
// with enough cores, or without the key, nothing changes.
TEST(ClusterFile, NodeCoresSharedByMoreRanksSlowThem) {
  const std::string dev = "[devices.cpu]\npeak_tflops = 1\nmemory_gb = 8\n";
  const planner::ClusterModel shared = cluster_model(
      parse_cluster_file(dev + "[[nodes]]\nname = \"a\"\nranks_per_node = 4\ncores = 2\n"
                               "[[nodes]]\nname = \"b\"\nranks_per_node = 3\ncores = 8\n",
                         "c.toml"));
  ASSERT_EQ(shared.world(), 7);
  for (int r = 0; r < 4; ++r) EXPECT_DOUBLE_EQ(shared.slowdown_of(r), 2.0) << r;
  for (int r = 4; r < 7; ++r) EXPECT_DOUBLE_EQ(shared.slowdown_of(r), 1.0) << r;
  planner::ClusterModel slowed = shared;
  slowed.slowdown = {1, 3, 1, 1, 2, 1, 1};  // an emulated slowdown multiplies
  EXPECT_DOUBLE_EQ(slowed.slowdown_of(1), 6.0);
  EXPECT_DOUBLE_EQ(slowed.slowdown_of(4), 2.0);
  const planner::ClusterModel plain =
      cluster_model(parse_cluster_file(dev + "[[nodes]]\nranks_per_node = 4\n", "p.toml"));
  EXPECT_TRUE(plain.node_core_sharing.empty());
  EXPECT_DOUBLE_EQ(plain.slowdown_of(3), 1.0);
  expect_rejected("[[nodes]]\nranks_per_node = 2\ncores = 0\n", 2, "nodes[0].cores:");
}

// [devices.NAME.runtime] and the matmul tiling keys reach the device kind;
// bad values name the key.
TEST(ClusterFile, RuntimeSettingsAndMatmulTiling) {
  const ClusterFile f = parse_cluster_file(R"(
[[nodes]]
ranks = [0]
[devices.gpu]
peak_tflops = 19.5
peak_tflops_bf16 = 312
memory_gb = 80
compute_units = 108
matmul_tile = [256, 128]
[devices.gpu.runtime]
half_activations = true
fused_elementwise = true
attention_dropout = true
blocking_p2p = true
source = "Megatron-LM"
)",
                                           "t.toml");
  const planner::ClusterModel m = cluster_model(f, 1);
  const planner::DeviceKind& k = m.kinds.at(0);
  EXPECT_TRUE(k.half_activations);
  EXPECT_TRUE(k.fused_elementwise);
  EXPECT_TRUE(k.attention_dropout);
  EXPECT_TRUE(k.blocking_p2p);
  EXPECT_EQ(k.runtime_source, "Megatron-LM");
  EXPECT_EQ(k.compute_units, 108);
  EXPECT_EQ(k.matmul_tile[0], 256);
  EXPECT_EQ(k.matmul_tile[1], 128);
  expect_rejected("node_size = 1\n[devices.g.runtime]\nfused = true\n", 1,
                  "devices.g.runtime.fused: unknown key (expected one of: half_activations, "
                  "fused_elementwise, attention_dropout, blocking_p2p, source)");
  expect_rejected("node_size = 1\n[devices.g.runtime]\nblocking_p2p = true\n", 1,
                  "devices.g.runtime.source: missing: say which runtime");
  expect_rejected("node_size = 1\n[devices.g.runtime]\nhalf_activations = 1\nsource = \"x\"\n", 1,
                  "devices.g.runtime.half_activations: expected true or false, got 1");
  expect_rejected("node_size = 1\n[devices.g.runtime]\nfused_elementwise = true\n", 1,
                  "devices.g.runtime.source: missing: say which runtime");
  expect_rejected("node_size = 1\n[devices.g]\ncompute_units = 108\nmatmul_tile = [256]\n", 1,
                  "devices.g.matmul_tile: expected [rows, columns] (2 integers), got 1 entries");
  expect_rejected("node_size = 1\n[devices.g]\ncompute_units = 0\nmatmul_tile = [256, 128]\n", 1,
                  "devices.g.compute_units: expected an integer >= 1, got 0");
  expect_rejected("node_size = 1\n[devices.g]\nmatmul_tile = [256, 128]\n", 1,
                  "devices.g.compute_units: missing: compute_units and matmul_tile are given "
                  "together");
}

// The shipped real-system files (configs/cluster/, numbers from vendor
// datasheets named in their comments) load as cluster models.
TEST(ClusterFile, ShippedRealSystemFilesLoad) {
  struct Want {
    const char* file;
    int kinds;
    double intra_gbit, inter_gbit;
  };
  for (const Want& w :
       {Want{"a100_ib200.toml", 1, 2400, 200}, Want{"h100_ndr400.toml", 1, 3600, 400},
        Want{"a100_v100_mixed.toml", 2, 1200, 100}, Want{"two_sites_10gbit.toml", 1, 2400, 200}}) {
    SCOPED_TRACE(w.file);
    const planner::ClusterModel m =
        cluster_model(read_cluster_file(std::string(MT_SOURCE_DIR "/configs/cluster/") + w.file));
    ASSERT_EQ(m.world(), 32);
    EXPECT_EQ(m.layout.nodes(), 4);
    EXPECT_EQ(static_cast<int>(m.kinds.size()), w.kinds);
    for (const planner::DeviceKind& k : m.kinds) {
      EXPECT_GT(k.peak_flops_f32, 1e13) << k.name;
      EXPECT_GT(k.peak_flops_bf16, k.peak_flops_f32 * 0.99) << k.name;
      EXPECT_GT(k.memory_bytes, 3e10) << k.name;
      EXPECT_GT(k.memory_bandwidth, 8e11) << k.name;
      EXPECT_FALSE(k.source.empty()) << k.name;
    }
    EXPECT_DOUBLE_EQ(m.layout.intra_node.bandwidth_bytes_s, w.intra_gbit * 1e9 / 8);
    EXPECT_DOUBLE_EQ(m.layout.inter_node.bandwidth_bytes_s, w.inter_gbit * 1e9 / 8);
  }
  const planner::ClusterModel mixed =
      cluster_model(read_cluster_file(MT_SOURCE_DIR "/configs/cluster/a100_v100_mixed.toml"));
  EXPECT_EQ(mixed.device(0).name, "a100_80gb");
  EXPECT_EQ(mixed.device(31).name, "v100_32gb");
  EXPECT_DOUBLE_EQ(mixed.layout.link(0, 8).bandwidth_bytes_s, 200e9 / 8);  // the A100 pair
  EXPECT_DOUBLE_EQ(mixed.layout.link(0, 16).bandwidth_bytes_s, 100e9 / 8);
  const planner::ClusterModel sites =
      cluster_model(read_cluster_file(MT_SOURCE_DIR "/configs/cluster/two_sites_10gbit.toml"));
  EXPECT_EQ(sites.layout.kind(0, 8), LinkKind::inter_node);
  EXPECT_EQ(sites.layout.kind(0, 16), LinkKind::inter_site);
  EXPECT_DOUBLE_EQ(sites.layout.link(0, 16).bandwidth_bytes_s, 10e9 / 8);
}

// dist.cluster is read with the config; its slowdown becomes dist.slowdown
// (the trainer's mechanism); dist.slowdown as well, or dist.node_size with
// it, is an error naming both.
TEST(ClusterFile, RunConfigReadsItAndFeedsSlowdown) {
  mt::testing::TempDir dir;
  const std::string path = dir.write("c.toml", "node_size = 2\n[ranks]\nslowdown = [1, 3]\n");
  Config c = Config::parse(fmt::format("[dist]\ncluster = \"{}\"\n", path), "run.toml");
  const RunConfig rc = read_run_config(c);
  ASSERT_TRUE(rc.cluster.has_value());
  EXPECT_EQ(rc.cluster->node_size, 2);
  EXPECT_EQ(rc.train.dist.slowdown, (std::vector<double>{1, 3}));
  EXPECT_TRUE(rc.hierarchical);

  Config both =
      Config::parse(fmt::format("[dist]\ncluster = \"{}\"\nslowdown = [1, 2]\n", path), "run.toml");
  EXPECT_THAT([&] { read_run_config(both); },
              ::testing::ThrowsMessage<ConfigError>(HasSubstr(
                  "dist.slowdown and the cluster file " + path + "'s ranks.slowdown both")));
  Config grouped =
      Config::parse(fmt::format("[dist]\ncluster = \"{}\"\nnode_size = 2\n", path), "run.toml");
  EXPECT_THAT([&] { read_run_config(grouped); },
              ::testing::ThrowsMessage<ConfigError>(HasSubstr("both group ranks into nodes")));
  Config bad = Config::parse("[dist]\nnode_size = -1\n", "run.toml");
  EXPECT_THAT([&] { read_run_config(bad); },
              ::testing::ThrowsMessage<ConfigError>(HasSubstr("dist.node_size")));
}

}  // namespace
}  // namespace mt
