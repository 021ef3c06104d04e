// The memory figures of a run's summary line: the process's peak RSS and
// the allocator's counters per category (tensor/memory_stats.h), for this
// rank and, gathered for rank 0's summary, for every rank. Both trainers
// (the Trainer and the pipeline trainer) write them alike.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "meshtrain/tensor/memory_stats.h"

namespace mt {

class Communicator;
struct CollectiveOptions;

// The process's peak resident set so far, in bytes (getrusage).
int64_t peak_rss_bytes();

// {"params": bytes, "grads": bytes, ...}: one entry per category.
nlohmann::json memory_by_category(const std::array<int64_t, kMemoryCategories>& bytes);

// Named per-rank figures beside the memory ones (e.g. compute seconds per
// step); every rank passes the same names in the same order.
using RankFigures = std::vector<std::pair<std::string, double>>;

// [{"rank": q, "peak_rss_bytes", "mem_live_bytes", "mem_peak_bytes", and
// each of `figures`}, ...] for every rank of `comm`, from each rank's
// `peak_rss`, `counters` and `figures`. Collective over `comm` (one
// all-reduce) unless `gather` is false, when only this rank's entry is
// filled (the others zero): for schemes where a rank may have stopped (a
// parameter server under ASP).
nlohmann::json memory_by_rank(Communicator& comm, int64_t peak_rss, const MemoryCounters& counters,
                              const CollectiveOptions& collective, bool gather = true,
                              const RankFigures& figures = {});

}  // namespace mt
