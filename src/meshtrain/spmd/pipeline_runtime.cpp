#include "meshtrain/spmd/pipeline_runtime.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <set>
#include <tuple>
#include <utility>

#include "meshtrain/base/error.h"
#include "meshtrain/base/timer.h"
#include "meshtrain/tensor/memory_stats.h"

namespace mt {

namespace {

// Receives are posted this many actions ahead of the action that waits for
// them: early enough that the message lands while the compute before it
// runs, late enough that a 1F1B stage holds about p received buffers, not m.
constexpr size_t kRecvLookahead = 6;

// At most this many executors per stage run its forward (plan_views()):
// each keeps the stash of a micro-batch in flight in its arena until that
// micro-batch's backward, so the forward copies nothing. 3 covers 1F1B's
// first stage at p = 2 (2 micro-batches in flight plus one arena free for
// the next forward); beyond it forwards copy their stash out, as before.
constexpr size_t kForwardArenas = 3;

size_t ix(int v) {
  return static_cast<size_t>(v);
}

using Stash = std::map<std::string, Tensor>;

struct Pass {
  const StagePass* pass = nullptr;
  std::unique_ptr<Executor> exec;  // null for a pass without nodes
  // Parameter gradients the executor writes straight into the runtime's
  // accumulators (bound; each run after the step's first adds its matmul's
  // product there, Executor::set_accumulate), with their parameters'
  // names. The others stay in the arena and are added by flush_grads().
  std::vector<std::pair<ValueId, std::string>> direct;
};

// Whether gradient value `gv` of `g` can accumulate in place: an f32 matmul
// produces it and no node reads it (Executor::set_accumulate).
bool accumulates_in_place(const Graph& g, ValueId gv) {
  const Value& val = g.value(gv);
  if (val.producer == kNoNode || val.dtype != DType::f32) return false;
  const Node& n = g.node(val.producer);
  if (n.op != OpKind::matmul || n.outputs.size() != 1) return false;
  for (ValueId v : n.inputs) {
    if (g.value(v).dtype != DType::f32) return false;
  }
  for (const Node& r : g.nodes()) {
    if (std::ranges::find(r.inputs, gv) != r.inputs.end()) return false;
  }
  return true;
}

struct StageRt {
  const PipelineStage* st = nullptr;
  Pass forward, backward, backward_input, backward_weight;
  std::vector<Pass> forward_more;  // the forward's arenas 1, 2, ... (plan_views())

  Pass& forward_in(size_t slot) { return slot == 0 ? forward : forward_more[slot - 1]; }
};

void add_into(Tensor& acc, const Tensor& g, const std::string& name) {
  MT_CHECK(acc.numel() == g.numel() && acc.dtype() == DType::f32 && g.dtype() == DType::f32,
           "pipeline: gradient of '{}' is {}, its accumulator {}", name, g.desc(), acc.desc());
  float* a = acc.data<float>();
  const float* b = g.data<float>();
  const int64_t n = acc.numel();  // hoisted: numel() walks the shape
  for (int64_t i = 0; i < n; ++i) a[i] += b[i];
}

}  // namespace

struct PipelineRuntime::Impl {
  Communicator& comm;
  PipelineCut cut;
  PipelineSchedule sched;
  PipelineOptions opts;
  int p = 1, m = 1, rank = 0;  // rank: this rank's physical stage
  int me = 0;                  // this rank in comm
  const CrossMeshExchange* xm = nullptr;
  int tensors_per_stage = 1;  // for tags
  std::vector<int> mine;      // virtual stages
  std::map<int, StageRt> stages;
  std::vector<std::string> param_names;
  std::map<std::string, Tensor> params, grads;
  // Per accumulator: whether a pass of this step has written it yet. The
  // first pass copies its gradient in instead of adding it to zeros, so a
  // step neither zeroes the accumulators first nor reads them in its first
  // addition (flush_grads()); the ones no pass wrote are zeroed at the end.
  std::map<std::string, bool> written;

  // Per step.
  std::map<std::pair<int, int>, Stash> stash;  // (virtual stage, micro-batch)
  std::map<std::tuple<int, int, int>, std::vector<CommHandle>> recvs;  // (kind, stage, mb)
  // The receive buffers of recvs, kept across micro-batches and steps
  // (recv_buffer()). A fresh buffer's pages are first touched by the
  // receiver's copy of the message, inside its poll: 128 page faults per
  // 512 KB message, 0.25 of the copy's 0.3 ms on the machine measured
  // (docs/plan.md, "The 1F1B gap"). recv_buffers_made: how many it made.
  std::vector<Tensor> recv_pool;
  int64_t recv_buffers_made = 0;
  // Stages on different meshes: the routes' hops into this rank, finished
  // (relayed hops received, passed on, assembled) when the action waits.
  struct Arrival {
    const ReshardPlan* plan = nullptr;
    size_t route = 0, hop = 0;  // hop: this rank's place in the route's targets
    Tensor buf, dest;
    Box dbox;
    Communicator* relay = nullptr;
    uint32_t tag = 0;
  };
  std::map<std::tuple<int, int, int>, std::vector<Arrival>> xrecvs;
  std::vector<std::pair<CommHandle, Tensor>> sends;
  // Sends reading an executor's arena (the tensors a pass hands straight to
  // the send that follows it, not copied out): that executor runs again
  // only once they are done (run_pass). sending_from: set while such a
  // send is issued.
  std::vector<std::pair<CommHandle, const Executor*>> arena_sends;
  const Executor* sending_from = nullptr;
  std::vector<PipelineSpan> spans, waits;
  bool recomputing = false;  // run_pass is rerunning a forward
  double loss_sum = 0;
  int losses = 0;
  int64_t stash_now = 0, stash_peak = 0;
  int64_t copied = 0;         // bytes cloned out of the arenas this step
  int64_t bf16_elements = 0;  // opts.bf16_stash: elements stashed in bf16 this step
  uint64_t sent = 0;
  size_t posted = 0;  // actions whose receives are posted
  // Per action of this rank's list: a forward whose stash may stay in its
  // executor's arena (views, no copies), because every pass that reads that
  // micro-batch's stash runs before the executor runs again (plan_views()).
  std::vector<bool> keep_views;
  // Per action of this rank's list: which of its stage's forward executors
  // runs it (0 for any other action).
  std::vector<size_t> fwd_slot;
  // Backward passes whose parameter gradients are still in their
  // executor's arena, to be added into the accumulators (flush_grads()).
  std::vector<Pass*> pending_grads;

  // Asynchronous pipelining (PipelineOptions::async).
  using Weights = std::map<std::string, Tensor>;
  int version = 0;                          // weight updates applied on this rank
  int window = 0;                           // steps run: the next window of the stream
  bool draining = false;                    // drain() is running
  std::vector<PipelineAction> window_list;  // this call's actions (async)
  std::map<int, int> fwd_version;           // micro-batch in flight -> version its forward used
  std::map<int, Weights> versions;          // pipedream: older versions still to be used
  Weights current;                          // the newest weights while another version is in params
  Weights smooth;                           // spectrain: smoothed change per update
  bool swapped = false;
  int64_t wstash_now = 0, wstash_peak = 0;
  // Async with a parameter shared by stages (GPT's tied wte): its lowest
  // holder owns it (updates it with the summed gradient, stashes and
  // predicts it with its other weights); the other holders, the last stage
  // (version gap 0), mirror it: before the forward of micro-batch j they
  // receive the value the owner's forward of j used, after its backward
  // they send the owner their part of j's gradient, and they never update
  // it themselves (async_mirrored()). Index k: the tag's slot.
  struct Tied {
    std::string name;
    int owner = 0;
    std::vector<int> mirrors;
  };
  std::vector<Tied> tied;
  int wversions_peak = 0;
  // act[q] / grad[q]: what physical stage q sends; shared: the tied-gradient
  // exchange. Declared last so that they are destroyed first: a
  // communicator's destructor waits for its queued sends and receives,
  // whose buffers the stash and the send list above own.
  std::vector<std::unique_ptr<Communicator>> act, grad;
  // Stages on different meshes: what stage q's boundaries relay inside the
  // receiving stage, and the reductions inside q of a partial source.
  std::vector<std::unique_ptr<Communicator>> act_relay, grad_relay;
  std::unique_ptr<Communicator> shared;
  // Stages on different meshes: a boundary between two virtual stages of
  // this rank's physical stage (ZBV's turn) resharded inside its ranks.
  std::unique_ptr<Communicator> local;

