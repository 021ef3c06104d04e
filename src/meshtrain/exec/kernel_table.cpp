#include "meshtrain/exec/kernel_table.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <fmt/format.h>

#include "meshtrain/base/error.h"
#include "meshtrain/graph/op_registry.h"

namespace mt {

namespace {

using In = const std::vector<Tensor>&;
using Out = std::vector<Tensor>&;

Conv2dParams conv_params(const Attrs& a) {
  Conv2dParams p;
  p.stride_h = a.i_or("stride_h", 1);
  p.stride_w = a.i_or("stride_w", 1);
  p.pad_h = a.i_or("pad_h", 0);
  p.pad_w = a.i_or("pad_w", 0);
  return p;
}

Pool2dParams pool_params(const Attrs& a) {
  Pool2dParams p;
  p.kernel_h = a.i("kernel_h");
  p.kernel_w = a.i("kernel_w");
  p.stride_h = a.i("stride_h");
  p.stride_w = a.i("stride_w");
  p.pad_h = a.i_or("pad_h", 0);
  p.pad_w = a.i_or("pad_w", 0);
  return p;
}

template <BinaryOp B>
void binary(KernelBackend& k, const Node&, In in, Out out) {
  k.binary(B, in[0], in[1], out[0]);
}

template <UnaryOp U>
void unary(KernelBackend& k, const Node&, In in, Out out) {
  k.unary(U, in[0], out[0]);
}

void matmul(KernelBackend& k, const Node& n, In in, Out out) {
  MatmulParams p;
  p.trans_a = n.attrs.b_or("trans_a", false);
  p.trans_b = n.attrs.b_or("trans_b", false);
  k.matmul(in[0], in[1], out[0], p);
}

// Only runs when the output is caller memory (a bound gradient); otherwise
// the executor makes the output a view and skips the kernel.
void reshape_copy(KernelBackend&, const Node&, In in, Out out) {
  MT_CHECK_EQ(in[0].nbytes(), out[0].nbytes());
  if (in[0].nbytes() > 0) std::memcpy(out[0].raw(), in[0].raw(), in[0].nbytes());
}

void broadcast_to(KernelBackend&, const Node&, In in, Out out) {
  const size_t chunk = in[0].nbytes();
  if (chunk == 0) return;
  const int64_t reps = out[0].numel() / in[0].numel();
  auto* dst = static_cast<char*>(out[0].raw());
  for (int64_t r = 0; r < reps; ++r)
    std::memcpy(dst + static_cast<size_t>(r) * chunk, in[0].raw(), chunk);
}

// split_to_group: this rank's piece of x along `dim` (attrs as all_gather).
void group_piece(KernelBackend&, const Node& n, In in, Out out) {
  const std::vector<int64_t>& sizes = n.attrs.ints("sizes");
  const auto rank = static_cast<size_t>(n.attrs.i("rank"));
  const int dim = static_cast<int>(n.attrs.i("dim"));
  const Shape& xs = in[0].shape();
  int64_t before = 0;
  for (size_t q = 0; q < rank; ++q) before += sizes[q];
  const auto elem = static_cast<int64_t>(dtype_size(in[0].dtype()));
  const int64_t outer = xs.prod(0, dim), inner = xs.prod(dim + 1, xs.rank()) * elem;
  const int64_t row_in = xs[dim] * inner, row_out = sizes[rank] * inner;
  const auto* src = static_cast<const char*>(in[0].raw()) + before * inner;
  auto* dst = static_cast<char*>(out[0].raw());
  for (int64_t o = 0; o < outer; ++o) {
    if (row_out > 0) std::memcpy(dst + o * row_out, src + o * row_in, static_cast<size_t>(row_out));
  }
}

// ---- vocabulary-parallel embedding and cross-entropy (graph.h) ----
// Plain loops in f32 / f64 (sums in double): they touch this rank's slice of
// the vocabulary once per row, as the whole-table kernels do.

template <typename F>
void f32_or_f64(const Node& n, DType t, F&& f) {
  if (t == DType::f32) {
    f(float{});
  } else if (t == DType::f64) {
    f(double{});
  } else {
    throw InternalError(
        fmt::format("node '{}' ({}): {} is not f32 or f64", n.name, op_name(n.op), dtype_name(t)));
  }
}

// The local row (or column) of id, -1 when another rank holds it; ids
// outside the vocabulary are bad input, as for the whole table.
int64_t local_index(const Node& n, const char* what, int32_t id, int64_t i, int64_t rows) {
  const int64_t off = n.attrs.i("offset"), vocab = n.attrs.i("vocab");
  if (id < 0 || id >= vocab) {
    throw ShapeError(
        fmt::format("node '{}' ({}): {} {} at flat position {} is out of range [0, {})", n.name,
                    op_name(n.op), what, id, i, vocab));
  }
  const int64_t r = id - off;
  return r >= 0 && r < rows ? r : -1;
}

void embedding_range(KernelBackend&, const Node& n, In in, Out out) {
  const Tensor& table = in[0];
  const int32_t* ids = in[1].data<int32_t>();
  const int64_t rows = table.shape()[0];
  const size_t row = static_cast<size_t>(table.shape()[1]) * dtype_size(table.dtype());
  const auto* src = static_cast<const char*>(table.raw());
  auto* dst = static_cast<char*>(out[0].raw());
  for (int64_t i = 0; i < in[1].numel(); ++i) {
    const int64_t r = local_index(n, "id", ids[i], i, rows);
    char* d = dst + static_cast<size_t>(i) * row;
    if (row == 0) continue;
    if (r < 0) {
      std::memset(d, 0, row);
    } else {
      std::memcpy(d, src + static_cast<size_t>(r) * row, row);
    }
  }
}

void embedding_range_grad(KernelBackend&, const Node& n, In in, Out out) {
  Tensor& dt = out[0];
  const int32_t* ids = in[1].data<int32_t>();
  const int64_t rows = dt.shape()[0], c = dt.shape()[1];
  f32_or_f64(n, dt.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* d = dt.data<T>();
    const T* dy = in[0].data<T>();
    std::fill(d, d + dt.numel(), T{0});
    for (int64_t i = 0; i < in[1].numel(); ++i) {
      const int64_t r = local_index(n, "id", ids[i], i, rows);
      if (r < 0) continue;
      for (int64_t k = 0; k < c; ++k) d[r * c + k] += dy[i * c + k];
    }
  });
}

void row_max(KernelBackend&, const Node& n, In in, Out out) {
  const int64_t rows = in[0].shape()[0], c = in[0].shape()[1];
  f32_or_f64(n, in[0].dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* x = in[0].data<T>();
    T* y = out[0].data<T>();
    for (int64_t i = 0; i < rows; ++i) {
      T m = -std::numeric_limits<T>::infinity();
      for (int64_t j = 0; j < c; ++j) m = std::max(m, x[i * c + j]);
      y[i] = m;
    }
  });
}

