// Optimizers against independent double-precision reference updates written
// from PyTorch's documented formulas, hand-computed values, slice invariance
// (a parameter stepped whole equals the same parameter stepped as per-rank
// slices, with the NormReducer supplying whole-parameter norms), state
// round-trips, and option/input validation.
#include <gtest/gtest.h>

#include <barrier>
#include <cmath>
#include <mutex>
#include <thread>

#include "meshtrain/train/optimizer.h"

namespace mt {
namespace {

constexpr int kSteps = 5;
const double kLrs[kSteps] = {0.1, 0.05, 0.08, 0.02, 0.04};

// Two parameters: a matrix (decayed by the default filter) and a bias (not).
struct Spec {
  std::string name;
  Shape shape;
};
const std::vector<Spec> kSpecs = {{"layer.w", {3, 5}}, {"layer.b", {5}}};

double init_value(size_t p, int64_t i) {
  return 0.8 * std::cos(0.9 * static_cast<double>(i) + p);
}
double grad_value(int step, size_t p, int64_t i) {
  return std::sin(1.3 * static_cast<double>(i) + 0.7 * p + 2.1 * step) * (0.5 + 0.1 * step);
}

using Values = std::vector<std::vector<double>>;  // [param][element]

Values initial_values() {
  Values v;
  for (size_t p = 0; p < kSpecs.size(); ++p) {
    std::vector<double> w(static_cast<size_t>(kSpecs[p].shape.numel()));
    for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(init_value(p, i));
    v.push_back(w);
  }
  return v;
}

Values grads_at(int step) {
  Values g;
  for (size_t p = 0; p < kSpecs.size(); ++p) {
    std::vector<double> x(static_cast<size_t>(kSpecs[p].shape.numel()));
    for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(grad_value(step, p, i));
    g.push_back(x);
  }
  return g;
}

bool decayed(size_t p, int min_rank) {
  return kSpecs[p].shape.rank() >= min_rank;
}

double norm(const std::vector<double>& x) {
  double s = 0;
  for (double v : x) s += v * v;
  return std::sqrt(s);
}

// Runs `opt` for kSteps over whole parameters; returns the final values.
Values run_whole(Optimizer& opt) {
  std::vector<Tensor> w, g;
  for (size_t p = 0; p < kSpecs.size(); ++p) {
    w.push_back(Tensor::empty(kSpecs[p].shape, DType::f32));
    g.push_back(Tensor::empty(kSpecs[p].shape, DType::f32));
    for (int64_t i = 0; i < w[p].numel(); ++i) w[p].set_item(i, init_value(p, i));
  }
  for (int s = 0; s < kSteps; ++s) {
    std::vector<ParamRef> refs;
    for (size_t p = 0; p < kSpecs.size(); ++p) {
      for (int64_t i = 0; i < g[p].numel(); ++i) g[p].set_item(i, grad_value(s, p, i));
      refs.push_back({kSpecs[p].name, w[p], g[p]});
    }
    opt.step(refs, kLrs[s]);
  }
  Values out;
  for (const Tensor& t : w) {
    std::vector<double> v;
    for (int64_t i = 0; i < t.numel(); ++i) v.push_back(t.item(i));
    out.push_back(v);
  }
  return out;
}

void expect_close(const Values& got, const Values& want, double rel, const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t p = 0; p < got.size(); ++p) {
    ASSERT_EQ(got[p].size(), want[p].size());
    for (size_t i = 0; i < got[p].size(); ++i) {
      EXPECT_NEAR(got[p][i], want[p][i], rel * std::max(1.0, std::abs(want[p][i])))
          << what << ": " << kSpecs[p].name << "[" << i << "]";
    }
  }
}

// --- references, in double, one parameter at a time -----------------------

Values ref_sgd(double mom, double damp, bool nesterov, double wd, int min_rank) {
  Values w = initial_values();
  Values buf(w.size());
  for (int s = 0; s < kSteps; ++s) {
    Values g = grads_at(s);
    for (size_t p = 0; p < w.size(); ++p) {
      if (decayed(p, min_rank)) {
        for (size_t i = 0; i < w[p].size(); ++i) g[p][i] += wd * w[p][i];
      }
      std::vector<double> d = g[p];
      if (mom != 0) {
        if (s == 0) {
          buf[p] = g[p];
        } else {
          for (size_t i = 0; i < w[p].size(); ++i)
            buf[p][i] = mom * buf[p][i] + (1 - damp) * g[p][i];
        }
        for (size_t i = 0; i < w[p].size(); ++i)
          d[i] = nesterov ? g[p][i] + mom * buf[p][i] : buf[p][i];
      }
      for (size_t i = 0; i < w[p].size(); ++i) w[p][i] -= kLrs[s] * d[i];
    }
  }
  return w;
}

Values ref_adamw(double b1, double b2, double eps, double wd, int min_rank) {
  Values w = initial_values();
  Values m(w.size()), v(w.size());
  for (size_t p = 0; p < w.size(); ++p) {
    m[p].assign(w[p].size(), 0.0);
    v[p].assign(w[p].size(), 0.0);
  }
  for (int s = 0; s < kSteps; ++s) {
    const Values g = grads_at(s);
    const int t = s + 1;
    for (size_t p = 0; p < w.size(); ++p) {
      const double lam = decayed(p, min_rank) ? wd : 0.0;
      for (size_t i = 0; i < w[p].size(); ++i) {
        w[p][i] -= kLrs[s] * lam * w[p][i];
        m[p][i] = b1 * m[p][i] + (1 - b1) * g[p][i];
        v[p][i] = b2 * v[p][i] + (1 - b2) * g[p][i] * g[p][i];
        const double mhat = m[p][i] / (1 - std::pow(b1, t));
        const double vhat = v[p][i] / (1 - std::pow(b2, t));
        w[p][i] -= kLrs[s] * mhat / (std::sqrt(vhat) + eps);
      }
    }
  }
  return w;
}

Values ref_lars(double mom, double wd, double eta, double eps, bool exclude, int min_rank) {
  Values w = initial_values();
  Values buf(w.size());
  for (int s = 0; s < kSteps; ++s) {
    const Values g = grads_at(s);
    for (size_t p = 0; p < w.size(); ++p) {
      const bool dec = decayed(p, min_rank);
      const double lam = dec ? wd : 0.0;
      double trust = 1;
      if (dec || !exclude) {
        const double wn = norm(w[p]), gn = norm(g[p]);
        if (wn > 0 && gn > 0) trust = eta * wn / (gn + lam * wn + eps);
      }
      std::vector<double> d(w[p].size());
      for (size_t i = 0; i < d.size(); ++i) d[i] = trust * (g[p][i] + lam * w[p][i]);
      if (s == 0)
        buf[p] = d;
      else
        for (size_t i = 0; i < d.size(); ++i) buf[p][i] = mom * buf[p][i] + d[i];
      for (size_t i = 0; i < d.size(); ++i) w[p][i] -= kLrs[s] * buf[p][i];
    }
  }
  return w;
}

Values ref_lamb(double b1, double b2, double eps, double wd, int min_rank) {
  Values w = initial_values();
  Values m(w.size()), v(w.size());
  for (size_t p = 0; p < w.size(); ++p) {
    m[p].assign(w[p].size(), 0.0);
    v[p].assign(w[p].size(), 0.0);
  }
  for (int s = 0; s < kSteps; ++s) {
    const Values g = grads_at(s);
    const int t = s + 1;
    for (size_t p = 0; p < w.size(); ++p) {
      const bool dec = decayed(p, min_rank);
      std::vector<double> r(w[p].size());
      for (size_t i = 0; i < r.size(); ++i) {
        m[p][i] = b1 * m[p][i] + (1 - b1) * g[p][i];
        v[p][i] = b2 * v[p][i] + (1 - b2) * g[p][i] * g[p][i];
        const double mhat = m[p][i] / (1 - std::pow(b1, t));
        const double vhat = v[p][i] / (1 - std::pow(b2, t));
        r[i] = mhat / (std::sqrt(vhat) + eps) + (dec ? wd * w[p][i] : 0.0);
      }
      double trust = 1;
      if (dec) {  // exclude_from_adaptation: the bias keeps trust 1
        const double wn = norm(w[p]), rn = norm(r);
        if (wn > 0 && rn > 0) trust = wn / rn;
      }
      for (size_t i = 0; i < r.size(); ++i) w[p][i] -= kLrs[s] * trust * r[i];
    }
  }
  return w;
}

// --- reference comparisons --------------------------------------------------

TEST(Sgd, PlainWithWeightDecayOnEveryParameterMatchesReference) {
  SgdOptions o;
  o.weight_decay = 0.1;
  o.decay.min_rank = 0;  // PyTorch's default: decay everything
  auto opt = make_sgd(o);
  expect_close(run_whole(*opt), ref_sgd(0, 0, false, 0.1, 0), 1e-6, "sgd");
}

TEST(Sgd, MomentumWithDampeningMatchesReference) {
  SgdOptions o;
  o.momentum = 0.9;
  o.dampening = 0.3;
  o.weight_decay = 0.05;  // default filter: only the matrix decays
  auto opt = make_sgd(o);
  expect_close(run_whole(*opt), ref_sgd(0.9, 0.3, false, 0.05, 2), 1e-6, "sgd momentum");
}

TEST(Sgd, NesterovMatchesReference) {
  SgdOptions o;
  o.momentum = 0.8;
  o.nesterov = true;
  o.weight_decay = 0.02;
  auto opt = make_sgd(o);
  expect_close(run_whole(*opt), ref_sgd(0.8, 0, true, 0.02, 2), 1e-6, "sgd nesterov");
}

TEST(Sgd, NesterovTwoStepsByHand) {
  // w = 1, g = 0.5, lr = 0.1, momentum 0.9, weight decay 0.1:
  // step 1: d = 0.6, buf = 0.6, u = 0.6 + 0.54 = 1.14, w = 0.886
  // step 2: d = 0.5886, buf = 0.54 + 0.5886 = 1.1286, u = 0.5886 + 1.01574 = 1.60434,
  //         w = 0.886 - 0.160434 = 0.725566
  SgdOptions o;
  o.momentum = 0.9;
  o.nesterov = true;
  o.weight_decay = 0.1;
  o.decay.min_rank = 0;
  auto opt = make_sgd(o);
  Tensor w = Tensor::full({1}, DType::f32, 1.0);
  Tensor g = Tensor::full({1}, DType::f32, 0.5);
  std::vector<ParamRef> refs = {{"w", w, g}};
  opt->step(refs, 0.1);
  EXPECT_NEAR(w.item(0), 0.886, 1e-6);
  opt->step(refs, 0.1);
  EXPECT_NEAR(w.item(0), 0.725566, 1e-6);
}

TEST(AdamW, MatchesReferenceWithBiasCorrectionAndDecoupledDecay) {
  AdamWOptions o;
  o.beta1 = 0.8;
  o.beta2 = 0.95;
  o.eps = 1e-6;
  o.weight_decay = 0.1;
  auto opt = make_adamw(o);
  expect_close(run_whole(*opt), ref_adamw(0.8, 0.95, 1e-6, 0.1, 2), 2e-6, "adamw");
}

TEST(AdamW, FirstStepMovesEachWeightByLrTimesSignByHand) {
  // After bias correction the first step's m/sqrt(v) is g/|g|, so
  // w1 = w0 * (1 - lr * wd) - lr * sign(g) (up to eps).
  AdamWOptions o;
  o.weight_decay = 0.5;
  o.decay.min_rank = 0;
  auto opt = make_adamw(o);
  Tensor w = Tensor::full({2}, DType::f32, 2.0);
  Tensor g = Tensor::empty({2}, DType::f32);
  g.set_item(0, 3.0);
  g.set_item(1, -0.25);
  std::vector<ParamRef> refs = {{"w", w, g}};
  opt->step(refs, 0.01);
  EXPECT_NEAR(w.item(0), 2.0 * 0.995 - 0.01, 1e-6);
  EXPECT_NEAR(w.item(1), 2.0 * 0.995 + 0.01, 1e-6);
}

TEST(Lars, MatchesReferenceWithTrustRatioAndExcludedBias) {
  LarsOptions o;
  o.momentum = 0.9;
  o.weight_decay = 0.01;
  o.trust_coefficient = 0.02;
  o.eps = 1e-9;
  auto opt = make_lars(o);
  expect_close(run_whole(*opt), ref_lars(0.9, 0.01, 0.02, 1e-9, true, 2), 2e-6, "lars");
}

TEST(Lars, AdaptsEveryParameterWhenNotExcluded) {
  LarsOptions o;
  o.momentum = 0.5;
  o.weight_decay = 0.01;
  o.trust_coefficient = 0.05;
  o.exclude_from_adaptation = false;
  auto opt = make_lars(o);
  expect_close(run_whole(*opt), ref_lars(0.5, 0.01, 0.05, 0, false, 2), 2e-6, "lars all");
}

TEST(Lars, TrustRatioByHand) {
  // w = [3, 4] (||w|| = 5), g = [0, 1] (||g|| = 1), eta 0.1, wd 0.2:
  // trust = 0.1 * 5 / (1 + 0.2 * 5) = 0.25; d = 0.25 * ([0, 1] + 0.2 * [3, 4]) = [0.15, 0.45]
  // no momentum, lr 1: w = [2.85, 3.55]
  LarsOptions o;
  o.momentum = 0;
  o.weight_decay = 0.2;
  o.trust_coefficient = 0.1;
  o.decay.min_rank = 0;
  auto opt = make_lars(o);
  Tensor w = Tensor::empty({2}, DType::f32);
  w.set_item(0, 3);
  w.set_item(1, 4);
  Tensor g = Tensor::zeros({2}, DType::f32);
  g.set_item(1, 1);
  std::vector<ParamRef> refs = {{"w", w, g}};
  opt->step(refs, 1.0);
  EXPECT_NEAR(w.item(0), 2.85, 1e-6);
  EXPECT_NEAR(w.item(1), 3.55, 1e-6);
}

TEST(Lamb, MatchesReferenceWithBiasCorrectionAndTrustRatio) {
  LambOptions o;
  o.beta1 = 0.85;
  o.beta2 = 0.99;
  o.eps = 1e-6;
  o.weight_decay = 0.02;
  auto opt = make_lamb(o);
  expect_close(run_whole(*opt), ref_lamb(0.85, 0.99, 1e-6, 0.02, 2), 2e-6, "lamb");
}

TEST(Lamb, FirstStepByHand) {
  // Step 1: r = g/|g| + wd * w = [1, -1] + 0.5 * [3, 4] = [2.5, 1] per element,
  // ||w|| = 5, ||r|| = sqrt(7.25), w -= lr * 5 / sqrt(7.25) * r.
  LambOptions o;
  o.weight_decay = 0.5;
  o.decay.min_rank = 0;
  auto opt = make_lamb(o);
  Tensor w = Tensor::empty({2}, DType::f32);
  w.set_item(0, 3);
  w.set_item(1, 4);
  Tensor g = Tensor::empty({2}, DType::f32);
  g.set_item(0, 0.3);
  g.set_item(1, -2.0);
  std::vector<ParamRef> refs = {{"w", w, g}};
  opt->step(refs, 0.1);
  const double k = 0.1 * 5 / std::sqrt(7.25);
  EXPECT_NEAR(w.item(0), 3 - k * 2.5, 1e-5);
  EXPECT_NEAR(w.item(1), 4 - k * 1.0, 1e-5);
}

// --- slice invariance -------------------------------------------------------

// An all-reduce (sum) among `n` threads: what a sharded caller's NormReducer
// does over its communicator.
class ThreadSum {
 public:
  explicit ThreadSum(int n) : n_(n), bar_(n) {}
  void operator()(std::span<double> v) {
    bar_.arrive_and_wait();  // the previous round's results have been read
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (arrived_++ % n_ == 0) acc_.assign(v.size(), 0.0);
      EXPECT_EQ(acc_.size(), v.size()) << "ranks reduce vectors of different lengths";
      for (size_t i = 0; i < std::min(v.size(), acc_.size()); ++i) acc_[i] += v[i];
    }
    bar_.arrive_and_wait();
    for (size_t i = 0; i < std::min(v.size(), acc_.size()); ++i) v[i] = acc_[i];
    ++calls_;
  }
  int64_t calls() const { return calls_; }

