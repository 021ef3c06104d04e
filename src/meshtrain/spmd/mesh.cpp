#include "meshtrain/spmd/mesh.h"

#include <fmt/format.h>

#include "meshtrain/base/error.h"

namespace mt {

Mesh::Mesh(std::vector<MeshAxis> axes) : axes_(std::move(axes)) {
  for (size_t i = 0; i < axes_.size(); ++i) {
    const MeshAxis& a = axes_[i];
    if (a.name.empty()) throw ConfigError(fmt::format("mesh: axis {} has an empty name", i));
    if (a.size < 1) {
      throw ConfigError(
          fmt::format("mesh: axis {} has size {} (expected a size of at least 1)", a.name, a.size));
    }
    for (size_t j = 0; j < i; ++j) {
      if (axes_[j].name == a.name)
        throw ConfigError(fmt::format("mesh: axis {} is named twice", a.name));
    }
  }
}

int Mesh::size() const {
  int n = 1;
  for (const MeshAxis& a : axes_) n *= a.size;
  return n;
}

int Mesh::axis_index(std::string_view name) const {
  for (size_t i = 0; i < axes_.size(); ++i) {
    if (axes_[i].name == name) return static_cast<int>(i);
  }
  return -1;
}

int Mesh::axis_size(std::string_view name) const {
  const int i = axis_index(name);
  return i < 0 ? 1 : axes_[static_cast<size_t>(i)].size;
}

std::vector<int> Mesh::coords(int rank) const {
  MT_CHECK(rank >= 0 && rank < size(), "rank {} outside mesh {}", rank, describe());
  std::vector<int> c(axes_.size());
  for (size_t i = axes_.size(); i-- > 0;) {
    c[i] = rank % axes_[i].size;
    rank /= axes_[i].size;
  }
  return c;
}

int Mesh::coord(int rank, std::string_view axis) const {
  const int i = axis_index(axis);
  return i < 0 ? 0 : coords(rank)[static_cast<size_t>(i)];
}

int Mesh::rank_of(const std::vector<int>& c) const {
  MT_CHECK_EQ(c.size(), axes_.size());
  int r = 0;
  for (size_t i = 0; i < axes_.size(); ++i) {
    MT_CHECK(c[i] >= 0 && c[i] < axes_[i].size, "coordinate {} outside axis {} of size {}", c[i],
             axes_[i].name, axes_[i].size);
    r = r * axes_[i].size + c[i];
  }
  return r;
}

std::vector<int> Mesh::group(int rank, std::string_view axis) const {
  const int i = axis_index(axis);
  if (i < 0) return {rank};
  std::vector<int> c = coords(rank);
  std::vector<int> g;
  for (int k = 0; k < axes_[static_cast<size_t>(i)].size; ++k) {
    c[static_cast<size_t>(i)] = k;
    g.push_back(rank_of(c));
  }
  return g;
}

std::vector<std::vector<int>> Mesh::groups(std::string_view axis) const {
  std::vector<std::vector<int>> out;
  for (int r = 0; r < size(); ++r) {
    if (coord(r, axis) == 0) out.push_back(group(r, axis));
  }
  return out;
}

int Mesh::group_index(int rank, std::string_view axis) const {
  // Groups are ordered by their lowest rank, the one at coordinate 0.
  std::vector<int> c = coords(rank);
  const int a = axis_index(axis);
  if (a >= 0) c[static_cast<size_t>(a)] = 0;
  const int first = rank_of(c);
  int index = 0;
  for (int r = 0; r < first; ++r) index += coord(r, axis) == 0 ? 1 : 0;
  return index;
}

void Mesh::check_world(int world, std::string_view where) const {
  if (size() == world) return;
  throw ConfigError(fmt::format(
      "{}: mesh {} has {} device{} but the job has {} rank{} (the mesh must cover the job's "
      "ranks exactly{})",
      where, describe(), size(), size() == 1 ? "" : "s", world, world == 1 ? "" : "s",
      size() > world ? fmt::format("; start {} ranks, e.g. --nproc {}", size(), size()) : ""));
}

std::string Mesh::describe() const {
  if (axes_.empty()) return "(no axes: 1 device)";
  std::string s;
  for (const MeshAxis& a : axes_) {
    if (!s.empty()) s += " x ";
    s += fmt::format("{}={}", a.name, a.size);
  }
  return s;
}

bool Mesh::operator==(const Mesh& o) const {
  if (axes_.size() != o.axes_.size()) return false;
  for (size_t i = 0; i < axes_.size(); ++i) {
    if (axes_[i].name != o.axes_[i].name || axes_[i].size != o.axes_[i].size) return false;
  }
  return true;
}

}  // namespace mt
