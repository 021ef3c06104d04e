// What the synchronization-scheme tests under mpirun share (sync_mpi,
// codec_schemes_mpi, sync_checkpoint_mpi, ps_mpi): the small MLP they train
// and the Trainer options they start from -- plain SGD on the reference
// backend, 1 KiB buckets, no progress or evaluation, one seed -- so that a
// test states only what it varies.
#pragma once

#include <cstdint>

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

}  // namespace mt::test