 private:
  int n_;
  std::barrier<> bar_;
  std::mutex mu_;
  std::vector<double> acc_;
  int64_t arrived_ = 0;
  std::atomic<int64_t> calls_{0};
};

// The parameters concatenated into one flat buffer, split among `ranks` as
// ZeRO would split it (uneven; a rank may hold no part of a parameter), each
// rank stepping its slices with its own optimizer.
Values run_sharded(const std::function<std::unique_ptr<Optimizer>()>& make,
                   const std::vector<int64_t>& bounds, int64_t* reducer_calls) {
  const int ranks = static_cast<int>(bounds.size()) - 1;
  int64_t total = 0;
  std::vector<int64_t> offset;
  for (const Spec& s : kSpecs) {
    offset.push_back(total);
    total += s.shape.numel();
  }
  Tensor flat_w = Tensor::empty({total}, DType::f32);
  Tensor flat_g = Tensor::empty({total}, DType::f32);
  for (size_t p = 0; p < kSpecs.size(); ++p) {
    for (int64_t i = 0; i < kSpecs[p].shape.numel(); ++i)
      flat_w.set_item(offset[p] + i, init_value(p, i));
  }
  ThreadSum sum(ranks);
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto opt = make();
        opt->set_norm_reducer([&](std::span<double> v) { sum(v); });
        float* w = flat_w.data<float>();
        float* g = flat_g.data<float>();
        for (int s = 0; s < kSteps; ++s) {
          std::vector<ParamRef> refs;
          for (size_t p = 0; p < kSpecs.size(); ++p) {
            const int64_t lo =
                std::clamp(bounds[r], offset[p], offset[p] + kSpecs[p].shape.numel());
            const int64_t hi =
                std::clamp(bounds[r + 1], offset[p], offset[p] + kSpecs[p].shape.numel());
            for (int64_t i = lo; i < hi; ++i)
              g[i] = static_cast<float>(grad_value(s, p, i - offset[p]));
            refs.push_back({kSpecs[p].name, Tensor::wrap(w + lo, {hi - lo}, DType::f32),
                            Tensor::wrap(g + lo, {hi - lo}, DType::f32), kSpecs[p].shape.rank()});
          }
          opt->step(refs, kLrs[s]);
        }
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  *reducer_calls = sum.calls();
  Values out;
  for (size_t p = 0; p < kSpecs.size(); ++p) {
    std::vector<double> v;
    for (int64_t i = 0; i < kSpecs[p].shape.numel(); ++i) v.push_back(flat_w.item(offset[p] + i));
    out.push_back(v);
  }
  return out;
}

