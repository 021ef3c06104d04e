// 2-D convolution (NCHW, weights OIHW, optional bias) and max pooling, with
// their backward operators.
#include <fmt/format.h>

#include "meshtrain/graph/op_registry.h"

namespace mt {

namespace {

struct Window {
  int64_t kh = 1, kw = 1, sh = 1, sw = 1, ph = 0, pw = 0;
};

Window conv_window(const Attrs& a, int64_t kh, int64_t kw) {
  return {
      kh, kw, a.i_or("stride_h", 1), a.i_or("stride_w", 1), a.i_or("pad_h", 0), a.i_or("pad_w", 0)};
}

Window pool_window(const Attrs& a) {
  return {a.i("kernel_h"), a.i("kernel_w"),    a.i("stride_h"),
          a.i("stride_w"), a.i_or("pad_h", 0), a.i_or("pad_w", 0)};
}

// Output spatial size of a window sliding over [h, w]; fails on bad geometry.
std::pair<int64_t, int64_t> out_hw(const InferContext& c, const Window& win, int64_t h, int64_t w) {
  if (win.kh < 1 || win.kw < 1 || win.sh < 1 || win.sw < 1 || win.ph < 0 || win.pw < 0) {
    c.fail(fmt::format("bad window: kernel {}x{}, stride {}x{}, pad {}x{}", win.kh, win.kw, win.sh,
                       win.sw, win.ph, win.pw));
  }
  if (h + 2 * win.ph < win.kh || w + 2 * win.pw < win.kw) {
    c.fail(fmt::format("kernel {}x{} is larger than the padded input {}x{}", win.kh, win.kw,
                       h + 2 * win.ph, w + 2 * win.pw));
  }
  return {(h + 2 * win.ph - win.kh) / win.sh + 1, (w + 2 * win.pw - win.kw) / win.sw + 1};
}

Attrs conv_attrs_of(const Attrs& a) {
  return Attrs()
      .set("stride_h", a.i_or("stride_h", 1))
      .set("stride_w", a.i_or("stride_w", 1))
      .set("pad_h", a.i_or("pad_h", 0))
      .set("pad_w", a.i_or("pad_w", 0));
}

// ---- conv2d ----

std::vector<ValueType> infer_conv2d(const InferContext& c) {
  c.expect_rank(0, 4, "x (NCHW)");
  c.expect_rank(1, 4, "w (OIHW)");
  c.expect_float(0, "x");
  c.expect_same_dtype(0, 1);
  const Shape& x = c.shape(0);
  const Shape& w = c.shape(1);
  if (w[1] != x[1]) {
    c.fail(fmt::format("input channels differ: x has {}, w expects {}", x[1], w[1]));
  }
  if (c.num_inputs() == 3) {
    c.expect_same_dtype(0, 2);
    if (c.shape(2) != Shape{w[0]}) c.fail(fmt::format("bias must have shape [{}]", w[0]));
  }
  auto [oh, ow] = out_hw(c, conv_window(c.attrs(), w[2], w[3]), x[2], x[3]);
  return {{Shape{x[0], w[0], oh, ow}, c.dtype(0)}};
}

// 2 * N * O * OH * OW * C * KH * KW, given dy [N,O,OH,OW] and w [O,C,KH,KW].
double conv_core_flops(const Shape& dy, const Shape& w) {
  return 2.0 * static_cast<double>(dy.numel()) * static_cast<double>(w[1] * w[2] * w[3]);
}

double flops_conv2d(const Graph& g, const Node& n) {
  const Shape& y = g.value(n.outputs[0]).shape;
  double f = conv_core_flops(y, g.value(n.inputs[1]).shape);
  if (n.inputs.size() == 3) f += static_cast<double>(y.numel());
  return f;
}

void grad_conv2d(GradContext& c) {
  const Attrs base = conv_attrs_of(c.attrs());
  if (c.wants(0)) {
    Attrs a = base;
    a.set("shape", c.value(c.x(0)).shape.dims());
    c.give(0, c.emit(OpKind::conv2d_grad_data, c.name(0), {c.dy(), c.x(1)}, a));
  }
  const bool bias = c.num_inputs() == 3 && c.wants(2);
  if (c.wants(1) || bias) {
    Attrs a = base;
    a.set("has_bias", bias).set("shape", c.value(c.x(1)).shape.dims());
    std::vector<ValueId> outs =
        c.emit_multi(OpKind::conv2d_grad_weight, c.name(1), {c.dy(), c.x(0)}, a);
    c.give(1, outs[0]);
    if (bias) {
      c.graph().rename_value(outs[1], c.name(2));
      c.give(2, outs[1]);
    }
  }
}

std::vector<ValueType> infer_conv2d_grad_data(const InferContext& c) {
  c.expect_rank(0, 4, "dy");
  c.expect_rank(1, 4, "w");
  c.expect_float(0, "dy");
  c.expect_same_dtype(0, 1);
  Shape x = c.shape_attr("shape");
  const Shape& w = c.shape(1);
  if (x.rank() != 4 || x[1] != w[1]) c.fail(fmt::format("x shape {} does not fit w", x.str()));
  auto [oh, ow] = out_hw(c, conv_window(c.attrs(), w[2], w[3]), x[2], x[3]);
  if (c.shape(0) != Shape{x[0], w[0], oh, ow}) {
    c.fail(fmt::format("dy must be [{}, {}, {}, {}] for x {}", x[0], w[0], oh, ow, x.str()));
  }
  return {{x, c.dtype(0)}};
}

double flops_conv2d_grad_data(const Graph& g, const Node& n) {
  return conv_core_flops(g.value(n.inputs[0]).shape, g.value(n.inputs[1]).shape);
}

std::vector<ValueType> infer_conv2d_grad_weight(const InferContext& c) {
  c.expect_rank(0, 4, "dy");
  c.expect_rank(1, 4, "x");
  c.expect_float(0, "dy");
  c.expect_same_dtype(0, 1);
  Shape w = c.shape_attr("shape");
  const Shape& x = c.shape(1);
  if (w.rank() != 4 || w[1] != x[1]) c.fail(fmt::format("w shape {} does not fit x", w.str()));
  auto [oh, ow] = out_hw(c, conv_window(c.attrs(), w[2], w[3]), x[2], x[3]);
  if (c.shape(0) != Shape{x[0], w[0], oh, ow}) {
    c.fail(fmt::format("dy must be [{}, {}, {}, {}] for w {}", x[0], w[0], oh, ow, w.str()));
  }
  std::vector<ValueType> out{{w, c.dtype(0)}};
  if (c.attrs().b("has_bias")) out.push_back({Shape{w[0]}, c.dtype(0)});
  return out;
}

double flops_conv2d_grad_weight(const Graph& g, const Node& n) {
  const Shape& dy = g.value(n.inputs[0]).shape;
  double f = conv_core_flops(dy, g.value(n.outputs[0]).shape);
  if (n.outputs.size() == 2) f += static_cast<double>(dy.numel());
  return f;
}

// ---- max_pool2d ----

std::vector<ValueType> infer_max_pool2d(const InferContext& c) {
  c.expect_rank(0, 4, "x (NCHW)");
  c.expect_float(0, "x");
  const Shape& x = c.shape(0);
  Window win = pool_window(c.attrs());
  if (win.ph * 2 > win.kh || win.pw * 2 > win.kw) {
    c.fail(
        fmt::format("padding {}x{} exceeds half the kernel {}x{}", win.ph, win.pw, win.kh, win.kw));
  }
  auto [oh, ow] = out_hw(c, win, x[2], x[3]);
  Shape y{x[0], x[1], oh, ow};
  return {{y, c.dtype(0)}, {y, DType::i32}};
}

double flops_max_pool2d(const Graph& g, const Node& n) {
  Window win = pool_window(n.attrs);
  return numel_of(g, n.outputs[0]) * static_cast<double>(win.kh * win.kw);
}

void grad_max_pool2d(GradContext& c) {
  Attrs a = shape_attrs(c.value(c.x(0)).shape);
  for (const char* k : {"kernel_h", "kernel_w", "stride_h", "stride_w", "pad_h", "pad_w"}) {
    if (c.attrs().has(k)) a.set(k, c.attrs().i(k));
  }
  c.give(0, c.emit(OpKind::max_pool2d_grad, c.name(0), {c.dy(), c.y(1)}, a));
}

std::vector<ValueType> infer_max_pool2d_grad(const InferContext& c) {
  c.expect_rank(0, 4, "dy");
  c.expect_float(0, "dy");
  c.expect_dtype(1, DType::i32, "argmax");
  if (c.shape(1) != c.shape(0)) c.fail("argmax must have dy's shape");
  Shape x = c.shape_attr("shape");
  if (x.rank() != 4 || x[0] != c.shape(0)[0] || x[1] != c.shape(0)[1]) {
    c.fail(fmt::format("x shape {} does not fit dy", x.str()));
  }
  return {{x, c.dtype(0)}};
}

double flops_max_pool2d_grad(const Graph& g, const Node& n) {
  return numel_of(g, n.inputs[0]);
}

}  // namespace

void register_conv_ops(std::vector<OpDef>& t) {
  t.push_back(make_op_def(OpKind::conv2d, "conv2d", 2, 3, infer_conv2d, flops_conv2d, grad_conv2d));
  t.push_back(make_op_def(OpKind::conv2d_grad_data, "conv2d_grad_data", 2, 2,
                          infer_conv2d_grad_data, flops_conv2d_grad_data, nullptr));
  OpDef gw = make_op_def(OpKind::conv2d_grad_weight, "conv2d_grad_weight", 2, 2,
                         infer_conv2d_grad_weight, flops_conv2d_grad_weight, nullptr);
  gw.extra_output_names = {"dbias"};
  t.push_back(gw);
  OpDef pool = make_op_def(OpKind::max_pool2d, "max_pool2d", 1, 1, infer_max_pool2d,
                           flops_max_pool2d, grad_max_pool2d);
  pool.extra_output_names = {"argmax"};
  t.push_back(pool);
  t.push_back(make_op_def(OpKind::max_pool2d_grad, "max_pool2d_grad", 2, 2, infer_max_pool2d_grad,
                          flops_max_pool2d_grad, nullptr));
}

}  // namespace mt
