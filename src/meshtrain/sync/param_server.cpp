// The parameter server (sync/param_server.h): the worker side as a
// ReplicaSync over a one-rank DataParallel (its buckets and gradient memory),
// the server side as serve(), a loop over Communicator::wait_any.
#include "meshtrain/sync/param_server.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <numeric>

#include "meshtrain/base/error.h"
#include "meshtrain/comm/backends/self/self_transport.h"
#include "meshtrain/sync/codecs.h"
#include "meshtrain/tensor/memory_stats.h"

namespace mt {

namespace {

constexpr uint32_t kPushTag = 11;
constexpr uint32_t kReplyTag = 12;
constexpr size_t kHeader = 6;  // int64 words in a header
constexpr size_t kHeaderBytes = kHeader * sizeof(int64_t);

enum PushKind : int64_t { kGrad = 1, kDone = 2 };
enum Status : int64_t { kOk = 0, kAbort = 1 };
enum Mode : int64_t { kBsp = 0, kAsp = 1, kSsp = 2 };
constexpr int64_t kFlagStraggler = 1;

const char* mode_name(int64_t m) {
  return m == kBsp ? "bsp" : m == kAsp ? "asp" : "ssp";
}

int64_t mode_of(const std::string& s) {
  return s == "bsp" ? kBsp : s == "asp" ? kAsp : kSsp;
}

double as_double(int64_t bits) {
  double d;
  std::memcpy(&d, &bits, sizeof d);
  return d;
}
int64_t bits_of(double d) {
  int64_t b;
  std::memcpy(&b, &d, sizeof b);
  return b;
}

class ParamServerSync : public ReplicaSync {
 public:
  ParamServerSync(const SyncOptions& o, Communicator& group, ParamLayout layout, Tensor flat,
                  DataParallelOptions dp, double share)
      : o_(o),
        group_(group),
        self_(make_self_communicator()),
        layout_(layout),
        local_(*self_, layout, flat, with_push_hook(dp)),
        flat_(std::move(flat)),
        share_(share),
        servers_(static_cast<int>(o.servers)),
        workers_(group.size() - static_cast<int>(o.servers)),
        shard_of_(ps_shards(layout_, servers_)),
        mode_(mode_of(o.ps_mode)) {
    const auto timeout = dp.collective.timeout.value_or(group.options().timeout);
    timeout_ = std::chrono::duration_cast<std::chrono::milliseconds>(timeout);
    shard_elems_.assign(static_cast<size_t>(servers_), 0);
    for (size_t i = 0; i < layout_.size(); ++i) {
      shard_elems_[static_cast<size_t>(shard_of_[i])] += layout_[i].shape.numel();
    }
    if (o_.ps_switch.starts_with("after:")) switch_after_ = std::stoll(o_.ps_switch.substr(6));
    setup_codecs();  // before plan_pieces: a piece's bytes are its parameters' push bytes
    plan_pieces();
    MemoryScope tag(MemoryCategory::comm);
    if (is_server()) {
      const int j = server_index();
      const size_t msg = message_bytes(j);
      inbox_ = Tensor::empty({static_cast<int64_t>(push_bytes(j)) * workers_}, DType::u8);
      outbox_ = Tensor::empty({static_cast<int64_t>(msg) * workers_}, DType::u8);
      acc_ =
          Tensor::zeros({std::max<int64_t>(shard_elems_[static_cast<size_t>(j)], 1)}, DType::f32);
      size_t at = 0;
      for (const size_t i : order_[static_cast<size_t>(j)]) {
        const ParamLayoutEntry& e = layout_[i];
        ParamSlice s;
        s.name = e.name;
        s.full_shape = e.shape;
        s.begin = 0;
        s.end = e.shape.numel();
        s.param = Tensor::wrap(flat_.data<float>() + e.offset, e.shape, DType::f32);
        s.grad = Tensor::wrap(acc_.data<float>() + at, e.shape, DType::f32);
        at += static_cast<size_t>(e.shape.numel());
        server_slices_.push_back(std::move(s));
        server_params_.push_back(i);
      }
    } else {
      size_t total = 0, pushed = 0;
      for (int j = 0; j < servers_; ++j) {
        total += message_bytes(j);
        pushed += push_bytes(j);
      }
      push_ = Tensor::empty({static_cast<int64_t>(pushed)}, DType::u8);
      pull_ = Tensor::empty({static_cast<int64_t>(total)}, DType::u8);
      seen_.assign(static_cast<size_t>(servers_), 0);
    }
    clocks_.assign(static_cast<size_t>(workers_), 0);
  }

  // ---- worker ------------------------------------------------------------------

