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

TEST(PipelineMpi, GptInterleavedMatchesTheSingleProcessRun) {
  // Four model chunks, one block each: rank 0 holds blocks 0 and 2 (and wte
  // and wpe), rank 1 blocks 1 and 3 (and ln_f, and wte again for the head).
  test::check_pipeline_matches_single(
      world(), PipeCase{"gpt", ScheduleKind::interleaved, 4, 2, {1, 1, 1, 1}});
}

TEST(PipelineMpi, MlpZeroBubbleMatchesTheSingleProcessRun) {
  test::check_pipeline_matches_single(world(),
                                      PipeCase{"mlp", ScheduleKind::zero_bubble, 4, 1, {3, 2}});
}

TEST(PipelineMpi, GptZeroBubbleMatchesTheSingleProcessRun) {
  test::check_pipeline_matches_single(world(),
                                      PipeCase{"gpt", ScheduleKind::zero_bubble, 4, 1, {}});
}

TEST(PipelineMpi, GptZbvMatchesTheSingleProcessRun) {
  // The V: rank 0 holds blocks 0 and 3 (wte twice, the loss), rank 1 blocks
  // 1 and 2 (the turn handed over in memory).
  test::check_pipeline_matches_single(world(),
                                      PipeCase{"gpt", ScheduleKind::zbv, 4, 2, {1, 1, 1, 1}});
}

TEST(PipelineMpi, GptDualPipeVMatchesTheSingleProcessRun) {
  test::check_pipeline_matches_single(world(),
                                      PipeCase{"gpt", ScheduleKind::dualpipev, 4, 2, {1, 1, 1, 1}});
}

TEST(PipelineMpi, GpipeStagesOverlap) {
  // p=2, m=4: the formula's (p-1)/(m+p-1) = 0.2 is a floor (a quiet run
  // measured 0.35: the stages differ by about a sixth, and messages and the
  // copies into the stashes take time the formula does not count); serial
  // stages would idle 0.5. The overlap check is skipped (saying so, with the
  // figures) when the machine is oversubscribed: pipeline_harness.cpp says
  // how that is measured.
  test::check_gpipe_idle_fraction(world(), 4);
}

}  // namespace
}  // namespace mt

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  mt::world();  // initialise MPI before any test
  return RUN_ALL_TESTS();
}
