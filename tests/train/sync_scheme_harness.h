// What the synchronization-scheme tests under mpirun share (sync_mpi,
// codec_schemes_mpi, codec_momentum_mpi, gossip_codec_mpi,
// sync_checkpoint_mpi, ps_mpi): the small MLP they train, the Trainer
// options they start from -- plain SGD on the reference backend, 1 KiB
// buckets, no progress or evaluation, one seed -- so that a test states only
// what it varies, and how far one run is from another.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>

#include "meshtrain/train/trainer.h"

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

}  // namespace mt::test
