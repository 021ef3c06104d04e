// The collective calls of Communicator: argument checks, then a comm::Call
// that Impl runs now or queues (async).
#include <numeric>

#include "meshtrain/base/error.h"
#include "meshtrain/comm/communicator.h"
#include "meshtrain/comm/communicator_impl.h"

namespace mt {

using comm::Call;

namespace {

void check_peer(const Communicator& c, int peer, std::string_view what) {
  if (peer < 0 || peer >= c.size() || peer == c.rank()) {
    throw ConfigError(
        fmt::format("comm '{}' rank {} of {}: {} names rank {}, which is not "
                    "another rank of this communicator",
                    c.name(), c.rank(), c.size(), what, peer));
  }
}

void check_root(const Communicator& c, int root) {
  if (root < 0 || root >= c.size()) {
    throw ConfigError(fmt::format("comm '{}' rank {} of {}: broadcast root {} is out of range",
                                  c.name(), c.rank(), c.size(), root));
  }
}

void check_counts(const Communicator& c, std::span<const size_t> counts, std::string_view what) {
  if (counts.size() != static_cast<size_t>(c.size())) {
    throw ShapeError(fmt::format("comm '{}' rank {} of {}: {} got {} per-rank counts, expected {}",
                                 c.name(), c.rank(), c.size(), what, counts.size(), c.size()));
  }
}

void check_same_dtype(const Communicator& c, const Tensor& a, const Tensor& b,
                      std::string_view what) {
  if (a.dtype() != b.dtype()) {
    throw ShapeError(fmt::format("comm '{}' rank {}: {} input {} and output {} differ in dtype",
                                 c.name(), c.rank(), what, a.desc(), b.desc()));
  }
}

Call make_call(Collective kind, const void* send, void* recv, size_t count, DType dtype,
               const CollectiveOptions& opts) {
  Call c;
  c.kind = kind;
  c.send = send;
  c.recv = recv;
  c.count = count;
  c.dtype = dtype;
  c.opts = opts;
  return c;
}

}  // namespace

// ---- raw-buffer calls: build the Call, then run it or queue it -------------------------

CommHandle Communicator::Impl::issue(Call call, bool async) {
  if (call.opts.tag > kMaxUserTag) {
    throw ConfigError(fmt::format("comm '{}' rank {}: tag {} exceeds the largest tag {}",
                                  options.name, rank, call.opts.tag, kMaxUserTag));
  }
  if (async) return submit(std::move(call));
  run(std::move(call));
  return CommHandle();
}

namespace {

Call all_reduce_call(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
                     const CollectiveOptions& opts) {
  Call c = make_call(Collective::all_reduce, send, recv, count, dtype, opts);
  c.op = op;
  return c;
}

Call reduce_scatter_call(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
                         const CollectiveOptions& opts) {
  Call c = make_call(Collective::reduce_scatter, send, recv, count, dtype, opts);
  c.op = op;
  return c;
}

Call v_call(Collective kind, const void* send, void* recv, std::span<const size_t> counts,
            DType dtype, ReduceOp op, const CollectiveOptions& opts) {
  Call c = make_call(kind, send, recv, std::accumulate(counts.begin(), counts.end(), size_t{0}),
                     dtype, opts);
  c.counts.assign(counts.begin(), counts.end());
  c.counts_hash = comm::hash_counts(counts);
  c.op = op;
  return c;
}

Call rooted_call(Collective kind, const void* send, void* recv, size_t count, DType dtype, int root,
                 const CollectiveOptions& opts) {
  Call c = make_call(kind, send, recv, count, dtype, opts);
  c.root = root;
  return c;
}

Call all_to_allv_call(const void* send, std::span<const size_t> send_counts, void* recv,
                      std::span<const size_t> recv_counts, DType dtype,
                      const CollectiveOptions& opts) {
  Call c = make_call(Collective::all_to_allv, send, recv, 0, dtype, opts);
  c.counts.assign(send_counts.begin(), send_counts.end());
  c.counts2.assign(recv_counts.begin(), recv_counts.end());
  return c;
}

}  // namespace

void Communicator::all_reduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
                              const CollectiveOptions& opts) {
  impl_->issue(all_reduce_call(send, recv, count, dtype, op, opts), false);
}
CommHandle Communicator::all_reduce_async(const void* send, void* recv, size_t count, DType dtype,
                                          ReduceOp op, const CollectiveOptions& opts) {
  return impl_->issue(all_reduce_call(send, recv, count, dtype, op, opts), true);
}

