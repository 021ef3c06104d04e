// Each algorithm's stated cost (algorithms.h) against what the communicator's
// counters saw, per rank, over world sizes 1..8 and uneven sizes; and the
// stated costs against the textbook formulas where those are exact.
#include <numeric>

#include <gtest/gtest.h>

#include "meshtrain/comm/algorithms.h"
#include "meshtrain/comm/backends/local/local_world.h"
#include "meshtrain/comm/communicator.h"
#include "meshtrain/comm/reduce.h"

namespace mt {
namespace {

struct Case {
  Collective kind;
  CommAlgorithm algorithm;
};

// Checks the collective's counter and the per-peer totals against `want`
// (the handshake's bytes count separately), and that the per-peer books of
// all ranks agree: what rank r counted as sent to q (where r wrote or sent
// it) is what q counted as received from r (where q read or received it).
void expect_counted(Communicator& c, const std::string& key, const CollectiveCost& want,
                    const std::string& what) {
  const CommCounters got = c.counters();
  const size_t n = static_cast<size_t>(c.size());
  std::vector<int64_t> mine(2 * n), all(2 * n * n);
  for (size_t q = 0; q < n; ++q) {
    mine[2 * q] = static_cast<int64_t>(got.by_peer[q].bytes_sent);
    mine[2 * q + 1] = static_cast<int64_t>(got.by_peer[q].bytes_received);
  }
  c.all_gather(mine.data(), all.data(), 2 * n, DType::i64);
  for (size_t r = 0; r < n; ++r) {
    for (size_t q = 0; q < n; ++q) {
      const int64_t sent = all[r * 2 * n + 2 * q], received = all[q * 2 * n + 2 * r + 1];
      if (sent != received) {
        throw std::runtime_error(
            fmt::format("{} ({} ranks): rank {} counted {} bytes sent to rank {}, which counted "
                        "{} bytes received from it",
                        what, n, r, sent, q, received));
      }
    }
  }
  const auto it = got.by_collective.find(key);
  const CollectiveCounter counted =
      it == got.by_collective.end() ? CollectiveCounter{} : it->second;
  if (counted.bytes_sent != want.bytes_sent || counted.bytes_received != want.bytes_received) {
    throw std::runtime_error(fmt::format(
        "rank {}/{} {}: counters say {} bytes sent / {} received, the cost function {} / {}",
        c.rank(), c.size(), what, counted.bytes_sent, counted.bytes_received, want.bytes_sent,
        want.bytes_received));
  }
  const auto hs = got.by_collective.find("handshake");
  const uint64_t hs_sent = hs == got.by_collective.end() ? 0 : hs->second.bytes_sent;
  const uint64_t hs_recv = hs == got.by_collective.end() ? 0 : hs->second.bytes_received;
  if (got.total_sent() != counted.bytes_sent + hs_sent ||
      got.total_received() != counted.bytes_received + hs_recv) {
    throw std::runtime_error(
        fmt::format("rank {} {}: per-peer totals {} / {} differ from the "
                    "per-collective ones",
                    c.rank(), what, got.total_sent(), got.total_received()));
  }
}

class CommCosts : public ::testing::TestWithParam<int> {};

TEST_P(CommCosts, CountersMatchStatedCosts) {
  LocalWorldOptions o;
  o.size = GetParam();
  o.shm_bytes_per_rank = 32 * 1024;  // several rounds for the larger sizes
  o.comm.timeout = std::chrono::milliseconds(30'000);
  LocalWorld::run(o, [&](Communicator& c) {
    const size_t n = static_cast<size_t>(c.size());
    using A = CommAlgorithm;
    for (size_t count : {size_t{0}, size_t{1}, size_t{1000}, size_t{100'003}}) {
      for (DType t : {DType::f32, DType::bf16}) {
        const size_t e = dtype_size(t);
        std::vector<std::byte> a(count * n * e + 1), b(count * n * e + 1);
        std::vector<size_t> uneven(n);
        for (size_t q = 0; q < n; ++q) uneven[q] = count / (q + 1) + q;
        const size_t uneven_total = std::accumulate(uneven.begin(), uneven.end(), size_t{0});
        std::vector<std::byte> va(uneven_total * e + 1), vb(uneven_total * e + 1);
        for (A alg : {A::ring, A::halving_doubling, A::shared_memory}) {
          CollectiveOptions opts;
          opts.algorithm = alg;
          const std::string tag =
              fmt::format("{} {} count {}", algorithm_name(alg), dtype_name(t), count);

          c.reset_counters();
          c.all_reduce(a.data(), b.data(), count, t, ReduceOp::sum, opts);
          expect_counted(c, "all_reduce", c.cost(Collective::all_reduce, alg, count, t),
                         "all_reduce " + tag);

          c.reset_counters();
          c.all_gather(a.data(), b.data(), count, t, opts);
          expect_counted(c, "all_gather", c.cost(Collective::all_gather, alg, count, t),
                         "all_gather " + tag);

          c.reset_counters();
          c.reduce_scatter(a.data(), b.data(), count, t, ReduceOp::sum, opts);
          expect_counted(c, "reduce_scatter", c.cost(Collective::reduce_scatter, alg, count, t),
                         "reduce_scatter " + tag);

          c.reset_counters();
          c.all_gatherv(va.data(), vb.data(), uneven, t, opts);
          expect_counted(c, "all_gatherv", c.cost(Collective::all_gatherv, alg, 0, t, uneven),
                         "all_gatherv " + tag);

          c.reset_counters();
          c.reduce_scatterv(va.data(), vb.data(), uneven, t, ReduceOp::max, opts);
          expect_counted(c, "reduce_scatterv",
                         c.cost(Collective::reduce_scatterv, alg, 0, t, uneven),
                         "reduce_scatterv " + tag);
        }
        for (A alg : {A::tree, A::shared_memory}) {
          CollectiveOptions opts;
          opts.algorithm = alg;
          const int root = c.size() - 1;
          c.reset_counters();
          c.broadcast(a.data(), count, t, root, opts);
          expect_counted(c, "broadcast", c.cost(Collective::broadcast, alg, count, t, {}, root),
                         fmt::format("broadcast {} count {}", algorithm_name(alg), count));
        }
        c.reset_counters();
        c.all_to_all(a.data(), b.data(), count, t);
        expect_counted(c, "all_to_all", c.cost(Collective::all_to_all, A::pairwise, count, t),
                       fmt::format("all_to_all count {}", count));
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, CommCosts, ::testing::Range(1, 9));

// The stated costs reproduce the known closed forms where blocks are equal.
TEST(CommCostFormulas, MatchTheTextbook) {
  for (int n = 1; n <= 8; ++n) {
    const uint64_t nn = static_cast<uint64_t>(n);
    const size_t count = 64 * 16 * static_cast<size_t>(n);  // divisible by n and by 16 n
    const uint64_t bytes = count * 4;
    for (int r = 0; r < n; ++r) {
      // Ring all-reduce: 2 (n-1)/n of the buffer each way, 2 (n-1) steps.
      const CollectiveCost ring = comm::ring_all_reduce_cost(n, r, count, 4);
      EXPECT_EQ(ring.bytes_sent, 2 * (nn - 1) * bytes / nn);
      EXPECT_EQ(ring.bytes_received, 2 * (nn - 1) * bytes / nn);
      EXPECT_EQ(ring.steps, 2 * (n - 1));
      // Shared memory: the same bytes per rank, read from the peers' slots.
      const CollectiveCost shm = comm::shm_all_reduce_cost(n, r, count, 4, size_t{1} << 20);
      EXPECT_EQ(shm.bytes_received, 2 * (nn - 1) * bytes / nn);
      // Halving-doubling on a power of two: also 2 (n-1)/n, in 2 log2 n steps.
      if ((n & (n - 1)) == 0) {
        const CollectiveCost hd = comm::hd_all_reduce_cost(n, r, count, 4);
        EXPECT_EQ(hd.bytes_sent, 2 * (nn - 1) * bytes / nn);
        int log2n = 0;
        while ((1 << log2n) < n) ++log2n;
        EXPECT_EQ(hd.steps, 2 * log2n);
        // The root of a binomial tree sends once per level.
        EXPECT_EQ(comm::tree_broadcast_cost(n, 0, bytes, 0).bytes_sent,
                  static_cast<uint64_t>(log2n) * bytes);
      }
      // Ring all-gather: (n-1) blocks each way.
      const std::vector<size_t> blocks(static_cast<size_t>(n), count / static_cast<size_t>(n));
      EXPECT_EQ(comm::ring_all_gatherv_cost(n, r, blocks, 4).bytes_received, (nn - 1) * bytes / nn);
    }
  }
}

// One rounding at the end: with f32 accumulation 256 + 1 + 1 is 258 in bf16,
// where bf16 arithmetic would stay at 256 (256 + 1 rounds to even, 256).
TEST(CommReduceKernels, SixteenBitFloatsAccumulateInF32) {
  const bf16 a[1] = {f32_to_bf16(256)};
  const bf16 one[1] = {f32_to_bf16(1)};
  bf16 out[1];
  const void* three[3] = {a, one, one};
  comm::reduce_sources(out, three, 3, 1, DType::bf16, ReduceOp::sum);
  EXPECT_EQ(bf16_to_f32(out[0]), 258.0f);
  comm::combine(out, a, one, 1, DType::bf16, ReduceOp::sum);
  EXPECT_EQ(bf16_to_f32(out[0]), 256.0f);
  // Avg divides before the single rounding.
  comm::reduce_sources(out, three, 3, 1, DType::bf16, ReduceOp::avg, 3);
  EXPECT_EQ(bf16_to_f32(out[0]), 86.0f);
  const f16 h[2] = {f32_to_f16(2048), f32_to_f16(1)};
  f16 hout[1];
  const void* hsrc[3] = {&h[0], &h[1], &h[1]};
  comm::reduce_sources(hout, hsrc, 3, 1, DType::f16, ReduceOp::sum);
  EXPECT_EQ(f16_to_f32(hout[0]), 2050.0f);
}

TEST(CommReduceKernels, IntegersWrapAndAverageTowardZero) {
  const int32_t big[2] = {2147483647, -7};
  const int32_t one[2] = {1, 0};
  int32_t out[2];
  comm::combine(out, big, one, 2, DType::i32, ReduceOp::sum);
  EXPECT_EQ(out[0], -2147483647 - 1);
  const int64_t x[1] = {-7}, y[1] = {0};
  int64_t avg[1];
  comm::combine(avg, x, y, 1, DType::i64, ReduceOp::avg, 2);
  EXPECT_EQ(avg[0], -3);
  const float f[3] = {1, -5, 3}, g[3] = {2, -6, 3};
  float m[3];
  comm::combine(m, f, g, 3, DType::f32, ReduceOp::max);
  EXPECT_EQ(m[1], -5);
  comm::combine(m, f, g, 3, DType::f32, ReduceOp::min);
  EXPECT_EQ(m[0], 1);
}

TEST(CommReduceKernels, SharedMemoryAllReduceOfBf16RoundsOnce) {
  LocalWorldOptions o;
  o.size = 3;
  LocalWorld::run(o, [&](Communicator& c) {
    Tensor t = Tensor::full(Shape{40}, DType::bf16, c.rank() == 0 ? 256 : 1);
    CollectiveOptions shm;
    shm.algorithm = CommAlgorithm::shared_memory;
    c.all_reduce(t, ReduceOp::sum, shm);
    for (int i = 0; i < 40; ++i) {
      if (t.item(i) != 258) throw std::runtime_error(fmt::format("element {} is {}", i, t.item(i)));
    }
  });
}

}  // namespace
}  // namespace mt
