// The CLI's sub-commands. Each returns a process exit code and throws
// mt::Error subclasses for failures (main.cpp reports them).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "meshtrain/spmd/plan.h"

namespace mt {

struct CommandOptions {
  std::string config_path;
  std::vector<std::string> overrides;  // "section.key=value"
  std::string metrics_path;
  std::string trace_path;       // Chrome-trace JSON of every rank (merged)
  std::string tensorboard_dir;  // TensorBoard event file directory (train.tensorboard)
  int nproc = 0;                // 0: from the config (dist.nproc)
  std::string hostfile;         // --hosts: Open MPI hostfile for ranks on many machines
  bool quiet = false;
  // export
  std::string export_checkpoint;  // empty: train.checkpoint of the config
  std::string export_out;
  int64_t logits_for = 0;     // > 0: also write the logits of this many test examples
  std::string logits_out;     // empty: next to export_out
  bool print_config = false;  // print the effective configuration and stop
  // Parallel plans (spmd/plan.h): --plan FILE instead of the [parallel]
  // shorthand; --write-plan PATH writes the expanded plan (inspect: and stops).
  std::string plan_path;
  std::string write_plan_path;
  std::string graph_out;  // graph-gen: the graph file to write
  // plan / simulate / calibrate (docs/planner.md, docs/planner-search.md)
  std::string cluster_path;      // plan, simulate: the cluster file
  int top = 5;                   // plan: how many plans to print
  std::string plan_out;          // plan: where the best plan goes
  int plan_threads = 0;          // plan: threads pricing plans (0: the machine's)
  std::string calibrate_out;     // calibrate: the cluster file to write (empty: stdout)
  bool calibrate_quick = false;  // calibrate: small sizes, a few seconds (tests)
};

int cmd_train(const CommandOptions& opts, int argc, char** argv);
// `meshtrain simulate` (simulate_command.cpp): the plan on the cluster file
// through the planner's simulator.
int cmd_simulate(const CommandOptions& opts);
// The run config of --config (and --set); the defaults without --config.
struct RunConfig;
RunConfig load_command_config(const CommandOptions& opts);
// The run's parallel plan: --plan, else the config's [parallel] expanded
// for the model; checked against the model and `world`; nullopt for neither.
std::optional<Plan> command_plan(const CommandOptions& opts, const RunConfig& rc, int world);
int cmd_inspect(const CommandOptions& opts);
int cmd_export(const CommandOptions& opts);  // export_command.cpp
// `meshtrain graph-gen`: writes the graph the config's data.* keys name, so a
// peer (bench/run gnn) or a later run reads identical data.
int cmd_graph_gen(const CommandOptions& opts);
// `meshtrain plan` (plan_command.cpp): the best plans for a model on a cluster.
int cmd_plan(const CommandOptions& opts);
// `meshtrain calibrate` (calibrate.cpp): measures this machine, writes its cluster file.
int cmd_calibrate(const CommandOptions& opts, int argc, char** argv);
// `meshtrain config --list`: every config key with type, default, allowed
// values and meaning (markdown: as the Markdown table in README.md).
int cmd_config_list(bool markdown);

// "meshtrain 0.1.0 (git 62ccd20-dirty)": the project version from CMake and
// `git describe` at configure time when built from a checkout.
std::string version_string();

// When `arg` (the first command-line argument) is neither an option nor one
// of `commands`: a message naming it, the closest command and the list, e.g.
// "unknown command 'trian' (did you mean 'train'?); commands: train, inspect".
std::optional<std::string> unknown_command_message(std::string_view arg,
                                                   const std::vector<std::string>& commands);

}  // namespace mt