  Impl(Communicator& c, const PipelineCut& k, PipelineSchedule s, PipelineOptions o)
      : comm(c), cut(k), sched(std::move(s)), opts(std::move(o)) {}

  int owner(int vs) const { return sched.owner(vs); }
  const PipelineStage& st(int vs) const { return cut.stages[ix(vs)]; }

  uint32_t tag(int sender_vs, int mb, int k) const {
    // Async: global micro-batch ids; at most p < 2m are in flight at once.
    const int tag_m = opts.async == AsyncMode::none ? m : 2 * m;
    const int64_t t =
        1 + (static_cast<int64_t>(sender_vs) * tag_m + mb % tag_m) * tensors_per_stage + k;
    if (t > static_cast<int64_t>(kMaxUserTag)) {
      throw ConfigError(fmt::format(
          "pipeline: {} virtual stages x {} micro-batches x {} boundary tensors need more "
          "message tags than the communicator has ({})",
          sched.virtual_count(), m, tensors_per_stage, kMaxUserTag));
    }
    return static_cast<uint32_t>(t);
  }

  void build() {
    p = sched.stages;
    m = sched.microbatches;
    rank = me = comm.rank();
    if (opts.cross_mesh) {
      xm = &*opts.cross_mesh;
      if (static_cast<int>(xm->stage_ranks.size()) != p) {
        throw ConfigError(fmt::format(
            "pipeline: stages on different meshes: {} rank sets for a schedule of {} stages x {} "
            "virtual (expected one set per physical stage)",
            xm->stage_ranks.size(), p, sched.virtual_stages));
      }
      rank = -1;
      for (int q = 0; q < p; ++q) {
        if (std::ranges::find(xm->stage_ranks[ix(q)], me) != xm->stage_ranks[ix(q)].end()) rank = q;
      }
      if (rank < 0) {
        throw ConfigError(fmt::format("pipeline: rank {} of the job runs no stage", me));
      }
      for (int vs = 0; vs + 1 < sched.virtual_count(); ++vs) {
        if (ix(vs) >= xm->boundaries.size() ||
            xm->boundaries[ix(vs)].size() != cut.stages[ix(vs)].outputs.size()) {
          throw ConfigError(fmt::format(
              "pipeline: stages on different meshes: boundary {} -> {} has {} tensors but {} "
              "plans",
              vs, vs + 1, cut.stages[ix(vs)].outputs.size(),
              ix(vs) < xm->boundaries.size() ? xm->boundaries[ix(vs)].size() : 0));
        }
      }
      if (cut.shared_params.size() != xm->shared.size()) {
        throw ConfigError(fmt::format(
            "pipeline: stages on different meshes: {} parameters shared by stages but {} plans "
            "to sum their gradients",
            cut.shared_params.size(), xm->shared.size()));
      }
    } else if (comm.size() != p) {
      throw ConfigError(
          fmt::format("pipeline: the schedule has {} stages but the pipeline group has {} ranks", p,
                      comm.size()));
    }
    if (static_cast<int>(cut.stages.size()) != sched.virtual_count()) {
      throw ConfigError(fmt::format(
          "pipeline: the model is cut into {} stages but the schedule runs {} ({} stages x {} "
          "virtual)",
          cut.stages.size(), sched.virtual_count(), p, sched.virtual_stages));
    }
    for (const PipelineStage& s : cut.stages) {
      tensors_per_stage = std::max<int>(tensors_per_stage, static_cast<int>(s.outputs.size()));
    }
    for (int vs = 0; vs < sched.virtual_count(); ++vs) {
      if (owner(vs) == rank) mine.push_back(vs);
    }
    // Parameters in model order over this rank's stages, one tensor per name.
    for (int vs : mine) {
      for (const std::string& name : st(vs).params) {
        if (params.count(name) != 0) continue;
        const Graph& g = st(vs).forward.graph;
        const Value& v = g.value(*g.find(name));
        {
          MemoryScope as_params(MemoryCategory::params);
          params[name] = Tensor::zeros(v.shape, v.dtype);
        }
        MemoryScope as_grads(MemoryCategory::grads);
        grads[name] = Tensor::zeros(v.shape, DType::f32);
        written[name] = true;
        param_names.push_back(name);
      }
    }
    for (int vs : mine) {
      StageRt& r = stages[vs];
      r.st = &st(vs);
      r.forward = make_pass(r.st->forward);
      r.backward = make_pass(r.st->backward);
      r.backward_input = make_pass(r.st->backward_input);
      r.backward_weight = make_pass(r.st->backward_weight);
    }
    for (int q = 0; q < p; ++q) {
      act.push_back(comm.split(0, me, fmt::format("{}/pp_act{}", comm.name(), q)));
      grad.push_back(comm.split(0, me, fmt::format("{}/pp_grad{}", comm.name(), q)));
      if (xm != nullptr) {
        act_relay.push_back(comm.split(0, me, fmt::format("{}/pp_act_relay{}", comm.name(), q)));
        grad_relay.push_back(comm.split(0, me, fmt::format("{}/pp_grad_relay{}", comm.name(), q)));
      }
    }
    shared = comm.split(0, me, comm.name() + "/pp_shared");
    if (xm != nullptr) local = comm.split(0, me, comm.name() + "/pp_local");
    plan_views();
    for (size_t i = 0; i < fwd_slot.size(); ++i) {
      StageRt& r = stages.at(sched.actions[ix(rank)][i].stage);
      while (r.forward_more.size() < fwd_slot[i])
        r.forward_more.push_back(make_pass(r.st->forward));
    }
    if (opts.async != AsyncMode::none) check_async_setup();
  }

  // A forward's stash (what its backward passes and a next stage on this
  // rank read) is copied out of the executor's arena because the next
  // micro-batch's forward reuses that arena. Where the schedule runs every
  // reader first -- 1F1B's last stage runs F(i) then B(i) -- the copies
  // are not needed: the stash keeps views of the arena. Not under
  // recomputation (the backward reruns the forward), and the stage's
  // outputs are copied still (a send may be in flight when the arena is
  // reused). This takes the copies off 1F1B's critical path at p = 2
  // (the last stage's F -> B -> gradient send).
  // Where another forward of the stage runs before the backward (1F1B's
  // first stages, GPipe), the forward runs in one of up to kForwardArenas
  // executors of its own, each an arena whose views stay until their last
  // reader: a forward takes the lowest arena whose views are all read, and
  // keeps views in it when its views die before the stage's next forward or
  // another arena is left free for that forward (so one always is);
  // otherwise it copies, as before. Asynchronous pipelining: one arena,
  // copies (its list is a window of an endless stream).
  void plan_views() {
    const auto& list = sched.actions[ix(rank)];
    keep_views.assign(list.size(), false);
    fwd_slot.assign(list.size(), 0);
    if (opts.async != AsyncMode::none || opts.bf16_stash) return;
    // Per stage, per arena: the last action reading the views it holds.
    std::map<int, std::vector<size_t>> held;
    for (size_t i = 0; i < list.size(); ++i) {
      const PipelineAction& a = list[i];
      if (a.kind != ActionKind::forward || st(a.stage).recompute) continue;
      const int vs = a.stage, mb = a.microbatch;
      const bool local_next = vs + 1 < sched.virtual_count() && owner(vs + 1) == rank;
      size_t next_run = list.size();  // the next forward of vs, any micro-batch
      size_t last_read = i;           // the last pass reading stash (vs, mb)
      for (size_t j = i + 1; j < list.size(); ++j) {
        const PipelineAction& b = list[j];
        if (b.stage == vs && b.kind == ActionKind::forward && next_run == list.size()) {
          next_run = j;
        }
        const bool reads =
            (b.stage == vs && b.microbatch == mb &&
             (b.kind == ActionKind::backward || b.kind == ActionKind::backward_input ||
              b.kind == ActionKind::backward_weight)) ||
            (local_next && b.stage == vs + 1 && b.microbatch == mb &&
             b.kind == ActionKind::forward);
        if (reads) last_read = j;
      }
      std::vector<size_t>& arenas = held[vs];
      size_t slot = arenas.size(), free = kForwardArenas - arenas.size();
      for (size_t k = 0; k < arenas.size(); ++k) {
        if (arenas[k] >= i) continue;  // views still to be read
        slot = std::min(slot, k);
        ++free;
      }
      MT_CHECK(free >= 1, "pipeline: stage {} has no free forward arena at action {}", vs, i);
      if (slot == arenas.size()) arenas.push_back(0);
      keep_views[i] = last_read < next_run || free >= 2;
      fwd_slot[i] = slot;
      arenas[slot] = keep_views[i] ? last_read : i;
    }
  }

