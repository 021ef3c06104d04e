// The discrete-event simulator (planner/simulator.h). Each rank's tasks are
// resolved lane by lane as soon as what they wait for is known: the previous
// task of the lane, the tasks named in `after`, the other members of a
// collective, the message of a receive. Times only ever come from those
// dependencies, so the order in which ranks are visited does not change them.
#include "meshtrain/planner/simulator.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <map>
#include <mutex>
#include <numeric>
#include <tuple>

#include <fmt/format.h>

#include "meshtrain/base/error.h"
#include "meshtrain/train/timeline.h"

namespace mt::planner {

namespace {

constexpr double kUnset = -1.0;

struct ProgramIndex {
  std::vector<int> prev_in_lane;        // per task: the previous task of its lane, or -1
  std::vector<std::vector<int>> lanes;  // per lane: task indices in order
  // Per collective task: the compute-lane seconds the rank ran since its
  // previous synchronisation (a compute-lane collective or receive, or a
  // compute task's wait for a collective) up to the task, or up to the compute task it waits for
  // (`after`) on another lane: the work whose jitter makes members late.
  std::vector<double> segment;
};

ProgramIndex index_program(const Program& p) {
  ProgramIndex ix;
  ix.prev_in_lane.assign(p.tasks.size(), -1);
  std::map<int, int> last;
  int max_lane = 0;
  for (const Task& t : p.tasks) max_lane = std::max(max_lane, t.lane);
  ix.lanes.resize(static_cast<size_t>(max_lane) + 1);
  for (size_t i = 0; i < p.tasks.size(); ++i) {
    const int lane = p.tasks[i].lane;
    auto it = last.find(lane);
    ix.prev_in_lane[i] = it == last.end() ? -1 : it->second;
    last[lane] = static_cast<int>(i);
    ix.lanes[static_cast<size_t>(lane)].push_back(static_cast<int>(i));
    for (int a : p.tasks[i].after) {
      if (a < 0 || static_cast<size_t>(a) >= i) {
        throw InternalError(fmt::format(
            "program '{}': task {} waits for task {}, not an earlier one", p.signature, i, a));
      }
    }
  }
  ix.segment.assign(p.tasks.size(), 0.0);
  std::vector<double> acc_at(p.tasks.size(), 0.0);
  double acc = 0;
  for (size_t i = 0; i < p.tasks.size(); ++i) {
    const Task& t = p.tasks[i];
    if (t.lane == 0 && t.kind == Task::Kind::compute) {
      // Waiting for a collective (the optimizer for the last gradient
      // bucket, a pass for its ZeRO-3 gather) synchronises too.
      for (int a : t.after) {
        if (p.tasks[static_cast<size_t>(a)].kind == Task::Kind::collective) acc = 0;
      }
      acc += t.seconds;
      acc_at[i] = acc;
    } else if (t.kind == Task::Kind::collective) {
      if (t.lane == 0) {
        ix.segment[i] = acc;
      } else {
        for (int a : t.after) {
          const Task& at = p.tasks[static_cast<size_t>(a)];
          if (at.lane == 0 && at.kind == Task::Kind::compute) {
            ix.segment[i] = std::max(ix.segment[i], acc_at[static_cast<size_t>(a)]);
          }
        }
      }
    }
    if (t.lane == 0 && (t.kind == Task::Kind::collective || t.kind == Task::Kind::recv)) acc = 0;
  }
  return ix;
}

struct RankState {
  std::vector<double> ready;   // per task: when its own dependencies were met (kUnset: not yet)
  std::vector<double> start;   // per task
  std::vector<double> finish;  // per task (kUnset: not yet)
  std::vector<size_t> next;    // per lane: position in ProgramIndex::lanes
  uint64_t bytes_sent = 0;
  double comm_total = 0;
};

struct Instance {  // one collective call on one group
  int arrived = 0;
  double ready = 0;
  double jitter_s = 0;                       // the largest member's compute_jitter x segment
  std::vector<std::pair<int, int>> members;  // (rank, task)
};

}  // namespace

// E[max of n independent standard normal variables] (0 for n = 1): how
// far, in standard deviations, the last of n members arrives after their
// mean. Numerically, E = integral of x n phi(x) Phi(x)^(n-1) dx.
double expected_max_normal(int n) {
  if (n <= 1) return 0.0;
  static std::mutex mutex;
  static std::map<int, double> cache;
  std::lock_guard<std::mutex> hold(mutex);
  auto it = cache.find(n);
  if (it != cache.end()) return it->second;
  const double lo = -12, hi = 12;
  const int steps = 24000;
  const double h = (hi - lo) / steps;
  double sum = 0;
  for (int k = 0; k <= steps; ++k) {
    const double x = lo + h * k;
    const double phi = std::exp(-0.5 * x * x) / std::sqrt(2 * M_PI);
    const double cdf = 0.5 * std::erfc(-x / std::sqrt(2.0));
    const double f = x * n * phi * std::pow(cdf, n - 1);
    sum += (k == 0 || k == steps ? 0.5 : 1.0) * f;
  }
  return cache[n] = sum * h;
}

StepEstimate simulate(const Programs& programs, const ClusterModel& cluster,
                      const SimulationOptions& options) {
  const int world = static_cast<int>(programs.ranks.size());
  if (world != cluster.world()) {
    throw ConfigError(fmt::format("simulate: {} rank programs for a cluster of {} ranks ({})",
                                  world, cluster.world(), cluster.source));
  }
  const comm::CommCostModel cm = comm_model(cluster);
  std::vector<ProgramIndex> index;
  for (const Program& p : programs.programs) index.push_back(index_program(p));

  std::vector<RankState> st(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    const RankBinding& b = programs.ranks[static_cast<size_t>(r)];
    const Program& p = programs.programs.at(static_cast<size_t>(b.program));
    RankState& s = st[static_cast<size_t>(r)];
    s.ready.assign(p.tasks.size(), kUnset);
    s.start.assign(p.tasks.size(), kUnset);
    s.finish.assign(p.tasks.size(), kUnset);
    s.next.assign(index[static_cast<size_t>(b.program)].lanes.size(), 0);
  }

  // Collective times per (group, shape): ranks of one group share them, and
  // so do equal calls (a pipeline's per-parameter all-reduces of equal
  // layers, programs that differ only by device) -- pricing a call is
  // linear in the group's ranks, the simulation calls it per task.
  using ShapeKey = std::tuple<int, Collective, size_t, std::vector<size_t>, size_t, int>;
  std::map<ShapeKey, comm::CollectiveEstimate> estimates;
  auto estimate = [&](int gid, int prog, int shape) -> const comm::CollectiveEstimate& {
    const comm::CollectiveShape& s =
        programs.programs[static_cast<size_t>(prog)].shapes.at(static_cast<size_t>(shape));
    ShapeKey key{gid, s.kind, s.count, s.counts, s.elem_bytes, s.root};
    auto it = estimates.find(key);
    if (it == estimates.end()) {
      it = estimates
               .emplace(std::move(key),
                        cm.collective(s, programs.groups.at(static_cast<size_t>(gid))))
               .first;
    }
    return it->second;
  };

  std::map<std::pair<int, int64_t>, Instance> instances;     // (group, seq)
  std::map<std::tuple<int, int, int64_t>, double> arrivals;  // (from, to, tag)
  std::deque<int> work;
  std::vector<char> queued(static_cast<size_t>(world), 1);
  for (int r = 0; r < world; ++r) work.push_back(r);
  auto wake = [&](int r) {
    if (!queued[static_cast<size_t>(r)]) {
      queued[static_cast<size_t>(r)] = 1;
      work.push_back(r);
    }
  };

  while (!work.empty()) {
    const int r = work.front();
    work.pop_front();
    queued[static_cast<size_t>(r)] = 0;
    const RankBinding& b = programs.ranks[static_cast<size_t>(r)];
    const Program& p = programs.programs[static_cast<size_t>(b.program)];
    const ProgramIndex& ix = index[static_cast<size_t>(b.program)];
    RankState& s = st[static_cast<size_t>(r)];
    bool progress = true;
    while (progress) {
      progress = false;
      for (size_t lane = 0; lane < ix.lanes.size(); ++lane) {
        while (s.next[lane] < ix.lanes[lane].size()) {
          const int i = ix.lanes[lane][s.next[lane]];
          const Task& t = p.tasks[static_cast<size_t>(i)];
          if (s.ready[static_cast<size_t>(i)] == kUnset) {
            double ready = 0;
            bool known = true;
            const int prev = ix.prev_in_lane[static_cast<size_t>(i)];
            if (prev >= 0) ready = s.finish[static_cast<size_t>(prev)];
            for (int a : t.after) {
              if (s.finish[static_cast<size_t>(a)] == kUnset) known = false;
              ready = std::max(ready, s.finish[static_cast<size_t>(a)]);
            }
            if (!known) break;  // an `after` task on another lane is not done yet
            s.ready[static_cast<size_t>(i)] = ready;
            if (t.kind == Task::Kind::collective) {
              const int gid = b.group_ids.at(static_cast<size_t>(t.group));
              Instance& in = instances[{gid, t.seq}];
              ++in.arrived;
              in.ready = std::max(in.ready, ready);
              in.jitter_s = std::max(in.jitter_s, cluster.device(r).compute_jitter *
                                                      ix.segment[static_cast<size_t>(i)]);
              in.members.emplace_back(r, i);
              const auto& group = programs.groups[static_cast<size_t>(gid)];
              if (in.arrived == static_cast<int>(group.size())) {
                const comm::CollectiveEstimate& e = estimate(gid, b.program, t.shape);
                // Members run equal work at one predicted time, but each
                // rank's compute jitters: the call starts when the last one
                // arrives, E[max of n] standard deviations after their mean.
                if (in.jitter_s > 0) {
                  in.ready += in.jitter_s * expected_max_normal(static_cast<int>(group.size()));
                }
                for (const auto& [mr, mi] : in.members) {
                  RankState& ms = st[static_cast<size_t>(mr)];
                  ms.start[static_cast<size_t>(mi)] = in.ready;
                  ms.finish[static_cast<size_t>(mi)] = in.ready + e.seconds;
                  const size_t pos = static_cast<size_t>(std::find(group.begin(), group.end(), mr) -
                                                         group.begin());
                  ms.bytes_sent += e.bytes_sent.at(pos);
                  ms.comm_total += e.seconds;
                  if (mr != r) wake(mr);
                }
                instances.erase({gid, t.seq});
              }
            }
          }
          const double ready = s.ready[static_cast<size_t>(i)];
          if (t.kind == Task::Kind::compute) {
            s.start[static_cast<size_t>(i)] = ready;
            s.finish[static_cast<size_t>(i)] = ready + t.seconds;
          } else if (t.kind == Task::Kind::send) {
            const int to = b.peer_ranks.at(static_cast<size_t>(t.peer));
            const double d = cm.send_s(r, to, t.bytes);
            s.start[static_cast<size_t>(i)] = ready;
            s.finish[static_cast<size_t>(i)] = ready + d;
            s.bytes_sent += to != r ? t.bytes : 0;
            s.comm_total += d;
            arrivals[{r, to, t.tag}] = ready + d;
            wake(to);
          } else if (t.kind == Task::Kind::recv) {
            const int from = b.peer_ranks.at(static_cast<size_t>(t.peer));
            auto it = arrivals.find({from, r, t.tag});
            if (it == arrivals.end()) break;  // its message is not sent yet
            s.start[static_cast<size_t>(i)] = ready;
            s.finish[static_cast<size_t>(i)] = std::max(ready, it->second);
            arrivals.erase(it);
          } else if (s.finish[static_cast<size_t>(i)] == kUnset) {
            break;  // a collective whose group has not all arrived
          }
          ++s.next[lane];
          progress = true;
        }
      }
    }
  }

  // Every task must have finished; otherwise the programs deadlock.
  std::vector<std::string> stuck;
  for (int r = 0; r < world && stuck.size() < 8; ++r) {
    const RankBinding& b = programs.ranks[static_cast<size_t>(r)];
    const Program& p = programs.programs[static_cast<size_t>(b.program)];
    const RankState& s = st[static_cast<size_t>(r)];
    for (size_t i = 0; i < p.tasks.size(); ++i) {
      if (s.finish[i] == kUnset) {
        stuck.push_back(fmt::format("rank {} at task {} '{}'", r, i, p.tasks[i].name));
        break;
      }
    }
  }
  if (!stuck.empty()) {
    throw InternalError(
        fmt::format("simulate: the rank programs deadlock: {}", fmt::join(stuck, "; ")));
  }

  StepEstimate est;
  est.distinct_programs = static_cast<int>(programs.programs.size());
  est.notes = programs.notes;
  est.ranks.resize(static_cast<size_t>(world));
  double peak_sum = 0;
  for (int r = 0; r < world; ++r) {
    const RankState& s = st[static_cast<size_t>(r)];
    for (double f : s.finish) est.step_s = std::max(est.step_s, f);
    const DeviceKind& dev = cluster.device(r);
    peak_sum += programs.half_precision && dev.peak_flops_bf16 > 0 ? dev.peak_flops_bf16
                                                                   : dev.peak_flops_f32;
  }
  for (int r = 0; r < world; ++r) {
    const RankBinding& b = programs.ranks[static_cast<size_t>(r)];
    const Program& p = programs.programs[static_cast<size_t>(b.program)];
    const RankState& s = st[static_cast<size_t>(r)];
    RankEstimate& e = est.ranks[static_cast<size_t>(r)];
    double lane0_comm = 0;
    for (size_t i = 0; i < p.tasks.size(); ++i) {
      const Task& t = p.tasks[i];
      if (t.kind == Task::Kind::compute && t.category == "comm") {
        // Collectives folded into a pipeline pass: communication on the
        // compute lane.
        lane0_comm += t.seconds;
        e.comm_s += t.seconds;
      } else if (t.kind == Task::Kind::compute) {
        e.compute_s += t.seconds;
        if (t.category == "forward") e.forward_s += t.seconds;
        if (t.category == "backward") e.backward_s += t.seconds;
        if (t.category == "optimizer") e.optimizer_s += t.seconds;
        e.overhead_s += t.overhead_s;
        e.traffic_s += t.traffic_s;
      } else if (t.lane == 0 && t.kind != Task::Kind::recv) {
        lane0_comm += s.finish[i] - s.start[i];
      }
    }
    e.comm_s += s.comm_total;
    e.idle_s = std::max(0.0, est.step_s - e.compute_s - lane0_comm);
    e.utilisation = est.step_s > 0 ? e.compute_s / est.step_s : 0.0;
    e.peak_memory_bytes = p.peak_memory_bytes;
    e.bytes_sent = s.bytes_sent;
  }
  est.samples_per_s =
      est.step_s > 0 ? static_cast<double>(programs.samples_per_step) / est.step_s : 0.0;
  est.mfu = est.step_s > 0 && peak_sum > 0 ? programs.model_flops_per_step / (est.step_s * peak_sum)
                                           : 0.0;

  if (!options.trace_path.empty()) {
    const int n = options.trace_ranks > 0 ? std::min(world, options.trace_ranks) : world;
    std::vector<std::string> bodies;
    for (int r = 0; r < n; ++r) {
      const RankBinding& b = programs.ranks[static_cast<size_t>(r)];
      const Program& p = programs.programs[static_cast<size_t>(b.program)];
      const RankState& s = st[static_cast<size_t>(r)];
      TimelineOptions to;
      to.max_events = p.tasks.size() * 2 + 16;
      Timeline tl(to);
      const int64_t epoch = tl.epoch_ns();
      auto ns = [&](double sec) { return epoch + static_cast<int64_t>(sec * 1e9); };
      for (size_t i = 0; i < p.tasks.size(); ++i) {
        const Task& t = p.tasks[i];
        const bool comm = t.kind != Task::Kind::compute || t.category == "comm";
        if (t.kind == Task::Kind::recv) {
          if (s.finish[i] > s.start[i]) {
            tl.add(t.name, "wait", ns(s.start[i]), ns(s.finish[i]), Timeline::kWait);
          }
          continue;
        }
        if (t.kind == Task::Kind::collective && s.start[i] > s.ready[i]) {
          tl.add("wait " + t.name, "wait", ns(s.ready[i]), ns(s.start[i]), Timeline::kWait);
        }
        nlohmann::json args = nlohmann::json::object();
        if (t.flops > 0) args["flops"] = t.flops;
        if (t.bytes > 0) args["bytes"] = t.bytes;
        args["predicted"] = true;
        tl.add(t.name, comm ? "comm" : t.category, ns(s.start[i]), ns(s.finish[i]),
               comm && t.lane != 0 ? Timeline::kComm : Timeline::kCompute, std::move(args));
      }
      tl.add("step", "step", ns(0), ns(est.step_s), Timeline::kCompute);
      bodies.push_back(tl.serialize(r));
    }
    write_trace_file(options.trace_path, bodies);
  }
  return est;
}

}  // namespace mt::planner
