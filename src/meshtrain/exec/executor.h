// Runs a (forward + backward) Graph in one process.
//
// Construction compiles a plan: the schedule (the graph's node order), the
// memory plan (every activation and gradient gets an offset in one arena,
// buffers reused once their last reader has run, so peak activation memory is
// known before the first step), optional activation recomputation, and a
// kernel per node. Inputs and parameters live outside the arena: the caller
// binds them (the optimizer updates them in place). A parameter gradient the
// caller binds is written straight into that memory; one it does not bind is
// planned in the arena and kept alive until the end of run().
//
// A collective node runs as a start step as soon as its inputs are written
// (keeping the graph's order of collectives) and a wait step right before
// its first reader (exec_plan.h); the runner in
// ExecOptions::collectives does the communication, and compute between the
// two overlaps it. The profile lists the wait as "<node>/wait".
//
// run() executes every node once (recomputed nodes twice), timing each. The
// executor keeps its own copy of the graph. Not thread-safe; one executor per
// rank.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/exec/collective_runner.h"
#include "meshtrain/graph/graph.h"
#include "meshtrain/tensor/kernels.h"
#include "meshtrain/tensor/tensor.h"

namespace mt {

struct ExecOptions {
  std::string backend = "fast";  // see tensor/kernels.h
  FastBackendOptions fast;       // engine and layout choices of the "fast" backend
  // Recompute cheap forward activations (element-wise, normalisation) during
  // backward instead of keeping them alive: trades FLOPs for memory.
  bool recompute = false;
  bool profile = true;  // time every operator
  // Values kept alive until the end of run() so get() can read them. Always
  // kept: the graph's loss, unbound parameter gradients, and the first output
  // of every forward node that no node reads (e.g. the loss of a forward-only
  // graph). Add e.g. the logits for accuracy.
  std::vector<ValueId> outputs;
  // Threads per kernel call, passed to the backend's set_num_threads (which
  // is process-wide); 0 leaves the backend's setting alone.
  int num_threads = 0;
  // Runs the graph's collective nodes (graph/collective.h). A graph with a
  // collective that communicates and no runner fails in run() with a
  // ConfigError naming the node, even for a group of one rank: the executor
  // cannot know a group's size, and silently treating a collective as the
  // identity would hide a missing runner. f (copy_to_group) needs none.
  std::shared_ptr<CollectiveRunner> collectives;
  // Emulated device speed (dist.slowdown): every kernel's time is stretched
  // by this factor (the executor sleeps (factor - 1) x its duration,
  // gathered into sleeps of at least 0.2 ms), collectives and their waits
  // are not, so a slower device looks like one to its peers. 1 = none.
  double slowdown = 1.0;
};

struct MemoryPlan {
  int64_t arena_bytes = 0;      // planned peak of activations + temporaries
  int64_t param_bytes = 0;      // bound parameters
  int64_t grad_bytes = 0;       // bound or planned parameter gradients
  int64_t unplanned_bytes = 0;  // what keeping every value alive would take
  std::vector<int64_t> offset;  // per ValueId: arena offset, -1 if not in the arena
  // With ExecOptions::recompute: forward nodes re-run during backward, and their FLOPs.
  int recompute_steps = 0;
  double recompute_flops = 0;
};

// Where the parameter gradients of a training graph live, for planning.
enum class GradMemory {
  kept,       // unbound: in the arena, alive to the end of run() (the default)
  bound,      // bound to caller memory, outside the arena (Executor::bind)
  transient,  // unbound: in the arena until on_grad_ready returns (set_transient_grads)
};

// The memory plan an Executor for `g` with `opts` has once its parameter
// gradients are placed as `grads` says, computed by the same code without
// building an executor or allocating anything (Executor::memory_plan() then
// reports the same numbers). For sizing a run before committing to it.
MemoryPlan plan_memory(const Graph& g, const ExecOptions& opts, GradMemory grads);

// One event of the parameter-residency protocol (Executor::set_param_hooks):
// `param` is about to be read (acquire) or was read for the last time
// (release) in the forward phase (forward nodes) or the backward phase
// (backward nodes and recomputation steps).
struct ParamUse {
  ValueId param = kNoValue;
  bool acquire = true;
  bool backward = false;
};

// Callbacks for parameters that are not resident all the time (sharded
// parameters under ZeRO-3, offloading). Either may be empty.
struct ParamHooks {
  std::function<void(ValueId param, bool backward)> acquire;
  std::function<void(ValueId param, bool backward)> release;
};

struct OpProfile {
  std::string name;
  OpKind op;
  double flops = 0;
  int64_t total_ns = 0;
  int64_t calls = 0;
};

class Executor {
 public:
  Executor(const Graph& g, ExecOptions opts);
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // Binds caller-owned memory to a graph input, parameter or gradient value.
  // Shape and dtype must match (ShapeError naming the value otherwise).
  // During run() (from a callback) only parameters and inputs may be bound.
  void bind(ValueId v, Tensor t);
  // Called after the node producing a parameter's gradient has run, with the
  // parameter id (data-parallel sync starts buckets from here).
  // Replaces any earlier callback; an empty function removes it. Fires in
  // run() only (not run_forward()), not for recomputation steps.
  void on_grad_ready(std::function<void(ValueId param)> cb);
  // Called after every executed (non-view) step with its name (as in
  // profile()), operator, whether it is a backward step, and its start and
  // end (now_ns()). For timelines; an empty function removes it.
  using NodeCallback = std::function<void(const std::string& name, OpKind op, bool backward,
                                          int64_t start_ns, int64_t end_ns)>;
  void on_node_done(NodeCallback cb);

