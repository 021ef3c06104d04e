// What an algorithm sees while it runs one call: the transport, the deadline,
// the byte counters and enough about the call to write a useful error.
//
// A CollectiveContext lives for one call on one rank and is driven by one
// thread. Every wait goes through wait_until(), which spins briefly, then
// yields, then sleeps, and throws TimeoutError at the deadline or CommError
// when the transport reports a lost peer; both messages name the rank, the
// collective, its sequence number and bytes, what it was waiting for and the
// communicator's watchdog report (who has not entered the call).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "meshtrain/comm/counters.h"
#include "meshtrain/comm/options.h"
#include "meshtrain/comm/transport.h"

namespace mt::comm {

// One call, as it appears in messages, handshakes and the status board.
struct CallInfo {
  std::string_view comm_name;  // the communicator's name (outlives the call)
  int rank = 0;
  int size = 1;
  Collective kind = Collective::barrier;
  uint64_t seq = 0;  // collective sequence number in the communicator (p2p: 0)
  DType dtype = DType::u8;
  size_t count = 0;  // the count argument as the caller passed it
  size_t bytes = 0;  // payload bytes (see CollectiveCounter::payload_bytes)
  ReduceOp op = ReduceOp::sum;
  int root = -1;  // broadcast root, send/recv peer
  uint32_t tag = 0;
  CommAlgorithm algorithm = CommAlgorithm::automatic;
  double timeout_s = 0;         // the call's timeout, for messages
  const char* phase = nullptr;  // e.g. "handshake"

  // "all_reduce #17 (f32 x 1000 = 4000 bytes, sum, algorithm ring)"
  std::string describe() const;
  // "comm 'world' rank 0 of 4"
  std::string where() const;
};

class CollectiveContext {
 public:
  // Returns the watchdog's view of the other ranks (may be empty).
  using Diagnose = std::function<std::string()>;

  CollectiveContext(Transport& transport, const CallInfo& call, Deadline deadline,
                    uint32_t wire_tag, CounterBook& counters, const CommOptions& options,
                    Diagnose diagnose);
  CollectiveContext(const CollectiveContext&) = delete;
  CollectiveContext& operator=(const CollectiveContext&) = delete;

  Transport& transport() { return transport_; }
  const CallInfo& call() const { return call_; }
  int rank() const { return call_.rank; }
  int size() const { return call_.size; }
  Deadline deadline() const { return deadline_; }

  // Nonblocking messages on this call's tag; wait_all() completes every one
  // posted so far, counting bytes per peer as each completes.
  void post_send(int peer, const void* buf, size_t bytes);
  void post_recv(int peer, void* buf, size_t bytes);
  void wait_all();
  void sendrecv(int to, const void* send_buf, size_t send_bytes, int from, void* recv_buf,
                size_t recv_bytes);
  // Waits for a native collective started by the caller.
  void wait_request(TransportRequest& req, const std::string& what);

  // Bytes moved through shared memory, counted at the copies into and out of
  // the window (put / get / reduce_slots in shm_algorithms.cpp).
  void count_sent(int peer, uint64_t bytes);
  void count_received(int peer, uint64_t bytes);
  uint64_t bytes_sent() const { return sent_; }
  uint64_t bytes_received() const { return received_; }

  // How long a wait spins (pause loop) before it starts yielding its core.
  void set_spin(std::chrono::nanoseconds spin) { spin_ = spin; }

  // For messages: "step 3 of 6".
  void set_step(int64_t step, int64_t total) {
    step_ = step;
    steps_total_ = total;
  }

  // A reusable buffer of at least `bytes` bytes (owned by the communicator).
  std::byte* scratch(size_t bytes, int which = 0);
  void set_scratch(std::vector<std::byte>* pool0, std::vector<std::byte>* pool1) {
    scratch_[0] = pool0;
    scratch_[1] = pool1;
  }

  // Spins until ready() is true. `peers` are the ranks still being waited for
  // (checked for liveness; ready() may shrink the list as peers deliver);
  // `what` describes the wait for errors ("flag 'published' to reach 3 from
  // rank 1 (at 2)"), evaluated only on failure.
  template <class Ready, class What>
  void wait_until(Ready&& ready, const std::vector<int>& peers, What&& what) {
    if (ready()) return;
    WaitState w = begin_wait();
    while (!ready()) {
      if (idle(w, peers, what)) {
        if (ready()) return;  // the peer finished its part before it went away
        fail_lost(w, what());
      }
    }
  }

  // Builds the message of a failed call: "<where>: <call> <failure> at step s
  // of t, waiting for <what>; this call moved ...; <watchdog report>".
  std::string failure_message(const std::string& failure, const std::string& what) const;

 private:
  struct Pending {
    std::unique_ptr<TransportRequest> req;
    int peer;
    size_t bytes;
    bool is_send;
    bool done;
  };
  struct WaitState {
    int64_t iter = 0;
    Deadline start;
    Deadline next_peer_check;
    bool stall_reported = false;
  };

  WaitState begin_wait() const;
  // One backoff step. Throws TimeoutError at the deadline; returns true when a
  // peer in `peers` is known to be lost (the caller rechecks, then fails).
  template <class What>
  bool idle(WaitState& w, std::span<const int> peers, What& what) {
    ++w.iter;
    if (w.iter < kSpinIters) {
      cpu_relax();
      return false;
    }
    return slow_idle(w, peers, std::function<std::string()>(std::ref(what)));
  }
  bool slow_idle(WaitState& w, std::span<const int> peers,
                 const std::function<std::string()>& what);
  [[noreturn]] void fail_lost(const WaitState& w, const std::string& what);
  std::string pending_description() const;
  static void cpu_relax();

  static constexpr int64_t kSpinIters = 256;

  Transport& transport_;
  const CallInfo& call_;
  Deadline deadline_;
  uint32_t tag_;
  CounterBook& counters_;
  const CommOptions& options_;
  Diagnose diagnose_;
  std::vector<Pending> pending_;
  std::string lost_;
  uint64_t sent_ = 0;
  uint64_t received_ = 0;
  std::chrono::nanoseconds spin_{0};
  int64_t step_ = -1;
  int64_t steps_total_ = 0;
  std::vector<std::byte>* scratch_[2] = {nullptr, nullptr};
};

}  // namespace mt::comm
