// Node groups, link emulation and the hierarchical all-reduce over local
// worlds (ranks as threads): an emulated transfer takes latency + bytes /
// bandwidth; the hierarchical all-reduce equals the flat one; its counters
// equal its cost function; shared memory and native paths are hidden where
// the layout says the ranks do not share a node or links are emulated.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <random>
#include <thread>

#include "comm_test_util.h"
#include "meshtrain/base/error.h"
#include "meshtrain/base/timer.h"
#include "meshtrain/comm/backends/local/local_world.h"
#include "meshtrain/comm/cluster.h"
#include "meshtrain/comm/communicator.h"

namespace mt {
namespace {

using Seconds = std::chrono::duration<double>;

std::shared_ptr<ClusterLayout> two_nodes_link(double latency_s, double bandwidth_bytes_s) {
  auto l = std::make_shared<ClusterLayout>(ClusterLayout::by_node_size(2, 1));
  l->inter_node = LinkSpec{latency_s, bandwidth_bytes_s};
  return l;
}

// The acceptance check of the issue: B bytes over a link of bandwidth W and
// latency L take L + B / W (within 10%). A round trip (there and back over
// the same link kind) needs no clock agreement between the ranks.
TEST(LinkEmulation, TransferTakesLatencyPlusBytesOverBandwidth) {
  const double L = 0.020, W = 25e6;  // 20 ms, 200 Mbit/s
  const size_t B = size_t{4} << 20;  // 4 MiB: 168 ms on the wire, ~1 ms of real copying
  LocalWorldOptions o;
  o.size = 2;
  o.comm.cluster = two_nodes_link(L, W);
  std::atomic<double> measured{0};
  LocalWorld::run(o, [&](Communicator& c) {
    std::vector<std::byte> buf(B, std::byte{1});
    c.barrier();
    if (c.rank() == 0) {
      const auto t0 = CommClock::now();
      c.send(buf.data(), B, DType::u8, 1);
      c.recv(buf.data(), B, DType::u8, 1);
      measured = Seconds(CommClock::now() - t0).count();
    } else {
      c.recv(buf.data(), B, DType::u8, 0);
      c.send(buf.data(), B, DType::u8, 0);
    }
  });
  const double expected = 2 * (L + static_cast<double>(B) / W);
  fmt::print("round trip of {} bytes over {}: {:.4f} s, expected {:.4f} s ({:+.1f}%)\n", B,
             LinkSpec{L, W}.describe(), measured.load(), expected,
             100 * (measured.load() / expected - 1));
  EXPECT_GE(measured.load(), expected * 0.99) << "faster than the emulated link allows";
  EXPECT_LE(measured.load(), expected * 1.10)
      << "round trip " << measured.load() << " s, expected " << expected << " s";
}

// A transport that records when each message is handed to it (completing
// at once): what the emulation layer delays.
class RecordingTransport final : public Transport {
 public:
  struct Posted {
    int peer;
    size_t bytes;
    CommClock::time_point at;
  };
  explicit RecordingTransport(int rank) : rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return 3; }
  std::string backend() const override { return "recording"; }
  std::unique_ptr<TransportRequest> isend(int peer, uint32_t, const void*, size_t bytes) override {
    posted.push_back({peer, bytes, CommClock::now()});
    return std::make_unique<Done>();
  }
  std::unique_ptr<TransportRequest> irecv(int, uint32_t, void*, size_t) override {
    return std::make_unique<Done>();
  }
  std::shared_ptr<Transport> split(int, const std::vector<int>&, uint64_t, Deadline) override {
    return nullptr;
  }
  std::vector<Posted> posted;

