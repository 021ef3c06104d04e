// Mixed precision that never makes training slower: at start-up the trainer
// times this machine's f32 and bf16 matmuls on the model's own training-step
// shapes (forward and backward, each once warm and at best of 3) and decides.
//
//   train.precision = "auto": bf16 when its matmuls run at least kMinGain
//                     times the f32 rate (the gain must pay for the casts
//                     mixed precision adds); else f32 compute with bf16
//                     activation storage (graph/bf16_stash.h) when the
//                     storage's casts, timed on the stash's own sizes, cost
//                     at most kMaxStorageCost of the step's f32 matmul time
//                     (so they cannot slow the step by more than that
//                     fraction: the step is longer than its matmuls), or
//                     when the f32 run's planned memory exceeds the
//                     rank's memory limit and the storage plan fits (then
//                     the alternative is not running at all); else f32
//                     throughout;
//                     "bf16_storage": f32 compute, bf16 stash, as configured;
//                     "bf16": bf16 as configured, with a warning when its
//                     matmuls are slower here (Intel without AMX: the bf16
//                     dot-product instruction has half the FMA ports);
//                     "f32" / "f16": as configured, nothing measured.
//
// The decision, the two rates and the reason go to the log and the metrics
// summary (precision_decision). Under data parallelism rank 0 measures and
// every rank follows it (the graphs must agree). Blocks for the measurement
// (tens of milliseconds for the models shipped, at most a second for large ones).
#pragma once

#include <string>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/graph/graph.h"
#include "meshtrain/tensor/backend.h"
#include "meshtrain/tensor/kernels.h"

namespace mt {

// One distinct matmul of a training step and how often a step runs it.
struct MatmulUse {
  Shape a, b, c;
  bool trans_a = false, trans_b = false;
  int64_t calls = 0;
  double flops = 0;  // per call
};

// The distinct f32 matmuls of `g` (a training graph: forward and backward).
std::vector<MatmulUse> matmul_uses(const Graph& g);

struct PrecisionDecision {
  static constexpr double kMinGain = 1.1;
  static constexpr double kMaxStorageCost = 0.02;
  std::string requested;  // "f32", "bf16", "f16", "bf16_storage" or "auto"
  DType chosen = DType::f32;
  bool bf16_storage = false;  // chosen f32 compute with the bf16 stash
  bool measured = false;
  // Over the step's matmuls, flop-weighted, at one thread.
  double f32_gflops = 0, bf16_gflops = 0;
  // The bf16 stash of the f32 training graph: its elements, the f32 matmul
  // seconds of one step and the seconds of the stash's two casts per step
  // (one thread; 0 when not measured).
  int64_t stash_elements = 0;
  double f32_matmul_s = 0, storage_cast_s = 0;
  double storage_cost() const { return f32_matmul_s > 0 ? storage_cast_s / f32_matmul_s : 0.0; }
  // The rank's memory limit (TrainerOptions::memory_limit; 0: none) and the
  // planned memory per rank (training_plan.h total) of the f32 run and of
  // the bf16 storage run; set by the trainer for auto.
  int64_t memory_limit = 0, f32_plan_bytes = 0, storage_plan_bytes = 0;
  bool storage_needed_to_fit() const {
    return memory_limit > 0 && f32_plan_bytes > memory_limit && storage_plan_bytes > 0 &&
           storage_plan_bytes <= memory_limit;
  }
  std::string mode() const;  // "f32", "bf16", "f16" or "bf16_storage"
  double seconds = 0;        // the measurement's own time
  std::string isa;           // oneDNN's ISA ("avx512_core_amx" where AMX runs bf16)
  bool amx = false;          // oneDNN runs bf16 on AMX tiles
  bool cpu_amx = false;      // the CPU (and the OS) offer AMX, whether oneDNN uses it or not
  std::string reason;        // one line for the log
  double bf16_over_f32() const { return f32_gflops > 0 ? bf16_gflops / f32_gflops : 0.0; }
};

// bf16_rate_factor_for_testing scales the measured bf16 rate (a test makes
// bf16 look slower with 0.5), storage_cost_factor_for_testing the measured
// cast time; 1 outside tests. stash_sizes: the elements of each value the
// bf16 stash pass would keep in bf16 (Bf16StashReport::stashed); timed
// only for "auto".
// `backend` and `fast`: the training's kernel backend and options; only the
// fast backend is measured (on a private instance, at one thread: the ratio
// is the core's).
PrecisionDecision decide_precision(const std::string& requested, const std::vector<MatmulUse>& uses,
                                   const std::string& backend, const FastBackendOptions& fast,
                                   double bf16_rate_factor_for_testing = 1.0,
                                   const std::vector<int64_t>& stash_sizes = {},
                                   double storage_cost_factor_for_testing = 1.0);

// The decision for "f32" / "bf16" / "f16" / "bf16_storage" / "auto" once the
// rates are known (pure: the policy above). Gradients are never sent in bf16
// by auto: sync.codec = "bf16" compresses them, but only on request (it is
// lossy and breaks step-by-step equality with the single-process run), and
// the reason says so when auto keeps matmuls in f32.
void apply_precision_policy(PrecisionDecision& d);

// Every rank of `comm` takes rank 0's decision (its measured rates, stash,
// memory figures and choice; one broadcast), so ranks whose own
// measurements would differ train alike.
void follow_rank0_precision(Communicator& comm, PrecisionDecision& d);

}  // namespace mt
