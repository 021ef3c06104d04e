// A device mesh: the ranks of a job arranged as an N-d grid with named axes
// ({"pp": 2, "dp": 2, "tp": 2}), the coordinate system that sharding specs
// and pipeline stages refer to.
//
// Ranks are numbered row-major over the axes in the order given, the last
// axis fastest (so with {"dp": 2, "tp": 2} ranks 0 and 1 share dp = 0 and
// form one tp group, as Megatron keeps tensor-parallel peers adjacent). A
// value type: pure functions of the axes, no communication, no blocking.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace mt {

struct MeshAxis {
  std::string name;
  int size = 1;
};

class Mesh {
 public:
  // One device, no axes.
  Mesh() = default;
  // Throws ConfigError for an empty or duplicate axis name or a size < 1,
  // naming the axis.
  explicit Mesh(std::vector<MeshAxis> axes);

  const std::vector<MeshAxis>& axes() const { return axes_; }
  // Product of the axis sizes (1 for no axes).
  int size() const;
  // Index of the axis in axes(), or -1.
  int axis_index(std::string_view name) const;
  bool has_axis(std::string_view name) const { return axis_index(name) >= 0; }
  // The axis's size; an axis the mesh does not have counts as size 1.
  int axis_size(std::string_view name) const;

  // Coordinates of `rank`, one per axis; rank must be in [0, size()).
  std::vector<int> coords(int rank) const;
  // The coordinate of `rank` on `axis` (0 for an axis the mesh lacks).
  int coord(int rank, std::string_view axis) const;
  int rank_of(const std::vector<int>& coords) const;
  // The ranks that share every coordinate of `rank` except the one on `axis`,
  // ordered by their coordinate on `axis` (so group(r, a)[coord(r, a)] == r).
  // An axis the mesh lacks gives {rank}.
  std::vector<int> group(int rank, std::string_view axis) const;
  // Every group of `axis`, in order of their lowest rank.
  std::vector<std::vector<int>> groups(std::string_view axis) const;
  // The position of group(rank, axis) in groups(axis).
  int group_index(int rank, std::string_view axis) const;

  // Throws ConfigError unless size() == world, naming the mesh and the world.
  void check_world(int world, std::string_view where) const;

  // "dp=2 x tp=2" ("1 device" for no axes).
  std::string describe() const;

  bool operator==(const Mesh& o) const;

 private:
  std::vector<MeshAxis> axes_;
};

}  // namespace mt
