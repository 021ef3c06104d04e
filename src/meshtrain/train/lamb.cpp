// LAMB: Adam moments with bias correction, and a per-parameter trust ratio
// ||w|| / ||r|| over the whole parameter (see optimizer.h).
#include <algorithm>
#include <cmath>

#include "meshtrain/train/optimizer.h"

namespace mt {

namespace {

using detail::check_option;

// Owned by whoever called make_lamb; see Optimizer for threading and the
// NormReducer contract.
class Lamb final : public Optimizer {
 public:
  explicit Lamb(const LambOptions& o) : o_(o) {
    check_option(o.beta1 >= 0 && o.beta1 < 1, "lamb", "beta1", o.beta1, "in [0, 1)");
    check_option(o.beta2 >= 0 && o.beta2 < 1, "lamb", "beta2", o.beta2, "in [0, 1)");
    check_option(std::isfinite(o.eps) && o.eps > 0, "lamb", "eps", o.eps, "finite and > 0");
    check_option(std::isfinite(o.weight_decay) && o.weight_decay >= 0, "lamb", "weight_decay",
                 o.weight_decay, "finite and >= 0");
  }

  std::string_view name() const override { return "lamb"; }
  std::vector<std::string> state_kinds() const override { return {"exp_avg", "exp_avg_sq"}; }

 protected:
  void update(std::span<ParamRef> params, double lr) override {
    // Pass 1 updates the moments and measures ||w||^2 and ||r||^2 without
    // storing r; after the reduction, pass 2 recomputes r from the stored
    // moments, which costs a few flops but no parameter-sized scratch buffer.
    norms_.assign(2 * params.size(), 0.0);
    coef_.resize(params.size());
    const auto b1 = static_cast<float>(o_.beta1);
    const auto b2 = static_cast<float>(o_.beta2);
    for (size_t k = 0; k < params.size(); ++k) {
      ParamRef& p = params[k];
      const auto t = static_cast<double>(next_step(p));
      Coef& c = coef_[k];
      c.inv_bc1 = static_cast<float>(1.0 / (1.0 - std::pow(o_.beta1, t)));
      c.inv_bc2 = static_cast<float>(1.0 / (1.0 - std::pow(o_.beta2, t)));
      c.wd = static_cast<float>(o_.decay.applies(p) ? o_.weight_decay : 0.0);
      const float* w = p.param.data<float>();
      const float* g = p.grad.data<float>();
      float* m = slot(p, "exp_avg");
      float* v = slot(p, "exp_avg_sq");
      const int64_t n = p.param.numel();
      const bool adapt = adapts(p);
      // Blocks of r go through a small buffer so that the moment update and
      // r vectorise and the squared norm reuses sum_squares' partial sums.
      float r[kBlock];
      double rr = 0;
      for (int64_t b = 0; b < n; b += kBlock) {
        const int64_t len = std::min<int64_t>(kBlock, n - b);
        for (int64_t j = 0; j < len; ++j) {
          const int64_t i = b + j;
          m[i] = b1 * m[i] + (1.0f - b1) * g[i];
          v[i] = b2 * v[i] + (1.0f - b2) * g[i] * g[i];
          r[j] = direction(c, m[i], v[i], w[i]);
        }
        if (adapt) rr += sum_squares(r, len);
      }
      if (!adapt || !p.counted) continue;
      norms_[2 * k] = sum_squares(w, n);
      norms_[2 * k + 1] = rr;
    }
    reduce(norms_);

    for (size_t k = 0; k < params.size(); ++k) {
      ParamRef& p = params[k];
      double trust = 1.0;
      if (adapts(p)) {
        const double wn = std::sqrt(norms_[2 * k]);
        const double rn = std::sqrt(norms_[2 * k + 1]);
        if (wn > 0 && rn > 0) trust = wn / rn;
      }
      const auto scale = static_cast<float>(lr * trust);
      float* w = p.param.data<float>();
      const float* m = slot(p, "exp_avg");
      const float* v = slot(p, "exp_avg_sq");
      const int64_t n = p.param.numel();
      for (int64_t i = 0; i < n; ++i) w[i] -= scale * direction(coef_[k], m[i], v[i], w[i]);
    }
  }

 private:
  struct Coef {
    float inv_bc1, inv_bc2, wd;
  };

  // r for one element; both passes must use this same expression.
  float direction(const Coef& c, float m, float v, float w) const {
    return (m * c.inv_bc1) / (std::sqrt(v * c.inv_bc2) + static_cast<float>(o_.eps)) + c.wd * w;
  }

  bool adapts(const ParamRef& p) const {
    return !o_.exclude_from_adaptation || o_.decay.applies(p);
  }

  static constexpr int64_t kBlock = 256;

  LambOptions o_;
  std::vector<double> norms_;  // scratch, reused across steps
  std::vector<Coef> coef_;
};

}  // namespace

std::unique_ptr<Optimizer> make_lamb(const LambOptions& options) {
  return std::make_unique<Lamb>(options);
}

}  // namespace mt
