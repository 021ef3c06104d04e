// The executor: memory reuse, planned == allocated, gradient-ready callbacks,
// recomputation, backends agreeing, binding errors, profiling.
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

// Runs the mixed-precision graph m on both backends and the f32 graph m32 on
// the reference, with the same inputs and parameters (matched by name);
// checks the loss and every parameter gradient (which must be f32) against
// the f32 run, and returns each backend's gradients by parameter name.
std::map<std::string, std::map<std::string, Tensor>> expect_near_f32_run(const Model& m,
                                                                         const Model& m32,
                                                                         uint64_t seed) {
  auto bindings32 = testing_models::random_bindings(m32, seed);
  std::map<ValueId, Tensor> bindings;  // the same tensors, by name in m's graph
  for (const auto& [id, t] : bindings32) bindings[*m.g.find(m32.g.value(id).name)] = t;
  Executor exact(m32.g, reference_opts());
  bind_all(exact, bindings32);
  exact.run();
  std::map<std::string, std::map<std::string, Tensor>> grads;
  for (const char* backend : {"reference", "fast"}) {
    ExecOptions o;
    o.backend = backend;
    Executor ex(m.g, o);
    bind_all(ex, bindings);
    ex.run();
    // bf16 operands carry ~3 significant digits.
    EXPECT_NEAR(ex.get(m.loss).item(), exact.get(m32.loss).item(), 2e-2) << backend;
    for (const auto& [p, gv] : m.g.grads()) {
      const std::string& name = m.g.value(p).name;
      EXPECT_EQ(m.g.value(gv).dtype, DType::f32) << name;
      ValueId p32 = *m32.g.find(name);
      EXPECT_LE(max_rel_diff(ex.get(gv), exact.get(m32.g.grad_of(p32))), 5e-2)
          << backend << " " << name;
      grads[backend][name] = ex.get(gv).clone();
    }
  }
  return grads;
}

TEST(Executor, MixedPrecisionTransformerRunsOnBothBackends) {
  expect_near_f32_run(testing_models::tiny_transformer(DType::bf16),
                      testing_models::tiny_transformer(DType::f32), 6);
}

TEST(Executor, Bf16ActivationsMatchF32OnBothBackends) {
  // Hidden activations (bias add, gelu and their gradients) in bf16; the
  // parameter gradients come out f32 and near the all-f32 run's.
  Model m = testing_models::mlp(16, {12, 24, 20, 5}, /*gelu=*/true, true, DType::bf16);
  int bf16_values = 0;
  for (ValueId v = 0; v < m.g.num_values(); ++v) bf16_values += m.g.value(v).dtype == DType::bf16;
  EXPECT_GT(bf16_values, 10);
  auto grads = expect_near_f32_run(m, testing_models::mlp(16, {12, 24, 20, 5}, true), 8);
  // Fast and reference round the same f32 results: they agree far closer.
  for (const auto& [name, g] : grads["fast"]) {
    EXPECT_LE(max_rel_diff(g, grads["reference"][name]), 2e-2) << name;
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
