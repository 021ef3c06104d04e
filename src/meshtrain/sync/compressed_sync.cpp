// All-reduce data parallelism with a gradient codec (sync/local_steps.h,
// make_compressed_sync): the gradients of each step go through one
// CompressedAllReduce per parameter (sync/compressed_all_reduce.h); under
// ZeRO 1-3 through one CompressedReduceScatter per bucket
// (sync/compressed_reduce_scatter.h).
#include <fmt/format.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/base/error.h"
#include "meshtrain/comm/backends/self/self_transport.h"
#include "meshtrain/sync/codecs.h"
#include "meshtrain/sync/compressed_all_reduce.h"
#include "meshtrain/sync/compressed_reduce_scatter.h"
#include "meshtrain/sync/data_parallel_sync.h"
#include "meshtrain/sync/local_steps.h"

namespace mt {

namespace {

class CompressedSync : public DataParallelSync {
 public:
  CompressedSync(const SyncOptions& o, Communicator& group, ParamLayout layout, Tensor flat,
                 DataParallelOptions dp, double share)
      : group_(group),
        self_(make_self_communicator()),
        local_(*self_, layout, std::move(flat), dp),
        ranks_(static_cast<double>(group.size())) {
    (void)share;  // the trainer's weights already carry it (see begin_micro_step)
    CompressedAllReduceOptions co;
    co.codec = parse_codec_spec(o.codec);
    co.codec.error_feedback = o.codec_error_feedback;
    co.collective = dp.collective;
    for (const ParamLayoutEntry& e : layout) {
      exchanges_.push_back(std::make_unique<CompressedAllReduce>(group_, e.name, e.shape, co));
    }
    options_ = o;
    exchange_options_ = co;
    for (const ParamLayoutEntry& e : layout) params_.emplace_back(e.name, e.shape);
    momentum_ = static_cast<float>(o.codec_momentum);
    nesterov_ = o.codec_nesterov;
    masking_ = o.codec_momentum_masking;
    if (momentum_ > 0) {
      for (const ParamLayoutEntry& e : layout) {
        velocity_.emplace_back(static_cast<size_t>(e.shape.numel()), 0.0f);
      }
    }
  }

  // The trainer's weight w is this micro-batch's share of the global batch;
  // times the rank count, each rank's gradient is n x (its share of the
  // global gradient), so the exchange's average over ranks is the global
  // batch's gradient for any batch shares.
  void begin_micro_step(double w) override { local_.begin_micro_step(w * ranks_); }
  std::function<void(std::span<double>)> norm_reducer() override { return {}; }

  void step(const std::function<void(std::span<ParamSlice>)>& update) override {
    local_.step([&](std::span<ParamSlice> s) {
      MT_CHECK_EQ(s.size(), exchanges_.size());
      warm_up();
      if (options_.powersgd_batched) {
        batched_powersgd(s);
        update(s);
        return;
      }
      for (size_t i = 0; i < s.size(); ++i) {
        const auto n = static_cast<size_t>(s[i].grad.numel());
        std::span<float> g(s[i].grad.data<float>(), n);
        if (momentum_ > 0) {
          correct_momentum(i, g);
        } else {
          exchange(i).run(g, g);  // in place: the average of what every rank sent
        }
      }
      ++steps_;
      update(s);
    });
  }

  DataParallelMemory memory(int kinds, int64_t optimizer_bytes) const override {
    DataParallelMemory m = local_.memory(kinds, optimizer_bytes);
    int64_t residual = 0;
    for (const auto& x : exchanges_) residual += static_cast<int64_t>(x->residual().size()) * 4;
    // A sparsity warm-up's stage holds a second residual while it lasts;
    // momentum correction a velocity per parameter.
    if (options_.codec_warmup_steps > 0) residual *= 2;
    for (const auto& u : velocity_) residual += static_cast<int64_t>(u.size()) * 4;
    m.world_size = group_.size();
    m.staging_bytes += residual;
    m.expected_buffer_bytes += residual;
    return m;
  }
  std::string name() const override {
    return "allreduce+" + exchanges_.front()->options().codec.to_string();
  }
  uint64_t bytes_sent() const override { return sync_bytes_sent(group_); }

