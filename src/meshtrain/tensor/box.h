// An N-d box of a tensor: [begin[d], end[d]) in each dimension d. Used by
// spmd (the part of a global tensor a rank holds under a sharding) and by
// checkpoint pieces (sync/data_parallel.h's ShardPiece). Plain data; no
// validation here (callers check a box against a shape where it matters).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "meshtrain/tensor/shape.h"

namespace mt {

class Tensor;

struct Box {
  std::vector<int64_t> begin, end;

  // The box's extent per dimension.
  Shape shape() const {
    std::vector<int64_t> d(begin.size());
    for (size_t i = 0; i < begin.size(); ++i) d[i] = end[i] - begin[i];
    return Shape(std::move(d));
  }
  int64_t elements() const {
    int64_t n = 1;
    for (size_t i = 0; i < begin.size(); ++i) n *= end[i] - begin[i];
    return n;
  }
  // The whole of a tensor of `shape`.
  static Box whole(const Shape& shape) {
    return Box{std::vector<int64_t>(shape.dims().size(), 0), shape.dims()};
  }
  // "[0:8, 4:8]"
  std::string str() const {
    std::string s = "[";
    for (size_t i = 0; i < begin.size(); ++i) {
      if (i > 0) s += ", ";
      s += std::to_string(begin[i]) + ":" + std::to_string(i < end.size() ? end[i] : 0);
    }
    return s + "]";
  }
  bool operator==(const Box&) const = default;
};

// Copies box `b` of `whole` into `piece` (its elements in row-major order;
// piece.numel() == b.elements(), same dtype), or `piece` back into box `b`
// of `whole`: one contiguous run per row of the box. InternalError for a box
// outside `whole` or a piece of another size or dtype.
void copy_box_out(const Tensor& whole, const Box& b, Tensor& piece);
void copy_box_in(Tensor& whole, const Box& b, const Tensor& piece);

}  // namespace mt
