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
        local_(*self_, layout, flat, dp),
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
    setup_codecs();
    MemoryScope tag(MemoryCategory::comm);
    if (is_server()) {
      const int j = server_index();
      const size_t msg = message_bytes(j);
      inbox_ = Tensor::empty({static_cast<int64_t>(push_bytes(j)) * workers_}, DType::u8);
      outbox_ = Tensor::empty({static_cast<int64_t>(msg) * workers_}, DType::u8);
      acc_ =
          Tensor::zeros({std::max<int64_t>(shard_elems_[static_cast<size_t>(j)], 1)}, DType::f32);
      for (size_t i = 0, at = 0; i < layout_.size(); ++i) {
        if (shard_of_[i] != j) continue;
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
    local_.step([&](std::span<ParamSlice> s) { exchange(s, kGrad); });
    ++steps_;
  }

  void finish() override {
    if (is_server() || finished_) return;
    finished_ = true;
    exchange({}, kDone);
  }

  void gather_params(Tensor& flat_out) override {
    MT_CHECK(flat_out.numel() >= flat_.numel(), "parameter buffer {}", flat_out.desc());
    if (flat_out.raw() != flat_.raw()) std::memcpy(flat_out.raw(), flat_.raw(), flat_.nbytes());
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
    int64_t extra = static_cast<int64_t>(inbox_.nbytes() + outbox_.nbytes() + acc_.nbytes() +
                                         push_.nbytes() + pull_.nbytes());
    // sync.codec: each encoder's residual and its scratch (e = grad + residual)
    for (const auto& e : encoders_) extra += 8 * static_cast<int64_t>(e->residual().size());
    m.world_size = group_.size();
    m.staging_bytes += extra;
    m.expected_buffer_bytes += extra;
    return m;
  }
  // wait_seconds: time in the exchange with the servers (pushes, replies).
  DataParallelStats stats() const override {
    DataParallelStats st = local_.stats();
    st.wait_seconds += exchange_seconds_;
    return st;
  }
  void reset_stats() override {
    local_.reset_stats();
    exchange_seconds_ = 0;
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
  std::vector<size_t> server_params_;  // layout indices of this server's shard
  // sync.codec: each parameter's payload codec (pure; both sides) and, on a
  // worker, its error-feedback encoder (layout order). Empty: f32 pushes.
  std::vector<std::unique_ptr<PayloadCodec>> codecs_;
  std::vector<std::unique_ptr<FeedbackEncoder>> encoders_;

  void setup_codecs() {
    CodecSpec spec = parse_codec_spec(o_.codec);
    if (spec.kind == CodecKind::none) return;
    spec.error_feedback = o_.codec_error_feedback;
    for (const ParamLayoutEntry& e : layout_) {  // ConfigError when k does not fit
      const auto n = static_cast<size_t>(e.shape.numel());
      codecs_.push_back(make_payload_codec(spec, n));
      if (!is_server()) {
        encoders_.push_back(
            std::make_unique<FeedbackEncoder>(make_payload_codec(spec, n), spec.error_feedback));
      }
    }
  }
  // Bytes of parameter i's gradient in a push.
  size_t push_param_bytes(size_t i) const {
    return codecs_.empty() ? 4 * static_cast<size_t>(layout_[i].shape.numel())
                           : codecs_[i]->payload_bytes();
  }
  // A push to server j: header, then its parameters' gradients (f32 or the
  // codec's payloads), layout order.
  size_t push_bytes(int j) const {
    size_t b = kHeaderBytes;
    for (size_t i = 0; i < layout_.size(); ++i) {
      if (shard_of_[i] == j) b += push_param_bytes(i);
    }
    return b;
  }
  // Server, with a codec: acc = (add ? acc : 0) + scale x the decoded push.
  void decode_push(const std::byte* payloads, float scale, bool add) {
    float* acc = acc_.data<float>();
    for (size_t i : server_params_) {
      const auto n = static_cast<size_t>(layout_[i].shape.numel());
      if (!add) std::fill(acc, acc + n, 0.0F);
      codecs_[i]->decode_add({payloads, push_param_bytes(i)}, scale, {acc, n});
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

  // Packs server j's part of `grads` (layout order) after a header: f32, or
  // each parameter's codec payload (its residual kept for the next push).
  void pack(std::byte* out, int j, std::span<ParamSlice> grads, int64_t kind) {
    int64_t h[kHeader] = {kind,
                          steps_,
                          seen_[static_cast<size_t>(j)],
                          bits_of(share_),
                          straggler_seen_ ? kFlagStraggler : 0,
                          0};
    std::memcpy(out, h, kHeaderBytes);
    if (!codecs_.empty()) {
      std::byte* p = out + kHeaderBytes;
      const uint64_t base = parse_codec_spec(o_.codec).seed;
      for (size_t i = 0; i < layout_.size(); ++i) {
        if (shard_of_[i] != j) continue;
        const auto n = static_cast<size_t>(layout_[i].shape.numel());
        const std::span<std::byte> payload(p, push_param_bytes(i));
        if (kind == kGrad) {
          encoders_[i]->encode({grads[i].grad.data<float>(), n},
                               codec_seed(base + i, group_.rank(), static_cast<uint64_t>(steps_)),
                               payload);
        } else {
          std::fill(payload.begin(), payload.end(), std::byte{0});
        }
        p += payload.size();
      }
      return;
    }
    float* g = reinterpret_cast<float*>(out + kHeaderBytes);
    for (size_t i = 0; i < layout_.size(); ++i) {
      if (shard_of_[i] != j) continue;
      const auto n = static_cast<size_t>(layout_[i].shape.numel());
      if (kind == kGrad) {
        std::memcpy(g, grads[i].grad.raw(), n * sizeof(float));
      } else {
        std::memset(g, 0, n * sizeof(float));
      }
      g += n;
    }
  }

  // Push to every server (asynchronously, so the servers work in parallel),
  // then take each server's reply: its shard of the parameters.
  void exchange(std::span<ParamSlice> grads, int64_t kind) {
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<CommHandle> sends;
    std::byte* out = static_cast<std::byte*>(push_.raw());
    const auto wait = timeout_ + std::chrono::seconds(2);
    for (int j = 0; j < servers_; ++j) {
      pack(out, j, grads, kind);
      sends.push_back(
          group_.send_async(out, push_bytes(j), DType::u8, server_rank(j), p2p(kPushTag, wait)));
      out += push_bytes(j);
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
      for (size_t i = 0; i < layout_.size(); ++i) {
        if (shard_of_[i] != j) continue;
        const auto n = static_cast<size_t>(layout_[i].shape.numel());
        std::memcpy(flat_.data<float>() + layout_[i].offset, p, n * sizeof(float));
        p += n;
      }
      in += message_bytes(j);
    }
    for (CommHandle& h : sends) h.wait();
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
  int64_t version = 0;  // optimizer updates of this shard
  int64_t bsp_steps = 0;
  bool switch_requested = false;
  const auto reply_timeout = timeout_ + std::chrono::seconds(2);
  for (int w = 0; w < workers_; ++w)
    group_.post_recv(in_of(w), push, DType::u8, w, p2p(kPushTag, timeout_));

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
    // Every active worker pushed this step: one optimizer step on the sum.
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
      const auto s = static_cast<float>(as_double(h[3]));
      float* acc = acc_.data<float>();
      if (codecs_.empty()) {
        for (size_t i = 0; i < n_elems; ++i) acc[i] += s * g[i];
      } else {
        decode_push(in_of(w) + kHeaderBytes, s, true);
      }
      x.arrived = true;
      x.held = true;
      group_.post_recv(in_of(w), push, DType::u8, w, p2p(kPushTag, timeout_));
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
    group_.post_recv(in_of(w), push, DType::u8, w, p2p(kPushTag, timeout_));
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
