#include "meshtrain/spmd/schedule.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <tuple>

#include "meshtrain/base/error.h"

namespace mt {

std::string_view schedule_name(ScheduleKind k) {
  switch (k) {
    case ScheduleKind::gpipe:
      return "gpipe";
    case ScheduleKind::one_f_one_b:
      return "1f1b";
    case ScheduleKind::interleaved:
      return "interleaved";
    case ScheduleKind::zero_bubble:
      return "zero_bubble";
    case ScheduleKind::zbv:
      return "zbv";
    case ScheduleKind::dualpipev:
      return "dualpipev";
  }
  return "?";
}

int stage_owner(ScheduleKind kind, int stages, int vs) {
  if (is_v_shaped(kind) && vs >= stages) return 2 * stages - 1 - vs;
  return vs % stages;
}

bool splits_backward(ScheduleKind kind) {
  return kind == ScheduleKind::zero_bubble || kind == ScheduleKind::zbv ||
         kind == ScheduleKind::dualpipev;
}

bool is_v_shaped(ScheduleKind kind) {
  return kind == ScheduleKind::zbv || kind == ScheduleKind::dualpipev;
}

ScheduleKind parse_schedule_kind(std::string_view name, std::string_view where) {
  for (ScheduleKind k : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::interleaved,
                         ScheduleKind::zero_bubble, ScheduleKind::zbv, ScheduleKind::dualpipev}) {
    if (schedule_name(k) == name) return k;
  }
  throw ConfigError(fmt::format(
      "{}: unknown schedule \"{}\" (expected gpipe, 1f1b, interleaved, zero_bubble, zbv or "
      "dualpipev)",
      where, name));
}

std::string_view action_name(ActionKind k) {
  switch (k) {
    case ActionKind::forward:
      return "F";
    case ActionKind::backward:
      return "B";
    case ActionKind::backward_input:
      return "BI";
    case ActionKind::backward_weight:
      return "BW";
    case ActionKind::send_activation:
      return "send_act";
    case ActionKind::recv_activation:
      return "recv_act";
    case ActionKind::send_grad:
      return "send_grad";
    case ActionKind::recv_grad:
      return "recv_grad";
  }
  return "?";
}

bool PipelineAction::is_compute() const {
  return kind == ActionKind::forward || kind == ActionKind::backward ||
         kind == ActionKind::backward_input || kind == ActionKind::backward_weight;
}

std::string describe(const PipelineAction& a) {
  std::string s = fmt::format("{}{}@{}", action_name(a.kind), a.microbatch, a.stage);
  if (a.kind == ActionKind::send_activation || a.kind == ActionKind::send_grad)
    s += fmt::format("->{}", a.peer);
  if (a.kind == ActionKind::recv_activation || a.kind == ActionKind::recv_grad)
    s += fmt::format("<-{}", a.peer);
  return s;
}

void check_schedule(ScheduleKind kind, int p, int m, int v, std::string_view where) {
  if (p < 1) throw ConfigError(fmt::format("{}: {} pipeline stages (expected >= 1)", where, p));
  if (m < 1) throw ConfigError(fmt::format("{}.microbatches: {} (expected >= 1)", where, m));
  if (v < 1) throw ConfigError(fmt::format("{}.virtual_stages: {} (expected >= 1)", where, v));
  const std::string_view name = schedule_name(kind);
  if (kind == ScheduleKind::interleaved) {
    if (v < 2) {
      throw ConfigError(fmt::format(
          "{}.virtual_stages: schedule interleaved needs at least 2 virtual stages per stage, "
          "got {}",
          where, v));
    }
    if (m % p != 0) {
      throw ConfigError(
          fmt::format("{}.microbatches: schedule interleaved with {} stages needs a multiple of {} "
                      "micro-batches (each round sends {} through every model chunk), got {}",
                      where, p, p, p, m));
    }
    return;
  }
  if (is_v_shaped(kind)) {
    if (v != 2) {
      throw ConfigError(fmt::format(
          "{}.virtual_stages: schedule {} runs exactly 2 model chunks per stage (rank r holds "
          "virtual stages r and 2p-1-r), got {} (set virtual_stages = 2)",
          where, name, v));
    }
  } else if (v != 1) {
    throw ConfigError(fmt::format(
        "{}.virtual_stages: {} virtual stages need schedule interleaved, zbv or dualpipev "
        "(schedule {} runs one stage per rank)",
        where, v, name));
  }
  if (kind == ScheduleKind::dualpipev && m < 2 * p) {
    throw ConfigError(fmt::format(
        "{}.microbatches: schedule dualpipev with {} stages needs at least {} micro-batches (one "
        "per model chunk: its steady phase pairs each forward with a backward), got {}",
        where, p, 2 * p, m));
  }
  if ((kind == ScheduleKind::one_f_one_b || splits_backward(kind)) && m < p) {
    throw ConfigError(fmt::format(
        "{}.microbatches: schedule {} with {} stages needs at least {} micro-batches (one "
        "per stage to fill the pipeline), got {}",
        where, name, p, p, m));
  }
}

