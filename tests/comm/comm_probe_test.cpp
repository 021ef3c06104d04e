// comm/probe.h: the measured algorithm choice. An injected timing table
// picks the expected algorithm per size (margin, ranges, availability,
// group size); a live probe over local ranks gives every rank the same
// table and choice; with the choice installed, results equal the static
// choice's bit for bit (exact sums, gathers) and the byte counters equal
// the cost function of the algorithm that ran.
#include <cstring>
#include <limits>
#include <mutex>

#include <gtest/gtest.h>

#include "comm_test_util.h"
#include "meshtrain/base/error.h"
#include "meshtrain/comm/backends/local/local_world.h"
#include "meshtrain/comm/communicator.h"
#include "meshtrain/comm/probe.h"

namespace mt {
namespace {

using A = CommAlgorithm;
using comm::ProbeTable;

constexpr double kInf = std::numeric_limits<double>::infinity();

// One collective (all_gather), sizes 4 KiB, 64 KiB, 1 MiB, 16 MiB;
// candidates ring, halving_doubling, shared_memory, native.
ProbeTable gather_table(std::vector<std::array<double, 4>> rows) {
  ProbeTable t;
  t.collectives = {Collective::all_gather};
  t.sizes = {4096, 65536, size_t{1} << 20, size_t{16} << 20};
  t.candidates = {A::ring, A::halving_doubling, A::shared_memory, A::native};
  t.size = 2;
  t.shared_memory = true;
  t.native = true;
  for (const auto& r : rows) t.seconds.insert(t.seconds.end(), r.begin(), r.end());
  return t;
}

TEST(CommProbe, InjectedTableChoosesPerSize) {
  // Shared memory wins small, Open MPI's own (native) 64 KiB .. 1 MiB, ring at 16 MiB.
  const ProbeTable t = gather_table({{9e-6, 9e-6, 2e-6, 8e-6},
                                     {3e-5, 3e-5, 2e-5, 1e-5},
                                     {3e-4, 4e-4, 3e-4, 1e-4},
                                     {1e-3, 2e-3, 3e-3, 2.5e-3}});
  AlgorithmPolicy static_policy;
  const MeasuredChoice m = comm::choose_from_table(t, static_policy, 0.10);
  ASSERT_EQ(m.entries.size(), 1u);
  const auto& r = m.entries[0].ranges;
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[0].algorithm, A::shared_memory);
  EXPECT_EQ(r[0].max_bytes, 16384u);  // sqrt(4 KiB x 64 KiB)
  EXPECT_EQ(r[1].algorithm, A::native);
  EXPECT_EQ(r[1].max_bytes, size_t{4} << 20);  // sqrt(1 MiB x 16 MiB)
  EXPECT_EQ(r[2].algorithm, A::ring);

  // Through select_algorithm, the one place the choice is made.
  AlgorithmPolicy p;
  p.measured = std::make_shared<MeasuredChoice>(m);
  comm::GroupTopology topo;
  topo.size = 2;
  topo.shared_memory = true;
  topo.native = true;
  EXPECT_EQ(comm::select_algorithm(p, Collective::all_gather, 4096, topo), A::shared_memory);
  EXPECT_EQ(comm::select_algorithm(p, Collective::all_gather, 16384, topo), A::shared_memory);
  EXPECT_EQ(comm::select_algorithm(p, Collective::all_gather, 16385, topo), A::native);
  EXPECT_EQ(comm::select_algorithm(p, Collective::all_gatherv, 1 << 20, topo), A::native);
  EXPECT_EQ(comm::select_algorithm(p, Collective::split, 1 << 20, topo), A::native);
  EXPECT_EQ(comm::select_algorithm(p, Collective::all_gather, size_t{64} << 20, topo), A::ring);
  // Collectives the table has no entry for keep the static rules.
  EXPECT_EQ(comm::select_algorithm(p, Collective::all_reduce, size_t{64} << 20, topo),
            A::shared_memory);
  EXPECT_EQ(comm::select_algorithm(p, Collective::broadcast, 4096, topo), A::shared_memory);
  EXPECT_NE(m.describe().find("all_gather: shared_memory up to 16 KiB, native up to 4 MiB, ring "
                              "above"),
            std::string::npos)
      << m.describe();

  // Native where the engine cannot run the call: the static rules.
  comm::GroupTopology no_native = topo;
  no_native.native = false;
  EXPECT_EQ(comm::select_algorithm(p, Collective::all_gather, 1 << 20, no_native),
            A::shared_memory);
  // Another group size (a sub-communicator) or no shared window: not measured there.
  comm::GroupTopology four = topo;
  four.size = 4;
  EXPECT_EQ(comm::select_algorithm(p, Collective::all_gather, size_t{64} << 20, four),
            A::shared_memory);
  comm::GroupTopology no_shm = topo;
  no_shm.shared_memory = false;
  EXPECT_EQ(comm::select_algorithm(p, Collective::all_gather, size_t{64} << 20, no_shm), A::ring);
}

TEST(CommProbe, MarginKeepsTheStaticChoiceAgainstNoise) {
  // Native 5% faster than shared memory (the static choice): within the
  // margin, kept; 20% faster: taken. Infinity (could not run) never wins.
  const ProbeTable t = gather_table({{1e-5, 1e-5, 1e-5, 0.95e-5},
                                     {1e-4, 1e-4, 1e-4, 0.8e-4},
                                     {kInf, kInf, 1e-3, kInf},
                                     {kInf, kInf, kInf, kInf}});
  const MeasuredChoice m = comm::choose_from_table(t, AlgorithmPolicy{}, 0.10);
  const auto& r = m.entries[0].ranges;
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[0].algorithm, A::shared_memory);
  EXPECT_EQ(r[1].algorithm, A::native);
  EXPECT_EQ(r[2].algorithm, A::shared_memory);
  EXPECT_EQ(r[2].max_bytes, std::numeric_limits<size_t>::max());
  // With no margin the 5% wins.
  const MeasuredChoice m0 = comm::choose_from_table(t, AlgorithmPolicy{}, 0.0);
  EXPECT_EQ(m0.entries[0].ranges[0].algorithm, A::native);
}

