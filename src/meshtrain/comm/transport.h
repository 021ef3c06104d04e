// The interface a comm backend implements (callers use communicator.h).
//
// A Transport moves bytes between the ranks of one group: nonblocking
// point-to-point messages, matched per (source, tag) in the order they were
// sent, and polled by the caller with a deadline (a transport never blocks
// without one). Optionally it offers a node-shared memory arena (the
// shared_memory algorithms), the engine's own collectives (native) and a way to
// tell that a peer has died. Algorithms and the Communicator are written
// against this interface only; backends live in comm/backends/{self,local,mpi}.
//
// Threading: one Communicator drives a transport from one thread at a time
// (the caller's or its progress thread); different transports may be driven
// concurrently.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "meshtrain/comm/options.h"
#include "meshtrain/tensor/dtype.h"

namespace mt {

using CommClock = std::chrono::steady_clock;
using Deadline = CommClock::time_point;

// One pending message or native collective. Destroying an unfinished request
// cancels it where the engine allows; afterwards the transport no longer
// writes into the request's buffer (local) or the engine still owns it until
// the transport is destroyed (mpi: a broken transport is never reused).
class TransportRequest {
 public:
  virtual ~TransportRequest() = default;
  // Makes progress without blocking; true once complete. Throws CommError when
  // the engine reports a failure (e.g. a message of the wrong size).
  virtual bool test() = 0;
};

// Memory shared by all ranks of a transport on one node: one region per rank,
// each mapped into every rank's address space, kControlBytes of control block
// followed by data_bytes() of data (64-byte aligned, equal on every rank).
// Created zero-filled, with each rank's control block constructed by its owner
// before any rank uses the arena.
class SharedArena {
 public:
  static constexpr size_t kControlBytes = 4096;
  virtual ~SharedArena() = default;
  virtual int size() const = 0;
  virtual std::byte* region(int rank) const = 0;
  virtual size_t data_bytes() const = 0;
};

// The engine's own collectives, started nonblocking and polled by the caller
// (so they obey deadlines). Counts are elements of `dtype` or bytes as named;
// reductions get sum, max or min (avg is a sum divided by the caller).
class NativeCollectives {
 public:
  virtual ~NativeCollectives() = default;
  virtual std::string engine_name() const = 0;  // e.g. "openmpi-4.1.4"
  // Whether the engine can run `c` on `dtype` with `op` and a largest per-rank
  // element count of `max_count` (MPI counts are ints).
  virtual bool supports(Collective c, DType dtype, ReduceOp op, size_t max_count) const = 0;
  virtual std::unique_ptr<TransportRequest> all_reduce(const void* send, void* recv, size_t count,
                                                       DType dtype, ReduceOp op) = 0;
  virtual std::unique_ptr<TransportRequest> all_gather(const void* send, void* recv, size_t count,
                                                       DType dtype) = 0;
  virtual std::unique_ptr<TransportRequest> all_gatherv(const void* send, void* recv,
                                                        std::span<const size_t> counts,
                                                        DType dtype) = 0;
  virtual std::unique_ptr<TransportRequest> reduce_scatter(const void* send, void* recv,
                                                           size_t recv_count, DType dtype,
                                                           ReduceOp op) = 0;
  virtual std::unique_ptr<TransportRequest> reduce_scatterv(const void* send, void* recv,
                                                            std::span<const size_t> counts,
                                                            DType dtype, ReduceOp op) = 0;
  virtual std::unique_ptr<TransportRequest> broadcast(void* buf, size_t count, DType dtype,
                                                      int root) = 0;
  virtual std::unique_ptr<TransportRequest> all_to_allv(const void* send,
                                                        std::span<const size_t> send_counts,
                                                        void* recv,
                                                        std::span<const size_t> recv_counts,
                                                        DType dtype) = 0;
  virtual std::unique_ptr<TransportRequest> barrier() = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string backend() const = 0;  // "self", "local", "mpi"

  // Ranks of this transport on this rank's node (sets how waits spin).
  virtual int ranks_on_node() const { return size(); }
  // The node of each rank of this transport (numbered from 0 in order of
  // first appearance): what hierarchical collectives group by. Default: one
  // node. mpi: by host name; a ClusterTransport: by its layout.
  virtual std::vector<int> node_of() const {
    return std::vector<int>(static_cast<size_t>(size()), 0);
  }

  // Largest tag isend/irecv accept (at least 2^30 - 1).
  virtual uint32_t max_tag() const { return (1u << 30) - 1; }
  // Starts a message of `bytes` bytes to / from `peer` (a rank of this
  // transport other than rank()). The buffer must stay valid until the request
  // completes or is destroyed. A receive must name the exact size sent.
  virtual std::unique_ptr<TransportRequest> isend(int peer, uint32_t tag, const void* buf,
                                                  size_t bytes) = 0;
  virtual std::unique_ptr<TransportRequest> irecv(int peer, uint32_t tag, void* buf,
                                                  size_t bytes) = 0;

  // A sentence naming the first of `peers` known to be gone ("rank 1 (pid 42
  // on host a) is no longer running"), or nullopt. Cheap; waits call it every
  // few tens of milliseconds.
  virtual std::optional<std::string> lost_peer(std::span<const int> peers) {
    (void)peers;
    return std::nullopt;
  }

  // Sub-groups. Called by every rank of this transport after they agreed on
  // the grouping (Communicator::split does that), so it may block briefly:
  // ranks with group >= 0 get a transport over `members` (ranks of this
  // transport, in new-rank order, the same list on every member); ranks with
  // group < 0 pass an empty list and get nullptr. `split_id` is the same on
  // every rank and different for every split of this transport.
  virtual std::shared_ptr<Transport> split(int group, const std::vector<int>& members,
                                           uint64_t split_id, Deadline deadline) = 0;

  virtual SharedArena* arena() { return nullptr; }
  virtual NativeCollectives* native() { return nullptr; }

  // Told when a call failed with a timeout or a lost peer: messages may still
  // be in flight, so the transport must not be trusted again (mpi: skip
  // MPI_Finalize at exit, which would wait for dead peers).
  virtual void mark_broken(const std::string& why) { (void)why; }
};

}  // namespace mt
