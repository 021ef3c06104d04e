#include "meshtrain/train/step_checkpoints.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <filesystem>

#include "meshtrain/base/error.h"
#include "meshtrain/comm/communicator.h"
#include "meshtrain/train/checkpoint.h"
#include "meshtrain/train/sharded_checkpoint.h"

namespace mt {

namespace {

namespace fs = std::filesystem;

constexpr std::string_view kStepPrefix = "step_";

int64_t step_of(const std::string& path, const std::map<std::string, std::string>& meta,
                const std::string& key) {
  auto it = meta.find(key);
  int64_t v = -1;
  if (it != meta.end()) {
    const std::string& s = it->second;
    auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (ec == std::errc() && end == s.data() + s.size() && v >= 0) return v;
  }
  throw CheckpointError(
      fmt::format("checkpoint {}: metadata '{}' is missing or not a step count", path, key));
}

// Opens and verifies what can be verified without reading every tensor.
int64_t verified_step(const std::string& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) {
    CheckpointReader r(path);
    return step_of(path, r.metadata(), "step");
  }
  const ShardedIndex idx = read_index(path);
  for (const ShardedFileInfo& f : idx.shards) {
    const fs::path p = fs::path(path) / f.file;
    const auto size = fs::file_size(p, ec);
    if (ec) {
      throw FileError(
          fmt::format("checkpoint {}: shard file {} of rank {} is missing", path, f.file, f.rank));
    }
    if (size != f.bytes) {
      throw CheckpointError(
          fmt::format("checkpoint {}: shard file {} has {} bytes but the index "
                      "records {}",
                      path, f.file, size, f.bytes));
    }
  }
  return step_of(path, idx.metadata, "step");
}

std::vector<std::pair<int64_t, fs::path>> step_dirs(const std::string& root) {
  std::vector<std::pair<int64_t, fs::path>> out;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return out;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const int64_t s = parse_step_name(e.path().filename().string());
    if (s >= 0 && e.is_directory(ec)) out.emplace_back(s, e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

std::string step_checkpoint_path(const std::string& root, int64_t step) {
  return (fs::path(root) / fmt::format("{}{:08d}", kStepPrefix, step)).string();
}

int64_t parse_step_name(std::string_view name) {
  if (!name.starts_with(kStepPrefix) || name.size() == kStepPrefix.size()) return -1;
  const std::string_view digits = name.substr(kStepPrefix.size());
  int64_t v = -1;
  auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), v);
  return ec == std::errc() && end == digits.data() + digits.size() && v >= 0 ? v : -1;
}

std::vector<FoundCheckpoint> list_step_checkpoints(const std::string& root) {
  std::vector<FoundCheckpoint> out;
  for (const auto& [s, p] : step_dirs(root)) out.push_back(FoundCheckpoint{p.string(), s});
  return out;
}

CheckpointSearch find_newest_checkpoint(const std::string& root) {
  CheckpointSearch out;
  std::vector<std::string> candidates;
  std::error_code ec;
  // The root itself, when it is a checkpoint (train.checkpoint_keep = 0).
  if (!fs::is_directory(root, ec)) {
    if (fs::exists(root, ec)) candidates.push_back(root);
  } else {
    // A sharded checkpoint, or one whose save stopped part-way (shards, no
    // index); a directory of step checkpoints alone is not one.
    bool sharded = is_sharded_checkpoint(root);
    for (const auto& e : fs::directory_iterator(root, ec)) {
      sharded = sharded || e.path().filename().string().starts_with("shard-");
    }
    if (sharded) candidates.push_back(root);
  }
  for (const auto& [s, p] : step_dirs(root)) candidates.push_back(p.string());
  for (const std::string& c : candidates) {
    try {
      const int64_t s = verified_step(c);
      if (!out.newest || s >= out.newest->step) out.newest = FoundCheckpoint{c, s};
    } catch (const Error& e) {
      out.skipped.push_back(e.what());  // every error names the checkpoint's path
    }
  }
  return out;
}

std::vector<std::string> prune_step_checkpoints(const std::string& root, int64_t keep,
                                                const std::string& written) {
  std::vector<std::string> removed;
  if (keep <= 0) return removed;
  const fs::path kept = fs::path(written).lexically_normal();
  const int64_t written_step = parse_step_name(kept.filename().string());
  int64_t others = 0;                 // complete checkpoints kept besides `written`, newest first
  const auto dirs = step_dirs(root);  // ascending by step
  for (auto it = dirs.rbegin(); it != dirs.rend(); ++it) {
    const auto& [step, path] = *it;
    if (path.lexically_normal() == kept) continue;
    if (is_sharded_checkpoint(path.string())) {
      if (others < keep - 1) {
        ++others;
        continue;
      }
    } else if (step > written_step) {
      continue;  // not ours to judge: only older incomplete saves are leftovers
    }
    std::error_code ec;
    fs::remove_all(path, ec);
    if (ec) {
      throw FileError(
          fmt::format("removing old checkpoint {} failed: {}", path.string(), ec.message()));
    }
    removed.push_back(path.string());
  }
  return removed;
}

std::string resolve_auto_resume(const std::string& root, Communicator& world,
                                const CollectiveOptions& collective,
                                const std::function<void(const std::string&)>& notice) {
  if (root.empty()) {
    throw ConfigError(
        "train.resume = \"auto\": needs train.checkpoint, where it looks for the newest "
        "checkpoint");
  }
  const CheckpointSearch found = find_newest_checkpoint(root);
  // One all-reduce (max) gives the largest and, negated, the smallest step.
  double steps[2] = {found.newest ? static_cast<double>(found.newest->step) : -1.0, 0.0};
  steps[1] = -steps[0];
  world.all_reduce(steps, steps, 2, DType::f64, ReduceOp::max, collective);
  if (steps[0] != -steps[1]) {
    throw MismatchError(fmt::format(
        "train.resume = \"auto\": ranks found different newest checkpoints under {} (steps {} "
        "to {}); do all ranks see the same files?",
        root, -steps[1], steps[0]));
  }
  for (const std::string& s : found.skipped) notice(fmt::format("warning: skipping {}", s));
  if (!found.newest) {
    notice(fmt::format("train.resume = \"auto\": no checkpoint under {}; starting fresh", root));
    return {};
  }
  return found.newest->path;
}

}  // namespace mt
