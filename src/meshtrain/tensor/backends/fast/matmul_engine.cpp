// Fast matmul: validation, the per-signature engine choice and the two
// engines (see matmul_engine.h for the policy).
#include "meshtrain/tensor/backends/fast/matmul_engine.h"

#include <cblas.h>

#include <bit>
#include <climits>
#include <cmath>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/base/timer.h"
#include "meshtrain/tensor/backends/fast/fast_common.h"
#include "meshtrain/tensor/backends/fast/fast_kernels.h"

namespace mt::fast {

namespace {

using dnnl::memory;

bool is_half(DType t) {
  return t == DType::bf16 || t == DType::f16;
}

memory::data_type dnnl_type(DType t) {
  switch (t) {
    case DType::f32:
      return memory::data_type::f32;
    case DType::bf16:
      return memory::data_type::bf16;
    case DType::f16:
      return memory::data_type::f16;
    default:
      MT_CHECK(false, "matmul: no oneDNN type for {}", dtype_name(t));
  }
  return memory::data_type::undef;
}

// A row-major matrix (or batch of them) of logical shape [rows, cols] stored
// transposed when `trans`; `batch` 0 means rank 2, and a shared operand is a
// batch of 1 broadcast by oneDNN.
memory::desc operand_desc(int64_t batch, int64_t rows, int64_t cols, bool trans,
                          memory::data_type t) {
  const memory::dims s2 = trans ? memory::dims{1, rows} : memory::dims{cols, 1};
  if (batch == 0) return memory::desc({rows, cols}, t, s2);
  return memory::desc({batch, rows, cols}, t, {rows * cols, s2[0], s2[1]});
}

// An f32 copy of a 16-bit operand, through the vectorised casts.
Tensor widened(const Tensor& t, int threads) {
  Tensor w = Tensor::empty(t.shape(), DType::f32);
  if (!cast(t, w, threads)) convert(t, w);
  return w;
}

}  // namespace

MatmulEngine::MatmulEngine(OneDnnContext& ctx, MatmulEngineChoice f32_choice, MatmulTrust trust,
                           MatmulEngineFault fault)
    : ctx_(ctx), f32_choice_(f32_choice), trust_(std::move(trust)), fault_(fault) {
  // The backend refuses to pin a dropped engine (ConfigError) before this.
  MT_CHECK(trust_.onednn || trust_.openblas, "matmul: no trusted f32 engine");
  MT_CHECK(f32_choice_ != MatmulEngineChoice::onednn || trust_.onednn,
           "matmul: oneDNN pinned but dropped");
  MT_CHECK(f32_choice_ != MatmulEngineChoice::openblas || trust_.openblas,
           "matmul: OpenBLAS pinned but dropped");
}

void MatmulEngine::inject_fault(Engine e, Tensor& c) const {
  const bool hit = (fault_ == MatmulEngineFault::onednn && e == Engine::onednn) ||
                   (fault_ == MatmulEngineFault::openblas && e == Engine::openblas);
  if (hit && c.numel() > 0) c.data<float>()[c.numel() / 2] += 1.0f;
}

MatmulEngine::~MatmulEngine() = default;

bool MatmulEngine::supports(const Tensor& a, const Tensor& b, const Tensor& c) {
  if (!a.defined() || !b.defined() || !c.defined()) return false;
  if (a.dtype() != b.dtype()) return false;
  // f32 x f32 -> f32; 16-bit x 16-bit -> f32, or -> the same 16-bit type
  // (accumulated in f32, rounded once).
  if (a.dtype() == DType::f32) return c.dtype() == DType::f32;
  return is_half(a.dtype()) && (c.dtype() == DType::f32 || c.dtype() == a.dtype());
}

void MatmulEngine::fold_batch(Dims& d, const MatmulParams& p) {
  if (d.shared_b && !p.trans_a) {  // [B,M,K] @ [K,N] is one [B*M,K] @ [K,N]
    d.m *= d.batch;
    d.batch = 1;
  }
  if (d.batch == 1) d.shared_b = false;
}

MatmulEngine::Key MatmulEngine::key_of(DType in, DType out, const Dims& d, const MatmulParams& p,
                                       int threads) {
  return Key{in,
             out,
             d.batch,
             d.m,
             d.n,
             d.k,
             d.shared_b,
             p.trans_a,
             p.trans_b,
             std::bit_cast<uint32_t>(p.alpha),
             std::bit_cast<uint32_t>(p.beta),
             threads};
}

void MatmulEngine::run(const Tensor& a, const Tensor& b, Tensor& c, const MatmulParams& p,
                       int threads) {
  const char* K = "matmul";
  require_defined(K, "a", a);
  require_defined(K, "b", b);
  require_defined(K, "c", c);
  MT_CHECK(supports(a, b, c), "matmul: dtypes a {} b {} c {} reached the fast engine", a.desc(),
           b.desc(), c.desc());
  Dims d = check_matmul(a, b, c, p);
  if (c.numel() == 0) return;
  if (d.k == 0) {  // an empty sum: c = beta * c, and c is write-only when beta == 0
    if (c.dtype() != DType::f32) {
      Tensor wide = Tensor::zeros(c.shape(), DType::f32);
      if (p.beta != 0.0f) {
        wide = widened(c, threads);
        for (float& v : std::span(wide.data<float>(), static_cast<size_t>(wide.numel()))) {
          v *= p.beta;
        }
      }
      if (!cast(wide, c, threads)) convert(wide, c);
      return;
    }
    float* pc = c.data<float>();
    for (int64_t i = 0, n = c.numel(); i < n; ++i) pc[i] = p.beta == 0.0f ? 0.0f : p.beta * pc[i];
    return;
  }
  if (d.m > INT_MAX || d.n > INT_MAX || d.k > INT_MAX) {
    fail(K, "a {} and b {}: dimensions beyond 2^31 are not supported", a.desc(), b.desc());
  }
  fold_batch(d, p);

  Plan& plan = plan_for(key_of(a.dtype(), c.dtype(), d, p, threads), d, a.dtype(), c.dtype(), p);
  if (a.dtype() != DType::f32) {
    if (plan.prim && trust_.onednn) {
      run_onednn(plan, a, b, c);
    } else if (c.dtype() == DType::f32) {
      // No half-precision kernel on this CPU: the f32 product is exact for these inputs.
      run(widened(a, threads), widened(b, threads), c, p, threads);
    } else {
      Tensor wide = p.beta != 0.0f ? widened(c, threads) : Tensor::empty(c.shape(), DType::f32);
      run(widened(a, threads), widened(b, threads), wide, p, threads);
      if (!cast(wide, c, threads)) convert(wide, c);
    }
    return;
  }
  Engine e = plan.engine;
  if (f32_choice_ == MatmulEngineChoice::onednn || !trust_.openblas) e = Engine::onednn;
  if (f32_choice_ == MatmulEngineChoice::openblas || !trust_.onednn) e = Engine::openblas;
  if (e != Engine::undecided) {
    if (e == Engine::onednn) {
      run_onednn(plan, a, b, c);
    } else {
      run_openblas(d, a, b, c, p);
    }
    inject_fault(e, c);
    return;
  }
  // Undecided: alternate engines and keep each one's best time. Primitive
  // creation happens outside the timed region (plan_for made it already).
  const bool use_onednn = plan.trials % 2 == 0;
  const double t0 = trial_clock_s(threads);
  if (use_onednn) {
    run_onednn(plan, a, b, c);
  } else {
    run_openblas(d, a, b, c, p);
  }
  const double t = trial_clock_s(threads) - t0;
  inject_fault(use_onednn ? Engine::onednn : Engine::openblas, c);
  double& best = use_onednn ? plan.best_onednn : plan.best_openblas;
  best = std::min(best, t);
  if (++plan.trials == 2 * kTrials) {
    plan.engine =
        plan.best_openblas < kOpenBlasMargin * plan.best_onednn ? Engine::openblas : Engine::onednn;
  }
}

MatmulEngine::Plan& MatmulEngine::plan_for(const Key& key, const Dims& d, DType in, DType out,
                                           const MatmulParams& p) {
  auto it = plans_.find(key);
  if (it != plans_.end()) return *it->second;
  // Shapes come from a model, so the set is small; this bound only stops a
  // pathological caller from growing the cache forever.
  if (plans_.size() >= 4096) plans_.clear();
  auto plan = std::make_unique<Plan>();
  const memory::data_type t = dnnl_type(in);
  const int64_t rank3 = d.batch > 1 ? d.batch : 0;
  plan->a_md = operand_desc(rank3, d.m, d.k, p.trans_a, t);
  plan->b_md = d.shared_b ? operand_desc(1, d.k, d.n, p.trans_b, t)
                          : operand_desc(rank3, d.k, d.n, p.trans_b, t);
  plan->c_md = operand_desc(rank3, d.m, d.n, false, dnnl_type(out));
  dnnl::primitive_attr attr;
  if (p.alpha != 1.0f) attr.set_output_scales(0, {p.alpha});
  if (p.beta != 0.0f) {
    dnnl::post_ops po;
    po.append_sum(p.beta);
    attr.set_post_ops(po);
  }
  try {
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(plan->a_md, plan->b_md, plan->c_md), attr,
                                    ctx_.engine);
    plan->prim.emplace(pd);
  } catch (const dnnl::error& e) {
    // oneDNN lacks some half-precision kernels on some CPUs (run() then
    // converts to f32); an f32 matmul it cannot build is a bug.
    if (in == DType::f32) {
      throw InternalError(
          fmt::format("matmul: oneDNN cannot build an f32 matmul M={} N={} K={} "
                      "batch={}: {}",
                      d.m, d.n, d.k, d.batch, e.what()));
    }
  }
  return *plans_.emplace(key, std::move(plan)).first->second;
}

