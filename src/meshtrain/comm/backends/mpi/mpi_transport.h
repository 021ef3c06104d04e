// The `mpi` backend's transport (for implementers; callers use
// mpi_communicator.h).
//
// MpiTransport owns a duplicate of an MPI communicator with MPI_ERRORS_RETURN
// set, and never calls a blocking MPI operation that a missing peer could
// stall forever: messages and the engine's collectives are nonblocking and
// polled (MPI_Test) by the communicator against its deadline, and the few
// blocking set-up calls (dup, split, window allocation) run only after an
// MPI_Ibarrier, polled with the deadline, showed every rank present. Peers on
// the same host are checked for liveness by pid, so a dead rank is named
// instead of waited for. When all ranks share a node it offers an MPI-3
// shared window as the arena of the shared_memory algorithms.
#pragma once

#include <mpi.h>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/comm/backends/mpi/mpi_communicator.h"
#include "meshtrain/comm/transport.h"

namespace mt {

class MpiArena;

class MpiTransport : public Transport {
 public:
  // Collective over `parent`; throws TimeoutError if not every rank calls it
  // before `deadline`.
  static std::shared_ptr<MpiTransport> create(MPI_Comm parent, const MpiOptions& options,
                                              Deadline deadline);
  ~MpiTransport() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "mpi"; }
  uint32_t max_tag() const override { return max_tag_; }
  int ranks_on_node() const override;
  std::vector<int> node_of() const override;
  std::unique_ptr<TransportRequest> isend(int peer, uint32_t tag, const void* buf,
                                          size_t bytes) override;
  std::unique_ptr<TransportRequest> irecv(int peer, uint32_t tag, void* buf, size_t bytes) override;
  std::optional<std::string> lost_peer(std::span<const int> peers) override;
  std::shared_ptr<Transport> split(int group, const std::vector<int>& members, uint64_t split_id,
                                   Deadline deadline) override;
  SharedArena* arena() override;
  NativeCollectives* native() override { return native_.get(); }
  void mark_broken(const std::string& why) override;

  MPI_Comm comm() const { return comm_; }

 private:
  MpiTransport() = default;
  void set_up_arena(Deadline deadline);

  struct Peer {
    int64_t pid = 0;
    std::string host;
    bool same_host = false;
  };

  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Win win_ = MPI_WIN_NULL;
  int rank_ = 0;
  int size_ = 1;
  uint32_t max_tag_ = 0;
  MpiOptions options_;
  std::vector<Peer> peers_;
  std::unique_ptr<MpiArena> arena_;
  std::unique_ptr<NativeCollectives> native_;
  std::atomic<bool> broken_{false};
};

// The engine's collectives on `comm` (nonblocking, polled by the caller).
std::unique_ptr<NativeCollectives> make_mpi_native(MPI_Comm comm, int rank, int size);

}  // namespace mt
