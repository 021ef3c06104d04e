// The executor: memory reuse, planned == allocated, gradient-ready callbacks,
// recomputation, backends agreeing, binding errors, profiling.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "meshtrain/exec/executor.h"
#include "meshtrain/graph/cost.h"
#include "meshtrain/tensor/kernels.h"
#include "test_models.h"

namespace mt {
namespace {

using testing_models::Model;

ExecOptions reference_opts() {
  ExecOptions o;
  o.backend = "reference";
  return o;
}

void bind_all(Executor& ex, const std::map<ValueId, Tensor>& b) {
  for (const auto& [id, t] : b) ex.bind(id, t);
}

// Largest |a - b| / max(1, |b|) over all elements.
double max_rel_diff(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.shape(), b.shape());
  double worst = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    worst = std::max(worst, std::fabs(a.item(i) - b.item(i)) / std::max(1.0, std::fabs(b.item(i))));
  }
  return worst;
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() &&
         std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

TEST(Executor, ChainOfOpsReusesMemory) {
  // 12 element-wise ops over 256 KiB tensors: only an input and an output
  // buffer need to be alive at any time.
  Graph g;
  Builder b(g);
  ValueId x = b.input("x", {256, 256});
  ValueId h = x;
  for (int i = 0; i < 12; ++i) h = (i % 2) ? b.tanh(h) : b.scale(h, 0.5);
  Executor ex(g, reference_opts());
  const MemoryPlan& p = ex.memory_plan();
  const int64_t one = 256 * 256 * 4;
  EXPECT_EQ(p.unplanned_bytes, 12 * one);
  EXPECT_EQ(p.arena_bytes, 2 * one);
  Tensor xt = Tensor::full({256, 256}, DType::f32, 1.0);
  ex.bind(x, xt);
  ex.run();
  // The result is right despite the reuse: (((1 * .5) tanh) * .5) tanh ...
  double want = 1.0;
  for (int i = 0; i < 12; ++i) want = (i % 2) ? std::tanh(want) : want * 0.5;
  Tensor y = ex.get(h);
  EXPECT_NEAR(y.item(0), want, 1e-6);
  EXPECT_NEAR(y.item(y.numel() - 1), want, 1e-6);
}

TEST(Executor, PlannedArenaIsTheAllocatedArena) {
  Model m = testing_models::tiny_transformer(DType::f32);
  Executor ex(m.g, reference_opts());
  EXPECT_EQ(ex.allocated_arena_bytes(), 0);
  bind_all(ex, testing_models::random_bindings(m, 1));
  ex.run();
  const MemoryPlan& p = ex.memory_plan();
  EXPECT_GT(p.arena_bytes, 0);
  EXPECT_EQ(ex.allocated_arena_bytes(), p.arena_bytes);
  EXPECT_LT(p.arena_bytes, p.unplanned_bytes);
  for (ValueId v = 0; v < m.g.num_values(); ++v) {
    const Value& val = m.g.value(v);
    const int64_t off = p.offset[static_cast<size_t>(v)];
    if (val.role == ValueRole::input || val.role == ValueRole::param) {
      EXPECT_EQ(off, -1);
    }
    if (off >= 0) {
      EXPECT_LE(off + val.shape.numel() * static_cast<int64_t>(dtype_size(val.dtype)),
                p.arena_bytes)
          << val.name;
    }
  }
  int64_t params = 0;
  for (ValueId v : m.g.params()) params += m.g.value(v).shape.numel() * 4;
  EXPECT_EQ(p.param_bytes, params);
  EXPECT_EQ(p.grad_bytes, params);
}

TEST(Executor, BindingGradientsMovesThemOutOfTheArena) {
  Model m = testing_models::mlp(16, {32, 64, 64, 10});
  auto bindings = testing_models::random_bindings(m, 2);
  Executor planned(m.g, reference_opts());
  bind_all(planned, bindings);
  planned.run();
  const int64_t arena_unbound = planned.memory_plan().arena_bytes;

  Executor bound(m.g, reference_opts());
  bind_all(bound, bindings);
  std::map<ValueId, Tensor> grads;
  for (const auto& [p, gv] : m.g.grads()) {
    grads[p] = Tensor::zeros(m.g.value(gv).shape, DType::f32);
    bound.bind(gv, grads[p]);
  }
  bound.run();
  EXPECT_LT(bound.memory_plan().arena_bytes, arena_unbound);
  EXPECT_EQ(bound.allocated_arena_bytes(), bound.memory_plan().arena_bytes);
  EXPECT_EQ(bound.memory_plan().offset[static_cast<size_t>(m.g.grad_of(m.g.params()[0]))], -1);
  for (const auto& [p, t] : grads) {
    EXPECT_TRUE(bitwise_equal(t, planned.get(m.g.grad_of(p)))) << m.g.value(p).name;
  }
}

TEST(Executor, GradReadyFiresInReverseLayerOrderWithFinishedGradients) {
  Model m = testing_models::mlp(8, {6, 12, 12, 4});
  Executor ex(m.g, reference_opts());
  bind_all(ex, testing_models::random_bindings(m, 3));
  std::vector<std::string> order;
  std::map<ValueId, Tensor> at_callback;
  ex.on_grad_ready([&](ValueId p) {
    order.push_back(m.g.value(p).name);
    at_callback[p] = ex.get(m.g.grad_of(p)).clone();
  });
  ex.run();
  EXPECT_EQ(order,
            (std::vector<std::string>{"fc3.b", "fc3.w", "fc2.b", "fc2.w", "fc1.b", "fc1.w"}));
  for (const auto& [p, t] : at_callback) {
    EXPECT_TRUE(bitwise_equal(t, ex.get(m.g.grad_of(p)))) << m.g.value(p).name;
  }
  order.clear();
  ex.run_forward();
  EXPECT_TRUE(order.empty());
  ex.run();
  EXPECT_EQ(order.size(), 6u);
}

TEST(Executor, RecomputationSavesMemoryAndGivesIdenticalResults) {
  for (bool transformer : {false, true}) {
    Model m = transformer ? testing_models::tiny_transformer(DType::f32)
                          : testing_models::mlp(256, {32, 64, 64, 64, 10}, /*gelu=*/true);
    auto bindings = testing_models::random_bindings(m, 4);
    ExecOptions plain = reference_opts();
    ExecOptions rec = plain;
    rec.recompute = true;
    Executor a(m.g, plain);
    Executor b(m.g, rec);
    bind_all(a, bindings);
    bind_all(b, bindings);
    // Gradients in caller memory, as a trainer binds them: the arena then
    // holds activations only.
    std::map<ValueId, Tensor> ga, gb;
    for (const auto& [p, gv] : m.g.grads()) {
      ga[p] = Tensor::zeros(m.g.value(gv).shape, DType::f32);
      gb[p] = Tensor::zeros(m.g.value(gv).shape, DType::f32);
      a.bind(gv, ga[p]);
      b.bind(gv, gb[p]);
    }
    a.run();
    b.run();
    const MemoryPlan& pa = a.memory_plan();
    const MemoryPlan& pb = b.memory_plan();
    EXPECT_LT(pb.arena_bytes, pa.arena_bytes) << (transformer ? "transformer" : "mlp");
    EXPECT_GT(pb.recompute_steps, 0);
    EXPECT_GT(pb.recompute_flops, 0);
    EXPECT_EQ(pa.recompute_steps, 0);
    EXPECT_EQ(b.allocated_arena_bytes(), pb.arena_bytes);
    EXPECT_TRUE(bitwise_equal(a.get(m.loss), b.get(m.loss)));
    for (const auto& [p, t] : ga) {
      EXPECT_TRUE(bitwise_equal(t, gb.at(p))) << m.g.value(p).name;
    }
    // Recomputation steps show up in the profile under their own names.
    int rec_entries = 0;
    for (const OpProfile& op : b.profile()) {
      if (op.name.rfind("recompute/", 0) == 0) {
        ++rec_entries;
        EXPECT_EQ(op.calls, 1) << op.name;
      }
    }
    EXPECT_EQ(rec_entries, pb.recompute_steps);
  }
}

TEST(Executor, FastBackendMatchesReference) {
  ASSERT_NE(kernels("fast").name(), kernels("reference").name());
  for (bool transformer : {false, true}) {
    Model m = transformer ? testing_models::tiny_transformer(DType::f32)
                          : testing_models::mlp(32, {20, 48, 48, 10});
    auto bindings = testing_models::random_bindings(m, 5);
    ExecOptions fast_opts;
    fast_opts.backend = "fast";
    Executor ref(m.g, reference_opts());
    Executor fast(m.g, fast_opts);
    bind_all(ref, bindings);
    bind_all(fast, bindings);
    ref.run();
    fast.run();
    const char* which = transformer ? "transformer" : "mlp";
    EXPECT_LE(max_rel_diff(fast.get(m.loss), ref.get(m.loss)), 1e-5) << which;
    for (const auto& [p, gv] : m.g.grads()) {
      EXPECT_LE(max_rel_diff(fast.get(gv), ref.get(gv)), 1e-5) << which << " " << m.g.value(p).name;
    }
  }
}

// ||a - b||_2 / ||b||_2: the difference relative to the tensor's own size
// (element-wise ratios blow up on the tensor's near-zero entries).
double rel_norm_diff(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.shape(), b.shape());
  double d2 = 0, b2 = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double d = a.item(i) - b.item(i);
    d2 += d * d;
    b2 += b.item(i) * b.item(i);
  }
  return b2 > 0 ? std::sqrt(d2 / b2) : std::sqrt(d2);
}