namespace {

struct Compute {
  ActionKind kind;
  int mb;
  int stage;
};

// Wraps each stage's compute order with the send / recv its neighbours need.
PipelineSchedule with_transfers(ScheduleKind kind, int p, int m, int v,
                                const std::vector<std::vector<Compute>>& order) {
  PipelineSchedule s;
  s.kind = kind;
  s.stages = p;
  s.microbatches = m;
  s.virtual_stages = v;
  s.actions.resize(static_cast<size_t>(p));
  const int last = p * v - 1;
  for (int r = 0; r < p; ++r) {
    auto& out = s.actions[static_cast<size_t>(r)];
    for (const Compute& c : order[static_cast<size_t>(r)]) {
      auto add = [&](ActionKind k, int peer) { out.push_back({k, c.mb, c.stage, peer}); };
      const int prev = c.stage > 0 ? s.owner(c.stage - 1) : -1;
      const int next = c.stage < last ? s.owner(c.stage + 1) : -1;
      if (c.kind == ActionKind::forward) {
        if (prev >= 0 && prev != r) add(ActionKind::recv_activation, prev);
        add(c.kind, -1);
        if (next >= 0 && next != r) add(ActionKind::send_activation, next);
      } else if (c.kind == ActionKind::backward_weight) {
        add(c.kind, -1);
      } else {
        if (next >= 0 && next != r) add(ActionKind::recv_grad, next);
        add(c.kind, -1);
        if (prev >= 0 && prev != r) add(ActionKind::send_grad, prev);
      }
    }
  }
  return s;
}

std::vector<std::vector<Compute>> gpipe_order(int p, int m) {
  std::vector<std::vector<Compute>> o(static_cast<size_t>(p));
  for (int r = 0; r < p; ++r) {
    for (int i = 0; i < m; ++i) o[static_cast<size_t>(r)].push_back({ActionKind::forward, i, r});
    for (int i = 0; i < m; ++i) o[static_cast<size_t>(r)].push_back({ActionKind::backward, i, r});
  }
  return o;
}

// 1F1B (PipeDream-flush, as Megatron runs it): p-1-r warm-up forwards, then
// alternate one forward and one backward, then the remaining backwards.
std::vector<std::vector<Compute>> one_f_one_b_order(int p, int m, int extra) {
  std::vector<std::vector<Compute>> o(static_cast<size_t>(p));
  for (int r = 0; r < p; ++r) {
    auto& l = o[static_cast<size_t>(r)];
    const int warm = std::min(p - 1 - r + (r < p - 1 ? extra : 0), m);
    for (int i = 0; i < warm; ++i) l.push_back({ActionKind::forward, i, r});
    const int steady = m - warm;
    for (int i = 0; i < steady; ++i) {
      l.push_back({ActionKind::forward, warm + i, r});
      l.push_back({ActionKind::backward, i, r});
    }
    for (int i = steady; i < m; ++i) l.push_back({ActionKind::backward, i, r});
  }
  return o;
}

// Interleaved 1F1B (Narayanan et al. 2021, Megatron's ordering): the k-th
// forward of a stage is micro-batch (k / (p*v)) * p + k % p on its model
// chunk (k % (p*v)) / p; backwards walk the chunks in reverse. Warm-up is
// 2 (p-1-r) + (v-1) p forwards (all of them when m == p).
std::vector<std::vector<Compute>> interleaved_order(int p, int m, int v) {
  std::vector<std::vector<Compute>> o(static_cast<size_t>(p));
  const int total = m * v;
  auto item = [&](int k, bool forward, int r) {
    const int in_group = k % (p * v);
    int chunk = in_group / p;
    if (!forward) chunk = v - 1 - chunk;
    const int mb = (k / (p * v)) * p + k % p;
    return Compute{forward ? ActionKind::forward : ActionKind::backward, mb, chunk * p + r};
  };
  for (int r = 0; r < p; ++r) {
    auto& l = o[static_cast<size_t>(r)];
    int warm = m == p ? total : std::min(total, 2 * (p - 1 - r) + (v - 1) * p);
    for (int k = 0; k < warm; ++k) l.push_back(item(k, true, r));
    const int steady = total - warm;
    for (int k = 0; k < steady; ++k) {
      l.push_back(item(warm + k, true, r));
      l.push_back(item(k, false, r));
    }
    for (int k = steady; k < total; ++k) l.push_back(item(k, false, r));
  }
  return o;
}

// Zero-bubble ZB-H1 (Qi et al. 2023), built greedily in unit time: each free
// stage runs, in order of preference, the next input-gradient pass whose
// output gradient has arrived, the next forward (at most p-r micro-batches
// between forward and input-gradient, 1F1B's warm-up, so activation memory
// stays bounded), and otherwise a pending weight-gradient pass, which
// nothing downstream waits for and so fills what would be a bubble. A stage
// holding more than p-1-r pending weight passes runs one first.
std::vector<std::vector<Compute>> zero_bubble_order(int p, int m) {
  std::vector<std::vector<Compute>> o(static_cast<size_t>(p));
  constexpr int kNever = 1 << 30;
  std::vector<std::vector<int>> f_done(static_cast<size_t>(p), std::vector<int>(m, kNever));
  auto bi_done = f_done;
  std::vector<int> next_f(p, 0), next_b(p, 0), next_w(p, 0), free_at(p, 0);
  int remaining = 3 * m * p;
  for (int t = 0; remaining > 0; ++t) {
    MT_CHECK(t < 10 * (3 * m + p) + 10, "zero-bubble construction did not finish");
    for (int r = 0; r < p; ++r) {
      const size_t ru = static_cast<size_t>(r);
      if (free_at[ru] > t) continue;
      const int b = next_b[ru], f = next_f[ru], w = next_w[ru];
      const bool b_ready = b < m && f_done[ru][static_cast<size_t>(b)] <= t &&
                           (r == p - 1 || bi_done[ru + 1][static_cast<size_t>(b)] <= t);
      const bool f_ready =
          f < m && f - b < p - r && (r == 0 || f_done[ru - 1][static_cast<size_t>(f)] <= t);
      const bool w_ready = w < b;
      const bool w_urgent = w_ready && (b - w) > p - 1 - r;
      Compute c{};
      if (w_urgent) {
        c = {ActionKind::backward_weight, w, r};
        ++next_w[ru];
      } else if (b_ready) {
        c = {ActionKind::backward_input, b, r};
        bi_done[ru][static_cast<size_t>(b)] = t + 1;
        ++next_b[ru];
      } else if (f_ready) {
        c = {ActionKind::forward, f, r};
        f_done[ru][static_cast<size_t>(f)] = t + 1;
        ++next_f[ru];
      } else if (w_ready) {
        c = {ActionKind::backward_weight, w, r};
        ++next_w[ru];
      } else {
        continue;
      }
      o[ru].push_back(c);
      free_at[ru] = t + 1;
      --remaining;
    }
  }
  return o;
}

// ZBV (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory"):
// two chunks per rank in a V, built greedily in unit time (forward, input
// gradient and weight gradient one unit each). A free rank runs, in order of
// preference: a ready input-gradient pass (the lowest micro-batch, the
// deeper chunk first: the neighbour waits for it); a ready forward (the
// deeper chunk first, which carries a micro-batch towards the loss and so
// frees memory sooner; a micro-batch enters a rank's shallow chunk only
// while the rank will then hold at most 2p chunk passes, counting the deep
// passes still to come, 1F1B's memory); otherwise the oldest
// pending weight-gradient pass, which nothing waits for and so fills what
// would be a bubble.
std::vector<std::vector<Compute>> zbv_order(int p, int m) {
  const int S = 2 * p;
  auto owner = [&](int vs) { return stage_owner(ScheduleKind::zbv, p, vs); };
  constexpr int kNever = 1 << 30;
  // done times per (stage, micro-batch)
  std::vector<std::vector<int>> f_done(static_cast<size_t>(S), std::vector<int>(m, kNever));
  auto bi_done = f_done;
  std::vector<std::vector<Compute>> o(static_cast<size_t>(p));
  // held: chunk passes whose activations this rank holds (forward done,
  // weight pass not yet); owed: micro-batches through its shallow chunk
  // whose deep chunk forward is still to come.
  std::vector<int> free_at(p, 0), held(p, 0), owed(p, 0);
  std::vector<std::vector<std::pair<int, int>>> pending_w(static_cast<size_t>(p));  // (mb, vs)
  std::vector<std::vector<bool>> f_started(static_cast<size_t>(S), std::vector<bool>(m, false));
  auto bi_started = f_started;
  int remaining = 3 * m * S;
  for (int t = 0; remaining > 0; ++t) {
    MT_CHECK(t < 20 * (3 * m * 2 + S) + 10, "zbv construction did not finish");
    for (int r = 0; r < p; ++r) {
      const size_t ru = static_cast<size_t>(r);
      if (free_at[ru] > t) continue;
      const int chunks[2] = {S - 1 - r, r};  // deeper chunk first
      Compute c{ActionKind::forward, -1, -1};
      for (int i = 0; i < m && c.mb < 0; ++i) {
        for (int vs : chunks) {
          const size_t v = static_cast<size_t>(vs), iu = static_cast<size_t>(i);
          if (bi_started[v][iu] || f_done[v][iu] > t) continue;
          if (vs < S - 1 && bi_done[v + 1][iu] > t) continue;
          c = {ActionKind::backward_input, i, vs};
          bi_started[v][iu] = true;
          bi_done[v][iu] = t + 1;
          break;
        }
      }
      for (int i = 0; i < m && c.mb < 0; ++i) {
        for (int vs : chunks) {
          const size_t v = static_cast<size_t>(vs), iu = static_cast<size_t>(i);
          if (f_started[v][iu]) continue;
          if (vs > 0 && f_done[v - 1][iu] > t) continue;
          // Room for this micro-batch's two chunk passes and the deep
          // passes still to come of those already in: at most 2p held.
          if (vs == r && held[ru] + owed[ru] + 2 > 2 * p) continue;
          // Micro-batches enter the pipeline in order.
          if (vs == 0 && i > 0 && !f_started[0][iu - 1]) continue;
          c = {ActionKind::forward, i, vs};
          f_started[v][iu] = true;
          f_done[v][iu] = t + 1;
          ++held[ru];
          owed[ru] += vs == r ? 1 : -1;
          break;
        }
      }
      if (c.mb < 0 && !pending_w[ru].empty()) {
        c = {ActionKind::backward_weight, pending_w[ru].front().first,
             pending_w[ru].front().second};
        pending_w[ru].erase(pending_w[ru].begin());
        --held[ru];
      }
      if (c.mb < 0) continue;
      if (c.kind == ActionKind::backward_input) pending_w[ru].push_back({c.mb, c.stage});
      MT_CHECK(owner(c.stage) == r, "zbv: stage {} is not on rank {}", c.stage, r);
      o[ru].push_back(c);
      free_at[ru] = t + 1;
      --remaining;
    }
  }
  return o;
}

// DualPipeV (DeepSeek's DualPipe cut in half, as PyTorch's
// ScheduleDualPipeV orders it): the V of zbv (rank r holds shallow chunk r
// and deep chunk 2p-1-r), in eight phases per rank:
//   1. 2(p-1-r) shallow forwards;
//   2. r+1 times: a shallow and a deep forward;
//   3. p-1-r times: deep input gradient, its weight gradient, deep forward;
//   4. m-2p+r+1 times: shallow forward + deep backward, then deep forward +
//      shallow backward (the pairs DualPipe overlaps on a GPU, where one's
//      all-to-all hides behind the other's compute; here they run one after
//      the other);
//   5. p-1-r times: deep backward, then deep forward + shallow backward;
//   6. r+1 times: deep then shallow backward, split into input and weight
//      passes from the middle on (zero bubble for the tail);
//   7. p-1-r times: a pending weight pass, then a shallow backward;
//   8. the r+1 weight passes still pending.
// Every chunk sees each micro-batch once forward and once backward
// (whole, or input + weight).
std::vector<std::vector<Compute>> dualpipev_order(int p, int m) {
  std::vector<std::vector<Compute>> o(static_cast<size_t>(p));
  for (int r = 0; r < p; ++r) {
    auto& l = o[static_cast<size_t>(r)];
    const int s0 = r, s1 = 2 * p - 1 - r;
    std::map<int, int> next_f, next_b;         // per chunk: next micro-batch
    std::vector<std::pair<int, int>> weights;  // pending (chunk, micro-batch)
    auto forward = [&](int s) { l.push_back({ActionKind::forward, next_f[s]++, s}); };
    auto backward = [&](int s, bool split) {
      const int mb = next_b[s]++;
      if (!split) {
        l.push_back({ActionKind::backward, mb, s});
        return;
      }
      l.push_back({ActionKind::backward_input, mb, s});
      weights.push_back({s, mb});
    };
    auto weight = [&] {
      if (weights.empty()) return;
      l.push_back({ActionKind::backward_weight, weights.front().second, weights.front().first});
      weights.erase(weights.begin());
    };
    for (int i = 0; i < 2 * (p - 1 - r); ++i) forward(s0);
    for (int i = 0; i < r + 1; ++i) {
      forward(s0);
      forward(s1);
    }
    for (int i = 0; i < p - 1 - r; ++i) {
      backward(s1, true);
      weight();
      forward(s1);
    }
    for (int i = 0; i < m - 2 * p + r + 1; ++i) {
      forward(s0);
      backward(s1, false);
      forward(s1);
      backward(s0, false);
    }
    for (int i = 0; i < p - 1 - r; ++i) {
      backward(s1, false);
      forward(s1);
      backward(s0, false);
    }
    bool split = false;
    for (int i = 0; i < r + 1; ++i) {
      if (i == (r + 1) / 2 && r % 2 == 1) split = true;
      backward(s1, split);
      if (i == (r + 1) / 2 && r % 2 == 0) split = true;
      backward(s0, split);
    }
    for (int i = 0; i < p - 1 - r; ++i) {
      weight();
      backward(s0, split);
    }
    for (int i = 0; i < r + 1; ++i) weight();
    MT_CHECK(
        weights.empty() && next_f[s0] == m && next_f[s1] == m && next_b[s0] == m && next_b[s1] == m,
        "dualpipev: rank {} of {} does not run every micro-batch once", r, p);
  }
  return o;
}

}  // namespace

