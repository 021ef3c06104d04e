// The bf16 stash pass (graph/bf16_stash.h): forward results unchanged,
// gradients within a bf16 rounding bound of the f32 graph's, a smaller
// activation plan, and the values it must leave alone left alone.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "meshtrain/base/error.h"
#include "meshtrain/exec/executor.h"
#include "meshtrain/graph/bf16_stash.h"
#include "test_models.h"

namespace mt {
namespace {

using testing_models::Model;

// ||a - b||_2 / ||b||_2 (as executor_test.cpp).
double rel_norm_diff(const Tensor& a, const Tensor& b) {
  double d2 = 0, b2 = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double d = a.item(i) - b.item(i);
    d2 += d * d;
    b2 += b.item(i) * b.item(i);
  }
  return b2 > 0 ? std::sqrt(d2 / b2) : std::sqrt(d2);
}

// Runs m (stashed) and m32 (its f32 twin: the same graph before the pass)
// from the same bindings on `backend`. The forward is untouched: the loss
// is bit-identical. The backward reads stashed values rounded to bf16 once
// each (at most u = 2^-8 relative per element) and computes in f32, so the
// gradients drift as in executor_test.cpp's MixedBounds, for the backward
// stages alone: a dot product of length k over rounded operands collects
// errors of random sign, sqrt(k) u relative to a result no larger than one
// term, and `depth` backward matmul stages add in quadrature: sqrt(depth k) u.
// The worst measured is 0.16 of it (the transformer's ln1 gain gradient).
void expect_near_twin(const Model& m, const Model& m32, const char* backend, int depth, int64_t k) {
  const double bound = std::sqrt(static_cast<double>(depth * k)) * std::ldexp(1.0, -8);
  auto bindings = testing_models::random_bindings(m32, 11);
  ExecOptions o;
  o.backend = backend;
  Executor a(m.g, o), b(m32.g, o);
  for (const auto& [id, t] : bindings) {
    a.bind(id, t);
    b.bind(id, t);
  }
  a.run();
  b.run();
  // The fast backend's per-shape engine trials may run a product on another
  // engine in each executor (float-rounding apart); the reference is exact.
  if (std::string(backend) == "reference") {
    EXPECT_EQ(a.get(m.loss).item(), b.get(m32.loss).item());
  } else {
    EXPECT_NEAR(a.get(m.loss).item(), b.get(m32.loss).item(), 1e-5 * b.get(m32.loss).item());
  }
  int differ = 0;
  for (const auto& [p, gv] : m.g.grads()) {
    const Tensor g = a.get(gv), g32 = b.get(m32.g.grad_of(p));
    ASSERT_EQ(m.g.value(gv).dtype, DType::f32);
    const double d = rel_norm_diff(g, g32);
    EXPECT_LE(d, bound) << backend << " gradient of " << m.g.value(p).name;
    differ += d > 0 ? 1 : 0;
  }
  // The stash was rounded: some gradient moved (else the test proves nothing).
  EXPECT_GT(differ, 0) << backend;
}

int count_dtype(const Graph& g, DType t) {
  int n = 0;
  for (ValueId v = 0; v < g.num_values(); ++v) n += g.value(v).dtype == t ? 1 : 0;
  return n;
}

TEST(Bf16Stash, MlpGradientsWithinBf16BoundOfF32Twin) {
  // Three matmul stages; longest dot product 64 (the batch, in the weight
  // gradients).
  const Model m32 = testing_models::mlp(64, {48, 40, 36, 5}, /*gelu=*/true);
  Model m = testing_models::mlp(64, {48, 40, 36, 5}, true);
  const Bf16StashReport r = stash_in_bf16(m.g, Bf16StashOptions{0});
  // Per hidden layer: the bias add's output (gelu's gradient reads it) and
  // gelu's output (the next matmul's weight gradient reads it). The logits
  // are read by the loss, the last forward node: left in f32.
  EXPECT_EQ(r.stashed.size(), 4u) << r.describe();
  EXPECT_EQ(r.skipped_live, 1) << r.describe();
  EXPECT_EQ(count_dtype(m.g, DType::bf16), 4);
  for (ValueId v : r.stashed) EXPECT_NE(v, m.logits);
  for (const char* backend : {"reference", "fast"}) expect_near_twin(m, m32, backend, 3, 64);
}

TEST(Bf16Stash, TransformerGradientsWithinBf16BoundOfF32Twin) {
  // Longest matmul path 7 (q/k/v, scores, p @ v, projection, MLP in and out,
  // head); longest dot product 16 (the MLP's width 2C).
  const Model m32 = testing_models::tiny_transformer(DType::f32);
  Model m = testing_models::tiny_transformer(DType::f32);
  const Bf16StashReport r = stash_in_bf16(m.g, Bf16StashOptions{0});
  EXPECT_GE(r.stashed.size(), 8u) << r.describe();
  // Only f32 values are stashed (the i32 ids and labels never are).
  for (ValueId v : r.stashed) EXPECT_EQ(m.g.value(v).dtype, DType::f32);
  for (const char* backend : {"reference", "fast"}) expect_near_twin(m, m32, backend, 7, 16);
}

TEST(Bf16Stash, ActivationPlanShrinksAndSmallValuesStay) {
  // Six hidden layers of 512 at batch 128 (the README's MLP is two deep).
  const std::vector<int64_t> widths = {784, 512, 512, 512, 512, 512, 512, 10};
  const Model m32 = testing_models::mlp(128, widths);
  Model m = testing_models::mlp(128, widths);
  const Bf16StashReport r = stash_in_bf16(m.g);      // default min_bytes
  ASSERT_EQ(r.stashed.size(), 12u) << r.describe();  // per layer: bias add and relu outputs
  // Gradients in caller memory, as the trainer binds them (without ZeRO or
  // accumulation): the arena's peak is then the stash at the boundary.
  const ExecOptions o;
  const int64_t before = plan_memory(m32.g, o, GradMemory::bound).arena_bytes;
  const int64_t after = plan_memory(m.g, o, GradMemory::bound).arena_bytes;
  // At the boundary the f32 stash (r.f32_bytes) takes half as many bytes;
  // the backward then widens one layer's two values (2 of the 12) back to
  // f32 while it works on them, so the peak falls by at least
  // f32_bytes / 2 - 2/12 f32_bytes = f32_bytes / 3.
  EXPECT_LE(after, before - r.f32_bytes / 3) << before << " -> " << after << "; " << r.describe();

  // A value below min_bytes stays f32.
  Model small = testing_models::mlp(4, {8, 6, 3});
  const Bf16StashReport rs = stash_in_bf16(small.g);
  EXPECT_TRUE(rs.stashed.empty());
  EXPECT_GT(rs.skipped_small, 0);
  EXPECT_EQ(count_dtype(small.g, DType::bf16), 0);

  // A forward-only graph is left as it is.
  Model fwd = testing_models::mlp(128, {784, 512, 10}, false, /*differentiate=*/false);
  const int nodes = fwd.g.num_nodes();
  EXPECT_TRUE(stash_in_bf16(fwd.g).stashed.empty());
  EXPECT_EQ(fwd.g.num_nodes(), nodes);
}

TEST(Bf16Stash, GraphRewritesCheckTheirInput) {
  Model m = testing_models::mlp(4, {8, 6, 3});
  std::vector<NodeId> order;
  for (NodeId i = m.g.num_nodes() - 1; i >= 0; --i) order.push_back(i);
  EXPECT_THROW(m.g.reorder_nodes(order), InternalError);
  // Nothing changed: the graph still runs.
  for (NodeId i = 0; i < m.g.num_nodes(); ++i) order[static_cast<size_t>(i)] = i;
  m.g.reorder_nodes(order);
  EXPECT_THROW(m.g.replace_input(m.g.num_nodes() - 1, 0, m.labels), ShapeError);
}

}  // namespace
}  // namespace mt
