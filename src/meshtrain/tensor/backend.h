// The kernel interface every tensor backend implements (the implementer's
// header; callers include kernels.h).
//
// Conventions for every method:
// - Tensors are contiguous and row-major; outputs are pre-allocated by the
//   caller with the right shape and dtype, and are overwritten (never
//   accumulated into) unless the method says otherwise.
// - The reference backend supports f32 and f64 for every float kernel (the
//   gradient checks run in f64), and bf16/f16 storage for matmul, unary,
//   unary_backward, binary and sum_to, computed in f32 and rounded once.
//   Fast backends support at least f32 and fall back to the reference
//   backend for anything else.
// - Integer index tensors (labels, token ids, argmax) are i32.
// - Shape or dtype errors throw mt::ShapeError naming the kernel and shapes.
// - Methods may use several threads internally (see set_num_threads) but are
//   called from one thread at a time per backend instance.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/tensor/tensor.h"

namespace mt {

enum class UnaryOp : uint8_t { relu, gelu, tanh, sigmoid };
enum class BinaryOp : uint8_t { add, sub, mul, div };

struct MatmulParams {
  bool trans_a = false;
  bool trans_b = false;
  float alpha = 1.0f;
  // c = alpha * op(a) @ op(b) + beta * c.  beta != 0 accumulates into c.
  float beta = 0.0f;
};

struct Conv2dParams {
  int64_t stride_h = 1, stride_w = 1;
  int64_t pad_h = 0, pad_w = 0;
};

struct Pool2dParams {
  int64_t kernel_h = 2, kernel_w = 2;
  int64_t stride_h = 2, stride_w = 2;
  int64_t pad_h = 0, pad_w = 0;
};

// What a backend decided about its engines, for logs and the metrics
// summary (KernelBackend::engine_report).
struct EngineReport {
  // Per f32 matmul signature seen on the calling thread ("128x512x784 nn t1",
  // M x N x K, transposes of a and b, threads; "b4" prefix when batched):
  // the engine serving it ("onednn", "openblas", "undecided" while timing).
  std::vector<std::pair<std::string, std::string>> matmul;
  // Engines the correctness probe dropped, each with the reason.
  std::vector<std::pair<std::string, std::string>> dropped;
  std::string blas_core;  // OpenBLAS's core type (machine.h), "" if unused
};

class KernelBackend {
 public:
  virtual ~KernelBackend() = default;
  virtual std::string name() const = 0;
  // Threads used inside one kernel call (OpenMP / oneDNN / OpenBLAS).
  virtual void set_num_threads(int n) = 0;
  // Engine choices so far (see EngineReport); empty for a single-engine backend.
  virtual EngineReport engine_report() { return {}; }

  // ---- linear algebra ----
  // a: [M,K] (or [K,M] if trans_a), b: [K,N] (or [N,K] if trans_b), c: [M,N].
  // Batched: a [B,M,K], b [B,K,N], c [B,M,N]; b may also be rank 2 and shared
  // across the batch. Mixed precision: a and b may be bf16 (or f16) with c f32
  // or c of their own 16-bit type (accumulated in f32, rounded once).
  virtual void matmul(const Tensor& a, const Tensor& b, Tensor& c, const MatmulParams& p) = 0;

  // ---- element-wise ----
  // y = op(x). x and y have equal shapes; may alias.
  virtual void unary(UnaryOp op, const Tensor& x, Tensor& y) = 0;
  // dx = dy * op'(x). (x is the forward input; y = op(x) is passed too so a
  // backend may use whichever is cheaper.) May not alias dy with x.
  virtual void unary_backward(UnaryOp op, const Tensor& x, const Tensor& y, const Tensor& dy,
                              Tensor& dx) = 0;
  // c = a op b. b has a's shape, or a suffix of it (broadcast over the leading
  // dims, e.g. a bias [C] over [N, C]), or is a scalar (rank 0 or numel 1).
  virtual void binary(BinaryOp op, const Tensor& a, const Tensor& b, Tensor& c) = 0;
  // y = alpha * x (+ beta * y if beta != 0).
  virtual void scale(const Tensor& x, Tensor& y, double alpha, double beta = 0.0) = 0;
  // y = sum of x over its leading dims so that y's shape is a suffix of x's
  // (the backward of a broadcast binary). y scalar = sum of all elements. A
  // 16-bit x may sum into an f32 y.
  virtual void sum_to(const Tensor& x, Tensor& y) = 0;
  // Element-wise dtype conversion.
  virtual void cast(const Tensor& x, Tensor& y) = 0;
  // y = x transposed by `perm` (y.shape[i] == x.shape[perm[i]]).
  virtual void permute(const Tensor& x, Tensor& y, const std::vector<int>& perm) = 0;