 private:
  struct Done final : TransportRequest {
    bool test() override { return true; }
  };
  int rank_;
};

// Messages to one peer share its link direction, in order: posted together,
// the second leaves a full transfer time after the first; a message to
// another peer (another link) is not held up by them.
TEST(LinkEmulation, MessagesOnOneLinkAreSerialisedInOrder) {
  const double L = 0.010, W = 50e6;
  const size_t B = size_t{1} << 20;  // 21 ms each
  auto layout = std::make_shared<ClusterLayout>(ClusterLayout::by_node_size(3, 1));
  layout->inter_node = {L, W};
  auto inner = std::make_shared<RecordingTransport>(0);
  std::shared_ptr<Transport> t =
      make_cluster_transport(inner, layout, CommClock::now() + std::chrono::seconds(10));
  std::vector<std::byte> buf(B);
  const auto t0 = CommClock::now();
  auto a = t->isend(1, 5, buf.data(), B);
  auto b = t->isend(1, 5, buf.data(), B / 2);
  auto c = t->isend(2, 5, buf.data(), B);
  for (bool done = false; !done;) {
    const bool da = a->test(), db = b->test(), dc = c->test();  // each polled every round
    done = da && db && dc;
    std::this_thread::yield();
  }
  ASSERT_EQ(inner->posted.size(), 3u);
  auto at = [&](size_t i) { return Seconds(inner->posted[i].at - t0).count(); };
  const double one = static_cast<double>(B) / W;
  std::vector<size_t> to1;
  size_t ic = 0;
  for (size_t i = 0; i < 3; ++i) {
    if (inner->posted[i].peer == 1) to1.push_back(i);
    if (inner->posted[i].peer == 2) ic = i;
  }
  ASSERT_EQ(to1.size(), 2u);
  const size_t ia = to1[0], ib = to1[1];
  // Posting order is message order on the link (b is the shorter one).
  EXPECT_EQ(inner->posted[ia].bytes, B) << "the later, shorter message overtook the first";
  // A message is posted when a poll finds its time has come: never early
  // (4 ms of clock slack), and late by at most a scheduling delay (15 ms: a
  // loaded machine under ASan was seen 9 ms late). b unserialised would be
  // 21 ms early, which the lower bound catches.
  auto near = [&](size_t i, double want) {
    EXPECT_GE(at(i), want - 0.004) << "message " << i << " early";
    EXPECT_LE(at(i), want + 0.015) << "message " << i << " late";
  };
  near(ia, L + one);
  near(ib, L + 1.5 * one);
  near(ic, L + one);  // its own link
}

// Two ranks of node 0 send to two ranks of node 1 at once: with one link per
// rank pair each message arrives L + B/W after its own send; with node_pair
// sharing the node pair's link carries them one after the other, so the
// last arrives no earlier than L + 2 B/W after the first send. Times are
// taken on one clock (the ranks are threads) from each send's start, so a
// rank descheduled around the barrier cannot fake or hide serialisation:
// the lower bounds are the emulation's own; the upper bounds leave room for
// a loaded machine.
TEST(LinkEmulation, NodePairSharingSerialisesANodesRanks) {
  const double L = 0.010, W = 10e6;
  const size_t B = size_t{1} << 20;  // 105 ms each
  const double wire = static_cast<double>(B) / W, one = L + wire;
  for (LinkSharing sharing : {LinkSharing::rank_pair, LinkSharing::node_pair}) {
    SCOPED_TRACE(std::string(link_sharing_name(sharing)));
    auto layout = std::make_shared<ClusterLayout>(ClusterLayout::by_node_size(4, 2));
    layout->inter_node = {L, W};
    layout->sharing = sharing;
    LocalWorldOptions o;
    o.size = 4;
    o.comm.cluster = layout;
    const auto origin = CommClock::now();
    std::array<std::atomic<double>, 2> start{}, arrival{};
    LocalWorld::run(o, [&](Communicator& c) {
      std::vector<std::byte> buf(B);
      c.barrier();
      if (c.rank() < 2) {
        start[static_cast<size_t>(c.rank())] = Seconds(CommClock::now() - origin).count();
        c.send(buf.data(), B, DType::u8, c.rank() + 2);
      } else {
        c.recv(buf.data(), B, DType::u8, c.rank() - 2);
        arrival[static_cast<size_t>(c.rank() - 2)] = Seconds(CommClock::now() - origin).count();
      }
    });
    if (sharing == LinkSharing::rank_pair) {
      for (size_t i = 0; i < 2; ++i) {
        const double took = arrival[i] - start[i];
        EXPECT_GE(took, one - 0.002) << "message " << i;
        EXPECT_LT(took, one + 0.5 * wire) << "message " << i << ": serialised?";
      }
    } else {
      const double from = std::min(start[0].load(), start[1].load());
      const double last = std::max(arrival[0].load(), arrival[1].load()) - from;
      EXPECT_GE(last, L + 2 * wire - 0.002) << "the node pair's link carried both at once";
      EXPECT_LT(last, L + 2 * wire + 0.5 * one);
    }
  }
}

// Collectives pay the emulated links too, and the call observer (the
// timeline) and the counters' seconds show it: a 2-rank ring all-reduce is
// a handshake (one latency) and two steps of half the buffer.
TEST(LinkEmulation, CollectivesAndObserverShowEmulatedTime) {
  const double L = 0.010, W = 50e6;
  const size_t count = size_t{1} << 19;  // 2 MiB of f32
  // One all-reduce over links of latency `lat` and bandwidth `bw`: rank
  // 0's observed time and counted seconds.
  auto run = [&](double lat, double bw) {
    LocalWorldOptions o;
    o.size = 2;
    o.comm.cluster = two_nodes_link(lat, bw);
    std::atomic<int64_t> observed_ns{0};
    std::atomic<double> counted_s{0};
    LocalWorld::run(o, [&](Communicator& c) {
      EXPECT_FALSE(c.has_shared_memory());  // shared memory cannot be delayed per link
      EXPECT_FALSE(c.has_native());
      if (c.rank() == 0) {
        c.set_call_observer([&](const CallEvent& e) {
          if (e.kind == Collective::all_reduce) observed_ns = e.end_ns - e.start_ns;
        });
      }
      std::vector<float> v(count, 1.0f);
      c.barrier();
      c.all_reduce(v.data(), v.data(), count, DType::f32, ReduceOp::sum);
      EXPECT_EQ(v[0], 2.0f);
      if (c.rank() == 0) counted_s = c.counters().by_collective.at("all_reduce").seconds;
    });
    return std::pair{static_cast<double>(observed_ns.load()) * 1e-9, counted_s.load()};
  };
  // The same ring through the same emulating transport with links that
  // delay nothing: what the copies and the reduction take on this build
  // (a sanitizer build or a loaded machine takes several times longer).
  // Noise (a preempted thread, a sanitizer's bookkeeping) only adds time,
  // so each is the fastest of three runs: one run at a time missed the
  // bound by 0.1 ms under ASan on a loaded machine.
  double work = 1e9, observed = 1e9, counted = 1e9;
  for (int i = 0; i < 3; ++i) work = std::min(work, run(0.0, 1e15).first);
  for (int i = 0; i < 3; ++i) {
    const auto [o, c] = run(L, W);
    if (o < observed) observed = o, counted = c;
  }
  const double expected = 3 * L + static_cast<double>(count * 4) / W;
  EXPECT_GE(observed, expected * 0.95);
  // The slack: 10% of the emulated time and twice that work (the old fixed
  // 25% failed a sanitizer build, whose copies and sums are slower).
  EXPECT_LE(observed, expected * 1.1 + 2 * work)
      << "observed " << observed << " expected " << expected << " work " << work;
  EXPECT_GE(counted, expected * 0.95);
}

// Ranks of one node talk over the intra-node link, others over inter-node.
TEST(LinkEmulation, LinkKindsFollowTheLayout) {
  ClusterLayout l = ClusterLayout::by_node_size(6, 2);
  l.site_of_node = {0, 0, 1};
  l.intra_node = {1e-6, 0};
  l.inter_node = {1e-3, 125e6};
  l.inter_site = {50e-3, 12.5e6};
  l.node_pairs[{0, 1}] = {2e-3, 0};
  EXPECT_EQ(l.kind(0, 1), LinkKind::intra_node);
  EXPECT_EQ(l.kind(1, 2), LinkKind::inter_node);
  EXPECT_EQ(l.kind(3, 4), LinkKind::inter_site);
  EXPECT_EQ(l.link(0, 1).latency_s, 1e-6);
  EXPECT_EQ(l.link(1, 2).latency_s, 2e-3);  // the node pair's own link
  EXPECT_EQ(l.link(4, 0).latency_s, 50e-3);
  EXPECT_TRUE(l.emulates());
  EXPECT_FALSE(ClusterLayout::by_node_size(4, 2).emulates());
  EXPECT_NE(l.describe().find("6 ranks on 3 nodes (2 + 2 + 2) at 2 sites"), std::string::npos)
      << l.describe();
  EXPECT_EQ(LinkSpec({1e-3, 125e6}).describe(), "1 Gbit/s, 1 ms");
  EXPECT_EQ(LinkSpec({50e-3, 12.5e6}).describe(), "100 Mbit/s, 50 ms");
}

struct HierCase {
  int world;
  int node_size;
  bool emulate;
  size_t shm_bytes;  // 0: no shared memory at all
};

std::shared_ptr<ClusterLayout> layout_for(const HierCase& h) {
  auto l = std::make_shared<ClusterLayout>(ClusterLayout::by_node_size(h.world, h.node_size));
  if (h.emulate) {
    l->intra_node = {20e-6, 0};
    l->inter_node = {200e-6, 0};
  }
  return l;
}

// Hierarchical all-reduce equals the flat ring bit for bit on exactly
// representable sums (any order gives the same bits), and the closed form;
// on random floats within a relative 1e-5 (orders differ: the node's
// partial sums first).
TEST(Hierarchical, EqualsFlatAllReduce) {
  for (const HierCase h :
       {HierCase{4, 2, false, 1 << 20}, HierCase{4, 2, false, 0}, HierCase{6, 2, false, 1 << 20},
        HierCase{6, 3, true, 1 << 20}, HierCase{8, 4, false, 1 << 16}, HierCase{8, 2, true, 0}}) {
    SCOPED_TRACE(fmt::format("{} ranks, node size {}, emulated {}, shm {}", h.world, h.node_size,
                             h.emulate, h.shm_bytes));
    LocalWorldOptions o;
    o.size = h.world;
    o.shm_bytes_per_rank = h.shm_bytes;
    o.comm.cluster = layout_for(h);
    LocalWorld::run(o, [&](Communicator& c) {
      if (!c.has_hierarchy()) throw std::runtime_error("no hierarchy built");
      if (c.has_shared_memory()) throw std::runtime_error("world spans nodes but has shm");
      if (c.choose_algorithm(Collective::all_reduce, 4096) != CommAlgorithm::hierarchical) {
        throw std::runtime_error("automatic does not pick hierarchical");
      }
      for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{1000}, size_t{70001}}) {
        for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
          std::vector<float> in(count), flat(count), hier(count);
          for (size_t i = 0; i < count; ++i) {
            in[i] = static_cast<float>(test::input_value(DType::f32, c.rank(), i));
          }
          CollectiveOptions ring;
          ring.algorithm = CommAlgorithm::ring;
          c.all_reduce(in.data(), flat.data(), count, DType::f32, op, ring);
          c.all_reduce(in.data(), hier.data(), count, DType::f32, op);
          std::vector<float> inplace = in;
          CollectiveOptions forced;
          forced.algorithm = CommAlgorithm::hierarchical;
          c.all_reduce(inplace.data(), inplace.data(), count, DType::f32, op, forced);
          for (size_t i = 0; i < count; ++i) {
            double want = op == ReduceOp::max ? -1e30 : 0;
            for (int r = 0; r < c.size(); ++r) {
              const double x = test::input_value(DType::f32, r, i);
              want = op == ReduceOp::max ? std::max(want, x) : want + x;
            }
            if (op == ReduceOp::avg) want /= c.size();
            if (std::memcmp(&flat[i], &hier[i], 4) != 0 ||
                std::memcmp(&flat[i], &inplace[i], 4) != 0 || hier[i] != static_cast<float>(want)) {
              throw std::runtime_error(fmt::format(
                  "rank {} count {} op {} element {}: flat {} hierarchical {} in place {} want {}",
                  c.rank(), count, reduce_op_name(op), i, flat[i], hier[i], inplace[i], want));
            }
          }
        }
      }
      // Random floats: summation orders differ.
      std::mt19937 gen(static_cast<unsigned>(c.rank() + 1));
      std::uniform_real_distribution<float> u(-1.0f, 1.0f);
      std::vector<float> in(10007), flat(in.size()), hier(in.size());
      for (float& x : in) x = u(gen);
      CollectiveOptions ring;
      ring.algorithm = CommAlgorithm::ring;
      c.all_reduce(in.data(), flat.data(), in.size(), DType::f32, ReduceOp::sum, ring);
      c.all_reduce(in.data(), hier.data(), in.size(), DType::f32, ReduceOp::sum);
      for (size_t i = 0; i < in.size(); ++i) {
        if (std::abs(flat[i] - hier[i]) > 1e-5f * std::max(1.0f, std::abs(flat[i]))) {
          throw std::runtime_error(
              fmt::format("random element {}: flat {} hierarchical {}", i, flat[i], hier[i]));
        }
      }
    });
  }
}

