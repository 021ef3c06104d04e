// Fast kernels over the last axis (softmax, log_softmax, layer_norm,
// cross_entropy) and the embedding gather / scatter-add.
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "meshtrain/tensor/backends/fast/fast_common.h"
#include "meshtrain/tensor/backends/fast/fast_kernels.h"
#include "meshtrain/tensor/backends/fast/simd.h"

namespace mt::fast {

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

int64_t num_rows(const Tensor& t, int64_t cols) {
  return cols == 0 ? 0 : t.numel() / cols;
}

Shape leading_dims(const Shape& s) {
  std::vector<int64_t> d = s.dims();
  if (!d.empty()) d.pop_back();
  return Shape(d);
}

float row_max(const float* p, int64_t n) {
  VecF m = VecF::set1(-kInf);
  vec_loop(n, [&](int64_t i, int64_t cnt) { m = max_nan(m, VecF::load(p + i, cnt, -kInf)); });
  return m.reduce_max();
}

// sum_j e^{p_j - mx}; also stores the terms in `out` (which may alias p) when
// it is not null.
float sum_exp(const float* p, float mx, int64_t n, float* out) {
  const VecF vm = VecF::set1(mx);
  VecF s = VecF::zero();
  vec_loop(n, [&](int64_t i, int64_t cnt) {
    const VecF e = exp(VecF::load(p + i, cnt) - vm);
    if (out != nullptr) e.store(out + i, cnt);
    s = s + e.keep_head(cnt);
  });
  return s.reduce_add();
}

float row_sum(const float* p, int64_t n) {
  VecF s = VecF::zero();
  vec_loop(n, [&](int64_t i, int64_t cnt) { s = s + VecF::load(p + i, cnt); });
  return s.reduce_add();
}

float row_dot(const float* a, const float* b, int64_t n) {
  VecF s = VecF::zero();
  vec_loop(n, [&](int64_t i, int64_t cnt) {
    s = fma(VecF::load(a + i, cnt), VecF::load(b + i, cnt), s);
  });
  return s.reduce_add();
}

// log(sum(exp(row))), stable around the row's maximum; -inf for an all -inf
// row, as the reference computes it.
float log_sum_exp(const float* p, int64_t n) {
  const float mx = row_max(p, n);
  if (mx == -kInf) return mx;
  return mx + std::log(sum_exp(p, mx, n, nullptr));
}

void check_last_axis(const char* kernel, const char* name, const Tensor& t) {
  require_dtype(kernel, name, t, DType::f32);
  if (t.rank() < 1) fail(kernel, "{} {} needs rank >= 1", name, t.desc());
}

}  // namespace

// ---- softmax family ----

void softmax(const Tensor& x, Tensor& y, bool causal, int threads) {
  const char* K = "softmax";
  require_dtype(K, "x", x, DType::f32);
  require_f32_like(K, "y", y, "x", x);
  if (x.rank() < (causal ? 2 : 1)) {
    fail(K, "x {} needs rank >= {}{}", x.desc(), causal ? 2 : 1, causal ? " when causal" : "");
  }
  const int64_t s = x.shape()[-1];
  const int64_t t = causal ? x.shape()[-2] : 1;
  if (causal && s < t) fail(K, "causal mask needs x [..., T, S] with S >= T, got x {}", x.desc());
  const float* px = x.data<float>();
  float* py = y.data<float>();
  parallel_for(num_rows(x, s), row_grain(s), threads, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = px + r * s;
      float* yr = py + r * s;
      // Columns [0, valid) take part; masked outputs are exactly 0.
      const int64_t valid = causal ? (r % t) + (s - t) + 1 : s;
      const float mx = row_max(xr, valid);
      const VecF inv = VecF::set1(1.0f / sum_exp(xr, mx, valid, yr));
      vec_loop(valid,
               [&](int64_t i, int64_t cnt) { (VecF::load(yr + i, cnt) * inv).store(yr + i, cnt); });
      if (valid < s) std::memset(yr + valid, 0, static_cast<size_t>(s - valid) * sizeof(float));
    }
  });
}

void softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx, int threads) {
  const char* K = "softmax_backward";
  check_last_axis(K, "y", y);
  require_f32_like(K, "dy", dy, "y", y);
  require_f32_like(K, "dx", dx, "y", y);
  const int64_t s = y.shape()[-1];
  const float* py = y.data<float>();
  const float* pdy = dy.data<float>();
  float* pdx = dx.data<float>();
  parallel_for(num_rows(y, s), row_grain(s), threads, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* yr = py + r * s;
      const float* dyr = pdy + r * s;
      float* dxr = pdx + r * s;
      const VecF dot = VecF::set1(row_dot(dyr, yr, s));
      vec_loop(s, [&](int64_t i, int64_t cnt) {
        (VecF::load(yr + i, cnt) * (VecF::load(dyr + i, cnt) - dot)).store(dxr + i, cnt);
      });
    }
  });
}

void log_softmax(const Tensor& x, Tensor& y, int threads) {
  const char* K = "log_softmax";
  check_last_axis(K, "x", x);
  require_f32_like(K, "y", y, "x", x);
  const int64_t s = x.shape()[-1];
  const float* px = x.data<float>();
  float* py = y.data<float>();
  parallel_for(num_rows(x, s), row_grain(s), threads, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const VecF lse = VecF::set1(log_sum_exp(px + r * s, s));
      vec_loop(s, [&](int64_t i, int64_t cnt) {
        (VecF::load(px + r * s + i, cnt) - lse).store(py + r * s + i, cnt);
      });
    }
  });
}

void log_softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx, int threads) {
  const char* K = "log_softmax_backward";
  check_last_axis(K, "y", y);
  require_f32_like(K, "dy", dy, "y", y);
  require_f32_like(K, "dx", dx, "y", y);
  const int64_t s = y.shape()[-1];
  const float* py = y.data<float>();
  const float* pdy = dy.data<float>();
  float* pdx = dx.data<float>();
  parallel_for(num_rows(y, s), row_grain(s), threads, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t o = r * s;
      const VecF sum = VecF::set1(row_sum(pdy + o, s));
      vec_loop(s, [&](int64_t i, int64_t cnt) {
        const VecF d = VecF::load(pdy + o + i, cnt) - exp(VecF::load(py + o + i, cnt)) * sum;
        d.store(pdx + o + i, cnt);
      });
    }
  });
}

// ---- layer norm ----

namespace {

int64_t check_layer_norm(const char* kernel, const Tensor& x, const Tensor& gamma,
                         const Tensor& mean, const Tensor& rstd) {
  check_last_axis(kernel, "x", x);
  const int64_t c = x.shape()[-1];
  if (c == 0) fail(kernel, "x {} has an empty normalised (last) axis", x.desc());
  require_dtype(kernel, "gamma", gamma, DType::f32);
  require_shape(kernel, "gamma", gamma, Shape{c});
  const Shape lead = leading_dims(x.shape());
  for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"mean", &mean},
                                std::pair<const char*, const Tensor*>{"rstd", &rstd}}) {
    require_dtype(kernel, name, *t, DType::f32);
    if (!(t->shape() == Shape{lead.numel()}) && !(t->shape() == lead)) {
      fail(kernel, "{} is {}, expected shape [{}] or {} for x {}", name, t->desc(), lead.numel(),
           lead.str(), x.desc());
    }
  }
  return c;
}

}  // namespace

