#include "meshtrain/cli/commands.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <thread>

#include "meshtrain/cli/config.h"
#include "meshtrain/cli/config_keys.h"
#include "meshtrain/cli/launch.h"
#include "meshtrain/cli/run_config.h"
#include "meshtrain/comm/backends/mpi/mpi_communicator.h"
#include "meshtrain/exec/executor.h"
#include "meshtrain/graph/autodiff.h"
#include "meshtrain/graph/cost.h"
#include "meshtrain/graph/print.h"
#include "meshtrain/train/trainer.h"
#include "meshtrain/train/training_plan.h"

namespace mt {

namespace {

// Parses "kill:RANK@STEP" / "stall:RANK@STEP" into an after-step callback
// that makes that rank die (SIGKILL, as a crashed node would) or hang.
std::function<void(int64_t, int)> fault_drill(const std::string& spec) {
  const auto colon = spec.find(':'), at = spec.find('@');
  std::string kind = spec.substr(0, colon);
  int victim = -1;
  int64_t when = -1;
  try {
    if (colon != std::string::npos && at != std::string::npos && at > colon) {
      victim = std::stoi(spec.substr(colon + 1, at - colon - 1));
      when = std::stoll(spec.substr(at + 1));
    }
  } catch (const std::exception&) {
  }
  if ((kind != "kill" && kind != "stall") || victim < 0 || when < 0) {
    throw ConfigError(fmt::format(
        "dist.fault: expected \"kill:RANK@STEP\" or \"stall:RANK@STEP\", got \"{}\"", spec));
  }
  return [kind, victim, when](int64_t step, int rank) {
    if (rank != victim || step != when) return;
    fmt::print(stderr, "meshtrain: fault drill: rank {} {} after step {}\n", rank,
               kind == "kill" ? "dies" : "stalls", step);
    std::fflush(stderr);
    if (kind == "kill") raise(SIGKILL);
    for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
  };
}

// The run's configuration. `effective` gets the --print-config text;
// `empty` says the file held no keys, which is worth a notice: a wrong or
// truncated file would otherwise train on defaults without a word.
RunConfig load(const CommandOptions& opts, std::string* effective = nullptr,
               bool* empty = nullptr) {
  Config c = Config::load(opts.config_path);
  c.set_all(opts.overrides);
  RunConfig rc = read_run_config(c);
  if (effective != nullptr) *effective = format_effective_config(c);
  if (empty != nullptr) *empty = c.source_empty();
  return rc;
}

// Ranks of this job on this machine (from the MPI launcher's environment).
int64_t local_ranks() {
  for (const char* name :
       {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"}) {
    if (const char* v = std::getenv(name)) {
      try {
        const int64_t n = std::stoll(v);
        if (n > 0) return n;
      } catch (const std::exception&) {
      }
    }
  }
  return 1;
}

void empty_notice(const CommandOptions& opts) {
  fmt::print(stderr,
             "meshtrain: config {} is empty: every key takes its default (meshtrain config "
             "--list shows them)\n",
             opts.config_path);
}
}  // namespace

std::optional<std::string> unknown_command_message(std::string_view arg,
                                                   const std::vector<std::string>& commands) {
  if (arg.empty() || arg.front() == '-') return std::nullopt;
  if (std::find(commands.begin(), commands.end(), arg) != commands.end()) return std::nullopt;
  std::string guess;
  size_t best = std::max<size_t>(2, arg.size() / 3) + 1;
  for (const std::string& c : commands) {
    const size_t d = edit_distance(arg, c);
    if (d < best) {
      best = d;
      guess = c;
    }
  }
  return fmt::format("unknown command '{}'{}; commands: {}", arg,
                     guess.empty() ? "" : fmt::format(" (did you mean '{}'?)", guess),
                     fmt::join(commands, ", "));
}

int cmd_config_list(bool markdown) {
  fmt::print("{}", markdown ? format_key_markdown() : format_key_list());
  return 0;
}

int cmd_train(const CommandOptions& opts, int argc, char** argv) {
  std::string effective;
  bool empty = false;
  RunConfig rc = load(opts, &effective, &empty);
  if (opts.print_config) {
    fmt::print("{}", effective);
    return 0;
  }
  const int nproc = opts.nproc > 0 ? opts.nproc : rc.nproc;
  if (nproc > 1 && !launched_by_mpi()) {
    std::vector<std::string> args;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--nproc") {
        ++i;  // skip its value
      } else if (a.rfind("--nproc=", 0) != 0) {
        args.push_back(a);
      }
    }
    relaunch_under_mpirun(nproc, args);
  }
  if (!opts.metrics_path.empty()) rc.train.metrics_path = opts.metrics_path;
  if (!opts.trace_path.empty()) rc.train.dist.trace_path = opts.trace_path;
  rc.train.progress = !opts.quiet;