  void check_async_setup() {
    const std::string_view mode = async_name(opts.async);
    check_async(opts.async, sched.kind, "parallel");
    for (const auto& [name, vstages] : cut.shared_params) {
      const std::vector<int> h = holders(vstages);
      if (h.size() < 2) continue;
      if (xm != nullptr) {
        throw ConfigError(fmt::format(
            "parallel.async: {} with parameter '{}' shared by stages on different meshes is "
            "not supported",
            mode, name));
      }
      Tied t{name, h.front(), {h.begin() + 1, h.end()}};
      for (int q : t.mirrors) {
        if (async_version_gap(p, q, 1 << 20) != 0) {
          throw ConfigError(fmt::format(
              "parallel.async: {} with parameter '{}' shared by stages {} and {}: only the last "
              "stage (version gap 0) can mirror a parameter another stage updates",
              mode, name, t.owner, q));
        }
      }
      tied.push_back(std::move(t));
    }
    for (const PipelineStage& s : cut.stages) {
      if (s.recompute) {
        throw ConfigError(fmt::format(
            "parallel.async: {} with recomputation on stage {} is not supported", mode, s.index));
      }
    }
    if (!opts.update) {
      throw ConfigError(fmt::format("pipeline: async {} needs an update function", mode));
    }
    MemoryScope tag(MemoryCategory::params);
    for (const std::string& n : param_names)
      current[n] = Tensor::empty(params[n].shape(), DType::f32);
  }

  static void copy_weights(const Weights& from, Weights& to) {
    for (auto& [n, t] : to) std::memcpy(t.raw(), from.at(n).raw(), t.nbytes());
  }

  // Puts other weights in place of the current ones (kept in `current`).
  void swap_in(const Weights& w) {
    MT_CHECK(!swapped, "pipeline async: weights swapped twice");
    copy_weights(params, current);
    copy_weights(w, params);
    swapped = true;
  }
  void swap_back() {
    if (!swapped) return;
    copy_weights(current, params);
    swapped = false;
  }

  // Tags of the tied parameters' messages on `shared` (weights owner ->
  // mirror, gradients mirror -> owner: opposite directions never match
  // each other); fewer than tied_tag_m micro-batches are in flight.
  int tied_tag_m() const { return 2 * (m + p); }
  uint32_t tied_tag(int mb, size_t k) const {
    return static_cast<uint32_t>(1 + (mb % tied_tag_m()) * static_cast<int>(tied.size()) +
                                 static_cast<int>(k));
  }
  // The owner's weight version at the forward of micro-batch mb (1F1B
  // stream): the mirror receives a value only once it differs from the
  // initial one both start from.
  bool tied_changed(int owner, int mb) const { return mb - async_version_gap(p, owner, mb) > 0; }
  bool mirrors_here(const std::string& name) const {
    return std::ranges::any_of(tied, [&](const Tied& t) {
      return t.name == name && std::ranges::find(t.mirrors, rank) != t.mirrors.end();
    });
  }
  // Before F(mb), after async_forward: the owner sends the value this
  // forward uses (spectrain: the prediction); a mirror receives it.
  void tied_forward(int mb) {
    for (size_t k = 0; k < tied.size(); ++k) {
      const Tied& t = tied[k];
      if (!tied_changed(t.owner, mb) || !params.contains(t.name)) continue;
      Tensor& w = params.at(t.name);
      if (rank == t.owner) {
        MT_CHECK(version == mb - async_version_gap(p, rank, mb),
                 "pipeline async: stage {} is at weight version {} at the forward of micro-batch "
                 "{}, not the 1F1B stream's",
                 rank, version, mb);
        for (int q : t.mirrors) send(*shared, w.clone(), q, tied_tag(mb, k));
      } else if (std::ranges::find(t.mirrors, rank) != t.mirrors.end()) {
        CollectiveOptions o;
        o.tag = tied_tag(mb, k);
        shared->recv(w.raw(), static_cast<size_t>(w.numel()), w.dtype(), t.owner, o);
      }
    }
  }
  // After B(mb), before the update: a mirror sends its part of the
  // gradient; the owner adds the mirrors' parts to its own, so its update
  // applies micro-batch mb's whole gradient (both uses at the weights mb's
  // forward saw: the mirror's copy changes only before its forwards, and
  // its backward follows its forward directly).
  void tied_backward(int mb) {
    for (size_t k = 0; k < tied.size(); ++k) {
      const Tied& t = tied[k];
      if (!grads.contains(t.name)) continue;
      Tensor& g = grads.at(t.name);
      if (rank == t.owner) {
        Tensor part = Tensor::empty(g.shape(), g.dtype());
        for (int q : t.mirrors) {
          CollectiveOptions o;
          o.tag = tied_tag(mb, k);
          shared->recv(part.raw(), static_cast<size_t>(part.numel()), part.dtype(), q, o);
          add_into(g, part, t.name);
        }
      } else if (std::ranges::find(t.mirrors, rank) != t.mirrors.end()) {
        send(*shared, g.clone(), t.owner, tied_tag(mb, k));
      }
    }
  }
  // After the drain: the mirrors take the owner's final value.
  void tied_final() {
    for (size_t k = 0; k < tied.size(); ++k) {
      const Tied& t = tied[k];
      if (!params.contains(t.name)) continue;
      Tensor& w = params.at(t.name);
      CollectiveOptions o;
      o.tag = static_cast<uint32_t>(1 + tied_tag_m() * static_cast<int>(tied.size()) +
                                    static_cast<int>(k));
      const auto n = static_cast<size_t>(w.numel());
      if (rank == t.owner) {
        for (int q : t.mirrors) shared->send(w.raw(), n, w.dtype(), q, o);
      } else if (std::ranges::find(t.mirrors, rank) != t.mirrors.end()) {
        shared->recv(w.raw(), n, w.dtype(), t.owner, o);
      }
    }
  }

  // Before F(mb): record the version; spectrain: predict gap updates ahead.
  void async_forward(int mb) {
    fwd_version[mb] = version;
    const int s = async_version_gap(p, rank, mb);
    if (opts.async != AsyncMode::spectrain || s == 0 || smooth.empty()) return;
    copy_weights(params, current);
    for (auto& [n, w] : params) {
      float* d = w.data<float>();
      const float* u = smooth.at(n).data<float>();
      const int64_t k = w.numel();
      for (int64_t i = 0; i < k; ++i) d[i] -= static_cast<float>(s) * u[i];
    }
    swapped = true;
  }

  // Before B(mb): zero the accumulators; pipedream: the forward's version.
  void async_backward(int mb) {
    for (auto& [name, g] : grads) g.zero_();
    for (auto& [name, w] : written) w = true;
    if (opts.async != AsyncMode::pipedream) return;
    const int v = fwd_version.at(mb);
    if (v != version) swap_in(versions.at(v));
  }

  int64_t weights_bytes() const {
    int64_t b = 0;
    for (const auto& [n, t] : params) b += static_cast<int64_t>(t.nbytes());
    return b;
  }

  // After B(mb): the newest weights back, the update, the stash trimmed.
  void async_update(int mb) {
    swap_back();
    fwd_version.erase(mb);
    // Versions no micro-batch in flight still needs go first.
    for (auto it = versions.begin(); it != versions.end();) {
      const int v = it->first;
      if (std::ranges::none_of(fwd_version, [&](const auto& e) { return e.second == v; })) {
        wstash_now -= weights_bytes();
        it = versions.erase(it);
      } else {
        ++it;
      }
    }
    // pipedream: a micro-batch in flight whose forward saw the version about
    // to be replaced needs it for its backward.
    if (opts.async == AsyncMode::pipedream &&
        std::ranges::any_of(fwd_version, [&](const auto& e) { return e.second == version; })) {
      MemoryScope tag(MemoryCategory::params);
      Weights& w = versions[version];
      for (const auto& [n, t] : params) w[n] = t.clone();
      wstash_now += weights_bytes();
    }
    wstash_peak = std::max(wstash_peak, wstash_now);
    wversions_peak = std::max(wversions_peak, static_cast<int>(versions.size()));
    const bool predict = opts.async == AsyncMode::spectrain;
    if (predict) copy_weights(params, current);
    opts.update(mb);
    if (predict) {
      const bool first = smooth.empty();
      if (first) {
        MemoryScope tag(MemoryCategory::params);
        for (const auto& [n, t] : params) smooth[n] = Tensor::zeros(t.shape(), DType::f32);
      }
      for (auto& [n, u] : smooth) {
        float* d = u.data<float>();
        const float* before = current.at(n).data<float>();
        const float* after = params.at(n).data<float>();
        const int64_t k = u.numel();
        for (int64_t i = 0; i < k; ++i) {
          const float delta = before[i] - after[i];
          d[i] = first ? delta : 0.9f * d[i] + 0.1f * delta;
        }
      }
    }
    ++version;
  }