  void attach(Executor& exec, const Graph& graph) override { local_.attach(exec, graph); }
  // Each worker's gradient is the mean over its own examples (the trainer's
  // weight is a share of the global batch); BSP weighs it back by the share.
  void begin_micro_step(double w) override { local_.begin_micro_step(w / share_); }
  void end_micro_step() override { local_.end_micro_step(); }
  std::span<ParamSlice> slices() override { return local_.slices(); }
  std::function<void(std::span<double>)> norm_reducer() override { return {}; }

  // The optimizer runs on the servers: `update` is not called on a worker.
  void step(const std::function<void(std::span<ParamSlice>)>& /*update*/) override {
    local_.step([&](std::span<ParamSlice>) { exchange(kGrad); });
    ++steps_;
  }

  void finish() override {
    if (is_server() || finished_) return;
    finished_ = true;
    exchange(kDone);
  }

  void gather_params(Tensor& flat_out) override {
    MT_CHECK(flat_out.numel() >= flat_.numel(), "parameter buffer {}", flat_out.desc());
    if (flat_out.raw() != flat_.raw()) std::memcpy(flat_out.raw(), flat_.raw(), flat_.nbytes());
  }
  // A checkpoint's parameters and optimizer state are the servers' shards,
  // whole tensors (as all-reduce DP saves them); workers write none of
  // them (they hold the servers' final parameters after finish()).
  std::vector<ShardPiece> param_pieces(PieceUse use) override {
    if (use == PieceUse::load) return local_.param_pieces(use);
    std::vector<ShardPiece> out;
    for (const ParamSlice& s : server_slices_)
      out.push_back({s.name, s.full_shape, 0, s.end, s.param});
    return out;
  }
  // The optimizer state exists on servers only, for their shard.
  std::vector<ShardPiece> state_pieces(const std::map<std::string, Tensor>& state,
                                       PieceUse use) const override {
    return local_.state_pieces(state, use);
  }
  std::vector<ShardPiece> new_state_pieces(std::span<const std::string> kinds) const override {
    std::vector<ShardPiece> out;
    for (const ParamSlice& s : server_slices_) {
      for (const std::string& kind : kinds) {
        MemoryScope tag(MemoryCategory::optimizer);
        out.push_back(
            {s.name + "." + kind, s.full_shape, 0, s.end, Tensor::zeros(s.full_shape, DType::f32)});
      }
    }
    return out;
  }

