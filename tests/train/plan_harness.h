// What the plan tests under mpirun share (pipeline_checkpoint_mpi,
// pipeline_zero_mpi, xmesh_mpi): the single-process reference run, a run
// under a plan on the MPI world whose every parameter piece each rank holds
// is compared with the same box of the reference's parameter, a temporary
// directory every rank names alike, and the checkpoint handover (written
// after half the steps under one plan, resumed under another) measured
// against the uninterrupted single-process run. A test states its model,
// options and plans; the comparisons (relative to the largest magnitude of
// the reference's piece, at least 1e-3; losses relative to the reference's)
// are the same for all of them.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "meshtrain/data/dataset.h"
#include "meshtrain/tensor/memory_stats.h"
#include "meshtrain/train/trainer.h"
#include "sync/dp_harness.h"

namespace mt::test {

// The GPT the plan tests train: d_model 24 in 6 heads, 8 tokens, a
// vocabulary of 36, `layers` blocks; wte tied to the head.
ModelSpec plan_gpt(int64_t layers = 2);

// The options the GPT plan tests start from: batch 8, `steps` steps, AdamW
// (weight decay 0.01) at 0.003 on a cosine schedule (a resumed run must
// continue it, not restart it), the gradient norm clipped to 0.5 (a global
// norm over every stage's and shard's part), seed 3, the reference backend,
// no progress or evaluation.
TrainerOptions plan_adamw_options(int steps);

// The single-process run: every step's loss, the test loss (with test
// data), the final parameters whole.
struct Reference {
  std::vector<double> losses;
  std::optional<double> test_loss;
  std::map<std::string, Tensor> params;
};

// Trains `o` in one process on `data` (default: SyntheticData(spec, 96, 5)).
Reference single_run(const ModelSpec& spec, const TrainerOptions& o,
                     std::shared_ptr<const Dataset> data = nullptr,
                     std::shared_ptr<const Dataset> test_data = nullptr);

// The largest relative difference of the parameter pieces this rank holds
// from the same boxes of the reference's, and the name where it is.
struct PieceDiff {
  double worst = 0;
  std::string where;
  bool split = false;  // some piece is a box of its parameter (a tensor axis splits it)
};

// Compares every piece the trainer holds on this rank (a pipeline's stage
// pieces, gathered first under ZeRO-3 -- collective --, else params()) with
// the reference's. A piece of the wrong size fails the test.
PieceDiff compare_pieces(Trainer& t, const Reference& ref);

struct PlanRun {
  std::vector<double> losses;
  std::optional<double> test_loss;
  int64_t steps = 0;
  double worst_param = 0;  // largest relative error of any piece against the reference
  std::string where;
  bool split = false;
  std::vector<int64_t> param_numels;  // of the pieces this rank holds, in the runtime's order
  MemoryCounters allocated;
};

struct PlanRunChecks {
  // A pipeline's boundary bytes sent in the last step equal its prediction.
  bool pipeline_bytes = false;
};

// Trains `o` on the MPI world and, with `ref`, compares every piece this
// rank holds (compare_pieces).
PlanRun run_plan(const ModelSpec& spec, const TrainerOptions& o, const Reference* ref,
                 PlanRunChecks checks = {}, std::shared_ptr<const Dataset> data = nullptr,
                 std::shared_ptr<const Dataset> test_data = nullptr);

// The worst relative error of losses `got` against the reference's from
// step `first` on; `where` names the step.
double worst_loss(const std::vector<double>& got, const Reference& ref, size_t first,
                  std::string* where);

// A run's worst relative difference from the reference over every step's
// loss and the final parameters, and where it is (Divergence: dp_harness.h).
Divergence divergence(const PlanRun& got, const Reference& ref);

// Prints (rank 0) "`label`: worst relative error W at WHERE" and expects
// W <= `tol` on every rank, the failure naming the label, rank and where.
void expect_within(const Divergence& d, double tol, const std::string& label);

// A directory under /tmp that rank 0 names and every rank creates, and its
// removal after every rank is done with it (collective).
std::string shared_tmp_dir(const char* what);
void remove_shared_tmp_dir(const std::string& dir);

// A checkpoint handover: `first` runs half of `steps` and writes `dir`/ck,
// `second` resumes from it and runs the rest, its pieces compared with the
// reference's. `worst` covers both halves' losses and the final pieces;
// `resumed` only the resumed half's losses and the final pieces.
struct Handover {
  PlanRun a, b;
  Divergence worst, resumed;
};
// Fails the test (fatally: call through ASSERT_NO_FATAL_FAILURE) where a
// half did not run its steps.
void run_handover(const ModelSpec& spec, TrainerOptions first, TrainerOptions second, int steps,
                  const Reference& ref, const std::string& dir, Handover* out,
                  PlanRunChecks checks = {});

}  // namespace mt::test
