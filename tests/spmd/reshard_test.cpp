// Cross-mesh resharding (spmd/reshard.h) on the `local` communicator (ranks
// as threads), 2 to 4 ranks: every pair of layouts (replicated; split on
// dim 0 / dim 1, evenly and by ratios; split with replicas; partial; partial
// and split) between source and destination rank sets that are the same,
// disjoint, overlapping or listed in another order. Each destination piece
// is bitwise the same box of the tensor (addends are small integers, so a
// partial sum is exact in any order), and each rank's byte counter equals
// the plan's bytes for it, whose total is the minimal count computed here
// independently: no element sent twice, none sent to a rank that holds it.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "meshtrain/base/error.h"
#include "meshtrain/comm/backends/local/local_world.h"
#include "meshtrain/spmd/reshard.h"
#include "spmd/reshard_cases.h"

namespace mt {
namespace {

const Shape kShape({12, 12});

using test::layouts;
using test::minimal_bytes;
using test::NamedLayout;
using test::rank_sets;
using test::run_reshard_on_rank;
using test::set_name;

class ReshardLocal : public ::testing::TestWithParam<int> {};

TEST_P(ReshardLocal, EveryPairOfLayoutsIsExactAndSendsTheMinimalBytes) {
  const int world = GetParam();
  int cases = 0;
  for (const std::vector<int>& src_ranks : rank_sets(world)) {
    for (const std::vector<int>& dst_ranks : rank_sets(world)) {
      for (const NamedLayout& fl : layouts(kShape)) {
        for (const NamedLayout& tl : layouts(kShape)) {
          if (tl.source_only) continue;
          const TensorLayout from = fl.make(src_ranks);
          const TensorLayout to = tl.make(dst_ranks);
          const std::string label = fmt::format("{} on {} -> {} on {}", fl.name,
                                                set_name(src_ranks), tl.name, set_name(dst_ranks));
          const ReshardPlan plan = plan_reshard(kShape, DType::f32, from, to);
          EXPECT_EQ(plan.total_bytes(), minimal_bytes(from, to)) << label << "\n"
                                                                 << plan.describe();
          std::mutex mu;
          std::vector<std::string> wrong;
          LocalWorld::run(world, [&](Communicator& comm) {
            std::string w = run_reshard_on_rank(comm, kShape, plan);
            std::lock_guard lock(mu);
            if (!w.empty()) wrong.push_back(w);
          });
          EXPECT_TRUE(wrong.empty()) << label << ": " << wrong.front() << "\n" << plan.describe();
          ++cases;
        }
      }
    }
  }
  std::printf("%d ranks: %d layout pairs\n", world, cases);
}

INSTANTIATE_TEST_SUITE_P(Worlds, ReshardLocal, ::testing::Values(2, 3, 4));

// Load balance and broadcast: a tensor replicated on ranks {0, 1} moved to
// the replicated group {2, 3} leaves the source ranks once (half from
// each), then the group shares it: each destination receives it whole.
TEST(Reshard, ReplicasShareTheSendsAndTheDestinationGroupIsEnteredOnce) {
  const TensorLayout from = TensorLayout::replicated(kShape, {0, 1});
  const TensorLayout to = TensorLayout::replicated(kShape, {2, 3});
  const ReshardPlan plan = plan_reshard(kShape, DType::f32, from, to);
  const uint64_t whole = static_cast<uint64_t>(kShape.numel()) * 4;
  EXPECT_EQ(plan.bytes_sent(0), whole / 2) << plan.describe();
  EXPECT_EQ(plan.bytes_sent(1), whole / 2);
  EXPECT_EQ(plan.bytes_sent(0) + plan.bytes_sent(1), whole);  // once into the group
  EXPECT_EQ(plan.total_bytes(), 2 * whole);
  // A partial source over {0, 1, 2, 3} into a split over {0, 1}: each rank
  // starts one part's reduction (the reduce-scatter's spread).
  const TensorLayout p = TensorLayout::partial_sum(kShape, {0, 1, 2, 3});
  const ReshardPlan rp =
      plan_reshard(kShape, DType::f32, p, TensorLayout::split(kShape, {0, 1}, 0));
  for (int r = 0; r < 4; ++r) EXPECT_GT(rp.bytes_sent(r), 0u) << rp.describe();
}

TEST(Reshard, BadLayoutsAreRejectedNamingTheRankAndBox) {
  const TensorLayout whole = TensorLayout::replicated(kShape, {0});
  TensorLayout outside = whole;
  outside.boxes[0].end[1] = 13;
  try {
    plan_reshard(kShape, DType::f32, outside, whole);
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("[0:12, 0:13] of rank 0"), std::string::npos) << e.what();
  }
  TensorLayout half = TensorLayout::split(kShape, {0, 1}, 0);
  half.ranks.pop_back();
  half.boxes.pop_back();
  try {
    plan_reshard(kShape, DType::f32, half, TensorLayout::replicated(kShape, {1}));
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("[6:12, 0:12]"), std::string::npos) << e.what();
  }
  EXPECT_THROW(plan_reshard(kShape, DType::f32, whole, TensorLayout::partial_sum(kShape, {1})),
               ConfigError);
  EXPECT_THROW(TensorLayout::split(kShape, {0, 1, 2, 3, 4}, 0), ConfigError);  // 12 rows / 5
}

