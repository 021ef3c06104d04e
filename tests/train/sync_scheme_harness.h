// What the synchronization-scheme tests under mpirun share (sync_mpi,
// codec_schemes_mpi, codec_momentum_mpi, gossip_codec_mpi,
// sync_checkpoint_mpi, ps_mpi): the small MLP they train, the Trainer
// options they start from -- plain SGD on the reference backend, 1 KiB
// buckets, no progress or evaluation, one seed -- so that a test states only
// what it varies, how far one run is from another, and (the codec tests)
// one run on the MPI world and what it leaves.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "meshtrain/sync/compressed_all_reduce.h"
#include "meshtrain/sync/replica_sync.h"
#include "meshtrain/train/param_store.h"
#include "meshtrain/train/trainer.h"
#include "sync/dp_harness.h"
#include "train/mpi_world.h"

namespace mt::test {

// The MLP: `image` x `image` inputs, hidden layers {hidden, 16}, 6 classes.
inline ModelSpec sync_mlp(int64_t hidden = 32, int64_t image = 8) {
  ModelSpec s;
  s.kind = "mlp";
  s.image_size = image;
  s.classes = 6;
  s.hidden = {hidden, 16};
  return s;
}

// The parts of a run a test varies; the rest is fixed by sync_options.
struct SyncRun {
  int64_t batch = 16;  // global
  int64_t steps = 12;
  double lr = 0.1;
  double momentum = 0;
};

inline TrainerOptions sync_options(const SyncOptions& sync, const SyncRun& r = {}) {
  TrainerOptions o;
  o.batch_size = r.batch;
  o.max_steps = r.steps;
  o.epochs = 100;  // max_steps ends the run
  o.progress = false;
  o.eval = false;
  o.seed = 5;
  o.exec.backend = "reference";
  o.optimizer = "sgd";
  o.optim.sgd.momentum = r.momentum;
  o.optim.sgd.nesterov = false;
  o.schedule.lr = r.lr;
  o.dist.dp.bucket_bytes = 1 << 10;
  o.dist.sync = sync;
  return o;
}

// How far run `got` is from run `want`: the largest relative difference of
// a step's loss, or of a parameter relative to the largest parameter
// magnitude of `want`, whichever is larger.
inline double divergence(std::span<const double> want_losses, std::span<const double> got_losses,
                         std::span<const float> want_params, std::span<const float> got_params) {
  double worst = 0;
  for (size_t i = 0; i < want_losses.size(); ++i) {
    worst = std::max(worst, std::abs(got_losses[i] - want_losses[i]) / std::abs(want_losses[i]));
  }
  double diff = 0, mag = 0;
  for (size_t i = 0; i < want_params.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(got_params[i]) - want_params[i]));
    mag = std::max(mag, std::abs(static_cast<double>(want_params[i])));
  }
  return std::max(worst, diff / mag);
}

// The same for two runs that carry `losses` and `params` (the replicas'
// mean parameters).
template <class Run>
double divergence(const Run& want, const Run& got) {
  return divergence(want.losses, got.losses, want.params, got.params);
}

// What a run on the MPI world leaves (train_sync).
struct SyncOutcome {
  std::vector<double> losses;
  std::vector<float> params;  // the replicas' mean (ps: the servers' final ones); with mean_params
  std::vector<float> own;     // this rank's own parameters (none under ZeRO-3)
  std::vector<float> residual;
  std::vector<ParamStore::Entry> entries;
  uint64_t bytes = 0;
  bool server = false;
  std::string name;
  ReplicaSync::Consensus consensus;  // with consensus
};

// Which runs' ranks report their own loss, averaged over the ranks (equal
// batches) to read as the global one: none, those between agreements
// (agreement_period() > 1: local_sgd, diloco), those not in lock step
// (AD-PSGD).
enum class OwnLosses { none, between_agreements, unless_lock_step };

struct SyncRecord {
  OwnLosses own_losses = OwnLosses::none;
  bool mean_params = true;  // the replicas' mean parameters (collective)
  bool consensus = false;   // the replicas' consensus distance (collective)
};

// Trains `o` on the sync MLP over 480 synthetic examples (seed 9) on the MPI
// world and records the outcome. Collective.
inline SyncOutcome train_sync(const TrainerOptions& o, const SyncRecord& rec = {}) {
  auto data = std::make_shared<SyntheticData>(sync_mlp(), 480, 9);
  Communicator& world = mpi_world();
  Trainer t(sync_mlp(), data, nullptr, o, &world);
  SyncOutcome out;
  out.losses = t.run().losses;
  const ReplicaSync& rs = t.replica_sync();
  if ((rec.own_losses == OwnLosses::between_agreements && rs.agreement_period() > 1) ||
      (rec.own_losses == OwnLosses::unless_lock_step && !rs.lock_step())) {
    world.all_reduce(out.losses.data(), out.losses.data(), out.losses.size(), DType::f64);
    for (double& x : out.losses) x /= world.size();
  }
  out.server = rs.is_server();
  if (o.dist.dp.stage < 3) {  // ZeRO-3 holds no whole parameters between steps
    const Tensor own = t.params().flat_values();
    out.own.assign(own.data<float>(), own.data<float>() + own.numel());
  }
  out.entries = t.params().entries();
  out.residual = rs.codec_residual();
  out.bytes = rs.bytes_sent();
  out.name = rs.name();
  if (rec.consensus) out.consensus = t.replica_sync().consensus();
  if (rec.mean_params) {
    const Tensor mean = t.gather_params();
    out.params.assign(mean.data<float>(), mean.data<float>() + mean.numel());
  }
  return out;
}

// This rank's bytes for one compressed all-reduce of every parameter (the
// scheme's communicator is a split of the world with the same ranks and
// collective options), handshakes left out as bytes_sent() leaves them.
inline uint64_t predicted_exchange(const std::vector<ParamStore::Entry>& entries,
                                   const std::string& codec) {
  CompressedAllReduceOptions co;
  co.codec = parse_codec_spec(codec);
  uint64_t b = 0;
  for (const ParamStore::Entry& e : entries) {
    b += predict_traffic(mpi_world(), compressed_all_reduce_plan(co, e.shape)).bytes_sent;
  }
  return b;
}

// Whether the mean of the last three losses is below that of the first three.
inline bool mean3_falls(const std::vector<double>& v) {
  const size_t n = v.size();
  return v[n - 1] + v[n - 2] + v[n - 3] < v[0] + v[1] + v[2];
}

}  // namespace mt::test
