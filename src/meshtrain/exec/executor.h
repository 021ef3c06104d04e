// Runs a (forward + backward) Graph in one process.
//
// Construction compiles a plan: the schedule (the graph's node order), the
// memory plan (every activation and gradient gets an offset in one arena,
// buffers reused once their last reader has run, so peak activation memory is
// known before the first step), optional activation recomputation, and a
// kernel per node. Parameters and their gradients live outside the arena:
// the caller binds them (the optimizer updates them in place).
//
// run() executes every node once, timing each. Not thread-safe; one executor
// per rank.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/graph/graph.h"
#include "meshtrain/tensor/tensor.h"

namespace mt {

struct ExecOptions {
  std::string backend = "fast";  // see tensor/kernels.h
  // Recompute cheap forward activations (element-wise, normalisation) during
  // backward instead of keeping them alive: trades FLOPs for memory.
  bool recompute = false;
  bool profile = true;  // time every operator
  // Values kept alive until the end of run() so get() can read them (the
  // loss always is; add e.g. the logits for accuracy).
  std::vector<ValueId> outputs;
};

struct MemoryPlan {
  int64_t arena_bytes = 0;       // planned peak of activations + temporaries
  int64_t param_bytes = 0;       // bound parameters
  int64_t grad_bytes = 0;        // bound or planned parameter gradients
  int64_t unplanned_bytes = 0;   // what keeping every value alive would take
  std::vector<int64_t> offset;   // per ValueId: arena offset, -1 if not in the arena
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
  void bind(ValueId v, Tensor t);
  // Called after the node producing a parameter's gradient has run, with the
  // parameter id (data-parallel sync starts buckets from here).
  void on_grad_ready(std::function<void(ValueId param)> cb);

  // Runs all nodes. Throws if an input or parameter is unbound.
  void run();
  // Runs only the forward nodes (evaluation).
  void run_forward();

  // The current contents of any value that is still alive after run() (the
  // loss, outputs, gradients, bound values).
  Tensor get(ValueId v) const;

  const MemoryPlan& memory_plan() const;
  const std::vector<OpProfile>& profile() const;
  void reset_profile();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mt