void check_warmup_extra(ScheduleKind kind, int extra, std::string_view where) {
  if (extra < 0) {
    throw ConfigError(fmt::format("{}.warmup_extra: {} (expected >= 0)", where, extra));
  }
  if (extra > 0 && kind != ScheduleKind::one_f_one_b) {
    throw ConfigError(fmt::format(
        "{}.warmup_extra: {} extra warm-up forwards need schedule 1f1b (schedule {} has its own "
        "warm-up)",
        where, extra, schedule_name(kind)));
  }
}

std::string_view async_name(AsyncMode m) {
  switch (m) {
    case AsyncMode::none:
      return "none";
    case AsyncMode::pipedream:
      return "pipedream";
    case AsyncMode::spectrain:
      return "spectrain";
  }
  return "?";
}

AsyncMode parse_async_mode(std::string_view name, std::string_view where) {
  for (AsyncMode m : {AsyncMode::none, AsyncMode::pipedream, AsyncMode::spectrain}) {
    if (async_name(m) == name) return m;
  }
  throw ConfigError(fmt::format(
      "{}: unknown asynchronous mode \"{}\" (expected none, pipedream or spectrain)", where, name));
}

void check_async(AsyncMode mode, ScheduleKind kind, std::string_view where) {
  if (mode == AsyncMode::none || kind == ScheduleKind::one_f_one_b) return;
  throw ConfigError(
      fmt::format("{}.async: {} runs on schedule 1f1b (PipeDream's 1F1B with an update after each "
                  "micro-batch), not {}",
                  where, async_name(mode), schedule_name(kind)));
}