struct SliceCase {
  std::string name;
  std::function<std::unique_ptr<Optimizer>()> make;
  bool uses_reducer;
};

class SliceInvariance : public ::testing::TestWithParam<int> {};

std::vector<SliceCase> slice_cases() {
  SgdOptions sgd;
  sgd.momentum = 0.9;
  sgd.nesterov = true;
  sgd.weight_decay = 0.05;
  AdamWOptions adamw;
  adamw.weight_decay = 0.1;
  LarsOptions lars;
  lars.weight_decay = 0.01;
  lars.trust_coefficient = 0.02;
  LambOptions lamb;
  lamb.weight_decay = 0.02;
  return {{"sgd", [=] { return make_sgd(sgd); }, false},
          {"adamw", [=] { return make_adamw(adamw); }, false},
          {"lars", [=] { return make_lars(lars); }, true},
          {"lamb", [=] { return make_lamb(lamb); }, true}};
}

TEST_P(SliceInvariance, ShardedStepsEqualWholeSteps) {
  const SliceCase c = slice_cases()[static_cast<size_t>(GetParam())];
  const Values whole = run_whole(*c.make());
  // 20 elements: "layer.w" is [0, 15), "layer.b" is [15, 20). Rank 1 holds
  // the tail of w and the head of b; rank 0 holds no part of b, rank 2 none
  // of w, and in the four-rank split rank 2 holds nothing at all.
  for (const std::vector<int64_t>& bounds :
       {std::vector<int64_t>{0, 20}, std::vector<int64_t>{0, 7, 20},
        std::vector<int64_t>{0, 6, 17, 20}, std::vector<int64_t>{0, 9, 16, 16, 20}}) {
    int64_t calls = 0;
    const Values sharded = run_sharded(c.make, bounds, &calls);
    expect_close(sharded, whole, 1e-6, fmt::format("{} over {} ranks", c.name, bounds.size() - 1));
    EXPECT_EQ(calls, c.uses_reducer ? kSteps * static_cast<int64_t>(bounds.size() - 1) : 0)
        << c.name << ": one reduction per rank and step";
  }
}