  // Under an MPI launcher every process is one data-parallel rank.
  std::unique_ptr<Communicator> comm;
  if (launched_by_mpi()) {
    CommOptions co;
    co.timeout = std::chrono::milliseconds(rc.timeout_s * 1000);
    co.on_stall = [](const std::string& report) {
      fmt::print(stderr, "meshtrain: stall: {}\n", report);
    };
    comm = make_mpi_communicator(co);
  }
  const bool leader = comm == nullptr || comm->rank() == 0;
  if (!rc.fault.empty()) rc.train.dist.after_step = fault_drill(rc.fault);
  if (!leader) rc.train.progress = false;
  if (empty && leader) empty_notice(opts);

  // Every rank on this machine plans to fit its share of what is free now.
  rc.train.memory_limit = available_memory_bytes() / local_ranks();

  auto train_data = open_dataset(rc.data, rc.model, DataSplit::train);
  auto test_data = open_dataset(rc.data, rc.model, DataSplit::test);
  if (!opts.quiet && leader) {
    fmt::print(stderr, "meshtrain: training {} on {} ({} rank{}, ZeRO stage {}, {} threads, {})\n",
               rc.model.kind, train_data->describe(), comm ? comm->size() : 1,
               comm && comm->size() > 1 ? "s" : "", rc.train.dist.dp.stage, rc.train.threads,
               dtype_name(rc.train.precision));
  }
  Trainer trainer(rc.model, train_data, test_data, rc.train, comm.get());
  TrainResult r = trainer.run();
  if (!leader) return 0;
  fmt::print("steps {}  final loss {:.4f}  {:.0f} samples/s (median)\n", r.steps, r.final_loss,
             r.samples_per_s);
  if (rc.train.eval) {
    fmt::print("final test accuracy: {:.2f}%  (test loss {:.4f})\n", 100.0 * r.test_accuracy,
               r.test_loss);
  }
  if (!rc.train.checkpoint_path.empty()) fmt::print("checkpoint: {}\n", rc.train.checkpoint_path);
  return 0;
}

int cmd_inspect(const CommandOptions& opts) {
  std::string effective;
  bool empty = false;
  RunConfig rc = load(opts, &effective, &empty);
  if (opts.print_config) {
    fmt::print("{}", effective);
    return 0;
  }
  if (empty) empty_notice(opts);
  // The graph, options and memory plan rank 0 of a run of this config gets
  // (train/training_plan.h, the code the Trainer uses), at dist.nproc ranks.
  const int world = rc.nproc;
  const BatchSplit split = split_batch(rc.train, 0, world);
  const TrainingGraph tg = build_training_graph(rc.model, rc.train, split.micro_batch);
  const TrainingPlan plan = plan_training(tg, rc.model, rc.train, split, 0, world);
  const Graph& g = tg.model.graph;
  fmt::print("{}", describe(g));
  const OpCost cost = graph_cost(g);
  const int k = rc.train.dist.dp.accumulation_steps;
  fmt::print("\nparameters: {} ({})\n", g.param_count(),
             human_count(static_cast<double>(g.param_count()) * 4, "B"));
  fmt::print(
      "FLOPs per training step (forward + backward): {} per rank ({} micro-step{} of {} "
      "examples)\n",
      human_count(cost.flops * k, "FLOP"), k, k == 1 ? "" : "s", split.micro_batch);
  fmt::print("planned peak activation memory: {} ({} bytes; without reuse: {})\n",
             format_bytes(plan.activations.arena_bytes), plan.activations.arena_bytes,
             format_bytes(plan.activations.unplanned_bytes));
  fmt::print("{}", plan.describe());
  const int64_t avail = available_memory_bytes();
  const int64_t mine = avail / (world > 1 ? world : 1);
  fmt::print("available memory: {}{} -> {}\n", format_bytes(avail),
             world > 1 ? fmt::format(" / {} local ranks", world) : "",
             plan.total_bytes() <= mine ? "fits" : "does NOT fit (meshtrain train will refuse)");
  return 0;
}

}  // namespace mt
