// Every operator's gradient rule checked against central finite differences
// in f64 on the reference backend. One table row per case: the operator, its
// input shapes (float inputs become parameters; i32 inputs get random indices
// below `high`) and attributes. The harness builds
//   loss = sum_to(op(inputs...) * W, [])        (W a fixed random input)
// differentiates it, runs the executor, and compares every input's gradient
// with (loss(x + eps) - loss(x - eps)) / (2 eps), element by element. The same
// table also checks the fast backend against the reference one in f32.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <random>
#include <string>

#include "meshtrain/exec/executor.h"
#include "meshtrain/graph/autodiff.h"
#include "meshtrain/graph/builder.h"
#include "meshtrain/graph/op_registry.h"

namespace mt {
namespace {

struct In {
  Shape shape;
  DType dtype = DType::f64;
  int high = 0;  // i32 inputs: values in [0, high)
};

struct GradCase {
  std::string label;
  OpKind op;
  std::vector<In> inputs;
  Attrs attrs;
  double eps = 1e-6;
  double tol = 1e-6;
};

In ids(Shape s, int high) {
  return In{std::move(s), DType::i32, high};
}
Attrs mm(bool ta, bool tb) {
  return Attrs().set("trans_a", ta).set("trans_b", tb);
}
Attrs conv(int64_t sh, int64_t sw, int64_t ph, int64_t pw) {
  return Attrs().set("stride_h", sh).set("stride_w", sw).set("pad_h", ph).set("pad_w", pw);
}
Attrs pool(int64_t k, int64_t s, int64_t p) {
  return Attrs()
      .set("kernel_h", k)
      .set("kernel_w", k)
      .set("stride_h", s)
      .set("stride_w", s)
      .set("pad_h", p)
      .set("pad_w", p);
}
Attrs shape_attr(std::vector<int64_t> s) {
  return Attrs().set("shape", std::move(s));
}

std::vector<GradCase> cases() {
  using O = OpKind;
  return {
      {"matmul", O::matmul, {{{3, 4}}, {{4, 5}}}, mm(false, false)},
      {"matmul_trans_a", O::matmul, {{{4, 3}}, {{4, 5}}}, mm(true, false)},
      {"matmul_trans_b", O::matmul, {{{3, 4}}, {{5, 4}}}, mm(false, true)},
      {"matmul_trans_ab", O::matmul, {{{4, 3}}, {{5, 4}}}, mm(true, true)},
      {"matmul_1x1", O::matmul, {{{1, 1}}, {{1, 1}}}, mm(false, false)},
      {"matmul_vector_rows", O::matmul, {{{1, 5}}, {{5, 1}}}, mm(false, false)},
      {"matmul_batched", O::matmul, {{{2, 3, 4}}, {{2, 4, 5}}}, mm(false, false)},
      {"matmul_batched_trans", O::matmul, {{{3, 4, 3}}, {{3, 5, 4}}}, mm(true, true)},
      {"matmul_shared_b", O::matmul, {{{2, 3, 4}}, {{4, 5}}}, mm(false, false)},
      {"matmul_shared_b_trans", O::matmul, {{{2, 4, 3}}, {{5, 4}}}, mm(true, true)},
      {"add_same", O::add, {{{3, 4}}, {{3, 4}}}, {}},
      {"add_bias", O::add, {{{3, 4}}, {{4}}}, {}},
      {"add_suffix_rank3", O::add, {{{2, 3, 4}}, {{3, 4}}}, {}},
      {"add_scalar", O::add, {{{3, 4}}, {{}}}, {}},
      {"add_one_element", O::add, {{{3, 4}}, {{1}}}, {}},
      {"sub_same", O::sub, {{{2, 5}}, {{2, 5}}}, {}},
      {"sub_bias", O::sub, {{{3, 4}}, {{4}}}, {}},
      {"sub_scalar", O::sub, {{{3, 1}}, {{}}}, {}},
      {"mul_same", O::mul, {{{3, 4}}, {{3, 4}}}, {}},
      {"mul_bias", O::mul, {{{2, 3, 4}}, {{4}}}, {}},
      {"mul_scalar", O::mul, {{{5}}, {{}}}, {}},
      {"mul_one_element", O::mul, {{{2, 3}}, {{1}}}, {}},
      {"scale", O::scale, {{{3, 5}}}, Attrs().set("alpha", -1.7)},
      {"relu", O::relu, {{{4, 7}}}, {}},
      {"gelu", O::gelu, {{{4, 7}}}, {}},
      {"tanh", O::tanh, {{{3, 5}}}, {}},
      {"sigmoid", O::sigmoid, {{{1}}}, {}},
      {"sigmoid_rows", O::sigmoid, {{{6, 3}}}, {}},
      {"softmax", O::softmax, {{{3, 7}}}, Attrs().set("causal", false)},
      {"softmax_one_column", O::softmax, {{{4, 1}}}, Attrs().set("causal", false)},
      {"softmax_causal", O::softmax, {{{2, 4, 4}}}, Attrs().set("causal", true)},
      {"softmax_causal_rect", O::softmax, {{{3, 5}}}, Attrs().set("causal", true)},
      {"log_softmax", O::log_softmax, {{{3, 6}}}, {}},
      {"log_softmax_1x1", O::log_softmax, {{{1, 1}}}, {}},
      {"layer_norm", O::layer_norm, {{{4, 6}}, {{6}}, {{6}}}, Attrs().set("eps", 1e-5)},
      {"layer_norm_rank3", O::layer_norm, {{{2, 3, 5}}, {{5}}, {{5}}}, Attrs().set("eps", 1e-5)},
      {"layer_norm_one_row", O::layer_norm, {{{1, 7}}, {{7}}, {{7}}}, Attrs().set("eps", 1e-3)},
      {"cross_entropy", O::cross_entropy, {{{5, 4}}, ids({5}, 4)}, {}},
      {"cross_entropy_one_row", O::cross_entropy, {{{1, 3}}, ids({1}, 3)}, {}},
      {"embedding", O::embedding, {{{7, 3}}, ids({5}, 7)}, {}},
      {"embedding_repeated_ids", O::embedding, {{{3, 2}}, ids({2, 4}, 3)}, {}},
      {"conv2d_bias_stride_pad",
       O::conv2d,
       {{{2, 3, 6, 5}}, {{4, 3, 3, 3}}, {{4}}},
       conv(2, 2, 1, 1)},
      {"conv2d_1x1", O::conv2d, {{{1, 2, 3, 3}}, {{3, 2, 1, 1}}}, conv(1, 1, 0, 0)},
      {"conv2d_asymmetric", O::conv2d, {{{2, 2, 5, 4}}, {{3, 2, 2, 3}}, {{3}}}, conv(2, 1, 0, 1)},
      {"max_pool2d", O::max_pool2d, {{{2, 3, 6, 6}}}, pool(2, 2, 0)},
      {"max_pool2d_overlapping", O::max_pool2d, {{{1, 2, 7, 7}}}, pool(3, 2, 0)},
      {"max_pool2d_padded", O::max_pool2d, {{{1, 1, 5, 5}}}, pool(3, 1, 1)},
      {"reshape", O::reshape, {{{3, 4}}}, shape_attr({2, 6})},
      {"reshape_infer", O::reshape, {{{2, 3, 2}}}, shape_attr({-1, 3})},
      {"permute", O::permute, {{{2, 3, 4}}}, Attrs().set("perm", std::vector<int64_t>{2, 0, 1})},
      {"cast_f32_roundtrip",
       O::cast,
       {{{3, 4}}},
       Attrs().set("dtype", std::string("f32")),
       1e-3,
       1e-3},
      {"sum_to_rows", O::sum_to, {{{3, 4}}}, shape_attr({4})},
      {"sum_to_scalar", O::sum_to, {{{3, 4}}}, shape_attr({})},
      {"sum_to_rank3", O::sum_to, {{{2, 3, 4}}}, shape_attr({3, 4})},
      {"broadcast_to", O::broadcast_to, {{{4}}}, shape_attr({3, 4})},
      {"broadcast_to_scalar", O::broadcast_to, {{{}}}, shape_attr({2, 3})},
  };
}

Tensor random_tensor(const In& in, std::mt19937_64& rng) {
  Tensor t = Tensor::empty(in.shape, in.dtype);
  if (in.dtype == DType::i32) {
    std::uniform_int_distribution<int> d(0, in.high - 1);
    for (int64_t i = 0; i < t.numel(); ++i) t.data<int32_t>()[i] = d(rng);
  } else {
    std::uniform_real_distribution<double> d(-1.0, 1.0);
    for (int64_t i = 0; i < t.numel(); ++i) t.set_item(i, d(rng));
  }
  return t;
}

// One case's graph: float inputs as parameters of dtype `dt`, the loss
// sum(op(...) * W) in the same dtype, differentiated; data drawn from the
// case's label so every run of a case sees the same numbers.
struct CaseGraph {
  Graph g;
  std::vector<ValueId> ins;
  std::vector<Tensor> data;
  ValueId w = kNoValue;
  Tensor w_data;
  ValueId loss = kNoValue;

