#include "meshtrain/spmd/pipeline_runtime.h"

#include <fmt/format.h>

#include <time.h>

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

int64_t thread_cpu_ns() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

size_t ix(int v) {
  return static_cast<size_t>(v);
}

using Stash = std::map<std::string, Tensor>;

struct Pass {
  const StagePass* pass = nullptr;
  std::unique_ptr<Executor> exec;  // null for a pass without nodes
};

struct StageRt {
  const PipelineStage* st = nullptr;
  Pass forward, backward, backward_input, backward_weight;
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
  int p = 1, m = 1, rank = 0;
  int tensors_per_stage = 1;  // for tags
  std::vector<int> mine;      // virtual stages
  std::map<int, StageRt> stages;
  std::vector<std::string> param_names;
  std::map<std::string, Tensor> params, grads;

  // Per step.
  std::map<std::pair<int, int>, Stash> stash;  // (virtual stage, micro-batch)
  std::map<std::tuple<int, int, int>, std::vector<CommHandle>> recvs;  // (kind, stage, mb)
  std::vector<std::pair<CommHandle, Tensor>> sends;
  std::vector<PipelineSpan> spans, waits;
  bool recomputing = false;  // run_pass is rerunning a forward
  double loss_sum = 0;
  int losses = 0;
  int64_t stash_now = 0, stash_peak = 0;
  uint64_t sent = 0;
  size_t posted = 0;  // actions whose receives are posted
  // act[q] / grad[q]: what physical stage q sends; shared: the tied-gradient
  // exchange. Declared last so that they are destroyed first: a
  // communicator's destructor waits for its queued sends and receives,
  // whose buffers the stash and the send list above own.
  std::vector<std::unique_ptr<Communicator>> act, grad;
  std::unique_ptr<Communicator> shared;

  Impl(Communicator& c, const PipelineCut& k, PipelineSchedule s, PipelineOptions o)
      : comm(c), cut(k), sched(std::move(s)), opts(std::move(o)) {}

  int owner(int vs) const { return sched.owner(vs); }
  const PipelineStage& st(int vs) const { return cut.stages[ix(vs)]; }

  uint32_t tag(int sender_vs, int mb, int k) const {
    const int64_t t = 1 + (static_cast<int64_t>(sender_vs) * m + mb) * tensors_per_stage + k;
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
    rank = comm.rank();
    if (comm.size() != p) {
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
      act.push_back(comm.split(0, rank, fmt::format("{}/pp_act{}", comm.name(), q)));
      grad.push_back(comm.split(0, rank, fmt::format("{}/pp_grad{}", comm.name(), q)));
    }
    shared = comm.split(0, rank, comm.name() + "/pp_shared");
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
    if (it == recvs.end()) return;
    const int64_t t0 = now_ns();
    for (CommHandle& h : it->second) h.wait();
    waits.push_back({vs, mb, action, t0, now_ns(), 0, 0});
    recvs.erase(it);
  }

