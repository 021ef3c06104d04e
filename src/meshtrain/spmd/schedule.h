// Pipeline schedules as pure functions: for p physical stages, m
// micro-batches, v virtual stages per physical stage and a kind, the ordered
// list of actions each physical stage performs in one optimizer step
// (forward / backward of micro-batch i on virtual stage s, the backward split
// into input-gradient and weight-gradient parts for zero-bubble, and the
// send / recv of activations and gradients between stages), plus a
// simulator that runs those lists with per-action costs and dependencies and
// reports the makespan and the idle ("bubble") fraction.
//
// The runtime executes these lists; the planner's simulator reuses them.
// Nothing here blocks or communicates.
//
// Virtual stage s (0 .. p*v-1) runs on physical stage s % p: with v = 2 and
// p = 4, physical stage 0 holds virtual stages 0 and 4 (Megatron's model
// chunks). With v = 1 virtual and physical stages coincide. zbv and
// dualpipev instead fold the stages into a V: s < p on rank s, s >= p on
// rank 2p-1-s (stage_owner() says which, for every kind).
//
// Bubbles with unit-cost actions (forward 1, backward 2 = input 1 + weight 1),
// as the simulator measures them and tests/spmd/schedule_test.cpp checks:
//   gpipe, 1f1b:   (p-1) / (m+p-1)
//   interleaved:   (p-1) / (v*m+p-1): the warm-up and cool-down still take
//                  p-1 slots each, but a slot is now one chunk (1/v of the
//                  stage's work), so the idle time is 1/v of 1F1B's.
//   zbv:           the V-shaped zero-bubble schedule (Qi et al. 2024, as
//                  PyTorch's ScheduleZBVZeroBubble): v = 2 chunks per
//                  rank, rank r holding virtual stages r and 2p-1-r, so
//                  the first and the last chunk (data in, loss out) are on
//                  rank 0 and the turn of the V (p-1 -> p) stays on rank
//                  p-1. Built greedily like zero_bubble below; measured by
//                  simulate() (tests/spmd/schedule_test.cpp): below 1F1B's
//                  and interleaved's (p-1)/(2m+p-1), e.g. p=4, m=8: 0.040.
//   dualpipev:     DeepSeek's DualPipe cut in half (PyTorch's
//                  ScheduleDualPipeV): zbv's V, a fixed eight-phase order
//                  whose steady phase pairs a forward of one chunk with a
//                  backward of the other, and zero-bubble input / weight
//                  passes in its tail (schedule.cpp, dualpipev_order).
//                  Needs m >= 2p. Measured by simulate(), not a formula:
//                  e.g. p=4, m=8 (tests/spmd/schedule_test.cpp).
//   zero_bubble:   below 1F1B's: weight-gradient passes, which nothing
//                  waits for, fill the slots 1F1B leaves idle (ZB-H1's
//                  warm-up, as 1F1B's; the deferred weight passes keep at
//                  most 2p micro-batches' inputs, against 1F1B's p). Not
//                  down to ZB-H1's ideal (p-1)/(3m+p-1): p=4, m=8 gives
//                  0.200 against 1F1B's 0.273 and the ideal's 0.111.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace mt {

enum class ScheduleKind { gpipe, one_f_one_b, interleaved, zero_bubble, zbv, dualpipev };

// "gpipe", "1f1b", "interleaved", "zero_bubble", "zbv", "dualpipev".
std::string_view schedule_name(ScheduleKind k);
// Throws ConfigError naming `where` and listing the kinds.
ScheduleKind parse_schedule_kind(std::string_view name, std::string_view where);

enum class ActionKind {
  forward,
  backward,         // the whole backward (input and weight gradients)
  backward_input,   // zero-bubble: the gradient w.r.t. the stage's input
  backward_weight,  // zero-bubble: the gradient w.r.t. the stage's weights
  send_activation,  // the output of forward(i, s) to the owner of s+1
  recv_activation,  // the input of forward(i, s) from the owner of s-1
  send_grad,        // the input gradient of stage s to the owner of s-1
  recv_grad,        // the output gradient of stage s from the owner of s+1
};
std::string_view action_name(ActionKind k);

