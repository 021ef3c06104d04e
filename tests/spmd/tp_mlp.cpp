// The tensor-parallel MLP (Megatron's MLP block, by hand):
//
//   single process:  h0 = relu(x W0 + b0); h1 = gelu(h0 W1 + b1);
//                    loss = cross_entropy(h1 W2 + b2, labels)
//   rank r of n:     h0 = relu(x W0 + b0)                  (replicated)
//                    a  = f(h0)                            (copy_to_group)
//                    h1 = gelu(a W1[:, cols r] + b1[cols r])   column-parallel
//                    s  = g(h1 W2[rows r, :])              (reduce_from_group)
//                    loss = cross_entropy(s + b2, labels)  (replicated)
//
// W0 sits before f so that f's backward (an all-reduce of dh0) decides dW0
// and db0: without it no gradient would flow through f. Every rank also
// builds the single-process graph and runs it on the same batch, as the DP
// equivalence tests do.
//
// Tolerance. Both runs compute in f32 on the reference backend. They differ
// only in the order of two sums: fc2's contraction over the hidden width
// K = 12 (n partial sums, added by g's all-reduce) and dh0's contraction
// over K (added by f's backward all-reduce). Re-associating a sum of K f32
// terms changes it by at most 2 K u sum|terms| (u = 2^-24), 1.4e-6 relative
// to the magnitudes summed; everything downstream inherits that relative
// error, and SGD carries each step's into the next, so after 10 steps the
// bound is about 10 x 1.4e-6 = 1.4e-5. Checked: |tp - single| <= 2e-5 x
// max|single| over each tensor (loss: 2e-5 x |loss|). A wrong rule (a
// missing all-reduce, a wrong piece) is off by O(1) of the values.
#include "tp_mlp.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/base/random.h"
#include "meshtrain/exec/executor.h"
#include "meshtrain/graph/autodiff.h"
#include "meshtrain/graph/builder.h"
#include "meshtrain/graph/collective.h"
#include "meshtrain/graph/cost.h"
#include "meshtrain/spmd/collective_runner.h"

namespace mt::test {

namespace {

constexpr int64_t kN = 8, kD = 6, kH0 = 10, kH = 12, kC = 5;
constexpr int kSteps = 10;
constexpr double kLr = 0.2;
constexpr double kRel = 2e-5;

// The full parameters, row-major f32, drawn once from a fixed seed.
struct Params {
  std::map<std::string, Tensor> t;
};

Tensor randn(Rng& rng, const Shape& s, double scale) {
  Tensor t = Tensor::empty(s, DType::f32);
  for (int64_t i = 0; i < t.numel(); ++i) t.set_item(i, scale * (2 * rng.uniform() - 1));
  return t;
}

Params full_params() {
  Rng rng(1234);
  Params p;
  p.t["w0"] = randn(rng, {kD, kH0}, 0.6);
  p.t["b0"] = randn(rng, {kH0}, 0.1);
  p.t["w1"] = randn(rng, {kH0, kH}, 0.5);
  p.t["b1"] = randn(rng, {kH}, 0.1);
  p.t["w2"] = randn(rng, {kH, kC}, 0.5);
  p.t["b2"] = randn(rng, {kC}, 0.1);
  return p;
}

// Columns [c0, c0 + nc) of a [rows, cols] matrix (or a slice of a vector).
Tensor columns(const Tensor& m, int64_t c0, int64_t nc) {
  const int64_t rows = m.rank() == 1 ? 1 : m.shape().dims()[0];
  const int64_t cols = m.shape().dims().back();
  Tensor out = Tensor::empty(m.rank() == 1 ? Shape{nc} : Shape{rows, nc}, DType::f32);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < nc; ++c) out.set_item(r * nc + c, m.item(r * cols + c0 + c));
  }
  return out;
}