INSTANTIATE_TEST_SUITE_P(AllOptimizers, SliceInvariance, ::testing::Range(0, 4), [](const auto& p) {
  return slice_cases()[static_cast<size_t>(p.param)].name;
});

TEST(SliceInvariance, LarsWithoutReducerSeesOnlyItsSliceAndDiffers) {
  // Guards the test above: without the reducer the trust ratio comes from
  // the slice's own norms, which must change the result.
  LarsOptions o;
  o.weight_decay = 0.01;
  o.trust_coefficient = 0.02;
  Tensor whole_w = Tensor::empty({15}, DType::f32);
  Tensor g = Tensor::empty({15}, DType::f32);
  for (int64_t i = 0; i < 15; ++i) {
    whole_w.set_item(i, init_value(0, i));
    g.set_item(i, grad_value(0, 0, i));
  }
  Tensor slice_w = whole_w.clone();
  std::vector<ParamRef> whole = {{"layer.w", whole_w, g, 2}};
  make_lars(o)->step(whole, kLrs[0]);
  std::vector<ParamRef> slice = {{"layer.w", Tensor::wrap(slice_w.data<float>(), {7}, DType::f32),
                                  Tensor::wrap(g.data<float>(), {7}, DType::f32), 2}};
  make_lars(o)->step(slice, kLrs[0]);
  EXPECT_GT(std::abs(whole_w.item(0) - slice_w.item(0)), 1e-6);
}