  // Checkpoints (written after finish(): the servers are done serving).
  // Server rows "ps.server": version, BSP steps, mode, switch requested,
  // then each worker's pushes; worker rows "ps.worker": its steps, mode,
  // straggler seen, then each server's version of its last pull.
  RankCheckpoint rank_checkpoint() const override { return RankCheckpoint::kServers; }
  void prepare_checkpoint() override {
    std::vector<int64_t> c;
    if (is_server()) {
      c = {version_, bsp_steps_, mode_, switch_requested_ ? 1 : 0};
      c.insert(c.end(), clocks_.begin(), clocks_.end());
    } else {
      c = {steps_, mode_, straggler_seen_ ? 1 : 0};
      c.insert(c.end(), seen_.begin(), seen_.end());
      float* r = residuals().data<float>();
      for (const auto& e : encoders_) {  // the residual, then the codec's state (PowerSGD's Q)
        std::copy(e->residual().begin(), e->residual().end(), r);
        r += e->residual().size();
        std::copy(e->state().begin(), e->state().end(), r);
        r += e->state().size();
      }
    }
    std::memcpy(counters().raw(), c.data(), c.size() * sizeof(int64_t));
  }
  // With sync.codec a worker's error-feedback residuals (layout order) are
  // its row "ps.worker.residual", each followed by its codec's state
  // (PowerSGD's Q; its codecs' seeds follow its steps).
  std::vector<StatePiece> checkpoint_state() override {
    if (is_server()) return {{"ps.server", server_index(), servers_, counters()}};
    std::vector<StatePiece> out = {{"ps.worker", group_.rank(), workers_, counters()}};
    if (!encoders_.empty())
      out.push_back({"ps.worker.residual", group_.rank(), workers_, residuals()});
    return out;
  }
  void restore_checkpoint(int64_t step, bool with_state) override {
    if (!with_state) {
      // Another scheme's checkpoint: as if `step` steps had run in lock step.
      mode_ = switch_after_ > 0 && step >= switch_after_ ? kAsp : mode_of(o_.ps_mode);
      steps_ = version_ = bsp_steps_ = step;
      std::fill(seen_.begin(), seen_.end(), step);
      std::fill(clocks_.begin(), clocks_.end(), step);
      return;
    }
    const int64_t* c = counters().data<int64_t>();
    if (is_server()) {
      version_ = c[0];
      bsp_steps_ = c[1];
      mode_ = c[2];
      switch_requested_ = c[3] != 0;
      clocks_.assign(c + 4, c + 4 + workers_);
      return;
    }
    if (c[0] != step) {
      throw CheckpointError(fmt::format(
          "sync.scheme = \"ps\": worker rank {}'s saved state is at step {}, the checkpoint's "
          "metadata says step {}",
          group_.rank(), c[0], step));
    }
    steps_ = c[0];
    mode_ = c[1];
    straggler_seen_ = c[2] != 0;
    seen_.assign(c + 3, c + 3 + servers_);
    const float* r = residuals().data<float>();
    for (const auto& e : encoders_) {
      const size_t n = e->residual().size();
      e->set_residual({r, n});
      r += n;
      const size_t m = e->state().size();
      e->set_state({r, m});
      r += m;
    }
  }
  DataParallelMemory memory(int kinds, int64_t optimizer_bytes) const override {
    DataParallelMemory m = local_.memory(kinds, optimizer_bytes);
    int64_t extra = static_cast<int64_t>(inbox_.nbytes() + outbox_.nbytes() + acc_.nbytes() +
                                         push_.nbytes() + pull_.nbytes());
    // sync.codec: each encoder's residual and its scratch (e = grad + residual)
    for (const auto& e : encoders_) {
      extra += 4 * static_cast<int64_t>(2 * e->residual().size() + e->state().size());
    }
    m.world_size = group_.size();
    m.staging_bytes += extra;
    m.expected_buffer_bytes += extra;
    return m;
  }
  // wait_seconds: time in the exchange with the servers (pushes, replies).
  DataParallelStats stats() const override {
    DataParallelStats st = local_.stats();
    st.wait_seconds += exchange_seconds_;
    st.collectives += pushed_pieces_;  // pushes, one per bucket and server holding part of it
    st.overlapped += overlapped_pieces_;
    return st;
  }
  void reset_stats() override {
    local_.reset_stats();
    exchange_seconds_ = 0;
    pushed_pieces_ = overlapped_pieces_ = 0;
  }
  std::string name() const override {
    const std::string mode = o_.ps_switch.empty() ? o_.ps_mode : "bsp/switch=" + o_.ps_switch;
    if (codecs_.empty()) return fmt::format("ps+{}", mode);
    return fmt::format("ps+{}+{}", mode, parse_codec_spec(o_.codec).to_string());
  }
  std::vector<float> codec_residual() const override {
    std::vector<float> r;
    if (encoders_.empty()) return r;
    r.assign(static_cast<size_t>(flat_.numel()), 0.0F);
    for (size_t i = 0; i < layout_.size(); ++i) {
      const std::span<const float> x = encoders_[i]->residual();
      std::copy(x.begin(), x.end(), r.begin() + layout_[i].offset);
    }
    return r;
  }
  // Workers hold the parameters of their last pull, which differ under ASP
  // and SSP; after finish() every worker holds the servers' final ones.
  bool replicas_identical() const override { return false; }
  uint64_t bytes_sent() const override { return sync_bytes_sent(group_); }
  bool is_server() const override { return group_.rank() >= workers_; }
  bool lock_step() const override { return mode_ == kBsp; }
  void persistent_straggler() override {
    if (o_.ps_switch == "straggler") straggler_seen_ = true;
  }

  const std::vector<PsStepLog>& log() const { return log_; }
  std::vector<std::string> notices() const override { return notices_; }

  // ---- server ------------------------------------------------------------------

  void serve(const ServerUpdate& update) override;

 private:
  SyncOptions o_;
  Communicator& group_;
  std::unique_ptr<Communicator> self_;
  ParamLayout layout_;
  DataParallel local_;
  Tensor flat_;
  double share_ = 1;
  int servers_ = 1, workers_ = 1;
  std::vector<int> shard_of_;
  std::vector<int64_t> shard_elems_;
  int64_t mode_ = kBsp;
  int64_t switch_after_ = 0;
  std::chrono::milliseconds timeout_{0};
  int64_t steps_ = 0;
  bool finished_ = false;
  bool straggler_seen_ = false;
  double exchange_seconds_ = 0;
  std::vector<int64_t> seen_;  // worker: server j's version of the last pull
  std::vector<PsStepLog> log_;
  std::vector<std::string> notices_;
  Tensor push_, pull_;           // worker: one message per server, back to back
  Tensor inbox_, outbox_, acc_;  // server: one message per worker; BSP's sum
  std::vector<ParamSlice> server_slices_;
  std::vector<size_t> server_params_;  // layout indices of this server's shard (message order)
  // Pushes: server j's shard in message order (buckets in index order,
  // layout order inside a bucket), each parameter as its push bytes (f32,
  // or its codec's payload); its pieces, one per bucket holding part of it
  // (byte offset after the header and bytes, the parameters), sent as one
  // message each, the first with the header in front.
  struct Piece {
    size_t offset = 0, bytes = 0;
    std::vector<size_t> params;
  };
  std::vector<std::vector<size_t>> order_;
  std::vector<std::vector<Piece>> pieces_;
  std::vector<std::vector<int>> piece_of_bucket_;  // per server, per bucket: piece or -1
  std::vector<size_t> push_at_;                    // worker: server j's message in push_
  size_t total_pieces_ = 0;
  bool pushing_ = false;  // this step's headers are packed and pieces going out
  std::vector<CommHandle> sends_;
  int64_t pushed_pieces_ = 0, overlapped_pieces_ = 0;

