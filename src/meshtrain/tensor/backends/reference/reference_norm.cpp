// Reference kernels over the last axis: softmax, log_softmax, layer_norm,
// cross_entropy; and the embedding gather / scatter-add.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/tensor/backends/reference/reference_backend.h"
#include "meshtrain/tensor/backends/reference/reference_util.h"

namespace mt {

using namespace reference;

namespace {

// Rows of length `cols` in a tensor whose last axis has `cols` entries.
int64_t num_rows(const Tensor& t, int64_t cols) {
  return cols == 0 ? 0 : t.numel() / cols;
}

// Shape of every axis but the last.
Shape leading_dims(const Shape& s) {
  std::vector<int64_t> d = s.dims();
  if (!d.empty()) d.pop_back();
  return Shape(d);
}

// log(sum(exp(row[0..n)))) computed stably around the row's maximum.
template <class T>
double log_sum_exp(const T* row, int64_t n) {
  double mx = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < n; ++j) mx = std::max(mx, static_cast<double>(row[j]));
  // An all -inf row would give -inf - -inf = NaN below; its log-sum-exp is -inf.
  if (std::isinf(mx) && mx < 0) return mx;
  double s = 0.0;
  for (int64_t j = 0; j < n; ++j) s += std::exp(static_cast<double>(row[j]) - mx);
  return mx + std::log(s);
}

void check_loss_scalar(const char* kernel, const char* name, const Tensor& t) {
  require_f32_f64(kernel, name, t);
  if (t.numel() != 1) fail(kernel, "{} {} must hold exactly one element", name, t.desc());
}

void check_labels(const char* kernel, const Tensor& logits, const Tensor& labels) {
  require_f32_f64(kernel, "logits", logits);
  require_rank(kernel, "logits", logits, 2);
  require_i32(kernel, "labels", labels);
  const int64_t n = logits.shape()[0], c = logits.shape()[1];
  require_shape(kernel, "labels", labels, Shape{n});
  const int32_t* pl = labels.data<int32_t>();
  for (int64_t i = 0; i < n; ++i) {
    if (pl[i] < 0 || pl[i] >= c) {
      fail(kernel, "label {} at row {} is out of range [0, {}) for logits {}", pl[i], i, c,
           logits.desc());
    }
  }
}

void check_ids(const char* kernel, const Tensor& ids, int64_t vocab, const Tensor& table) {
  require_i32(kernel, "ids", ids);
  const int32_t* pi = ids.data<int32_t>();
  for (int64_t i = 0; i < ids.numel(); ++i) {
    if (pi[i] < 0 || pi[i] >= vocab) {
      fail(kernel, "id {} at flat position {} of ids {} is out of range [0, {}) for table {}",
           pi[i], i, ids.desc(), vocab, table.desc());
    }
  }
}

}  // namespace

// ---- softmax family ----

void ReferenceBackend::softmax(const Tensor& x, Tensor& y, bool causal) {
  const char* K = "softmax";
  require_f32_f64(K, "x", x);
  require_like(K, "y", y, "x", x);
  if (x.rank() < (causal ? 2 : 1)) {
    fail(K, "x {} needs rank >= {}{}", x.desc(), causal ? 2 : 1, causal ? " when causal" : "");
  }
  const int64_t s = x.shape()[-1];
  const int64_t t = causal ? x.shape()[-2] : 1;
  if (causal && s < t) {
    fail(K, "causal mask needs x [..., T, S] with S >= T, got x {}", x.desc());
  }
  dispatch_f32_f64(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    std::vector<double> row(static_cast<size_t>(s));
    for (int64_t r = 0; r < num_rows(x, s); ++r) {
      const T* px = x.data<T>() + r * s;
      T* py = y.data<T>() + r * s;
      // Columns [0, valid) take part; the rest are masked to -inf.
      const int64_t valid = causal ? (r % t) + (s - t) + 1 : s;
      const double lse = log_sum_exp(px, valid);
      for (int64_t j = 0; j < valid; ++j) row[static_cast<size_t>(j)] = std::exp(px[j] - lse);
      for (int64_t j = 0; j < s; ++j) {
        py[j] = j < valid ? static_cast<T>(row[static_cast<size_t>(j)]) : T{0};
      }
    }
  });
}

