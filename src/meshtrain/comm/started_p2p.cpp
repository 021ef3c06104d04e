// Communicator::send_now / recv_now: point-to-point messages started on the
// issuing thread and driven by whoever tests their handle, instead of by
// the progress thread. A queued send_async has to wake the progress thread,
// which on a machine whose cores the ranks' compute threads occupy waits
// for a core before it can even post the message; a started one is on the
// wire when send_now returns, and the receiver completes it when it tests
// (typically when it is about to wait for it anyway). The transport is
// only ever driven under exec_mu, so started calls and queued ones never
// drive it from two threads at once.
#include <fmt/format.h>

#include <algorithm>
#include <thread>

#include "meshtrain/base/error.h"
#include "meshtrain/base/timer.h"
#include "meshtrain/comm/communicator.h"
#include "meshtrain/comm/communicator_impl.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace mt {

namespace comm {

struct StartedOp {
  Communicator::Impl* impl = nullptr;
  std::unique_ptr<TransportRequest> req;
  Call call;  // its arguments (keep: the tensors it holds alive)
  size_t bytes = 0;
  int64_t start_ns = 0;
  Deadline deadline;
};

bool started_done(OpState& s) {
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.finished) return true;
  }
  return s.started->impl->poll_started(s, false);
}

void started_wait(OpState& s, std::optional<std::chrono::milliseconds> timeout) {
  bool finished = false;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    finished = s.finished;
  }
  if (!finished) s.started->impl->wait_started(s, timeout);
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.error) std::rethrow_exception(s.error);
}

}  // namespace comm

using comm::Call;
using comm::OpState;
using comm::StartedOp;

namespace {

// How long a wait sleeps between tests once it has spun for Impl::spin.
constexpr std::chrono::microseconds kNap{50};
// A test taking longer than this did work (wait_started).
constexpr std::chrono::microseconds kMoved{10};

void cpu_pause() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

// Marks the call finished: counts its bytes (when it succeeded), tells the
// observer and releases what it held. Under exec_mu.
void finish(Communicator::Impl& impl, OpState& s, std::exception_ptr error) {
  StartedOp& op = *s.started;
  const int64_t end = now_ns();
  const Call& c = op.call;
  if (!error) {
    const bool send = c.kind == Collective::send;
    if (send) {
      impl.counters.add_sent(c.root, op.bytes);
    } else {
      impl.counters.add_received(c.root, op.bytes);
    }
    impl.counters.close_call(static_cast<int>(c.kind), op.bytes, send ? op.bytes : 0,
                             send ? 0 : op.bytes, end - op.start_ns);
  }
  if (impl.options.on_call_done) {
    impl.options.on_call_done(CallEvent{c.kind, 0, op.bytes, CommAlgorithm::pairwise, op.start_ns,
                                        end, error == nullptr});
  }
  if (error && op.req) {
    // The engine may still own a failed message's request (transport.h).
    impl.abandoned.push_back(std::move(op.req));
  }
  op.req.reset();
  if (!error) op.call.keep.clear();
  std::lock_guard<std::mutex> lock(s.mu);
  s.finished = true;
  s.error = error;
}

}  // namespace

void Communicator::Impl::mark_broken(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(broken_mu);
    if (!broken) broken = why;
    is_broken.store(true, std::memory_order_release);
  }
  transport->mark_broken(why);
}

void Communicator::Impl::refuse_if_broken(const comm::CallInfo& info) const {
  if (!is_broken.load(std::memory_order_acquire)) return;
  std::lock_guard<std::mutex> lock(broken_mu);
  if (broken) {
    throw CommError(
        fmt::format("{}: {} refused: the communicator is unusable after an earlier failure: {}",
                    info.where(), info.describe(), *broken));
  }
}

CommHandle Communicator::Impl::start(Call call) {
  if (call.opts.tag > kMaxUserTag) {
    throw ConfigError(fmt::format("comm '{}' rank {}: tag {} exceeds the largest tag {}",
                                  options.name, rank, call.opts.tag, kMaxUserTag));
  }
  // Started only where the transport moves a message without its sender's
  // further help: ranks of one node sharing memory (Open MPI's vader has the
  // receiver read a large message straight from the sender, CMA). Between
  // nodes (TCP) or under emulated links a large message advances only while
  // its sender tests it, which a sender busy computing would not: there
  // they queue for the progress thread as send_async / recv_async do.
  if (!shm) return submit(std::move(call));
  // Drive the earlier ones a step too (a send whose handle was dropped
  // completes, and is counted, here or at the latest in the destructor).
  std::erase_if(started,
                [this](const std::shared_ptr<OpState>& s) { return poll_started(*s, false); });
  {
    std::unique_lock<std::mutex> lock(q_mu);
    if (outstanding > 0) {
      // Behind queued calls: keep the issue order.
      lock.unlock();
      return submit(std::move(call));
    }
  }
  std::lock_guard<std::mutex> exec(exec_mu);
  const comm::CallInfo info = info_of(call);
  refuse_if_broken(info);
  auto state = std::make_shared<OpState>();
  state->description = info.describe();
  auto op = std::make_shared<StartedOp>();
  op->impl = this;
  op->bytes = info.bytes;
  op->start_ns = now_ns();
  op->deadline = CommClock::now() + call.opts.timeout.value_or(options.timeout);
  const uint32_t tag = wire_tag(call);
  op->req = call.kind == Collective::send ? transport->isend(call.root, tag, call.send, info.bytes)
                                          : transport->irecv(call.root, tag, call.recv, info.bytes);
  op->call = std::move(call);
  state->started = std::move(op);
  started.push_back(state);
  return CommHandle(state);
}

