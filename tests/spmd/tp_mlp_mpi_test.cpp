// The hand-built tensor-parallel MLP (tp_mlp.cpp) under mpirun: one process
// per rank, over the MPI communicator.
#include <gtest/gtest.h>

#include "meshtrain/comm/backends/mpi/mpi_communicator.h"
#include "tp_mlp.h"

namespace mt {
namespace {

Communicator& world() {
  static std::unique_ptr<Communicator> comm = [] {
    CommOptions o;
    o.timeout = std::chrono::milliseconds(60'000);
    return make_mpi_communicator(o);
  }();
  return *comm;
}

TEST(TpMlpMpi, MatchesTheSingleProcessMlpStepByStep) {
  test::check_tp_mlp(world());
}

}  // namespace
}  // namespace mt

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  mt::world();  // initialise MPI before any test
  return RUN_ALL_TESTS();
}
