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
//              Streaming DiLoCo (Douillard et al. 2025) as options: the
//              flat parameters in `fragments` consecutive pieces
//              (diloco_fragments()), fragment f exchanged every `period`
//              steps at its own phase; with overlap_steps = tau > 0 the
//              exchange is an *_async collective on the scheme's
//              communicator (its progress thread moves it) and lands after
//              the update of step t + tau, when the outer step runs and the
//              replica keeps alpha theta + (1 - alpha) start (merge_alpha);
//              outer_bits = 4 sends each rank's weighted pseudo-gradient as
//              4-bit codes (sync/outer_quant.h) by one all_gather, decoded
//              and summed in f32 in rank order on every rank (so every
//              replica computes the same outer step).
//   gossip     D-PSGD: after each step a replica replaces its parameters by
//              the uniform mean of its own and its neighbours' on the
//              topology (gossip_neighbours()), exchanged by one all_to_allv
//              in which only neighbours receive (every rank calls it, so
//              there is no pairwise ordering to deadlock on). On the complete
//              graph it is local_sgd with period 1 and equal shares.
//   partial    layer-wise partial synchronization (in the spirit of
//              DreamDDP): a layer is the parameters sharing a name up to the
//              last '.', numbered in layout order; layer l is in group
//              l % period. After step t's update the weighted mean of group
//              (t - 1) % period starts (an all_reduce_async of a packed copy)
//              and lands in the parameters when the next forward first
//              reads one of the group's parameters (an executor parameter
//              hook), or at the next update / gather / checkpoint / finish,
//              whichever comes first; so it overlaps with the next step's
//              start and the forward of the layers before the group. Every
//              layer is averaged once every `period` steps (groups are empty
//              when layers < period). With period 1 it is local_sgd with
//              period 1; bytes over a whole number of periods are local_sgd's
//              with the same period.
//   adpsgd     AD-PSGD: even ranks are active, odd ranks passive. After each
//              local step an active rank sends its parameters to one passive
//              neighbour (uniform at random among its opposite-parity
//              neighbours on sync.topology, per-rank seed) on a communicator
//              of its own and keeps the mean of its own and the reply. A
//              passive rank's server thread (the only user of that
//              communicator on its rank) answers each request at once with
//              the parameters it published at its last step boundary and
//              folds the active's parameters in as a pending average
//              (theta <- (theta + x) / 2, composed as theta <- a theta + b),
//              applied at its next step boundary. Deadlock-free by
//              construction: requests go only active -> passive, replies only
//              back; a passive server never waits for its own rank's compute
//              or for another rank's reply, so the wait graph is bipartite
//              with edges one way and has no cycle; no collective ties ranks
//              together per step (lock_step() is false: the trainer reports
//              each rank's own loss).
//
// sync.codec (local_sgd, diloco, partial): the averaged quantity is the
// pseudo-gradient, the parameters' change since the last synchronization
// (local_sgd, partial: anchor - theta_r with the anchor the parameters the
// last synchronization of that parameter left; diloco: start - theta_r). Each rank sends n s_r x
// that change through one CompressedAllReduce per parameter
// (sync/compressed_all_reduce.h, its own error-feedback residual), which
// averages what the ranks sent; local_sgd takes theta = anchor - average
// (sum_r s_r theta_r when nothing is held back), diloco's outer step takes
// the average as its pseudo-gradient. With Streaming DiLoCo's fragments
// each fragment's pseudo-gradient goes through the codec when its turn
// comes, one CompressedAllReduce per piece of a parameter in that fragment
// (diloco_codec_pieces(), each with its own residual; one fragment: one
// piece per parameter, as local_sgd); with sync.overlap_steps each piece
// is encoded when the fragment is sent, its collective runs asynchronously
// (CompressedAllReduce::start / finish) and its average lands
// overlap_steps inner steps later, as the f32 exchange's does (PowerSGD,
// whose two all-reduces depend on each other, runs blocking when sent and
// lands as late). The 4-bit outer exchange is a codec of its own: sync.codec
// with sync.outer_bits = 4 is refused. partial's group exchange is
// blocking, right after the update.
//
// sync.codec (gossip, adpsgd): CHOCO-SGD (sync/choco.h, docs/sync.md
// "Compressed gossip"). gossip: each rank keeps its public copy xhat and
// mixed = sum_j w_ij xhat_j over itself and its neighbours (seeded by one
// f32 exchange before the first step); after its step it sends Q(theta -
// xhat) to its neighbours (one all_to_allv of payloads), adds its own and
// theirs into xhat / mixed, and takes theta += gamma (mixed - xhat).
// adpsgd: per partner, copies of both sides' xhat; an exchange sends
// Q(theta - xhat) both ways (whole f32 parameters the first time a pair
// meets), and each side moves gamma / 2 towards the other's copy (the
// passive through its pending correction, additive instead of a scale).
//
// Gradients are handled by a DataParallel over a one-rank communicator (its
// buckets, accumulation and gradient memory), scaled so each replica's
// gradient is the mean over its own examples. Memory beyond DataParallel's:
// diloco two parameter-sized buffers (start and the outer momentum), gossip
// 2 x degree parameter-sized exchange buffers (with a codec instead: two
// parameter-sized copies and 2 x degree payloads), partial one buffer the
// size of the largest layer group, adpsgd two (active) or three (passive)
// parameter-sized buffers (with a codec: plus 2 x partners copies), counted
// as buffers in memory().
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "meshtrain/sync/replica_sync.h"