  Pass make_pass(const StagePass& sp) {
    Pass out;
    out.pass = &sp;
    if (sp.graph.num_nodes() == 0) return out;
    ExecOptions o = opts.exec;
    o.outputs.clear();  // ids of the caller's graph mean nothing here
    for (const std::string& name : sp.stash) o.outputs.push_back(*sp.graph.find(name));
    out.exec = std::make_unique<Executor>(sp.graph, o);
    for (ValueId pv : sp.graph.params()) out.exec->bind(pv, params.at(sp.graph.value(pv).name));
    // Weight gradients of matmuls go straight into the accumulators: no
    // copy or addition after the pass (on 1F1B's first stage at p = 2 that
    // addition of every micro-batch was on the lock-step path).
    for (const auto& [pv, gv] : sp.graph.grads()) {
      const std::string& name = sp.graph.value(pv).name;
      if (!accumulates_in_place(sp.graph, gv)) continue;
      out.exec->bind(gv, grads.at(name));
      out.direct.emplace_back(gv, name);
    }
    return out;
  }

  void put(Stash& s, const std::string& name, Tensor t) {
    auto it = s.find(name);
    if (it != s.end()) stash_now -= static_cast<int64_t>(it->second.nbytes());
    stash_now += static_cast<int64_t>(t.nbytes());
    stash_peak = std::max(stash_peak, stash_now);
    s[name] = std::move(t);
  }
  void erase(Stash& s, const std::string& name) {
    auto it = s.find(name);
    if (it == s.end()) return;
    stash_now -= static_cast<int64_t>(it->second.nbytes());
    s.erase(it);
  }

  void wait_recvs(int kind, int vs, int mb, ActionKind action) {
    auto it = recvs.find({kind, vs, mb});
    auto xt = xrecvs.find({kind, vs, mb});
    if (it == recvs.end() && xt == xrecvs.end()) return;
    // About to wait: add the gradients still pending first (useful work in
    // what would be idle time), counted as the last pass's overhead.
    if (!pending_grads.empty() && it != recvs.end() &&
        !std::ranges::all_of(it->second, [](const CommHandle& h) { return h.done(); })) {
      const int64_t f0 = now_ns();
      flush_grads();
      if (!spans.empty()) spans.back().overhead_ns += now_ns() - f0;
    }
    const int64_t t0 = now_ns();
    if (it != recvs.end()) {
      for (CommHandle& h : it->second) h.wait();
      recvs.erase(it);
    }
    if (xt != xrecvs.end()) {
      for (Arrival& a : xt->second) finish_arrival(a);
      xrecvs.erase(xt);
    }
    waits.push_back({vs, mb, action, t0, now_ns(), 0, 0});
  }

  // Stages on different meshes: a route's hop into this rank is complete
  // (its first hop was posted ahead; a later one is received from the
  // target before it now); pass it on along the chain and put it into the
  // rank's piece.
  void finish_arrival(Arrival& a) {
    const ReshardRoute& rt = a.plan->routes[a.route];
    CollectiveOptions o;
    o.tag = a.tag;
    if (a.hop > 0) {
      a.relay->recv(a.buf.raw(), static_cast<size_t>(a.buf.numel()), a.buf.dtype(),
                    rt.targets[a.hop - 1], o);
    }
    if (a.hop + 1 < rt.targets.size()) send(*a.relay, a.buf, rt.targets[a.hop + 1], a.tag);
    put_box_part(a.dest, a.dbox, rt.box, a.buf);
  }

  // Stages on different meshes: posts the receives of a recv action
  // (kind 0: the activations of stage vs - 1; 1: the gradients of vs + 1).
  void post_cross(int kind, int vs, int mb) {
    const bool fwd = kind == 0;
    const int sender = fwd ? vs - 1 : vs + 1;
    const int q = owner(sender);
    const auto& list = fwd ? st(vs).inputs : st(vs).outputs;
    const auto& plans = xm->boundaries[ix(fwd ? vs - 1 : vs)];
    for (size_t k = 0; k < list.size(); ++k) {
      if (!fwd && !list[k].has_grad) continue;
      const ReshardPlan& plan = fwd ? plans[k].forward : plans[k].backward;
      Tensor dest = Tensor::empty(list[k].shape, list[k].dtype);
      const Box* dbox = plan.to.box_of(me);
      MT_CHECK(dbox != nullptr && dbox->elements() == dest.numel(),
               "pipeline: rank {} receives '{}' ({}) but the boundary's plan gives it {}", me,
               list[k].name, dest.desc(), dbox != nullptr ? dbox->str() : std::string("no box"));
      const uint32_t tg = tag(sender, mb, static_cast<int>(k));
      Communicator& c = fwd ? *act[ix(q)] : *grad[ix(q)];
      Communicator* relay = fwd ? act_relay[ix(q)].get() : grad_relay[ix(q)].get();
      for (size_t r = 0; r < plan.routes.size(); ++r) {
        const ReshardRoute& rt = plan.routes[r];
        const auto t = std::ranges::find(rt.targets, me);
        if (t == rt.targets.end()) continue;
        const size_t hop = static_cast<size_t>(t - rt.targets.begin());
        Tensor buf = Tensor::empty(rt.box.shape(), plan.dtype);
        if (hop == 0) {
          CollectiveOptions o;
          o.tag = tg;
          recvs[{kind, vs, mb}].push_back(c.recv_now(buf.raw(), static_cast<size_t>(buf.numel()),
                                                     buf.dtype(), rt.reducers.back(), o));
        }
        xrecvs[{kind, vs, mb}].push_back({&plan, r, hop, buf, dest, *dbox, relay, tg});
      }
      put(stash[{vs, mb}], fwd ? list[k].name : "dout/" + list[k].name, std::move(dest));
    }
  }

  // Stages on different meshes: queues the routes this rank starts for the
  // tensors of a send action (a partial source's reduction passes through
  // it: the addend before it is received and added first).
  void send_cross(const PipelineAction& a) {
    const int vs = a.stage, mb = a.microbatch;
    const PipelineStage& ps = st(vs);
    Stash& s = stash[{vs, mb}];
    const bool fwd = a.kind == ActionKind::send_activation;
    Communicator& c = fwd ? *act[ix(rank)] : *grad[ix(rank)];
    Communicator& relay = fwd ? *act_relay[ix(rank)] : *grad_relay[ix(rank)];
    auto start = [&](const ReshardPlan& plan, const Tensor& piece, uint32_t tg) {
      const Box* sbox = plan.from.box_of(me);
      MT_CHECK(sbox != nullptr && sbox->elements() == piece.numel(),
               "pipeline: rank {} sends {} but the boundary's plan gives it {}", me, piece.desc(),
               sbox != nullptr ? sbox->str() : std::string("no box"));
      for (const ReshardRoute& rt : plan.routes) {
        const auto red = std::ranges::find(rt.reducers, me);
        if (red == rt.reducers.end()) continue;
        const size_t i = static_cast<size_t>(red - rt.reducers.begin());
        Tensor value = Tensor::empty(rt.box.shape(), plan.dtype);
        copy_box_part(piece, *sbox, rt.box, value);
        CollectiveOptions o;
        o.tag = tg;
        if (i > 0) {
          Tensor in = Tensor::empty(rt.box.shape(), plan.dtype);
          relay.recv(in.raw(), static_cast<size_t>(in.numel()), in.dtype(), rt.reducers[i - 1], o);
          add_addend(value, in);
        }
        if (i + 1 < rt.reducers.size()) {
          send(relay, value, rt.reducers[i + 1], tg);
        } else if (!rt.targets.empty()) {
          send(c, value, rt.targets[0], tg);
        }
      }
    };
    if (fwd) {
      for (size_t k = 0; k < ps.outputs.size(); ++k) {
        start(xm->boundaries[ix(vs)][k].forward, s.at(ps.outputs[k].name),
              tag(vs, mb, static_cast<int>(k)));
      }
      return;
    }
    size_t g = 0;
    for (size_t k = 0; k < ps.inputs.size(); ++k) {
      if (!ps.inputs[k].has_grad) continue;
      const std::string& name = ps.input_grads[g++];
      start(xm->boundaries[ix(vs - 1)][k].backward, s.at(name), tag(vs, mb, static_cast<int>(k)));
      erase(s, name);
    }
  }

