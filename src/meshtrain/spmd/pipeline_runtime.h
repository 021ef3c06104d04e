// The pipeline runtime: one rank's part of a pipelined training step.
//
// Rank r of the pipeline group runs physical stage r, i.e. the virtual
// stages s with s % p == r of a PipelineCut (pipeline_stage.h), following
// its list of a PipelineSchedule's actions (schedule.h) for the m
// micro-batches of one optimizer step:
//   F(i, s)   runs stage s's forward pass on micro-batch i;
//   B(i, s)   its backward (BI / BW: the input- and weight-gradient parts);
//   send / recv of activations and gradients to and from the neighbours.
//
// Memory: saved buffers, not one executor per micro-batch in flight. Each
// pass of each stage has one executor (one arena, reused by every
// micro-batch); after a pass runs, what later passes read (PipelineStage's
// stash lists: activations the backward needs, outputs to send, input
// gradients) is copied out into that micro-batch's stash, which its last
// backward pass frees. Activation memory is therefore the passes' arenas
// plus (micro-batches in flight) x (one micro-batch's stash): peak_stash_bytes
// measures the latter as the step runs. Where the schedule runs every
// reader of a forward's stash before that forward's next run (1F1B's last
// stage: F(i) then B(i)), the stash keeps views of the arena instead of
// copies (the stage's outputs, which sends read, are copied still); it
// counts them as stashed all the same. Where another forward runs first
// (1F1B's first stage, GPipe), the forward runs in one of up to 3 arenas
// of its own, so up to 2 micro-batches in flight keep views as well.
//
// Communication is asynchronous. Each receive is posted a few actions
// before the one that waits for it (into the stash buffer the pass will
// read), and every send is queued as soon as its tensor exists; a recv
// action only waits for its message, so transfers overlap compute. Each direction between two
// stages has its own communicator (split from the group's at
// construction): activations sent by stage q travel on one, gradients sent
// by q on another, so a receive waiting for its message never holds up a
// send, and each is matched by a tag naming (sender's virtual stage,
// micro-batch, tensor).
//
// Gradients: each backward pass adds its parameter gradients into the
// rank's accumulators; at the end of the step they are divided by m (the
// loss is a mean over the global batch, each micro-batch's loss a mean over
// its equal share), and a parameter held by several ranks (a tied
// embedding, PipelineCut::shared_params) has its parts summed over them
// (sent to the lowest holder, summed in holder order, sent back), so every
// copy gets the same full gradient. grad() exposes them for an optimizer;
// sgd_step() is plain SGD for tests.
//
// Recomputation (PipelineStage::recompute): after a stage's forward the
// micro-batch's stash keeps only what was received (and outputs a stage on
// the same rank still reads); the backward (or input-gradient) action first
// runs the forward again, recorded as a span with recompute set.
//
// Timing: every compute action is recorded as a span (virtual stage,
// micro-batch, kind, start and end in now_ns(), a clock all processes of a
// node share), the per-micro-batch forward / backward timeline of a stage.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/exec/executor.h"
#include "meshtrain/spmd/pipeline_stage.h"
#include "meshtrain/spmd/reshard.h"
#include "meshtrain/spmd/schedule.h"