  // Checkpoints: the parameters and optimizer state are whole (identical
  // replicas); each rank's row holds its exchanges' state (residuals,
  // PowerSGD's Q) and run counts (stochastic codecs' seeds), step() calls,
  // and DGC's velocity. The sparsity warm-up's stage is rebuilt from the
  // step count at the next step, taking over the restored state.
  RankCheckpoint rank_checkpoint() const override { return RankCheckpoint::kRanks; }

  void prepare_checkpoint() override {
    float* x = codec_state().data<float>();
    int64_t* c = counters().data<int64_t>();
    c[0] = steps_;
    for (size_t i = 0; i < exchanges_.size(); ++i) {
      const CompressedAllReduce& e = exchange(i);
      const size_t m = e.state_numel();
      e.save_state({x, m});
      x += m;
      c[1 + i] = static_cast<int64_t>(e.steps());
    }
    if (!velocity_.empty()) {
      float* v = velocity_state().data<float>();
      for (const auto& u : velocity_) v = std::copy(u.begin(), u.end(), v);
    }
  }

  std::vector<StatePiece> checkpoint_state() override {
    const int r = group_.rank(), n = group_.size();
    std::vector<StatePiece> out = {{"allreduce.counters", r, n, counters()},
                                   {"codec.state", r, n, codec_state()}};
    if (!velocity_.empty()) out.push_back({"codec.velocity", r, n, velocity_state()});
    return out;
  }

  void restore_checkpoint(int64_t step, bool with_state) override {
    warm_.clear();
    if (!with_state) {
      // A checkpoint without this codec's state: residuals and velocity
      // start at zero, the warm-up's stage follows the step.
      steps_ = step;
      return;
    }
    const int64_t* c = counters().data<int64_t>();
    if (c[0] != step) {
      throw CheckpointError(fmt::format(
          "sync.codec = \"{}\": the checkpoint's codec state is at step {}, its metadata says "
          "step {}",
          options_.codec, c[0], step));
    }
    steps_ = c[0];
    const float* x = codec_state().data<float>();
    for (size_t i = 0; i < exchanges_.size(); ++i) {
      const size_t m = exchanges_[i]->state_numel();
      exchanges_[i]->load_state({x, m}, static_cast<uint64_t>(c[1 + i]));
      x += m;
    }
    if (!velocity_.empty()) {
      const float* v = velocity_state().data<float>();
      for (auto& u : velocity_) {
        std::copy(v, v + u.size(), u.begin());
        v += u.size();
      }
    }
  }

 protected:
  DataParallel& dp() override { return local_; }
  const DataParallel& dp() const override { return local_; }

 private:
  // Checkpoint buffers (checkpoint_state()'s views), made at first use.
  Tensor& counters() {
    if (!counters_.defined()) {
      counters_ = Tensor::zeros({1 + static_cast<int64_t>(exchanges_.size())}, DType::i64);
    }
    return counters_;
  }
  Tensor& codec_state() {
    if (!codec_state_.defined()) {
      size_t m = 0;
      for (const auto& e : exchanges_) m += e->state_numel();
      codec_state_ = Tensor::zeros({static_cast<int64_t>(m)}, DType::f32);
    }
    return codec_state_;
  }
  Tensor& velocity_state() {
    if (!velocity_state_.defined()) {
      size_t m = 0;
      for (const auto& u : velocity_) m += u.size();
      velocity_state_ = Tensor::zeros({static_cast<int64_t>(m)}, DType::f32);
    }
    return velocity_state_;
  }

