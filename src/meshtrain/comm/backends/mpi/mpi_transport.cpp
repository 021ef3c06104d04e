#include "meshtrain/comm/backends/mpi/mpi_transport.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <thread>

#include "meshtrain/base/error.h"
#include "meshtrain/comm/backends/mpi/mpi_request.h"
#include "meshtrain/comm/backends/mpi/mpi_runtime.h"
#include "meshtrain/comm/shm_channel.h"

namespace mt {

// The regions of an MPI-3 shared window, one per rank, as the arena.
class MpiArena : public SharedArena {
 public:
  MpiArena(std::vector<std::byte*> regions, size_t data_bytes)
      : regions_(std::move(regions)), data_bytes_(data_bytes) {}
  int size() const override { return static_cast<int>(regions_.size()); }
  std::byte* region(int rank) const override { return regions_[static_cast<size_t>(rank)]; }
  size_t data_bytes() const override { return data_bytes_; }

 private:
  std::vector<std::byte*> regions_;
  size_t data_bytes_;
};

namespace {

// Messages above this size go as several MPI messages (MPI counts are int).
constexpr size_t kMaxPiece = size_t{1} << 30;

struct Identity {
  int64_t pid;
  char host[64];
};

void check_mpi(int rc, const char* call, int rank) {
  if (rc != MPI_SUCCESS) {
    throw CommError(
        fmt::format("mpi transport rank {}: {} failed: {}", rank, call, mpi_error_string(rc)));
  }
}

// Polls `req` until it completes or `deadline` passes (then the request is
// left to MPI: the caller throws and the transport is not used again).
void poll(MPI_Request& req, Deadline deadline, const std::string& what, int rank, int size) {
  for (int64_t i = 0;; ++i) {
    int flag = 0;
    {
      auto lock = MpiRuntime::instance().lock();
      check_mpi(MPI_Test(&req, &flag, MPI_STATUS_IGNORE), what.c_str(), rank);
    }
    if (flag) return;
    if (CommClock::now() >= deadline) {
      throw TimeoutError(
          fmt::format("mpi transport rank {} of {}: {} timed out: not every rank reached it", rank,
                      size, what));
    }
    if (i > 1000) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    } else {
      std::this_thread::yield();
    }
  }
}

void barrier(MPI_Comm comm, Deadline deadline, const std::string& what, int rank, int size) {
  MPI_Request req;
  {
    auto lock = MpiRuntime::instance().lock();
    check_mpi(MPI_Ibarrier(comm, &req), "MPI_Ibarrier", rank);
  }
  poll(req, deadline, what, rank, size);
}

// A process that no longer exists, or a zombie its parent has not reaped.
bool process_gone(int64_t pid) {
  if (::kill(static_cast<pid_t>(pid), 0) == -1 && errno == ESRCH) return true;
  std::ifstream stat(fmt::format("/proc/{}/stat", pid));
  std::string text;
  if (!std::getline(stat, text)) return false;
  const auto close = text.rfind(')');
  if (close == std::string::npos || close + 2 >= text.size()) return false;
  const char state = text[close + 2];
  return state == 'Z' || state == 'X';
}

}  // namespace

std::shared_ptr<MpiTransport> MpiTransport::create(MPI_Comm parent, const MpiOptions& options,
                                                   Deadline deadline) {
  MpiRuntime& rt = MpiRuntime::instance();
  std::shared_ptr<MpiTransport> t(new MpiTransport());
  t->options_ = options;
  {
    auto lock = rt.lock();
    MPI_Comm_rank(parent, &t->rank_);
    MPI_Comm_size(parent, &t->size_);
  }
  barrier(parent, deadline, "communicator creation", t->rank_, t->size_);
  {
    auto lock = rt.lock();
    check_mpi(MPI_Comm_dup(parent, &t->comm_), "MPI_Comm_dup", t->rank_);
    check_mpi(MPI_Comm_set_errhandler(t->comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler",
              t->rank_);
    void* ub = nullptr;
    int found = 0;
    // MPI_TAG_UB is only cached on MPI_COMM_WORLD.
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &found);
    t->max_tag_ = found ? static_cast<uint32_t>(*static_cast<int*>(ub)) : 32767;
  }
  // Who is where: pids for liveness checks, hosts to tell whether a shared
  // window is possible.
  Identity mine{};
  mine.pid = ::getpid();
  ::gethostname(mine.host, sizeof(mine.host) - 1);
  std::vector<Identity> all(static_cast<size_t>(t->size_));
  MPI_Request req;
  {
    auto lock = rt.lock();
    check_mpi(MPI_Iallgather(&mine, sizeof(Identity), MPI_BYTE, all.data(), sizeof(Identity),
                             MPI_BYTE, t->comm_, &req),
              "MPI_Iallgather", t->rank_);
  }
  poll(req, deadline, "exchange of host names and pids", t->rank_, t->size_);
  bool one_node = true;
  for (const Identity& id : all) {
    Peer p;
    p.pid = id.pid;
    p.host = std::string(id.host, strnlen(id.host, sizeof(id.host)));
    p.same_host = p.host == std::string(mine.host);
    one_node = one_node && p.same_host;
    t->peers_.push_back(std::move(p));
  }
  if (options.shared_memory && one_node) t->set_up_arena(deadline);
  t->native_ = make_mpi_native(t->comm_, t->rank_, t->size_);
  return t;
}

