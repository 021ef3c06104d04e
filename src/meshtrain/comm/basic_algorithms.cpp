// The small algorithms: block partitions, binomial-tree broadcast, pairwise
// all-to-all, dissemination barrier and the direct record exchange the
// handshake uses without shared memory.
#include <algorithm>
#include <cstring>
#include <numeric>

#include "meshtrain/comm/algorithms.h"

namespace mt::comm {
namespace {

inline std::byte* at(void* p, size_t offset) {
  return static_cast<std::byte*>(p) + offset;
}
inline const std::byte* at(const void* p, size_t offset) {
  return static_cast<const std::byte*>(p) + offset;
}

int ceil_log2(int n) {
  int l = 0;
  while ((1 << l) < n) ++l;
  return l;
}

}  // namespace

std::vector<size_t> balanced_counts(size_t count, int parts, size_t align) {
  const size_t p = static_cast<size_t>(parts);
  const size_t units = count / align;
  std::vector<size_t> out(p);
  for (size_t i = 0; i < p; ++i) out[i] = (units / p + (i < units % p ? 1 : 0)) * align;
  out[p - 1] += count - units * align;
  return out;
}

std::vector<size_t> prefix_offsets(std::span<const size_t> counts) {
  std::vector<size_t> out(counts.size() + 1, 0);
  for (size_t i = 0; i < counts.size(); ++i) out[i + 1] = out[i] + counts[i];
  return out;
}

// Binomial tree on ranks renumbered so the root is 0: a rank receives from
// the rank that differs in its lowest set bit, then forwards to the ranks
// that differ in each lower bit, largest subtree first.
void tree_broadcast(CollectiveContext& ctx, void* buf, size_t bytes, int root) {
  const int n = ctx.size();
  const int vr = (ctx.rank() - root + n) % n;
  const int64_t steps = ceil_log2(n);
  int mask = 1;
  while (mask < n) {
    if (vr & mask) {
      ctx.set_step(0, steps);
      ctx.post_recv((vr - mask + root) % n, buf, bytes);
      ctx.wait_all();
      break;
    }
    mask <<= 1;
  }
  for (mask >>= 1; mask > 0; mask >>= 1) {
    if (vr + mask < n) ctx.post_send((vr + mask + root) % n, buf, bytes);
  }
  ctx.set_step(steps - 1, steps);
  ctx.wait_all();
}

// Every non-root rank receives the buffer once; a rank sends it once per
// child, and the root has ceil(log2 n) children when n is a power of two.
CollectiveCost tree_broadcast_cost(int n, int rank, size_t bytes, int root) {
  const int vr = (rank - root + n) % n;
  int lowest = 1;
  while (lowest < n && !(vr & lowest)) lowest <<= 1;
  int children = 0;
  for (int mask = lowest >> 1; mask > 0; mask >>= 1) {
    if (vr + mask < n) ++children;
  }
  return {ceil_log2(n), static_cast<uint64_t>(children) * bytes, vr == 0 ? 0 : bytes};
}

// Step s exchanges with the ranks s ahead and s behind, so each step is a
// permutation and no rank is a hot spot.
void pairwise_all_to_allv(CollectiveContext& ctx, const void* send,
                          std::span<const size_t> send_counts, void* recv,
                          std::span<const size_t> recv_counts, size_t elem_bytes) {
  const int n = ctx.size();
  const int r = ctx.rank();
  const std::vector<size_t> soff = prefix_offsets(send_counts);
  const std::vector<size_t> roff = prefix_offsets(recv_counts);
  const size_t me = static_cast<size_t>(r);
  copy_bytes(at(recv, roff[me] * elem_bytes), at(send, soff[me] * elem_bytes),
             std::min(send_counts[me], recv_counts[me]) * elem_bytes);
  for (int s = 1; s < n; ++s) {
    const size_t to = static_cast<size_t>((r + s) % n);
    const size_t from = static_cast<size_t>((r - s + n) % n);
    ctx.set_step(s - 1, n - 1);
    ctx.sendrecv(static_cast<int>(to), at(send, soff[to] * elem_bytes),
                 send_counts[to] * elem_bytes, static_cast<int>(from),
                 at(recv, roff[from] * elem_bytes), recv_counts[from] * elem_bytes);
  }
}

CollectiveCost pairwise_all_to_allv_cost(int n, int rank, std::span<const size_t> send_counts,
                                         std::span<const size_t> recv_counts, size_t elem_bytes) {
  const size_t me = static_cast<size_t>(rank);
  const uint64_t sent =
      std::accumulate(send_counts.begin(), send_counts.end(), uint64_t{0}) - send_counts[me];
  const uint64_t received =
      std::accumulate(recv_counts.begin(), recv_counts.end(), uint64_t{0}) - recv_counts[me];
  return {n - 1, sent * elem_bytes, received * elem_bytes};
}

// Round k signals rank r+2^k and waits for rank r-2^k: after ceil(log2 n)
// rounds every rank has (transitively) heard from every other.
void dissemination_barrier(CollectiveContext& ctx) {
  const int n = ctx.size();
  const int r = ctx.rank();
  std::byte token[1] = {};
  int64_t step = 0;
  for (int k = 1; k < n; k <<= 1) {
    ctx.set_step(step++, ceil_log2(n));
    ctx.sendrecv((r + k) % n, token, 0, (r - k + n) % n, token, 0);
  }
}

CollectiveCost dissemination_barrier_cost(int n, int /*rank*/) {
  return {ceil_log2(n), 0, 0};
}

void direct_exchange(CollectiveContext& ctx, const void* record, void* all, size_t record_bytes) {
  const int n = ctx.size();
  const int r = ctx.rank();
  copy_bytes(at(all, static_cast<size_t>(r) * record_bytes), record, record_bytes);
  for (int q = 0; q < n; ++q) {
    if (q == r) continue;
    ctx.post_recv(q, at(all, static_cast<size_t>(q) * record_bytes), record_bytes);
    ctx.post_send(q, record, record_bytes);
  }
  ctx.set_step(0, 1);
  ctx.wait_all();
}

CollectiveCost direct_exchange_cost(int n, int /*rank*/, size_t record_bytes) {
  const uint64_t b = static_cast<uint64_t>(n - 1) * record_bytes;
  return {n > 1 ? 1 : 0, b, b};
}

}  // namespace mt::comm
