// The memory figures of a run's summary line: the process's peak RSS and
// the allocator's counters per category (tensor/memory_stats.h), for this
// rank and, gathered for rank 0's summary, for every rank. Both trainers
// (the Trainer and the pipeline trainer) write them alike.
#pragma once

#include <array>
#include <cstdint>

#include <nlohmann/json.hpp>

#include "meshtrain/tensor/memory_stats.h"

namespace mt {

class Communicator;
struct CollectiveOptions;

// The process's peak resident set so far, in bytes (getrusage).
int64_t peak_rss_bytes();

// {"params": bytes, "grads": bytes, ...}: one entry per category.
nlohmann::json memory_by_category(const std::array<int64_t, kMemoryCategories>& bytes);

// [{"rank": q, "peak_rss_bytes", "mem_live_bytes", "mem_peak_bytes"}, ...]
// for every rank of `comm`, from each rank's `peak_rss` and `counters`.
// Collective over `comm` (one all-reduce) unless `gather` is false, when
// only this rank's entry is filled (the others zero): for schemes where a
// rank may have stopped (a parameter server under ASP).
nlohmann::json memory_by_rank(Communicator& comm, int64_t peak_rss, const MemoryCounters& counters,
                              const CollectiveOptions& collective, bool gather = true);

}  // namespace mt
