#include "meshtrain/exec/memory_planner.h"

#include <algorithm>
#include <map>
#include <numeric>

#include "meshtrain/base/error.h"

namespace mt {

namespace {

// Free holes below `top`, keyed by offset; adjacent holes are merged so a
// large buffer can use the space of several small dead ones.
class FreeList {
 public:
  int64_t allocate(int64_t bytes) {
    auto best = holes_.end();
    for (auto it = holes_.begin(); it != holes_.end(); ++it) {
      if (it->second >= bytes && (best == holes_.end() || it->second < best->second)) best = it;
    }
    if (best != holes_.end()) {
      const int64_t off = best->first;
      const int64_t rest = best->second - bytes;
      holes_.erase(best);
      if (rest > 0) holes_[off + bytes] = rest;
      return off;
    }
    // No hole fits: grow the arena, starting inside a hole that touches the top.
    int64_t off = top_;
    if (!holes_.empty()) {
      auto last = std::prev(holes_.end());
      if (last->first + last->second == top_) {
        off = last->first;
        holes_.erase(last);
      }
    }
    top_ = off + bytes;
    peak_ = std::max(peak_, top_);
    return off;
  }

  void release(int64_t off, int64_t bytes) {
    auto [it, inserted] = holes_.emplace(off, bytes);
    MT_CHECK(inserted, "arena offset {} released twice", off);
    auto next = std::next(it);
    if (next != holes_.end() && it->first + it->second == next->first) {
      it->second += next->second;
      holes_.erase(next);
    }
    if (it != holes_.begin()) {
      auto prev = std::prev(it);
      if (prev->first + prev->second == it->first) {
        prev->second += it->second;
        holes_.erase(it);
        it = prev;
      }
    }
    if (it->first + it->second == top_) {
      top_ = it->first;
      holes_.erase(it);
    }
  }

  int64_t peak() const { return peak_; }

 private:
  std::map<int64_t, int64_t> holes_;
  int64_t top_ = 0;
  int64_t peak_ = 0;
};

}  // namespace

namespace {

// Schedule-order best fit: walks the steps, placing what each writes and
// releasing what it read last.
ArenaLayout plan_in_order(const std::vector<BufferLife>& buffers) {
  ArenaLayout out;
  out.offset.assign(buffers.size(), 0);
  std::vector<size_t> by_first(buffers.size());
  std::iota(by_first.begin(), by_first.end(), size_t{0});
  std::stable_sort(by_first.begin(), by_first.end(),
                   [&](size_t a, size_t b) { return buffers[a].first < buffers[b].first; });
  std::vector<size_t> by_last = by_first;
  std::stable_sort(by_last.begin(), by_last.end(),
                   [&](size_t a, size_t b) { return buffers[a].last < buffers[b].last; });

  FreeList fl;
  size_t ai = 0, fi = 0;
  // At each step: place what it writes, then release what it read for the last time.
  while (ai < by_first.size() || fi < by_last.size()) {
    const bool alloc_next =
        ai < by_first.size() &&
        (fi >= by_last.size() || buffers[by_first[ai]].first <= buffers[by_last[fi]].last);
    const int step = alloc_next ? buffers[by_first[ai]].first : buffers[by_last[fi]].last;
    for (; ai < by_first.size() && buffers[by_first[ai]].first == step; ++ai) {
      const BufferLife& b = buffers[by_first[ai]];
      const int64_t bytes = align_up(b.bytes);
      if (bytes > 0) out.offset[by_first[ai]] = fl.allocate(bytes);
    }
    for (; fi < by_last.size() && buffers[by_last[fi]].last == step; ++fi) {
      const int64_t bytes = align_up(buffers[by_last[fi]].bytes);
      if (bytes > 0) fl.release(out.offset[by_last[fi]], bytes);
    }
  }
  out.peak = fl.peak();
  return out;
}

// Largest first: each buffer goes to the lowest offset where it overlaps no
// already placed buffer that is alive at the same time. Big buffers placed
// first leave holes small ones fill, which in-order placement can fragment.
ArenaLayout plan_by_size(const std::vector<BufferLife>& buffers) {
  ArenaLayout out;
  out.offset.assign(buffers.size(), 0);
  std::vector<size_t> order(buffers.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return align_up(buffers[a].bytes) > align_up(buffers[b].bytes);
  });
  std::vector<size_t> placed;
  std::vector<std::pair<int64_t, int64_t>> busy;  // [offset, end) of conflicting buffers
  for (size_t i : order) {
    const BufferLife& b = buffers[i];
    const int64_t bytes = align_up(b.bytes);
    if (bytes == 0) continue;
    busy.clear();
    for (size_t j : placed) {
      const BufferLife& o = buffers[j];
      if (o.first <= b.last && b.first <= o.last) {
        busy.emplace_back(out.offset[j], out.offset[j] + align_up(o.bytes));
      }
    }
    std::sort(busy.begin(), busy.end());
    int64_t at = 0;
    for (const auto& [lo, hi] : busy) {
      if (lo - at >= bytes) break;
      at = std::max(at, hi);
    }
    out.offset[i] = at;
    out.peak = std::max(out.peak, at + bytes);
    placed.push_back(i);
  }
  return out;
}

}  // namespace

ArenaLayout plan_arena(const std::vector<BufferLife>& buffers) {
  for (const BufferLife& b : buffers) {
    MT_CHECK(b.last >= b.first && b.bytes >= 0, "buffer of {} bytes alive from step {} to {}",
             b.bytes, b.first, b.last);
  }
  // Neither heuristic wins on every graph; both are cheap next to a step.
  ArenaLayout in_order = plan_in_order(buffers);
  ArenaLayout by_size = plan_by_size(buffers);
  return by_size.peak < in_order.peak ? by_size : in_order;
}

}  // namespace mt
