#include "meshtrain/cli/calibrate.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <thread>

#include "meshtrain/base/error.h"
#include "meshtrain/cli/commands.h"
#include "meshtrain/cli/launch.h"
#include "meshtrain/comm/backends/mpi/mpi_communicator.h"
#include "meshtrain/comm/communicator.h"
#include "meshtrain/comm/probe.h"
#include "meshtrain/exec/executor.h"
#include "meshtrain/graph/op_registry.h"
#include "meshtrain/planner/cost_model.h"
#include "meshtrain/planner/simulator.h"
#include "meshtrain/tensor/machine.h"
#include "meshtrain/train/training_plan.h"

namespace mt {

CalibrationFit fit_alpha_beta(const std::vector<double>& steps, const std::vector<double>& bytes,
                              const std::vector<double>& seconds) {
  // Normal equations of t = s L + b beta, each measurement weighted by
  // 1 / t^2 (relative errors: a 5% error on a large message must not drown
  // the latency the small ones measure).
  double ss = 0, sb = 0, bb = 0, st = 0, bt = 0;
  for (size_t k = 0; k < seconds.size(); ++k) {
    const double w = seconds[k] > 0 ? 1.0 / (seconds[k] * seconds[k]) : 0.0;
    ss += w * steps[k] * steps[k], sb += w * steps[k] * bytes[k], bb += w * bytes[k] * bytes[k];
    st += w * steps[k] * seconds[k], bt += w * bytes[k] * seconds[k];
  }
  if (bb <= 0) throw ConfigError("calibrate: no bytes moved, the bandwidth is undetermined");
  double latency = 0, beta = 0;
  const double det = ss * bb - sb * sb;
  if (std::abs(det) > 1e-12 * ss * bb) {
    latency = (st * bb - bt * sb) / det;
    beta = (ss * bt - sb * st) / det;
  }
  if (!(latency > 0) || !(beta > 0)) {  // the bound L >= 0 binds
    latency = 0;
    beta = bt / bb;
  }
  if (!(beta > 0)) throw ConfigError("calibrate: the fitted bandwidth is not positive");
  CalibrationFit f;
  f.latency_s = latency;
  f.bandwidth_bytes_s = 1.0 / beta;
  double err = 0;
  for (size_t k = 0; k < seconds.size(); ++k) {
    const double pred = steps[k] * latency + bytes[k] * beta;
    err += std::pow((pred - seconds[k]) / seconds[k], 2);
  }
  f.rms_rel_error = std::sqrt(err / static_cast<double>(std::max<size_t>(1, seconds.size())));
  return f;
}

namespace {

// CPU time of the whole process (the kernels' thread and any other).
double process_cpu_s() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// One operator kind at one model size: FLOPs and seconds summed over its calls.
struct OpRate {
  double flops = 0, seconds = 0;
  double rate() const { return seconds > 0 ? flops / seconds : 0; }
};

struct KernelRun {
  std::string label;                  // "mlp 256", "gpt d128"
  std::map<std::string, OpRate> ops;  // by operator name
  // The executor's own time per kernel it runs: the run's wall time less
  // its operators' (dispatch, bookkeeping between kernels), the least of
  // the repetitions.
  double overhead_s = 0;
  int64_t kernels = 0;  // kernels one run executes
  // With a peer: the least wall time of a whole run with nothing pending
  // and with a receive from the peer posted on the communicator's progress
  // thread through the run (as a pipeline stage computes while it waits
  // for the next message), repetitions interleaved.
  double plain_s = 0, pending_s = 0;
  // Bytes one run's matmuls move of the weights (read) and their gradients
  // (written): planner::weight_values' values, f32. Priced apart from the
  // FLOPs (DeviceKind::weight_bandwidth), so taken out of the matmul's
  // measured time before its rate is computed.
  double matmul_weight_bytes = 0;
  double param_bytes = 0;  // f32 bytes of the model's parameters
  // With ranks running it at once (started together by a barrier): per
  // repetition, how late the last rank finished after the ranks' mean, as
  // a fraction of the mean, the median over the repetitions, over
  // E[max of n standard normals] -- the relative standard deviation of a
  // rank's compute (DeviceKind::compute_jitter). -1: not measured.
  double jitter = -1;
  std::vector<double> lateness;  // per repetition, the same before the division
};

// Forward + backward of `spec` at `batch` through the executor, its profile
// per operator kind: the fastest of `reps` runs after one warm-up.
KernelRun profile_model(const std::string& label, const ModelSpec& spec, int64_t batch, int reps,
                        Communicator* together) {
  TrainerOptions o;
  o.batch_size = batch;
  TrainingGraph tg = build_training_graph(spec, o, batch);
  const Graph& g = tg.model.graph;
  tg.exec.profile = true;
  Executor ex(g, tg.exec);
  std::vector<Tensor> keep;
  for (int i = 0; i < g.num_values(); ++i) {
    const Value& v = g.value(static_cast<ValueId>(i));
    if (v.role != ValueRole::input && v.role != ValueRole::param) continue;
    keep.push_back(v.role == ValueRole::param ? Tensor::full(v.shape, v.dtype, 0.01)
                                              : Tensor::zeros(v.shape, v.dtype));
    ex.bind(static_cast<ValueId>(i), keep.back());
  }
  for (const auto& [id, t] : tg.model.constants) ex.bind(id, t);
  ex.run();
  KernelRun k;
  k.label = label;
  {
    const std::vector<char> w = planner::weight_values(g);
    for (ValueId v : g.params())
      k.param_bytes += 4.0 * static_cast<double>(g.value(v).shape.numel());
    for (NodeId i = 0; i < g.num_nodes(); ++i) {
      const Node& n = g.node(i);
      if (n.op != OpKind::matmul) continue;
      for (const auto* vs : {&n.inputs, &n.outputs}) {
        for (ValueId v : *vs) {
          if (w[static_cast<size_t>(v)]) {
            k.matmul_weight_bytes += planner::value_bytes(planner::Pricing{}, g.value(v));
          }
        }
      }
    }
  }
  k.overhead_s = std::numeric_limits<double>::infinity();
  k.plain_s = k.pending_s = std::numeric_limits<double>::infinity();
  std::map<std::string, std::vector<OpRate>> all;           // per operator kind, one per repetition
  const int peer = together ? (together->rank() ^ 1) : -1;  // pairs 0-1, 2-3, ...
  const bool paired = peer >= 0 && peer < (together ? together->size() : 0);
  float token_in = 0, token_out = 1;
  // One communicator per direction, as the pipeline runtime has: a send
  // queued behind the pending receive on one progress thread would never
  // leave. Even ranks receive on `a` and send on `b`, odd ranks the reverse.
  std::unique_ptr<Communicator> a =
      paired ? together->split(0, together->rank(), "calibrate-a") : nullptr;
  std::unique_ptr<Communicator> b =
      paired ? together->split(0, together->rank(), "calibrate-b") : nullptr;
  Communicator* inbox = paired ? (together->rank() % 2 == 0 ? a.get() : b.get()) : nullptr;
  Communicator* outbox = paired ? (together->rank() % 2 == 0 ? b.get() : a.get()) : nullptr;
  std::vector<double> walls;     // this rank's run time per repetition
  std::vector<double> had_core;  // its CPU time / wall time
  for (int rep = 0; rep < reps; ++rep) {
    if (paired) {
      // The same run with a receive pending, not profiled into the rates.
      together->barrier();
      CommHandle pending = inbox->recv_async(&token_in, 1, DType::f32, peer);
      const double p0 = now_s();
      ex.run();
      k.pending_s = std::min(k.pending_s, now_s() - p0);
      outbox->send(&token_out, 1, DType::f32, peer);
      pending.wait();
    }
    if (together) together->barrier();  // every rank's repetition at once
    ex.reset_profile();
    const double t0 = now_s();
    const double c0 = process_cpu_s();
    ex.run();
    const double wall = now_s() - t0;
    walls.push_back(wall);
    // The share of a core the run had: below 0.9 another process took it.
    had_core.push_back(wall > 0 ? (process_cpu_s() - c0) / wall : 0.0);
    k.plain_s = std::min(k.plain_s, wall);
    double in_ops = 0;
    int64_t kernels = 0;
    for (const OpProfile& p : ex.profile()) {
      in_ops += static_cast<double>(p.total_ns) * 1e-9;
      if (!op_def(p.op).view && p.calls > 0) ++kernels;
    }
    if (kernels > 0) {
      k.kernels = kernels;
      k.overhead_s =
          std::min(k.overhead_s, std::max(0.0, wall - in_ops) / static_cast<double>(kernels));
    }
    std::map<std::string, OpRate> run;
    for (const OpProfile& p : ex.profile()) {
      if (p.flops <= 0 || p.total_ns <= 0) continue;
      OpRate& r = run[std::string(op_name(p.op))];
      r.flops += p.flops;
      r.seconds += static_cast<double>(p.total_ns) * 1e-9;
    }
    for (const auto& [op, r] : run) all[op].push_back(r);
  }
  if (together && together->size() > 1 && !walls.empty()) {
    const int n = together->size();
    std::vector<double> all_walls(walls.size() * static_cast<size_t>(n));
    std::vector<double> all_cores(walls.size() * static_cast<size_t>(n));
    together->all_gather(walls.data(), all_walls.data(), walls.size(), DType::f64);
    together->all_gather(had_core.data(), all_cores.data(), walls.size(), DType::f64);
    std::vector<double> late;
    for (size_t rep = 0; rep < walls.size(); ++rep) {
      double sum = 0, most = 0, least_core = 1;
      for (int r = 0; r < n; ++r) {
        const size_t at = static_cast<size_t>(r) * walls.size() + rep;
        sum += all_walls[at];
        most = std::max(most, all_walls[at]);
        least_core = std::min(least_core, all_cores[at]);
      }
      const double mean = sum / n;
      // Only repetitions in which every rank had its core: as the rates
      // are the kernels' with the core, the jitter is the ranks' own
      // (caches, memory bandwidth, the other rank), not another process
      // taking a core (at load 4-14 the median of all repetitions gave
      // 4-42%, i12-model).
      if (mean > 0 && least_core >= 0.9) late.push_back((most - mean) / mean);
    }
    // The median of those repetitions.
    std::sort(late.begin(), late.end());
    if (!late.empty()) k.jitter = late[late.size() / 2] / planner::expected_max_normal(n);
    k.lateness = late;
  }
  // Per operator kind, the fastest of the repetitions. The median, tried
  // in i12-time to match the trainer's median step, made the file follow
  // the load of the seconds it was measured in (at load 5 it priced every
  // plan 35-85% slower than trainings measured at load 2-3 minutes later);
  // the fastest repetition is what the kernels do when they have the core.
  for (auto& [op, rs] : all) {
    k.ops[op] = *std::max_element(
        rs.begin(), rs.end(), [](const OpRate& x, const OpRate& y) { return x.rate() < y.rate(); });
  }
  return k;
}

// Bytes of the largest cache level over the node: one instance's size
// times the instances (the online CPUs over the CPUs sharing one); 0 where
// sysfs does not say.
double last_level_cache_bytes() {
  const std::string dir = "/sys/devices/system/cpu/cpu0/cache/";
  int best_level = 0;
  double best = 0;
  for (int i = 0; i < 8; ++i) {
    const std::string idx = dir + "index" + std::to_string(i) + "/";
    std::ifstream level(idx + "level"), type(idx + "type"), size(idx + "size"),
        shared(idx + "shared_cpu_list");
    int lv = 0;
    std::string ty, sz, list;
    if (!(level >> lv) || !(type >> ty) || !(size >> sz) || !(shared >> list)) continue;
    if (ty == "Instruction" || lv <= best_level || sz.empty()) continue;
    double bytes = std::atof(sz.c_str());
    if (sz.back() == 'K') bytes *= 1024;
    if (sz.back() == 'M') bytes *= 1024 * 1024;
    // CPUs sharing it: "0-1", "0,2", "0-3,8-11".
    int sharing = 0;
    std::stringstream ss(list);
    std::string part;
    while (std::getline(ss, part, ',')) {
      const auto dash = part.find('-');
      sharing += dash == std::string::npos
                     ? 1
                     : std::atoi(part.c_str() + dash + 1) - std::atoi(part.c_str()) + 1;
    }
    const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    if (sharing <= 0 || cpus <= 0) continue;
    best_level = lv;
    best = bytes * std::max(1.0, static_cast<double>(cpus) / sharing);
  }
  return best;
}

double copy_bandwidth(size_t bytes, int reps) {
  std::vector<char> a(bytes, 1), b(bytes, 0);
  double best = 0;
  for (int r = 0; r < reps; ++r) {
    const double t0 = now_s();
    std::memcpy(b.data(), a.data(), bytes);
    const double t = now_s() - t0;
    if (t > 0) best = std::max(best, 2.0 * static_cast<double>(bytes) / t);  // read + write
  }
  if (b[bytes / 2] != 1) throw InternalError("calibrate: the copy did not copy");
  return best;
}

int64_t mem_total_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit) {
    if (key == "MemTotal:") return kb * 1024;
  }
  return available_memory_bytes();
}