std::vector<int> version_gaps(const PipelineSchedule& s, int stage) {
  MT_CHECK(stage >= 0 && stage < s.stages, "version_gaps: stage {} of {}", stage, s.stages);
  std::vector<int> gaps(static_cast<size_t>(s.microbatches), -1);
  std::vector<int> backwards_at_forward(static_cast<size_t>(s.microbatches), -1);
  int backwards = 0;
  for (const PipelineAction& a : s.actions[static_cast<size_t>(stage)]) {
    const auto i = static_cast<size_t>(a.microbatch);
    if (a.kind == ActionKind::forward) {
      backwards_at_forward[i] = backwards;
    } else if (a.kind == ActionKind::backward || a.kind == ActionKind::backward_weight) {
      MT_CHECK(backwards_at_forward[i] >= 0, "version_gaps: B{} before F{} on stage {}", i, i,
               stage);
      gaps[i] = backwards - backwards_at_forward[i];
      ++backwards;
    }
  }
  return gaps;
}

PipelineSchedule make_async_window(int p, int m, int window, bool drain) {
  check_schedule(ScheduleKind::one_f_one_b, p, m, 1, "async");
  PipelineSchedule s;
  s.kind = ScheduleKind::one_f_one_b;
  s.stages = p;
  s.microbatches = m;
  s.actions.resize(static_cast<size_t>(p));
  const int first = window * m;
  for (int r = 0; r < p; ++r) {
    auto& list = s.actions[static_cast<size_t>(r)];
    const int lag = p - 1 - r;
    auto backward = [&](int b) {
      if (b < 0) return;
      if (r < p - 1) list.push_back({ActionKind::recv_grad, b, r, r + 1});
      list.push_back({ActionKind::backward, b, r, -1});
      if (r > 0) list.push_back({ActionKind::send_grad, b, r, r - 1});
    };
    for (int i = 0; i < m; ++i) {
      if (drain) {
        if (i >= m - lag) backward(first + i - m);
        continue;
      }
      const int f = first + i;
      if (r > 0) list.push_back({ActionKind::recv_activation, f, r, r - 1});
      list.push_back({ActionKind::forward, f, r, -1});
      if (r < p - 1) list.push_back({ActionKind::send_activation, f, r, r + 1});
      backward(f - lag);
    }
  }
  return s;
}

