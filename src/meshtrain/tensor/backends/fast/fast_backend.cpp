// FastBackend: routes each KernelBackend call to the fast kernels when the
// dtypes are ones they compute, to the fallback backend otherwise, and keeps
// OpenMP / oneDNN / OpenBLAS on the configured thread count.
#include "meshtrain/tensor/backends/fast/fast_backend.h"

#include <cblas.h>
#include <omp.h>

#include <atomic>
#include <initializer_list>
#include <unordered_map>

#include "meshtrain/tensor/backends/fast/conv_engine.h"
#include "meshtrain/tensor/backends/fast/fast_common.h"
#include "meshtrain/tensor/backends/fast/fast_kernels.h"
#include "meshtrain/tensor/backends/fast/matmul_engine.h"
#include "meshtrain/tensor/backends/fast/onednn_context.h"
#include "meshtrain/tensor/backends/reference/reference_backend.h"
#include "meshtrain/tensor/machine.h"

namespace mt {

namespace {

// True when every defined tensor in `ts` is f32 and the first one is defined
// (undefined optional tensors such as a missing bias do not count).
bool f32_inputs(std::initializer_list<const Tensor*> ts) {
  if (!(*ts.begin())->defined()) return false;
  for (const Tensor* t : ts) {
    if (t->defined() && t->dtype() != DType::f32) return false;
  }
  return true;
}

// True when every defined tensor in `ts` is f32, or every one is bf16, or
// every one is f16 (the storage types of the element-wise kernels), and the
// first one is defined.
bool elementwise_storage(std::initializer_list<const Tensor*> ts) {
  const Tensor* first = *ts.begin();
  if (!first->defined()) return false;
  const DType t = first->dtype();
  if (t != DType::f32 && t != DType::bf16 && t != DType::f16) return false;
  for (const Tensor* x : ts) {
    if (x->defined() && x->dtype() != t) return false;
  }
  return true;
}

bool any_empty(std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts) {
    if (t->defined() && t->numel() == 0) return true;
  }
  return false;
}

// What one calling thread needs for oneDNN and the measured engine choices:
// its own stream, primitive caches, trial timings and blocked-layout
// buffers, so threads calling one backend at once (ranks run as threads)
// never share mutable state.
struct ThreadEngines {
  ThreadEngines(const FastBackendOptions& o, const fast::MatmulTrust& trust)
      : matmul(ctx, o.f32_matmul, trust, o.faulty_engine_for_testing), conv(ctx, o.conv_layout) {}
  fast::OneDnnContext ctx;
  fast::MatmulEngine matmul;
  fast::ConvEngine conv;
};

std::atomic<uint64_t> next_backend_id{1};

// The fast backend (see fast_backend.h). `fallback_` is borrowed. The oneDNN
// engines live per calling thread (engines()); the rest is immutable but for
// the thread count. Calls block.
class FastBackend final : public KernelBackend {
 public:
  FastBackend(KernelBackend& fallback, const FastBackendOptions& options)
      : fallback_(fallback), options_(options) {
    set_num_threads(1);
    // No engine computes for anyone before it has shown it computes right.
    ReferenceBackend oracle;
    trust_ = fast::probe_matmul_engines(oracle, options_.faulty_engine_for_testing);
    auto refuse = [&](const char* engine, const std::string& why) {
      throw ConfigError(fmt::format(
          "exec.matmul = {}: the {} f32 matmul failed the correctness probe on this machine "
          "(OpenBLAS core {}): {}; use exec.matmul = \"measure\" to run the engines that pass",
          engine, engine, openblas_core_description(), why));
    };
    if (options_.f32_matmul == MatmulEngineChoice::onednn && !trust_.onednn) {
      refuse("onednn", trust_.onednn_reason);
    }
    if (options_.f32_matmul == MatmulEngineChoice::openblas && !trust_.openblas) {
      refuse("openblas", trust_.openblas_reason);
    }
  }

  std::string name() const override { return "fast"; }

  EngineReport engine_report() override {
    EngineReport r;
    r.matmul = engines().matmul.report();
    if (!trust_.onednn) r.dropped.emplace_back("onednn", trust_.onednn_reason);
    if (!trust_.openblas) r.dropped.emplace_back("openblas", trust_.openblas_reason);
    r.blas_core = openblas_core_description();
    return r;
  }

