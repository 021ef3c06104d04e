#include "meshtrain/cli/launch.h"

#include <mpi.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "meshtrain/base/error.h"

namespace mt {

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "SLURM_STEP_ID"}) {
    if (std::getenv(v) != nullptr) return true;
  }
  return false;
}

void abort_distributed_job(int exit_code) {
  int initialized = 0, finalized = 0, size = 1;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) return;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size > 1) MPI_Abort(MPI_COMM_WORLD, exit_code);
}

void relaunch_under_mpirun(int nproc, const std::vector<std::string>& args) {
  std::vector<std::string> cmd = {"mpirun", "-np", std::to_string(nproc)};
  if (geteuid() == 0) cmd.emplace_back("--allow-run-as-root");
  // One machine: ranks may outnumber cores, and must not be pinned to one core
  // each when they run several threads.
  for (const char* a : {"--oversubscribe", "--bind-to", "none", "--mca", "btl", "self,vader"}) {
    cmd.emplace_back(a);
  }
  char exe[4096];
  const ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (n <= 0) throw Error(fmt::format("cannot find this executable: {}", std::strerror(errno)));
  exe[n] = '\0';
  cmd.emplace_back(exe);
  cmd.insert(cmd.end(), args.begin(), args.end());

  std::vector<char*> argv;
  for (auto& s : cmd) argv.push_back(s.data());
  argv.push_back(nullptr);
  execvp(argv[0], argv.data());
  throw Error(
      fmt::format("cannot start mpirun to launch {} local ranks: {} (it is provided by "
                  "the Debian package openmpi-bin)",
                  nproc, std::strerror(errno)));
}

}  // namespace mt
