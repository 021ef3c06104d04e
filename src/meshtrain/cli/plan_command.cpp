// `meshtrain plan --config model.toml --cluster cluster.toml [--top K]
// [--out plan.json]`: the plan search (planner/search.h) for the config's
// model on the cluster file's ranks; prints the best plans and writes the
// first as a plan file `meshtrain train --plan` runs (docs/planner-search.md).
#include <unistd.h>

#include <chrono>
#include <set>

#include "meshtrain/base/error.h"
#include "meshtrain/cli/cluster_file.h"
#include "meshtrain/cli/commands.h"
#include "meshtrain/cli/config.h"
#include "meshtrain/cli/run_config.h"
#include "meshtrain/planner/search.h"
#include "meshtrain/train/training_plan.h"

namespace mt {

namespace {

std::string seconds(double s) {
  if (s >= 1) return fmt::format("{:.3f} s", s);
  if (s >= 1e-3) return fmt::format("{:.2f} ms", s * 1e3);
  return fmt::format("{:.1f} us", s * 1e6);
}

// "a100_80gb x16, v100_32gb x16"
std::string kinds_line(const planner::ClusterModel& c) {
  std::map<int, int> count;
  for (int k : c.kind_of) ++count[k];
  std::string s;
  for (const auto& [k, n] : count) {
    s += fmt::format("{}{} x{}", s.empty() ? "" : ", ", c.kinds[static_cast<size_t>(k)].name, n);
  }
  return s;
}

}  // namespace

int cmd_plan(const CommandOptions& opts) {
  Config c = Config::load(opts.config_path);
  c.set_all(opts.overrides);
  const RunConfig rc = read_run_config(c);
  if (rc.model.kind != "mlp" && rc.model.kind != "cnn" && rc.model.kind != "gpt") {
    throw ConfigError(
        fmt::format("model.kind: meshtrain plan searches plans for mlp, cnn and gpt "
                    "(the kinds [parallel] expands), got {}",
                    rc.model.kind));
  }
  const ClusterFile file = read_cluster_file(opts.cluster_path);
  const int world = opts.nproc > 0 ? opts.nproc : (file.ranks() > 0 ? 0 : rc.nproc);
  planner::ClusterModel cluster = cluster_model(file, world);
  // dist.slowdown stands in for the file's ranks.slowdown (as for simulate).
  if (cluster.slowdown.empty() && !rc.train.dist.slowdown.empty()) {
    if (static_cast<int>(rc.train.dist.slowdown.size()) != cluster.world()) {
      throw ConfigError(fmt::format("dist.slowdown: {} factors for the cluster's {} ranks",
                                    rc.train.dist.slowdown.size(), cluster.world()));
    }
    cluster.slowdown = rc.train.dist.slowdown;
  }

  planner::SearchOptions so;
  so.top = opts.top;
  so.threads = opts.plan_threads;
  const bool tty = isatty(STDERR_FILENO) != 0;
  auto last = std::chrono::steady_clock::now();
  so.progress = [&](int done, int total, double best) {
    if (opts.quiet) return;
    const auto now = std::chrono::steady_clock::now();
    if (done < total && now - last < std::chrono::seconds(1)) return;
    last = now;
    const std::string line =
        fmt::format("meshtrain plan: {}/{} shapes priced, best so far {}", done, total,
                    best > 0 ? seconds(best) + " per step" : std::string("none fits yet"));
    if (tty) {
      fmt::print(stderr, "\r{}{}", line, done == total ? "\n" : "");
    } else {
      fmt::print(stderr, "{}\n", line);
    }
  };
  const planner::SearchResult r = planner::search_plans(rc.model, rc.train, cluster, so);
  if (r.best.empty()) throw ConfigError(planner::nothing_fits_message(r, cluster));

  fmt::print("{} (batch {}) on {} ranks of {} ({} nodes; {})\n", rc.model.kind, rc.train.batch_size,
             cluster.world(), opts.cluster_path, cluster.layout.nodes(), kinds_line(cluster));
  fmt::print(
      "{} plans: {} fit in memory, {} over memory ({} of them by their parameters alone, "
      "not priced), {} refused{}{}\n",
      r.candidates, r.fitting, r.over_memory, r.pruned, r.refused,
      r.not_simulated > 0
          ? fmt::format(", {} of the fitting slower than the best {} by a bound (not simulated)",
                        r.not_simulated, so.top)
          : std::string(),
      r.dominated > 0
          ? fmt::format(", {} not priced (a twin without recomputation or ZeRO fits)", r.dominated)
          : std::string());
  for (const std::string& why : r.refusals) fmt::print("  refused, e.g.: {}\n", why);
  if (r.unpriced > 0) {
    fmt::print("{} plans the cost model could not price (not proposed):\n", r.unpriced);
    for (const std::string& why : r.unpriced_reasons) fmt::print("  {}\n", why);
  }
  fmt::print("\n");
  fmt::print("{:>2}  {:>10}  {:>10}  {:>5}  {:>22}  {:>14}  {}\n", "#", "step", "samples/s", "MFU",
             "peak memory / device", "sent / device", "plan");
  for (size_t i = 0; i < r.best.size(); ++i) {
    const planner::PlanCandidate& p = r.best[i];
    int worst = 0;  // the (mesh) rank with the least headroom, on its device
    double headroom = 1e300;
    for (int k = 0; k < cluster.world(); ++k) {
      const double h =
          cluster.device(p.plan.device_of(k)).memory_bytes -
          static_cast<double>(p.estimate.ranks[static_cast<size_t>(k)].peak_memory_bytes);
      if (h < headroom) headroom = h, worst = k;
    }
    const int64_t peak = p.estimate.ranks[static_cast<size_t>(worst)].peak_memory_bytes;
    fmt::print("{:>2}  {:>10}  {:>10.1f}  {:>4.1f}%  {:>22}  {:>14}  {}\n", i + 1,
               seconds(p.estimate.step_s), p.estimate.samples_per_s, p.estimate.mfu * 100,
               fmt::format("{} of {}", format_bytes(peak),
                           format_bytes(static_cast<int64_t>(
                               cluster.device(p.plan.device_of(worst)).memory_bytes))),
               format_bytes(static_cast<int64_t>(p.estimate.max_bytes_sent())), p.describe());
  }
  const planner::PlanCandidate& fastest = r.best.front();
  std::set<std::string> notes(fastest.estimate.notes.begin(), fastest.estimate.notes.end());
  for (const std::string& n : notes) fmt::print("note: {}\n", n);
  const planner::PlanCandidate& best = fastest;
  if (!best.devices.empty()) {
    fmt::print(
        "devices ({}): mesh rank m runs on world rank [{}][m] (the plan file's \"devices\")\n",
        best.device_order, fmt::join(best.devices, ","));
  }
  const std::string out = opts.plan_out.empty() ? std::string("plan.json") : opts.plan_out;
  write_plan(best.plan, out);
  std::string sets;
  for (const std::string& s : best.settings(cluster.world())) sets += " --set " + s;
  fmt::print(
      "\nwrote the best plan to {}; run it with:\n  meshtrain train --config {} --plan {}{}\n", out,
      opts.config_path, out, sets);
  return 0;
}

}  // namespace mt