namespace mt {

// Streaming DiLoCo's fragments (SyncOptions::fragments): fragment f holds
// the flat parameters' elements [offset, offset + numel), offset = f *
// numel_total / fragments (consecutive layers in layout order, cut at
// element boundaries, so fragment sizes differ by at most one element), and
// synchronizes after the inner steps t >= 1 with t = phase (mod period),
// phase = f * period / fragments: the phases are spread evenly over the
// period, so the bytes per step are even (one fragment every period /
// fragments steps). With one fragment it is plain DiLoCo (t = 0 mod period).
struct DilocoFragment {
  int64_t offset = 0, numel = 0, phase = 0;
};
std::vector<DilocoFragment> diloco_fragments(int64_t numel, int64_t fragments, int64_t period);

// DiLoCo with sync.codec: what one compressed all-reduce carries -- the
// part of parameter `param` (layout index) that lies in fragment
// `fragment`, flat elements [offset, offset + shape.numel()). Its shape is
// the parameter's when the fragment holds all of it, a slab of whole rows
// (rows x the parameter's numel / shape[0]) when the cut falls between rows
// (PowerSGD sees a matrix either way), else 1-D. In fragment order, then
// layout order; with one fragment, one piece per parameter.
struct CodecPiece {
  std::string name;  // "fc1.w" or "fc1.w[0:96] (fragment 1)"
  Shape shape;
  int64_t offset = 0;
  int param = 0;
  int fragment = 0;
};
std::vector<CodecPiece> diloco_codec_pieces(const ParamLayout& layout, int64_t flat_numel,
                                            int64_t fragments, int64_t period);

// Throws ConfigError for ZeRO stages > 0 (these schemes step on whole
// parameters) or a batch share outside (0, 1].
std::unique_ptr<ReplicaSync> make_local_steps_sync(const SyncOptions& o, Communicator& group,
                                                   ParamLayout layout, Tensor flat_params,
                                                   DataParallelOptions dp, double local_share);

// allreduce with a gradient codec (SyncOptions::codec): each rank's
// gradient (weighted by its batch share x ranks, so the average is the
// global batch's gradient) is compressed and averaged per parameter by
// CompressedAllReduce before the optimizer runs; every replica then holds
// the same parameters. Under ZeRO stages 1-3 (dp.stage > 0) each bucket's
// reduce-scatter is a CompressedReduceScatter instead (each chunk encoded
// for its owner, all-to-all, decoded and summed there; payload codecs only).
// ConfigError for a codec that does not fit a parameter or a ZeRO chunk
// (naming it), or PowerSGD under ZeRO.
std::unique_ptr<ReplicaSync> make_compressed_sync(const SyncOptions& o, Communicator& group,
                                                  ParamLayout layout, Tensor flat_params,
                                                  DataParallelOptions dp, double local_share);

}  // namespace mt
