// Parameter server (sync.scheme = "ps"): the last `servers` ranks of the
// group hold the parameters, sharded by bytes, and run the optimizer on
// their shard; the other ranks are workers that compute gradients, push them
// to every server and pull the updated shards back. Servers do not compute.
//
// Shards: whole parameters, assigned largest first to the server holding the
// fewest bytes so far (ties: the lower server), each server's parameters in
// layout order. Whole parameters keep per-parameter optimizers (LAMB, LARS)
// exact on a shard. ConfigError when there are more servers than parameters.
//
// Global batch: train.batch_size is split over the workers only. In BSP a
// server waits for every worker's push of a step, sums the gradients weighted
// by each worker's share of the batch (the gradient of the global batch's
// mean loss, as all-reduce data parallelism has it) and takes one optimizer
// step: BSP is all-reduce DP step by step. In ASP and SSP every push is one
// optimizer step on that worker's own gradient (the mean over its
// batch_size / workers examples), applied as it arrives, with the learning
// rate of the pushing worker's step (optionally divided by the push's
// staleness: server updates since the worker's parameters were pulled).
// SSP(s) holds a worker's reply until the slowest live worker has pushed at
// least (its pushes - s) gradients: no worker computes more than s steps
// ahead of the slowest. ps_switch "after:N" runs BSP for N steps then ASP;
// "straggler" switches when the workers' straggler report (sync/straggler.h,
// run among the workers while they move in lock step) sees a persistent
// straggler; the switch takes effect on every worker at the same step.
//
// Messages (on a communicator of their own; sizes exact, so a receive names
// them): a push from worker w to server j is a 48-byte header (kind, the
// worker's step, the server version its parameters came from, its batch
// share, flags) and server j's shard of the gradient, f32; the reply is a
// 48-byte header (status, server version, the mode the push was handled in,
// the mode of the next step, the slowest worker's pushes) and server j's
// shard of the parameters. Per worker and step: push + pull = 2 x sum_j (48 +
// 4 n_j) bytes (n_j the elements of shard j); at the end one more of each
// (the "done" push and the final parameters). A push leaves per bucket
// during the backward (DataParallelOptions::on_bucket_final): shard j in
// message order (the worker's buckets in index order, layout order inside
// one), one message per bucket holding part of it, the first with the
// header; the server receives them in place, one posted receive at a time,
// and handles the push when its last piece is in. BSP sums a step's pushes
// in worker order (bitwise reproducible). Checkpoints (replica_sync.h):
// the servers' shards and optimizer state as whole tensors, each server's
// and worker's counters as rows, written after finish().
//
// sync.codec (payload codecs: f16, bf16, topk, randk, qsgd, sign): a push
// carries each of server j's parameters as the codec's payload instead of
// f32 (sizes fixed by codec and shape, so receives still name them), encoded
// on the worker with an error-feedback residual per parameter
// (sync/codecs.h, FeedbackEncoder); the server decodes it and adds share x
// the decoded gradient (BSP) or steps on it (ASP / SSP). Replies stay f32
// parameters. PowerSGD is refused: its factors are all-reduced among the
// compressing ranks, which a server that takes pushes one by one is not.
//
// How a server serves: it posts one receive per worker (Communicator::
// post_recv) and handles whichever completes first (wait_any), re-posting
// that worker's receive once the message is consumed. A worker sends one push
// per server and then waits for the replies; it never sends a second push
// before the first was answered, so each worker has at most one message in
// flight per server and the server's receive for it is always posted: nothing
// is ever waiting on a send that nobody receives. Servers never talk to each
// other and answer without waiting on a worker's reply, so there is no cycle
// of waits (no deadlock): BSP and SSP hold replies only for pushes of other
// workers, which are never blocked themselves (the slowest worker is always
// answered). A worker the server has answered and that sends nothing within
// dist.timeout_s (or whose process the transport sees gone) is, under BSP and
// SSP, reported by name: the server sends every waiting worker an abort
// reply naming it and throws; under ASP the server drops it and goes on.
// Workers wait for a reply up to the timeout plus 2 s, so the server's named
// error reaches them first.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "meshtrain/sync/replica_sync.h"

namespace mt {

// Which server (0-based) holds each layout entry (whole parameters, greedy
// by bytes as above). ConfigError when servers > layout.size().
std::vector<int> ps_shards(const ParamLayout& layout, int servers);

// One worker step as the worker saw it (for the SSP and switching tests and
// the metrics): its 0-based step, the server version of the parameters it
// got back (from server 0), the slowest worker's pushes when the reply was
// sent, and the mode the push was handled in ("bsp", "asp", "ssp").
struct PsStepLog {
  int64_t step = 0;
  int64_t version = 0;
  int64_t slowest = 0;
  std::string mode;
};

// The "ps" scheme over `group` (every rank: workers first, then the last
// o.servers ranks as servers). ConfigError for ZeRO stages > 0, servers out
// of [1, group size), or a shard without parameters.
std::unique_ptr<ReplicaSync> make_param_server_sync(const SyncOptions& o, Communicator& group,
                                                    ParamLayout layout, Tensor flat_params,
                                                    DataParallelOptions dp, double local_share);

// The per-step log of a worker's ps scheme (empty for servers and other schemes).
std::vector<PsStepLog> ps_step_log(const ReplicaSync& sync);

}  // namespace mt