  DataParallelOptions with_push_hook(DataParallelOptions dp) {
    dp.on_bucket_final = [this](int b, bool during_backward) { push_bucket(b, during_backward); };
    return dp;
  }

  void plan_pieces() {
    const BucketPlan& plan = local_.plan();
    const auto nb = plan.buckets().size();
    order_.assign(static_cast<size_t>(servers_), {});
    pieces_.assign(static_cast<size_t>(servers_), {});
    piece_of_bucket_.assign(static_cast<size_t>(servers_), std::vector<int>(nb, -1));
    for (size_t b = 0; b < nb; ++b) {
      const BucketInfo& info = plan.buckets()[b];
      for (int q = info.first_param; q <= info.last_param; ++q) {
        const auto i = static_cast<size_t>(q);
        const auto j = static_cast<size_t>(shard_of_[i]);
        if (piece_of_bucket_[j][b] < 0) {
          piece_of_bucket_[j][b] = static_cast<int>(pieces_[j].size());
          Piece pc;
          for (size_t x : order_[j]) pc.offset += push_param_bytes(x);
          pieces_[j].push_back(pc);
        }
        Piece& pc = pieces_[j].back();
        pc.params.push_back(i);
        pc.bytes += push_param_bytes(i);
        order_[j].push_back(i);
      }
    }
    size_t at = 0;
    for (int j = 0; j < servers_; ++j) {
      push_at_.push_back(at);
      at += push_bytes(j);
      total_pieces_ += pieces_[static_cast<size_t>(j)].size();
    }
  }

  // Piece k of a push to server j: {byte offset in the push, bytes}.
  std::pair<size_t, size_t> piece_bytes(int j, int k) const {
    const Piece& pc = pieces_[static_cast<size_t>(j)][static_cast<size_t>(k)];
    if (k == 0) return {0, kHeaderBytes + pc.bytes};
    return {kHeaderBytes + pc.offset, pc.bytes};
  }
  // Server: optimizer updates of this shard, BSP steps taken, a switch to
  // ASP asked for, each worker's pushes (kept across serve() for checkpoints).
  int64_t version_ = 0;
  int64_t bsp_steps_ = 0;
  bool switch_requested_ = false;
  std::vector<int64_t> clocks_;
  Tensor counters_;

  Tensor& counters() {
    if (!counters_.defined()) {
      counters_ = Tensor::zeros({is_server() ? 4 + workers_ : 3 + servers_}, DType::i64);
    }
    return counters_;
  }
  Tensor residuals_;  // worker, sync.codec: checkpoints' copy of the residuals
  Tensor& residuals() {
    if (!residuals_.defined()) {
      size_t n = 0;
      for (const auto& e : encoders_) n += e->residual().size() + e->state().size();
      residuals_ = Tensor::zeros({std::max<int64_t>(static_cast<int64_t>(n), 1)}, DType::f32);
    }
    return residuals_;
  }
  // sync.codec: each parameter's payload codec (pure; both sides) and, on a
  // worker, its error-feedback encoder (layout order). Empty: f32 pushes.
  std::vector<std::unique_ptr<PayloadCodec>> codecs_;
  std::vector<float> factors_;  // per parameter: contraction_factor(), 1 without error feedback
  std::vector<std::unique_ptr<FeedbackEncoder>> encoders_;

