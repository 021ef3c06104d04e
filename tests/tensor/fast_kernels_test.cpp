// The fast kernel backend against the reference backend: every method, on
// edge shapes (size 1, empty, odd sizes that leave vector tails) and on
// shapes large enough to take the multi-threaded paths, at 1 and 2 threads.
//
// Tolerances: f32 results must match within 1e-5 relative (plus a small
// absolute term scaled to the data, since the reference accumulates in f64).
// bf16/f16 matmul is compared with the reference on the same rounded inputs
// (f32 accumulation, so f32-like tolerance), and with the f32 product of the
// unrounded inputs within 1e-2 relative (the rounding of the inputs).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "meshtrain/tensor/backends/fast/fast_backend.h"
#include "meshtrain/tensor/backends/fast/matmul_engine.h"
#include "meshtrain/tensor/kernels.h"

namespace mt {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

Tensor random_tensor(const Shape& s, uint32_t seed, double lo = -2.0, double hi = 2.0,
                     DType dt = DType::f32) {
  Tensor t = Tensor::empty(s, DType::f32);
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(static_cast<float>(lo), static_cast<float>(hi));
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = dist(gen);
  return dt == DType::f32 ? t : t.to(dt);
}

Tensor random_ids(const Shape& s, int32_t hi, uint32_t seed) {
  Tensor t = Tensor::empty(s, DType::i32);
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int32_t> dist(0, hi - 1);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<int32_t>()[i] = dist(gen);
  return t;
}

// |got - want| <= atol + rtol |want| element-wise (NaN matches NaN only);
// reports the worst element.
void expect_close(const Tensor& got, const Tensor& want, double rtol, double atol,
                  const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  ASSERT_EQ(got.dtype(), want.dtype()) << what;
  double worst = 0.0;
  int64_t worst_i = -1;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double g = got.item(i), w = want.item(i);
    if (std::isnan(w) || std::isnan(g)) {
      if (std::isnan(w) != std::isnan(g)) {
        ADD_FAILURE() << what << ": element " << i << " is " << g << ", expected " << w;
        return;
      }
      continue;
    }
    if (std::isinf(w) || std::isinf(g)) {
      if (g != w) {
        ADD_FAILURE() << what << ": element " << i << " is " << g << ", expected " << w;
        return;
      }
      continue;
    }
    const double excess = std::fabs(g - w) - (atol + rtol * std::fabs(w));
    if (excess > worst) {
      worst = excess;
      worst_i = i;
    }
  }
  if (worst_i >= 0) {
    ADD_FAILURE() << what << ": element " << worst_i << " of " << got.desc() << " is "
                  << got.item(worst_i) << ", expected " << want.item(worst_i) << " (rtol " << rtol
                  << ", atol " << atol << ")";
  }
}

double max_abs(const Tensor& t) {
  double m = 0.0;
  for (int64_t i = 0; i < t.numel(); ++i) m = std::max(m, std::fabs(t.item(i)));
  return m;
}

// Outputs start as NaN so a kernel that skips an element is caught.
Tensor nan_like(const Shape& s, DType dt = DType::f32) {
  return Tensor::full(s, dt, kNaN);
}

class FastKernels : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    fast_ = make_fast_backend(ref_);
    fast_->set_num_threads(GetParam());
  }
  KernelBackend& ref_ = kernels("reference");
  std::unique_ptr<KernelBackend> fast_;
};

// ---- matmul ----

struct MatmulCase {
  int64_t batch;  // 0: rank 2
  int64_t m, n, k;
  bool ta, tb, shared_b;
  float alpha, beta;
};

void check_matmul(KernelBackend& fast, KernelBackend& ref, const MatmulCase& mc, uint32_t seed,
                  DType in = DType::f32) {
  const Shape as = mc.batch == 0
                       ? (mc.ta ? Shape{mc.k, mc.m} : Shape{mc.m, mc.k})
                       : (mc.ta ? Shape{mc.batch, mc.k, mc.m} : Shape{mc.batch, mc.m, mc.k});
  const Shape bs2 = mc.tb ? Shape{mc.n, mc.k} : Shape{mc.k, mc.n};
  const Shape bs = mc.batch == 0 || mc.shared_b ? bs2 : Shape{mc.batch, bs2[0], bs2[1]};
  const Shape cs = mc.batch == 0 ? Shape{mc.m, mc.n} : Shape{mc.batch, mc.m, mc.n};
  const Tensor a = random_tensor(as, seed, -1, 1, in), b = random_tensor(bs, seed + 1, -1, 1, in);
  const Tensor c0 = random_tensor(cs, seed + 2);
  const MatmulParams p{mc.ta, mc.tb, mc.alpha, mc.beta};
  Tensor want = c0.clone();
  ref.matmul(a, b, want, p);
  // Several calls on fresh copies take the engine-choice trials and then the
  // chosen engine; every one must be right (beta != 0 accumulates once).
  for (int call = 0; call < 2 * fast::MatmulEngine::kTrials + 1; ++call) {
    Tensor got = mc.beta == 0.0f ? nan_like(cs) : c0.clone();
    fast.matmul(a, b, got, p);
    expect_close(got, want, 1e-5, 1e-5 * std::sqrt(static_cast<double>(mc.k) + 1.0),
                 fmt::format("matmul {} batch {} m {} n {} k {} ta {} tb {} shared {} alpha {} "
                             "beta {} call {}",
                             dtype_name(in), mc.batch, mc.m, mc.n, mc.k, mc.ta, mc.tb, mc.shared_b,
                             mc.alpha, mc.beta, call));
  }
}

TEST_P(FastKernels, MatmulMatchesReference) {
  const std::vector<MatmulCase> cases = {
      {0, 1, 1, 1, false, false, false, 1, 0},       {0, 7, 13, 5, false, false, false, 1, 0},
      {0, 7, 13, 5, true, false, false, 1, 0},       {0, 7, 13, 5, false, true, false, 1, 0},
      {0, 7, 13, 5, true, true, false, 1, 0},        {0, 33, 17, 65, false, false, false, 0.5f, 0},
      {0, 33, 17, 65, false, true, false, 1, 1},     {0, 33, 17, 65, true, false, false, -2, 0.25f},
      {0, 128, 10, 512, false, false, false, 1, 0},  // MLP output layer
      {0, 512, 10, 128, true, false, false, 1, 0},   // its weight gradient
      {0, 128, 512, 10, false, true, false, 1, 0},   // its data gradient
      {3, 9, 11, 6, false, false, false, 1, 0},      {3, 9, 11, 6, true, true, false, 1, 0},
      {3, 9, 11, 6, false, false, true, 1, 0},        // shared b: folded into one product
      {3, 9, 11, 6, true, false, true, 1, 1},         // shared b with a transposed: broadcast
      {4, 16, 16, 8, false, true, false, 0.125f, 0},  // attention scores q k^T
      {1, 5, 4, 3, false, false, false, 1, 0},
  };
  uint32_t seed = 10;
  for (const MatmulCase& mc : cases) check_matmul(*fast_, ref_, mc, seed += 3);
}

TEST_P(FastKernels, MatmulLargeMlpShape) {
  check_matmul(*fast_, ref_, {0, 128, 512, 784, false, false, false, 1, 0}, 7);
  check_matmul(*fast_, ref_, {0, 784, 512, 128, true, false, false, 1, 1}, 8);
}