// Rows [r0, r0 + rows) of a row-major [N, c] tensor, as a tensor of its own.
Tensor rows_of(const Tensor& t, int64_t r0, int64_t rows) {
  const int64_t c = t.shape()[1];
  auto* base = static_cast<char*>(const_cast<void*>(t.raw()));
  return Tensor::wrap(base + static_cast<size_t>(r0 * c) * dtype_size(t.dtype()), Shape{rows, c},
                      t.dtype());
}

// Rows per pass of the backend's (vectorised, threaded) row kernels: about
// 256 K elements of scratch, whatever the vocabulary.
int64_t chunk_rows(int64_t c) {
  return std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(c, 1));
}

// [N, 2]: sum_j exp(logit_j - m), the label's logit where this rank holds it.
// The sum is exp(lse - m) with lse the log-sum-exp of the row's own columns,
// read off the backend's log_softmax (lse = logit_0 - log_softmax_0).
void vocab_ce_stats(KernelBackend& k, const Node& n, In in, Out out) {
  const int64_t rows = in[0].shape()[0], c = in[0].shape()[1];
  const int32_t* labels = in[1].data<int32_t>();
  const int64_t chunk = std::min(rows, chunk_rows(c));
  Tensor scratch = c > 0 && rows > 0 ? Tensor::empty(Shape{chunk, c}, in[0].dtype()) : Tensor();
  f32_or_f64(n, in[0].dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* x = in[0].data<T>();
    const T* m = in[2].data<T>();
    T* y = out[0].data<T>();
    for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
      const int64_t nr = std::min(chunk, rows - r0);
      if (c > 0) {
        Tensor ls = rows_of(scratch, 0, nr);
        k.log_softmax(rows_of(in[0], r0, nr), ls);
      }
      const T* ls = c > 0 ? scratch.data<T>() : nullptr;
      for (int64_t i = r0; i < r0 + nr; ++i) {
        const T* row = x + i * c;
        const double lse =
            c > 0 ? static_cast<double>(row[0]) - static_cast<double>(ls[(i - r0) * c]) : 0.0;
        const int64_t at = local_index(n, "label", labels[i], i, c);
        y[2 * i] = static_cast<T>(c > 0 ? std::exp(lse - static_cast<double>(m[i])) : 0.0);
        y[2 * i + 1] = at < 0 ? T{0} : row[at];
      }
    }
  });
}

