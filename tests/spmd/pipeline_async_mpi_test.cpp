// Asynchronous pipelining under mpirun (2 ranks as processes): PipeDream's
// stash and SpecTrain's prediction against the sequential reference of
// pipeline_async.cpp, as pipeline_async_test.cpp does on local threads.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>

#include "meshtrain/comm/backends/mpi/mpi_communicator.h"
#include "pipeline_async.h"

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

TEST(PipelineAsyncMpi, PipeDreamBackwardUsesTheWeightsItsForwardUsed) {
  test::check_async_matches_reference(world(), AsyncMode::pipedream, {2, 1}, 4);
}

TEST(PipelineAsyncMpi, SpecTrainForwardUsesPredictedWeights) {
  test::check_async_matches_reference(world(), AsyncMode::spectrain, {1, 2}, 4);
}

TEST(PipelineAsyncMpi, PipeDreamGptTiedEmbeddingIsOneParameter) {
  test::check_async_matches_reference(world(), AsyncMode::pipedream, {3, 2}, 4, "gpt");
}

}  // namespace
}  // namespace mt

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  mt::world();  // initialise MPI before any test
  return RUN_ALL_TESTS();
}