TEST_P(FastKernels, MatmulEmptyDimensions) {
  // K = 0: c = beta c (or 0); M = 0: nothing to write.
  const Tensor a = Tensor::zeros({3, 0}, DType::f32), b = Tensor::zeros({0, 4}, DType::f32);
  Tensor c = nan_like({3, 4});
  fast_->matmul(a, b, c, {});
  expect_close(c, Tensor::zeros({3, 4}, DType::f32), 0, 0, "K = 0, beta = 0");
  Tensor c2 = Tensor::full({3, 4}, DType::f32, 2.0);
  fast_->matmul(a, b, c2, {false, false, 1.0f, 0.5f});
  expect_close(c2, Tensor::full({3, 4}, DType::f32, 1.0), 0, 0, "K = 0, beta = 0.5");
  Tensor c3 = Tensor::empty({0, 4}, DType::f32);
  fast_->matmul(Tensor::zeros({0, 5}, DType::f32), random_tensor({5, 4}, 1), c3, {});
}

TEST_P(FastKernels, MatmulHalfPrecisionInputs) {
  for (DType dt : {DType::bf16, DType::f16}) {
    check_matmul(*fast_, ref_, {0, 37, 29, 70, false, false, false, 1, 0}, 20, dt);
    check_matmul(*fast_, ref_, {0, 37, 29, 70, true, true, false, 1, 1}, 21, dt);
    check_matmul(*fast_, ref_, {2, 9, 7, 16, false, true, false, 1, 0}, 22, dt);
  }
  // Against the f32 product of the unrounded inputs: off by input rounding only.
  const Tensor a = random_tensor({64, 96}, 30), b = random_tensor({96, 48}, 31);
  Tensor want = Tensor::empty({64, 48}, DType::f32), got = Tensor::empty({64, 48}, DType::f32);
  ref_.matmul(a, b, want, {});
  fast_->matmul(a.to(DType::bf16), b.to(DType::bf16), got, {});
  expect_close(got, want, 1e-2, 1e-2 * max_abs(want), "bf16 vs f32 product");
}

// bf16 storage (activations kept in bf16 under mixed precision): fast and
// reference both compute in f32 and round once, so they agree to about one
// bf16 unit in the last place; the reference is exactly the rounded f32 result.
constexpr double kBf16Rtol = 1.0 / 128;

TEST_P(FastKernels, MatmulBf16Output) {
  for (const MatmulCase& mc : {MatmulCase{0, 37, 29, 70, false, false, false, 1, 0},
                               MatmulCase{0, 37, 29, 70, true, true, false, 1, 0},
                               MatmulCase{2, 9, 7, 16, false, true, false, 1, 0},
                               MatmulCase{3, 8, 5, 12, false, false, true, 1, 0},
                               MatmulCase{0, 16, 16, 0, false, false, false, 1, 0}}) {
    const Shape as = mc.batch == 0 ? (mc.ta ? Shape{mc.k, mc.m} : Shape{mc.m, mc.k})
                                   : Shape{mc.batch, mc.m, mc.k};
    const Shape bs2 = mc.tb ? Shape{mc.n, mc.k} : Shape{mc.k, mc.n};
    const Shape bs = mc.batch == 0 || mc.shared_b ? bs2 : Shape{mc.batch, bs2[0], bs2[1]};
    const Shape cs = mc.batch == 0 ? Shape{mc.m, mc.n} : Shape{mc.batch, mc.m, mc.n};
    const Tensor a = random_tensor(as, 40, -1, 1, DType::bf16);
    const Tensor b = random_tensor(bs, 41, -1, 1, DType::bf16);
    const MatmulParams p{mc.ta, mc.tb, 1.0f, 0.0f};
    Tensor wide = Tensor::empty(cs, DType::f32), want = nan_like(cs, DType::bf16),
           got = nan_like(cs, DType::bf16);
    ref_.matmul(a, b, wide, p);
    ref_.matmul(a, b, want, p);
    EXPECT_EQ(std::memcmp(want.raw(), wide.to(DType::bf16).raw(), want.nbytes()), 0)
        << "reference bf16 product is not the rounded f32 one";
    fast_->matmul(a, b, got, p);
    expect_close(
        got.to(DType::f32), wide, kBf16Rtol, 1e-6,
        fmt::format("bf16-out matmul batch {} m {} n {} k {}", mc.batch, mc.m, mc.n, mc.k));
  }
}

// One unit in the last place of f16 (11 significant bits), as kBf16Rtol is
// bf16's.
constexpr double kF16Rtol = 1.0 / 1024;

double ulp_rtol(DType t) {
  return t == DType::bf16 ? kBf16Rtol : kF16Rtol;
}

// bf16 and f16 storage: the fast kernels load and store 16 bits and compute in
// f32, as the reference does.
TEST_P(FastKernels, ElementwiseOn16BitStorage) {
  for (DType dt : {DType::bf16, DType::f16}) {
    const Shape shape{7, 45};  // not a multiple of the vector width
    const Tensor x = random_tensor(shape, 50, -3, 3, dt);
    const Tensor dy = random_tensor(shape, 51, -1, 1, dt);
    // run(backend, output, widen) runs the kernel on the 16-bit inputs, or on
    // their exact f32 widenings when widen is true.
    auto check = [&](const std::string& what, auto&& run) {
      const std::string label = what + " " + std::string(dtype_name(dt));
      Tensor got = nan_like(shape, dt), want = nan_like(shape, dt);
      run(*fast_, got, false);
      run(ref_, want, false);
      expect_close(got.to(DType::f32), want.to(DType::f32), ulp_rtol(dt), 1e-6, label);
      // Exactly the f32 kernel on the widened inputs, rounded once.
      Tensor wide = nan_like(shape, DType::f32);
      run(*fast_, wide, true);
      EXPECT_EQ(std::memcmp(got.raw(), wide.to(dt).raw(), got.nbytes()), 0) << label;
    };
    auto in = [](const Tensor& t, bool widen) { return widen ? t.to(DType::f32) : t; };
    for (UnaryOp op : {UnaryOp::relu, UnaryOp::gelu, UnaryOp::tanh, UnaryOp::sigmoid}) {
      check("unary", [&](KernelBackend& k, Tensor& y, bool w) { k.unary(op, in(x, w), y); });
      check("unary_backward", [&](KernelBackend& k, Tensor& dx, bool w) {
        k.unary_backward(op, in(x, w), Tensor(), in(dy, w), dx);
      });
    }
    const Tensor bias = random_tensor({45}, 52, -1, 1, dt);
    const Tensor scalar = random_tensor({}, 53, 0.5, 1, dt);
    for (BinaryOp op : {BinaryOp::add, BinaryOp::sub, BinaryOp::mul, BinaryOp::div}) {
      check("binary same shape",
            [&](KernelBackend& k, Tensor& c, bool w) { k.binary(op, in(x, w), in(dy, w), c); });
      check("binary bias",
            [&](KernelBackend& k, Tensor& c, bool w) { k.binary(op, in(x, w), in(bias, w), c); });
      check("binary scalar",
            [&](KernelBackend& k, Tensor& c, bool w) { k.binary(op, in(x, w), in(scalar, w), c); });
    }
    // The reference rounds the f32 result once.
    Tensor wide = Tensor::empty(shape, DType::f32), narrow = Tensor::empty(shape, dt);
    ref_.unary(UnaryOp::gelu, x.to(DType::f32), wide);
    ref_.unary(UnaryOp::gelu, x, narrow);
    EXPECT_EQ(std::memcmp(narrow.raw(), wide.to(dt).raw(), narrow.nbytes()), 0);
  }
}