std::string g3(double v) {
  return fmt::format("{:.4g}", v);
}

}  // namespace

int cmd_calibrate(const CommandOptions& opts, int argc, char** argv) {
  const int nproc = opts.nproc > 0 ? opts.nproc : 1;
  if (nproc > 1 && !launched_by_mpi()) {
    LaunchOptions lo;
    lo.nproc = nproc;
    std::vector<std::string> args;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--nproc") {
        ++i;
      } else if (a.rfind("--nproc=", 0) != 0) {
        args.push_back(a);
      }
    }
    return run_under_mpirun(lo, args);
  }
  std::unique_ptr<Communicator> comm;
  if (launched_by_mpi()) {
    CommOptions co;
    co.timeout = std::chrono::minutes(10);
    comm = make_mpi_communicator(co);
  }
  const int rank = comm ? comm->rank() : 0;
  const int world = comm ? comm->size() : 1;
  const bool quick = opts.calibrate_quick;
  auto say = [&](const std::string& s) {
    if (rank == 0 && !opts.quiet) fmt::print(stderr, "meshtrain calibrate: {}\n", s);
  };
  const double started = now_s();

  // 1. Kernels. Training runs every rank's kernels at once, so where each
  // rank of this node can have a core of its own, every rank profiles the
  // same models at the same time (a barrier before each repetition) and
  // rank 0's rates are written: they carry what ranks running side by side
  // cost each other (shared caches, memory bandwidth, the other rank's
  // communicator thread), which a kernel timed alone on an idle machine
  // does not. With more ranks than cores, rank 0 alone (the others wait):
  // the cluster file describes one device per rank, and sharing a core is
  // a slowdown the plan states, not an efficiency.
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const bool together = comm && world > 1 && static_cast<unsigned>(world) <= cores;
  Communicator* sync = together ? comm.get() : nullptr;
  std::vector<KernelRun> runs;
  double mem_bw = 0;
  if (rank == 0 || together) {
    struct Size {
      std::string label;
      ModelSpec spec;
      int64_t batch;
    };
    std::vector<Size> sizes;
    for (int64_t w :
         quick ? std::vector<int64_t>{128, 256} : std::vector<int64_t>{256, 512, 1024}) {
      ModelSpec s;
      s.kind = "mlp";
      s.hidden = {w, w};
      sizes.push_back({fmt::format("mlp hidden {}", w), s, quick ? 32 : 128});
    }
    for (int64_t d : quick ? std::vector<int64_t>{64} : std::vector<int64_t>{128, 256}) {
      ModelSpec s;
      s.kind = "gpt";
      s.layers = 2, s.d_model = d, s.heads = 4, s.seq_len = quick ? 32 : 64, s.vocab = 256;
      sizes.push_back({fmt::format("gpt d_model {}", d), s, quick ? 4 : 8});
    }
    for (const Size& s : sizes) {
      say(fmt::format("kernels: {} (batch {})", s.label, s.batch));
      runs.push_back(profile_model(s.label, s.spec, s.batch, quick ? 2 : 5, sync));
    }
    for (const KernelRun& k : runs) {
      if (std::isfinite(k.pending_s)) {
        say(fmt::format("{}: a run {:.3f} ms, with a receive pending {:.3f} ms ({:.3f}x)", k.label,
                        k.plain_s * 1e3, k.pending_s * 1e3, k.pending_s / k.plain_s));
      }
    }
    say("memory bandwidth: a large copy");
    if (sync) sync->barrier();
    mem_bw = copy_bandwidth(quick ? (16u << 20) : (256u << 20), quick ? 2 : 5);
  }

  // 2. Collectives: every algorithm the communicator runs here, a few sizes.
  struct Fit {
    std::string algorithm;
    CalibrationFit fit;
    std::string detail;
  };
  std::vector<Fit> fits;
  if (comm && world > 1) {
    comm->barrier();
    struct Case {
      Collective c;
      CommAlgorithm a;
    };
    std::vector<Case> cases = {{Collective::all_reduce, CommAlgorithm::ring},
                               {Collective::all_reduce, CommAlgorithm::halving_doubling},
                               {Collective::all_gather, CommAlgorithm::ring},
                               {Collective::reduce_scatter, CommAlgorithm::ring},
                               {Collective::broadcast, CommAlgorithm::tree},
                               {Collective::all_to_all, CommAlgorithm::pairwise}};
    if (comm->has_shared_memory()) {
      cases.push_back({Collective::all_reduce, CommAlgorithm::shared_memory});
    }
    const std::vector<size_t> elems = quick ? std::vector<size_t>{1024, 65536}
                                            : std::vector<size_t>{1024, 16384, 262144, 2097152};
    const int reps = quick ? 3 : 7;
    std::map<CommAlgorithm, std::vector<double>> s_of, b_of, t_of;
    std::map<CommAlgorithm, std::string> detail;
    for (const Case& cs : cases) {
      say(fmt::format("collectives: {} {}", collective_name(cs.c), algorithm_name(cs.a)));
      for (size_t n : elems) {
        const size_t count = std::max<size_t>(1, n / static_cast<size_t>(world)) *
                             static_cast<size_t>(world);  // divisible blocks
        const size_t block = count / static_cast<size_t>(world);
        std::vector<float> a(count, 1.0f), b(count, 0.0f);
        CollectiveOptions co;
        co.algorithm = cs.a;
        // As the runtime issues its collectives (the tensor-parallel
        // CollectiveRunner, DataParallel's buckets, ZeRO's gathers): queued
        // on the communicator's progress thread and waited for by the
        // caller, so the fit holds the hand-off and wake-up the runtime
        // pays per call. The blocking call on the caller's thread is timed
        // beside it for the comment.
        auto start = [&]() -> CommHandle {
          switch (cs.c) {
            case Collective::all_reduce:
              return comm->all_reduce_async(a.data(), b.data(), count, DType::f32, ReduceOp::sum,
                                            co);
            case Collective::all_gather:
              return comm->all_gather_async(a.data(), b.data(), block, DType::f32, co);
            case Collective::reduce_scatter:
              return comm->reduce_scatter_async(a.data(), b.data(), block, DType::f32,
                                                ReduceOp::sum, co);
            case Collective::broadcast:
              return comm->broadcast_async(a.data(), count, DType::f32, 0, co);
            default:
              return comm->all_to_all_async(a.data(), b.data(), block, DType::f32, co);
          }
        };
        auto call = [&] { start().wait(); };
        auto call_blocking = [&] {
          switch (cs.c) {
            case Collective::all_reduce:
              comm->all_reduce(a.data(), b.data(), count, DType::f32, ReduceOp::sum, co);
              break;
            case Collective::all_gather:
              comm->all_gather(a.data(), b.data(), block, DType::f32, co);
              break;
            case Collective::reduce_scatter:
              comm->reduce_scatter(a.data(), b.data(), block, DType::f32, ReduceOp::sum, co);
              break;
            case Collective::broadcast:
              comm->broadcast(a.data(), count, DType::f32, 0, co);
              break;
            default:
              comm->all_to_all(a.data(), b.data(), block, DType::f32, co);
              break;
          }
        };
        const size_t cost_count =
            (cs.c == Collective::all_reduce || cs.c == Collective::broadcast) ? count : block;
        const CollectiveCost my = comm->cost(cs.c, cs.a, cost_count, DType::f32);
        call();  // warm-up
        call_blocking();
        std::vector<double> times, blocking;
        for (int r = 0; r < reps; ++r) {
          // Interleaved, so that both see the same machine.
          comm->barrier();
          double t0 = now_s();
          call();
          double t[4] = {now_s() - t0, static_cast<double>(my.steps),
                         static_cast<double>(std::max(my.bytes_sent, my.bytes_received)), 0};
          comm->barrier();
          t0 = now_s();
          call_blocking();
          t[3] = now_s() - t0;
          comm->all_reduce(t, t, 4, DType::f64, ReduceOp::max);  // the slowest rank's
          times.push_back(t[0]);
          blocking.push_back(t[3]);
          if (r == 0) {
            s_of[cs.a].push_back(t[1]);
            b_of[cs.a].push_back(t[2]);
          }
        }
        auto median = [](std::vector<double>& v) {
          std::nth_element(v.begin(), v.begin() + static_cast<long>(v.size() / 2), v.end());
          return v[v.size() / 2];
        };
        const double t_async = median(times), t_blocking = median(blocking);
        t_of[cs.a].push_back(t_async);
        detail[cs.a] +=
            fmt::format("{}{} {} B {:.1f} us (blocking {:.1f})", detail[cs.a].empty() ? "" : ", ",
                        collective_name(cs.c), count * 4, t_async * 1e6, t_blocking * 1e6);
      }
    }
    for (const auto& [a, t] : t_of) {
      try {
        fits.push_back(
            {std::string(algorithm_name(a)), fit_alpha_beta(s_of[a], b_of[a], t), detail[a]});
      } catch (const ConfigError& e) {
        say(fmt::format("{}: no fit ({})", algorithm_name(a), e.what()));
      }
    }
  }
  // 3. The measured algorithm choice (comm/probe.h): what
  // `dist.algorithm_choice = measured` would pick on this machine now.
  std::string choice;
  if (comm && world > 1) {
    say("collectives: the algorithm probe (dist.algorithm_choice = measured)");
    comm::ProbeTable table;
    if (auto m = comm::probe_algorithms(*comm, {}, &table)) {
      choice = fmt::format("{} ({})", m->describe(), m->source);
    }
  }
  if (rank != 0) return 0;

  // 4. The file.
  // The matmuls' time less their weights' traffic at the copy's bandwidth
  // (written as weight_bandwidth_gb_s: the planner adds it back per matmul,
  // in proportion to the weights, not the FLOPs). At most half the time is
  // taken out: more would say the copy's rate is not the kernels'.
  // Only for models whose weights and gradients do not fit a rank's share
  // of the last-level cache (DeviceKind::cache_bytes: the planner prices no
  // traffic for those either).
  const double cache = last_level_cache_bytes();
  std::string traffic_detail;
  for (KernelRun& k : runs) {
    auto it = k.ops.find("matmul");
    if (it == k.ops.end() || mem_bw <= 0 || k.matmul_weight_bytes <= 0) continue;
    if (cache > 0 && 2 * k.param_bytes <= cache / std::max(1, world)) {
      traffic_detail += fmt::format("{}{} in cache", traffic_detail.empty() ? "" : "; ", k.label);
      continue;
    }
    const double t = std::min(k.matmul_weight_bytes / mem_bw, 0.5 * it->second.seconds);
    traffic_detail += fmt::format("{}{} {:.3f} of {:.3f} ms", traffic_detail.empty() ? "" : "; ",
                                  k.label, t * 1e3, it->second.seconds * 1e3);
    it->second.seconds -= t;
  }
  double peak = 0;
  for (const KernelRun& k : runs) {
    if (auto it = k.ops.find("matmul"); it != k.ops.end()) peak = std::max(peak, it->second.rate());
  }
  if (peak <= 0) throw InternalError("calibrate: no matmul was timed");
  // Efficiency per operator: at the largest size measured that has it.
  std::map<std::string, double> eff;
  std::map<std::string, std::string> per_size;
  for (const KernelRun& k : runs) {
    for (const auto& [op, r] : k.ops) {
      eff[op] = std::clamp(r.rate() / peak, 1e-6, 1.0);
      per_size[op] += fmt::format("{}{} {} GFLOP/s", per_size[op].empty() ? "" : "; ", k.label,
                                  g3(r.rate() * 1e-9));
    }
  }
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  const std::time_t now = std::time(nullptr);
  char when[64];
  std::strftime(when, sizeof(when), "%Y-%m-%d %H:%M UTC", std::gmtime(&now));
  double load = 0;
  if (std::ifstream la("/proc/loadavg"); la) la >> load;
  const CpuInfo& cpu = cpu_info();
  std::string out;
  out += fmt::format(
      "# This machine, measured by `meshtrain calibrate --nproc {}` on {} ({}), {} ranks, load "
      "{:.2f},\n# in {:.1f} s{}. docs/cluster.md describes the format.\n"
      "# peak_tflops_f32 is the best matmul throughput measured (a CPU has no datasheet peak\n"
      "# its kernels reach); each operator's efficiency is its throughput over that peak.\n"
      "# Each rate is the fastest of the repetitions.\n"
      "# Memory is MemTotal / ranks (the ranks share it). Kernels and the copy: {}.\n"
      "# Collectives: through the async path the runtime uses (queued on the progress\n"
      "# thread, waited for by the caller); the blocking call's time beside each.\n\n",
      world, when, host, world, load, now_s() - started, quick ? " (--quick: small sizes)" : "",
      together ? fmt::format("timed on all {} ranks at once, as training runs them; rank 0's rates",
                             world)
               : std::string("timed on rank 0 alone"));
  out += "device = \"cpu\"\n\n[devices.cpu]\n";
  out += fmt::format("peak_tflops_f32 = {}\n", g3(peak * 1e-12));
  out += fmt::format("memory_gb = {}\n", g3(static_cast<double>(mem_total_bytes()) / world * 1e-9));
  if (mem_bw > 0) out += fmt::format("memory_bandwidth_gb_s = {}\n", g3(mem_bw * 1e-9));
  if (mem_bw > 0 && !traffic_detail.empty()) {
    out += fmt::format(
        "# matmuls' weight traffic, taken out of their measured time (the rates below): {}\n"
        "weight_bandwidth_gb_s = {}\n",
        traffic_detail, g3(mem_bw * 1e-9));
    if (cache > 0) {
      out += fmt::format("# the last-level cache over the node (sysfs)\ncache_mb = {}\n",
                         g3(cache * 1e-6));
    }
  }
  // The executor's time per kernel besides the kernel: the median over the
  // model sizes (each the least of its repetitions).
  std::vector<double> overheads;
  std::string overhead_detail;
  for (const KernelRun& k : runs) {
    if (!std::isfinite(k.overhead_s)) continue;
    overheads.push_back(k.overhead_s);
    overhead_detail +=
        fmt::format("{}{} {:.2f} us ({} kernels)", overhead_detail.empty() ? "" : "; ", k.label,
                    k.overhead_s * 1e6, k.kernels);
  }
  // Not priced: how much a pending receive (the communicator's progress
  // thread waiting, as a pipeline stage's does through its passes) slows a
  // run where threads outnumber cores; docs/planner.md "What TP and PP
  // leave out".
  std::string pending;
  for (const KernelRun& k : runs) {
    if (!std::isfinite(k.pending_s) || k.plain_s <= 0) continue;
    pending += fmt::format("{}{} {:.3f} / {:.3f} ms ({:.3f}x)", pending.empty() ? "" : "; ",
                           k.label, k.pending_s * 1e3, k.plain_s * 1e3, k.pending_s / k.plain_s);
  }
  if (!pending.empty()) {
    out += fmt::format("# a run with a receive pending / without (not priced): {}\n", pending);
  }
  if (!overheads.empty()) {
    std::sort(overheads.begin(), overheads.end());
    out += fmt::format(
        "# per kernel, the executor's run time less its kernels': {}\nop_overhead_us = {}\n",
        overhead_detail, g3(overheads[overheads.size() / 2] * 1e6));
  }
  // How much a rank's compute varies between ranks running the same work at
  // once: the median over every repetition of every model size (the
  // per-size medians in the comment). The simulator makes each collective wait for its last
  // member by it (DeviceKind::compute_jitter).
  std::vector<double> jitters;  // every repetition of every size
  std::string jitter_detail;
  for (const KernelRun& k : runs) {
    if (k.jitter < 0) continue;
    for (double l : k.lateness) jitters.push_back(l / planner::expected_max_normal(world));
    jitter_detail +=
        fmt::format("{}{} {:.2f}%", jitter_detail.empty() ? "" : "; ", k.label, k.jitter * 100);
  }
  if (!jitters.empty()) {
    std::sort(jitters.begin(), jitters.end());
    out += fmt::format(
        "# the ranks' run times side by side: the last rank's lateness after their mean, as a\n"
        "# fraction of it (median of the repetitions in which every rank had a core: CPU /\n"
        "# wall >= 0.9), over E[max of {} standard normals] (relative\n"
        "# standard deviation), per size: {}; written: the median of all those repetitions\n"
        "compute_jitter = {}\n",
        world, jitter_detail, g3(jitters[jitters.size() / 2]));
  } else if (together && world > 1) {
    out +=
        "# compute_jitter: not measured (no repetition in which every rank had its core, CPU /\n"
        "# wall >= 0.9: the machine is loaded); the planner then takes the ranks as arriving\n"
        "# together\n";
  }
  out += fmt::format("source = \"meshtrain calibrate on {}, {} ({}), {}\"\n", host, cpu.model,
                     cpu.isa_flags(), when);
  out += "[devices.cpu.efficiency]\n";
  for (const auto& [op, e] : eff) {
    out += fmt::format("# {}: {}\n\"{}\" = {}\n", op, per_size[op], op, g3(e));
  }
  // The cores the node's ranks share: with more ranks than cores (a plan
  // of 4 ranks here on 2 cores) each computes on a share of one, which the
  // cost model prices (ClusterModel::node_core_sharing).
  out += fmt::format(
      "\n[[nodes]]\nname = \"{}\"\nranks_per_node = {}\n# the CPU cores the node's ranks share\n"
      "cores = {}\n",
      host, world, cores);
  for (const Fit& f : fits) {
    out += fmt::format(
        "\n# {}: measured (median of the repetitions, slowest rank) {};\n"
        "# fit: rms relative error {:.0f}%\n",
        f.algorithm, f.detail, f.fit.rms_rel_error * 100);
    out += fmt::format("[collectives.{}.intra_node]\nlatency_ms = {}\nbandwidth_gbit_s = {}\n",
                       f.algorithm, g3(f.fit.latency_s * 1e3), g3(f.fit.bandwidth_bytes_s * 8e-9));
  }
  if (!choice.empty()) {
    out += fmt::format(
        "\n# dist.algorithm_choice = measured would pick, on {} ranks here: {}.\n"
        "# (Not read back: train probes when it starts, docs/comm.md \"Measured choice\".)\n",
        world, choice);
  }
  if (opts.calibrate_out.empty()) {
    fmt::print("{}", out);
  } else {
    std::ofstream f(opts.calibrate_out, std::ios::binary);
    if (!f || !(f << out)) {
      throw FileError(fmt::format("calibrate --out {}: cannot write: {}", opts.calibrate_out,
                                  std::strerror(errno)));
    }
    say(fmt::format("wrote {} ({:.0f} s)", opts.calibrate_out, now_s() - started));
  }
  return 0;
}

}  // namespace mt