  void setup_codecs() {
    CodecSpec spec = parse_codec_spec(o_.codec);
    if (spec.kind == CodecKind::none) return;
    spec.error_feedback = o_.codec_error_feedback;
    // PowerSGD: each worker's own factors of the parameter as a matrix
    // (shape[0] x the rest), its own warm-started Q (the encoder's state).
    auto make = [&](const ParamLayoutEntry& e) {
      const auto n = static_cast<size_t>(e.shape.numel());
      if (spec.kind != CodecKind::powersgd) return make_payload_codec(spec, n);
      const size_t rows = e.shape.rank() == 0 ? 1 : static_cast<size_t>(e.shape[0]);
      return make_low_rank_payload_codec(spec, rows, rows == 0 ? 0 : n / rows);
    };
    for (const ParamLayoutEntry& e : layout_) {  // ConfigError when k does not fit
      codecs_.push_back(make(e));
      // With error feedback QSGD is scaled to a contraction (sync/codecs.h),
      // by the worker's residual and the server's decode alike.
      const float f = spec.error_feedback
                          ? contraction_factor(spec, static_cast<size_t>(e.shape.numel()))
                          : 1.0F;
      factors_.push_back(f);
      if (!is_server()) {
        encoders_.push_back(std::make_unique<FeedbackEncoder>(make(e), spec.error_feedback, f));
      }
    }
  }
  // Bytes of parameter i's gradient in a push.
  size_t push_param_bytes(size_t i) const {
    return codecs_.empty() ? 4 * static_cast<size_t>(layout_[i].shape.numel())
                           : codecs_[i]->payload_bytes();
  }
  // A push to server j: header, then its parameters' gradients (f32 or the
  // codec's payloads), message order.
  size_t push_bytes(int j) const {
    size_t b = kHeaderBytes;
    for (size_t i = 0; i < layout_.size(); ++i) {
      if (shard_of_[i] == j) b += push_param_bytes(i);
    }
    return b;
  }
  // Server, with a codec: acc = (add ? acc : 0) + scale x the decoded push
  // (both in message order).
  void decode_push(const std::byte* payloads, float scale, bool add) {
    float* acc = acc_.data<float>();
    for (size_t i : server_params_) {
      const auto n = static_cast<size_t>(layout_[i].shape.numel());
      if (!add) std::fill(acc, acc + n, 0.0F);
      codecs_[i]->decode_add({payloads, push_param_bytes(i)}, scale * factors_[i], {acc, n});
      payloads += push_param_bytes(i);
      acc += n;
    }
  }

  int server_index() const { return group_.rank() - workers_; }
  int server_rank(int j) const { return workers_ + j; }
  size_t message_bytes(int j) const {
    return kHeaderBytes + 4 * static_cast<size_t>(shard_elems_[static_cast<size_t>(j)]);
  }
  CollectiveOptions p2p(uint32_t tag, std::chrono::milliseconds timeout) const {
    CollectiveOptions c;
    c.tag = tag;
    c.timeout = timeout;
    return c;
  }

  // Packs the header of a push to server j; a "done" push's gradients are
  // zeros (a gradient push's follow bucket by bucket, push_bucket).
  void pack(std::byte* out, int j, int64_t kind) const {
    int64_t h[kHeader] = {kind,
                          steps_,
                          seen_[static_cast<size_t>(j)],
                          bits_of(share_),
                          straggler_seen_ ? kFlagStraggler : 0,
                          0};
    std::memcpy(out, h, kHeaderBytes);
    if (kind == kGrad) return;
    std::memset(out + kHeaderBytes, 0, push_bytes(j) - kHeaderBytes);
  }

  // The DataParallel hook: bucket b's gradients are final, so each server's
  // part of them goes now, while the backward goes on with the next
  // buckets (a piece's first message carries the header, packed then).
  // Each parameter goes into its place in the push as f32, or encoded by
  // its codec (the residual kept on this worker for the next push).
  void push_bucket(int b, bool during_backward) {
    if (!pushing_) {
      pushing_ = true;
      std::byte* out = static_cast<std::byte*>(push_.raw());
      for (int j = 0; j < servers_; ++j) {
        pack(out, j, kGrad);
        out += push_bytes(j);
      }
    }
    std::span<ParamSlice> grads = local_.slices();
    std::byte* base = static_cast<std::byte*>(push_.raw());
    const uint64_t seed = codecs_.empty() ? 0 : parse_codec_spec(o_.codec).seed;
    for (int j = 0; j < servers_; ++j) {
      const int k = piece_of_bucket_[static_cast<size_t>(j)][static_cast<size_t>(b)];
      if (k < 0) continue;
      const Piece& pc = pieces_[static_cast<size_t>(j)][static_cast<size_t>(k)];
      std::byte* p = base + push_at_[static_cast<size_t>(j)] + kHeaderBytes + pc.offset;
      for (const size_t i : pc.params) {
        const auto n = static_cast<size_t>(layout_[i].shape.numel());
        const size_t bytes = push_param_bytes(i);
        if (codecs_.empty()) {
          std::memcpy(p, grads[i].grad.raw(), bytes);
        } else {
          encoders_[i]->encode({grads[i].grad.data<float>(), n},
                               codec_seed(seed + i, group_.rank(), static_cast<uint64_t>(steps_)),
                               {p, bytes});
        }
        p += bytes;
      }
      send_piece(j, k);
      ++pushed_pieces_;
      if (during_backward) ++overlapped_pieces_;
    }
  }

  void send_piece(int j, int k) {
    const auto [at, bytes] = piece_bytes(j, k);
    std::byte* out = static_cast<std::byte*>(push_.raw()) + push_at_[static_cast<size_t>(j)] + at;
    sends_.push_back(group_.send_async(out, bytes, DType::u8, server_rank(j),
                                       p2p(kPushTag, timeout_ + std::chrono::seconds(2))));
  }