// --- state ------------------------------------------------------------------

TEST(OptimizerState, SaveAndLoadMidRunContinuesExactly) {
  for (const SliceCase& c : slice_cases()) {
    auto straight = c.make();
    const Values want = run_whole(*straight);

    // Same run, but the optimizer is replaced by a fresh one loaded from a
    // deep copy of the state after two steps.
    std::vector<Tensor> w, g;
    for (size_t p = 0; p < kSpecs.size(); ++p) {
      w.push_back(Tensor::empty(kSpecs[p].shape, DType::f32));
      g.push_back(Tensor::empty(kSpecs[p].shape, DType::f32));
      for (int64_t i = 0; i < w[p].numel(); ++i) w[p].set_item(i, init_value(p, i));
    }
    auto opt = c.make();
    for (int s = 0; s < kSteps; ++s) {
      if (s == 2) {
        OptimizerState st = opt->state();
        for (auto& [k, t] : st.tensors) t = t.clone();
        EXPECT_EQ(st.steps.at("layer.w"), 2);
        opt = c.make();
        opt->load_state(st);
      }
      std::vector<ParamRef> refs;
      for (size_t p = 0; p < kSpecs.size(); ++p) {
        for (int64_t i = 0; i < g[p].numel(); ++i) g[p].set_item(i, grad_value(s, p, i));
        refs.push_back({kSpecs[p].name, w[p], g[p]});
      }
      opt->step(refs, kLrs[s]);
    }
    for (size_t p = 0; p < kSpecs.size(); ++p) {
      for (int64_t i = 0; i < w[p].numel(); ++i) {
        EXPECT_EQ(w[p].item(i), want[p][static_cast<size_t>(i)]) << c.name;
      }
    }
  }
}

