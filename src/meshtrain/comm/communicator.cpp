// Communicator itself: handles, the queue and progress thread, accessors,
// groups (the collective calls are in communicator_calls.cpp).
#include "meshtrain/comm/communicator.h"

#include <algorithm>
#include <numeric>
#include <set>

#include "meshtrain/base/error.h"
#include "meshtrain/comm/communicator_impl.h"
#include "meshtrain/comm/cost.h"

namespace mt {

using comm::Call;
using comm::OpState;

// ---- CommHandle -----------------------------------------------------------------

bool CommHandle::done() const {
  if (!state_) return true;
  if (state_->started) return comm::started_done(*state_);
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->finished;
}

void CommHandle::wait(std::optional<std::chrono::milliseconds> timeout) const {
  if (!state_) return;
  if (state_->started) {
    comm::started_wait(*state_, timeout);
    return;
  }
  std::unique_lock<std::mutex> lock(state_->mu);
  if (timeout) {
    if (!state_->cv.wait_for(lock, *timeout, [&] { return state_->finished; })) {
      throw TimeoutError(fmt::format(
          "{}: waiting for its handle timed out after {:.3f} s (the call is still queued or "
          "running)",
          state_->description, std::chrono::duration<double>(*timeout).count()));
    }
  } else {
    state_->cv.wait(lock, [&] { return state_->finished; });
  }
  if (state_->error) std::rethrow_exception(state_->error);
}

std::string CommHandle::describe() const {
  return state_ ? state_->description : "(empty)";
}

// ---- queueing ---------------------------------------------------------------------

void Communicator::Impl::run(Call call) {
  if (!worker_started.load(std::memory_order_acquire)) {
    if (!comm::is_p2p(call.kind)) ++next_seq;
    call.seq = comm::is_p2p(call.kind) ? 0 : next_seq;
    execute(call);
    return;
  }
  {
    std::unique_lock<std::mutex> lock(q_mu);
    if (!comm::is_p2p(call.kind)) call.seq = ++next_seq;
    if (outstanding > 0) {
      // Calls run in issue order: wait behind the queued async ones.
      call.state = std::make_shared<OpState>();
      call.state->description = info_of(call).describe();
      CommHandle h(call.state);
      queue.push_back(std::move(call));
      ++outstanding;
      q_cv.notify_all();
      lock.unlock();
      h.wait();
      return;
    }
  }
  std::lock_guard<std::mutex> exec(exec_mu);
  execute(call);
}

CommHandle Communicator::Impl::submit(Call call) {
  std::lock_guard<std::mutex> lock(q_mu);
  if (!comm::is_p2p(call.kind)) call.seq = ++next_seq;
  call.state = std::make_shared<OpState>();
  call.state->description = info_of(call).describe();
  CommHandle h(call.state);
  queue.push_back(std::move(call));
  ++outstanding;
  if (!worker.joinable()) {
    worker = std::thread([this] { worker_loop(); });
    worker_started.store(true, std::memory_order_release);
  }
  q_cv.notify_all();
  return h;
}

void Communicator::Impl::worker_loop() {
  for (;;) {
    Call call;
    {
      std::unique_lock<std::mutex> lock(q_mu);
      q_cv.wait(lock, [&] { return stopping || !queue.empty(); });
      if (queue.empty()) return;  // stopping and drained
      call = std::move(queue.front());
      queue.pop_front();
    }
    std::exception_ptr error;
    {
      std::lock_guard<std::mutex> exec(exec_mu);
      try {
        execute(call);
      } catch (...) {
        error = std::current_exception();
      }
    }
    call.keep.clear();
    {
      std::lock_guard<std::mutex> lock(q_mu);
      --outstanding;
    }
    {
      std::lock_guard<std::mutex> lock(call.state->mu);
      call.state->finished = true;
      call.state->error = error;
    }
    call.state->cv.notify_all();
  }
}

void Communicator::Impl::stop_worker() {
  {
    std::lock_guard<std::mutex> lock(q_mu);
    stopping = true;
  }
  q_cv.notify_all();
  if (worker.joinable()) worker.join();
}

// ---- Communicator -------------------------------------------------------------------

Communicator::Communicator(std::shared_ptr<Transport> transport, CommOptions options)
    : impl_(std::make_unique<Impl>(std::move(transport), std::move(options))) {}

Communicator::~Communicator() {
  impl_->finish_started();
  impl_->stop_worker();
}

int Communicator::rank() const {
  return impl_->rank;
}
int Communicator::size() const {
  return impl_->size;
}
const std::string& Communicator::name() const {
  return impl_->options.name;
}
const CommOptions& Communicator::options() const {
  return impl_->options;
}
void Communicator::set_call_observer(std::function<void(const CallEvent&)> observer) {
  std::lock_guard<std::mutex> exec(impl_->exec_mu);  // not while a call runs
  impl_->options.on_call_done = std::move(observer);
}
void Communicator::set_measured_choice(std::shared_ptr<const MeasuredChoice> measured) {
  std::lock_guard<std::mutex> exec(impl_->exec_mu);  // not while a call runs
  impl_->options.policy.measured = std::move(measured);
}
std::string Communicator::backend() const {
  return impl_->transport->backend();
}
bool Communicator::has_shared_memory() const {
  return impl_->shm != nullptr;
}
bool Communicator::has_hierarchy() const {
  return impl_->node_comm != nullptr;
}
bool Communicator::has_native() const {
  return impl_->transport->native() != nullptr;
}

CommAlgorithm Communicator::choose_algorithm(Collective c, size_t bytes) const {
  comm::GroupTopology t;
  t.size = impl_->size;
  t.shared_memory = has_shared_memory();
  t.native = has_native();
  t.hierarchy = impl_->node_comm != nullptr;
  return comm::select_algorithm(impl_->options.policy, c, bytes, t);
}

std::optional<std::string> Communicator::broken() const {
  std::lock_guard<std::mutex> lock(impl_->broken_mu);
  return impl_->broken;
}

CommCounters Communicator::counters() const {
  return impl_->counters.snapshot();
}
void Communicator::reset_counters() {
  impl_->counters.reset();
}

namespace {
comm::Call make_split_call(void* send, void* recv, const CollectiveOptions& opts) {
  comm::Call c;
  c.kind = Collective::split;
  c.send = send;
  c.recv = recv;
  c.count = 2;
  c.dtype = DType::i64;
  c.opts = opts;
  return c;
}
}  // namespace

// ---- groups -----------------------------------------------------------------------------

std::unique_ptr<Communicator> Communicator::split(int color, int key, std::string name,
                                                  const CollectiveOptions& opts) {
  return impl_->split(color, key, 0, std::move(name), opts);
}

std::unique_ptr<Communicator> Communicator::subgroup(std::span<const int> ranks, std::string name,
                                                     const CollectiveOptions& opts) {
  std::set<int> seen;
  for (int r : ranks) {
    if (r < 0 || r >= size() || !seen.insert(r).second) {
      throw ConfigError(fmt::format(
          "comm '{}' rank {} of {}: subgroup rank list has {} rank {} (ranks must be distinct "
          "and in [0, {}))",
          this->name(), rank(), size(), seen.count(r) && r >= 0 && r < size() ? "repeated" : "bad",
          r, size()));
    }
  }
  const auto it = std::find(ranks.begin(), ranks.end(), rank());
  const int color = it == ranks.end() ? -1 : 0;
  const int key = static_cast<int>(it - ranks.begin());
  std::vector<size_t> as_counts(ranks.begin(), ranks.end());
  return impl_->split(color, key, comm::hash_counts(as_counts) | 1, std::move(name), opts);
}

std::unique_ptr<Communicator> Communicator::Impl::split(int color, int key, uint64_t list_hash,
                                                        std::string name,
                                                        const CollectiveOptions& opts) {
  int64_t mine[2] = {color, key};
  std::vector<int64_t> all(2 * static_cast<size_t>(size));
  Call c = make_split_call(mine, all.data(), opts);
  c.counts_hash = list_hash;
  run(std::move(c));
  uint64_t split_id;
  {
    std::lock_guard<std::mutex> lock(q_mu);
    split_id = next_seq;  // the split's own sequence number: same on every rank
  }
  // Groups in order of their smallest color; members ordered by (key, rank).
  std::vector<int64_t> colors;
  for (int r = 0; r < size; ++r) {
    if (all[2 * static_cast<size_t>(r)] >= 0) colors.push_back(all[2 * static_cast<size_t>(r)]);
  }
  std::sort(colors.begin(), colors.end());
  colors.erase(std::unique(colors.begin(), colors.end()), colors.end());
  int group = -1;
  std::vector<int> members;
  if (color >= 0) {
    group =
        static_cast<int>(std::lower_bound(colors.begin(), colors.end(), color) - colors.begin());
    for (int r = 0; r < size; ++r) {
      if (all[2 * static_cast<size_t>(r)] == color) members.push_back(r);
    }
    std::stable_sort(members.begin(), members.end(), [&](int a, int b) {
      return all[2 * static_cast<size_t>(a) + 1] < all[2 * static_cast<size_t>(b) + 1];
    });
  }
  const auto timeout = opts.timeout.value_or(options.timeout);
  std::shared_ptr<Transport> t =
      transport->split(group, members, split_id, CommClock::now() + timeout);
  if (!t) return nullptr;
  CommOptions o = options;
  o.name = name.empty() ? fmt::format("{}/{}", options.name, color) : std::move(name);
  return std::make_unique<Communicator>(std::move(t), std::move(o));
}

}  // namespace mt