// f16 stores round like f32_to_f16 at the edges of its range: subnormal
// results, overflow to inf, and inf/NaN passing through.
TEST_P(FastKernels, F16StorageRangeEdges) {
  const std::vector<float> vals{6.0e-8f, -3.0e-6f, 1.0e-5f, 6.1e-5f, 65504.0f, 65520.0f,
                                -7.0e4f, kInf,     -kInf,   kNaN,    0.0f,     -0.0f,
                                1.0f,    3.0e-7f,  2.0e4f,  -1.5f,   0.333f};
  const Shape shape{static_cast<int64_t>(vals.size())};
  Tensor x32 = Tensor::empty(shape, DType::f32);
  for (size_t i = 0; i < vals.size(); ++i) x32.data<float>()[i] = vals[i];
  // x * 1 + 0 and x * 3 move values across the subnormal and overflow edges.
  const Tensor x = x32.to(DType::f16);
  for (double factor : {1.0, 3.0, 1.0 / 3}) {
    const Tensor f = Tensor::full({}, DType::f16, factor);
    Tensor got = nan_like(shape, DType::f16), want = nan_like(shape, DType::f16);
    fast_->binary(BinaryOp::mul, x, f, got);
    ref_.binary(BinaryOp::mul, x, f, want);
    for (int64_t i = 0; i < got.numel(); ++i) {
      const double g = got.item(i), w = want.item(i);
      if (std::isnan(w)) {
        EXPECT_TRUE(std::isnan(g)) << "element " << i << " times " << factor;
      } else {
        EXPECT_EQ(got.data<f16>()[i].bits, want.data<f16>()[i].bits)
            << "element " << i << " (" << vals[static_cast<size_t>(i)] << ") times " << factor
            << ": fast " << g << ", reference " << w;
      }
    }
  }
}

TEST_P(FastKernels, SumToFrom16BitInto16BitOrF32) {
  for (DType dt : {DType::bf16, DType::f16}) {
    const Tensor x = random_tensor({300, 45}, 60, -1, 1, dt);
    Tensor want = Tensor::empty({45}, DType::f32);
    ref_.sum_to(x.to(DType::f32), want);
    for (DType out : {DType::f32, dt}) {
      Tensor got = nan_like({45}, out), ref_got = nan_like({45}, out);
      fast_->sum_to(x, got);
      ref_.sum_to(x, ref_got);
      const double rtol = out == DType::f32 ? 1e-5 : ulp_rtol(dt);
      const std::string what = fmt::format("sum_to {} -> {}", dtype_name(dt), dtype_name(out));
      expect_close(got.to(DType::f32), want, rtol, 1e-5, what);
      expect_close(ref_got.to(DType::f32), want, rtol, 1e-5, "reference " + what);
    }
    Tensor all = nan_like({}, DType::f32), all_want = Tensor::empty({}, DType::f32);
    fast_->sum_to(x, all);
    ref_.sum_to(x.to(DType::f32), all_want);
    expect_close(all, all_want, 1e-5, 1e-4, fmt::format("sum_to {} -> f32 scalar", dtype_name(dt)));
    // Into neither x's dtype nor f32.
    Tensor bad = Tensor::empty({45}, dt == DType::bf16 ? DType::f16 : DType::bf16);
    EXPECT_THROW(fast_->sum_to(x, bad), ShapeError);
  }
}

TEST_P(FastKernels, MatmulRejectsBadShapes) {
  Tensor c = Tensor::empty({3, 5}, DType::f32);
  EXPECT_THROW(fast_->matmul(random_tensor({3, 4}, 1), random_tensor({5, 5}, 2), c, {}),
               ShapeError);
  EXPECT_THROW(fast_->matmul(random_tensor({3, 4}, 1), random_tensor({4, 6}, 2), c, {}),
               ShapeError);
  Tensor c3 = Tensor::empty({2, 3, 5}, DType::f32);
  EXPECT_THROW(fast_->matmul(random_tensor({2, 3, 4}, 1), random_tensor({3, 4, 5}, 2), c3, {}),
               ShapeError);
}

TEST(FastKernelsEngines, EveryEngineAndLayoutChoiceMatchesAndTheMeasuredOneSettles) {
  KernelBackend& ref = kernels("reference");
  for (MatmulEngineChoice choice :
       {MatmulEngineChoice::onednn, MatmulEngineChoice::openblas, MatmulEngineChoice::measure}) {
    auto fast = make_fast_backend(ref, FastBackendOptions{choice});
    check_matmul(*fast, ref, {0, 45, 31, 60, false, true, false, 1, 1}, 40);
    check_matmul(*fast, ref, {5, 12, 20, 16, false, true, false, 0.25f, 0}, 41);
  }
  // Both convolution layouts, forced, give the reference's results.
  const Conv2dParams cp{1, 1, 1, 1};
  const Tensor x = random_tensor({3, 16, 9, 9}, 42), w = random_tensor({32, 16, 3, 3}, 43);
  const Tensor bias = random_tensor({32}, 44), dy = random_tensor({3, 32, 9, 9}, 45);
  Tensor y_want = Tensor::empty(dy.shape(), DType::f32),
         dx_want = Tensor::empty(x.shape(), DType::f32);
  Tensor dw_want = Tensor::empty(w.shape(), DType::f32), db_want = Tensor::empty({32}, DType::f32);
  ref.conv2d(x, w, bias, y_want, cp);
  ref.conv2d_backward_data(dy, w, dx_want, cp);
  ref.conv2d_backward_weight(dy, x, dw_want, db_want, cp);
  for (ConvLayoutChoice layout : {ConvLayoutChoice::plain, ConvLayoutChoice::blocked}) {
    auto fast = make_fast_backend(ref, FastBackendOptions{MatmulEngineChoice::measure, layout});
    Tensor y = nan_like(dy.shape()), dx = nan_like(x.shape()), dw = nan_like(w.shape()),
           db = nan_like({32});
    fast->conv2d(x, w, bias, y, cp);
    fast->conv2d_backward_data(dy, w, dx, cp);
    fast->conv2d_backward_weight(dy, x, dw, db, cp);
    const std::string what = layout == ConvLayoutChoice::plain ? "plain" : "blocked";
    expect_close(y, y_want, 1e-5, 1e-4, what + " conv forward");
    expect_close(dx, dx_want, 1e-5, 1e-4, what + " conv backward data");
    expect_close(dw, dw_want, 1e-5, 1e-3, what + " conv backward weight");
    expect_close(db, db_want, 1e-5, 1e-3, what + " conv backward bias");
  }

  // The measured engine, used directly, settles after its trials.
  fast::OneDnnContext ctx;
  fast::MatmulEngine engine(ctx, MatmulEngineChoice::measure);
  const Tensor a = random_tensor({40, 30}, 1), b = random_tensor({30, 20}, 2);
  Tensor c = Tensor::zeros({40, 20}, DType::f32);
  EXPECT_STREQ(engine.chosen_engine(a, b, {}, 1), "undecided");
  for (int i = 0; i < 2 * fast::MatmulEngine::kTrials; ++i) engine.run(a, b, c, {}, 1);
  const std::string chosen = engine.chosen_engine(a, b, {}, 1);
  EXPECT_TRUE(chosen == "onednn" || chosen == "openblas") << chosen;
}

// ---- element-wise ----

