// Fast-backend-only argument checks (its f32 dtype rules) and threading
// helpers shared by the fast backend's source files (internal to
// src/meshtrain/tensor/backends/fast). The checks every backend shares live in
// meshtrain/tensor/kernel_checks.h; these throw the same mt::ShapeError form.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include "meshtrain/base/error.h"
#include "meshtrain/tensor/kernel_checks.h"
#include "meshtrain/tensor/tensor.h"

namespace mt::fast {

inline void require_dtype(const char* kernel, const char* name, const Tensor& t, DType want) {
  require_defined(kernel, name, t);
  if (t.dtype() != want) fail(kernel, "{} {} must be {}", name, t.desc(), dtype_name(want));
}

// t is defined, f32 and shaped like ref.
inline void require_f32_like(const char* kernel, const char* name, const Tensor& t,
                             const char* ref_name, const Tensor& ref) {
  require_dtype(kernel, name, t, DType::f32);
  require_same_shape(kernel, ref_name, ref, name, t);
}

// Work below this many elements per thread is not worth waking a thread for.
inline constexpr int64_t kMinElemsPerThread = 16 * 1024;

// Calls f(begin, end) over [0, n) split into at most `threads` contiguous
// chunks of at least `grain` items; runs inline (no OpenMP region) when one
// chunk suffices, so single-threaded calls pay nothing. f must not throw.
template <class F>
void parallel_for(int64_t n, int64_t grain, int threads, F&& f) {
  if (n <= 0) return;
  const int64_t chunks =
      std::min<int64_t>(threads, std::max<int64_t>(1, n / std::max<int64_t>(grain, 1)));
  if (chunks <= 1) {
    f(int64_t{0}, n);
    return;
  }
#pragma omp parallel for num_threads(static_cast <int>(chunks)) schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    f(n * c / chunks, n * (c + 1) / chunks);
  }
}

// Grain (in rows) so that each chunk of rows of `cols` elements holds about
// kMinElemsPerThread elements.
inline int64_t row_grain(int64_t cols) {
  return std::max<int64_t>(1, kMinElemsPerThread / std::max<int64_t>(cols, 1));
}

}  // namespace mt::fast
