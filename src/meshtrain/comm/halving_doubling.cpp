// Recursive halving (reduce-scatter) and recursive doubling (all-gather), as
// in Rabenseifner's all-reduce: log2(p) steps per phase, each exchanging with
// the rank whose active index differs in one bit, the exchanged range halving
// (doubling) every step. A group that is not a power of two first folds: the
// 2*rem lowest ranks pair up, even ones hand their data to the odd neighbour
// and sit out, and get the result back at the end (one extra step each way,
// a full buffer each).
#include <algorithm>
#include <cstring>
#include <numeric>

#include "meshtrain/comm/algorithms.h"
#include "meshtrain/comm/reduce.h"

namespace mt::comm {
namespace {

inline std::byte* at(void* p, size_t offset) {
  return static_cast<std::byte*>(p) + offset;
}
inline const std::byte* at(const void* p, size_t offset) {
  return static_cast<const std::byte*>(p) + offset;
}

struct Fold {
  int n;
  int p = 1;  // largest power of two <= n
  int rem;    // n - p ranks sit out

  explicit Fold(int size) : n(size) {
    while (p * 2 <= n) p *= 2;
    rem = n - p;
  }
  bool sits_out(int r) const { return r < 2 * rem && r % 2 == 0; }
  bool folds_in(int r) const { return r < 2 * rem && r % 2 == 1; }
  int active_index(int r) const { return r < 2 * rem ? r / 2 : r - rem; }
  int original(int k) const { return k < rem ? 2 * k + 1 : k + rem; }
  int log2p() const {
    int l = 0;
    while ((1 << l) < p) ++l;
    return l;
  }
  // Offsets (p + 1 entries) of the superblocks of per-rank `offsets`: active
  // index k < rem owns the blocks of ranks 2k and 2k+1, the others one block.
  std::vector<size_t> superblock_offsets(std::span<const size_t> offsets) const {
    std::vector<size_t> sb(static_cast<size_t>(p) + 1);
    for (int k = 0; k < p; ++k)
      sb[static_cast<size_t>(k)] = offsets[static_cast<size_t>(k < rem ? 2 * k : k + rem)];
    sb[static_cast<size_t>(p)] = offsets[static_cast<size_t>(n)];
    return sb;
  }
};

// Sum of superblocks [lo, hi) in elements.
inline size_t span_of(const std::vector<size_t>& sb, int lo, int hi) {
  return sb[static_cast<size_t>(hi)] - sb[static_cast<size_t>(lo)];
}

// In place in `buf`: afterwards active index k holds superblock k reduced
// over all active ranks. The last step divides by `divisor`.
void halving(CollectiveContext& ctx, const Fold& f, int k, void* buf, const std::vector<size_t>& sb,
             DType dtype, ReduceOp op, int divisor, std::byte* tmp, int64_t& step,
             int64_t total_steps) {
  const size_t elem = dtype_size(dtype);
  for (int m = f.p / 2; m >= 1; m /= 2) {
    const int partner = f.original(k ^ m);
    const int lo = k & ~(2 * m - 1);
    const int mid = lo + m;
    const bool upper = (k & m) != 0;
    const int keep_lo = upper ? mid : lo;
    const int give_lo = upper ? lo : mid;
    const size_t keep = span_of(sb, keep_lo, keep_lo + m);
    const size_t give = span_of(sb, give_lo, give_lo + m);
    ctx.set_step(step++, total_steps);
    ctx.sendrecv(partner, at(buf, sb[static_cast<size_t>(give_lo)] * elem), give * elem, partner,
                 tmp, keep * elem);
    std::byte* dst = at(buf, sb[static_cast<size_t>(keep_lo)] * elem);
    combine(dst, dst, tmp, keep, dtype, op, m == 1 ? divisor : 1);
  }
}

// In place in `buf`: active index k starts with superblock k and ends with all.
void doubling(CollectiveContext& ctx, const Fold& f, int k, void* buf,
              const std::vector<size_t>& sb, size_t elem, int64_t& step, int64_t total_steps) {
  for (int m = 1; m < f.p; m *= 2) {
    const int pk = k ^ m;
    const int mine = k & ~(m - 1);
    const int theirs = pk & ~(m - 1);
    ctx.set_step(step++, total_steps);
    ctx.sendrecv(f.original(pk), at(buf, sb[static_cast<size_t>(mine)] * elem),
                 span_of(sb, mine, mine + m) * elem, f.original(pk),
                 at(buf, sb[static_cast<size_t>(theirs)] * elem),
                 span_of(sb, theirs, theirs + m) * elem);
  }
}

// Bytes of the power-of-two phases for active index k: at the step with
// distance m the rank keeps the aligned group H of m superblocks containing k
// out of the aligned group G of 2m; halving sends G-H and receives H,
// doubling the reverse.
struct PhaseBytes {
  uint64_t keep = 0;  // sum over steps of |H|
  uint64_t give = 0;  // sum over steps of |G| - |H|
};
PhaseBytes phase_bytes(const Fold& f, int k, const std::vector<size_t>& sb, size_t elem) {
  PhaseBytes b;
  for (int m = f.p / 2; m >= 1; m /= 2) {
    const int g = k & ~(2 * m - 1);
    const int h = k & ~(m - 1);
    b.keep += span_of(sb, h, h + m) * elem;
    b.give += (span_of(sb, g, g + 2 * m) - span_of(sb, h, h + m)) * elem;
  }
  return b;
}

}  // namespace

void hd_all_reduce(CollectiveContext& ctx, const void* send, void* recv, size_t count, DType dtype,
                   ReduceOp op) {
  const int n = ctx.size();
  const int r = ctx.rank();
  const size_t elem = dtype_size(dtype);
  if (send != recv) copy_bytes(recv, send, count * elem);
  if (n == 1) return;
  const Fold f(n);
  const int64_t total_steps = 2 * f.log2p() + (r < 2 * f.rem ? 2 : 0);
  int64_t step = 0;
  if (f.sits_out(r)) {
    ctx.set_step(step++, total_steps);
    ctx.post_send(r + 1, recv, count * elem);
    ctx.wait_all();
    ctx.set_step(step++, total_steps);
    ctx.post_recv(r + 1, recv, count * elem);
    ctx.wait_all();
    return;
  }
  std::byte* tmp = ctx.scratch(count * elem);
  if (f.folds_in(r)) {
    ctx.set_step(step++, total_steps);
    ctx.post_recv(r - 1, tmp, count * elem);
    ctx.wait_all();
    combine(recv, recv, tmp, count, dtype, op);
  }
  const int k = f.active_index(r);
  const std::vector<size_t> blocks = balanced_counts(count, f.p);
  const std::vector<size_t> sb = prefix_offsets(blocks);
  halving(ctx, f, k, recv, sb, dtype, op, op == ReduceOp::avg ? n : 1, tmp, step, total_steps);
  doubling(ctx, f, k, recv, sb, elem, step, total_steps);
  if (f.folds_in(r)) {
    ctx.set_step(step++, total_steps);
    ctx.post_send(r - 1, recv, count * elem);
    ctx.wait_all();
  }
}

CollectiveCost hd_all_reduce_cost(int n, int rank, size_t count, size_t elem_bytes) {
  if (n == 1) return {};
  const Fold f(n);
  const uint64_t total = count * elem_bytes;
  if (f.sits_out(rank)) return {2, total, total};
  CollectiveCost c;
  if (f.folds_in(rank)) c = {2, total, total};
  const std::vector<size_t> blocks = balanced_counts(count, f.p);
  const PhaseBytes b = phase_bytes(f, f.active_index(rank), prefix_offsets(blocks), elem_bytes);
  c.steps += 2 * f.log2p();
  c.bytes_sent += b.give + b.keep;
  c.bytes_received += b.keep + b.give;
  return c;
}

// Works on a scratch copy of the input; ranks that sit out receive their block
// from their odd neighbour, which owns both blocks of its superblock.
void hd_reduce_scatterv(CollectiveContext& ctx, const void* send, void* recv,
                        std::span<const size_t> counts, DType dtype, ReduceOp op) {
  const int n = ctx.size();
  const int r = ctx.rank();
  const size_t elem = dtype_size(dtype);
  const std::vector<size_t> offsets = prefix_offsets(counts);
  const size_t total = offsets.back();
  const size_t mine = counts[static_cast<size_t>(r)];
  if (n == 1) {
    copy_bytes(recv, send, mine * elem);
    return;
  }
  const Fold f(n);
  const int64_t total_steps = f.log2p() + (r < 2 * f.rem ? 2 : 0);
  int64_t step = 0;
  if (f.sits_out(r)) {
    ctx.set_step(step++, total_steps);
    ctx.post_send(r + 1, send, total * elem);
    ctx.wait_all();
    ctx.set_step(step++, total_steps);
    ctx.post_recv(r + 1, recv, mine * elem);
    ctx.wait_all();
    return;
  }
  std::byte* work = ctx.scratch(total * elem, 0);
  std::byte* tmp = ctx.scratch(total * elem, 1);
  copy_bytes(work, send, total * elem);
  if (f.folds_in(r)) {
    ctx.set_step(step++, total_steps);
    ctx.post_recv(r - 1, tmp, total * elem);
    ctx.wait_all();
    combine(work, work, tmp, total, dtype, op);
  }
  const int k = f.active_index(r);
  const std::vector<size_t> sb = f.superblock_offsets(offsets);
  halving(ctx, f, k, work, sb, dtype, op, op == ReduceOp::avg ? n : 1, tmp, step, total_steps);
  if (f.folds_in(r)) {
    const size_t left = static_cast<size_t>(r - 1);
    ctx.set_step(step++, total_steps);
    ctx.post_send(r - 1, work + offsets[left] * elem, counts[left] * elem);
    ctx.wait_all();
  }
  copy_bytes(recv, work + offsets[static_cast<size_t>(r)] * elem, mine * elem);
}

CollectiveCost hd_reduce_scatterv_cost(int n, int rank, std::span<const size_t> counts,
                                       size_t elem_bytes) {
  if (n == 1) return {};
  const Fold f(n);
  const std::vector<size_t> offsets = prefix_offsets(counts);
  const uint64_t total = offsets.back() * elem_bytes;
  const auto block = [&](int i) { return counts[static_cast<size_t>(i)] * elem_bytes; };
  if (f.sits_out(rank)) return {2, total, block(rank)};
  CollectiveCost c;
  if (f.folds_in(rank)) c = {2, block(rank - 1), total};
  const PhaseBytes b =
      phase_bytes(f, f.active_index(rank), f.superblock_offsets(offsets), elem_bytes);
  c.steps += f.log2p();
  c.bytes_sent += b.give;
  c.bytes_received += b.keep;
  return c;
}

void hd_all_gatherv(CollectiveContext& ctx, const void* send, void* recv,
                    std::span<const size_t> counts, size_t elem_bytes) {
  const int n = ctx.size();
  const int r = ctx.rank();
  const std::vector<size_t> offsets = prefix_offsets(counts);
  const size_t total = offsets.back();
  std::byte* own = at(recv, offsets[static_cast<size_t>(r)] * elem_bytes);
  const size_t mine = counts[static_cast<size_t>(r)] * elem_bytes;
  if (send != own) copy_bytes(own, send, mine);
  if (n == 1) return;
  const Fold f(n);
  const int64_t total_steps = f.log2p() + (r < 2 * f.rem ? 2 : 0);
  int64_t step = 0;
  if (f.sits_out(r)) {
    ctx.set_step(step++, total_steps);
    ctx.post_send(r + 1, own, mine);
    ctx.wait_all();
    ctx.set_step(step++, total_steps);
    ctx.post_recv(r + 1, recv, total * elem_bytes);
    ctx.wait_all();
    return;
  }
  if (f.folds_in(r)) {
    const size_t left = static_cast<size_t>(r - 1);
    ctx.set_step(step++, total_steps);
    ctx.post_recv(r - 1, at(recv, offsets[left] * elem_bytes), counts[left] * elem_bytes);
    ctx.wait_all();
  }
  const int k = f.active_index(r);
  doubling(ctx, f, k, recv, f.superblock_offsets(offsets), elem_bytes, step, total_steps);
  if (f.folds_in(r)) {
    ctx.set_step(step++, total_steps);
    ctx.post_send(r - 1, recv, total * elem_bytes);
    ctx.wait_all();
  }
}

CollectiveCost hd_all_gatherv_cost(int n, int rank, std::span<const size_t> counts,
                                   size_t elem_bytes) {
  if (n == 1) return {};
  const Fold f(n);
  const std::vector<size_t> offsets = prefix_offsets(counts);
  const uint64_t total = offsets.back() * elem_bytes;
  const auto block = [&](int i) { return counts[static_cast<size_t>(i)] * elem_bytes; };
  if (f.sits_out(rank)) return {2, block(rank), total};
  CollectiveCost c;
  if (f.folds_in(rank)) c = {2, total, block(rank - 1)};
  const PhaseBytes b =
      phase_bytes(f, f.active_index(rank), f.superblock_offsets(offsets), elem_bytes);
  c.steps += f.log2p();
  c.bytes_sent += b.keep;
  c.bytes_received += b.give;
  return c;
}

}  // namespace mt::comm
