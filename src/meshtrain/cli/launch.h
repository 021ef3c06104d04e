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

// Replaces this process with `mpirun ... <this binary> <args>` (returns only
// by throwing ConfigError / Error, e.g. when mpirun is not installed). `args`
// are the arguments after argv[0] with --nproc removed.
[[noreturn]] void relaunch_under_mpirun(int nproc, const std::vector<std::string>& args);

}  // namespace mt