// Reduce-scatter(v) and all-gather(v) run hierarchically too (packed by
// local index): equal to the flat ring bit for bit (exact sums; gathers
// move data only), with uneven and empty blocks, all-gather also in place;
// and their counters equal their cost functions.
TEST(Hierarchical, ReduceScatterAndAllGatherEqualFlat) {
  for (const HierCase h : {HierCase{4, 2, false, 1 << 20}, HierCase{6, 3, true, 1 << 16},
                           HierCase{6, 2, false, 0}, HierCase{8, 4, false, 1 << 16}}) {
    SCOPED_TRACE(fmt::format("{} ranks, node size {}, emulated {}, shm {}", h.world, h.node_size,
                             h.emulate, h.shm_bytes));
    LocalWorldOptions o;
    o.size = h.world;
    o.shm_bytes_per_rank = h.shm_bytes;
    o.comm.cluster = layout_for(h);
    LocalWorld::run(o, [&](Communicator& c) {
      const size_t n = static_cast<size_t>(c.size());
      if (c.choose_algorithm(Collective::reduce_scatter, 1 << 20) != CommAlgorithm::hierarchical ||
          c.choose_algorithm(Collective::all_gatherv, 64) != CommAlgorithm::hierarchical) {
        throw std::runtime_error("automatic does not pick hierarchical for RS / AG");
      }
      CollectiveOptions ring;
      ring.algorithm = CommAlgorithm::ring;
      for (size_t base : {size_t{0}, size_t{1}, size_t{5}, size_t{3001}}) {
        std::vector<size_t> counts(n);
        for (size_t r = 0; r < n; ++r) counts[r] = base == 0 ? 0 : base + (r * 7) % 5;
        if (base == 5) counts[1] = 0;  // an empty block in the middle
        size_t total = 0;
        for (size_t x : counts) total += x;
        std::vector<float> in(total);
        for (size_t i = 0; i < total; ++i) {
          in[i] = static_cast<float>(test::input_value(DType::f32, c.rank(), i));
        }
        const size_t mine = counts[static_cast<size_t>(c.rank())];
        for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
          std::vector<float> flat(mine + 1), hier(mine + 1);
          c.reduce_scatterv(in.data(), flat.data(), counts, DType::f32, op, ring);
          c.reset_counters();
          c.reduce_scatterv(in.data(), hier.data(), counts, DType::f32, op);
          if (std::memcmp(flat.data(), hier.data(), mine * 4) != 0) {
            throw std::runtime_error(fmt::format("reduce_scatterv {} base {}: rank {} differs",
                                                 reduce_op_name(op), base, c.rank()));
          }
          const CollectiveCost want = c.cost(Collective::reduce_scatterv,
                                             CommAlgorithm::hierarchical, 0, DType::f32, counts);
          const CollectiveCounter got = c.counters().by_collective.at("reduce_scatterv");
          if (got.bytes_sent != want.bytes_sent || got.bytes_received != want.bytes_received) {
            throw std::runtime_error(fmt::format(
                "reduce_scatterv base {} rank {}: counted {} / {}, cost {} / {}", base, c.rank(),
                got.bytes_sent, got.bytes_received, want.bytes_sent, want.bytes_received));
          }
        }
        std::vector<float> block(mine + 1);
        for (size_t i = 0; i < mine; ++i) block[i] = static_cast<float>(c.rank() * 1000 + i);
        std::vector<float> flat(total + 1), hier(total + 1), inplace(total + 1);
        c.all_gatherv(block.data(), flat.data(), counts, DType::f32, ring);
        c.reset_counters();
        c.all_gatherv(block.data(), hier.data(), counts, DType::f32);
        const CollectiveCost want =
            c.cost(Collective::all_gatherv, CommAlgorithm::hierarchical, 0, DType::f32, counts);
        const CollectiveCounter got = c.counters().by_collective.at("all_gatherv");
        size_t off = 0;
        for (int r = 0; r < c.rank(); ++r) off += counts[static_cast<size_t>(r)];
        std::copy(block.begin(), block.begin() + static_cast<std::ptrdiff_t>(mine),
                  inplace.begin() + static_cast<std::ptrdiff_t>(off));
        c.all_gatherv(inplace.data() + off, inplace.data(), counts, DType::f32);
        if (std::memcmp(flat.data(), hier.data(), total * 4) != 0 ||
            std::memcmp(flat.data(), inplace.data(), total * 4) != 0) {
          throw std::runtime_error(
              fmt::format("all_gatherv base {}: rank {} differs", base, c.rank()));
        }
        if (got.bytes_sent != want.bytes_sent || got.bytes_received != want.bytes_received) {
          throw std::runtime_error(fmt::format(
              "all_gatherv base {} rank {}: counted {} / {}, cost {} / {}", base, c.rank(),
              got.bytes_sent, got.bytes_received, want.bytes_sent, want.bytes_received));
        }
      }
      // The even variant (what ZeRO calls) against its closed form.
      std::vector<float> full(n * 4), part(4);
      for (size_t i = 0; i < full.size(); ++i) full[i] = static_cast<float>(i % 7);
      c.reduce_scatter(full.data(), part.data(), 4, DType::f32, ReduceOp::sum);
      for (size_t i = 0; i < 4; ++i) {
        const float want = static_cast<float>(((static_cast<size_t>(c.rank()) * 4 + i) % 7) * n);
        if (part[i] != want) throw std::runtime_error("reduce_scatter closed form");
      }
    });
  }
}

