#include "meshtrain/spmd/reshard.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <set>

#include "meshtrain/base/error.h"

namespace mt {

namespace {

bool empty_box(const Box& b) {
  for (size_t d = 0; d < b.begin.size(); ++d) {
    if (b.end[d] <= b.begin[d]) return true;
  }
  return false;
}

// `rest` minus `b`, every piece kept disjoint.
std::vector<Box> subtract_all(const std::vector<Box>& rest, const Box& b) {
  std::vector<Box> out;
  for (const Box& r : rest) {
    for (Box& p : subtract_box(r, b)) out.push_back(std::move(p));
  }
  return out;
}

// The box `inner` (inside `outer`) of the row-major piece `whole` of box
// `outer`: copy between a piece of `outer` and a piece of `inner`.
void copy_sub(const Tensor& piece, const Box& outer, const Box& inner, Tensor& out) {
  Box rel = inner;
  for (size_t d = 0; d < rel.begin.size(); ++d) {
    rel.begin[d] -= outer.begin[d];
    rel.end[d] -= outer.begin[d];
  }
  copy_box_out(piece.reshape(outer.shape()), rel, out);
}

void put_sub(Tensor& piece, const Box& outer, const Box& inner, const Tensor& in) {
  Box rel = inner;
  for (size_t d = 0; d < rel.begin.size(); ++d) {
    rel.begin[d] -= outer.begin[d];
    rel.end[d] -= outer.begin[d];
  }
  Tensor shaped = piece.reshape(outer.shape());
  copy_box_in(shaped, rel, in);
}

void add_into(Tensor& acc, const Tensor& x) {
  switch (acc.dtype()) {
    case DType::f32: {
      float* a = acc.data<float>();
      const float* b = x.data<float>();
      for (int64_t i = 0, n = acc.numel(); i < n; ++i) a[i] += b[i];
      return;
    }
    case DType::f64: {
      double* a = acc.data<double>();
      const double* b = x.data<double>();
      for (int64_t i = 0, n = acc.numel(); i < n; ++i) a[i] += b[i];
      return;
    }
    default:
      throw ConfigError(fmt::format("reshard: partial sums of {} are not supported (f32, f64)",
                                    dtype_name(acc.dtype())));
  }
}

template <class T>
std::vector<T> rotated(const std::vector<T>& v, size_t by) {
  std::vector<T> out;
  for (size_t i = 0; i < v.size(); ++i) out.push_back(v[(i + by) % v.size()]);
  return out;
}

// Distinct boxes of a layout with the ranks that hold each, in first-listed order.
std::vector<std::pair<Box, std::vector<int>>> distinct_boxes(const TensorLayout& l) {
  std::vector<std::pair<Box, std::vector<int>>> out;
  for (size_t i = 0; i < l.ranks.size(); ++i) {
    auto it = std::ranges::find_if(out, [&](const auto& p) { return p.first == l.boxes[i]; });
    if (it == out.end()) {
      out.emplace_back(l.boxes[i], std::vector<int>{l.ranks[i]});
    } else {
      it->second.push_back(l.ranks[i]);
    }
  }
  return out;
}

void check_layout(const Shape& shape, const TensorLayout& l, const char* which) {
  if (l.ranks.size() != l.boxes.size()) {
    throw ConfigError(fmt::format("reshard: the {} layout lists {} ranks but {} boxes", which,
                                  l.ranks.size(), l.boxes.size()));
  }
  if (l.ranks.empty()) throw ConfigError(fmt::format("reshard: the {} layout has no ranks", which));
  std::set<int> seen;
  for (size_t i = 0; i < l.ranks.size(); ++i) {
    const Box& b = l.boxes[i];
    if (!seen.insert(l.ranks[i]).second || l.ranks[i] < 0) {
      throw ConfigError(fmt::format("reshard: the {} layout lists rank {} twice (or negative)",
                                    which, l.ranks[i]));
    }
    bool fits = b.begin.size() == shape.dims().size() && b.end.size() == b.begin.size();
    for (size_t d = 0; fits && d < b.begin.size(); ++d) {
      fits = 0 <= b.begin[d] && b.begin[d] <= b.end[d] && b.end[d] <= shape[static_cast<int>(d)];
    }
    if (!fits) {
      throw ConfigError(fmt::format("reshard: the {} layout's box {} of rank {} does not fit {}",
                                    which, b.str(), l.ranks[i], shape.str()));
    }
  }
}

}  // namespace

Box intersect_boxes(const Box& a, const Box& b) {
  Box out = a;
  for (size_t d = 0; d < a.begin.size(); ++d) {
    out.begin[d] = std::max(a.begin[d], b.begin[d]);
    out.end[d] = std::max(out.begin[d], std::min(a.end[d], b.end[d]));
  }
  return out;
}

std::vector<Box> subtract_box(const Box& a, const Box& b) {
  const Box i = intersect_boxes(a, b);
  if (empty_box(i)) return empty_box(a) ? std::vector<Box>{} : std::vector<Box>{a};
  // Peel off the slabs of `a` outside `i`, one dimension at a time.
  std::vector<Box> out;
  Box rest = a;
  for (size_t d = 0; d < a.begin.size(); ++d) {
    if (rest.begin[d] < i.begin[d]) {
      Box s = rest;
      s.end[d] = i.begin[d];
      out.push_back(s);
      rest.begin[d] = i.begin[d];
    }
    if (i.end[d] < rest.end[d]) {
      Box s = rest;
      s.begin[d] = i.end[d];
      out.push_back(s);
      rest.end[d] = i.end[d];
    }
  }
  return out;
}

std::vector<Box> split_box(const Box& b, int parts) {
  if (empty_box(b) || parts <= 1 || b.begin.empty()) return {b};
  size_t dim = 0;
  for (size_t d = 1; d < b.begin.size(); ++d) {
    if (b.end[d] - b.begin[d] > b.end[dim] - b.begin[dim]) dim = d;
  }
  const int64_t n = b.end[dim] - b.begin[dim];
  const int64_t k = std::min<int64_t>(parts, n);
  std::vector<Box> out;
  for (int64_t i = 0; i < k; ++i) {
    Box p = b;
    p.begin[dim] = b.begin[dim] + n * i / k;
    p.end[dim] = b.begin[dim] + n * (i + 1) / k;
    out.push_back(p);
  }
  return out;
}

TensorLayout TensorLayout::replicated(const Shape& shape, std::vector<int> ranks) {
  TensorLayout l;
  l.boxes.assign(ranks.size(), Box::whole(shape));
  l.ranks = std::move(ranks);
  return l;
}

TensorLayout TensorLayout::partial_sum(const Shape& shape, std::vector<int> ranks) {
  TensorLayout l = replicated(shape, std::move(ranks));
  l.partial = true;
  return l;
}

TensorLayout TensorLayout::split(const Shape& shape, std::vector<int> ranks, int dim,
                                 std::vector<int64_t> ratios) {
  if (dim < 0 || dim >= shape.rank()) {
    throw ConfigError(
        fmt::format("reshard: split along dimension {} of a tensor of shape {}", dim, shape.str()));
  }
  const Mesh mesh({MeshAxis{"split", static_cast<int>(ranks.size())}});
  ShardingSpec spec;
  spec.dims.resize(static_cast<size_t>(dim) + 1);
  spec.dims[static_cast<size_t>(dim)] = DimSharding::over("split", std::move(ratios));
  validate_sharding("reshard layout", shape, spec, mesh);
  return of(shape, spec, mesh, std::move(ranks));
}

TensorLayout TensorLayout::of(const Shape& shape, const ShardingSpec& spec, const Mesh& mesh,
                              std::vector<int> ranks) {
  if (ranks.empty()) {
    for (int m = 0; m < mesh.size(); ++m) ranks.push_back(m);
  }
  if (static_cast<int>(ranks.size()) != mesh.size()) {
    throw ConfigError(fmt::format("reshard: {} ranks for the mesh {} of {}", ranks.size(),
                                  mesh.describe(), mesh.size()));
  }
  TensorLayout l;
  l.partial = !spec.partial.empty();
  for (int m = 0; m < mesh.size(); ++m) {
    if (l.partial) {
      // Replicas along axes that neither split nor sum hold the same addend.
      bool first = true;
      for (const MeshAxis& a : mesh.axes()) {
        bool used = std::ranges::find(spec.partial, a.name) != spec.partial.end();
        for (const DimSharding& d : spec.dims) used |= d.axis == a.name;
        if (!used && mesh.coord(m, a.name) != 0) first = false;
      }
      if (!first) continue;
    }
    l.ranks.push_back(ranks[static_cast<size_t>(m)]);
    l.boxes.push_back(local_box(shape, spec, mesh, m));
  }
  return l;
}

const Box* TensorLayout::box_of(int rank) const {
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] == rank) return &boxes[i];
  }
  return nullptr;
}

