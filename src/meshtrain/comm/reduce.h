// Element-wise reduction kernels the collective algorithms combine buffers
// with. Stateless, non-blocking, thread-safe. 16-bit floats (bf16, f16) are
// widened to f32, combined in f32 and rounded to nearest-even once per call;
// integer sums wrap around (two's complement) instead of overflowing.
#pragma once

#include <cstddef>

#include "meshtrain/comm/options.h"
#include "meshtrain/tensor/dtype.h"

namespace mt::comm {

// dst[i] = srcs[0][i] (op) srcs[1][i] (op) ... (op) srcs[nsrc-1][i], divided by
// `divisor` when it is above 1 (ReduceOp::avg passes the group size on the
// last combine; `op` avg is treated as sum here). dst may alias srcs[0] but no
// other source. nsrc >= 1. When `dst2` is set the result is stored there too
// (in the same pass; dst2 aliases nothing).
void reduce_sources(void* dst, const void* const* srcs, int nsrc, size_t count, DType dtype,
                    ReduceOp op, int divisor = 1, void* dst2 = nullptr);

// dst[i] = a[i] (op) b[i], divided by `divisor` when above 1. dst may alias a.
inline void combine(void* dst, const void* a, const void* b, size_t count, DType dtype, ReduceOp op,
                    int divisor = 1) {
  const void* srcs[2] = {a, b};
  reduce_sources(dst, srcs, 2, count, dtype, op, divisor);
}

// buf[i] /= divisor (average after a sum computed elsewhere, e.g. by MPI).
void divide(void* buf, size_t count, DType dtype, int divisor);

}  // namespace mt::comm
