// Every collective, every algorithm, over local worlds of 1..8 ranks (with
// and without the shared-memory arena), buffer sizes 0, 1, not divisible by
// the world size and large, all dtypes and reduce ops; results are checked
// against closed-form values computed from the inputs' formula.
#include <atomic>
#include <numeric>
#include <tuple>

#include <gtest/gtest.h>

#include "comm_test_util.h"
#include "meshtrain/comm/backends/local/local_world.h"
#include "meshtrain/comm/communicator.h"

namespace mt {
namespace {

using test::check_values;
using test::fill_input;
using test::input_value;
using test::make_buffer;
using test::reduced_value;

class CommGrid : public ::testing::TestWithParam<std::tuple<int, bool>> {
 protected:
  int n() const { return std::get<0>(GetParam()); }
  bool shm() const { return std::get<1>(GetParam()); }

  LocalWorldOptions world() const {
    LocalWorldOptions o;
    o.size = n();
    o.comm.timeout = std::chrono::milliseconds(30'000);
    // A small arena makes the shared-memory algorithms run many rounds.
    o.shm_bytes_per_rank = shm() ? 64 * 1024 : 0;
    // Odd worlds with an arena skip the handshake: the shared-memory
    // algorithms then publish their first round themselves instead of
    // staging it under the handshake's flag.
    o.comm.handshake = !(shm() && n() % 2 == 1);
    return o;
  }

  std::vector<CommAlgorithm> reduction_algorithms() const {
    std::vector<CommAlgorithm> a = {CommAlgorithm::automatic, CommAlgorithm::ring,
                                    CommAlgorithm::halving_doubling};
    if (shm()) a.push_back(CommAlgorithm::shared_memory);
    return a;
  }

  // 0, 1, not divisible by n (n > 1), moderately sized.
  std::vector<size_t> small_counts() const {
    return {0, 1, 7 * static_cast<size_t>(n()) + 1, 1000};
  }
};

std::string label(const Communicator& c, std::string_view coll, CommAlgorithm a, DType t,
                  size_t count, std::string_view extra = "") {
  return fmt::format("rank {}/{} {} algorithm {} {} count {}{}", c.rank(), c.size(), coll,
                     algorithm_name(a), dtype_name(t), count, extra);
}

CollectiveOptions with(CommAlgorithm a) {
  CollectiveOptions o;
  o.algorithm = a;
  return o;
}

constexpr DType kAllDtypes[] = {DType::f32, DType::f64, DType::bf16,
                                DType::f16, DType::i32, DType::i64};
constexpr ReduceOp kAllOps[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min};
constexpr size_t kLarge = size_t{1} << 20;

TEST_P(CommGrid, AllReduce) {
  LocalWorld::run(world(), [&](Communicator& c) {
    const int r = c.rank();
    for (CommAlgorithm a : reduction_algorithms()) {
      for (DType t : kAllDtypes) {
        for (ReduceOp op : kAllOps) {
          for (size_t count : small_counts()) {
            const bool in_place = (count + static_cast<size_t>(op)) % 2 == 0;
            auto send = make_buffer(t, count);
            auto recv = make_buffer(t, count);
            fill_input(send, t, count, r);
            c.all_reduce(send.data(), in_place ? send.data() : recv.data(), count, t, op, with(a));
            check_values(
                label(c, "all_reduce", a, t, count,
                      fmt::format(" op {}{}", reduce_op_name(op), in_place ? " in place" : "")),
                in_place ? send : recv, t, count,
                [&](size_t i) { return reduced_value(t, op, c.size(), i); });
          }
        }
      }
      auto big = make_buffer(DType::f32, kLarge);
      fill_input(big, DType::f32, kLarge, r);
      c.all_reduce(big.data(), big.data(), kLarge, DType::f32, ReduceOp::sum, with(a));
      check_values(label(c, "all_reduce", a, DType::f32, kLarge), big, DType::f32, kLarge,
                   [&](size_t i) { return reduced_value(DType::f32, ReduceOp::sum, c.size(), i); });
    }
  });
}

TEST_P(CommGrid, AllGatherAndAllGatherv) {
  LocalWorld::run(world(), [&](Communicator& c) {
    const int r = c.rank();
    const size_t nr = static_cast<size_t>(c.size());
    for (CommAlgorithm a : reduction_algorithms()) {
      for (DType t : {DType::f32, DType::bf16, DType::i64}) {
        std::vector<size_t> per_rank = small_counts();
        per_rank.push_back(kLarge / nr + 1);
        for (size_t count : per_rank) {
          auto send = make_buffer(t, count);
          auto recv = make_buffer(t, count * nr);
          fill_input(send, t, count, r);
          c.all_gather(send.data(), recv.data(), count, t, with(a));
          check_values(label(c, "all_gather", a, t, count), recv, t, count * nr, [&](size_t i) {
            return input_value(t, static_cast<int>(i / count), i % count);
          });
        }
        // Uneven blocks, some empty: rank q contributes (q * 7 + 3) % 11 elements.
        for (size_t scale : {size_t{1}, size_t{4099}}) {
          std::vector<size_t> counts(nr);
          for (size_t q = 0; q < nr; ++q) counts[q] = (q * 7 + 3) % 11 * scale;
          const size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
          std::vector<size_t> offsets(nr + 1, 0);
          for (size_t q = 0; q < nr; ++q) offsets[q + 1] = offsets[q] + counts[q];
          auto send = make_buffer(t, counts[static_cast<size_t>(r)]);
          auto recv = make_buffer(t, total);
          fill_input(send, t, counts[static_cast<size_t>(r)], r);
          c.all_gatherv(send.data(), recv.data(), counts, t, with(a));
          check_values(label(c, "all_gatherv", a, t, total), recv, t, total, [&](size_t i) {
            const size_t q = static_cast<size_t>(
                std::upper_bound(offsets.begin(), offsets.end(), i) - offsets.begin() - 1);
            return input_value(t, static_cast<int>(q), i - offsets[q]);
          });
        }
      }
    }
  });
}

TEST_P(CommGrid, ReduceScatterAndReduceScatterv) {
  LocalWorld::run(world(), [&](Communicator& c) {
    const int r = c.rank();
    const size_t nr = static_cast<size_t>(c.size());
    for (CommAlgorithm a : reduction_algorithms()) {
      for (DType t : kAllDtypes) {
        for (ReduceOp op : kAllOps) {
          for (size_t count : {size_t{0}, size_t{1}, size_t{13}}) {
            auto send = make_buffer(t, count * nr);
            auto recv = make_buffer(t, count);
            fill_input(send, t, count * nr, r);
            c.reduce_scatter(send.data(), recv.data(), count, t, op, with(a));
            check_values(
                label(c, "reduce_scatter", a, t, count, fmt::format(" op {}", reduce_op_name(op))),
                recv, t, count, [&](size_t i) {
                  return reduced_value(t, op, c.size(), static_cast<size_t>(r) * count + i);
                });
          }
        }
      }
      const size_t big = kLarge / nr + 3;
      auto send = make_buffer(DType::f32, big * nr);
      auto recv = make_buffer(DType::f32, big);
      fill_input(send, DType::f32, big * nr, r);
      c.reduce_scatter(send.data(), recv.data(), big, DType::f32, ReduceOp::sum, with(a));
      check_values(label(c, "reduce_scatter", a, DType::f32, big), recv, DType::f32, big,
                   [&](size_t i) {
                     return reduced_value(DType::f32, ReduceOp::sum, c.size(),
                                          static_cast<size_t>(r) * big + i);
                   });
      for (DType t : {DType::f32, DType::bf16, DType::i32}) {
        std::vector<size_t> counts(nr);
        for (size_t q = 0; q < nr; ++q) counts[q] = (q * 5 + 2) % 7 * 301;
        std::vector<size_t> offsets(nr + 1, 0);
        for (size_t q = 0; q < nr; ++q) offsets[q + 1] = offsets[q] + counts[q];
        auto vsend = make_buffer(t, offsets[nr]);
        auto vrecv = make_buffer(t, counts[static_cast<size_t>(r)]);
        fill_input(vsend, t, offsets[nr], r);
        c.reduce_scatterv(vsend.data(), vrecv.data(), counts, t, ReduceOp::sum, with(a));
        check_values(label(c, "reduce_scatterv", a, t, counts[static_cast<size_t>(r)]), vrecv, t,
                     counts[static_cast<size_t>(r)], [&](size_t i) {
                       return reduced_value(t, ReduceOp::sum, c.size(),
                                            offsets[static_cast<size_t>(r)] + i);
                     });
      }
    }
  });
}

TEST_P(CommGrid, Broadcast) {
  LocalWorld::run(world(), [&](Communicator& c) {
    std::vector<CommAlgorithm> algos = {CommAlgorithm::automatic, CommAlgorithm::tree};
    if (shm()) algos.push_back(CommAlgorithm::shared_memory);
    for (CommAlgorithm a : algos) {
      for (int root : {0, c.size() - 1, c.size() / 2}) {
        for (size_t count : {size_t{0}, size_t{1}, size_t{1001}, root == 0 ? kLarge : 7}) {
          auto buf = make_buffer(DType::f32, count);
          fill_input(buf, DType::f32, count, c.rank());
          c.broadcast(buf.data(), count, DType::f32, root, with(a));
          check_values(label(c, "broadcast", a, DType::f32, count, fmt::format(" root {}", root)),
                       buf, DType::f32, count,
                       [&](size_t i) { return input_value(DType::f32, root, i); });
        }
      }
    }
  });
}

TEST_P(CommGrid, AllToAllAndAllToAllv) {
  LocalWorld::run(world(), [&](Communicator& c) {
    const int r = c.rank();
    const size_t nr = static_cast<size_t>(c.size());
    for (size_t count : {size_t{0}, size_t{1}, size_t{257}}) {
      // Block q of rank r's input: values with salt r so the receiver can tell.
      auto send = make_buffer(DType::i32, count * nr);
      auto recv = make_buffer(DType::i32, count * nr);
      fill_input(send, DType::i32, count * nr, r);
      c.all_to_all(send.data(), recv.data(), count, DType::i32);
      check_values(label(c, "all_to_all", CommAlgorithm::pairwise, DType::i32, count), recv,
                   DType::i32, count * nr, [&](size_t i) {
                     const size_t q = i / count;
                     return input_value(DType::i32, static_cast<int>(q),
                                        static_cast<size_t>(r) * count + i % count);
                   });
    }
    // Rank s sends (s + q) % 4 * 3 elements to rank q.
    auto amount = [](size_t s, size_t q) { return (s + q) % 4 * 3; };
    std::vector<size_t> sc(nr), rc(nr);
    for (size_t q = 0; q < nr; ++q) {
      sc[q] = amount(static_cast<size_t>(r), q);
      rc[q] = amount(q, static_cast<size_t>(r));
    }
    const size_t stotal = std::accumulate(sc.begin(), sc.end(), size_t{0});
    const size_t rtotal = std::accumulate(rc.begin(), rc.end(), size_t{0});
    auto send = make_buffer(DType::f64, stotal);
    auto recv = make_buffer(DType::f64, rtotal);
    // Element j of the block for rank q is input_value(f64, r, q * 100 + j).
    {
      Tensor v = Tensor::wrap(send.data(), Shape{static_cast<int64_t>(stotal)}, DType::f64);
      size_t k = 0;
      for (size_t q = 0; q < nr; ++q) {
        for (size_t j = 0; j < sc[q]; ++j) {
          v.set_item(static_cast<int64_t>(k++), input_value(DType::f64, r, q * 100 + j));
        }
      }
    }
    c.all_to_allv(send.data(), sc, recv.data(), rc, DType::f64);
    std::vector<std::pair<size_t, size_t>> origin;  // (sender, j) per received element
    for (size_t q = 0; q < nr; ++q) {
      for (size_t j = 0; j < rc[q]; ++j) origin.emplace_back(q, j);
    }
    check_values(label(c, "all_to_allv", CommAlgorithm::pairwise, DType::f64, rtotal), recv,
                 DType::f64, rtotal, [&](size_t i) {
                   return input_value(DType::f64, static_cast<int>(origin[i].first),
                                      static_cast<size_t>(r) * 100 + origin[i].second);
                 });
  });
}

TEST_P(CommGrid, BarrierOrdersEveryRank) {
  std::atomic<int> arrived{0};
  std::atomic<int> wrong{0};
  LocalWorld::run(world(), [&](Communicator& c) {
    std::vector<CommAlgorithm> algos = {CommAlgorithm::automatic, CommAlgorithm::dissemination};
    if (shm()) algos.push_back(CommAlgorithm::shared_memory);
    for (size_t round = 0; round < algos.size(); ++round) {
      arrived.fetch_add(1);
      c.barrier(with(algos[round]));
      if (arrived.load() < static_cast<int>(round + 1) * c.size()) wrong.fetch_add(1);
      c.barrier(with(algos[round]));  // nobody starts the next round early
    }
  });
  EXPECT_EQ(wrong.load(), 0);
}

TEST_P(CommGrid, SendRecvMatchesByPeerAndTag) {
  LocalWorld::run(world(), [&](Communicator& c) {
    if (c.size() == 1) return;
    const int r = c.rank();
    const int right = (r + 1) % c.size();
    const int left = (r + c.size() - 1) % c.size();
    auto a = make_buffer(DType::f32, 100);
    auto b = make_buffer(DType::f32, 3);
    fill_input(a, DType::f32, 100, r, 0, 1);
    fill_input(b, DType::f32, 3, r, 0, 2);
    CollectiveOptions tag1, tag2;
    tag1.tag = 1;
    tag2.tag = 2;
    CommHandle h1 = c.send_async(a.data(), 100, DType::f32, right, tag1);
    CommHandle h2 = c.send_async(b.data(), 3, DType::f32, right, tag2);
    // Receive in the other order: matching is by tag, not arrival.
    auto got_b = make_buffer(DType::f32, 3);
    auto got_a = make_buffer(DType::f32, 100);
    c.recv(got_b.data(), 3, DType::f32, left, tag2);
    c.recv(got_a.data(), 100, DType::f32, left, tag1);
    h1.wait();
    h2.wait();
    check_values("recv tag 2", got_b, DType::f32, 3,
                 [&](size_t i) { return input_value(DType::f32, left, i, 2); });
    check_values("recv tag 1", got_a, DType::f32, 100,
                 [&](size_t i) { return input_value(DType::f32, left, i, 1); });
  });
}

TEST_P(CommGrid, AsyncCallsCompleteInIssueOrder) {
  LocalWorld::run(world(), [&](Communicator& c) {
    const int r = c.rank();
    const size_t count = 4097;
    std::vector<std::vector<std::byte>> bufs;
    std::vector<CommHandle> handles;
    for (int k = 0; k < 6; ++k) {
      bufs.push_back(make_buffer(DType::f32, count));
      fill_input(bufs.back(), DType::f32, count, r, 0, static_cast<size_t>(k));
    }
    for (int k = 0; k < 6; ++k) {
      handles.push_back(c.all_reduce_async(bufs[static_cast<size_t>(k)].data(),
                                           bufs[static_cast<size_t>(k)].data(), count, DType::f32,
                                           ReduceOp::sum));
    }
    // A blocking call queues behind the async ones.
    Tensor t = Tensor::full(Shape{3}, DType::f64, r + 1);
    c.all_reduce(t, ReduceOp::max);
    for (auto& h : handles) h.wait(std::chrono::milliseconds(30'000));
    for (int k = 0; k < 6; ++k) {
      check_values(fmt::format("rank {} async all_reduce {}", r, k), bufs[static_cast<size_t>(k)],
                   DType::f32, count, [&](size_t i) {
                     return reduced_value(DType::f32, ReduceOp::sum, c.size(), i,
                                          static_cast<size_t>(k));
                   });
    }
    EXPECT_EQ(t.item(2), c.size());
    Tensor in = Tensor::full(Shape{2}, DType::i64, r);
    Tensor out = Tensor::zeros(Shape{2 * c.size()}, DType::i64);
    c.all_gather_async(in, out).wait();
    for (int q = 0; q < c.size(); ++q) EXPECT_EQ(out.item(2 * q + 1), q);
  });
}

TEST_P(CommGrid, SplitAndSubgroupFormIndependentGroups) {
  LocalWorld::run(world(), [&](Communicator& c) {
    const int r = c.rank();
    // Odd and even ranks, each ordered from the highest world rank down.
    auto half = c.split(r % 2, -r);
    ASSERT_NE(half, nullptr);
    const int members = (c.size() + (r % 2 == 0 ? 1 : 0)) / 2;
    ASSERT_EQ(half->size(), members);
    int above = 0;  // same-parity ranks above r come first
    for (int q = r + 2; q < c.size(); q += 2) ++above;
    EXPECT_EQ(half->rank(), above);
    Tensor t = Tensor::full(Shape{5}, DType::i64, r);
    half->all_reduce(t, ReduceOp::sum);
    int64_t want = 0;
    for (int q = r % 2; q < c.size(); q += 2) want += q;
    EXPECT_EQ(t.item(4), want);
    // The parent still works while a child exists, and children split again.
    Tensor u = Tensor::full(Shape{1}, DType::f32, 1);
    c.all_reduce(u);
    EXPECT_EQ(u.item(), c.size());
    auto quarter = half->split(half->rank() % 2, 0);
    ASSERT_NE(quarter, nullptr);
    quarter->barrier();
    // A subgroup of the last ranks, listed in reverse; the others get nullptr.
    std::vector<int> last;
    for (int q = c.size() - 1; q >= c.size() / 2; --q) last.push_back(q);
    auto sub = c.subgroup(last, "tail");
    const bool in = r >= c.size() / 2;
    ASSERT_EQ(sub != nullptr, in);
    if (sub) {
      EXPECT_EQ(sub->rank(), c.size() - 1 - r);
      EXPECT_EQ(sub->name(), "tail");
      Tensor v = Tensor::full(Shape{1}, DType::i32, r);
      sub->broadcast(v, 0);
      EXPECT_EQ(v.item(), c.size() - 1);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, CommGrid,
                         ::testing::Combine(::testing::Range(1, 9), ::testing::Bool()),
                         [](const ::testing::TestParamInfo<std::tuple<int, bool>>& p) {
                           return fmt::format("n{}_{}", std::get<0>(p.param),
                                              std::get<1>(p.param) ? "shm" : "noshm");
                         });

}  // namespace
}  // namespace mt
