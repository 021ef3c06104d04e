// Reference kernels for NCHW convolution (weights OIHW) and max pooling.
#include <cmath>
#include <limits>
#include <vector>

#include "meshtrain/tensor/backends/reference/reference_backend.h"
#include "meshtrain/tensor/backends/reference/reference_util.h"

namespace mt {

using namespace reference;

namespace {

using ConvGeom = Conv2dDims;

void check_conv_out(const char* kernel, const char* name, const Tensor& t, const ConvGeom& g,
                    const Conv2dParams& p) {
  require_defined(kernel, name, t);
  const Shape want{g.n, g.co, g.oh, g.ow};
  if (!(t.shape() == want)) {
    fail(kernel, "{} is {}, expected shape {} ({})", name, t.desc(), want.str(),
         conv2d_params_str(p));
  }
}

void check_bias(const char* kernel, const char* name, const Tensor& bias, const Tensor& ref,
                int64_t co) {
  require_same_dtype(kernel, "w", ref, name, bias);
  require_shape(kernel, name, bias, Shape{co});
}

}  // namespace

// ---- convolution ----

void ReferenceBackend::conv2d(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y,
                              const Conv2dParams& p) {
  const char* K = "conv2d";
  require_f32_f64(K, "x", x);
  require_defined(K, "w", w);
  require_same_dtype(K, "x", x, "w", w);
  const ConvGeom g = check_conv2d(K, x, "x", w, "w", p);
  if (bias.defined()) check_bias(K, "bias", bias, w, g.co);
  check_conv_out(K, "y", y, g, p);
  require_same_dtype(K, "x", x, "y", y);
  dispatch_f32_f64(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    const T* pw = w.data<T>();
    T* py = y.data<T>();
    for (int64_t n = 0; n < g.n; ++n)
      for (int64_t o = 0; o < g.co; ++o)
        for (int64_t oh = 0; oh < g.oh; ++oh)
          for (int64_t ow = 0; ow < g.ow; ++ow) {
            double acc = bias.defined() ? static_cast<double>(bias.data<T>()[o]) : 0.0;
            for (int64_t c = 0; c < g.ci; ++c)
              for (int64_t i = 0; i < g.kh; ++i) {
                const int64_t ih = oh * p.stride_h - p.pad_h + i;
                if (ih < 0 || ih >= g.h) continue;  // zero padding
                for (int64_t j = 0; j < g.kw; ++j) {
                  const int64_t iw = ow * p.stride_w - p.pad_w + j;
                  if (iw < 0 || iw >= g.w) continue;
                  acc += static_cast<double>(px[((n * g.ci + c) * g.h + ih) * g.w + iw]) *
                         pw[((o * g.ci + c) * g.kh + i) * g.kw + j];
                }
              }
            py[((n * g.co + o) * g.oh + oh) * g.ow + ow] = static_cast<T>(acc);
          }
  });
}

void ReferenceBackend::conv2d_backward_data(const Tensor& dy, const Tensor& w, Tensor& dx,
                                            const Conv2dParams& p) {
  const char* K = "conv2d_backward_data";
  require_f32_f64(K, "dx", dx);
  require_defined(K, "w", w);
  require_defined(K, "dy", dy);
  require_same_dtype(K, "dx", dx, "w", w);
  require_same_dtype(K, "dx", dx, "dy", dy);
  // dx fixes H and W: with stride > 1 several input sizes give the same dy.
  const ConvGeom g = check_conv2d(K, dx, "dx", w, "w", p);
  check_conv_out(K, "dy", dy, g, p);
  dispatch_f32_f64(dx.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* pdy = dy.data<T>();
    const T* pw = w.data<T>();
    // The exact transpose of the forward loop: every product that conv2d adds
    // into y is scattered back into dx.
    std::vector<double> acc(static_cast<size_t>(dx.numel()), 0.0);
    for (int64_t n = 0; n < g.n; ++n)
      for (int64_t o = 0; o < g.co; ++o)
        for (int64_t oh = 0; oh < g.oh; ++oh)
          for (int64_t ow = 0; ow < g.ow; ++ow) {
            const double d = pdy[((n * g.co + o) * g.oh + oh) * g.ow + ow];
            for (int64_t c = 0; c < g.ci; ++c)
              for (int64_t i = 0; i < g.kh; ++i) {
                const int64_t ih = oh * p.stride_h - p.pad_h + i;
                if (ih < 0 || ih >= g.h) continue;
                for (int64_t j = 0; j < g.kw; ++j) {
                  const int64_t iw = ow * p.stride_w - p.pad_w + j;
                  if (iw < 0 || iw >= g.w) continue;
                  acc[static_cast<size_t>(((n * g.ci + c) * g.h + ih) * g.w + iw)] +=
                      d * pw[((o * g.ci + c) * g.kh + i) * g.kw + j];
                }
              }
          }
    T* pdx = dx.data<T>();
    for (int64_t i = 0; i < dx.numel(); ++i) pdx[i] = static_cast<T>(acc[static_cast<size_t>(i)]);
  });
}

