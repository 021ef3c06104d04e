// CPU identification (cpuid / xgetbv), oneDNN's ISA, OpenBLAS's core type and
// the start-up advice about it (see machine.h).
#include "meshtrain/tensor/machine.h"

#include <cblas.h>
#include <cpuid.h>

#include <oneapi/dnnl/dnnl.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include <fmt/format.h>

namespace mt {

namespace {

struct Regs {
  unsigned a = 0, b = 0, c = 0, d = 0;
};

Regs cpuid(unsigned leaf, unsigned sub = 0) {
  Regs r;
  if (__get_cpuid_max(leaf & 0x80000000u, nullptr) < leaf) return r;
  __cpuid_count(leaf, sub, r.a, r.b, r.c, r.d);
  return r;
}

bool bit(unsigned v, int i) {
  return ((v >> i) & 1u) != 0;
}

// XCR0: which register states the OS saves (AVX needs bits 1-2, AVX-512
// bits 5-7, AMX tiles 17-18).
uint64_t xcr0() {
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

CpuInfo detect() {
  CpuInfo c;
  const Regs r0 = cpuid(0);
  char vendor[13] = {};
  std::memcpy(vendor, &r0.b, 4);
  std::memcpy(vendor + 4, &r0.d, 4);
  std::memcpy(vendor + 8, &r0.c, 4);
  c.vendor = vendor;
  if (cpuid(0x80000000u).a >= 0x80000004u) {
    std::array<char, 49> brand{};
    for (unsigned i = 0; i < 3; ++i) {
      const Regs r = cpuid(0x80000002u + i);
      std::memcpy(brand.data() + 16 * i, &r, 16);
    }
    std::string s = brand.data();
    const auto first = s.find_first_not_of(' ');
    const auto last = s.find_last_not_of(' ');
    c.model = first == std::string::npos ? "" : s.substr(first, last - first + 1);
  }
  const Regs r1 = cpuid(1);
  const unsigned base_family = (r1.a >> 8) & 0xf;
  c.family =
      static_cast<int>(base_family == 0xf ? base_family + ((r1.a >> 20) & 0xff) : base_family);
  const unsigned base_model = (r1.a >> 4) & 0xf;
  c.model_number =
      static_cast<int>(base_family >= 6 ? base_model | (((r1.a >> 16) & 0xf) << 4) : base_model);
  const bool osxsave = bit(r1.c, 27);
  const uint64_t x = osxsave ? xcr0() : 0;
  const bool ymm = (x & 0x6) == 0x6;
  const bool zmm = ymm && (x & 0xe0) == 0xe0;
  const bool tiles = (x & 0x60000) == 0x60000;
  const Regs r7 = cpuid(7, 0);
  const Regs r71 = cpuid(7, 1);
  c.fma = ymm && bit(r1.c, 12);
  c.avx2 = ymm && bit(r7.b, 5);
  // AVX-512 F, DQ, BW, VL.
  c.avx512 = zmm && bit(r7.b, 16) && bit(r7.b, 17) && bit(r7.b, 30) && bit(r7.b, 31);
  c.avx512_bf16 = c.avx512 && bit(r71.a, 5);
  // AMX-BF16 (EDX 22) and AMX-TILE (EDX 24). Linux also wants a permission
  // request before the first tile instruction; oneDNN makes it.
  c.amx = tiles && bit(r7.d, 22) && bit(r7.d, 24);
  return c;
}

std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char ch) { return static_cast<char>(std::tolower(ch)); });
  return out;
}

}  // namespace

std::string CpuInfo::isa_flags() const {
  std::string s;
  auto add = [&](bool on, const char* name) {
    if (!on) return;
    if (!s.empty()) s += ',';
    s += name;
  };
  add(avx2, "avx2");
  add(fma, "fma");
  add(avx512, "avx512");
  add(avx512_bf16, "avx512_bf16");
  add(amx, "amx");
  return s;
}

std::string CpuInfo::describe() const {
  return fmt::format("{} {} (family {}, model {})", vendor, model, family, model_number);
}

const CpuInfo& cpu_info() {
  static const CpuInfo info = detect();
  return info;
}

std::string onednn_isa() {
  switch (dnnl::get_effective_cpu_isa()) {
    case dnnl::cpu_isa::sse41:
      return "sse41";
    case dnnl::cpu_isa::avx:
      return "avx";
    case dnnl::cpu_isa::avx2:
      return "avx2";
    case dnnl::cpu_isa::avx2_vnni:
      return "avx2_vnni";
    case dnnl::cpu_isa::avx512_mic:
      return "avx512_mic";
    case dnnl::cpu_isa::avx512_mic_4ops:
      return "avx512_mic_4ops";
    case dnnl::cpu_isa::avx512_core:
      return "avx512_core";
    case dnnl::cpu_isa::avx512_core_vnni:
      return "avx512_core_vnni";
    case dnnl::cpu_isa::avx512_core_bf16:
      return "avx512_core_bf16";
    case dnnl::cpu_isa::avx512_core_amx:
      return "avx512_core_amx";
    default:
      return "unknown";
  }
}