void MpiTransport::set_up_arena(Deadline deadline) {
  const size_t data =
      std::max<size_t>(options_.shm_bytes_per_rank / 64 * 64, 64 * 2 * static_cast<size_t>(size_));
  const size_t stride = SharedArena::kControlBytes + data;
  std::vector<std::byte*> regions(static_cast<size_t>(size_));
  {
    auto lock = MpiRuntime::instance().lock();
    MPI_Info info;
    MPI_Info_create(&info);
    // Each rank's region on its own pages (first-touch by its owner).
    MPI_Info_set(info, "alloc_shared_noncontig", "true");
    void* base = nullptr;
    const int rc =
        MPI_Win_allocate_shared(static_cast<MPI_Aint>(stride + 64), 1, info, comm_, &base, &win_);
    MPI_Info_free(&info);
    check_mpi(rc, "MPI_Win_allocate_shared", rank_);
    for (int r = 0; r < size_; ++r) {
      MPI_Aint bytes = 0;
      int disp = 0;
      void* p = nullptr;
      check_mpi(MPI_Win_shared_query(win_, r, &bytes, &disp, &p), "MPI_Win_shared_query", rank_);
      if (static_cast<size_t>(bytes) < stride + 64) {
        throw CommError(
            fmt::format("mpi transport rank {}: rank {}'s shared region has {} bytes, "
                        "expected {}",
                        rank_, r, bytes, stride));
      }
      // MPI aligns less than the control block's cache lines need (+64 above).
      const auto addr = reinterpret_cast<uintptr_t>(p);
      regions[static_cast<size_t>(r)] = reinterpret_cast<std::byte*>((addr + 63) / 64 * 64);
    }
  }
  comm::ShmChannel::construct(regions[static_cast<size_t>(rank_)], data, ::getpid());
  // Nobody reads a control block before its owner has constructed it.
  barrier(comm_, deadline, "shared window set-up", rank_, size_);
  arena_ = std::make_unique<MpiArena>(std::move(regions), data);
}

MpiTransport::~MpiTransport() {
  if (comm_ == MPI_COMM_NULL) return;
  MpiRuntime& rt = MpiRuntime::instance();
  if (rt.peer_lost()) return;  // freeing would synchronise with the dead
  try {
    // MPI_Win_free synchronises; free only once every rank is here. One
    // barrier is not enough to know that: a rank that gives up on it (it
    // came more than teardown_timeout before the others) leaves its
    // MPI_Ibarrier posted, so the late ranks' barrier completes and they
    // would wait in MPI_Win_free for a rank already in MPI_Finalize (the
    // parameter server's hang at exit, where the servers finish long before
    // the workers). A second barrier that only ranks which completed the
    // first enter: when one gave up, the others time out on it and leave
    // the window to MPI as well.
    if (win_ != MPI_WIN_NULL) {
      barrier(comm_, CommClock::now() + options_.teardown_timeout, "communicator teardown", rank_,
              size_);
      barrier(comm_, CommClock::now() + options_.teardown_timeout,
              "communicator teardown (every rank there)", rank_, size_);
      auto lock = rt.lock();
      MPI_Win_free(&win_);
    }
    auto lock = rt.lock();
    MPI_Comm_free(&comm_);
  } catch (const Error&) {
    // Some rank never came: leave the window and communicator to MPI.
  }
}