std::string TensorLayout::describe() const {
  std::string s = partial ? "partial {" : "{";
  for (size_t i = 0; i < ranks.size(); ++i) {
    s += fmt::format("{}{}: {}", i > 0 ? ", " : "", ranks[i], boxes[i].str());
  }
  return s + "}";
}

uint64_t ReshardPlan::bytes_sent(int rank) const {
  uint64_t n = 0;
  const uint64_t es = dtype_size(dtype);
  for (const ReshardRoute& r : routes) {
    const uint64_t bytes = static_cast<uint64_t>(r.box.elements()) * es;
    for (size_t i = 0; i + 1 < r.reducers.size(); ++i) n += r.reducers[i] == rank ? bytes : 0;
    if (r.targets.empty()) continue;
    n += r.reducers.back() == rank ? bytes : 0;
    for (size_t i = 0; i + 1 < r.targets.size(); ++i) n += r.targets[i] == rank ? bytes : 0;
  }
  return n;
}

uint64_t ReshardPlan::total_bytes() const {
  uint64_t n = 0;
  for (const ReshardRoute& r : routes) {
    const size_t hops = r.reducers.size() - 1 + r.targets.size();
    n += static_cast<uint64_t>(r.box.elements()) * dtype_size(dtype) * hops;
  }
  return n;
}