// The physical stage (rank of the pipeline group) that runs virtual stage
// `vs` under `kind` with p physical stages.
int stage_owner(ScheduleKind kind, int stages, int vs);
// Whether the schedule splits the backward into input- and weight-gradient
// passes (zero_bubble, zbv; dualpipev for its tail).
bool splits_backward(ScheduleKind kind);
// Whether the stages fold into a V: rank r holds virtual stages r and
// 2p-1-r (zbv, dualpipev).
bool is_v_shaped(ScheduleKind kind);

struct PipelineAction {
  ActionKind kind = ActionKind::forward;
  int microbatch = 0;
  int stage = 0;  // virtual stage
  int peer = -1;  // send/recv: the other physical stage
  bool is_compute() const;
  bool operator==(const PipelineAction&) const = default;
};
// "F3@1", "B3@1", "BI3@1", "BW3@1", "send_act3@1->2", "recv_grad3@1<-2".
std::string describe(const PipelineAction& a);

struct PipelineSchedule {
  ScheduleKind kind = ScheduleKind::gpipe;
  int stages = 1;          // physical stages p
  int microbatches = 1;    // m
  int virtual_stages = 1;  // v (model chunks per physical stage)
  int warmup_extra = 0;    // 1f1b: extra warm-up forwards on every stage but the last
  std::vector<std::vector<PipelineAction>> actions;  // per physical stage, in order

  int virtual_count() const { return stages * virtual_stages; }
  int owner(int virtual_stage) const { return stage_owner(kind, stages, virtual_stage); }
};

// Throws ConfigError when (kind, p, m, v) cannot be scheduled, naming the
// keys (`where` prefixes them, e.g. "parallel" or "plan x.json") and what is
// expected: v must be 1 except for interleaved (which needs v >= 2), zbv and
// dualpipev (exactly 2); 1f1b, zero_bubble and zbv need m >= p, dualpipev
// m >= 2p, interleaved m a multiple of p.
void check_schedule(ScheduleKind kind, int stages, int microbatches, int virtual_stages,
                    std::string_view where);

// The actions of every physical stage. Call check_schedule() first.
// `warmup_extra` (1f1b only; check_warmup_extra()): each stage but the last
// runs that many more forwards before its first backward (p-1-r+extra, at
// most m). With transfers that take time, plain 1F1B at p = 2 waits for a
// message twice per micro-batch (the stages alternate in lock-step); one
// extra forward keeps the next activation in flight while the stage waits
// for a gradient, so the waits no longer add up per micro-batch. Each extra
// forward holds one more micro-batch's stash on the stage.
PipelineSchedule make_schedule(ScheduleKind kind, int stages, int microbatches,
                               int virtual_stages = 1, int warmup_extra = 0);
// Throws ConfigError naming `where`.warmup_extra unless it is 0, or >= 0
// with schedule 1f1b.
void check_warmup_extra(ScheduleKind kind, int warmup_extra, std::string_view where);

