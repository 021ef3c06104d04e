// The measured algorithm choice (comm/probe.h).
#include "meshtrain/comm/probe.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>

#include <fmt/format.h>

#include "meshtrain/base/error.h"
#include "meshtrain/comm/communicator.h"

namespace mt::comm {

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

std::vector<CommAlgorithm> probe_candidates(const GroupTopology& t) {
  // On 2 ranks halving-doubling is ring's exchange (one step each way per
  // phase): timing it twice would only add noise.
  std::vector<CommAlgorithm> c = {CommAlgorithm::ring};
  if (t.size != 2) c.push_back(CommAlgorithm::halving_doubling);
  if (t.shared_memory) c.push_back(CommAlgorithm::shared_memory);
  if (t.native) c.push_back(CommAlgorithm::native);
  return c;
}

MeasuredChoice choose_from_table(const ProbeTable& table, const AlgorithmPolicy& policy,
                                 double margin) {
  if (table.seconds.size() !=
      table.collectives.size() * table.sizes.size() * table.candidates.size()) {
    throw InternalError(fmt::format("probe table holds {} times for {} x {} x {} points",
                                    table.seconds.size(), table.collectives.size(),
                                    table.sizes.size(), table.candidates.size()));
  }
  AlgorithmPolicy fixed = policy;
  fixed.measured.reset();
  MeasuredChoice m;
  m.size = table.size;
  m.shared_memory = table.shared_memory;
  for (size_t ci = 0; ci < table.collectives.size(); ++ci) {
    const Collective c = table.collectives[ci];
    MeasuredChoice::Entry e;
    e.collective = c;
    for (size_t si = 0; si < table.sizes.size(); ++si) {
      const size_t bytes = table.sizes[si];
      const CommAlgorithm fallback =
          fixed.choose(c, bytes, table.size, table.shared_memory, table.native);
      CommAlgorithm pick = fallback;
      double fallback_s = std::numeric_limits<double>::infinity();
      double best_s = std::numeric_limits<double>::infinity();
      CommAlgorithm best = fallback;
      for (size_t ai = 0; ai < table.candidates.size(); ++ai) {
        const double t = table.at(ci, si, ai);
        if (table.candidates[ai] == fallback) fallback_s = t;
        if (t < best_s) {
          best_s = t;
          best = table.candidates[ai];
        }
      }
      if (std::isfinite(best_s) && best_s * (1.0 + margin) < fallback_s) pick = best;
      // The range of this size ends halfway (geometrically) to the next.
      const size_t upper =
          si + 1 < table.sizes.size()
              ? static_cast<size_t>(std::sqrt(static_cast<double>(bytes) *
                                              static_cast<double>(table.sizes[si + 1])))
              : std::numeric_limits<size_t>::max();
      if (!e.ranges.empty() && e.ranges.back().algorithm == pick) {
        e.ranges.back().max_bytes = upper;
      } else {
        e.ranges.push_back({upper, pick});
      }
    }
    m.entries.push_back(std::move(e));
  }
  return m;
}

ProbeTable time_candidates(Communicator& comm, const ProbeOptions& options) {
  const double started = now_s();
  ProbeTable t;
  t.collectives = options.collectives;
  t.sizes = options.sizes;
  t.size = comm.size();
  t.shared_memory = comm.has_shared_memory();
  t.native = comm.has_native();
  GroupTopology topo;
  topo.size = t.size;
  topo.shared_memory = t.shared_memory;
  topo.native = t.native;
  t.candidates = probe_candidates(topo);
  t.seconds.assign(t.collectives.size() * t.sizes.size() * t.candidates.size(),
                   std::numeric_limits<double>::infinity());
  if (t.size <= 1 || options.samples < 1) return t;
  for (Collective c : t.collectives) {
    if (c != Collective::all_reduce && c != Collective::all_gather &&
        c != Collective::reduce_scatter) {
      throw ConfigError(
          fmt::format("the algorithm probe times all_reduce, all_gather and "
                      "reduce_scatter, not {}",
                      collective_name(c)));
    }
  }
  const size_t n = static_cast<size_t>(t.size);
  size_t max_elems = 0;
  for (size_t b : t.sizes) max_elems = std::max(max_elems, b / 4 + n);
  std::vector<float> in(max_elems, 1.0f), out(max_elems, 0.0f);
  for (size_t ci = 0; ci < t.collectives.size(); ++ci) {
    const Collective c = t.collectives[ci];
    for (size_t si = 0; si < t.sizes.size(); ++si) {
      // Whole f32 blocks per rank, at least one.
      const size_t block = std::max<size_t>(1, t.sizes[si] / 4 / n);
      const size_t calls =
          std::clamp<size_t>((size_t{256} << 10) / std::max<size_t>(1, t.sizes[si]), 1, 4);
      std::vector<std::vector<double>> samples(t.candidates.size());
      std::vector<bool> runs(t.candidates.size(), true);
      auto call = [&](CommAlgorithm a) {
        CollectiveOptions o;
        o.algorithm = a;
        switch (c) {
          case Collective::all_reduce:
            comm.all_reduce(in.data(), out.data(), block * n, DType::f32, ReduceOp::sum, o);
            break;
          case Collective::all_gather:
            comm.all_gather(in.data(), out.data(), block, DType::f32, o);
            break;
          default:
            comm.reduce_scatter(in.data(), out.data(), block, DType::f32, ReduceOp::sum, o);
            break;
        }
      };
      // Warm-up (pages, caches); a candidate the communicator refuses for
      // this call (a native engine that cannot run it) is left out. The
      // refusal is the same on every rank: it depends only on the call.
      for (size_t ai = 0; ai < t.candidates.size(); ++ai) {
        try {
          call(t.candidates[ai]);
        } catch (const ConfigError&) {
          runs[ai] = false;
        }
      }
      // Samples of the candidates alternate, so all see the same load.
      for (int s = 0; s < options.samples; ++s) {
        for (size_t ai = 0; ai < t.candidates.size(); ++ai) {
          if (!runs[ai]) continue;
          comm.barrier();
          const double t0 = now_s();
          for (size_t k = 0; k < calls; ++k) call(t.candidates[ai]);
          samples[ai].push_back((now_s() - t0) / static_cast<double>(calls));
        }
      }
      for (size_t ai = 0; ai < t.candidates.size(); ++ai) {
        std::vector<double>& v = samples[ai];
        if (v.empty()) continue;
        std::nth_element(v.begin(), v.begin() + static_cast<long>(v.size() / 2), v.end());
        t.at(ci, si, ai) = v[v.size() / 2];
      }
    }
  }
  // The slowest rank's time of every point, on every rank: one all-reduce.
  // (Infinity stays infinity: max is exact, so every rank holds the same bits.)
  comm.all_reduce(t.seconds.data(), t.seconds.data(), t.seconds.size(), DType::f64, ReduceOp::max);
  double took = now_s() - started;
  comm.broadcast(&took, 1, DType::f64, 0);
  t.probe_seconds = took;
  return t;
}

std::shared_ptr<const MeasuredChoice> probe_algorithms(Communicator& comm,
                                                       const ProbeOptions& options,
                                                       ProbeTable* table_out) {
  if (comm.size() <= 1 || comm.has_hierarchy()) return nullptr;
  ProbeTable table = time_candidates(comm, options);
  auto m = std::make_shared<MeasuredChoice>(
      choose_from_table(table, comm.options().policy, options.margin));
  m->source = fmt::format("probe on {} ranks, {:.2f} s", table.size, table.probe_seconds);
  if (table_out != nullptr) *table_out = std::move(table);
  return m;
}

}  // namespace mt::comm
