// A small pool of f32 buffers reused across steps (bucket staging for
// gradients, gathered parameters under ZeRO-3), so that steps do not
// allocate and page-fault large blocks again and again.
//
// acquire(n) hands out the smallest free buffer of at least n elements, or
// allocates a new one of exactly n (dropping a free buffer too small to be
// reused, so the count stays bounded). release() returns it. The pool owns
// the memory; handed-out pointers stay valid until release(). Not
// thread-safe; units are f32 elements and bytes.
#pragma once

#include <cstdint>
#include <vector>

#include "meshtrain/tensor/tensor.h"

namespace mt {

class BufferPool {
 public:
  // Index of a buffer of at least `numel` elements, now busy.
  int acquire(int64_t numel);
  void release(int index);
  float* data(int index) { return buffers_[static_cast<size_t>(index)].data<float>(); }
  // Whether a free buffer of at least `numel` exists (acquire would not allocate).
  bool has_free(int64_t numel) const;
  int busy() const;
  int64_t allocated_bytes() const;  // now
  int64_t peak_bytes() const { return peak_bytes_; }

 private:
  std::vector<Tensor> buffers_;  // no memory: slot dropped
  std::vector<bool> busy_;
  int64_t peak_bytes_ = 0;
};

}  // namespace mt