void layer_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps, Tensor& y,
                Tensor& mean, Tensor& rstd, int threads) {
  const char* K = "layer_norm";
  const int64_t c = check_layer_norm(K, x, gamma, mean, rstd);
  require_f32_like(K, "beta", beta, "gamma", gamma);
  require_f32_like(K, "y", y, "x", x);
  if (!(eps >= 0.0)) fail(K, "eps {} must be >= 0 (x {})", eps, x.desc());
  const float* px = x.data<float>();
  const float* pg = gamma.data<float>();
  const float* pb = beta.data<float>();
  float* py = y.data<float>();
  float* pm = mean.data<float>();
  float* pr = rstd.data<float>();
  parallel_for(num_rows(x, c), row_grain(c), threads, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = px + r * c;
      float* yr = py + r * c;
      const float mu = row_sum(xr, c) / static_cast<float>(c);
      const VecF vmu = VecF::set1(mu);
      VecF sq = VecF::zero();
      vec_loop(c, [&](int64_t i, int64_t cnt) {
        const VecF d = (VecF::load(xr + i, cnt) - vmu).keep_head(cnt);
        sq = fma(d, d, sq);
      });
      const double var = static_cast<double>(sq.reduce_add()) / static_cast<double>(c);
      const auto rs = static_cast<float>(1.0 / std::sqrt(var + eps));
      const VecF vrs = VecF::set1(rs);
      // y may alias x: each element is read before it is written.
      vec_loop(c, [&](int64_t i, int64_t cnt) {
        const VecF xhat = (VecF::load(xr + i, cnt) - vmu) * vrs;
        fma(xhat, VecF::load(pg + i, cnt), VecF::load(pb + i, cnt)).store(yr + i, cnt);
      });
      pm[r] = mu;
      pr[r] = rs;
    }
  });
}

void layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                         const Tensor& rstd, Tensor& dx, Tensor& dgamma, Tensor& dbeta,
                         int threads) {
  const char* K = "layer_norm_backward";
  const int64_t c = check_layer_norm(K, x, gamma, mean, rstd);
  require_f32_like(K, "dy", dy, "x", x);
  require_f32_like(K, "dx", dx, "x", x);
  require_f32_like(K, "dgamma", dgamma, "gamma", gamma);
  require_f32_like(K, "dbeta", dbeta, "gamma", gamma);
  const float* px = x.data<float>();
  const float* pdy = dy.data<float>();
  const float* pg = gamma.data<float>();
  const float* pm = mean.data<float>();
  const float* pr = rstd.data<float>();
  float* pdx = dx.data<float>();
  const int64_t rows = num_rows(x, c);
  const auto uc = static_cast<size_t>(c);
  const int chunks =
      static_cast<int>(std::min<int64_t>(threads, std::max<int64_t>(1, rows / row_grain(c))));
  // Per-chunk f64 sums of dgamma / dbeta, fed every kBlock rows from f32
  // partials, then reduced in chunk order (deterministic for a thread count).
  constexpr int64_t kBlock = 64;
  std::vector<double> acc(static_cast<size_t>(chunks) * 2 * uc, 0.0);
  parallel_for(chunks, 1, chunks, [&](int64_t c0, int64_t c1) {
    std::vector<float> part(2 * uc);
    for (int64_t ch = c0; ch < c1; ++ch) {
      double* dg_acc = acc.data() + static_cast<size_t>(ch) * 2 * uc;
      double* db_acc = dg_acc + uc;
      const int64_t r_end = rows * (ch + 1) / chunks;
      for (int64_t rb = rows * ch / chunks; rb < r_end; rb += kBlock) {
        std::fill(part.begin(), part.end(), 0.0f);
        float* dg = part.data();
        float* db = dg + uc;
        for (int64_t r = rb; r < std::min(r_end, rb + kBlock); ++r) {
          const float* xr = px + r * c;
          const float* dyr = pdy + r * c;
          float* dxr = pdx + r * c;
          const VecF mu = VecF::set1(pm[r]);
          const VecF rs = VecF::set1(pr[r]);
          // With g = dy * gamma: dx = rstd * (g - mean(g) - xhat * mean(g * xhat)).
          VecF sg = VecF::zero(), sgx = VecF::zero();
          vec_loop(c, [&](int64_t i, int64_t cnt) {
            const VecF d = VecF::load(dyr + i, cnt);
            const VecF xhat = (VecF::load(xr + i, cnt) - mu) * rs;
            const VecF g = d * VecF::load(pg + i, cnt);
            sg = sg + g;
            sgx = fma(g, xhat, sgx);
            fma(d, xhat, VecF::load(dg + i, cnt)).store(dg + i, cnt);
            (d + VecF::load(db + i, cnt)).store(db + i, cnt);
          });
          const VecF mg = VecF::set1(sg.reduce_add() / static_cast<float>(c));
          const VecF mgx = VecF::set1(sgx.reduce_add() / static_cast<float>(c));
          vec_loop(c, [&](int64_t i, int64_t cnt) {
            const VecF xhat = (VecF::load(xr + i, cnt) - mu) * rs;
            const VecF g = VecF::load(dyr + i, cnt) * VecF::load(pg + i, cnt);
            (rs * (g - mg - xhat * mgx)).store(dxr + i, cnt);
          });
        }
        for (size_t j = 0; j < uc; ++j) {
          dg_acc[j] += dg[j];
          db_acc[j] += db[j];
        }
      }
    }
  });
  float* pdg = dgamma.data<float>();
  float* pdb = dbeta.data<float>();
  for (size_t j = 0; j < uc; ++j) {
    double sdg = 0.0, sdb = 0.0;
    for (size_t ch = 0; ch < static_cast<size_t>(chunks); ++ch) {
      sdg += acc[ch * 2 * uc + j];
      sdb += acc[ch * 2 * uc + uc + j];
    }
    pdg[j] = static_cast<float>(sdg);
    pdb[j] = static_cast<float>(sdb);
  }
}

