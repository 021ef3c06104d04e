#include "meshtrain/comm/launch_env.h"

#include <charconv>
#include <cstdlib>
#include <cstring>

#include "meshtrain/base/error.h"

namespace mt {
namespace {

struct Scheme {
  const char* launcher;
  const char* rank;
  const char* size;
  const char* local_rank;
  const char* local_size;
};

constexpr Scheme kSchemes[] = {
    {"openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"},
    {"slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"},
    {"env", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
};

int parse(const char* name, const char* text, int min) {
  int v = 0;
  const char* end = text + std::strlen(text);
  auto [p, ec] = std::from_chars(text, end, v);
  if (ec != std::errc() || p != end || v < min) {
    throw ConfigError(fmt::format("launcher environment variable {}='{}' is not an integer >= {}",
                                  name, text, min));
  }
  return v;
}

}  // namespace

LaunchEnv read_launch_env(const std::function<const char*(const char*)>& getenv) {
  LaunchEnv env;
  for (const Scheme& s : kSchemes) {
    const char* rank = getenv(s.rank);
    const char* size = getenv(s.size);
    if (rank == nullptr || size == nullptr) continue;
    env.launcher = s.launcher;
    env.rank = parse(s.rank, rank, 0);
    env.size = parse(s.size, size, 1);
    if (env.rank >= env.size) {
      throw ConfigError(fmt::format("launcher environment: {}={} is not below {}={}", s.rank,
                                    env.rank, s.size, env.size));
    }
    const char* local = getenv(s.local_rank);
    env.local_rank = local ? parse(s.local_rank, local, 0) : 0;
    // Slurm's tasks-per-node may read "2(x3)"; only a plain number is used.
    const char* local_size = getenv(s.local_size);
    if (local_size != nullptr) {
      int v = 0;
      const char* end = local_size + std::strlen(local_size);
      auto [p, ec] = std::from_chars(local_size, end, v);
      if (ec == std::errc() && p == end && v >= 1) env.local_size = v;
    }
    return env;
  }
  return env;
}

LaunchEnv read_launch_env() {
  return read_launch_env([](const char* name) { return std::getenv(name); });
}

}  // namespace mt
