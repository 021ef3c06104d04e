#include "meshtrain/sync/local_steps.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>

#include "meshtrain/base/error.h"
#include "meshtrain/comm/backends/self/self_transport.h"
#include "meshtrain/tensor/memory_stats.h"

namespace mt {

namespace {

class LocalStepsSync : public ReplicaSync {
 public:
  LocalStepsSync(const SyncOptions& o, Communicator& group, ParamLayout layout, Tensor flat,
                 DataParallelOptions dp, double share)
      : o_(o),
        group_(group),
        self_(make_self_communicator()),
        local_(*self_, std::move(layout), flat, std::move(dp)),
        flat_(std::move(flat)),
        share_(share) {
    n_ = static_cast<size_t>(flat_.numel());
    MemoryScope tag(MemoryCategory::comm);
    if (o_.scheme == "diloco") {
      start_ = flat_.clone();
      momentum_ = Tensor::zeros({flat_.numel()}, DType::f32);
    }
    if (o_.scheme == "gossip") {
      neighbours_ = gossip_neighbours(o_.topology, group_.rank(), group_.size());
      const int64_t deg = static_cast<int64_t>(neighbours_.size());
      send_ = Tensor::empty({std::max<int64_t>(deg, 1) * flat_.numel()}, DType::f32);
      recv_ = Tensor::empty({std::max<int64_t>(deg, 1) * flat_.numel()}, DType::f32);
    }
  }

  void attach(Executor& exec, const Graph& graph) override { local_.attach(exec, graph); }
  // Each replica's gradient is the mean over its own examples: the trainer's
  // weight (a share of the global batch) divided by this rank's share.
  void begin_micro_step(double w) override { local_.begin_micro_step(w / share_); }
  void end_micro_step() override { local_.end_micro_step(); }
  std::span<ParamSlice> slices() override { return local_.slices(); }
  std::function<void(std::span<double>)> norm_reducer() override { return {}; }

  void step(const std::function<void(std::span<ParamSlice>)>& update) override {
    local_.step(update);
    ++steps_;
    if (group_.size() == 1) return;
    if (o_.scheme == "local_sgd") {
      if (steps_ <= o_.sync_until || steps_ % o_.period == 0) average_in_place();
    } else if (o_.scheme == "diloco") {
      if (steps_ % o_.period == 0) outer_step();
    } else {
      mix();
    }
  }

  // This replica's own parameters.
  void gather_params(Tensor& flat_out) override { copy(flat_, flat_out); }
  void average_into(Tensor& flat_out) override {
    const uint64_t before = sync_bytes_sent(group_);
    weighted_sum(flat_, flat_out);
    side_bytes_ += sync_bytes_sent(group_) - before;
  }

  Consensus consensus() override {
    if (group_.size() == 1) return {};
    const uint64_t before = sync_bytes_sent(group_);
    MemoryScope tag(MemoryCategory::comm);
    Tensor mean = Tensor::empty({flat_.numel()}, DType::f32);
    weighted_sum(flat_, mean);
    double sums[2] = {0, 0};  // ||theta_r - mean||^2 over ranks, ||mean||^2 (once)
    const float* a = flat_.data<float>();
    const float* m = mean.data<float>();
    for (size_t i = 0; i < n_; ++i) {
      const double d = static_cast<double>(a[i]) - m[i];
      sums[0] += d * d;
      if (group_.rank() == 0) sums[1] += static_cast<double>(m[i]) * m[i];
    }
    group_.all_reduce(sums, sums, 2, DType::f64, ReduceOp::sum, opts());
    side_bytes_ += sync_bytes_sent(group_) - before;
    Consensus c;
    c.distance = std::sqrt(sums[0] / group_.size());
    c.relative = sums[1] > 0 ? c.distance / std::sqrt(sums[1]) : 0.0;
    return c;
  }

  std::vector<ShardPiece> param_pieces(PieceUse use) override { return local_.param_pieces(use); }
  std::vector<ShardPiece> state_pieces(const std::map<std::string, Tensor>& state,
                                       PieceUse use) const override {
    return local_.state_pieces(state, use);
  }
  std::vector<ShardPiece> new_state_pieces(std::span<const std::string> kinds) const override {
    return local_.new_state_pieces(kinds);
  }
  DataParallelMemory memory(int kinds, int64_t optimizer_bytes) const override {
    DataParallelMemory m = local_.memory(kinds, optimizer_bytes);
    const int64_t extra = 4 * (start_.numel() + momentum_.numel() + send_.numel() + recv_.numel());
    m.world_size = group_.size();
    m.staging_bytes += extra;
    m.expected_buffer_bytes += extra;
    return m;
  }
  DataParallelStats stats() const override { return local_.stats(); }
  void reset_stats() override { local_.reset_stats(); }
  std::string name() const override { return o_.scheme; }
  bool replicas_identical() const override { return group_.size() == 1; }
  // The scheme's own traffic: measurements (consensus, the averages taken
  // for evaluation) left out.
  uint64_t bytes_sent() const override { return sync_bytes_sent(group_) - side_bytes_; }