// How far a mixed-precision run may drift from its f32 twin, per tensor,
// relative to the tensor's size. Derivation (errors of random sign, which add
// in quadrature):
// - Rounding to the 16-bit compute dtype moves a value by at most u relative:
//   u = 2^-8 for bf16 (8 significant bits), 2^-11 for f16 (11).
// - A dot product of length k over rounded operands collects k such errors,
//   each at most ~u times a term: ~sqrt(k) u times a term. Relative to the
//   result that is sqrt(k) u when the result is no larger than one term --
//   the worst case here, a bias gradient summing the batch with
//   cancellation. k is the longest dot product (a width, or the batch).
// - Successive stages add their errors in quadrature too: after s matmul
//   stages a tensor is off by sqrt(s k) u. A gradient follows the forward
//   path and as many backward stages: s = 2 depth (depth = matmul stages on
//   the longest forward path).
// - The loss is a mean over `rows` rows (tokens or samples) whose errors,
//   each within the forward path's sqrt(depth k) u of a row's loss, are
//   independent: sqrt(depth k / rows) u.
// - After a few plain SGD steps a parameter has moved by lr times the sum of
//   its gradients; their errors do not grow faster than the sum, and the two
//   runs' trajectories part only to second order, so the movement takes the
//   gradient bound.
// The worst measured (both models, bf16 and f16, both backends) is 0.4 of
// the gradient bound, 0.3 of the movement's and 0.15 of the loss's.
struct MixedBounds {
  double u;
  int depth;
  int64_t k;
  int64_t rows;
  double grad() const { return std::sqrt(static_cast<double>(2 * depth * k)) * u; }
  double loss() const { return std::sqrt(static_cast<double>(depth * k) / rows) * u; }
  double update() const { return grad(); }
};

