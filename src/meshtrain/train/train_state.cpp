#include "meshtrain/train/train_state.h"

#include <charconv>

#include "meshtrain/train/checkpoint.h"

namespace mt {

namespace {

constexpr std::string_view kParam = "param/";
constexpr std::string_view kOptim = "optim/";
constexpr std::string_view kOptimStep = "optim_step/";
constexpr std::string_view kExtra = "extra/";

// The parameter an optimizer state key "<param>.<kind>" belongs to.
std::string owner_of(const std::string& key) {
  const size_t dot = key.rfind('.');
  return dot == std::string::npos ? std::string() : key.substr(0, dot);
}

template <class T>
T parse_number(const CheckpointReader& r, const std::string& key) {
  const auto it = r.metadata().find(key);
  if (it == r.metadata().end()) {
    throw CheckpointError(fmt::format("checkpoint {}: metadata '{}' is missing", r.path(), key));
  }
  const std::string& s = it->second;
  T v{};
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size()) {
    throw CheckpointError(
        fmt::format("checkpoint {}: metadata '{}' = '{}' is not a valid number", r.path(), key, s));
  }
  return v;
}

}  // namespace

void save_train_state(const std::string& path, const TrainState& s) {
  std::map<std::string, Tensor> tensors;
  for (const auto& [name, t] : s.params) tensors[std::string(kParam) + name] = t;
  for (const auto& [key, t] : s.optimizer_state.tensors) {
    if (!s.params.contains(owner_of(key))) {
      throw ConfigError(
          fmt::format("saving {}: optimizer state '{}' belongs to no parameter", path, key));
    }
    tensors[std::string(kOptim) + key] = t;
  }
  std::map<std::string, std::string> meta;
  meta["optimizer"] = s.optimizer;
  meta["step"] = fmt::format("{}", s.step);
  meta["epoch"] = fmt::format("{}", s.epoch);
  meta["rng_position"] = fmt::format("{}", s.rng_position);
  meta["lr_step"] = fmt::format("{}", s.lr_step);
  // fmt prints the shortest text that parses back to the same double.
  meta["loss_scale"] = fmt::format("{}", s.loss_scaler.scale);
  meta["loss_scale_good_steps"] = fmt::format("{}", s.loss_scaler.good_steps);
  for (const auto& [name, n] : s.optimizer_state.steps) {
    meta[std::string(kOptimStep) + name] = fmt::format("{}", n);
  }
  for (const auto& [k, v] : s.extra) meta[std::string(kExtra) + k] = v;
  save_checkpoint(path, tensors, meta);
}

void load_train_state(const std::string& path, TrainState& state) {
  CheckpointReader r(path);
  auto fail = [&](const std::string& what) {
    throw CheckpointError(fmt::format("checkpoint {}: {}", path, what));
  };

  TrainState out;
  const auto opt = r.metadata().find("optimizer");
  if (opt == r.metadata().end()) fail("metadata 'optimizer' is missing");
  out.optimizer = opt->second;
  if (!state.optimizer.empty() && out.optimizer != state.optimizer) {
    fail(fmt::format("written by optimizer '{}' but this run uses '{}'", out.optimizer,
                     state.optimizer));
  }
  out.step = parse_number<int64_t>(r, "step");
  out.epoch = parse_number<int64_t>(r, "epoch");
  out.rng_position = parse_number<uint64_t>(r, "rng_position");
  out.lr_step = parse_number<int64_t>(r, "lr_step");
  out.loss_scaler.scale = parse_number<double>(r, "loss_scale");
  out.loss_scaler.good_steps = parse_number<int64_t>(r, "loss_scale_good_steps");

  for (const auto& [key, value] : r.metadata()) {
    if (key.starts_with(kExtra)) {
      out.extra[key.substr(kExtra.size())] = value;
    } else if (key.starts_with(kOptimStep)) {
      const std::string name = key.substr(kOptimStep.size());
      if (!state.params.contains(name)) fail(fmt::format("'{}' names no parameter", key));
      out.optimizer_state.steps[name] = parse_number<int64_t>(r, key);
    }
  }

  for (const SafetensorsEntry& e : r.header().entries) {
    if (e.name.starts_with(kParam)) continue;  // load_into checks these
    if (!e.name.starts_with(kOptim)) fail(fmt::format("unexpected tensor '{}'", e.name));
    const std::string key = e.name.substr(kOptim.size());
    const auto p = state.params.find(owner_of(key));
    if (p == state.params.end()) {
      fail(fmt::format("optimizer state '{}' belongs to no parameter", e.name));
    }
    if (e.dtype != DType::f32 || e.shape.numel() != p->second.numel()) {
      fail(fmt::format("optimizer state '{}' is {}{} but parameter '{}' is {}", e.name,
                       dtype_name(e.dtype), e.shape.str(), p->first, p->second.desc()));
    }
    out.optimizer_state.tensors[key] = r.read(e.name);
  }

  // Last, because it is the only step that writes into the caller's memory.
  r.load_into(state.params, kParam);
  out.params = std::move(state.params);
  state = std::move(out);
}

}  // namespace mt