namespace mt {

// Stages on different meshes (spmd/cross_mesh.h): the runtime's `comm` is
// the whole job, physical stage q runs on the ranks stage_ranks[q] of it
// (disjoint sets; its virtual stages all there), and the tensors crossing
// boundary s -> s+1 (virtual stages) move by boundaries[s][k] (output k of
// stage s) instead of one send per tensor; between two virtual stages of
// one physical stage (ZBV's turn) by execute_reshard inside its ranks, all
// of which run that forward / backward at the same point of their lists. The schedule's actions
// stay: a send action queues the routes this rank starts (a partial source first takes the addend
// of the rank before it in the reduction, adds its own and passes it on); a receive is posted ahead
// for the routes' first hops into this rank, and when its action waits the rank receives the hops
// relayed inside its own stage, passes them on along the route's chain and assembles its piece.
// Activations and gradients sent by stage q, and the relays of each, travel on their own
// communicators, so no posted receive holds up a send.
// A parameter several stages hold (GPT's tied embedding) has its gradient
// summed over the holders' meshes after the step's backwards by `shared`
// (spmd/reshard.h's SharedParamReshard, in world ranks).
struct CrossMeshExchange {
  std::vector<std::vector<int>> stage_ranks;
  std::vector<std::vector<BoundaryReshard>> boundaries;
  std::vector<SharedParamReshard> shared;
};

struct PipelineOptions {
  // For every pass's executor (ExecOptions::outputs is replaced by what
  // each pass leaves in the stash).
  ExecOptions exec;
  // Asynchronous pipelining (schedule.h, AsyncMode; schedule 1f1b only):
  // after each micro-batch's backward on this rank, grad() holds that
  // micro-batch's gradients (of its mean loss, not divided by m) and
  // `update(microbatch)` is called to change param() in place (an
  // optimizer step). pipedream: the backward (and so the gradient) uses
  // the weight version the micro-batch's forward used, copied into a
  // stash (allocator category params) while newer versions exist.
  // spectrain: the forward uses W - s * u (s: its version gap, u: the
  // smoothed change per update, an exponential average with factor 0.9
  // starting from the first change), the backward the current weights.
  // Without the flush: see run_step / drain. A parameter shared by stages
  // (GPT's tied embedding) is updated by its lowest holder with the sum of
  // every holder's gradient of the micro-batch; the other holder, which
  // must be the last stage, mirrors it (async_mirrored: `update` leaves it
  // alone there): it receives the value the owner's forward of micro-batch
  // j used before its own forward of j, and sends its gradient part back.
  // Refused (ConfigError) with recomputing stages, a schedule other than
  // 1f1b, a shared parameter on a stage other than the first and last, or
  // on stages with meshes of their own.
  AsyncMode async = AsyncMode::none;
  std::function<void(int microbatch)> update;
  // Set: stages on different meshes (above).
  std::optional<CrossMeshExchange> cross_mesh;
  // train.precision = "bf16_storage" (graph/bf16_stash.h for the
  // single-process graph): what a forward leaves for its backward passes
  // -- each f32 activation of at least bf16_stash_min_bytes that is not a
  // stage output or the loss -- is stashed rounded to bf16 (half the
  // bytes) and widened to f32 where a backward pass binds it; every pass
  // still computes in f32. Forwards then always copy their stash out (no
  // views of the arenas, which would keep the f32 values alive). Received
  // inputs and the tensors sent stay f32.
  bool bf16_stash = false;
  int64_t bf16_stash_min_bytes = 16 * 1024;
};

struct PipelineSpan {
  int stage = 0;  // virtual stage
  int microbatch = 0;
  ActionKind kind = ActionKind::forward;
  int64_t start_ns = 0;
  int64_t end_ns = 0;
  // CPU time of the calling thread during the pass: below end - start when
  // the core was shared (an oversubscribed machine) or kernels ran on other
  // threads.
  int64_t cpu_ns = 0;
  // Time around the pass that is not the executor's: binding its inputs
  // before start_ns, and after end_ns copying what later passes read into
  // the stash and adding the parameter gradients into the accumulators.
  int64_t overhead_ns = 0;
  // A forward run again before the backward (PipelineStage::recompute).
  bool recompute = false;
};

// The model inputs a stage reads (e.g. "x", "y", "pos") for micro-batch i,
// at the micro-batch's shape.
using MicrobatchData = std::function<Tensor(int microbatch, const std::string& input)>;

class PipelineRuntime {
 public:
  // `comm` is the pipeline group: comm.size() == schedule.stages (or the
  // whole job, under opts.cross_mesh), and
  // `cut` has schedule.stages * schedule.virtual_stages stages. Collective
  // over comm (splits its private communicators). Parameters start at zero:
  // set them with set_param() before the first step (every copy of a shared
  // parameter must start equal). Throws ConfigError when the sizes disagree.
  PipelineRuntime(Communicator& comm, const PipelineCut& cut, PipelineSchedule schedule,
                  PipelineOptions opts = {});
  ~PipelineRuntime();
  PipelineRuntime(const PipelineRuntime&) = delete;
  PipelineRuntime& operator=(const PipelineRuntime&) = delete;

