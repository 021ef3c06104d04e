// CommCollectiveRunner: exec's CollectiveRunner (exec/collective_runner.h)
// over a Communicator. Group id i of a collective node means the ranks
// groups[i] of the communicator the runner was built over, in that order
// (group rank k is world rank groups[i][k]); each group this rank belongs to
// gets its own sub-communicator (Communicator::subgroup), so collectives of
// one group never wait on ranks outside it and each group counts its own
// bytes.
//
// start() queues the call on the group communicator's progress thread
// (*_async), so it overlaps the compute the executor runs before wait().
// Calls: all_reduce and reduce_from_group -> all_reduce (sum); all_gather ->
// all_gatherv; reduce_scatter -> reduce_scatterv (the v variants take the
// node's piece sizes, even or not); all_to_all -> all_to_all (even pieces). Along the outermost
// non-trivial dimension the pieces are contiguous blocks and the executor's buffers are used
// directly; along an inner dimension a staging buffer of the full (gathered / scattered) size holds
// the pieces rank by rank for the duration of the call (outside the executor's memory plan).
//
// Owned by the caller (the executor holds it through a shared_ptr); the
// world communicator must outlive it. Not thread-safe, like Communicator.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/exec/collective_runner.h"
#include "meshtrain/spmd/mesh.h"

namespace mt {

// This rank's group of mesh axis `axis` as a communicator split off
// `world` (group ranks ordered by their coordinate on the axis). Collective
// over `world`: every rank calls it with the same mesh and axis.
std::unique_ptr<Communicator> axis_communicator(Communicator& world, const Mesh& mesh,
                                                std::string_view axis, const std::string& name,
                                                const CollectiveOptions& opts = {});

class CommCollectiveRunner : public CollectiveRunner {
 public:
  // Collective over `world`: every rank calls it with the same `groups`
  // (lists of ranks of `world`, each rank at most once per list). Throws
  // ConfigError for an empty group or a rank out of range.
  CommCollectiveRunner(Communicator& world, std::vector<std::vector<int>> groups,
                       CollectiveOptions opts = {});
  ~CommCollectiveRunner() override;

  CollectiveHandle start(const CollectiveCall& call) override;
  void wait(CollectiveHandle h) override;

  int num_groups() const { return static_cast<int>(groups_.size()); }
  const std::vector<int>& ranks_of(int64_t group) const;
  // This rank's communicator of `group`; nullptr when it is not a member.
  Communicator* comm_of(int64_t group) const;

  // What the call node `n` of `g` costs this rank on its group's
  // communicator, with the algorithm that communicator chooses for it: the
  // same function the communicator's byte counters are checked against.
  CollectiveCost cost_of(const Graph& g, const Node& n) const;

 private:
  struct Pending;
  Communicator& world_;
  std::vector<std::vector<int>> groups_;
  std::vector<std::unique_ptr<Communicator>> comms_;  // per group; null if not a member
  CollectiveOptions opts_;
  uint64_t next_ = 1;
  std::map<uint64_t, std::unique_ptr<Pending>> pending_;

  Communicator& member_comm(const std::string& node, OpKind op, int64_t group) const;
};

}  // namespace mt
