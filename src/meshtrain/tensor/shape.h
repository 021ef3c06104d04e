// A tensor's dimensions (row-major, contiguous). Rank 0 is a scalar.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

namespace mt {

class Shape {
 public:
  Shape() = default;
  Shape(std::initializer_list<int64_t> dims) : dims_(dims) {}
  explicit Shape(std::vector<int64_t> dims) : dims_(std::move(dims)) {}

  int rank() const { return static_cast<int>(dims_.size()); }
  // Negative axes count from the end, as in NumPy.
  int64_t operator[](int axis) const { return dims_.at(static_cast<size_t>(norm_axis(axis))); }
  int64_t& operator[](int axis) { return dims_.at(static_cast<size_t>(norm_axis(axis))); }
  int64_t numel() const;
  const std::vector<int64_t>& dims() const { return dims_; }
  int norm_axis(int axis) const { return axis < 0 ? axis + rank() : axis; }
  // Product of dims [begin, end).
  int64_t prod(int begin, int end) const;
  // "[2, 3, 4]"
  std::string str() const;

  friend bool operator==(const Shape& a, const Shape& b) { return a.dims_ == b.dims_; }

 private:
  std::vector<int64_t> dims_;
};

}  // namespace mt