  // Deep Gradient Compression's momentum correction (SyncOptions::
  // codec_momentum): the velocity u = m u + g goes into the codec (Nesterov:
  // g + m u), so the residual accumulates velocity; with masking, u is zeroed
  // at the k coordinates the codec sends -- the k largest |residual + x|,
  // the codec's own choice (top_k_indices, sync/codecs.h). g is replaced by
  // the average of what every rank sent.
  // PowerSGD with every tensor's P (and the tensors sent whole) in one
  // all-reduce and every Q in another (SyncOptions::powersgd_batched).
  void batched_powersgd(std::span<ParamSlice> s) {
    const CollectiveOptions& co = exchanges_.front()->options().collective;
    std::vector<std::span<float>> part(s.size());
    const auto all_reduce = [&](bool low_rank_only) {
      size_t total = 0;
      for (size_t i = 0; i < s.size(); ++i) {
        if (!low_rank_only || exchanges_[i]->low_rank()) total += part[i].size();
      }
      if (total == 0) return;
      batch_.resize(total);
      size_t at = 0;
      for (size_t i = 0; i < s.size(); ++i) {
        if (low_rank_only && !exchanges_[i]->low_rank()) continue;
        std::copy(part[i].begin(), part[i].end(), batch_.begin() + static_cast<ptrdiff_t>(at));
        at += part[i].size();
      }
      group_.all_reduce(batch_.data(), batch_.data(), total, DType::f32, ReduceOp::avg, co);
      at = 0;
      for (size_t i = 0; i < s.size(); ++i) {
        if (low_rank_only && !exchanges_[i]->low_rank()) continue;
        std::copy_n(batch_.begin() + static_cast<ptrdiff_t>(at), part[i].size(), part[i].begin());
        at += part[i].size();
      }
    };
    for (size_t i = 0; i < s.size(); ++i) {
      const auto n = static_cast<size_t>(s[i].grad.numel());
      part[i] = exchanges_[i]->powersgd_project(std::span<const float>(s[i].grad.data<float>(), n));
    }
    all_reduce(false);
    for (size_t i = 0; i < s.size(); ++i) {
      if (exchanges_[i]->low_rank()) part[i] = exchanges_[i]->powersgd_back_project();
    }
    all_reduce(true);
    for (size_t i = 0; i < s.size(); ++i) {
      const auto n = static_cast<size_t>(s[i].grad.numel());
      exchanges_[i]->powersgd_expand(std::span<float>(s[i].grad.data<float>(), n));
      exchanges_[i]->powersgd_count_step();
    }
  }

  // The exchange of parameter i at this step: the warm-up stage's, or the
  // codec's own.
  CompressedAllReduce& exchange(size_t i) { return warm_.empty() ? *exchanges_[i] : *warm_[i]; }

  // Sparsity warm-up (SyncOptions::codec_warmup_steps): at a stage's first
  // step, one exchange per parameter at the stage's density takes over the
  // residual (and step count) of the one before; after the last stage the
  // codec's own exchanges take it back.
  void warm_up() {
    if (options_.codec_warmup_steps == 0) return;
    const bool warm = steps_ < options_.codec_warmup_steps;
    if (!warm && warm_.empty()) return;
    const double f = codec_warmup_fraction(options_, exchange_options_.codec.k_fraction, steps_);
    if (warm && !warm_.empty() && f == warm_fraction_) return;
    std::vector<std::unique_ptr<CompressedAllReduce>> next;
    if (warm) {
      CompressedAllReduceOptions co = exchange_options_;
      co.codec.k_fraction = f;
      for (const auto& [name, shape] : params_) {
        next.push_back(std::make_unique<CompressedAllReduce>(group_, name, shape, co));
      }
    }
    std::vector<float> state;
    for (size_t i = 0; i < exchanges_.size(); ++i) {
      const CompressedAllReduce& from = exchange(i);
      CompressedAllReduce& to = warm ? *next[i] : *exchanges_[i];
      state.resize(from.state_numel());
      from.save_state(state);
      to.load_state(state, from.steps());
    }
    warm_ = std::move(next);
    warm_fraction_ = f;
  }

