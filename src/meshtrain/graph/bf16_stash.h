// bf16 activation storage around f32 compute (train.precision =
// "bf16_storage"): a pass over a differentiated graph that keeps the forward
// values the backward reads (the stash) in bf16 between the forward and the
// backward, while every operator still computes in f32.
//
// For each stashed value v it inserts a cast to bf16 right after v's last
// forward reader (or its producer, when the forward does not read it) and
// one cast back to f32 right before v's first backward reader, and points
// every backward reader at that f32 copy. The executor's liveness plan then
// frees v's f32 storage after its last forward reader and keeps only the
// bf16 copy across the forward/backward boundary, where the activation peak
// is: the stash costs half the bytes, for two element-wise casts per value.
//
// A value is stashed when all hold (else it is left alone):
// - f32 and produced by a forward node (integer tensors such as indices, and
//   values in caller memory -- inputs, parameters -- are not);
// - read by a backward node;
// - at least min_bytes in f32 (tiny tensors such as layer norm's mean and
//   rstd save nothing worth two kernel launches);
// - not read by the last forward node (the logits read by the loss: the
//   forward keeps them live up to the boundary anyway, so a bf16 copy would
//   add bytes at the peak rather than remove them).
// Rounding to bf16 moves each stashed element by at most 2^-8 relative;
// gradients stay f32 (tests/exec/executor_test.cpp derives their bound).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "meshtrain/graph/graph.h"

namespace mt {

struct Bf16StashOptions {
  int64_t min_bytes = 16 * 1024;  // smallest f32 value worth stashing
};

struct Bf16StashReport {
  std::vector<ValueId> stashed;  // the f32 values now kept in bf16 across the boundary
  int64_t elements = 0;          // their total elements (each cast twice per step)
  int64_t f32_bytes = 0;         // their f32 size (the bf16 copies take half)
  int skipped_small = 0, skipped_live = 0;
  // Set by the trainer (train/training_plan.cpp), which keeps the pass only
  // where it lowers the planned activation peak: the arena of the f32 graph
  // and of the stashed one, and whether it kept the f32 graph because the
  // stash would not have lowered it (stashed is then empty).
  int64_t arena_bytes_f32 = 0, arena_bytes = 0;
  bool kept_f32 = false;
  std::string describe() const;  // one line for the log
};

// Rewrites g in place (g must be differentiated: build_backward ran); a
// graph without backward nodes is left unchanged.
Bf16StashReport stash_in_bf16(Graph& g, const Bf16StashOptions& opts = {});

}  // namespace mt