// ---- cross entropy ----

namespace {

void check_loss_scalar(const char* kernel, const char* name, const Tensor& t) {
  require_defined(kernel, name, t);
  if (t.dtype() != DType::f32 && t.dtype() != DType::f64) {
    fail(kernel, "{} {} has an unsupported dtype (expected f32 or f64)", name, t.desc());
  }
  if (t.numel() != 1) fail(kernel, "{} {} must hold exactly one element", name, t.desc());
}

void check_labels(const char* kernel, const Tensor& logits, const Tensor& labels) {
  require_dtype(kernel, "logits", logits, DType::f32);
  require_rank(kernel, "logits", logits, 2);
  require_dtype(kernel, "labels", labels, DType::i32);
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

}  // namespace

void cross_entropy(const Tensor& logits, const Tensor& labels, Tensor& loss, int threads) {
  const char* K = "cross_entropy";
  check_labels(K, logits, labels);
  check_loss_scalar(K, "loss", loss);
  const int64_t n = logits.shape()[0], c = logits.shape()[1];
  const float* px = logits.data<float>();
  const int32_t* pl = labels.data<int32_t>();
  const int chunks =
      static_cast<int>(std::min<int64_t>(threads, std::max<int64_t>(1, n / row_grain(c))));
  std::vector<double> partial(static_cast<size_t>(chunks), 0.0);
  parallel_for(chunks, 1, chunks, [&](int64_t c0, int64_t c1) {
    for (int64_t ch = c0; ch < c1; ++ch) {
      double sum = 0.0;
      for (int64_t i = n * ch / chunks; i < n * (ch + 1) / chunks; ++i) {
        const float* row = px + i * c;
        sum += static_cast<double>(log_sum_exp(row, c)) - static_cast<double>(row[pl[i]]);
      }
      partial[static_cast<size_t>(ch)] = sum;
    }
  });
  double total = 0.0;
  for (double v : partial) total += v;
  // The mean over an empty batch is 0, as in the reference.
  loss.set_item(0, n == 0 ? 0.0 : total / static_cast<double>(n));
}

void cross_entropy_backward(const Tensor& logits, const Tensor& labels, const Tensor& dloss,
                            Tensor& dlogits, int threads) {
  const char* K = "cross_entropy_backward";
  check_labels(K, logits, labels);
  check_loss_scalar(K, "dloss", dloss);
  require_f32_like(K, "dlogits", dlogits, "logits", logits);
  const int64_t n = logits.shape()[0], c = logits.shape()[1];
  if (n == 0) return;
  const auto scale = static_cast<float>(dloss.item(0) / static_cast<double>(n));
  const float* px = logits.data<float>();
  const int32_t* pl = labels.data<int32_t>();
  float* pd = dlogits.data<float>();
  parallel_for(n, row_grain(c), threads, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      const float* row = px + i * c;
      float* drow = pd + i * c;
      const float mx = row_max(row, c);
      // drow temporarily holds e^{x - max}; then scale * (p - onehot).
      const VecF k = VecF::set1(scale / sum_exp(row, mx, c, drow));
      vec_loop(
          c, [&](int64_t j, int64_t cnt) { (VecF::load(drow + j, cnt) * k).store(drow + j, cnt); });
      drow[pl[i]] -= scale;
    }
  });
}

