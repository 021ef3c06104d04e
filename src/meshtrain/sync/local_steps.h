// Schemes in which every replica steps on its own gradients and replicas are
// brought together afterwards (sync/replica_sync.h says which is which):
//
//   local_sgd  parameters averaged (weighted by batch share) every `period`
//              steps, and after every step for the first `sync_until` steps
//              (post-local SGD). With period 1 and plain SGD it is all-reduce
//              data parallelism: sum_r s_r (p - lr g_r) = p - lr sum_r s_r g_r.
//   diloco     the trainer's optimizer is the inner one; every `period`
//              steps the weighted mean pseudo-gradient d = start - theta_r
//              takes an outer Nesterov step (v = mu v + d; start -= lr (d +
//              mu v)) and every replica restarts from `start`. With period 1,
//              outer lr 1 and mu 0 it is local_sgd with period 1.
//   gossip     D-PSGD: after each step a replica replaces its parameters by
//              the uniform mean of its own and its neighbours' on the
//              topology (gossip_neighbours()), exchanged by one all_to_allv
//              in which only neighbours receive (every rank calls it, so
//              there is no pairwise ordering to deadlock on). On the complete
//              graph it is local_sgd with period 1 and equal shares.
//
// Gradients are handled by a DataParallel over a one-rank communicator (its
// buckets, accumulation and gradient memory), scaled so each replica's
// gradient is the mean over its own examples. Memory beyond DataParallel's:
// diloco two parameter-sized buffers (start and the outer momentum), gossip
// 2 x degree parameter-sized exchange buffers, counted as buffers in memory().
#pragma once

#include <memory>

#include "meshtrain/sync/replica_sync.h"

namespace mt {

// Throws ConfigError for ZeRO stages > 0 (these schemes step on whole
// parameters) or a batch share outside (0, 1].
std::unique_ptr<ReplicaSync> make_local_steps_sync(const SyncOptions& o, Communicator& group,
                                                   ParamLayout layout, Tensor flat_params,
                                                   DataParallelOptions dp, double local_share);

// allreduce with a gradient codec (SyncOptions::codec): each rank's
// gradient (weighted by its batch share x ranks, so the average is the
// global batch's gradient) is compressed and averaged per parameter by
// CompressedAllReduce before the optimizer runs; every replica then holds
// the same parameters. ConfigError for ZeRO stages > 0 or a codec that
// does not fit a parameter (naming it).
std::unique_ptr<ReplicaSync> make_compressed_sync(const SyncOptions& o, Communicator& group,
                                                  ParamLayout layout, Tensor flat_params,
                                                  DataParallelOptions dp, double local_share);

}  // namespace mt