double unit_roundoff(DType t) {
  return t == DType::bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
}

// Runs the mixed-precision graph m (compute `compute`) on both backends and
// its f32 twin m32 on the reference, from the same inputs and parameters
// (matched by name), for kSteps plain SGD steps on f32 master parameters.
// Checks at every step the loss and every parameter gradient (which must be
// f32), and after the last step every parameter's movement, against the f32
// run within `bounds`. Returns each backend's first-step gradients by name.
std::map<std::string, std::map<std::string, Tensor>> expect_near_f32_run(
    const Model& m, const Model& m32, uint64_t seed, DType compute, const MixedBounds& bounds) {
  constexpr int kSteps = 3;
  constexpr double kLr = 0.1;
  std::map<std::string, std::map<std::string, Tensor>> first_grads;
  for (const char* backend : {"reference", "fast"}) {
    auto bindings32 = testing_models::random_bindings(m32, seed);
    std::map<ValueId, Tensor> bindings;  // copies, by name in m's graph
    for (const auto& [id, t] : bindings32) bindings[*m.g.find(m32.g.value(id).name)] = t.clone();
    std::map<std::string, Tensor> start;
    for (ValueId p : m32.g.params()) start[m32.g.value(p).name] = bindings32.at(p).clone();
    ExecOptions o;
    o.backend = backend;
    Executor exact(m32.g, reference_opts()), ex(m.g, o);
    for (int step = 0; step < kSteps; ++step) {
      bind_all(exact, bindings32);
      bind_all(ex, bindings);
      exact.run();
      ex.run();
      const std::string at = fmt::format("{} {} step {}", backend, dtype_name(compute), step);
      const double l = ex.get(m.loss).item(), l32 = exact.get(m32.loss).item();
      EXPECT_LE(std::fabs(l - l32) / std::fabs(l32), bounds.loss())
          << at << " loss " << l << " vs f32 " << l32;
      for (const auto& [p, gv] : m.g.grads()) {
        const std::string& name = m.g.value(p).name;
        EXPECT_EQ(m.g.value(gv).dtype, DType::f32) << name;
        const ValueId p32 = *m32.g.find(name);
        const Tensor g = ex.get(gv), g32 = exact.get(m32.g.grad_of(p32));
        EXPECT_LE(rel_norm_diff(g, g32), bounds.grad()) << at << " gradient of " << name;
        if (step == 0) first_grads[backend][name] = g.clone();
        // Plain SGD on the f32 masters of both runs.
        Tensor& w = bindings.at(p);
        Tensor& w32 = bindings32.at(p32);
        for (int64_t i = 0; i < w.numel(); ++i) {
          w.set_item(i, w.item(i) - kLr * g.item(i));
          w32.set_item(i, w32.item(i) - kLr * g32.item(i));
        }
      }
    }
    for (ValueId p32 : m32.g.params()) {
      const std::string& name = m32.g.value(p32).name;
      Tensor moved = bindings.at(*m.g.find(name)).clone(), moved32 = bindings32.at(p32).clone();
      for (int64_t i = 0; i < moved.numel(); ++i) {
        moved.set_item(i, moved.item(i) - start.at(name).item(i));
        moved32.set_item(i, moved32.item(i) - start.at(name).item(i));
      }
      EXPECT_LE(rel_norm_diff(moved, moved32), bounds.update())
          << backend << " " << dtype_name(compute) << ": " << name << " after " << kSteps
          << " steps";
    }
  }
  return first_grads;
}

