#include "meshtrain/spmd/sharding.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <numeric>

#include "meshtrain/base/error.h"

namespace mt {

bool ShardingSpec::replicated() const {
  if (!partial.empty()) return false;
  for (const DimSharding& d : dims) {
    if (d.split()) return false;
  }
  return true;
}

DimSharding ShardingSpec::dim(size_t d) const {
  return d < dims.size() ? dims[d] : DimSharding{};
}

std::string ShardingSpec::describe() const {
  if (replicated()) return "replicated";
  std::vector<std::string> parts;
  for (const DimSharding& d : dims) {
    if (!d.split()) {
      parts.emplace_back("-");
      continue;
    }
    std::string s = d.axis;
    if (!d.ratios.empty()) s += fmt::format(" {}", fmt::join(d.ratios, ":"));
    if (d.unit != 1) s += fmt::format(" unit {}", d.unit);
    parts.push_back(s);
  }
  std::string out = parts.empty() ? "" : fmt::format("[{}]", fmt::join(parts, ", "));
  if (!partial.empty()) {
    out += fmt::format("{}partial({})", out.empty() ? "" : " ", fmt::join(partial, ", "));
  }
  return out;
}

std::vector<int64_t> split_sizes(int64_t n, int parts, const std::vector<int64_t>& ratios,
                                 int64_t unit) {
  MT_CHECK(parts >= 1 && unit >= 1 && n % unit == 0, "split {} into {} parts of unit {}", n, parts,
           unit);
  const int64_t units = n / unit;
  std::vector<int64_t> sizes(static_cast<size_t>(parts));
  if (ratios.empty()) {
    MT_CHECK(units % parts == 0, "{} units over {} parts", units, parts);
    for (auto& s : sizes) s = units / parts * unit;
    return sizes;
  }
  MT_CHECK_EQ(ratios.size(), static_cast<size_t>(parts));
  const int64_t total = std::accumulate(ratios.begin(), ratios.end(), int64_t{0});
  // Boundaries at the cumulative ratio, rounded down to a whole unit (as
  // data/loader.h's shard_bounds splits a batch by shares), so the pieces
  // sum to n exactly and the rounding never accumulates.
  int64_t cum = 0, prev = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    cum += ratios[i];
    const int64_t boundary = units * cum / total;
    sizes[i] = (boundary - prev) * unit;
    prev = boundary;
  }
  return sizes;
}

void validate_sharding(const std::string& tensor, const Shape& shape, const ShardingSpec& spec,
                       const Mesh& mesh) {
  const size_t rank = static_cast<size_t>(shape.rank());
  if (spec.dims.size() > rank) {
    throw ConfigError(fmt::format(
        "tensor {}: the sharding spec gives {} dimensions but the tensor has {} (shape {})", tensor,
        spec.dims.size(), rank, shape.str()));
  }
  auto known_axis = [&](const std::string& axis, const std::string& where) {
    if (mesh.has_axis(axis)) return;
    std::vector<std::string> names;
    for (const MeshAxis& a : mesh.axes()) names.push_back(a.name);
    throw ConfigError(
        fmt::format("tensor {}: {} names mesh axis '{}', which the mesh {} lacks "
                    "(axes: {})",
                    tensor, where, axis, mesh.describe(),
                    names.empty() ? "none" : fmt::format("{}", fmt::join(names, ", "))));
  };
  std::vector<std::string> used;
  for (size_t d = 0; d < spec.dims.size(); ++d) {
    const DimSharding& ds = spec.dims[d];
    const int64_t n = shape[static_cast<int>(d)];
    const std::string where = fmt::format("dimension {} (size {})", d, n);
    if (!ds.split()) {
      if (!ds.ratios.empty()) {
        throw ConfigError(fmt::format(
            "tensor {}: {} is replicated but has ratios [{}] (ratios need an axis to split over)",
            tensor, where, fmt::join(ds.ratios, ", ")));
      }
      continue;
    }
    known_axis(ds.axis, where);
    for (const std::string& u : used) {
      if (u == ds.axis) {
        throw ConfigError(fmt::format(
            "tensor {}: mesh axis {} splits two dimensions (each axis splits at most one)", tensor,
            ds.axis));
      }
    }
    used.push_back(ds.axis);
    const int parts = mesh.axis_size(ds.axis);
    if (ds.unit < 1 || n % ds.unit != 0) {
      throw ConfigError(fmt::format("tensor {}: {} is split in units of {}, which do not divide it",
                                    tensor, where, ds.unit));
    }
    const int64_t units = n / ds.unit;
    const std::string unit_text =
        ds.unit == 1 ? "" : fmt::format(" = {} units of {}", units, ds.unit);
    if (ds.ratios.empty()) {
      if (units % parts != 0) {
        throw ConfigError(fmt::format(
            "tensor {}: {}{} is split evenly over axis {} of size {}, which does not divide it "
            "(expected a multiple of {}, or ratios for an uneven split)",
            tensor, where, unit_text, ds.axis, parts, parts));
      }
      continue;
    }
    if (static_cast<int64_t>(ds.ratios.size()) != parts) {
      throw ConfigError(fmt::format(
          "tensor {}: {} is split over axis {} of size {} by {} ratios [{}] "
          "(expected {} ratios, one per rank of the axis)",
          tensor, where, ds.axis, parts, ds.ratios.size(), fmt::join(ds.ratios, ":"), parts));
    }
    for (int64_t r : ds.ratios) {
      if (r < 1) {
        throw ConfigError(fmt::format(
            "tensor {}: {} has ratio {} in [{}] over axis {} (expected positive integers)", tensor,
            where, r, fmt::join(ds.ratios, ":"), ds.axis));
      }
    }
    const std::vector<int64_t> sizes = split_sizes(n, parts, ds.ratios, ds.unit);
    for (size_t i = 0; i < sizes.size(); ++i) {
      if (sizes[i] == 0) {
        throw ConfigError(fmt::format(
            "tensor {}: {}{} split over axis {} by ratios [{}] leaves coordinate {} an empty "
            "piece (expected at least one unit each)",
            tensor, where, unit_text, ds.axis, fmt::join(ds.ratios, ":"), i));
      }
    }
  }
  for (const std::string& p : spec.partial) {
    known_axis(p, "partial");
    for (const std::string& u : used) {
      if (u == p) {
        throw ConfigError(fmt::format(
            "tensor {}: mesh axis {} both splits a dimension and holds partial sums", tensor, p));
      }
    }
  }
}

Box local_box(const Shape& shape, const ShardingSpec& spec, const Mesh& mesh, int rank) {
  Box b;
  for (int d = 0; d < shape.rank(); ++d) {
    const DimSharding ds = spec.dim(static_cast<size_t>(d));
    if (!ds.split()) {
      b.begin.push_back(0);
      b.end.push_back(shape[d]);
      continue;
    }
    const std::vector<int64_t> sizes =
        split_sizes(shape[d], mesh.axis_size(ds.axis), ds.ratios, ds.unit);
    const int c = mesh.coord(rank, ds.axis);
    int64_t begin = 0;
    for (int i = 0; i < c; ++i) begin += sizes[static_cast<size_t>(i)];
    b.begin.push_back(begin);
    b.end.push_back(begin + sizes[static_cast<size_t>(c)]);
  }
  return b;
}

Shape local_shape(const Shape& shape, const ShardingSpec& spec, const Mesh& mesh, int rank) {
  return local_box(shape, spec, mesh, rank).shape();
}

}  // namespace mt
