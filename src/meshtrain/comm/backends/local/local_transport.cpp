#include "meshtrain/comm/backends/local/local_transport.h"

#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include "meshtrain/base/error.h"
#include "meshtrain/comm/shm_channel.h"

namespace mt {

// Plain heap memory stands in for a node-shared window: threads share an
// address space, so the shared_memory algorithms run unchanged.
class LocalArena : public SharedArena {
 public:
  LocalArena(int size, size_t data_bytes)
      : size_(size),
        data_bytes_(data_bytes),
        stride_(kControlBytes + data_bytes),
        base_(
            static_cast<std::byte*>(std::aligned_alloc(64, stride_ * static_cast<size_t>(size)))) {
    if (base_ == nullptr) {
      throw CommError(
          fmt::format("local shared arena: out of memory allocating {} x {} bytes", size, stride_));
    }
    std::memset(base_, 0, stride_ * static_cast<size_t>(size));
    for (int r = 0; r < size; ++r) comm::ShmChannel::construct(region(r), data_bytes, getpid());
  }
  ~LocalArena() override { std::free(base_); }
  int size() const override { return size_; }
  std::byte* region(int rank) const override { return base_ + static_cast<size_t>(rank) * stride_; }
  size_t data_bytes() const override { return data_bytes_; }

 private:
  int size_;
  size_t data_bytes_;
  size_t stride_;
  std::byte* base_;
};

// ---- LocalFabric ----------------------------------------------------------------

LocalFabric::LocalFabric(int world_size, size_t shm_bytes_per_rank)
    : world_size_(world_size),
      shm_bytes_(shm_bytes_per_rank / 64 * 64),
      ended_(static_cast<size_t>(world_size)),
      ended_flag_(new std::atomic<int>[static_cast<size_t>(world_size)]) {
  for (int r = 0; r < world_size; ++r) {
    boxes_.push_back(std::make_unique<Mailbox>());
    ended_flag_[static_cast<size_t>(r)].store(0);
  }
  world_ = std::make_shared<Group>();
  world_->ctx = 0;
  for (int r = 0; r < world_size; ++r) world_->members.push_back(r);
  if (shm_bytes_ > 0) world_->arena = std::make_unique<LocalArena>(world_size, shm_bytes_);
}

LocalFabric::~LocalFabric() = default;

std::shared_ptr<LocalFabric::Group> LocalFabric::find_or_create_group(
    uint64_t parent_ctx, uint64_t split_id, int group, const std::vector<int>& world_members) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& slot = groups_[{parent_ctx, split_id, group}];
  if (!slot) {
    slot = std::make_shared<Group>();
    slot->ctx = next_ctx_++;
    slot->members = world_members;
    if (shm_bytes_ > 0) {
      slot->arena =
          std::make_unique<LocalArena>(static_cast<int>(world_members.size()), shm_bytes_);
    }
  }
  MT_CHECK(slot->members == world_members, "split {} group {}: members differ between ranks",
           split_id, group);
  return slot;
}

void LocalFabric::rank_ended(int world_rank, const std::string& error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ended_[static_cast<size_t>(world_rank)] =
        error.empty() ? std::string("its thread returned")
                      : fmt::format("its thread ended with an error: {}", error);
  }
  ended_flag_[static_cast<size_t>(world_rank)].store(1, std::memory_order_release);
}

std::optional<std::string> LocalFabric::ended(int world_rank) const {
  if (ended_flag_[static_cast<size_t>(world_rank)].load(std::memory_order_acquire) == 0) {
    return std::nullopt;
  }
  std::lock_guard<std::mutex> lock(mu_);
  return ended_[static_cast<size_t>(world_rank)];
}

// ---- requests ----------------------------------------------------------------------

namespace {

class DoneRequest : public TransportRequest {
 public:
  explicit DoneRequest(std::string error = {}) : error_(std::move(error)) {}
  bool test() override {
    if (!error_.empty()) throw CommError(error_);
    return true;
  }

 private:
  std::string error_;
};

class PostedRecvRequest : public TransportRequest {
 public:
  PostedRecvRequest(LocalFabric::Mailbox& box, std::shared_ptr<LocalFabric::RecvState> state)
      : box_(box), state_(std::move(state)) {}
  ~PostedRecvRequest() override {
    if (state_->done.load(std::memory_order_acquire)) return;
    // Withdraw the receive so no sender writes into a buffer that is gone.
    std::lock_guard<std::mutex> lock(box_.mu);
    for (auto it = box_.posted.begin(); it != box_.posted.end(); ++it) {
      if (it->state == state_) {
        box_.posted.erase(it);
        break;
      }
    }
  }
  bool test() override {
    if (!state_->done.load(std::memory_order_acquire)) return false;
    if (!state_->error.empty()) throw CommError(state_->error);
    return true;
  }

