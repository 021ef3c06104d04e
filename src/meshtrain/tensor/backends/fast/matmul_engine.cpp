// Fast matmul: validation, the per-signature engine choice and the two
// engines (see matmul_engine.h for the policy).
#include "meshtrain/tensor/backends/fast/matmul_engine.h"

#include <cblas.h>

#include <bit>
#include <climits>
#include <cstring>
#include <span>

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

MatmulEngine::MatmulEngine(OneDnnContext& ctx, MatmulEngineChoice f32_choice)
    : ctx_(ctx), f32_choice_(f32_choice) {}

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
    if (plan.prim) {
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
  if (f32_choice_ == MatmulEngineChoice::onednn) e = Engine::onednn;
  if (f32_choice_ == MatmulEngineChoice::openblas) e = Engine::openblas;
  if (e != Engine::undecided) {
    if (e == Engine::onednn) {
      run_onednn(plan, a, b, c);
    } else {
      run_openblas(d, a, b, c, p);
    }
    return;
  }
  // Undecided: alternate engines and keep each one's best time. Primitive
  // creation happens outside the timed region (plan_for made it already).
  const bool use_onednn = plan.trials % 2 == 0;
  const double t0 = trial_clock(threads);
  if (use_onednn) {
    run_onednn(plan, a, b, c);
  } else {
    run_openblas(d, a, b, c, p);
  }
  const double t = trial_clock(threads) - t0;
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
  if (a.dtype() != DType::f32) return "onednn";
  if (f32_choice_ == MatmulEngineChoice::onednn) return "onednn";
  if (f32_choice_ == MatmulEngineChoice::openblas) return "openblas";
  Dims d = matmul_dims(a, b, p);
  fold_batch(d, p);
  auto it = plans_.find(key_of(a.dtype(), DType::f32, d, p, threads));
  if (it == plans_.end() || it->second->engine == Engine::undecided) return "undecided";
  return it->second->engine == Engine::onednn ? "onednn" : "openblas";
}

}  // namespace mt::fast
