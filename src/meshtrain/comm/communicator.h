// Communicator: the comm layer's interface for callers.
//
// A Communicator is one rank's handle on a group of ranks (all processes of an
// MPI job, the threads of a LocalWorld, a sub-group made by split()). It owns
// a Transport (comm/transport.h) and runs collectives on it with the
// algorithms of comm/algorithms.h. Every rank of the group must issue the same
// collectives in the same order; by default a cheap handshake checks this
// before each collective (same collective, dtype, count, root, op, tag and
// requested algorithm) and throws the same MismatchError on every rank when
// they disagree.
//
// Blocking: every call blocks until done, at most its timeout
// (CollectiveOptions::timeout, else CommOptions::timeout), then throws
// TimeoutError naming the rank, the collective, its sequence number, bytes and
// the ranks that have not entered it. *_async variants queue the call on the
// communicator's progress thread and return a CommHandle; calls run in issue
// order, blocking ones after every queued one. After a timeout or a lost
// peer the communicator is unusable (messages may be in flight) and later
// calls throw CommError; a mismatch leaves it usable.
//
// Threading: issue calls from one thread at a time. Buffers passed to an
// *_async call must stay valid until its handle completes (the Tensor
// overloads keep their tensors alive themselves). Counts are elements of the
// dtype; byte counters are in bytes.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "meshtrain/comm/counters.h"
#include "meshtrain/comm/options.h"
#include "meshtrain/tensor/tensor.h"

namespace mt {

class Transport;

namespace comm {
struct OpState;
}

// The future of an *_async call. Copyable; all copies share the operation.
class CommHandle {
 public:
  CommHandle() = default;
  explicit CommHandle(std::shared_ptr<comm::OpState> state) : state_(std::move(state)) {}

  bool valid() const { return state_ != nullptr; }
  // True once the operation finished (successfully or not); never blocks.
  bool done() const;
  // Blocks until the operation finished and rethrows its error, if any. With
  // `timeout`, throws TimeoutError when it passes first (the operation keeps
  // running). Without, the wait is bounded by the operation's own timeout
  // (and those of the calls queued before it).
  void wait(std::optional<std::chrono::milliseconds> timeout = std::nullopt) const;
  // "all_reduce #12 (f32 x 1024 = 4096 bytes, sum, algorithm shared_memory)"
  std::string describe() const;

 private:
  std::shared_ptr<comm::OpState> state_;
};

class Communicator {
 public:
  Communicator(std::shared_ptr<Transport> transport, CommOptions options);
  // Waits for queued async calls (each bounded by its timeout), then stops the
  // progress thread.
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const;
  int size() const;
  const std::string& name() const;
  const CommOptions& options() const;
  // Replaces CommOptions::on_call_done (e.g. a timeline attaching to a
  // communicator it did not create). Waits for a running call to finish.
  void set_call_observer(std::function<void(const CallEvent&)> observer);
  std::string backend() const;  // "self", "local", "mpi"
  bool has_shared_memory() const;
  bool has_native() const;
  // Whether the ranks sit on several nodes with the same number (> 1) on each
  // (from the machine or CommOptions::cluster): the hierarchical all-reduce
  // is then available, and automatic picks it.
  bool has_hierarchy() const;
  // The algorithm `automatic` resolves to for `c` over `bytes` payload bytes.
  CommAlgorithm choose_algorithm(Collective c, size_t bytes) const;
  // Replaces AlgorithmPolicy::measured (comm/probe.h; null: the static rules).
  // Every rank must install the same table before its next call (a probe's
  // result is: it is reduced over the ranks). Waits for a running call.
  void set_measured_choice(std::shared_ptr<const MeasuredChoice> measured);
  // Set after a timeout or lost peer: the first error's message.
  std::optional<std::string> broken() const;

  // ---- groups (collective over this communicator; nothing assumes a global group)
  // Ranks with the same color >= 0 form one group, ordered by (key, rank);
  // ranks passing a negative color get nullptr.
  std::unique_ptr<Communicator> split(int color, int key, std::string name = {},
                                      const CollectiveOptions& opts = {});
  // The group of `ranks` (of this communicator, in new-rank order). Every rank
  // calls it with the same list; ranks not in the list get nullptr.
  std::unique_ptr<Communicator> subgroup(std::span<const int> ranks, std::string name = {},
                                         const CollectiveOptions& opts = {});