bool Communicator::Impl::poll_started(OpState& s, bool block) {
  std::unique_lock<std::mutex> exec(exec_mu, std::defer_lock);
  if (block) {
    exec.lock();
  } else if (!exec.try_lock()) {
    return false;  // the progress thread drives the transport now
  }
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.finished) return true;
  }
  StartedOp& op = *s.started;
  try {
    if (!op.req->test()) return false;
  } catch (const CommError& e) {
    const comm::CallInfo info = info_of(op.call);
    const std::string msg =
        fmt::format("{}: {} failed: {}", info.where(), info.describe(), e.what());
    mark_broken(msg);
    finish(*this, s, std::make_exception_ptr(CommError(msg)));
    return true;
  }
  finish(*this, s, nullptr);
  return true;
}

void Communicator::Impl::wait_started(OpState& s,
                                      std::optional<std::chrono::milliseconds> timeout) {
  if (poll_started(s, true)) return;
  StartedOp& op = *s.started;
  if (timeout) {
    // The caller's own bound: the call keeps running when it passes.
    const Deadline until = CommClock::now() + *timeout;
    for (int round = 0; !poll_started(s, true); ++round) {
      if (CommClock::now() >= until) {
        throw TimeoutError(fmt::format(
            "{}: waiting for its handle timed out after {:.3f} s (the call is still running)",
            s.description, std::chrono::duration<double>(*timeout).count()));
      }
      if (round < 64) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
    return;
  }
  // The call's own deadline and lost-peer checks, as a queued call has. The
  // wait spins briefly (the message is often just behind), then sleeps in
  // short naps rather than yielding: a rank that waits for its neighbour
  // should give its core away, not burn it on sched_yield while other
  // processes share the machine (a sleeping thread is also the one the
  // scheduler prefers once it has work again).
  comm::CallInfo info = info_of(op.call);
  info.algorithm = CommAlgorithm::pairwise;
  info.timeout_s =
      std::chrono::duration<double>(op.call.opts.timeout.value_or(options.timeout)).count();
  comm::CollectiveContext ctx(*transport, info, op.deadline, wire_tag(op.call), counters, options,
                              {});
  auto what = [&] {
    const bool send = op.call.kind == Collective::send;
    return fmt::format("{} of {} bytes {} rank {}", send ? "send" : "recv", op.bytes,
                       send ? "to" : "from", op.call.root);
  };
  const std::vector<int> peers = {op.call.root};
  const Deadline t0 = CommClock::now();
  Deadline next_check = t0 + std::chrono::milliseconds(20);
  bool stall_reported = false;
  try {
    bool retested = false;
    for (Deadline polled = CommClock::now(); !poll_started(s, true);) {
      const Deadline now = CommClock::now();
      // A test that took a while moved the message (the receiver's copy of
      // a large one runs in it) without completing it: Open MPI completes
      // the request in the next test, which a nap would put off by 50 us
      // and a wake-up. Once in a row only (a test made slow by losing its
      // core does not keep a waiter from napping).
      const bool moved = !retested && now - polled >= kMoved;
      retested = moved;
      if (now >= op.deadline) {
        throw TimeoutError(
            ctx.failure_message(fmt::format("timed out after {:.3f} s", info.timeout_s), what()));
      }
      if (now >= next_check) {
        next_check = now + std::chrono::milliseconds(20);
        if (auto lost = transport->lost_peer(peers)) {
          if (poll_started(s, true)) break;  // it delivered before it went away
          throw CommError(ctx.failure_message(fmt::format("failed: {}", *lost), what()));
        }
        if (!stall_reported && options.on_stall && now - t0 >= options.stall_warning) {
          stall_reported = true;
          options.on_stall(
              ctx.failure_message(fmt::format("is stalled ({:.1f} s without progress)",
                                              std::chrono::duration<double>(now - t0).count()),
                                  what()));
        }
      }
      if (moved || now - t0 < spin) {
        for (int i = 0; i < 16; ++i) cpu_pause();
      } else {
        std::this_thread::sleep_for(kNap);
      }
      polled = CommClock::now();
    }
  } catch (const CommError& e) {  // TimeoutError too: the message may be in flight
    std::lock_guard<std::mutex> exec(exec_mu);
    mark_broken(e.what());
    bool finished = false;
    {
      std::lock_guard<std::mutex> lock(s.mu);
      finished = s.finished;
    }
    if (!finished) finish(*this, s, std::current_exception());
  }
}

void Communicator::Impl::finish_started() {
  for (const std::shared_ptr<OpState>& s : started) {
    try {
      wait_started(*s, std::nullopt);
    } catch (...) {
      // Reported by the handle, if anyone still waits for it.
    }
  }
  started.clear();
}

}  // namespace mt
