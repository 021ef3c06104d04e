// AdamW with decoupled weight decay and bias correction, following
// torch.optim.AdamW's formulas (see optimizer.h).
#include <cmath>

#include "meshtrain/train/optimizer.h"

namespace mt {

namespace {

using detail::check_option;

// Owned by whoever called make_adamw; see Optimizer for threading.
class AdamW final : public Optimizer {
 public:
  explicit AdamW(const AdamWOptions& o) : o_(o) {
    check_option(o.beta1 >= 0 && o.beta1 < 1, "adamw", "beta1", o.beta1, "in [0, 1)");
    check_option(o.beta2 >= 0 && o.beta2 < 1, "adamw", "beta2", o.beta2, "in [0, 1)");
    check_option(std::isfinite(o.eps) && o.eps > 0, "adamw", "eps", o.eps, "finite and > 0");
    check_option(std::isfinite(o.weight_decay) && o.weight_decay >= 0, "adamw", "weight_decay",
                 o.weight_decay, "finite and >= 0");
  }

  std::string_view name() const override { return "adamw"; }
  std::vector<std::string> state_kinds() const override { return {"exp_avg", "exp_avg_sq"}; }

 protected:
  void update(std::span<ParamRef> params, double lr) override {
    const auto b1 = static_cast<float>(o_.beta1);
    const auto b2 = static_cast<float>(o_.beta2);
    const auto eps = static_cast<float>(o_.eps);
    for (ParamRef& p : params) {
      const auto t = static_cast<double>(next_step(p));
      // Scalars in double as PyTorch computes them in Python, then one
      // rounding to f32 for the element loop.
      const double wd = o_.decay.applies(p) ? o_.weight_decay : 0.0;
      const auto shrink = static_cast<float>(1.0 - lr * wd);
      const auto step_size = static_cast<float>(lr / (1.0 - std::pow(o_.beta1, t)));
      const auto inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(o_.beta2, t)));
      float* w = p.param.data<float>();
      const float* g = p.grad.data<float>();
      float* m = slot(p, "exp_avg");
      float* v = slot(p, "exp_avg_sq");
      const int64_t n = p.param.numel();
      for (int64_t i = 0; i < n; ++i) {
        m[i] = b1 * m[i] + (1.0f - b1) * g[i];
        v[i] = b2 * v[i] + (1.0f - b2) * g[i] * g[i];
        const float denom = std::sqrt(v[i]) * inv_bc2_sqrt + eps;
        w[i] = w[i] * shrink - step_size * m[i] / denom;
      }
    }
  }

 private:
  AdamWOptions o_;
};

}  // namespace

std::unique_ptr<Optimizer> make_adamw(const AdamWOptions& options) {
  return std::make_unique<AdamW>(options);
}

}  // namespace mt
