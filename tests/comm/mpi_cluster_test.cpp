// Hierarchical all-reduce, reduce-scatter and all-gather over the mpi backend, 4 ranks grouped into
// 2 nodes of 2 (a forced layout, as dist.node_size = 2 gives): equal to the flat algorithms bit for
// bit on exactly representable sums, within 1e-5 on random floats; counters equal to the cost
// function; the node's sub-calls on the real shared window, the cross-node ones on MPI messages;
// and the same under emulated links. The machine's own grouping (one host) builds no hierarchy.
#include <random>

#include <gtest/gtest.h>

#include "comm_test_util.h"
#include "meshtrain/comm/backends/mpi/mpi_communicator.h"
#include "meshtrain/comm/cluster.h"

namespace mt {
namespace {

std::unique_ptr<Communicator> world(std::shared_ptr<const ClusterLayout> layout) {
  CommOptions o;
  o.timeout = std::chrono::milliseconds(60'000);
  o.cluster = std::move(layout);
  MpiOptions m;
  m.shm_bytes_per_rank = 64 * 1024;  // several shared-memory rounds at moderate sizes
  return make_mpi_communicator(o, m);
}

void check_equal_to_flat(Communicator& c) {
  ASSERT_TRUE(c.has_hierarchy());
  ASSERT_EQ(c.choose_algorithm(Collective::all_reduce, 1 << 20), CommAlgorithm::hierarchical);
  for (size_t count : {size_t{1}, size_t{33}, size_t{4097}, size_t{200000}}) {
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::min}) {
      std::vector<float> in(count), ring(count), hd(count), hier(count);
      for (size_t i = 0; i < count; ++i) {
        in[i] = static_cast<float>(test::input_value(DType::f32, c.rank(), i));
      }
      CollectiveOptions o;
      o.algorithm = CommAlgorithm::ring;
      c.all_reduce(in.data(), ring.data(), count, DType::f32, op, o);
      o.algorithm = CommAlgorithm::halving_doubling;
      c.all_reduce(in.data(), hd.data(), count, DType::f32, op, o);
      c.reset_counters();
      c.all_reduce(in.data(), hier.data(), count, DType::f32, op);
      ASSERT_EQ(0, std::memcmp(ring.data(), hier.data(), count * 4))
          << "rank " << c.rank() << " count " << count << " op " << reduce_op_name(op);
      ASSERT_EQ(0, std::memcmp(hd.data(), hier.data(), count * 4));
      const CollectiveCost want =
          c.cost(Collective::all_reduce, CommAlgorithm::hierarchical, count, DType::f32);
      const CollectiveCounter got = c.counters().by_collective.at("all_reduce");
      EXPECT_EQ(got.bytes_sent, want.bytes_sent) << "count " << count;
      EXPECT_EQ(got.bytes_received, want.bytes_received) << "count " << count;
    }
  }
  std::mt19937 gen(static_cast<unsigned>(c.rank() + 7));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> in(50001), ring(in.size()), hier(in.size());
  for (float& x : in) x = u(gen);
  CollectiveOptions o;
  o.algorithm = CommAlgorithm::ring;
  c.all_reduce(in.data(), ring.data(), in.size(), DType::f32, ReduceOp::sum, o);
  c.all_reduce(in.data(), hier.data(), in.size(), DType::f32, ReduceOp::sum);
  for (size_t i = 0; i < in.size(); ++i) {
    ASSERT_NEAR(ring[i], hier[i], 1e-5f * std::max(1.0f, std::abs(ring[i]))) << "element " << i;
  }
}

void check_rs_ag_equal_to_flat(Communicator& c) {
  const size_t n = static_cast<size_t>(c.size());
  ASSERT_EQ(c.choose_algorithm(Collective::reduce_scatter, 1 << 20), CommAlgorithm::hierarchical);
  CollectiveOptions ring;
  ring.algorithm = CommAlgorithm::ring;
  for (size_t base : {size_t{1}, size_t{1000}, size_t{70000}}) {
    std::vector<size_t> counts(n);
    for (size_t r = 0; r < n; ++r) counts[r] = base + r % 3;
    size_t total = 0;
    for (size_t x : counts) total += x;
    const size_t mine = counts[static_cast<size_t>(c.rank())];
    std::vector<float> in(total), flat(mine), hier(mine);
    for (size_t i = 0; i < total; ++i) {
      in[i] = static_cast<float>(test::input_value(DType::f32, c.rank(), i));
    }
    c.reduce_scatterv(in.data(), flat.data(), counts, DType::f32, ReduceOp::sum, ring);
    c.reset_counters();
    c.reduce_scatterv(in.data(), hier.data(), counts, DType::f32, ReduceOp::sum);
    ASSERT_EQ(0, std::memcmp(flat.data(), hier.data(), mine * 4)) << "base " << base;
    CollectiveCost want =
        c.cost(Collective::reduce_scatterv, CommAlgorithm::hierarchical, 0, DType::f32, counts);
    CollectiveCounter got = c.counters().by_collective.at("reduce_scatterv");
    EXPECT_EQ(got.bytes_sent, want.bytes_sent);
    EXPECT_EQ(got.bytes_received, want.bytes_received);
    std::vector<float> gflat(total), ghier(total);
    c.all_gatherv(hier.data(), gflat.data(), counts, DType::f32, ring);
    c.reset_counters();
    c.all_gatherv(hier.data(), ghier.data(), counts, DType::f32);
    ASSERT_EQ(0, std::memcmp(gflat.data(), ghier.data(), total * 4)) << "base " << base;
    want = c.cost(Collective::all_gatherv, CommAlgorithm::hierarchical, 0, DType::f32, counts);
    got = c.counters().by_collective.at("all_gatherv");
    EXPECT_EQ(got.bytes_sent, want.bytes_sent);
    EXPECT_EQ(got.bytes_received, want.bytes_received);
  }
}

TEST(MpiCluster, HierarchicalEqualsFlatWithNodeSize2) {
  auto c = world(std::make_shared<ClusterLayout>(ClusterLayout::by_node_size(4, 2)));
  EXPECT_FALSE(c->has_shared_memory());  // the world spans the two (forced) nodes
  check_equal_to_flat(*c);
  check_rs_ag_equal_to_flat(*c);
}

TEST(MpiCluster, HierarchicalEqualsFlatOverEmulatedLinks) {
  auto layout = std::make_shared<ClusterLayout>(ClusterLayout::by_node_size(4, 2));
  layout->intra_node = {10e-6, 0};
  layout->inter_node = {100e-6, 0};
  layout->sharing = LinkSharing::node_pair;  // the node pairs' table shared by the processes
  auto c = world(layout);
  EXPECT_FALSE(c->has_native());
  check_equal_to_flat(*c);
  check_rs_ag_equal_to_flat(*c);
}

TEST(MpiCluster, OneHostBuildsNoHierarchy) {
  auto c = world(nullptr);
  EXPECT_FALSE(c->has_hierarchy());
  EXPECT_TRUE(c->has_shared_memory());
}

}  // namespace
}  // namespace mt
