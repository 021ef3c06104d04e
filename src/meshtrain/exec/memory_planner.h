// Offset assignment for buffers with known lifetimes inside one arena.
//
// Each buffer is alive over an inclusive range of schedule steps; buffers
// alive at the same step never share bytes. Two greedy placements are tried
// and the smaller arena kept: in schedule order with best fit among the holes
// of dead buffers, and largest buffer first at the lowest free offset. The
// result is the peak arena size before anything runs. Pure function; no
// allocation of the memory itself.
#pragma once

#include <cstdint>
#include <vector>

namespace mt {

inline constexpr int64_t kArenaAlign = 64;

inline int64_t align_up(int64_t n, int64_t a = kArenaAlign) {
  return (n + a - 1) / a * a;
}

struct BufferLife {
  int64_t bytes = 0;  // rounded up to kArenaAlign by the planner
  int first = 0;      // step that writes it
  int last = 0;       // last step that reads it (>= first)
};

struct ArenaLayout {
  std::vector<int64_t> offset;  // per buffer, multiples of kArenaAlign
  int64_t peak = 0;             // arena bytes needed
};

ArenaLayout plan_arena(const std::vector<BufferLife>& buffers);

}  // namespace mt
