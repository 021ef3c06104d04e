// Byte counters of a communicator: what each collective and each peer moved.
//
// CommCounters is a plain snapshot (copyable, no locks). CounterBook is the
// live, thread-safe book a Communicator owns: algorithms add per-peer bytes
// as messages complete (relaxed atomics, callable from the progress thread),
// and the communicator closes each call into the per-collective table. Units
// are bytes and seconds.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace mt {

struct CollectiveCounter {
  uint64_t calls = 0;
  uint64_t payload_bytes = 0;   // the caller's buffer size (all-reduce: the whole buffer)
  uint64_t bytes_sent = 0;      // to peers, measured as the bytes move (docs/comm.md)
  uint64_t bytes_received = 0;  // from peers, likewise
  double seconds = 0;           // wall time inside the calls, handshake included
};

struct PeerCounter {
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
};

struct CommCounters {
  // Keyed by collective name ("all_reduce", "send", ...) and "handshake" for
  // the pre-collective agreement records.
  std::map<std::string, CollectiveCounter> by_collective;
  // Indexed by the peer's rank in this communicator (own rank stays zero).
  std::vector<PeerCounter> by_peer;

  uint64_t total_sent() const;
  uint64_t total_received() const;
  // {"all_reduce": {"calls": 3, ...}, ..., "by_peer": [...]} for logs.
  std::string to_json() const;
};

class CounterBook {
 public:
  // Keys of close_call(): one per Collective, plus the handshake.
  static constexpr int kHandshake = 12;
  static constexpr int kKeys = 13;

  explicit CounterBook(int size);

  void add_sent(int peer, uint64_t bytes) {
    peers_[static_cast<size_t>(peer)].sent.fetch_add(bytes, std::memory_order_relaxed);
  }
  void add_received(int peer, uint64_t bytes) {
    peers_[static_cast<size_t>(peer)].received.fetch_add(bytes, std::memory_order_relaxed);
  }
  // key: static_cast<int>(Collective) or kHandshake.
  void close_call(int key, uint64_t payload_bytes, uint64_t sent, uint64_t received,
                  int64_t nanoseconds);

  CommCounters snapshot() const;
  void reset();

 private:
  struct PeerBytes {
    std::atomic<uint64_t> sent{0};
    std::atomic<uint64_t> received{0};
  };
  struct CallTotals {
    std::atomic<uint64_t> calls{0};
    std::atomic<uint64_t> payload{0};
    std::atomic<uint64_t> sent{0};
    std::atomic<uint64_t> received{0};
    std::atomic<int64_t> nanoseconds{0};
  };
  std::unique_ptr<PeerBytes[]> peers_;
  size_t size_;
  CallTotals calls_[kKeys];
};

}  // namespace mt