  CaseGraph(const GradCase& c, DType dt) {
    std::mt19937_64 rng(std::hash<std::string>{}(c.label));
    Builder b(g);
    for (size_t i = 0; i < c.inputs.size(); ++i) {
      In in = c.inputs[i];
      if (in.dtype != DType::i32) in.dtype = dt;
      const std::string name = "in" + std::to_string(i);
      ins.push_back(in.dtype == DType::i32 ? b.input(name, in.shape, in.dtype)
                                           : b.param(name, in.shape, ParamInit{}, in.dtype));
      data.push_back(random_tensor(in, rng));
    }
    ValueId y = g.add_node(c.op, "op", ins, c.attrs).front();
    ValueId yd = g.value(y).dtype == dt ? y : b.cast(y, dt);
    In w_spec{g.value(y).shape, dt};
    w = b.input("w", w_spec.shape, dt);
    w_data = random_tensor(w_spec, rng);
    loss = b.name(b.sum_to(b.mul(yd, w), {}), "loss");
    build_backward(g, loss);
  }

  // An executor with every input bound, after one run().
  std::unique_ptr<Executor> run(const std::string& backend) {
    ExecOptions opts;
    opts.backend = backend;
    opts.profile = false;
    auto ex = std::make_unique<Executor>(g, opts);
    for (size_t i = 0; i < ins.size(); ++i) ex->bind(ins[i], data[i]);
    ex->bind(w, w_data);
    ex->run();
    return ex;
  }
};

class GradCheck : public ::testing::TestWithParam<GradCase> {};

TEST_P(GradCheck, MatchesCentralDifferences) {
  const GradCase& c = GetParam();
  CaseGraph cg(c, DType::f64);
  std::unique_ptr<Executor> ex = cg.run("reference");

  // Copied out now: run_forward() reuses the arena memory of unbound gradients.
  std::vector<Tensor> analytic_of(cg.ins.size());
  for (size_t i = 0; i < cg.ins.size(); ++i) {
    if (c.inputs[i].dtype == DType::i32) continue;
    ValueId gv = cg.g.grad_of(cg.ins[i]);
    ASSERT_NE(gv, kNoValue) << c.label << ": input " << i << " got no gradient";
    analytic_of[i] = ex->get(gv).clone();
  }
  for (size_t i = 0; i < cg.ins.size(); ++i) {
    if (c.inputs[i].dtype == DType::i32) continue;
    const Tensor& analytic = analytic_of[i];
    Tensor& x = cg.data[i];
    double worst = 0, worst_a = 0, worst_n = 0;
    int64_t worst_at = -1;
    for (int64_t e = 0; e < x.numel(); ++e) {
      const double orig = x.item(e);
      x.set_item(e, orig + c.eps);
      ex->run_forward();
      const double lp = ex->get(cg.loss).item();
      x.set_item(e, orig - c.eps);
      ex->run_forward();
      const double lm = ex->get(cg.loss).item();
      x.set_item(e, orig);
      const double numeric = (lp - lm) / (2 * c.eps);
      const double a = analytic.item(e);
      const double err = std::fabs(a - numeric) / std::max(1.0, std::fabs(numeric));
      if (err > worst) {
        worst = err;
        worst_at = e;
        worst_a = a;
        worst_n = numeric;
      }
    }
    EXPECT_LE(worst, c.tol) << c.label << ": d loss / d input " << i << " " << x.desc()
                            << ": max relative difference " << worst << " at element " << worst_at
                            << " (analytic " << worst_a << ", numeric " << worst_n << ")";
  }
}

// The same graphs in f32: the fast backend's forward and backward kernels
// agree with the reference backend's.
TEST_P(GradCheck, FastBackendAgreesWithReferenceInF32) {
  const GradCase& c = GetParam();
  CaseGraph cg(c, DType::f32);
  std::unique_ptr<Executor> ref = cg.run("reference");
  std::unique_ptr<Executor> fast = cg.run("fast");
  auto compare = [&](ValueId v, const std::string& what) {
    Tensor a = fast->get(v), b = ref->get(v);
    double worst = 0;
    int64_t at = -1;
    for (int64_t e = 0; e < a.numel(); ++e) {
      const double d = std::fabs(a.item(e) - b.item(e)) / std::max(1.0, std::fabs(b.item(e)));
      if (d > worst) {
        worst = d;
        at = e;
      }
    }
    EXPECT_LE(worst, 1e-5) << c.label << ": " << what << " " << b.desc()
                           << ": fast differs from reference by " << worst << " at element " << at
                           << " (fast " << (at >= 0 ? a.item(at) : 0) << ", reference "
                           << (at >= 0 ? b.item(at) : 0) << ")";
  };
  compare(cg.loss, "loss");
  for (size_t i = 0; i < cg.ins.size(); ++i) {
    if (c.inputs[i].dtype != DType::i32)
      compare(cg.g.grad_of(cg.ins[i]), "d loss / d input " + std::to_string(i));
  }
}

INSTANTIATE_TEST_SUITE_P(Ops, GradCheck, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<GradCase>& p) { return p.param.label; });

// Every operator that has a gradient rule in the registry has a case above,
// so adding a differentiable operator without a check fails here.
TEST(GradCheckTable, CoversEveryDifferentiableOperator) {
  std::vector<OpKind> ops = all_ops();
  std::vector<bool> covered(ops.size(), false);
  for (const GradCase& c : cases()) covered.at(static_cast<size_t>(c.op)) = true;
  int differentiable = 0;
  for (OpKind op : ops) {
    if (op_def(op).grad == nullptr) continue;
    ++differentiable;
    EXPECT_TRUE(covered[static_cast<size_t>(op)]) << op_name(op) << " has no gradient check";
  }
  EXPECT_GE(differentiable, 21);
}

}  // namespace
}  // namespace mt
