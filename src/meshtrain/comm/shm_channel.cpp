#include "meshtrain/comm/shm_channel.h"

#include <new>
#include <thread>

#include "meshtrain/base/error.h"

namespace mt::comm {

void ShmChannel::construct(std::byte* region, size_t data_bytes, int64_t pid) {
  auto* c = new (region) Control();
  c->pid.store(pid, std::memory_order_relaxed);
  c->data_bytes.store(data_bytes, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
}

ShmChannel::ShmChannel(SharedArena& arena, int rank)
    : arena_(arena), rank_(rank), size_(arena.size()) {
  // Slots are 64-byte multiples so every chunk starts on its own cache line.
  slot_bytes_ = arena.data_bytes() / kDepth / 64 * 64;
  MT_CHECK(slot_bytes_ >= 64 * static_cast<size_t>(size_),
           "shared arena data area of {} bytes is too small for {} ranks", arena.data_bytes(),
           size_);
  for (int r = 0; r < size_; ++r) {
    if (r != rank_) peers_.push_back(r);
  }
}

void ShmChannel::publish_status(const Status& s) {
  Control& c = control(rank_);
  const uint64_t v = c.status_version.load(std::memory_order_relaxed);
  c.status_version.store(v + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  c.status_seq.store(s.seq, std::memory_order_relaxed);
  c.status_word.store(static_cast<uint64_t>(s.kind) | static_cast<uint64_t>(s.state) << 8 |
                          static_cast<uint64_t>(s.algorithm) << 16,
                      std::memory_order_relaxed);
  c.status_bytes.store(s.bytes, std::memory_order_relaxed);
  c.status_time_ns.store(s.time_ns, std::memory_order_relaxed);
  c.status_version.store(v + 2, std::memory_order_release);
}

std::optional<ShmChannel::Status> ShmChannel::read_status(int r) const {
  const Control& c = control(r);
  for (int attempt = 0; attempt < 1000; ++attempt) {
    const uint64_t v1 = c.status_version.load(std::memory_order_acquire);
    if (v1 & 1) {
      std::this_thread::yield();
      continue;
    }
    Status s;
    s.seq = c.status_seq.load(std::memory_order_relaxed);
    const uint64_t w = c.status_word.load(std::memory_order_relaxed);
    s.bytes = c.status_bytes.load(std::memory_order_relaxed);
    s.time_ns = c.status_time_ns.load(std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (c.status_version.load(std::memory_order_relaxed) != v1) continue;
    s.kind = static_cast<Collective>(w & 0xff);
    s.state = static_cast<State>((w >> 8) & 0xff);
    s.algorithm = static_cast<CommAlgorithm>((w >> 16) & 0xff);
    return s;
  }
  return std::nullopt;
}

}  // namespace mt::comm