// dlogits_j = dy0 exp(logit_j - m) + dy1 [j is the label] = dy0 s softmax_j
// (+ dy1), s = exp(lse - m) the row's own sum; dm = -dy0 s. Written in place:
// log_softmax into dlogits gives lse, softmax over it the row's shape.
void vocab_ce_stats_grad(KernelBackend& k, const Node& n, In in, Out out) {
  const int64_t rows = in[0].shape()[0], c = in[0].shape()[1];
  const int32_t* labels = in[1].data<int32_t>();
  const int64_t chunk = std::min(rows, chunk_rows(c));
  std::vector<double> lse(static_cast<size_t>(std::max<int64_t>(chunk, 0)));
  f32_or_f64(n, in[0].dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* x = in[0].data<T>();
    const T* m = in[2].data<T>();
    const T* dy = in[3].data<T>();
    T* dx = out[0].data<T>();
    T* dm = out[1].data<T>();
    for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
      const int64_t nr = std::min(chunk, rows - r0);
      if (c > 0) {
        const Tensor xs = rows_of(in[0], r0, nr);
        Tensor ds = rows_of(out[0], r0, nr);
        k.log_softmax(xs, ds);
        for (int64_t i = 0; i < nr; ++i) {
          lse[static_cast<size_t>(i)] =
              static_cast<double>(x[(r0 + i) * c]) - static_cast<double>(dx[(r0 + i) * c]);
        }
        k.softmax(xs, ds, false);
      }
      for (int64_t i = r0; i < r0 + nr; ++i) {
        const double d0 = dy[2 * i];
        const double s =
            c > 0 ? std::exp(lse[static_cast<size_t>(i - r0)] - static_cast<double>(m[i])) : 0.0;
        const auto f = static_cast<T>(d0 * s);
        T* row = dx + i * c;
        for (int64_t j = 0; j < c; ++j) row[j] *= f;
        const int64_t at = local_index(n, "label", labels[i], i, c);
        if (at >= 0) row[at] = static_cast<T>(static_cast<double>(row[at]) + dy[2 * i + 1]);
        dm[i] = static_cast<T>(-d0 * s);
      }
    }
  });
}

// mean_n log tot[n,0] + m[n] - tot[n,1] (0 for no rows, as cross_entropy).
void vocab_ce_loss(KernelBackend&, const Node& n, In in, Out out) {
  const int64_t rows = in[0].shape()[0];
  f32_or_f64(n, in[0].dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* tot = in[0].data<T>();
    const T* m = in[1].data<T>();
    double s = 0;
    for (int64_t i = 0; i < rows; ++i) {
      s += std::log(static_cast<double>(tot[2 * i])) + static_cast<double>(m[i]) -
           static_cast<double>(tot[2 * i + 1]);
    }
    out[0].data<T>()[0] = static_cast<T>(rows == 0 ? 0.0 : s / static_cast<double>(rows));
  });
}