void MatmulEngine::run_onednn(Plan& plan, const Tensor& a, const Tensor& b, Tensor& c) {
  plan.prim->execute(ctx_.stream, {{DNNL_ARG_SRC, wrap_memory(plan.a_md, ctx_, a.raw())},
                                   {DNNL_ARG_WEIGHTS, wrap_memory(plan.b_md, ctx_, b.raw())},
                                   {DNNL_ARG_DST, wrap_memory(plan.c_md, ctx_, c.raw())}});
  ctx_.stream.wait();
}

void MatmulEngine::run_openblas(const Dims& d, const Tensor& a, const Tensor& b, Tensor& c,
                                const MatmulParams& p) {
  const float* pa = a.data<float>();
  const float* pb = b.data<float>();
  float* pc = c.data<float>();
  const auto m = static_cast<int>(d.m), n = static_cast<int>(d.n), k = static_cast<int>(d.k);
  for (int64_t bi = 0; bi < d.batch; ++bi) {
    cblas_sgemm(CblasRowMajor, p.trans_a ? CblasTrans : CblasNoTrans,
                p.trans_b ? CblasTrans : CblasNoTrans, m, n, k, p.alpha, pa + bi * d.m * d.k,
                p.trans_a ? m : k, pb + (d.shared_b ? 0 : bi * d.k * d.n), p.trans_b ? k : n,
                p.beta, pc + bi * d.m * d.n, n);
  }
}

