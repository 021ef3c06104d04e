// Choosing a kernel backend (the caller's header; implementers see backend.h).
//
//   KernelBackend& k = kernels("fast");
//   k.matmul(a, b, c, {});
//   KernelBackend& pinned = kernels("fast", {MatmulEngineChoice::onednn, ConvLayoutChoice::plain});
//
// "reference": naive loops in f32/f64, the oracle every fast kernel is tested
//              against. Slow; single-threaded.
// "fast":      oneDNN (convolution, bf16 matmul) and OpenBLAS / oneDNN (f32
//              matmul, chosen by measurement), vectorised element-wise code.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "meshtrain/tensor/backend.h"

namespace mt {

// Which library computes f32 matmuls.
enum class MatmulEngineChoice : uint8_t {
  measure,   // time both on the first calls of each shape, keep the faster
  onednn,    // always oneDNN's matmul primitive
  openblas,  // always OpenBLAS sgemm
};

// Test hook of FastBackendOptions: which f32 matmul engine computes wrong results.
enum class MatmulEngineFault : uint8_t { none, onednn, openblas };

// Which memory layout convolutions run in.
enum class ConvLayoutChoice : uint8_t {
  measure,  // time both on the first calls of each shape, keep the faster
  plain,    // oneDNN works on the caller's NCHW / OIHW buffers directly
  blocked,  // oneDNN's preferred (channel-blocked) layouts, reordered to and fro
};

// "measure" picks by timing, so on a machine where two choices run about
// equally fast a run may pick differently from the last one, and its float
// results differ in the last bits; pin both for bitwise-repeatable runs.
//
// Every f32 matmul engine is checked against the reference backend when the
// backend is made (a few small GEMMs of awkward shapes; see
// backends/fast/matmul_engine.h): one that computes wrong results is dropped
// with the reason in engine_report(), and pinning it is a ConfigError.
struct FastBackendOptions {
  MatmulEngineChoice f32_matmul = MatmulEngineChoice::measure;
  ConvLayoutChoice conv_layout = ConvLayoutChoice::measure;
  // Test hook: this engine's f32 results come out wrong (one element off,
  // as a library misdetecting the CPU may compute), so tests can watch the
  // correctness probe drop it. `none` outside tests.
  MatmulEngineFault faulty_engine_for_testing = MatmulEngineFault::none;
};

// The process-wide instance of a backend (one per distinct FastBackendOptions
// for "fast"; the reference backend ignores them); throws ConfigError for an
// unknown name.
KernelBackend& kernels(std::string_view name, const FastBackendOptions& fast = {});

// "measure", "onednn", "openblas" / "measure", "plain", "blocked"; ConfigError otherwise.
MatmulEngineChoice parse_matmul_engine(std::string_view text);
ConvLayoutChoice parse_conv_layout(std::string_view text);

std::vector<std::string_view> kernel_backend_names();

}  // namespace mt
