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

ArenaLayout plan_arena(const std::vector<BufferLife>& buffers) {
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
      MT_CHECK(b.last >= b.first, "buffer alive from step {} to {}", b.first, b.last);
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

}  // namespace mt