  // ---- normalisation and losses (over the last axis) ----
  // causal: x is [..., T, S] and entries with column > row + (S - T) are
  // masked to -inf before the softmax (decoder self-attention).
  virtual void softmax(const Tensor& x, Tensor& y, bool causal) = 0;
  // dx = y * (dy - sum(dy * y)).
  virtual void softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx) = 0;
  virtual void log_softmax(const Tensor& x, Tensor& y) = 0;
  // dx = dy - exp(y) * sum(dy).
  virtual void log_softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx) = 0;
  // x [..., C], gamma/beta [C]; mean/rstd [prod(leading dims)] are saved for
  // the backward (f32 for f32 x, f64 for f64 x).
  virtual void layer_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps,
                          Tensor& y, Tensor& mean, Tensor& rstd) = 0;
  virtual void layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                   const Tensor& mean, const Tensor& rstd, Tensor& dx,
                                   Tensor& dgamma, Tensor& dbeta) = 0;
  // logits [N, C], labels i32 [N] in [0, C) -> loss scalar = mean_n
  // -log softmax(logits)[n, label[n]]. Out-of-range labels throw ShapeError.
  virtual void cross_entropy(const Tensor& logits, const Tensor& labels, Tensor& loss) = 0;
  // dlogits = dloss * (softmax(logits) - onehot(labels)) / N.
  virtual void cross_entropy_backward(const Tensor& logits, const Tensor& labels,
                                      const Tensor& dloss, Tensor& dlogits) = 0;

  // ---- embeddings ----
  // table [V, C], ids i32 [...] -> y [..., C]. Out-of-range ids throw.
  virtual void embedding(const Tensor& table, const Tensor& ids, Tensor& y) = 0;
  // dtable = scatter-add of dy rows at ids (dtable is overwritten: zeroed first).
  virtual void embedding_backward(const Tensor& dy, const Tensor& ids, Tensor& dtable) = 0;

  // ---- convolution and pooling (NCHW, weights OIHW) ----
  // bias [O] may be undefined (Tensor()).
  virtual void conv2d(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y,
                      const Conv2dParams& p) = 0;
  virtual void conv2d_backward_data(const Tensor& dy, const Tensor& w, Tensor& dx,
                                    const Conv2dParams& p) = 0;
  // dbias may be undefined (no bias).
  virtual void conv2d_backward_weight(const Tensor& dy, const Tensor& x, Tensor& dw, Tensor& dbias,
                                      const Conv2dParams& p) = 0;
  // y [N,C,OH,OW]; argmax i32 [N,C,OH,OW] holds the flat index (h * W + w)
  // inside the input plane of the chosen element.
  virtual void max_pool2d(const Tensor& x, Tensor& y, Tensor& argmax, const Pool2dParams& p) = 0;
  virtual void max_pool2d_backward(const Tensor& dy, const Tensor& argmax, Tensor& dx) = 0;

  // ---- sparse (CSR) x dense ----
  // A sparse matrix A [N, M] is given in CSR form: row_ptr i32 [N+1]
  // (row_ptr[0] == 0, non-decreasing, row_ptr[N] == E) and col_idx i32 [E]
  // (each in [0, M)), plus optional edge values w [E] of x's dtype (undefined
  // Tensor(): every value is 1). Row i's entries are the edges
  // row_ptr[i] .. row_ptr[i+1]-1. Empty rows, self-loops (col == row) and
  // duplicate entries are allowed (duplicates add). In a graph, row i lists
  // the in-neighbours of vertex i, so A @ X aggregates messages into i.
  // A malformed CSR throws ShapeError naming the field and position.
  //
  // y [N, F] = A @ x, x [M, F].
  virtual void spmm(const Tensor& row_ptr, const Tensor& col_idx, const Tensor& w, const Tensor& x,
                    Tensor& y) = 0;
  // dx [M, F] = A^T @ dy, dy [N, F] (overwritten; no dense A^T is formed).
  virtual void spmm_transposed(const Tensor& row_ptr, const Tensor& col_idx, const Tensor& w,
                               const Tensor& dy, Tensor& dx) = 0;
  // out [E]: out[e] = dot(a[row(e)], b[col_idx[e]]), a [N, F], b [M, F]
  // (the sampled dense-dense product; spmm's gradient for w).
  virtual void sddmm(const Tensor& row_ptr, const Tensor& col_idx, const Tensor& a, const Tensor& b,
                     Tensor& out) = 0;
  // y [N, F] = max over row i's entries of x[col, f] (no edge values);
  // argmax i32 [N, F] holds the chosen column (source vertex). Ties pick the
  // first entry; a NaN is the maximum (the first NaN wins). An empty row
  // gives y = 0 and argmax = -1.
  virtual void spmm_max(const Tensor& row_ptr, const Tensor& col_idx, const Tensor& x, Tensor& y,
                        Tensor& argmax) = 0;
  // dx [M, F] zeroed, then dx[argmax[i, f], f] += dy[i, f] (skipping -1).
  virtual void spmm_max_backward(const Tensor& dy, const Tensor& argmax, Tensor& dx) = 0;
  // y [E] = softmax of x [E] over each row's entries (a graph attention
  // layer's normalisation over a vertex's incoming edges).
  virtual void edge_softmax(const Tensor& row_ptr, const Tensor& x, Tensor& y) = 0;
  // dx[e] = y[e] * (dy[e] - sum over e's row of dy * y).
  virtual void edge_softmax_backward(const Tensor& row_ptr, const Tensor& y, const Tensor& dy,
                                     Tensor& dx) = 0;
};

}  // namespace mt