  // ---- collectives on tensors (sizes checked: ShapeError on misfit)
  void all_reduce(Tensor& t, ReduceOp op = ReduceOp::sum, const CollectiveOptions& opts = {});
  // out.numel() == size() * in.numel()
  void all_gather(const Tensor& in, Tensor& out, const CollectiveOptions& opts = {});
  // in.numel() == size() * out.numel()
  void reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op = ReduceOp::sum,
                      const CollectiveOptions& opts = {});
  void broadcast(Tensor& t, int root, const CollectiveOptions& opts = {});
  // in and out hold size() equal blocks.
  void all_to_all(const Tensor& in, Tensor& out, const CollectiveOptions& opts = {});
  void send(const Tensor& t, int peer, const CollectiveOptions& opts = {});
  void recv(Tensor& t, int peer, const CollectiveOptions& opts = {});

  CommHandle all_reduce_async(Tensor t, ReduceOp op = ReduceOp::sum,
                              const CollectiveOptions& opts = {});
  CommHandle all_gather_async(Tensor in, Tensor out, const CollectiveOptions& opts = {});
  CommHandle reduce_scatter_async(Tensor in, Tensor out, ReduceOp op = ReduceOp::sum,
                                  const CollectiveOptions& opts = {});
  CommHandle broadcast_async(Tensor t, int root, const CollectiveOptions& opts = {});

  // ---- collectives on raw buffers
  // send == recv is in place.
  void all_reduce(const void* send, void* recv, size_t count, DType dtype,
                  ReduceOp op = ReduceOp::sum, const CollectiveOptions& opts = {});
  // recv holds size() blocks of `count`; send may already be recv's own block.
  void all_gather(const void* send, void* recv, size_t count, DType dtype,
                  const CollectiveOptions& opts = {});
  // Block r has counts[r] elements; send has counts[rank()].
  void all_gatherv(const void* send, void* recv, std::span<const size_t> counts, DType dtype,
                   const CollectiveOptions& opts = {});
  // send holds size() blocks of `recv_count`; recv gets the reduced own block.
  void reduce_scatter(const void* send, void* recv, size_t recv_count, DType dtype,
                      ReduceOp op = ReduceOp::sum, const CollectiveOptions& opts = {});
  void reduce_scatterv(const void* send, void* recv, std::span<const size_t> counts, DType dtype,
                       ReduceOp op = ReduceOp::sum, const CollectiveOptions& opts = {});
  void broadcast(void* buf, size_t count, DType dtype, int root,
                 const CollectiveOptions& opts = {});
  // Block r of send goes to rank r; block q of recv comes from rank q.
  void all_to_all(const void* send, void* recv, size_t count_per_rank, DType dtype,
                  const CollectiveOptions& opts = {});
  // Rank r's send_counts[q] must equal rank q's recv_counts[r].
  void all_to_allv(const void* send, std::span<const size_t> send_counts, void* recv,
                   std::span<const size_t> recv_counts, DType dtype,
                   const CollectiveOptions& opts = {});
  void barrier(const CollectiveOptions& opts = {});
  // Point to point, matched by (peer, opts.tag) in order; the receiver names
  // the exact count. Not collective: no handshake, no sequence number.
  void send(const void* buf, size_t count, DType dtype, int peer,
            const CollectiveOptions& opts = {});
  void recv(void* buf, size_t count, DType dtype, int peer, const CollectiveOptions& opts = {});

