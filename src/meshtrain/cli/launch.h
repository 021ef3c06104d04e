// Starting local ranks: `meshtrain train --nproc N` re-executes itself under
// Open MPI's `mpirun` with N processes on this machine, adding what running
// as root or with more ranks than cores needs. Under `mpirun -np N` or `srun`
// (already launched), nothing is started and the ranks come from the
// engine's environment.
#pragma once

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

// Replaces this process with `mpirun ... <this binary> <args>` (returns only
// by throwing ConfigError / Error, e.g. when mpirun is not installed). `args`
// are the arguments after argv[0] with --nproc removed.
[[noreturn]] void relaunch_under_mpirun(int nproc, const std::vector<std::string>& args);

}  // namespace mt