std::unique_ptr<TransportRequest> MpiTransport::isend(int peer, uint32_t tag, const void* buf,
                                                      size_t bytes) {
  auto req = std::make_unique<MpiRequest>(
      false, fmt::format("MPI_Isend of {} bytes to rank {} (tag {})", bytes, peer, tag));
  auto lock = MpiRuntime::instance().lock();
  size_t off = 0;
  do {
    const size_t len = std::min(kMaxPiece, bytes - off);
    MPI_Request r;
    check_mpi(MPI_Isend(static_cast<const std::byte*>(buf) + off, static_cast<int>(len), MPI_BYTE,
                        peer, static_cast<int>(tag), comm_, &r),
              "MPI_Isend", rank_);
    req->reqs.push_back(r);
    off += len;
  } while (off < bytes);
  return req;
}

std::unique_ptr<TransportRequest> MpiTransport::irecv(int peer, uint32_t tag, void* buf,
                                                      size_t bytes) {
  auto req = std::make_unique<MpiRequest>(
      false, fmt::format("MPI_Irecv of {} bytes from rank {} (tag {})", bytes, peer, tag));
  auto lock = MpiRuntime::instance().lock();
  size_t off = 0;
  do {
    const size_t len = std::min(kMaxPiece, bytes - off);
    MPI_Request r;
    check_mpi(MPI_Irecv(static_cast<std::byte*>(buf) + off, static_cast<int>(len), MPI_BYTE, peer,
                        static_cast<int>(tag), comm_, &r),
              "MPI_Irecv", rank_);
    req->reqs.push_back(r);
    req->expect_bytes.push_back(static_cast<long long>(len));
    off += len;
  } while (off < bytes);
  return req;
}

std::optional<std::string> MpiTransport::lost_peer(std::span<const int> peers) {
  for (int q : peers) {
    const Peer& p = peers_[static_cast<size_t>(q)];
    if (!p.same_host || !process_gone(p.pid)) continue;
    std::string why = fmt::format("rank {} (pid {} on {}) is no longer running", q, p.pid, p.host);
    MpiRuntime::instance().mark_peer_lost(why);
    return why;
  }
  return std::nullopt;
}

std::shared_ptr<Transport> MpiTransport::split(int group, const std::vector<int>& members,
                                               uint64_t /*split_id*/, Deadline deadline) {
  const int key =
      static_cast<int>(std::find(members.begin(), members.end(), rank_) - members.begin());
  MPI_Comm sub = MPI_COMM_NULL;
  {
    // Blocking, but every rank has just finished the split's all-gather.
    auto lock = MpiRuntime::instance().lock();
    check_mpi(MPI_Comm_split(comm_, group < 0 ? MPI_UNDEFINED : group, key, &sub), "MPI_Comm_split",
              rank_);
  }
  if (sub == MPI_COMM_NULL) return nullptr;
  std::shared_ptr<MpiTransport> t;
  try {
    t = create(sub, options_, deadline);
  } catch (...) {
    auto lock = MpiRuntime::instance().lock();
    MPI_Comm_free(&sub);
    throw;
  }
  auto lock = MpiRuntime::instance().lock();
  MPI_Comm_free(&sub);
  return t;
}

SharedArena* MpiTransport::arena() {
  return arena_.get();
}

int MpiTransport::ranks_on_node() const {
  return static_cast<int>(
      std::count_if(peers_.begin(), peers_.end(), [](const Peer& p) { return p.same_host; }));
}

std::vector<int> MpiTransport::node_of() const {
  // Ranks on the same host share memory (what MPI_Comm_split_type with
  // MPI_COMM_TYPE_SHARED groups by, as Open MPI decides it); numbered by first
  // appearance.
  std::vector<int> out;
  std::vector<std::string> hosts;
  for (const Peer& p : peers_) {
    auto it = std::find(hosts.begin(), hosts.end(), p.host);
    if (it == hosts.end()) {
      hosts.push_back(p.host);
      it = hosts.end() - 1;
    }
    out.push_back(static_cast<int>(it - hosts.begin()));
  }
  return out;
}

void MpiTransport::mark_broken(const std::string& /*why*/) {
  broken_ = true;
}

// ---- factory ----------------------------------------------------------------------

std::unique_ptr<Communicator> make_mpi_communicator(CommOptions options, MpiOptions mpi) {
  MpiRuntime::instance();
  auto t = MpiTransport::create(MPI_COMM_WORLD, mpi, CommClock::now() + options.timeout);
  return std::make_unique<Communicator>(std::move(t), std::move(options));
}

}  // namespace mt
