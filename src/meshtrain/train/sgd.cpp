// SGD with momentum, dampening, Nesterov and coupled weight decay, following
// torch.optim.SGD's formulas (see optimizer.h).
#include <cmath>

#include "meshtrain/train/optimizer.h"

namespace mt {

namespace {

using detail::check_option;

// Owned by whoever called make_sgd; see Optimizer for threading.
class Sgd final : public Optimizer {
 public:
  explicit Sgd(const SgdOptions& o) : o_(o) {
    check_option(std::isfinite(o.momentum) && o.momentum >= 0, "sgd", "momentum", o.momentum,
                 "finite and >= 0");
    check_option(std::isfinite(o.dampening) && o.dampening >= 0 && o.dampening <= 1, "sgd",
                 "dampening", o.dampening, "in [0, 1]");
    check_option(std::isfinite(o.weight_decay) && o.weight_decay >= 0, "sgd", "weight_decay",
                 o.weight_decay, "finite and >= 0");
    if (o.nesterov && (o.momentum <= 0 || o.dampening != 0)) {
      throw ConfigError(
          fmt::format("sgd: nesterov needs momentum > 0 and dampening == 0, got "
                      "momentum {} and dampening {}",
                      o.momentum, o.dampening));
    }
  }

  std::string_view name() const override { return "sgd"; }
  std::vector<std::string> state_kinds() const override { return {"momentum_buffer"}; }

 protected:
  void update(std::span<ParamRef> params, double lr) override {
    const auto flr = static_cast<float>(lr);
    const auto mom = static_cast<float>(o_.momentum);
    const auto keep = static_cast<float>(1.0 - o_.dampening);
    for (ParamRef& p : params) {
      next_step(p);
      const auto wd = static_cast<float>(o_.decay.applies(p) ? o_.weight_decay : 0.0);
      float* w = p.param.data<float>();
      const float* g = p.grad.data<float>();
      const int64_t n = p.param.numel();
      if (o_.momentum == 0) {
        for (int64_t i = 0; i < n; ++i) w[i] -= flr * (g[i] + wd * w[i]);
        continue;
      }
      bool first = false;
      float* buf = slot(p, "momentum_buffer", &first);
      // PyTorch starts the buffer at the first gradient, undamped.
      const float b_keep = first ? 0.0f : mom;
      const float g_keep = first ? 1.0f : keep;
      for (int64_t i = 0; i < n; ++i) {
        const float d = g[i] + wd * w[i];
        buf[i] = b_keep * buf[i] + g_keep * d;
        const float u = o_.nesterov ? d + mom * buf[i] : buf[i];
        w[i] -= flr * u;
      }
    }
  }

 private:
  SgdOptions o_;
};

}  // namespace

std::unique_ptr<Optimizer> make_sgd(const SgdOptions& options) {
  return std::make_unique<Sgd>(options);
}

}  // namespace mt
