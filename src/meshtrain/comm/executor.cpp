// Running one call of a Communicator: deadline, status board, handshake,
// algorithm, counters, and what a failure does to the communicator.
#include <algorithm>
#include <numeric>
#include <thread>

#include "meshtrain/base/error.h"
#include "meshtrain/base/timer.h"
#include "meshtrain/comm/algorithms.h"
#include "meshtrain/comm/cluster.h"
#include "meshtrain/comm/communicator_impl.h"

namespace mt {

using comm::Call;
using comm::CallInfo;
using comm::CallRecord;
using comm::ShmChannel;

namespace {
// Wire tags: user point-to-point tags below 2^20, collectives and handshakes
// in their own ranges so they can never match a user message.
constexpr uint32_t kCollectiveTagBit = 1u << 29;
constexpr uint32_t kHandshakeTagBit = 1u << 28;
constexpr uint32_t kSeqTagMask = (1u << 28) - 1;
}  // namespace

Communicator::Impl::Impl(std::shared_ptr<Transport> t, CommOptions o)
    : transport(std::move(t)),
      options(std::move(o)),
      rank(transport->rank()),
      size(transport->size()),
      counters(transport->size()) {
  if (options.cluster) {
    // Split communicators inherit the wrapped transport, not the field.
    transport = make_cluster_transport(std::move(transport), std::move(options.cluster),
                                       CommClock::now() + options.timeout);
    options.cluster = nullptr;
  }
  if (transport->max_tag() < (kCollectiveTagBit | kHandshakeTagBit | kSeqTagMask)) {
    throw CommError(
        fmt::format("comm '{}': the {} transport allows message tags up to {}, but "
                    "meshtrain needs tags up to 2^30 - 1",
                    options.name, transport->backend(), transport->max_tag()));
  }
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  spin = static_cast<unsigned>(transport->ranks_on_node()) <= cores
             ? std::chrono::nanoseconds(options.spin)
             : std::chrono::nanoseconds(std::chrono::microseconds(2));
  if (SharedArena* arena = transport->arena()) {
    shm = std::make_unique<ShmChannel>(*arena, rank);
  }
  if (size > 2) build_hierarchy(CommClock::now() + options.timeout);
}

void Communicator::Impl::build_hierarchy(Deadline deadline) {
  const std::vector<int> node_of = transport->node_of();
  const int nodes = *std::max_element(node_of.begin(), node_of.end()) + 1;
  std::vector<std::vector<int>> members(static_cast<size_t>(nodes));
  for (int r = 0; r < size; ++r)
    members[static_cast<size_t>(node_of[static_cast<size_t>(r)])].push_back(r);
  const size_t per_node = members[0].size();
  if (nodes < 2 || per_node < 2) return;
  for (const auto& m : members) {
    if (m.size() != per_node) return;  // unequal nodes: flat algorithms only (docs/comm.md)
  }
  const int my_node = node_of[static_cast<size_t>(rank)];
  const auto& mine = members[static_cast<size_t>(my_node)];
  const int local = static_cast<int>(std::find(mine.begin(), mine.end(), rank) - mine.begin());
  std::vector<int> cross;
  for (const auto& m : members) cross.push_back(m[static_cast<size_t>(local)]);
  // Split ids above every sequence number Impl::split uses.
  constexpr uint64_t kNodeSplit = (uint64_t{1} << 62) | 1;
  constexpr uint64_t kCrossSplit = (uint64_t{1} << 62) | 2;
  std::shared_ptr<Transport> tn = transport->split(my_node, mine, kNodeSplit, deadline);
  std::shared_ptr<Transport> tc = transport->split(local, cross, kCrossSplit, deadline);
  CommOptions o = options;
  o.on_call_done = nullptr;  // the timeline shows the hierarchical call itself
  o.name = fmt::format("{}/node{}", options.name, my_node);
  node_comm = std::make_unique<Communicator>(std::move(tn), o);
  o.name = fmt::format("{}/cross{}", options.name, local);
  cross_comm = std::make_unique<Communicator>(std::move(tc), o);
  hier.node = node_comm.get();
  hier.cross = cross_comm.get();
  hier.node_members = mine;
  hier.cross_members = cross;
  hier.nodes = nodes;
  hier.per_node = static_cast<int>(per_node);
  for (const auto& m : members) hier.grid.insert(hier.grid.end(), m.begin(), m.end());
}

uint32_t Communicator::Impl::wire_tag(const Call& call) const {
  if (comm::is_p2p(call.kind)) return call.opts.tag;
  return kCollectiveTagBit | static_cast<uint32_t>(call.seq & kSeqTagMask);
}

CallInfo Communicator::Impl::info_of(const Call& call) const {
  CallInfo info;
  info.comm_name = options.name;
  info.rank = rank;
  info.size = size;
  info.kind = call.kind;
  info.seq = call.seq;
  info.dtype = call.dtype;
  info.count = call.count;
  info.op = call.op;
  info.root = call.root;
  info.tag = call.opts.tag;
  info.algorithm = call.opts.algorithm;
  info.timeout_s =
      std::chrono::duration<double>(call.opts.timeout.value_or(options.timeout)).count();
  const size_t elem = dtype_size(call.dtype);
  const size_t n = static_cast<size_t>(size);
  switch (call.kind) {
    case Collective::all_gather:
    case Collective::reduce_scatter:
    case Collective::all_to_all:
      info.bytes = n * call.count * elem;
      break;
    case Collective::all_to_allv:
      info.bytes = std::accumulate(call.counts.begin(), call.counts.end(), size_t{0}) * elem;
      break;
    case Collective::split:
      info.bytes = n * call.count * elem;
      break;
    default:
      info.bytes = call.count * elem;
      break;
  }
  return info;
}

void Communicator::Impl::publish(const CallInfo& info, ShmChannel::State state, int64_t time_ns) {
  if (!shm) return;
  ShmChannel::Status s;
  s.seq = info.seq;
  s.kind = info.kind;
  s.state = state;
  s.algorithm = info.algorithm;
  s.bytes = info.bytes;
  s.time_ns = time_ns;
  shm->publish_status(s);
}

std::string Communicator::Impl::watchdog_report(const CallInfo& info) const {
  if (!shm) return {};
  std::string missing;
  std::string entered;
  for (int q : shm->peers()) {
    const auto s = shm->read_status(q);
    if (!s) {
      missing += fmt::format("{}rank {} (status unreadable: it may have died while updating it)",
                             missing.empty() ? "" : "; ", q);
      continue;
    }
    if (s->seq >= info.seq && s->state != ShmChannel::State::none) {
      entered += fmt::format("{}{}", entered.empty() ? "" : ", ", q);
      continue;
    }
    const double ago = static_cast<double>(now_ns() - s->time_ns) * 1e-9;
    if (s->state == ShmChannel::State::none) {
      missing += fmt::format("{}rank {} (has not entered any collective yet)",
                             missing.empty() ? "" : "; ", q);
    } else {
      const char* state = s->state == ShmChannel::State::entered     ? "still in"
                          : s->state == ShmChannel::State::completed ? "completed"
                                                                     : "failed in";
      missing += fmt::format("{}rank {} (last: {} {} #{}, {} bytes, {:.1f} s ago)",
                             missing.empty() ? "" : "; ", q, state, collective_name(s->kind),
                             s->seq, s->bytes, ago);
    }
  }
  if (missing.empty()) {
    return fmt::format("watchdog: every rank has entered {} #{}", collective_name(info.kind),
                       info.seq);
  }
  return fmt::format("watchdog: ranks that have not entered {} #{}: {}{}",
                     collective_name(info.kind), info.seq, missing,
                     entered.empty() ? "" : fmt::format("; entered: {}", entered));
}

void Communicator::Impl::handshake(const CallInfo& info, const Call& call, Deadline deadline) {
  const CallRecord mine = comm::make_record(info, call.counts_hash, call.opts.algorithm);
  records.resize(static_cast<size_t>(size));
  CallInfo hinfo = info;
  hinfo.phase = "handshake";
  const uint32_t tag = kCollectiveTagBit | kHandshakeTagBit |
                       static_cast<uint32_t>((shm ? shm->agreements : agreements) & kSeqTagMask);
  // Without a status board, the records that did not arrive say who is missing.
  comm::CollectiveContext::Diagnose diagnose = [&] {
    if (shm) return watchdog_report(info);
    return std::string(
        "watchdog: the ranks whose handshake records did not arrive have not entered the call");
  };
  comm::CollectiveContext hctx(*transport, hinfo, deadline, tag, counters, options, diagnose);
  hctx.set_spin(spin);
  if (shm) {
    comm::shm_exchange(hctx, *shm, &mine, records.data(), sizeof(CallRecord));
  } else {
    comm::direct_exchange(hctx, &mine, records.data(), sizeof(CallRecord));
    ++agreements;
  }
  // Its time is part of the collective's seconds.
  counters.close_call(CounterBook::kHandshake, 0, hctx.bytes_sent(), hctx.bytes_received(), 0);
  if (auto msg = comm::find_mismatch(options.name, records)) {
    throw MismatchError(*msg);
  }
}

void Communicator::Impl::execute(Call& call) {
  CallInfo info = info_of(call);
  // Reports the call to the observer however it ends.
  struct Observe {
    const CommOptions& o;
    const CallInfo& info;
    int64_t start = now_ns();
    bool ok = false;
    ~Observe() {
      if (o.on_call_done) {
        o.on_call_done(
            CallEvent{info.kind, info.seq, info.bytes, info.algorithm, start, now_ns(), ok});
      }
    }
  } observe{options, info};
  refuse_if_broken(info);
  const auto timeout = call.opts.timeout.value_or(options.timeout);
  const Deadline start = CommClock::now();
  const Deadline deadline = start + timeout;
  const int64_t start_ns = start.time_since_epoch().count();
  auto fail = [&](ShmChannel::State state) {
    if (!comm::is_p2p(call.kind)) publish(info, state, now_ns());
  };
  const bool p2p = comm::is_p2p(call.kind);
  try {
    std::exception_ptr resolve_error;
    try {
      info.algorithm = resolve(call, info);
    } catch (const ConfigError&) {
      // Thrown after the handshake, so that every rank agrees on the call first.
      resolve_error = std::current_exception();
    }
    comm::CollectiveContext ctx(*transport, info, deadline, wire_tag(call), counters, options,
                                [&] { return watchdog_report(info); });
    ctx.set_scratch(&scratch0, &scratch1);
    ctx.set_spin(spin);
    bool staged = false;
    if (!p2p) {
      publish(info, ShmChannel::State::entered, start_ns);
      if (call.opts.handshake.value_or(options.handshake) && size > 1) {
        staged =
            !resolve_error && info.algorithm == CommAlgorithm::shared_memory && stage(ctx, call);
        handshake(info, call, deadline);
      }
    }
    if (resolve_error) std::rethrow_exception(resolve_error);
    dispatch(ctx, call, info.algorithm, staged);
    const int64_t end_ns = now_ns();
    if (!p2p) publish(info, ShmChannel::State::completed, end_ns);
    counters.close_call(static_cast<int>(call.kind), info.bytes, ctx.bytes_sent(),
                        ctx.bytes_received(), end_ns - start_ns);
    observe.ok = true;
  } catch (const TimeoutError& e) {
    // Messages of this call may still be in flight: nothing later could trust
    // the transport's matching, so the communicator refuses further calls.
    mark_broken(e.what());
    fail(ShmChannel::State::failed);
    throw;
  } catch (const MismatchError&) {
    // Every rank saw the same records and stops before moving data: usable.
    fail(ShmChannel::State::failed);
    throw;
  } catch (const CommError& e) {
    mark_broken(e.what());
    fail(ShmChannel::State::failed);
    throw;
  } catch (...) {
    fail(ShmChannel::State::failed);
    throw;
  }
}

}  // namespace mt
