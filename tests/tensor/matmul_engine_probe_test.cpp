// The machine description (machine.h), the OpenBLAS core-type advice, and
// the matmul engines' correctness probe: a wrong engine (injected through
// FastBackendOptions' test hook) is dropped with its reason, the other one
// serves every call, and pinning the wrong one is a ConfigError; the clock
// the engines time their trials on sees a trial of tens of microseconds.
#include <gtest/gtest.h>

#include <string>

#include "meshtrain/base/error.h"
#include "meshtrain/base/timer.h"
#include "meshtrain/tensor/backends/fast/fast_backend.h"
#include "meshtrain/tensor/backends/fast/matmul_engine.h"
#include "meshtrain/tensor/kernels.h"
#include "meshtrain/tensor/machine.h"

namespace mt {
namespace {

Tensor ramp(const Shape& s, float scale) {
  Tensor t = Tensor::empty(s, DType::f32);
  for (int64_t i = 0; i < t.numel(); ++i) {
    t.data<float>()[i] = scale * static_cast<float>((i * 37) % 23 - 11) / 11.0f;
  }
  return t;
}

// Runs one shape often enough for the measured choice to settle and checks
// every result against the reference backend.
void expect_matches_reference(KernelBackend& fast, const Shape& sa, const Shape& sb,
                              const Shape& sc, MatmulParams p) {
  KernelBackend& ref = kernels("reference");
  const Tensor a = ramp(sa, 1.0f), b = ramp(sb, 0.5f);
  Tensor want = Tensor::zeros(sc, DType::f32);
  ref.matmul(a, b, want, p);
  for (int i = 0; i < 2 * fast::MatmulEngine::kTrials + 1; ++i) {
    Tensor got = Tensor::zeros(sc, DType::f32);
    fast.matmul(a, b, got, p);
    for (int64_t j = 0; j < got.numel(); ++j) {
      ASSERT_NEAR(got.data<float>()[j], want.data<float>()[j], 1e-4)
          << "call " << i << " elem " << j;
    }
  }
}

TEST(MatmulEngineProbe, BothRealEnginesPass) {
  const fast::MatmulTrust t =
      fast::probe_matmul_engines(kernels("reference"), MatmulEngineFault::none);
  EXPECT_TRUE(t.onednn) << t.onednn_reason;
  EXPECT_TRUE(t.openblas) << t.openblas_reason;
  auto fast = make_fast_backend(kernels("reference"));
  EXPECT_TRUE(fast->engine_report().dropped.empty());
  EXPECT_FALSE(fast->engine_report().blas_core.empty());
}

TEST(MatmulEngineProbe, AWrongOpenBlasIsDroppedAndOneDnnServesEveryCall) {
  FastBackendOptions o;
  o.faulty_engine_for_testing = MatmulEngineFault::openblas;
  auto fast = make_fast_backend(kernels("reference"), o);
  const EngineReport r = fast->engine_report();
  ASSERT_EQ(r.dropped.size(), 1u);
  EXPECT_EQ(r.dropped[0].first, "openblas");
  EXPECT_NE(r.dropped[0].second.find("the reference backend gives"), std::string::npos)
      << r.dropped[0].second;
  // The faulty engine would be off by one in the middle element; every call is right.
  expect_matches_reference(*fast, {33, 20}, {20, 17}, {33, 17}, {});
  expect_matches_reference(*fast, {2, 9, 12}, {2, 10, 12}, {2, 9, 10}, {false, true, 1.0f, 0.0f});
  for (const auto& [sig, engine] : fast->engine_report().matmul) EXPECT_EQ(engine, "onednn") << sig;
}

TEST(MatmulEngineProbe, AWrongOneDnnIsDroppedAndBf16StillComputesRight) {
  FastBackendOptions o;
  o.faulty_engine_for_testing = MatmulEngineFault::onednn;
  auto fast = make_fast_backend(kernels("reference"), o);
  const EngineReport r = fast->engine_report();
  ASSERT_EQ(r.dropped.size(), 1u);
  EXPECT_EQ(r.dropped[0].first, "onednn");
  expect_matches_reference(*fast, {33, 20}, {20, 17}, {33, 17}, {false, false, 0.5f, 0.0f});
  for (const auto& [sig, engine] : fast->engine_report().matmul)
    EXPECT_EQ(engine, "openblas") << sig;
  // bf16 inputs widen to f32 (OpenBLAS) instead of trusting oneDNN.
  Tensor a = Tensor::empty({8, 6}, DType::bf16), b = Tensor::empty({6, 5}, DType::bf16);
  KernelBackend& ref = kernels("reference");
  ref.cast(ramp({8, 6}, 1.0f), a);
  ref.cast(ramp({6, 5}, 1.0f), b);
  Tensor got = Tensor::zeros({8, 5}, DType::f32), want = Tensor::zeros({8, 5}, DType::f32);
  fast->matmul(a, b, got, {});
  ref.matmul(a, b, want, {});
  for (int64_t j = 0; j < got.numel(); ++j) {
    EXPECT_NEAR(got.data<float>()[j], want.data<float>()[j], 1e-4) << j;
  }
}

TEST(MatmulEngineProbe, PinningADroppedEngineIsAConfigErrorNamingTheKeyAndTheCase) {
  FastBackendOptions o;
  o.f32_matmul = MatmulEngineChoice::openblas;
  o.faulty_engine_for_testing = MatmulEngineFault::openblas;
  try {
    make_fast_backend(kernels("reference"), o);
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("exec.matmul = openblas"), std::string::npos) << msg;
    EXPECT_NE(msg.find("failed the correctness probe"), std::string::npos) << msg;
    EXPECT_NE(msg.find("M="), std::string::npos) << msg;
  }
  // Pinning the healthy one works.
  o.f32_matmul = MatmulEngineChoice::onednn;
  EXPECT_NO_THROW(make_fast_backend(kernels("reference"), o));
}

CpuInfo cpu_with(bool avx2, bool avx512) {
  CpuInfo c;
  c.vendor = "GenuineIntel";
  c.fma = avx2;
  c.avx2 = avx2;
  c.avx512 = avx512;
  return c;
}

// Where the thread CPU clock advances only at the scheduler's tick, a short
// trial read 0 s on it (train.precision = "auto" then priced the bf16 casts
// at nothing); the trial clock falls back to the wall clock there.
TEST(TrialClock, SeesATrialOfFiftyMicroseconds) {
  for (int threads : {1, 2}) {
    const double t0 = trial_clock_s(threads);
    const int64_t until = now_ns() + 50'000;
    while (now_ns() < until) {
    }
    const double t = trial_clock_s(threads) - t0;
    EXPECT_GT(t, 0.0) << threads
                      << " thread(s); thread CPU clock fine: " << thread_cpu_clock_is_fine();
    EXPECT_LT(t, 1.0) << threads << " thread(s)";
  }
}

TEST(OpenBlasCoretype, LevelsOfKnownCoreTypes) {
  EXPECT_EQ(openblas_core_level("Prescott"), 0);
  EXPECT_EQ(openblas_core_level("Sandybridge"), 1);
  EXPECT_EQ(openblas_core_level("Haswell"), 2);
  EXPECT_EQ(openblas_core_level("ZEN"), 2);
  EXPECT_EQ(openblas_core_level("SkylakeX"), 3);
  EXPECT_EQ(openblas_core_level("Cooperlake"), 3);
  EXPECT_EQ(openblas_core_level("Nonsense"), -1);
  EXPECT_EQ(best_openblas_coretype(cpu_with(true, true)), "SkylakeX");
  EXPECT_EQ(best_openblas_coretype(cpu_with(true, false)), "Haswell");
  EXPECT_EQ(best_openblas_coretype(cpu_with(false, false)), "");
}

TEST(OpenBlasCoretype, AdviceFixesMisdetectionButKeepsTheEnvironmentsChoice) {
  const CpuInfo avx512 = cpu_with(true, true);
  // OpenBLAS fell back to a generic kernel on its own: restart with SkylakeX.
  CoretypeAdvice a = advise_openblas_coretype("auto", avx512, "Prescott", nullptr, false);
  EXPECT_EQ(a.set_to, "SkylakeX");
  EXPECT_NE(a.note.find("restarting with OPENBLAS_CORETYPE=SkylakeX"), std::string::npos) << a.note;
  // A lesser AVX2 kernel on an AVX-512 CPU too.
  EXPECT_EQ(advise_openblas_coretype("auto", avx512, "Haswell", nullptr, false).set_to, "SkylakeX");
  // Already the best: nothing to do.
  a = advise_openblas_coretype("auto", avx512, "Cooperlake", nullptr, false);
  EXPECT_EQ(a.set_to, "");
  EXPECT_EQ(a.note, "");
  // The environment chose (some sites do, for OpenBLAS builds that compute
  // wrong results on their CPU): kept under auto, with a note; overridden by best.
  a = advise_openblas_coretype("auto", avx512, "Haswell", "Haswell", false);
  EXPECT_EQ(a.set_to, "");
  EXPECT_NE(a.note.find("OPENBLAS_CORETYPE=Haswell is set in the environment"), std::string::npos)
      << a.note;
  EXPECT_EQ(advise_openblas_coretype("best", avx512, "Haswell", "Haswell", false).set_to,
            "SkylakeX");
  // keep never changes anything; a re-executed process never loops.
  EXPECT_EQ(advise_openblas_coretype("keep", avx512, "Prescott", nullptr, false).set_to, "");
  EXPECT_EQ(advise_openblas_coretype("auto", avx512, "Prescott", nullptr, true).set_to, "");
  // An AVX2-only CPU on Haswell kernels is fine; on Prescott it gets Haswell.
  EXPECT_EQ(
      advise_openblas_coretype("auto", cpu_with(true, false), "Haswell", nullptr, false).set_to,
      "");
  EXPECT_EQ(
      advise_openblas_coretype("auto", cpu_with(true, false), "Prescott", nullptr, false).set_to,
      "Haswell");
  // An environment's core type the CPU cannot run (OpenBLAS does not check
  // it; its first GEMM would raise SIGILL) is replaced under auto and best,
  // kept under keep.
  for (const char* policy : {"auto", "best"}) {
    a = advise_openblas_coretype(policy, cpu_with(true, false), "SkylakeX", "SkylakeX", false);
    EXPECT_EQ(a.set_to, "Haswell") << policy;
    EXPECT_NE(a.note.find("asks for kernels this CPU cannot run"), std::string::npos) << a.note;
    EXPECT_EQ(advise_openblas_coretype(policy, cpu_with(false, false), "Haswell", "Haswell", false)
                  .set_to,
              "Prescott");
  }
  EXPECT_EQ(
      advise_openblas_coretype("keep", cpu_with(true, false), "SkylakeX", "SkylakeX", false).set_to,
      "");
  // OpenBLAS's own choice above the cpuid view is its business (no restart).
  EXPECT_EQ(
      advise_openblas_coretype("auto", cpu_with(true, false), "SkylakeX", nullptr, false).set_to,
      "");
  // An unknown (maybe newer) name is left alone under auto.
  EXPECT_EQ(advise_openblas_coretype("auto", avx512, "Graniterapids", nullptr, false).set_to, "");
}

TEST(MachineInfo, CpuidAgreesWithTheCompilersView) {
  const CpuInfo& c = cpu_info();
  EXPECT_FALSE(c.vendor.empty());
  __builtin_cpu_init();
  EXPECT_EQ(c.avx2, __builtin_cpu_supports("avx2") != 0);
  EXPECT_EQ(c.avx512, __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"));
  EXPECT_EQ(c.isa_flags().find("avx512") != std::string::npos, c.avx512);
  EXPECT_FALSE(onednn_isa().empty());
  EXPECT_NE(onednn_isa(), "unknown");
  // oneDNN uses AMX only where cpuid says the CPU and the OS have it.
  if (onednn_isa() == "avx512_core_amx") {
    EXPECT_TRUE(c.amx);
  }
  EXPECT_FALSE(openblas_corename().empty());
}

}  // namespace
}  // namespace mt