void ReferenceBackend::softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx) {
  const char* K = "softmax_backward";
  require_f32_f64(K, "y", y);
  if (y.rank() < 1) fail(K, "y {} needs rank >= 1", y.desc());
  require_like(K, "dy", dy, "y", y);
  require_like(K, "dx", dx, "y", y);
  const int64_t s = y.shape()[-1];
  dispatch_f32_f64(y.dtype(), [&](auto tag) {
    using T = decltype(tag);
    for (int64_t r = 0; r < num_rows(y, s); ++r) {
      const T* py = y.data<T>() + r * s;
      const T* pdy = dy.data<T>() + r * s;
      T* pdx = dx.data<T>() + r * s;
      double dot = 0.0;
      for (int64_t j = 0; j < s; ++j) dot += static_cast<double>(pdy[j]) * py[j];
      for (int64_t j = 0; j < s; ++j) {
        pdx[j] = static_cast<T>(static_cast<double>(py[j]) * (pdy[j] - dot));
      }
    }
  });
}

void ReferenceBackend::log_softmax(const Tensor& x, Tensor& y) {
  const char* K = "log_softmax";
  require_f32_f64(K, "x", x);
  if (x.rank() < 1) fail(K, "x {} needs rank >= 1", x.desc());
  require_like(K, "y", y, "x", x);
  const int64_t s = x.shape()[-1];
  dispatch_f32_f64(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    for (int64_t r = 0; r < num_rows(x, s); ++r) {
      const T* px = x.data<T>() + r * s;
      T* py = y.data<T>() + r * s;
      const double lse = log_sum_exp(px, s);
      for (int64_t j = 0; j < s; ++j) py[j] = static_cast<T>(px[j] - lse);
    }
  });
}

void ReferenceBackend::log_softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx) {
  const char* K = "log_softmax_backward";
  require_f32_f64(K, "y", y);
  if (y.rank() < 1) fail(K, "y {} needs rank >= 1", y.desc());
  require_like(K, "dy", dy, "y", y);
  require_like(K, "dx", dx, "y", y);
  const int64_t s = y.shape()[-1];
  dispatch_f32_f64(y.dtype(), [&](auto tag) {
    using T = decltype(tag);
    for (int64_t r = 0; r < num_rows(y, s); ++r) {
      const T* py = y.data<T>() + r * s;
      const T* pdy = dy.data<T>() + r * s;
      T* pdx = dx.data<T>() + r * s;
      double sum = 0.0;
      for (int64_t j = 0; j < s; ++j) sum += pdy[j];
      for (int64_t j = 0; j < s; ++j) {
        pdx[j] = static_cast<T>(pdy[j] - std::exp(static_cast<double>(py[j])) * sum);
      }
    }
  });
}

// ---- layer norm ----

namespace {

// Validates x [..., C] against gamma [C] and mean/rstd; returns C.
int64_t check_layer_norm(const char* kernel, const Tensor& x, const Tensor& gamma,
                         const Tensor& mean, const Tensor& rstd) {
  require_f32_f64(kernel, "x", x);
  if (x.rank() < 1) fail(kernel, "x {} needs rank >= 1", x.desc());
  const int64_t c = x.shape()[-1];
  if (c == 0) fail(kernel, "x {} has an empty normalised (last) axis", x.desc());
  require_defined(kernel, "gamma", gamma);
  require_same_dtype(kernel, "x", x, "gamma", gamma);
  require_shape(kernel, "gamma", gamma, Shape{c});
  const Shape lead = leading_dims(x.shape());
  for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"mean", &mean},
                                std::pair<const char*, const Tensor*>{"rstd", &rstd}}) {
    require_defined(kernel, name, *t);
    require_same_dtype(kernel, "x", x, name, *t);
    const Shape flat{lead.numel()};
    if (!(t->shape() == flat) && !(t->shape() == lead)) {
      const std::string want = lead == flat ? flat.str() : flat.str() + " or " + lead.str();
      fail(kernel, "{} is {}, expected shape {} for x {}", name, t->desc(), want, x.desc());
    }
  }
  return c;
}

}  // namespace

