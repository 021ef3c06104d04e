// Test harness for data-parallel equivalence: a single-process reference run
// (plain executor, ParamStore, optimizer; no DataParallel) and the same
// training distributed over LocalWorld ranks (threads) with DataParallel,
// both recording the full flat parameters after every optimizer step, so a
// test can compare them step by step and print the largest difference and
// where it is.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/comm/backends/local/local_world.h"
#include "meshtrain/data/dataset.h"
#include "meshtrain/data/loader.h"
#include "meshtrain/exec/executor.h"
#include "meshtrain/models/model.h"
#include "meshtrain/sync/data_parallel.h"
#include "meshtrain/train/optimizer.h"
#include "meshtrain/train/param_store.h"

namespace mt::test {

// Deterministic synthetic examples: MLP images (f32 [C*H*W], label in
// [0, classes)) or GPT token sequences (i32 [T], next tokens [T]).
class SyntheticData : public Dataset {
 public:
  SyntheticData(const ModelSpec& spec, int64_t n, uint64_t seed);
  int64_t size() const override { return n_; }
  Batch gather(std::span<const int64_t> indices) const override;
  std::string describe() const override { return "synthetic"; }

 private:
  ModelSpec spec_;
  int64_t n_;
  std::vector<float> x_;
  std::vector<int32_t> tokens_, labels_;
};

struct TrainSetup {
  ModelSpec spec;
  int64_t global_batch = 12;  // examples per optimizer step, all ranks and micro-steps
  int steps = 20;
  std::string optimizer = "sgd";
  OptimizerOptions optim;
  double lr = 0.05;
  uint64_t seed = 7;
  double clip = 0;         // > 0: clip_grad_norm through the data-parallel norm reducer
  bool recompute = false;  // ExecOptions::recompute (backward re-reads norm parameters)
  // Test of the test: every rank weighs its gradient 1 / (world * K)
  // instead of by its share of the global batch (wrong for uneven shares).
  bool equal_weights = false;
};

// Flat parameters (ParamStore layout) after each step.
using Trajectory = std::vector<std::vector<float>>;

Trajectory run_reference(const TrainSetup& s);

struct DpRun {
  int world = 1;
  DataParallelOptions dp;
  std::vector<int64_t> shares;  // empty: equal
  LocalWorldOptions local;      // size is set from `world`
};

struct DpResult {
  Trajectory params;                       // rank 0's gathered parameters per step
  std::vector<DataParallelMemory> memory;  // per rank, after the last step
  std::vector<DataParallelStats> stats;    // per rank
  std::vector<CollectiveCost> step_cost;   // per rank
  std::vector<CommCounters> counters;      // per rank: the last step alone
  std::vector<int64_t> buckets;            // per rank
};

DpResult run_data_parallel(const TrainSetup& s, const DpRun& run);

// One rank's side of run_data_parallel, for tests that need to look inside
// between steps: its loader, model, executor, parameters, DataParallel and
// optimizer.
struct RankTrainer {
  RankTrainer(Communicator& comm, const TrainSetup& s, const DpRun& run);
  ~RankTrainer();
  // One optimizer step (K micro-steps) on the next global batch.
  void step();
  // Whole current parameters (collective).
  std::vector<float> full_params();

  TrainSetup s;
  int K = 1;
  int world = 1;
  int next_step = 0;
  int64_t local_batch = 0;
  std::unique_ptr<Dataset> data;
  std::unique_ptr<DataLoader> loader;
  std::unique_ptr<ModelGraph> model;
  std::unique_ptr<Executor> exec;
  std::unique_ptr<ParamStore> store;
  std::unique_ptr<DataParallel> dp;
  std::unique_ptr<Optimizer> opt;
};

ParamLayout layout_of(const ParamStore& store);
std::vector<ParamRef> refs_of(std::span<ParamSlice> slices);

// Largest elementwise |a - b| / max(|b|, floor_fraction * the largest |b|
// of the same tensor) over every step, i.e. relative error, with elements
// near zero measured against their tensor's scale (roundoff there is
// relative to the values it was computed from). With the step, parameter
// name and values for failure messages.
struct Divergence {
  double worst = 0;
  std::string where;
};
Divergence compare(const TrainSetup& s, const Trajectory& got, const Trajectory& want,
                   double floor_fraction = 0.1);

ModelSpec small_mlp();
ModelSpec small_gpt();

}  // namespace mt::test