std::string openblas_corename() {
  const char* name = openblas_get_corename();
  return name ? std::string(name) : std::string("unknown");
}

int openblas_core_level(std::string_view corename) {
  const std::string n = lower(corename);
  for (const char* k : {"skylakex", "cooperlake", "sapphirerapids"}) {
    if (n == k) return 3;
  }
  for (const char* k : {"haswell", "zen"}) {
    if (n == k) return 2;
  }
  for (const char* k : {"sandybridge", "bulldozer", "piledriver", "steamroller", "excavator"}) {
    if (n == k) return 1;
  }
  for (const char* k : {"prescott", "core2", "penryn", "dunnington", "nehalem", "atom", "barcelona",
                        "bobcat", "opteron", "opteron_sse3", "katmai", "coppermine", "northwood",
                        "athlon", "generic", "nano"}) {
    if (n == k) return 0;
  }
  return -1;
}

int cpu_blas_level(const CpuInfo& cpu) {
  if (cpu.avx512 && cpu.fma) return 3;
  if (cpu.avx2 && cpu.fma) return 2;
  return 0;
}

std::string best_openblas_coretype(const CpuInfo& cpu) {
  switch (cpu_blas_level(cpu)) {
    case 3:
      return "SkylakeX";
    case 2:
      return "Haswell";
    default:
      return "";
  }
}

CoretypeAdvice advise_openblas_coretype(std::string_view policy, const CpuInfo& cpu,
                                        std::string_view corename, const char* env_coretype,
                                        bool already_reexecuted) {
  CoretypeAdvice a;
  const int have = openblas_core_level(corename);
  const int can = cpu_blas_level(cpu);
  const std::string best = best_openblas_coretype(cpu);
  if (already_reexecuted) return a;  // the re-executed process keeps what it got
  if (policy == "keep") return a;
  const bool from_env = env_coretype != nullptr && *env_coretype != '\0';
  if (from_env && have > can) {
    // OpenBLAS takes a forced core type without checking the CPU (0.3.21's
    // force_coretype), so its first GEMM would die on an illegal
    // instruction: the environment's choice cannot win here.
    a.set_to = best.empty() ? std::string("Prescott") : best;
    a.note = fmt::format(
        "OPENBLAS_CORETYPE={} in the environment asks for kernels this CPU cannot run (it has "
        "{}): restarting with OPENBLAS_CORETYPE={}",
        env_coretype,
        cpu.isa_flags().empty() ? std::string("none of AVX2, AVX-512") : cpu.isa_flags(), a.set_to);
    return a;
  }
  if (have >= can || best.empty()) return a;
  const std::string what = have < 0
                               ? fmt::format("'{}' (a core type meshtrain does not know)", corename)
                               : fmt::format("{} kernels", corename);
  if (env_coretype != nullptr && *env_coretype != '\0' && policy != "best") {
    a.note = fmt::format(
        "OpenBLAS runs {} (OPENBLAS_CORETYPE={} is set in the environment) on a CPU with {}; "
        "left as set (exec.openblas_coretype = \"best\" asks for {}); the f32 engine choice "
        "times oneDNN against it",
        what, env_coretype, cpu.isa_flags(), best);
    return a;
  }
  if (have < 0 && policy != "best") return a;  // an unknown name may be newer than our table
  a.set_to = best;
  a.note = fmt::format(
      "OpenBLAS {} {}{} on a CPU with {}: restarting with OPENBLAS_CORETYPE={}",
      from_env ? "runs" : "chose", what,
      from_env ? fmt::format(" (OPENBLAS_CORETYPE={} from the environment)", env_coretype)
               : std::string(),
      cpu.isa_flags(), best);
  return a;
}

std::string openblas_core_description() {
  std::string s = openblas_corename();
  if (const char* from = std::getenv(kCoretypeReexecVar); from != nullptr && *from != '\0') {
    s += fmt::format(" (re-executed with OPENBLAS_CORETYPE; OpenBLAS had chosen {})", from);
  } else if (const char* env = std::getenv("OPENBLAS_CORETYPE"); env != nullptr && *env != '\0') {
    s += fmt::format(" (OPENBLAS_CORETYPE={} from the environment)", env);
  }
  return s;
}

}  // namespace mt
