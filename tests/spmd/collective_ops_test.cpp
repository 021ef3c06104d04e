// Collective operators (graph/collective.h) run through CommCollectiveRunner
// on the `local` communicator (ranks as threads), 2 to 4 ranks:
// - forward results bitwise equal to the closed form (integer-valued data,
//   so every sum is exact), even and uneven pieces, outer and inner dims,
//   sub-groups of the world, with and without shared memory; the group's
//   byte counters equal each node's cost facts;
// - every gradient rule against central finite differences of the global
//   function in f64. The global objective follows graph/collective.h: the sum
//   of every rank's loss, each rank's input its own variable (all_reduce,
//   all_gather, reduce_scatter); for f the input is one replicated variable
//   (perturbed on every rank at once); for g the loss reads the replicated
//   result once (rank 0's loss, which every rank computes identically);
// - the errors for a group the runner does not know and for pieces meant
//   for another rank.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "meshtrain/base/error.h"
#include "meshtrain/base/random.h"
#include "meshtrain/comm/backends/local/local_world.h"
#include "meshtrain/exec/executor.h"
#include "meshtrain/graph/autodiff.h"
#include "meshtrain/graph/builder.h"
#include "meshtrain/graph/collective.h"
#include "meshtrain/graph/cost.h"
#include "meshtrain/graph/op_registry.h"
#include "meshtrain/spmd/collective_runner.h"