// The counters of a hierarchical all-reduce equal its cost function, with
// the node's sub-calls on shared memory or on point-to-point messages.
TEST(Hierarchical, CountersEqualCostFunction) {
  for (const HierCase h : {HierCase{4, 2, false, 1 << 20}, HierCase{4, 2, true, 1 << 20},
                           HierCase{6, 3, false, 1 << 16}, HierCase{8, 2, false, 0}}) {
    SCOPED_TRACE(
        fmt::format("{} ranks, node size {}, emulated {}", h.world, h.node_size, h.emulate));
    LocalWorldOptions o;
    o.size = h.world;
    o.shm_bytes_per_rank = h.shm_bytes;
    o.comm.cluster = layout_for(h);
    LocalWorld::run(o, [&](Communicator& c) {
      for (size_t count : {size_t{1}, size_t{999}, size_t{300000}}) {
        for (DType t : {DType::f32, DType::bf16}) {
          std::vector<std::byte> buf = test::make_buffer(t, count);
          c.reset_counters();
          c.all_reduce(buf.data(), buf.data(), count, t, ReduceOp::sum);
          const CommCounters got = c.counters();
          const CollectiveCost want =
              c.cost(Collective::all_reduce, CommAlgorithm::hierarchical, count, t);
          const CollectiveCounter& ar = got.by_collective.at("all_reduce");
          if (ar.bytes_sent != want.bytes_sent || ar.bytes_received != want.bytes_received) {
            throw std::runtime_error(
                fmt::format("rank {} count {} {}: counted {} / {} bytes, cost function {} / {}",
                            c.rank(), count, dtype_name(t), ar.bytes_sent, ar.bytes_received,
                            want.bytes_sent, want.bytes_received));
          }
          // Inter-node bytes: 2 (k-1)/k of this rank's chunk, far below the
          // flat ring's 2 (n-1)/n of the buffer at scale.
          if (count == 300000 && want.bytes_sent == 0) throw std::runtime_error("nothing sent");
        }
      }
    });
  }
}