void Communicator::all_gather(const void* send, void* recv, size_t count, DType dtype,
                              const CollectiveOptions& opts) {
  impl_->issue(make_call(Collective::all_gather, send, recv, count, dtype, opts), false);
}
CommHandle Communicator::all_gather_async(const void* send, void* recv, size_t count, DType dtype,
                                          const CollectiveOptions& opts) {
  return impl_->issue(make_call(Collective::all_gather, send, recv, count, dtype, opts), true);
}

void Communicator::all_gatherv(const void* send, void* recv, std::span<const size_t> counts,
                               DType dtype, const CollectiveOptions& opts) {
  check_counts(*this, counts, "all_gatherv");
  impl_->issue(v_call(Collective::all_gatherv, send, recv, counts, dtype, ReduceOp::sum, opts),
               false);
}
CommHandle Communicator::all_gatherv_async(const void* send, void* recv,
                                           std::span<const size_t> counts, DType dtype,
                                           const CollectiveOptions& opts) {
  check_counts(*this, counts, "all_gatherv");
  return impl_->issue(
      v_call(Collective::all_gatherv, send, recv, counts, dtype, ReduceOp::sum, opts), true);
}

void Communicator::reduce_scatter(const void* send, void* recv, size_t recv_count, DType dtype,
                                  ReduceOp op, const CollectiveOptions& opts) {
  impl_->issue(reduce_scatter_call(send, recv, recv_count, dtype, op, opts), false);
}
CommHandle Communicator::reduce_scatter_async(const void* send, void* recv, size_t recv_count,
                                              DType dtype, ReduceOp op,
                                              const CollectiveOptions& opts) {
  return impl_->issue(reduce_scatter_call(send, recv, recv_count, dtype, op, opts), true);
}

void Communicator::reduce_scatterv(const void* send, void* recv, std::span<const size_t> counts,
                                   DType dtype, ReduceOp op, const CollectiveOptions& opts) {
  check_counts(*this, counts, "reduce_scatterv");
  impl_->issue(v_call(Collective::reduce_scatterv, send, recv, counts, dtype, op, opts), false);
}
CommHandle Communicator::reduce_scatterv_async(const void* send, void* recv,
                                               std::span<const size_t> counts, DType dtype,
                                               ReduceOp op, const CollectiveOptions& opts) {
  check_counts(*this, counts, "reduce_scatterv");
  return impl_->issue(v_call(Collective::reduce_scatterv, send, recv, counts, dtype, op, opts),
                      true);
}

void Communicator::broadcast(void* buf, size_t count, DType dtype, int root,
                             const CollectiveOptions& opts) {
  check_root(*this, root);
  impl_->issue(rooted_call(Collective::broadcast, buf, buf, count, dtype, root, opts), false);
}
CommHandle Communicator::broadcast_async(void* buf, size_t count, DType dtype, int root,
                                         const CollectiveOptions& opts) {
  check_root(*this, root);
  return impl_->issue(rooted_call(Collective::broadcast, buf, buf, count, dtype, root, opts), true);
}

void Communicator::all_to_all(const void* send, void* recv, size_t count_per_rank, DType dtype,
                              const CollectiveOptions& opts) {
  impl_->issue(make_call(Collective::all_to_all, send, recv, count_per_rank, dtype, opts), false);
}
CommHandle Communicator::all_to_all_async(const void* send, void* recv, size_t count_per_rank,
                                          DType dtype, const CollectiveOptions& opts) {
  return impl_->issue(make_call(Collective::all_to_all, send, recv, count_per_rank, dtype, opts),
                      true);
}