  void correct_momentum(size_t i, std::span<float> g) {
    std::vector<float>& u = velocity_[i];
    const float m = momentum_;
    for (size_t j = 0; j < g.size(); ++j) {
      u[j] = m * u[j] + g[j];
      g[j] = nesterov_ ? g[j] + m * u[j] : u[j];
    }
    std::vector<uint32_t> sent;
    if (masking_) {
      const std::span<const float> r = exchange(i).residual();
      e_.resize(g.size());
      for (size_t j = 0; j < g.size(); ++j) e_[j] = r.empty() ? g[j] : r[j] + g[j];
      sent = top_k_indices(e_, exchange(i).options().codec.k_for(g.size()));
    }
    exchange(i).run(g, g);
    for (const uint32_t j : sent) u[j] = 0.0f;
  }

  Communicator& group_;
  std::unique_ptr<Communicator> self_;
  DataParallel local_;
  double ranks_ = 1;
  std::vector<std::unique_ptr<CompressedAllReduce>> exchanges_;
  SyncOptions options_;
  CompressedAllReduceOptions exchange_options_;
  std::vector<std::pair<std::string, Shape>> params_;
  int64_t steps_ = 0;                                       // step() calls
  std::vector<std::unique_ptr<CompressedAllReduce>> warm_;  // the warm-up stage's
  double warm_fraction_ = 0;
  float momentum_ = 0;
  bool nesterov_ = false;
  bool masking_ = true;
  std::vector<std::vector<float>> velocity_;        // per parameter, with codec_momentum
  std::vector<float> e_;                            // residual + x, to find what is sent
  std::vector<float> batch_;                        // powersgd_batched: the factors of every tensor
  Tensor counters_, codec_state_, velocity_state_;  // checkpoints (prepare_checkpoint())
};

// ZeRO stages 1-3 with a codec: DataParallel on the group as without one,
// each bucket's reduce-scatter replaced by a CompressedReduceScatter
// (sync/compressed_reduce_scatter.h: every destination's chunk encoded with
// its own residual, exchanged all-to-all, decoded and summed by its owner).
// The rest -- sharded optimizer state and gradients, the parameters'
// all-gather (f32), stage 3's gathers -- is ZeRO's own.
class ZeroCompressedSync : public DataParallelSync {
 public:
  ZeroCompressedSync(const SyncOptions& o, Communicator& group, ParamLayout layout, Tensor flat,
                     DataParallelOptions dp)
      : group_(group), dp_(group, std::move(layout), std::move(flat), with_hook(std::move(dp))) {
    CompressedAllReduceOptions co;
    co.codec = parse_codec_spec(o.codec);
    co.codec.error_feedback = o.codec_error_feedback;
    co.collective = collective_;
    const BucketPlan& plan = dp_.plan();
    if (group.size() > 1) {
      for (size_t b = 0; b < plan.buckets().size(); ++b) {
        exchanges_.push_back(std::make_unique<CompressedReduceScatter>(
            group_, fmt::format("bucket {} ({})", b, plan.bucket_params(static_cast<int>(b))),
            plan.buckets()[b].counts, co));
      }
    }
    codec_ = co.codec.to_string();
  }

  DataParallelMemory memory(int kinds, int64_t optimizer_bytes) const override {
    DataParallelMemory m = dp_.memory(kinds, optimizer_bytes);
    int64_t held = 0;  // residuals of every chunk, and the payload buffers
    for (const auto& x : exchanges_) held += static_cast<int64_t>(x->residual_numel()) * 4;
    m.staging_bytes += held;
    m.expected_buffer_bytes += held;
    return m;
  }
  std::string name() const override { return "allreduce+" + codec_; }
  uint64_t bytes_sent() const override { return sync_bytes_sent(group_); }

  // Checkpoints: ZeRO's shards are saved as without a codec; each rank's
  // row holds its buckets' chunk residuals (and codec state) and the run
  // count (the stochastic codecs' seeds; every bucket runs once a step).
  RankCheckpoint rank_checkpoint() const override {
    return exchanges_.empty() ? RankCheckpoint::kNone : RankCheckpoint::kRanks;
  }

  void prepare_checkpoint() override {
    float* x = state().data<float>();
    for (const auto& e : exchanges_) {
      const size_t m = e->state_numel();
      e->save_state({x, m});
      x += m;
    }
    counters().data<int64_t>()[0] = static_cast<int64_t>(exchanges_.front()->steps());
  }