  // Parameter residency. With hooks set, run() and run_forward() bracket the
  // reads of each parameter per phase: acquire(p, backward) runs before the
  // first step of the phase that reads p, release(p, backward) after the last
  // one (after that step's on_grad_ready callbacks). acquire may bind() p:
  // parameters may be re-bound between steps during a run. After release the
  // executor does not touch p's memory until the next acquire, so the caller
  // may free it; bind borrowed memory (Tensor::wrap) for that, since the
  // executor keeps the handle it was given. While hooks are set a parameter
  // may be unbound when run() starts; acquire must bind it (ConfigError
  // otherwise). Empty hooks switch the protocol off.
  void set_param_hooks(ParamHooks hooks);
  // The events run() (forward_only: run_forward()) issues, in order; every
  // parameter a phase reads is acquired and released exactly once in it.
  std::vector<ParamUse> param_uses(bool forward_only) const;

  // Transient gradients: a parameter gradient the caller does not bind then
  // lives in the arena only until its on_grad_ready callback returns; the
  // callback must consume it (get() works inside the callback), and the
  // memory is reused by later steps, so no full gradient buffer exists
  // (ZeRO-2/3). get() of such a gradient after run() throws ConfigError.
  // Off by default: unbound gradients stay alive until the end of run().
  void set_transient_grads(bool transient);

  // Gradient accumulation in place: a bound parameter gradient `grad` whose
  // producer is an f32 matmul (inputs and output f32) is added into its
  // bound memory by the next run()s (the product's matmul with beta = 1,
  // as Megatron's gradient-accumulation fusion does), not overwritten; off
  // writes it as before (a step's first micro-batch: no zeroing needed).
  // The memory then holds the sum, so no node may read `grad`. ConfigError
  // naming the value otherwise, or when it is unbound, or during run().
  void set_accumulate(ValueId grad, bool on);

  // Runs all nodes. Throws ConfigError naming every input or parameter that a
  // node reads but that is unbound.
  void run();
  // Runs only the forward nodes (evaluation).
  void run_forward();

  // The current contents of any value that is still alive after run() (the
  // loss, outputs, gradients, bound values). Arena values are returned as a
  // view, valid until the next run() or bind() or the executor's end. Other
  // values, and arena gradients after a run_forward(), throw ConfigError
  // naming the value.
  Tensor get(ValueId v) const;

  // The plan for the current bindings: binding a gradient moves it out of the
  // arena, so the plan (and the arena, at the next run) follows bind().
  const MemoryPlan& memory_plan() const;
  // Bytes of the one arena actually allocated (0 before the first run).
  int64_t allocated_arena_bytes() const;
  // One entry per step in schedule order: the graph's nodes, with
  // recomputation steps (named "recompute/<node>") interleaved where they
  // run. Times accumulate over runs until reset_profile().
  const std::vector<OpProfile>& profile() const;
  void reset_profile();
  // Wall time spent in kernels (not collective starts / waits, not views)
  // since construction or reset_profile(), with the slowdown's sleeps
  // (ExecOptions::slowdown): the emulated device's compute time. Counted
  // while the profile is on or a slowdown applies.
  int64_t compute_ns() const;
  // The same kernels' CPU time on the calling thread, times the slowdown:
  // what the emulated device would take with a core of its own (on a
  // machine whose cores are shared, compute_ns() also holds the waits for
  // a core).
  int64_t compute_cpu_ns() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mt