std::string ReshardPlan::describe() const {
  std::string s;
  for (const ReshardRoute& r : routes) {
    s += "box " + r.box.str() + ": ";
    for (size_t i = 0; i < r.reducers.size(); ++i) {
      s += (i > 0 ? " + " : "") + std::to_string(r.reducers[i]);
    }
    if (r.last_keeps) s += " (kept)";
    for (int t : r.targets) s += " -> " + std::to_string(t);
    s += "\n";
  }
  return s;
}

ReshardPlan plan_reshard(const Shape& shape, DType dtype, const TensorLayout& from,
                         const TensorLayout& to) {
  check_layout(shape, from, "source");
  check_layout(shape, to, "destination");
  if (to.partial) {
    throw ConfigError(
        "reshard: a partial destination layout is not supported (the destination "
        "holds values, not addends)");
  }
  ReshardPlan plan;
  plan.shape = shape;
  plan.dtype = dtype;
  plan.from = from;
  plan.to = to;
  const auto sources = distinct_boxes(from);
  if (from.partial) {
    for (size_t i = 0; i < sources.size(); ++i) {
      for (size_t j = i + 1; j < sources.size(); ++j) {
        if (!empty_box(intersect_boxes(sources[i].first, sources[j].first))) {
          throw ConfigError(fmt::format(
              "reshard: the partial source's boxes {} (rank {}) and {} (rank {}) overlap; a "
              "partial layout's distinct boxes must be disjoint",
              sources[i].first.str(), sources[i].second[0], sources[j].first.str(),
              sources[j].second[0]));
        }
      }
    }
  }
  size_t turn = 0;  // rotates which replica sends / which target is entered first
  for (const auto& [dbox, group] : distinct_boxes(to)) {
    std::vector<Box> rest;
    if (!empty_box(dbox)) rest.push_back(dbox);
    // Boxes a member of the group holds itself come first (local copies).
    std::vector<size_t> order;
    for (size_t s = 0; s < sources.size(); ++s) order.push_back(s);
    std::stable_partition(order.begin(), order.end(), [&](size_t s) {
      return std::ranges::any_of(sources[s].second,
                                 [&](int r) { return std::ranges::find(group, r) != group.end(); });
    });
    for (size_t s : order) {
      const auto& [sbox, holders] = sources[s];
      std::vector<Box> pieces;
      for (const Box& r : rest) {
        const Box i = intersect_boxes(r, sbox);
        if (!empty_box(i)) pieces.push_back(i);
      }
      rest = subtract_all(rest, sbox);
      std::vector<int> in_group, lacking;  // holders that are destinations; members without
      for (int m : group) {
        (std::ranges::find(holders, m) != holders.end() ? in_group : lacking).push_back(m);
      }
      for (const Box& piece : pieces) {
        if (!from.partial) {
          for (int m : in_group) plan.routes.push_back({piece, {m}, true, {}});
          if (lacking.empty()) continue;
          const std::vector<Box> parts = split_box(piece, static_cast<int>(holders.size()));
          for (size_t k = 0; k < parts.size(); ++k, ++turn) {
            plan.routes.push_back({parts[k],
                                   {holders[turn % holders.size()]},
                                   false,
                                   rotated(lacking, turn % lacking.size())});
          }
          continue;
        }
        // Partial: each part reduced along the holders, starting at another
        // one each time; the chain ends at a holder that is a destination
        // when there is one, which keeps the value.
        const std::vector<Box> parts = split_box(piece, static_cast<int>(holders.size()));
        for (size_t k = 0; k < parts.size(); ++k, ++turn) {
          std::vector<int> chain = rotated(holders, turn % holders.size());
          int keeper = -1;
          for (int h : chain) {
            if (std::ranges::find(group, h) != group.end()) {
              keeper = h;
              break;
            }
          }
          if (keeper >= 0) {
            std::erase(chain, keeper);
            chain.push_back(keeper);
          }
          std::vector<int> targets;
          for (int m : group) {
            if (m != keeper) targets.push_back(m);
          }
          if (!targets.empty()) targets = rotated(targets, turn % targets.size());
          plan.routes.push_back({parts[k], std::move(chain), keeper >= 0, std::move(targets)});
        }
      }
    }
    if (!rest.empty()) {
      throw ConfigError(fmt::format(
          "reshard: elements {} of the destination box {} (rank {}) are in no source box of {}",
          rest[0].str(), dbox.str(), group[0], from.describe()));
    }
  }
  return plan;
}

