// The [parallel] shorthand of a run config (dp, tp, pp, sp, microbatches,
// schedule, virtual_stages, tp_ratios, stage_layers), as Megatron and
// DeepSpeed users write it, and its expansion into a full Plan with
// Megatron-style sharding specs for the models meshtrain ships:
//   gpt: attention's q, k, v column-parallel split by heads (unit = head
//        size), its output projection row-parallel; the MLP's fc
//        column-parallel and proj row-parallel; the token embedding (tied
//        with the output head) vocabulary-parallel; layer norms and position
//        embedding replicated.
//   mlp: hidden layers alternate column- and row-parallel (fc1 column, fc2
//        row, ...), the head continuing the alternation.
//   cnn: convolutions replicated, the classifier's fc1 column- and head
//        row-parallel.
// Inputs x and y are split along the batch over dp, as the data loader
// splits it (dist.batch_shares as ratios). Pipeline stages cut the
// model's layers (gpt: its blocks, the embeddings joining the first stage
// and the final norm the last) by stage_layers, or else into runs of equal
// forward FLOPs as the graph's cost facts count them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "meshtrain/graph/graph.h"
#include "meshtrain/spmd/plan.h"

namespace mt {

struct ParallelShorthand {
  int dp = 0;  // 0: the world size / (tp * pp)
  int tp = 1;
  int pp = 1;
  bool sp = false;  // sequence parallelism over the tp axis (gpt)
  int microbatches = 1;
  ScheduleKind schedule = ScheduleKind::one_f_one_b;
  int virtual_stages = 1;
  int warmup_extra = 0;               // 1f1b: extra warm-up forwards (Plan::warmup_extra)
  AsyncMode async = AsyncMode::none;  // asynchronous pipelining (Plan::async)
  std::vector<int64_t> tp_ratios;     // empty: even; else one per tp rank
  std::vector<int64_t> stage_layers;  // empty: balanced; else layers per (virtual) stage
  // Activation recomputation per pipeline stage (StagePlan::recompute):
  // every stage, or the listed virtual stages.
  bool recompute = false;
  std::vector<int64_t> recompute_stages;
  // Not a [parallel] key: dist.batch_shares, the data-parallel split of the
  // batch (one share per dp rank; empty = equal).
  std::vector<int64_t> batch_shares;
};

// What the expansion needs to know about the model beyond its graph.
struct ShorthandModel {
  std::string kind;       // "mlp", "cnn" or "gpt"
  int64_t head_size = 1;  // gpt: d_model / heads
};

// The full plan. Throws ConfigError naming the parallel.* key and what was
// expected (tp * pp not dividing the world, ratios not one per tp rank, a
// stage with no layers, sp without tp, ...). The result still goes through
// validate_plan(), which checks the specs against the shapes.
Plan expand_shorthand(const ParallelShorthand& sh, const ShorthandModel& model, const Graph& g,
                      int world);

// The layers pipeline stages count under the shorthand (gpt: its blocks).
std::vector<std::string> stage_units(const ShorthandModel& model, const Graph& g);

}  // namespace mt