// ---- embeddings ----

namespace {

void check_ids(const char* kernel, const Tensor& ids, int64_t vocab, const Tensor& table) {
  require_dtype(kernel, "ids", ids, DType::i32);
  const int32_t* pi = ids.data<int32_t>();
  for (int64_t i = 0, n = ids.numel(); i < n; ++i) {
    if (pi[i] < 0 || pi[i] >= vocab) {
      fail(kernel, "id {} at flat position {} of ids {} is out of range [0, {}) for table {}",
           pi[i], i, ids.desc(), vocab, table.desc());
    }
  }
}

}  // namespace

void embedding(const Tensor& table, const Tensor& ids, Tensor& y, int threads) {
  const char* K = "embedding";
  require_defined(K, "table", table);
  require_rank(K, "table", table, 2);
  const int64_t v = table.shape()[0], c = table.shape()[1];
  check_ids(K, ids, v, table);
  require_defined(K, "y", y);
  if (y.dtype() != table.dtype())
    fail(K, "dtypes differ: table {} vs y {}", table.desc(), y.desc());
  std::vector<int64_t> want = ids.shape().dims();
  want.push_back(c);
  require_shape(K, "y", y, Shape(want));
  const size_t row_bytes = static_cast<size_t>(c) * dtype_size(table.dtype());
  if (row_bytes == 0) return;
  const auto* src = static_cast<const unsigned char*>(table.raw());
  auto* dst = static_cast<unsigned char*>(y.raw());
  const int32_t* pi = ids.data<int32_t>();
  parallel_for(ids.numel(), row_grain(c), threads, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      std::memcpy(dst + static_cast<size_t>(i) * row_bytes,
                  src + static_cast<size_t>(pi[i]) * row_bytes, row_bytes);
    }
  });
}

void embedding_backward(const Tensor& dy, const Tensor& ids, Tensor& dtable, int threads) {
  const char* K = "embedding_backward";
  require_dtype(K, "dtable", dtable, DType::f32);
  require_rank(K, "dtable", dtable, 2);
  const int64_t v = dtable.shape()[0], c = dtable.shape()[1];
  check_ids(K, ids, v, dtable);
  require_dtype(K, "dy", dy, DType::f32);
  std::vector<int64_t> want = ids.shape().dims();
  want.push_back(c);
  require_shape(K, "dy", dy, Shape(want));
  float* pt = dtable.data<float>();
  const float* pdy = dy.data<float>();
  const int32_t* pi = ids.data<int32_t>();
  const int64_t n = ids.numel();
  if (dtable.numel() > 0) std::memset(pt, 0, dtable.nbytes());
  // Threads split the columns, so each one owns its slice of every row: no
  // races, and each element's sum runs in id order as in the reference.
  const int64_t col_blocks = (c + VecF::kWidth - 1) / VecF::kWidth;
  parallel_for(
      col_blocks, std::max<int64_t>(1, kMinElemsPerThread / std::max<int64_t>(n * VecF::kWidth, 1)),
      threads, [&](int64_t b0, int64_t b1) {
        const int64_t j0 = b0 * VecF::kWidth, j1 = std::min(c, b1 * VecF::kWidth);
        for (int64_t i = 0; i < n; ++i) {
          float* row = pt + static_cast<int64_t>(pi[i]) * c;
          const float* d = pdy + i * c;
          vec_loop(j1 - j0, [&](int64_t j, int64_t cnt) {
            (VecF::load(row + j0 + j, cnt) + VecF::load(d + j0 + j, cnt)).store(row + j0 + j, cnt);
          });
        }
      });
}

}  // namespace mt::fast
