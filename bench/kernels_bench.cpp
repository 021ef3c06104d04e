// Micro-benchmarks of the fast kernel backend (Google Benchmark).
//
//   build/bench/kernels_bench                         # everything
//   build/bench/kernels_bench --benchmark_filter=sgemm  # single-core SGEMM peak
//
// Cases and their counters:
// - sgemm_<engine>/N/N/N: square f32 matmul at 1 thread through one engine
//   (onednn first, so bench/run core's "largest square sgemm" is the faster
//   library); GFLOP/s. The largest one is the single-core SGEMM peak.
// - matmul_<dtype>_<engine>/M/N/K/trans_a/trans_b/threads: the MLP
//   784-512-512-10 products at batch 128 (forward, weight and data
//   gradients); engine "measure" is the backend's default per-shape choice;
//   bf16 takes bf16 inputs with an f32 output (oneDNN).
// - bmm_<dtype>_<engine>/batch/M/N/K/trans_a/trans_b/threads: GPT attention
//   products (16 sequences x 4 heads, T = 128, head dim 64).
// - conv_<direction>_<layout>/N/C/H/O/threads: the CNN's 3x3 pad-1
//   convolutions at batch 128; GFLOP/s.
// - layer_norm, softmax_causal, gelu, cross_entropy, max_pool (fwd and bwd):
//   GPT / CNN shapes; bytes/s counts each tensor read or written once.
#include <benchmark/benchmark.h>

#include <map>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "meshtrain/tensor/backends/fast/fast_backend.h"
#include "meshtrain/tensor/kernels.h"
#include "meshtrain/tensor/machine.h"