Tensor rows(const Tensor& m, int64_t r0, int64_t nr) {
  const int64_t cols = m.shape().dims()[1];
  Tensor out = Tensor::empty({nr, cols}, DType::f32);
  for (int64_t i = 0; i < nr * cols; ++i) out.set_item(i, m.item(r0 * cols + i));
  return out;
}

struct Program {
  Graph g;
  ValueId x = kNoValue, labels = kNoValue, loss = kNoValue;
  std::map<std::string, ValueId> param;
};

Program build(int64_t hidden, bool tp) {
  Program p;
  Builder b(p.g);
  auto param = [&](const std::string& name, const Shape& s) {
    return p.param[name] = b.param(name, s, ParamInit{});
  };
  p.x = b.input("x", {kN, kD});
  p.labels = b.input("labels", {kN}, DType::i32);
  ValueId h0 = b.relu(b.add(b.matmul(p.x, param("w0", {kD, kH0})), param("b0", {kH0})));
  ValueId a = tp ? b.copy_to_group(h0, 0) : h0;
  ValueId h1 = b.gelu(b.add(b.matmul(a, param("w1", {kH0, hidden})), param("b1", {hidden})));
  ValueId s = b.matmul(h1, param("w2", {hidden, kC}));
  if (tp) s = b.reduce_from_group(s, 0);
  p.loss = b.cross_entropy(b.add(s, param("b2", {kC})), p.labels);
  build_backward(p.g, p.loss);
  return p;
}

// max |a - b| over max |b|, and the check.
void expect_close(const Tensor& got, const Tensor& want, const std::string& what, double& worst) {
  ASSERT_EQ(got.numel(), want.numel()) << what;
  double diff = 0, mag = 0;
  for (int64_t i = 0; i < want.numel(); ++i) {
    diff = std::max(diff, std::abs(got.item(i) - want.item(i)));
    mag = std::max(mag, std::abs(want.item(i)));
  }
  EXPECT_LE(diff, kRel * mag) << what << ": max |tp - single| " << diff << ", max |single| " << mag;
  if (mag > 0) worst = std::max(worst, diff / mag);
}

}  // namespace