TEST(CommProbe, TableOfTheWrongShapeIsAnError) {
  ProbeTable t = gather_table({{1, 1, 1, 1}});
  EXPECT_THROW(comm::choose_from_table(t, AlgorithmPolicy{}, 0.1), InternalError);
}

// Live probe over n local ranks; small sizes keep it quick.
void probe_world(int n) {
  LocalWorldOptions o;
  o.size = n;
  o.shm_bytes_per_rank = 64 * 1024;  // several shared-memory rounds at 256 KiB
  std::mutex mu;
  std::vector<std::vector<double>> tables;
  std::vector<std::string> choices;
  LocalWorld::run(o, [&](Communicator& c) {
    comm::ProbeOptions po;
    po.sizes = {4096, 256 * 1024};
    po.samples = 2;
    comm::ProbeTable table;
    std::shared_ptr<const MeasuredChoice> m = comm::probe_algorithms(c, po, &table);
    ASSERT_NE(m, nullptr);
    EXPECT_EQ(m->size, n);
    EXPECT_TRUE(m->shared_memory);
    ASSERT_EQ(m->entries.size(), 3u);
    for (double s : table.seconds) {
      EXPECT_TRUE(s > 0 && std::isfinite(s)) << s;  // every candidate ran (no native: local)
    }
    {
      std::lock_guard<std::mutex> lock(mu);
      tables.push_back(table.seconds);
      choices.push_back(m->describe());
    }
    // Bitwise equal to the static choice (exact sums; gathers copy), and the
    // counters equal the cost of the algorithm that ran.
    const size_t n_ranks = static_cast<size_t>(n);
    for (size_t count : {size_t{1000}, size_t{70'000}}) {
      const size_t total = count * n_ranks;
      std::vector<float> in(total), stat(total), meas(total);
      for (size_t i = 0; i < total; ++i) {
        in[i] = static_cast<float>(test::input_value(DType::f32, c.rank(), i));
      }
      c.set_measured_choice(nullptr);
      c.all_reduce(in.data(), stat.data(), total, DType::f32, ReduceOp::sum);
      c.set_measured_choice(m);
      c.reset_counters();
      c.all_reduce(in.data(), meas.data(), total, DType::f32, ReduceOp::sum);
      const A ar = c.choose_algorithm(Collective::all_reduce, total * 4);
      EXPECT_EQ(ar, m->lookup(Collective::all_reduce, total * 4));
      const CollectiveCost want = c.cost(Collective::all_reduce, ar, total, DType::f32);
      const CollectiveCounter got = c.counters().by_collective.at("all_reduce");
      EXPECT_EQ(got.bytes_sent, want.bytes_sent) << algorithm_name(ar);
      EXPECT_EQ(got.bytes_received, want.bytes_received) << algorithm_name(ar);
      ASSERT_EQ(0, std::memcmp(stat.data(), meas.data(), total * 4)) << "all_reduce " << total;

      c.set_measured_choice(nullptr);
      c.all_gather(in.data(), stat.data(), count, DType::f32);
      c.reduce_scatter(in.data(), stat.data() + count, count, DType::f32, ReduceOp::sum);
      c.set_measured_choice(m);
      c.all_gather(in.data(), meas.data(), count, DType::f32);
      c.reduce_scatter(in.data(), meas.data() + count, count, DType::f32, ReduceOp::sum);
      ASSERT_EQ(0, std::memcmp(stat.data(), meas.data(), total * 4)) << "gather/scatter " << count;
    }
  });
  ASSERT_EQ(tables.size(), static_cast<size_t>(n));
  for (int r = 1; r < n; ++r) {
    EXPECT_EQ(0, std::memcmp(tables[0].data(), tables[static_cast<size_t>(r)].data(),
                             tables[0].size() * sizeof(double)))
        << "rank " << r << "'s table";
    EXPECT_EQ(choices[0], choices[static_cast<size_t>(r)]);
  }
}

TEST(CommProbe, LocalRanksAgreeAndResultsMatchTheStaticChoice2) {
  probe_world(2);
}
TEST(CommProbe, LocalRanksAgreeAndResultsMatchTheStaticChoice4) {
  probe_world(4);
}

TEST(CommProbe, OneRankHasNothingToChoose) {
  LocalWorld::run(1, [](Communicator& c) { EXPECT_EQ(comm::probe_algorithms(c), nullptr); });
}

}  // namespace
}  // namespace mt
