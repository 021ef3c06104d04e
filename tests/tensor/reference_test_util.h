// Helpers for the reference backend's tests: building small tensors from
// literal values and comparing results element by element.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "meshtrain/tensor/kernels.h"
#include "meshtrain/tensor/tensor.h"

namespace mt::testing {

inline const std::vector<DType> kRefFloatTypes = {DType::f32, DType::f64};

// Absolute tolerance for results whose magnitude is about 1.
inline double tol(DType t) {
  return t == DType::f32 ? 2e-6 : 1e-12;
}

inline Tensor make(const Shape& shape, DType dtype, const std::vector<double>& values) {
  Tensor t = Tensor::empty(shape, dtype);
  EXPECT_EQ(static_cast<int64_t>(values.size()), t.numel()) << "literal for " << t.desc();
  for (int64_t i = 0; i < t.numel() && i < static_cast<int64_t>(values.size()); ++i) {
    t.set_item(i, values[static_cast<size_t>(i)]);
  }
  return t;
}

inline std::vector<double> values(const Tensor& t) {
  std::vector<double> v(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) v[static_cast<size_t>(i)] = t.item(i);
  return v;
}

// Element-wise |got - want| <= atol + rtol * |want|; reports the first index
// that differs.
inline ::testing::AssertionResult near(const Tensor& got, const std::vector<double>& want,
                                       double atol, double rtol = 0.0) {
  if (got.numel() != static_cast<int64_t>(want.size())) {
    return ::testing::AssertionFailure()
           << got.desc() << " has " << got.numel() << " elements, want " << want.size();
  }
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double g = got.item(i), w = want[static_cast<size_t>(i)];
    const bool same_special = (std::isnan(g) && std::isnan(w)) || (std::isinf(w) && g == w);
    if (!same_special && !(std::abs(g - w) <= atol + rtol * std::abs(w))) {
      return ::testing::AssertionFailure() << got.desc() << " element " << i << " is " << g
                                           << ", want " << w << " (atol " << atol << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

// Runs `f` and returns the ShapeError's message ("" and a test failure if it
// did not throw one).
template <class F>
std::string shape_error_of(F&& f) {
  try {
    f();
  } catch (const ShapeError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a ShapeError";
  return "";
}

}  // namespace mt::testing
