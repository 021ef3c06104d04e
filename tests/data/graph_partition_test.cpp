// Graph partitioning (data/graph_partition.h): each method's balance and
// determinism, the locality-aware method's cut against random's, and the
// edge cut and halo sizes against hand counts.
#include <gtest/gtest.h>

#include <algorithm>

#include "meshtrain/base/error.h"
#include "meshtrain/data/graph_data.h"
#include "meshtrain/data/graph_partition.h"

namespace mt {
namespace {

PartitionOptions opts(PartitionMethod m, int64_t parts) {
  PartitionOptions o;
  o.method = m;
  o.parts = parts;
  return o;
}

GraphData csbm() {
  CsbmOptions o;
  o.vertices = 3001;  // not divisible by the part counts below
  o.classes = 4;
  o.avg_degree = 10;
  o.homophily = 0.9;
  return make_csbm(o);
}

TEST(Partition, ContiguousAndRandomAreExactlyBalancedAndSeeded) {
  const GraphData g = csbm();
  for (int64_t parts : {1, 2, 3, 7}) {
    const Partition c = partition_graph(g.adj, opts(PartitionMethod::contiguous, parts));
    const Partition r = partition_graph(g.adj, opts(PartitionMethod::random, parts));
    for (const Partition* p : {&c, &r}) {
      const std::vector<int64_t> s = p->sizes();
      EXPECT_LE(*std::max_element(s.begin(), s.end()) - *std::min_element(s.begin(), s.end()), 1)
          << parts << " parts";
    }
    EXPECT_TRUE(std::is_sorted(c.owner.begin(), c.owner.end()));
    if (parts > 1) {
      EXPECT_FALSE(std::is_sorted(r.owner.begin(), r.owner.end()));
      PartitionOptions o = opts(PartitionMethod::random, parts);
      EXPECT_EQ(partition_graph(g.adj, o).owner, r.owner);
      o.seed = 2;
      EXPECT_NE(partition_graph(g.adj, o).owner, r.owner);
    }
  }
}

TEST(Partition, LocalityCutsFarBelowRandomWithinTheBalanceBound) {
  const GraphData g = csbm();
  for (int64_t parts : {2, 4}) {
    PartitionOptions o = opts(PartitionMethod::locality, parts);
    o.imbalance = 0.05;
    const Partition l = partition_graph(g.adj, o);
    const PartitionStats ls = partition_stats(g.adj, l);
    const PartitionStats rs =
        partition_stats(g.adj, partition_graph(g.adj, opts(PartitionMethod::random, parts)));
    // Homophily 0.9 over 4 classes: a class-aligned split cuts about 10%
    // (2 parts: less), random cuts 1 - 1/parts.
    EXPECT_LT(ls.cut_fraction(), 0.5 * rs.cut_fraction())
        << parts << " parts: locality " << ls.cut_fraction() << " random " << rs.cut_fraction();
    EXPECT_LT(ls.halo_total(), rs.halo_total());
    const int64_t cap = (3001 * 105 + parts * 100 - 1) / (parts * 100);
    for (int64_t v : ls.vertices) {
      EXPECT_LE(v, cap) << parts << " parts";
      EXPECT_GE(v, 1);
    }
    EXPECT_EQ(partition_graph(g.adj, o).owner, l.owner);  // deterministic
  }
}

TEST(PartitionStats, EdgeCutAndHalosMatchHandCounts) {
  // Path 0 - 1 - 2 - 3 - 4 (undirected), a self-loop on 2, and 0 - 4.
  const Csr a = simple_undirected(5, {{0, 1}, {1, 2}, {2, 3}, {3, 4}, {0, 4}});
  Partition p;
  p.parts = 2;
  p.owner = {0, 0, 1, 1, 1};
  const PartitionStats s = partition_stats(a, p);
  EXPECT_EQ(s.entries, 10);
  // Cut edges 1-2 and 0-4, both ways.
  EXPECT_EQ(s.cut_entries, 4);
  // Part 0 (rows 0, 1) reads 4 and 2 from part 1; part 1 reads 1 and 0.
  EXPECT_EQ(s.halo_of(0, 1), 2);
  EXPECT_EQ(s.halo_of(1, 0), 2);
  EXPECT_EQ(s.halo_of(0, 0), 0);
  EXPECT_EQ(s.halo_in(0), 2);
  EXPECT_EQ(s.halo_out(1), 2);
  EXPECT_EQ(s.vertices, (std::vector<int64_t>{2, 3}));
  // A vertex two rows of one part read is one halo row.
  p.owner = {0, 1, 0, 1, 1};
  const PartitionStats t = partition_stats(a, p);
  EXPECT_EQ(t.halo_of(0, 1), 3);  // 0 reads 1 and 4, 2 reads 1 and 3: {1, 3, 4}
  EXPECT_EQ(t.halo_of(1, 0), 2);  // 1 reads 0 and 2, 3 reads 2, 4 reads 0: {0, 2}
  EXPECT_NE(s.describe().find("edge cut: 4 of 10"), std::string::npos) << s.describe();
}

TEST(Partition, MorePartsThanVerticesIsAClearError) {
  const Csr a = simple_undirected(3, {{0, 1}, {1, 2}});
  try {
    partition_graph(a, opts(PartitionMethod::locality, 4));
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "4 parts (dist.nproc / gnn.replication) for a graph of 3 vertices"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(parse_partition_method("metis"), ConfigError);
  EXPECT_EQ(partition_graph(a, opts(PartitionMethod::locality, 3)).sizes(),
            (std::vector<int64_t>{1, 1, 1}));
}

}  // namespace
}  // namespace mt