namespace mt {
namespace {

// How the objective of a case is formed (graph/collective.h).
enum class Objective {
  sum_of_losses,     // L = sum_r L_r, x_r independent
  replicated_input,  // L = sum_r L_r, x one variable held by every rank
  replicated_loss,   // L = L_0 (= every L_r), x_r independent
};

struct OpCase {
  std::string label;
  OpKind op;
  int ranks;
  std::vector<int64_t> sizes;  // pieces (all_gather / reduce_scatter), one per rank
  int64_t dim = 0;
  Objective objective = Objective::sum_of_losses;
  int64_t concat_dim = 0;  // all_to_all
  bool uneven = false;     // all_to_all: uneven pieces (all_to_allv), see send_sizes
};

// Uneven all_to_all: rank r sends send_sizes(r)[q] rows (along dim) to rank
// q, zero included, and receives send_sizes(q)[r] from each.
std::vector<int64_t> send_sizes(int ranks, int r) {
  std::vector<int64_t> s;
  for (int q = 0; q < ranks; ++q) s.push_back((r + 2 * q) % 3);
  return s;
}
std::vector<int64_t> recv_sizes(int ranks, int r) {
  std::vector<int64_t> s;
  for (int q = 0; q < ranks; ++q) s.push_back(send_sizes(ranks, q)[static_cast<size_t>(r)]);
  return s;
}

void PrintTo(const OpCase& c, std::ostream* os) {
  *os << c.label;
}

// x's shape on rank r: pieces along dim for all_gather; the full extent
// along dim for reduce_scatter; [2, 3] otherwise. Rank-3 shapes where dim = 1
// so the pieces are not contiguous (inner > 1).
Shape input_shape(const OpCase& c, int r) {
  int64_t along = 3;
  if (c.op == OpKind::all_gather || c.op == OpKind::gather_from_group) {
    along = c.sizes[static_cast<size_t>(r)];
  }
  if (c.op == OpKind::reduce_scatter || c.op == OpKind::all_to_all ||
      c.op == OpKind::split_to_group) {
    along = 0;
    for (int64_t s : c.uneven ? send_sizes(c.ranks, r) : c.sizes) along += s;
  }
  if (c.dim == 0) return Shape{along, 3};
  return Shape{2, along, 2};
}

ValueId apply(Builder& b, const OpCase& c, ValueId x, int r) {
  switch (c.op) {
    case OpKind::all_reduce:
      return b.all_reduce(x, 0);
    case OpKind::all_gather:
      return b.all_gather(x, 0, c.dim, c.sizes, r);
    case OpKind::reduce_scatter:
      return b.reduce_scatter(x, 0, c.dim, c.sizes, r);
    case OpKind::all_to_all:
      if (c.uneven) {
        return b.all_to_allv(x, 0, c.dim, send_sizes(c.ranks, r), recv_sizes(c.ranks, r), r);
      }
      return b.all_to_all(x, 0, c.dim, c.concat_dim, c.sizes, r);
    case OpKind::copy_to_group:
      return b.copy_to_group(x, 0);
    case OpKind::reduce_from_group:
      return b.reduce_from_group(x, 0);
    case OpKind::gather_from_group:
      return b.gather_from_group(x, 0, c.dim, c.sizes, r);
    case OpKind::split_to_group:
      return b.split_to_group(x, 0, c.dim, c.sizes, r);
    default:
      throw InternalError("not a collective");
  }
}

std::vector<int> all_ranks(int n) {
  std::vector<int> v;
  for (int r = 0; r < n; ++r) v.push_back(r);
  return v;
}

std::vector<OpCase> cases() {
  using O = OpKind;
  using J = Objective;
  std::vector<OpCase> out;
  for (int n : {2, 3, 4}) {
    const std::vector<int64_t> even(static_cast<size_t>(n), 2);
    std::vector<int64_t> uneven = {3, 1, 2, 1};
    uneven.resize(static_cast<size_t>(n));
    auto label = [&](const char* s) { return fmt::format("{}_np{}", s, n); };
    out.push_back({label("all_reduce"), O::all_reduce, n, {}, 0});
    out.push_back({label("all_gather_dim0_even"), O::all_gather, n, even, 0});
    out.push_back({label("all_gather_dim1_uneven"), O::all_gather, n, uneven, 1});
    out.push_back({label("reduce_scatter_dim0_even"), O::reduce_scatter, n, even, 0});
    out.push_back({label("reduce_scatter_dim1_uneven"), O::reduce_scatter, n, uneven, 1});
    out.push_back(
        {label("all_to_all_dim0_to_dim1"), O::all_to_all, n, even, 0, J::sum_of_losses, 1});
    out.push_back(
        {label("all_to_all_dim1_to_dim0"), O::all_to_all, n, even, 1, J::sum_of_losses, 0});
    out.push_back(
        {label("all_to_all_dim1_to_dim1"), O::all_to_all, n, even, 1, J::sum_of_losses, 1});
    out.push_back({label("all_to_allv_dim0"), O::all_to_all, n, {}, 0, J::sum_of_losses, 0, true});
    out.push_back({label("all_to_allv_dim1"), O::all_to_all, n, {}, 1, J::sum_of_losses, 1, true});
    out.push_back({label("copy_to_group"), O::copy_to_group, n, {}, 0, J::replicated_input});
    out.push_back({label("reduce_from_group"), O::reduce_from_group, n, {}, 0, J::replicated_loss});
    out.push_back({label("gather_from_group_dim1_uneven"), O::gather_from_group, n, uneven, 1,
                   J::replicated_loss});
    out.push_back({label("gather_from_group_dim0_even"), O::gather_from_group, n, even, 0,
                   J::replicated_loss});
    out.push_back({label("split_to_group_dim1_uneven"), O::split_to_group, n, uneven, 1,
                   J::replicated_input});
    out.push_back(
        {label("split_to_group_dim0_even"), O::split_to_group, n, even, 0, J::replicated_input});
  }
  // A rank with an empty piece.
  out.push_back({"all_gather_empty_piece_np3", O::all_gather, 3, {2, 0, 1}, 0});
  out.push_back({"reduce_scatter_empty_piece_np3", O::reduce_scatter, 3, {0, 2, 1}, 1});
  return out;
}

LocalWorldOptions world(int n) {
  LocalWorldOptions o;
  o.size = n;
  o.comm.timeout = std::chrono::milliseconds(30'000);
  return o;
}

// ---- forward, bitwise ----

// Element i of rank r's input: distinct small integers, exact in f32 sums.
double input_value(int r, int64_t i) {
  return static_cast<double>(100 * (r + 1) + i);
}

// all_to_all on rank r: element m of y (the shape of x with dim / n and
// concat_dim x n) comes from rank q = m[concat_dim] / piece extent there, at
// m with concat_dim reduced modulo that extent and dim shifted to piece r.
std::vector<float> expected_all_to_all(const OpCase& c, int r) {
  const std::vector<int64_t> xs = input_shape(c, 0).dims();
  std::vector<int64_t> ps = xs;
  const auto d = static_cast<size_t>(c.dim), cd = static_cast<size_t>(c.concat_dim);
  ps[d] = c.sizes[0];
  std::vector<int64_t> ys = ps;
  ys[cd] *= c.ranks;
  int64_t count = 1;
  for (int64_t e : ys) count *= e;
  std::vector<float> y;
  for (int64_t j = 0; j < count; ++j) {
    std::vector<int64_t> m(ys.size());
    int64_t rest = j;
    for (size_t k = ys.size(); k-- > 0;) {
      m[k] = rest % ys[k];
      rest /= ys[k];
    }
    const int q = static_cast<int>(m[cd] / ps[cd]);
    m[cd] %= ps[cd];
    m[d] += r * c.sizes[0];
    int64_t flat = 0;
    for (size_t k = 0; k < xs.size(); ++k) flat = flat * xs[k] + m[k];
    y.push_back(static_cast<float>(input_value(q, flat)));
  }
  return y;
}

// Uneven all_to_all on rank r: for each outer index, rank q's piece r (rows
// [sum_{t<r} send_sizes(q)[t], + send_sizes(q)[r]) along dim), q ascending.
std::vector<float> expected_all_to_allv(const OpCase& c, int r) {
  const int64_t outer = c.dim == 0 ? 1 : 2, inner = c.dim == 0 ? 3 : 2;
  std::vector<float> y;
  for (int64_t o = 0; o < outer; ++o) {
    for (int q = 0; q < c.ranks; ++q) {
      const std::vector<int64_t> sq = send_sizes(c.ranks, q);
      int64_t along = 0, off = 0;
      for (size_t t = 0; t < sq.size(); ++t) {
        if (static_cast<int>(t) < r) off += sq[t];
        along += sq[t];
      }
      for (int64_t row = 0; row < sq[static_cast<size_t>(r)]; ++row) {
        for (int64_t i = 0; i < inner; ++i) {
          y.push_back(static_cast<float>(input_value(q, (o * along + off + row) * inner + i)));
        }
      }
    }
  }
  return y;
}

// The closed form of each op's output on rank r, from every rank's input.
std::vector<float> expected(const OpCase& c, int r) {
  if (c.op == OpKind::all_to_all && c.uneven) return expected_all_to_allv(c, r);
  if (c.op == OpKind::all_to_all) return expected_all_to_all(c, r);
  const int n = c.ranks;
  std::vector<Shape> shapes;
  for (int q = 0; q < n; ++q) shapes.push_back(input_shape(c, q));
  auto x = [&](int q, int64_t i) { return static_cast<float>(input_value(q, i)); };
  std::vector<float> y;
  if (c.op == OpKind::copy_to_group) {
    for (int64_t i = 0; i < shapes[0].numel(); ++i) y.push_back(x(r, i));
    return y;
  }
  if (c.op == OpKind::all_reduce || c.op == OpKind::reduce_from_group) {
    for (int64_t i = 0; i < shapes[0].numel(); ++i) {
      float s = 0;
      for (int q = 0; q < n; ++q) s += x(q, i);
      y.push_back(s);
    }
    return y;
  }
  // Shapes [outer, along, inner] with dim the middle one (dim 0: outer = 1).
  const int64_t outer = c.dim == 0 ? 1 : 2,
                inner = 3 - c.dim;  // dim 0: [along, 3]; 1: [2, along, 2]
  int64_t total = 0;
  std::vector<int64_t> before;
  for (int64_t s : c.sizes) {
    before.push_back(total);
    total += s;
  }
  if (c.op == OpKind::all_gather || c.op == OpKind::gather_from_group) {
    for (int64_t o = 0; o < outer; ++o) {
      for (int q = 0; q < n; ++q) {
        const int64_t sq = c.sizes[static_cast<size_t>(q)];
        for (int64_t k = 0; k < sq * inner; ++k) y.push_back(x(q, o * sq * inner + k));
      }
    }
    return y;
  }
  const int64_t mine = c.sizes[static_cast<size_t>(r)];
  if (c.op == OpKind::split_to_group) {  // this rank's piece of its own x
    for (int64_t o = 0; o < outer; ++o) {
      for (int64_t k = 0; k < mine * inner; ++k) {
        y.push_back(x(r, (o * total + before[static_cast<size_t>(r)]) * inner + k));
      }
    }
    return y;
  }
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t k = 0; k < mine * inner; ++k) {
      float s = 0;
      for (int q = 0; q < n; ++q)
        s += x(q, (o * total + before[static_cast<size_t>(r)]) * inner + k);
      y.push_back(s);
    }
  }
  return y;
}

class CollectiveForward : public ::testing::TestWithParam<OpCase> {};

TEST_P(CollectiveForward, BitwiseEqualToTheClosedForm) {
  const OpCase c = GetParam();
  for (size_t shm : {size_t{1} << 20, size_t{0}}) {  // shared memory, and ring / halving-doubling
    LocalWorldOptions wo = world(c.ranks);
    wo.shm_bytes_per_rank = shm;
    LocalWorld::run(wo, [&](Communicator& comm) {
      const int r = comm.rank();
      Graph g;
      Builder b(g);
      ValueId x = b.input("x", input_shape(c, r));
      ValueId y = apply(b, c, x, r);
      ExecOptions o;
      o.backend = "reference";
      o.outputs = {y};
      auto runner = std::make_shared<CommCollectiveRunner>(
          comm, std::vector<std::vector<int>>{all_ranks(c.ranks)});
      o.collectives = runner;
      Executor ex(g, o);
      Tensor xt = Tensor::empty(g.value(x).shape, DType::f32);
      for (int64_t i = 0; i < xt.numel(); ++i) xt.set_item(i, input_value(r, i));
      ex.bind(x, xt);
      for (int rep = 0; rep < 2; ++rep) {  // twice: buffers are reused
        ex.run();
        const Tensor yt = ex.get(y);
        const std::vector<float> want = expected(c, r);
        ASSERT_EQ(static_cast<size_t>(yt.numel()), want.size()) << "rank " << r;
        EXPECT_TRUE(want.empty() ||
                    std::memcmp(yt.raw(), want.data(), want.size() * sizeof(float)) == 0)
            << c.label << " rank " << r << " shm " << shm;
      }
      // The group's byte counters equal the node's cost facts: payload from
      // graph/cost.h, wire bytes from comm's cost of the algorithm used.
      const Node& node = g.node(g.value(y).producer);
      const CommCounters counters = runner->comm_of(0)->counters();
      if (!communicates(node.op)) {
        EXPECT_EQ(counters.total_sent(), 0u);
        return;
      }
      const bool gathers = node.op == OpKind::all_gather || node.op == OpKind::gather_from_group;
      const char* kind = gathers                             ? "all_gatherv"
                         : node.op == OpKind::reduce_scatter ? "reduce_scatterv"
                         : node.op == OpKind::all_to_all ? (c.uneven ? "all_to_allv" : "all_to_all")
                                                         : "all_reduce";
      ASSERT_EQ(counters.by_collective.count(kind), 1u) << counters.to_json();
      const CollectiveCounter& k = counters.by_collective.at(kind);
      const CollectiveCost cost = runner->cost_of(g, node);
      EXPECT_EQ(k.calls, 2u);
      EXPECT_EQ(k.payload_bytes, 2 * static_cast<uint64_t>(op_cost(g, node).comm_bytes));
      EXPECT_EQ(k.bytes_sent, 2 * cost.bytes_sent) << "rank " << r;
      EXPECT_EQ(k.bytes_received, 2 * cost.bytes_received) << "rank " << r;
    });
  }
}

INSTANTIATE_TEST_SUITE_P(Ops, CollectiveForward, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<OpCase>& p) { return p.param.label; });

