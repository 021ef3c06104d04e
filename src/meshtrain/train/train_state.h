// What a training run saves and resumes from, and its layout in a
// checkpoint file (see checkpoint.h):
//   tensors   "param/<name>"          f32 master weights (whole parameters)
//             "optim/<name>.<kind>"   optimizer state, e.g. "optim/fc1.w.exp_avg"
//   metadata  "optimizer", "step", "epoch", "rng_position", "lr_step",
//             "loss_scale", "loss_scale_good_steps",
//             "optim_step/<name>"     per-parameter optimizer step counts
//             "extra/<key>"           the caller's free-form entries
// Numbers are stored as decimal text that round-trips exactly.
//
// Free functions over a plain struct; blocking file I/O.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "meshtrain/train/loss_scaler.h"
#include "meshtrain/train/optimizer.h"

namespace mt {

struct TrainState {
  // On load, the tensors already here name the expected parameters, give
  // their shapes, and receive the values (e.g. views into a ParamStore).
  std::map<std::string, Tensor> params;
  // The optimizer's name; on load, if non-empty, it must match the file's.
  std::string optimizer;
  OptimizerState optimizer_state;  // state of whole parameters
  int64_t step = 0;                // optimizer steps completed
  int64_t epoch = 0;
  uint64_t rng_position = 0;  // draws consumed from the run's random stream
  int64_t lr_step = 0;        // next 0-based step of the LR schedule
  LossScalerState loss_scaler;
  std::map<std::string, std::string> extra;
};

// Throws ConfigError if an optimizer state tensor belongs to no parameter,
// FileError when writing fails (the previous file at `path` then survives).
void save_train_state(const std::string& path, const TrainState& state);

// Reads `path` into `state`: params are copied into the existing tensors,
// everything else is replaced. Throws CheckpointError naming the tensor or
// key for a missing, extra or mis-shaped parameter, optimizer state that
// does not fit its parameter, another optimizer's checkpoint, or a missing
// or malformed number; FileError if the file cannot be read. On error
// `state` is left unchanged.
void load_train_state(const std::string& path, TrainState& state);

}  // namespace mt