  void set_num_threads(int n) override {
    if (n < 1) {
      throw ConfigError(fmt::format("fast backend: set_num_threads({}): need at least 1", n));
    }
    threads_.store(n, std::memory_order_relaxed);
    omp_set_num_threads(n);
    openblas_set_num_threads(n);
    fallback_.set_num_threads(n);
  }

  void matmul(const Tensor& a, const Tensor& b, Tensor& c, const MatmulParams& p) override {
    // With both engines dropped only the (slow, correct) fallback is left.
    if (!fast::MatmulEngine::supports(a, b, c) || (!trust_.onednn && !trust_.openblas)) {
      return fallback_.matmul(a, b, c, p);
    }
    apply_threads();
    engines().matmul.run(a, b, c, p, threads());
  }

  void unary(UnaryOp op, const Tensor& x, Tensor& y) override {
    if (!elementwise_storage({&x, &y})) return fallback_.unary(op, x, y);
    fast::unary(op, x, y, threads());
  }
  void unary_backward(UnaryOp op, const Tensor& x, const Tensor& y, const Tensor& dy,
                      Tensor& dx) override {
    if (!elementwise_storage({&x, &y, &dy, &dx})) {
      return fallback_.unary_backward(op, x, y, dy, dx);
    }
    fast::unary_backward(op, x, y, dy, dx, threads());
  }
  void binary(BinaryOp op, const Tensor& a, const Tensor& b, Tensor& c) override {
    if (!elementwise_storage({&a, &b, &c})) return fallback_.binary(op, a, b, c);
    fast::binary(op, a, b, c, threads());
  }
  void scale(const Tensor& x, Tensor& y, double alpha, double beta) override {
    if (!f32_inputs({&x, &y})) return fallback_.scale(x, y, alpha, beta);
    fast::scale(x, y, alpha, beta, threads());
  }
  void sum_to(const Tensor& x, Tensor& y) override {
    // A 16-bit x may sum into an f32 y.
    const bool wide_y = x.defined() && y.defined() &&
                        (x.dtype() == DType::bf16 || x.dtype() == DType::f16) &&
                        y.dtype() == DType::f32;
    if (!wide_y && !elementwise_storage({&x, &y})) return fallback_.sum_to(x, y);
    fast::sum_to(x, y, threads());
  }
  void cast(const Tensor& x, Tensor& y) override {
    if (!fast::cast(x, y, threads())) fallback_.cast(x, y);
  }
  void permute(const Tensor& x, Tensor& y, const std::vector<int>& perm) override {
    fast::permute(x, y, perm, threads());
  }

