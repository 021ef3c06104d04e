#include "meshtrain/exec/kernel_table.h"

#include <cstring>

#include <fmt/format.h>

#include "meshtrain/base/error.h"

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
      return
          [](KernelBackend& k, const Node&, In in, Out out) { k.embedding(in[0], in[1], out[0]); };
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
      return [](KernelBackend& k, const Node&, In in, Out out) {
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
      return nullptr;
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
