// How one value (a parameter, input or activation) is laid out over a mesh:
// per tensor dimension either replicated or split over one mesh axis, evenly
// or by integer ratios (2:1 gives the faster device twice the rows), plus
// the mesh axes over which the local pieces are partial sums of the value.
//
// Pure functions: each rank's piece of the global tensor as an N-d box
// [begin, end), its local shape, and validation that names the tensor, the
// dimension, the axis and what was expected. Splits are in whole `unit`s of
// the dimension (e.g. the head size for attention's columns), so a 2:1 split
// of 12 heads gives 8 and 4 heads, never a fraction of one.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/spmd/mesh.h"
#include "meshtrain/tensor/box.h"
#include "meshtrain/tensor/shape.h"

namespace mt {

struct DimSharding {
  std::string axis;             // "" = replicated along this dimension
  std::vector<int64_t> ratios;  // empty = even; else one positive ratio per axis coordinate
  int64_t unit = 1;             // pieces are whole multiples of this many elements

  // Split over `axis` (evenly when `ratios` is empty).
  static DimSharding over(std::string axis, std::vector<int64_t> ratios = {}, int64_t unit = 1) {
    return DimSharding{std::move(axis), std::move(ratios), unit};
  }
  bool split() const { return !axis.empty(); }
  bool operator==(const DimSharding&) const = default;
};

struct ShardingSpec {
  // One entry per tensor dimension; fewer entries than dimensions leave the
  // rest replicated (so {} is fully replicated).
  std::vector<DimSharding> dims;
  // Mesh axes over which the ranks' pieces are partial sums of the value.
  std::vector<std::string> partial;

  bool replicated() const;  // no split and no partial axis
  // The spec of dimension d (replicated past dims.size()).
  DimSharding dim(size_t d) const;
  // "[tp, -] partial(dp)", "[tp 2:1 unit 64, -]", "replicated".
  std::string describe() const;
  bool operator==(const ShardingSpec&) const = default;
};

// Box (tensor/box.h): an N-d box of a global tensor, [begin[d], end[d]) in
// each dimension.

// Splits `n` elements into `parts` pieces of whole `unit`s: evenly when
// `ratios` is empty (n / unit must be a multiple of parts), else in
// proportion to the ratios, each boundary rounded down to a whole unit (as
// shard_bounds() splits a batch by dist.batch_shares).
// Returns the piece sizes (sum n). Precondition: what validate_sharding
// checks (unit divides n; even: parts divides n / unit; ratios: one per
// part, positive, and no piece empty).
std::vector<int64_t> split_sizes(int64_t n, int parts, const std::vector<int64_t>& ratios,
                                 int64_t unit);

// Throws ConfigError unless `spec` fits a tensor of `shape` on `mesh`:
// more dims than the tensor has; an axis the mesh lacks; an axis used twice;
// a unit that does not divide the dimension; an even split whose axis does
// not divide the dimension's units; ratios whose count is not the axis size,
// that are not positive, or that leave a rank an empty piece. Messages name
// `tensor`, the dimension and its size, the axis and what was expected.
void validate_sharding(const std::string& tensor, const Shape& shape, const ShardingSpec& spec,
                       const Mesh& mesh);

// The box of the global tensor that `rank` holds (the whole tensor for a
// replicated spec). Call validate_sharding() first.
Box local_box(const Shape& shape, const ShardingSpec& spec, const Mesh& mesh, int rank);
Shape local_shape(const Shape& shape, const ShardingSpec& spec, const Mesh& mesh, int rank);

}  // namespace mt
