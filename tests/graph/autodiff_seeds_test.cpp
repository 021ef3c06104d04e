// Autodiff from seeds (a pipeline stage's backward) and the split of a
// backward into its input-gradient and weight-gradient parts.
//
// The seeded backward of y = tanh(a W) (+ a residual use of a) with incoming
// gradient gy must equal the one-loss backward of L = sum(y * gy) with a
// made a parameter: d L / d y = gy, so both compute the same vector-Jacobian
// product through the same rules. Both run on the reference backend in f64,
// so they agree to rounding (1e-12).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "meshtrain/base/error.h"
#include "meshtrain/exec/executor.h"
#include "meshtrain/graph/autodiff.h"
#include "meshtrain/graph/builder.h"

namespace mt {
namespace {

Tensor random_f64(const Shape& s, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(-1, 1);
  Tensor t = Tensor::empty(s, DType::f64);
  for (int64_t i = 0; i < t.numel(); ++i) t.set_item(i, u(rng));
  return t;
}

double max_diff(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.numel(), b.numel());
  double m = 0;
  for (int64_t i = 0; i < a.numel(); ++i) m = std::max(m, std::abs(a.item(i) - b.item(i)));
  return m;
}

// y = tanh(a W) + a (a [4,3], W [3,3]).
ValueId stage_body(Builder& b, ValueId a, ValueId w) {
  return b.add(b.tanh(b.matmul(a, w)), a);
}

TEST(AutodiffSeeds, SeededBackwardEqualsTheLossOfTheSeededProduct) {
  std::mt19937_64 rng(7);
  const Tensor a_val = random_f64({4, 3}, rng), w_val = random_f64({3, 3}, rng),
               gy_val = random_f64({4, 3}, rng);

  Graph g;
  Builder b(g);
  ValueId a = b.input("a", {4, 3}, DType::f64);
  ValueId gy = b.input("gy", {4, 3}, DType::f64);
  ValueId w = b.param("w", {3, 3}, ParamInit{}, DType::f64);
  ValueId y = stage_body(b, a, w);
  const BackwardSeed seeds[] = {{y, gy}};
  const ValueId wrt[] = {a};
  const std::vector<ValueId> da = build_backward(g, seeds, wrt);
  ASSERT_EQ(da.size(), 1u);
  ASSERT_NE(da[0], kNoValue);
  EXPECT_EQ(g.value(da[0]).name, "grad/a");
  EXPECT_EQ(g.loss(), kNoValue);
  ASSERT_NE(g.grad_of(w), kNoValue);

  Graph twin;
  Builder t(twin);
  ValueId ta = t.param("a", {4, 3}, ParamInit{}, DType::f64);
  ValueId tgy = t.input("gy", {4, 3}, DType::f64);
  ValueId tw = t.param("w", {3, 3}, ParamInit{}, DType::f64);
  ValueId loss = t.sum_to(t.mul(stage_body(t, ta, tw), tgy), Shape{});
  build_backward(twin, loss);

  ExecOptions o;
  o.backend = "reference";
  o.outputs = {da[0]};
  Executor e(g, o);
  e.bind(a, a_val.clone());
  e.bind(gy, gy_val.clone());
  e.bind(w, w_val.clone());
  e.run();
  ExecOptions to;
  to.backend = "reference";
  Executor te(twin, to);
  te.bind(ta, a_val.clone());
  te.bind(tgy, gy_val.clone());
  te.bind(tw, w_val.clone());
  te.run();
  EXPECT_LT(max_diff(e.get(da[0]), te.get(twin.grad_of(ta))), 1e-12);
  EXPECT_LT(max_diff(e.get(g.grad_of(w)), te.get(twin.grad_of(tw))), 1e-12);
}

TEST(AutodiffSeeds, SplitPutsWeightGradientsAfterInputGradients) {
  Graph g;
  Builder b(g);
  ValueId a = b.input("a", {4, 3}, DType::f64);
  ValueId gy = b.input("gy", {4, 3}, DType::f64);
  ValueId w1 = b.param("w1", {3, 3}, ParamInit{}, DType::f64);
  ValueId w2 = b.param("w2", {3, 3}, ParamInit{}, DType::f64);
  ValueId y = b.matmul(b.tanh(b.matmul(a, w1)), w2);
  const BackwardSeed seeds[] = {{y, gy}};
  const ValueId wrt[] = {a};
  const std::vector<ValueId> da = build_backward(g, seeds, wrt);
  const BackwardSplit split = split_backward(g, da);
  auto in = [&](const std::vector<NodeId>& part, ValueId v) {
    return std::find(part.begin(), part.end(), g.value(v).producer) != part.end();
  };
  EXPECT_TRUE(in(split.input_part, da[0]));
  // dW2 = h^T gy and dW1 = a^T dh read what the input part made, and nothing
  // in the input part reads them.
  EXPECT_TRUE(in(split.weight_part, g.grad_of(w1)));
  EXPECT_TRUE(in(split.weight_part, g.grad_of(w2)));
  EXPECT_EQ(split.input_part.size() + split.weight_part.size(),
            static_cast<size_t>(g.num_nodes() - g.num_forward_nodes()));
  for (NodeId n : split.input_part) {
    for (ValueId v : g.node(n).inputs) {
      EXPECT_FALSE(in(split.weight_part, v)) << g.node(n).name << " reads " << g.value(v).name;
    }
  }
  // With no input gradient wanted, everything is weight work.
  EXPECT_TRUE(split_backward(g, {}).input_part.empty());
}

TEST(AutodiffSeeds, BadSeedsAreRejectedNamingTheValue) {
  Graph g;
  Builder b(g);
  ValueId a = b.input("a", {4, 3}, DType::f64);
  ValueId gbad = b.input("gbad", {4, 2}, DType::f64);
  ValueId w = b.param("w", {3, 3}, ParamInit{}, DType::f64);
  ValueId y = b.matmul(a, w);
  const BackwardSeed bad_shape[] = {{y, gbad}};
  try {
    build_backward(g, bad_shape, {});
    FAIL() << "a gradient of the wrong shape was accepted";
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("'gbad' given for '"), std::string::npos) << e.what();
  }
  const BackwardSeed twice[] = {{y, kNoValue}, {y, kNoValue}};
  EXPECT_THROW(build_backward(g, twice, {}), ConfigError);
  const ValueId not_input[] = {w};
  const BackwardSeed one[] = {{y, kNoValue}};
  EXPECT_THROW(build_backward(g, one, not_input), ConfigError);
}

}  // namespace
}  // namespace mt