int async_version_gap(int p, int r, int64_t g) {
  return static_cast<int>(std::min<int64_t>(g, p - 1 - r));
}

PipelineSchedule make_schedule(ScheduleKind kind, int p, int m, int v, int extra) {
  check_schedule(kind, p, m, v, "schedule");
  check_warmup_extra(kind, extra, "schedule");
  if (extra > 0) {
    PipelineSchedule s = with_transfers(kind, p, m, 1, one_f_one_b_order(p, m, extra));
    s.warmup_extra = extra;
    return s;
  }
  switch (kind) {
    case ScheduleKind::gpipe:
      return with_transfers(kind, p, m, 1, gpipe_order(p, m));
    case ScheduleKind::one_f_one_b:
      return with_transfers(kind, p, m, 1, one_f_one_b_order(p, m, 0));
    case ScheduleKind::interleaved:
      return with_transfers(kind, p, m, v, interleaved_order(p, m, v));
    case ScheduleKind::zero_bubble:
      return with_transfers(kind, p, m, 1, zero_bubble_order(p, m));
    case ScheduleKind::zbv:
      return with_transfers(kind, p, m, 2, zbv_order(p, m));
    case ScheduleKind::dualpipev:
      return with_transfers(kind, p, m, 2, dualpipev_order(p, m));
  }
  MT_CHECK(false, "unknown schedule kind");
  return {};
}

