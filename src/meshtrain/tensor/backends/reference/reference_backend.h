// The reference kernel backend: plain single-threaded loops that compute every
// KernelBackend method the obvious way, accumulating in double. It is the
// oracle that every fast kernel and every gradient check is compared with, so
// it favours clarity over speed and validates every argument.
//
// Ownership and threading: kernels("reference") owns the process-wide
// instance; the object is stateless, so any number may exist. Calls block
// until the result is written and use only the calling thread.
//
// Dtypes: every float kernel takes f32 and f64 (all operands of one call share
// the dtype unless noted). matmul also takes bf16 or f16 inputs with an f32
// output; cast takes every dtype pair; permute and embedding (forward) copy
// elements of any dtype. Index tensors (labels, ids, argmax) are i32.
//
// Semantics that backend.h leaves open, fixed here (fast backends must match):
// - Aliasing: outputs of element-wise kernels (unary, unary_backward, binary,
//   scale, cast of equal dtypes, softmax, log_softmax and their backwards,
//   layer_norm's y) may alias an input of the same shape. matmul's c,
//   permute's y, conv and pool outputs and embedding outputs must not alias an
//   input.
// - matmul: with beta == 0, c is only written, never read (garbage or NaN in
//   c does not leak into the result). a rank 2 needs b and c rank 2; a rank 3
//   [B,M,K] takes b [B,K,N] or a shared b [K,N], and c [B,M,N]. a and b share
//   a dtype; c has that dtype, or f32 when a and b are bf16/f16.
// - relu(x) = x < 0 ? 0 : x (NaN propagates); relu'(x) = 1 for x > 0, else 0.
// - gelu is the tanh approximation used by GPT-2:
//     gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))),
//   and gelu' is the exact derivative of that formula.
// - sigmoid(x) = 1 / (1 + exp(-x)); unary_backward recomputes op'(x) from x,
//   so its y argument may be undefined (Tensor()); if defined, it must match x.
// - binary and sum_to: b (or y) is "scalar" when its numel is 1, whatever its
//   rank; otherwise its shape must equal the trailing dims of a (or x).
//   sum_to into a scalar sums every element.
// - softmax(causal): x is [..., T, S] with S >= T (ShapeError otherwise);
//   entry (t, s) is masked when s > t + (S - T), and masked outputs are
//   exactly 0. Every row keeps at least one unmasked entry.
// - layer_norm: biased variance (divide by C), rstd = 1 / sqrt(var + eps),
//   y = (x - mean) * rstd * gamma + beta. C must be >= 1. mean and rstd have
//   x's dtype and shape [R] (R = product of the leading dims) or the leading
//   dims themselves.
// - cross_entropy: loss and dloss are f32 or f64, independently of the
//   logits' dtype, and have one element. An empty batch (N = 0) gives loss 0
//   and an empty dlogits. A label outside [0, C) throws ShapeError naming
//   its row and value.
// - embedding: ids of any shape (rank 0 included); an id outside [0, V)
//   throws ShapeError naming its position and value.
// - conv2d: direct convolution with zero padding, no groups or dilation:
//   OH = (H + 2 pad_h - KH) / stride_h + 1 (integer division), same for W.
//   Strides must be >= 1 and pads >= 0.
// - max_pool2d: padding contributes -inf; requires 0 <= pad < kernel so that
//   every window holds at least one input element. Ties pick the first
//   element in row-major window order; a NaN in a window is the maximum (the
//   first NaN wins). max_pool2d_backward adds dy into dx at argmax (windows
//   may overlap) after zeroing dx; an argmax outside [0, H*W) throws.
#pragma once

#include <string>
#include <vector>

#include "meshtrain/tensor/backend.h"

namespace mt {

class ReferenceBackend final : public KernelBackend {
 public:
  std::string name() const override { return "reference"; }
  // The reference backend is single-threaded; n only has to be >= 1
  // (ConfigError otherwise).
  void set_num_threads(int n) override;

  void matmul(const Tensor& a, const Tensor& b, Tensor& c, const MatmulParams& p) override;

  void unary(UnaryOp op, const Tensor& x, Tensor& y) override;
  void unary_backward(UnaryOp op, const Tensor& x, const Tensor& y, const Tensor& dy,
                      Tensor& dx) override;
  void binary(BinaryOp op, const Tensor& a, const Tensor& b, Tensor& c) override;
  void scale(const Tensor& x, Tensor& y, double alpha, double beta = 0.0) override;
  void sum_to(const Tensor& x, Tensor& y) override;
  void cast(const Tensor& x, Tensor& y) override;
  void permute(const Tensor& x, Tensor& y, const std::vector<int>& perm) override;

  void softmax(const Tensor& x, Tensor& y, bool causal) override;
  void softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx) override;
  void log_softmax(const Tensor& x, Tensor& y) override;
  void log_softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx) override;
  void layer_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps, Tensor& y,
                  Tensor& mean, Tensor& rstd) override;
  void layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                           const Tensor& mean, const Tensor& rstd, Tensor& dx, Tensor& dgamma,
                           Tensor& dbeta) override;
  void cross_entropy(const Tensor& logits, const Tensor& labels, Tensor& loss) override;
  void cross_entropy_backward(const Tensor& logits, const Tensor& labels, const Tensor& dloss,
                              Tensor& dlogits) override;

  void embedding(const Tensor& table, const Tensor& ids, Tensor& y) override;
  void embedding_backward(const Tensor& dy, const Tensor& ids, Tensor& dtable) override;

  void conv2d(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y,
              const Conv2dParams& p) override;
  void conv2d_backward_data(const Tensor& dy, const Tensor& w, Tensor& dx,
                            const Conv2dParams& p) override;
  void conv2d_backward_weight(const Tensor& dy, const Tensor& x, Tensor& dw, Tensor& dbias,
                              const Conv2dParams& p) override;
  void max_pool2d(const Tensor& x, Tensor& y, Tensor& argmax, const Pool2dParams& p) override;
  void max_pool2d_backward(const Tensor& dy, const Tensor& argmax, Tensor& dx) override;

  // Sparse kernels (reference_sparse.cpp): a loop over rows and their entries,
  // accumulating in double, every CSR field validated on each call.
  void spmm(const Tensor& row_ptr, const Tensor& col_idx, const Tensor& w, const Tensor& x,
            Tensor& y) override;
  void spmm_transposed(const Tensor& row_ptr, const Tensor& col_idx, const Tensor& w,
                       const Tensor& dy, Tensor& dx) override;
  void sddmm(const Tensor& row_ptr, const Tensor& col_idx, const Tensor& a, const Tensor& b,
             Tensor& out) override;
  void spmm_max(const Tensor& row_ptr, const Tensor& col_idx, const Tensor& x, Tensor& y,
                Tensor& argmax) override;
  void spmm_max_backward(const Tensor& dy, const Tensor& argmax, Tensor& dx) override;
  void edge_softmax(const Tensor& row_ptr, const Tensor& x, Tensor& y) override;
  void edge_softmax_backward(const Tensor& row_ptr, const Tensor& y, const Tensor& dy,
                             Tensor& dx) override;
};

}  // namespace mt
