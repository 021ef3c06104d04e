// Rank, world size and node-local rank as the launcher put them in the
// environment, for logs and device binding before (or without) MPI. Reads
// Open MPI's OMPI_COMM_WORLD_*, Slurm's SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID
// and the torchrun-style RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE, in that
// order of preference. Pure function of the environment; never blocks.
#pragma once

#include <functional>
#include <string>

namespace mt {

struct LaunchEnv {
  int rank = 0;
  int size = 1;
  int local_rank = 0;
  int local_size = 1;             // 1 when the launcher does not say
  std::string launcher = "none";  // "openmpi", "slurm", "env" (RANK/WORLD_SIZE) or "none"

  bool launched() const { return launcher != "none"; }
};

// Throws ConfigError naming the variable when a value is not a number in range.
LaunchEnv read_launch_env();
LaunchEnv read_launch_env(const std::function<const char*(const char*)>& getenv);

}  // namespace mt