ScheduleSimulation simulate(const PipelineSchedule& s, const ActionCosts& costs) {
  const int p = s.stages, last = s.virtual_count() - 1;
  // Finish time of each compute action: key (kind, micro-batch, virtual stage).
  // A whole backward also counts as its input-gradient part.
  std::map<std::tuple<int, int, int>, double> done;
  auto key = [](ActionKind k, int mb, int st) {
    return std::make_tuple(static_cast<int>(k), mb, st);
  };
  auto finished = [&](ActionKind k, int mb, int st) -> const double* {
    auto it = done.find(key(k, mb, st));
    return it == done.end() ? nullptr : &it->second;
  };
  ScheduleSimulation sim;
  sim.busy.assign(static_cast<size_t>(p), 0.0);
  sim.peak_in_flight.assign(static_cast<size_t>(p), 0);
  sim.start.resize(static_cast<size_t>(p));
  std::vector<size_t> pos(static_cast<size_t>(p), 0);
  std::vector<double> now(static_cast<size_t>(p), 0.0);
  std::vector<int> in_flight(static_cast<size_t>(p), 0);
  for (int r = 0; r < p; ++r)
    sim.start[static_cast<size_t>(r)].assign(s.actions[static_cast<size_t>(r)].size(), -1.0);
  for (;;) {
    bool progress = false, all_done = true;
    for (int r = 0; r < p; ++r) {
      const size_t ru = static_cast<size_t>(r);
      const auto& list = s.actions[ru];
      while (pos[ru] < list.size()) {
        const PipelineAction& a = list[pos[ru]];
        if (!a.is_compute()) {
          ++pos[ru];
          progress = true;
          continue;
        }
        std::vector<const double*> deps;
        double cost = 0;
        switch (a.kind) {
          case ActionKind::forward:
            cost = costs.forward;
            if (a.stage > 0)
              deps.push_back(finished(ActionKind::forward, a.microbatch, a.stage - 1));
            break;
          case ActionKind::backward:
          case ActionKind::backward_input:
            cost = a.kind == ActionKind::backward ? costs.backward_input + costs.backward_weight
                                                  : costs.backward_input;
            deps.push_back(finished(ActionKind::forward, a.microbatch, a.stage));
            if (a.stage < last)
              deps.push_back(finished(ActionKind::backward_input, a.microbatch, a.stage + 1));
            break;
          case ActionKind::backward_weight:
            cost = costs.backward_weight;
            deps.push_back(finished(ActionKind::backward_input, a.microbatch, a.stage));
            break;
          default:
            break;
        }
        // The stage each dependency ran on (same order as deps).
        std::vector<int> dep_stage;
        switch (a.kind) {
          case ActionKind::forward:
            if (a.stage > 0) dep_stage.push_back(a.stage - 1);
            break;
          case ActionKind::backward:
          case ActionKind::backward_input:
            dep_stage.push_back(a.stage);
            if (a.stage < last) dep_stage.push_back(a.stage + 1);
            break;
          default:
            dep_stage.push_back(a.stage);
            break;
        }
        double start = now[ru];
        bool ready = true;
        for (size_t k = 0; k < deps.size(); ++k) {
          const double* d = deps[k];
          if (d == nullptr) {
            ready = false;
            break;
          }
          const bool remote = s.owner(dep_stage[k]) != r;
          start = std::max(start, *d + (remote ? costs.transfer : 0.0));
        }
        if (!ready) break;
        const double end = start + cost;
        sim.start[ru][pos[ru]] = start;
        now[ru] = end;
        sim.busy[ru] += cost;
        if (a.kind == ActionKind::backward) {
          done[key(ActionKind::backward_input, a.microbatch, a.stage)] = end;
        }
        done[key(a.kind, a.microbatch, a.stage)] = end;
        if (a.kind == ActionKind::forward) ++in_flight[ru];
        if (a.kind == ActionKind::backward || a.kind == ActionKind::backward_weight)
          --in_flight[ru];
        sim.peak_in_flight[ru] = std::max(sim.peak_in_flight[ru], in_flight[ru]);
        ++pos[ru];
        progress = true;
      }
      if (pos[ru] < list.size()) all_done = false;
    }
    if (all_done) break;
    if (!progress) {
      std::string stuck;
      for (int r = 0; r < p; ++r) {
        const size_t ru = static_cast<size_t>(r);
        if (pos[ru] < s.actions[ru].size())
          stuck += fmt::format(" stage {} at {};", r, describe(s.actions[ru][pos[ru]]));
      }
      throw InternalError(fmt::format("pipeline schedule {} (p={}, m={}, v={}) deadlocks:{}",
                                      schedule_name(s.kind), p, s.microbatches, s.virtual_stages,
                                      stuck));
    }
  }
  for (double t : now) sim.makespan = std::max(sim.makespan, t);
  double busy = 0;
  for (double b : sim.busy) busy += b;
  sim.idle_fraction = sim.makespan > 0 ? 1.0 - busy / (p * sim.makespan) : 0.0;
  return sim;
}

double formula_idle_fraction(ScheduleKind kind, int p, int m, int v) {
  const double pm1 = p - 1;
  if (kind == ScheduleKind::interleaved) return pm1 / (static_cast<double>(v) * m + pm1);
  if (is_v_shaped(kind)) return pm1 / (2.0 * m + pm1);
  return pm1 / (m + pm1);
}

}  // namespace mt