void ReferenceBackend::layer_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                  double eps, Tensor& y, Tensor& mean, Tensor& rstd) {
  const char* K = "layer_norm";
  const int64_t c = check_layer_norm(K, x, gamma, mean, rstd);
  require_like(K, "beta", beta, "gamma", gamma);
  require_like(K, "y", y, "x", x);
  if (!(eps >= 0.0)) fail(K, "eps {} must be >= 0 (x {})", eps, x.desc());
  dispatch_f32_f64(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* pg = gamma.data<T>();
    const T* pb = beta.data<T>();
    for (int64_t r = 0; r < num_rows(x, c); ++r) {
      const T* px = x.data<T>() + r * c;
      T* py = y.data<T>() + r * c;
      double mu = 0.0;
      for (int64_t j = 0; j < c; ++j) mu += px[j];
      mu /= static_cast<double>(c);
      double var = 0.0;
      for (int64_t j = 0; j < c; ++j) var += (px[j] - mu) * (px[j] - mu);
      var /= static_cast<double>(c);
      const double rs = 1.0 / std::sqrt(var + eps);
      for (int64_t j = 0; j < c; ++j) {
        py[j] = static_cast<T>((px[j] - mu) * rs * pg[j] + pb[j]);
      }
      mean.data<T>()[r] = static_cast<T>(mu);
      rstd.data<T>()[r] = static_cast<T>(rs);
    }
  });
}

void ReferenceBackend::layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                           const Tensor& mean, const Tensor& rstd, Tensor& dx,
                                           Tensor& dgamma, Tensor& dbeta) {
  const char* K = "layer_norm_backward";
  const int64_t c = check_layer_norm(K, x, gamma, mean, rstd);
  require_like(K, "dy", dy, "x", x);
  require_like(K, "dx", dx, "x", x);
  require_like(K, "dgamma", dgamma, "gamma", gamma);
  require_like(K, "dbeta", dbeta, "gamma", gamma);
  dispatch_f32_f64(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* pg = gamma.data<T>();
    std::vector<double> dg(static_cast<size_t>(c), 0.0), db(static_cast<size_t>(c), 0.0);
    std::vector<double> xhat(static_cast<size_t>(c));
    for (int64_t r = 0; r < num_rows(x, c); ++r) {
      const T* px = x.data<T>() + r * c;
      const T* pdy = dy.data<T>() + r * c;
      T* pdx = dx.data<T>() + r * c;
      const double mu = mean.data<T>()[r];
      const double rs = rstd.data<T>()[r];
      // With g = dy * gamma: dx = rstd * (g - mean(g) - xhat * mean(g * xhat)).
      double mean_g = 0.0, mean_gx = 0.0;
      for (int64_t j = 0; j < c; ++j) {
        const auto uj = static_cast<size_t>(j);
        xhat[uj] = (px[j] - mu) * rs;
        const double g = static_cast<double>(pdy[j]) * pg[j];
        mean_g += g;
        mean_gx += g * xhat[uj];
        dg[uj] += static_cast<double>(pdy[j]) * xhat[uj];
        db[uj] += pdy[j];
      }
      mean_g /= static_cast<double>(c);
      mean_gx /= static_cast<double>(c);
      for (int64_t j = 0; j < c; ++j) {
        const double g = static_cast<double>(pdy[j]) * pg[j];
        pdx[j] = static_cast<T>(rs * (g - mean_g - xhat[static_cast<size_t>(j)] * mean_gx));
      }
    }
    for (int64_t j = 0; j < c; ++j) {
      dgamma.data<T>()[j] = static_cast<T>(dg[static_cast<size_t>(j)]);
      dbeta.data<T>()[j] = static_cast<T>(db[static_cast<size_t>(j)]);
    }
  });
}

// ---- cross entropy ----

