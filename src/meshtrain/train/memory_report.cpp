#include "meshtrain/train/memory_report.h"

#include <sys/resource.h>

#include <string>
#include <vector>

#include "meshtrain/comm/communicator.h"

namespace mt {

int64_t peak_rss_bytes() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<int64_t>(ru.ru_maxrss) * 1024;
}

nlohmann::json memory_by_category(const std::array<int64_t, kMemoryCategories>& bytes) {
  nlohmann::json j = nlohmann::json::object();
  for (int c = 0; c < kMemoryCategories; ++c) {
    j[std::string(memory_category_name(static_cast<MemoryCategory>(c)))] =
        bytes[static_cast<size_t>(c)];
  }
  return j;
}

nlohmann::json memory_by_rank(Communicator& comm, int64_t peak_rss, const MemoryCounters& counters,
                              const CollectiveOptions& collective, bool gather,
                              const RankFigures& figures) {
  const int world = comm.size(), rank = comm.rank();
  // Per rank: peak RSS, live and peak allocator bytes per category, then
  // the figures.
  const int kPer = 1 + 2 * kMemoryCategories + static_cast<int>(figures.size());
  std::vector<double> per_rank(static_cast<size_t>(kPer * world), 0.0);
  double* mine = per_rank.data() + static_cast<ptrdiff_t>(kPer) * rank;
  mine[0] = static_cast<double>(peak_rss);
  for (int c = 0; c < kMemoryCategories; ++c) {
    mine[1 + c] = static_cast<double>(counters.live[static_cast<size_t>(c)]);
    mine[1 + kMemoryCategories + c] = static_cast<double>(counters.peak[static_cast<size_t>(c)]);
  }
  for (size_t f = 0; f < figures.size(); ++f) {
    mine[1 + 2 * kMemoryCategories + static_cast<int>(f)] = figures[f].second;
  }
  if (world > 1 && gather) {
    comm.all_reduce(per_rank.data(), per_rank.data(), per_rank.size(), DType::f64, ReduceOp::sum,
                    collective);
  }
  nlohmann::json ranks = nlohmann::json::array();
  for (int q = 0; q < world; ++q) {
    const double* v = per_rank.data() + static_cast<ptrdiff_t>(kPer) * q;
    std::array<int64_t, kMemoryCategories> live{}, peak{};
    for (int c = 0; c < kMemoryCategories; ++c) {
      live[static_cast<size_t>(c)] = static_cast<int64_t>(v[1 + c]);
      peak[static_cast<size_t>(c)] = static_cast<int64_t>(v[1 + kMemoryCategories + c]);
    }
    nlohmann::json entry = {{"rank", q},
                            {"peak_rss_bytes", static_cast<int64_t>(v[0])},
                            {"mem_live_bytes", memory_by_category(live)},
                            {"mem_peak_bytes", memory_by_category(peak)}};
    for (size_t f = 0; f < figures.size(); ++f) {
      entry[figures[f].first] = v[1 + 2 * kMemoryCategories + static_cast<int>(f)];
    }
    ranks.push_back(std::move(entry));
  }
  return ranks;
}

}  // namespace mt
