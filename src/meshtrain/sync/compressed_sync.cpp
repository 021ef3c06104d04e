// All-reduce data parallelism with a gradient codec (sync/local_steps.h,
// make_compressed_sync): the gradients of each step go through one
// CompressedAllReduce per parameter (sync/compressed_all_reduce.h).
#include <fmt/format.h>

#include <memory>
#include <vector>

#include "meshtrain/base/error.h"
#include "meshtrain/comm/backends/self/self_transport.h"
#include "meshtrain/sync/compressed_all_reduce.h"
#include "meshtrain/sync/local_steps.h"

namespace mt {

namespace {

class CompressedSync : public ReplicaSync {
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
  }

  void attach(Executor& exec, const Graph& graph) override { local_.attach(exec, graph); }
  // The trainer's weight w is this micro-batch's share of the global batch;
  // times the rank count, each rank's gradient is n x (its share of the
  // global gradient), so the exchange's average over ranks is the global
  // batch's gradient for any batch shares.
  void begin_micro_step(double w) override { local_.begin_micro_step(w * ranks_); }
  void end_micro_step() override { local_.end_micro_step(); }
  std::span<ParamSlice> slices() override { return local_.slices(); }
  std::function<void(std::span<double>)> norm_reducer() override { return {}; }

  void step(const std::function<void(std::span<ParamSlice>)>& update) override {
    local_.step([&](std::span<ParamSlice> s) {
      MT_CHECK_EQ(s.size(), exchanges_.size());
      for (size_t i = 0; i < s.size(); ++i) {
        const auto n = static_cast<size_t>(s[i].grad.numel());
        std::span<float> g(s[i].grad.data<float>(), n);
        exchanges_[i]->run(g, g);  // in place: the average of what every rank sent
      }
      update(s);
    });
  }

  void gather_params(Tensor& flat_out) override { local_.gather_params(flat_out); }
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
    int64_t residual = 0;
    for (const auto& x : exchanges_) residual += static_cast<int64_t>(x->residual().size()) * 4;
    m.world_size = group_.size();
    m.staging_bytes += residual;
    m.expected_buffer_bytes += residual;
    return m;
  }
  DataParallelStats stats() const override { return local_.stats(); }
  void reset_stats() override { local_.reset_stats(); }
  std::string name() const override {
    return "allreduce+" + exchanges_.front()->options().codec.to_string();
  }
  uint64_t bytes_sent() const override { return sync_bytes_sent(group_); }

 private:
  Communicator& group_;
  std::unique_ptr<Communicator> self_;
  DataParallel local_;
  double ranks_ = 1;
  std::vector<std::unique_ptr<CompressedAllReduce>> exchanges_;
};

}  // namespace

std::unique_ptr<ReplicaSync> make_compressed_sync(const SyncOptions& o, Communicator& group,
                                                  ParamLayout layout, Tensor flat_params,
                                                  DataParallelOptions dp, double local_share) {
  if (dp.stage != 0) {
    // ZeRO 1-2 reduce-scatter each bucket's gradient so a rank holds only
    // its shard of the sum; the codecs' exchanges (an all-gather of
    // payloads, PowerSGD's two all-reduces) leave the whole average on every
    // rank and the residual is a whole-gradient buffer, so sharding would
    // save nothing. A compressed reduce-scatter (each piece encoded for its
    // owner, exchanged all-to-all, as ZeRO++'s quantized gradients) is not
    // implemented.
    throw ConfigError(fmt::format(
        "sync.codec = \"{}\" with dist.zero_stage = {}: the compressed exchange leaves the "
        "whole averaged gradient on every rank (no compressed reduce-scatter yet), so ZeRO's "
        "sharded gradients would save nothing; dist.zero_stage must be 0 (got {}), or drop "
        "sync.codec",
        o.codec, dp.stage, dp.stage));
  }
  if (layout.empty()) throw ConfigError("sync.codec: the model has no parameters");
  return std::make_unique<CompressedSync>(o, group, std::move(layout), std::move(flat_params),
                                          std::move(dp), local_share);
}

}  // namespace mt
