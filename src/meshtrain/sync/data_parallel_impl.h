// Internal to sync: the state behind DataParallel, shared by its source
// files (data_parallel.cpp: micro-steps, buckets, optimizer step, costs;
// data_parallel_attach.cpp: executor hooks and ZeRO-3 gathering;
// data_parallel_pieces.cpp: checkpoint pieces and the memory report).
#pragma once

#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/sync/buffer_pool.h"
#include "meshtrain/sync/data_parallel.h"

namespace mt {

// One executor DataParallel is attached to, and what it needs to serve its
// callbacks. Owned by DataParallel::Impl; the executor's callbacks hold a
// raw pointer to it.
struct DpAttachment {
  Executor* exec = nullptr;
  bool training = false;             // the graph has parameter gradients
  std::vector<int> param_of;         // per ValueId: layout index of a parameter, else -1
  std::vector<ValueId> grad_value;   // per layout index: gradient ValueId, or kNoValue
  std::vector<ValueId> param_value;  // per layout index: parameter ValueId, or kNoValue
  // ZeRO-3, per phase (0 forward, 1 backward): buckets in the order they are
  // first needed, the next one in that order per bucket (-1 at the end), and
  // how many of a bucket's parameters the phase reads.
  std::vector<int> order[2];
  std::vector<int> next[2];
  std::vector<int> users[2];
};

struct DataParallel::Impl {
  Impl(Communicator& c, DataParallelOptions o, BucketPlan p)
      : comm(c), opt(std::move(o)), plan(std::move(p)) {}

  Communicator& comm;
  DataParallelOptions opt;
  BucketPlan plan;

  // Storage (see the class comment for which stage holds what).
  Tensor flat_params;   // stages 0-2: the caller's replicated buffer
  Tensor full_grads;    // stages 0-1
  Tensor shard_params;  // stage 3
  Tensor shard_grads;   // stages 2-3
  Tensor accum;         // stages 2-3 with K > 1 and N > 1: full-size accumulation
  std::vector<ParamSlice> slices;

  // Progress of the current optimizer step.
  int64_t step = 0;
  int micro = 0;  // micro-steps finished in this optimizer step
  bool in_micro = false;
  bool grads_ready = false;
  double weight = 1.0;
  bool bound_grads = false;  // stages 0-1 with K == 1: the executor writes full_grads itself

  struct BucketRun {
    int pending = 0;  // gradients of this micro-step not ready yet
    bool launched = false;
    CommHandle handle;
    int staging = -1;  // staging pool buffer, -1 if none
  };
  std::vector<BucketRun> runs;
  int next_launch = 0;
  std::deque<int> in_flight;  // launched buckets still holding a staging buffer
  BufferPool staging;
  std::vector<int> grad_params;  // per bucket: parameters that receive a gradient
  // Per bucket: element ranges (relative to the bucket) no gradient is
  // written to (padding, parameters without a gradient), zeroed in staging.
  std::vector<std::vector<std::pair<int64_t, int64_t>>> unwritten;
  std::vector<bool> has_grad;  // per layout index

  // ZeRO-3 gathered parameters, per bucket.
  struct Gathered {
    int buffer = -1;  // gather pool buffer; -1 when not gathered
    bool pending = false;
    CommHandle handle;
    int users_left = 0;
    bool used = false;  // acquired since this gather started (else: prefetched, not read yet)
  };
  std::vector<Gathered> gathered;
  BufferPool gather_pool;

  std::vector<std::unique_ptr<DpAttachment>> attachments;
  DpAttachment* training = nullptr;
  bool external = false;    // use_external_grads(): gradients come through add_grad()
  std::vector<bool> added;  // external: per layout index, given in this micro-step
  DataParallelStats stats;

  int world() const { return plan.world_size(); }
  int stage() const { return opt.stage; }

  // data_parallel.cpp
  float* grad_target(int bucket);  // where bucket's gradients accumulate (flat index begin)
  void on_grad(DpAttachment& a, ValueId param);
  // Scales parameter p's gradient (src; nullptr: already in full_grads) into its bucket.
  void take_grad(int p, const float* src);
  // Per bucket: how many of its parameters get a gradient, and the ranges none is written to.
  void set_grad_params();
  void launch_ready();
  void launch(int bucket);
  void reclaim_staging(bool wait_one);
  void wait_bucket(int bucket, const char* what);
  std::string context(int bucket, std::string_view what) const;
  void start_gather(DpAttachment& a, int bucket, int phase);
  void wait_gather(int bucket);
  void acquire(DpAttachment& a, ValueId param, bool backward);
  void release(DpAttachment& a, ValueId param, bool backward);
};

// Runs f and rethrows a CommError (or its TimeoutError / MismatchError
// subclass) with where() in front of its message, keeping the type. where()
// is called only on failure, so the message costs nothing on the fast path.
template <class Where, class F>
void with_comm_context(Where&& where, F&& f) {
  try {
    f();
  } catch (const TimeoutError& e) {
    throw TimeoutError(where() + ": " + e.what());
  } catch (const MismatchError& e) {
    throw MismatchError(where() + ": " + e.what());
  } catch (const CommError& e) {
    throw CommError(where() + ": " + e.what());
  }
}

}  // namespace mt
