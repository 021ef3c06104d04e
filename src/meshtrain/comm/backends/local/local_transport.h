// The `local` backend: ranks are threads of one process (for tests and for
// running every strategy without MPI).
//
// A LocalFabric is shared by the threads of one LocalWorld: per-rank
// mailboxes (a send copies straight into a posted receive, or queues the
// message until the receive is posted), an in-process shared arena per group,
// and each rank's liveness, so a rank whose thread has ended is reported as a
// lost peer instead of leaving the others to time out. LocalTransport is one
// rank's view of one group; it never blocks (the communicator polls).
#pragma once

#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "meshtrain/comm/transport.h"

namespace mt {

class LocalArena;

class LocalFabric {
 public:
  // shm_bytes_per_rank == 0: groups get no shared arena.
  LocalFabric(int world_size, size_t shm_bytes_per_rank);
  ~LocalFabric();

  struct Group {
    uint64_t ctx;                       // distinguishes groups in the mailboxes
    std::vector<int> members;           // world ranks, in group-rank order
    std::unique_ptr<LocalArena> arena;  // null without shared memory
  };
  std::shared_ptr<Group> world_group() const { return world_; }
  // The group (parent ctx, split_id, group), created by its first member.
  std::shared_ptr<Group> find_or_create_group(uint64_t parent_ctx, uint64_t split_id, int group,
                                              const std::vector<int>& world_members);

  // Called when a rank's thread ends; `error` is empty after a normal return.
  void rank_ended(int world_rank, const std::string& error);
  // nullopt while the rank's thread is running.
  std::optional<std::string> ended(int world_rank) const;

  struct RecvState {
    std::atomic<bool> done{false};
    std::string error;  // set before done when the message did not fit
  };
  struct Posted {
    uint64_t ctx;
    int src;
    uint32_t tag;
    void* buf;
    size_t bytes;
    std::shared_ptr<RecvState> state;
  };
  struct Message {
    uint64_t ctx;
    int src;
    uint32_t tag;
    std::vector<std::byte> data;
  };
  struct Mailbox {
    std::mutex mu;
    std::deque<Message> unexpected;
    std::deque<Posted> posted;
  };
  Mailbox& mailbox(int world_rank) { return *boxes_[static_cast<size_t>(world_rank)]; }

 private:
  int world_size_;
  size_t shm_bytes_;
  std::vector<std::unique_ptr<Mailbox>> boxes_;
  std::shared_ptr<Group> world_;
  mutable std::mutex mu_;
  std::vector<std::optional<std::string>> ended_;
  std::unique_ptr<std::atomic<int>[]> ended_flag_;
  std::map<std::tuple<uint64_t, uint64_t, int>, std::shared_ptr<Group>> groups_;
  uint64_t next_ctx_ = 1;
};

class LocalTransport : public Transport {
 public:
  LocalTransport(std::shared_ptr<LocalFabric> fabric, std::shared_ptr<LocalFabric::Group> group,
                 int rank);

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(group_->members.size()); }
  std::string backend() const override { return "local"; }
  std::unique_ptr<TransportRequest> isend(int peer, uint32_t tag, const void* buf,
                                          size_t bytes) override;
  std::unique_ptr<TransportRequest> irecv(int peer, uint32_t tag, void* buf, size_t bytes) override;
  std::optional<std::string> lost_peer(std::span<const int> peers) override;
  std::shared_ptr<Transport> split(int group, const std::vector<int>& members, uint64_t split_id,
                                   Deadline deadline) override;
  SharedArena* arena() override;

 private:
  std::shared_ptr<LocalFabric> fabric_;
  std::shared_ptr<LocalFabric::Group> group_;
  int rank_;
};

}  // namespace mt