void vocab_ce_loss_grad(KernelBackend&, const Node& n, In in, Out out) {
  const int64_t rows = in[0].shape()[0];
  f32_or_f64(n, in[0].dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* tot = in[0].data<T>();
    T* d = out[0].data<T>();
    const double g =
        rows == 0 ? 0.0 : static_cast<double>(in[1].data<T>()[0]) / static_cast<double>(rows);
    for (int64_t i = 0; i < rows; ++i) {
      d[2 * i] = static_cast<T>(g / static_cast<double>(tot[2 * i]));
      d[2 * i + 1] = static_cast<T>(-g);
    }
  });
}

KernelFn lookup(OpKind op) {
  switch (op) {
    case OpKind::matmul:
      return matmul;
    case OpKind::add:
      return binary<BinaryOp::add>;
    case OpKind::sub:
      return binary<BinaryOp::sub>;
    case OpKind::mul:
      return binary<BinaryOp::mul>;
    case OpKind::scale:
      return [](KernelBackend& k, const Node& n, In in, Out out) {
        k.scale(in[0], out[0], n.attrs.f("alpha"));
      };
    case OpKind::relu:
      return unary<UnaryOp::relu>;
    case OpKind::gelu:
      return unary<UnaryOp::gelu>;
    case OpKind::tanh:
      return unary<UnaryOp::tanh>;
    case OpKind::sigmoid:
      return unary<UnaryOp::sigmoid>;
    case OpKind::softmax:
      return [](KernelBackend& k, const Node& n, In in, Out out) {
        k.softmax(in[0], out[0], n.attrs.b_or("causal", false));
      };
    case OpKind::log_softmax:
      return [](KernelBackend& k, const Node&, In in, Out out) { k.log_softmax(in[0], out[0]); };
    case OpKind::layer_norm:
      return [](KernelBackend& k, const Node& n, In in, Out out) {
        k.layer_norm(in[0], in[1], in[2], n.attrs.f("eps"), out[0], out[1], out[2]);
      };
    case OpKind::cross_entropy:
      return [](KernelBackend& k, const Node&, In in, Out out) {
        k.cross_entropy(in[0], in[1], out[0]);
      };
    case OpKind::embedding:
      return [](KernelBackend& k, const Node& n, In in, Out out) {
        if (n.attrs.has("offset")) return embedding_range(k, n, in, out);
        k.embedding(in[0], in[1], out[0]);
      };
    case OpKind::conv2d:
      return [](KernelBackend& k, const Node& n, In in, Out out) {
        k.conv2d(in[0], in[1], in.size() == 3 ? in[2] : Tensor(), out[0], conv_params(n.attrs));
      };
    case OpKind::max_pool2d:
      return [](KernelBackend& k, const Node& n, In in, Out out) {
        k.max_pool2d(in[0], out[0], out[1], pool_params(n.attrs));
      };
    case OpKind::reshape:
      return reshape_copy;
    case OpKind::permute:
      return [](KernelBackend& k, const Node& n, In in, Out out) {
        const auto& p = n.attrs.ints("perm");
        k.permute(in[0], out[0], std::vector<int>(p.begin(), p.end()));
      };
    case OpKind::cast:
      return [](KernelBackend& k, const Node&, In in, Out out) { k.cast(in[0], out[0]); };
    case OpKind::sum_to:
      return [](KernelBackend& k, const Node&, In in, Out out) { k.sum_to(in[0], out[0]); };
    case OpKind::unary_grad:
      return [](KernelBackend& k, const Node& n, In in, Out out) {
        k.unary_backward(static_cast<UnaryOp>(n.attrs.i("unary")), in[0], in[1], in[2], out[0]);
      };
    case OpKind::softmax_grad:
      return [](KernelBackend& k, const Node&, In in, Out out) {
        k.softmax_backward(in[0], in[1], out[0]);
      };
    case OpKind::log_softmax_grad:
      return [](KernelBackend& k, const Node&, In in, Out out) {
        k.log_softmax_backward(in[0], in[1], out[0]);
      };
    case OpKind::layer_norm_grad:
      return [](KernelBackend& k, const Node&, In in, Out out) {
        k.layer_norm_backward(in[0], in[1], in[2], in[3], in[4], out[0], out[1], out[2]);
      };
    case OpKind::cross_entropy_grad:
      return [](KernelBackend& k, const Node&, In in, Out out) {
        k.cross_entropy_backward(in[0], in[1], in[2], out[0]);
      };
    case OpKind::embedding_grad:
      return [](KernelBackend& k, const Node& n, In in, Out out) {
        if (n.attrs.has("offset")) return embedding_range_grad(k, n, in, out);
        k.embedding_backward(in[0], in[1], out[0]);
      };
    case OpKind::conv2d_grad_data:
      return [](KernelBackend& k, const Node& n, In in, Out out) {
        k.conv2d_backward_data(in[0], in[1], out[0], conv_params(n.attrs));
      };
    case OpKind::conv2d_grad_weight:
      return [](KernelBackend& k, const Node& n, In in, Out out) {
        Tensor none;
        k.conv2d_backward_weight(in[0], in[1], out[0], out.size() == 2 ? out[1] : none,
                                 conv_params(n.attrs));
      };
    case OpKind::max_pool2d_grad:
      return [](KernelBackend& k, const Node&, In in, Out out) {
        k.max_pool2d_backward(in[0], in[1], out[0]);
      };
    case OpKind::fill:
      return [](KernelBackend&, const Node& n, In, Out out) { out[0].fill(n.attrs.f("value")); };
    case OpKind::broadcast_to:
      return broadcast_to;
    case OpKind::copy_to_group:  // identity forward: a view, or this copy into caller memory
      return reshape_copy;
    case OpKind::all_reduce:  // these move data between ranks: the CollectiveRunner runs them
    case OpKind::all_gather:
    case OpKind::reduce_scatter:
    case OpKind::reduce_from_group:
    case OpKind::all_to_all:
    case OpKind::gather_from_group:
    case OpKind::all_reduce_max:
      return nullptr;
    case OpKind::row_max:
      return row_max;
    case OpKind::vocab_ce_stats:
      return vocab_ce_stats;
    case OpKind::vocab_ce_stats_grad:
      return vocab_ce_stats_grad;
    case OpKind::vocab_ce_loss:
      return vocab_ce_loss;
    case OpKind::vocab_ce_loss_grad:
      return vocab_ce_loss_grad;
    case OpKind::split_to_group:
      return group_piece;
    case OpKind::spmm:
      return [](KernelBackend& k, const Node&, In in, Out out) {
        k.spmm(in[0], in[1], in.size() == 4 ? in[3] : Tensor(), in[2], out[0]);
      };
    case OpKind::spmm_t:
      return [](KernelBackend& k, const Node&, In in, Out out) {
        k.spmm_transposed(in[0], in[1], in.size() == 4 ? in[3] : Tensor(), in[2], out[0]);
      };
    case OpKind::sddmm:
      return [](KernelBackend& k, const Node&, In in, Out out) {
        k.sddmm(in[0], in[1], in[2], in[3], out[0]);
      };
    case OpKind::spmm_max:
      return [](KernelBackend& k, const Node&, In in, Out out) {
        k.spmm_max(in[0], in[1], in[2], out[0], out[1]);
      };
    case OpKind::spmm_max_grad:
      return [](KernelBackend& k, const Node&, In in, Out out) {
        k.spmm_max_backward(in[0], in[1], out[0]);
      };
    case OpKind::edge_softmax:
      return [](KernelBackend& k, const Node&, In in, Out out) {
        k.edge_softmax(in[0], in[1], out[0]);
      };
    case OpKind::edge_softmax_grad:
      return [](KernelBackend& k, const Node&, In in, Out out) {
        k.edge_softmax_backward(in[0], in[1], in[2], out[0]);
      };
  }
  return nullptr;
}

}  // namespace

KernelFn kernel_for(OpKind op) {
  KernelFn f = lookup(op);
  if (f == nullptr) {
    throw InternalError(fmt::format("executor: no kernel for operator #{}", static_cast<int>(op)));
  }
  return f;
}

}  // namespace mt