  // Adds the pending backward passes' parameter gradients into the
  // accumulators (before their executors run again, and at the step's end).
  void flush_grads() {
    for (Pass* pass : pending_grads) {
      const Graph& g = pass->pass->graph;
      for (const auto& [pv, gv] : g.grads()) {
        if (std::ranges::any_of(pass->direct, [&](const auto& d) { return d.first == gv; })) {
          continue;  // already in its accumulator
        }
        const std::string& name = g.value(pv).name;
        bool& w = written.at(name);
        Tensor& acc = grads.at(name);
        if (w) {
          add_into(acc, pass->exec->get(gv), name);
          continue;
        }
        const Tensor src = pass->exec->get(gv);
        MT_CHECK(acc.numel() == src.numel() && src.dtype() == DType::f32,
                 "pipeline: gradient of '{}' is {}, its accumulator {}", name, src.desc(),
                 acc.desc());
        std::memcpy(acc.raw(), src.raw(), acc.nbytes());
        w = true;
      }
    }
    pending_grads.clear();
  }

  // Whether action j of this rank's list is a forward whose output is sent
  // right after it.
  bool forward_next(size_t j) const {
    const auto& list = sched.actions[ix(rank)];
    return j + 1 < list.size() && list[j].kind == ActionKind::forward &&
           list[j + 1].kind == ActionKind::send_activation && list[j + 1].stage == list[j].stage &&
           list[j + 1].microbatch == list[j].microbatch;
  }

  // `then_send`: the send action that follows the pass (its tensors are
  // copied out and queued first, before the rest of the stash and the
  // gradient accumulation, so the neighbour's wait does not include them);
  // null when none follows.
  // `views`: the stash keeps views of the executor's arena instead of
  // copies, except the stage's outputs (a send may read them later, or
  // in flight; plan_views()).
  // `defer_grads`: the parameter gradients are added later (a forward
  // follows whose output a neighbour waits for: 1F1B's first stage, B(i)
  // then F(i+p)), not before it starts: when the rank next has to wait for
  // a message (wait_recvs), else before the next pass that reuses an arena
  // with gradients pending, at the latest at the step's end.
  void run_pass(Pass& pass, int vs, int mb, ActionKind kind, const MicrobatchData& data,
                const PipelineAction* then_send, bool views = false, bool defer_grads = false) {
    if (!pass.exec) {
      if (then_send != nullptr) send_action(*then_send);
      return;
    }
    const int64_t tb = now_ns();
    // Sends still reading this executor's arena finish first.
    std::erase_if(arena_sends, [&](auto& x) {
      if (x.second != pass.exec.get()) return false;
      x.first.wait();
      return true;
    });
    Stash& s = stash[{vs, mb}];
    const Graph& g = pass.pass->graph;
    for (ValueId in : g.inputs()) {
      const Value& v = g.value(in);
      auto it = s.find(v.name);
      Tensor t;
      if (it != s.end()) {
        t = it->second;
        // opts.bf16_stash: an activation kept in bf16, widened for the pass
        // (the executor holds the f32 copy while it runs).
        if (t.dtype() == DType::bf16 && v.dtype == DType::f32) t = widen_bf16(t);
      } else if (data) {
        t = data(mb, v.name);
      }
      if (!t.defined() || t.shape() != v.shape || t.dtype() != v.dtype) {
        throw ConfigError(fmt::format(
            "pipeline: stage {} pass {} of micro-batch {} reads '{}' ({}{}), {}", vs,
            action_name(kind), mb, v.name, dtype_name(v.dtype), v.shape.str(),
            t.defined() ? fmt::format("but the data gave {}", t.desc())
                        : std::string("which was neither received nor given by the data")));
      }
      pass.exec->bind(in, t);
    }
    // A pass with gradients may reuse an arena whose gradients are pending.
    if (!g.grads().empty()) flush_grads();
    // The step's first gradient into an accumulator overwrites it.
    for (const auto& [gv, name] : pass.direct) pass.exec->set_accumulate(gv, written.at(name));
    const int64_t c0 = thread_cpu_ns();
    const int64_t t0 = now_ns();
    pass.exec->run();
    const int64_t t1 = now_ns();
    const int64_t cpu = thread_cpu_ns() - c0;
    for (const auto& [gv, name] : pass.direct) written.at(name) = true;

    std::vector<std::string> first;
    if (then_send != nullptr) {
      const bool grads_out = then_send->kind != ActionKind::send_activation;
      if (!grads_out) {
        for (const StageBoundary& b : st(vs).outputs) first.push_back(b.name);
      } else {
        first = st(vs).input_grads;
      }
      // Sent straight from the arena, not copied, where nothing else reads
      // the tensor once the arena is reused: input gradients (dropped from
      // the stash when sent) and outputs of a forward whose arena holds its
      // views until their last reader (plan_views()). The executor's next
      // run waits for the send. Not across meshes (pieces of the tensor
      // travel) nor under async (a window's sends outlive it).
      const bool from_arena =
          xm == nullptr && opts.async == AsyncMode::none && (grads_out || views);
      for (const std::string& name : first) {
        if (auto id = g.find(name);
            id && std::ranges::find(pass.pass->stash, name) != pass.pass->stash.end()) {
          Tensor t = pass.exec->get(*id);
          if (!from_arena) {
            t = t.clone();
            copied += static_cast<int64_t>(t.nbytes());
          }
          put(s, name, std::move(t));
        }
      }
      sending_from = from_arena ? pass.exec.get() : nullptr;
      send_action(*then_send);
      sending_from = nullptr;
    }
    for (const std::string& name : pass.pass->stash) {
      if (std::ranges::find(first, name) != first.end()) continue;
      Tensor t = pass.exec->get(*g.find(name));
      const bool output = std::ranges::any_of(
          st(vs).outputs, [&](const StageBoundary& b) { return b.name == name; });
      if (opts.bf16_stash && kind == ActionKind::forward && !output && name != st(vs).loss &&
          t.dtype() == DType::f32 &&
          static_cast<int64_t>(t.nbytes()) >= opts.bf16_stash_min_bytes) {
        Tensor h = narrow_bf16(t);
        copied += static_cast<int64_t>(h.nbytes());
        bf16_elements += h.numel();
        put(s, name, std::move(h));
        continue;
      }
      if (!views || output) copied += static_cast<int64_t>(t.nbytes());
      put(s, name, views && !output ? std::move(t) : t.clone());
    }
    if (!g.grads().empty()) {
      pending_grads.push_back(&pass);
      if (!defer_grads) flush_grads();
    }
    spans.push_back({vs, mb, kind, t0, t1, cpu, (t0 - tb) + (now_ns() - t1), recomputing});
  }

  // opts.bf16_stash: an f32 tensor rounded to bf16 (nearest even), and back.
  static Tensor narrow_bf16(const Tensor& t) {
    Tensor h = Tensor::empty(t.shape(), DType::bf16);
    const float* x = t.data<float>();
    bf16* y = h.data<bf16>();
    for (int64_t i = 0, n = t.numel(); i < n; ++i) y[i] = f32_to_bf16(x[i]);
    return h;
  }
  static Tensor widen_bf16(const Tensor& h) {
    Tensor t = Tensor::empty(h.shape(), DType::f32);
    const bf16* x = h.data<bf16>();
    float* y = t.data<float>();
    for (int64_t i = 0, n = h.numel(); i < n; ++i) y[i] = bf16_to_f32(x[i]);
    return t;
  }

