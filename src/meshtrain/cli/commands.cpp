#include "meshtrain/cli/commands.h"

#include <fmt/format.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <functional>
#include <thread>

#include "meshtrain/base/plural.h"
#include "meshtrain/cli/config.h"
#include "meshtrain/cli/launch.h"
#include "meshtrain/cli/run_config.h"
#include "meshtrain/comm/backends/mpi/mpi_communicator.h"
#include "meshtrain/exec/executor.h"
#include "meshtrain/graph/autodiff.h"
#include "meshtrain/graph/cost.h"
#include "meshtrain/graph/print.h"
#include "meshtrain/train/trainer.h"

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

RunConfig load(const CommandOptions& opts) {
  Config c = Config::load(opts.config_path);
  c.set_all(opts.overrides);
  return read_run_config(c);
}
}  // namespace

int cmd_train(const CommandOptions& opts, int argc, char** argv) {
  RunConfig rc = load(opts);
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
  if (!opts.tensorboard_dir.empty()) rc.train.tensorboard_dir = opts.tensorboard_dir;
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

  auto train_data = open_dataset(rc.data, rc.model, DataSplit::train);
  auto test_data = open_dataset(rc.data, rc.model, DataSplit::test);
  if (!opts.quiet && leader) {
    fmt::print(stderr, "meshtrain: training {} on {} ({}, ZeRO stage {}, {}, {})\n", rc.model.kind,
               train_data->describe(), plural(comm ? comm->size() : 1, "rank"),
               rc.train.dist.dp.stage, plural(rc.train.threads, "thread"),
               dtype_name(rc.train.precision));
  }
  Trainer trainer(rc.model, train_data, test_data, rc.train, comm.get());
  TrainResult r = trainer.run();
  if (!leader) return 0;
  if (r.tokens_per_s > 0) {
    fmt::print("steps {}  final loss {:.4f}  {:.0f} samples/s, {:.0f} tokens/s (median)\n", r.steps,
               r.final_loss, r.samples_per_s, r.tokens_per_s);
  } else {
    fmt::print("steps {}  final loss {:.4f}  {:.0f} samples/s (median)\n", r.steps, r.final_loss,
               r.samples_per_s);
  }
  if (rc.train.eval) {
    fmt::print("final test accuracy: {:.2f}%  (test loss {:.4f})\n", 100.0 * r.test_accuracy,
               r.test_loss);
  }
  if (!rc.train.checkpoint_path.empty()) fmt::print("checkpoint: {}\n", rc.train.checkpoint_path);
  return 0;
}

int cmd_inspect(const CommandOptions& opts) {
  RunConfig rc = load(opts);
  ModelSpec spec = rc.model;
  spec.compute = rc.train.precision;
  ModelGraph m = build_model(spec, rc.train.batch_size);
  build_backward(m.graph, m.loss);
  fmt::print("{}", describe(m.graph));
  Executor ex(m.graph, rc.train.exec);
  const MemoryPlan& plan = ex.memory_plan();
  const OpCost cost = graph_cost(m.graph);
  fmt::print("\nparameters: {} ({})\n", m.graph.param_count(),
             human_count(static_cast<double>(m.graph.param_count()) * 4, "B"));
  fmt::print("FLOPs per training step (forward + backward): {}\n", human_count(cost.flops, "FLOP"));
  fmt::print("planned peak activation memory: {} (without reuse: {})\n",
             human_count(static_cast<double>(plan.arena_bytes), "B"),
             human_count(static_cast<double>(plan.unplanned_bytes), "B"));
  fmt::print("parameters + gradients: {} + {}\n",
             human_count(static_cast<double>(m.graph.param_count()) * 4, "B"),
             human_count(static_cast<double>(m.graph.param_count()) * 4, "B"));
  return 0;
}

}  // namespace mt