TEST_P(FastKernels, UnaryAndBackwardMatchReference) {
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{17}, int64_t{1000}, int64_t{70001}}) {
    Tensor x = random_tensor({n}, static_cast<uint32_t>(n) + 1, -6, 6);
    if (n >= 1000) {  // extremes: saturation, overflow of exp, signed zeros, NaN
      const float special[] = {0.0f,  -0.0f,  1e-7f,  -1e-7f,  0.3f,  -0.62f, 0.63f, 20.0f, -20.0f,
                               88.0f, -88.0f, 100.0f, -100.0f, 1e30f, -1e30f, kInf,  -kInf, kNaN};
      for (size_t i = 0; i < std::size(special); ++i)
        x.set_item(static_cast<int64_t>(i), special[i]);
    }
    const Tensor dy = random_tensor({n}, 99);
    for (UnaryOp op : {UnaryOp::relu, UnaryOp::gelu, UnaryOp::tanh, UnaryOp::sigmoid}) {
      const std::string what = fmt::format("op {} n {}", static_cast<int>(op), n);
      Tensor want = nan_like({n}), got = nan_like({n});
      ref_.unary(op, x, want);
      fast_->unary(op, x, got);
      expect_close(got, want, 2e-6, 1e-7, "unary " + what);
      Tensor dwant = nan_like({n}), dgot = nan_like({n});
      ref_.unary_backward(op, x, Tensor(), dy, dwant);
      fast_->unary_backward(op, x, got, dy, dgot);
      expect_close(dgot, dwant, 1e-5, 1e-6, "unary_backward " + what);
    }
  }
  Tensor x = random_tensor({3, 5}, 4), y = x.clone();
  fast_->unary(UnaryOp::tanh, y, y);  // in place
  Tensor want = Tensor::empty({3, 5}, DType::f32);
  ref_.unary(UnaryOp::tanh, x, want);
  expect_close(y, want, 2e-6, 1e-7, "unary in place");
  Tensor bad = Tensor::empty({5, 3}, DType::f32);
  EXPECT_THROW(fast_->unary(UnaryOp::relu, x, bad), ShapeError);
}

TEST_P(FastKernels, BinaryBroadcastsLikeReference) {
  struct Case {
    Shape a, b;
  };
  const std::vector<Case> cases = {
      {{7}, {7}}, {{4, 5}, {5}}, {{2, 3, 5}, {3, 5}}, {{2, 3, 5}, {}},    {{2, 3, 5}, {1}},
      {{1}, {1}}, {{0, 4}, {4}}, {{300, 257}, {257}}, {{70000}, {70000}}, {{40000, 3}, {3}}};
  for (const Case& c : cases) {
    const Tensor a = random_tensor(c.a, 1), b = random_tensor(c.b, 2, 0.5, 2.0);
    for (BinaryOp op : {BinaryOp::add, BinaryOp::sub, BinaryOp::mul, BinaryOp::div}) {
      Tensor want = nan_like(c.a), got = nan_like(c.a);
      ref_.binary(op, a, b, want);
      fast_->binary(op, a, b, got);
      expect_close(got, want, 1e-6, 0,
                   fmt::format("binary {} a {} b {}", static_cast<int>(op), c.a.str(), c.b.str()));
    }
  }
  Tensor a = random_tensor({4, 6}, 5), b = random_tensor({6}, 6);
  Tensor want = Tensor::empty({4, 6}, DType::f32);
  ref_.binary(BinaryOp::mul, a, b, want);
  fast_->binary(BinaryOp::mul, a, b, a);  // c aliases a
  expect_close(a, want, 1e-6, 0, "binary in place");
  Tensor c = Tensor::empty({4, 6}, DType::f32);
  EXPECT_THROW(fast_->binary(BinaryOp::add, a, random_tensor({4}, 1), c), ShapeError);
}

TEST_P(FastKernels, ScaleHonoursBeta) {
  const Tensor x = random_tensor({1001}, 3);
  Tensor want = nan_like({1001}), got = nan_like({1001});
  ref_.scale(x, want, 2.5);
  fast_->scale(x, got, 2.5);  // beta 0: the NaN in y must not leak
  expect_close(got, want, 1e-6, 0, "scale beta 0");
  Tensor y0 = random_tensor({1001}, 4);
  Tensor want2 = y0.clone(), got2 = y0.clone();
  ref_.scale(x, want2, -0.5, 0.75);
  fast_->scale(x, got2, -0.5, 0.75);
  expect_close(got2, want2, 1e-6, 1e-7, "scale beta 0.75");
}

TEST_P(FastKernels, SumToMatchesReference) {
  struct Case {
    Shape x, y;
  };
  const std::vector<Case> cases = {
      {{1000, 37}, {37}},       {{5, 3, 4}, {3, 4}}, {{5, 3, 4}, {}}, {{7}, {1}},
      {{300001}, {}},           {{0, 5}, {5}},       {{0}, {}},       {{6, 1}, {1}},
      {{4096, 64}, {4096, 64}}, {{20000, 3}, {3}}};
  for (const Case& c : cases) {
    const Tensor x = random_tensor(c.x, 8);
    Tensor want = nan_like(c.y), got = nan_like(c.y);
    ref_.sum_to(x, want);
    fast_->sum_to(x, got);
    expect_close(got, want, 1e-5, 1e-4, fmt::format("sum_to {} -> {}", c.x.str(), c.y.str()));
  }
  Tensor y = Tensor::empty({4}, DType::f32);
  EXPECT_THROW(fast_->sum_to(random_tensor({4, 3}, 1), y), ShapeError);
}

TEST_P(FastKernels, CastIsBitExact) {
  Tensor x = random_tensor({1, 50000}, 9, -1e5, 1e5);
  const float special[] = {0.0f,
                           -0.0f,
                           kInf,
                           -kInf,
                           kNaN,
                           1e-40f,
                           -3e-39f,
                           3.4e38f,
                           1.0f + 1.0f / 256,
                           1.0f + 3.0f / 256};
  for (size_t i = 0; i < std::size(special); ++i) x.set_item(static_cast<int64_t>(i), special[i]);
  for (DType to : {DType::bf16, DType::f16, DType::f64, DType::f32}) {
    Tensor want = Tensor::empty(x.shape(), to), got = Tensor::empty(x.shape(), to);
    ref_.cast(x, want);
    fast_->cast(x, got);
    EXPECT_EQ(std::memcmp(got.raw(), want.raw(), got.nbytes()), 0) << "f32 -> " << dtype_name(to);
    Tensor back_want = Tensor::empty(x.shape(), DType::f32),
           back = Tensor::empty(x.shape(), DType::f32);
    ref_.cast(want, back_want);
    fast_->cast(want, back);
    EXPECT_EQ(std::memcmp(back.raw(), back_want.raw(), back.nbytes()), 0)
        << dtype_name(to) << " -> f32";
  }
  // 16-bit NaN payloads (a signalling f16 NaN among them) widen bit for bit.
  Tensor h = Tensor::empty({40}, DType::f16);
  for (int64_t i = 0; i < 40; ++i) {
    h.data<f16>()[i] = f16{static_cast<uint16_t>(i % 2 ? 0x7d01 + i : 0x3c00 + i)};
  }
  Tensor hw = Tensor::empty({40}, DType::f32), hg = Tensor::empty({40}, DType::f32);
  ref_.cast(h, hw);
  fast_->cast(h, hg);
  EXPECT_EQ(std::memcmp(hg.raw(), hw.raw(), hg.nbytes()), 0) << "f16 NaN payloads";
  Tensor bad = Tensor::empty({50000}, DType::bf16);
  EXPECT_THROW(fast_->cast(x, bad), ShapeError);
}