// Asynchronous pipelining (Plan::async, docs/plan.md "Asynchronous
// pipelining"): on top of 1F1B, each stage updates its weights after every
// micro-batch's backward instead of once per step, so a micro-batch's
// forward and backward on a stage may meet different weight versions.
//   none:      synchronous (gradients accumulated over the step's m
//              micro-batches, one optimizer step).
//   pipedream: PipeDream's weight stashing: the forward of micro-batch i
//              records the stage's weight version, and its backward runs
//              with exactly that version (kept in a stash until then); the
//              update is applied to the newest weights.
//   spectrain: SpecTrain's weight prediction: the forward runs with
//              W - s * u, u the smoothed (exponential average, factor
//              0.9) per-update change of the weights and s the micro-batch's
//              version gap (async_version_gap below); the backward runs with the
//              current weights, which are the ones its update applies to.
// Not equivalent to the synchronous run by design. Without the flush: a
// step is a window of the endless 1F1B stream (make_async_window below),
// micro-batches stay in flight across steps, and the pipeline drains only
// at the end of training.
enum class AsyncMode { none, pipedream, spectrain };
// "none", "pipedream", "spectrain".
std::string_view async_name(AsyncMode m);
// Throws ConfigError naming `where` and listing the modes.
AsyncMode parse_async_mode(std::string_view name, std::string_view where);
// Throws ConfigError naming `where`.async unless the mode is none or the
// schedule is 1f1b (PipeDream's; the other schedules' orders are not
// defined for per-micro-batch updates here).
void check_async(AsyncMode mode, ScheduleKind kind, std::string_view where);
// Per micro-batch of physical stage `stage` (one virtual stage per rank):
// how many of the stage's backward passes (= weight updates under async)
// run between the micro-batch's forward and its backward in the lists of
// `s`. 1F1B: p - 1 - stage in the steady state (+ warmup_extra on all but
// the last stage), micro-batch i of the warm-up min(i, that).
std::vector<int> version_gaps(const PipelineSchedule& s, int stage);

// Asynchronous pipelining runs 1F1B without the flush: one optimizer step
// is a window of the endless 1F1B stream, in which every stage runs the
// forwards of the step's m micro-batches (global ids window*m .. +m-1) and
// m backwards lagging p - 1 - r micro-batches behind on stage r (those of
// ids below window*m belong to the previous step, whose stash the stage
// still holds; window 0 skips the negative ids: 1F1B's warm-up). With
// `drain`, the window has no forwards: only the backwards still owed
// (the end of training). Micro-batch ids in the actions are global. The
// windows 0 .. T-1 and the drain, concatenated, are 1F1B over T*m
// micro-batches (tests/spmd/pipeline_async_test.cpp simulates them).
PipelineSchedule make_async_window(int stages, int microbatches, int window, bool drain);
// The version gap of global micro-batch g on physical stage r under the
// endless stream: min(g, p - 1 - r).
int async_version_gap(int stages, int stage, int64_t microbatch);

// Time units of each compute action (backward = input + weight).
struct ActionCosts {
  double forward = 1.0;
  double backward_input = 1.0;
  double backward_weight = 1.0;
  // Time from an action's end to its result's arrival on another physical
  // stage (latency of a transfer); 0: free.
  double transfer = 0.0;
};

struct ScheduleSimulation {
  double makespan = 0;
  std::vector<double> busy;                // per physical stage
  std::vector<int> peak_in_flight;         // per physical stage: micro-batch chunks whose
                                           // activations are held (forward done, backward
                                           // or weight pass not yet)
  std::vector<std::vector<double>> start;  // per stage, per action (-1 for send/recv)
  double idle_fraction = 0;                // 1 - sum(busy) / (p * makespan)
};

// Runs each stage's list in order; a compute action starts when its stage
// is free and its inputs exist: forward(i, s) after forward(i, s-1);
// backward / backward_input(i, s) after forward(i, s) and the backward
// (input) of (i, s+1); backward_weight(i, s) after backward_input(i, s).
// Send/recv take no time (their order is what the runtime follows).
// Throws InternalError naming the stuck stages if the lists deadlock or an
// action's input is never produced.
ScheduleSimulation simulate(const PipelineSchedule& s, const ActionCosts& costs = {});

// The closed-form bubble of gpipe / 1f1b / interleaved (above); for
// zero_bubble, 1F1B's (an upper bound); for zbv and dualpipev,
// interleaved's with 2 chunks, (p-1)/(2m+p-1) (an upper bound).
double formula_idle_fraction(ScheduleKind kind, int stages, int microbatches, int virtual_stages);

}  // namespace mt
