// comm/cost.h: the alpha-beta times of the collective algorithms against
// hand-computed values, and the pure algorithm choice and per-rank bytes
// against what a live communicator picks and counts.
#include <memory>

#include <gtest/gtest.h>

#include "meshtrain/comm/algorithms.h"
#include "meshtrain/comm/backends/local/local_world.h"
#include "meshtrain/comm/communicator.h"
#include "meshtrain/comm/cost.h"

namespace mt {
namespace {

using comm::CollectiveShape;
using comm::CommCostModel;

std::vector<int> iota_ranks(int n) {
  std::vector<int> r(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) r[static_cast<size_t>(i)] = i;
  return r;
}

// n ranks, one per node, inter-node link (L, W).
CommCostModel one_per_node(int n, double latency, double bandwidth) {
  CommCostModel m;
  m.layout = ClusterLayout::by_node_size(n, 1);
  m.layout.inter_node = {latency, bandwidth};
  return m;
}

TEST(CommTime, RingAllReduceIsTheClosedForm) {
  const double L = 5e-6, W = 10e9;
  for (int n : {2, 3, 4, 8}) {
    CommCostModel m = one_per_node(n, L, W);
    const size_t count = static_cast<size_t>(n) * 300'000;  // divisible by n, > 256 KiB
    const double B = static_cast<double>(count * 4);
    CollectiveShape s{Collective::all_reduce, count, {}, 4, 0};
    const std::vector<int> ranks = iota_ranks(n);
    const auto e = m.collective(s, ranks);
    EXPECT_EQ(e.algorithm, CommAlgorithm::ring) << n;
    const double want = 2.0 * (n - 1) / n * B / W + 2.0 * (n - 1) * L;
    EXPECT_NEAR(e.seconds, want, want * 1e-12) << n;
    EXPECT_EQ(e.steps, 2 * (n - 1));
    for (int r = 0; r < n; ++r) {
      EXPECT_EQ(e.bytes_sent[static_cast<size_t>(r)], 2 * (n - 1) * count * 4 / n);
    }
  }
}

TEST(CommTime, HalvingDoublingSmallMessages) {
  // 8 ranks (a power of two), 64 KiB: the policy picks halving-doubling,
  // 2 log2(8) = 6 steps and 2 (n-1)/n B per rank.
  const double L = 2e-6, W = 1e9;
  CommCostModel m = one_per_node(8, L, W);
  const size_t count = 16 * 1024;
  CollectiveShape s{Collective::all_reduce, count, {}, 4, 0};
  const auto e = m.collective(s, iota_ranks(8));
  EXPECT_EQ(e.algorithm, CommAlgorithm::halving_doubling);
  const double B = count * 4.0;
  EXPECT_NEAR(e.seconds, 6 * L + 2.0 * 7 / 8 * B / W, 1e-15);
}

TEST(CommTime, RingAllGatherAndReduceScatter) {
  const double L = 1e-5, W = 2e9;
  CommCostModel m = one_per_node(4, L, W);
  const size_t block = 200'000;  // per rank; 3.2 MB gathered
  const double b = block * 4.0;
  for (Collective c : {Collective::all_gather, Collective::reduce_scatter}) {
    CollectiveShape s{c, block, {}, 4, 0};
    const auto e = m.collective(s, iota_ranks(4));
    EXPECT_EQ(e.algorithm, CommAlgorithm::ring);
    EXPECT_NEAR(e.seconds, 3 * L + 3 * b / W, 1e-15) << collective_name(c);
  }
}

TEST(CommTime, HierarchicalAddsItsPhasesOverTheirLinks) {
  // 2 nodes x 2 ranks; intra link (Li, Wi), inter link (Le, We); emulated
  // links: no shared memory, so ring everywhere (4 MiB, 2-rank groups).
  const double Li = 1e-6, Wi = 50e9, Le = 1e-4, We = 1e9;
  CommCostModel m;
  m.layout = ClusterLayout::by_node_size(4, 2);
  m.layout.intra_node = {Li, Wi};
  m.layout.inter_node = {Le, We};
  const size_t count = 1 << 20;
  const double B = count * 4.0;
  CollectiveShape s{Collective::all_reduce, count, {}, 4, 0};
  const auto e = m.collective(s, iota_ranks(4));
  ASSERT_EQ(e.algorithm, CommAlgorithm::hierarchical);
  // node reduce-scatter (1 step, B/2) + cross all-reduce of B/2 on 2 ranks
  // (2 steps, B/2) + node all-gather (1 step, B/2).
  const double want = 2 * Li + B / Wi + 2 * Le + B / 2 / We;
  EXPECT_NEAR(e.seconds, want, want * 1e-12);
  // The bytes are hier_all_reduce_cost's.
  comm::HierAlgorithms a;  // ring x 3
  for (int r = 0; r < 4; ++r) {
    const CollectiveCost c = comm::hier_all_reduce_cost(2, 2, r / 2, r % 2, count, 4, a);
    EXPECT_EQ(e.bytes_sent[static_cast<size_t>(r)], c.bytes_sent);
    EXPECT_EQ(e.bytes_received[static_cast<size_t>(r)], c.bytes_received);
  }
}

TEST(CommTime, MeasuredFitReplacesTheLink) {
  CommCostModel m = one_per_node(2, 1e-3, 1e6);
  m.algorithm_links["ring/inter_node"] = {1e-5, 1e9};
  const size_t count = 1 << 20;
  CollectiveShape s{Collective::all_reduce, count, {}, 4, 0};
  const auto e = m.collective(s, iota_ranks(2));
  EXPECT_NEAR(e.seconds, 2 * 1e-5 + count * 4.0 / 1e9, 1e-15);
  EXPECT_NEAR(m.send_s(0, 1, 1000), 1e-3 + 1000 / 1e6, 1e-15);
  m.algorithm_links["pairwise/inter_node"] = {2e-6, 1e10};
  EXPECT_NEAR(m.send_s(0, 1, 1000), 2e-6 + 1000 / 1e10, 1e-18);
}

TEST(CommTime, SlowestLinkOfTheGroupBounds) {
  // Three nodes; the pair (0, 2) is slow: a ring over all three runs at it.
  CommCostModel m = one_per_node(3, 1e-5, 10e9);
  m.layout.node_pairs[{0, 2}] = {1e-3, 1e8};
  LinkKind kind{};
  const std::vector<int> all = iota_ranks(3), fast = {0, 1};
  const LinkSpec slow = m.group_link(CommAlgorithm::ring, all, &kind);
  EXPECT_EQ(kind, LinkKind::inter_node);
  EXPECT_DOUBLE_EQ(slow.bandwidth_bytes_s, 1e8);
  EXPECT_DOUBLE_EQ(slow.latency_s, 1e-3);
  EXPECT_DOUBLE_EQ(m.group_link(CommAlgorithm::ring, fast).bandwidth_bytes_s, 10e9);
}

// Without per-pair links a group's link comes from the kinds of its pairs
// (linear in the group; the planner prices groups of a thousand ranks):
// the same as the worst of every pair's link, here over 2 sites x 3 nodes x
// 2 ranks, with and without a pair override.
TEST(CommTime, GroupLinkIsTheWorstPairsLink) {
  CommCostModel m;
  m.layout = ClusterLayout::by_node_size(12, 2);
  m.layout.site_of_node = {0, 0, 0, 1, 1, 1};
  m.layout.intra_node = {1e-6, 100e9};
  m.layout.inter_node = {1e-5, 10e9};
  m.layout.inter_site = {1e-3, 1e9};
  auto brute = [&](const std::vector<int>& g, LinkKind* kind) {
    LinkSpec w{};
    *kind = g.size() > 1 ? LinkKind::intra_node : LinkKind::self;
    bool first = true;
    for (int a : g) {
      for (int b : g) {
        const LinkKind k = m.layout.kind(a, b);
        if (a == b || k == LinkKind::intra_node) continue;
        if (k == LinkKind::inter_site || *kind != LinkKind::inter_site) *kind = k;
        const LinkSpec& l = m.layout.link(a, b);
        w.latency_s = first ? l.latency_s : std::max(w.latency_s, l.latency_s);
        w.bandwidth_bytes_s =
            first ? l.bandwidth_bytes_s : std::min(w.bandwidth_bytes_s, l.bandwidth_bytes_s);
        first = false;
      }
    }
    return first && g.size() > 1 ? m.layout.intra_node : w;
  };
  const std::vector<std::vector<int>> groups = {{0},    {0, 1},  {0, 2},       {1, 3, 5},
                                                {4, 6}, {0, 11}, {2, 3, 8, 9}, iota_ranks(12)};
  for (int pass = 0; pass < 2; ++pass) {
    if (pass == 1) m.layout.node_pairs[{1, 2}] = {5e-3, 5e8};
    for (const std::vector<int>& g : groups) {
      LinkKind want{}, got{};
      const LinkSpec w = brute(g, &want);
      const LinkSpec l = m.group_link(CommAlgorithm::ring, g, &got);
      EXPECT_EQ(got, want) << "pass " << pass << " group of " << g.size() << " from " << g[0];
      EXPECT_DOUBLE_EQ(l.latency_s, w.latency_s) << "pass " << pass << " from " << g[0];
      EXPECT_DOUBLE_EQ(l.bandwidth_bytes_s, w.bandwidth_bytes_s) << "pass " << pass;
    }
  }
}

// The planner's choice and bytes are the communicator's: ranks as threads,
// one node (shared memory), and 2 nodes x 2 ranks (hierarchical).
TEST(CommTime, ChoiceAndBytesMatchTheCommunicator) {
  for (bool two_nodes : {false, true}) {
    LocalWorldOptions o;
    o.size = 4;
    o.comm.timeout = std::chrono::milliseconds(30'000);
    CommCostModel m;
    m.layout = two_nodes ? ClusterLayout::by_node_size(4, 2) : ClusterLayout::by_node_size(4, 4);
    if (two_nodes) o.comm.cluster = std::make_shared<ClusterLayout>(m.layout);
    LocalWorld::run(o, [&](Communicator& c) {
      for (size_t count : {size_t{1000}, size_t{300'000}}) {
        CollectiveShape s{Collective::all_reduce, count, {}, 4, 0};
        const auto e = m.collective(s, iota_ranks(4));
        EXPECT_EQ(c.choose_algorithm(Collective::all_reduce, count * 4), e.algorithm)
            << two_nodes << " " << count;
        std::vector<float> buf(count, 1.0f);
        c.reset_counters();
        c.all_reduce(buf.data(), buf.data(), count, DType::f32, ReduceOp::sum);
        const CollectiveCost stated =
            c.cost(Collective::all_reduce, e.algorithm, count, DType::f32);
        EXPECT_EQ(stated.bytes_sent, e.bytes_sent[static_cast<size_t>(c.rank())]);
        EXPECT_EQ(stated.bytes_received, e.bytes_received[static_cast<size_t>(c.rank())]);
      }
    });
  }
}

}  // namespace
}  // namespace mt
