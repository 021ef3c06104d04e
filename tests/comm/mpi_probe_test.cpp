// The measured algorithm choice under mpirun (2 and 4 ranks): the probe
// times every candidate, Open MPI's own collectives (native) included, and
// every rank ends with the same table and the same choice (checked by
// reducing the table with min and with max: equal bits on every rank);
// with the choice installed, results equal the static choice's bit for bit
// on exact sums, and the byte counters equal the cost of the algorithm that
// ran.
#include <cmath>
#include <cstring>

#include <gtest/gtest.h>

#include "comm_test_util.h"
#include "meshtrain/comm/backends/mpi/mpi_communicator.h"
#include "meshtrain/comm/probe.h"

namespace mt {
namespace {

TEST(MpiProbe, EveryRankDecidesTheSame) {
  CommOptions o;
  o.timeout = std::chrono::milliseconds(60'000);
  auto c = make_mpi_communicator(o);
  ASSERT_TRUE(c->has_native());
  comm::ProbeOptions po;
  po.sizes = {4096, 256 * 1024};
  po.samples = 2;
  comm::ProbeTable table;
  std::shared_ptr<const MeasuredChoice> m = comm::probe_algorithms(*c, po, &table);
  ASSERT_NE(m, nullptr);
  ASSERT_EQ(table.candidates.back(), CommAlgorithm::native);
  for (double s : table.seconds) EXPECT_TRUE(s > 0 && std::isfinite(s)) << s;
  std::vector<double> lo(table.seconds.size()), hi(table.seconds.size());
  c->all_reduce(table.seconds.data(), lo.data(), lo.size(), DType::f64, ReduceOp::min);
  c->all_reduce(table.seconds.data(), hi.data(), hi.size(), DType::f64, ReduceOp::max);
  EXPECT_EQ(0, std::memcmp(lo.data(), table.seconds.data(), lo.size() * sizeof(double)));
  EXPECT_EQ(0, std::memcmp(hi.data(), table.seconds.data(), hi.size() * sizeof(double)));
  // The decision itself: every size's algorithm, as one number per point.
  std::vector<double> picks;
  for (Collective k : po.collectives) {
    for (size_t b : {size_t{1024}, size_t{4096}, size_t{65536}, size_t{1} << 20}) {
      picks.push_back(static_cast<double>(m->lookup(k, b)));
    }
  }
  std::vector<double> plo(picks.size()), phi(picks.size());
  c->all_reduce(picks.data(), plo.data(), picks.size(), DType::f64, ReduceOp::min);
  c->all_reduce(picks.data(), phi.data(), picks.size(), DType::f64, ReduceOp::max);
  EXPECT_EQ(plo, picks) << m->describe();
  EXPECT_EQ(phi, picks) << m->describe();
  if (c->rank() == 0)
    std::printf("measured choice (%s): %s\n", m->source.c_str(), m->describe().c_str());

  const size_t n = static_cast<size_t>(c->size());
  for (size_t count : {size_t{1000}, size_t{70'000}}) {
    const size_t total = count * n;
    std::vector<float> in(total), stat(total), meas(total);
    for (size_t i = 0; i < total; ++i) {
      in[i] = static_cast<float>(test::input_value(DType::f32, c->rank(), i));
    }
    c->set_measured_choice(nullptr);
    c->all_reduce(in.data(), stat.data(), total, DType::f32, ReduceOp::sum);
    c->all_gather(in.data(), stat.data() + count, count / n, DType::f32);
    c->set_measured_choice(m);
    c->reset_counters();
    c->all_reduce(in.data(), meas.data(), total, DType::f32, ReduceOp::sum);
    const CommAlgorithm a = c->choose_algorithm(Collective::all_reduce, total * 4);
    if (a != CommAlgorithm::native) {  // the engine's own collective counts payload only
      const CollectiveCost want = c->cost(Collective::all_reduce, a, total, DType::f32);
      const CollectiveCounter got = c->counters().by_collective.at("all_reduce");
      EXPECT_EQ(got.bytes_sent, want.bytes_sent) << algorithm_name(a);
      EXPECT_EQ(got.bytes_received, want.bytes_received) << algorithm_name(a);
    }
    c->all_gather(in.data(), meas.data() + count, count / n, DType::f32);
    ASSERT_EQ(0, std::memcmp(stat.data(), meas.data(), total * 4)) << "count " << count;
  }
}

}  // namespace
}  // namespace mt