const char* MatmulEngine::chosen_engine(const Tensor& a, const Tensor& b, const MatmulParams& p,
                                        int threads) const {
  if (a.dtype() != DType::f32) return trust_.onednn ? "onednn" : "openblas";
  if (f32_choice_ == MatmulEngineChoice::onednn || !trust_.openblas) return "onednn";
  if (f32_choice_ == MatmulEngineChoice::openblas || !trust_.onednn) return "openblas";
  Dims d = matmul_dims(a, b, p);
  fold_batch(d, p);
  auto it = plans_.find(key_of(a.dtype(), DType::f32, d, p, threads));
  if (it == plans_.end() || it->second->engine == Engine::undecided) return "undecided";
  return it->second->engine == Engine::onednn ? "onednn" : "openblas";
}

std::vector<std::pair<std::string, std::string>> MatmulEngine::report() const {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& [key, plan] : plans_) {
    if (key.in != DType::f32) continue;
    std::string sig =
        key.batch > 1 ? fmt::format("b{}{} ", key.batch, key.shared_b ? "s" : "") : std::string();
    sig += fmt::format("{}x{}x{} {}{} t{}", key.m, key.n, key.k, key.trans_a ? 't' : 'n',
                       key.trans_b ? 't' : 'n', key.threads);
    Engine e = plan->engine;
    if (f32_choice_ == MatmulEngineChoice::onednn || !trust_.openblas) e = Engine::onednn;
    if (f32_choice_ == MatmulEngineChoice::openblas || !trust_.onednn) e = Engine::openblas;
    out.emplace_back(std::move(sig), e == Engine::onednn     ? "onednn"
                                     : e == Engine::openblas ? "openblas"
                                                             : "undecided");
  }
  return out;
}