TEST(Executor, MixedPrecisionTransformerRunsOnBothBackends) {
  // Longest matmul path: q/k/v, scores, p @ v, output projection, MLP in and
  // out, tied head = 7; longest dot product: the MLP's 2C = 16; 8 tokens.
  for (DType t : {DType::bf16, DType::f16}) {
    expect_near_f32_run(testing_models::tiny_transformer(t),
                        testing_models::tiny_transformer(DType::f32), 6, t,
                        MixedBounds{unit_roundoff(t), 7, 16, 8});
  }
}

TEST(Executor, SixteenBitActivationsMatchF32OnBothBackends) {
  // Hidden activations (bias add, gelu and their gradients) in 16 bits; the
  // parameter gradients come out f32 and near the all-f32 run's. Three
  // matmul stages; longest dot product 24 (a width; the batch is 16 rows).
  for (DType t : {DType::bf16, DType::f16}) {
    Model m = testing_models::mlp(16, {12, 24, 20, 5}, /*gelu=*/true, true, t);
    int narrow_values = 0;
    for (ValueId v = 0; v < m.g.num_values(); ++v) narrow_values += m.g.value(v).dtype == t;
    EXPECT_GT(narrow_values, 10);
    const MixedBounds bounds{unit_roundoff(t), 3, 24, 16};
    auto grads =
        expect_near_f32_run(m, testing_models::mlp(16, {12, 24, 20, 5}, true), 8, t, bounds);
    // Fast and reference round the same f32 results: each is within the
    // bound of the other too.
    for (const auto& [name, g] : grads["fast"]) {
      EXPECT_LE(rel_norm_diff(g, grads["reference"][name]), bounds.grad()) << name;
    }
  }
}