  // Recomputation: drops what the forward of (vs, mb) left in the stash but
  // what was received, the loss and outputs the next stage on this rank reads.
  void drop_activations(int vs, int mb) {
    const PipelineStage& ps = st(vs);
    const bool local_next = vs + 1 < sched.virtual_count() && owner(vs + 1) == rank;
    Stash& s = stash[{vs, mb}];
    for (const std::string& name : ps.forward.stash) {
      if (name == ps.loss) continue;
      if (local_next &&
          std::ranges::any_of(ps.outputs, [&](const StageBoundary& b) { return b.name == name; })) {
        continue;
      }
      if (std::ranges::any_of(ps.inputs, [&](const StageBoundary& b) { return b.name == name; }))
        continue;
      erase(s, name);
    }
  }

  // Frees a micro-batch's stash after its last backward pass, keeping the
  // input gradients still to be sent.
  void release(int vs, int mb) {
    Stash& s = stash[{vs, mb}];
    std::vector<std::string> names;
    for (const auto& [name, t] : s) names.push_back(name);
    const auto& keep = st(vs).input_grads;
    for (const std::string& n : names) {
      if (std::find(keep.begin(), keep.end(), n) == keep.end()) erase(s, n);
    }
  }

  // A receive buffer of this shape and dtype that no one else holds now (the
  // stash dropped it and the receive filling it finished, its handle
  // releasing it), or a new one, pre-faulted (zeroed) where it is made.
  Tensor recv_buffer(const Shape& shape, DType dtype) {
    for (const Tensor& t : recv_pool) {
      if (t.use_count() == 1 && t.dtype() == dtype && t.shape() == shape) return t;
    }
    recv_pool.push_back(Tensor::zeros(shape, dtype));
    ++recv_buffers_made;
    return recv_pool.back();
  }

  // Posts the receives of actions [posted, end) of this rank's list.
  void post_recvs(size_t end) {
    const auto& list = actions();
    for (; posted < std::min(end, list.size()); ++posted) {
      const PipelineAction& a = list[posted];
      const int vs = a.stage, mb = a.microbatch;
      MemoryScope in_comm(MemoryCategory::comm);  // receive buffers, stashed until read
      if (xm != nullptr &&
          (a.kind == ActionKind::recv_activation || a.kind == ActionKind::recv_grad)) {
        post_cross(a.kind == ActionKind::recv_activation ? 0 : 1, vs, mb);
        continue;
      }
      if (a.kind == ActionKind::recv_activation) {
        const auto& ins = st(vs).inputs;
        for (size_t k = 0; k < ins.size(); ++k) {
          Tensor buf = recv_buffer(ins[k].shape, ins[k].dtype);
          CollectiveOptions o;
          o.tag = tag(vs - 1, mb, static_cast<int>(k));
          recvs[{0, vs, mb}].push_back(act[ix(a.peer)]->recv_now(buf, a.peer, o));
          put(stash[{vs, mb}], ins[k].name, std::move(buf));
        }
      } else if (a.kind == ActionKind::recv_grad) {
        const auto& outs = st(vs).outputs;
        for (size_t k = 0; k < outs.size(); ++k) {
          if (!outs[k].has_grad) continue;
          Tensor buf = recv_buffer(outs[k].shape, outs[k].dtype);
          CollectiveOptions o;
          o.tag = tag(vs + 1, mb, static_cast<int>(k));
          recvs[{1, vs, mb}].push_back(grad[ix(a.peer)]->recv_now(buf, a.peer, o));
          put(stash[{vs, mb}], "dout/" + outs[k].name, std::move(buf));
        }
      }
    }
  }

  void send(Communicator& c, const Tensor& t, int peer, uint32_t tg) {
    CollectiveOptions o;
    o.tag = tg;
    sends.emplace_back(c.send_now(t.raw(), static_cast<size_t>(t.numel()), t.dtype(), peer, o), t);
    if (sending_from != nullptr) arena_sends.emplace_back(sends.back().first, sending_from);
    // Drop finished sends so their tensors can go.
    std::erase_if(sends, [](const auto& s) { return s.first.done() && (s.first.wait(), true); });
  }

  // A neighbour on the same rank (one physical stage): hand tensors over
  // directly; across meshes through the boundary's plan, inside this
  // physical stage's ranks (every one of them runs this action now).
  void local_inputs(int vs, int mb) {
    if (vs == 0 || owner(vs - 1) != rank) return;
    Stash& prev = stash[{vs - 1, mb}];
    const PipelineStage& ps = st(vs - 1);
    const auto& ins = st(vs).inputs;
    for (size_t k = 0; k < ins.size(); ++k) {
      if (xm == nullptr) {
        put(stash[{vs, mb}], ins[k].name, prev.at(ins[k].name));
      } else {
        put(stash[{vs, mb}], ins[k].name,
            reshard_local(xm->boundaries[ix(vs - 1)][k].forward, prev.at(ps.outputs[k].name),
                          ins[k].shape, ins[k].dtype));
      }
      // A recomputing stage rebuilds its outputs for its backward: once
      // handed over (the V's turn, interleaved chunks) they are the next
      // stage's input alone, not held (and counted) twice.
      if (ps.recompute) erase(prev, ps.outputs[k].name);
    }
  }
  void local_grads(int vs, int mb) {
    if (vs + 1 >= sched.virtual_count() || owner(vs + 1) != rank) return;
    const PipelineStage& next = st(vs + 1);
    Stash& ns = stash[{vs + 1, mb}];
    size_t g = 0;
    for (size_t k = 0; k < next.inputs.size(); ++k) {
      if (!next.inputs[k].has_grad) continue;
      const std::string& name = next.input_grads[g++];
      if (xm == nullptr) {
        put(stash[{vs, mb}], "dout/" + next.inputs[k].name, ns.at(name));
      } else {
        const StageBoundary& out = st(vs).outputs[k];
        put(stash[{vs, mb}], "dout/" + out.name,
            reshard_local(xm->boundaries[ix(vs)][k].backward, ns.at(name), out.shape, out.dtype));
      }
      erase(ns, name);
    }
  }
  Tensor reshard_local(const ReshardPlan& plan, const Tensor& piece, const Shape& shape,
                       DType dtype) {
    MemoryScope in_comm(MemoryCategory::comm);
    Tensor dest = Tensor::empty(shape, dtype);
    execute_reshard(*local, plan, piece, dest);
    return dest;
  }

  void send_action(const PipelineAction& a) {
    if (xm != nullptr) {
      send_cross(a);
      return;
    }
    const int vs = a.stage, mb = a.microbatch;
    const PipelineStage& ps = st(vs);
    Stash& s = stash[{vs, mb}];
    if (a.kind == ActionKind::send_activation) {
      for (size_t k = 0; k < ps.outputs.size(); ++k) {
        send(*act[ix(rank)], s.at(ps.outputs[k].name), a.peer, tag(vs, mb, static_cast<int>(k)));
      }
      return;
    }
    size_t g = 0;
    for (size_t k = 0; k < ps.inputs.size(); ++k) {
      if (!ps.inputs[k].has_grad) continue;
      const std::string& name = ps.input_grads[g++];
      send(*grad[ix(rank)], s.at(name), a.peer, tag(vs, mb, static_cast<int>(k)));
      erase(s, name);
    }
  }

  // The actions this call runs: the schedule's, or async's window.
  const std::vector<PipelineAction>& actions() const {
    return opts.async == AsyncMode::none ? sched.actions[ix(rank)] : window_list;
  }

  // One optimizer step. Async: the next window of the endless 1F1B stream
  // (make_async_window); micro-batch ids are global, `data` is asked for
  // this step's (id - window * m), the backwards of earlier steps read
  // only their stash (the forward keeps the data its backward reads).
  void step(const MicrobatchData& data) {
    if (opts.async == AsyncMode::none) {
      run_actions(data);
      return;
    }
    window_list = make_async_window(p, m, window, false).actions[ix(rank)];
    const int64_t first = static_cast<int64_t>(window) * m;
    run_actions([&](int g, const std::string& name) -> Tensor {
      const int64_t j = g - first;
      return j >= 0 && j < m ? data(static_cast<int>(j), name) : Tensor();
    });
    ++window;
  }

  // Async: the backwards still owed (the end of training).
  void drain() {
    if (opts.async == AsyncMode::none) return;
    window_list = make_async_window(p, m, window, true).actions[ix(rank)];
    draining = true;
    run_actions([](int, const std::string&) { return Tensor(); });
    draining = false;
    tied_final();
    MT_CHECK(fwd_version.empty() && versions.empty(),
             "pipeline async: stage {} still has micro-batches in flight after the drain", rank);
    MT_CHECK(stash_now == 0, "pipeline async: stage {} holds {} stashed bytes after the drain",
             rank, stash_now);
    stash.clear();
  }