namespace {

using mt::DType;
using mt::Shape;
using mt::Tensor;

Tensor random_tensor(const Shape& s, uint32_t seed, DType dt = DType::f32) {
  Tensor t = Tensor::empty(s, DType::f32);
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = dist(gen);
  return dt == DType::f32 ? t : t.to(dt);
}

// One fast backend per option set, kept for the process so primitive caches
// and engine choices persist across benchmark runs as they do in training.
mt::KernelBackend& backend(mt::MatmulEngineChoice mm,
                           mt::ConvLayoutChoice conv = mt::ConvLayoutChoice::measure) {
  static std::map<std::pair<int, int>, std::unique_ptr<mt::KernelBackend>> backends;
  auto& b = backends[{static_cast<int>(mm), static_cast<int>(conv)}];
  if (!b) b = mt::make_fast_backend(mt::kernels("reference"), mt::FastBackendOptions{mm, conv});
  return *b;
}

mt::KernelBackend& fast(int threads) {
  mt::KernelBackend& k = backend(mt::MatmulEngineChoice::measure);
  k.set_num_threads(threads);
  return k;
}

const char* engine_name(mt::MatmulEngineChoice e) {
  switch (e) {
    case mt::MatmulEngineChoice::measure:
      return "measure";
    case mt::MatmulEngineChoice::onednn:
      return "onednn";
    case mt::MatmulEngineChoice::openblas:
      return "openblas";
  }
  return "?";
}

void set_rate(benchmark::State& state, const char* name, double per_iteration) {
  state.counters[name] =
      benchmark::Counter(per_iteration, benchmark::Counter::kIsIterationInvariantRate);
}

// Registers a case; multi-threaded ones are timed by the wall clock (CPU
// time would count the main thread only), single-threaded ones by CPU time,
// which a busy shared machine disturbs less.
template <class F>
void reg(const std::string& name, int threads, benchmark::TimeUnit unit, F&& f) {
  benchmark::internal::Benchmark* b =
      benchmark::RegisterBenchmark(name.c_str(), std::forward<F>(f));
  b->Unit(unit);
  if (threads > 1) b->UseRealTime();
}

// ---- matmul ----

void run_matmul(benchmark::State& state, mt::MatmulEngineChoice engine, DType dt, int64_t batch,
                int64_t m, int64_t n, int64_t k, bool ta, bool tb, int threads) {
  mt::KernelBackend& kb = backend(engine);
  kb.set_num_threads(threads);
  const Shape as = ta ? Shape{k, m} : Shape{m, k};
  const Shape bs = tb ? Shape{n, k} : Shape{k, n};
  const Tensor a = random_tensor(batch ? Shape{batch, as[0], as[1]} : as, 1, dt);
  const Tensor b = random_tensor(batch ? Shape{batch, bs[0], bs[1]} : bs, 2, dt);
  Tensor c = Tensor::empty(batch ? Shape{batch, m, n} : Shape{m, n}, DType::f32);
  const mt::MatmulParams p{ta, tb, 1.0f, 0.0f};
  for (int i = 0; i < 8; ++i) kb.matmul(a, b, c, p);  // primitives, engine choice
  for (auto _ : state) {
    kb.matmul(a, b, c, p);
    benchmark::DoNotOptimize(c.raw());
  }
  set_rate(state, "GFLOP/s", 2.0 * static_cast<double>(std::max<int64_t>(batch, 1) * m * n * k));
}

void register_matmuls() {
  using E = mt::MatmulEngineChoice;
  for (E e : {E::onednn, E::openblas}) {
    for (int64_t s : {512, 1024, 2048}) {
      reg(fmt::format("sgemm_{}/{}/{}/{}", engine_name(e), s, s, s), 1, benchmark::kMillisecond,
          [=](benchmark::State& st) {
            run_matmul(st, e, DType::f32, 0, s, s, s, false, false, 1);
          });
    }
  }
  // The bf16 peak beside it: how much faster than f32 a bf16 matmul can be on
  // this CPU, the ceiling of mixed precision's speed-up.
  for (int64_t s : {1024, 2048}) {
    reg(fmt::format("bf16gemm_onednn/{}/{}/{}", s, s, s), 1, benchmark::kMillisecond,
        [=](benchmark::State& st) {
          run_matmul(st, E::onednn, DType::bf16, 0, s, s, s, false, false, 1);
        });
  }
  // MLP 784-512-512-10, batch 128: forward, weight gradient (a^T), data gradient (b^T).
  const std::vector<std::tuple<int64_t, int64_t, int64_t, bool, bool>> mlp = {
      {128, 512, 784, false, false}, {128, 512, 512, false, false}, {128, 10, 512, false, false},
      {784, 512, 128, true, false},  {512, 512, 128, true, false},  {512, 10, 128, true, false},
      {128, 784, 512, false, true},  {128, 512, 512, false, true},  {128, 512, 10, false, true}};
  const std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, bool, bool>> attention = {
      {64, 128, 128, 64, false, true},   // scores = q k^T; d att = d out v^T
      {64, 128, 64, 128, false, false},  // att v; d q = d scores k
      {64, 128, 64, 128, true, false}};  // d v = att^T d out; d k = d scores^T q
  for (int threads : {1, 2}) {
    for (const auto& [dt, e] :
         {std::pair{DType::f32, E::measure}, std::pair{DType::f32, E::onednn},
          std::pair{DType::f32, E::openblas}, std::pair{DType::bf16, E::onednn}}) {
      const std::string tag = fmt::format("{}_{}", mt::dtype_name(dt), engine_name(e));
      for (const auto& [m, n, k, ta, tb] : mlp) {
        reg(fmt::format("matmul_{}/{}/{}/{}/{}/{}/{}", tag, m, n, k, int{ta}, int{tb}, threads),
            threads, benchmark::kMicrosecond,
            [=](benchmark::State& st) { run_matmul(st, e, dt, 0, m, n, k, ta, tb, threads); });
      }
      for (const auto& [bt, m, n, k, ta, tb] : attention) {
        reg(fmt::format("bmm_{}/{}/{}/{}/{}/{}/{}/{}", tag, bt, m, n, k, int{ta}, int{tb}, threads),
            threads, benchmark::kMicrosecond,
            [=](benchmark::State& st) { run_matmul(st, e, dt, bt, m, n, k, ta, tb, threads); });
      }
    }
  }
}

// ---- convolution ----

enum class ConvDir { forward, backward_data, backward_weight };

void run_conv(benchmark::State& state, ConvDir dir, mt::ConvLayoutChoice layout, int64_t n,
              int64_t c, int64_t h, int64_t o, int threads) {
  mt::KernelBackend& kb = backend(mt::MatmulEngineChoice::measure, layout);
  kb.set_num_threads(threads);
  const mt::Conv2dParams p{1, 1, 1, 1};
  const Tensor x = random_tensor({n, c, h, h}, 1), w = random_tensor({o, c, 3, 3}, 2);
  const Tensor bias = random_tensor({o}, 3), dy = random_tensor({n, o, h, h}, 4);
  Tensor y = Tensor::empty({n, o, h, h}, DType::f32), dx = Tensor::empty(x.shape(), DType::f32);
  Tensor dw = Tensor::empty(w.shape(), DType::f32), db = Tensor::empty({o}, DType::f32);
  auto call = [&] {
    switch (dir) {
      case ConvDir::forward:
        kb.conv2d(x, w, bias, y, p);
        break;
      case ConvDir::backward_data:
        kb.conv2d_backward_data(dy, w, dx, p);
        break;
      case ConvDir::backward_weight:
        kb.conv2d_backward_weight(dy, x, dw, db, p);
        break;
    }
  };
  for (int i = 0; i < 7; ++i) call();  // primitives, layout choice
  for (auto _ : state) call();
  set_rate(state, "GFLOP/s", 2.0 * static_cast<double>(n * o * c * 9 * h * h));
}

void register_convs() {
  using L = mt::ConvLayoutChoice;
  const std::pair<ConvDir, const char*> dirs[] = {{ConvDir::forward, "fwd"},
                                                  {ConvDir::backward_data, "bwd_data"},
                                                  {ConvDir::backward_weight, "bwd_weight"}};
  const std::pair<L, const char*> layouts[] = {
      {L::measure, "measure"}, {L::plain, "plain"}, {L::blocked, "blocked"}};
  for (int threads : {1, 2}) {
    for (const auto& [dir, dname] : dirs) {
      for (const auto& [layout, lname] : layouts) {
        for (const auto& [c, h, o] :
             {std::tuple<int64_t, int64_t, int64_t>{1, 28, 32}, {32, 14, 64}}) {
          reg(fmt::format("conv_{}_{}/128/{}/{}/{}/{}", dname, lname, c, h, o, threads), threads,
              benchmark::kMillisecond, [=, d = dir, l = layout](benchmark::State& st) {
                run_conv(st, d, l, 128, c, h, o, threads);
              });
        }
      }
    }
  }
}

// ---- element-wise, normalisation, losses, pooling ----

void register_elementwise() {
  for (int threads : {1, 2}) {
    auto name = [threads](const char* base) { return fmt::format("{}/{}", base, threads); };
    // GPT: 16 x 128 tokens of width 256; MLP hidden 4 x 256.
    reg(name("layer_norm_fwd/2048/256"), threads, benchmark::kMicrosecond,
        [=](benchmark::State& st) {
          mt::KernelBackend& k = fast(threads);
          const Tensor x = random_tensor({2048, 256}, 1), g = random_tensor({256}, 2),
                       b = random_tensor({256}, 3);
          Tensor y = Tensor::empty(x.shape(), DType::f32), m = Tensor::empty({2048}, DType::f32),
                 r = Tensor::empty({2048}, DType::f32);
          for (auto _ : st) k.layer_norm(x, g, b, 1e-5, y, m, r);
          set_rate(st, "bytes/s", 2.0 * static_cast<double>(x.nbytes()));
        });
    reg(name("layer_norm_bwd/2048/256"), threads, benchmark::kMicrosecond,
        [=](benchmark::State& st) {
          mt::KernelBackend& k = fast(threads);
          const Tensor x = random_tensor({2048, 256}, 1), g = random_tensor({256}, 2),
                       b = random_tensor({256}, 3), dy = random_tensor({2048, 256}, 4);
          Tensor y = Tensor::empty(x.shape(), DType::f32), m = Tensor::empty({2048}, DType::f32),
                 r = Tensor::empty({2048}, DType::f32), dx = Tensor::empty(x.shape(), DType::f32),
                 dg = Tensor::empty({256}, DType::f32), db = Tensor::empty({256}, DType::f32);
          k.layer_norm(x, g, b, 1e-5, y, m, r);
          for (auto _ : st) k.layer_norm_backward(dy, x, g, m, r, dx, dg, db);
          set_rate(st, "bytes/s", 3.0 * static_cast<double>(x.nbytes()));
        });
    reg(name("softmax_causal_fwd/64/128/128"), threads, benchmark::kMicrosecond,
        [=](benchmark::State& st) {
          mt::KernelBackend& k = fast(threads);
          const Tensor x = random_tensor({64, 128, 128}, 1);
          Tensor y = Tensor::empty(x.shape(), DType::f32);
          for (auto _ : st) k.softmax(x, y, true);
          set_rate(st, "bytes/s", 2.0 * static_cast<double>(x.nbytes()));
        });
    reg(name("softmax_bwd/64/128/128"), threads, benchmark::kMicrosecond,
        [=](benchmark::State& st) {
          mt::KernelBackend& k = fast(threads);
          const Tensor x = random_tensor({64, 128, 128}, 1), dy = random_tensor({64, 128, 128}, 2);
          Tensor y = Tensor::empty(x.shape(), DType::f32),
                 dx = Tensor::empty(x.shape(), DType::f32);
          k.softmax(x, y, true);
          for (auto _ : st) k.softmax_backward(y, dy, dx);
          set_rate(st, "bytes/s", 3.0 * static_cast<double>(x.nbytes()));
        });
    for (const auto& [op, op_name] :
         {std::pair{mt::UnaryOp::gelu, "gelu"}, std::pair{mt::UnaryOp::relu, "relu"}}) {
      // f32, and bf16 / f16 storage (16-bit activations).
      for (const DType dt : {DType::f32, DType::bf16, DType::f16}) {
        const char* suffix = dt == DType::f32 ? "" : dt == DType::bf16 ? "_bf16" : "_f16";
        reg(fmt::format("{}_fwd{}/2048/1024/{}", op_name, suffix, threads), threads,
            benchmark::kMicrosecond, [=, o = op](benchmark::State& st) {
              mt::KernelBackend& k = fast(threads);
              const Tensor x = random_tensor({2048, 1024}, 1).to(dt);
              Tensor y = Tensor::empty(x.shape(), dt);
              for (auto _ : st) k.unary(o, x, y);
              set_rate(st, "bytes/s", 2.0 * static_cast<double>(x.nbytes()));
            });
        reg(fmt::format("{}_bwd{}/2048/1024/{}", op_name, suffix, threads), threads,
            benchmark::kMicrosecond, [=, o = op](benchmark::State& st) {
              mt::KernelBackend& k = fast(threads);
              const Tensor x = random_tensor({2048, 1024}, 1).to(dt),
                           dy = random_tensor({2048, 1024}, 2).to(dt);
              Tensor dx = Tensor::empty(x.shape(), dt);
              for (auto _ : st) k.unary_backward(o, x, Tensor(), dy, dx);
              set_rate(st, "bytes/s", 3.0 * static_cast<double>(x.nbytes()));
            });
      }
    }
    // Mixed precision's casts: the MLP input [128, 784] and a GPT MLP hidden
    // activation [2048, 1024], f32 -> bf16 (before a matmul) and back.
    for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{128, 784}, {2048, 1024}}) {
      for (const bool narrow : {true, false}) {
        reg(fmt::format("cast_{}/{}/{}/{}", narrow ? "f32_bf16" : "bf16_f32", rows, cols, threads),
            threads, benchmark::kMicrosecond, [=](benchmark::State& st) {
              mt::KernelBackend& k = fast(threads);
              Tensor x = random_tensor({rows, cols}, 1);
              if (!narrow) {
                Tensor b = Tensor::empty(x.shape(), DType::bf16);
                k.cast(x, b);
                x = b;
              }
              Tensor y = Tensor::empty(x.shape(), narrow ? DType::bf16 : DType::f32);
              for (auto _ : st) k.cast(x, y);
              set_rate(st, "bytes/s", static_cast<double>(x.nbytes() + y.nbytes()));
            });
      }
    }
    reg(name("cross_entropy_fwd_bwd/2048/256"), threads, benchmark::kMicrosecond,
        [=](benchmark::State& st) {
          mt::KernelBackend& k = fast(threads);
          const Tensor x = random_tensor({2048, 256}, 1);
          Tensor labels = Tensor::empty({2048}, DType::i32);
          for (int64_t i = 0; i < 2048; ++i)
            labels.data<int32_t>()[i] = static_cast<int32_t>(i % 256);
          Tensor loss = Tensor::empty({}, DType::f32), dx = Tensor::empty(x.shape(), DType::f32);
          const Tensor dloss = Tensor::full({}, DType::f32, 1.0);
          for (auto _ : st) {
            k.cross_entropy(x, labels, loss);
            k.cross_entropy_backward(x, labels, dloss, dx);
          }
          set_rate(st, "bytes/s", 3.0 * static_cast<double>(x.nbytes()));
        });
    reg(name("max_pool_fwd_bwd/128/32/28"), threads, benchmark::kMicrosecond,
        [=](benchmark::State& st) {
          mt::KernelBackend& k = fast(threads);
          const Tensor x = random_tensor({128, 32, 28, 28}, 1),
                       dy = random_tensor({128, 32, 14, 14}, 2);
          Tensor y = Tensor::empty({128, 32, 14, 14}, DType::f32),
                 a = Tensor::empty({128, 32, 14, 14}, DType::i32),
                 dx = Tensor::empty(x.shape(), DType::f32);
          for (auto _ : st) {
            k.max_pool2d(x, y, a, {});
            k.max_pool2d_backward(dy, a, dx);
          }
          set_rate(st, "bytes/s",
                   2.0 * static_cast<double>(x.nbytes()) + 3.0 * static_cast<double>(y.nbytes()));
        });
  }
}

}  // namespace

int main(int argc, char** argv) {
  register_matmuls();
  register_convs();
  register_elementwise();
  // The machine and its engines, in the JSON's "context" beside the rates.
  const mt::CpuInfo& cpu = mt::cpu_info();
  benchmark::AddCustomContext("cpu", cpu.describe());
  benchmark::AddCustomContext("isa", cpu.isa_flags());
  benchmark::AddCustomContext("onednn_isa", mt::onednn_isa());
  benchmark::AddCustomContext("openblas_core", mt::openblas_core_description());
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
