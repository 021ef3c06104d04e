// The hand-built tensor-parallel MLP (tp_mlp.cpp) on local threads: 2 ranks
// (3 and 4 too: the hidden width 12 divides), with the shared-memory
// collectives and without them (ring / halving-doubling), so the byte check
// covers both algorithm families.
#include <gtest/gtest.h>

#include "meshtrain/comm/backends/local/local_world.h"
#include "tp_mlp.h"

namespace mt {
namespace {

TEST(TpMlp, MatchesTheSingleProcessMlpStepByStep) {
  for (int n : {2, 3, 4}) {
    for (size_t shm : {size_t{1} << 20, size_t{0}}) {
      SCOPED_TRACE(::testing::Message() << n << " ranks, shm bytes " << shm);
      LocalWorldOptions o;
      o.size = n;
      o.shm_bytes_per_rank = shm;
      o.comm.timeout = std::chrono::milliseconds(60'000);
      LocalWorld::run(o, [](Communicator& world) { test::check_tp_mlp(world); });
    }
  }
}

}  // namespace
}  // namespace mt
