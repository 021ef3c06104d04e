#include "meshtrain/spmd/collective_runner.h"

#include <cstring>
#include <numeric>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "meshtrain/base/error.h"

namespace mt {

namespace {

// A gather / scatter along `dim` of a tensor of `dims` (the full shape):
// `outer` rows of `inner`-element items; piece q spans sizes[q] items.
struct Pieces {
  int64_t outer = 1, inner = 1, total = 0;
  std::vector<int64_t> sizes;
  std::vector<size_t> counts;  // elements of each rank's block, rank-major
  bool contiguous() const { return outer == 1; }
};

Pieces pieces_of(const Shape& full, const CollectiveAttrs& a) {
  Pieces p;
  const auto d = static_cast<size_t>(a.dim);
  for (size_t i = 0; i < d; ++i) p.outer *= full.dims()[i];
  for (size_t i = d + 1; i < full.dims().size(); ++i) p.inner *= full.dims()[i];
  p.sizes = a.sizes;
  for (int64_t s : a.sizes) {
    p.total += s;
    p.counts.push_back(static_cast<size_t>(p.outer * s * p.inner));
  }
  return p;
}

// Copies between the full tensor's layout [outer, total, inner] and the
// rank-major blocks [q][outer, sizes[q], inner]: to_blocks from `full` into
// `blocks`, else back.
void shuffle(const Pieces& p, size_t elem, const char* src, char* dst, bool to_blocks) {
  size_t block = 0;
  int64_t before = 0;
  for (size_t q = 0; q < p.sizes.size(); ++q) {
    const size_t row = static_cast<size_t>(p.sizes[q] * p.inner) * elem;
    for (int64_t o = 0; o < p.outer && row > 0; ++o) {
      const size_t f = static_cast<size_t>((o * p.total + before) * p.inner) * elem;
      const size_t b = block + static_cast<size_t>(o) * row;
      if (to_blocks) {
        std::memcpy(dst + b, src + f, row);
      } else {
        std::memcpy(dst + f, src + b, row);
      }
    }
    block += p.counts[q] * elem;
    before += p.sizes[q];
  }
}

}  // namespace

struct CommCollectiveRunner::Pending {
  CommHandle handle;
  std::string node;
  // Inner-dimension all_gather: unpack staging into out after the call.
  bool unpack = false;
  Pieces pieces;
  Tensor staging, out;
  Tensor send_staging;  // all_to_all along an inner dim: x's pieces rank-major
};

std::unique_ptr<Communicator> axis_communicator(Communicator& world, const Mesh& mesh,
                                                std::string_view axis, const std::string& name,
                                                const CollectiveOptions& opts) {
  const int r = world.rank();
  return world.split(mesh.group_index(r, axis), mesh.coord(r, axis), name, opts);
}

CommCollectiveRunner::CommCollectiveRunner(Communicator& world,
                                           std::vector<std::vector<int>> groups,
                                           CollectiveOptions opts)
    : world_(world), groups_(std::move(groups)), opts_(opts) {
  for (size_t i = 0; i < groups_.size(); ++i) {
    const std::vector<int>& ranks = groups_[i];
    if (ranks.empty()) throw ConfigError(fmt::format("collective group {} has no ranks", i));
    std::vector<bool> seen(static_cast<size_t>(world.size()), false);
    for (int r : ranks) {
      if (r < 0 || r >= world.size() || seen[static_cast<size_t>(r)]) {
        throw ConfigError(fmt::format(
            "collective group {} [{}]: rank {} is {} (communicator '{}' has {} ranks)", i,
            fmt::join(ranks, ", "), r, r < 0 || r >= world.size() ? "out of range" : "listed twice",
            world.name(), world.size()));
      }
      seen[static_cast<size_t>(r)] = true;
    }
  }
  for (size_t i = 0; i < groups_.size(); ++i) {
    comms_.push_back(world.subgroup(groups_[i], fmt::format("{}.group{}", world.name(), i), opts_));
  }
}

CommCollectiveRunner::~CommCollectiveRunner() {
  for (auto& [id, p] : pending_) {
    try {
      p->handle.wait();
    } catch (...) {  // nothing to report to from a destructor
    }
  }
}

const std::vector<int>& CommCollectiveRunner::ranks_of(int64_t group) const {
  return groups_.at(static_cast<size_t>(group));
}

Communicator* CommCollectiveRunner::comm_of(int64_t group) const {
  if (group < 0 || group >= num_groups()) return nullptr;
  return comms_[static_cast<size_t>(group)].get();
}

Communicator& CommCollectiveRunner::member_comm(const std::string& node, OpKind op,
                                                int64_t group) const {
  if (group < 0 || group >= num_groups()) {
    throw ConfigError(
        fmt::format("collective node '{}' ({}): group {} is not one of the {} groups "
                    "of the runner over '{}'",
                    node, op_name(op), group, num_groups(), world_.name()));
  }
  Communicator* c = comms_[static_cast<size_t>(group)].get();
  if (c == nullptr) {
    throw ConfigError(fmt::format(
        "collective node '{}' ({}): rank {} of '{}' is not in group {} (ranks [{}])", node,
        op_name(op), world_.rank(), world_.name(), group, fmt::join(ranks_of(group), ", ")));
  }
  return *c;
}

CollectiveHandle CommCollectiveRunner::start(const CollectiveCall& call) {
  Communicator& comm = member_comm(call.node, call.op, call.attrs.group);
  MT_CHECK(call.in.size() == 1 && call.out.size() == 1, "collective '{}': {} inputs, {} outputs",
           call.node, call.in.size(), call.out.size());
  const Tensor& in = call.in[0];
  Tensor out = call.out[0];  // a handle on the executor's buffer
  auto p = std::make_unique<Pending>();
  p->node = call.node;
  switch (call.op) {
    case OpKind::all_reduce:
    case OpKind::reduce_from_group:
      p->handle = comm.all_reduce_async(in.raw(), out.raw(), static_cast<size_t>(in.numel()),
                                        in.dtype(), ReduceOp::sum, opts_);
      break;
    case OpKind::all_reduce_max:
      p->handle = comm.all_reduce_async(in.raw(), out.raw(), static_cast<size_t>(in.numel()),
                                        in.dtype(), ReduceOp::max, opts_);
      break;
    case OpKind::all_gather:
    case OpKind::gather_from_group:
    case OpKind::reduce_scatter:
    case OpKind::all_to_all: {
      const CollectiveAttrs& a = call.attrs;
      if (a.group_size() != comm.size() || a.rank != comm.rank()) {
        throw ConfigError(fmt::format(
            "collective node '{}' ({}): its pieces are for rank {} of a group of {} (sizes [{}]), "
            "but this rank is rank {} of {} in group {} (ranks [{}])",
            call.node, op_name(call.op), a.rank, a.group_size(), fmt::join(a.sizes, ", "),
            comm.rank(), comm.size(), a.group, fmt::join(ranks_of(a.group), ", ")));
      }
      const bool gather = call.op == OpKind::all_gather || call.op == OpKind::gather_from_group;
      const size_t elem = dtype_size(in.dtype());
      if (call.op == OpKind::all_to_all && !a.recv_sizes.empty()) {
        // Uneven pieces (all_to_allv): pack x's pieces rank-major when they
        // are not contiguous, receive rank-major, unpack after the call.
        const Pieces send = pieces_of(in.shape(), a);
        const void* src = in.raw();
        if (!send.contiguous()) {
          p->send_staging = Tensor::empty(in.shape(), in.dtype());
          shuffle(send, elem, static_cast<const char*>(in.raw()),
                  static_cast<char*>(p->send_staging.raw()), true);
          src = p->send_staging.raw();
        }
        CollectiveAttrs received = a;
        received.sizes = a.recv_sizes;
        p->pieces = pieces_of(out.shape(), received);
        void* dst = out.raw();
        if (!p->pieces.contiguous()) {
          p->staging = Tensor::empty(out.shape(), out.dtype());
          p->out = out;
          p->unpack = true;
          dst = p->staging.raw();
        }
        p->handle =
            comm.all_to_allv_async(src, send.counts, dst, p->pieces.counts, in.dtype(), opts_);
        break;
      }
      if (call.op == OpKind::all_to_all) {
        // Pack x's pieces along dim rank-major, exchange equal blocks, and
        // join the received blocks along concat_dim.
        const Pieces send = pieces_of(in.shape(), a);
        const void* src = in.raw();
        if (!send.contiguous()) {
          p->send_staging = Tensor::empty(in.shape(), in.dtype());
          shuffle(send, elem, static_cast<const char*>(in.raw()),
                  static_cast<char*>(p->send_staging.raw()), true);
          src = p->send_staging.raw();
        }
        CollectiveAttrs joined = a;
        joined.dim = a.concat_dim;
        const int64_t n = a.group_size();
        joined.sizes.assign(static_cast<size_t>(n),
                            out.shape().dims()[static_cast<size_t>(a.concat_dim)] / n);
        p->pieces = pieces_of(out.shape(), joined);
        void* dst = out.raw();
        if (!p->pieces.contiguous()) {
          p->staging = Tensor::empty(out.shape(), out.dtype());
          p->out = out;
          p->unpack = true;
          dst = p->staging.raw();
        }
        p->handle = comm.all_to_all_async(src, dst, send.counts.empty() ? 0 : send.counts[0],
                                          in.dtype(), opts_);
        break;
      }
      p->pieces = pieces_of(gather ? out.shape() : in.shape(), a);
      if (gather) {
        void* dst = out.raw();
        if (!p->pieces.contiguous()) {
          p->staging = Tensor::empty(out.shape(), out.dtype());
          p->out = out;
          p->unpack = true;
          dst = p->staging.raw();
        }
        p->handle = comm.all_gatherv_async(in.raw(), dst, p->pieces.counts, in.dtype(), opts_);
      } else {
        const void* src = in.raw();
        if (!p->pieces.contiguous()) {
          p->staging = Tensor::empty(in.shape(), in.dtype());
          shuffle(p->pieces, elem, static_cast<const char*>(in.raw()),
                  static_cast<char*>(p->staging.raw()), true);
          src = p->staging.raw();
        }
        p->handle = comm.reduce_scatterv_async(src, out.raw(), p->pieces.counts, in.dtype(),
                                               ReduceOp::sum, opts_);
      }
      break;
    }
    default:
      throw InternalError(
          fmt::format("collective node '{}': {} is not a collective", call.node, op_name(call.op)));
  }
  const uint64_t id = next_++;
  pending_.emplace(id, std::move(p));
  return CollectiveHandle{id};
}

void CommCollectiveRunner::wait(CollectiveHandle h) {
  auto it = pending_.find(h.id);
  MT_CHECK(it != pending_.end(), "collective runner: handle {} is not in flight", h.id);
  std::unique_ptr<Pending> p = std::move(it->second);
  pending_.erase(it);
  p->handle.wait();
  if (p->unpack) {
    shuffle(p->pieces, dtype_size(p->out.dtype()), static_cast<const char*>(p->staging.raw()),
            static_cast<char*>(p->out.raw()), false);
  }
}

CollectiveCost CommCollectiveRunner::cost_of(const Graph& g, const Node& n) const {
  const CollectiveAttrs a = CollectiveAttrs::of(n);
  Communicator& comm = member_comm(n.name, n.op, a.group);
  const Value& x = g.value(n.inputs[0]);
  const size_t elem = dtype_size(x.dtype);
  auto algorithm = [&](Collective c, size_t bytes) {
    return opts_.algorithm != CommAlgorithm::automatic ? opts_.algorithm
                                                       : comm.choose_algorithm(c, bytes);
  };
  switch (n.op) {
    case OpKind::all_reduce:
    case OpKind::all_reduce_max:
    case OpKind::reduce_from_group: {
      const auto count = static_cast<size_t>(x.shape.numel());
      return comm.cost(Collective::all_reduce, algorithm(Collective::all_reduce, count * elem),
                       count, x.dtype);
    }
    case OpKind::all_gather:
    case OpKind::gather_from_group:
    case OpKind::reduce_scatter: {
      const bool gather = n.op == OpKind::all_gather || n.op == OpKind::gather_from_group;
      const Pieces p = pieces_of(gather ? g.value(n.outputs[0]).shape : x.shape, a);
      const size_t total = std::accumulate(p.counts.begin(), p.counts.end(), size_t{0});
      const Collective c = gather ? Collective::all_gatherv : Collective::reduce_scatterv;
      return comm.cost(c, algorithm(c, total * elem), total, x.dtype, p.counts);
    }
    case OpKind::all_to_all: {
      const Pieces p = pieces_of(x.shape, a);
      if (!a.recv_sizes.empty()) {
        // Pairwise exchange, as comm's all_to_allv: every other rank's
        // piece, one step per peer (no cost model call: comm has none for
        // the v-variant's two count lists).
        CollectiveAttrs received = a;
        received.sizes = a.recv_sizes;
        const Pieces r = pieces_of(g.value(n.outputs[0]).shape, received);
        const auto me = static_cast<size_t>(a.rank);
        const size_t sent =
            std::accumulate(p.counts.begin(), p.counts.end(), size_t{0}) - p.counts[me];
        const size_t got =
            std::accumulate(r.counts.begin(), r.counts.end(), size_t{0}) - r.counts[me];
        return {comm.size() - 1, sent * elem, got * elem};
      }
      const size_t per_rank = p.counts.empty() ? 0 : p.counts[0];
      return comm.cost(Collective::all_to_all,
                       algorithm(Collective::all_to_all, per_rank * p.counts.size() * elem),
                       per_rank, x.dtype);
    }
    default:
      return {};
  }
}

}  // namespace mt
