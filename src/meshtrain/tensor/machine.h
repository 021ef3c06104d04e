// What this CPU is and what the math libraries make of it (the caller's
// header): vendor, model name and the ISA flags that decide GEMM speed
// (AVX2, AVX-512, AVX512_BF16, AMX) from cpuid, oneDNN's effective ISA, and
// the kernel family ("core type") OpenBLAS chose. Benchmarks, logs and the
// metrics summary name the machine with these; main() uses
// advise_openblas_coretype() to re-execute itself when OpenBLAS chose kernels
// below what the CPU runs (Debian's OpenBLAS 0.3.21 does not know CPUs newer
// than it and falls back to a lesser or generic kernel).
//
// All functions are cheap after their first call and safe from any thread.
#pragma once

#include <string>
#include <string_view>

namespace mt {

struct CpuInfo {
  std::string vendor;  // "GenuineIntel", "AuthenticAMD", ...
  std::string model;   // the brand string, e.g. "AMD EPYC 9B45"
  int family = 0, model_number = 0;
  // Usable: the CPU has the instructions and the OS saves their registers.
  bool avx2 = false, fma = false;
  bool avx512 = false;  // AVX-512 F, BW, DQ and VL (what SkylakeX kernels need)
  bool avx512_bf16 = false;
  bool amx = false;  // AMX-TILE and AMX-BF16 (Sapphire Rapids and later)
  // "avx2,fma,avx512,avx512_bf16" -- the flags above that hold, comma-separated.
  std::string isa_flags() const;
  // "AuthenticAMD AMD EPYC 9B45 (family 26, model 2)": virtual machines often
  // shorten the brand string, so family and model say which core it is.
  std::string describe() const;
};

// This machine's CPU (cpuid, read once).
const CpuInfo& cpu_info();

// oneDNN's effective ISA, e.g. "avx512_core_bf16" or "avx512_core_amx".
std::string onednn_isa();

// The OpenBLAS kernel family in use ("Haswell", "SkylakeX", "Prescott", ...).
std::string openblas_corename();

// How far an OpenBLAS core type's kernels go: 0 generic / SSE, 1 AVX,
// 2 AVX2, 3 AVX-512; -1 for a name this table does not know.
int openblas_core_level(std::string_view corename);

// The level the CPU supports (same scale) and the core type meshtrain would
// ask OpenBLAS for at that level ("SkylakeX", "Haswell", "" below AVX2).
int cpu_blas_level(const CpuInfo& cpu);
std::string best_openblas_coretype(const CpuInfo& cpu);

// What to do about OpenBLAS's core type at start-up.
//   policy "auto": fix OpenBLAS's own misdetection (no OPENBLAS_CORETYPE in
//                  the environment); an environment's choice is kept (some
//                  sites set it because old OpenBLAS builds compute wrong
//                  results on their CPU);
//          "best": the CPU's best core type even over the environment's;
//          "keep": never change anything.
// Under auto and best, an environment's core type that needs instructions
// the CPU lacks (SkylakeX on an AVX2-only CPU) is replaced too: OpenBLAS
// does not check a forced core type, and its first GEMM would die on an
// illegal instruction.
// env_coretype: the environment's OPENBLAS_CORETYPE (nullptr if unset);
// already_reexecuted: this process is the re-executed one (never loop).
// The matmul engine's correctness probe still checks whatever runs: an
// OpenBLAS that computes wrong results is dropped, not trusted.
struct CoretypeAdvice {
  std::string set_to;  // non-empty: re-execute with OPENBLAS_CORETYPE=set_to
  std::string note;    // one line for the log; empty when nothing is worth saying
};
CoretypeAdvice advise_openblas_coretype(std::string_view policy, const CpuInfo& cpu,
                                        std::string_view corename, const char* env_coretype,
                                        bool already_reexecuted);

// The environment variable that marks a re-executed process; its value is
// the core type OpenBLAS had chosen before (for the log).
inline constexpr const char* kCoretypeReexecVar = "MESHTRAIN_OPENBLAS_REEXEC_FROM";

// The OpenBLAS line for logs and the metrics summary: the core in use and,
// after a re-execution, which one OpenBLAS had chosen by itself.
std::string openblas_core_description();

}  // namespace mt