TEST(OptimizerState, NamesStateByParameterAndKind) {
  auto opt = make_adamw({});
  Tensor w = Tensor::zeros({2, 2}, DType::f32), g = Tensor::zeros({2, 2}, DType::f32);
  std::vector<ParamRef> refs = {{"fc.w", w, g}};
  opt->step(refs, 0.1);
  const OptimizerState st = opt->state();
  ASSERT_EQ(st.tensors.size(), 2u);
  EXPECT_TRUE(st.tensors.contains("fc.w.exp_avg"));
  EXPECT_TRUE(st.tensors.contains("fc.w.exp_avg_sq"));
  EXPECT_EQ(st.steps.at("fc.w"), 1);
}

TEST(OptimizerState, RejectsForeignKindsAndMisSizedState) {
  auto opt = make_adamw({});
  OptimizerState foreign;
  foreign.tensors["w.momentum_buffer"] = Tensor::zeros({4}, DType::f32);
  try {
    opt->load_state(foreign);
    FAIL() << "expected CheckpointError";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("w.momentum_buffer"), std::string::npos) << e.what();
  }
  OptimizerState wrong_size;
  wrong_size.tensors["w.exp_avg"] = Tensor::zeros({3}, DType::f32);
  opt->load_state(wrong_size);
  Tensor w = Tensor::zeros({4}, DType::f32), g = Tensor::zeros({4}, DType::f32);
  std::vector<ParamRef> refs = {{"w", w, g}};
  try {
    opt->step(refs, 0.1);
    FAIL() << "expected CheckpointError";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("'w.exp_avg' has 3 elements"), std::string::npos)
        << e.what();
  }
}

