// Graph IR, builder, shape inference (and its error messages), cost facts,
// autodiff structure, describe().
#include <gtest/gtest.h>

#include <string>

#include "meshtrain/graph/autodiff.h"
#include "meshtrain/graph/builder.h"
#include "meshtrain/graph/cost.h"
#include "meshtrain/graph/op_registry.h"
#include "meshtrain/graph/print.h"

namespace mt {
namespace {

const ParamInit kInit{ParamInit::Kind::normal, 0.1};

// Runs f, expects ShapeError, returns its message.
template <class F>
std::string shape_error(F&& f) {
  try {
    f();
  } catch (const ShapeError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a ShapeError";
  return "";
}

TEST(Graph, ValuesNodesAndNames) {
  Graph g;
  Builder b(g);
  ValueId x = b.input("x", {4, 3});
  b.push_scope("fc1");
  ValueId w = b.param("w", {3, 5}, kInit);
  ValueId y = b.name(b.matmul(x, w), "out");
  ValueId r = b.relu(y);
  b.pop_scope();
  EXPECT_EQ(g.value(w).name, "fc1.w");
  EXPECT_EQ(g.value(y).name, "fc1.out");
  EXPECT_EQ(g.value(r).name.rfind("fc1.relu_", 0), 0u) << g.value(r).name;
  EXPECT_EQ(g.value(y).shape, (Shape{4, 5}));
  EXPECT_EQ(g.value(y).role, ValueRole::activation);
  EXPECT_EQ(g.value(y).producer, 0);
  EXPECT_EQ(g.find("fc1.w"), w);
  EXPECT_FALSE(g.find("nope").has_value());
  EXPECT_EQ(g.param_count(), 15);
  EXPECT_EQ(g.num_nodes(), 2);
  EXPECT_EQ(op_name(OpKind::matmul), "matmul");
  EXPECT_THROW(b.param("fc1.w", {1}, kInit), ConfigError);  // duplicate (no scope now)
  b.push_scope("fc1");
  EXPECT_THROW(b.param("w", {1}, kInit), ConfigError);
}

TEST(Graph, RenamingANodeRenamesItsOutputs) {
  Graph g;
  Builder b(g);
  ValueId x = b.input("x", {2, 4});
  ValueId ln = b.layer_norm(x, b.param("g", {4}, kInit), b.param("b", {4}, kInit));
  b.push_scope("block0");
  b.name(ln, "ln1");
  const Node& n = g.node(g.value(ln).producer);
  EXPECT_EQ(n.name, "block0.ln1");
  EXPECT_EQ(g.value(n.outputs[0]).name, "block0.ln1");
  EXPECT_EQ(g.value(n.outputs[1]).name, "block0.ln1.mean");
  EXPECT_EQ(g.value(n.outputs[2]).name, "block0.ln1.rstd");
  EXPECT_EQ(g.find("block0.ln1.rstd"), n.outputs[2]);
  EXPECT_THROW(b.name(b.relu(x), "ln1"), ConfigError);  // taken
  EXPECT_THROW(b.name(x, "y"), ConfigError);            // not an operator output
}

TEST(Graph, EveryOpKindHasARegistryEntry) {
  std::vector<OpKind> ops = all_ops();
  EXPECT_EQ(ops.size(), static_cast<size_t>(OpKind::vocab_ce_loss_grad) + 1);
  for (OpKind op : ops) {
    EXPECT_FALSE(op_name(op).empty());
    EXPECT_NE(op_def(op).infer, nullptr);
  }
}

TEST(Graph, AttrGettersNameKeyAndType) {
  Attrs a;
  a.set("alpha", 2.0).set("n", int64_t{3});
  EXPECT_EQ(a.f("alpha"), 2.0);
  EXPECT_EQ(a.i_or("missing", 7), 7);
  try {
    a.i("alpha");
    FAIL();
  } catch (const InternalError& e) {
    EXPECT_NE(std::string(e.what()).find("'alpha'"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("expected int, got float"), std::string::npos);
  }
  try {
    a.b("flag");
    FAIL();
  } catch (const InternalError& e) {
    EXPECT_NE(std::string(e.what()).find("'flag' is missing"), std::string::npos);
  }
}

TEST(ShapeInference, MatmulVariants) {
  Graph g;
  Builder b(g);
  ValueId a = b.input("a", {8, 3});
  ValueId w = b.input("w", {5, 3});
  EXPECT_EQ(b.shape(b.matmul(a, w, false, true)), (Shape{8, 5}));
  EXPECT_EQ(b.shape(b.matmul(a, a, true, false)), (Shape{3, 3}));
  ValueId q = b.input("q", {2, 4, 6});
  ValueId k = b.input("k", {2, 7, 6});
  EXPECT_EQ(b.shape(b.matmul(q, k, false, true)), (Shape{2, 4, 7}));
  ValueId shared = b.input("shared", {6, 9});
  EXPECT_EQ(b.shape(b.matmul(q, shared)), (Shape{2, 4, 9}));
  // Mixed precision: 16-bit operands accumulate into f32.
  ValueId ab = b.cast(a, DType::bf16);
  ValueId wb = b.cast(w, DType::bf16);
  ValueId c = b.matmul(ab, wb, false, true);
  EXPECT_EQ(g.value(c).dtype, DType::f32);
  // ... or into their own type when asked; nothing else.
  EXPECT_EQ(g.value(b.matmul(ab, wb, false, true, DType::bf16)).dtype, DType::bf16);
  std::string msg = shape_error([&] { b.matmul(ab, wb, false, true, DType::f64); });
  EXPECT_NE(msg.find("out_dtype f64 must be f32 or the inputs' dtype"), std::string::npos) << msg;
  msg = shape_error([&] { b.matmul(a, w, false, true, DType::bf16); });
  EXPECT_NE(msg.find("out_dtype bf16"), std::string::npos) << msg;
  // sum_to: a 16-bit x may sum into f32, nothing may narrow.
  Attrs wide = shape_attrs(Shape{5});
  wide.set("dtype", std::string("f32"));
  EXPECT_EQ(g.value(g.add_node(OpKind::sum_to, "s", {b.cast(c, DType::bf16)}, wide).front()).dtype,
            DType::f32);
  Attrs narrow = shape_attrs(Shape{5});
  narrow.set("dtype", std::string("bf16"));
  msg = shape_error([&] { g.add_node(OpKind::sum_to, "s2", {c}, narrow); });
  EXPECT_NE(msg.find("must be x's"), std::string::npos) << msg;
}

TEST(ShapeInference, MatmulErrorNamesNodeOpAndShapes) {
  Graph g;
  Builder b(g);
  ValueId h = b.input("h", {128, 512});
  ValueId w = b.param("w", {256, 10}, kInit);
  std::string msg = shape_error([&] { g.add_node(OpKind::matmul, "fc2", {h, w}); });
  EXPECT_EQ(msg, "node 'fc2' (matmul): inner dimensions differ: f32[128, 512] @ f32[256, 10]");
  // Nothing was added by the failed call.
  EXPECT_EQ(g.num_nodes(), 0);
  EXPECT_FALSE(g.find("fc2").has_value());

  ValueId q = b.input("q", {2, 4, 6});
  ValueId k = b.input("k", {3, 6, 4});
  msg = shape_error([&] { g.add_node(OpKind::matmul, "scores", {q, k}); });
  EXPECT_NE(msg.find("node 'scores' (matmul): batch dimensions differ"), std::string::npos) << msg;
  EXPECT_NE(msg.find("f32[2, 4, 6] @ f32[3, 6, 4]"), std::string::npos) << msg;
  ValueId d = b.input("d", {2, 4}, DType::f64);
  msg = shape_error([&] { b.matmul(h, d); });
  EXPECT_NE(msg.find("differ in dtype"), std::string::npos) << msg;
}

TEST(ShapeInference, BinaryBroadcastRules) {
  Graph g;
  Builder b(g);
  ValueId x = b.input("x", {4, 3});
  EXPECT_EQ(b.shape(b.add(x, b.input("bias", {3}))), (Shape{4, 3}));
  EXPECT_EQ(b.shape(b.mul(x, b.input("s", {}))), (Shape{4, 3}));
  EXPECT_EQ(b.shape(b.sub(x, b.input("one", {1}))), (Shape{4, 3}));
  ValueId bad = b.input("bad", {4});
  std::string msg = shape_error([&] { g.add_node(OpKind::add, "res", {x, bad}); });
  EXPECT_NE(msg.find("node 'res' (add)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("f32[4, 3] + f32[4]"), std::string::npos) << msg;
}

TEST(ShapeInference, ErrorsListEveryInput) {
  Graph g;
  Builder b(g);
  ValueId x = b.input("x", {2, 8});
  ValueId gamma = b.param("gamma", {7}, kInit);
  ValueId beta = b.param("beta", {8}, kInit);
  std::string msg = shape_error([&] {
    g.add_node(OpKind::layer_norm, "ln", {x, gamma, beta}, Attrs().set("eps", 1e-5));
  });
  EXPECT_NE(msg.find("node 'ln' (layer_norm)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("inputs: f32[2, 8], f32[7], f32[8]"), std::string::npos) << msg;

  ValueId logits = b.input("logits", {4, 10});
  ValueId labels = b.input("labels", {5}, DType::i32);
  msg = shape_error([&] { g.add_node(OpKind::cross_entropy, "loss", {logits, labels}); });
  EXPECT_NE(msg.find("labels must be i32[4]"), std::string::npos) << msg;
  ValueId flabels = b.input("flabels", {4});
  msg = shape_error([&] { b.cross_entropy(logits, flabels); });
  EXPECT_NE(msg.find("labels must be i32"), std::string::npos) << msg;

  ValueId img = b.input("img", {1, 3, 8, 8});
  ValueId k = b.param("k", {4, 2, 3, 3}, kInit);
  msg = shape_error([&] { g.add_node(OpKind::conv2d, "conv", {img, k}); });
  EXPECT_NE(msg.find("input channels differ: x has 3, w expects 2"), std::string::npos) << msg;
  ValueId big = b.param("big", {4, 3, 11, 11}, kInit);
  msg = shape_error([&] { b.conv2d(img, big, kNoValue, {}); });
  EXPECT_NE(msg.find("larger than the padded input 8x8"), std::string::npos) << msg;

  msg = shape_error([&] { b.reshape(x, {3, 5}); });
  EXPECT_NE(msg.find("cannot reshape f32[2, 8] (16 elements) to [3, 5]"), std::string::npos) << msg;
  msg = shape_error([&] { b.permute(x, {0, 0}); });
  EXPECT_NE(msg.find("not a permutation"), std::string::npos) << msg;
  ValueId ids = b.input("ids", {3}, DType::i32);
  msg = shape_error([&] { b.embedding(x, b.input("fids", {3})); });
  EXPECT_NE(msg.find("ids must be i32"), std::string::npos) << msg;
  EXPECT_EQ(b.shape(b.embedding(x, ids)), (Shape{3, 8}));
  msg = shape_error([&] { b.softmax(b.input("wide", {5, 3}), true); });
  EXPECT_NE(msg.find("T <= S"), std::string::npos) << msg;
}

TEST(ShapeInference, ConvPoolLayerNormOutputs) {
  Graph g;
  Builder b(g);
  ValueId x = b.input("x", {2, 3, 9, 7});
  ValueId w = b.param("w", {4, 3, 3, 2}, kInit);
  ValueId bias = b.param("bias", {4}, kInit);
  Conv2dParams cp;
  cp.stride_h = 2;
  cp.pad_h = 1;
  cp.pad_w = 1;
  ValueId y = b.conv2d(x, w, bias, cp);
  // OH = (9 + 2 - 3) / 2 + 1 = 5; OW = (7 + 2 - 2) / 1 + 1 = 8.
  EXPECT_EQ(b.shape(y), (Shape{2, 4, 5, 8}));
  Pool2dParams pp;
  pp.kernel_h = pp.kernel_w = 3;
  pp.stride_h = pp.stride_w = 2;
  ValueId p = b.max_pool2d(y, pp);
  EXPECT_EQ(b.shape(p), (Shape{2, 4, 2, 3}));
  const Node& pool = g.node(g.value(p).producer);
  ASSERT_EQ(pool.outputs.size(), 2u);
  EXPECT_EQ(g.value(pool.outputs[1]).dtype, DType::i32);
  EXPECT_EQ(g.value(pool.outputs[1]).name, g.value(p).name + ".argmax");

  ValueId h = b.input("h", {2, 5, 6}, DType::f64);
  ValueId ln =
      b.layer_norm(h, b.param("g", {6}, kInit, DType::f64), b.param("bt", {6}, kInit, DType::f64));
  const Node& n = g.node(g.value(ln).producer);
  ASSERT_EQ(n.outputs.size(), 3u);
  EXPECT_EQ(g.value(n.outputs[1]).shape, (Shape{10}));
  EXPECT_EQ(g.value(n.outputs[2]).dtype, DType::f64);
  EXPECT_EQ(b.shape(b.reshape(h, {-1, 6})), (Shape{10, 6}));
}

TEST(Cost, MatmulAndConvFlopsInClosedForm) {
  Graph g;
  Builder b(g);
  const int64_t M = 7, K = 11, N = 13, B = 3;
  ValueId a = b.input("a", {M, K});
  ValueId w = b.param("w", {N, K}, kInit);
  ValueId c = b.matmul(a, w, false, true);
  OpCost mc = op_cost(g, g.node(g.value(c).producer));
  EXPECT_EQ(mc.flops, 2.0 * M * N * K);
  EXPECT_EQ(mc.bytes, 4.0 * (M * K + N * K + M * N));
  ValueId q = b.input("q", {B, M, K});
  ValueId bm = b.matmul(q, w, false, true);
  EXPECT_EQ(op_cost(g, g.node(g.value(bm).producer)).flops, 2.0 * B * M * N * K);

  const int64_t n = 2, C = 3, H = 10, W = 9, O = 5, KH = 3, KW = 2;
  ValueId x = b.input("x", {n, C, H, W});
  ValueId k = b.param("k", {O, C, KH, KW}, kInit);
  Conv2dParams p;
  p.stride_h = 2;
  p.pad_w = 1;
  ValueId y = b.conv2d(x, k, kNoValue, p);
  const int64_t OH = (H - KH) / 2 + 1, OW = (W + 2 - KW) + 1;
  ASSERT_EQ(b.shape(y), (Shape{n, O, OH, OW}));
  EXPECT_EQ(op_cost(g, g.node(g.value(y).producer)).flops, 2.0 * n * O * OH * OW * C * KH * KW);
  ValueId yb = b.conv2d(x, k, b.param("kb", {O}, kInit), p);
  EXPECT_EQ(op_cost(g, g.node(g.value(yb).producer)).flops,
            2.0 * n * O * OH * OW * C * KH * KW + n * O * OH * OW);

  // A reshape is a view: no FLOPs, no bytes.
  ValueId r = b.reshape(y, {n, -1});
  EXPECT_EQ(op_cost(g, g.node(g.value(r).producer)).bytes, 0.0);

  OpCost total = graph_cost(g);
  double sum = 0;
  for (const Node& node : g.nodes()) sum += op_cost(g, node).flops;
  EXPECT_EQ(total.flops, sum);
}

TEST(Cost, BackwardOfMatmulCostsTwiceTheForward) {
  Graph g;
  Builder b(g);
  ValueId x = b.param("x", {6, 4}, kInit);
  ValueId w = b.param("w", {4, 9}, kInit);
  ValueId y = b.matmul(x, w);
  ValueId loss = b.sum_to(y, {});
  build_backward(g, loss);
  double fwd = 0, bwd_mm = 0;
  for (const Node& n : g.nodes()) {
    if (n.op != OpKind::matmul) continue;
    (n.backward ? bwd_mm : fwd) += op_cost(g, n).flops;
  }
  EXPECT_EQ(fwd, 2.0 * 6 * 4 * 9);
  EXPECT_EQ(bwd_mm, 2 * fwd);
}

TEST(Autodiff, MlpStructureAndNames) {
  Graph g;
  Builder b(g);
  ValueId x = b.input("x", {8, 4});
  ValueId labels = b.input("labels", {8}, DType::i32);
  ValueId w1 = b.param("fc1.w", {4, 16}, kInit);
  ValueId b1 = b.param("fc1.b", {16}, kInit);
  ValueId w2 = b.param("fc2.w", {16, 3}, kInit);
  ValueId unused = b.param("unused", {2}, kInit);
  ValueId h = b.relu(b.add(b.matmul(x, w1), b1));
  ValueId loss = b.name(b.cross_entropy(b.matmul(h, w2), labels), "loss");
  const int forward = g.num_nodes();
  build_backward(g, loss);
  EXPECT_EQ(g.loss(), loss);
  EXPECT_EQ(g.num_forward_nodes(), forward);
  for (int i = forward; i < g.num_nodes(); ++i) EXPECT_TRUE(g.node(i).backward);
  for (ValueId p : {w1, b1, w2}) {
    ValueId gp = g.grad_of(p);
    ASSERT_NE(gp, kNoValue) << g.value(p).name;
    EXPECT_EQ(g.value(gp).name, "grad/" + g.value(p).name);
    EXPECT_EQ(g.value(gp).shape, g.value(p).shape);
    EXPECT_EQ(g.value(gp).role, ValueRole::grad);
  }
  EXPECT_EQ(g.grad_of(unused), kNoValue);
  EXPECT_EQ(g.grad_of(x), kNoValue);  // inputs get no gradient
  // The seed d loss / d loss = 1.
  ASSERT_TRUE(g.find("grad/loss").has_value());
  const Node& seed = g.node(g.value(*g.find("grad/loss")).producer);
  EXPECT_EQ(seed.op, OpKind::fill);
  EXPECT_EQ(seed.attrs.f("value"), 1.0);
  // The bias gradient reduces the broadcast dimension.
  EXPECT_EQ(g.node(g.value(g.grad_of(b1)).producer).op, OpKind::sum_to);
  EXPECT_THROW(build_backward(g, loss), InternalError);
}

TEST(Autodiff, TiedParameterGetsSummedGradient) {
  Graph g;
  Builder b(g);
  ValueId ids = b.input("ids", {5}, DType::i32);
  ValueId labels = b.input("labels", {5}, DType::i32);
  ValueId table = b.param("wte", {11, 4}, kInit);
  ValueId h = b.embedding(table, ids);               // [5, 4]
  ValueId logits = b.matmul(h, table, false, true);  // tied head: [5, 11]
  ValueId loss = b.cross_entropy(logits, labels);
  build_backward(g, loss);
  ValueId gt = g.grad_of(table);
  ASSERT_NE(gt, kNoValue);
  const Node& sum = g.node(g.value(gt).producer);
  EXPECT_EQ(sum.op, OpKind::add);
  EXPECT_EQ(g.value(gt).name, "grad/wte");
  ASSERT_EQ(sum.inputs.size(), 2u);
  std::vector<OpKind> parts{g.node(g.value(sum.inputs[0]).producer).op,
                            g.node(g.value(sum.inputs[1]).producer).op};
  std::sort(parts.begin(), parts.end());
  EXPECT_EQ(parts, (std::vector<OpKind>{OpKind::matmul, OpKind::embedding_grad}));
  EXPECT_EQ(g.value(sum.inputs[0]).name.rfind("grad/wte.", 0), 0u);
}

TEST(Autodiff, PassThroughGradientOfParamIsCopied) {
  // add(p, q) hands dy unchanged to both; each parameter gets its own value.
  Graph g;
  Builder b(g);
  ValueId p = b.param("p", {3}, kInit);
  ValueId q = b.param("q", {3}, kInit);
  ValueId loss = b.sum_to(b.add(p, q), {});
  build_backward(g, loss);
  ASSERT_NE(g.grad_of(p), kNoValue);
  ASSERT_NE(g.grad_of(q), kNoValue);
  EXPECT_NE(g.grad_of(p), g.grad_of(q));
  EXPECT_EQ(g.value(g.grad_of(p)).name, "grad/p");
}

TEST(Autodiff, MixedPrecisionGradientsStayF32) {
  // The bf16 copies' gradients are carried in f32: the weight's gradient is
  // the matmul's f32 product itself, not rounded to bf16 and widened again.
  Graph g;
  Builder b(g);
  ValueId x = b.input("x", {4, 8});
  ValueId w = b.param("w", {8, 2}, kInit);
  ValueId y = b.matmul(b.cast(x, DType::bf16), b.cast(w, DType::bf16));
  ASSERT_EQ(g.value(y).dtype, DType::f32);
  build_backward(g, b.sum_to(y, {}));
  ValueId gw = g.grad_of(w);
  ASSERT_NE(gw, kNoValue);
  EXPECT_EQ(g.value(gw).dtype, DType::f32);
  EXPECT_EQ(g.value(gw).name, "grad/w");
  const Node& back = g.node(g.value(gw).producer);
  EXPECT_EQ(back.op, OpKind::matmul);
  EXPECT_EQ(g.value(back.inputs[0]).dtype, DType::bf16);
  // The only cast left in backward is dy's, to bf16 for the matmul.
  int casts = 0;
  for (const Node& n : g.nodes()) {
    if (n.backward && n.op == OpKind::cast) {
      ++casts;
      EXPECT_EQ(g.value(n.outputs[0]).dtype, DType::bf16) << n.name;
    }
  }
  EXPECT_EQ(casts, 1);
}

TEST(Autodiff, WideAndNarrowContributionsMeetInF32) {
  // wb feeds a matmul (f32 gradient) and a bf16 sum (bf16 gradient): the
  // narrow one is widened before they are added.
  Graph g;
  Builder b(g);
  ValueId x = b.input("x", {4, 8});
  ValueId w = b.param("w", {8, 2}, kInit);
  ValueId wb = b.cast(w, DType::bf16);
  ValueId y = b.sum_to(b.matmul(b.cast(x, DType::bf16), wb), {});
  ValueId s = b.cast(b.sum_to(wb, {}), DType::f32);
  build_backward(g, b.add(y, s));
  ValueId gw = g.grad_of(w);
  ASSERT_NE(gw, kNoValue);
  const Node& sum = g.node(g.value(gw).producer);
  ASSERT_EQ(sum.op, OpKind::add);
  EXPECT_EQ(g.value(gw).dtype, DType::f32);
  for (ValueId in : sum.inputs) EXPECT_EQ(g.value(in).dtype, DType::f32);
}

TEST(Autodiff, Bf16ActivationChainHasOneCastInBackward) {
  // x -> bf16 matmul with bf16 output + bf16 bias -> relu (bf16) -> matmul
  // with f32 output -> loss. Backward: only the loss side's f32 gradient is
  // cast (to bf16, for the matmuls); weight and bias gradients come out f32
  // straight from their matmul / sum.
  Graph g;
  Builder b(g);
  ValueId x = b.input("x", {4, 8});
  ValueId w1 = b.param("w1", {8, 6}, kInit), b1 = b.param("b1", {6}, kInit);
  ValueId w2 = b.param("w2", {6, 3}, kInit);
  ValueId h = b.relu(
      b.add(b.matmul(b.cast(x, DType::bf16), b.cast(w1, DType::bf16), false, false, DType::bf16),
            b.cast(b1, DType::bf16)));
  EXPECT_EQ(g.value(h).dtype, DType::bf16);
  ValueId y = b.matmul(h, b.cast(w2, DType::bf16), false, false, DType::f32);
  build_backward(g, b.sum_to(y, {}));
  int casts = 0;
  for (const Node& n : g.nodes()) casts += n.backward && n.op == OpKind::cast;
  EXPECT_EQ(casts, 1);
  for (ValueId p : {w1, b1, w2}) {
    ASSERT_NE(g.grad_of(p), kNoValue);
    EXPECT_EQ(g.value(g.grad_of(p)).dtype, DType::f32) << g.value(p).name;
  }
  EXPECT_EQ(g.node(g.value(g.grad_of(b1)).producer).op, OpKind::sum_to);
}

TEST(Autodiff, RejectsNonScalarLoss) {
  Graph g;
  Builder b(g);
  ValueId w = b.param("w", {3}, kInit);
  try {
    build_backward(g, b.name(b.relu(w), "v"));
    FAIL();
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("loss 'v' must be a float scalar, got f32[3]"),
              std::string::npos)
        << e.what();
  }
}

TEST(Describe, OneLinePerNodeWithParamsAndFlops) {
  Graph g;
  Builder b(g);
  ValueId x = b.input("x", {2, 3});
  ValueId w = b.param("w", {3, 4}, kInit);
  b.name(b.matmul(x, w), "fc");
  std::string s = describe(g);
  EXPECT_NE(s.find("1 nodes"), std::string::npos) << s;
  EXPECT_NE(s.find("param  w"), std::string::npos) << s;
  // fc line: op, output type, 12 parameter elements, 48 FLOPs.
  const size_t at = s.find(" fc ");
  ASSERT_NE(at, std::string::npos) << s;
  const std::string line = s.substr(at, s.find('\n', at) - at);
  EXPECT_NE(line.find("matmul"), std::string::npos) << line;
  EXPECT_NE(line.find("f32[2, 4]"), std::string::npos) << line;
  EXPECT_NE(line.find(" 12 "), std::string::npos) << line;
  EXPECT_NE(line.find("48 FLOP"), std::string::npos) << line;
}

}  // namespace
}  // namespace mt
