// Every operator's gradient rule checked against central finite differences
// in f64 on the reference backend. One table row per case: the operator, its
// input shapes (float inputs become parameters; i32 inputs get random indices
// below `high`) and attributes. The harness builds
//   loss = sum_to(op(inputs...) * W, [])        (W a fixed random input)
// differentiates it, runs the executor, and compares every input's gradient
// with (loss(x + eps) - loss(x - eps)) / (2 eps), element by element. The same
// table also checks the fast backend against the reference one in f32.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <tuple>

#include "meshtrain/exec/executor.h"
#include "meshtrain/graph/autodiff.h"
#include "meshtrain/graph/builder.h"
#include "meshtrain/graph/collective.h"
#include "meshtrain/graph/op_registry.h"

namespace mt {
namespace {

struct In {
  Shape shape;
  DType dtype = DType::f64;
  int high = 0;  // i32 inputs: values in [0, high)
  // i32 inputs with fixed contents (a CSR structure) instead of random ones.
  std::vector<int32_t> values = {};
  // Float inputs drawn from [0.5, 1.5) instead of [-1, 1) (a logarithm's argument).
  bool positive = false;
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
In positive(Shape s) {
  return In{std::move(s), DType::f64, 0, {}, true};
}
Attrs vocab_range(int64_t offset, int64_t vocab) {
  return Attrs().set("offset", offset).set("vocab", vocab);
}
In fixed(std::vector<int32_t> v) {
  const auto n = static_cast<int64_t>(v.size());
  return In{{n}, DType::i32, 0, std::move(v)};
}

// A sparse matrix with the awkward cases in it: 4 rows over 6 columns; row 1
// empty, row 2 with a self-loop (col 2) and a duplicate entry (col 0 twice),
// column 5 never referenced (an isolated vertex).
const std::vector<int32_t> kRowPtr = {0, 2, 2, 6, 7};
const std::vector<int32_t> kColIdx = {1, 3, 2, 0, 0, 4, 3};

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
      // Vocabulary-parallel: this table is rows [3, 7) of 9; ids of other
      // rows look up zeros and add nothing to the table's gradient.
      {"embedding_vocab_range", O::embedding, {{{4, 3}}, ids({3, 4}, 9)}, vocab_range(3, 9)},
      {"embedding_vocab_first_rows", O::embedding, {{{2, 2}}, ids({6}, 5)}, vocab_range(0, 5)},
      // Columns [3, 7) of a vocabulary of 9 (labels of other columns pick
      // nothing here); m is an input like any other in this check.
      {"vocab_ce_stats", O::vocab_ce_stats, {{{5, 4}}, ids({5}, 9), {{5}}}, vocab_range(3, 9)},
      {"vocab_ce_stats_whole",
       O::vocab_ce_stats,
       {{{3, 4}}, ids({3}, 4), {{3}}},
       vocab_range(0, 4)},
      {"vocab_ce_loss", O::vocab_ce_loss, {positive({5, 2}), {{5}}}, {}},
      {"vocab_ce_loss_one_row", O::vocab_ce_loss, {positive({1, 2}), {{1}}}, {}},
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
      {"spmm", O::spmm, {fixed(kRowPtr), fixed(kColIdx), {{6, 3}}}, {}},
      {"spmm_weighted", O::spmm, {fixed(kRowPtr), fixed(kColIdx), {{6, 3}}, {{7}}}, {}},
      {"spmm_no_entries", O::spmm, {fixed({0, 0, 0}), fixed({}), {{3, 2}}, {{0}}}, {}},
      {"spmm_max", O::spmm_max, {fixed(kRowPtr), fixed(kColIdx), {{6, 5}}}, {}},
      {"edge_softmax", O::edge_softmax, {fixed(kRowPtr), {{7}}}, {}},
      {"edge_softmax_no_entries", O::edge_softmax, {fixed({0, 0}), {{0}}}, {}},
  };
}

Tensor random_tensor(const In& in, std::mt19937_64& rng) {
  Tensor t = Tensor::empty(in.shape, in.dtype);
  if (in.dtype == DType::i32 && !in.values.empty()) {
    for (int64_t i = 0; i < t.numel(); ++i)
      t.data<int32_t>()[i] = in.values[static_cast<size_t>(i)];
  } else if (in.dtype == DType::i32) {
    std::uniform_int_distribution<int> d(0, in.high - 1);
    for (int64_t i = 0; i < t.numel(); ++i) t.data<int32_t>()[i] = d(rng);
  } else if (in.positive) {
    std::uniform_real_distribution<double> d(0.5, 1.5);
    for (int64_t i = 0; i < t.numel(); ++i) t.set_item(i, d(rng));
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

// ---- Mixed precision ----
//
// The rules bf16/f16 graphs add -- matmul with 16-bit operands giving an f32
// product or (out_dtype) a 16-bit one, gradients carried wide for 16-bit
// copies of f32 values (GradContext::grad_dtype: backward matmuls with
// out_dtype, sum_to with a wide dtype for a bias), casts both ways, wide and
// narrow contributions meeting in autodiff, and the element-wise, softmax and
// layout rules on 16-bit activations -- checked against central differences.
// A 16-bit forward pass is too coarse to difference, so each case is built
// twice by one function: the mixed graph (f32 parameters and loss, 16-bit
// compute; its gradient is what is checked) and its f64 twin (every dtype
// f64, casts vanish, out_dtype/dtype name f64), whose loss is differenced on
// the reference backend. Parameter values are 16-bit numbers, so the casts of
// the mixed graph are exact and both graphs compute the same function up to
// the mixed graph's roundings.
//
// Tolerance, per element: |analytic - numeric| <= kMixedUlps * u * max|numeric|
// over the tensor, u the 16-bit unit roundoff (bf16 2^-8, f16 2^-11). In these
// small cases a gradient element passes through two or three roundings to 16
// bits (the dy cast, a 16-bit forward product or activation, a 16-bit backward
// product), each off by at most u relative to the value rounded, and those
// values are about the size of the tensor's largest gradient; the worst case
// measured is 1.35 u, so 4 u leaves room while a wrong rule (a missing
// transpose, sum or scale, a wrong operand) is off by O(1) of max|numeric|.
constexpr double kMixedUlps = 4;

struct MixedCase {
  std::string label;
  // Builds the outputs whose weighted sums form the loss. `wide` is the
  // parameters' dtype (f32, or f64 in the twin), `narrow` the compute dtype
  // (bf16/f16, or f64 in the twin). Parameters come from p(name, shape).
  std::function<std::vector<ValueId>(Builder& b, DType wide, DType narrow,
                                     const std::function<ValueId(const char*, Shape)>& p)>
      build;
  // Backward nodes the mixed graph must contain, so a case keeps exercising
  // the rule it is for: (op, attribute, value) with value "narrow" or "wide"
  // standing for the dtype names.
  std::vector<std::tuple<OpKind, std::string, std::string>> expect;
};

// y = sum_to(x, shape) summed into `dtype` (the attribute the wide gradient of
// a 16-bit bias uses).
ValueId sum_into(Builder& b, ValueId x, const Shape& shape, DType dtype) {
  return b.graph()
      .add_node(OpKind::sum_to, b.graph().unique_name("sum_into"), {x},
                Attrs().set("shape", shape.dims()).set("dtype", std::string(dtype_name(dtype))))
      .front();
}

std::vector<MixedCase> mixed_cases() {
  using O = OpKind;
  using P = std::function<ValueId(const char*, Shape)>;
  auto mm_wide = [](bool ta, bool tb, Shape as, Shape bs) {
    return [=](Builder& b, DType, DType n, const P& p) {
      return std::vector<ValueId>{b.matmul(b.cast(p("a", as), n), b.cast(p("b", bs), n), ta, tb)};
    };
  };
  // out_dtype given (the narrow dtype; f64 in the twin) on a backward matmul.
  const std::tuple<O, std::string, std::string> bwd_mm_narrow{O::matmul, "out_dtype", "narrow"};
  return {
      // 16-bit copies of f32 values: f32 product; dy cast to 16 bits, gradients
      // kept f32 (the backward matmuls' natural dtype, no out_dtype).
      {"matmul_f32_out", mm_wide(false, false, {3, 4}, {4, 5}), {{O::cast, "dtype", "narrow"}}},
      {"matmul_f32_out_trans_a", mm_wide(true, false, {4, 3}, {4, 5}), {}},
      {"matmul_f32_out_trans_b", mm_wide(false, true, {3, 4}, {5, 4}), {}},
      {"matmul_f32_out_trans_ab", mm_wide(true, true, {4, 3}, {5, 4}), {}},
      {"matmul_f32_out_batched", mm_wide(false, true, {2, 3, 4}, {2, 5, 4}), {}},
      {"matmul_f32_out_shared_b", mm_wide(true, false, {2, 4, 3}, {4, 5}), {}},
      // A 16-bit product (out_dtype) feeding a 16-bit bias add and activation,
      // then a matmul of that 16-bit activation (not a cast: its gradient is a
      // 16-bit backward matmul) -- the MLP's hidden layer.
      {"mlp_hidden_layer",
       [](Builder& b, DType w, DType n, const P& p) {
         ValueId h =
             b.matmul(b.cast(p("x", {3, 4}), n), b.cast(p("w1", {4, 6}), n), false, false, n);
         h = b.gelu(b.add(h, b.cast(p("b1", {6}), n)));
         ValueId y = b.matmul(h, b.cast(p("w2", {6, 2}), n));
         return std::vector<ValueId>{b.add(y, b.cast(p("b2", {2}), w))};
       },
       {bwd_mm_narrow, {O::sum_to, "dtype", "wide"}}},
      {"relu_hidden_trans_b",
       [](Builder& b, DType, DType n, const P& p) {
         ValueId h =
             b.matmul(b.cast(p("x", {2, 3, 4}), n), b.cast(p("w1", {5, 4}), n), false, true, n);
         h = b.relu(b.add(h, b.cast(p("b1", {5}), n)));
         return std::vector<ValueId>{b.matmul(h, b.cast(p("w2", {3, 5}), n), false, true)};
       },
       {bwd_mm_narrow, {O::sum_to, "dtype", "wide"}}},
      // Causal attention as the GPT wires it: 16-bit q, k, v (reshaped and
      // permuted in 16 bits), f32 scores and softmax, a 16-bit copy of p, a
      // 16-bit attention output.
      {"attention",
       [](Builder& b, DType, DType n, const P& p) {
         const int64_t B = 2, T = 3, C = 4, H = 2, D = 2;
         ValueId x = b.cast(p("x", {B * T, C}), n);
         auto heads = [&](const char* w) {
           ValueId v = b.matmul(x, b.cast(p(w, {C, C}), n), false, false, n);
           v = b.permute(b.reshape(v, {B, T, H, D}), {0, 2, 1, 3});
           return b.reshape(v, {B * H, T, D});
         };
         ValueId q = heads("wq"), k = heads("wk"), v = heads("wv");
         ValueId s = b.softmax(b.scale(b.matmul(q, k, false, true), 0.7), true);
         return std::vector<ValueId>{b.matmul(b.cast(s, n), v, false, false, n)};
       },
       {bwd_mm_narrow, {O::cast, "dtype", "narrow"}}},
      // sum_to of a 16-bit x into a wide result, to the last dims and to a scalar.
      {"sum_to_wide",
       [](Builder& b, DType w, DType n, const P& p) {
         ValueId x = b.cast(p("x", {3, 4}), n);
         return std::vector<ValueId>{sum_into(b, x, {4}, w), sum_into(b, x, {}, w)};
       },
       {{O::cast, "dtype", "narrow"}}},
      // A cast to 16 bits and back around a 16-bit activation: both cast rules
      // emit a cast (dy arrives in the other dtype).
      {"cast_round_trip",
       [](Builder& b, DType w, DType n, const P& p) {
         return std::vector<ValueId>{b.cast(b.tanh(b.cast(p("x", {4, 5}), n)), w)};
       },
       {{O::cast, "dtype", "narrow"}, {O::cast, "dtype", "wide"}}},
      // One 16-bit copy read by a matmul (f32 gradient) and a 16-bit
      // activation (16-bit gradient): autodiff widens the latter and adds.
      {"wide_and_narrow_contributions",
       [](Builder& b, DType, DType n, const P& p) {
         ValueId x = b.cast(p("x", {3, 4}), n);
         return std::vector<ValueId>{b.matmul(x, b.cast(p("w", {4, 2}), n)), b.sigmoid(x),
                                     b.mul(x, x)};
       },
       {{O::cast, "dtype", "wide"}}},
      // The f16 models' linear layer: f32 activations, 16-bit matmul operands,
      // f32 bias.
      {"linear_f32_activations",
       [](Builder& b, DType w, DType n, const P& p) {
         ValueId y = b.matmul(b.cast(p("x", {3, 4}), n), b.cast(p("w", {4, 5}), n));
         y = b.add(y, b.cast(p("b", {5}), w));
         ValueId z = b.matmul(b.cast(b.tanh(y), n), b.cast(p("w2", {5, 2}), n));
         return std::vector<ValueId>{b.log_softmax(z)};
       },
       {}},
  };
}

// One mixed case built with (wide, narrow); loss = sum_i sum(cast(y_i, wide) * W_i).
struct MixedGraph {
  Graph g;
  std::vector<std::string> names;  // parameters, in creation order
  std::vector<ValueId> params, ws;
  ValueId loss = kNoValue;

  MixedGraph(const MixedCase& c, DType wide, DType narrow) {
    Builder b(g);
    auto p = [&](const char* name, Shape s) {
      names.push_back(name);
      params.push_back(b.param(name, s, ParamInit{}, wide));
      return params.back();
    };
    ValueId total = kNoValue;
    for (ValueId y : c.build(b, wide, narrow, p)) {
      ValueId w = b.input(fmt::format("w{}", ws.size()), g.value(y).shape, wide);
      ws.push_back(w);
      ValueId term = b.sum_to(b.mul(b.cast(y, wide), w), {});
      total = total == kNoValue ? term : b.add(total, term);
    }
    loss = b.name(total, "loss");
    build_backward(g, loss);
  }
};

struct MixedParam {
  MixedCase c;
  DType narrow;
};

void PrintTo(const MixedParam& p, std::ostream* os) {
  *os << p.c.label << " in " << dtype_name(p.narrow);
}

class MixedGradCheck : public ::testing::TestWithParam<MixedParam> {};

TEST_P(MixedGradCheck, MatchesCentralDifferencesOfF64Twin) {
  const MixedCase& c = GetParam().c;
  const DType narrow = GetParam().narrow;
  const double u = narrow == DType::bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  MixedGraph mixed(c, DType::f32, narrow);
  MixedGraph twin(c, DType::f64, DType::f64);
  ASSERT_EQ(mixed.names, twin.names);

  // The rules under test are in the mixed graph, and the twin has no 16 bits.
  for (const auto& [op, attr, value] : c.expect) {
    const std::string want(dtype_name(value == "narrow" ? narrow : DType::f32));
    bool found = false;
    for (const Node& n : mixed.g.nodes()) {
      found |= n.backward && n.op == op && n.attrs.has(attr) && n.attrs.s(attr) == want;
    }
    EXPECT_TRUE(found) << c.label << ": no backward " << op_name(op) << " with " << attr << " = "
                       << want;
  }
  bool narrow_seen = false;
  for (ValueId v = 0; v < mixed.g.num_values(); ++v)
    narrow_seen |= mixed.g.value(v).dtype == narrow;
  EXPECT_TRUE(narrow_seen) << c.label;
  for (ValueId v = 0; v < twin.g.num_values(); ++v) {
    const DType t = twin.g.value(v).dtype;
    ASSERT_TRUE(t == DType::f64 || t == DType::i32) << c.label << ": twin has " << dtype_name(t);
  }

  // Same numbers in both: 16-bit values, held in f32 and in f64.
  std::mt19937_64 rng(std::hash<std::string>{}(c.label));
  std::uniform_real_distribution<double> dist(-1.0, 1.0);
  auto draw = [&](const Shape& s) {
    Tensor t = Tensor::empty(s, DType::f64);
    for (int64_t i = 0; i < t.numel(); ++i) t.set_item(i, dist(rng));
    return t.to(narrow).to(DType::f64);
  };
  ExecOptions opts;
  opts.backend = "reference";
  opts.profile = false;
  Executor ex_mixed(mixed.g, opts), ex_twin(twin.g, opts);
  std::vector<Tensor> data;
  for (size_t i = 0; i < mixed.params.size(); ++i) {
    data.push_back(draw(mixed.g.value(mixed.params[i]).shape));
    ex_mixed.bind(mixed.params[i], data.back().to(DType::f32));
    ex_twin.bind(twin.params[i], data.back());
  }
  for (size_t i = 0; i < mixed.ws.size(); ++i) {
    Tensor w = draw(mixed.g.value(mixed.ws[i]).shape);
    ex_mixed.bind(mixed.ws[i], w.to(DType::f32));
    ex_twin.bind(twin.ws[i], w);
  }
  ex_mixed.run();

  const double eps = 1e-6;
  for (size_t i = 0; i < mixed.params.size(); ++i) {
    const ValueId gv = mixed.g.grad_of(mixed.params[i]);
    ASSERT_NE(gv, kNoValue) << c.label << ": " << mixed.names[i] << " got no gradient";
    EXPECT_EQ(mixed.g.value(gv).dtype, DType::f32) << c.label << ": " << mixed.names[i];
    const Tensor analytic = ex_mixed.get(gv).clone();
    Tensor& x = data[i];
    std::vector<double> numeric(static_cast<size_t>(x.numel()));
    double scale = 0;
    for (int64_t e = 0; e < x.numel(); ++e) {
      const double orig = x.item(e);
      x.set_item(e, orig + eps);
      ex_twin.run_forward();
      const double lp = ex_twin.get(twin.loss).item();
      x.set_item(e, orig - eps);
      ex_twin.run_forward();
      const double lm = ex_twin.get(twin.loss).item();
      x.set_item(e, orig);
      numeric[static_cast<size_t>(e)] = (lp - lm) / (2 * eps);
      scale = std::max(scale, std::fabs(numeric[static_cast<size_t>(e)]));
    }
    ASSERT_GT(scale, 0) << c.label << ": " << mixed.names[i] << " has a zero gradient";
    double worst = 0;
    int64_t at = 0;
    for (int64_t e = 0; e < x.numel(); ++e) {
      const double d = std::fabs(analytic.item(e) - numeric[static_cast<size_t>(e)]);
      if (d > worst) {
        worst = d;
        at = e;
      }
    }
    EXPECT_LE(worst, kMixedUlps * u * scale)
        << c.label << " (" << dtype_name(narrow) << "): d loss / d " << mixed.names[i] << " "
        << x.desc() << ": max difference " << worst << " (" << worst / (u * scale)
        << " u of max|grad| " << scale << ") at element " << at << " (analytic "
        << analytic.item(at) << ", numeric " << numeric[static_cast<size_t>(at)] << ")";
  }
}

std::vector<MixedParam> mixed_params() {
  std::vector<MixedParam> out;
  for (DType t : {DType::bf16, DType::f16}) {
    for (const MixedCase& c : mixed_cases()) out.push_back({c, t});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Ops, MixedGradCheck, ::testing::ValuesIn(mixed_params()),
                         [](const ::testing::TestParamInfo<MixedParam>& p) {
                           return p.param.c.label + "_" + std::string(dtype_name(p.param.narrow));
                         });

// Every operator that has a gradient rule in the registry has a case above,
// so adding a differentiable operator without a check fails here. Collectives
// need several ranks: tests/spmd/collective_ops_test.cpp checks them (and has
// its own coverage test).
TEST(GradCheckTable, CoversEveryDifferentiableOperator) {
  std::vector<OpKind> ops = all_ops();
  std::vector<bool> covered(ops.size(), false);
  for (const GradCase& c : cases()) covered.at(static_cast<size_t>(c.op)) = true;
  int differentiable = 0;
  for (OpKind op : ops) {
    if (op_def(op).grad == nullptr || is_group_op(op)) continue;
    ++differentiable;
    EXPECT_TRUE(covered[static_cast<size_t>(op)]) << op_name(op) << " has no gradient check";
  }
  EXPECT_GE(differentiable, 21);
}

}  // namespace
}  // namespace mt