TEST(Reshard, BoxHelpers) {
  const Box a{{0, 0}, {4, 4}}, b{{1, 2}, {3, 6}};
  EXPECT_EQ(intersect_boxes(a, b), (Box{{1, 2}, {3, 4}}));
  int64_t n = 0;
  for (const Box& p : subtract_box(a, b)) {
    EXPECT_EQ(intersect_boxes(p, b).elements(), 0) << p.str();
    n += p.elements();
  }
  EXPECT_EQ(n, 16 - 4);
  const std::vector<Box> parts = split_box(Box{{0, 0}, {3, 10}}, 4);
  ASSERT_EQ(parts.size(), 4u);
  EXPECT_EQ(parts[0], (Box{{0, 0}, {3, 2}}));
  EXPECT_EQ(parts[3], (Box{{0, 7}, {3, 10}}));
  EXPECT_EQ(split_box(Box{{0}, {2}}, 4).size(), 2u);
}

// Stages on different meshes, by hand: stage 0 is a tensor-parallel MLP
// block on ranks {0, 1} (tp = 2: h = tanh(x W1) column-parallel, y = h W2
// row-parallel, y left as a partial sum: no all-reduce), stage 1 a linear
// layer and loss 0.5 |y W3|^2 on rank 2 (tp = 1). The boundary y moves
// through plan_boundary: forward reduced on the way into rank 2, backward
// its gradient from rank 2 into the tp group, entered once. Every rank's
// gradient pieces equal the same boxes of the single-process gradients
// (relative 1e-5: y's sum is split in two), and the bytes each rank sends
// are the plans'.
TEST(Reshard, StagesOnDifferentMeshesExchangeTheBoundaryThroughThePlan) {
  constexpr int64_t B = 4, D = 6, H = 8, O = 5, C = 3;
  auto fill = [](int64_t n, int seed) {
    std::vector<double> v(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = std::sin(0.7 * i + seed) * 0.5;
    return v;
  };
  const std::vector<double> x = fill(B * D, 1), w1 = fill(D * H, 2), w2 = fill(H * O, 3),
                            w3 = fill(O * C, 4);
  // a [n, k] times b [k, m], with column / row windows: a's columns
  // [ka, ka + k) of its `lda`, b's rows [kb, kb + k) and columns [mb, mb + m) of `ldb`.
  auto matmul = [](const std::vector<double>& a, int64_t lda, int64_t ka,
                   const std::vector<double>& b, int64_t ldb, int64_t kb, int64_t mb, int64_t n,
                   int64_t k, int64_t m) {
    std::vector<double> c(static_cast<size_t>(n * m), 0.0);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < m; ++j) {
        double acc = 0;
        for (int64_t q = 0; q < k; ++q) {
          acc += a[static_cast<size_t>(i * lda + ka + q)] *
                 b[static_cast<size_t>((kb + q) * ldb + mb + j)];
        }
        c[static_cast<size_t>(i * m + j)] = acc;
      }
    }
    return c;
  };
  auto transpose = [](const std::vector<double>& a, int64_t n, int64_t m) {
    std::vector<double> t(a.size());
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < m; ++j)
        t[static_cast<size_t>(j * n + i)] = a[static_cast<size_t>(i * m + j)];
    }
    return t;
  };
  // Stage 0 on columns [c0, c0 + hc) of the hidden layer: h, y's addend.
  auto stage0_forward = [&](int64_t c0, int64_t hc, std::vector<double>& h) {
    h = matmul(x, D, 0, w1, H, 0, c0, B, D, hc);
    for (double& v : h) v = std::tanh(v);
    return matmul(h, hc, 0, w2, O, c0, 0, B, hc, O);
  };
  // Stage 0's gradients from dy: dW1's columns and dW2's rows [c0, c0 + hc).
  auto stage0_backward = [&](int64_t c0, int64_t hc, const std::vector<double>& h,
                             const std::vector<double>& dy, std::vector<double>& dw1,
                             std::vector<double>& dw2) {
    dw2 = matmul(transpose(h, B, hc), B, 0, dy, O, 0, 0, hc, B, O);
    const std::vector<double> w2t = transpose(w2, H, O);  // [O, H]
    std::vector<double> dh = matmul(dy, O, 0, w2t, H, 0, c0, B, O, hc);
    for (size_t i = 0; i < dh.size(); ++i) dh[i] *= 1 - h[i] * h[i];
    dw1 = matmul(transpose(x, B, D), B, 0, dh, hc, 0, 0, D, B, hc);
  };
  // Stage 1: dW3 and dy from y.
  auto stage1 = [&](const std::vector<double>& y, std::vector<double>& dw3) {
    const std::vector<double> z = matmul(y, O, 0, w3, C, 0, 0, B, O, C);  // dz = z
    dw3 = matmul(transpose(y, B, O), B, 0, z, C, 0, 0, O, B, C);
    return matmul(z, C, 0, transpose(w3, O, C), O, 0, 0, B, C, O);
  };
  // The single-process reference.
  std::vector<double> h_all, dw1_ref, dw2_ref, dw3_ref;
  const std::vector<double> y_ref = stage0_forward(0, H, h_all);
  const std::vector<double> dy_ref = stage1(y_ref, dw3_ref);
  stage0_backward(0, H, h_all, dy_ref, dw1_ref, dw2_ref);

  const Shape ys({B, O});
  const BoundaryReshard plan = plan_boundary(ys, DType::f64, TensorLayout::partial_sum(ys, {0, 1}),
                                             TensorLayout::replicated(ys, {2}));
  std::mutex mu;
  std::vector<std::string> errors;
  LocalWorld::run(3, [&](Communicator& comm) {
    const int me = comm.rank();
    auto to_tensor = [](const std::vector<double>& v, const Shape& s) {
      Tensor t = Tensor::empty(s, DType::f64);
      std::copy(v.begin(), v.end(), t.data<double>());
      return t;
    };
    auto from_tensor = [](const Tensor& t) {
      return std::vector<double>(t.data<double>(), t.data<double>() + t.numel());
    };
    auto compare = [&](const std::vector<double>& got, const std::vector<double>& want,
                       const std::string& what) {
      double diff = 0, mag = 1e-12;
      for (size_t i = 0; i < want.size(); ++i) {
        diff = std::max(diff, std::abs(got[i] - want[i]));
        mag = std::max(mag, std::abs(want[i]));
      }
      if (got.size() != want.size() || diff / mag > 1e-5) {
        std::lock_guard lock(mu);
        errors.push_back(fmt::format("rank {} {}: relative {}", me, what, diff / mag));
      }
    };
    comm.reset_counters();
    if (me < 2) {
      const int64_t c0 = me * H / 2, hc = H / 2;
      std::vector<double> h, dw1, dw2;
      const Tensor addend = to_tensor(stage0_forward(c0, hc, h), ys);
      Tensor none;
      execute_reshard(comm, plan.forward, addend, none);
      Tensor dy = Tensor::empty(ys, DType::f64);
      execute_reshard(comm, plan.backward, Tensor(), dy);
      stage0_backward(c0, hc, h, from_tensor(dy), dw1, dw2);
      std::vector<double> want1, want2;
      for (int64_t i = 0; i < D; ++i) {
        for (int64_t j = 0; j < hc; ++j)
          want1.push_back(dw1_ref[static_cast<size_t>(i * H + c0 + j)]);
      }
      want2.assign(dw2_ref.begin() + c0 * O, dw2_ref.begin() + (c0 + hc) * O);
      compare(dw1, want1, "dW1 columns");
      compare(dw2, want2, "dW2 rows");
    } else {
      Tensor y = Tensor::empty(ys, DType::f64);
      execute_reshard(comm, plan.forward, Tensor(), y);
      compare(from_tensor(y), y_ref, "y");
      std::vector<double> dw3;
      const Tensor dy = to_tensor(stage1(from_tensor(y), dw3), ys);
      Tensor none;
      execute_reshard(comm, plan.backward, dy, none);
      compare(dw3, dw3_ref, "dW3");
    }
    const uint64_t sent = comm.counters().total_sent();
    const uint64_t want = plan.forward.bytes_sent(me) + plan.backward.bytes_sent(me);
    if (sent != want) {
      std::lock_guard lock(mu);
      errors.push_back(fmt::format("rank {} sent {} bytes, the plans say {}", me, sent, want));
    }
  });
  for (const std::string& e : errors) ADD_FAILURE() << e;
  const uint64_t y_bytes = static_cast<uint64_t>(B * O) * 8;
  // Forward: each half of y reduced by one hop and delivered by one; backward:
  // into the tp group once (rank 2 sends y's size), then passed on once.
  EXPECT_EQ(plan.forward.total_bytes(), 2 * y_bytes) << plan.forward.describe();
  EXPECT_EQ(plan.backward.bytes_sent(2), y_bytes) << plan.backward.describe();
  EXPECT_EQ(plan.backward.total_bytes(), 2 * y_bytes);
}

}  // namespace
}  // namespace mt
