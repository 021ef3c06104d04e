// The MPI world communicator of a test binary run under mpirun: made once,
// with a deadline generous enough for a loaded 2-core CI machine.
#pragma once

#include <chrono>
#include <memory>

#include "meshtrain/comm/backends/mpi/mpi_communicator.h"

namespace mt::test {

inline Communicator& mpi_world() {
  static std::unique_ptr<Communicator> comm = [] {
    CommOptions o;
    o.timeout = std::chrono::milliseconds(60'000);
    return make_mpi_communicator(o);
  }();
  return *comm;
}

}  // namespace mt::test
