// Internal to the communicator: its state and the split of its work between
// communicator.cpp (public calls, queueing, the progress thread),
// executor.cpp (running one call: handshake, status board, errors) and
// dispatch.cpp (algorithm choice and dispatch, costs).
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "meshtrain/comm/agreement.h"
#include "meshtrain/comm/algorithms.h"
#include "meshtrain/comm/call.h"
#include "meshtrain/comm/communicator.h"
#include "meshtrain/comm/counters.h"
#include "meshtrain/comm/shm_channel.h"
#include "meshtrain/comm/transport.h"

namespace mt {

struct Communicator::Impl {
  Impl(std::shared_ptr<Transport> t, CommOptions o);

  // Runs `call` on the calling thread (under exec_mu); throws its error.
  void execute(comm::Call& call);
  // Blocking call: inline when nothing is queued, else queued and awaited.
  void run(comm::Call call);
  CommHandle submit(comm::Call call);
  // Checks the tag, then run() or submit().
  CommHandle issue(comm::Call call, bool async);
  std::unique_ptr<Communicator> split(int color, int key, uint64_t list_hash, std::string name,
                                      const CollectiveOptions& opts);
  void worker_loop();
  void stop_worker();

  // send_now / recv_now (started_p2p.cpp): starts the message on the
  // calling thread, or queues it as an async call when calls are queued.
  CommHandle start(comm::Call call);
  // Tests a started call once (under exec_mu: never while the progress
  // thread drives the transport; `block`: wait for the lock, else report
  // not done when it is taken); true once it finished (error or not).
  bool poll_started(comm::OpState& s, bool block);
  // Drives it to completion; rethrows its error.
  void wait_started(comm::OpState& s, std::optional<std::chrono::milliseconds> timeout);
  // Waits for the started calls still in flight (the destructor).
  void finish_started();
  void mark_broken(const std::string& why);
  // A call on a communicator marked broken: a CommError naming the call and
  // the earlier failure (no-op while the communicator is usable).
  void refuse_if_broken(const comm::CallInfo& info) const;

  comm::CallInfo info_of(const comm::Call& call) const;
  CommAlgorithm resolve(const comm::Call& call, const comm::CallInfo& info) const;
  // Writes a single-round shared-memory call's data before the handshake
  // (whose flag then publishes it too); true when it did.
  bool stage(comm::CollectiveContext& ctx, const comm::Call& call);
  void dispatch(comm::CollectiveContext& ctx, comm::Call& call, CommAlgorithm algorithm,
                bool staged);
  void handshake(const comm::CallInfo& info, const comm::Call& call, Deadline deadline);
  std::string watchdog_report(const comm::CallInfo& info) const;
  void publish(const comm::CallInfo& info, comm::ShmChannel::State state, int64_t time_ns);
  uint32_t wire_tag(const comm::Call& call) const;
  // Builds the node and cross-node communicators when this one's ranks sit
  // on several nodes with the same number (> 1) on each (collective: every
  // rank's constructor runs it).
  void build_hierarchy(Deadline deadline);

  std::shared_ptr<Transport> transport;
  CommOptions options;
  int rank;
  int size;
  CounterBook counters;
  std::unique_ptr<comm::ShmChannel> shm;
  // Set when the ranks span several equal nodes (build_hierarchy).
  std::unique_ptr<Communicator> node_comm, cross_comm;
  comm::HierGroups hier;
  std::chrono::nanoseconds spin;  // options.spin, or short when ranks outnumber cores
  std::vector<std::byte> scratch0, scratch1;
  uint64_t agreements = 0;                // handshakes without shared memory
  std::vector<comm::CallRecord> records;  // handshake scratch

  std::mutex exec_mu;  // held while a call executes

  std::mutex q_mu;
  std::condition_variable q_cv;
  std::deque<comm::Call> queue;
  size_t outstanding = 0;  // queued or running async calls
  uint64_t next_seq = 0;   // collective sequence numbers handed out
  bool stopping = false;
  std::thread worker;
  // Set (under q_mu) when the worker starts; until then the issuing thread is
  // the only one executing, so run() takes no locks.
  std::atomic<bool> worker_started{false};

  // post_recv() / wait_any(): one posted receive per peer.
  struct PostedRecv {
    std::unique_ptr<TransportRequest> req;
    size_t bytes = 0;
    CommClock::time_point start;
  };
  std::map<int, PostedRecv> posted;
  // send_now / recv_now calls that may still be in flight (held, so that
  // dropping a handle neither cancels its message nor loses its count).
  std::vector<std::shared_ptr<comm::OpState>> started;
  // Requests of lost peers: the engine may still own them (transport.h).
  std::vector<std::unique_ptr<TransportRequest>> abandoned;

  mutable std::mutex broken_mu;
  std::optional<std::string> broken;
  std::atomic<bool> is_broken{false};
};

namespace comm {
// CommHandle::done() / wait() of a started call (Impl::poll_started /
// wait_started once it is not finished).
bool started_done(OpState& s);
void started_wait(OpState& s, std::optional<std::chrono::milliseconds> timeout);
}  // namespace comm

}  // namespace mt
