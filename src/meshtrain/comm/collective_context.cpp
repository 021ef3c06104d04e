#include "meshtrain/comm/collective_context.h"

#include <sched.h>

#include <algorithm>
#include <thread>

#include "meshtrain/base/error.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace mt::comm {

std::string CallInfo::describe() const {
  std::string s = fmt::format("{} #{} ({} x {} = {} bytes", collective_name(kind), seq,
                              dtype_name(dtype), count, bytes);
  if (kind == Collective::all_reduce || kind == Collective::reduce_scatter ||
      kind == Collective::reduce_scatterv) {
    s += fmt::format(", {}", reduce_op_name(op));
  }
  if (kind == Collective::broadcast) s += fmt::format(", root {}", root);
  if (kind == Collective::send) s += fmt::format(", to rank {}", root);
  if (kind == Collective::recv) s += fmt::format(", from rank {}", root);
  if (tag != 0) s += fmt::format(", tag {}", tag);
  if (kind != Collective::send && kind != Collective::recv) {
    s += fmt::format(", algorithm {}", algorithm_name(algorithm));
  }
  s += ")";
  if (phase != nullptr) s += fmt::format(" [{}]", phase);
  return s;
}

std::string CallInfo::where() const {
  return fmt::format("comm '{}' rank {} of {}", comm_name, rank, size);
}

CollectiveContext::CollectiveContext(Transport& transport, const CallInfo& call, Deadline deadline,
                                     uint32_t wire_tag, CounterBook& counters,
                                     const CommOptions& options, Diagnose diagnose)
    : transport_(transport),
      call_(call),
      deadline_(deadline),
      tag_(wire_tag),
      counters_(counters),
      options_(options),
      diagnose_(std::move(diagnose)) {}

void CollectiveContext::post_send(int peer, const void* buf, size_t bytes) {
  pending_.push_back({transport_.isend(peer, tag_, buf, bytes), peer, bytes, true, false});
}

void CollectiveContext::post_recv(int peer, void* buf, size_t bytes) {
  pending_.push_back({transport_.irecv(peer, tag_, buf, bytes), peer, bytes, false, false});
}

void CollectiveContext::wait_all() {
  std::vector<int> peers;
  auto ready = [&] {
    bool all = true;
    for (Pending& p : pending_) {
      if (p.done) continue;
      bool finished = false;
      try {
        finished = p.req->test();
      } catch (const CommError& e) {
        throw CommError(failure_message(e.what(), pending_description()));
      }
      if (finished) {
        p.done = true;
        if (p.is_send) {
          count_sent(p.peer, p.bytes);
        } else {
          count_received(p.peer, p.bytes);
        }
      } else {
        all = false;
      }
    }
    // Liveness is checked only for the peers of unfinished messages.
    peers.clear();
    for (const Pending& p : pending_) {
      if (!p.done) peers.push_back(p.peer);
    }
    return all;
  };
  wait_until(ready, peers, [&] { return pending_description(); });
  pending_.clear();
}

void CollectiveContext::sendrecv(int to, const void* send_buf, size_t send_bytes, int from,
                                 void* recv_buf, size_t recv_bytes) {
  post_recv(from, recv_buf, recv_bytes);
  post_send(to, send_buf, send_bytes);
  wait_all();
}

void CollectiveContext::wait_request(TransportRequest& req, const std::string& what) {
  std::vector<int> peers;
  for (int r = 0; r < size(); ++r) {
    if (r != rank()) peers.push_back(r);
  }
  auto ready = [&] {
    try {
      return req.test();
    } catch (const CommError& e) {
      throw CommError(failure_message(e.what(), what));
    }
  };
  wait_until(ready, peers, [&] { return what; });
}

void CollectiveContext::count_sent(int peer, uint64_t bytes) {
  sent_ += bytes;
  counters_.add_sent(peer, bytes);
}

void CollectiveContext::count_received(int peer, uint64_t bytes) {
  received_ += bytes;
  counters_.add_received(peer, bytes);
}

std::byte* CollectiveContext::scratch(size_t bytes, int which) {
  std::vector<std::byte>* pool = scratch_[which];
  MT_CHECK(pool != nullptr, "no scratch pool {} set for {}", which, call_.describe());
  if (pool->size() < std::max<size_t>(bytes, 64)) pool->resize(std::max<size_t>(bytes, 64));
  return pool->data();
}

std::string CollectiveContext::pending_description() const {
  std::string s;
  for (const Pending& p : pending_) {
    if (p.done) continue;
    if (!s.empty()) s += ", ";
    s += p.is_send ? fmt::format("send of {} bytes to rank {}", p.bytes, p.peer)
                   : fmt::format("recv of {} bytes from rank {}", p.bytes, p.peer);
  }
  return s.empty() ? "nothing" : s;
}

std::string CollectiveContext::failure_message(const std::string& failure,
                                               const std::string& what) const {
  std::string s = fmt::format("{}: {} {}", call_.where(), call_.describe(), failure);
  if (step_ >= 0) s += fmt::format(" at step {} of {}", step_ + 1, steps_total_);
  s += fmt::format(", waiting for {}; this call moved {} bytes out and {} bytes in", what, sent_,
                   received_);
  if (diagnose_) {
    std::string report = diagnose_();
    if (!report.empty()) s += "; " + report;
  }
  return s;
}

CollectiveContext::WaitState CollectiveContext::begin_wait() const {
  WaitState w;
  w.start = CommClock::now();
  w.next_peer_check = w.start + std::chrono::milliseconds(20);
  return w;
}

void CollectiveContext::cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

bool CollectiveContext::slow_idle(WaitState& w, std::span<const int> peers,
                                  const std::function<std::string()>& what) {
  const Deadline now = CommClock::now();
  if (now >= deadline_) {
    throw TimeoutError(
        failure_message(fmt::format("timed out after {:.3f} s", call_.timeout_s), what()));
  }
  if (now >= w.next_peer_check) {
    w.next_peer_check = now + std::chrono::milliseconds(20);
    if (auto lost = transport_.lost_peer(peers)) {
      lost_ = *lost;
      return true;
    }
    if (!w.stall_reported && options_.on_stall && now - w.start >= options_.stall_warning) {
      w.stall_reported = true;
      options_.on_stall(
          failure_message(fmt::format("is stalled ({:.1f} s without progress)",
                                      std::chrono::duration<double>(now - w.start).count()),
                          what()));
    }
  }
  // Spin while the peer is probably running on its own core: yielding hands
  // the core to any other runnable process, and getting it back can take a
  // whole scheduler slice. Then yield (the peer may need this core); sleep
  // once a wait is clearly long so that idle ranks stop burning the machine.
  const auto waited = now - w.start;
  if (waited < spin_) {
    for (int i = 0; i < 16; ++i) cpu_relax();
  } else if (waited < std::chrono::milliseconds(10)) {
    sched_yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  return false;
}

void CollectiveContext::fail_lost(const WaitState& /*w*/, const std::string& what) {
  throw CommError(failure_message(fmt::format("failed: {}", lost_), what));
}

}  // namespace mt::comm
