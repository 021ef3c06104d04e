// Which algorithm runs a call, running it, and what it costs.
#include <numeric>
#include <vector>

#include "meshtrain/base/error.h"
#include "meshtrain/comm/algorithms.h"
#include "meshtrain/comm/communicator_impl.h"
#include "meshtrain/comm/cost.h"
#include "meshtrain/comm/reduce.h"

namespace mt {

using comm::Call;
using comm::CallInfo;

namespace {

bool applies(Collective c, CommAlgorithm a) {
  using A = CommAlgorithm;
  switch (c) {
    case Collective::all_reduce:
    case Collective::reduce_scatter:
    case Collective::reduce_scatterv:
    case Collective::all_gather:
    case Collective::all_gatherv:
      return a == A::ring || a == A::halving_doubling || a == A::shared_memory || a == A::native ||
             a == A::hierarchical;
    case Collective::split:
      return a == A::ring || a == A::halving_doubling || a == A::shared_memory || a == A::native;
    case Collective::broadcast:
      return a == A::tree || a == A::shared_memory || a == A::native;
    case Collective::all_to_all:
    case Collective::all_to_allv:
      return a == A::pairwise || a == A::native;
    case Collective::barrier:
      return a == A::dissemination || a == A::shared_memory || a == A::native;
    case Collective::send:
    case Collective::recv:
      return true;
  }
  return false;
}

size_t max_count(const Call& call, int size) {
  size_t m = call.count;
  for (size_t c : call.counts) m = std::max(m, c);
  for (size_t c : call.counts2) m = std::max(m, c);
  if (call.kind == Collective::all_to_all) m = call.count * static_cast<size_t>(size);
  return m;
}

// The engine's collective for the call's kind (split gathers like all_gather).
Collective native_kind(Collective c) {
  return c == Collective::split ? Collective::all_gather : c;
}

}  // namespace

CommAlgorithm Communicator::Impl::resolve(const Call& call, const CallInfo& info) const {
  if (comm::is_p2p(call.kind)) return CommAlgorithm::pairwise;
  NativeCollectives* native = transport->native();
  const bool native_ok = native != nullptr && native->supports(native_kind(call.kind), call.dtype,
                                                               call.op, max_count(call, size));
  CommAlgorithm a = call.opts.algorithm;
  if (a == CommAlgorithm::automatic) {
    // The same pure function the planner calls (comm/cost.h).
    comm::GroupTopology t;
    t.size = size;
    t.shared_memory = shm != nullptr;
    t.native = native_ok;
    t.hierarchy = node_comm != nullptr;
    return comm::select_algorithm(options.policy, call.kind, info.bytes, t);
  }
  if (!applies(call.kind, a)) {
    throw ConfigError(fmt::format("{}: algorithm {} does not apply to {}", info.where(),
                                  algorithm_name(a), collective_name(call.kind)));
  }
  if (a == CommAlgorithm::shared_memory && !shm) {
    throw ConfigError(fmt::format(
        "{}: {} asks for the shared_memory algorithm, but the {} transport has no shared "
        "memory window (ranks on several nodes?)",
        info.where(), collective_name(call.kind), transport->backend()));
  }
  if (a == CommAlgorithm::hierarchical && !node_comm) {
    throw ConfigError(fmt::format(
        "{}: {} asks for the hierarchical algorithm, but the ranks are not on several nodes "
        "with the same number (> 1) of them on each (set dist.node_size or a cluster file to "
        "group them)",
        info.where(), collective_name(call.kind)));
  }
  if (a == CommAlgorithm::native && !native_ok) {
    throw ConfigError(fmt::format(
        "{}: {} asks for the native algorithm, but the {} transport {}", info.where(),
        info.describe(), transport->backend(),
        native ? "cannot run it for this dtype, op or count" : "has no native collectives"));
  }
  return a;
}

bool Communicator::Impl::stage(comm::CollectiveContext& ctx, const Call& call) {
  const size_t elem = dtype_size(call.dtype);
  const size_t n = static_cast<size_t>(size);
  switch (call.kind) {
    case Collective::all_reduce:
      return comm::shm_stage_all_reduce(ctx, *shm, call.send, call.count, call.dtype);
    case Collective::all_gather:
    case Collective::split:
      return comm::shm_stage_all_gatherv(ctx, *shm, call.send, std::vector<size_t>(n, call.count),
                                         elem);
    case Collective::all_gatherv:
      return comm::shm_stage_all_gatherv(ctx, *shm, call.send, call.counts, elem);
    case Collective::reduce_scatter:
      return comm::shm_stage_reduce_scatterv(ctx, *shm, call.send,
                                             std::vector<size_t>(n, call.count), call.dtype);
    case Collective::reduce_scatterv:
      return comm::shm_stage_reduce_scatterv(ctx, *shm, call.send, call.counts, call.dtype);
    case Collective::broadcast:
      return comm::shm_stage_broadcast(ctx, *shm, call.recv, call.count * elem, call.root);
    case Collective::barrier:
      return true;  // the handshake is the barrier
    default:
      return false;
  }
}

void Communicator::Impl::dispatch(comm::CollectiveContext& ctx, Call& call, CommAlgorithm algorithm,
                                  bool staged) {
  using A = CommAlgorithm;
  const size_t elem = dtype_size(call.dtype);
  const size_t n = static_cast<size_t>(size);
  NativeCollectives* native = transport->native();
  auto run_native = [&](std::unique_ptr<TransportRequest> req) {
    ctx.wait_request(
        *req, fmt::format("{} native {}", native->engine_name(), collective_name(call.kind)));
  };
  const ReduceOp native_op = call.op == ReduceOp::avg ? ReduceOp::sum : call.op;
  switch (call.kind) {
    case Collective::all_reduce:
      if (algorithm == A::ring) {
        comm::ring_all_reduce(ctx, call.send, call.recv, call.count, call.dtype, call.op);
      } else if (algorithm == A::halving_doubling) {
        comm::hd_all_reduce(ctx, call.send, call.recv, call.count, call.dtype, call.op);
      } else if (algorithm == A::shared_memory) {
        comm::shm_all_reduce(ctx, *shm, call.send, call.recv, call.count, call.dtype, call.op,
                             staged);
      } else if (algorithm == A::hierarchical) {
        comm::hier_all_reduce(ctx, hier, call.send, call.recv, call.count, call.dtype, call.op);
      } else {
        run_native(native->all_reduce(call.send, call.recv, call.count, call.dtype, native_op));
        if (call.op == ReduceOp::avg) comm::divide(call.recv, call.count, call.dtype, size);
      }
      return;
    case Collective::all_gather:
    case Collective::split:
    case Collective::all_gatherv: {
      const bool even = call.kind != Collective::all_gatherv;
      const std::vector<size_t> counts = even ? std::vector<size_t>(n, call.count) : call.counts;
      if (algorithm == A::hierarchical) {
        comm::hier_all_gatherv(ctx, hier, call.send, call.recv, counts, call.dtype);
      } else if (algorithm == A::ring) {
        comm::ring_all_gatherv(ctx, call.send, call.recv, counts, elem);
      } else if (algorithm == A::halving_doubling) {
        comm::hd_all_gatherv(ctx, call.send, call.recv, counts, elem);
      } else if (algorithm == A::shared_memory) {
        comm::shm_all_gatherv(ctx, *shm, call.send, call.recv, counts, elem, staged);
      } else if (even) {
        run_native(native->all_gather(call.send, call.recv, call.count, call.dtype));
      } else {
        run_native(native->all_gatherv(call.send, call.recv, counts, call.dtype));
      }
      return;
    }
    case Collective::reduce_scatter:
    case Collective::reduce_scatterv: {
      const bool even = call.kind == Collective::reduce_scatter;
      const std::vector<size_t> counts = even ? std::vector<size_t>(n, call.count) : call.counts;
      if (algorithm == A::hierarchical) {
        comm::hier_reduce_scatterv(ctx, hier, call.send, call.recv, counts, call.dtype, call.op);
      } else if (algorithm == A::ring) {
        comm::ring_reduce_scatterv(ctx, call.send, call.recv, counts, call.dtype, call.op);
      } else if (algorithm == A::halving_doubling) {
        comm::hd_reduce_scatterv(ctx, call.send, call.recv, counts, call.dtype, call.op);
      } else if (algorithm == A::shared_memory) {
        comm::shm_reduce_scatterv(ctx, *shm, call.send, call.recv, counts, call.dtype, call.op,
                                  staged);
      } else {
        run_native(
            even ? native->reduce_scatter(call.send, call.recv, call.count, call.dtype, native_op)
                 : native->reduce_scatterv(call.send, call.recv, counts, call.dtype, native_op));
        if (call.op == ReduceOp::avg) {
          comm::divide(call.recv, counts[static_cast<size_t>(rank)], call.dtype, size);
        }
      }
      return;
    }
    case Collective::broadcast:
      if (algorithm == A::tree) {
        comm::tree_broadcast(ctx, call.recv, call.count * elem, call.root);
      } else if (algorithm == A::shared_memory) {
        comm::shm_broadcast(ctx, *shm, call.recv, call.count * elem, call.root, staged);
      } else {
        run_native(native->broadcast(call.recv, call.count, call.dtype, call.root));
      }
      return;
    case Collective::all_to_all:
    case Collective::all_to_allv: {
      const bool even = call.kind == Collective::all_to_all;
      const std::vector<size_t> sc = even ? std::vector<size_t>(n, call.count) : call.counts;
      const std::vector<size_t> rc = even ? sc : call.counts2;
      if (algorithm == A::pairwise) {
        comm::pairwise_all_to_allv(ctx, call.send, sc, call.recv, rc, elem);
      } else {
        run_native(native->all_to_allv(call.send, sc, call.recv, rc, call.dtype));
      }
      return;
    }
    case Collective::barrier:
      if (algorithm == A::dissemination) {
        comm::dissemination_barrier(ctx);
      } else if (algorithm == A::shared_memory) {
        if (!staged) comm::shm_barrier(ctx, *shm);
      } else {
        run_native(native->barrier());
      }
      return;
    case Collective::send:
      ctx.post_send(call.root, call.send, call.count * elem);
      ctx.wait_all();
      return;
    case Collective::recv:
      ctx.post_recv(call.root, call.recv, call.count * elem);
      ctx.wait_all();
      return;
  }
}

CollectiveCost Communicator::cost(Collective c, CommAlgorithm algorithm, size_t count, DType dtype,
                                  std::span<const size_t> counts, int root) const {
  using A = CommAlgorithm;
  const int n = size();
  const int r = rank();
  const size_t elem = dtype_size(dtype);
  const size_t slot = impl_->shm ? impl_->shm->slot_bytes() : 0;
  if (algorithm == A::shared_memory && !impl_->shm) {
    throw ConfigError(fmt::format("comm '{}': no shared memory, so no shared_memory cost", name()));
  }
  const std::vector<size_t> even(static_cast<size_t>(n), count);
  const std::span<const size_t> blocks = counts.empty() ? std::span<const size_t>(even) : counts;
  switch (c) {
    case Collective::all_reduce:
      if (algorithm == A::ring) return comm::ring_all_reduce_cost(n, r, count, elem);
      if (algorithm == A::halving_doubling) return comm::hd_all_reduce_cost(n, r, count, elem);
      if (algorithm == A::shared_memory) {
        return comm::shm_all_reduce_cost(n, r, count, elem, slot);
      }
      if (algorithm == A::hierarchical && impl_->node_comm) {
        const auto& h = impl_->hier;
        const std::vector<size_t> chunks = comm::hier_chunk_counts(count, h.per_node, elem);
        const int local = h.node->rank();
        comm::HierAlgorithms a;
        a.intra_reduce_scatter =
            h.node->choose_algorithm(Collective::reduce_scatterv, count * elem);
        a.inter_all_reduce = h.cross->choose_algorithm(Collective::all_reduce,
                                                       chunks[static_cast<size_t>(local)] * elem);
        a.intra_all_gather = h.node->choose_algorithm(Collective::all_gatherv, count * elem);
        a.intra_slot_bytes = h.node->impl_->shm ? h.node->impl_->shm->slot_bytes() : 0;
        return comm::hier_all_reduce_cost(h.nodes, h.per_node, h.cross->rank(), local, count, elem,
                                          a);
      }
      break;
    case Collective::all_gather:
    case Collective::all_gatherv:
      if (algorithm == A::hierarchical && impl_->node_comm) {
        const auto& h = impl_->hier;
        const size_t bytes = std::accumulate(blocks.begin(), blocks.end(), size_t{0}) * elem;
        comm::HierAlgorithms a;
        a.inter_all_reduce = h.cross->choose_algorithm(
            Collective::all_gatherv,
            comm::hier_group_counts(h, blocks)[static_cast<size_t>(h.node->rank())] * elem);
        a.intra_all_gather = h.node->choose_algorithm(Collective::all_gatherv, bytes);
        a.intra_slot_bytes = h.node->impl_->shm ? h.node->impl_->shm->slot_bytes() : 0;
        return comm::hier_all_gatherv_cost(h, h.cross->rank(), h.node->rank(), blocks, elem, a);
      }
      if (algorithm == A::ring) return comm::ring_all_gatherv_cost(n, r, blocks, elem);
      if (algorithm == A::halving_doubling) return comm::hd_all_gatherv_cost(n, r, blocks, elem);
      if (algorithm == A::shared_memory) {
        return comm::shm_all_gatherv_cost(n, r, blocks, elem, slot);
      }
      break;
    case Collective::reduce_scatter:
    case Collective::reduce_scatterv:
      if (algorithm == A::hierarchical && impl_->node_comm) {
        const auto& h = impl_->hier;
        const size_t bytes = std::accumulate(blocks.begin(), blocks.end(), size_t{0}) * elem;
        comm::HierAlgorithms a;
        a.intra_reduce_scatter = h.node->choose_algorithm(Collective::reduce_scatterv, bytes);
        a.inter_all_reduce = h.cross->choose_algorithm(
            Collective::reduce_scatterv,
            comm::hier_group_counts(h, blocks)[static_cast<size_t>(h.node->rank())] * elem);
        a.intra_slot_bytes = h.node->impl_->shm ? h.node->impl_->shm->slot_bytes() : 0;
        return comm::hier_reduce_scatterv_cost(h, h.cross->rank(), h.node->rank(), blocks, elem, a);
      }
      if (algorithm == A::ring) return comm::ring_reduce_scatterv_cost(n, r, blocks, elem);
      if (algorithm == A::halving_doubling) {
        return comm::hd_reduce_scatterv_cost(n, r, blocks, elem);
      }
      if (algorithm == A::shared_memory) {
        return comm::shm_reduce_scatterv_cost(n, r, blocks, elem, slot);
      }
      break;
    case Collective::broadcast:
      if (algorithm == A::tree) return comm::tree_broadcast_cost(n, r, count * elem, root);
      if (algorithm == A::shared_memory) {
        return comm::shm_broadcast_cost(n, r, count * elem, root, slot);
      }
      break;
    case Collective::all_to_all:
      if (algorithm == A::pairwise) return comm::pairwise_all_to_allv_cost(n, r, even, even, elem);
      break;
    case Collective::barrier:
      if (algorithm == A::dissemination) return comm::dissemination_barrier_cost(n, r);
      if (algorithm == A::shared_memory) return comm::shm_barrier_cost(n, r);
      break;
    default:
      break;
  }
  throw ConfigError(fmt::format("comm '{}': no cost model for {} with algorithm {}", name(),
                                collective_name(c), algorithm_name(algorithm)));
}

}  // namespace mt
