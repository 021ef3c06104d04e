#include "meshtrain/train/optimizer.h"

#include <algorithm>
#include <cmath>
#include <set>

#include <fmt/ranges.h>

#include "meshtrain/tensor/memory_stats.h"

namespace mt {

bool DecayFilter::applies(const ParamRef& p) const {
  if (p.whole_rank() < min_rank) return false;
  return std::none_of(exclude_names.begin(), exclude_names.end(), [&](const std::string& s) {
    return !s.empty() && p.name.find(s) != std::string::npos;
  });
}

double sum_squares(const float* x, int64_t n) {
  // Four partial sums let the compiler keep several adds in flight without
  // reassociating the double accumulation itself.
  double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += static_cast<double>(x[i]) * x[i];
    s1 += static_cast<double>(x[i + 1]) * x[i + 1];
    s2 += static_cast<double>(x[i + 2]) * x[i + 2];
    s3 += static_cast<double>(x[i + 3]) * x[i + 3];
  }
  for (; i < n; ++i) s0 += static_cast<double>(x[i]) * x[i];
  return (s0 + s1) + (s2 + s3);
}

void detail::check_option(bool ok, std::string_view optimizer, std::string_view field, double value,
                          std::string_view want) {
  if (!ok)
    throw ConfigError(fmt::format("{}: {} must be {}, got {}", optimizer, field, want, value));
}

void Optimizer::step(std::span<ParamRef> params, double lr) {
  if (!std::isfinite(lr) || lr < 0) {
    throw ConfigError(fmt::format("{}: learning rate must be finite and >= 0, got {}", name(), lr));
  }
  std::set<std::string_view> seen;
  for (const ParamRef& p : params) {
    if (!seen.insert(p.name).second) {
      throw ConfigError(fmt::format("{}: parameter '{}' passed twice to one step", name(), p.name));
    }
    if (p.param.dtype() != DType::f32 || p.grad.dtype() != DType::f32) {
      throw ShapeError(
          fmt::format("{}: parameter '{}' must be f32 with an f32 gradient, got {} "
                      "and {}",
                      name(), p.name, p.param.desc(), p.grad.desc()));
    }
    if (p.param.numel() != p.grad.numel()) {
      throw ShapeError(fmt::format("{}: parameter '{}' is {} but its gradient is {}", name(),
                                   p.name, p.param.desc(), p.grad.desc()));
    }
    if (!p.param.defined() || !p.grad.defined()) {
      throw ShapeError(fmt::format("{}: parameter '{}' has no storage", name(), p.name));
    }
  }
  update(params, lr);
}

void Optimizer::load_state(const OptimizerState& state) {
  const std::vector<std::string> kinds = state_kinds();
  std::map<std::string, Tensor> slots;
  for (const auto& [key, t] : state.tensors) {
    const size_t dot = key.rfind('.');
    const std::string kind = dot == std::string::npos ? std::string() : key.substr(dot + 1);
    if (dot == 0 || std::find(kinds.begin(), kinds.end(), kind) == kinds.end()) {
      throw CheckpointError(
          fmt::format("{}: optimizer state '{}' is not '<param>.<kind>' with a "
                      "kind this optimizer keeps ({})",
                      name(), key, fmt::join(kinds, ", ")));
    }
    if (t.dtype() != DType::f32 || !t.defined()) {
      throw CheckpointError(
          fmt::format("{}: optimizer state '{}' must be f32, got {}", name(), key, t.desc()));
    }
    MemoryScope tag(MemoryCategory::optimizer);
    slots[key] = t.clone();
  }
  for (const auto& [param, n] : state.steps) {
    if (n < 0) {
      throw CheckpointError(
          fmt::format("{}: step count of parameter '{}' is negative ({})", name(), param, n));
    }
  }
  slots_ = std::move(slots);
  steps_ = state.steps;
}

float* Optimizer::slot(const ParamRef& p, const std::string& kind, bool* created) {
  const std::string key = p.name + "." + kind;
  auto it = slots_.find(key);
  if (it == slots_.end()) {
    MemoryScope tag(MemoryCategory::optimizer);
    it = slots_.emplace(key, Tensor::zeros({p.param.numel()}, DType::f32)).first;
    if (created != nullptr) *created = true;
  } else {
    if (it->second.numel() != p.param.numel()) {
      throw CheckpointError(
          fmt::format("{}: optimizer state '{}' has {} elements but parameter "
                      "'{}' has {} here",
                      name(), key, it->second.numel(), p.name, p.param.numel()));
    }
    if (created != nullptr) *created = false;
  }
  return it->second.data<float>();
}

int64_t Optimizer::state_bytes() const {
  int64_t n = 0;
  for (const auto& [key, t] : slots_) n += static_cast<int64_t>(t.nbytes());
  return n;
}

int64_t Optimizer::next_step(const ParamRef& p) {
  return ++steps_[p.name];
}

void Optimizer::reduce(std::span<double> values) const {
  if (reducer_ && !values.empty()) reducer_(values);
}

std::unique_ptr<Optimizer> make_optimizer(std::string_view name, const OptimizerOptions& options) {
  if (name == "sgd") return make_sgd(options.sgd);
  if (name == "adamw") return make_adamw(options.adamw);
  if (name == "lars") return make_lars(options.lars);
  if (name == "lamb") return make_lamb(options.lamb);
  throw ConfigError(
      fmt::format("unknown optimizer '{}' (expected one of sgd, adamw, lars, lamb)", name));
}

}  // namespace mt
