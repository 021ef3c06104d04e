// The executor's compiled plan (internal to exec): the step list (the graph's
// node order, plus recomputation steps when enabled), one memory slot per
// value incarnation, each slot's lifetime, and its arena offset.
//
// A slot is a value's storage: graph value v owns slot v; a recomputed value
// gets an extra slot. A slot is bound (caller memory), a view of another slot
// (reshape outputs alias their input's root), or placed in the arena.
#pragma once

#include <vector>

#include "meshtrain/exec/executor.h"
#include "meshtrain/graph/graph.h"

namespace mt {

struct PlanSlot {
  ValueId value = kNoValue;
  bool recomputed = false;
  bool bound = false;   // caller memory (input, parameter, bound gradient)
  int view_of = -1;     // root slot whose memory this one reuses; -1 if none
  bool kept = false;    // alive until the end of run()
  int first = -1;       // step that writes it (-1: never written by a step)
  int last = -1;        // last step that reads it (or the view of it)
  int64_t offset = -1;  // arena offset (root slots in the arena only)
};

// A collective node (graph/collective.h communicates()) becomes two steps: a
// start right after the step that writes its last input (but after every
// earlier collective's start: the graph's collective order is kept, as all
// ranks must issue them in one order), and a wait right before the first step that
// reads one of its outputs (or at the end). The wait step lists the node's
// inputs and outputs as `in` (and no `out`), so the lifetimes keep every
// in-flight buffer alive from start to wait.
struct PlanStep {
  NodeId node = kNoNode;
  bool recompute = false;  // a re-run of a forward node for backward readers
  bool view = false;       // output 0 is a view of input 0: no kernel runs
  bool start = false;      // starts a collective (the runner, not a kernel)
  bool wait = false;       // waits for the collective started at step `started`
  int started = -1;
  std::vector<int> in, out;
};

struct ExecPlan {
  std::vector<PlanSlot> slots;
  std::vector<PlanStep> steps;
  MemoryPlan memory;

  int root(int slot) const {
    while (slots[static_cast<size_t>(slot)].view_of >= 0)
      slot = slots[static_cast<size_t>(slot)].view_of;
    return slot;
  }
};

struct PlanRequest {
  bool recompute = false;
  std::vector<ValueId> kept;  // alive to the end (loss, outputs, unbound param grads)
  std::vector<bool> bound;    // per ValueId: lives in caller memory
};

ExecPlan make_exec_plan(const Graph& g, const PlanRequest& req);

}  // namespace mt