  // The pushes went out per bucket during the backward (push_bucket); a
  // "done" push goes now, all pieces of zeros. Then each server's reply:
  // its shard of the parameters (f32).
  void exchange(int64_t kind) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto wait = timeout_ + std::chrono::seconds(2);
    if (kind == kDone) {
      std::byte* out = static_cast<std::byte*>(push_.raw());
      for (int j = 0; j < servers_; ++j) {
        pack(out, j, kind);
        for (size_t k = 0; k < pieces_[static_cast<size_t>(j)].size(); ++k) {
          send_piece(j, static_cast<int>(k));
        }
        out += push_bytes(j);
      }
    } else {
      MT_CHECK(pushing_ && sends_.size() == total_pieces_,
               "ps worker {}: {} of {} gradient pieces pushed at step {}", group_.rank(),
               sends_.size(), total_pieces_, steps_);
    }
    std::byte* in = static_cast<std::byte*>(pull_.raw());
    PsStepLog entry;
    entry.step = steps_;
    int64_t next_mode = mode_;
    for (int j = 0; j < servers_; ++j) {
      group_.recv(in, message_bytes(j), DType::u8, server_rank(j), p2p(kReplyTag, wait));
      int64_t h[kHeader];
      std::memcpy(h, in, kHeaderBytes);
      if (h[0] == kAbort) {
        throw CommError(fmt::format(
            "sync.scheme = \"ps\": server rank {} stopped training: worker rank {} sent no "
            "gradients for its step {} within {:.3g} s (dist.timeout_s){}",
            server_rank(j), h[5], h[4], timeout_.count() / 1000.0,
            h[5] == group_.rank() ? " (this rank)" : ""));
      }
      seen_[static_cast<size_t>(j)] = h[1];
      if (j == 0) {
        entry.version = h[1];
        entry.mode = mode_name(h[2]);
        entry.slowest = h[4];
        next_mode = h[3];
      }
      const float* p = reinterpret_cast<const float*>(in + kHeaderBytes);
      for (const size_t i : order_[static_cast<size_t>(j)]) {
        const auto n = static_cast<size_t>(layout_[i].shape.numel());
        std::memcpy(flat_.data<float>() + layout_[i].offset, p, n * sizeof(float));
        p += n;
      }
      in += message_bytes(j);
    }
    for (CommHandle& h : sends_) h.wait();
    sends_.clear();
    pushing_ = false;
    if (kind == kGrad) log_.push_back(entry);
    mode_ = next_mode;
    exchange_seconds_ +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
};

void ParamServerSync::serve(const ServerUpdate& update) {
  MT_CHECK(is_server(), "serve() on worker rank {}", group_.rank());
  const int j = server_index();
  const size_t msg = message_bytes(j);
  const size_t push = push_bytes(j);
  const auto n_elems = static_cast<size_t>(shard_elems_[static_cast<size_t>(j)]);
  std::byte* inbox = static_cast<std::byte*>(inbox_.raw());
  std::byte* outbox = static_cast<std::byte*>(outbox_.raw());
  auto in_of = [&](int w) { return inbox + static_cast<size_t>(w) * push; };
  auto out_of = [&](int w) { return outbox + static_cast<size_t>(w) * msg; };
  using Clock = std::chrono::steady_clock;

  struct Worker {
    int64_t clock = 0;                          // gradients pushed
    bool done = false;                          // sent "done"
    bool dropped = false;                       // stopped (ASP goes on without it)
    bool held = false;                          // pushed, reply not sent yet (BSP / SSP)
    bool arrived = false;                       // BSP: pushed this step
    Clock::time_point answered = Clock::now();  // last reply (it owes a push since)
  };
  std::vector<Worker> ws(static_cast<size_t>(workers_));
  for (int w = 0; w < workers_; ++w)
    ws[static_cast<size_t>(w)].clock = clocks_[static_cast<size_t>(w)];
  int64_t& version = version_;  // optimizer updates of this shard
  int64_t& bsp_steps = bsp_steps_;
  bool& switch_requested = switch_requested_;
  // The pushes so far stay for a checkpoint, however serve() ends.
  struct SaveClocks {
    std::vector<Worker>& ws;
    std::vector<int64_t>& clocks;
    ~SaveClocks() {
      for (size_t w = 0; w < ws.size(); ++w) clocks[w] = ws[w].clock;
    }
  } save_clocks{ws, clocks_};
  const auto reply_timeout = timeout_ + std::chrono::seconds(2);
  // A push arrives as one message per piece (push_bucket), each received
  // in place: the next piece's receive is posted when one lands, and the
  // push is handled when its last piece is in.
  const size_t n_pieces = pieces_[static_cast<size_t>(j)].size();
  std::vector<size_t> next_piece(static_cast<size_t>(workers_), 0);
  auto post_piece = [&](int w) {
    const auto k = static_cast<int>(next_piece[static_cast<size_t>(w)]);
    const auto [at, bytes] = piece_bytes(j, k);
    group_.post_recv(in_of(w) + at, bytes, DType::u8, w, p2p(kPushTag, timeout_));
  };
  for (int w = 0; w < workers_; ++w) post_piece(w);

  auto active = [&](const Worker& x) { return !x.done && !x.dropped; };
  auto slowest = [&] {
    int64_t m = std::numeric_limits<int64_t>::max();
    for (const Worker& x : ws) {
      if (active(x)) m = std::min(m, x.clock);
    }
    return m == std::numeric_limits<int64_t>::max() ? int64_t{0} : m;
  };
  auto send_params = [&](int w, int64_t status, int64_t applied, int64_t extra4, int64_t extra5) {
    std::byte* out = out_of(w);
    int64_t h[kHeader] = {status, version, applied, mode_, extra4, extra5};
    std::memcpy(out, h, kHeaderBytes);
    float* p = reinterpret_cast<float*>(out + kHeaderBytes);
    for (size_t i : server_params_) {
      const auto n = static_cast<size_t>(layout_[i].shape.numel());
      std::memcpy(p, flat_.data<float>() + layout_[i].offset, n * sizeof(float));
      p += n;
    }
    group_.send(out, msg, DType::u8, w, p2p(kReplyTag, reply_timeout));
    ws[static_cast<size_t>(w)].answered = Clock::now();
  };
  // BSP / SSP cannot go on without a worker: tell every worker waiting on a
  // reply who is missing, then fail naming it.
  auto abort_for = [&](int missing, const std::string& why) {
    const int64_t its_step = ws[static_cast<size_t>(missing)].clock;
    for (int w = 0; w < workers_; ++w) {
      Worker& x = ws[static_cast<size_t>(w)];
      if (w == missing || !x.held) continue;
      try {
        send_params(w, kAbort, mode_, its_step, missing);
      } catch (const CommError&) {
      }
    }
    throw CommError(fmt::format(
        "sync.scheme = \"ps\" ({}): server rank {} cannot go on: worker rank {} {} (its step {})",
        mode_name(mode_), group_.rank(), missing, why, its_step));
  };
  auto release_ssp = [&] {
    const int64_t low = slowest();
    for (int w = 0; w < workers_; ++w) {
      Worker& x = ws[static_cast<size_t>(w)];
      if (x.held && (mode_ != kSsp || x.clock - low <= o_.staleness)) {
        x.held = false;
        send_params(w, kOk, mode_, low, 0);
      }
    }
  };

  auto finish_bsp_step = [&] {
    // Every active worker pushed this step: one optimizer step on the sum,
    // taken in worker order (not arrival order), so that a BSP run is the
    // same bit for bit every time (a resumed one too). Each gradient is
    // still in its worker's inbox, whose receive is posted again only now
    // (a held worker sends nothing before its reply anyway).
    float* acc = acc_.data<float>();
    for (int w = 0; w < workers_; ++w) {
      if (!ws[static_cast<size_t>(w)].arrived) continue;
      int64_t hw[kHeader];
      std::memcpy(hw, in_of(w), kHeaderBytes);
      const auto share = static_cast<float>(as_double(hw[3]));
      if (codecs_.empty()) {
        const float* gw = reinterpret_cast<const float*>(in_of(w) + kHeaderBytes);
        for (size_t i = 0; i < n_elems; ++i) acc[i] += share * gw[i];
      } else {
        decode_push(in_of(w) + kHeaderBytes, share, true);
      }
      post_piece(w);
    }
    update(server_slices_, bsp_steps, 1.0);
    ++version;
    ++bsp_steps;
    std::fill(acc_.data<float>(), acc_.data<float>() + acc_.numel(), 0.0f);
    const int64_t applied = mode_;
    if ((switch_after_ > 0 && bsp_steps >= switch_after_) || switch_requested) mode_ = kAsp;
    for (int w = 0; w < workers_; ++w) {
      Worker& x = ws[static_cast<size_t>(w)];
      x.arrived = false;
      if (x.held) {
        x.held = false;
        send_params(w, kOk, applied, slowest(), 0);
      }
    }
  };
  auto bsp_complete = [&] {
    bool any = false;
    for (const Worker& x : ws) {
      if (!active(x)) continue;
      if (!x.arrived) return false;
      any = true;
    }
    return any;
  };

  for (;;) {
    bool all_finished = true;
    for (const Worker& x : ws) all_finished = all_finished && !active(x);
    if (all_finished) break;
    const auto r = group_.wait_any(std::chrono::milliseconds(50));
    if (!r) {
      // Who owes a push (answered and silent) for longer than the timeout.
      const auto now = Clock::now();
      for (int w = 0; w < workers_; ++w) {
        Worker& x = ws[static_cast<size_t>(w)];
        if (!active(x) || x.held || now - x.answered < timeout_) continue;
        const std::string why = fmt::format("sent no gradients within {:.3g} s (dist.timeout_s)",
                                            timeout_.count() / 1000.0);
        if (mode_ != kAsp) abort_for(w, why);
        x.dropped = true;
        notices_.push_back(fmt::format(
            "sync.scheme = \"ps\" (asp): server rank {} goes on without worker rank {}: it {} "
            "after {} steps",
            group_.rank(), w, why, x.clock));
        if (mode_ == kSsp) release_ssp();
      }
      continue;
    }
    const int w = r->peer;
    Worker& x = ws[static_cast<size_t>(w)];
    if (r->lost) {
      if (mode_ != kAsp) abort_for(w, fmt::format("is gone: {}", r->lost_message));
      x.dropped = true;
      notices_.push_back(fmt::format(
          "sync.scheme = \"ps\" (asp): server rank {} goes on without worker rank {}: {}",
          group_.rank(), w, r->lost_message));
      continue;
    }
    if (++next_piece[static_cast<size_t>(w)] < n_pieces) {
      post_piece(w);
      continue;
    }
    next_piece[static_cast<size_t>(w)] = 0;
    int64_t h[kHeader];
    std::memcpy(h, in_of(w), kHeaderBytes);
    const float* g = reinterpret_cast<const float*>(in_of(w) + kHeaderBytes);
    if (h[0] == kDone) {
      x.done = true;
      if (mode_ == kBsp && bsp_complete()) finish_bsp_step();
      if (mode_ == kSsp) release_ssp();
      continue;
    }
    if (x.dropped) x.dropped = false;  // back after a silence (ASP): served again
    if (h[4] & kFlagStraggler) switch_requested = switch_requested || o_.ps_switch == "straggler";
    ++x.clock;
    if (mode_ == kBsp) {
      // Summed (and its receive posted again) when the step is complete.
      x.arrived = true;
      x.held = true;
      if (bsp_complete()) finish_bsp_step();
      continue;
    }
    // ASP / SSP: one optimizer step on this worker's gradient, now.
    if (codecs_.empty()) {
      std::memcpy(acc_.raw(), g, n_elems * sizeof(float));
    } else {
      decode_push(in_of(w) + kHeaderBytes, 1.0F, false);
    }
    const int64_t staleness = version - h[2];
    const double scale =
        o_.staleness_lr && staleness > 1 ? 1.0 / static_cast<double>(staleness) : 1.0;
    update(server_slices_, h[1], scale);
    ++version;
    post_piece(w);
    x.held = true;
    release_ssp();
  }
  // Everyone is done: the final parameters to every worker that finished.
  for (int w = 0; w < workers_; ++w) {
    if (ws[static_cast<size_t>(w)].done) send_params(w, kOk, mode_, slowest(), 0);
  }
}

}  // namespace

std::vector<int> ps_shards(const ParamLayout& layout, int servers) {
  if (servers > static_cast<int>(layout.size())) {
    throw ConfigError(fmt::format(
        "sync.servers = {}: the model has {} parameters and each server holds whole ones, so at "
        "most {} servers have something to hold",
        servers, layout.size(), layout.size()));
  }
  std::vector<size_t> order(layout.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return layout[a].shape.numel() > layout[b].shape.numel();
  });
  std::vector<int64_t> load(static_cast<size_t>(servers), 0);
  std::vector<int> shard(layout.size(), 0);
  for (size_t i : order) {
    const auto j = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    shard[i] = static_cast<int>(j);
    load[j] += layout[i].shape.numel() * 4;
  }
  return shard;
}

std::unique_ptr<ReplicaSync> make_param_server_sync(const SyncOptions& o, Communicator& group,
                                                    ParamLayout layout, Tensor flat_params,
                                                    DataParallelOptions dp, double local_share) {
  if (dp.stage != 0) {
    throw ConfigError(fmt::format(
        "sync.scheme = \"ps\": the servers hold the parameter shards, so dist.zero_stage must be "
        "0 (got {})",
        dp.stage));
  }
  if (o.servers >= group.size()) {
    throw ConfigError(fmt::format(
        "sync.servers = {}: needs at least one worker besides the servers, but the job has {} "
        "ranks",
        o.servers, group.size()));
  }
  if (!(local_share > 0 && local_share <= 1)) {
    throw ConfigError(
        fmt::format("sync.scheme = \"ps\": this rank's share of the batch is {}", local_share));
  }
  return std::make_unique<ParamServerSync>(o, group, std::move(layout), std::move(flat_params),
                                           std::move(dp), local_share);
}

std::vector<PsStepLog> ps_step_log(const ReplicaSync& sync) {
  if (const auto* p = dynamic_cast<const ParamServerSync*>(&sync)) return p->log();
  return {};
}

}  // namespace mt