  CommHandle all_reduce_async(const void* send, void* recv, size_t count, DType dtype,
                              ReduceOp op = ReduceOp::sum, const CollectiveOptions& opts = {});
  CommHandle all_gather_async(const void* send, void* recv, size_t count, DType dtype,
                              const CollectiveOptions& opts = {});
  CommHandle all_gatherv_async(const void* send, void* recv, std::span<const size_t> counts,
                               DType dtype, const CollectiveOptions& opts = {});
  CommHandle reduce_scatter_async(const void* send, void* recv, size_t recv_count, DType dtype,
                                  ReduceOp op = ReduceOp::sum, const CollectiveOptions& opts = {});
  CommHandle reduce_scatterv_async(const void* send, void* recv, std::span<const size_t> counts,
                                   DType dtype, ReduceOp op = ReduceOp::sum,
                                   const CollectiveOptions& opts = {});
  CommHandle broadcast_async(void* buf, size_t count, DType dtype, int root,
                             const CollectiveOptions& opts = {});
  CommHandle all_to_all_async(const void* send, void* recv, size_t count_per_rank, DType dtype,
                              const CollectiveOptions& opts = {});
  CommHandle all_to_allv_async(const void* send, std::span<const size_t> send_counts, void* recv,
                               std::span<const size_t> recv_counts, DType dtype,
                               const CollectiveOptions& opts = {});
  CommHandle barrier_async(const CollectiveOptions& opts = {});
  CommHandle send_async(const void* buf, size_t count, DType dtype, int peer,
                        const CollectiveOptions& opts = {});
  CommHandle recv_async(void* buf, size_t count, DType dtype, int peer,
                        const CollectiveOptions& opts = {});

  // ---- point to point started on the calling thread
  // send_now / recv_now start the message on the transport at once, on the
  // calling thread, instead of queueing it for the progress thread (while
  // async calls are queued or running here they queue as send_async /
  // recv_async do, so calls keep their issue order). The handle's done()
  // and wait() drive the message from the thread that calls them, which
  // must be the issuing thread: no thread is woken to send or receive, so
  // a message between two ranks whose cores are busy computing costs no
  // thread switch (a pipeline's boundary tensors). Matched, counted,
  // observed and timed out as send / recv are. The Tensor overloads keep
  // their tensor alive until the handle completes. Calls still in flight
  // when the communicator is destroyed are waited for, as queued ones are.
  // Started so only on a communicator with shared memory (its ranks on one
  // node, links not emulated), where the receiver completes a message
  // without the sender's help (Open MPI's vader copies it with CMA; with
  // btl_vader_single_copy_mechanism = none it would wait for the sender's
  // next test); elsewhere they queue as send_async / recv_async do.
  CommHandle send_now(const void* buf, size_t count, DType dtype, int peer,
                      const CollectiveOptions& opts = {});
  CommHandle recv_now(void* buf, size_t count, DType dtype, int peer,
                      const CollectiveOptions& opts = {});
  CommHandle send_now(Tensor t, int peer, const CollectiveOptions& opts = {});
  CommHandle recv_now(Tensor t, int peer, const CollectiveOptions& opts = {});

  // ---- receive from whichever peer sends first (parameter servers)
  // post_recv() starts a receive of `count` elements from `peer` on
  // opts.tag at once, on the calling thread: it is not queued behind *_async
  // calls (none may be in flight on this communicator while receives are
  // posted) and at most one is posted per peer. wait_any() blocks until one
  // posted receive completes and returns it (its bytes then counted as a
  // "recv" call), or reports a peer the transport knows is gone (its receive
  // dropped; the buffer must stay valid until the communicator is
  // destroyed), or returns nullopt when `timeout` passes first, so the caller
  // can name whom it was waiting for. With nothing posted it returns nullopt
  // at once. Matching is by (peer, tag) in order, as for recv(); the sender
  // uses send() / send_async() with the same tag.
  struct AnyRecv {
    int peer = -1;
    bool lost = false;  // the peer is gone; `lost_message` says how
    std::string lost_message;
  };
  void post_recv(void* buf, size_t count, DType dtype, int peer,
                 const CollectiveOptions& opts = {});
  std::optional<AnyRecv> wait_any(std::chrono::milliseconds timeout);
  // Whether a receive from `peer` is posted and not yet returned by wait_any().
  bool recv_posted(int peer) const;

  // ---- byte counters
  CommCounters counters() const;
  void reset_counters();
  // What the algorithm `algorithm` (not automatic) costs this rank for a call
  // of `c` with these arguments; the counters report the same byte numbers.
  // counts: per-rank element counts (v-variants), else empty; count: the
  // count argument of the non-v variant.
  CollectiveCost cost(Collective c, CommAlgorithm algorithm, size_t count, DType dtype,
                      std::span<const size_t> counts = {}, int root = 0) const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace mt
