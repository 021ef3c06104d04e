// The mpi backend under mpirun (-np 2 and -np 4): every collective with every
// algorithm, the engine's own included, against closed-form values; byte
// counters against the stated costs and against the peers' counters; what
// `bench/run comm` times, with its settings; groups; the mismatch error on every rank;
// and (last, since it leaves its communicator unusable) a timeout that names
// the rank that never called.
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "comm_test_util.h"
#include "meshtrain/comm/backends/mpi/mpi_communicator.h"
#include "meshtrain/comm/backends/mpi/mpi_runtime.h"
#include "meshtrain/comm/launch_env.h"

namespace mt {
namespace {

using test::check_values;
using test::fill_input;
using test::input_value;
using test::make_buffer;
using test::reduced_value;
using ::testing::HasSubstr;

std::unique_ptr<Communicator> world(int timeout_ms = 60'000) {
  CommOptions o;
  o.timeout = std::chrono::milliseconds(timeout_ms);
  MpiOptions m;
  m.shm_bytes_per_rank = 64 * 1024;  // several rounds at moderate sizes
  return make_mpi_communicator(o, m);
}

CollectiveOptions with(CommAlgorithm a) {
  CollectiveOptions o;
  o.algorithm = a;
  return o;
}

std::string label(const Communicator& c, std::string_view coll, CommAlgorithm a, DType t,
                  size_t count) {
  return fmt::format("mpi rank {}/{} {} algorithm {} {} count {}", c.rank(), c.size(), coll,
                     algorithm_name(a), dtype_name(t), count);
}

const CommAlgorithm kReduceAlgos[] = {CommAlgorithm::automatic, CommAlgorithm::ring,
                                      CommAlgorithm::halving_doubling, CommAlgorithm::shared_memory,
                                      CommAlgorithm::native};

TEST(MpiComm, RankAndSizeAgreeWithTheLauncher) {
  auto c = world();
  const LaunchEnv env = read_launch_env();
  EXPECT_EQ(env.launcher, "openmpi");
  EXPECT_EQ(c->rank(), env.rank);
  EXPECT_EQ(c->size(), env.size);
  EXPECT_EQ(c->size(), MpiRuntime::instance().world_size());
  EXPECT_EQ(c->backend(), "mpi");
  EXPECT_TRUE(c->has_shared_memory());
  EXPECT_TRUE(c->has_native());
  EXPECT_TRUE(MpiRuntime::instance().thread_multiple());
}

TEST(MpiComm, AllReduceEveryAlgorithmDtypeAndOp) {
  auto c = world();
  const size_t n = static_cast<size_t>(c->size());
  for (CommAlgorithm a : kReduceAlgos) {
    for (DType t : {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i32, DType::i64}) {
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min}) {
        for (size_t count : {size_t{0}, size_t{1}, 7 * n + 1, size_t{70'001}}) {
          auto send = make_buffer(t, count);
          auto recv = make_buffer(t, count);
          fill_input(send, t, count, c->rank());
          c->all_reduce(send.data(), recv.data(), count, t, op, with(a));
          check_values(label(*c, "all_reduce", a, t, count) + " " + std::string(reduce_op_name(op)),
                       recv, t, count,
                       [&](size_t i) { return reduced_value(t, op, c->size(), i); });
        }
      }
    }
    const size_t big = size_t{1} << 20;
    auto buf = make_buffer(DType::f32, big);
    fill_input(buf, DType::f32, big, c->rank());
    c->all_reduce(buf.data(), buf.data(), big, DType::f32, ReduceOp::sum, with(a));
    check_values(label(*c, "all_reduce in place", a, DType::f32, big), buf, DType::f32, big,
                 [&](size_t i) { return reduced_value(DType::f32, ReduceOp::sum, c->size(), i); });
  }
}

TEST(MpiComm, GatherAndScatterEveryAlgorithm) {
  auto c = world();
  const int r = c->rank();
  const size_t n = static_cast<size_t>(c->size());
  for (CommAlgorithm a : kReduceAlgos) {
    for (size_t count : {size_t{0}, size_t{1}, size_t{5003}, size_t{300'000}}) {
      auto send = make_buffer(DType::f32, count);
      auto recv = make_buffer(DType::f32, count * n);
      fill_input(send, DType::f32, count, r);
      c->all_gather(send.data(), recv.data(), count, DType::f32, with(a));
      check_values(label(*c, "all_gather", a, DType::f32, count), recv, DType::f32, count * n,
                   [&](size_t i) {
                     return input_value(DType::f32, static_cast<int>(i / count), i % count);
                   });

      auto big = make_buffer(DType::bf16, count * n);
      auto part = make_buffer(DType::bf16, count);
      fill_input(big, DType::bf16, count * n, r);
      c->reduce_scatter(big.data(), part.data(), count, DType::bf16, ReduceOp::sum, with(a));
      check_values(label(*c, "reduce_scatter", a, DType::bf16, count), part, DType::bf16, count,
                   [&](size_t i) {
                     return reduced_value(DType::bf16, ReduceOp::sum, c->size(),
                                          static_cast<size_t>(r) * count + i);
                   });
    }
    std::vector<size_t> counts(n);
    for (size_t q = 0; q < n; ++q) counts[q] = (q * 7 + 3) % 11 * 997;
    std::vector<size_t> offsets(n + 1, 0);
    for (size_t q = 0; q < n; ++q) offsets[q + 1] = offsets[q] + counts[q];
    auto mine = make_buffer(DType::i64, counts[static_cast<size_t>(r)]);
    auto all = make_buffer(DType::i64, offsets[n]);
    fill_input(mine, DType::i64, counts[static_cast<size_t>(r)], r);
    c->all_gatherv(mine.data(), all.data(), counts, DType::i64, with(a));
    check_values(label(*c, "all_gatherv", a, DType::i64, offsets[n]), all, DType::i64, offsets[n],
                 [&](size_t i) {
                   const size_t q = static_cast<size_t>(
                       std::upper_bound(offsets.begin(), offsets.end(), i) - offsets.begin() - 1);
                   return input_value(DType::i64, static_cast<int>(q), i - offsets[q]);
                 });
    auto full = make_buffer(DType::f64, offsets[n]);
    auto own = make_buffer(DType::f64, counts[static_cast<size_t>(r)]);
    fill_input(full, DType::f64, offsets[n], r);
    c->reduce_scatterv(full.data(), own.data(), counts, DType::f64, ReduceOp::max, with(a));
    check_values(label(*c, "reduce_scatterv", a, DType::f64, counts[static_cast<size_t>(r)]), own,
                 DType::f64, counts[static_cast<size_t>(r)], [&](size_t i) {
                   return reduced_value(DType::f64, ReduceOp::max, c->size(),
                                        offsets[static_cast<size_t>(r)] + i);
                 });
  }
}

TEST(MpiComm, BroadcastAllToAllBarrierSendRecv) {
  auto c = world();
  const int r = c->rank();
  const size_t n = static_cast<size_t>(c->size());
  for (CommAlgorithm a :
       {CommAlgorithm::tree, CommAlgorithm::shared_memory, CommAlgorithm::native}) {
    for (int root : {0, c->size() - 1}) {
      for (size_t count : {size_t{0}, size_t{3}, size_t{200'001}}) {
        auto buf = make_buffer(DType::f32, count);
        fill_input(buf, DType::f32, count, r);
        c->broadcast(buf.data(), count, DType::f32, root, with(a));
        check_values(label(*c, "broadcast", a, DType::f32, count), buf, DType::f32, count,
                     [&](size_t i) { return input_value(DType::f32, root, i); });
      }
    }
  }
  for (CommAlgorithm a : {CommAlgorithm::pairwise, CommAlgorithm::native}) {
    const size_t count = 1001;
    auto send = make_buffer(DType::i32, count * n);
    auto recv = make_buffer(DType::i32, count * n);
    fill_input(send, DType::i32, count * n, r);
    c->all_to_all(send.data(), recv.data(), count, DType::i32, with(a));
    check_values(label(*c, "all_to_all", a, DType::i32, count), recv, DType::i32, count * n,
                 [&](size_t i) {
                   return input_value(DType::i32, static_cast<int>(i / count),
                                      static_cast<size_t>(r) * count + i % count);
                 });
  }
  for (CommAlgorithm a :
       {CommAlgorithm::dissemination, CommAlgorithm::shared_memory, CommAlgorithm::native}) {
    c->barrier(with(a));
  }
  // A ring of sends, received with a different tag order than sent.
  const int right = (r + 1) % c->size();
  const int left = (r + c->size() - 1) % c->size();
  auto a1 = make_buffer(DType::f64, 10), a2 = make_buffer(DType::f64, 20);
  fill_input(a1, DType::f64, 10, r, 0, 1);
  fill_input(a2, DType::f64, 20, r, 0, 2);
  CollectiveOptions t1, t2;
  t1.tag = 1;
  t2.tag = 2;
  CommHandle h1 = c->send_async(a1.data(), 10, DType::f64, right, t1);
  CommHandle h2 = c->send_async(a2.data(), 20, DType::f64, right, t2);
  auto b2 = make_buffer(DType::f64, 20), b1 = make_buffer(DType::f64, 10);
  c->recv(b2.data(), 20, DType::f64, left, t2);
  c->recv(b1.data(), 10, DType::f64, left, t1);
  h1.wait();
  h2.wait();
  check_values("recv tag 2", b2, DType::f64, 20,
               [&](size_t i) { return input_value(DType::f64, left, i, 2); });
  check_values("recv tag 1", b1, DType::f64, 10,
               [&](size_t i) { return input_value(DType::f64, left, i, 1); });
}

TEST(MpiComm, CountersMatchStatedCosts) {
  auto c = world();
  const size_t n = static_cast<size_t>(c->size());
  for (CommAlgorithm a :
       {CommAlgorithm::ring, CommAlgorithm::halving_doubling, CommAlgorithm::shared_memory}) {
    for (size_t count : {size_t{1}, size_t{4099}, size_t{250'000}}) {
      auto x = make_buffer(DType::f32, count * n), y = make_buffer(DType::f32, count * n);
      c->reset_counters();
      c->all_reduce(x.data(), y.data(), count, DType::f32, ReduceOp::sum, with(a));
      c->all_gather(x.data(), y.data(), count, DType::f32, with(a));
      c->reduce_scatter(x.data(), y.data(), count, DType::f32, ReduceOp::sum, with(a));
      const CommCounters got = c->counters();
      // Rank q's "sent to r" (counted where q wrote or sent) equals r's
      // "received from q" (counted where r read or received).
      std::vector<int64_t> sent(n), all(n * n);
      for (size_t q = 0; q < n; ++q) sent[q] = static_cast<int64_t>(got.by_peer[q].bytes_sent);
      c->all_gather(sent.data(), all.data(), n, DType::i64);
      for (size_t q = 0; q < n; ++q) {
        EXPECT_EQ(all[q * n + static_cast<size_t>(c->rank())],
                  static_cast<int64_t>(got.by_peer[q].bytes_received))
            << "bytes rank " << q << " sent to rank " << c->rank() << ", " << algorithm_name(a)
            << " count " << count;
      }
      for (Collective k :
           {Collective::all_reduce, Collective::all_gather, Collective::reduce_scatter}) {
        const CollectiveCost want = c->cost(k, a, count, DType::f32);
        const CollectiveCounter& have = got.by_collective.at(std::string(collective_name(k)));
        EXPECT_EQ(have.bytes_sent, want.bytes_sent)
            << collective_name(k) << " " << algorithm_name(a) << " count " << count;
        EXPECT_EQ(have.bytes_received, want.bytes_received)
            << collective_name(k) << " " << algorithm_name(a) << " count " << count;
      }
    }
  }
}

// What `bench/run comm` times, checked here with the same settings: the
// default shared window (comm_bench's MpiOptions unless --shm-bytes), the
// automatic algorithm, f32, its sizes 4 KiB .. 64 MiB (powers of 4) laid out
// as comm_bench lays them out; one call of each collective per size, exact.
TEST(MpiComm, BenchmarkSizesWithTheDefaultWindow) {
  CommOptions o;
  o.timeout = std::chrono::milliseconds(120'000);
  auto c = make_mpi_communicator(o, MpiOptions{});
  const int r = c->rank();
  const size_t n = static_cast<size_t>(c->size());
  const size_t max_count = (size_t{64} << 20) / 4;
  auto in = make_buffer(DType::f32, max_count);
  auto out = make_buffer(DType::f32, max_count);
  fill_input(in, DType::f32, max_count, r);
  const CommAlgorithm a = CommAlgorithm::automatic;
  for (size_t count = 1024; count <= max_count; count *= 4) {
    const size_t block = count / n;
    c->all_reduce(in.data(), out.data(), count, DType::f32, ReduceOp::sum);
    check_values(
        label(*c, "all_reduce", a, DType::f32, count), out, DType::f32, count,
        [&](size_t i) { return reduced_value(DType::f32, ReduceOp::sum, c->size(), i); }, 0);
    c->all_gather(in.data(), out.data(), block, DType::f32);
    check_values(
        label(*c, "all_gather", a, DType::f32, block), out, DType::f32, block * n,
        [&](size_t i) { return input_value(DType::f32, static_cast<int>(i / block), i % block); },
        0);
    c->reduce_scatter(in.data(), out.data(), block, DType::f32, ReduceOp::sum);
    check_values(
        label(*c, "reduce_scatter", a, DType::f32, block), out, DType::f32, block,
        [&](size_t i) {
          return reduced_value(DType::f32, ReduceOp::sum, c->size(),
                               static_cast<size_t>(r) * block + i);
        },
        0);
  }
}

TEST(MpiComm, GroupsAndAsync) {
  auto c = world();
  const int r = c->rank();
  auto half = c->split(r % 2, r);
  ASSERT_NE(half, nullptr);
  Tensor t = Tensor::full(Shape{1000}, DType::f32, r);
  CommHandle h = half->all_reduce_async(t);
  Tensor u = Tensor::full(Shape{10}, DType::i64, 1);
  c->all_reduce(u);  // the parent runs while the child's call is in flight
  h.wait(std::chrono::milliseconds(60'000));
  float want = 0;
  for (int q = r % 2; q < c->size(); q += 2) want += static_cast<float>(q);
  EXPECT_EQ(t.item(999), want);
  EXPECT_EQ(u.item(0), c->size());
  EXPECT_EQ(half->has_shared_memory(), true);
  std::vector<int> first = {0};
  auto solo = c->subgroup(first);
  EXPECT_EQ(solo != nullptr, r == 0);
  if (solo) {
    EXPECT_EQ(solo->size(), 1);
    solo->barrier();
  }
}

TEST(MpiComm, MismatchRaisesTheSameErrorOnEveryRank) {
  auto c = world();
  std::vector<float> buf(100, 1.0f);
  std::string message;
  try {
    c->all_reduce(buf.data(), buf.data(), c->rank() == 1 ? 99 : 100, DType::f32);
  } catch (const MismatchError& e) {
    message = e.what();
  }
  EXPECT_THAT(message, HasSubstr("rank 1 called all_reduce #1 (f32 x 99, sum"));
  // Every rank caught it (and the communicator still works): min over ranks.
  int32_t caught = message.empty() ? 0 : 1;
  c->all_reduce(&caught, &caught, 1, DType::i32, ReduceOp::min);
  EXPECT_EQ(caught, 1);
  // The same message on every rank: compare hashes.
  int64_t h = static_cast<int64_t>(std::hash<std::string>{}(message) >> 1);
  int64_t lo = h, hi = h;
  c->all_reduce(&lo, &lo, 1, DType::i64, ReduceOp::min);
  c->all_reduce(&hi, &hi, 1, DType::i64, ReduceOp::max);
  EXPECT_EQ(lo, hi);
}

// A rank that reaches a communicator's teardown long before the others
// gives up freeing its shared window; the late ones must then give up too
// rather than wait in MPI_Win_free for it (the parameter server's hang at
// exit: servers finish while the workers still evaluate).
TEST(MpiComm, TeardownWithOneRankFarAheadEndsOnEveryRank) {
  auto w = world();
  CommOptions o;
  MpiOptions m;
  m.shm_bytes_per_rank = 64 * 1024;
  m.teardown_timeout = std::chrono::milliseconds(200);
  auto c = make_mpi_communicator(o, m);
  if (c->rank() != 0) std::this_thread::sleep_for(std::chrono::milliseconds(700));
  c.reset();
  w->barrier();  // every rank is out of the destructor
}

// Last: the communicators it times out on become unusable.
TEST(MpiComm, TimeoutNamesTheRankThatNeverCalls) {
  for (bool shm : {true, false}) {
    CommOptions o;
    o.timeout = std::chrono::milliseconds(500);
    MpiOptions m;
    m.shared_memory = shm;
    auto c = make_mpi_communicator(o, m);
    const int absent = c->size() - 1;
    if (c->rank() == absent) {
      // Stay alive past the others' deadline, without calling.
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));
      continue;
    }
    std::vector<float> buf(256, 1.0f);
    try {
      c->all_reduce(buf.data(), buf.data(), buf.size(), DType::f32);
      ADD_FAILURE() << "no timeout";
    } catch (const TimeoutError& e) {
      const std::string m2 = e.what();
      EXPECT_THAT(m2, HasSubstr("all_reduce #1 (f32 x 256 = 1024 bytes"));
      EXPECT_THAT(m2, HasSubstr("timed out after 0.500 s"));
      if (shm) {
        EXPECT_THAT(m2, HasSubstr(fmt::format("ranks that have not entered all_reduce #1: rank {}",
                                              absent)));
      } else {
        EXPECT_THAT(m2, HasSubstr(fmt::format("from rank {}", absent)));
      }
    }
  }
}

}  // namespace
}  // namespace mt
