// Ring algorithms: each rank talks only to its neighbours (r+1 to the right,
// r-1 to the left), so every link carries the same load and the per-rank
// bytes are the bandwidth lower bound (n-1)/n of the data per phase. The price
// is n-1 latency-bound steps per phase, which halving-doubling avoids for
// small messages.
#include <algorithm>
#include <cstring>
#include <numeric>

#include "meshtrain/comm/algorithms.h"
#include "meshtrain/comm/reduce.h"

namespace mt::comm {
namespace {

inline size_t wrap(int64_t i, int n) {
  return static_cast<size_t>(((i % n) + n) % n);
}
inline std::byte* at(void* p, size_t offset) {
  return static_cast<std::byte*>(p) + offset;
}
inline const std::byte* at(const void* p, size_t offset) {
  return static_cast<const std::byte*>(p) + offset;
}

// After a reduce-scatter rank r holds block r of `buf`; n-1 steps pass each
// block once around the ring. `first_step` numbers the steps for messages.
void all_gather_in_place(CollectiveContext& ctx, void* buf, std::span<const size_t> counts,
                         std::span<const size_t> offsets, size_t elem, int64_t first_step,
                         int64_t total_steps) {
  const int n = ctx.size();
  const int r = ctx.rank();
  const int right = static_cast<int>(wrap(r + 1, n));
  const int left = static_cast<int>(wrap(r - 1, n));
  for (int t = 0; t < n - 1; ++t) {
    const size_t sb = wrap(r - t, n);
    const size_t rb = wrap(r - t - 1, n);
    ctx.set_step(first_step + t, total_steps);
    ctx.sendrecv(right, at(buf, offsets[sb] * elem), counts[sb] * elem, left,
                 at(buf, offsets[rb] * elem), counts[rb] * elem);
  }
}

}  // namespace

// Reduce-scatter then all-gather over balanced blocks, in place in `recv`:
// at step s rank r sends block r-s-1 and reduces block r-s-2 into its copy,
// so after n-1 steps it owns block r, reduced over all ranks.
void ring_all_reduce(CollectiveContext& ctx, const void* send, void* recv, size_t count,
                     DType dtype, ReduceOp op) {
  const int n = ctx.size();
  const int r = ctx.rank();
  const size_t elem = dtype_size(dtype);
  if (send != recv) copy_bytes(recv, send, count * elem);
  if (n == 1) return;
  const std::vector<size_t> blocks = balanced_counts(count, n);
  const std::vector<size_t> offsets = prefix_offsets(blocks);
  const int right = static_cast<int>(wrap(r + 1, n));
  const int left = static_cast<int>(wrap(r - 1, n));
  const size_t max_block = *std::max_element(blocks.begin(), blocks.end());
  std::byte* tmp = ctx.scratch(max_block * elem);
  const int64_t total_steps = 2 * (n - 1);
  for (int s = 0; s < n - 1; ++s) {
    const size_t sb = wrap(r - s - 1, n);
    const size_t rb = wrap(r - s - 2, n);
    ctx.set_step(s, total_steps);
    ctx.sendrecv(right, at(recv, offsets[sb] * elem), blocks[sb] * elem, left, tmp,
                 blocks[rb] * elem);
    const int divisor = (op == ReduceOp::avg && s == n - 2) ? n : 1;
    std::byte* dst = at(recv, offsets[rb] * elem);
    combine(dst, dst, tmp, blocks[rb], dtype, op, divisor);
  }
  all_gather_in_place(ctx, recv, blocks, offsets, elem, n - 1, total_steps);
}

// Rank r sends every block but its own (reduce-scatter) and every block but
// r+1's (all-gather); it receives every block but r-1's and every block but
// its own.
CollectiveCost ring_all_reduce_cost(int n, int rank, size_t count, size_t elem_bytes) {
  if (n == 1) return {};
  const std::vector<size_t> b = balanced_counts(count, n);
  const uint64_t total = count * elem_bytes;
  auto bytes = [&](int64_t i) { return b[wrap(i, n)] * elem_bytes; };
  return {2 * (n - 1), (total - bytes(rank)) + (total - bytes(rank + 1)),
          (total - bytes(rank - 1)) + (total - bytes(rank))};
}

// The partial sums travel in a scratch accumulator; the first step sends the
// rank's own input block, the last one reduces straight into `recv`.
void ring_reduce_scatterv(CollectiveContext& ctx, const void* send, void* recv,
                          std::span<const size_t> counts, DType dtype, ReduceOp op) {
  const int n = ctx.size();
  const int r = ctx.rank();
  const size_t elem = dtype_size(dtype);
  const std::vector<size_t> offsets = prefix_offsets(counts);
  if (n == 1) {
    copy_bytes(recv, send, counts[0] * elem);
    return;
  }
  const int right = static_cast<int>(wrap(r + 1, n));
  const int left = static_cast<int>(wrap(r - 1, n));
  const size_t max_block = *std::max_element(counts.begin(), counts.end());
  std::byte* acc = ctx.scratch(max_block * elem, 0);
  std::byte* tmp = ctx.scratch(max_block * elem, 1);
  for (int s = 0; s < n - 1; ++s) {
    const size_t sb = wrap(r - s - 1, n);
    const size_t rb = wrap(r - s - 2, n);
    ctx.set_step(s, n - 1);
    const void* out = s == 0 ? at(send, offsets[sb] * elem) : acc;
    ctx.post_recv(left, tmp, counts[rb] * elem);
    ctx.post_send(right, out, counts[sb] * elem);
    ctx.wait_all();
    const bool last = s == n - 2;
    const int divisor = (op == ReduceOp::avg && last) ? n : 1;
    combine(last ? recv : acc, at(send, offsets[rb] * elem), tmp, counts[rb], dtype, op, divisor);
  }
}

// Sends every block but its own, receives every block but rank r-1's.
CollectiveCost ring_reduce_scatterv_cost(int n, int rank, std::span<const size_t> counts,
                                         size_t elem_bytes) {
  if (n == 1) return {};
  const uint64_t total = std::accumulate(counts.begin(), counts.end(), uint64_t{0}) * elem_bytes;
  return {n - 1, total - counts[wrap(rank, n)] * elem_bytes,
          total - counts[wrap(rank - 1, n)] * elem_bytes};
}

void ring_all_gatherv(CollectiveContext& ctx, const void* send, void* recv,
                      std::span<const size_t> counts, size_t elem_bytes) {
  const int r = ctx.rank();
  const std::vector<size_t> offsets = prefix_offsets(counts);
  std::byte* own = at(recv, offsets[static_cast<size_t>(r)] * elem_bytes);
  if (send != own) copy_bytes(own, send, counts[static_cast<size_t>(r)] * elem_bytes);
  if (ctx.size() == 1) return;
  all_gather_in_place(ctx, recv, counts, offsets, elem_bytes, 0, ctx.size() - 1);
}

// Sends every block but rank r+1's, receives every block but its own.
CollectiveCost ring_all_gatherv_cost(int n, int rank, std::span<const size_t> counts,
                                     size_t elem_bytes) {
  if (n == 1) return {};
  const uint64_t total = std::accumulate(counts.begin(), counts.end(), uint64_t{0}) * elem_bytes;
  return {n - 1, total - counts[wrap(rank + 1, n)] * elem_bytes,
          total - counts[wrap(rank, n)] * elem_bytes};
}

}  // namespace mt::comm
