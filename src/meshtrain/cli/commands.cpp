#include "meshtrain/cli/commands.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <thread>

#include "meshtrain/base/plural.h"
#include "meshtrain/cli/config.h"
#include "meshtrain/cli/config_keys.h"
#include "meshtrain/cli/launch.h"
#include "meshtrain/cli/run_config.h"
#include "meshtrain/comm/backends/mpi/mpi_communicator.h"
#include "meshtrain/comm/launch_env.h"
#include "meshtrain/comm/probe.h"
#include "meshtrain/data/loader.h"
#include "meshtrain/exec/executor.h"
#include "meshtrain/graph/autodiff.h"
#include "meshtrain/graph/cost.h"
#include "meshtrain/graph/print.h"
#include "meshtrain/spmd/cross_mesh.h"
#include "meshtrain/spmd/lower.h"
#include "meshtrain/spmd/pipeline_stage.h"
#include "meshtrain/spmd/plan.h"
#include "meshtrain/spmd/shorthand.h"
#include "meshtrain/tensor/machine.h"
#include "meshtrain/train/full_graph.h"
#include "meshtrain/train/graph_file.h"
#include "meshtrain/train/graph_parallel.h"
#include "meshtrain/train/layer_pipeline.h"
#include "meshtrain/train/pipeline_training.h"
#include "meshtrain/train/trainer.h"
#include "meshtrain/train/training_plan.h"