void Communicator::all_to_allv(const void* send, std::span<const size_t> send_counts, void* recv,
                               std::span<const size_t> recv_counts, DType dtype,
                               const CollectiveOptions& opts) {
  check_counts(*this, send_counts, "all_to_allv send");
  check_counts(*this, recv_counts, "all_to_allv recv");
  impl_->issue(all_to_allv_call(send, send_counts, recv, recv_counts, dtype, opts), false);
}
CommHandle Communicator::all_to_allv_async(const void* send, std::span<const size_t> send_counts,
                                           void* recv, std::span<const size_t> recv_counts,
                                           DType dtype, const CollectiveOptions& opts) {
  check_counts(*this, send_counts, "all_to_allv send");
  check_counts(*this, recv_counts, "all_to_allv recv");
  return impl_->issue(all_to_allv_call(send, send_counts, recv, recv_counts, dtype, opts), true);
}

void Communicator::barrier(const CollectiveOptions& opts) {
  impl_->issue(make_call(Collective::barrier, nullptr, nullptr, 0, DType::u8, opts), false);
}
CommHandle Communicator::barrier_async(const CollectiveOptions& opts) {
  return impl_->issue(make_call(Collective::barrier, nullptr, nullptr, 0, DType::u8, opts), true);
}

void Communicator::send(const void* buf, size_t count, DType dtype, int peer,
                        const CollectiveOptions& opts) {
  check_peer(*this, peer, "send");
  impl_->issue(rooted_call(Collective::send, buf, nullptr, count, dtype, peer, opts), false);
}
CommHandle Communicator::send_async(const void* buf, size_t count, DType dtype, int peer,
                                    const CollectiveOptions& opts) {
  check_peer(*this, peer, "send");
  return impl_->issue(rooted_call(Collective::send, buf, nullptr, count, dtype, peer, opts), true);
}

void Communicator::recv(void* buf, size_t count, DType dtype, int peer,
                        const CollectiveOptions& opts) {
  check_peer(*this, peer, "recv");
  impl_->issue(rooted_call(Collective::recv, nullptr, buf, count, dtype, peer, opts), false);
}
CommHandle Communicator::recv_async(void* buf, size_t count, DType dtype, int peer,
                                    const CollectiveOptions& opts) {
  check_peer(*this, peer, "recv");
  return impl_->issue(rooted_call(Collective::recv, nullptr, buf, count, dtype, peer, opts), true);
}

CommHandle Communicator::send_now(const void* buf, size_t count, DType dtype, int peer,
                                  const CollectiveOptions& opts) {
  check_peer(*this, peer, "send");
  return impl_->start(rooted_call(Collective::send, buf, nullptr, count, dtype, peer, opts));
}
CommHandle Communicator::recv_now(void* buf, size_t count, DType dtype, int peer,
                                  const CollectiveOptions& opts) {
  check_peer(*this, peer, "recv");
  return impl_->start(rooted_call(Collective::recv, nullptr, buf, count, dtype, peer, opts));
}
CommHandle Communicator::send_now(Tensor t, int peer, const CollectiveOptions& opts) {
  check_peer(*this, peer, "send");
  Call c = rooted_call(Collective::send, t.raw(), nullptr, static_cast<size_t>(t.numel()),
                       t.dtype(), peer, opts);
  c.keep = {std::move(t)};
  return impl_->start(std::move(c));
}
CommHandle Communicator::recv_now(Tensor t, int peer, const CollectiveOptions& opts) {
  check_peer(*this, peer, "recv");
  Call c = rooted_call(Collective::recv, nullptr, t.raw(), static_cast<size_t>(t.numel()),
                       t.dtype(), peer, opts);
  c.keep = {std::move(t)};
  return impl_->start(std::move(c));
}

// ---- tensor calls ---------------------------------------------------------------------

