// Pipeline parallelism under mpirun: one process per stage (2 ranks), over
// the MPI communicator. pipeline_harness.cpp says what is checked and why.
#include <gtest/gtest.h>

#include "meshtrain/comm/backends/mpi/mpi_communicator.h"
#include "pipeline_harness.h"

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

using test::PipeCase;

TEST(PipelineMpi, MlpGpipeMatchesTheSingleProcessRun) {
  test::check_pipeline_matches_single(world(), PipeCase{"mlp", ScheduleKind::gpipe, 4, 1, {}});
}

TEST(PipelineMpi, Mlp1f1bMatchesTheSingleProcessRun) {
  test::check_pipeline_matches_single(world(),
                                      PipeCase{"mlp", ScheduleKind::one_f_one_b, 4, 1, {3, 2}});
}

TEST(PipelineMpi, GptGpipeMatchesTheSingleProcessRun) {
  test::check_pipeline_matches_single(world(), PipeCase{"gpt", ScheduleKind::gpipe, 2, 1, {}});
}

TEST(PipelineMpi, Gpt1f1bMatchesTheSingleProcessRun) {
  test::check_pipeline_matches_single(world(),
                                      PipeCase{"gpt", ScheduleKind::one_f_one_b, 4, 1, {}});
}

}  // namespace
}  // namespace mt

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  mt::world();  // initialise MPI before any test
  return RUN_ALL_TESTS();
}