  std::vector<StatePiece> checkpoint_state() override {
    if (exchanges_.empty()) return {};
    const int r = group_.rank(), n = group_.size();
    return {{"zero.counters", r, n, counters()}, {"codec.state", r, n, state()}};
  }

  void restore_checkpoint(int64_t step, bool with_state) override {
    if (!with_state || exchanges_.empty()) return;  // residuals at zero
    const int64_t runs = counters().data<int64_t>()[0];
    const float* x = state().data<float>();
    for (const auto& e : exchanges_) {
      const size_t m = e->state_numel();
      e->load_state({x, m}, static_cast<uint64_t>(runs));
      x += m;
    }
    (void)step;  // ZeRO's exchanges run once per step, skipped f16 steps included
  }
  std::vector<float> codec_residual() const override {
    // Each bucket's chunks in order are its flat range [begin, end).
    std::vector<float> r(static_cast<size_t>(dp_.plan().flat_numel()), 0.0f);
    const auto& buckets = dp_.plan().buckets();
    for (size_t b = 0; b < exchanges_.size(); ++b) {
      const std::vector<float> x = exchanges_[b]->residual();
      std::copy(x.begin(), x.end(), r.begin() + buckets[b].begin);
    }
    return r;
  }

 protected:
  DataParallel& dp() override { return dp_; }
  const DataParallel& dp() const override { return dp_; }

 private:
  DataParallelOptions with_hook(DataParallelOptions dp) {
    collective_ = dp.collective;
    dp.reduce_bucket = [this](int bucket, std::span<const float> g, std::span<float> chunk) {
      exchanges_[static_cast<size_t>(bucket)]->run(g, chunk);
    };
    return dp;
  }

  Tensor& counters() {
    if (!counters_.defined()) counters_ = Tensor::zeros({1}, DType::i64);
    return counters_;
  }
  Tensor& state() {
    if (!state_.defined()) {
      size_t m = 0;
      for (const auto& e : exchanges_) m += e->state_numel();
      state_ = Tensor::zeros({static_cast<int64_t>(std::max<size_t>(m, 1))}, DType::f32);
    }
    return state_;
  }

  Communicator& group_;
  CollectiveOptions collective_;
  std::vector<std::unique_ptr<CompressedReduceScatter>> exchanges_;
  DataParallel dp_;  // after exchanges_: its hook reads them
  std::string codec_;
  Tensor counters_, state_;  // checkpoints (prepare_checkpoint())
};

}  // namespace

std::unique_ptr<ReplicaSync> make_compressed_sync(const SyncOptions& o, Communicator& group,
                                                  ParamLayout layout, Tensor flat_params,
                                                  DataParallelOptions dp, double local_share) {
  if (dp.stage != 0) {
    if (o.codec_momentum > 0) {
      throw ConfigError(fmt::format(
          "sync.codec_momentum: momentum correction needs dist.zero_stage = 0 (each rank's whole "
          "velocity beside its whole gradient), got dist.zero_stage = {}",
          dp.stage));
    }
    if (o.powersgd_batched) {
      throw ConfigError(fmt::format(
          "sync.powersgd_batched: PowerSGD needs dist.zero_stage = 0, got dist.zero_stage = {}",
          dp.stage));
    }
    if (o.codec_warmup_steps > 0) {
      throw ConfigError(fmt::format(
          "sync.codec_warmup_steps: the sparsity warm-up needs dist.zero_stage = 0 (the "
          "per-parameter top-k all-reduce), got dist.zero_stage = {}",
          dp.stage));
    }
    if (layout.empty()) throw ConfigError("sync.codec: the model has no parameters");
    return std::make_unique<ZeroCompressedSync>(o, group, std::move(layout), std::move(flat_params),
                                                std::move(dp));
  }
  if (layout.empty()) throw ConfigError("sync.codec: the model has no parameters");
  return std::make_unique<CompressedSync>(o, group, std::move(layout), std::move(flat_params),
                                          std::move(dp), local_share);
}

}  // namespace mt
