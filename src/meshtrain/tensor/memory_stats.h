// Allocator counters by category: the bytes of tensor storage this process
// holds now (live) and at most so far (peak), per category and in total.
//
// Every owned Tensor allocation (Tensor::empty / zeros / full / clone / to)
// is counted under the category current on the allocating thread when it is
// made, and uncounted when its last handle goes. Callers tag what they
// allocate with a MemoryScope:
//
//   { MemoryScope tag(MemoryCategory::optimizer); slots_.emplace(..., Tensor::zeros(...)); }
//
// Untagged allocations count as `other` (data batches, tests, temporaries).
// Bytes are the requested sizes rounded up to the 64-byte alignment, i.e.
// what the allocator was asked for (not its bookkeeping or page rounding;
// RSS is measured separately). Borrowed memory (Tensor::wrap) is not counted.
// Counters are process-wide atomics; the current category is per thread.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

namespace mt {

enum class MemoryCategory : uint8_t {
  other = 0,
  params,       // parameters (master weights, shards, temporary full copies)
  grads,        // parameter gradients
  optimizer,    // optimizer state (moments, momentum buffers)
  activations,  // executor arenas (activations, backward temporaries)
  comm,         // communication buffers (bucket staging, gathered parameters)
};
inline constexpr int kMemoryCategories = 6;

std::string_view memory_category_name(MemoryCategory c);  // "params", ...

struct MemoryCounters {
  std::array<int64_t, kMemoryCategories> live{};
  std::array<int64_t, kMemoryCategories> peak{};  // per category, since start or reset
  int64_t live_total = 0;
  int64_t peak_total = 0;  // of the sum (not the sum of the peaks)

  int64_t live_of(MemoryCategory c) const { return live[static_cast<int>(c)]; }
  int64_t peak_of(MemoryCategory c) const { return peak[static_cast<int>(c)]; }
};

MemoryCounters memory_counters();
// Sets every peak to the current live value (e.g. after start-up).
void reset_memory_peaks();

MemoryCategory current_memory_category();

// Tags the allocations of this thread with `c` while it lives (nests).
class MemoryScope {
 public:
  explicit MemoryScope(MemoryCategory c);
  ~MemoryScope();
  MemoryScope(const MemoryScope&) = delete;
  MemoryScope& operator=(const MemoryScope&) = delete;

 private:
  MemoryCategory saved_;
};

namespace detail {
void count_alloc(MemoryCategory c, int64_t bytes);
void count_free(MemoryCategory c, int64_t bytes);
}  // namespace detail

}  // namespace mt