  // Async forward: what the micro-batch's backward reads from the data
  // goes into its stash (the backward may run in a later step).
  void keep_backward_data(StageRt& r, int vs, int mb, const MicrobatchData& data) {
    if (!r.backward.exec) return;
    Stash& s = stash[{vs, mb}];
    const Graph& g = r.backward.pass->graph;
    for (ValueId in : g.inputs()) {
      const std::string& name = g.value(in).name;
      if (s.count(name) != 0) continue;
      const Tensor t = data(mb, name);
      if (t.defined()) put(s, name, t.clone());
    }
  }

  void run_actions(const MicrobatchData& data) {
    const bool async = opts.async != AsyncMode::none;
    if (!async) {
      stash.clear();
      stash_now = 0;
    }
    recvs.clear();
    pending_grads.clear();
    xrecvs.clear();
    spans.clear();
    waits.clear();
    if (!async) {
      sends.clear();
      arena_sends.clear();
    }
    stash_peak = stash_now;
    wstash_peak = wstash_now;
    wversions_peak = static_cast<int>(versions.size());
    loss_sum = 0;
    losses = 0;
    copied = 0;
    bf16_elements = 0;
    if (async) {
      for (auto& [name, g] : grads) g.zero_();
    }
    for (auto& [name, w] : written) w = async;
    std::vector<Communicator*> all;
    for (auto& c : act) all.push_back(c.get());
    for (auto& c : grad) all.push_back(c.get());
    for (auto& c : act_relay) all.push_back(c.get());
    for (auto& c : grad_relay) all.push_back(c.get());
    all.push_back(shared.get());
    if (local) all.push_back(local.get());
    for (Communicator* c : all) c->reset_counters();

    posted = 0;
    const auto& list = actions();
    size_t sent_early = list.size();  // a send action run_pass already did
    for (size_t i = 0; i < list.size(); ++i) {
      post_recvs(i + kRecvLookahead);
      const PipelineAction& a = list[i];
      const int vs = a.stage, mb = a.microbatch;
      StageRt& r = stages.at(vs);
      // The send that follows a pass, for the same stage and micro-batch.
      const PipelineAction* then_send = nullptr;
      if (a.is_compute() && i + 1 < list.size()) {
        const PipelineAction& n = list[i + 1];
        const bool fits =
            (a.kind == ActionKind::forward && n.kind == ActionKind::send_activation) ||
            ((a.kind == ActionKind::backward || a.kind == ActionKind::backward_input) &&
             n.kind == ActionKind::send_grad);
        if (fits && n.stage == vs && n.microbatch == mb) {
          then_send = &n;
          sent_early = i + 1;
        }
      }
      switch (a.kind) {
        case ActionKind::recv_activation:
          wait_recvs(0, vs, mb, a.kind);
          break;
        case ActionKind::recv_grad:
          wait_recvs(1, vs, mb, a.kind);
          break;
        case ActionKind::forward: {
          wait_recvs(0, vs, mb, a.kind);
          local_inputs(vs, mb);
          if (async) {
            async_forward(mb);
            tied_forward(mb);
          }
          run_pass(r.forward_in(async ? 0 : fwd_slot[i]), vs, mb, a.kind, data, then_send,
                   !async && keep_views[i]);
          swap_back();
          if (async) keep_backward_data(r, vs, mb, data);
          if (!r.st->loss.empty()) {
            loss_sum += stash[{vs, mb}].at(r.st->loss).item();
            ++losses;
          }
          if (r.st->recompute) drop_activations(vs, mb);
          break;
        }
        case ActionKind::backward:
        case ActionKind::backward_input: {
          wait_recvs(1, vs, mb, a.kind);
          local_grads(vs, mb);
          if (r.st->recompute) {
            recomputing = true;
            run_pass(r.forward, vs, mb, ActionKind::forward, data, nullptr);
            recomputing = false;
          }
          // Recomputation runs the whole backward here, its weight pass
          // too: the rebuilt stash goes at once instead of waiting for a
          // deferred weight pass (zero-bubble, the V schedules), which
          // reads most of it -- with several such waits a rank held as
          // many rebuilt stashes as without recomputation. The schedule's
          // weight action then runs nothing (its bubble stays unfilled).
          const bool whole = a.kind == ActionKind::backward || r.st->recompute;
          if (async) async_backward(mb);
          // Async: the update right after needs the gradients now.
          run_pass(whole ? r.backward : r.backward_input, vs, mb,
                   whole ? ActionKind::backward : a.kind, data, then_send, false,
                   !async && forward_next(i + (then_send != nullptr ? 2 : 1)));
          if (async) {
            tied_backward(mb);
            async_update(mb);
          }
          if (whole) release(vs, mb);
          break;
        }
        case ActionKind::backward_weight:
          if (r.st->recompute) break;  // ran with the input pass
          run_pass(r.backward_weight, vs, mb, a.kind, data, nullptr, false, forward_next(i + 1));
          release(vs, mb);
          break;
        case ActionKind::send_activation:
        case ActionKind::send_grad:
          if (i != sent_early) send_action(a);
          break;
      }
    }
    flush_grads();
    // Async: a gradient sent for a micro-batch whose backward the receiver
    // runs in the next window completes then; only the drain waits for all.
    const int64_t ts = now_ns();
    if (!async || draining) {
      for (auto& [h, t] : sends) h.wait();
      sends.clear();
      arena_sends.clear();
    } else {
      std::erase_if(sends, [](const auto& x) { return x.first.done() && (x.first.wait(), true); });
    }
    waits.push_back({-1, -1, ActionKind::send_activation, ts, now_ns(), 0, 0});
    MT_CHECK(recvs.empty() && xrecvs.empty(),
             "pipeline: stage {} posted receives its schedule never waited for", rank);
    // Async: grads hold the last micro-batch's gradients, already applied.
    const float inv = opts.async == AsyncMode::none ? 1.0f / static_cast<float>(m) : 1.0f;
    for (auto& [name, g] : grads) {
      if (!written.at(name)) {
        g.zero_();
        continue;
      }
      float* d = g.data<float>();
      const int64_t n = g.numel();
      for (int64_t i = 0; i < n; ++i) d[i] *= inv;
    }
    if (!async) exchange_shared();  // async: per micro-batch (tied_backward)
    sent = 0;
    for (Communicator* c : all) sent += c->counters().total_sent();
  }

  std::vector<int> holders(const std::vector<int>& vstages) const {
    std::set<int> h;
    for (int vs : vstages) h.insert(owner(vs));
    return {h.begin(), h.end()};
  }

  void exchange_shared() {
    if (xm != nullptr) {
      exchange_shared_across_meshes();
      return;
    }
    uint32_t t = 1;
    for (const auto& [name, vstages] : cut.shared_params) {
      const std::vector<int> h = holders(vstages);
      const uint32_t tg = t++;
      if (h.size() < 2 || std::find(h.begin(), h.end(), rank) == h.end()) continue;
      Tensor& g = grads.at(name);
      const size_t n = static_cast<size_t>(g.numel());
      CollectiveOptions o;
      o.tag = tg;
      if (rank == h.front()) {
        Tensor part = Tensor::empty(g.shape(), g.dtype());
        for (size_t k = 1; k < h.size(); ++k) {
          shared->recv(part.raw(), n, g.dtype(), h[k], o);
          add_into(g, part, name);
        }
        for (size_t k = 1; k < h.size(); ++k) shared->send(g.raw(), n, g.dtype(), h[k], o);
      } else {
        shared->send(g.raw(), n, g.dtype(), h.front(), o);
        shared->recv(g.raw(), n, g.dtype(), h.front(), o);
      }
    }
  }

  // Stages on different meshes: each shared gradient moved onto the first
  // holder's boxes and added there, then the sum moved back to the others.
  void exchange_shared_across_meshes() {
    uint32_t t = 1;
    for (const SharedParamReshard& sp : xm->shared) {
      // Holders are virtual stages, each on its own physical stage.
      const bool holds = std::ranges::any_of(sp.stages, [&](int h) { return owner(h) == rank; });
      const bool first = rank == owner(sp.stages.front());
      Tensor none;
      Tensor& g = holds ? grads.at(sp.name) : none;
      for (size_t k = 0; k < sp.to_first.size(); ++k) {
        CollectiveOptions o;
        o.tag = t++;
        Tensor part = first ? Tensor::empty(g.shape(), g.dtype()) : Tensor();
        execute_reshard(*shared, sp.to_first[k], rank == owner(sp.stages[k + 1]) ? g : none, part,
                        o);
        if (first) add_into(g, part, sp.name);
      }
      for (size_t k = 0; k < sp.from_first.size(); ++k) {
        CollectiveOptions o;
        o.tag = t++;
        Tensor sink;
        execute_reshard(*shared, sp.from_first[k], first ? g : none,
                        rank == owner(sp.stages[k + 1]) ? g : sink, o);
      }
    }
  }

