#include "meshtrain/tensor/tensor.h"

#include <cstdlib>
#include <cstring>

#include "meshtrain/tensor/memory_stats.h"

namespace mt {

namespace {
constexpr size_t kAlign = 64;

template <class T>
double load(const void* p, int64_t i) {
  const T v = static_cast<const T*>(p)[i];
  if constexpr (std::is_same_v<T, bf16>)
    return bf16_to_f32(v);
  else if constexpr (std::is_same_v<T, f16>)
    return f16_to_f32(v);
  else
    return static_cast<double>(v);
}

template <class T>
void store(void* p, int64_t i, double v) {
  T& dst = static_cast<T*>(p)[i];
  if constexpr (std::is_same_v<T, bf16>)
    dst = f32_to_bf16(static_cast<float>(v));
  else if constexpr (std::is_same_v<T, f16>)
    dst = f32_to_f16(static_cast<float>(v));
  else
    dst = static_cast<T>(v);
}
}  // namespace

Tensor Tensor::empty(const Shape& shape, DType dtype) {
  for (int64_t d : shape.dims()) {
    if (d < 0) throw ShapeError("tensor shape " + shape.str() + " has a negative dimension");
  }
  Tensor t;
  t.shape_ = shape;
  t.dtype_ = dtype;
  size_t bytes = t.nbytes();
  size_t rounded = (bytes + kAlign - 1) / kAlign * kAlign;
  if (rounded == 0) rounded = kAlign;
  void* p = std::aligned_alloc(kAlign, rounded);
  if (p == nullptr)
    throw Error(fmt::format("out of memory allocating {} bytes for {}", bytes, t.desc()));
  // Counted under the thread's current category until the last handle goes.
  const MemoryCategory cat = current_memory_category();
  const auto counted = static_cast<int64_t>(rounded);
  detail::count_alloc(cat, counted);
  t.owner_ = std::shared_ptr<void>(p, [cat, counted](void* q) {
    std::free(q);
    detail::count_free(cat, counted);
  });
  t.data_ = p;
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype) {
  Tensor t = empty(shape, dtype);
  t.zero_();
  return t;
}

Tensor Tensor::full(const Shape& shape, DType dtype, double value) {
  Tensor t = empty(shape, dtype);
  t.fill(value);
  return t;
}

Tensor Tensor::wrap(void* data, const Shape& shape, DType dtype) {
  Tensor t;
  t.data_ = data;
  t.shape_ = shape;
  t.dtype_ = dtype;
  return t;
}

Tensor Tensor::reshape(const Shape& shape) const {
  if (shape.numel() != numel()) {
    throw ShapeError(fmt::format("cannot reshape {} to {}: {} vs {} elements", desc(), shape.str(),
                                 numel(), shape.numel()));
  }
  Tensor t = *this;
  t.shape_ = shape;
  return t;
}

Tensor Tensor::clone() const {
  Tensor t = empty(shape_, dtype_);
  if (nbytes() > 0) std::memcpy(t.data_, data_, nbytes());
  return t;
}

Tensor Tensor::to(DType dtype) const {
  Tensor t = empty(shape_, dtype);
  convert(*this, t);
  return t;
}

double Tensor::item(int64_t i) const {
  MT_CHECK(i >= 0 && i < numel(), "index {} out of range for {}", i, desc());
  double r = 0;
  visit_dtype(dtype_, [&](auto tag) { r = load<decltype(tag)>(data_, i); });
  return r;
}

void Tensor::set_item(int64_t i, double v) {
  MT_CHECK(i >= 0 && i < numel(), "index {} out of range for {}", i, desc());
  visit_dtype(dtype_, [&](auto tag) { store<decltype(tag)>(data_, i, v); });
}

void Tensor::fill(double v) {
  visit_dtype(dtype_, [&](auto tag) {
    using T = decltype(tag);
    if (numel() == 0) return;
    store<T>(data_, 0, v);
    T first = static_cast<T*>(data_)[0];
    T* p = static_cast<T*>(data_);
    for (int64_t i = 1; i < numel(); ++i) p[i] = first;
  });
}

void Tensor::zero_() {
  if (nbytes() > 0) std::memset(data_, 0, nbytes());
}

std::string Tensor::desc() const {
  return fmt::format("{}{}", dtype_name(dtype_), shape_.str());
}

void Tensor::check_dtype(DType want) const {
  if (want != dtype_) {
    throw InternalError(fmt::format("tensor {} accessed as {}", desc(), dtype_name(want)));
  }
}

void convert(const Tensor& src, Tensor& dst) {
  if (src.numel() != dst.numel()) {
    throw ShapeError(
        fmt::format("convert: {} and {} differ in element count", src.desc(), dst.desc()));
  }
  const int64_t n = src.numel();
  if (src.dtype() == dst.dtype()) {
    if (n > 0) std::memcpy(dst.raw(), src.raw(), src.nbytes());
    return;
  }
  if (src.dtype() == DType::f32 && dst.dtype() == DType::bf16) {
    const float* s = src.data<float>();
    bf16* d = dst.data<bf16>();
    for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(s[i]);
    return;
  }
  if (src.dtype() == DType::bf16 && dst.dtype() == DType::f32) {
    const bf16* s = src.data<bf16>();
    float* d = dst.data<float>();
    for (int64_t i = 0; i < n; ++i) d[i] = bf16_to_f32(s[i]);
    return;
  }
  // f16 <-> f32 directly, bit for bit as f16_to_f32 / f32_to_f16 (and the
  // fast backend) convert: through the generic double path a signalling NaN
  // came back quieted wherever the compiler kept the float -> double step.
  if (src.dtype() == DType::f32 && dst.dtype() == DType::f16) {
    const float* s = src.data<float>();
    f16* d = dst.data<f16>();
    for (int64_t i = 0; i < n; ++i) d[i] = f32_to_f16(s[i]);
    return;
  }
  if (src.dtype() == DType::f16 && dst.dtype() == DType::f32) {
    const f16* s = src.data<f16>();
    float* d = dst.data<float>();
    for (int64_t i = 0; i < n; ++i) d[i] = f16_to_f32(s[i]);
    return;
  }
  visit_dtype(src.dtype(), [&](auto st) {
    using S = decltype(st);
    visit_dtype(dst.dtype(), [&](auto dt) {
      using D = decltype(dt);
      for (int64_t i = 0; i < n; ++i) store<D>(dst.raw(), i, load<S>(src.raw(), i));
    });
  });
}

}  // namespace mt