  // `then_send`: the send action that follows the pass (its tensors are
  // copied out and queued first, before the rest of the stash and the
  // gradient accumulation, so the neighbour's wait does not include them);
  // null when none follows.
  void run_pass(Pass& pass, int vs, int mb, ActionKind kind, const MicrobatchData& data,
                const PipelineAction* then_send) {
    if (!pass.exec) {
      if (then_send != nullptr) send_action(*then_send);
      return;
    }
    const int64_t tb = now_ns();
    Stash& s = stash[{vs, mb}];
    const Graph& g = pass.pass->graph;
    for (ValueId in : g.inputs()) {
      const Value& v = g.value(in);
      auto it = s.find(v.name);
      Tensor t;
      if (it != s.end()) {
        t = it->second;
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
    const int64_t c0 = thread_cpu_ns();
    const int64_t t0 = now_ns();
    pass.exec->run();
    const int64_t t1 = now_ns();
    const int64_t cpu = thread_cpu_ns() - c0;

    std::vector<std::string> first;
    if (then_send != nullptr) {
      if (then_send->kind == ActionKind::send_activation) {
        for (const StageBoundary& b : st(vs).outputs) first.push_back(b.name);
      } else {
        first = st(vs).input_grads;
      }
      for (const std::string& name : first) {
        if (auto id = g.find(name);
            id && std::ranges::find(pass.pass->stash, name) != pass.pass->stash.end()) {
          put(s, name, pass.exec->get(*id).clone());
        }
      }
      send_action(*then_send);
    }
    for (const std::string& name : pass.pass->stash) {
      if (std::ranges::find(first, name) != first.end()) continue;
      put(s, name, pass.exec->get(*g.find(name)).clone());
    }
    for (const auto& [pv, gv] : g.grads()) {
      const std::string& name = g.value(pv).name;
      add_into(grads.at(name), pass.exec->get(gv), name);
    }
    spans.push_back({vs, mb, kind, t0, t1, cpu, (t0 - tb) + (now_ns() - t1), recomputing});
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

  // Posts the receives of actions [posted, end) of this rank's list.
  void post_recvs(size_t end) {
    const auto& list = sched.actions[ix(rank)];
    for (; posted < std::min(end, list.size()); ++posted) {
      const PipelineAction& a = list[posted];
      const int vs = a.stage, mb = a.microbatch;
      MemoryScope in_comm(MemoryCategory::comm);  // receive buffers, stashed until read
      if (a.kind == ActionKind::recv_activation) {
        const auto& ins = st(vs).inputs;
        for (size_t k = 0; k < ins.size(); ++k) {
          Tensor buf = Tensor::empty(ins[k].shape, ins[k].dtype);
          CollectiveOptions o;
          o.tag = tag(vs - 1, mb, static_cast<int>(k));
          recvs[{0, vs, mb}].push_back(act[ix(a.peer)]->recv_async(
              buf.raw(), static_cast<size_t>(buf.numel()), buf.dtype(), a.peer, o));
          put(stash[{vs, mb}], ins[k].name, std::move(buf));
        }
      } else if (a.kind == ActionKind::recv_grad) {
        const auto& outs = st(vs).outputs;
        for (size_t k = 0; k < outs.size(); ++k) {
          if (!outs[k].has_grad) continue;
          Tensor buf = Tensor::empty(outs[k].shape, outs[k].dtype);
          CollectiveOptions o;
          o.tag = tag(vs + 1, mb, static_cast<int>(k));
          recvs[{1, vs, mb}].push_back(grad[ix(a.peer)]->recv_async(
              buf.raw(), static_cast<size_t>(buf.numel()), buf.dtype(), a.peer, o));
          put(stash[{vs, mb}], "dout/" + outs[k].name, std::move(buf));
        }
      }
    }
  }

  void send(Communicator& c, const Tensor& t, int peer, uint32_t tg) {
    CollectiveOptions o;
    o.tag = tg;
    sends.emplace_back(c.send_async(t.raw(), static_cast<size_t>(t.numel()), t.dtype(), peer, o),
                       t);
    // Drop finished sends so their tensors can go.
    std::erase_if(sends, [](const auto& s) { return s.first.done() && (s.first.wait(), true); });
  }

  // A neighbour on the same rank (one physical stage): hand tensors over directly.
  void local_inputs(int vs, int mb) {
    if (vs == 0 || owner(vs - 1) != rank) return;
    Stash& prev = stash[{vs - 1, mb}];
    for (const StageBoundary& b : st(vs).inputs) put(stash[{vs, mb}], b.name, prev.at(b.name));
  }
  void local_grads(int vs, int mb) {
    if (vs + 1 >= sched.virtual_count() || owner(vs + 1) != rank) return;
    const PipelineStage& next = st(vs + 1);
    Stash& ns = stash[{vs + 1, mb}];
    size_t g = 0;
    for (size_t k = 0; k < next.inputs.size(); ++k) {
      if (!next.inputs[k].has_grad) continue;
      put(stash[{vs, mb}], "dout/" + next.inputs[k].name, ns.at(next.input_grads[g]));
      erase(ns, next.input_grads[g]);
      ++g;
    }
  }

  void send_action(const PipelineAction& a) {
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

  void step(const MicrobatchData& data) {
    stash.clear();
    recvs.clear();
    spans.clear();
    waits.clear();
    sends.clear();
    stash_now = stash_peak = 0;
    loss_sum = 0;
    losses = 0;
    for (auto& [name, g] : grads) g.zero_();
    std::vector<Communicator*> all;
    for (auto& c : act) all.push_back(c.get());
    for (auto& c : grad) all.push_back(c.get());
    all.push_back(shared.get());
    for (Communicator* c : all) c->reset_counters();

    posted = 0;
    const auto& list = sched.actions[ix(rank)];
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
          run_pass(r.forward, vs, mb, a.kind, data, then_send);
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
          const bool whole = a.kind == ActionKind::backward;
          run_pass(whole ? r.backward : r.backward_input, vs, mb, a.kind, data, then_send);
          if (whole) release(vs, mb);
          break;
        }
        case ActionKind::backward_weight:
          run_pass(r.backward_weight, vs, mb, a.kind, data, nullptr);
          release(vs, mb);
          break;
        case ActionKind::send_activation:
        case ActionKind::send_grad:
          if (i != sent_early) send_action(a);
          break;
      }
    }
    const int64_t ts = now_ns();
    for (auto& [h, t] : sends) h.wait();
    waits.push_back({-1, -1, ActionKind::send_activation, ts, now_ns(), 0, 0});
    sends.clear();
    MT_CHECK(recvs.empty(), "pipeline: stage {} posted receives its schedule never waited for",
             rank);
    const float inv = 1.0f / static_cast<float>(m);
    for (auto& [name, g] : grads) {
      float* d = g.data<float>();
      const int64_t n = g.numel();
      for (int64_t i = 0; i < n; ++i) d[i] *= inv;
    }
    exchange_shared();
    sent = 0;
    for (Communicator* c : all) sent += c->counters().total_sent();
  }

  std::vector<int> holders(const std::vector<int>& vstages) const {
    std::set<int> h;
    for (int vs : vstages) h.insert(owner(vs));
    return {h.begin(), h.end()};
  }

  void exchange_shared() {
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

  uint64_t predicted() const {
    uint64_t b = 0;
    for (const PipelineAction& a : sched.actions[ix(rank)]) {
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
      const uint64_t bytes = static_cast<uint64_t>(grads.at(name).nbytes());
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

void PipelineRuntime::bind_storage(const std::string& name, Tensor value, Tensor grad) {
  Impl& m = *impl_;
  Tensor old = param(name);
  auto check = [&](const Tensor& t, const Tensor& want, const char* what) {
    if (t.shape() != want.shape() || t.dtype() != want.dtype() || t.raw() == nullptr) {
      throw ShapeError(fmt::format("pipeline: bind_storage '{}': {} must be {}, got {}", name, what,
                                   want.desc(), t.desc()));
    }
  };
  check(value, old, "the parameter");
  if (value.raw() != old.raw()) std::memcpy(value.raw(), old.raw(), old.nbytes());
  m.params[name] = value;
  if (grad.raw() != nullptr) {
    check(grad, m.grads.at(name), "the gradient");
    m.grads[name] = grad;
  }
  // Every pass that reads the parameter reads the new memory from now on.
  for (auto& [vs, r] : m.stages) {
    for (Pass* ps : {&r.forward, &r.backward, &r.backward_input, &r.backward_weight}) {
      if (!ps->exec) continue;
      const Graph& g = ps->pass->graph;
      for (ValueId pv : g.params()) {
        if (g.value(pv).name == name) ps->exec->bind(pv, value);
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

void PipelineRuntime::sgd_step(double lr) {
  const auto a = static_cast<float>(lr);
  for (auto& [name, p] : impl_->params) {
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
  impl_->shared->set_call_observer(observer);
}
uint64_t PipelineRuntime::bytes_sent() const {
  return impl_->sent;
}
uint64_t PipelineRuntime::predicted_bytes_sent() const {
  return impl_->predicted();
}
int64_t PipelineRuntime::peak_stash_bytes() const {
  return impl_->stash_peak;
}

}  // namespace mt
