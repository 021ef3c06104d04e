// Strict resume: does a checkpoint hold exactly the parameters of the model
// this run builds? Resuming continues one run, so any difference (a tensor
// missing or extra, another shape or dtype, another model kind or size) is
// an error listing every difference, never a partial load. Loading other
// weights on purpose (fine-tuning) is train.init's job, not resume's.
//
// Both checkpoint forms record the model in their metadata: the kind under
// "model" and its size settings under their config keys ("model.hidden",
// "model.layers", ...); a single file stores them as TrainState extras
// ("extra/model", ...). Pure functions, no I/O.
#pragma once

#include <map>
#include <string>

#include "meshtrain/models/model.h"
#include "meshtrain/tensor/tensor.h"

namespace mt {

struct TensorSignature {
  DType dtype = DType::f32;
  Shape shape;
};
using TensorSignatures = std::map<std::string, TensorSignature>;

// The model's kind ("model") and the size settings that shape its
// parameters, keyed by their config keys, as a checkpoint records them.
std::map<std::string, std::string> model_settings(const ModelSpec& spec);

// Throws CheckpointError naming `path` if `stored` (the checkpoint's
// parameters, names without a prefix) and `expected` (this run's) differ or
// the recorded model settings differ from `run_model` (settings absent from
// the checkpoint, e.g. an older one's, are not compared). The message lists
// the differing settings, the tensors missing from the checkpoint, those
// this model does not have, and the shape differences (each list capped),
// and points to train.init for loading other weights.
void require_same_params(const std::string& path,
                         const std::map<std::string, std::string>& stored_model,
                         const std::map<std::string, std::string>& run_model,
                         const TensorSignatures& stored, const TensorSignatures& expected);

}  // namespace mt
