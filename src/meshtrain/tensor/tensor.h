// A dense, contiguous, row-major buffer with a shape and a dtype.
//
// Tensor is a cheap handle: copies share the same memory (like a
// std::shared_ptr). Memory is either owned (allocated 64-byte aligned by
// Tensor::empty/zeros, freed with the last handle) or borrowed (Tensor::wrap
// over memory someone else owns, e.g. the executor's arena). clone() makes a
// deep copy. Owned memory is counted by category (tensor/memory_stats.h).
// Not thread-safe for concurrent writes to the same memory.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "meshtrain/base/error.h"
#include "meshtrain/tensor/dtype.h"
#include "meshtrain/tensor/shape.h"

namespace mt {

class Tensor {
 public:
  Tensor() = default;

  static Tensor empty(const Shape& shape, DType dtype);
  static Tensor zeros(const Shape& shape, DType dtype);
  // A scalar or any-shape tensor filled with `value` (converted to dtype).
  static Tensor full(const Shape& shape, DType dtype, double value);
  // Borrows `data`; the caller keeps it alive longer than every handle.
  static Tensor wrap(void* data, const Shape& shape, DType dtype);

  bool defined() const { return data_ != nullptr || shape_.numel() == 0; }
  const Shape& shape() const { return shape_; }
  DType dtype() const { return dtype_; }
  int rank() const { return shape_.rank(); }
  int64_t numel() const { return shape_.numel(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  // How many handles share this tensor's owned memory (views included; 0
  // when it is borrowed or empty): 1 means this handle is the only one.
  long use_count() const { return owner_.use_count(); }

  void* raw() { return data_; }
  const void* raw() const { return data_; }
  template <class T>
  T* data() {
    check_dtype(dtype_of<T>());
    return static_cast<T*>(data_);
  }
  template <class T>
  const T* data() const {
    check_dtype(dtype_of<T>());
    return static_cast<const T*>(data_);
  }

  // Same memory, another shape with the same element count.
  Tensor reshape(const Shape& shape) const;
  // Deep copy into freshly owned memory.
  Tensor clone() const;
  // Copy of this tensor converted to `dtype`.
  Tensor to(DType dtype) const;
  // Element i converted to double (slow; for tests and diagnostics).
  double item(int64_t i = 0) const;
  void set_item(int64_t i, double v);
  void fill(double v);
  void zero_();

  std::string desc() const;  // "f32[2, 3]"

 private:
  void check_dtype(DType want) const;

  std::shared_ptr<void> owner_;
  void* data_ = nullptr;
  Shape shape_;
  DType dtype_ = DType::f32;
};

// Converts between any two dtypes element-wise; shapes must have equal numel.
void convert(const Tensor& src, Tensor& dst);

}  // namespace mt
