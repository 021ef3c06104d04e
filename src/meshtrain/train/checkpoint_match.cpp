#include "meshtrain/train/checkpoint_match.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <vector>

#include "meshtrain/base/error.h"

namespace mt {

namespace {

// Long lists (a 48-layer GPT resumed into another width) stay readable.
constexpr size_t kListed = 8;

std::string int_list(const std::vector<int64_t>& v) {
  return fmt::format("[{}]", fmt::join(v, ", "));
}

std::string sig(const TensorSignature& s) {
  return fmt::format("{}{}", dtype_name(s.dtype), s.shape.str());
}

void add_section(std::string& msg, const std::string& title,
                 const std::vector<std::string>& items) {
  if (items.empty()) return;
  msg += fmt::format("\n  {} ({}): ", title, items.size());
  for (size_t i = 0; i < items.size() && i < kListed; ++i) msg += (i ? ", " : "") + items[i];
  if (items.size() > kListed) msg += fmt::format(", ... and {} more", items.size() - kListed);
}

}  // namespace

std::map<std::string, std::string> model_settings(const ModelSpec& s) {
  std::map<std::string, std::string> m;
  m["model"] = s.kind;
  if (s.kind == "mlp") {
    m["model.hidden"] = int_list(s.hidden);
  } else if (s.kind == "cnn") {
    m["model.conv_channels"] = int_list(s.conv_channels);
    m["model.fc"] = std::to_string(s.fc);
  } else if (s.kind == "gpt") {
    m["model.layers"] = std::to_string(s.layers);
    m["model.d_model"] = std::to_string(s.d_model);
    m["model.heads"] = std::to_string(s.heads);
    m["model.seq_len"] = std::to_string(s.seq_len);
  }
  return m;
}

void require_same_params(const std::string& path,
                         const std::map<std::string, std::string>& stored_model,
                         const std::map<std::string, std::string>& run_model,
                         const TensorSignatures& stored, const TensorSignatures& expected) {
  std::vector<std::string> settings, missing, extra, shapes;
  for (const auto& [key, value] : run_model) {
    auto it = stored_model.find(key);
    if (it != stored_model.end() && it->second != value) {
      settings.push_back(fmt::format("{}: checkpoint {}, this run {}",
                                     key == "model" ? "model.kind" : key, it->second, value));
    }
  }
  for (const auto& [name, s] : expected) {
    auto it = stored.find(name);
    if (it == stored.end()) {
      missing.push_back(fmt::format("{} {}", name, sig(s)));
    } else if (it->second.dtype != s.dtype || !(it->second.shape == s.shape)) {
      shapes.push_back(
          fmt::format("{}: checkpoint {}, this run {}", name, sig(it->second), sig(s)));
    }
  }
  for (const auto& [name, s] : stored) {
    if (!expected.contains(name)) extra.push_back(fmt::format("{} {}", name, sig(s)));
  }
  if (settings.empty() && missing.empty() && extra.empty() && shapes.empty()) return;

  std::string msg = fmt::format(
      "checkpoint {} does not fit the model this run builds, so it cannot be resumed:", path);
  add_section(msg, "model settings that differ", settings);
  add_section(msg, "tensors this model has but the checkpoint lacks", missing);
  add_section(msg, "tensors in the checkpoint that this model does not have", extra);
  add_section(msg, "tensors with another shape or dtype", shapes);
  msg +=
      "\n  resume continues a run with the same model.* settings; to start from other weights "
      "(e.g. fine-tuning), load them with train.init instead";
  throw CheckpointError(msg);
}

}  // namespace mt