  uint64_t predicted() const {
    uint64_t b = 0;
    if (xm != nullptr) {
      // Each micro-batch crosses every boundary once each way.
      for (int vs = 0; vs + 1 < sched.virtual_count(); ++vs) {
        for (size_t k = 0; k < st(vs).outputs.size(); ++k) {
          const BoundaryReshard& br = xm->boundaries[ix(vs)][k];
          b += br.forward.bytes_sent(me);
          if (st(vs).outputs[k].has_grad) b += br.backward.bytes_sent(me);
        }
      }
      b *= static_cast<uint64_t>(m);
      for (const SharedParamReshard& sp : xm->shared) b += sp.bytes_sent(me);
      return b;
    }
    // Async: a window of the steady state (the first one sends fewer gradients).
    const PipelineSchedule steady =
        opts.async == AsyncMode::none ? sched : make_async_window(p, m, 1, false);
    for (const PipelineAction& a : steady.actions[ix(rank)]) {
      if (a.kind == ActionKind::send_activation) {
        for (const StageBoundary& o : st(a.stage).outputs) b += static_cast<uint64_t>(o.bytes());
      } else if (a.kind == ActionKind::send_grad) {
        for (const StageBoundary& i : st(a.stage).inputs) {
          if (i.has_grad) b += static_cast<uint64_t>(i.bytes());
        }
      }
    }
    for (const auto& [name, vstages] : cut.shared_params) {
      const std::vector<int> h = holders(vstages);
      if (h.size() < 2 || std::find(h.begin(), h.end(), rank) == h.end()) continue;
      // Async: per micro-batch, the owner's value to each mirror and the
      // mirror's gradient back (steady state); synchronous: once per step.
      const uint64_t bytes = static_cast<uint64_t>(grads.at(name).nbytes()) *
                             static_cast<uint64_t>(opts.async == AsyncMode::none ? 1 : m);
      b += rank == h.front() ? (h.size() - 1) * bytes : bytes;
    }
    return b;
  }
};

PipelineRuntime::PipelineRuntime(Communicator& comm, const PipelineCut& cut,
                                 PipelineSchedule schedule, PipelineOptions opts)
    : impl_(std::make_unique<Impl>(comm, cut, std::move(schedule), std::move(opts))) {
  impl_->build();
}

PipelineRuntime::~PipelineRuntime() = default;

int PipelineRuntime::stage() const {
  return impl_->rank;
}
const std::vector<int>& PipelineRuntime::virtual_stages() const {
  return impl_->mine;
}
const std::vector<std::string>& PipelineRuntime::param_names() const {
  return impl_->param_names;
}

Tensor PipelineRuntime::param(const std::string& name) const {
  auto it = impl_->params.find(name);
  if (it == impl_->params.end()) {
    throw ConfigError(fmt::format("pipeline: stage {} holds no parameter '{}'", impl_->rank, name));
  }
  return it->second;
}

void PipelineRuntime::set_param(const std::string& name, const Tensor& value) {
  Tensor p = param(name);
  if (value.shape() != p.shape() || value.dtype() != p.dtype()) {
    throw ShapeError(
        fmt::format("pipeline: set_param '{}': expected {}, got {}", name, p.desc(), value.desc()));
  }
  std::memcpy(p.raw(), value.raw(), p.nbytes());
}

void PipelineRuntime::bind_storage(const std::string& name, Tensor value, Tensor grad,
                                   bool copy_values) {
  Impl& m = *impl_;
  Tensor old = param(name);
  auto check = [&](const Tensor& t, const Tensor& want, const char* what) {
    if (t.shape() != want.shape() || t.dtype() != want.dtype() || t.raw() == nullptr) {
      throw ShapeError(fmt::format("pipeline: bind_storage '{}': {} must be {}, got {}", name, what,
                                   want.desc(), t.desc()));
    }
  };
  check(value, old, "the parameter");
  if (copy_values && value.raw() != old.raw()) std::memcpy(value.raw(), old.raw(), old.nbytes());
  m.params[name] = value;
  if (grad.raw() != nullptr) {
    check(grad, m.grads.at(name), "the gradient");
    m.grads[name] = grad;
  }
  // Every pass that reads the parameter reads the new memory from now on,
  // and writes its gradient into the new accumulator.
  for (auto& [vs, r] : m.stages) {
    std::vector<Pass*> passes = {&r.forward, &r.backward, &r.backward_input, &r.backward_weight};
    for (Pass& f : r.forward_more) passes.push_back(&f);
    for (Pass* ps : passes) {
      if (!ps->exec) continue;
      const Graph& g = ps->pass->graph;
      for (ValueId pv : g.params()) {
        if (g.value(pv).name == name) ps->exec->bind(pv, value);
      }
      if (grad.raw() == nullptr) continue;
      for (const auto& [gv, n] : ps->direct) {
        if (n == name) ps->exec->bind(gv, grad);
      }
    }
  }
}

const Tensor& PipelineRuntime::grad(const std::string& name) const {
  auto it = impl_->grads.find(name);
  if (it == impl_->grads.end()) {
    throw ConfigError(fmt::format("pipeline: stage {} holds no parameter '{}'", impl_->rank, name));
  }
  return it->second;
}

void PipelineRuntime::run_step(const MicrobatchData& data) {
  impl_->step(data);
}

void PipelineRuntime::drain() {
  impl_->drain();
}

bool PipelineRuntime::async_mirrored(const std::string& name) const {
  return impl_->mirrors_here(name);
}

void PipelineRuntime::sgd_step(double lr) {
  const auto a = static_cast<float>(lr);
  for (auto& [name, p] : impl_->params) {
    if (impl_->mirrors_here(name)) continue;
    MT_CHECK(p.dtype() == DType::f32, "pipeline sgd: parameter '{}' is {}", name, p.desc());
    float* w = p.data<float>();
    const float* g = impl_->grads.at(name).data<float>();
    const int64_t n = p.numel();
    for (int64_t i = 0; i < n; ++i) w[i] -= a * g[i];
  }
}

bool PipelineRuntime::has_loss() const {
  return impl_->losses > 0;
}
double PipelineRuntime::loss() const {
  if (impl_->losses == 0) {
    throw ConfigError(
        fmt::format("pipeline: stage {} does not compute the loss (the last stage "
                    "does)",
                    impl_->rank));
  }
  return impl_->loss_sum / impl_->losses;
}
const std::vector<PipelineSpan>& PipelineRuntime::spans() const {
  return impl_->spans;
}
const std::vector<PipelineSpan>& PipelineRuntime::waits() const {
  return impl_->waits;
}
void PipelineRuntime::set_call_observer(std::function<void(const CallEvent&)> observer) {
  for (auto& c : impl_->act) c->set_call_observer(observer);
  for (auto& c : impl_->grad) c->set_call_observer(observer);
  for (auto& c : impl_->act_relay) c->set_call_observer(observer);
  for (auto& c : impl_->grad_relay) c->set_call_observer(observer);
  impl_->shared->set_call_observer(observer);
}
uint64_t PipelineRuntime::bytes_sent() const {
  return impl_->sent;
}
uint64_t PipelineRuntime::predicted_bytes_sent() const {
  return impl_->predicted();
}
int64_t PipelineRuntime::stash_copied_bytes() const {
  return impl_->copied;
}

int64_t PipelineRuntime::bf16_stashed_elements() const {
  return impl_->bf16_elements;
}

int64_t PipelineRuntime::recv_buffers_made() const {
  return impl_->recv_buffers_made;
}
int64_t PipelineRuntime::peak_stash_bytes() const {
  return impl_->stash_peak;
}
int64_t PipelineRuntime::peak_weight_stash_bytes() const {
  return impl_->wstash_peak;
}
int PipelineRuntime::peak_weight_versions() const {
  return impl_->wversions_peak;
}
int PipelineRuntime::weight_version() const {
  return impl_->version;
}

}  // namespace mt
