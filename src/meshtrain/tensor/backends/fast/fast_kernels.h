// The fast backend's hand-written kernels (internal to
// src/meshtrain/tensor/backends/fast): element-wise and layout kernels
// (elementwise_kernels.cpp), softmax / layer norm / losses / embeddings
// (norm_kernels.cpp) and max pooling (pool_kernels.cpp).
//
// Each function validates its arguments as the reference backend does
// (ShapeError naming the kernel), computes in f32 with VecF (simd.h), and
// splits rows or elements over up to `threads` OpenMP threads when there is
// enough work. The backend routes only the dtypes named below here; the
// semantics are the reference backend's (reference_backend.h).
#pragma once

#include <vector>

#include "meshtrain/tensor/backend.h"

namespace mt::fast {

// ---- element-wise and layout (f32 unless noted) ----
// unary, unary_backward, binary and sum_to also take bf16 or f16 storage
// (computed in f32, rounded once); sum_to may sum a 16-bit x into an f32 y.
void unary(UnaryOp op, const Tensor& x, Tensor& y, int threads);
void unary_backward(UnaryOp op, const Tensor& x, const Tensor& y, const Tensor& dy, Tensor& dx,
                    int threads);
void binary(BinaryOp op, const Tensor& a, const Tensor& b, Tensor& c, int threads);
void scale(const Tensor& x, Tensor& y, double alpha, double beta, int threads);
void sum_to(const Tensor& x, Tensor& y, int threads);
// f32 <-> bf16, f32 <-> f16 (with AVX-512) and same-dtype copies, bit for bit
// as the reference; returns false (doing nothing) for other dtype pairs, which
// the backend hands to its fallback.
bool cast(const Tensor& x, Tensor& y, int threads);
// Any dtype.
void permute(const Tensor& x, Tensor& y, const std::vector<int>& perm, int threads);

// ---- over the last axis ----
void softmax(const Tensor& x, Tensor& y, bool causal, int threads);
void softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx, int threads);
void log_softmax(const Tensor& x, Tensor& y, int threads);
void log_softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx, int threads);
void layer_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps, Tensor& y,
                Tensor& mean, Tensor& rstd, int threads);
void layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                         const Tensor& rstd, Tensor& dx, Tensor& dgamma, Tensor& dbeta,
                         int threads);
// f32 logits; loss / dloss may be f32 or f64.
void cross_entropy(const Tensor& logits, const Tensor& labels, Tensor& loss, int threads);
void cross_entropy_backward(const Tensor& logits, const Tensor& labels, const Tensor& dloss,
                            Tensor& dlogits, int threads);
// Any table dtype.
void embedding(const Tensor& table, const Tensor& ids, Tensor& y, int threads);
void embedding_backward(const Tensor& dy, const Tensor& ids, Tensor& dtable, int threads);

// ---- pooling ----
void max_pool2d(const Tensor& x, Tensor& y, Tensor& argmax, const Pool2dParams& p, int threads);
void max_pool2d_backward(const Tensor& dy, const Tensor& argmax, Tensor& dx, int threads);

// ---- sparse (CSR) x dense, f32 (sparse_kernels.cpp) ----
void spmm(const Tensor& row_ptr, const Tensor& col_idx, const Tensor& w, const Tensor& x, Tensor& y,
          int threads);
void spmm_transposed(const Tensor& row_ptr, const Tensor& col_idx, const Tensor& w,
                     const Tensor& dy, Tensor& dx, int threads);
void sddmm(const Tensor& row_ptr, const Tensor& col_idx, const Tensor& a, const Tensor& b,
           Tensor& out, int threads);
void spmm_max(const Tensor& row_ptr, const Tensor& col_idx, const Tensor& x, Tensor& y,
              Tensor& argmax, int threads);
void spmm_max_backward(const Tensor& dy, const Tensor& argmax, Tensor& dx, int threads);
void edge_softmax(const Tensor& row_ptr, const Tensor& x, Tensor& y, int threads);
void edge_softmax_backward(const Tensor& row_ptr, const Tensor& y, const Tensor& dy, Tensor& dx,
                           int threads);

}  // namespace mt::fast
