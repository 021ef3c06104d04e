// Cutting a model graph into pipeline stages.
//
// The input is the forward graph of one micro-batch (models' build_model at
// the micro-batch size: reshapes carry their batch, so the graph is built at
// the shape it runs) and the plan's virtual stages, each a run of the
// model's layers (model_layers() names them). Every forward node goes to one
// stage:
//   - a node reading a parameter runs no earlier than the stage holding the
//     parameter's layer, and no earlier than the stages producing its
//     activation inputs: its stage is the largest of those;
//   - a node reading only graph inputs (data, constants) runs in the first
//     stage that reads its output.
// A value produced in stage s and read in a later stage t is a boundary:
// stage s sends it, every stage between s and t receives it and passes it
// on (no copy: the received tensor is sent again), and the gradient flows
// back the same way, summed where a stage also uses the value.
//
// A parameter used by two stages (GPT's tied token embedding wte: the
// embedding in the first stage, the output head in the last) is held by
// both, starting from the same values; each stage's backward yields its own
// part of the gradient, and the runtime sums the parts over the ranks
// holding the copies before the optimizer step, so the copies stay equal.
// PipelineCut::shared_params lists them.
//
// Each stage is compiled into passes, separate graphs the executor runs one
// micro-batch at a time: forward; backward (from the received output
// gradients, or d loss = 1 in the last stage, to the parameter gradients and
// the gradients of the boundary inputs, which it sends back); and the same
// backward split into its input-gradient part and weight-gradient part
// (zero-bubble schedules run the latter later). A pass reads graph inputs
// by name and names what it leaves for later passes (its stash): the forward
// keeps exactly the activations the backward reads, so one micro-batch's
// stash is the memory a stage holds for each micro-batch in flight.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/graph/graph.h"
#include "meshtrain/spmd/plan.h"
#include "meshtrain/spmd/schedule.h"

namespace mt {

// A tensor crossing from one stage to the next (by its name in the model graph).
struct StageBoundary {
  std::string name;
  Shape shape;
  DType dtype = DType::f32;
  // The next stage sends a gradient back for it ("grad/<name>" there, held
  // as "dout/<name>" here). False for integer tensors and for values no
  // parameter's gradient depends on.
  bool has_grad = false;
  int64_t bytes() const;
};

// One runnable graph of a stage. Its graph inputs are bound by name from
// the micro-batch's stash (received tensors, what earlier passes left) or,
// failing that, from the data (the model's inputs); parameters by name.
struct StagePass {
  Graph graph;
  // Values this pass produces that later passes or the runtime read
  // (copied out after it runs): boundary outputs, the loss, activations the
  // backward needs, input gradients to send.
  std::vector<std::string> stash;
};

struct PipelineStage {
  int index = 0;  // virtual stage
  std::vector<std::string> layers;
  std::vector<std::string> params;       // held here, in model order
  std::vector<std::string> data_inputs;  // model inputs read here (x, labels, constants)
  std::vector<StageBoundary> inputs;     // received from stage index-1, in value order
  std::vector<StageBoundary> outputs;    // sent to stage index+1 (== its inputs)
  std::string loss;                      // the last stage: the loss's name; else empty
  // Per input with has_grad: the name of its gradient in the backward passes.
  std::vector<std::string> input_grads;
  StagePass forward;
  StagePass backward;         // the whole backward
  StagePass backward_input;   // its input-gradient part (runs first)
  StagePass backward_weight;  // its weight-gradient part
  // Bytes one micro-batch holds from its forward to its backward: the
  // received inputs and the activations the backward reads.
  int64_t stash_bytes = 0;
  // StagePlan::recompute: the runtime keeps only the received inputs
  // (recompute_stash_bytes, also counting outputs handed over in memory to
  // the next stage on the same rank) and reruns the forward before the
  // backward.
  bool recompute = false;
  int64_t recompute_stash_bytes = 0;
};

struct PipelineCut {
  std::vector<PipelineStage> stages;  // virtual stages in order
  // Parameters held by more than one stage, with those stages.
  std::vector<std::pair<std::string, std::vector<int>>> shared_params;
};

// Cuts `forward` (a forward-only graph with scalar loss `loss`) into the
// plan's virtual stages (`stages[s].layers`; ranks are ignored here).
// Throws ConfigError naming the stage or layer when a stage lists a layer
// the graph does not have, a layer is in no stage or in two, or the loss is
// not computed in the last stage; InternalError if `forward` has backward
// nodes.
struct CutOptions {
  // A collective node (graph/collective.h) whose inputs come from an
  // earlier stage runs in the first stage that reads its output, not in the
  // producer's: for stages on different meshes (spmd/cross_mesh.h), where
  // each stage's lowering converts its own inputs and a producer's partial
  // output is reduced on the way.
  bool collectives_join_consumers = false;
  // A cast of a parameter to a narrower dtype (mixed precision's f16 / bf16
  // copy before a matmul) runs in the first stage that reads its output,
  // which then shares the parameter, not in the parameter's stage: as in
  // the unpipelined graph, the reader's gradient for the copy is carried
  // in the parameter's dtype (GradContext::grad_dtype), not rounded to the
  // narrow dtype per micro-batch and sent back so (a tied GPT head under
  // f16 overflowed there at a 16x smaller loss scale). Off where shared
  // parameters cannot run (parallel.async).
  bool param_casts_join_consumers = false;
};
PipelineCut cut_pipeline(const Graph& forward, ValueId loss, const std::vector<StagePlan>& stages,
                         const CutOptions& options = {});

// The planned peak of stashed bytes on physical stage `rank` under `sched`
// (schedule.h): the most micro-batch chunks simulate() holds there at once
// times the largest per-micro-batch stash of its stages (a recomputing
// stage: what it keeps, plus one whole stash rebuilt for a backward -- one
// at a time, as the runtime runs a recomputing stage's whole backward at
// its input pass, also under zero-bubble and the V schedules, whose
// weight pass then runs nothing). An upper bound of
// PipelineRuntime::peak_stash_bytes() up to the boundary tensors in
// transit: outputs waiting to be sent or handed to the next chunk on the
// rank, gradients received ahead and input gradients waiting to be sent.
// Without recomputation a zero-bubble input pass also keeps, until the
// weight pass, intermediates the plan does not count.
int64_t planned_stash_bytes(const PipelineCut& cut, const PipelineSchedule& sched, int rank);
// One line per virtual stage (stash per micro-batch, what recomputation
// keeps) and one per rank (planned peak), for meshtrain inspect.
std::string describe_stash(const PipelineCut& cut, const PipelineSchedule& sched);

}  // namespace mt
