#include "meshtrain/tensor/box.h"

#include <cstring>

#include "meshtrain/base/error.h"
#include "meshtrain/tensor/tensor.h"

namespace mt {

namespace {

// Calls run(whole_offset, piece_offset, count) in elements for each row of
// box `b` of a tensor of shape `whole`.
template <typename F>
void for_each_box_row(const Shape& whole, const Box& b, F run) {
  const int r = whole.rank();
  MT_CHECK(static_cast<int>(b.begin.size()) == r && static_cast<int>(b.end.size()) == r,
           "box {} of a tensor of shape {}", b.str(), whole.str());
  for (int d = 0; d < r; ++d) {
    MT_CHECK(b.begin[static_cast<size_t>(d)] >= 0 &&
                 b.begin[static_cast<size_t>(d)] <= b.end[static_cast<size_t>(d)] &&
                 b.end[static_cast<size_t>(d)] <= whole[d],
             "box {} outside a tensor of shape {}", b.str(), whole.str());
  }
  if (r == 0) {
    run(0, 0, 1);
    return;
  }
  const Shape bs = b.shape();
  const int64_t row = bs[r - 1];
  if (row == 0) return;
  const int64_t rows = bs.numel() / row;
  for (int64_t k = 0; k < rows; ++k) {
    int64_t rest = k, flat = b.begin[static_cast<size_t>(r - 1)], stride = whole[r - 1];
    for (int d = r - 2; d >= 0; --d) {
      flat += (b.begin[static_cast<size_t>(d)] + rest % bs[d]) * stride;
      rest /= bs[d];
      stride *= whole[d];
    }
    run(flat, k * row, row);
  }
}

void check_piece(const Tensor& whole, const Box& b, const Tensor& piece) {
  MT_CHECK(piece.numel() == b.elements() && piece.dtype() == whole.dtype(),
           "box {} of {} into a piece {}", b.str(), whole.desc(), piece.desc());
}

}  // namespace

void copy_box_out(const Tensor& whole, const Box& b, Tensor& piece) {
  check_piece(whole, b, piece);
  const size_t e = dtype_size(whole.dtype());
  const auto* src = static_cast<const char*>(whole.raw());
  auto* dst = static_cast<char*>(piece.raw());
  for_each_box_row(whole.shape(), b, [&](int64_t w, int64_t p, int64_t n) {
    std::memcpy(dst + static_cast<size_t>(p) * e, src + static_cast<size_t>(w) * e,
                static_cast<size_t>(n) * e);
  });
}

void copy_box_in(Tensor& whole, const Box& b, const Tensor& piece) {
  check_piece(whole, b, piece);
  const size_t e = dtype_size(whole.dtype());
  const auto* src = static_cast<const char*>(piece.raw());
  auto* dst = static_cast<char*>(whole.raw());
  for_each_box_row(whole.shape(), b, [&](int64_t w, int64_t p, int64_t n) {
    std::memcpy(dst + static_cast<size_t>(w) * e, src + static_cast<size_t>(p) * e,
                static_cast<size_t>(n) * e);
  });
}

}  // namespace mt