namespace mt {

namespace {

struct FaultSpec {
  std::string kind;  // "kill" or "stall"
  int victim = -1;
  int64_t when = -1;
};

// Parses "kill:RANK@STEP" / "stall:RANK@STEP" (dist.fault).
FaultSpec parse_fault(const std::string& spec) {
  const auto colon = spec.find(':'), at = spec.find('@');
  FaultSpec f;
  f.kind = spec.substr(0, colon);
  try {
    if (colon != std::string::npos && at != std::string::npos && at > colon) {
      size_t used_rank = 0, used_step = 0;
      const std::string rank_text = spec.substr(colon + 1, at - colon - 1);
      const std::string step_text = spec.substr(at + 1);
      f.victim = std::stoi(rank_text, &used_rank);
      f.when = std::stoll(step_text, &used_step);
      if (used_rank != rank_text.size() || used_step != step_text.size()) f.victim = -1;
    }
  } catch (const std::exception&) {
    f.victim = -1;
  }
  if ((f.kind != "kill" && f.kind != "stall") || f.victim < 0 || f.when < 0) {
    throw ConfigError(fmt::format(
        "dist.fault: expected \"kill:RANK@STEP\" or \"stall:RANK@STEP\", got \"{}\"", spec));
  }
  return f;
}

// The keys whose values depend on the number of ranks, checked against it:
// by the launcher before any rank starts, and by every rank against its
// communicator (under mpirun / srun).
// dp_world: the data-parallel ranks the batch is shared by (the world, or
// the plan's dp axis under tensor parallelism).
void check_world(const RunConfig& rc, int world, int dp_world) {
  // The cluster file's nodes must cover the job's ranks, its slowdown list
  // have one factor per rank (checked before dist.slowdown, which it fills).
  if (rc.cluster) resolve_cluster(*rc.cluster, world);
  const auto& shares = rc.train.dist.batch_shares;
  if (!shares.empty() && static_cast<int64_t>(shares.size()) != dp_world) {
    throw ConfigError(fmt::format(
        "dist.batch_shares: {} shares [{}] given for {} {}rank{} (one share per {}rank)",
        shares.size(), fmt::join(shares, ", "), dp_world, dp_world == world ? "" : "data-parallel ",
        dp_world == 1 ? "" : "s", dp_world == world ? "" : "data-parallel "));
  }
  const auto& slow = rc.train.dist.slowdown;
  if (!slow.empty() && static_cast<int64_t>(slow.size()) != world) {
    throw ConfigError(
        fmt::format("dist.slowdown: {} factors [{}] given for {} rank{} (one factor per rank)",
                    slow.size(), fmt::join(slow, ", "), world, world == 1 ? "" : "s"));
  }
  if (!rc.fault.empty()) {
    const FaultSpec f = parse_fault(rc.fault);
    if (f.victim >= world) {
      throw ConfigError(
          fmt::format("dist.fault: \"{}\" names rank {}, but the job has {} rank{} "
                      "(0..{})",
                      rc.fault, f.victim, world, world == 1 ? "" : "s", world - 1));
    }
  }
}

// An after-step callback that makes the drill's rank die (SIGKILL, as a
// crashed node would) or hang.
std::function<void(int64_t, int)> fault_drill(const std::string& spec) {
  const FaultSpec f = parse_fault(spec);
  return [kind = f.kind, victim = f.victim, when = f.when](int64_t step, int rank) {
    if (rank != victim || step != when) return;
    fmt::print(stderr, "meshtrain: fault drill: rank {} {} after step {}\n", rank,
               kind == "kill" ? "dies" : "stalls", step);
    std::fflush(stderr);
    if (kind == "kill") raise(SIGKILL);
    for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
  };
}

// What train.init loaded; with train.init_partial, also what it skipped and
// left at its initial values (always shown: a partial load is a choice the
// user should see the consequences of).
void print_init_report(const TorchLoadReport& r) {
  if (!r.assumed.empty()) fmt::print(stderr, "meshtrain: note: {}\n", r.assumed);
  fmt::print(stderr, "meshtrain: initialised {} tensor{} ({} values) from {}\n", r.loaded.size(),
             r.loaded.size() == 1 ? "" : "s", r.elements, r.path);
  if (!r.skipped.empty()) {
    fmt::print(stderr, "meshtrain: skipped {} tensor{} of the file:\n", r.skipped.size(),
               r.skipped.size() == 1 ? "" : "s");
    for (const std::string& s : r.skipped) fmt::print(stderr, "  {}\n", s);
  }
  if (!r.left_at_init.empty()) {
    fmt::print(stderr, "meshtrain: left at their initial values ({}):\n", r.left_at_init.size());
    for (const std::string& s : r.left_at_init) fmt::print(stderr, "  {}\n", s);
  }
}

// A failed multi-rank run's communicator, left undestroyed (see cmd_train).
Communicator* abandoned_communicator = nullptr;

// SIGINT / SIGTERM during training: the first one asks the trainer to stop
// after the current step and write its checkpoint (TrainerOptions::
// stop_signal); a second one ends the process at once, as the default
// action would.
std::atomic<int> g_stop_signal{0};
static_assert(std::atomic<int>::is_always_lock_free, "read from a signal handler");

extern "C" void on_stop_signal(int sig) {
  if (g_stop_signal.load() != 0) {
    ::signal(sig, SIG_DFL);  // both async-signal-safe
    ::raise(sig);
    return;
  }
  g_stop_signal.store(sig);
}

void install_stop_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // file and MPI calls carry on; the trainer polls the flag
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

std::string signal_name(int sig) {
  if (sig == SIGINT) return "SIGINT";
  if (sig == SIGTERM) return "SIGTERM";
  return fmt::format("signal {}", sig);
}

// The end-of-run lines. A value this invocation did not measure prints as
// "n/a" with the reason, never as 0.
void print_summary(const TrainResult& r, const TrainerOptions& o) {
  std::string loss = "n/a", rate = "n/a samples/s";
  if (r.final_loss) loss = fmt::format("{:.4f}", *r.final_loss);
  if (r.samples_per_s) {
    rate = fmt::format(
        "{:.0f} samples/s{} (median{})", *r.samples_per_s,
        r.tokens_per_s ? fmt::format(", {:.0f} tokens/s", *r.tokens_per_s) : std::string(),
        !r.samples_per_s_includes_warmup ? std::string()
        : r.steps_run == 1               ? std::string(" of 1 step, warm-up included")
                           : fmt::format(" of all {} steps, warm-up included", r.steps_run));
  }
  fmt::print("steps {}  final loss {}  {}{}\n", r.steps, loss, rate,
             r.steps_run == 0 ? "  (no steps ran: the run had already finished)" : "");
  if (!o.eval) return;
  if (r.test_accuracy && r.test_loss) {
    fmt::print("final test accuracy: {:.2f}%  (test loss {:.4f}, {} test examples)\n",
               100.0 * *r.test_accuracy, *r.test_loss, r.test_examples);
  } else {
    fmt::print("final test accuracy: n/a  (no evaluation ran{})\n",
               o.halt_after > 0 ? ": train.halt_after stopped the run before its end" : "");
  }
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

// The run's parallel plan: --plan's file, else the config's [parallel]
// shorthand expanded for this model; nullopt when neither is given. Either
// way it is checked against the model's graph (at the global batch) and the
// world before anything runs.
std::optional<Plan> run_plan(const CommandOptions& opts, const RunConfig& rc, int world,
                             Graph* graph_out = nullptr) {
  if (opts.plan_path.empty() && !rc.parallel_given && opts.write_plan_path.empty())
    return std::nullopt;
  if (!opts.plan_path.empty() && rc.parallel_given) {
    throw ConfigError(fmt::format(
        "--plan {} and the config's [parallel] section both describe the plan; use one of them",
        opts.plan_path));
  }
  ModelSpec spec = rc.model;
  spec.compute = DType::f32;  // names and shapes do not depend on it
  ModelGraph m = build_model(spec, rc.train.batch_size);
  Plan plan;
  std::string where;
  if (!opts.plan_path.empty()) {
    plan = load_plan(opts.plan_path);
    where = fmt::format("plan {}", opts.plan_path);
    if (!plan.model.empty() && plan.model != rc.model.kind) {
      throw ConfigError(
          fmt::format("{}: model: the plan was written for model.kind {}, this run "
                      "trains {}",
                      where, plan.model, rc.model.kind));
    }
  } else {
    const ShorthandModel sm{rc.model.kind,
                            rc.model.kind == "gpt" ? rc.model.d_model / rc.model.heads : 1};
    ParallelShorthand sh = rc.parallel;
    sh.batch_shares = rc.train.dist.batch_shares;
    plan = expand_shorthand(sh, sm, m.graph, world);
    where = "parallel";
  }
  validate_plan(plan, m.graph, world, rc.train.batch_size, where);
  if (graph_out != nullptr) *graph_out = std::move(m.graph);
  return plan;
}

// Why `plan` is more than data parallelism, for the error that says the
// runtime cannot execute it yet.
std::string beyond_data_parallel(const Plan& plan, const Graph& g) {
  std::vector<std::string> why;
  if (plan.pipeline_stages() > 1)
    why.push_back(fmt::format("{} pipeline stages", plan.pipeline_stages()));
  if (plan.microbatches > 1) why.push_back(fmt::format("{} micro-batches", plan.microbatches));
  if (plan.sequence_parallel) why.push_back("sequence parallelism");
  for (const auto& [name, s] : plan.specs) {
    const auto id = g.find(name);
    const bool input = id && g.value(*id).role == ValueRole::input;
    bool split_beyond_batch = !s.partial.empty();
    for (size_t d = input ? 1 : 0; d < s.dims.size(); ++d) split_beyond_batch |= s.dims[d].split();
    if (split_beyond_batch) {
      why.push_back(fmt::format("{} is {}", name, s.describe()));
      break;
    }
  }
  if (why.empty()) {
    why.push_back(
        "a mesh whose ranks do not each read their own slice of the batch over one "
        "axis");
  }
  return fmt::format("{}", fmt::join(why, ", "));
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

namespace {

// train --plan / [parallel] / --write-plan: the plan is checked before any
// step (every rank checks it, so a bad plan fails everywhere, no hang);
// `write` writes it for --write-plan. Data-parallel plans run as [dist] data
// parallelism; plans with tensor axes (tensor / sequence parallelism, with
// or without dp) are returned for the Trainer to lower and run; pipeline
// stages and micro-batches are refused, never run as something else.
std::optional<Plan> check_train_plan(const CommandOptions& opts, const RunConfig& rc, int world,
                                     bool write, bool announce) {
  Graph g;
  const std::optional<Plan> plan = run_plan(opts, rc, world, &g);
  if (!plan) return std::nullopt;
  const std::string where =
      opts.plan_path.empty() ? std::string("parallel") : "plan " + opts.plan_path;
  if (write && !opts.write_plan_path.empty()) {
    write_plan(*plan, opts.write_plan_path);
    fmt::print(stderr, "meshtrain: wrote the plan to {}\n", opts.write_plan_path);
  }
  const bool lowered = needs_lowering(*plan);
  const bool pipelined = plan->pipeline_stages() > 1;
  if ((!pipelined && plan->microbatches > 1) ||
      (!lowered && !pipelined && !plan->data_parallel_only(g))) {
    throw ConfigError(fmt::format(
        "{}: this plan ({}; mesh {}) {}, which the trainer does not execute yet (data, "
        "tensor, sequence and pipeline parallelism run, and dp with either; `meshtrain inspect` "
        "shows the plan{})",
        where, beyond_data_parallel(*plan, g), plan->mesh.describe(),
        "has micro-batches without pipeline stages",
        write && !opts.write_plan_path.empty() ? ", and it was written to " + opts.write_plan_path
                                               : ""));
  }
  if (pipelined) {
    TrainerOptions t = rc.train;
    t.dist.plan = std::make_shared<const Plan>(*plan);
    check_pipeline_options(t);
  }
  if (plan->stage_meshes()) {
    // The boundaries between the stages' meshes (a tied parameter across
    // them is refused here, before any rank starts).
    ModelSpec spec = rc.model;
    spec.compute = DType::f32;
    const ModelGraph mm = build_model(spec, rc.train.batch_size / plan->microbatches);
    plan_cross_mesh(mm.graph, mm.loss, *plan, 0);
  }
  // Data parallelism reads the batch as the loader splits it (by
  // dist.batch_shares over the data-parallel ranks); a plan that splits it
  // otherwise would silently train on other examples than it says.
  const bool by_axis = lowered || pipelined;  // the dp axis, not every rank, shares the batch
  const int dp_world = by_axis ? plan->mesh.axis_size("dp") : world;
  auto dp_rank = [&](int r) { return by_axis ? plan->mesh.coord(r, "dp") : r; };
  const int64_t batch = g.value(*g.find("x")).shape[0];
  std::vector<int64_t> shares = rc.train.dist.batch_shares;
  if (shares.empty()) shares.assign(static_cast<size_t>(dp_world), 1);
  // (A count that does not fit is check_world()'s message.)
  const bool shares_fit = static_cast<int>(shares.size()) == dp_world;
  const std::vector<int64_t> bounds =
      shares_fit ? shard_bounds(batch, shares) : std::vector<int64_t>{};
  for (const char* in : {"x", "y"}) {
    const auto id = g.find(in);
    if (!id || !shares_fit) continue;
    const Shape& shape = g.value(*id).shape;
    const int64_t per = shape[0] / batch;  // gpt: seq_len labels per example
    for (int r = 0; r < world; ++r) {
      const Box b = local_box(shape, plan->spec(in), plan->mesh, r);
      const int64_t lo = bounds[static_cast<size_t>(dp_rank(r))] * per;
      const int64_t hi = bounds[static_cast<size_t>(dp_rank(r)) + 1] * per;
      if (b.begin[0] == lo && b.end[0] == hi) continue;
      throw ConfigError(fmt::format(
          "{}: values.{}: rank {} would read rows [{}, {}) of {}, but data parallelism gives it "
          "[{}, {}) (dist.batch_shares {}); make the plan's batch ratios and dist.batch_shares "
          "agree",
          where, in, r, b.begin[0], b.end[0], shape[0], lo, hi,
          rc.train.dist.batch_shares.empty()
              ? std::string("equal")
              : fmt::format("[{}]", fmt::join(rc.train.dist.batch_shares, ", "))));
    }
  }
  if (announce && pipelined) {
    fmt::print(stderr,
               "meshtrain: {}: mesh {}: {} pipeline stages, {} micro-batches, schedule {}\n", where,
               plan->mesh.describe(), plan->pipeline_stages(), plan->microbatches,
               schedule_name(plan->schedule));
  } else if (announce && lowered) {
    fmt::print(stderr,
               "meshtrain: {}: mesh {}: tensor axes lowered into each rank's graph{}, data "
               "parallelism over dp (ZeRO stage {})\n",
               where, plan->mesh.describe(),
               plan->sequence_parallel ? " with sequence parallelism" : "", rc.train.dist.dp.stage);
  } else if (announce) {
    fmt::print(stderr,
               "meshtrain: {}: mesh {} is data parallelism; it runs as [dist] data "
               "parallelism (ZeRO stage {})\n",
               where, plan->mesh.describe(), rc.train.dist.dp.stage);
  }
  if (!lowered && !pipelined) return std::nullopt;
  return plan;
}

int plan_dp_world(const std::optional<Plan>& plan, int world) {
  return plan ? plan->mesh.axis_size("dp") : world;
}

// OpenBLAS reads OPENBLAS_CORETYPE once, when the library loads (before
// main), so choosing its kernels means starting this program again with the
// variable set. Done before any rank starts or MPI initialises; the process
// keeps its id, so a launcher never notices. The probe in the fast backend
// then checks the new kernels compute right (and drops them if not).
// True in a process started by an MPI launcher as rank 0, or not started by one.
bool first_rank_or_alone() {
  if (!launched_by_mpi()) return true;
  for (const char* v : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"}) {
    if (const char* r = std::getenv(v)) return std::string(r) == "0";
  }
  return false;
}

// `launching`: this process is about to start the ranks through mpirun
// (they inherit the environment and print the note themselves, rank 0 only).
void reexec_for_openblas(const std::string& policy, bool quiet, bool launching, char** argv) {
  const char* marker = std::getenv(kCoretypeReexecVar);
  const CoretypeAdvice a = advise_openblas_coretype(
      policy, cpu_info(), openblas_corename(), std::getenv("OPENBLAS_CORETYPE"), marker != nullptr);
  const bool say = !quiet && (launching ? !a.set_to.empty() : first_rank_or_alone());
  if (!a.note.empty() && say) fmt::print(stderr, "meshtrain: note: {}\n", a.note);
  if (a.set_to.empty()) return;
  setenv("OPENBLAS_CORETYPE", a.set_to.c_str(), 1);
  setenv(kCoretypeReexecVar, openblas_corename().c_str(), 1);
  std::fflush(stdout);
  std::fflush(stderr);
  execv("/proc/self/exe", argv);
  // Still here: carry on with the kernels OpenBLAS chose.
  fmt::print(stderr, "meshtrain: note: could not restart with OPENBLAS_CORETYPE={}: {}\n", a.set_to,
             std::strerror(errno));
  unsetenv("OPENBLAS_CORETYPE");
  unsetenv(kCoretypeReexecVar);
}

// dist.algorithm_choice = measured: the collective probe (comm/probe.h) on
// the freshly made communicator, every rank at once; its calls do not count
// toward the run's byte counters.
void apply_algorithm_choice(Communicator& comm, const RunConfig& rc, bool quiet) {
  if (rc.algorithm_choice != "measured") return;
  std::shared_ptr<const MeasuredChoice> m = comm::probe_algorithms(comm);
  comm.reset_counters();
  if (m == nullptr) return;
  comm.set_measured_choice(m);
  if (!quiet && comm.rank() == 0) {
    fmt::print(stderr, "meshtrain: collectives measured ({}): {}\n", m->source, m->describe());
  }
}

}  // namespace

// Starts `nproc` ranks of this command through mpirun (or the hostfile's),
// passing on every argument but the launcher's own.
static int launch_ranks(const CommandOptions& opts, const RunConfig& rc, int nproc, int argc,
                        char** argv) {
  LaunchOptions lo;
  lo.nproc = nproc;
  lo.stop_grace = std::chrono::seconds(rc.stop_grace_s);
  if (!opts.hostfile.empty()) {
    if (access(opts.hostfile.c_str(), R_OK) != 0) {
      throw FileError(fmt::format("--hosts {}: cannot read the hostfile: {}", opts.hostfile,
                                  std::strerror(errno)));
    }
    lo.hostfile = opts.hostfile;
  } else if (const int cores = usable_cores(); nproc > cores) {
    fmt::print(stderr,
               "meshtrain: warning: {} ranks on {} core{}: they share cores and each runs "
               "slower (fine for trying things out)\n",
               nproc, cores, cores == 1 ? "" : "s");
  }
  std::vector<std::string> args;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--nproc" || a == "--hosts" || a == "--write-plan") {
      ++i;  // skip its value
    } else if (a.rfind("--nproc=", 0) != 0 && a.rfind("--hosts=", 0) != 0 &&
               a.rfind("--write-plan=", 0) != 0) {
      args.push_back(a);
    }
  }
  return run_under_mpirun(lo, args);
}

// Full-graph GNN training (data.kind = "graph"), the whole graph every
// epoch (train/full_graph.h): in one process, or graph-parallel over the
// ranks mpirun starts (gnn.parallel = "graph").
static int train_graph(const CommandOptions& opts, RunConfig& rc, int nproc, bool empty, int argc,
                       char** argv) {
  const bool several = nproc > 1 || !opts.hostfile.empty() || launched_by_mpi();
  if (several && rc.gnn.mode == GnnParallel::none) {
    throw ConfigError(fmt::format(
        "dist.nproc = {}: gnn.parallel = \"none\" trains the graph in one process; set "
        "gnn.parallel = \"graph\" for graph parallelism over the ranks, \"layer\" for layer "
        "pipelining, or dist.nproc = 1",
        nproc));
  }
  if (several && rc.gnn.mode == GnnParallel::graph) {
    check_graph_parallel_model(rc.model, rc.gnn.replication);
  }
  check_graph_parts(rc.gnn);
  if (rc.gnn.mode == GnnParallel::layer && !launched_by_mpi()) {
    // Throw naming gnn.graph_parts, then model.gnn_layers.
    layer_pipeline_stages(rc.model.gnn_layers, hybrid_stages(rc.gnn, nproc));
  }
  if (several && !launched_by_mpi() && nproc % rc.gnn.replication != 0) {
    throw ConfigError(fmt::format(
        "gnn.replication = {} must divide the {} ranks (row blocks = ranks / replication)",
        rc.gnn.replication, nproc));
  }
  if (several && !launched_by_mpi()) return launch_ranks(opts, rc, nproc, argc, argv);
  std::unique_ptr<Communicator> comm;
  if (launched_by_mpi()) {
    CommOptions co;
    co.timeout = std::chrono::milliseconds(rc.timeout_s * 1000);
    co.on_stall = [](const std::string& report) {
      fmt::print(stderr, "meshtrain: stall: {}\n", report);
    };
    comm = make_mpi_communicator(co);
    apply_algorithm_choice(*comm, rc, opts.quiet);
  }
  const int ranks = comm ? comm->size() : 1;
  const bool leader = comm == nullptr || comm->rank() == 0;
  // One rank: the single-process path (a partition of one part is the graph).
  GraphParallelOptions par = rc.gnn;
  if (ranks == 1) par.mode = GnnParallel::none;
  if (!opts.metrics_path.empty()) rc.train.metrics_path = opts.metrics_path;
  if (empty && leader) empty_notice(opts);
  const GraphData g = open_graph(rc.data);
  if (!opts.quiet && leader) {
    fmt::print(stderr, "meshtrain: training {} on {} (full graph, {}, {})\n", rc.model.kind,
               g.describe(),
               ranks == 1 ? std::string("1 process")
               : par.mode == GnnParallel::layer
                   ? fmt::format("layer pipeline over {} ranks{}, {} {} chunks after {}", ranks,
                                 par.graph_parts > 1
                                     ? fmt::format(" ({} stages x {} graph parts)",
                                                   ranks / par.graph_parts, par.graph_parts)
                                     : std::string(),
                                 par.chunks, partition_method_name(par.partition.method),
                                 plural(par.startup_epochs, "startup epoch"))
                   : fmt::format("graph parallel over {} ranks{}, {} partition", ranks,
                                 par.replication > 1
                                     ? fmt::format(" (1.5D, replication {})", par.replication)
                                     : std::string(),
                                 partition_method_name(par.partition.method)),
               plural(rc.train.threads, "thread"));
  }
  auto log = [&](const std::string& line) {
    if (!opts.quiet) fmt::print(stderr, "meshtrain: {}\n", line);
  };
  FullGraphResult r;
  try {
    r = train_full_graph(rc.model, g, rc.train, log, par, comm.get());
  } catch (...) {
    // As cmd_train: leave the communicator to the process exit (main ends the job).
    if (comm && comm->size() > 1) abandoned_communicator = comm.release();
    throw;
  }
  // Bytes per rank per epoch, as each rank's communicator counted them.
  std::vector<uint64_t> halo(static_cast<size_t>(ranks)), grads(static_cast<size_t>(ranks)),
      replica(static_cast<size_t>(ranks)), stages(static_cast<size_t>(ranks));
  if (ranks > 1) {
    Tensor mine = Tensor::empty(Shape{4}, DType::f64);
    mine.set_item(0, static_cast<double>(r.halo_bytes_sent_per_epoch));
    mine.set_item(1, static_cast<double>(r.allreduce_bytes_sent_per_epoch));
    mine.set_item(2, static_cast<double>(r.replica_bytes_sent_per_epoch));
    mine.set_item(3, static_cast<double>(r.pipeline_bytes_sent_per_epoch));
    Tensor all = Tensor::empty(Shape{4 * ranks}, DType::f64);
    comm->all_gather(mine, all);
    for (int q = 0; q < ranks; ++q) {
      halo[static_cast<size_t>(q)] = static_cast<uint64_t>(all.item(4 * q));
      grads[static_cast<size_t>(q)] = static_cast<uint64_t>(all.item(4 * q + 1));
      replica[static_cast<size_t>(q)] = static_cast<uint64_t>(all.item(4 * q + 2));
      stages[static_cast<size_t>(q)] = static_cast<uint64_t>(all.item(4 * q + 3));
    }
  }
  if (!leader) return 0;
  fmt::print(
      "{} epochs: loss {:.4f}, accuracy train {:.3f} val {:.3f} test {:.3f}, median "
      "epoch {:.1f} ms, {} parameters\n",
      r.epochs.size(), r.final_loss, r.train_acc, r.val_acc, r.test_acc,
      1e3 * r.median_epoch_seconds, r.params);
  if (ranks > 1 && par.mode == GnnParallel::layer && par.graph_parts > 1) {
    fmt::print(
        "bytes sent per rank per epoch: between stages [{}], halo exchange [{}], gradient "
        "all-reduce [{}]\n",
        fmt::join(stages, ", "), fmt::join(halo, ", "), fmt::join(grads, ", "));
  } else if (ranks > 1 && par.mode == GnnParallel::layer) {
    fmt::print("bytes sent per rank per epoch: between stages [{}]\n", fmt::join(stages, ", "));
  } else if (ranks > 1) {
    fmt::print("bytes sent per rank per epoch: halo exchange [{}], gradient all-reduce [{}]{}\n",
               fmt::join(halo, ", "), fmt::join(grads, ", "),
               par.replication > 1 ? fmt::format(", partial aggregations over the replicas [{}]",
                                                 fmt::join(replica, ", "))
                                   : std::string());
  }
  return 0;
}

// `inspect` of a graph config: the graph, the model's size, and how
// gnn.partition splits the graph over dist.nproc ranks (edge cut, halo rows).
static int inspect_graph(const RunConfig& rc) {
  const GraphData g = open_graph(rc.data);
  fmt::print("graph: {}\n", g.describe());
  GnnGraph gg;
  gg.adj = &g.adj;
  gg.features = g.feature_dim();
  gg.classes = g.classes;
  gg.loss_vertices = GraphData::members(g.train_mask);
  const ModelGraph m = build_gnn(rc.model, gg);
  fmt::print("model: {} ({} layers, hidden {}), {} parameters; FLOPs per epoch (forward): {}\n",
             rc.model.kind, rc.model.gnn_layers, rc.model.gnn_hidden, m.graph.param_count(),
             human_count(graph_cost(m.graph).flops, "FLOP"));
  PartitionOptions po = rc.gnn.partition;
  const int64_t c = rc.gnn.replication;
  if (rc.nproc % c != 0) {
    throw ConfigError(fmt::format(
        "gnn.replication = {} must divide dist.nproc = {} (row blocks = ranks / replication)", c,
        rc.nproc));
  }
  po.parts = rc.nproc / c;
  const Partition part = partition_graph(g.adj, po);
  fmt::print("partition: {} into {} (dist.nproc{}; gnn.partition)\n",
             partition_method_name(po.method), plural(po.parts, "part"),
             c > 1 ? fmt::format(" / gnn.replication {}", c) : std::string());
  fmt::print("{}", partition_stats(g.adj, part).describe());
  if (rc.nproc > 1 && graph_parallel_supports(rc.model, c)) {
    std::vector<int64_t> bytes;
    for (int64_t q = 0; q < rc.nproc; ++q) {
      bytes.push_back(halo_bytes_per_epoch(
          rc.model, make_graph_shard(g, rc.model, part, q, c).shard, g.feature_dim(), g.classes));
    }
    fmt::print("halo bytes each rank sends per epoch (gnn.parallel = graph, {}): [{}]\n",
               rc.model.kind, fmt::join(bytes, ", "));
  }
  // The hybrid (gnn.parallel = layer, gnn.graph_parts = G): what each rank
  // sends between stages and in its stage's halo exchange (the gradient
  // all-reduce depends on the group's algorithm; train prints it).
  const bool splittable = rc.model.kind == "gcn" || rc.model.kind == "resgcn" ||
                          (rc.model.kind == "sage" && rc.model.sage_aggregation == "mean");
  if (rc.gnn.mode == GnnParallel::layer && rc.gnn.graph_parts > 1 && splittable) {
    const int stages = hybrid_stages(rc.gnn, rc.nproc);
    const auto ranges = layer_pipeline_stages(rc.model.gnn_layers, stages);
    PartitionOptions hp = rc.gnn.partition;
    hp.parts = rc.gnn.graph_parts;
    const PartitionStats hs = partition_stats(g.adj, partition_graph(g.adj, hp));
    std::vector<int64_t> between, halo;
    for (int r = 0; r < rc.nproc; ++r) {
      const int64_t p = r / stages, s = r % stages;
      between.push_back(
          layer_pipeline_bytes_per_epoch(rc.model, hs.vertices[static_cast<size_t>(p)], s, stages));
      halo.push_back(hybrid_halo_bytes_per_epoch(
          rc.model, hs.halo_out(p), hs.halo_in(p), ranges[static_cast<size_t>(s)].first,
          ranges[static_cast<size_t>(s)].second, g.feature_dim(), g.classes));
    }
    fmt::print(
        "hybrid (gnn.parallel = layer, {} stages x {} graph parts, {}): bytes each rank sends per "
        "epoch: between stages [{}], halo exchange [{}]\n",
        stages, rc.gnn.graph_parts, rc.model.kind, fmt::join(between, ", "), fmt::join(halo, ", "));
  }
  return 0;
}

int cmd_graph_gen(const CommandOptions& opts) {
  RunConfig rc = load(opts, nullptr, nullptr);
  if (rc.data.kind != "graph") {
    throw ConfigError(
        fmt::format("graph-gen: data.kind is '{}', not \"graph\" (set model.kind "
                    "to a GNN or data.kind = \"graph\")",
                    rc.data.kind));
  }
  const GraphData g = open_graph(rc.data);
  save_graph(opts.graph_out, g);
  fmt::print("wrote {}: {}\n", opts.graph_out, g.describe());
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
  // Before anything else runs (the graph trainer's kernels use OpenBLAS too).
  if (rc.train.exec.backend == "fast") {
    const bool launching = (nproc > 1 || !opts.hostfile.empty()) && !launched_by_mpi();
    reexec_for_openblas(rc.openblas_coretype, opts.quiet, launching, argv);
  }
  if (rc.data.kind == "graph") return train_graph(opts, rc, nproc, empty, argc, argv);
  const bool launcher = (nproc > 1 || !opts.hostfile.empty()) && !launched_by_mpi();
  if (launcher) {
    const std::optional<Plan> tplan =
        check_train_plan(opts, rc, nproc, /*write=*/true, /*announce=*/false);
    check_world(rc, nproc, plan_dp_world(tplan, nproc));
    return launch_ranks(opts, rc, nproc, argc, argv);
  }
  // This process is a rank from here on: a SIGINT / SIGTERM (from the user,
  // the launcher or a cluster's preemption) now stops it after a step with
  // a checkpoint instead of killing it.
  install_stop_handlers();
  if (!opts.metrics_path.empty()) rc.train.metrics_path = opts.metrics_path;
  if (!opts.trace_path.empty()) rc.train.dist.trace_path = opts.trace_path;
  if (!opts.tensorboard_dir.empty()) rc.train.tensorboard_dir = opts.tensorboard_dir;
  rc.train.progress = !opts.quiet;
  rc.train.progress_tty = launcher_stderr_is_tty();

  // Under an MPI launcher every process is one data-parallel rank.
  std::unique_ptr<Communicator> comm;
  if (launched_by_mpi()) {
    CommOptions co;
    co.timeout = std::chrono::milliseconds(rc.timeout_s * 1000);
    co.on_stall = [](const std::string& report) {
      fmt::print(stderr, "meshtrain: stall: {}\n", report);
    };
    // Node groups and emulated links for the whole job (docs/cluster.md).
    const int world = read_launch_env().size;
    if (rc.cluster) {
      co.cluster = std::make_shared<ClusterLayout>(resolve_cluster(*rc.cluster, world));
    } else if (rc.node_size > 0) {
      co.cluster =
          std::make_shared<ClusterLayout>(ClusterLayout::by_node_size(world, rc.node_size));
    }
    co.policy.prefer_hierarchical = rc.hierarchical;
    comm = make_mpi_communicator(co);
    apply_algorithm_choice(*comm, rc, opts.quiet);
    if (co.cluster && comm->rank() == 0 && !opts.quiet) {
      fmt::print(stderr, "meshtrain: cluster {}: {}; all-reduce {}{}\n", co.cluster->source,
                 co.cluster->describe(),
                 comm->has_hierarchy() ? "hierarchical (reduce-scatter in each node, all-reduce "
                                         "across nodes, all-gather in each node)"
                 : rc.hierarchical     ? "flat (not several nodes of equal size)"
                                       : "flat (dist.hierarchical = false)",
                 co.cluster->emulates() ? " (emulated in the transport: every message waits "
                                          "latency + bytes / bandwidth of its link)"
                                        : "");
    }
  }
  const int world = comm ? comm->size() : 1;
  bool leader = comm == nullptr || comm->rank() == 0;
  // Under the --nproc launcher the plan was written before the ranks started
  // (it does not pass --write-plan on).
  const std::optional<Plan> tplan =
      check_train_plan(opts, rc, world, /*write=*/leader, /*announce=*/leader && !opts.quiet);
  check_world(rc, world, plan_dp_world(tplan, world));
  if (tplan) rc.train.dist.plan = std::make_shared<const Plan>(*tplan);
  // The plan's devices (docs/plan.md): the Trainer numbers the ranks by the
  // mesh, so the process running mesh rank 0 leads (prints the summary).
  if (tplan && comm) leader = tplan->device_of(0) == comm->rank();
  if (!rc.fault.empty()) rc.train.dist.after_step = fault_drill(rc.fault);
  if (!leader) rc.train.progress = false;
  if (empty && leader) empty_notice(opts);

  // Every rank on this machine plans to fit its share of what is free now.
  rc.train.memory_limit = available_memory_bytes() / local_ranks();

  auto train_data = open_dataset(rc.data, rc.model, DataSplit::train);
  // Without evaluation the test split is not read (text may then give it
  // no bytes: data.test_fraction = 0).
  std::shared_ptr<const Dataset> test_data;
  if (rc.train.eval) test_data = open_dataset(rc.data, rc.model, DataSplit::test);
  if (!opts.quiet && leader) {
    fmt::print(stderr, "meshtrain: training {} on {} ({}, ZeRO stage {}, {}, {})\n", rc.model.kind,
               train_data->describe(), plural(comm ? comm->size() : 1, "rank"),
               rc.train.dist.dp.stage, plural(rc.train.threads, "thread"),
               rc.train.precision_auto ? "precision auto"
               : rc.train.bf16_storage ? "f32 compute, bf16 activation storage"
                                       : dtype_name(rc.train.precision));
  }
  rc.train.on_notice = [](const std::string& msg) { fmt::print(stderr, "meshtrain: {}\n", msg); };
  rc.train.stop_signal = &g_stop_signal;
  TrainResult r;
  try {
    Trainer trainer(rc.model, train_data, test_data, rc.train, comm.get());
    if (leader && trainer.init_report() != nullptr) print_init_report(*trainer.init_report());
    r = trainer.run();
  } catch (...) {
    // main reports the error and ends the job (MPI_Abort). Destroying the
    // communicator first would wait (MpiOptions::teardown_timeout, 10 s) for
    // the ranks that failed or stalled; the job is about to end, so it is
    // left to the process exit (still reachable: no leak report).
    if (comm && comm->size() > 1) abandoned_communicator = comm.release();
    throw;
  }
  if (r.stop_signal != 0) {
    // docs/errors.md: 128 + the signal's number, as a shell reports a
    // process the signal ended, so scripts see the run did not finish.
    if (leader) {
      fmt::print(stderr, "meshtrain: stopped by signal at step {} ({}); {}\n", r.steps,
                 signal_name(r.stop_signal),
                 r.checkpoint.empty()
                     ? std::string("no checkpoint written (train.checkpoint is empty)")
                     : fmt::format("checkpoint written to {} (continue with --set "
                                   "train.resume=\"{}\" or train.resume=\"auto\")",
                                   r.checkpoint, r.checkpoint));
    }
    return 128 + r.stop_signal;
  }
  if (!leader) return 0;
  print_summary(r, rc.train);
  if (!r.checkpoint.empty()) fmt::print("checkpoint: {}\n", r.checkpoint);
  return 0;
}

RunConfig load_command_config(const CommandOptions& opts) {
  if (!opts.config_path.empty()) return load(opts);
  Config c = Config::parse("", "defaults");
  c.set_all(opts.overrides);
  return read_run_config(c);
}

std::optional<Plan> command_plan(const CommandOptions& opts, const RunConfig& rc, int world) {
  return run_plan(opts, rc, world);
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
  if (rc.data.kind == "graph") return inspect_graph(rc);
  Graph plan_graph;
  const std::optional<Plan> pplan = run_plan(opts, rc, rc.nproc, &plan_graph);
  if (pplan && !opts.write_plan_path.empty()) {
    write_plan(*pplan, opts.write_plan_path);
    fmt::print("wrote the plan to {}\n", opts.write_plan_path);
    return 0;
  }
  // The graph, options and memory plan rank 0 of a run of this config gets
  // (train/training_plan.h, the code the Trainer uses), at dist.nproc ranks;
  // under a plan with tensor axes, rank 0's lowered program.
  const int world = rc.nproc;
  const bool runs_lowered =
      pplan && needs_lowering(*pplan) && pplan->pipeline_stages() == 1 && pplan->microbatches == 1;
  if (runs_lowered) rc.train.dist.plan = std::make_shared<const Plan>(*pplan);
  const DataParallelPlace place = data_parallel_place(rc.train, 0, world);
  const BatchSplit split = split_batch(rc.train, place.rank, place.world);
  const TrainingGraph tg = build_training_graph(rc.model, rc.train, split.micro_batch, 0);
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
  if (pplan) {
    fmt::print("\nparallel plan ({}; the memory plan above is {}):\n{}",
               opts.plan_path.empty() ? std::string("from [parallel]") : opts.plan_path,
               runs_lowered ? "rank 0's program under it" : "data parallelism's",
               describe_plan(*pplan, plan_graph));
    if (runs_lowered) {
      // Every rank's program: its parameter boxes, the collectives the
      // lowering inserted (forward and backward, with bytes) and its memory.
      fmt::print("\nper-rank programs (spmd lowering):\n");
      for (int r = 0; r < world; ++r) {
        const TrainingGraph tr = build_training_graph(rc.model, rc.train, split.micro_batch, r);
        const TrainingPlan pr = plan_training(tr, rc.model, rc.train, split, r, world);
        fmt::print("{}  planned memory: {} (activations {}, parameters {})\n",
                   describe_lowered(tr.lowered, tr.model.graph), format_bytes(pr.total_bytes()),
                   format_bytes(pr.activations.arena_bytes),
                   format_bytes(pr.state.expected_param_bytes));
      }
    } else if (pplan->pipeline_stages() > 1) {
      // The pipeline's activation memory: each stage's stash per
      // micro-batch (the micro-batch model cut as the trainer cuts it) and
      // each rank's planned peak under the schedule.
      const int dp = pplan->mesh.has_axis("dp") ? pplan->mesh.axis_size("dp") : 1;
      const int64_t micro = rc.train.batch_size / dp / pplan->microbatches;
      const ModelGraph mm = build_model(rc.model, micro);
      // Cut as the trainer cuts (train/pipeline_training.cpp).
      CutOptions co;
      co.param_casts_join_consumers = pplan->async == AsyncMode::none;
      const PipelineCut cut = cut_pipeline(mm.graph, mm.loss, pplan->stages, co);
      const PipelineSchedule sched = plan_schedule(*pplan);
      fmt::print("pipeline activation stash ({} examples per micro-batch{}):\n{}", micro,
                 needs_lowering(*pplan) ? "; the unlowered model's" : "",
                 describe_stash(cut, sched));
      if (pplan->stage_meshes()) {
        // Each stage lowered on its own mesh; the boundaries' reshard plans.
        fmt::print("{}",
                   describe_cross_mesh(plan_cross_mesh(mm.graph, mm.loss, *pplan, 0), *pplan));
        fmt::print("{}", describe_cross_mesh_programs(mm.graph, mm.loss, *pplan));
      }
      fmt::print(
          "meshtrain train runs this plan through the pipeline runtime (docs/plan.md); the "
          "memory plan above is the unpipelined model's\n");
    } else if (!pplan->data_parallel_only(plan_graph)) {
      fmt::print("the trainer does not execute this plan yet ({}); meshtrain train refuses it\n",
                 beyond_data_parallel(*pplan, plan_graph));
    }
  }
  return 0;
}

}  // namespace mt
