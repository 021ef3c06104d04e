// Layout and bookkeeping of a SharedArena as the shared_memory algorithms and
// the watchdog use it.
//
// Each rank's region starts with a Control block (flags, handshake records,
// status board) followed by its data area, cut into kDepth slots used round
// by round. Flags are monotonic counters of rounds (never reset), so a round
// g of any collective writes slot g % kDepth only after every peer's `done`
// flag shows it finished round g - kDepth; that keeps consecutive collectives
// of any kind safe without a barrier between them. All ranks advance `round`
// identically because they run the same calls in the same order (which the
// handshake checks).
//
// Owned by a Communicator, used by one thread at a time; the arena outlives it.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "meshtrain/comm/options.h"
#include "meshtrain/comm/transport.h"

namespace mt::comm {

class ShmChannel {
 public:
  static constexpr uint64_t kDepth = 2;
  static constexpr size_t kRecordBytes = 48;

  struct alignas(64) Counter {
    std::atomic<uint64_t> value{0};
  };
  struct Control {
    Counter published;  // rounds whose inputs this rank has written
    Counter reduced;    // rounds whose reduced output this rank has written
    Counter done;       // rounds this rank has finished reading
    // Handshake records by agreement parity, each in one cache line with the
    // count that publishes it, so a peer's wait fetches both at once.
    struct alignas(64) AgreeLine {
      std::atomic<uint64_t> count{0};  // a + 1 once record a is here
      std::byte record[kRecordBytes];
    };
    AgreeLine agree[2];
    // Status board (a seqlock): the last collective this rank entered.
    alignas(64) std::atomic<uint64_t> status_version{0};
    std::atomic<uint64_t> status_seq{0};
    std::atomic<uint64_t> status_word{0};  // kind | state << 8 | algorithm << 16
    std::atomic<uint64_t> status_bytes{0};
    std::atomic<int64_t> status_time_ns{0};
    // Set once by the owner at creation.
    alignas(64) std::atomic<int64_t> pid{0};
    std::atomic<uint64_t> data_bytes{0};
  };
  static_assert(sizeof(Control) <= SharedArena::kControlBytes);

  enum class State : uint8_t { none = 0, entered = 1, completed = 2, failed = 3 };
  struct Status {
    uint64_t seq = 0;
    Collective kind = Collective::barrier;
    State state = State::none;
    CommAlgorithm algorithm = CommAlgorithm::automatic;
    uint64_t bytes = 0;
    int64_t time_ns = 0;  // steady clock (CLOCK_MONOTONIC, shared by processes)
  };

  // Constructs the control block at the start of `region` (the owner does
  // this once at creation, before the arena's creation barrier).
  static void construct(std::byte* region, size_t data_bytes, int64_t pid);

  ShmChannel(SharedArena& arena, int rank);

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::vector<int>& peers() const { return peers_; }
  Control& control(int r) const { return *reinterpret_cast<Control*>(arena_.region(r)); }
  size_t slot_bytes() const { return slot_bytes_; }
  std::byte* slot(int r, uint64_t g) const {
    return arena_.region(r) + SharedArena::kControlBytes + (g % kDepth) * slot_bytes_;
  }

  void publish_status(const Status& s);
  // nullopt when the rank is mid-update for too long (e.g. died while writing).
  std::optional<Status> read_status(int r) const;

  uint64_t round = 0;       // next round number, identical on all ranks
  uint64_t agreements = 0;  // handshakes done, identical on all ranks
  uint64_t done_floor = 0;  // every peer's `done` was seen at least this high

 private:
  SharedArena& arena_;
  int rank_;
  int size_;
  size_t slot_bytes_;
  std::vector<int> peers_;
};

}  // namespace mt::comm