 private:
  SyncOptions o_;
  Communicator& group_;
  std::unique_ptr<Communicator> self_;
  DataParallel local_;
  Tensor flat_;
  size_t n_ = 0;
  double share_ = 1;
  int64_t steps_ = 0;
  Tensor start_, momentum_;  // diloco
  std::vector<int> neighbours_;
  Tensor send_, recv_;       // gossip
  uint64_t side_bytes_ = 0;  // sent by consensus() and average_into()

  const CollectiveOptions& opts() const { return local_.options().collective; }

  void copy(const Tensor& from, Tensor& to) const {
    MT_CHECK(to.numel() >= from.numel() && to.dtype() == DType::f32, "parameter buffer {}",
             to.desc());
    std::memcpy(to.raw(), from.raw(), n_ * sizeof(float));
  }

  // out = sum over ranks of share_r * x_r (the batch-weighted mean).
  void weighted_sum(const Tensor& x, Tensor& out) {
    const float* a = x.data<float>();
    float* o = out.data<float>();
    const auto s = static_cast<float>(share_);
    for (size_t i = 0; i < n_; ++i) o[i] = s * a[i];
    group_.all_reduce(o, o, n_, DType::f32, ReduceOp::sum, opts());
  }

  void average_in_place() { weighted_sum(flat_, flat_); }

  void outer_step() {
    float* theta = flat_.data<float>();
    float* start = start_.data<float>();
    float* v = momentum_.data<float>();
    // Pseudo-gradient, weighted and summed over replicas, in flat_'s memory.
    for (size_t i = 0; i < n_; ++i) theta[i] = start[i] - theta[i];
    weighted_sum(flat_, flat_);
    const auto mu = static_cast<float>(o_.outer_momentum);
    const auto lr = static_cast<float>(o_.outer_lr);
    for (size_t i = 0; i < n_; ++i) {
      const float d = theta[i];
      v[i] = mu * v[i] + d;
      start[i] -= lr * (d + mu * v[i]);  // Nesterov
      theta[i] = start[i];
    }
  }

  void mix() {
    const int n = group_.size();
    std::vector<size_t> counts(static_cast<size_t>(n), 0);
    float* send = send_.data<float>();
    size_t at = 0;
    for (int q : neighbours_) {  // ascending: blocks in destination order
      counts[static_cast<size_t>(q)] = n_;
      std::memcpy(send + at, flat_.raw(), n_ * sizeof(float));
      at += n_;
    }
    group_.all_to_allv(send, counts, recv_.raw(), counts, DType::f32, opts());
    float* theta = flat_.data<float>();
    const float* recv = recv_.data<float>();
    const auto w = static_cast<float>(1.0 / static_cast<double>(neighbours_.size() + 1));
    for (size_t i = 0; i < n_; ++i) {
      float sum = theta[i];
      for (size_t k = 0; k < neighbours_.size(); ++k) sum += recv[k * n_ + i];
      theta[i] = sum * w;
    }
  }
};

}  // namespace

std::unique_ptr<ReplicaSync> make_local_steps_sync(const SyncOptions& o, Communicator& group,
                                                   ParamLayout layout, Tensor flat_params,
                                                   DataParallelOptions dp, double local_share) {
  if (dp.stage != 0) {
    throw ConfigError(fmt::format(
        "sync.scheme = \"{}\": every replica steps on its own whole parameters, so "
        "dist.zero_stage must be 0 (got {}); ZeRO shards run with sync.scheme = \"allreduce\"",
        o.scheme, dp.stage));
  }
  if (!(local_share > 0 && local_share <= 1)) {
    throw ConfigError(fmt::format("sync.scheme = \"{}\": this rank's share of the batch is {}",
                                  o.scheme, local_share));
  }
  return std::make_unique<LocalStepsSync>(o, group, std::move(layout), std::move(flat_params),
                                          std::move(dp), local_share);
}

}  // namespace mt
