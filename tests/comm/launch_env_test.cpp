// read_launch_env against fake environments of each launcher.
#include <map>
#include <string>

#include <gtest/gtest.h>

#include "meshtrain/base/error.h"
#include "meshtrain/comm/launch_env.h"

namespace mt {
namespace {

LaunchEnv read(const std::map<std::string, std::string>& vars) {
  return read_launch_env([&](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

TEST(LaunchEnv, PrefersOpenMpiThenSlurmThenTorchrunStyle) {
  const LaunchEnv ompi = read({{"OMPI_COMM_WORLD_RANK", "3"},
                               {"OMPI_COMM_WORLD_SIZE", "8"},
                               {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                               {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                               {"RANK", "0"},
                               {"WORLD_SIZE", "1"}});
  EXPECT_EQ(ompi.launcher, "openmpi");
  EXPECT_EQ(ompi.rank, 3);
  EXPECT_EQ(ompi.size, 8);
  EXPECT_EQ(ompi.local_rank, 1);
  EXPECT_EQ(ompi.local_size, 2);
  const LaunchEnv slurm = read({{"SLURM_PROCID", "5"},
                                {"SLURM_NTASKS", "6"},
                                {"SLURM_LOCALID", "2"},
                                {"SLURM_NTASKS_PER_NODE", "3(x2)"}});
  EXPECT_EQ(slurm.launcher, "slurm");
  EXPECT_EQ(slurm.rank, 5);
  EXPECT_EQ(slurm.local_rank, 2);
  EXPECT_EQ(slurm.local_size, 1);  // "3(x2)" is not a plain number
  const LaunchEnv env = read({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}});
  EXPECT_EQ(env.launcher, "env");
  EXPECT_EQ(env.size, 4);
  EXPECT_TRUE(env.launched());
  const LaunchEnv none = read({});
  EXPECT_EQ(none.launcher, "none");
  EXPECT_EQ(none.rank, 0);
  EXPECT_EQ(none.size, 1);
  EXPECT_FALSE(none.launched());
}

TEST(LaunchEnv, MalformedValuesNameTheVariable) {
  try {
    read({{"RANK", "two"}, {"WORLD_SIZE", "4"}});
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("RANK='two'"), std::string::npos) << e.what();
  }
  EXPECT_THROW(read({{"SLURM_PROCID", "4"}, {"SLURM_NTASKS", "4"}}), ConfigError);
  EXPECT_THROW(read({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "0"}}), ConfigError);
}

}  // namespace
}  // namespace mt
