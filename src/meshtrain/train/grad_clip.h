// Gradient clipping by global L2 norm, as torch.nn.utils.clip_grad_norm_.
//
// The norm is taken over the gradients of all parameters together. When the
// gradients are sharded across ranks (each rank holds a slice), pass a
// NormReducer that sums over those ranks so that every rank sees the same
// global norm; when they are replicated (after a data-parallel all-reduce),
// pass none. Free functions; they block only inside the reducer.
#pragma once

#include <span>

#include "meshtrain/train/optimizer.h"

namespace mt {

// sqrt of the sum of squares of every gradient element (reduced), in double.
// Throws ShapeError for a gradient that is not f32.
double global_grad_norm(std::span<const ParamRef> params, const NormReducer& reducer = {});

// Multiplies every gradient by max_norm / (norm + 1e-6) when the global norm
// exceeds max_norm, and returns the norm measured before clipping. A
// non-finite norm (inf or NaN gradients) is returned as it is and the
// gradients are left untouched, so the caller can skip the step. Throws
// ConfigError unless max_norm is finite and > 0.
double clip_grad_norm(std::span<ParamRef> params, double max_norm, const NormReducer& reducer = {});

}  // namespace mt