void Communicator::all_reduce(Tensor& t, ReduceOp op, const CollectiveOptions& opts) {
  all_reduce(t.raw(), t.raw(), static_cast<size_t>(t.numel()), t.dtype(), op, opts);
}

CommHandle Communicator::all_reduce_async(Tensor t, ReduceOp op, const CollectiveOptions& opts) {
  Call c = all_reduce_call(t.raw(), t.raw(), static_cast<size_t>(t.numel()), t.dtype(), op, opts);
  c.keep = {t};
  return impl_->issue(std::move(c), true);
}

namespace {
void check_gather_shapes(const Communicator& c, const Tensor& small, const Tensor& big,
                         std::string_view what) {
  check_same_dtype(c, small, big, what);
  if (big.numel() != small.numel() * c.size()) {
    throw ShapeError(fmt::format(
        "comm '{}' rank {} of {}: {} needs the large tensor to hold {} x the small one: got {} "
        "and {}",
        c.name(), c.rank(), c.size(), what, c.size(), big.desc(), small.desc()));
  }
}
}  // namespace

void Communicator::all_gather(const Tensor& in, Tensor& out, const CollectiveOptions& opts) {
  check_gather_shapes(*this, in, out, "all_gather");
  all_gather(in.raw(), out.raw(), static_cast<size_t>(in.numel()), in.dtype(), opts);
}

CommHandle Communicator::all_gather_async(Tensor in, Tensor out, const CollectiveOptions& opts) {
  check_gather_shapes(*this, in, out, "all_gather");
  Call c = make_call(Collective::all_gather, in.raw(), out.raw(), static_cast<size_t>(in.numel()),
                     in.dtype(), opts);
  c.keep = {in, out};
  return impl_->issue(std::move(c), true);
}

void Communicator::reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op,
                                  const CollectiveOptions& opts) {
  check_gather_shapes(*this, out, in, "reduce_scatter");
  reduce_scatter(in.raw(), out.raw(), static_cast<size_t>(out.numel()), in.dtype(), op, opts);
}

CommHandle Communicator::reduce_scatter_async(Tensor in, Tensor out, ReduceOp op,
                                              const CollectiveOptions& opts) {
  check_gather_shapes(*this, out, in, "reduce_scatter");
  Call c = reduce_scatter_call(in.raw(), out.raw(), static_cast<size_t>(out.numel()), in.dtype(),
                               op, opts);
  c.keep = {in, out};
  return impl_->issue(std::move(c), true);
}

void Communicator::broadcast(Tensor& t, int root, const CollectiveOptions& opts) {
  broadcast(t.raw(), static_cast<size_t>(t.numel()), t.dtype(), root, opts);
}

CommHandle Communicator::broadcast_async(Tensor t, int root, const CollectiveOptions& opts) {
  check_root(*this, root);
  Call c = rooted_call(Collective::broadcast, t.raw(), t.raw(), static_cast<size_t>(t.numel()),
                       t.dtype(), root, opts);
  c.keep = {t};
  return impl_->issue(std::move(c), true);
}

void Communicator::all_to_all(const Tensor& in, Tensor& out, const CollectiveOptions& opts) {
  check_same_dtype(*this, in, out, "all_to_all");
  if (in.numel() != out.numel() || in.numel() % size() != 0) {
    throw ShapeError(fmt::format(
        "comm '{}' rank {} of {}: all_to_all needs equal tensors divisible into {} blocks: got "
        "{} and {}",
        name(), rank(), size(), size(), in.desc(), out.desc()));
  }
  all_to_all(in.raw(), out.raw(), static_cast<size_t>(in.numel() / size()), in.dtype(), opts);
}

void Communicator::send(const Tensor& t, int peer, const CollectiveOptions& opts) {
  send(t.raw(), static_cast<size_t>(t.numel()), t.dtype(), peer, opts);
}

void Communicator::recv(Tensor& t, int peer, const CollectiveOptions& opts) {
  recv(t.raw(), static_cast<size_t>(t.numel()), t.dtype(), peer, opts);
}

}  // namespace mt
