// `meshtrain simulate`: a plan (--plan, or the config's [parallel]) on a
// cluster file through the planner's cost model and discrete-event
// simulator (planner/simulator.h): predicted step time, throughput, MFU,
// per-rank compute / communication / idle, peak memory and bytes, and
// optionally a Chrome trace in the runtime's --trace format.
#include <algorithm>
#include <chrono>

#include <fmt/format.h>

#include "meshtrain/base/error.h"
#include "meshtrain/cli/cluster_file.h"
#include "meshtrain/cli/commands.h"
#include "meshtrain/cli/run_config.h"
#include "meshtrain/planner/simulator.h"
#include "meshtrain/train/training_plan.h"

namespace mt {

namespace {

std::string seconds(double s) {
  if (s >= 1) return fmt::format("{:.3f} s", s);
  if (s >= 1e-3) return fmt::format("{:.3f} ms", s * 1e3);
  return fmt::format("{:.1f} us", s * 1e6);
}

}  // namespace

int cmd_simulate(const CommandOptions& opts) {
  const auto t0 = std::chrono::steady_clock::now();
  RunConfig rc = load_command_config(opts);
  const ClusterFile file = read_cluster_file(opts.cluster_path);
  // The world: the cluster file's ranks; a node_size file has none of its
  // own, so the plan's mesh (or dist.nproc) sizes it.
  int world = file.ranks();
  if (world == 0)
    world = !opts.plan_path.empty() ? load_plan(opts.plan_path).mesh.size() : rc.nproc;
  const std::optional<Plan> plan = command_plan(opts, rc, world);
  if (plan) {
    plan->mesh.check_world(world, fmt::format("the plan's mesh (cluster file {} has {} ranks)",
                                              opts.cluster_path, world));
    rc.train.dist.plan = std::make_shared<const Plan>(*plan);
  }
  planner::ClusterModel cluster = cluster_model(file, world);
  if (cluster.slowdown.empty() && !rc.train.dist.slowdown.empty()) {
    if (static_cast<int>(rc.train.dist.slowdown.size()) != world) {
      throw ConfigError(fmt::format("dist.slowdown: {} factors for {} ranks",
                                    rc.train.dist.slowdown.size(), world));
    }
    cluster.slowdown = rc.train.dist.slowdown;
  }
  // Ranks numbered by the plan's mesh: the plan's devices pick which world
  // rank (device) runs each mesh rank.
  if (plan && !plan->devices_in_order()) cluster = planner::arrange_cluster(cluster, plan->devices);
  planner::SimulationOptions so;
  so.trace_path = opts.trace_path;
  const planner::Programs programs = planner::build_programs(rc.model, rc.train, cluster);
  const auto t1 = std::chrono::steady_clock::now();
  const planner::StepEstimate e = planner::simulate(programs, cluster, so);
  const auto t2 = std::chrono::steady_clock::now();
  const double build_s = std::chrono::duration<double>(t1 - t0).count();
  const double sim_s = std::chrono::duration<double>(t2 - t1).count();

  fmt::print("plan: {} on {} ranks ({}); cluster: {}\n",
             plan ? (opts.plan_path.empty() ? std::string("[parallel]") : opts.plan_path)
                  : std::string("data parallelism"),
             world, plan ? plan->mesh.describe() : fmt::format("dp={}", world), cluster.source);
  fmt::print("model: {}, global batch {}, precision {}\n", rc.model.kind, rc.train.batch_size,
             dtype_name(rc.train.precision));
  fmt::print("predicted step time: {}\n", seconds(e.step_s));
  fmt::print("throughput: {:.1f} samples/s", e.samples_per_s);
  if (rc.model.kind == "gpt") {
    fmt::print(", {:.0f} tokens/s", e.samples_per_s * static_cast<double>(rc.model.seq_len));
  }
  fmt::print("\nMFU: {:.1f}% (model FLOPs / (step time x the ranks' peak FLOP/s))\n", e.mfu * 100);
  fmt::print("distinct rank programs: {} (of {} ranks)\n", e.distinct_programs, world);
  // One line per distinct program (its first rank's figures; its ranks
  // differ only in waiting for others), at most 32.
  fmt::print(
      "per program (first rank shown): ranks / compute / comm (all lanes) / idle / "
      "utilisation / peak memory / sent per step\n");
  std::vector<std::vector<int>> members(programs.programs.size());
  for (int r = 0; r < world; ++r) {
    members[static_cast<size_t>(programs.ranks[static_cast<size_t>(r)].program)].push_back(r);
  }
  const size_t shown = std::min<size_t>(members.size(), 32);
  for (size_t pi = 0; pi < shown; ++pi) {
    const int r = members[pi].front();
    const planner::RankEstimate& x = e.ranks[static_cast<size_t>(r)];
    const double mem = cluster.device(r).memory_bytes;
    const std::string who = members[pi].size() == 1
                                ? fmt::format("rank {}", r)
                                : fmt::format("rank {} +{}", r, members[pi].size() - 1);
    fmt::print("  {:<14} {:>10} {:>10} {:>10} {:>5.1f}% {:>10}{} {:>10}\n", who,
               seconds(x.compute_s), seconds(x.comm_s), seconds(x.idle_s), x.utilisation * 100,
               format_bytes(x.peak_memory_bytes),
               mem > 0 && static_cast<double>(x.peak_memory_bytes) > mem ? " (over memory!)" : "",
               format_bytes(static_cast<int64_t>(x.bytes_sent)));
  }
  if (shown < members.size()) fmt::print("  ... ({} more programs)\n", members.size() - shown);
  int over = 0;
  for (int r = 0; r < world; ++r) {
    const double mem = cluster.device(r).memory_bytes;
    if (mem > 0 && static_cast<double>(e.ranks[static_cast<size_t>(r)].peak_memory_bytes) > mem) {
      ++over;
    }
  }
  fmt::print("max peak memory {} ; max sent per step {}{}\n",
             format_bytes(e.max_peak_memory_bytes()),
             format_bytes(static_cast<int64_t>(e.max_bytes_sent())),
             over > 0 ? fmt::format("; {} ranks need more memory than their device has", over)
                      : std::string());
  for (const std::string& n : e.notes) fmt::print("note: {}\n", n);
  fmt::print("built the programs in {:.2f} s, simulated in {:.2f} s\n", build_s, sim_s);
  if (!opts.trace_path.empty()) {
    fmt::print("wrote the predicted timeline to {} (first {} ranks)\n", opts.trace_path,
               std::min(world, so.trace_ranks));
  }
  return 0;
}

}  // namespace mt