  int stage() const;                               // this rank's physical stage
  const std::vector<int>& virtual_stages() const;  // the virtual stages it runs
  // The parameters this rank's stages hold, in model order.
  const std::vector<std::string>& param_names() const;
  // The parameter's tensor: a handle on the memory the executors read, so
  // an optimizer updates it in place (assigning another tensor to the
  // handle changes nothing; use set_param to load values).
  Tensor param(const std::string& name) const;
  // Copies `value` into the parameter (ShapeError when shape or dtype differ).
  void set_param(const std::string& name, const Tensor& value);
  // Moves the parameter into `value` (and, when `grad` is not empty, its
  // gradient accumulator into `grad`): memory the caller owns, e.g. a flat
  // buffer that data-parallel sync updates and reduces in place. The
  // current values are copied over unless copy_values is false (the caller
  // filled `value` itself, e.g. ZeRO-3 gathering a stage's parameters into
  // a fresh buffer each step while the previous one is already freed); the
  // runtime's own tensors are freed. Both must outlive the runtime's use of
  // them. ShapeError when a shape or dtype differs.
  void bind_storage(const std::string& name, Tensor value, Tensor grad, bool copy_values = true);
  // After run_step: d loss / d param, the loss being the mean over the
  // step's micro-batches, summed over the stages sharing the parameter.
  const Tensor& grad(const std::string& name) const;

  // One step's forward and backward passes over m micro-batches, in the
  // schedule's order. Throws ConfigError naming the stage, pass and input
  // when `data` gives no tensor (or one of the wrong shape) for an input a
  // pass reads; comm errors (TimeoutError, CommError) propagate. After a
  // throw the runtime is unusable (messages of the failed step may still
  // be in flight): destroy it.
  void run_step(const MicrobatchData& data);
  // Async (PipelineOptions::async): run_step runs one window of 1F1B
  // without the flush (schedule.h, make_async_window): the step's
  // forwards, and backwards lagging p - 1 - stage micro-batches behind,
  // so micro-batches stay in flight across steps; drain() runs the
  // backwards (and updates) still owed, at the end of training. A no-op
  // when synchronous.
  void drain();
  // Async: the parameter is a mirror of another stage's (above), which
  // this rank's update must not change.
  bool async_mirrored(const std::string& name) const;
  // p -= lr * grad for every parameter held here (not the async mirrors).
  void sgd_step(double lr);

  // The last stage's rank: the mean of the step's micro-batch losses.
  bool has_loss() const;
  double loss() const;
  // The last step's compute spans, in execution order.
  const std::vector<PipelineSpan>& spans() const;
  // The last step's waits on peers, in order: a recv action (kind
  // recv_activation / recv_grad, or forward / backward whose receive was
  // waited for there) from when it started waiting to when its message was
  // in; microbatch -1, kind send_activation: the end-of-step wait for the
  // queued sends. cpu_ns is 0.
  const std::vector<PipelineSpan>& waits() const;
  // Observes every send / recv of the runtime's own communicators (for the
  // timeline's comm lane); see Communicator::set_call_observer.
  void set_call_observer(std::function<void(const CallEvent&)> observer);
  // Bytes this rank sent in the last step, as its communicators counted
  // them, and what the cut predicts: the boundary tensors of each send
  // action plus the shared-parameter gradient exchange.
  uint64_t bytes_sent() const;
  uint64_t predicted_bytes_sent() const;
  // The largest total of stashed tensors this rank held during the last step.
  int64_t peak_stash_bytes() const;
  // PipelineOptions::bf16_stash: the elements the last step's forwards
  // stashed in bf16 (0 otherwise).
  int64_t bf16_stashed_elements() const;
  // The bytes the last step's passes copied out of their arenas into the
  // stashes (the rest of the stash is views of the arenas or received).
  int64_t stash_copied_bytes() const;
  // How many receive buffers the runtime has made since construction: it
  // keeps them and reuses one once no one else holds it (an executor still
  // binds its last inputs), so a synchronous schedule's steps after the
  // second make none (stages on one mesh; across meshes receives still
  // allocate their buffers).
  int64_t recv_buffers_made() const;
  // Async pipedream: the most bytes of stashed weight versions this rank
  // held at once during the last step (0 otherwise), and how many versions.
  int64_t peak_weight_stash_bytes() const;
  int peak_weight_versions() const;
  // Async: the weight updates this rank applied since construction.
  int weight_version() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mt