void ReferenceBackend::conv2d_backward_weight(const Tensor& dy, const Tensor& x, Tensor& dw,
                                              Tensor& dbias, const Conv2dParams& p) {
  const char* K = "conv2d_backward_weight";
  require_f32_f64(K, "x", x);
  require_defined(K, "dw", dw);
  require_defined(K, "dy", dy);
  require_same_dtype(K, "x", x, "dw", dw);
  require_same_dtype(K, "x", x, "dy", dy);
  const ConvGeom g = check_conv2d(K, x, "x", dw, "dw", p);
  if (dbias.defined()) check_bias(K, "dbias", dbias, dw, g.co);
  check_conv_out(K, "dy", dy, g, p);
  dispatch_f32_f64(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    const T* pdy = dy.data<T>();
    T* pdw = dw.data<T>();
    for (int64_t o = 0; o < g.co; ++o)
      for (int64_t c = 0; c < g.ci; ++c)
        for (int64_t i = 0; i < g.kh; ++i)
          for (int64_t j = 0; j < g.kw; ++j) {
            double acc = 0.0;
            for (int64_t n = 0; n < g.n; ++n)
              for (int64_t oh = 0; oh < g.oh; ++oh) {
                const int64_t ih = oh * p.stride_h - p.pad_h + i;
                if (ih < 0 || ih >= g.h) continue;
                for (int64_t ow = 0; ow < g.ow; ++ow) {
                  const int64_t iw = ow * p.stride_w - p.pad_w + j;
                  if (iw < 0 || iw >= g.w) continue;
                  acc += static_cast<double>(pdy[((n * g.co + o) * g.oh + oh) * g.ow + ow]) *
                         px[((n * g.ci + c) * g.h + ih) * g.w + iw];
                }
              }
            pdw[((o * g.ci + c) * g.kh + i) * g.kw + j] = static_cast<T>(acc);
          }
    if (!dbias.defined()) return;
    T* pdb = dbias.data<T>();
    for (int64_t o = 0; o < g.co; ++o) {
      double acc = 0.0;
      for (int64_t n = 0; n < g.n; ++n)
        for (int64_t k = 0; k < g.oh * g.ow; ++k) acc += pdy[(n * g.co + o) * g.oh * g.ow + k];
      pdb[o] = static_cast<T>(acc);
    }
  });
}

// ---- max pooling ----

void ReferenceBackend::max_pool2d(const Tensor& x, Tensor& y, Tensor& argmax,
                                  const Pool2dParams& p) {
  const char* K = "max_pool2d";
  require_f32_f64(K, "x", x);
  require_rank(K, "x", x, 4);
  const Shape want = max_pool2d_out_shape(x, p);
  const int64_t n = want[0], c = want[1], h = x.shape()[2], w = x.shape()[3];
  const int64_t oh = want[2], ow = want[3];
  require_defined(K, "y", y);
  require_same_dtype(K, "x", x, "y", y);
  check_pool2d_output(x, y, want, p);
  require_i32(K, "argmax", argmax);
  require_shape(K, "argmax", argmax, want);
  dispatch_f32_f64(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* py = y.data<T>();
    int32_t* pa = argmax.data<int32_t>();
    for (int64_t plane = 0; plane < n * c; ++plane) {
      const T* px = x.data<T>() + plane * h * w;
      for (int64_t r = 0; r < oh; ++r)
        for (int64_t q = 0; q < ow; ++q) {
          // Padding is -inf, so only real elements can win; 0 <= pad < kernel
          // guarantees each window holds one.
          double best = -std::numeric_limits<double>::infinity();
          int64_t best_idx = -1;
          for (int64_t i = 0; i < p.kernel_h; ++i) {
            const int64_t ih = r * p.stride_h - p.pad_h + i;
            if (ih < 0 || ih >= h) continue;
            for (int64_t j = 0; j < p.kernel_w; ++j) {
              const int64_t iw = q * p.stride_w - p.pad_w + j;
              if (iw < 0 || iw >= w) continue;
              const double v = px[ih * w + iw];
              const bool first = best_idx < 0;
              if (first || (!std::isnan(best) && (std::isnan(v) || v > best))) {
                best = v;
                best_idx = ih * w + iw;
              }
            }
          }
          MT_CHECK(best_idx >= 0, "max_pool2d window ({}, {}) of x {} holds no element", r, q,
                   x.desc());
          py[(plane * oh + r) * ow + q] = static_cast<T>(best);
          pa[(plane * oh + r) * ow + q] = static_cast<int32_t>(best_idx);
        }
    }
  });
}

void ReferenceBackend::max_pool2d_backward(const Tensor& dy, const Tensor& argmax, Tensor& dx) {
  const char* K = "max_pool2d_backward";
  require_f32_f64(K, "dy", dy);
  require_rank(K, "dy", dy, 4);
  require_i32(K, "argmax", argmax);
  require_same_shape(K, "dy", dy, "argmax", argmax);
  require_defined(K, "dx", dx);
  require_same_dtype(K, "dy", dy, "dx", dx);
  require_rank(K, "dx", dx, 4);
  if (dx.shape()[0] != dy.shape()[0] || dx.shape()[1] != dy.shape()[1]) {
    fail(K, "batch or channels differ: dy {} vs dx {}", dy.desc(), dx.desc());
  }
  const int64_t planes = dy.shape()[0] * dy.shape()[1];
  const int64_t out_size = dy.shape()[2] * dy.shape()[3];
  const int64_t in_size = dx.shape()[2] * dx.shape()[3];
  const int32_t* pa = argmax.data<int32_t>();
  for (int64_t i = 0; i < argmax.numel(); ++i) {
    if (pa[i] < 0 || pa[i] >= in_size) {
      fail(K, "argmax {} at flat position {} is outside the input plane of dx {}", pa[i], i,
           dx.desc());
    }
  }
  dispatch_f32_f64(dy.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* pdy = dy.data<T>();
    std::vector<double> acc(static_cast<size_t>(dx.numel()), 0.0);
    for (int64_t plane = 0; plane < planes; ++plane)
      for (int64_t k = 0; k < out_size; ++k) {
        const int64_t i = plane * out_size + k;
        acc[static_cast<size_t>(plane * in_size + pa[i])] += pdy[i];
      }
    T* pdx = dx.data<T>();
    for (int64_t i = 0; i < dx.numel(); ++i) pdx[i] = static_cast<T>(acc[static_cast<size_t>(i)]);
  });
}

}  // namespace mt
