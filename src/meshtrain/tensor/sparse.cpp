#include "meshtrain/tensor/sparse.h"

#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "meshtrain/base/error.h"
#include "meshtrain/tensor/kernel_checks.h"

namespace mt {

void Csr::validate(const char* what) const {
  check_csr(what, tensor_from(row_ptr), tensor_from(col_idx), Tensor(), cols, DType::f32);
  if (static_cast<int64_t>(row_ptr.size()) != rows + 1) {
    throw ShapeError(fmt::format("{}: row_ptr has {} entries, expected rows + 1 = {}", what,
                                 row_ptr.size(), rows + 1));
  }
}

Csr Csr::from_entries(int64_t rows, int64_t cols, const std::vector<int32_t>& row,
                      const std::vector<int32_t>& col) {
  MT_CHECK_EQ(row.size(), col.size());
  Csr a;
  a.rows = rows;
  a.cols = cols;
  a.row_ptr.assign(static_cast<size_t>(rows + 1), 0);
  for (int32_t r : row) {
    if (r < 0 || r >= rows)
      throw ShapeError(fmt::format("Csr: row {} out of range [0, {})", r, rows));
    ++a.row_ptr[static_cast<size_t>(r) + 1];
  }
  for (size_t i = 1; i < a.row_ptr.size(); ++i) a.row_ptr[i] += a.row_ptr[i - 1];
  std::vector<int32_t> next(a.row_ptr.begin(), a.row_ptr.end() - 1);
  a.col_idx.resize(col.size());
  for (size_t k = 0; k < row.size(); ++k) {
    a.col_idx[static_cast<size_t>(next[static_cast<size_t>(row[k])]++)] = col[k];
  }
  return a;
}

Csr with_self_loops(const Csr& a) {
  if (a.rows != a.cols) {
    throw ShapeError(
        fmt::format("with_self_loops: the matrix is {}x{}, not square", a.rows, a.cols));
  }
  Csr b;
  b.rows = a.rows;
  b.cols = a.cols;
  b.row_ptr.assign(1, 0);
  b.col_idx.reserve(a.col_idx.size() + static_cast<size_t>(a.rows));
  for (int64_t i = 0; i < a.rows; ++i) {
    const auto lo = static_cast<size_t>(a.row_ptr[static_cast<size_t>(i)]);
    const auto hi = static_cast<size_t>(a.row_ptr[static_cast<size_t>(i) + 1]);
    bool has = false;
    for (size_t e = lo; e < hi; ++e) has = has || a.col_idx[e] == i;
    bool placed = has;
    for (size_t e = lo; e < hi; ++e) {
      if (!placed && a.col_idx[e] > i) {
        b.col_idx.push_back(static_cast<int32_t>(i));
        placed = true;
      }
      b.col_idx.push_back(a.col_idx[e]);
    }
    if (!placed) b.col_idx.push_back(static_cast<int32_t>(i));
    b.row_ptr.push_back(static_cast<int32_t>(b.col_idx.size()));
  }
  return b;
}

namespace {
int64_t degree(const Csr& a, int64_t v) {
  return a.row_ptr[static_cast<size_t>(v) + 1] - a.row_ptr[static_cast<size_t>(v)];
}
}  // namespace

std::vector<float> gcn_norm_values(const Csr& a) {
  std::vector<float> w(a.col_idx.size());
  for (int64_t i = 0; i < a.rows; ++i) {
    for (int32_t e = a.row_ptr[static_cast<size_t>(i)]; e < a.row_ptr[static_cast<size_t>(i) + 1];
         ++e) {
      const int32_t j = a.col_idx[static_cast<size_t>(e)];
      // A column that is not also a row (rectangular A) counts its own row's degree as 1.
      const double dj = j < a.rows ? static_cast<double>(degree(a, j)) : 1.0;
      const double di = static_cast<double>(degree(a, i));
      w[static_cast<size_t>(e)] =
          (di > 0 && dj > 0) ? static_cast<float>(1.0 / std::sqrt(di * dj)) : 0.0f;
    }
  }
  return w;
}

std::vector<float> mean_values(const Csr& a) {
  std::vector<float> w(a.col_idx.size());
  for (int64_t i = 0; i < a.rows; ++i) {
    const int64_t d = degree(a, i);
    for (int32_t e = a.row_ptr[static_cast<size_t>(i)]; e < a.row_ptr[static_cast<size_t>(i) + 1];
         ++e) {
      w[static_cast<size_t>(e)] = static_cast<float>(1.0 / static_cast<double>(d));
    }
  }
  return w;
}

std::vector<int32_t> entry_rows(const Csr& a) {
  std::vector<int32_t> r(a.col_idx.size());
  for (int64_t i = 0; i < a.rows; ++i) {
    for (int32_t e = a.row_ptr[static_cast<size_t>(i)]; e < a.row_ptr[static_cast<size_t>(i) + 1];
         ++e) {
      r[static_cast<size_t>(e)] = static_cast<int32_t>(i);
    }
  }
  return r;
}

Tensor tensor_from(const std::vector<int32_t>& v) {
  Tensor t = Tensor::empty(Shape{static_cast<int64_t>(v.size())}, DType::i32);
  if (!v.empty()) std::memcpy(t.raw(), v.data(), v.size() * sizeof(int32_t));
  return t;
}

Tensor tensor_from(const std::vector<float>& v) {
  Tensor t = Tensor::empty(Shape{static_cast<int64_t>(v.size())}, DType::f32);
  if (!v.empty()) std::memcpy(t.raw(), v.data(), v.size() * sizeof(float));
  return t;
}

}  // namespace mt