void check_tp_mlp(Communicator& world) {
  const int n = world.size(), r = world.rank();
  ASSERT_EQ(kH % n, 0) << "the hidden width must divide over the ranks";
  const int64_t hr = kH / n;

  Params full = full_params();
  Params shard;
  shard.t["w0"] = full.t["w0"].clone();
  shard.t["b0"] = full.t["b0"].clone();
  shard.t["w1"] = columns(full.t["w1"], r * hr, hr);
  shard.t["b1"] = columns(full.t["b1"], r * hr, hr);
  shard.t["w2"] = rows(full.t["w2"], r * hr, hr);
  shard.t["b2"] = full.t["b2"].clone();

  Program single = build(kH, false), tp = build(hr, true);
  ExecOptions o;
  o.backend = "reference";
  o.profile = false;
  Executor ex_single(single.g, o);
  std::vector<int> everyone;
  for (int q = 0; q < n; ++q) everyone.push_back(q);
  auto runner =
      std::make_shared<CommCollectiveRunner>(world, std::vector<std::vector<int>>{everyone});
  o.collectives = runner;
  Executor ex_tp(tp.g, o);
  for (auto& [name, v] : single.param) ex_single.bind(v, full.t[name]);
  for (auto& [name, v] : tp.param) ex_tp.bind(v, shard.t[name]);

  double worst = 0;
  for (int step = 0; step < kSteps; ++step) {
    Rng data(Rng::derive(99, fmt::format("step{}", step)));
    Tensor x = randn(data, {kN, kD}, 1.0);
    Tensor labels = Tensor::empty({kN}, DType::i32);
    for (int64_t i = 0; i < kN; ++i) labels.set_item(i, static_cast<double>(data.next() % kC));
    for (Executor* ex : {&ex_single, &ex_tp}) {
      Program& p = ex == &ex_single ? single : tp;
      ex->bind(p.x, x);
      ex->bind(p.labels, labels);
      ex->run();
    }
    const std::string at = fmt::format("rank {} step {}", r, step);
    const double loss = ex_single.get(single.loss).item();
    const double loss_tp = ex_tp.get(tp.loss).item();
    EXPECT_LE(std::abs(loss_tp - loss), kRel * std::abs(loss))
        << at << ": loss " << loss_tp << " vs single " << loss;
    worst = std::max(worst, std::abs(loss_tp - loss) / std::abs(loss));

    std::map<std::string, Tensor> g_full, g_tp;
    for (auto& [name, v] : single.param) g_full[name] = ex_single.get(single.g.grad_of(v)).clone();
    for (auto& [name, v] : tp.param) g_tp[name] = ex_tp.get(tp.g.grad_of(v)).clone();
    expect_close(g_tp["w0"], g_full["w0"], at + " grad w0", worst);
    expect_close(g_tp["b0"], g_full["b0"], at + " grad b0", worst);
    expect_close(g_tp["w1"], columns(g_full["w1"], r * hr, hr), at + " grad w1 (columns)", worst);
    expect_close(g_tp["b1"], columns(g_full["b1"], r * hr, hr), at + " grad b1 (slice)", worst);
    expect_close(g_tp["w2"], rows(g_full["w2"], r * hr, hr), at + " grad w2 (rows)", worst);
    expect_close(g_tp["b2"], g_full["b2"], at + " grad b2", worst);

    // SGD, in place on the bound parameters.
    for (auto* set : {&full, &shard}) {
      auto& grads = set == &full ? g_full : g_tp;
      for (auto& [name, t] : set->t) {
        for (int64_t i = 0; i < t.numel(); ++i) {
          t.set_item(i, static_cast<float>(t.item(i) - kLr * grads[name].item(i)));
        }
      }
    }
  }
  double w_final = 0;
  expect_close(shard.t["w1"], columns(full.t["w1"], r * hr, hr), "final w1", w_final);
  expect_close(shard.t["w2"], rows(full.t["w2"], r * hr, hr), "final w2", w_final);
  expect_close(shard.t["w0"], full.t["w0"], "final w0", w_final);
  if (r == 0) {
    std::printf(
        "tp_mlp: %d ranks, %d steps: largest |tp - single| / max|single| %.3g (bound %.1g)\n", n,
        kSteps, std::max(worst, w_final), kRel);
  }

  // The group communicator moved exactly what the operators' cost facts say:
  // payload bytes from graph/cost.h, wire bytes from the runner's cost_of()
  // (comm's cost function of the algorithm the communicator picks).
  uint64_t payload = 0, sent = 0, received = 0, calls = 0;
  for (const Node& node : tp.g.nodes()) {
    if (!communicates(node.op)) continue;
    ++calls;
    payload += static_cast<uint64_t>(op_cost(tp.g, node).comm_bytes);
    const CollectiveCost c = runner->cost_of(tp.g, node);
    sent += c.bytes_sent;
    received += c.bytes_received;
  }
  EXPECT_EQ(calls, 2u);  // g forward, f's backward (a g); x needs no gradient
  const CommCounters counters = runner->comm_of(0)->counters();
  ASSERT_EQ(counters.by_collective.count("all_reduce"), 1u) << counters.to_json();
  const CollectiveCounter& ar = counters.by_collective.at("all_reduce");
  EXPECT_EQ(ar.calls, kSteps * calls);
  EXPECT_EQ(ar.payload_bytes, kSteps * payload);
  EXPECT_EQ(ar.payload_bytes, static_cast<uint64_t>(kSteps * 4 * (kN * kC + kN * kH0)));
  EXPECT_EQ(ar.bytes_sent, kSteps * sent);
  EXPECT_EQ(ar.bytes_received, kSteps * received);
  EXPECT_GT(ar.bytes_sent, 0u);
}

}  // namespace mt::test