void ReferenceBackend::cross_entropy(const Tensor& logits, const Tensor& labels, Tensor& loss) {
  const char* K = "cross_entropy";
  check_labels(K, logits, labels);
  check_loss_scalar(K, "loss", loss);
  const int64_t n = logits.shape()[0], c = logits.shape()[1];
  double total = 0.0;
  dispatch_f32_f64(logits.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const int32_t* pl = labels.data<int32_t>();
    for (int64_t i = 0; i < n; ++i) {
      const T* row = logits.data<T>() + i * c;
      total += log_sum_exp(row, c) - static_cast<double>(row[pl[i]]);
    }
  });
  // The mean over an empty batch is defined as 0 so that empty shards add nothing.
  loss.set_item(0, n == 0 ? 0.0 : total / static_cast<double>(n));
}

void ReferenceBackend::cross_entropy_backward(const Tensor& logits, const Tensor& labels,
                                              const Tensor& dloss, Tensor& dlogits) {
  const char* K = "cross_entropy_backward";
  check_labels(K, logits, labels);
  check_loss_scalar(K, "dloss", dloss);
  require_like(K, "dlogits", dlogits, "logits", logits);
  const int64_t n = logits.shape()[0], c = logits.shape()[1];
  if (n == 0) return;
  const double scale = dloss.item(0) / static_cast<double>(n);
  dispatch_f32_f64(logits.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const int32_t* pl = labels.data<int32_t>();
    for (int64_t i = 0; i < n; ++i) {
      const T* row = logits.data<T>() + i * c;
      T* drow = dlogits.data<T>() + i * c;
      const double lse = log_sum_exp(row, c);
      for (int64_t j = 0; j < c; ++j) {
        const double p = std::exp(static_cast<double>(row[j]) - lse);
        drow[j] = static_cast<T>(scale * (p - (j == pl[i] ? 1.0 : 0.0)));
      }
    }
  });
}

// ---- embeddings ----

void ReferenceBackend::embedding(const Tensor& table, const Tensor& ids, Tensor& y) {
  const char* K = "embedding";
  require_defined(K, "table", table);
  require_rank(K, "table", table, 2);
  const int64_t v = table.shape()[0], c = table.shape()[1];
  check_ids(K, ids, v, table);
  require_defined(K, "y", y);
  require_same_dtype(K, "table", table, "y", y);
  std::vector<int64_t> want = ids.shape().dims();
  want.push_back(c);
  require_shape(K, "y", y, Shape(want));
  // A row copy is dtype-agnostic, so any table dtype works.
  const size_t row_bytes = static_cast<size_t>(c) * dtype_size(table.dtype());
  const auto* src = static_cast<const unsigned char*>(table.raw());
  auto* dst = static_cast<unsigned char*>(y.raw());
  const int32_t* pi = ids.data<int32_t>();
  for (int64_t i = 0; i < ids.numel(); ++i) {
    if (row_bytes == 0) break;
    std::memcpy(dst + static_cast<size_t>(i) * row_bytes,
                src + static_cast<size_t>(pi[i]) * row_bytes, row_bytes);
  }
}

void ReferenceBackend::embedding_backward(const Tensor& dy, const Tensor& ids, Tensor& dtable) {
  const char* K = "embedding_backward";
  require_f32_f64(K, "dtable", dtable);
  require_rank(K, "dtable", dtable, 2);
  const int64_t v = dtable.shape()[0], c = dtable.shape()[1];
  check_ids(K, ids, v, dtable);
  require_defined(K, "dy", dy);
  require_same_dtype(K, "dtable", dtable, "dy", dy);
  std::vector<int64_t> want = ids.shape().dims();
  want.push_back(c);
  require_shape(K, "dy", dy, Shape(want));
  dispatch_f32_f64(dtable.dtype(), [&](auto tag) {
    using T = decltype(tag);
    std::vector<double> acc(static_cast<size_t>(v * c), 0.0);
    const int32_t* pi = ids.data<int32_t>();
    const T* pdy = dy.data<T>();
    for (int64_t i = 0; i < ids.numel(); ++i) {
      for (int64_t j = 0; j < c; ++j) acc[static_cast<size_t>(pi[i] * c + j)] += pdy[i * c + j];
    }
    T* pt = dtable.data<T>();
    for (int64_t i = 0; i < v * c; ++i) pt[i] = static_cast<T>(acc[static_cast<size_t>(i)]);
  });
}

}  // namespace mt
