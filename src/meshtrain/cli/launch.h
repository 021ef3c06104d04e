// Starting ranks: `meshtrain train --nproc N` starts Open MPI's `mpirun` with N
// copies of this binary (on this machine, or on the machines of a hostfile)
// and stays as their supervising parent: it passes SIGINT / SIGTERM on to the
// ranks, kills them if they have not stopped within a grace period, and exits
// with their status. Under `mpirun -np N` or `srun` (already launched),
// nothing is started and the ranks come from the engine's environment.
#pragma once

#include <chrono>
#include <string>
#include <vector>

namespace mt {

// True when this process was started by an MPI launcher (Open MPI, Slurm, or
// a PMI-based one).
bool launched_by_mpi();

// After a fatal error on one rank of a multi-rank MPI job: brings the whole
// job down (MPI_Abort) so that no rank waits forever for this one, e.g. in
// MPI_Finalize or a collective of a rank that stalled. Does nothing outside
// MPI or at world size 1. Only the CLI calls it, after printing the error.
void abort_distributed_job(int exit_code);

struct LaunchOptions {
  int nproc = 2;
  // An Open MPI hostfile (`host slots=N` lines) for ranks on several
  // machines; empty: every rank on this machine.
  std::string hostfile;
  // How long ranks may take to stop after SIGINT / SIGTERM was passed on
  // (e.g. to save a checkpoint) before they are killed.
  std::chrono::milliseconds stop_grace{10'000};
};

// Runs `mpirun ... <this binary> <args>` as a child in its own process group
// and waits for it. `args` are the arguments after argv[0] without --nproc /
// --hosts. SIGINT, SIGTERM and SIGHUP received meanwhile are passed on to the
// ranks on this machine (and, with a hostfile, to mpirun, which passes them
// to the other machines); ranks still running `stop_grace` later, or at a
// second signal, are killed (SIGKILL). Returns the exit status for this
// process: mpirun's (the first failing rank's), or 128 + the signal that
// stopped the job. Throws Error when mpirun cannot be started.
int run_under_mpirun(const LaunchOptions& options, const std::vector<std::string>& args);

// Set in the ranks' environment by run_under_mpirun when this process's
// stderr is a terminal, so that rank 0 draws a progress bar although its own
// stderr is mpirun's pipe.
inline constexpr const char* kStderrTtyEnv = "MESHTRAIN_STDERR_TTY";
bool launcher_stderr_is_tty();

// Cores this process may run on (its CPU affinity).
int usable_cores();

}  // namespace mt