// --- validation -------------------------------------------------------------

TEST(OptimizerFactory, BuildsByNameAndRejectsUnknownNames) {
  for (std::string_view n : {"sgd", "adamw", "lars", "lamb"}) {
    EXPECT_EQ(make_optimizer(n, {})->name(), n);
  }
  try {
    make_optimizer("adam", {});
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("'adam'"), std::string::npos) << e.what();
  }
}

TEST(OptimizerFactory, RejectsBadOptionsNamingTheField) {
  SgdOptions s;
  s.nesterov = true;
  EXPECT_THROW(make_sgd(s), ConfigError);
  AdamWOptions a;
  a.beta1 = 1.0;
  try {
    make_adamw(a);
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("beta1"), std::string::npos) << e.what();
  }
  LarsOptions l;
  l.trust_coefficient = 0;
  EXPECT_THROW(make_lars(l), ConfigError);
  LambOptions m;
  m.eps = -1;
  EXPECT_THROW(make_lamb(m), ConfigError);
}

TEST(OptimizerStep, RejectsBadParametersAndLearningRates) {
  auto opt = make_sgd({});
  Tensor w = Tensor::zeros({4}, DType::f32), g3 = Tensor::zeros({3}, DType::f32);
  std::vector<ParamRef> mismatch = {{"w", w, g3}};
  EXPECT_THROW(opt->step(mismatch, 0.1), ShapeError);
  Tensor wd = Tensor::zeros({4}, DType::f64);
  std::vector<ParamRef> not_f32 = {{"w", wd, wd}};
  EXPECT_THROW(opt->step(not_f32, 0.1), ShapeError);
  Tensor g = Tensor::zeros({4}, DType::f32);
  std::vector<ParamRef> twice = {{"w", w, g}, {"w", w, g}};
  EXPECT_THROW(opt->step(twice, 0.1), ConfigError);
  std::vector<ParamRef> ok = {{"w", w, g}};
  EXPECT_THROW(opt->step(ok, -1.0), ConfigError);
  EXPECT_THROW(opt->step(ok, std::nan("")), ConfigError);
}

TEST(DecayFilter, ExcludesLowRankAndNamedParameters) {
  DecayFilter f;
  f.exclude_names = {"norm"};
  Tensor m = Tensor::zeros({2, 2}, DType::f32), v = Tensor::zeros({2}, DType::f32);
  EXPECT_TRUE(f.applies({"fc.w", m, m}));
  EXPECT_FALSE(f.applies({"fc.b", v, v}));
  EXPECT_FALSE(f.applies({"layer_norm.w", m, m}));
  EXPECT_TRUE(f.applies({"fc.w.shard", v, v, 2}));  // a 1-D slice of a matrix
}

}  // namespace
}  // namespace mt