TEST(Executor, UnboundInputIsAClearError) {
  Model m = testing_models::mlp(4, {3, 5, 2});
  Executor ex(m.g, reference_opts());
  auto bindings = testing_models::random_bindings(m, 7);
  for (const auto& [id, t] : bindings) {
    if (id != m.x) ex.bind(id, t);
  }
  try {
    ex.run();
    FAIL() << "run() with an unbound input";
  } catch (const ConfigError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("unbound input 'x' (f32[4, 3])"), std::string::npos) << msg;
  }
  Executor ex2(m.g, reference_opts());
  ex2.bind(m.x, bindings.at(m.x));
  try {
    ex2.run_forward();
    FAIL() << "run_forward() with unbound parameters";
  } catch (const ConfigError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("parameter 'fc1.w' (f32[3, 5])"), std::string::npos) << msg;
    EXPECT_NE(msg.find("input 'labels' (i32[4])"), std::string::npos) << msg;
  }
}

TEST(Executor, BindAndGetErrorsNameTheValue) {
  Model m = testing_models::mlp(4, {3, 5, 2});
  Executor ex(m.g, reference_opts());
  try {
    ex.bind(m.x, Tensor::zeros({4, 2}, DType::f32));
    FAIL();
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("bind 'x': expected f32[4, 3], got f32[4, 2]"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(ex.bind(m.logits, Tensor::zeros({4, 2}, DType::f32)), ConfigError);
  bind_all(ex, testing_models::random_bindings(m, 8));
  ex.run();
  try {
    ex.get(m.logits);  // not kept: its memory is reused
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("ExecOptions::outputs"), std::string::npos) << e.what();
  }
  ex.run_forward();
  EXPECT_THROW(ex.get(m.g.grad_of(m.g.params()[0])), ConfigError);  // stale after run_forward

  ExecOptions o = reference_opts();
  o.outputs = {m.logits};
  Executor with_logits(m.g, o);
  bind_all(with_logits, testing_models::random_bindings(m, 8));
  with_logits.run();
  EXPECT_EQ(with_logits.get(m.logits).shape(), (Shape{4, 2}));
}

TEST(Executor, KernelErrorsNameTheNode) {
  Model m = testing_models::mlp(4, {3, 5, 2});
  Executor ex(m.g, reference_opts());
  auto bindings = testing_models::random_bindings(m, 9);
  bindings.at(m.labels).data<int32_t>()[1] = 7;  // only 2 classes
  bind_all(ex, bindings);
  try {
    ex.run();
    FAIL();
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("node 'loss' (cross_entropy)"), std::string::npos)
        << e.what();
  }
}

TEST(Executor, ForwardOnlyGraphKeepsItsResults) {
  Model m = testing_models::mlp(4, {3, 5, 2}, false, /*differentiate=*/false);
  Executor ex(m.g, reference_opts());
  bind_all(ex, testing_models::random_bindings(m, 10));
  ex.run_forward();
  const double loss = ex.get(m.loss).item();
  EXPECT_TRUE(std::isfinite(loss));
  EXPECT_GT(loss, 0.0);
}

TEST(Executor, ReshapedParameterGradientIsCopiedIntoBoundMemory) {
  // p [6] is used as a [2, 3] matrix: its gradient is a reshape of another
  // value, which becomes a copy when the caller binds the gradient.
  Graph g;
  Builder b(g);
  ValueId x = b.input("x", {4, 2});
  ValueId p = b.param("p", {6}, testing_models::kInit);
  ValueId loss = b.sum_to(b.matmul(x, b.reshape(p, {2, 3})), {});
  build_backward(g, loss);
  Tensor xt = Tensor::empty({4, 2}, DType::f32);
  for (int i = 0; i < 8; ++i) xt.set_item(i, i + 1);
  Tensor pt = Tensor::zeros({6}, DType::f32);
  Tensor gp = Tensor::zeros({6}, DType::f32);
  Executor ex(g, reference_opts());
  ex.bind(x, xt);
  ex.bind(p, pt);
  ex.bind(g.grad_of(p), gp);
  ex.run();
  // d sum(x @ P) / dP[k][j] = sum_i x[i][k]: column sums of x are 16 and 20.
  for (int j = 0; j < 3; ++j) {
    EXPECT_EQ(gp.item(j), 16.0);
    EXPECT_EQ(gp.item(3 + j), 20.0);
  }
}

