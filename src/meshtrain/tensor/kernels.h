// Choosing a kernel backend (the caller's header; implementers see backend.h).
//
//   KernelBackend& k = kernels("fast");
//   k.matmul(a, b, c, {});
//
// "reference": naive loops in f32/f64, the oracle every fast kernel is tested
//              against. Slow; single-threaded.
// "fast":      oneDNN (convolution, bf16 matmul) and OpenBLAS / oneDNN (f32
//              matmul, chosen by measurement), vectorised element-wise code.
#pragma once

#include <string_view>
#include <vector>

#include "meshtrain/tensor/backend.h"

namespace mt {

// The process-wide instance of a backend; throws ConfigError for an unknown name.
KernelBackend& kernels(std::string_view name);
std::vector<std::string_view> kernel_backend_names();

}  // namespace mt
