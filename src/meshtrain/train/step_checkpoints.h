// Step-numbered checkpoints for long jobs, and finding the newest one.
//
// With train.checkpoint_keep = N > 0, train.checkpoint names a directory of
// checkpoints, one per save, each a sharded checkpoint directory named after
// the optimizer steps it holds:
//
//   <root>/step_00000120/index.json, shard-*.safetensors
//
// After a save completed (its index.json written on every rank's behalf),
// the oldest beyond the newest N are deleted, so a save that fails or is
// cut short never costs the previous good one. train.resume = "auto" picks
// the newest checkpoint that opens and verifies, skipping (and naming)
// incomplete or damaged ones.
//
// Blocking file-system calls; no collectives (callers run them on one rank
// or on every rank alike), except resolve_auto_resume, which every rank
// calls together.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace mt {

class Communicator;
struct CollectiveOptions;

// "<root>/step_<steps, 8 digits or more>"
std::string step_checkpoint_path(const std::string& root, int64_t step);
// The step of a name "step_<digits>", or -1 for any other name.
int64_t parse_step_name(std::string_view name);

struct FoundCheckpoint {
  std::string path;
  int64_t step = 0;  // optimizer steps completed, from its metadata
};

struct CheckpointSearch {
  std::optional<FoundCheckpoint> newest;  // none if no valid checkpoint was found
  std::vector<std::string> skipped;       // why each incomplete or damaged one was skipped
};

// The step checkpoint directories under `root` (complete or not, not
// verified), ascending by step; none if `root` is not a directory.
std::vector<FoundCheckpoint> list_step_checkpoints(const std::string& root);

// Looks at `root` itself (a single-file checkpoint, or a sharded directory)
// and at every <root>/step_<N>, and returns the valid one with the most
// steps. Valid: the file's header and metadata checksums verify, or the
// index verifies and every shard file it lists is present with its
// recorded size (tensor bytes are verified later, when loading). Never
// throws for a damaged candidate; it goes to `skipped`.
CheckpointSearch find_newest_checkpoint(const std::string& root);

// Deletes the step checkpoints under `root` (complete or not) beyond the
// newest `keep` by step number, never `written` (the one just saved).
// Returns the deleted paths. FileError if a deletion fails.
std::vector<std::string> prune_step_checkpoints(const std::string& root, int64_t keep,
                                                const std::string& written);

// train.resume = "auto", on every rank of `world` together: the newest
// valid checkpoint under `root` (find_newest_checkpoint), which every rank
// must find alike (MismatchError naming the steps otherwise). Returns its
// path, or "" when there is none (the run starts fresh). ConfigError when
// `root` (train.checkpoint) is empty. `notice` gets each skipped candidate
// and the fresh start.
std::string resolve_auto_resume(const std::string& root, Communicator& world,
                                const CollectiveOptions& collective,
                                const std::function<void(const std::string&)>& notice);

}  // namespace mt