  void softmax(const Tensor& x, Tensor& y, bool causal) override {
    if (!f32_inputs({&x, &y})) return fallback_.softmax(x, y, causal);
    fast::softmax(x, y, causal, threads());
  }
  void softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx) override {
    if (!f32_inputs({&y, &dy, &dx})) return fallback_.softmax_backward(y, dy, dx);
    fast::softmax_backward(y, dy, dx, threads());
  }
  void log_softmax(const Tensor& x, Tensor& y) override {
    if (!f32_inputs({&x, &y})) return fallback_.log_softmax(x, y);
    fast::log_softmax(x, y, threads());
  }
  void log_softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx) override {
    if (!f32_inputs({&y, &dy, &dx})) return fallback_.log_softmax_backward(y, dy, dx);
    fast::log_softmax_backward(y, dy, dx, threads());
  }
  void layer_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps, Tensor& y,
                  Tensor& mean, Tensor& rstd) override {
    if (!f32_inputs({&x, &gamma, &beta, &y, &mean, &rstd})) {
      return fallback_.layer_norm(x, gamma, beta, eps, y, mean, rstd);
    }
    fast::layer_norm(x, gamma, beta, eps, y, mean, rstd, threads());
  }
  void layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                           const Tensor& mean, const Tensor& rstd, Tensor& dx, Tensor& dgamma,
                           Tensor& dbeta) override {
    if (!f32_inputs({&dy, &x, &gamma, &mean, &rstd, &dx, &dgamma, &dbeta})) {
      return fallback_.layer_norm_backward(dy, x, gamma, mean, rstd, dx, dgamma, dbeta);
    }
    fast::layer_norm_backward(dy, x, gamma, mean, rstd, dx, dgamma, dbeta, threads());
  }
  void cross_entropy(const Tensor& logits, const Tensor& labels, Tensor& loss) override {
    // loss may be f32 or f64 whatever the logits' dtype.
    if (!f32_inputs({&logits})) return fallback_.cross_entropy(logits, labels, loss);
    fast::cross_entropy(logits, labels, loss, threads());
  }
  void cross_entropy_backward(const Tensor& logits, const Tensor& labels, const Tensor& dloss,
                              Tensor& dlogits) override {
    if (!f32_inputs({&logits, &dlogits})) {
      return fallback_.cross_entropy_backward(logits, labels, dloss, dlogits);
    }
    fast::cross_entropy_backward(logits, labels, dloss, dlogits, threads());
  }

  void embedding(const Tensor& table, const Tensor& ids, Tensor& y) override {
    fast::embedding(table, ids, y, threads());  // a row copy: every dtype
  }
  void embedding_backward(const Tensor& dy, const Tensor& ids, Tensor& dtable) override {
    if (!f32_inputs({&dtable, &dy})) return fallback_.embedding_backward(dy, ids, dtable);
    fast::embedding_backward(dy, ids, dtable, threads());
  }

  void conv2d(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y,
              const Conv2dParams& p) override {
    // Empty tensors (no batch, channels or filters) have nothing to compute;
    // the fallback validates them and writes the trivial result.
    if (!f32_inputs({&x, &w, &bias, &y}) || any_empty({&x, &w, &y})) {
      return fallback_.conv2d(x, w, bias, y, p);
    }
    const char* K = "conv2d";
    const fast::ConvGeom g = check_conv2d(K, x, "x", w, "w", p);
    if (bias.defined()) require_shape(K, "bias", bias, Shape{g.co});
    require_shape(K, "y", y, Shape{g.n, g.co, g.oh, g.ow});
    apply_threads();
    engines().conv.forward(g, p, x, w, bias, y, threads());
  }
  void conv2d_backward_data(const Tensor& dy, const Tensor& w, Tensor& dx,
                            const Conv2dParams& p) override {
    if (!f32_inputs({&dx, &w, &dy}) || any_empty({&dx, &w, &dy})) {
      return fallback_.conv2d_backward_data(dy, w, dx, p);
    }
    const char* K = "conv2d_backward_data";
    // dx fixes H and W: with stride > 1 several input sizes give the same dy.
    const fast::ConvGeom g = check_conv2d(K, dx, "dx", w, "w", p);
    require_shape(K, "dy", dy, Shape{g.n, g.co, g.oh, g.ow});
    apply_threads();
    engines().conv.backward_data(g, p, dy, w, dx, threads());
  }
  void conv2d_backward_weight(const Tensor& dy, const Tensor& x, Tensor& dw, Tensor& dbias,
                              const Conv2dParams& p) override {
    if (!f32_inputs({&x, &dw, &dy, &dbias}) || any_empty({&x, &dw, &dy})) {
      return fallback_.conv2d_backward_weight(dy, x, dw, dbias, p);
    }
    const char* K = "conv2d_backward_weight";
    const fast::ConvGeom g = check_conv2d(K, x, "x", dw, "dw", p);
    if (dbias.defined()) require_shape(K, "dbias", dbias, Shape{g.co});
    require_shape(K, "dy", dy, Shape{g.n, g.co, g.oh, g.ow});
    apply_threads();
    engines().conv.backward_weight(g, p, dy, x, dw, dbias, threads());
  }
  void max_pool2d(const Tensor& x, Tensor& y, Tensor& argmax, const Pool2dParams& p) override {
    if (!f32_inputs({&x, &y})) return fallback_.max_pool2d(x, y, argmax, p);
    fast::max_pool2d(x, y, argmax, p, threads());
  }
  void max_pool2d_backward(const Tensor& dy, const Tensor& argmax, Tensor& dx) override {
    if (!f32_inputs({&dy, &dx})) return fallback_.max_pool2d_backward(dy, argmax, dx);
    fast::max_pool2d_backward(dy, argmax, dx, threads());
  }

  void spmm(const Tensor& row_ptr, const Tensor& col_idx, const Tensor& w, const Tensor& x,
            Tensor& y) override {
    if (!f32_inputs({&x, &w, &y})) return fallback_.spmm(row_ptr, col_idx, w, x, y);
    fast::spmm(row_ptr, col_idx, w, x, y, threads());
  }
  void spmm_transposed(const Tensor& row_ptr, const Tensor& col_idx, const Tensor& w,
                       const Tensor& dy, Tensor& dx) override {
    if (!f32_inputs({&dy, &w, &dx})) return fallback_.spmm_transposed(row_ptr, col_idx, w, dy, dx);
    fast::spmm_transposed(row_ptr, col_idx, w, dy, dx, threads());
  }
  void sddmm(const Tensor& row_ptr, const Tensor& col_idx, const Tensor& a, const Tensor& b,
             Tensor& out) override {
    if (!f32_inputs({&a, &b, &out})) return fallback_.sddmm(row_ptr, col_idx, a, b, out);
    fast::sddmm(row_ptr, col_idx, a, b, out, threads());
  }
  void spmm_max(const Tensor& row_ptr, const Tensor& col_idx, const Tensor& x, Tensor& y,
                Tensor& argmax) override {
    if (!f32_inputs({&x, &y})) return fallback_.spmm_max(row_ptr, col_idx, x, y, argmax);
    fast::spmm_max(row_ptr, col_idx, x, y, argmax, threads());
  }
  void spmm_max_backward(const Tensor& dy, const Tensor& argmax, Tensor& dx) override {
    if (!f32_inputs({&dy, &dx})) return fallback_.spmm_max_backward(dy, argmax, dx);
    fast::spmm_max_backward(dy, argmax, dx, threads());
  }
  void edge_softmax(const Tensor& row_ptr, const Tensor& x, Tensor& y) override {
    if (!f32_inputs({&x, &y})) return fallback_.edge_softmax(row_ptr, x, y);
    fast::edge_softmax(row_ptr, x, y, threads());
  }
  void edge_softmax_backward(const Tensor& row_ptr, const Tensor& y, const Tensor& dy,
                             Tensor& dx) override {
    if (!f32_inputs({&y, &dy, &dx})) return fallback_.edge_softmax_backward(row_ptr, y, dy, dx);
    fast::edge_softmax_backward(row_ptr, y, dy, dx, threads());
  }

 private:
  // OpenMP's thread count is per calling thread and OpenBLAS's is global, and
  // either may have been changed since set_num_threads: oneDNN and OpenBLAS
  // read them at call time, so they are re-applied before each library call.
  void apply_threads() {
    const int n = threads();
    if (omp_get_max_threads() != n) omp_set_num_threads(n);
    if (openblas_get_num_threads() != n) openblas_set_num_threads(n);
  }

  int threads() const { return threads_.load(std::memory_order_relaxed); }

  // This thread's engines for this backend, made on first use and freed when
  // the thread exits. Keyed by a never-reused id, not the address, so a
  // later backend at the same address cannot pick up stale engines.
  ThreadEngines& engines() {
    thread_local std::unordered_map<uint64_t, std::unique_ptr<ThreadEngines>> per_thread;
    std::unique_ptr<ThreadEngines>& e = per_thread[id_];
    if (!e) e = std::make_unique<ThreadEngines>(options_, trust_);
    return *e;
  }

  KernelBackend& fallback_;
  const FastBackendOptions options_;
  fast::MatmulTrust trust_;  // set once in the constructor
  const uint64_t id_ = next_backend_id.fetch_add(1);
  std::atomic<int> threads_{1};
};

}  // namespace

std::unique_ptr<KernelBackend> make_fast_backend(KernelBackend& fallback) {
  return make_fast_backend(fallback, FastBackendOptions{});
}

std::unique_ptr<KernelBackend> make_fast_backend(KernelBackend& fallback,
                                                 const FastBackendOptions& options) {
  return std::make_unique<FastBackend>(fallback, options);
}

}  // namespace mt