TEST_P(FastKernels, PermuteMatchesReference) {
  struct Case {
    Shape x;
    std::vector<int> perm;
  };
  const std::vector<Case> cases = {{{2, 5, 3, 4}, {0, 2, 1, 3}},
                                   {{2, 5, 3, 4}, {0, 1, 3, 2}},
                                   {{2, 5, 3, 4}, {3, 2, 1, 0}},
                                   {{37, 53}, {1, 0}},
                                   {{3, 1, 7}, {2, 1, 0}},
                                   {{4, 6, 1}, {0, 2, 1}},
                                   {{5}, {0}},
                                   {{}, {}},
                                   {{0, 3}, {1, 0}},
                                   {{8, 128, 4, 16}, {0, 2, 1, 3}},
                                   {{32, 128, 64}, {0, 2, 1}},
                                   {{3, 17, 19, 5}, {1, 3, 0, 2}}};
  for (const Case& c : cases) {
    for (DType dt : {DType::f32, DType::bf16, DType::f64, DType::i32}) {
      const Tensor x = random_tensor(c.x, 3).to(dt);
      std::vector<int64_t> ys;
      for (int a : c.perm) ys.push_back(c.x[a]);
      Tensor want = Tensor::zeros(Shape(ys), dt), got = Tensor::zeros(Shape(ys), dt);
      ref_.permute(x, want, c.perm);
      fast_->permute(x, got, c.perm);
      EXPECT_EQ(std::memcmp(got.raw(), want.raw(), got.nbytes()), 0)
          << "permute " << x.desc() << " perm " << fmt::format("{}", fmt::join(c.perm, ","));
    }
  }
  Tensor y = Tensor::empty({3, 2}, DType::f32);
  EXPECT_THROW(fast_->permute(random_tensor({2, 3}, 1), y, {0, 0}), ShapeError);
  EXPECT_THROW(fast_->permute(random_tensor({2, 3}, 1), y, {0, 1}), ShapeError);
}

// ---- normalisation and losses ----

TEST_P(FastKernels, SoftmaxFamilyMatchesReference) {
  const std::vector<Shape> shapes = {{1}, {3, 1}, {4, 17}, {2, 3, 128}, {50, 1000}, {600, 64}};
  for (const Shape& s : shapes) {
    const Tensor x = random_tensor(s, 11, -10, 10), dy = random_tensor(s, 12);
    Tensor want = nan_like(s), got = nan_like(s);
    ref_.softmax(x, want, false);
    fast_->softmax(x, got, false);
    expect_close(got, want, 1e-5, 1e-7, "softmax " + s.str());
    Tensor dwant = nan_like(s), dgot = nan_like(s);
    ref_.softmax_backward(want, dy, dwant);
    fast_->softmax_backward(want, dy, dgot);
    expect_close(dgot, dwant, 1e-5, 1e-6, "softmax_backward " + s.str());
    ref_.log_softmax(x, want);
    fast_->log_softmax(x, got);
    expect_close(got, want, 1e-5, 1e-5, "log_softmax " + s.str());
    ref_.log_softmax_backward(want, dy, dwant);
    fast_->log_softmax_backward(want, dy, dgot);
    expect_close(dgot, dwant, 1e-5, 1e-5, "log_softmax_backward " + s.str());
  }
  // Causal: square and S > T (a cache of earlier positions), batched heads.
  for (const Shape& s : {Shape{5, 5}, Shape{2, 3, 4, 7}, Shape{4, 128, 128}, Shape{1, 1}}) {
    const Tensor x = random_tensor(s, 13, -5, 5);
    Tensor want = nan_like(s), got = nan_like(s);
    ref_.softmax(x, want, true);
    fast_->softmax(x, got, true);
    expect_close(got, want, 1e-5, 1e-7, "causal softmax " + s.str());
  }
  Tensor y = Tensor::empty({5, 3}, DType::f32);
  EXPECT_THROW(fast_->softmax(random_tensor({5, 3}, 1), y, true), ShapeError);  // S < T
}

TEST_P(FastKernels, LayerNormAndBackwardMatchReference) {
  const std::vector<Shape> shapes = {{1, 1}, {4, 7}, {3, 5, 64}, {1000, 33}, {256, 512}};
  for (const Shape& s : shapes) {
    const int64_t c = s[-1];
    const int64_t rows = s.numel() / c;
    const Tensor x = random_tensor(s, 21, -3, 5), gamma = random_tensor({c}, 22),
                 beta = random_tensor({c}, 23), dy = random_tensor(s, 24);
    std::vector<int64_t> lead = s.dims();
    lead.pop_back();
    Tensor y = nan_like(s), mean = nan_like(Shape(lead)), rstd = nan_like(Shape{rows});
    Tensor ry = nan_like(s), rmean = nan_like(Shape(lead)), rrstd = nan_like(Shape{rows});
    ref_.layer_norm(x, gamma, beta, 1e-5, ry, rmean, rrstd);
    fast_->layer_norm(x, gamma, beta, 1e-5, y, mean, rstd);
    expect_close(y, ry, 1e-5, 1e-5, "layer_norm y " + s.str());
    expect_close(mean, rmean, 1e-5, 1e-6, "layer_norm mean " + s.str());
    expect_close(rstd, rrstd, 1e-5, 1e-6, "layer_norm rstd " + s.str());
    Tensor dx = nan_like(s), dg = nan_like({c}), db = nan_like({c});
    Tensor rdx = nan_like(s), rdg = nan_like({c}), rdb = nan_like({c});
    ref_.layer_norm_backward(dy, x, gamma, rmean, rrstd, rdx, rdg, rdb);
    fast_->layer_norm_backward(dy, x, gamma, rmean, rrstd, dx, dg, db);
    const double tol_sum = 1e-5 * std::sqrt(static_cast<double>(rows));
    // dx subtracts nearly equal terms of size rstd |dy gamma| (exactly equal
    // when C = 1), so its absolute error scales with them.
    const double tol_dx = 1e-6 * max_abs(rrstd) * max_abs(dy) * max_abs(gamma);
    expect_close(dx, rdx, 1e-4, tol_dx, "layer_norm dx " + s.str());
    expect_close(dg, rdg, 1e-5, tol_sum, "layer_norm dgamma " + s.str());
    expect_close(db, rdb, 1e-5, tol_sum, "layer_norm dbeta " + s.str());
  }
  Tensor y = Tensor::empty({2, 0}, DType::f32), m = Tensor::empty({2}, DType::f32);
  EXPECT_THROW(fast_->layer_norm(Tensor::empty({2, 0}, DType::f32), Tensor::empty({0}, DType::f32),
                                 Tensor::empty({0}, DType::f32), 1e-5, y, m, m),
               ShapeError);
}

TEST_P(FastKernels, CrossEntropyMatchesReference) {
  for (const auto& [n, c] :
       {std::pair<int64_t, int64_t>{0, 10}, {1, 1}, {1, 5}, {128, 10}, {300, 257}, {64, 1000}}) {
    const Tensor logits = random_tensor({n, c}, 31, -8, 8);
    const Tensor labels = random_ids({n}, static_cast<int32_t>(c), 32);
    for (DType ldt : {DType::f32, DType::f64}) {
      Tensor want = nan_like({}, ldt), got = nan_like({}, ldt);
      ref_.cross_entropy(logits, labels, want);
      fast_->cross_entropy(logits, labels, got);
      expect_close(got, want, 1e-5, 1e-6, fmt::format("cross_entropy n {} c {}", n, c));
    }
    const Tensor dloss = Tensor::full({1}, DType::f32, 1.7);
    Tensor dwant = nan_like({n, c}), dgot = nan_like({n, c});
    ref_.cross_entropy_backward(logits, labels, dloss, dwant);
    fast_->cross_entropy_backward(logits, labels, dloss, dgot);
    expect_close(dgot, dwant, 1e-5, 1e-8, fmt::format("cross_entropy_backward n {} c {}", n, c));
  }
  Tensor labels = random_ids({4}, 3, 1);
  labels.data<int32_t>()[2] = 3;
  Tensor loss = Tensor::empty({}, DType::f32);
  EXPECT_THROW(fast_->cross_entropy(random_tensor({4, 3}, 1), labels, loss), ShapeError);
}

