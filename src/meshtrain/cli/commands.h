// The CLI's sub-commands. Each returns a process exit code and throws
// mt::Error subclasses for failures (main.cpp reports them).
#pragma once

#include <string>
#include <vector>

namespace mt {

struct CommandOptions {
  std::string config_path;
  std::vector<std::string> overrides;  // "section.key=value"
  std::string metrics_path;
  std::string trace_path;       // Chrome-trace JSON of every rank (merged)
  std::string tensorboard_dir;  // TensorBoard event file directory (train.tensorboard)
  int nproc = 0;                // 0: from the config (dist.nproc)
  bool quiet = false;
};

int cmd_train(const CommandOptions& opts, int argc, char** argv);
int cmd_inspect(const CommandOptions& opts);

}  // namespace mt