namespace {

// One probe case: c = alpha op(a) op(b) + beta c, batched when batch > 0.
struct ProbeCase {
  int64_t batch, m, n, k;
  bool trans_a, trans_b, shared_b;
  float alpha, beta;
};

Tensor probe_tensor(const Shape& s, uint64_t seed) {
  Tensor t = Tensor::empty(s, DType::f32);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    p[i] = static_cast<float>(static_cast<double>(x >> 11) * 0x1.0p-53 * 2.0 - 1.0);
  }
  return t;
}

Tensor abs_of(const Tensor& t) {
  Tensor out = Tensor::empty(t.shape(), DType::f32);
  for (int64_t i = 0; i < t.numel(); ++i) out.data<float>()[i] = std::abs(t.data<float>()[i]);
  return out;
}

// "" when `engine` matches `oracle` on every case, else what went wrong.
std::string probe_one(MatmulEngine& engine, KernelBackend& oracle) {
  static const ProbeCase cases[] = {
      {0, 1, 1, 1, false, false, false, 1.0f, 0.0f},
      {0, 7, 13, 5, false, false, false, 1.0f, 0.0f},
      {0, 37, 29, 53, true, false, false, 0.5f, 1.0f},
      {0, 17, 33, 300, false, true, false, 1.0f, 0.0f},
      {0, 65, 31, 129, true, true, false, -1.5f, 0.25f},
      {0, 100, 96, 1, false, false, false, 1.0f, 0.0f},
      {3, 9, 11, 6, false, false, false, 1.0f, 0.0f},
      {3, 12, 10, 19, true, true, false, 1.0f, 0.0f},
      {4, 5, 7, 8, false, false, true, 1.0f, 0.0f},
  };
  uint64_t seed = 1;
  for (const ProbeCase& pc : cases) {
    const Shape sa = pc.trans_a ? Shape{pc.k, pc.m} : Shape{pc.m, pc.k};
    const Shape sb = pc.trans_b ? Shape{pc.n, pc.k} : Shape{pc.k, pc.n};
    auto batched = [&](const Shape& s, bool shared) {
      return pc.batch > 0 && !shared ? Shape{pc.batch, s[0], s[1]} : s;
    };
    const Tensor a = probe_tensor(batched(sa, false), seed++);
    const Tensor b = probe_tensor(batched(sb, pc.shared_b), seed++);
    const Tensor c0 = probe_tensor(batched(Shape{pc.m, pc.n}, false), seed++);
    const MatmulParams p{pc.trans_a, pc.trans_b, pc.alpha, pc.beta};
    Tensor got = c0.clone(), want = c0.clone();
    engine.run(a, b, got, p, 1);
    oracle.matmul(a, b, want, p);
    // Scale of each element: |alpha| sum |a||b| + |beta c|.
    Tensor scale = abs_of(c0);
    oracle.matmul(abs_of(a), abs_of(b), scale,
                  MatmulParams{pc.trans_a, pc.trans_b, std::abs(pc.alpha), std::abs(pc.beta)});
    const double rel = static_cast<double>(pc.k + 2) * 0x1.0p-22;
    for (int64_t i = 0; i < got.numel(); ++i) {
      const double g = got.data<float>()[i], w = want.data<float>()[i];
      const double tol = rel * scale.data<float>()[i];
      if (!(std::abs(g - w) <= tol)) {
        return fmt::format(
            "{}M={} N={} K={} trans_a={} trans_b={} alpha={} beta={}: element {} is {} where the "
            "reference backend gives {} (tolerance {:.3g})",
            pc.batch > 0 ? fmt::format("batch={}{} ", pc.batch, pc.shared_b ? " (shared b)" : "")
                         : std::string(),
            pc.m, pc.n, pc.k, pc.trans_a, pc.trans_b, pc.alpha, pc.beta, i, g, w, tol);
      }
    }
  }
  return "";
}

}  // namespace

MatmulTrust probe_matmul_engines(KernelBackend& oracle, MatmulEngineFault fault) {
  MatmulTrust t;
  OneDnnContext ctx;
  // Each probe pins one engine; the other is nominally trusted so the
  // constructor's checks hold.
  {
    MatmulEngine e(ctx, MatmulEngineChoice::onednn, {}, fault);
    t.onednn_reason = probe_one(e, oracle);
  }
  {
    MatmulEngine e(ctx, MatmulEngineChoice::openblas, {}, fault);
    t.openblas_reason = probe_one(e, oracle);
  }
  t.onednn = t.onednn_reason.empty();
  t.openblas = t.openblas_reason.empty();
  return t;
}

}  // namespace mt::fast
