// The fast CPU kernel backend: oneDNN (convolution, bf16/f16 matmul), OpenBLAS
// or oneDNN for f32 matmul (chosen per shape by measurement), and vectorised,
// OpenMP-parallel element-wise, normalisation, loss, embedding and pooling
// kernels. It computes f32, bf16/f16 matmul inputs (with an f32 or 16-bit
// output) and bf16/f16 storage for unary, unary_backward, binary and sum_to
// itself, and hands every other dtype to `fallback`, which must outlive it.
//
// Before any engine computes, the constructor checks each f32 matmul engine
// against the reference backend on small awkward GEMMs and drops one that
// computes wrong results (matmul_engine.h; engine_report() says why;
// pinning a dropped engine throws ConfigError).
//
// Semantics are exactly those of the reference backend (see
// backends/reference/reference_backend.h), within float tolerance.
//
// Threads: set_num_threads(n) sets the threads used inside one kernel call for
// OpenMP, oneDNN (which runs on OpenMP here) and OpenBLAS; the default is 1.
// These runtimes keep process-wide (OpenBLAS) or per-calling-thread (OpenMP)
// settings, so the backend re-applies its count on entry to each kernel.
// Several threads may call one instance at once (e.g. ranks run as threads
// sharing kernels("fast")): each calling thread gets its own oneDNN
// primitives, engine choices and scratch buffers, freed when it exits.
#pragma once

#include <memory>

#include "meshtrain/tensor/backend.h"
#include "meshtrain/tensor/kernels.h"

namespace mt {

// MatmulEngineChoice, ConvLayoutChoice and FastBackendOptions: tensor/kernels.h.
std::unique_ptr<KernelBackend> make_fast_backend(KernelBackend& fallback);
std::unique_ptr<KernelBackend> make_fast_backend(KernelBackend& fallback,
                                                 const FastBackendOptions& options);

}  // namespace mt
