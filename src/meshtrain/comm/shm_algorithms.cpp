// Shared-memory collectives for ranks on one node. Data moves through each
// rank's arena slots in rounds of at most one slot; within a round a rank
// copies its contribution into its own slot, raises a flag, and reads its
// peers' slots once their flags are up. Chunks are small enough to stay in
// the caches between the writer and the reader, so a rank touches each byte
// of its own buffers about once in DRAM, and all n ranks reduce in parallel
// (each owns 1/n of the buffer), instead of forwarding partial sums hop by
// hop as the ring does.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <thread>

#include "meshtrain/base/error.h"
#include "meshtrain/base/timer.h"
#include "meshtrain/comm/algorithms.h"
#include "meshtrain/comm/reduce.h"
#include "meshtrain/comm/shm_channel.h"

namespace mt::comm {

namespace {

using Counter = ShmChannel::Counter;
using Control = ShmChannel::Control;

inline std::byte* at(void* p, size_t offset) {
  return static_cast<std::byte*>(p) + offset;
}
inline const std::byte* at(const void* p, size_t offset) {
  return static_cast<const std::byte*>(p) + offset;
}
inline size_t clamp_len(size_t total, size_t lo, size_t chunk) {
  return lo >= total ? 0 : std::min(chunk, total - lo);
}
inline uint64_t ceil_div(uint64_t a, uint64_t b) {
  return b == 0 ? 0 : (a + b - 1) / b;
}

void raise(ShmChannel& ch, Counter Control::*flag, uint64_t value) {
  (ch.control(ch.rank()).*flag).value.store(value, std::memory_order_release);
}

const char* flag_name(Counter Control::*flag) {
  if (flag == &Control::published) return "published";
  if (flag == &Control::reduced) return "reduced";
  return "done";
}

// Waits until every rank in `peers` has raised `flag` to at least `target`.
void wait_flags(CollectiveContext& ctx, ShmChannel& ch, Counter Control::*flag, uint64_t target,
                const std::vector<int>& peers) {
  auto behind = [&](int q) {
    return (ch.control(q).*flag).value.load(std::memory_order_acquire) < target;
  };
  if (std::none_of(peers.begin(), peers.end(), behind)) return;  // no allocation when ready
  std::vector<int> late = peers;  // liveness is checked for these only
  auto ready = [&] {
    std::erase_if(late, [&](int q) { return !behind(q); });
    return late.empty();
  };
  ctx.wait_until(ready, late, [&] {
    std::string list;
    for (int q : late) {
      list += fmt::format("{}rank {} (at {})", list.empty() ? "" : ", ", q,
                          (ch.control(q).*flag).value.load(std::memory_order_acquire));
    }
    return fmt::format("shared-memory flag '{}' to reach {} from {}", flag_name(flag), target,
                       list);
  });
}

// Before writing slot (g % kDepth) in round g: every peer must have finished
// reading what this rank wrote there in round g - kDepth. The lowest `done`
// seen is remembered, which spares most rounds a read of the peers' lines.
void wait_slot_free(CollectiveContext& ctx, ShmChannel& ch, uint64_t g) {
  if (g + 1 <= ShmChannel::kDepth) return;
  const uint64_t need = g + 1 - ShmChannel::kDepth;
  if (ch.done_floor >= need) return;
  uint64_t lowest = UINT64_MAX;
  for (int q : ch.peers()) {
    lowest = std::min(lowest, ch.control(q).done.value.load(std::memory_order_acquire));
  }
  if (lowest < need) {
    wait_flags(ctx, ch, &Control::done, need, ch.peers());
    lowest = need;
  }
  ch.done_floor = lowest;
}

// Element alignment that keeps shard boundaries on cache lines.
size_t shard_align(size_t elem) {
  return std::max<size_t>(1, 64 / elem);
}

// Elements per shard per round: one slot holds one chunk per rank.
size_t shard_chunk(size_t slot_bytes, int n, size_t elem) {
  const size_t align = shard_align(elem);
  const size_t chunk = slot_bytes / static_cast<size_t>(n) / elem / align * align;
  return std::max(chunk, align);
}

// Every byte the algorithms below move between ranks goes through put(),
// get() or reduce_slots(), and is counted there, as it moves: bytes written
// into this rank's slot count as sent to each peer that reads them (a region
// every peer reads counts once per peer), bytes read from a peer's slot as
// received from that peer. The cost functions state the same numbers
// independently (tests/comm/comm_costs_test.cpp compares them, and checks
// that what rank r counted as sent to q is what q counted as received).

// Copies `bytes` from src into this rank's slot of round g at `offset`, for
// `readers` to read.
void put(CollectiveContext& ctx, ShmChannel& ch, uint64_t g, size_t offset, const void* src,
         size_t bytes, std::span<const int> readers) {
  if (bytes == 0) return;
  MT_CHECK_LE(offset + bytes, ch.slot_bytes());
  copy_bytes(ch.slot(ch.rank(), g) + offset, src, bytes);
  for (int q : readers) ctx.count_sent(q, bytes);
}

// Copies `bytes` from `owner`'s slot of round g at `offset` into dst.
void get(CollectiveContext& ctx, ShmChannel& ch, int owner, uint64_t g, size_t offset, void* dst,
         size_t bytes) {
  if (bytes == 0) return;
  MT_CHECK_LE(offset + bytes, ch.slot_bytes());
  copy_bytes(dst, ch.slot(owner, g) + offset, bytes);
  ctx.count_received(owner, bytes);
}

// dst = `own` (op) every peer's `len` elements at `offset` of its round-g
// slot, in one pass (own first, then the peers by rank, on every rank the
// same order). With `publish` the result also goes into this rank's slot at
// `offset`, where every peer reads it. `srcs` is scratch of size() entries.
void reduce_slots(CollectiveContext& ctx, ShmChannel& ch, uint64_t g, size_t offset,
                  const void* own, void* dst, size_t len, DType dtype, ReduceOp op, int divisor,
                  bool publish, std::vector<const void*>& srcs) {
  if (len == 0) return;
  const size_t bytes = len * dtype_size(dtype);
  MT_CHECK_LE(offset + bytes, ch.slot_bytes());
  srcs[0] = own;
  size_t i = 1;
  for (int q : ch.peers()) srcs[i++] = ch.slot(q, g) + offset;
  reduce_sources(dst, srcs.data(), ch.size(), len, dtype, op, divisor,
                 publish ? ch.slot(ch.rank(), g) + offset : nullptr);
  for (int q : ch.peers()) {
    ctx.count_received(q, bytes);
    if (publish) ctx.count_sent(q, bytes);
  }
}

}  // namespace

// Copies chunk k of every block but this rank's own into this rank's slot for
// round g (block s at offset s * chunk): the peers' inputs for the blocks
// they reduce.
static void copy_blocks_in(CollectiveContext& ctx, ShmChannel& ch, uint64_t g, const void* send,
                           std::span<const size_t> blocks, std::span<const size_t> offs,
                           size_t chunk, size_t elem, uint64_t k) {
  const size_t lo = k * chunk;
  for (const int& s : ch.peers()) {
    const size_t ss = static_cast<size_t>(s);
    const size_t len = clamp_len(blocks[ss], lo, chunk);
    if (len == 0) continue;  // (no pointer past the block)
    put(ctx, ch, g, ss * chunk * elem, at(send, (offs[ss] + lo) * elem), len * elem,
        std::span<const int>(&s, 1));
  }
}

// ---- all-reduce ---------------------------------------------------------------

// Rank r owns shard r (1/n of the buffer, cache-line aligned). Round k: every
// rank copies chunk k of the other shards into its slot (published); rank r
// reduces chunk k of shard r from its own input and the peers' slots, in one
// pass into its output and its slot (reduced); then copies the peers' reduced
// chunks into its output (done).
void shm_all_reduce(CollectiveContext& ctx, ShmChannel& ch, const void* send, void* recv,
                    size_t count, DType dtype, ReduceOp op, bool staged) {
  const int n = ch.size();
  const int me = ch.rank();
  const size_t elem = dtype_size(dtype);
  if (n == 1 || count == 0) {
    if (send != recv) copy_bytes(recv, send, count * elem);
    return;
  }
  const std::vector<size_t> shards = balanced_counts(count, n, shard_align(elem));
  const std::vector<size_t> offs = prefix_offsets(shards);
  const size_t chunk = shard_chunk(ch.slot_bytes(), n, elem);
  const uint64_t rounds = ceil_div(*std::max_element(shards.begin(), shards.end()), chunk);
  MT_CHECK(!staged || rounds == 1, "staged shared-memory all-reduce needs one round, has {}",
           rounds);
  const int divisor = op == ReduceOp::avg ? n : 1;
  const size_t mine = static_cast<size_t>(me);
  std::vector<const void*> srcs(static_cast<size_t>(n));
  // In place (send == recv) works too: each chunk of the input is read (into
  // the slot or the reduction) before the same round overwrites it.
  for (uint64_t k = 0; k < rounds; ++k) {
    const uint64_t g = ch.round + k;
    const size_t lo = k * chunk;
    ctx.set_step(static_cast<int64_t>(k), static_cast<int64_t>(rounds));
    if (!staged) {  // else the handshake published round 0
      wait_slot_free(ctx, ch, g);
      copy_blocks_in(ctx, ch, g, send, shards, offs, chunk, elem, k);
      raise(ch, &Control::published, g + 1);
      wait_flags(ctx, ch, &Control::published, g + 1, ch.peers());
    }
    if (const size_t my_len = clamp_len(shards[mine], lo, chunk); my_len > 0) {
      reduce_slots(ctx, ch, g, mine * chunk * elem, at(send, (offs[mine] + lo) * elem),
                   at(recv, (offs[mine] + lo) * elem), my_len, dtype, op, divisor,
                   /*publish=*/true, srcs);
    }
    raise(ch, &Control::reduced, g + 1);
    wait_flags(ctx, ch, &Control::reduced, g + 1, ch.peers());

    for (int q : ch.peers()) {
      const size_t qq = static_cast<size_t>(q);
      const size_t len = clamp_len(shards[qq], lo, chunk);
      if (len > 0)
        get(ctx, ch, q, g, qq * chunk * elem, at(recv, (offs[qq] + lo) * elem), len * elem);
    }
    raise(ch, &Control::done, g + 1);
  }
  ch.round += rounds;
}

// Per peer q: this rank's shard plus q's shard, each way; 2 synchronisations
// per round of at most slot/n bytes per shard.
CollectiveCost shm_all_reduce_cost(int n, int rank, size_t count, size_t elem_bytes,
                                   size_t slot_bytes) {
  if (n == 1 || count == 0) return {};
  const std::vector<size_t> shards = balanced_counts(count, n, shard_align(elem_bytes));
  const size_t mine = shards[static_cast<size_t>(rank)];
  const uint64_t bytes = (static_cast<uint64_t>(n - 1) * mine + (count - mine)) * elem_bytes;
  const uint64_t rounds = ceil_div(*std::max_element(shards.begin(), shards.end()),
                                   shard_chunk(slot_bytes, n, elem_bytes));
  return {static_cast<int64_t>(2 * rounds), bytes, bytes};
}

bool shm_stage_all_reduce(CollectiveContext& ctx, ShmChannel& ch, const void* send, size_t count,
                          DType dtype) {
  const int n = ch.size();
  const size_t elem = dtype_size(dtype);
  if (n == 1 || count == 0) return false;
  const std::vector<size_t> shards = balanced_counts(count, n, shard_align(elem));
  const size_t chunk = shard_chunk(ch.slot_bytes(), n, elem);
  if (*std::max_element(shards.begin(), shards.end()) > chunk) return false;
  wait_slot_free(ctx, ch, ch.round);
  copy_blocks_in(ctx, ch, ch.round, send, shards, prefix_offsets(shards), chunk, elem, 0);
  return true;
}

// ---- reduce-scatter -----------------------------------------------------------

void shm_reduce_scatterv(CollectiveContext& ctx, ShmChannel& ch, const void* send, void* recv,
                         std::span<const size_t> counts, DType dtype, ReduceOp op, bool staged) {
  const int n = ch.size();
  const int me = ch.rank();
  const size_t mine = static_cast<size_t>(me);
  const size_t elem = dtype_size(dtype);
  const std::vector<size_t> offs = prefix_offsets(counts);
  if (n == 1) {
    copy_bytes(recv, send, counts[0] * elem);
    return;
  }
  const size_t chunk = shard_chunk(ch.slot_bytes(), n, elem);
  const uint64_t rounds = ceil_div(*std::max_element(counts.begin(), counts.end()), chunk);
  MT_CHECK(!staged || rounds == 1, "staged reduce-scatter needs one round, has {}", rounds);
  const int divisor = op == ReduceOp::avg ? n : 1;
  std::vector<const void*> srcs(static_cast<size_t>(n));
  for (uint64_t k = 0; k < rounds; ++k) {
    const uint64_t g = ch.round + k;
    const size_t lo = k * chunk;
    ctx.set_step(static_cast<int64_t>(k), static_cast<int64_t>(rounds));
    if (!staged) {
      wait_slot_free(ctx, ch, g);
      copy_blocks_in(ctx, ch, g, send, counts, offs, chunk, elem, k);
      raise(ch, &Control::published, g + 1);
      wait_flags(ctx, ch, &Control::published, g + 1, ch.peers());
    }
    if (const size_t my_len = clamp_len(counts[mine], lo, chunk); my_len > 0) {
      reduce_slots(ctx, ch, g, mine * chunk * elem, at(send, (offs[mine] + lo) * elem),
                   at(recv, lo * elem), my_len, dtype, op, divisor, /*publish=*/false, srcs);
    }
    raise(ch, &Control::done, g + 1);
  }
  ch.round += rounds;
}

// Sends each peer its block of this rank's input; receives its own block
// from every peer.
CollectiveCost shm_reduce_scatterv_cost(int n, int rank, std::span<const size_t> counts,
                                        size_t elem_bytes, size_t slot_bytes) {
  if (n == 1) return {};
  const uint64_t total = std::accumulate(counts.begin(), counts.end(), uint64_t{0});
  const uint64_t mine = counts[static_cast<size_t>(rank)];
  const uint64_t rounds = ceil_div(*std::max_element(counts.begin(), counts.end()),
                                   shard_chunk(slot_bytes, n, elem_bytes));
  return {static_cast<int64_t>(rounds), (total - mine) * elem_bytes,
          static_cast<uint64_t>(n - 1) * mine * elem_bytes};
}

bool shm_stage_reduce_scatterv(CollectiveContext& ctx, ShmChannel& ch, const void* send,
                               std::span<const size_t> counts, DType dtype) {
  const size_t elem = dtype_size(dtype);
  const size_t chunk = shard_chunk(ch.slot_bytes(), ch.size(), elem);
  const size_t most = *std::max_element(counts.begin(), counts.end());
  if (ch.size() == 1 || most == 0 || most > chunk) return false;
  wait_slot_free(ctx, ch, ch.round);
  copy_blocks_in(ctx, ch, ch.round, send, counts, prefix_offsets(counts), chunk, elem, 0);
  return true;
}

// ---- all-gather ---------------------------------------------------------------

void shm_all_gatherv(CollectiveContext& ctx, ShmChannel& ch, const void* send, void* recv,
                     std::span<const size_t> counts, size_t elem_bytes, bool staged) {
  const int n = ch.size();
  const int me = ch.rank();
  const std::vector<size_t> offs = prefix_offsets(counts);
  std::byte* own = at(recv, offs[static_cast<size_t>(me)] * elem_bytes);
  const size_t my_bytes = counts[static_cast<size_t>(me)] * elem_bytes;
  if (send != own) copy_bytes(own, send, my_bytes);
  if (n == 1) return;
  const size_t chunk = ch.slot_bytes();
  const uint64_t rounds =
      ceil_div(*std::max_element(counts.begin(), counts.end()) * elem_bytes, chunk);
  MT_CHECK(!staged || rounds == 1, "staged all-gather needs one round, has {}", rounds);
  for (uint64_t k = 0; k < rounds; ++k) {
    const uint64_t g = ch.round + k;
    const size_t lo = k * chunk;
    ctx.set_step(static_cast<int64_t>(k), static_cast<int64_t>(rounds));
    const size_t my_len = clamp_len(my_bytes, lo, chunk);
    if (!staged) {
      wait_slot_free(ctx, ch, g);
      put(ctx, ch, g, 0, own + lo, my_len, ch.peers());
      raise(ch, &Control::published, g + 1);
      wait_flags(ctx, ch, &Control::published, g + 1, ch.peers());
    }
    for (int q : ch.peers()) {
      const size_t qq = static_cast<size_t>(q);
      get(ctx, ch, q, g, 0, at(recv, offs[qq] * elem_bytes + lo),
          clamp_len(counts[qq] * elem_bytes, lo, chunk));
    }
    raise(ch, &Control::done, g + 1);
  }
  ch.round += rounds;
}

CollectiveCost shm_all_gatherv_cost(int n, int rank, std::span<const size_t> counts,
                                    size_t elem_bytes, size_t slot_bytes) {
  if (n == 1) return {};
  const uint64_t total = std::accumulate(counts.begin(), counts.end(), uint64_t{0});
  const uint64_t mine = counts[static_cast<size_t>(rank)];
  const uint64_t rounds =
      ceil_div(*std::max_element(counts.begin(), counts.end()) * elem_bytes, slot_bytes);
  return {static_cast<int64_t>(rounds), static_cast<uint64_t>(n - 1) * mine * elem_bytes,
          (total - mine) * elem_bytes};
}

bool shm_stage_all_gatherv(CollectiveContext& ctx, ShmChannel& ch, const void* send,
                           std::span<const size_t> counts, size_t elem_bytes) {
  const size_t most = *std::max_element(counts.begin(), counts.end()) * elem_bytes;
  if (ch.size() == 1 || most == 0 || most > ch.slot_bytes()) return false;
  wait_slot_free(ctx, ch, ch.round);
  put(ctx, ch, ch.round, 0, send, counts[static_cast<size_t>(ch.rank())] * elem_bytes, ch.peers());
  return true;
}

// ---- broadcast ----------------------------------------------------------------

void shm_broadcast(CollectiveContext& ctx, ShmChannel& ch, void* buf, size_t bytes, int root,
                   bool staged) {
  const int n = ch.size();
  const int me = ch.rank();
  if (n == 1) return;
  const size_t chunk = ch.slot_bytes();
  const uint64_t rounds = ceil_div(bytes, chunk);
  MT_CHECK(!staged || rounds == 1, "staged broadcast needs one round, has {}", rounds);
  const std::vector<int> from_root = {root};
  for (uint64_t k = 0; k < rounds; ++k) {
    const uint64_t g = ch.round + k;
    const size_t lo = k * chunk;
    const size_t len = clamp_len(bytes, lo, chunk);
    ctx.set_step(static_cast<int64_t>(k), static_cast<int64_t>(rounds));
    if (me == root) {
      if (!staged) {
        wait_slot_free(ctx, ch, g);
        put(ctx, ch, g, 0, at(buf, lo), len, ch.peers());
        raise(ch, &Control::published, g + 1);
      }
    } else {
      if (!staged) wait_flags(ctx, ch, &Control::published, g + 1, from_root);
      get(ctx, ch, root, g, 0, at(buf, lo), len);
    }
    raise(ch, &Control::done, g + 1);
  }
  ch.round += rounds;
}

CollectiveCost shm_broadcast_cost(int n, int rank, size_t bytes, int root, size_t slot_bytes) {
  if (n == 1) return {};
  const int64_t rounds = static_cast<int64_t>(ceil_div(bytes, slot_bytes));
  if (rank == root) return {rounds, static_cast<uint64_t>(n - 1) * bytes, 0};
  return {rounds, 0, bytes};
}

bool shm_stage_broadcast(CollectiveContext& ctx, ShmChannel& ch, const void* buf, size_t bytes,
                         int root) {
  if (ch.size() == 1 || bytes == 0 || bytes > ch.slot_bytes()) return false;
  if (ch.rank() == root) {
    wait_slot_free(ctx, ch, ch.round);
    put(ctx, ch, ch.round, 0, buf, bytes, ch.peers());
  }
  return true;
}

// ---- barrier and handshake ------------------------------------------------------

void shm_barrier(CollectiveContext& ctx, ShmChannel& ch) {
  if (ch.size() == 1) return;
  const uint64_t g = ch.round;
  ctx.set_step(0, 1);
  raise(ch, &Control::published, g + 1);
  wait_flags(ctx, ch, &Control::published, g + 1, ch.peers());
  raise(ch, &Control::done, g + 1);
  ch.round += 1;
}

CollectiveCost shm_barrier_cost(int n, int /*rank*/) {
  return {n > 1 ? 1 : 0, 0, 0};
}

// Records alternate between two lines: agreement a+2 reuses a's line only
// after every rank published a+1, which each does after reading a.
void shm_exchange(CollectiveContext& ctx, ShmChannel& ch, const void* record, void* all,
                  size_t record_bytes) {
  MT_CHECK_LE(record_bytes, ShmChannel::kRecordBytes);
  const int me = ch.rank();
  const uint64_t a = ch.agreements;
  const size_t p = a % 2;
  Control::AgreeLine& mine = ch.control(me).agree[p];
  copy_bytes(mine.record, record, record_bytes);
  for (int q : ch.peers()) ctx.count_sent(q, record_bytes);  // each peer reads it
  mine.count.store(a + 1, std::memory_order_release);
  auto arrived = [&](int q) {
    return ch.control(q).agree[p].count.load(std::memory_order_acquire) >= a + 1;
  };
  if (!std::all_of(ch.peers().begin(), ch.peers().end(), arrived)) {
    std::vector<int> late = ch.peers();
    auto ready = [&] {
      std::erase_if(late, arrived);
      return late.empty();
    };
    ctx.wait_until(ready, late, [&] {
      std::string list;
      for (int q : late) list += fmt::format("{}rank {}", list.empty() ? "" : ", ", q);
      return fmt::format("the handshake records of agreement {} from {}", a + 1, list);
    });
  }
  for (int q = 0; q < ch.size(); ++q) {
    copy_bytes(at(all, static_cast<size_t>(q) * record_bytes), ch.control(q).agree[p].record,
               record_bytes);
    if (q != me) ctx.count_received(q, record_bytes);
  }
  ch.agreements += 1;
}

CollectiveCost shm_exchange_cost(int n, int /*rank*/, size_t record_bytes) {
  const uint64_t b = static_cast<uint64_t>(n - 1) * record_bytes;
  return {n > 1 ? 1 : 0, b, b};
}

}  // namespace mt::comm