 private:
  LocalFabric::Mailbox& box_;
  std::shared_ptr<LocalFabric::RecvState> state_;
};

std::string size_mismatch(int src, uint32_t tag, size_t sent, size_t posted) {
  return fmt::format("message from rank {} (tag {}) has {} bytes but the receive expects {}", src,
                     tag, sent, posted);
}

}  // namespace

// ---- LocalTransport --------------------------------------------------------------------

LocalTransport::LocalTransport(std::shared_ptr<LocalFabric> fabric,
                               std::shared_ptr<LocalFabric::Group> group, int rank)
    : fabric_(std::move(fabric)), group_(std::move(group)), rank_(rank) {}

std::unique_ptr<TransportRequest> LocalTransport::isend(int peer, uint32_t tag, const void* buf,
                                                        size_t bytes) {
  LocalFabric::Mailbox& box = fabric_->mailbox(group_->members[static_cast<size_t>(peer)]);
  std::lock_guard<std::mutex> lock(box.mu);
  for (auto it = box.posted.begin(); it != box.posted.end(); ++it) {
    if (it->ctx != group_->ctx || it->src != rank_ || it->tag != tag) continue;
    if (it->bytes != bytes) {
      it->state->error = size_mismatch(rank_, tag, bytes, it->bytes);
    } else if (bytes > 0) {
      std::memcpy(it->buf, buf, bytes);
    }
    it->state->done.store(true, std::memory_order_release);
    box.posted.erase(it);
    return std::make_unique<DoneRequest>();
  }
  LocalFabric::Message m{group_->ctx, rank_, tag, std::vector<std::byte>(bytes)};
  if (bytes > 0) std::memcpy(m.data.data(), buf, bytes);
  box.unexpected.push_back(std::move(m));
  return std::make_unique<DoneRequest>();
}

std::unique_ptr<TransportRequest> LocalTransport::irecv(int peer, uint32_t tag, void* buf,
                                                        size_t bytes) {
  LocalFabric::Mailbox& box = fabric_->mailbox(group_->members[static_cast<size_t>(rank_)]);
  std::lock_guard<std::mutex> lock(box.mu);
  for (auto it = box.unexpected.begin(); it != box.unexpected.end(); ++it) {
    if (it->ctx != group_->ctx || it->src != peer || it->tag != tag) continue;
    std::string error;
    if (it->data.size() != bytes) {
      error = size_mismatch(peer, tag, it->data.size(), bytes);
    } else if (bytes > 0) {
      std::memcpy(buf, it->data.data(), bytes);
    }
    box.unexpected.erase(it);
    return std::make_unique<DoneRequest>(std::move(error));
  }
  auto state = std::make_shared<LocalFabric::RecvState>();
  box.posted.push_back({group_->ctx, peer, tag, buf, bytes, state});
  return std::make_unique<PostedRecvRequest>(box, std::move(state));
}

std::optional<std::string> LocalTransport::lost_peer(std::span<const int> peers) {
  for (int q : peers) {
    const int w = group_->members[static_cast<size_t>(q)];
    if (auto why = fabric_->ended(w)) {
      return fmt::format("rank {} (local world rank {}) is gone: {}", q, w, *why);
    }
  }
  return std::nullopt;
}

std::shared_ptr<Transport> LocalTransport::split(int group, const std::vector<int>& members,
                                                 uint64_t split_id, Deadline /*deadline*/) {
  if (group < 0) return nullptr;
  std::vector<int> world_members;
  int my_index = -1;
  for (size_t i = 0; i < members.size(); ++i) {
    world_members.push_back(group_->members[static_cast<size_t>(members[i])]);
    if (members[i] == rank_) my_index = static_cast<int>(i);
  }
  MT_CHECK(my_index >= 0, "rank {} is not in the members of its own group {}", rank_, group);
  auto g = fabric_->find_or_create_group(group_->ctx, split_id, group, world_members);
  return std::make_shared<LocalTransport>(fabric_, std::move(g), my_index);
}

SharedArena* LocalTransport::arena() {
  return group_->arena.get();
}

}  // namespace mt