BoundaryReshard plan_boundary(const Shape& shape, DType dtype, const TensorLayout& producer,
                              const TensorLayout& consumer) {
  TensorLayout grad_to = producer;
  grad_to.partial = false;
  return {plan_reshard(shape, dtype, producer, consumer),
          plan_reshard(shape, dtype, consumer, grad_to)};
}

void copy_box_part(const Tensor& piece, const Box& outer, const Box& inner, Tensor& out) {
  copy_sub(piece, outer, inner, out);
}
void put_box_part(Tensor& piece, const Box& outer, const Box& inner, const Tensor& in) {
  put_sub(piece, outer, inner, in);
}
void add_addend(Tensor& acc, const Tensor& x) {
  add_into(acc, x);
}

void execute_reshard(Communicator& comm, const ReshardPlan& plan, const Tensor& source,
                     Tensor& dest, const CollectiveOptions& options) {
  const int me = comm.rank();
  const Box* sbox = plan.from.box_of(me);
  const Box* dbox = plan.to.box_of(me);
  if (sbox == nullptr && dbox == nullptr) return;
  auto check_piece = [&](const Tensor& t, const Box& b, const char* what) {
    if (t.numel() != b.elements() || t.dtype() != plan.dtype) {
      throw ShapeError(fmt::format(
          "reshard on rank {}: the {} piece is {} {} elements, its box {} needs {} {}", me, what,
          dtype_name(t.dtype()), t.numel(), b.str(), dtype_name(plan.dtype), b.elements()));
    }
  };
  if (sbox != nullptr) check_piece(source, *sbox, "source");
  if (dbox != nullptr) check_piece(dest, *dbox, "destination");

  // Buffers stay alive until every queued call finished; what a target
  // receives is written into `dest` at the end.
  std::vector<Tensor> buffers;
  std::vector<CommHandle> handles;
  std::vector<std::pair<Box, Tensor>> arrivals;
  auto send = [&](const Tensor& t, int peer) {
    handles.push_back(
        comm.send_async(t.raw(), static_cast<size_t>(t.numel()), plan.dtype, peer, options));
  };
  auto recv = [&](Tensor& t, int peer) {
    handles.push_back(
        comm.recv_async(t.raw(), static_cast<size_t>(t.numel()), plan.dtype, peer, options));
    return handles.back();
  };
  for (const ReshardRoute& r : plan.routes) {
    const Shape bs = r.box.shape();
    const auto red = std::ranges::find(r.reducers, me);
    if (red != r.reducers.end()) {
      const size_t i = static_cast<size_t>(red - r.reducers.begin());
      const bool last = i + 1 == r.reducers.size();
      Tensor value = Tensor::empty(bs, plan.dtype);
      copy_sub(source, *sbox, r.box, value);
      if (i > 0) {
        Tensor in = Tensor::empty(bs, plan.dtype);
        recv(in, r.reducers[i - 1]).wait();  // the addends before this one
        add_into(value, in);
      }
      buffers.push_back(value);
      if (!last) {
        send(value, r.reducers[i + 1]);
      } else {
        if (r.last_keeps) arrivals.emplace_back(r.box, value);
        if (!r.targets.empty()) send(value, r.targets[0]);
      }
    }
    const auto tgt = std::ranges::find(r.targets, me);
    if (tgt != r.targets.end()) {
      const size_t j = static_cast<size_t>(tgt - r.targets.begin());
      Tensor in = Tensor::empty(bs, plan.dtype);
      recv(in, j == 0 ? r.reducers.back() : r.targets[j - 1]);
      buffers.push_back(in);
      // Queued after the receive: the progress thread runs calls in order.
      if (j + 1 < r.targets.size()) send(in, r.targets[j + 1]);
      arrivals.emplace_back(r.box, in);
    }
  }
  for (const CommHandle& h : handles) h.wait();
  for (const auto& [b, t] : arrivals) put_sub(dest, *dbox, b, t);
}

uint64_t SharedParamReshard::bytes_sent(int rank) const {
  uint64_t b = 0;
  for (const ReshardPlan& rp : to_first) b += rp.bytes_sent(rank);
  for (const ReshardPlan& rp : from_first) b += rp.bytes_sent(rank);
  return b;
}

}  // namespace mt
