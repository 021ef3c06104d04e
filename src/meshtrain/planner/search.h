// The plan search behind `meshtrain plan`: every way the runtime can spread
// a model over a cluster's ranks -- data / tensor / pipeline degrees,
// micro-batches and schedule, ZeRO stage, recomputation, and on unequal
// devices the uneven shares the balance LP (planner/balance.h) gives -- each
// priced by the cost model (planner/cost_model.h: step time from the
// simulator, peak memory per rank from the trainer's own memory plan) and
// ranked by predicted step time. Plans whose peak memory on some rank
// exceeds that rank's device memory are never returned; when none fits the
// result says which plan came closest and by how much it is over.
//
// Before pricing a shape, a lower bound of its memory (the parameters,
// gradients and, for AdamW / LAMB, the two moments a rank holds at least:
// P / (tp x pp) elements of each, divided by dp where ZeRO shards them, 4
// bytes each) above every device's memory skips it as over memory: that is what keeps the search of
// a hundreds-of-billions model on a thousand devices from pricing the plans that cannot hold it.
//
// Deterministic: candidates are enumerated in a fixed order and ties are
// broken by their description.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "meshtrain/models/model.h"
#include "meshtrain/planner/cluster_model.h"
#include "meshtrain/planner/cost_model.h"
#include "meshtrain/spmd/plan.h"
#include "meshtrain/spmd/shorthand.h"
#include "meshtrain/train/trainer.h"

namespace mt::planner {

struct SearchOptions {
  int top = 5;  // how many plans to return
  // Micro-batch counts tried under pipelines: pp x each factor that divides
  // the data-parallel replica's batch.
  std::vector<int> microbatch_factors = {1, 2, 4};
  std::vector<ScheduleKind> schedules = {ScheduleKind::one_f_one_b, ScheduleKind::gpipe};
  std::vector<int> zero_stages = {0, 1, 2, 3};  // tried where dp > 1
  // Try recomputation both ways: exec.recompute without a pipeline, every
  // stage's recomputation (parallel.recompute) with one.
  bool recompute = true;
  // Also price ZeRO-1 and ZeRO-2 on a pipeline's data-parallel axis (where
  // the plan without ZeRO does not fit: SearchResult::dominated).
  bool zero_pipelines = true;
  // Tensor parallelism at most over one node's ranks (its collectives run
  // every layer; across nodes they are rarely worth it); false: any degree.
  bool tp_within_node = true;
  bool uneven = true;  // LP shares on unequal devices
  // On unequal devices, also which devices form which stage / tensor group:
  // each pipeline or dp x tp shape in the ranks sorted by speed, fastest
  // first and slowest first (Plan::devices), besides the cluster's order.
  bool device_orders = true;
  // Threads pricing shapes at once (0: the machine's); the result is the
  // same for any number.
  int threads = 0;
  // Called after each candidate: done, total, the best step time so far (0: none fits yet).
  std::function<void(int done, int total, double best_step_s)> progress;
};

struct PlanCandidate {
  ParallelShorthand shape;  // dp, tp, pp, microbatches, schedule, ratios, stage layers, shares
  int zero_stage = 0;
  bool recompute = false;
  bool uneven = false;  // shares from the balance LP
  // Which world rank runs each mesh rank (Plan::devices; empty: the
  // cluster's order) and the order's name ("fast-first", "slow-first").
  std::vector<int> devices;
  std::string device_order;
  Plan plan;  // what `meshtrain train --plan` runs
  StepEstimate estimate;

  // "dp=4 tp=2 pp=1 zero=1" (+ micro-batches, schedule, shares when they apply).
  std::string describe() const;
  // The config settings the plan needs besides the plan file, as
  // `--set KEY=VALUE` arguments: dist.nproc, dist.zero_stage,
  // dist.batch_shares, exec.recompute.
  std::vector<std::string> settings(int world) const;
};

struct SearchResult {
  std::vector<PlanCandidate> best;  // at most `top`, fastest first
  int candidates = 0;               // enumerated
  int fitting = 0;                  // within memory on every rank
  int over_memory = 0;
  int refused = 0;   // the runtime would refuse it (degree not dividing, ...)
  int unpriced = 0;  // the cost model failed on it (InternalError): reported, not proposed
  std::vector<std::string> unpriced_reasons;  // the first few: plan and error
  // Over memory: the plan that came closest, its worst rank, and by how much.
  struct Miss {
    std::string plan;
    int rank = 0;
    int64_t need_bytes = 0, have_bytes = 0;
    bool lower_bound = false;  // need_bytes is the parameters' and gradients' bound (not priced)
  };
  int no_effect = 0;  // of fitting: recomputation that changed neither time nor memory, dropped
  int pruned = 0;     // of over_memory: over by the parameter + gradient bound alone, not priced
  // Not priced: under a pipeline, a plan with recomputation or ZeRO 1-2
  // whose twin without it fits (recomputation is never faster; ZeRO adds
  // the updated parameters' all-gather).
  int dominated = 0;
  // Of fitting: under pipelines (even devices), plans whose step is above
  // `top` runnable plans already priced by a lower bound (the sum of each
  // rank's compute-lane tasks), so never among the best nor the best
  // runnable: their memory is exact, their time not simulated.
  int not_simulated = 0;
  std::optional<Miss> closest;
  std::vector<std::string> refusals;  // the distinct reasons, first few
};

SearchResult search_plans(const ModelSpec& spec, const TrainerOptions& base,
                          const ClusterModel& cluster, const SearchOptions& options = {});

// When nothing fits: which constraint fails and by how much.
std::string nothing_fits_message(const SearchResult& r, const ClusterModel& cluster);

}  // namespace mt::planner
