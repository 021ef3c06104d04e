// Cross-mesh resharding (spmd/reshard.h) under mpirun (2 and 4 ranks): every
// pair of layouts of reshard_cases.h between the same, reversed, disjoint
// and overlapping rank sets, on a tensor large enough that Open MPI's
// shared-memory transport sends by rendezvous (36 KB whole, boxes above
// its 4 KB eager limit), so the non-blocking point-to-point calls queued in
// plan order are exercised where a send waits for its receiver. Every
// destination piece bitwise right, every rank's byte counter equal to the
// plan's bytes for it (whose total is the minimal count, checked on local
// ranks in reshard_test.cpp); a failure on any rank fails every rank.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/comm/backends/mpi/mpi_communicator.h"
#include "meshtrain/spmd/reshard.h"
#include "spmd/reshard_cases.h"

namespace mt {
namespace {

Communicator& world() {
  static std::unique_ptr<Communicator> comm = [] {
    CommOptions o;
    o.timeout = std::chrono::milliseconds(60'000);
    return make_mpi_communicator(o);
  }();
  return *comm;
}

TEST(ReshardMpi, EveryPairOfLayoutsIsExactAndSendsThePlansBytes) {
  const Shape shape({96, 96});
  const int n = world().size();
  int cases = 0;
  for (const std::vector<int>& src : test::rank_sets(n)) {
    for (const std::vector<int>& dst : test::rank_sets(n)) {
      for (const test::NamedLayout& fl : test::layouts(shape)) {
        for (const test::NamedLayout& tl : test::layouts(shape)) {
          if (tl.source_only) continue;
          const ReshardPlan plan = plan_reshard(shape, DType::f32, fl.make(src), tl.make(dst));
          const std::string wrong = test::run_reshard_on_rank(world(), shape, plan);
          double bad = wrong.empty() ? 0.0 : 1.0;
          world().all_reduce(&bad, &bad, 1, DType::f64, ReduceOp::sum);
          ASSERT_EQ(bad, 0.0) << fl.name << " on " << test::set_name(src) << " -> " << tl.name
                              << " on " << test::set_name(dst) << " (" << bad
                              << " ranks): " << wrong << "\n"
                              << plan.describe();
          ++cases;
        }
      }
    }
  }
  if (world().rank() == 0) std::printf("%d ranks: %d layout pairs\n", n, cases);
}

}  // namespace
}  // namespace mt

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  mt::world();  // initialise MPI before any test
  return RUN_ALL_TESTS();
}
