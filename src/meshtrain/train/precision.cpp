// The start-up precision decision (see precision.h).
#include "meshtrain/train/precision.h"

#include <algorithm>
#include <map>
#include <memory>
#include <tuple>

#include <fmt/format.h>

#include "meshtrain/base/error.h"
#include "meshtrain/base/timer.h"
#include "meshtrain/tensor/backends/fast/fast_backend.h"
#include "meshtrain/tensor/kernels.h"
#include "meshtrain/tensor/machine.h"

namespace mt {

namespace {

Tensor filled(const Shape& s, DType t, float v) {
  Tensor x = Tensor::full(s, DType::f32, v);
  if (t == DType::f32) return x;
  Tensor y = Tensor::empty(s, t);
  convert(x, y);
  return y;
}

// Best of three warm calls, in seconds.
double time_matmul(KernelBackend& k, const MatmulUse& u, DType t, int threads) {
  const Tensor a = filled(u.a, t, 0.5f), b = filled(u.b, t, 0.25f);
  Tensor c = Tensor::empty(u.c, DType::f32);
  const MatmulParams p{u.trans_a, u.trans_b, 1.0f, 0.0f};
  k.matmul(a, b, c, p);  // primitive creation, first touch
  double best = 1e300;
  for (int i = 0; i < 3; ++i) {
    const double t0 = trial_clock_s(threads);
    k.matmul(a, b, c, p);
    best = std::min(best, trial_clock_s(threads) - t0);
  }
  return std::max(best, 1e-9);
}

// One step's bf16 stash casts: every value f32 -> bf16, then every one back
// (as the step runs them: the stash leaves the cache between the two when it
// is larger than the cache). Best of three rounds after a warm one, in
// seconds. Past kMaxTimed elements (80 MiB of buffers: far past any cache,
// yet small beside a model whose memory is the question) a prefix is timed
// and scaled.
double time_stash_casts(KernelBackend& k, const std::vector<int64_t>& sizes, int threads) {
  constexpr int64_t kMaxTimed = int64_t{8} << 20;
  std::vector<Tensor> x, low, back;
  int64_t total = 0, timed = 0;
  for (int64_t n : sizes) {
    total += n;
    if (timed + n > kMaxTimed && timed > 0) continue;
    n = std::min(n, kMaxTimed);
    timed += n;
    x.push_back(Tensor::full({n}, DType::f32, 0.3f));
    low.push_back(Tensor::empty({n}, DType::bf16));
    back.push_back(Tensor::empty({n}, DType::f32));
  }
  if (timed == 0) return 0.0;
  double best = 1e300;
  for (int round = 0; round < 4; ++round) {
    const double t0 = trial_clock_s(threads);
    for (size_t i = 0; i < x.size(); ++i) k.cast(x[i], low[i]);
    for (size_t i = 0; i < x.size(); ++i) k.cast(low[i], back[i]);
    if (round > 0) best = std::min(best, trial_clock_s(threads) - t0);
  }
  return std::max(best, 1e-9) * static_cast<double>(total) / static_cast<double>(timed);
}

// Whether AMX did the bf16 work, for the rates line.
std::string amx_note(const PrecisionDecision& d) {
  if (d.amx) return ", AMX";
  if (d.cpu_amx) return ", AMX on the CPU but not used by oneDNN";
  return ", no AMX on this CPU";
}

}  // namespace

std::vector<MatmulUse> matmul_uses(const Graph& g) {
  std::map<std::tuple<std::vector<int64_t>, std::vector<int64_t>, bool, bool>, MatmulUse> uses;
  for (const Node& n : g.nodes()) {
    if (n.op != OpKind::matmul) continue;
    const Value& a = g.value(n.inputs[0]);
    const Value& b = g.value(n.inputs[1]);
    const Value& c = g.value(n.outputs[0]);
    const bool ta = n.attrs.b_or("trans_a", false), tb = n.attrs.b_or("trans_b", false);
    MatmulUse& u = uses[{a.shape.dims(), b.shape.dims(), ta, tb}];
    if (u.calls == 0) {
      u.a = a.shape;
      u.b = b.shape;
      u.c = c.shape;
      u.trans_a = ta;
      u.trans_b = tb;
      const int64_t k = ta ? a.shape[-2] : a.shape[-1];
      u.flops = 2.0 * static_cast<double>(c.shape.numel()) * static_cast<double>(k);
    }
    ++u.calls;
  }
  std::vector<MatmulUse> out;
  for (auto& [key, u] : uses) out.push_back(std::move(u));
  return out;
}

std::string PrecisionDecision::mode() const {
  return bf16_storage ? std::string("bf16_storage") : std::string(dtype_name(chosen));
}

void apply_precision_policy(PrecisionDecision& d) {
  d.bf16_storage = false;
  const double r = d.bf16_over_f32();
  const std::string rates =
      d.measured ? fmt::format(
                       "bf16 matmuls run at {:.2f}x f32 on this model's shapes ({:.1f} vs "
                       "{:.1f} GFLOP/s, oneDNN {}{})",
                       r, d.bf16_gflops, d.f32_gflops, d.isa, amx_note(d))
                 : std::string();
  if (d.requested == "auto" && !d.measured) {
    d.chosen = DType::f32;
    d.reason =
        "train.precision = \"auto\" chose f32: nothing measured (no matmuls, or not the "
        "fast backend)";
  } else if (d.requested == "bf16_storage") {
    d.chosen = DType::f32;
    d.bf16_storage = true;
    d.reason =
        "bf16_storage as configured: f32 compute, the activations the backward reads "
        "stored in bf16";
  } else if (d.requested == "f32" || d.requested == "f16") {
    d.chosen = d.requested == "f32" ? DType::f32 : DType::f16;
    d.reason = fmt::format("{} as configured", d.requested);
  } else if (d.requested == "bf16") {
    d.chosen = DType::bf16;
    d.reason = !d.measured ? std::string("bf16 as configured")
               : r < 1.0   ? fmt::format(
                                 "warning: {}: bf16 as configured is slower than f32 here "
                                   "(train.precision = \"auto\" would keep matmuls in f32)",
                                 rates)
                         : fmt::format("bf16 as configured; {}", rates);
  } else if (d.requested == "auto") {
    if (r >= PrecisionDecision::kMinGain) {
      d.chosen = DType::bf16;
      d.reason = fmt::format("train.precision = \"auto\" chose bf16: {}", rates);
    } else {
      d.chosen = DType::f32;
      const std::string why_f32 =
          fmt::format("{}, below the {:.2f}x that pays for the casts, so matmuls stay f32", rates,
                      PrecisionDecision::kMinGain);
      const std::string grads =
          "gradients are sent in f32 (sync.codec = \"bf16\" compresses them on request)";
      const double cost = d.storage_cost();
      if (d.stash_elements > 0 && d.storage_needed_to_fit()) {
        d.bf16_storage = true;
        d.reason = fmt::format(
            "train.precision = \"auto\" chose bf16_storage: {}; the f32 run's planned memory "
            "{:.1f} MiB exceeds this rank's {:.1f} MiB and with the activations the backward "
            "reads stored in bf16 it fits ({:.1f} MiB), though its casts cost {:.1f}% of the "
            "step's f32 matmul time; {}",
            why_f32, static_cast<double>(d.f32_plan_bytes) / (1 << 20),
            static_cast<double>(d.memory_limit) / (1 << 20),
            static_cast<double>(d.storage_plan_bytes) / (1 << 20), 100 * cost, grads);
      } else if (d.stash_elements > 0 && d.f32_matmul_s > 0 &&
                 cost <= PrecisionDecision::kMaxStorageCost) {
        d.bf16_storage = true;
        d.reason = fmt::format(
            "train.precision = \"auto\" chose bf16_storage: {}; the {:.2f} M activation values "
            "the backward reads are stored in bf16, whose casts cost {:.1f}% of the step's f32 "
            "matmul time (at most {:.0f}% pays); {}",
            why_f32, static_cast<double>(d.stash_elements) * 1e-6, 100 * cost,
            100 * PrecisionDecision::kMaxStorageCost, grads);
      } else {
        const std::string storage =
            d.stash_elements == 0
                ? std::string(
                      "bf16 activation storage would not lower the planned activation "
                      "peak (no stashed value large enough, or the backward widens them "
                      "again at the peak)")
                : fmt::format(
                      "bf16 activation storage would cost {:.1f}% of the step's f32 matmul time "
                      "in casts (more than the {:.0f}% that pays), so activations stay f32",
                      100 * cost, 100 * PrecisionDecision::kMaxStorageCost);
        d.reason = fmt::format("train.precision = \"auto\" chose f32: {}; {}; {}", why_f32, storage,
                               grads);
      }
    }
  } else {
    throw ConfigError(fmt::format(
        "train.precision: expected f32, bf16, f16, bf16_storage or auto, got {}", d.requested));
  }
}

PrecisionDecision decide_precision(const std::string& requested, const std::vector<MatmulUse>& uses,
                                   const std::string& backend, const FastBackendOptions& fast,
                                   double bf16_rate_factor_for_testing,
                                   const std::vector<int64_t>& stash_sizes,
                                   double storage_cost_factor_for_testing) {
  PrecisionDecision d;
  d.requested = requested;
  d.isa = onednn_isa();
  d.cpu_amx = cpu_info().amx;
  d.amx = d.cpu_amx && d.isa == "avx512_core_amx";
  if ((requested == "bf16" || requested == "auto") && backend == "fast") {
    // A private instance, so the training backend's engine choices and its
    // report list only what training runs; one thread, timed in the thread's
    // CPU time, so neighbours on a shared machine do not skew the ratio (the
    // ratio is a property of the core: FMA ports for bf16 vs f32).
    const std::unique_ptr<KernelBackend> owned = make_fast_backend(kernels("reference"), fast);
    KernelBackend& k = *owned;
    const int threads = 1;
    const double t0 = trial_clock_s(0);
    double flops = 0, f32_s = 0, bf16_s = 0;
    for (const MatmulUse& u : uses) {
      const auto calls = static_cast<double>(u.calls);
      flops += u.flops * calls;
      f32_s += time_matmul(k, u, DType::f32, threads) * calls;
      bf16_s += time_matmul(k, u, DType::bf16, threads) * calls;
    }
    if (flops > 0) {
      d.measured = true;
      d.f32_gflops = flops / f32_s * 1e-9;
      d.bf16_gflops = flops / bf16_s * 1e-9 * bf16_rate_factor_for_testing;
      d.f32_matmul_s = f32_s;
    }
    // The bf16 stash's casts, as the step runs them: f32 -> bf16 after the
    // forward, bf16 -> f32 before the backward, each value once.
    if (requested == "auto" && d.measured && d.bf16_over_f32() < PrecisionDecision::kMinGain) {
      for (int64_t n : stash_sizes) d.stash_elements += n;
      d.storage_cast_s =
          time_stash_casts(k, stash_sizes, threads) * storage_cost_factor_for_testing;
    }
    d.seconds = trial_clock_s(0) - t0;
  }
  apply_precision_policy(d);
  return d;
}

void follow_rank0_precision(Communicator& comm, PrecisionDecision& d) {
  Tensor t = Tensor::empty({11}, DType::f64);
  double* v = t.data<double>();
  v[0] = d.chosen == DType::bf16 ? 1.0 : 0.0;
  v[1] = d.f32_gflops;
  v[2] = d.bf16_gflops;
  v[3] = d.measured ? 1.0 : 0.0;
  v[4] = d.bf16_storage ? 1.0 : 0.0;
  v[5] = static_cast<double>(d.stash_elements);
  v[6] = d.f32_matmul_s;
  v[7] = d.storage_cast_s;
  v[8] = static_cast<double>(d.memory_limit);
  v[9] = static_cast<double>(d.f32_plan_bytes);
  v[10] = static_cast<double>(d.storage_plan_bytes);
  comm.broadcast(t, 0);
  d.memory_limit = static_cast<int64_t>(v[8]);
  d.f32_plan_bytes = static_cast<int64_t>(v[9]);
  d.storage_plan_bytes = static_cast<int64_t>(v[10]);
  d.measured = v[3] != 0.0;
  d.f32_gflops = v[1];
  d.bf16_gflops = v[2];
  d.stash_elements = static_cast<int64_t>(v[5]);
  d.f32_matmul_s = v[6];
  d.storage_cast_s = v[7];
  apply_precision_policy(d);
  d.chosen = v[0] != 0.0 ? DType::bf16 : DType::f32;
  d.bf16_storage = v[4] != 0.0;
}

}  // namespace mt