TEST(Executor, AccumulatingMatmulGradientsAddIntoBoundMemory) {
  // On both backends: a run with accumulation off writes each bound matmul
  // gradient, one with it on adds the product there (beta = 1); others are
  // refused, naming the value.
  for (const char* backend : {"reference", "fast"}) {
    Model m = testing_models::mlp(16, {32, 64, 10});
    auto bindings = testing_models::random_bindings(m, 3);
    ExecOptions o;
    o.backend = backend;
    Executor plain(m.g, o);
    bind_all(plain, bindings);
    plain.run();
    Executor acc(m.g, o);
    bind_all(acc, bindings);
    std::map<ValueId, Tensor> grads;
    int matmuls = 0;
    for (const auto& [p, gv] : m.g.grads()) {
      grads[p] = Tensor::zeros(m.g.value(gv).shape, DType::f32);
      acc.bind(gv, grads[p]);
      if (m.g.node(m.g.value(gv).producer).op == OpKind::matmul) {
        acc.set_accumulate(gv, false);
        ++matmuls;
      } else {
        EXPECT_THROW(acc.set_accumulate(gv, true), ConfigError) << m.g.value(p).name;
      }
    }
    ASSERT_EQ(matmuls, 2);
    for (auto& [p, t] : grads) t.fill(1e6);  // overwritten, not read, with accumulation off
    acc.run();
    // (The fast backend may pick other engines for memory laid out
    // otherwise: equal within rounding, not bitwise.)
    for (const auto& [p, t] : grads) {
      EXPECT_LT(max_rel_diff(t, plain.get(m.g.grad_of(p))), 1e-5) << backend << m.g.value(p).name;
    }
    for (const auto& [p, gv] : m.g.grads()) {
      if (m.g.node(m.g.value(gv).producer).op == OpKind::matmul) acc.set_accumulate(gv, true);
    }
    acc.run();
    for (const auto& [p, gv] : m.g.grads()) {
      const Tensor want = plain.get(gv);
      const bool adds = m.g.node(m.g.value(gv).producer).op == OpKind::matmul;
      for (int64_t i = 0; i < want.numel(); ++i) {
        const double w = (adds ? 2.0 : 1.0) * want.item(i);
        EXPECT_NEAR(grads[p].item(i), w, 1e-5 * std::max(1.0, std::fabs(w)))
            << backend << m.g.value(p).name << " element " << i;
      }
    }
  }
  Model m = testing_models::mlp(4, {8, 2});
  Executor ex(m.g, reference_opts());
  const ValueId gw = m.g.grads().begin()->second;
  EXPECT_THROW(ex.set_accumulate(gw, true), ConfigError);  // unbound
}

TEST(Executor, ProfileCountsCallsAndFlops) {
  Model m = testing_models::mlp(8, {6, 12, 4});
  Executor ex(m.g, reference_opts());
  bind_all(ex, testing_models::random_bindings(m, 11));
  ex.run();
  ex.run();
  const auto& prof = ex.profile();
  ASSERT_EQ(prof.size(), static_cast<size_t>(m.g.num_nodes()));
  for (size_t i = 0; i < prof.size(); ++i) {
    const Node& n = m.g.node(static_cast<NodeId>(i));
    EXPECT_EQ(prof[i].name, n.name);
    EXPECT_EQ(prof[i].op, n.op);
    EXPECT_EQ(prof[i].calls, 2);
    EXPECT_GE(prof[i].total_ns, 0);
    EXPECT_EQ(prof[i].flops, op_cost(m.g, n).flops);
  }
  int64_t total = 0;
  for (const OpProfile& p : prof) total += p.total_ns;
  EXPECT_GT(total, 0);
  ex.reset_profile();
  ex.run_forward();
  for (size_t i = 0; i < prof.size(); ++i) {
    EXPECT_EQ(prof[i].calls, m.g.node(static_cast<NodeId>(i)).backward ? 0 : 1);
  }
}

}  // namespace
}  // namespace mt
