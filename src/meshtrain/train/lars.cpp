// LARS: SGD with momentum whose step per parameter is scaled by a layer-wise
// trust ratio computed from norms of the whole parameter (see optimizer.h).
#include <cmath>

#include "meshtrain/train/optimizer.h"

namespace mt {

namespace {

using detail::check_option;

// Owned by whoever called make_lars; see Optimizer for threading and the
// NormReducer contract.
class Lars final : public Optimizer {
 public:
  explicit Lars(const LarsOptions& o) : o_(o) {
    check_option(std::isfinite(o.momentum) && o.momentum >= 0, "lars", "momentum", o.momentum,
                 "finite and >= 0");
    check_option(std::isfinite(o.weight_decay) && o.weight_decay >= 0, "lars", "weight_decay",
                 o.weight_decay, "finite and >= 0");
    check_option(std::isfinite(o.trust_coefficient) && o.trust_coefficient > 0, "lars",
                 "trust_coefficient", o.trust_coefficient, "finite and > 0");
    check_option(std::isfinite(o.eps) && o.eps >= 0, "lars", "eps", o.eps, "finite and >= 0");
    if (o.nesterov && o.momentum <= 0) {
      throw ConfigError(fmt::format("lars: nesterov needs momentum > 0, got {}", o.momentum));
    }
  }

  std::string_view name() const override { return "lars"; }
  std::vector<std::string> state_kinds() const override { return {"momentum_buffer"}; }

 protected:
  void update(std::span<ParamRef> params, double lr) override {
    // One reduction per step for all parameters: [||w||^2, ||g||^2] each.
    // Whether a parameter adapts depends only on its name and rank, so every
    // rank fills the same entries.
    norms_.assign(2 * params.size(), 0.0);
    for (size_t k = 0; k < params.size(); ++k) {
      const ParamRef& p = params[k];
      if (!adapts(p) || !p.counted) continue;
      norms_[2 * k] = sum_squares(p.param.data<float>(), p.param.numel());
      norms_[2 * k + 1] = sum_squares(p.grad.data<float>(), p.grad.numel());
    }
    reduce(norms_);

    const auto flr = static_cast<float>(lr);
    const auto mom = static_cast<float>(o_.momentum);
    for (size_t k = 0; k < params.size(); ++k) {
      ParamRef& p = params[k];
      next_step(p);
      const double wd = o_.decay.applies(p) ? o_.weight_decay : 0.0;
      double trust = 1.0;
      if (adapts(p)) {
        const double wn = std::sqrt(norms_[2 * k]);
        const double gn = std::sqrt(norms_[2 * k + 1]);
        if (wn > 0 && gn > 0) trust = o_.trust_coefficient * wn / (gn + wd * wn + o_.eps);
      }
      const auto ft = static_cast<float>(trust);
      const auto fwd = static_cast<float>(wd);
      float* w = p.param.data<float>();
      const float* g = p.grad.data<float>();
      const int64_t n = p.param.numel();
      if (o_.momentum == 0) {
        for (int64_t i = 0; i < n; ++i) w[i] -= flr * (ft * (g[i] + fwd * w[i]));
        continue;
      }
      bool first = false;
      float* buf = slot(p, "momentum_buffer", &first);
      const float b_keep = first ? 0.0f : mom;
      for (int64_t i = 0; i < n; ++i) {
        const float d = ft * (g[i] + fwd * w[i]);
        buf[i] = b_keep * buf[i] + d;
        w[i] -= flr * (o_.nesterov ? d + mom * buf[i] : buf[i]);
      }
    }
  }

 private:
  bool adapts(const ParamRef& p) const {
    return !o_.exclude_from_adaptation || o_.decay.applies(p);
  }

  LarsOptions o_;
  std::vector<double> norms_;  // scratch, reused across steps
};

}  // namespace

std::unique_ptr<Optimizer> make_lars(const LarsOptions& options) {
  return std::make_unique<Lars>(options);
}

}  // namespace mt
