#include "meshtrain/tensor/shape.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace mt {

int64_t Shape::numel() const {
  return prod(0, rank());
}

int64_t Shape::prod(int begin, int end) const {
  int64_t n = 1;
  for (int i = begin; i < end; ++i) n *= dims_[static_cast<size_t>(i)];
  return n;
}

std::string Shape::str() const {
  return fmt::format("[{}]", fmt::join(dims_, ", "));
}

}  // namespace mt