TEST_P(FastKernels, EmbeddingAndBackwardMatchReference) {
  const Tensor table = random_tensor({50, 24}, 41);
  for (const Shape& ids_shape : {Shape{}, Shape{7}, Shape{8, 128}, Shape{0}}) {
    const Tensor ids = random_ids(ids_shape, 50, 42);
    std::vector<int64_t> ys = ids_shape.dims();
    ys.push_back(24);
    Tensor want = nan_like(Shape(ys)), got = nan_like(Shape(ys));
    ref_.embedding(table, ids, want);
    fast_->embedding(table, ids, got);
    expect_close(got, want, 0, 0, "embedding " + ids_shape.str());
    const Tensor dy = random_tensor(Shape(ys), 43);
    Tensor dwant = nan_like({50, 24}), dgot = nan_like({50, 24});
    ref_.embedding_backward(dy, ids, dwant);
    fast_->embedding_backward(dy, ids, dgot);
    expect_close(dgot, dwant, 1e-5, 1e-5, "embedding_backward " + ids_shape.str());
  }
  // A wide table takes the column-split path; a bf16 table is copied as is.
  const Tensor wide = random_tensor({300, 2048}, 44);
  const Tensor ids = random_ids({64}, 300, 45);
  const Tensor dy = random_tensor({64, 2048}, 46);
  Tensor dwant = nan_like({300, 2048}), dgot = nan_like({300, 2048});
  ref_.embedding_backward(dy, ids, dwant);
  fast_->embedding_backward(dy, ids, dgot);
  expect_close(dgot, dwant, 1e-5, 1e-5, "embedding_backward wide");
  Tensor hw = Tensor::empty({64, 2048}, DType::bf16), hg = Tensor::empty({64, 2048}, DType::bf16);
  ref_.embedding(wide.to(DType::bf16), ids, hw);
  fast_->embedding(wide.to(DType::bf16), ids, hg);
  EXPECT_EQ(std::memcmp(hw.raw(), hg.raw(), hw.nbytes()), 0);
  Tensor bad_ids = random_ids({3}, 50, 1);
  bad_ids.data<int32_t>()[1] = 50;
  Tensor y = Tensor::empty({3, 24}, DType::f32);
  EXPECT_THROW(fast_->embedding(table, bad_ids, y), ShapeError);
}

// ---- convolution and pooling ----

struct ConvCase {
  int64_t n, ci, h, w, co, kh, kw;
  Conv2dParams p;
  bool bias;
};

// A random CSR matrix [n, m] with skewed degrees: every 7th row empty, every
// 50th a hub with many entries, duplicates and self-loops left in.
struct RandomCsr {
  Tensor row_ptr, col_idx;
};
RandomCsr random_csr(int64_t n, int64_t m, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int32_t> col(0, static_cast<int32_t>(m - 1));
  std::vector<int32_t> rp = {0}, ci;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t deg = i % 7 == 3 ? 0 : (i % 50 == 0 ? 200 : 1 + static_cast<int64_t>(gen() % 9));
    for (int64_t k = 0; k < deg; ++k) ci.push_back(col(gen));
    rp.push_back(static_cast<int32_t>(ci.size()));
  }
  RandomCsr r{Tensor::empty(Shape{n + 1}, DType::i32),
              Tensor::empty(Shape{static_cast<int64_t>(ci.size())}, DType::i32)};
  std::memcpy(r.row_ptr.raw(), rp.data(), rp.size() * 4);
  if (!ci.empty()) std::memcpy(r.col_idx.raw(), ci.data(), ci.size() * 4);
  return r;
}

TEST_P(FastKernels, SparseKernelsMatchReference) {
  // Small (one thread's work), a feature width with a vector tail, and large
  // enough for the threaded, edge-balanced row blocks.
  for (auto [n, m, f] : {std::tuple<int64_t, int64_t, int64_t>{5, 4, 3},
                         {300, 200, 37},
                         {3000, 2500, 64},
                         {2000, 2000, 130}}) {
    const std::string at = fmt::format("n={} m={} f={}", n, m, f);
    RandomCsr a = random_csr(n, m, static_cast<uint32_t>(n + f));
    const int64_t e = a.col_idx.numel();
    Tensor x = random_tensor({m, f}, 1), w = random_tensor({e}, 2), dy = random_tensor({n, f}, 3);
    for (const Tensor& wt : {Tensor(), w}) {
      const std::string what = at + (wt.defined() ? " weighted" : "");
      Tensor want = Tensor::empty({n, f}, DType::f32), got = Tensor::empty({n, f}, DType::f32);
      ref_.spmm(a.row_ptr, a.col_idx, wt, x, want);
      fast_->spmm(a.row_ptr, a.col_idx, wt, x, got);
      expect_close(got, want, 1e-5, 1e-5, "spmm " + what);
      Tensor dwant = Tensor::empty({m, f}, DType::f32), dgot = Tensor::full({m, f}, DType::f32, 7);
      ref_.spmm_transposed(a.row_ptr, a.col_idx, wt, dy, dwant);
      fast_->spmm_transposed(a.row_ptr, a.col_idx, wt, dy, dgot);
      expect_close(dgot, dwant, 1e-5, 1e-5, "spmm_transposed " + what);
    }
    Tensor swant = Tensor::empty({e}, DType::f32), sgot = Tensor::empty({e}, DType::f32);
    ref_.sddmm(a.row_ptr, a.col_idx, dy, x, swant);
    fast_->sddmm(a.row_ptr, a.col_idx, dy, x, sgot);
    expect_close(sgot, swant, 1e-5, 1e-5, "sddmm " + at);

    Tensor ymax = Tensor::empty({n, f}, DType::f32), ygot = Tensor::empty({n, f}, DType::f32);
    Tensor amax = Tensor::empty({n, f}, DType::i32), agot = Tensor::empty({n, f}, DType::i32);
    ref_.spmm_max(a.row_ptr, a.col_idx, x, ymax, amax);
    fast_->spmm_max(a.row_ptr, a.col_idx, x, ygot, agot);
    expect_close(ygot, ymax, 0, 0, "spmm_max " + at);
    expect_close(agot, amax, 0, 0, "spmm_max argmax " + at);
    Tensor dxw = Tensor::empty({m, f}, DType::f32), dxg = Tensor::full({m, f}, DType::f32, 3);
    ref_.spmm_max_backward(dy, amax, dxw);
    fast_->spmm_max_backward(dy, amax, dxg);
    expect_close(dxg, dxw, 1e-6, 1e-6, "spmm_max_backward " + at);

    Tensor sc = random_tensor({e}, 4, -8, 8), pw = Tensor::empty({e}, DType::f32),
           pg = Tensor::empty({e}, DType::f32);
    ref_.edge_softmax(a.row_ptr, sc, pw);
    fast_->edge_softmax(a.row_ptr, sc, pg);
    expect_close(pg, pw, 1e-5, 1e-6, "edge_softmax " + at);
    Tensor de = random_tensor({e}, 5), gw = Tensor::empty({e}, DType::f32),
           gg = Tensor::empty({e}, DType::f32);
    ref_.edge_softmax_backward(a.row_ptr, pw, de, gw);
    fast_->edge_softmax_backward(a.row_ptr, pw, de, gg);
    expect_close(gg, gw, 1e-5, 1e-6, "edge_softmax_backward " + at);
  }
}

