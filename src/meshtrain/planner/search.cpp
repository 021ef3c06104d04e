#include "meshtrain/planner/search.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <exception>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>

#include "meshtrain/base/error.h"
#include "meshtrain/planner/balance.h"
#include "meshtrain/planner/simulator.h"
#include "meshtrain/spmd/lower.h"
#include "meshtrain/train/pipeline_training.h"
#include "meshtrain/train/training_plan.h"

namespace mt::planner {

namespace {

std::vector<int> divisors(int n) {
  std::vector<int> d;
  for (int i = 1; i <= n; ++i) {
    if (n % i == 0) d.push_back(i);
  }
  return d;
}

// "[3,1]": no spaces, so that the settings paste into a shell as they are.
std::string list(const std::vector<int64_t>& v) {
  return fmt::format("[{}]", fmt::join(v, ","));
}

// Seconds per unit of work of each rank relative to the others: its slowdown
// over its device's f32 peak (what makes ranks unequal before any plan).
bool unequal_devices(const ClusterModel& c) {
  std::set<std::pair<int, double>> seen;
  for (int r = 0; r < c.world(); ++r)
    seen.insert({c.kind_of[static_cast<size_t>(r)], c.slowdown_of(r)});
  if (seen.size() <= 1) return false;
  std::set<double> speed;
  for (const auto& [k, s] : seen) speed.insert(c.kinds[static_cast<size_t>(k)].peak_flops_f32 / s);
  return speed.size() > 1;
}

// Which devices form which tensor group and stage (Plan::devices): besides
// the cluster's own order, its ranks sorted by speed (f32 peak over
// slowdown; stable, so like devices keep their order), fastest first and
// slowest first. Mesh ranks are numbered pp, dp, tp (tensor innermost), so
// sorted ranks put like devices in one tensor group (none held back by a
// slower member) and the fast ones on the first or on the last pipeline
// stage (whose extra work -- embeddings, head, loss -- or activation stash
// decides which is better; the cost model prices both). Orders equal to the
// cluster's are left out.
std::vector<std::pair<std::string, std::vector<int>>> device_orders(const ClusterModel& c) {
  const int world = c.world();
  std::vector<double> speed(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r)
    speed[static_cast<size_t>(r)] = c.device(r).peak_flops_f32 / c.slowdown_of(r);
  std::vector<int> ident(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) ident[static_cast<size_t>(r)] = r;
  std::vector<int> fast = ident, slow = ident;
  std::stable_sort(fast.begin(), fast.end(), [&](int a, int b) {
    return speed[static_cast<size_t>(a)] > speed[static_cast<size_t>(b)];
  });
  std::stable_sort(slow.begin(), slow.end(), [&](int a, int b) {
    return speed[static_cast<size_t>(a)] < speed[static_cast<size_t>(b)];
  });
  std::vector<std::pair<std::string, std::vector<int>>> out;
  if (fast != ident) out.push_back({"fast-first", fast});
  if (slow != ident && slow != fast) out.push_back({"slow-first", slow});
  return out;
}

// The largest number of ranks on one node.
int max_node_ranks(const ClusterModel& c) {
  std::map<int, int> per;
  int m = 1;
  for (int n : c.layout.node_of) m = std::max(m, ++per[n]);
  return m;
}

struct Evaluated {
  bool refused = false;
  std::string why;
  int64_t over_bytes = 0;  // > 0: over memory on `worst_rank`
  int worst_rank = 0;
  int64_t need = 0, have = 0;
};

}  // namespace

std::string PlanCandidate::describe() const {
  std::string s = fmt::format("dp={} tp={} pp={}", shape.dp, shape.tp, shape.pp);
  if (shape.pp > 1) {
    s += fmt::format(" mb={} {}", shape.microbatches, schedule_name(shape.schedule));
  }
  s += fmt::format(" zero={}", zero_stage);
  if (recompute) s += " recompute";
  if (!shape.batch_shares.empty()) s += " shares=" + list(shape.batch_shares);
  if (!shape.tp_ratios.empty()) s += " tp_ratios=" + list(shape.tp_ratios);
  if (!shape.stage_layers.empty()) s += " stage_layers=" + list(shape.stage_layers);
  if (!devices.empty()) s += " devices=" + device_order;
  return s;
}

std::vector<std::string> PlanCandidate::settings(int world) const {
  std::vector<std::string> s = {fmt::format("dist.nproc={}", world),
                                fmt::format("dist.zero_stage={}", zero_stage)};
  if (!shape.batch_shares.empty()) s.push_back("dist.batch_shares=" + list(shape.batch_shares));
  // Under a pipeline the plan file carries the stages' recomputation.
  if (recompute && shape.pp <= 1) s.push_back("exec.recompute=true");
  return s;
}

SearchResult search_plans(const ModelSpec& spec, const TrainerOptions& base,
                          const ClusterModel& cluster, const SearchOptions& opt) {
  const int world = cluster.world();
  if (world < 1) throw ConfigError("plan search: the cluster has no ranks");
  ModelSpec shape_spec = spec;
  shape_spec.compute = DType::f32;  // names and shapes do not depend on it
  const ModelGraph m = build_model(shape_spec, base.batch_size);
  const ShorthandModel sm{spec.kind, spec.kind == "gpt" ? spec.d_model / spec.heads : 1};
  const int units = static_cast<int>(stage_units(sm, m.graph).size());
  const int node_ranks = max_node_ranks(cluster);
  const bool unequal = opt.uneven && unequal_devices(cluster);

  // The even shapes, in a fixed order.
  struct Shape {
    ParallelShorthand sh;
    int zero = 0;
    bool recompute = false;
    // Under a pipeline, the twins it adds a memory saving to (without
    // recomputation; with ZeRO 0): where one of them fits, this one is not
    // priced (SearchResult::dominated). -1: none.
    int base_a = -1, base_b = -1;
    std::string device_order;  // with `devices`: which order (device_orders)
    std::vector<int> devices;  // empty: the cluster's order
  };
  // On unequal devices, where the order decides something (which devices
  // share a stage, or a tensor group of several replicas), each shape also
  // in the other device orders (each order its own run of twins).
  std::vector<std::pair<std::string, std::vector<int>>> orders{{"", {}}};
  if (unequal && opt.device_orders) {
    for (auto& o : device_orders(cluster)) orders.push_back(std::move(o));
  }
  std::vector<Shape> shapes;
  // Runs of shapes that differ only in ZeRO stage and recomputation, in
  // order: one unit of work, since a twin's price decides whether the next
  // is priced.
  std::vector<std::pair<size_t, size_t>> runs;
  for (int tp : divisors(world)) {
    if (opt.tp_within_node && tp > node_ranks) continue;
    for (int pp : divisors(world / tp)) {
      if (pp > units) continue;
      const int dp = world / (tp * pp);
      std::vector<std::pair<int, ScheduleKind>> pipe;
      if (pp == 1) {
        pipe.push_back({1, ScheduleKind::one_f_one_b});
      } else {
        for (int f : opt.microbatch_factors) {
          for (ScheduleKind k : opt.schedules) pipe.push_back({pp * f, k});
        }
      }
      for (const auto& [mb, kind] : pipe) {
        for (const auto& [order_name, order] : orders) {
          if (!order.empty() && !(pp > 1 || (tp > 1 && dp > 1))) continue;
          const size_t run_begin = shapes.size();
          std::map<std::pair<int, bool>, int> twin;  // (zero, recompute) -> shape index
          for (int zero : opt.zero_stages) {
            if (dp == 1 && zero > 0) continue;
            // ZeRO under a pipeline: stages 1 and 2, where
            // SearchOptions::zero_pipelines asks for them. 3 is not searched:
            // the stage holds its whole parameters through the step (plus
            // the shard), at 2's bytes, so it never fits where 2 does not
            // nor runs faster; it saves memory only between steps.
            if (pp > 1 && zero > 0 && (zero > 2 || !opt.zero_pipelines)) continue;
            // Recomputation: exec.recompute without a pipeline; with one,
            // every stage's (parallel.recompute, StagePlan::recompute).
            for (int rc = 0; rc < (opt.recompute ? 2 : 1); ++rc) {
              Shape s;
              s.sh.dp = dp, s.sh.tp = tp, s.sh.pp = pp;
              s.sh.microbatches = mb, s.sh.schedule = kind;
              s.sh.recompute = pp > 1 && rc == 1;
              s.zero = zero, s.recompute = rc == 1;
              s.device_order = order_name, s.devices = order;
              if (pp > 1) {
                // Recomputation only adds a forward per micro-batch (never
                // faster); ZeRO under a pipeline adds the all-gather of the
                // updated parameters: each is priced only where its twin
                // without it does not fit.
                auto at = [&](int z, bool r) {
                  auto it = twin.find({z, r});
                  return it == twin.end() ? -1 : it->second;
                };
                if (s.recompute) s.base_a = at(zero, false);
                if (zero >= 1) s.base_b = at(0, s.recompute);
              }
              twin[{zero, s.recompute}] = static_cast<int>(shapes.size());
              shapes.push_back(s);
            }
          }
          if (shapes.size() > run_begin) runs.emplace_back(run_begin, shapes.size());
        }
      }
    }
  }

  // Pricing is pure (the cost model's functions of their arguments), so the
  // shapes are priced on several threads; what is kept, counted and
  // reported is then recorded in shape order, so the result does not depend
  // on the threads.
  struct Priced {
    enum Kind { fits, over, refused, unpriced } kind = refused;
    // fits, not simulated: a lower bound of its step is above `top`
    // runnable plans already priced (SearchResult::not_simulated).
    bool bounded = false;
    PlanCandidate c;
    std::string why;
    int worst = 0;  // over: the rank furthest over its memory
  };
  // Stage passes shared by candidates that differ only in the schedule or
  // the micro-batch count (planner/cost_model.h).
  BuildCache cache;
  // The `top` fastest steps priced so far, for the pipelines' lower-bound
  // cut: a plan whose bound is above the top-th of them cannot be among the
  // best, whatever is priced later, so the result does not depend on the order.
  std::mutex top_mutex;
  std::multiset<double> top_runnable;
  // One shape's entries (one per tensor coordinate, up to a node's ranks)
  // until its twin with the other schedule, on each thread.
  const int pricing_threads =
      opt.threads > 0 ? opt.threads : static_cast<int>(std::thread::hardware_concurrency());
  cache.capacity = static_cast<size_t>(std::max(1, pricing_threads) * node_ranks);
  auto price = [&](PlanCandidate c) {
    Priced out;
    TrainerOptions o = base;
    o.dist.dp.stage = c.zero_stage;
    o.exec.recompute = c.recompute && c.shape.pp <= 1;
    o.dist.batch_shares = c.shape.batch_shares;
    o.dist.slowdown.clear();  // the cluster model carries the slowdown
    try {
      // Mesh rank m on world rank devices[m]: the cost model numbers ranks by the mesh.
      const ClusterModel arranged =
          c.devices.empty() ? ClusterModel{} : arrange_cluster(cluster, c.devices);
      const ClusterModel& mesh_cluster = c.devices.empty() ? cluster : arranged;
      c.plan = expand_shorthand(c.shape, sm, m.graph, world);
      c.plan.model = spec.kind;
      c.plan.devices = c.devices;
      validate_plan(c.plan, m.graph, world, base.batch_size, "plan");
      if (needs_lowering(c.plan) || c.plan.pipeline_stages() > 1) {
        o.dist.plan = std::make_shared<const Plan>(c.plan);
      } else {
        o.dist.plan = nullptr;
      }
      // What the pipeline runtime refuses, refused before pricing (cheap).
      if (c.plan.pipeline_stages() > 1) check_pipeline_options(o);
      // Memory before time: a plan over some rank's memory is never
      // proposed and needs no step time (only its memory, for the closest
      // miss), so it is not simulated -- exact, and most of a large
      // model's shapes are over.
      const Programs progs = build_programs(spec, o, mesh_cluster, &cache);
      bool over = false;
      for (int r = 0; r < world && !over; ++r) {
        const Program& pr =
            progs.programs[static_cast<size_t>(progs.ranks[static_cast<size_t>(r)].program)];
        over = pr.peak_memory_bytes > static_cast<int64_t>(mesh_cluster.device(r).memory_bytes);
      }
      if (over) {
        c.estimate.ranks.resize(static_cast<size_t>(world));
        for (int r = 0; r < world; ++r) {
          c.estimate.ranks[static_cast<size_t>(r)].peak_memory_bytes =
              progs.programs[static_cast<size_t>(progs.ranks[static_cast<size_t>(r)].program)]
                  .peak_memory_bytes;
        }
        c.estimate.distinct_programs = static_cast<int>(progs.programs.size());
      } else {
        if (c.shape.pp > 1 && !unequal && opt.top > 0) {
          // Each program's compute-lane tasks run one after another: their
          // sum bounds the step from below.
          double bound = 0;
          for (const Program& pr : progs.programs) {
            double sum = 0;
            for (const Task& t : pr.tasks) {
              if (t.kind == Task::Kind::compute && t.lane == 0) sum += t.seconds;
            }
            bound = std::max(bound, sum);
          }
          std::lock_guard<std::mutex> hold(top_mutex);
          out.bounded =
              static_cast<int>(top_runnable.size()) >= opt.top && bound > *top_runnable.rbegin();
        }
        if (out.bounded) {
          c.estimate.ranks.resize(static_cast<size_t>(world));
          for (int r = 0; r < world; ++r) {
            c.estimate.ranks[static_cast<size_t>(r)].peak_memory_bytes =
                progs.programs[static_cast<size_t>(progs.ranks[static_cast<size_t>(r)].program)]
                    .peak_memory_bytes;
          }
        } else {
          c.estimate = simulate(progs, mesh_cluster);
          std::lock_guard<std::mutex> hold(top_mutex);
          top_runnable.insert(c.estimate.step_s);
          while (static_cast<int>(top_runnable.size()) > std::max(1, opt.top)) {
            top_runnable.erase(std::prev(top_runnable.end()));
          }
        }
      }
    } catch (const ConfigError& e) {
      out.why = e.what();
      out.c = std::move(c);
      return out;
    } catch (const InternalError& e) {
      // The cost model could not price it (a simulator deadlock, ...): not a
      // plan to propose, and said in the output, never silently dropped.
      out.kind = Priced::unpriced;
      out.why = fmt::format("{}: {}", c.describe(), e.what());
      out.c = std::move(c);
      return out;
    }
    out.kind = Priced::fits;
    int64_t worst_over = 0;
    for (int r = 0; r < world; ++r) {
      const int64_t need = c.estimate.ranks[static_cast<size_t>(r)].peak_memory_bytes;
      const auto have = static_cast<int64_t>(cluster.device(c.plan.device_of(r)).memory_bytes);
      if (need > have && (out.kind == Priced::fits || need - have > worst_over)) {
        out.kind = Priced::over;
        worst_over = need - have;
        out.worst = r;
      }
    }
    out.c = std::move(c);
    return out;
  };
  std::mutex glpk;  // GLPK's environment is process-wide
  auto lp = [&](const BalanceProblem& bp) {
    std::lock_guard<std::mutex> hold(glpk);
    return balance_lp(bp);
  };

  double max_memory = 0;
  for (const DeviceKind& k : cluster.kinds) max_memory = std::max(max_memory, k.memory_bytes);
  const auto params = static_cast<double>(m.graph.param_count());
  // Optimizer state per parameter the bound may count for sure: AdamW's and
  // LAMB's two f32 moments (SGD's and LARS's momentum is optional: 0).
  const double state_bytes = base.optimizer == "adamw" || base.optimizer == "lamb" ? 8.0 : 0.0;

  struct ShapeResult {
    double bound = 0;        // > max_memory: not priced
    bool dominated = false;  // a twin without its memory saving fits: not priced
    std::optional<Priced> even, uneven;
    std::string lp_error;
  };
  std::vector<ShapeResult> results(shapes.size());
  std::atomic<size_t> next{0};
  std::mutex progress_mutex;
  int done = 0;
  double best_s = 0;
  auto fits_at = [&](int i) {
    if (i < 0) return false;
    const ShapeResult& t = results[static_cast<size_t>(i)];
    return t.even && t.even->kind == Priced::fits;
  };
  auto work = [&] {
    for (size_t ri = next++; ri < runs.size(); ri = next++) {
      for (size_t i = runs[ri].first; i < runs[ri].second; ++i) {
        const Shape& s = shapes[i];
        ShapeResult& sr = results[i];
        sr.dominated = fits_at(s.base_a) || fits_at(s.base_b);
        const double dp = s.sh.dp, split = static_cast<double>(s.sh.tp) * s.sh.pp;
        sr.bound = params / split *
                   (4.0 / (s.zero >= 3 ? dp : 1.0) + 4.0 / (s.zero >= 2 ? dp : 1.0) +
                    state_bytes / (s.zero >= 1 ? dp : 1.0));
        if (sr.bound <= max_memory && !sr.dominated) {
          PlanCandidate c;
          c.shape = s.sh;
          c.zero_stage = s.zero;
          c.recompute = s.recompute;
          c.devices = s.devices, c.device_order = s.device_order;
          sr.even = price(c);
          if (unequal && sr.even->kind == Priced::fits) {
            // Uneven shares from the LP, priced from the even plan's per-rank compute.
            const StepEstimate& est = sr.even->c.estimate;
            const Plan& p = sr.even->c.plan;
            PlanCandidate u = c;
            u.uneven = true;
            bool have = false;
            bool dp_lp = false;  // batch shares over dp: dp_bp is their LP
            BalanceProblem dp_bp;
            try {
              if (s.sh.pp == 1 && s.sh.dp > 1) {
                // Examples over the dp replicas: a replica is as slow as its slowest rank.
                const int64_t batch = base.batch_size;
                const double per = static_cast<double>(batch) / s.sh.dp;
                BalanceProblem bp;
                bp.total = static_cast<double>(batch);
                bp.what = "examples";
                bp.min_units.assign(static_cast<size_t>(s.sh.dp), 1);
                bp.time_per_unit.assign(static_cast<size_t>(s.sh.dp), 0);
                bp.fixed_time.assign(static_cast<size_t>(s.sh.dp), 0);
                bp.max_units.assign(static_cast<size_t>(s.sh.dp), 1e300);
                for (int r = 0; r < world; ++r) {
                  const auto d = static_cast<size_t>(p.mesh.coord(r, "dp"));
                  const RankEstimate& re = est.ranks[static_cast<size_t>(r)];
                  // The LP balances what each replica computes before the
                  // gradient sync: forward and backward, a_i per example
                  // plus the runtime's per-kernel time as the constant
                  // term (balance.h's b_i: the same whatever the share;
                  // counted per example, it handed slow ranks too many).
                  // The optimizer's update is left out: it follows the
                  // sync, so the step waits for the slowest rank's update
                  // whatever the shares, and giving that rank fewer
                  // examples to make up for it only makes the others'
                  // backward -- and the sync -- later
                  // (PlanSearch.LpSharesCountTheFixedCostsAsAConstant).
                  // The weights' memory traffic (DeviceKind::weight_bandwidth)
                  // is constant too: a replica reads all the weights and
                  // writes all their gradients whatever its examples
                  // (i12-traffic, PlanSearch.LpConstantTermHoldsTheWeightTraffic).
                  const double before_sync = std::max(0.0, re.compute_s - re.optimizer_s);
                  const double fixed = std::min(before_sync, re.overhead_s + re.traffic_s);
                  bp.time_per_unit[d] =
                      std::max(bp.time_per_unit[d], std::max(before_sync - fixed, 1e-12) / per);
                  bp.fixed_time[d] = std::max(bp.fixed_time[d], fixed);
                  // Memory grows at most in proportion to the examples (a
                  // conservative bound above the even share).
                  bp.max_units[d] = std::min(
                      bp.max_units[d],
                      per * cluster.device(p.device_of(r)).memory_bytes /
                          std::max<double>(1.0, static_cast<double>(re.peak_memory_bytes)));
                }
                u.shape.batch_shares = round_shares(bp, lp(bp));
                dp_bp = bp;
                dp_lp = true;
                have = true;
              } else if (s.sh.pp > 1) {
                // Layers over the stages: a stage is as slow as its slowest rank.
                const std::vector<int64_t> even_layers = [&] {
                  std::vector<int64_t> v;
                  for (const StagePlan& st : p.stages)
                    v.push_back(static_cast<int64_t>(st.layers.size()));
                  return v;
                }();
                BalanceProblem bp;
                bp.total = units;
                bp.what = "layers";
                bp.min_units.assign(static_cast<size_t>(s.sh.pp), 1);
                bp.time_per_unit.assign(static_cast<size_t>(s.sh.pp), 0);
                for (int r = 0; r < world; ++r) {
                  const auto st = static_cast<size_t>(p.mesh.coord(r, "pp"));
                  const double per_layer =
                      est.ranks[static_cast<size_t>(r)].compute_s /
                      std::max<double>(1, static_cast<double>(even_layers[st]));
                  bp.time_per_unit[st] = std::max(bp.time_per_unit[st], per_layer);
                }
                u.shape.stage_layers = round_shares(bp, lp(bp));
                have = true;
              } else if (s.sh.tp > 1 && spec.kind == "gpt") {
                // Heads over the tensor ranks.
                BalanceProblem bp;
                bp.total = static_cast<double>(spec.heads);
                bp.what = "heads";
                bp.min_units.assign(static_cast<size_t>(s.sh.tp), 1);
                bp.time_per_unit.assign(static_cast<size_t>(s.sh.tp), 0);
                bp.fixed_time.assign(static_cast<size_t>(s.sh.tp), 0);
                const double per = static_cast<double>(spec.heads) / s.sh.tp;
                for (int r = 0; r < world; ++r) {
                  const auto t = static_cast<size_t>(p.mesh.coord(r, "tp"));
                  // The per-kernel time does not move with the heads (the
                  // weights' traffic does: a rank's weight shard is its heads').
                  const RankEstimate& re = est.ranks[static_cast<size_t>(r)];
                  const double fixed = std::min(re.compute_s, re.overhead_s);
                  bp.time_per_unit[t] =
                      std::max(bp.time_per_unit[t], std::max(re.compute_s - fixed, 1e-12) / per);
                  bp.fixed_time[t] = std::max(bp.fixed_time[t], fixed);
                }
                u.shape.tp_ratios = round_shares(bp, lp(bp));
                have = true;
              }
            } catch (const ConfigError& e) {
              sr.lp_error = std::string("uneven shares: ") + e.what();
            }
            const bool same = u.shape.batch_shares.empty() && u.shape.stage_layers.empty() &&
                              u.shape.tp_ratios.empty();
            if (have && !same) sr.uneven = price(u);
            if (dp_lp && sr.uneven && sr.uneven->kind == Priced::fits) {
              // The model's compute is not linear in a replica's examples
              // (kernels' bytes that do not shrink with the batch, the
              // per-kernel time): with two priced points per replica --
              // the even share and the LP's -- the secant gives each its
              // own a_i and constant b_i; solved again, the shares are
              // kept when they price a step >= 1% shorter (i12-model,
              // PlanSearch.LpSharesRefinedFromTwoPricedPoints).
              const StepEstimate& ue = sr.uneven->c.estimate;
              const auto replicas = static_cast<size_t>(s.sh.dp);
              std::vector<double> ce(replicas, 0), cu(replicas, 0);
              for (int r = 0; r < world; ++r) {
                const auto d = static_cast<size_t>(p.mesh.coord(r, "dp"));
                const RankEstimate& e0 = est.ranks[static_cast<size_t>(r)];
                const RankEstimate& e1 = ue.ranks[static_cast<size_t>(r)];
                ce[d] = std::max(ce[d], e0.compute_s - e0.optimizer_s);
                cu[d] = std::max(cu[d], e1.compute_s - e1.optimizer_s);
              }
              BalanceProblem bp2 = dp_bp;
              const double per = static_cast<double>(base.batch_size) / s.sh.dp;
              bool ok = true;
              for (size_t d = 0; d < replicas; ++d) {
                const double xu = static_cast<double>(u.shape.batch_shares[d]);
                if (std::abs(xu - per) < 0.5) continue;  // one point: keep the first a_i, b_i
                double a = (cu[d] - ce[d]) / (xu - per);
                double b = ce[d] - a * per;
                if (b < 0) b = 0, a = cu[d] / xu;
                ok = ok && a > 0;
                bp2.time_per_unit[d] = a;
                bp2.fixed_time[d] = b;
              }
              if (ok) {
                PlanCandidate u2 = u;
                try {
                  u2.shape.batch_shares = round_shares(bp2, lp(bp2));
                } catch (const ConfigError&) {
                  u2.shape.batch_shares = u.shape.batch_shares;  // keep the first shares
                }
                if (u2.shape.batch_shares != u.shape.batch_shares) {
                  Priced p2 = price(u2);
                  // At least 1% shorter: a smaller gain is one whole
                  // example moved between ranks within the model's own
                  // error (GPT [1,1,2,3] at batch 48: [17,17,8,6] ->
                  // [18,17,8,5] priced 0.05% shorter, measured 1.12 ->
                  // 1.23 compute spread, i12-model).
                  if (p2.kind == Priced::fits &&
                      p2.c.estimate.step_s < 0.99 * sr.uneven->c.estimate.step_s) {
                    sr.uneven = std::move(p2);
                  }
                }
              }
            }
          }
        }
        std::lock_guard<std::mutex> hold(progress_mutex);
        for (const std::optional<Priced>* q : {&sr.even, &sr.uneven}) {
          if (*q && (*q)->kind == Priced::fits &&
              (best_s == 0 || (*q)->c.estimate.step_s < best_s)) {
            best_s = (*q)->c.estimate.step_s;
          }
        }
        ++done;
        if (opt.progress) opt.progress(done, static_cast<int>(shapes.size()), best_s);
      }
    }
  };
  const int threads = std::max(
      1, std::min<int>(
             opt.threads > 0 ? opt.threads : static_cast<int>(std::thread::hardware_concurrency()),
             static_cast<int>(runs.size())));
  {
    std::vector<std::thread> pool;
    std::exception_ptr failed;
    std::mutex failed_mutex;
    for (int t = 1; t < threads; ++t) {
      pool.emplace_back([&] {
        try {
          work();
        } catch (...) {
          std::lock_guard<std::mutex> hold(failed_mutex);
          if (!failed) failed = std::current_exception();
          next = runs.size();
        }
      });
    }
    try {
      work();
    } catch (...) {
      std::lock_guard<std::mutex> hold(failed_mutex);
      if (!failed) failed = std::current_exception();
      next = runs.size();
    }
    for (std::thread& t : pool) t.join();
    if (failed) std::rethrow_exception(failed);
  }

  // Recorded in shape order.
  SearchResult res;
  std::vector<PlanCandidate> fits;
  std::set<std::string> reasons;
  auto record = [&](Priced& q) {
    ++res.candidates;
    switch (q.kind) {
      case Priced::refused:
        ++res.refused;
        if (reasons.size() < 8) reasons.insert(q.why);
        return;
      case Priced::unpriced:
        ++res.unpriced;
        if (res.unpriced_reasons.size() < 4) res.unpriced_reasons.push_back(q.why);
        return;
      case Priced::over: {
        ++res.over_memory;
        const int64_t need = q.c.estimate.ranks[static_cast<size_t>(q.worst)].peak_memory_bytes;
        const int device = q.c.plan.device_of(q.worst);  // the world rank (mesh rank q.worst)
        const auto have = static_cast<int64_t>(cluster.device(device).memory_bytes);
        if (!res.closest || res.closest->lower_bound ||
            need - have < res.closest->need_bytes - res.closest->have_bytes) {
          res.closest = SearchResult::Miss{q.c.describe(), device, need, have, false};
        }
        return;
      }
      case Priced::fits:
        ++res.fitting;
        if (q.bounded) {
          ++res.not_simulated;
          return;
        }
        fits.push_back(std::move(q.c));
        return;
    }
  };
  for (size_t i = 0; i < shapes.size(); ++i) {
    ShapeResult& sr = results[i];
    if (sr.dominated && sr.bound <= max_memory) {
      ++res.candidates, ++res.dominated;
      continue;
    }
    if (sr.bound > max_memory) {
      const Shape& s = shapes[i];
      ++res.candidates, ++res.over_memory, ++res.pruned;
      PlanCandidate c;
      c.shape = s.sh, c.zero_stage = s.zero, c.recompute = s.recompute;
      const auto need = static_cast<int64_t>(sr.bound);
      const auto have = static_cast<int64_t>(max_memory);
      if (!res.closest || (res.closest->lower_bound &&
                           need - have < res.closest->need_bytes - res.closest->have_bytes)) {
        res.closest = SearchResult::Miss{c.describe(), 0, need, have, true};
      }
      continue;
    }
    record(*sr.even);
    if (!sr.lp_error.empty()) {
      ++res.candidates, ++res.refused;
      if (reasons.size() < 8) reasons.insert(sr.lp_error);
    }
    if (sr.uneven) record(*sr.uneven);
  }
  // Recomputation that changes neither the predicted step nor any rank's
  // memory (e.g. where the runtime does not apply it) is not a plan of its own.
  {
    std::map<std::string, const PlanCandidate*> plain;
    for (const PlanCandidate& c : fits) {
      if (!c.recompute) plain[c.describe()] = &c;
    }
    std::vector<PlanCandidate> kept;
    for (PlanCandidate& c : fits) {
      if (c.recompute) {
        PlanCandidate twin = c;
        twin.recompute = false;
        const auto it = plain.find(twin.describe());
        auto same = [](double a, double b) { return std::abs(a - b) <= 1e-9 * std::max(a, b); };
        if (it != plain.end() && same(it->second->estimate.step_s, c.estimate.step_s) &&
            same(static_cast<double>(it->second->estimate.max_peak_memory_bytes()),
                 static_cast<double>(c.estimate.max_peak_memory_bytes()))) {
          ++res.no_effect;
          continue;
        }
      }
      kept.push_back(std::move(c));
    }
    fits = std::move(kept);
  }
  std::stable_sort(fits.begin(), fits.end(), [](const PlanCandidate& a, const PlanCandidate& b) {
    if (a.estimate.step_s != b.estimate.step_s) return a.estimate.step_s < b.estimate.step_s;
    return a.describe() < b.describe();
  });
  if (static_cast<int>(fits.size()) > opt.top) fits.resize(static_cast<size_t>(opt.top));
  res.best = std::move(fits);
  res.refusals.assign(reasons.begin(), reasons.end());
  return res;
}

std::string nothing_fits_message(const SearchResult& r, const ClusterModel& cluster) {
  std::string s = fmt::format(
      "no plan fits: of {} plans tried, {} exceed device memory and {} "
      "the runtime would refuse",
      r.candidates, r.over_memory, r.refused);
  if (r.closest && r.closest->lower_bound) {
    s += fmt::format(
        "; the closest ({}) needs at least {} per rank for its parameters, gradients and optimizer "
        "state alone, "
        "the largest device has {}: {} over",
        r.closest->plan, format_bytes(r.closest->need_bytes), format_bytes(r.closest->have_bytes),
        format_bytes(r.closest->need_bytes - r.closest->have_bytes));
  } else if (r.closest) {
    const DeviceKind& k = cluster.device(r.closest->rank);
    s += fmt::format("; the closest ({}) needs {} on rank {} ({}, {} of memory): {} over",
                     r.closest->plan, format_bytes(r.closest->need_bytes), r.closest->rank, k.name,
                     format_bytes(r.closest->have_bytes),
                     format_bytes(r.closest->need_bytes - r.closest->have_bytes));
  }
  if (!r.refusals.empty()) s += fmt::format("; refused: {}", r.refusals.front());
  return s;
}

}  // namespace mt::planner
