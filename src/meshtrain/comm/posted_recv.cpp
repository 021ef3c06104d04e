// Communicator::post_recv / wait_any: receives from whichever of several
// peers sends first, for servers that answer requests in arrival order
// (sync/param_server.h). The receives go straight to the transport, polled
// by the calling thread under exec_mu, so they never wait behind one another
// as queued recv_async calls would.
#include <fmt/format.h>

#include <thread>

#include "meshtrain/base/error.h"
#include "meshtrain/comm/communicator.h"
#include "meshtrain/comm/communicator_impl.h"

namespace mt {

void Communicator::post_recv(void* buf, size_t count, DType dtype, int peer,
                             const CollectiveOptions& opts) {
  if (peer < 0 || peer >= size() || peer == rank()) {
    throw ConfigError(fmt::format(
        "comm '{}' rank {} of {}: post_recv names rank {}, which is not another rank of this "
        "communicator",
        name(), rank(), size(), peer));
  }
  std::lock_guard<std::mutex> exec(impl_->exec_mu);
  if (auto b = broken()) {
    throw CommError(
        fmt::format("comm '{}' rank {}: post_recv refused: the communicator is "
                    "unusable after an earlier failure: {}",
                    name(), rank(), *b));
  }
  if (impl_->posted.count(peer)) {
    throw ConfigError(fmt::format(
        "comm '{}' rank {}: post_recv from rank {}: a receive from it is already posted", name(),
        rank(), peer));
  }
  const size_t bytes = count * dtype_size(dtype);
  Impl::PostedRecv p;
  p.req = impl_->transport->irecv(peer, opts.tag, buf, bytes);
  p.bytes = bytes;
  p.start = CommClock::now();
  impl_->posted.emplace(peer, std::move(p));
}

bool Communicator::recv_posted(int peer) const {
  std::lock_guard<std::mutex> exec(impl_->exec_mu);
  return impl_->posted.count(peer) > 0;
}

std::optional<Communicator::AnyRecv> Communicator::wait_any(std::chrono::milliseconds timeout) {
  const Deadline deadline = CommClock::now() + timeout;
  auto next_liveness = CommClock::now();
  std::vector<int> peers;
  for (int round = 0;; ++round) {
    {
      std::lock_guard<std::mutex> exec(impl_->exec_mu);
      if (impl_->posted.empty()) return std::nullopt;
      // Round-robin start, so a peer that always has a message ready does not
      // starve the others.
      const size_t n = impl_->posted.size();
      auto it = impl_->posted.begin();
      std::advance(it, static_cast<long>(static_cast<size_t>(round) % n));
      for (size_t k = 0; k < n; ++k, ++it) {
        if (it == impl_->posted.end()) it = impl_->posted.begin();
        bool done = false;
        try {
          done = it->second.req->test();
        } catch (const CommError& e) {
          throw CommError(fmt::format("comm '{}' rank {}: receive from rank {} failed: {}", name(),
                                      rank(), it->first, e.what()));
        }
        if (!done) continue;
        const int peer = it->first;
        const uint64_t bytes = it->second.bytes;
        const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(CommClock::now() -
                                                                             it->second.start)
                            .count();
        impl_->posted.erase(it);
        impl_->counters.add_received(peer, bytes);
        impl_->counters.close_call(static_cast<int>(Collective::recv), bytes, 0, bytes, ns);
        return AnyRecv{peer, false, {}};
      }
      const auto now = CommClock::now();
      if (now >= next_liveness) {
        next_liveness = now + std::chrono::milliseconds(20);
        peers.clear();
        for (const auto& [peer, p] : impl_->posted) peers.push_back(peer);
        if (auto lost = impl_->transport->lost_peer(peers)) {
          // Which one: ask peer by peer (cheap, and only on failure).
          for (int q : peers) {
            const int one[1] = {q};
            if (auto m = impl_->transport->lost_peer(one)) {
              impl_->abandoned.push_back(std::move(impl_->posted.at(q).req));
              impl_->posted.erase(q);
              return AnyRecv{q, true, *m};
            }
          }
        }
      }
    }
    if (CommClock::now() >= deadline) return std::nullopt;
    if (round < 64) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
}

}  // namespace mt
