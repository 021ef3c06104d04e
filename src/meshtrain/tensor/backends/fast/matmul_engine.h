// Runs matmul for the fast backend (internal to
// src/meshtrain/tensor/backends/fast): f32 through OpenBLAS sgemm or oneDNN's
// matmul primitive, bf16/f16 inputs with an f32 output, or an output of the
// inputs' 16-bit type (accumulated in f32, rounded once), through oneDNN only
// (it uses AVX512_BF16 / AMX where the CPU has them).
//
// Engine choice for f32 (MatmulEngineChoice::measure): each distinct call
// signature -- dtype, batch, M, N, K, transposes, shared b, alpha, beta and
// thread count -- starts undecided. Its first 2 * kTrials calls alternate
// between oneDNN and OpenBLAS and time each (every trial is a real call that
// produces the caller's result, so measuring wastes no work); then OpenBLAS
// serves that signature for the engine's lifetime if its minimum time beats
// oneDNN's by kOpenBlasMargin, else oneDNN does. The margin keeps near-ties
// on oneDNN: it runs on the same OpenMP threads as every other kernel here,
// while OpenBLAS's own thread pool spins after each call and competes with
// them for cores. Times are the calling thread's CPU time at one thread
// (robust to other processes on a shared machine) and wall time otherwise
// (trial_clock_s in base/timer.h). oneDNN primitives are created once per
// signature and cached.
//
// Trust (MatmulTrust, probe_matmul_engines): before an engine serves any
// call, the backend runs it on a few small GEMMs of awkward shapes (odd
// sizes, every transpose, alpha and beta, batches, a shared b, K = 1 and
// K = 300) and compares with the reference backend. An element passes when
// |c - ref| <= (K + 2) * 2^-22 * (|alpha| sum_k |a_ik b_kj| + |beta c_ij|)
// (a few times f32's error bound for a K-term sum; a wrong kernel is off by
// O(1) of that scale). An engine that fails is dropped with the reason --
// some OpenBLAS builds compute wrong results on CPUs they do not know -- and
// measured choices never pick it; bf16/f16 matmuls then widen to f32 when
// oneDNN is the one dropped.
//
// Owned by the fast backend; blocks until c is written; one calling thread
// per instance.
#pragma once

#include <compare>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/tensor/backend.h"
#include "meshtrain/tensor/backends/fast/fast_backend.h"
#include "meshtrain/tensor/backends/fast/onednn_context.h"
#include "meshtrain/tensor/kernel_checks.h"

namespace mt::fast {

// Which f32 engines passed the correctness probe; a dropped one has its reason.
struct MatmulTrust {
  bool onednn = true, openblas = true;
  std::string onednn_reason, openblas_reason;
};

// Probes both engines against `oracle` (the reference backend), with `fault`
// injected (tests); never throws for a wrong engine, only reports it.
MatmulTrust probe_matmul_engines(KernelBackend& oracle, MatmulEngineFault fault);

class MatmulEngine {
 public:
  // Timed calls per engine while a signature is undecided.
  static constexpr int kTrials = 3;
  // OpenBLAS must take less than this fraction of oneDNN's time to be chosen.
  static constexpr double kOpenBlasMargin = 0.9;

  MatmulEngine(OneDnnContext& ctx, MatmulEngineChoice f32_choice, MatmulTrust trust = {},
               MatmulEngineFault fault = MatmulEngineFault::none);
  ~MatmulEngine();
  MatmulEngine(const MatmulEngine&) = delete;
  MatmulEngine& operator=(const MatmulEngine&) = delete;

  // True for the dtype combinations run() computes: f32 x f32 -> f32 and
  // bf16 x bf16 / f16 x f16 -> f32. The backend hands the rest to its fallback.
  static bool supports(const Tensor& a, const Tensor& b, const Tensor& c);
  // Validates shapes (ShapeError) and computes c = alpha op(a) op(b) + beta c
  // using `threads` threads (the caller has set OpenMP's count to match).
  void run(const Tensor& a, const Tensor& b, Tensor& c, const MatmulParams& p, int threads);

  // The engine serving f32 calls of this signature so far: "onednn",
  // "openblas" or "undecided" (for benchmarks and tests).
  const char* chosen_engine(const Tensor& a, const Tensor& b, const MatmulParams& p,
                            int threads) const;
  // Every f32 signature seen so far and its engine (EngineReport::matmul).
  std::vector<std::pair<std::string, std::string>> report() const;

 private:
  // Problem sizes after validation; batch folded into m when b is shared and
  // a is not transposed (then one 2-D product covers the whole batch).
  using Dims = MatmulDims;
  // A call signature; alpha and beta are kept as bit patterns.
  struct Key {
    DType in, out;
    int64_t batch, m, n, k;
    bool shared_b, trans_a, trans_b;
    uint32_t alpha_bits, beta_bits;
    int threads;
    auto operator<=>(const Key&) const = default;
  };
  enum class Engine : uint8_t { undecided, onednn, openblas };
  struct Plan {
    std::optional<dnnl::matmul> prim;  // created on first oneDNN use
    dnnl::memory::desc a_md, b_md, c_md;
    Engine engine = Engine::undecided;
    int trials = 0;
    double best_onednn = 1e300, best_openblas = 1e300;  // seconds
  };

  static void fold_batch(Dims& d, const MatmulParams& p);
  static Key key_of(DType in, DType out, const Dims& d, const MatmulParams& p, int threads);
  Plan& plan_for(const Key& key, const Dims& d, DType in, DType out, const MatmulParams& p);
  void run_onednn(Plan& plan, const Tensor& a, const Tensor& b, Tensor& c);
  void run_openblas(const Dims& d, const Tensor& a, const Tensor& b, Tensor& c,
                    const MatmulParams& p);

  // The test hook: perturbs c after the faulty engine ran.
  void inject_fault(Engine e, Tensor& c) const;

  OneDnnContext& ctx_;
  MatmulEngineChoice f32_choice_;
  MatmulTrust trust_;
  MatmulEngineFault fault_;
  std::map<Key, std::unique_ptr<Plan>> plans_;
};

}  // namespace mt::fast
