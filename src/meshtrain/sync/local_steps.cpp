#include "meshtrain/sync/local_steps.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <mutex>
#include <random>
#include <thread>

#include "meshtrain/base/error.h"
#include "meshtrain/comm/backends/self/self_transport.h"
#include "meshtrain/sync/choco.h"
#include "meshtrain/sync/codecs.h"
#include "meshtrain/sync/compressed_all_reduce.h"
#include "meshtrain/sync/outer_quant.h"
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
        local_(*self_, layout, flat, std::move(dp)),
        layout_(std::move(layout)),
        flat_(std::move(flat)),
        share_(share) {
    n_ = static_cast<size_t>(flat_.numel());
    MemoryScope tag(MemoryCategory::comm);
    if (o_.scheme == "diloco") {
      start_ = flat_.clone();
      momentum_ = Tensor::zeros({flat_.numel()}, DType::f32);
      plan_fragments();
    }
    if (o_.scheme == "gossip") {
      neighbours_ = gossip_neighbours(o_.topology, group_.rank(), group_.size());
    }
    const bool coded = parse_codec_spec(o_.codec).kind != CodecKind::none;
    if (o_.scheme == "gossip" && !coded) {  // with a codec: payload buffers (setup_choco)
      const int64_t deg = static_cast<int64_t>(neighbours_.size());
      send_ = Tensor::empty({std::max<int64_t>(deg, 1) * flat_.numel()}, DType::f32);
      recv_ = Tensor::empty({std::max<int64_t>(deg, 1) * flat_.numel()}, DType::f32);
    }
    if (o_.scheme == "partial") plan_layer_groups();
    if (o_.scheme == "adpsgd" && group_.size() > 1) setup_adpsgd();
    if (coded) {
      if (o_.scheme == "gossip" || o_.scheme == "adpsgd") {
        setup_choco();
      } else {
        setup_codecs();
      }
    }
  }

  ~LocalStepsSync() override {
    try {
      if (pending_.valid()) pending_.wait();
      for (Flight& f : flights_) f.handle.wait();  // they write into our buffers
    } catch (...) {  // the communicator reports it to whoever uses it next
    }
    stop_ = true;
    if (server_.joinable()) server_.join();
  }

  void attach(Executor& exec, const Graph& graph) override {
    local_.attach(exec, graph);
    if (o_.scheme == "partial" && group_.size() > 1) {
      // A layer's average lands right before the forward phase first reads
      // one of its parameters (or at the next update, whichever is first).
      auto of = std::make_shared<std::vector<int>>();
      for (ValueId v : graph.params()) {
        const auto it = group_of_name_.find(graph.value(v).name);
        if (static_cast<size_t>(v) >= of->size()) of->resize(static_cast<size_t>(v) + 1, -1);
        (*of)[static_cast<size_t>(v)] = it == group_of_name_.end() ? -1 : it->second;
      }
      ParamHooks hooks;
      hooks.acquire = [this, of](ValueId v, bool /*backward*/) {
        const auto i = static_cast<size_t>(v);
        if (pending_group_ >= 0 && i < of->size() && (*of)[i] == pending_group_) settle();
      };
      exec.set_param_hooks(std::move(hooks));
    }
    if (o_.scheme == "adpsgd" && group_.size() > 1 && !server_.joinable()) {
      std::memcpy(published_.raw(), flat_.raw(), n_ * sizeof(float));
      if (group_.rank() % 2 == 1) server_ = std::thread([this] { serve_loop(); });
    }
  }
  // Each replica's gradient is the mean over its own examples: the trainer's
  // weight (a share of the global batch) divided by this rank's share.
  void begin_micro_step(double w) override { local_.begin_micro_step(w / share_); }
  void end_micro_step() override { local_.end_micro_step(); }
  std::span<ParamSlice> slices() override { return local_.slices(); }
  std::function<void(std::span<double>)> norm_reducer() override { return {}; }

  void step(const std::function<void(std::span<ParamSlice>)>& update) override {
    settle();
    if (choco_ && choco_fresh_ && o_.scheme == "gossip" && group_.size() > 1) {
      seed_public_copies();
    }
    local_.step(update);
    ++steps_;
    if (group_.size() == 1) return;
    if (o_.scheme == "partial") {
      const int g = static_cast<int>((steps_ - 1) % o_.period);
      if (codecs_.empty()) {
        start_partial(g);
      } else {
        compressed_average(g);
      }
    } else if (o_.scheme == "adpsgd") {
      adpsgd_step();
    } else if (o_.scheme == "local_sgd") {
      if (steps_ <= o_.sync_until || steps_ % o_.period == 0) {
        if (codecs_.empty()) {
          average_in_place();
        } else {
          compressed_average(-1);
        }
      }
    } else if (o_.scheme == "diloco") {
      streaming_step();
    } else if (choco_) {
      choco_mix();
    } else {
      mix();
    }
  }

  // This replica's own parameters.
  void gather_params(Tensor& flat_out) override {
    settle();
    copy(flat_, flat_out);
  }
  void average_into(Tensor& flat_out) override {
    settle();
    quiesce();
    const uint64_t before = sync_bytes_sent(group_);
    weighted_sum(flat_, flat_out);
    side_bytes_ += sync_bytes_sent(group_) - before;
  }

  Consensus consensus() override {
    if (group_.size() == 1) return {};
    settle();
    quiesce();
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

  std::vector<ShardPiece> param_pieces(PieceUse use) override {
    settle();
    return local_.param_pieces(use);
  }
  std::vector<ShardPiece> state_pieces(const std::map<std::string, Tensor>& state,
                                       PieceUse use) const override {
    return local_.state_pieces(state, use);
  }
  std::vector<ShardPiece> new_state_pieces(std::span<const std::string> kinds) const override {
    return local_.new_state_pieces(kinds);
  }
  DataParallelMemory memory(int kinds, int64_t optimizer_bytes) const override {
    DataParallelMemory m = local_.memory(kinds, optimizer_bytes);
    const int64_t extra =
        4 * (start_.numel() + momentum_.numel() + send_.numel() + recv_.numel() + stage_.numel() +
             published_.numel() + pending_sum_.numel() + outer_stage_.numel() + anchor_.numel() +
             2 * codec_residual_numel() +
             choco_numel()) +  // a codec's residual, its scratch e; CHOCO's public copies
        static_cast<int64_t>(choco_out_.size() + choco_in_.size()) +
        static_cast<int64_t>(payload_.size() + gathered_.size() + slots_out_.size() +
                             slots_in_.size());
    m.world_size = group_.size();
    m.staging_bytes += extra;
    m.expected_buffer_bytes += extra;
    return m;
  }
  DataParallelStats stats() const override { return local_.stats(); }
  void reset_stats() override { local_.reset_stats(); }
  std::string name() const override {
    if (choco_) return fmt::format("{}+{}", o_.scheme, parse_codec_spec(o_.codec).to_string());
    if (codecs_.empty()) return o_.scheme;
    return fmt::format("{}+{}", o_.scheme, codecs_.front()->options().codec.to_string());
  }
  bool replicas_identical() const override { return group_.size() == 1; }
  std::vector<float> codec_residual() const override {
    std::vector<float> r;
    if (choco_ && public_.defined()) {
      // gossip: what the neighbours do not know yet, x - xhat.
      r.assign(n_, 0.0F);
      if (group_.size() == 1) return r;  // nothing to tell anyone
      const float* x = flat_.data<float>();
      const float* h = public_.data<float>();
      for (size_t i = 0; i < n_; ++i) r[i] = x[i] - h[i];
      return r;
    }
    if (codecs_.empty()) return r;
    r.assign(n_, 0.0F);
    for (size_t k = 0; k < pieces_.size(); ++k) {
      const std::span<const float> x = codecs_[k]->residual();
      std::copy(x.begin(), x.end(), r.begin() + pieces_[k].offset);
    }
    return r;
  }
  // adpsgd: no per-step collective may tie the ranks together.
  bool lock_step() const override { return o_.scheme != "adpsgd" || group_.size() == 1; }
  int64_t agreement_period() const override {
    return (o_.scheme == "local_sgd" || o_.scheme == "diloco") && group_.size() > 1 ? o_.period : 1;
  }
  // The scheme's own traffic: measurements (consensus, the averages taken
  // for evaluation) left out.
  uint64_t bytes_sent() const override {
    return sync_bytes_sent(group_) - side_bytes_ + (pair_ ? sync_bytes_sent(*pair_) : 0);
  }

  void finish() override {
    settle();
    // diloco: exchanges still in flight land now, in the order they left.
    for (Flight& f : flights_) land(f);
    flights_.clear();
    if (o_.scheme != "adpsgd" || group_.size() == 1) return;
    if (group_.rank() % 2 == 0) {
      // "done" to every passive neighbour: its server stops once every
      // active neighbour said so.
      float* out = send_.data<float>();
      out[0] = kDone;
      for (int q : partners_) pair_->send(out, 1, DType::f32, q, p2p(kRequestTag));
    } else {
      // Its own steps are done; from here the server gives up on active
      // neighbours silent for longer than the communicator's timeout.
      finishing_since_ = std::chrono::steady_clock::now().time_since_epoch().count();
      if (server_.joinable()) server_.join();
      apply_pending();
    }
    rethrow_server_error();
  }

  std::vector<std::string> notices() const override {
    if (o_.scheme == "diloco" && group_.size() > 1) {
      return {fmt::format(
          "sync.scheme = \"diloco\": rank {} ran {} fragment exchanges ({} fragment{}, {}{}, "
          "overlapping {} inner step{}) and waited {:.3g} s for them",
          group_.rank(), outer_syncs_, frags_.size(), frags_.size() == 1 ? "" : "s",
          codecs_.empty() ? fmt::format("{}-bit", o_.outer_bits)
                          : fmt::format("sync.codec = \"{}\"", o_.codec),
          reduce_scatter() ? " by reduce-scatter + all-gather" : "", o_.overlap_steps,
          o_.overlap_steps == 1 ? "" : "s", outer_wait_s_)};
    }
    if (o_.scheme == "partial" && group_.size() > 1) {
      return {
          fmt::format("sync.scheme = \"partial\": rank {} averaged {} layer groups; their "
                      "all-reduces took {:.3g} s, of which it waited {:.3g} s (the rest "
                      "overlapped with its own work)",
                      group_.rank(), partial_starts_, partial_comm_s_, settle_wait_s_)};
    }
    if (o_.scheme != "adpsgd" || group_.size() == 1) return {};
    if (group_.rank() % 2 == 0) {
      return {
          fmt::format("sync.scheme = \"adpsgd\": active rank {} averaged with a passive "
                      "neighbour {} times, waiting {:.3g} s for replies in all",
                      group_.rank(), exchanges_, reply_wait_s_)};
    }
    return {fmt::format("sync.scheme = \"adpsgd\": passive rank {} answered {} requests",
                        group_.rank(), served_.load())};
  }
  double reply_wait_seconds() const { return reply_wait_s_; }

  // Checkpoints: every replica its own row (adpsgd, whose pairs average at
  // any moment, is refused by the trainer). The counters: steps_, then per
  // DiLoCo fragment in flight (fragment, due, started), -1 for none.
  RankCheckpoint rank_checkpoint() const override { return RankCheckpoint::kReplicas; }

  void prepare_checkpoint() override {
    settle();
    for (Flight& f : flights_) resolve(f);
    std::vector<int64_t> c = {steps_};
    for (size_t f = 0; f < frags_.size(); ++f) {
      const Flight* fl = flight_of(f);
      c.push_back(fl != nullptr ? static_cast<int64_t>(f) : -1);
      c.push_back(fl != nullptr ? fl->due : -1);
      c.push_back(fl != nullptr ? fl->started : -1);
    }
    std::memcpy(counters().raw(), c.data(), c.size() * sizeof(int64_t));
    if (!codecs_.empty()) {
      float* x = codec_state().data<float>();
      int64_t* runs = codec_runs().data<int64_t>();
      for (size_t k = 0; k < codecs_.size(); ++k) {
        const size_t m = codecs_[k]->state_numel();
        codecs_[k]->save_state({x, m});
        x += m;
        runs[k] = static_cast<int64_t>(codecs_[k]->steps());
      }
    }
  }

  std::vector<StatePiece> checkpoint_state() override {
    const int r = group_.rank(), n = group_.size();
    std::vector<StatePiece> out = {{"counters", r, n, counters()}};
    if (o_.scheme == "diloco") {
      out.push_back({"diloco.start", r, n, start_});
      out.push_back({"diloco.outer_momentum", r, n, momentum_});
      // Exchanges in flight: their summed pseudo-gradients (prepare_checkpoint).
      if (outer_stage_.defined()) out.push_back({"diloco.in_flight", r, n, outer_stage_});
    }
    // sync.codec: each replica's residuals (and PowerSGD's Q), its codecs'
    // run counts (their seeds), and the anchor its next change is taken from.
    if (!codecs_.empty()) {
      out.push_back({"codec.state", r, n, codec_state()});
      out.push_back({"codec.runs", r, n, codec_runs()});
      if (anchor_.defined()) out.push_back({"codec.anchor", r, n, anchor_});
    }
    // gossip with a codec: the public copy xhat of this replica and the
    // weighted sum of its and its neighbours' (CHOCO-SGD's state).
    if (public_.defined()) {
      out.push_back({"choco.public", r, n, public_});
      out.push_back({"choco.mixed", r, n, mixed_});
    }
    return out;
  }

  void restore_checkpoint(int64_t step, bool with_state) override {
    flights_.clear();
    if (!with_state) {
      // Another scheme's checkpoint: every replica starts from the same
      // parameters (DiLoCo's start is them, its momentum zero).
      steps_ = step;
      if (o_.scheme == "diloco") std::memcpy(start_.raw(), flat_.raw(), n_ * sizeof(float));
      if (anchor_.defined()) std::memcpy(anchor_.raw(), flat_.raw(), n_ * sizeof(float));
      choco_fresh_ = true;  // seeded again before the next step
      return;
    }
    const int64_t* c = counters().data<int64_t>();
    if (c[0] != step) {
      throw CheckpointError(fmt::format(
          "sync.scheme = \"{}\": the checkpoint's scheme state is at step {}, its metadata says "
          "step {}",
          o_.scheme, c[0], step));
    }
    steps_ = c[0];
    choco_fresh_ = false;  // choco.public / choco.mixed were loaded
    if (!codecs_.empty()) {
      const float* x = codec_state().data<float>();
      const int64_t* runs = codec_runs().data<int64_t>();
      for (size_t k = 0; k < codecs_.size(); ++k) {
        const size_t m = codecs_[k]->state_numel();
        codecs_[k]->load_state({x, m}, static_cast<uint64_t>(runs[k]));
        x += m;
      }
    }
    for (size_t f = 0; f < frags_.size(); ++f) {
      const int64_t* e = c + 1 + 3 * f;
      if (e[0] < 0) continue;
      Flight fl;
      fl.fragment = f;
      fl.due = e[1];
      fl.started = e[2];
      fl.stage = 2;
      fl.resolved = true;  // its sum was saved in diloco.in_flight
      flights_.push_back(std::move(fl));
    }
    // In the order they left, as land() takes them.
    std::sort(flights_.begin(), flights_.end(), [](const Flight& a, const Flight& b) {
      return a.started != b.started ? a.started < b.started : a.fragment < b.fragment;
    });
  }

 private:
  SyncOptions o_;
  Communicator& group_;
  std::unique_ptr<Communicator> self_;
  DataParallel local_;
  ParamLayout layout_;
  Tensor flat_;
  size_t n_ = 0;
  double share_ = 1;
  int64_t steps_ = 0;
  Tensor start_, momentum_;  // diloco
  // sync.codec (local_sgd, diloco): one compressed all-reduce per parameter
  // (layout order) for the pseudo-gradients, each with its own residual;
  // local_sgd's parameters as of the last synchronization (diloco's start_).
  // diloco: one per piece of a parameter in a fragment (pieces_, in
  // fragment order; one fragment: one per parameter, layout order).
  std::vector<std::unique_ptr<CompressedAllReduce>> codecs_;
  std::vector<CodecPiece> pieces_;
  Tensor anchor_;
  // diloco: fragments (one for plain DiLoCo), the exchanges in flight, and
  // their buffers: outer_stage_ (with overlap; flat-sized f32: each fragment's summed
  // pseudo-gradient at its offset); 4-bit: payload_ (each fragment's own
  // payload at payload_at) and gathered_ (every rank's payloads, fragment f
  // at ranks x payload_at).
  // reduce_scatter exchange: a fragment's elements in ranks pieces of
  // `piece` elements (the last ones shorter or empty), each sent as one slot
  // of slot_bytes (the payload of a whole piece; shorter ones padded).
  struct Fragment {
    int64_t offset = 0, numel = 0, phase = 0;
    size_t payload_at = 0, payload_bytes = 0;
    int64_t piece = 0;
    size_t slot_at = 0, slot_bytes = 0;
  };
  std::vector<Fragment> frags_;
  struct Flight {
    size_t fragment = 0;
    int64_t due = 0;             // the step after whose update it lands
    int64_t started = 0;         // the step it was sent after
    int stage = 1;               // reduce_scatter: 1 the all_to_all, 2 the all_gather
    bool resolved = false;       // its sum is in pseudo_gradient() (resolve())
    bool codec_started = false;  // sync.codec: its pieces' exchanges are in flight
    CommHandle handle;
  };
  std::vector<Flight> flights_;
  Tensor outer_stage_;
  std::vector<std::byte> payload_, gathered_;
  std::vector<std::byte> slots_out_, slots_in_;  // reduce_scatter: ranks slots per fragment
  int64_t outer_syncs_ = 0;
  double outer_wait_s_ = 0;
  std::vector<int> neighbours_;
  Tensor send_, recv_;       // gossip
  uint64_t side_bytes_ = 0;  // sent by consensus() and average_into()
  // partial: layer groups (element ranges of flat_) and the one in flight.
  struct Range {
    int64_t offset = 0, numel = 0;
  };
  std::vector<std::vector<Range>> groups_;
  std::map<std::string, int> group_of_name_;
  Tensor stage_;
  CommHandle pending_;
  int pending_group_ = -1;
  int64_t partial_starts_ = 0;
  double settle_wait_s_ = 0;   // blocked on an average in flight
  double partial_comm_s_ = 0;  // inside those all-reduces (the communicator's clock)
  double comm_s_at_start_ = 0;
  // adpsgd: even ranks active, odd ranks passive (see local_steps.h).
  static constexpr float kAverage = 0, kDone = 1;
  static constexpr uint32_t kRequestTag = 0x4144, kBodyTag = 0x4145, kReplyTag = 0x4146;
  std::unique_ptr<Communicator> pair_;
  std::vector<int> partners_;  // opposite-role neighbours
  std::mt19937_64 rng_;
  std::thread server_;
  std::atomic<bool> stop_{false};
  // Passive: steady_clock ticks when finish() began waiting (0: not yet).
  std::atomic<int64_t> finishing_since_{0};
  std::atomic<int64_t> served_{0};
  std::mutex mu_;       // guards published_, pending_sum_, pending_scale_
  Tensor published_;    // passive: parameters as of the last step boundary
  Tensor pending_sum_;  // passive: theta <- pending_scale_ theta + pending_sum_
  double pending_scale_ = 1;
  std::exception_ptr server_error_;
  int64_t exchanges_ = 0;
  double reply_wait_s_ = 0;
  Tensor counters_;  // checkpoints: see prepare_checkpoint()
  // gossip / adpsgd with a codec (CHOCO-SGD, sync/choco.h). gossip:
  // public_ = xhat_i, mixed_ = sum_j w_ij xhat_j over this rank and its
  // neighbours (one sum instead of a copy per neighbour: the consensus step
  // needs only it); adpsgd: per partner e, edge_hats_ holds [xhat of this rank
  // as that partner knows it, xhat of the partner] (2 x partners x params).
  std::unique_ptr<ChocoCodec> choco_;
  Tensor public_, mixed_, edge_hats_;
  std::vector<std::byte> choco_out_, choco_in_;
  uint64_t choco_draws_ = 0;  // adpsgd: exchanges encoded (the seeds' draw)
  // gossip: the public copies are not yet seeded (the run's first step, or
  // a resume from a checkpoint without them); adpsgd: per partner, whether
  // this pair has met (its copies are seeded). Thread: the rank's own
  // (active) or its server's (passive).
  bool choco_fresh_ = true;
  std::vector<char> met_;

  int64_t choco_numel() const {
    int64_t m = 0;
    for (const Tensor* t : {&public_, &mixed_, &edge_hats_}) m += t->defined() ? t->numel() : 0;
    return m;
  }
  float* edge_hat(size_t edge, int which) {
    return edge_hats_.data<float>() + (2 * edge + static_cast<size_t>(which)) * n_;
  }

  Tensor& counters() {
    if (!counters_.defined()) {
      counters_ = Tensor::zeros({1 + 3 * static_cast<int64_t>(frags_.size())}, DType::i64);
    }
    return counters_;
  }
  Tensor codec_state_, codec_runs_;  // checkpoints with sync.codec
  Tensor& codec_state() {
    if (!codec_state_.defined()) {
      size_t m = 0;
      for (const auto& c : codecs_) m += c->state_numel();
      codec_state_ = Tensor::zeros({static_cast<int64_t>(m)}, DType::f32);
    }
    return codec_state_;
  }
  Tensor& codec_runs() {
    if (!codec_runs_.defined()) {
      codec_runs_ = Tensor::zeros({static_cast<int64_t>(codecs_.size())}, DType::i64);
    }
    return codec_runs_;
  }

  const Flight* flight_of(size_t f) const {
    for (const Flight& fl : flights_) {
      if (fl.fragment == f) return &fl;
    }
    return nullptr;
  }

  const CollectiveOptions& opts() const { return local_.options().collective; }

  CollectiveOptions p2p(uint32_t tag) const {
    CollectiveOptions c = opts();
    c.tag = tag;
    return c;
  }

  // partial: layers are the layout's parameters grouped by name up to the
  // last '.', numbered in layout order; layer l is in group l % period.
  void plan_layer_groups() {
    groups_.assign(static_cast<size_t>(o_.period), {});
    std::map<std::string, int> layer_of;
    int64_t widest = 0;
    for (const ParamLayoutEntry& e : layout_) {
      const size_t dot = e.name.rfind('.');
      const std::string layer = dot == std::string::npos ? e.name : e.name.substr(0, dot);
      const auto [it, fresh] = layer_of.emplace(layer, static_cast<int>(layer_of.size()));
      (void)fresh;
      const int g = static_cast<int>(it->second % o_.period);
      groups_[static_cast<size_t>(g)].push_back({e.offset, e.shape.numel()});
      group_of_name_[e.name] = g;
    }
    for (const auto& g : groups_) {
      int64_t n = 0;
      for (const Range& r : g) n += r.numel;
      widest = std::max(widest, n);
    }
    MemoryScope tag(MemoryCategory::comm);
    stage_ = Tensor::empty({std::max<int64_t>(widest, 1)}, DType::f32);
  }

  // Starts the weighted average of group g's parameters (as this step left
  // them) on the communicator's progress thread.
  void start_partial(int g) {
    const auto& ranges = groups_[static_cast<size_t>(g)];
    if (ranges.empty()) return;  // fewer layers than sync.period
    float* st = stage_.data<float>();
    const float* theta = flat_.data<float>();
    const auto s = static_cast<float>(share_);
    size_t at = 0;
    for (const Range& r : ranges) {
      for (int64_t i = 0; i < r.numel; ++i) st[at++] = s * theta[r.offset + i];
    }
    comm_s_at_start_ = all_reduce_seconds();
    pending_ = group_.all_reduce_async(st, st, at, DType::f32, ReduceOp::sum, opts());
    pending_group_ = g;
    ++partial_starts_;
  }

  double all_reduce_seconds() const {
    const CommCounters c = group_.counters();
    const auto it = c.by_collective.find("all_reduce");
    return it == c.by_collective.end() ? 0.0 : it->second.seconds;
  }

  // Waits for the average in flight, if any, and writes it into the parameters.
  void settle() {
    if (pending_group_ < 0) return;
    const int g = pending_group_;
    pending_group_ = -1;
    const auto t0 = std::chrono::steady_clock::now();
    pending_.wait();
    settle_wait_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    partial_comm_s_ += all_reduce_seconds() - comm_s_at_start_;
    pending_ = CommHandle();
    const float* st = stage_.data<float>();
    float* theta = flat_.data<float>();
    size_t at = 0;
    for (const Range& r : groups_[static_cast<size_t>(g)]) {
      std::memcpy(theta + r.offset, st + at, static_cast<size_t>(r.numel) * sizeof(float));
      at += static_cast<size_t>(r.numel);
    }
  }

  void setup_adpsgd() {
    const int r = group_.rank(), n = group_.size();
    for (int q : gossip_neighbours(o_.topology, r, n)) {
      if (q % 2 != r % 2) partners_.push_back(q);
    }
    // Every rank's own view decides whether it can take part; the check is
    // the same computation everywhere, so every rank throws or none does.
    for (int q = 0; q < n; ++q) {
      bool any = false;
      for (int p : gossip_neighbours(o_.topology, q, n)) any = any || p % 2 != q % 2;
      if (!any) {
        throw ConfigError(fmt::format(
            "sync.topology = \"{}\": sync.scheme = \"adpsgd\" pairs even (active) ranks with odd "
            "(passive) neighbours, and rank {} of {} has no neighbour of the other parity "
            "(use ring or complete)",
            o_.topology, q, n));
      }
    }
    rng_.seed(0x5eed0000u + static_cast<uint64_t>(r));
    const uint64_t before = sync_bytes_sent(group_);
    pair_ = group_.split(0, r, "adpsgd", opts());  // its agreement is no gossip traffic
    side_bytes_ += sync_bytes_sent(group_) - before;
    MemoryScope tag(MemoryCategory::comm);
    send_ = Tensor::empty({flat_.numel() + 1}, DType::f32);
    recv_ = Tensor::empty({flat_.numel()}, DType::f32);
    published_ = Tensor::empty({flat_.numel()}, DType::f32);
    if (r % 2 == 1) {
      pending_sum_ = Tensor::zeros({flat_.numel()}, DType::f32);
      // one request float per active neighbour, then one parameter body
      recv_ = Tensor::empty({static_cast<int64_t>(partners_.size()) + flat_.numel()}, DType::f32);
    }
  }

  // Active: send this rank's parameters to a random passive neighbour, take
  // its reply, keep the mean of the two. Passive: fold in the averages its
  // server took since the last step and publish the result.
  void adpsgd_step() {
    rethrow_server_error();
    if (group_.rank() % 2 == 1) {
      apply_pending();
      return;
    }
    std::uniform_int_distribution<size_t> pick(0, partners_.size() - 1);
    const size_t edge = pick(rng_);
    const int q = partners_[edge];
    if (choco_) {
      choco_exchange(edge, q);
      return;
    }
    float* out = send_.data<float>();
    out[0] = kAverage;
    std::memcpy(out + 1, flat_.raw(), n_ * sizeof(float));
    const auto t0 = std::chrono::steady_clock::now();
    // A one-float request first (the passive server polls for those), then
    // the parameters, which its server receives with a blocking call.
    pair_->send(out, 1, DType::f32, q, p2p(kRequestTag));
    pair_->send(out + 1, n_, DType::f32, q, p2p(kBodyTag));
    pair_->recv(recv_.raw(), n_, DType::f32, q, p2p(kReplyTag));
    reply_wait_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ++exchanges_;
    float* theta = flat_.data<float>();
    const float* x = recv_.data<float>();
    for (size_t i = 0; i < n_; ++i) theta[i] = 0.5F * (theta[i] + x[i]);
  }

  // adpsgd active with a codec (CHOCO-SGD on one edge): q_a = Q(x_a -
  // xhat_a) to partner q, which answers q_p = Q(x_p - xhat_p) (its published
  // parameters); both sides add each to their copies of that edge's xhat_a,
  // xhat_p; then x_a += gamma / 2 (xhat_p - xhat_a) (the passive, at its next step
  // boundary, x_p += gamma / 2 (xhat_a - xhat_p)). Exact codec, gamma 1: xhat = x
  // after the exchange and both move to the pair's mean.
  // A pair's first exchange sends whole f32 parameters both ways instead
  // (each side's copies start exact, as gossip's seed_public_copies()).
  void choco_exchange(size_t edge, int q) {
    const bool met = met_[edge] != 0;
    met_[edge] = 1;
    const size_t bytes = met ? choco_->payload_bytes() : n_ * sizeof(float);
    float* mine = edge_hat(edge, 0);
    float* theirs = edge_hat(edge, 1);
    if (met) {
      choco_->encode({flat_.data<float>(), n_}, {mine, n_}, group_.rank(), choco_draws_++,
                     {choco_out_.data(), bytes});
      choco_->decode_add({choco_out_.data(), bytes}, 1.0F, {mine, n_});
    } else {
      std::memcpy(choco_out_.data(), flat_.raw(), bytes);
      std::memcpy(mine, flat_.raw(), bytes);
    }
    float* out = send_.data<float>();
    out[0] = kAverage;
    const auto t0 = std::chrono::steady_clock::now();
    pair_->send(out, 1, DType::f32, q, p2p(kRequestTag));
    pair_->send(choco_out_.data(), bytes, DType::u8, q, p2p(kBodyTag));
    pair_->recv(choco_in_.data(), bytes, DType::u8, q, p2p(kReplyTag));
    reply_wait_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ++exchanges_;
    if (met) {
      choco_->decode_add({choco_in_.data(), bytes}, 1.0F, {theirs, n_});
    } else {
      std::memcpy(theirs, choco_in_.data(), bytes);
    }
    float* theta = flat_.data<float>();
    const auto g = static_cast<float>(0.5 * o_.gossip_gamma);
    for (size_t i = 0; i < n_; ++i) theta[i] += g * (theirs[i] - mine[i]);
  }

  void apply_pending() {
    std::lock_guard lock(mu_);
    float* theta = flat_.data<float>();
    float* b = pending_sum_.data<float>();
    if (choco_) {  // CHOCO: an additive correction (choco_serve())
      for (size_t i = 0; i < n_; ++i) {
        theta[i] += b[i];
        b[i] = 0;
      }
    }
    if (pending_scale_ != 1) {
      const auto a = static_cast<float>(pending_scale_);
      for (size_t i = 0; i < n_; ++i) {
        theta[i] = a * theta[i] + b[i];
        b[i] = 0;
      }
      pending_scale_ = 1;
    }
    std::memcpy(published_.raw(), flat_.raw(), n_ * sizeof(float));
  }

  // Passive rank's server thread: the only user of pair_ on this rank. It
  // answers each active neighbour's request with the published parameters
  // and records theta <- (theta + x_active) / 2 as pending (applied at the
  // next step boundary). It waits on nobody but the active ranks' requests.
  void serve_loop() {
    try {
      float* in = recv_.data<float>();
      float* body = in + partners_.size();
      auto slot = [&](int q) {
        return static_cast<size_t>(std::find(partners_.begin(), partners_.end(), q) -
                                   partners_.begin());
      };
      for (int q : partners_) pair_->post_recv(in + slot(q), 1, DType::f32, q, p2p(kRequestTag));
      size_t open = partners_.size();
      std::vector<char> said_done(partners_.size(), 0);
      using Clock = std::chrono::steady_clock;
      Clock::time_point last_heard = Clock::now();
      MemoryScope tag(MemoryCategory::comm);
      Tensor reply = Tensor::empty({flat_.numel()}, DType::f32);
      std::vector<std::byte> choco_reply(choco_ ? choco_->payload_bytes() : 0);
      std::vector<float> choco_x(choco_ ? n_ : 0);
      while (open > 0 && !stop_) {
        const auto r = pair_->wait_any(std::chrono::milliseconds(50));
        if (!r) {
          // After this rank's last step, an active neighbour that neither
          // asks nor says "done" within the timeout is stuck: name it
          // rather than wait for ever (a slow one keeps asking).
          const int64_t since = finishing_since_.load();
          if (since == 0) continue;
          const Clock::time_point t0 =
              std::max(last_heard, Clock::time_point(Clock::duration(since)));
          const std::chrono::milliseconds limit = opts().timeout.value_or(pair_->options().timeout);
          if (Clock::now() - t0 < limit) continue;
          std::string silent;
          for (size_t i = 0; i < partners_.size(); ++i) {
            if (!said_done[i])
              silent += fmt::format("{}{}", silent.empty() ? "" : ", ", partners_[i]);
          }
          throw TimeoutError(fmt::format(
              "sync.scheme = \"adpsgd\": passive rank {} finished its steps, but active rank(s) "
              "{} sent neither a request nor \"done\" within {:.3g} s (dist.timeout_s): stuck or "
              "stopped?",
              group_.rank(), silent, static_cast<double>(limit.count()) / 1000.0));
        }
        last_heard = Clock::now();
        if (r->lost) {
          throw CommError(
              fmt::format("sync.scheme = \"adpsgd\": passive rank {} lost active "
                          "rank {}: {}",
                          group_.rank(), r->peer, r->lost_message));
        }
        if (in[slot(r->peer)] == kDone) {
          said_done[slot(r->peer)] = 1;
          --open;
          continue;
        }
        if (choco_) {
          choco_serve(slot(r->peer), r->peer, choco_reply, choco_x);
          ++served_;
          pair_->post_recv(in + slot(r->peer), 1, DType::f32, r->peer, p2p(kRequestTag));
          pair_->send(choco_reply.data(), choco_reply.size(), DType::u8, r->peer, p2p(kReplyTag));
          continue;
        }
        pair_->recv(body, n_, DType::f32, r->peer, p2p(kBodyTag));
        const float* x = body;
        {
          std::lock_guard lock(mu_);
          std::memcpy(reply.raw(), published_.raw(), n_ * sizeof(float));
          float* b = pending_sum_.data<float>();
          for (size_t i = 0; i < n_; ++i) b[i] = 0.5F * (b[i] + x[i]);
          pending_scale_ *= 0.5;
        }
        ++served_;
        pair_->post_recv(in + slot(r->peer), 1, DType::f32, r->peer, p2p(kRequestTag));
        pair_->send(reply.raw(), n_, DType::f32, r->peer, p2p(kReplyTag));
      }
    } catch (...) {
      std::lock_guard lock(mu_);
      server_error_ = std::current_exception();
    }
  }

  // Passive server with a codec: takes active rank q's q_a (edge `edge`)
  // into its copy of xhat_a, answers q_p = Q(x_p - xhat_p) into `reply` with x_p
  // = published + pending (the averages it took since its last step
  // boundary count, as the uncompressed server composes them), and adds
  // gamma / 2 (xhat_a - xhat_p) to pending. Exact codec, gamma 1: x_p + pending
  // becomes the mean of it and x_a, request after request.
  void choco_serve(size_t edge, int q, std::vector<std::byte>& reply, std::vector<float>& x) {
    const bool met = met_[edge] != 0;
    met_[edge] = 1;
    const size_t bytes = met ? choco_->payload_bytes() : n_ * sizeof(float);
    reply.resize(bytes);
    pair_->recv(choco_in_.data(), bytes, DType::u8, q, p2p(kBodyTag));
    float* mine = edge_hat(edge, 0);
    float* theirs = edge_hat(edge, 1);
    if (met) {
      choco_->decode_add({choco_in_.data(), bytes}, 1.0F, {theirs, n_});
    } else {
      std::memcpy(theirs, choco_in_.data(), bytes);
    }
    std::lock_guard lock(mu_);
    float* b = pending_sum_.data<float>();
    const float* pub = published_.data<float>();
    for (size_t i = 0; i < n_; ++i) x[i] = pub[i] + b[i];
    if (met) {
      choco_->encode(x, {mine, n_}, group_.rank(), choco_draws_++, {reply.data(), bytes});
      choco_->decode_add({reply.data(), bytes}, 1.0F, {mine, n_});
    } else {
      std::memcpy(reply.data(), x.data(), bytes);
      std::memcpy(mine, x.data(), bytes);
    }
    const auto g = static_cast<float>(0.5 * o_.gossip_gamma);
    for (size_t i = 0; i < n_; ++i) b[i] += g * (theirs[i] - mine[i]);
  }

  void rethrow_server_error() {
    std::exception_ptr e;
    {
      std::lock_guard lock(mu_);
      e = server_error_;
    }
    if (e) std::rethrow_exception(e);
  }

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

  void setup_codecs() {
    CompressedAllReduceOptions co;
    co.codec = parse_codec_spec(o_.codec);
    co.codec.error_feedback = o_.codec_error_feedback;
    co.collective = opts();
    if (o_.scheme == "diloco") {
      pieces_ = diloco_codec_pieces(layout_, flat_.numel(), o_.fragments, o_.period);
    } else {
      for (size_t k = 0; k < layout_.size(); ++k) {
        pieces_.push_back(
            {layout_[k].name, layout_[k].shape, layout_[k].offset, static_cast<int>(k), 0});
      }
    }
    for (const CodecPiece& p : pieces_) {  // ConfigError when k does not fit
      codecs_.push_back(std::make_unique<CompressedAllReduce>(group_, p.name, p.shape, co));
    }
    MemoryScope tag(MemoryCategory::comm);
    if (o_.scheme == "local_sgd" || o_.scheme == "partial") anchor_ = flat_.clone();
  }

  int64_t codec_residual_numel() const {
    int64_t n = 0;
    for (const auto& c : codecs_) n += static_cast<int64_t>(c->residual().size());
    return n;
  }

  // diloco: fragment f's pieces of the flat buffer `base` (flat offsets)
  // averaged in place over the ranks through their codecs (the average of
  // what each rank sent).
  void run_codecs(size_t f, float* base) {
    for (size_t k = 0; k < pieces_.size(); ++k) {
      if (pieces_[k].fragment != static_cast<int>(f)) continue;
      const std::span<float> x(base + pieces_[k].offset,
                               static_cast<size_t>(pieces_[k].shape.numel()));
      codecs_[k]->run(x, x);
    }
  }

  // local_sgd (group -1: every parameter) and partial (layer group
  // `group`) with a codec: each parameter's pseudo-gradient d_r = n s_r
  // (anchor - theta_r) (its change since its last synchronization, weighted
  // so the average over ranks is the batch-weighted mean) is averaged
  // through its codec, with its residual; theta = anchor - that average,
  // which is sum_r s_r theta_r when nothing is held back, and becomes the
  // next anchor. Blocking (partial's overlap is for its f32 all-reduce).
  void compressed_average(int group) {
    const auto w = static_cast<float>(share_ * static_cast<double>(group_.size()));
    for (size_t k = 0; k < layout_.size(); ++k) {
      const ParamLayoutEntry& e = layout_[k];
      if (group >= 0 && group_of_name_.at(e.name) != group) continue;
      float* theta = flat_.data<float>() + e.offset;
      float* a = anchor_.data<float>() + e.offset;
      const auto n = static_cast<size_t>(e.shape.numel());
      for (size_t i = 0; i < n; ++i) theta[i] = w * (a[i] - theta[i]);
      codecs_[k]->run({theta, n}, {theta, n});
      for (size_t i = 0; i < n; ++i) {
        theta[i] = a[i] - theta[i];
        a[i] = theta[i];
      }
    }
  }

  void plan_fragments() {
    for (const DilocoFragment& d : diloco_fragments(flat_.numel(), o_.fragments, o_.period)) {
      Fragment f;
      f.offset = d.offset;
      f.numel = d.numel;
      f.phase = d.phase;
      if (o_.outer_bits == 4 && !reduce_scatter()) {
        f.payload_at = payload_.size();
        f.payload_bytes = Int4Quantizer::payload_bytes(static_cast<size_t>(d.numel));
        payload_.resize(payload_.size() + f.payload_bytes);
      }
      if (reduce_scatter()) {
        const int64_t n = group_.size();
        f.piece = (d.numel + n - 1) / n;
        f.slot_bytes = Int4Quantizer::payload_bytes(static_cast<size_t>(f.piece));
        f.slot_at = slots_out_.size();
        slots_out_.resize(slots_out_.size() + static_cast<size_t>(n) * f.slot_bytes);
        f.payload_at = payload_.size();  // this rank's re-quantized piece
        f.payload_bytes = f.slot_bytes;
        payload_.resize(payload_.size() + f.slot_bytes);
      }
      frags_.push_back(f);
    }
    if (group_.size() == 1) return;
    slots_in_.resize(slots_out_.size());
    MemoryScope tag(MemoryCategory::comm);
    // Without overlap the pseudo-gradient is computed, exchanged and
    // decoded in the parameters' own memory (they become start anyway).
    if (o_.overlap_steps > 0) outer_stage_ = Tensor::empty({flat_.numel()}, DType::f32);
    gathered_.resize(payload_.size() * static_cast<size_t>(group_.size()));
  }

  // After step t's inner update: the exchanges due at t land, then every
  // fragment whose turn it is (t = phase mod period) sends its weighted
  // pseudo-gradient share * (start - theta). Without overlap it lands at
  // once (plain DiLoCo when there is one fragment).
  void streaming_step() {
    // reduce_scatter: pieces sent after an earlier step are reduced now and
    // their all_gather starts.
    for (Flight& fl : flights_) {
      if (fl.stage == 1 && fl.started < steps_) second_stage(fl);
    }
    for (auto it = flights_.begin(); it != flights_.end();) {
      if (it->due == steps_) {
        land(*it);
        it = flights_.erase(it);
      } else {
        ++it;
      }
    }
    for (size_t f = 0; f < frags_.size(); ++f) {
      if ((steps_ - frags_[f].phase) % o_.period != 0) continue;
      Flight fl = launch(f);
      if (o_.overlap_steps == 0) {
        land(fl);
      } else {
        flights_.push_back(std::move(fl));
      }
    }
  }

  Flight launch(size_t f) {
    const Fragment& fr = frags_[f];
    // With a codec each rank sends n s_r (start - theta_r) and the exchange
    // averages: sum_r s_r (start - theta_r), as the f32 sum below.
    const auto s =
        static_cast<float>(codecs_.empty() ? share_ : share_ * static_cast<double>(group_.size()));
    const float* theta = flat_.data<float>() + fr.offset;  // may alias d
    const float* start = start_.data<float>() + fr.offset;
    float* d = pseudo_gradient(fr);
    const auto n = static_cast<size_t>(fr.numel);
    for (size_t i = 0; i < n; ++i) d[i] = s * (start[i] - theta[i]);
    Flight fl;
    fl.fragment = f;
    fl.due = steps_ + o_.overlap_steps;
    fl.started = steps_;
    ++outer_syncs_;
    const bool wait = o_.overlap_steps == 0;
    if (reduce_scatter()) {
      // Piece r of this rank's pseudo-gradient, quantized, goes to rank r.
      const int ranks = group_.size();
      std::byte* out = slots_out_.data() + fr.slot_at;
      for (int r = 0; r < ranks; ++r) {
        const auto [lo, len] = piece_of(fr, r);
        const uint64_t draw = static_cast<uint64_t>(steps_) * 4096 + static_cast<uint64_t>(r);
        encode_slot({d + lo, len}, codec_seed(0xd11c0 + f, group_.rank(), draw),
                    {out + static_cast<size_t>(r) * fr.slot_bytes, fr.slot_bytes});
      }
      std::byte* in = slots_in_.data() + fr.slot_at;
      if (wait) {
        const auto t0 = std::chrono::steady_clock::now();
        group_.all_to_all(out, in, fr.slot_bytes, DType::u8, opts());
        outer_wait_s_ += seconds_since(t0);
        second_stage(fl);
      } else {
        fl.handle = group_.all_to_all_async(out, in, fr.slot_bytes, DType::u8, opts());
      }
      return fl;
    }
    const auto t0 = std::chrono::steady_clock::now();
    if (!codecs_.empty()) {  // 32 bits (validate_sync_options)
      float* base = d - fr.offset;
      if (!wait && fragment_can_start(f)) {
        // Each piece encoded now, its collective in flight until resolve().
        for (size_t k = 0; k < pieces_.size(); ++k) {
          if (pieces_[k].fragment != static_cast<int>(f)) continue;
          codecs_[k]->start(
              {base + pieces_[k].offset, static_cast<size_t>(pieces_[k].shape.numel())});
        }
        fl.codec_started = true;
        outer_wait_s_ += seconds_since(t0);
        return fl;
      }
      run_codecs(f, base);  // blocking (PowerSGD; or no overlap); lands when due
      outer_wait_s_ += seconds_since(t0);
      return fl;
    }
    if (o_.outer_bits == 32) {
      if (wait) {
        group_.all_reduce(d, d, n, DType::f32, ReduceOp::sum, opts());
        outer_wait_s_ += seconds_since(t0);
      } else {
        fl.handle = group_.all_reduce_async(d, d, n, DType::f32, ReduceOp::sum, opts());
      }
      return fl;
    }
    std::byte* mine = payload_.data() + fr.payload_at;
    std::byte* all = gathered_.data() + fr.payload_at * static_cast<size_t>(group_.size());
    Int4Quantizer::encode({d, n}, codec_seed(0xd11c0 + f, group_.rank(), steps_),
                          {mine, fr.payload_bytes});
    if (wait) {
      const auto t1 = std::chrono::steady_clock::now();
      group_.all_gather(mine, all, fr.payload_bytes, DType::u8, opts());
      outer_wait_s_ += seconds_since(t1);
    } else {
      fl.handle = group_.all_gather_async(mine, all, fr.payload_bytes, DType::u8, opts());
    }
    return fl;
  }

  bool reduce_scatter() const {
    return o_.outer_bits == 4 && o_.outer_exchange == "reduce_scatter";
  }

  // Piece r of a fragment (reduce_scatter): [lo, lo + len) of its elements.
  static std::pair<size_t, size_t> piece_of(const Fragment& fr, int r) {
    const int64_t lo = std::min(fr.numel, r * fr.piece);
    const int64_t hi = std::min(fr.numel, lo + fr.piece);
    return {static_cast<size_t>(lo), static_cast<size_t>(hi - lo)};
  }

  // A piece's payload in a slot sized for a whole piece (the rest zeros).
  static void encode_slot(std::span<const float> x, uint64_t seed, std::span<std::byte> slot) {
    const size_t used = Int4Quantizer::payload_bytes(x.size());
    Int4Quantizer::encode(x, seed, slot.first(used));
    std::fill(slot.begin() + static_cast<std::ptrdiff_t>(used), slot.end(), std::byte{0});
  }
  static void decode_slot(std::span<const std::byte> slot, std::span<float> out) {
    Int4Quantizer::decode_add(slot.first(Int4Quantizer::payload_bytes(out.size())), out);
  }

  // reduce_scatter, after the all_to_all: this rank's piece summed in f32
  // (the ranks' pieces decoded in rank order), re-quantized and
  // all-gathered.
  void second_stage(Flight& fl) {
    const Fragment& fr = frags_[fl.fragment];
    if (fl.handle.valid()) {
      const auto t0 = std::chrono::steady_clock::now();
      fl.handle.wait();
      outer_wait_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      fl.handle = CommHandle();
    }
    const int ranks = group_.size(), me = group_.rank();
    float* d = pseudo_gradient(fr);
    const auto [lo, len] = piece_of(fr, me);
    std::fill(d + lo, d + lo + len, 0.0F);
    const std::byte* in = slots_in_.data() + fr.slot_at;
    for (int r = 0; r < ranks; ++r) {
      decode_slot({in + static_cast<size_t>(r) * fr.slot_bytes, fr.slot_bytes}, {d + lo, len});
    }
    std::byte* mine = payload_.data() + fr.payload_at;
    encode_slot({d + lo, len}, codec_seed(0x5ca77e4 + fl.fragment, me, fl.started),
                {mine, fr.slot_bytes});
    std::byte* all = gathered_.data() + fr.payload_at * static_cast<size_t>(ranks);
    fl.stage = 2;
    if (o_.overlap_steps == 0) {
      const auto t0 = std::chrono::steady_clock::now();
      group_.all_gather(mine, all, fr.slot_bytes, DType::u8, opts());
      outer_wait_s_ += seconds_since(t0);
    } else {
      fl.handle = group_.all_gather_async(mine, all, fr.slot_bytes, DType::u8, opts());
    }
  }

  static double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  // diloco: lets the exchanges in flight finish (they still land when due).
  // A measurement's blocking collective would queue behind them, and their
  // bytes would be counted as the measurement's.
  void quiesce() {
    for (Flight& fl : flights_) {
      if (fl.handle.valid()) fl.handle.wait();
      if (!fl.codec_started) continue;
      for (size_t k = 0; k < pieces_.size(); ++k) {
        if (pieces_[k].fragment == static_cast<int>(fl.fragment)) codecs_[k]->wait();
      }
    }
  }

  // sync.codec with overlap: whether every piece of fragment f has an
  // asynchronous exchange (payload codecs; PowerSGD's two dependent
  // all-reduces run blocking when the fragment is sent).
  bool fragment_can_start(size_t f) const {
    for (size_t k = 0; k < pieces_.size(); ++k) {
      if (pieces_[k].fragment == static_cast<int>(f) && !codecs_[k]->can_start()) return false;
    }
    return true;
  }

  // Where a fragment's pseudo-gradient lives while it is exchanged.
  float* pseudo_gradient(const Fragment& fr) {
    return (o_.overlap_steps > 0 ? outer_stage_ : flat_).data<float>() + fr.offset;
  }

  // The fragment's summed pseudo-gradient takes the outer Nesterov step on
  // `start` (v = mu v + d; start -= lr (d + mu v)); the replica's fragment
  // becomes start (no overlap) or alpha theta + (1 - alpha) start.
  void land(Flight& fl) {
    const Fragment& fr = frags_[fl.fragment];
    resolve(fl);
    const auto n = static_cast<size_t>(fr.numel);
    float* d = pseudo_gradient(fr);
    float* theta = flat_.data<float>() + fr.offset;
    float* start = start_.data<float>() + fr.offset;
    float* v = momentum_.data<float>() + fr.offset;
    const auto mu = static_cast<float>(o_.outer_momentum);
    const auto lr = static_cast<float>(o_.outer_lr);
    const bool mix = o_.overlap_steps > 0;
    const auto a = static_cast<float>(o_.merge_alpha);
    for (size_t i = 0; i < n; ++i) {  // d may alias theta (no overlap)
      const float di = d[i];
      v[i] = mu * v[i] + di;
      start[i] -= lr * (di + mu * v[i]);  // Nesterov
      theta[i] = mix ? a * theta[i] + (1.0F - a) * start[i] : start[i];
    }
  }

  // Completes a fragment's exchange: its summed pseudo-gradient in
  // pseudo_gradient() (4-bit payloads decoded in rank order). The same
  // values whenever it runs, so a checkpoint may resolve early.
  void resolve(Flight& fl) {
    if (fl.resolved) return;
    fl.resolved = true;
    const Fragment& fr = frags_[fl.fragment];
    if (fl.codec_started) {  // the pieces' averages into pseudo_gradient()
      const auto t0 = std::chrono::steady_clock::now();
      float* base = pseudo_gradient(fr) - fr.offset;
      for (size_t k = 0; k < pieces_.size(); ++k) {
        if (pieces_[k].fragment != static_cast<int>(fl.fragment)) continue;
        codecs_[k]->finish(
            {base + pieces_[k].offset, static_cast<size_t>(pieces_[k].shape.numel())});
      }
      fl.codec_started = false;
      outer_wait_s_ += seconds_since(t0);
      return;
    }
    if (reduce_scatter() && fl.stage == 1) second_stage(fl);
    if (fl.handle.valid()) {
      const auto t0 = std::chrono::steady_clock::now();
      fl.handle.wait();
      outer_wait_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      fl.handle = CommHandle();
    }
    const auto n = static_cast<size_t>(fr.numel);
    float* d = pseudo_gradient(fr);
    if (reduce_scatter()) {
      // Every rank decodes the same re-quantized pieces: the same sum.
      std::fill(d, d + n, 0.0F);
      const std::byte* all = gathered_.data() + fr.payload_at * static_cast<size_t>(group_.size());
      for (int r = 0; r < group_.size(); ++r) {
        const auto [lo, len] = piece_of(fr, r);
        decode_slot({all + static_cast<size_t>(r) * fr.slot_bytes, fr.slot_bytes}, {d + lo, len});
      }
    } else if (o_.outer_bits == 4) {
      // Every rank decodes the same payloads in rank order: the same sum.
      std::fill(d, d + n, 0.0F);
      const std::byte* all = gathered_.data() + fr.payload_at * static_cast<size_t>(group_.size());
      for (int r = 0; r < group_.size(); ++r) {
        Int4Quantizer::decode_add(
            {all + static_cast<size_t>(r) * fr.payload_bytes, fr.payload_bytes}, {d, n});
      }
    }
  }

  void setup_choco() {
    const CodecSpec spec = parse_codec_spec(o_.codec);
    choco_ = std::make_unique<ChocoCodec>(spec, layout_);  // ConfigError when k does not fit
    const size_t bytes = choco_->payload_bytes();
    MemoryScope tag(MemoryCategory::comm);
    if (o_.scheme == "gossip") {
      public_ = Tensor::zeros({flat_.numel()}, DType::f32);
      mixed_ = Tensor::zeros({flat_.numel()}, DType::f32);
      const size_t deg = std::max<size_t>(neighbours_.size(), 1);
      choco_out_.resize(deg * bytes);
      choco_in_.resize(deg * bytes);
    } else if (group_.size() > 1) {  // adpsgd
      edge_hats_ =
          Tensor::zeros({2 * static_cast<int64_t>(partners_.size()) * flat_.numel()}, DType::f32);
      // A pair's first exchange sends whole f32 copies (choco_exchange()).
      choco_out_.resize(std::max(bytes, n_ * sizeof(float)));
      choco_in_.resize(std::max(bytes, n_ * sizeof(float)));
      met_.assign(partners_.size(), 0);
      // The payloads replace the f32 bodies: only the request floats stay.
      send_ = Tensor::empty({1}, DType::f32);
      if (group_.rank() % 2 == 0) recv_ = Tensor::empty({1}, DType::f32);
    }
  }

  // gossip with a codec, before the first step after a start (or a resume
  // without the copies): one plain exchange of the parameters, so every
  // xhat_j starts as x_j exactly on every rank that holds it (xhat = 0 would
  // make the first exchanges send the parameters themselves through the
  // codec, and stochastic codecs, drawing differently on every rank, would
  // push identical replicas apart).
  void seed_public_copies() {
    choco_fresh_ = false;
    const int n = group_.size();
    const size_t deg = neighbours_.size();
    std::vector<float> send(deg * n_), recv(deg * n_);
    std::vector<size_t> counts(static_cast<size_t>(n), 0);
    for (size_t k = 0; k < deg; ++k) {
      counts[static_cast<size_t>(neighbours_[k])] = n_;
      std::memcpy(send.data() + k * n_, flat_.raw(), n_ * sizeof(float));
    }
    group_.all_to_allv(send.data(), counts, recv.data(), counts, DType::f32, opts());
    const auto w = static_cast<float>(1.0 / static_cast<double>(deg + 1));
    const float* theta = flat_.data<float>();
    float* hat = public_.data<float>();
    float* mixed = mixed_.data<float>();
    for (size_t i = 0; i < n_; ++i) {
      float sum = theta[i];
      for (size_t k = 0; k < deg; ++k) sum += recv[k * n_ + i];
      hat[i] = theta[i];
      mixed[i] = w * sum;
    }
  }

  // gossip with a codec (CHOCO-SGD): q_i = Q(x_i - xhat_i) to every
  // neighbour by one all_to_allv (only neighbours receive); xhat_i += q_i;
  // mixed += w (q_i + sum_j q_j); x_i += gamma (mixed - xhat_i).
  void choco_mix() {
    const int n = group_.size();
    const size_t bytes = choco_->payload_bytes();
    std::byte* mine = choco_out_.data();
    choco_->encode({flat_.data<float>(), n_}, {public_.data<float>(), n_}, group_.rank(),
                   static_cast<uint64_t>(steps_), {mine, bytes});
    std::vector<size_t> counts(static_cast<size_t>(n), 0);
    for (size_t k = 0; k < neighbours_.size(); ++k) {  // ascending: destination order
      counts[static_cast<size_t>(neighbours_[k])] = bytes;
      if (k > 0) std::memcpy(mine + k * bytes, mine, bytes);
    }
    group_.all_to_allv(choco_out_.data(), counts, choco_in_.data(), counts, DType::u8, opts());
    const auto w = static_cast<float>(1.0 / static_cast<double>(neighbours_.size() + 1));
    const std::span<float> hat(public_.data<float>(), n_);
    const std::span<float> mixed(mixed_.data<float>(), n_);
    choco_->decode_add({mine, bytes}, 1.0F, hat);
    choco_->decode_add({mine, bytes}, w, mixed);
    for (size_t k = 0; k < neighbours_.size(); ++k) {
      choco_->decode_add({choco_in_.data() + k * bytes, bytes}, w, mixed);
    }
    float* theta = flat_.data<float>();
    const auto g = static_cast<float>(o_.gossip_gamma);
    for (size_t i = 0; i < n_; ++i) theta[i] += g * (mixed[i] - hat[i]);
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
  if (o.scheme == "diloco" && o.fragments > static_cast<int64_t>(layout.size())) {
    throw ConfigError(fmt::format(
        "sync.fragments = {}: the model has {} parameter tensors, so at most {} fragments "
        "(a fragment is a consecutive run of the flat parameters, about 1 / fragments of them)",
        o.fragments, layout.size(), layout.size()));
  }
  return std::make_unique<LocalStepsSync>(o, group, std::move(layout), std::move(flat_params),
                                          std::move(dp), local_share);
}

std::vector<DilocoFragment> diloco_fragments(int64_t numel, int64_t fragments, int64_t period) {
  MT_CHECK(fragments >= 1 && period >= 1, "diloco_fragments({}, {}, {})", numel, fragments, period);
  std::vector<DilocoFragment> out;
  for (int64_t f = 0; f < fragments; ++f) {
    DilocoFragment d;
    d.offset = f * numel / fragments;
    d.numel = (f + 1) * numel / fragments - d.offset;
    d.phase = f * period / fragments;
    out.push_back(d);
  }
  return out;
}

std::vector<CodecPiece> diloco_codec_pieces(const ParamLayout& layout, int64_t flat_numel,
                                            int64_t fragments, int64_t period) {
  std::vector<CodecPiece> out;
  const std::vector<DilocoFragment> frags = diloco_fragments(flat_numel, fragments, period);
  for (size_t f = 0; f < frags.size(); ++f) {
    const int64_t flo = frags[f].offset, fhi = flo + frags[f].numel;
    for (size_t k = 0; k < layout.size(); ++k) {
      const ParamLayoutEntry& e = layout[k];
      const int64_t numel = e.shape.numel();
      const int64_t lo = std::max(flo, e.offset), hi = std::min(fhi, e.offset + numel);
      if (lo >= hi) continue;
      CodecPiece p;
      p.offset = lo;
      p.param = static_cast<int>(k);
      p.fragment = static_cast<int>(f);
      const int64_t len = hi - lo, at = lo - e.offset;
      if (len == numel) {
        p.name = e.name;
        p.shape = e.shape;
      } else {
        p.name = fmt::format("{}[{}:{}] (fragment {})", e.name, at, at + len, f);
        const int64_t cols = e.shape.rank() >= 2 ? numel / e.shape[0] : 0;
        p.shape =
            cols > 0 && at % cols == 0 && len % cols == 0 ? Shape{len / cols, cols} : Shape{len};
      }
      out.push_back(std::move(p));
    }
  }
  return out;
}

}  // namespace mt