TEST(Hierarchical, UnequalNodesStayFlatAndForcingItSaysWhy) {
  LocalWorldOptions o;
  o.size = 5;
  o.comm.cluster = std::make_shared<ClusterLayout>(ClusterLayout::by_node_size(5, 2));
  LocalWorld::run(o, [&](Communicator& c) {
    EXPECT_FALSE(c.has_hierarchy());
    EXPECT_EQ(c.choose_algorithm(Collective::all_reduce, 1 << 20), CommAlgorithm::ring);
    std::vector<float> v(16, 1.0f);
    CollectiveOptions forced;
    forced.algorithm = CommAlgorithm::hierarchical;
    try {
      c.all_reduce(v.data(), v.data(), v.size(), DType::f32, ReduceOp::sum, forced);
      ADD_FAILURE() << "forced hierarchical on unequal nodes ran";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("same number (> 1)"), std::string::npos) << e.what();
    }
    c.all_reduce(v.data(), v.data(), v.size(), DType::f32, ReduceOp::sum);
    EXPECT_EQ(v[3], 5.0f);
  });
}

// A layout without emulation keeps shared memory inside a node (the node
// communicator has it) but not across nodes; one node keeps it everywhere.
TEST(Hierarchical, SharedMemoryOnlyWhereRanksShareANode) {
  LocalWorldOptions o;
  o.size = 4;
  o.comm.cluster = std::make_shared<ClusterLayout>(ClusterLayout::by_node_size(4, 2));
  LocalWorld::run(o, [&](Communicator& c) {
    EXPECT_FALSE(c.has_shared_memory());
    EXPECT_TRUE(c.has_hierarchy());
    auto node = c.split(c.rank() / 2, c.rank());
    EXPECT_TRUE(node->has_shared_memory());
    auto cross = c.split(c.rank() % 2, c.rank());
    EXPECT_FALSE(cross->has_shared_memory());
  });
  o.comm.cluster = std::make_shared<ClusterLayout>(ClusterLayout::by_node_size(4, 4));
  LocalWorld::run(o, [&](Communicator& c) {
    EXPECT_TRUE(c.has_shared_memory());
    EXPECT_FALSE(c.has_hierarchy());
  });
}

TEST(ClusterLayout, WrongWorldIsRejected) {
  LocalWorldOptions o;
  o.size = 2;
  o.comm.cluster = std::make_shared<ClusterLayout>(ClusterLayout::by_node_size(4, 2));
  try {
    LocalWorld::run(o, [](Communicator&) {});
    ADD_FAILURE() << "a 4-rank layout on 2 ranks was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("describes 4 ranks, but the communicator has 2"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace mt
