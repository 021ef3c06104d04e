// Small building blocks shared by the models (linear layers, mixed-precision
// casts). Internal to the models layer.
#pragma once

#include <string>

#include "meshtrain/graph/builder.h"

namespace mt::layers {

// PyTorch's default initialisation for Linear / Conv weights and biases:
// uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)).
ParamInit fan_in_uniform(int64_t fan_in);

// x [N, in] @ w [in, out] (+ b [out]); operands cast to `compute` first when
// it is not f32 (the product is accumulated in f32).
ValueId linear(Builder& b, ValueId x, int64_t in, int64_t out, const std::string& name,
               DType compute, ParamInit w_init, bool bias = true);

// Casts v to `compute` unless compute is f32 (then returns v unchanged).
ValueId to_compute(Builder& b, ValueId v, DType compute);

}  // namespace mt::layers
