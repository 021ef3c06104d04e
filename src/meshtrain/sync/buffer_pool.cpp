#include "meshtrain/sync/buffer_pool.h"

#include <algorithm>

#include "meshtrain/base/error.h"
#include "meshtrain/tensor/memory_stats.h"

namespace mt {

int BufferPool::acquire(int64_t numel) {
  int best = -1;
  int too_small = -1;
  for (size_t i = 0; i < buffers_.size(); ++i) {
    if (busy_[i] || buffers_[i].raw() == nullptr) continue;
    if (buffers_[i].numel() >= numel) {
      if (best < 0 || buffers_[i].numel() < buffers_[static_cast<size_t>(best)].numel()) {
        best = static_cast<int>(i);
      }
    } else {
      too_small = static_cast<int>(i);
    }
  }
  if (best < 0) {
    // Replacing a free buffer that is too small keeps the pool from growing
    // by one buffer per distinct size.
    if (too_small >= 0) {
      best = too_small;
    } else {
      best = static_cast<int>(buffers_.size());
      buffers_.emplace_back();
      busy_.push_back(false);
    }
    buffers_[static_cast<size_t>(best)] = Tensor();
    MemoryScope tag(MemoryCategory::comm);  // bucket staging, gathered parameters
    buffers_[static_cast<size_t>(best)] = Tensor::empty({numel}, DType::f32);
    peak_bytes_ = std::max(peak_bytes_, allocated_bytes());
  }
  busy_[static_cast<size_t>(best)] = true;
  return best;
}

void BufferPool::release(int index) {
  MT_CHECK(
      index >= 0 && static_cast<size_t>(index) < busy_.size() && busy_[static_cast<size_t>(index)],
      "buffer {} released but not busy", index);
  busy_[static_cast<size_t>(index)] = false;
}

bool BufferPool::has_free(int64_t numel) const {
  for (size_t i = 0; i < buffers_.size(); ++i) {
    if (!busy_[i] && buffers_[i].raw() != nullptr && buffers_[i].numel() >= numel) return true;
  }
  return false;
}

int BufferPool::busy() const {
  int n = 0;
  for (bool b : busy_) n += b ? 1 : 0;
  return n;
}

int64_t BufferPool::allocated_bytes() const {
  int64_t n = 0;
  for (const Tensor& t : buffers_) n += t.raw() != nullptr ? static_cast<int64_t>(t.nbytes()) : 0;
  return n;
}

}  // namespace mt