TEST_P(FastKernels, SparseMaxTiesNaNAndEmptyRowsLikeReference) {
  // Row 0: cols 0, 1, 2 with x[1] == x[2] (tie: first wins) and a NaN in
  // column 1 of x[2]; row 1 empty.
  Tensor rp = Tensor::empty({3}, DType::i32), ci = Tensor::empty({3}, DType::i32);
  const int32_t rpv[] = {0, 3, 3}, civ[] = {0, 1, 2};
  std::memcpy(rp.raw(), rpv, sizeof rpv);
  std::memcpy(ci.raw(), civ, sizeof civ);
  Tensor x = Tensor::empty({3, 2}, DType::f32);
  const float xv[] = {0.5f, 1.0f, 2.0f, 3.0f, 2.0f, kNaN};
  std::memcpy(x.raw(), xv, sizeof xv);
  for (KernelBackend* k : {static_cast<KernelBackend*>(&ref_), fast_.get()}) {
    Tensor y = Tensor::empty({2, 2}, DType::f32), am = Tensor::empty({2, 2}, DType::i32);
    k->spmm_max(rp, ci, x, y, am);
    EXPECT_EQ(y.item(0), 2.0f) << k->name();
    EXPECT_EQ(am.data<int32_t>()[0], 1) << k->name() << ": a tie keeps the first entry";
    EXPECT_TRUE(std::isnan(y.item(1))) << k->name();
    EXPECT_EQ(am.data<int32_t>()[1], 2) << k->name();
    EXPECT_EQ(y.item(2), 0.0f) << k->name();
    EXPECT_EQ(am.data<int32_t>()[2], -1) << k->name() << ": an empty row has no argmax";
  }
}

TEST_P(FastKernels, SparseKernelsRejectMalformedCsr) {
  Tensor x = random_tensor({4, 2}, 1), y = Tensor::empty({2, 2}, DType::f32);
  auto csr = [](std::vector<int32_t> rp, std::vector<int32_t> ci) {
    RandomCsr r{Tensor::empty({static_cast<int64_t>(rp.size())}, DType::i32),
                Tensor::empty({static_cast<int64_t>(ci.size())}, DType::i32)};
    std::memcpy(r.row_ptr.raw(), rp.data(), rp.size() * 4);
    if (!ci.empty()) std::memcpy(r.col_idx.raw(), ci.data(), ci.size() * 4);
    return r;
  };
  const std::pair<RandomCsr, std::string> bad[] = {
      {csr({0, 1, 2}, {0, 4}), "col_idx[1] = 4 is out of range [0, 4)"},
      {csr({0, 2, 1}, {0, 1}), "row_ptr decreases at row 1"},
      {csr({1, 1, 2}, {0, 1}), "row_ptr[0] is 1"},
      {csr({0, 1, 3}, {0, 1}), "row_ptr[2] = 3 but there are 2 entries"},
  };
  for (KernelBackend* k : {static_cast<KernelBackend*>(&ref_), fast_.get()}) {
    for (const auto& [a, msg] : bad) {
      try {
        k->spmm(a.row_ptr, a.col_idx, Tensor(), x, y);
        ADD_FAILURE() << k->name() << ": no error for " << msg;
      } catch (const ShapeError& err) {
        EXPECT_NE(std::string(err.what()).find(msg), std::string::npos)
            << k->name() << ": " << err.what();
      }
    }
  }
}

TEST_P(FastKernels, ConvolutionMatchesReference) {
  const std::vector<ConvCase> cases = {
      {4, 1, 28, 28, 8, 3, 3, {1, 1, 1, 1}, true},    // CNN layer 1, smaller batch
      {2, 32, 14, 14, 64, 3, 3, {1, 1, 1, 1}, true},  // CNN layer 2
      {3, 5, 11, 9, 7, 3, 2, {2, 1, 0, 1}, false},    // odd sizes, rectangular kernel
      {2, 3, 8, 8, 4, 5, 5, {2, 2, 2, 2}, true},      // stride 2 with padding
      {1, 1, 1, 1, 1, 1, 1, {1, 1, 0, 0}, true},
      {2, 4, 7, 7, 3, 3, 3, {3, 3, 0, 0}, false},  // stride leaves a remainder
  };
  uint32_t seed = 50;
  for (const ConvCase& cc : cases) {
    const int64_t oh = (cc.h + 2 * cc.p.pad_h - cc.kh) / cc.p.stride_h + 1;
    const int64_t ow = (cc.w + 2 * cc.p.pad_w - cc.kw) / cc.p.stride_w + 1;
    const Tensor x = random_tensor({cc.n, cc.ci, cc.h, cc.w}, ++seed);
    const Tensor w = random_tensor({cc.co, cc.ci, cc.kh, cc.kw}, ++seed);
    const Tensor bias = cc.bias ? random_tensor({cc.co}, ++seed) : Tensor();
    const Tensor dy = random_tensor({cc.n, cc.co, oh, ow}, ++seed);
    const Shape ys{cc.n, cc.co, oh, ow};
    const std::string what = fmt::format("conv x {} w {}", x.desc(), w.desc());
    const double tol = 1e-5 * std::sqrt(static_cast<double>(cc.ci * cc.kh * cc.kw * cc.n));
    Tensor y_want = nan_like(ys), dx_want = nan_like(x.shape()), dw_want = nan_like(w.shape());
    Tensor db_want = cc.bias ? nan_like({cc.co}) : Tensor();
    ref_.conv2d(x, w, bias, y_want, cc.p);
    ref_.conv2d_backward_data(dy, w, dx_want, cc.p);
    ref_.conv2d_backward_weight(dy, x, dw_want, db_want, cc.p);
    // Enough calls to go through both layout variants' trials and then the choice.
    for (int call = 0; call < 7; ++call) {
      Tensor y = nan_like(ys), dx = nan_like(x.shape()), dw = nan_like(w.shape());
      Tensor db = cc.bias ? nan_like({cc.co}) : Tensor();
      fast_->conv2d(x, w, bias, y, cc.p);
      fast_->conv2d_backward_data(dy, w, dx, cc.p);
      fast_->conv2d_backward_weight(dy, x, dw, db, cc.p);
      expect_close(y, y_want, 1e-5, tol, what + " forward");
      expect_close(dx, dx_want, 1e-5, tol, what + " backward data");
      expect_close(dw, dw_want, 1e-5, tol * std::sqrt(static_cast<double>(oh * ow)),
                   what + " backward weight");
      if (cc.bias) expect_close(db, db_want, 1e-5, tol * oh, what + " backward bias");
    }
  }
  // Empty batch: handled by the fallback, same result.
  Tensor y0 = Tensor::empty({0, 2, 3, 3}, DType::f32);
  fast_->conv2d(Tensor::empty({0, 1, 3, 3}, DType::f32), random_tensor({2, 1, 1, 1}, 1), Tensor(),
                y0, {});
  Tensor y = Tensor::empty({1, 2, 3, 3}, DType::f32);
  EXPECT_THROW(fast_->conv2d(random_tensor({1, 3, 3, 3}, 1), random_tensor({2, 1, 1, 1}, 2),
                             Tensor(), y, {}),
               ShapeError);
}