// ---- gradients against finite differences of the global objective ----

// Rank r's graph: loss_r = sum(tanh(op(x)) * w_r), w_r a fixed random input.
struct RankProgram {
  Graph g;
  ValueId x = kNoValue, w = kNoValue, loss = kNoValue;
};

RankProgram build(const OpCase& c, int r) {
  RankProgram p;
  Builder b(p.g);
  p.x = b.param("x", input_shape(c, r), ParamInit{}, DType::f64);
  ValueId y = apply(b, c, p.x, r);
  p.w = b.input("w", b.shape(y), DType::f64);
  p.loss = b.sum_to(b.mul(b.tanh(y), p.w), {});
  build_backward(p.g, p.loss);
  return p;
}

class CollectiveGrad : public ::testing::TestWithParam<OpCase> {};

TEST_P(CollectiveGrad, MatchesCentralDifferencesOfTheGlobalObjective) {
  const OpCase c = GetParam();
  constexpr double kEps = 1e-6, kTol = 1e-7;
  LocalWorld::run(world(c.ranks), [&](Communicator& comm) {
    const int r = comm.rank(), n = comm.size();
    RankProgram p = build(c, r);
    ExecOptions o;
    o.backend = "reference";
    o.collectives =
        std::make_shared<CommCollectiveRunner>(comm, std::vector<std::vector<int>>{all_ranks(n)});
    Executor ex(p.g, o);
    // x: the same values on every rank for a replicated input.
    const int xseed = c.objective == Objective::replicated_input ? 0 : r + 1;
    // w: the same on every rank when the loss is replicated (it is one loss).
    const int wseed = c.objective == Objective::replicated_loss ? 0 : r + 1;
    Rng rx(Rng::derive(static_cast<uint64_t>(xseed), c.label));
    Rng rw(Rng::derive(77 + static_cast<uint64_t>(wseed), c.label));
    Tensor xt = Tensor::empty(p.g.value(p.x).shape, DType::f64);
    Tensor wt = Tensor::empty(p.g.value(p.w).shape, DType::f64);
    for (int64_t i = 0; i < xt.numel(); ++i) xt.set_item(i, 2 * rx.uniform() - 1);
    for (int64_t i = 0; i < wt.numel(); ++i) wt.set_item(i, 2 * rw.uniform() - 1);
    ex.bind(p.x, xt);
    ex.bind(p.w, wt);
    ex.run();
    const Tensor grad = ex.get(p.g.grad_of(p.x)).clone();

    // The global objective, the same number on every rank.
    auto objective = [&] {
      ex.run_forward();
      double l = ex.get(p.loss).item();
      if (c.objective == Objective::replicated_loss) {
        // Every rank computed the same replicated loss; L counts it once.
        double l0 = r == 0 ? l : 0;
        comm.all_reduce(&l0, &l0, 1, DType::f64);
        EXPECT_EQ(l, l0) << "rank " << r << ": the replicated loss differs from rank 0's";
        return l0;
      }
      comm.all_reduce(&l, &l, 1, DType::f64);
      return l;
    };
    // Perturb element i of x on rank q (on every rank for a replicated x);
    // every rank loops over the same (q, i) so the collectives line up.
    const bool together = c.objective == Objective::replicated_input;
    for (int q = 0; q < (together ? 1 : n); ++q) {
      int64_t count = xt.numel();
      comm.broadcast(&count, 1, DType::i64, q);
      for (int64_t i = 0; i < count; ++i) {
        const bool mine = together || q == r;
        const double x0 = mine ? xt.item(i) : 0;
        if (mine) xt.set_item(i, x0 + kEps);
        const double up = objective();
        if (mine) xt.set_item(i, x0 - kEps);
        const double down = objective();
        if (mine) xt.set_item(i, x0);
        if (!mine) continue;
        const double numeric = (up - down) / (2 * kEps);
        EXPECT_NEAR(grad.item(i), numeric, kTol)
            << c.label << ": rank " << r << " element " << i << " (perturbed on "
            << (together ? "every rank" : fmt::format("rank {}", q)) << ")";
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Ops, CollectiveGrad, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<OpCase>& p) { return p.param.label; });

// ---- all_reduce_max (no gradient: a stop-gradient) ----

// Rank r's element i: which rank holds the maximum varies with i, negative
// values and ties included; the result is bitwise the maximum on every rank,
// with shared memory and without, and the counters equal the cost facts.
TEST(CollectiveMax, BitwiseMaximumAndCountedBytes) {
  for (int n : {2, 3, 4}) {
    for (size_t shm : {size_t{1} << 20, size_t{0}}) {
      LocalWorldOptions wo = world(n);
      wo.shm_bytes_per_rank = shm;
      LocalWorld::run(wo, [&](Communicator& comm) {
        const int r = comm.rank();
        auto value = [](int q, int64_t i) {
          return static_cast<float>((i + 3 * q) % 5) - 2.5f * static_cast<float>(i % 2);
        };
        Graph g;
        Builder b(g);
        ValueId x = b.input("x", {2, 7});
        ValueId y = g.add_node(OpKind::all_reduce_max, "max", {x},
                               CollectiveAttrs{0, 0, {}, 0, 0}.to_attrs(OpKind::all_reduce_max))
                        .front();
        ExecOptions o;
        o.backend = "reference";
        o.outputs = {y};
        auto runner = std::make_shared<CommCollectiveRunner>(
            comm, std::vector<std::vector<int>>{all_ranks(n)});
        o.collectives = runner;
        Executor ex(g, o);
        Tensor xt = Tensor::empty({2, 7}, DType::f32);
        for (int64_t i = 0; i < xt.numel(); ++i) xt.set_item(i, value(r, i));
        ex.bind(x, xt);
        ex.run();
        const Tensor yt = ex.get(y);
        for (int64_t i = 0; i < yt.numel(); ++i) {
          float want = value(0, i);
          for (int q = 1; q < n; ++q) want = std::max(want, value(q, i));
          EXPECT_EQ(yt.data<float>()[i], want) << "np" << n << " rank " << r << " element " << i;
        }
        const Node& node = g.node(g.value(y).producer);
        const CommCounters counters = runner->comm_of(0)->counters();  // a copy: keep it
        const CollectiveCounter& k = counters.by_collective.at("all_reduce");
        const CollectiveCost cost = runner->cost_of(g, node);
        EXPECT_EQ(k.calls, 1u);
        EXPECT_EQ(k.payload_bytes, static_cast<uint64_t>(op_cost(g, node).comm_bytes));
        EXPECT_EQ(k.payload_bytes, 2u * 7u * 4u);
        EXPECT_EQ(k.bytes_sent, cost.bytes_sent) << "rank " << r;
        EXPECT_EQ(k.bytes_received, cost.bytes_received) << "rank " << r;
      });
    }
  }
}

// Autodiff treats the maximum as a constant: a loss reached only through it
// gives x no gradient, and one reached also directly gives x only the
// direct path's.
TEST(CollectiveMax, IsAStopGradient) {
  Graph g;
  Builder b(g);
  ValueId x = b.param("x", {3}, ParamInit{}, DType::f64);
  ValueId m = g.add_node(OpKind::all_reduce_max, "max", {x},
                         CollectiveAttrs{0, 0, {}, 0, 0}.to_attrs(OpKind::all_reduce_max))
                  .front();
  ValueId loss = b.sum_to(b.mul(x, m), {});
  build_backward(g, loss);
  const ValueId gx = g.grad_of(x);
  ASSERT_NE(gx, kNoValue);
  // d/dx sum(x * m) with m constant is m: the gradient is m itself (or a copy).
  const Node& prod = g.node(g.value(gx).producer);
  EXPECT_NE(prod.op, OpKind::all_reduce_max);
  for (const Node& n : g.nodes()) {
    if (n.backward) {
      EXPECT_FALSE(is_group_op(n.op)) << n.name << " communicates in backward";
    }
  }
}

// Every collective operator has forward and gradient cases above
// (all_reduce_max, which has no gradient, its own tests).
TEST(CollectiveCases, CoverEveryCollectiveOperator) {
  int found = 0;
  for (OpKind op : all_ops()) {
    if (!is_group_op(op)) continue;
    ++found;
    bool covered = op == OpKind::all_reduce_max;
    for (const OpCase& c : cases()) covered = covered || c.op == op;
    EXPECT_TRUE(covered) << op_name(op) << " has no case";
  }
  EXPECT_EQ(found, 9);
}

// ---- groups ----

// 4 ranks, groups {0,1}, {2,3} and all four: each pair sums within itself,
// then the world sums the pair sums; results bitwise.
TEST(CollectiveGroups, SubGroupsSumWithinThemselves) {
  LocalWorld::run(world(4), [&](Communicator& comm) {
    const int r = comm.rank();
    Graph g;
    Builder b(g);
    ValueId x = b.input("x", {5});
    ValueId pair = b.all_reduce(x, r / 2);
    ValueId all = b.all_reduce(pair, 2);
    ExecOptions o;
    o.backend = "reference";
    o.outputs = {pair, all};
    auto runner = std::make_shared<CommCollectiveRunner>(
        comm, std::vector<std::vector<int>>{{0, 1}, {2, 3}, {0, 1, 2, 3}});
    EXPECT_EQ(runner->comm_of(r / 2)->size(), 2);
    EXPECT_EQ(runner->comm_of(1 - r / 2), nullptr);
    o.collectives = runner;
    Executor ex(g, o);
    Tensor xt = Tensor::full({5}, DType::f32, std::ldexp(1.0, r));  // 1, 2, 4, 8
    ex.bind(x, xt);
    ex.run();
    EXPECT_EQ(ex.get(pair).item(3), r < 2 ? 3.0 : 12.0);
    EXPECT_EQ(ex.get(all).item(4), 2 * 15.0);  // each pair sum counted by both members
  });
}

TEST(CollectiveGroups, ErrorsNameTheNodeAndTheGroup) {
  LocalWorld::run(world(2), [&](Communicator& comm) {
    const int r = comm.rank();
    auto runner =
        std::make_shared<CommCollectiveRunner>(comm, std::vector<std::vector<int>>{{0, 1}, {0}});
    auto run_graph = [&](const std::function<void(Builder&, ValueId)>& add) {
      Graph g;
      Builder b(g);
      ValueId x = b.input("x", {2, 2});
      add(b, x);
      ExecOptions o;
      o.backend = "reference";
      o.collectives = runner;
      Executor ex(g, o);
      ex.bind(x, Tensor::zeros({2, 2}, DType::f32));
      ex.run();
    };
    auto message = [&](const std::function<void(Builder&, ValueId)>& add) {
      try {
        run_graph(add);
      } catch (const ConfigError& e) {
        return std::string(e.what());
      }
      return std::string("no error");
    };
    EXPECT_NE(message([](Builder& b, ValueId x) {
                b.name(b.all_reduce(x, 5), "s");
              }).find("node 's' (all_reduce): group 5 is not one of the 2 groups"),
              std::string::npos);
    if (r == 1) {
      EXPECT_NE(message([](Builder& b, ValueId x) {
                  b.name(b.all_reduce(x, 1), "s");
                }).find("rank 1 of 'world' is not in group 1 (ranks [0])"),
                std::string::npos);
    }
    // Pieces meant for another position in the group (on both ranks).
    const std::string m = message([r](Builder& b, ValueId x) {
      b.name(b.all_gather(x, 0, 0, {2, 2}, 1 - r), "gather");
    });
    EXPECT_NE(m.find(fmt::format(
                  "node 'gather' (all_gather): its pieces are for rank {} of a group of 2", 1 - r)),
              std::string::npos)
        << m;
  });
}

}  // namespace
}  // namespace mt
