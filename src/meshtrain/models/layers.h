// Small building blocks shared by the models (linear layers, mixed-precision
// casts). Internal to the models layer.
#pragma once

#include <string>

#include "meshtrain/graph/builder.h"

namespace mt::layers {

// PyTorch's default initialisation for Linear / Conv weights and biases:
// uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)).
ParamInit fan_in_uniform(int64_t fan_in);

// The dtype activations between matmuls are kept in: bf16 under bf16 compute;
// f32 otherwise (f16's range is too narrow to store activations unscaled, and
// f16 matmuls convert to f32 on CPUs without f16 units anyway).
DType activation_dtype(DType compute);

// What a linear layer hands on: an activation in activation_dtype(compute)
// (kept in bf16 for the next matmul under mixed precision), or f32 (logits,
// the residual stream).
enum class LinearOut : uint8_t { compute, f32 };

// x [N, in] @ w [in, out] (+ b [out]). Under a 16-bit `compute` the operands
// are cast to it (x only if it is not already), the product is accumulated in
// f32 and rounded to the output's dtype, and the bias is added in that dtype.
ValueId linear(Builder& b, ValueId x, int64_t in, int64_t out, const std::string& name,
               DType compute, ParamInit w_init, bool bias = true,
               LinearOut out_kind = LinearOut::compute);

// Casts v to `compute` unless compute is f32 (then returns v unchanged).
ValueId to_compute(Builder& b, ValueId v, DType compute);

}  // namespace mt::layers
