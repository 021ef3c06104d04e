// The measured algorithm choice (`dist.algorithm_choice = measured`): a short
// probe times each algorithm that can run a collective on this communicator
// (ring, halving-doubling, shared memory where the window exists, the
// engine's own collectives where it has them) at a few payload sizes, takes
// the slowest rank's time of each by one all-reduce (max), so every rank holds
// the same table, and picks per size range the fastest, keeping the static
// choice unless another algorithm beats it by more than a margin (noise on
// a shared machine must not flip the choice). The result is a
// MeasuredChoice for AlgorithmPolicy::measured: select_algorithm (comm/cost.h)
// stays the one place the choice is made, for the communicator and the
// planner alike. docs/comm.md ("Measured choice") has the design and the
// figures.
#pragma once

#include <cstddef>
#include <vector>

#include "meshtrain/comm/cost.h"
#include "meshtrain/comm/options.h"

namespace mt {

class Communicator;

namespace comm {

struct ProbeOptions {
  // Payload bytes probed per collective (the buffer for all-reduce, the
  // gathered / scattered total for all-gather / reduce-scatter).
  std::vector<size_t> sizes = {4096, 65536, size_t{1} << 20, size_t{4} << 20};
  std::vector<Collective> collectives = {Collective::all_reduce, Collective::all_gather,
                                         Collective::reduce_scatter};
  // Timed samples per point (after one warm-up call); each sample runs
  // enough back-to-back calls to move about 256 KiB (at most 4 calls).
  int samples = 3;
  // Another algorithm replaces the static choice at a size only when it is
  // faster by more than this fraction (a loaded machine's noise is of this
  // order; a smaller gain is not worth leaving the static rules for).
  double margin = 0.20;
};

// Seconds per call of each candidate at each size of each collective: the
// slowest rank's median (infinity where a candidate could not run).
struct ProbeTable {
  std::vector<Collective> collectives;
  std::vector<size_t> sizes;
  std::vector<CommAlgorithm> candidates;
  std::vector<double> seconds;  // [collective][size][candidate], row-major
  int size = 0;                 // ranks
  bool shared_memory = false;
  bool native = false;
  double probe_seconds = 0;  // wall time of the probe (rank 0's)

  double& at(size_t c, size_t s, size_t a) {
    return seconds[(c * sizes.size() + s) * candidates.size() + a];
  }
  double at(size_t c, size_t s, size_t a) const {
    return seconds[(c * sizes.size() + s) * candidates.size() + a];
  }
};

// The candidates a communicator of this topology can run for the probed
// collectives: ring, halving_doubling (not on 2 ranks, where it is ring's
// exchange), then shared_memory and native where available.
std::vector<CommAlgorithm> probe_candidates(const GroupTopology& t);

// Pure: the choice a table implies against `policy`'s static rules (the
// policy's own `measured` is ignored). Per size, the fastest candidate wins
// when it beats the static choice by more than `margin`; a range's upper end
// is the geometric mean of two probed sizes; adjacent equal ranges merge.
MeasuredChoice choose_from_table(const ProbeTable& table, const AlgorithmPolicy& policy,
                                 double margin);

// Collective over `comm` (every rank calls it, in the same order as its
// other calls): times every candidate, reduces to the slowest rank's
// times. Its calls count in the communicator's byte counters like any
// others (reset them after it to count from zero).
ProbeTable time_candidates(Communicator& comm, const ProbeOptions& options = {});

// time_candidates + choose_from_table against comm's current policy. Null
// where there is nothing to choose (one rank, or ranks on several nodes of
// equal size: the hierarchical algorithm decides there).
std::shared_ptr<const MeasuredChoice> probe_algorithms(Communicator& comm,
                                                       const ProbeOptions& options = {},
                                                       ProbeTable* table_out = nullptr);

}  // namespace comm
}  // namespace mt
