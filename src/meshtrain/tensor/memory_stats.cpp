#include "meshtrain/tensor/memory_stats.h"

#include <atomic>

namespace mt {

namespace {

struct Counters {
  std::atomic<int64_t> live[kMemoryCategories] = {};
  std::atomic<int64_t> peak[kMemoryCategories] = {};
  std::atomic<int64_t> live_total{0};
  std::atomic<int64_t> peak_total{0};
};

Counters& counters() {
  static Counters c;
  return c;
}

thread_local MemoryCategory t_current = MemoryCategory::other;

void raise(std::atomic<int64_t>& peak, int64_t v) {
  int64_t p = peak.load(std::memory_order_relaxed);
  while (v > p && !peak.compare_exchange_weak(p, v, std::memory_order_relaxed)) {
  }
}

}  // namespace

std::string_view memory_category_name(MemoryCategory c) {
  switch (c) {
    case MemoryCategory::other:
      return "other";
    case MemoryCategory::params:
      return "params";
    case MemoryCategory::grads:
      return "grads";
    case MemoryCategory::optimizer:
      return "optimizer";
    case MemoryCategory::activations:
      return "activations";
    case MemoryCategory::comm:
      return "comm";
  }
  return "?";
}

MemoryCounters memory_counters() {
  Counters& c = counters();
  MemoryCounters r;
  for (int i = 0; i < kMemoryCategories; ++i) {
    r.live[static_cast<size_t>(i)] = c.live[i].load(std::memory_order_relaxed);
    r.peak[static_cast<size_t>(i)] = c.peak[i].load(std::memory_order_relaxed);
  }
  r.live_total = c.live_total.load(std::memory_order_relaxed);
  r.peak_total = c.peak_total.load(std::memory_order_relaxed);
  return r;
}

void reset_memory_peaks() {
  Counters& c = counters();
  for (int i = 0; i < kMemoryCategories; ++i) {
    c.peak[i].store(c.live[i].load(std::memory_order_relaxed), std::memory_order_relaxed);
  }
  c.peak_total.store(c.live_total.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

MemoryCategory current_memory_category() {
  return t_current;
}

MemoryScope::MemoryScope(MemoryCategory c) : saved_(t_current) {
  t_current = c;
}
MemoryScope::~MemoryScope() {
  t_current = saved_;
}

namespace detail {
void count_alloc(MemoryCategory cat, int64_t bytes) {
  Counters& c = counters();
  const int i = static_cast<int>(cat);
  raise(c.peak[i], c.live[i].fetch_add(bytes, std::memory_order_relaxed) + bytes);
  raise(c.peak_total, c.live_total.fetch_add(bytes, std::memory_order_relaxed) + bytes);
}
void count_free(MemoryCategory cat, int64_t bytes) {
  Counters& c = counters();
  c.live[static_cast<int>(cat)].fetch_sub(bytes, std::memory_order_relaxed);
  c.live_total.fetch_sub(bytes, std::memory_order_relaxed);
}
}  // namespace detail

}  // namespace mt
