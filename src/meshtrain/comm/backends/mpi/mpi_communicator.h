// Communicators over MPI, for callers (no <mpi.h> here). Run the program
// under mpirun / srun; MpiRuntime initialises MPI on first use.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>

#include "meshtrain/comm/communicator.h"

namespace mt {

struct MpiOptions {
  // An MPI-3 shared window (MPI_Win_allocate_shared) for the shared_memory
  // algorithms when every rank of a communicator is on one node.
  bool shared_memory = true;
  // Data bytes per rank of that window (two slots of this size / 2).
  size_t shm_bytes_per_rank = size_t{1} << 20;
  // How long a communicator's destructor waits for the other ranks before it
  // gives up freeing the window (MPI_Win_free synchronises). Ranks that come
  // later than that then wait as long again and leave the window to MPI too
  // (no rank frees it unless every rank does).
  std::chrono::milliseconds teardown_timeout{10'000};
};

// A communicator over all ranks of the MPI job (a duplicate of
// MPI_COMM_WORLD). Collective: every rank calls it, within options.timeout.
std::unique_ptr<Communicator> make_mpi_communicator(CommOptions options = {}, MpiOptions mpi = {});

}  // namespace mt