TEST_P(FastKernels, MaxPoolMatchesReference) {
  struct Case {
    Shape x;
    Pool2dParams p;
  };
  const std::vector<Case> cases = {
      {{4, 8, 28, 28}, {2, 2, 2, 2, 0, 0}}, {{2, 3, 13, 11}, {3, 3, 2, 2, 1, 1}},
      {{1, 2, 7, 9}, {2, 3, 1, 2, 1, 0}},   {{1, 1, 1, 1}, {1, 1, 1, 1, 0, 0}},
      {{2, 2, 5, 200}, {2, 2, 2, 2, 0, 0}}, {{128, 32, 28, 28}, {2, 2, 2, 2, 0, 0}},
      {{2, 3, 12, 12}, {3, 3, 2, 2, 1, 1}},  // output sizes halve, but windows overlap
      {{2, 3, 9, 35}, {2, 2, 2, 2, 0, 0}}};  // odd sizes: last row and column unused
  for (const Case& c : cases) {
    // Coarse values make ties common; a few NaNs test the NaN rule.
    Tensor x = random_tensor(c.x, 61, -3, 3);
    float* px = x.data<float>();
    for (int64_t i = 0; i < x.numel(); ++i) px[i] = std::round(px[i]);
    for (int64_t i = 5; i < x.numel(); i += 97) px[i] = kNaN;
    const int64_t oh = (c.x[2] + 2 * c.p.pad_h - c.p.kernel_h) / c.p.stride_h + 1;
    const int64_t ow = (c.x[3] + 2 * c.p.pad_w - c.p.kernel_w) / c.p.stride_w + 1;
    const Shape ys{c.x[0], c.x[1], oh, ow};
    Tensor y_want = nan_like(ys), y = nan_like(ys);
    Tensor a_want = Tensor::full(ys, DType::i32, -7), a = Tensor::full(ys, DType::i32, -7);
    ref_.max_pool2d(x, y_want, a_want, c.p);
    fast_->max_pool2d(x, y, a, c.p);
    expect_close(y, y_want, 0, 0, "max_pool2d " + c.x.str());
    EXPECT_EQ(std::memcmp(a.raw(), a_want.raw(), a.nbytes()), 0) << "argmax " << c.x.str();
    const Tensor dy = random_tensor(ys, 62);
    Tensor dx_want = nan_like(c.x), dx = nan_like(c.x);
    ref_.max_pool2d_backward(dy, a_want, dx_want);
    fast_->max_pool2d_backward(dy, a_want, dx);
    expect_close(dx, dx_want, 1e-6, 0, "max_pool2d_backward " + c.x.str());
  }
  // An argmax that points outside its own 2x2 window is legal (any index into
  // the plane): the one-pass 2x2 backward must notice and scatter instead.
  Tensor odd_arg = Tensor::zeros({2, 3, 4, 5}, DType::i32);
  for (int64_t i = 0; i < odd_arg.numel(); ++i) {
    odd_arg.data<int32_t>()[i] = static_cast<int32_t>((i * 7) % 90);
  }
  const Tensor g = random_tensor({2, 3, 4, 5}, 63);
  Tensor dx_want = nan_like({2, 3, 9, 10}), dx_got = nan_like({2, 3, 9, 10});
  ref_.max_pool2d_backward(g, odd_arg, dx_want);
  fast_->max_pool2d_backward(g, odd_arg, dx_got);
  expect_close(dx_got, dx_want, 1e-6, 0, "max_pool2d_backward with foreign argmax");

  Tensor a = Tensor::full({1, 1, 1, 1}, DType::i32, 4);
  Tensor dx = Tensor::empty({1, 1, 2, 2}, DType::f32);
  EXPECT_THROW(fast_->max_pool2d_backward(random_tensor({1, 1, 1, 1}, 1), a, dx), ShapeError);
}

// ---- dtypes the fast kernels do not compute, and threads ----

TEST_P(FastKernels, OtherDtypesGoToTheFallback) {
  const Tensor x = random_tensor({6, 5}, 71, -2, 2, DType::f64);
  Tensor want = nan_like({6, 5}, DType::f64), got = nan_like({6, 5}, DType::f64);
  ref_.unary(UnaryOp::gelu, x, want);
  fast_->unary(UnaryOp::gelu, x, got);
  expect_close(got, want, 0, 0, "f64 gelu");
  const Tensor b = random_tensor({5, 4}, 72, -2, 2, DType::f64);
  Tensor cw = nan_like({6, 4}, DType::f64), cg = nan_like({6, 4}, DType::f64);
  ref_.matmul(x, b, cw, {});
  fast_->matmul(x, b, cg, {});
  expect_close(cg, cw, 0, 0, "f64 matmul");
  Tensor bad = Tensor::empty({6, 5}, DType::f64);
  EXPECT_THROW(fast_->unary(UnaryOp::relu, random_tensor({6, 5}, 1), bad), ShapeError);
}

TEST(FastKernelsEngines, PinnedChoicesAreProcessWideInstancesPerOptions) {
  const FastBackendOptions pinned{MatmulEngineChoice::openblas, ConvLayoutChoice::plain};
  KernelBackend& a = kernels("fast", pinned);
  EXPECT_EQ(&a, &kernels("fast", pinned));
  EXPECT_NE(&a, &kernels("fast"));
  EXPECT_EQ(&kernels("reference", pinned), &kernels("reference"));
  EXPECT_EQ(parse_matmul_engine("onednn"), MatmulEngineChoice::onednn);
  EXPECT_EQ(parse_conv_layout("blocked"), ConvLayoutChoice::blocked);
  EXPECT_THROW(parse_matmul_engine("mkl"), ConfigError);
  EXPECT_THROW(parse_conv_layout("nhwc"), ConfigError);
}

TEST(FastKernelsThreads, RejectsZeroThreadsAndGivesTheSameResultsAtTwo) {
  KernelBackend& ref = kernels("reference");
  auto one = make_fast_backend(ref);
  auto two = make_fast_backend(ref);
  two->set_num_threads(2);
  EXPECT_THROW(one->set_num_threads(0), ConfigError);
  const Tensor x = random_tensor({512, 300}, 81);
  Tensor y1 = Tensor::empty({512, 300}, DType::f32), y2 = Tensor::empty({512, 300}, DType::f32);
  one->softmax(x, y1, false);
  two->softmax(x, y2, false);
  EXPECT_EQ(std::memcmp(y1.raw(), y2.raw(), y1.nbytes()), 0);
}

TEST(FastKernelsThreads, ConcurrentCallersShareOneBackendSafely) {
  // Ranks run as threads share kernels("fast"): each caller has its own
  // primitives and blocked buffers, so concurrent convolutions and matmuls of
  // the same shapes stay correct.
  KernelBackend& ref = kernels("reference");
  auto fast = make_fast_backend(ref);
  const Conv2dParams cp{1, 1, 1, 1};
  const Tensor x = random_tensor({4, 8, 10, 10}, 91), w = random_tensor({16, 8, 3, 3}, 92);
  const Tensor a = random_tensor({33, 70}, 93), b = random_tensor({70, 21}, 94);
  Tensor y_want = Tensor::empty({4, 16, 10, 10}, DType::f32),
         c_want = Tensor::empty({33, 21}, DType::f32);
  ref.conv2d(x, w, Tensor(), y_want, cp);
  ref.matmul(a, b, c_want, {});
  std::vector<int> bad(3, 0);
  std::vector<std::thread> callers;
  for (size_t t = 0; t < bad.size(); ++t) {
    callers.emplace_back([&, t] {
      for (int i = 0; i < 20; ++i) {
        Tensor y = nan_like(y_want.shape()), c = nan_like(c_want.shape());
        fast->conv2d(x, w, Tensor(), y, cp);
        fast->matmul(a, b, c, {});
        for (int64_t j = 0; j < y.numel(); ++j) {
          if (!(std::fabs(y.item(j) - y_want.item(j)) <= 1e-4)) ++bad[t];
        }
        for (int64_t j = 0; j < c.numel(); ++j) {
          if (!(std::fabs(c.item(j) - c_want.item(j)) <= 1e-4)) ++bad[t];
        }
      }
    });
  }
  for (std::thread& th : callers) th.join();
  for (size_t t = 0; t < bad.size(); ++t) EXPECT_EQ(bad[t], 0) << "caller " << t;
}

INSTANTIATE_TEST_SUITE_P(Threads, FastKernels, ::testing::Values(1, 2),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return std::to_string(i.param) + "threads";
                         });

}  // namespace
}  // namespace mt
