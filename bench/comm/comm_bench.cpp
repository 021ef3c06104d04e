// Collective benchmark: meshtrain's all-reduce, all-gather and reduce-scatter
// against Open MPI's MPI_Allreduce / MPI_Allgather / MPI_Reduce_scatter_block
// on the same f32 buffers, sizes 4 KiB .. 64 MiB (powers of 4).
//
//   mpirun -np 2 build/bench/comm/comm_bench [--algorithms] [--only allreduce]
//       [--shm-bytes N] [--choice static|measured]
//
// Rank 0 prints one JSON line per collective and size, e.g.
//   {"suite": "comm", "name": "allreduce_bus_bw_1MiB", "unit": "GB/s",
//    "meshtrain": 9.1, "peer": 4.7, "ratio": 1.94,
//    "peer_name": "openmpi-4.1.4 MPI_Allreduce", "ranks": 2, ...}
// Bus bandwidth as in nccl-tests: all-reduce 2(n-1)/n * bytes / t, all-gather
// and reduce-scatter (n-1)/n * total bytes / t (total = the gathered buffer
// or the scattered input). t is the median over 21 samples (~2 ms of
// back-to-back calls each) of the slowest rank's time per call
// ("meshtrain_best" / "peer_best": the best sample). Samples of meshtrain and
// MPI alternate, all samples of one case within a fraction of a second, so
// both sides see the same machine load. meshtrain runs with its defaults
// (automatic algorithm, handshake on); --choice measured first runs the
// collective probe (comm/probe.h, as `dist.algorithm_choice = measured`) and
// installs its choice, and each line says which choice ran
// ("algorithm_choice", with "probe_s" and the probe's "measured_choice").
// --algorithms adds value lines for each
// explicit algorithm (the measurements behind the automatic policy).
// MT_BENCH_QUICK=1 stops at 4 MiB with fewer samples.
//
// Every result is checked before it is timed and again after (the output of
// the last timed call): rank r's input element i is a small integer, so every
// sum is exact in f32 and every correct algorithm returns the same bits. Each
// rank compares meshtrain's output and Open MPI's output with the expected
// values and with each other, element by element; a difference ends the
// benchmark on every rank (exit status 1), and rank 0 prints a JSON line with
// an "error" naming the collective, size, algorithm, rank, the first
// differing index and the three values.
//
// The shared window is MpiOptions' default (what the mpi tests run with too,
// see tests/comm/mpi_comm_test.cpp "BenchmarkSizesWithTheDefaultWindow")
// unless --shm-bytes says otherwise. Lines say what each side ran over:
// "meshtrain_transport" (the shared window and its size, or MPI
// point-to-point), "peer_transport" (Open MPI's pml and btl as mpirun was
// told through OMPI_MCA_pml / OMPI_MCA_btl, "default" when not) and
// "peer_coll" (the collective component; Open MPI does not report which of
// its algorithms a call used).
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "meshtrain/comm/backends/mpi/mpi_communicator.h"
#include "meshtrain/comm/backends/mpi/mpi_runtime.h"
#include "meshtrain/comm/probe.h"

namespace {

using mt::Collective;
using mt::CommAlgorithm;

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Bench {
  MPI_Comm comm;
  int rank;
  int size;
  int samples;

  // Seconds per call of fn, slowest rank, for one sample of `reps` calls.
  double sample(const std::function<void()>& fn, int reps) const {
    MPI_Barrier(comm);
    const double t0 = now_s();
    for (int i = 0; i < reps; ++i) fn();
    double t = (now_s() - t0) / reps;
    MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, comm);
    return t;
  }

  // Enough calls per sample for ~2 ms, agreed by all ranks.
  int reps_for(const std::function<void()>& fn) const {
    for (int i = 0; i < 3; ++i) fn();  // warm-up (first-touch, caches)
    double t = sample(fn, 3);
    int reps = static_cast<int>(std::clamp(2e-3 / std::max(t, 1e-7), 1.0, 2000.0));
    MPI_Allreduce(MPI_IN_PLACE, &reps, 1, MPI_INT, MPI_MAX, comm);
    return reps;
  }

  struct Stats {
    double median;
    double min;
  };
  static Stats stats(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return {v[v.size() / 2], v.front()};
  }

  // Seconds per call of a and b, sampled alternately.
  std::pair<Stats, Stats> compare(const std::function<void()>& a,
                                  const std::function<void()>& b) const {
    const int ra = reps_for(a);
    const int rb = reps_for(b);
    std::vector<double> ta, tb;
    for (int s = 0; s < samples; ++s) {
      ta.push_back(sample(a, ra));
      tb.push_back(sample(b, rb));
    }
    return {stats(ta), stats(tb)};
  }

  Stats measure(const std::function<void()>& a) const {
    const int ra = reps_for(a);
    std::vector<double> ta;
    for (int s = 0; s < samples; ++s) ta.push_back(sample(a, ra));
    return stats(ta);
  }
};

std::string size_label(size_t bytes) {
  if (bytes >= (size_t{1} << 20)) return fmt::format("{}MiB", bytes >> 20);
  return fmt::format("{}KiB", bytes >> 10);
}

double load_average() {
  double l = -1;
  if (FILE* f = std::fopen("/proc/loadavg", "r")) {
    if (std::fscanf(f, "%lf", &l) != 1) l = -1;
    std::fclose(f);
  }
  return l;
}

// Rank r's input element i: an integer in [-300, 720], so sums over ranks are
// exact in f32 and every correct algorithm gives the same bits.
float input_value(int r, size_t i) {
  return static_cast<float>(static_cast<int>((i * 7 + static_cast<size_t>(r) * 131) % 1021) - 300);
}

float sum_over_ranks(int n, size_t i) {
  float s = 0;
  for (int q = 0; q < n; ++q) s += input_value(q, i);
  return s;
}

// A wrong result: ends the benchmark on every rank.
struct WrongResult : std::runtime_error {
  using std::runtime_error::runtime_error;
};

bool same_bits(float a, float b) {
  return std::memcmp(&a, &b, sizeof a) == 0;
}

// "" when mine[i] and peer[i] both equal want(i) bit for bit for every
// i < count (so they also equal each other); else the first index where one
// does not, and the three values.
template <class Want>
std::string first_difference(const float* mine, const float* peer, size_t count, Want&& want) {
  for (size_t i = 0; i < count; ++i) {
    const float w = want(i);
    const bool mine_ok = same_bits(mine[i], w), peer_ok = same_bits(peer[i], w);
    if (mine_ok && peer_ok) continue;
    const char* who = !mine_ok && !peer_ok ? "meshtrain's and Open MPI's results differ"
                      : !mine_ok           ? "meshtrain's result differs"
                                           : "Open MPI's result differs";
    return fmt::format(
        "{} from the expected value at index {} of {}: meshtrain {}, Open MPI {}, expected {}", who,
        i, count, mine[i], peer[i], w);
  }
  return {};
}

// Collective over `comm`: returns when every rank's `error` is empty; else
// throws WrongResult on every rank, rank 0's carrying the message of the
// lowest failing rank.
void agree(MPI_Comm comm, int rank, const std::string& error) {
  int bad = error.empty() ? INT_MAX : rank;
  MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT, MPI_MIN, comm);
  if (bad == INT_MAX) return;
  std::string msg = error;
  if (bad != 0) {
    char buf[1024] = {};
    if (rank == bad) {
      std::snprintf(buf, sizeof buf, "%s", error.c_str());
      MPI_Send(buf, sizeof buf, MPI_CHAR, 0, 77, comm);
    } else if (rank == 0) {
      MPI_Recv(buf, sizeof buf, MPI_CHAR, bad, 77, comm, MPI_STATUS_IGNORE);
      msg = buf;
    }
  }
  if (rank != 0 && rank != bad) msg = fmt::format("rank {} found a wrong result", bad);
  throw WrongResult(msg);
}

std::string env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v && *v ? v : fallback;
}

std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  int rank = 0;
  try {
    mt::MpiRuntime& rt = mt::MpiRuntime::instance();
    rank = rt.world_rank();
    const bool quick = std::getenv("MT_BENCH_QUICK") != nullptr;
    bool algorithms = false;
    std::string choice = "static";
    std::string only;
    mt::MpiOptions mpi_options;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--algorithms") {
        algorithms = true;
      } else if (a == "--only" && i + 1 < argc) {
        only = argv[++i];
      } else if (a == "--choice" && i + 1 < argc) {
        choice = argv[++i];
        if (choice != "static" && choice != "measured") {
          throw mt::ConfigError(fmt::format(
              "--choice {}: unknown algorithm choice (expected static or measured)", choice));
        }
      } else if (a == "--shm-bytes" && i + 1 < argc) {
        mpi_options.shm_bytes_per_rank = std::stoull(argv[++i]);
      } else {
        throw mt::ConfigError(
            fmt::format("unknown argument '{}' (expected --algorithms, --only allreduce|allgather|"
                        "reducescatter, --shm-bytes N, --choice static|measured)",
                        a));
      }
    }
    mt::CommOptions options;
    options.name = "bench";
    auto comm = mt::make_mpi_communicator(options, mpi_options);
    std::string choice_fields = "\"algorithm_choice\": \"static\"";
    if (choice == "measured") {
      mt::comm::ProbeTable table;
      auto m = mt::comm::probe_algorithms(*comm, {}, &table);
      comm->reset_counters();
      if (m) {
        comm->set_measured_choice(m);
        choice_fields = fmt::format(
            "\"algorithm_choice\": \"measured\", \"probe_s\": {:.3f}, \"measured_choice\": "
            "\"{}\"",
            table.probe_seconds, m->describe());
        if (comm->rank() == 0) {
          std::fprintf(stderr, "comm_bench: measured choice (%s): %s\n", m->source.c_str(),
                       m->describe().c_str());
        }
      }
    }
    MPI_Comm mpi;
    MPI_Comm_dup(MPI_COMM_WORLD, &mpi);
    Bench bench{mpi, comm->rank(), comm->size(), quick ? 7 : 21};
    const int nranks = comm->size();
    const double n = nranks;
    const size_t max_bytes = quick ? (size_t{4} << 20) : (size_t{64} << 20);
    const std::string peer = rt.library();
    const std::string pml = env_or("OMPI_MCA_pml", "default");
    const std::string btl = env_or("OMPI_MCA_btl", "default");
    const std::string peer_transport =
        fmt::format("pml {}, btl {}{}", pml, btl,
                    btl.find("vader") != std::string::npos ? " (vader: shared memory)" : "");
    const std::string peer_coll =
        fmt::format("{} (which algorithm it uses per call is not reported)",
                    env_or("OMPI_MCA_coll", "default"));
    auto transport_of = [&](CommAlgorithm a) -> std::string {
      if (a == CommAlgorithm::shared_memory) {
        return fmt::format("shared-memory window (MPI_Win_allocate_shared, {} bytes per rank)",
                           mpi_options.shm_bytes_per_rank);
      }
      if (a == CommAlgorithm::native)
        return "Open MPI nonblocking collectives (" + peer_transport + ")";
      return "MPI point-to-point (" + peer_transport + ")";
    };

    std::vector<float> in(max_bytes / 4), out(max_bytes / 4), peer_out(max_bytes / 4);
    for (size_t i = 0; i < in.size(); ++i) in[i] = input_value(bench.rank, i);
    const float poison = std::numeric_limits<float>::quiet_NaN();

    // Median-based figures are the result; the best sample (min time) shows
    // what each side does when the shared machine leaves it alone.
    auto emit = [&](const std::string& name, size_t bytes, double factor, Bench::Stats mine,
                    Bench::Stats theirs, const std::string& peer_call, CommAlgorithm algo) {
      if (bench.rank != 0) return;
      auto bw = [&](double t) { return factor * static_cast<double>(bytes) / t / 1e9; };
      std::printf(
          "{\"suite\": \"comm\", \"name\": \"%s_bus_bw_%s\", \"unit\": \"GB/s\", "
          "\"meshtrain\": %.3f, \"peer\": %.3f, \"ratio\": %.3f, \"peer_name\": \"%s %s\", "
          "\"ranks\": %d, \"bytes\": %zu, \"meshtrain_us\": %.2f, \"peer_us\": %.2f, "
          "\"meshtrain_best\": %.3f, \"peer_best\": %.3f, \"algorithm\": \"%s\", "
          "\"meshtrain_transport\": \"%s\", \"peer_transport\": \"%s\", \"peer_coll\": \"%s\", "
          "\"checked\": \"exact values, and equal to Open MPI's, before and after timing\", "
          "\"dtype\": \"f32\", \"samples\": %d, \"loadavg_1m\": %.2f, %s}\n",
          name.c_str(), size_label(bytes).c_str(), bw(mine.median), bw(theirs.median),
          theirs.median / mine.median, peer.c_str(), peer_call.c_str(), bench.size, bytes,
          mine.median * 1e6, theirs.median * 1e6, bw(mine.min), bw(theirs.min),
          std::string(mt::algorithm_name(algo)).c_str(), transport_of(algo).c_str(),
          peer_transport.c_str(), peer_coll.c_str(), bench.samples, load_average(),
          choice_fields.c_str());
      std::fflush(stdout);
    };
    auto emit_value = [&](const std::string& name, size_t bytes, double factor, Bench::Stats t,
                          CommAlgorithm algo) {
      if (bench.rank != 0) return;
      auto bw = [&](double x) { return factor * static_cast<double>(bytes) / x / 1e9; };
      std::printf(
          "{\"suite\": \"comm\", \"name\": \"%s_bus_bw_%s_%s\", \"unit\": \"GB/s\", "
          "\"value\": %.3f, \"best\": %.3f, \"ranks\": %d, \"bytes\": %zu, \"us\": %.2f, "
          "\"algorithm\": \"%s\", \"meshtrain_transport\": \"%s\", "
          "\"checked\": \"exact values, and equal to Open MPI's, before and after timing\", "
          "\"loadavg_1m\": %.2f}\n",
          name.c_str(), size_label(bytes).c_str(), std::string(mt::algorithm_name(algo)).c_str(),
          bw(t.median), bw(t.min), bench.size, bytes, t.median * 1e6,
          std::string(mt::algorithm_name(algo)).c_str(), transport_of(algo).c_str(),
          load_average());
      std::fflush(stdout);
    };

    // One collective at one size: how to run it on each side and what every
    // element of its output must be.
    struct Case {
      std::string name;  // "allreduce"
      Collective kind;
      std::string peer_call;
      double factor;                                           // bus bandwidth = factor * bytes / t
      size_t out_count;                                        // elements of the output
      std::function<void(const mt::CollectiveOptions&)> mine;  // into out
      std::function<void()> theirs;                            // into peer_out
      std::function<float(size_t)> want;
    };
    // Runs each side once into poisoned outputs and checks both; then the
    // outputs of whatever ran last (after timing) are checked the same way.
    auto check = [&](const Case& c, size_t bytes, CommAlgorithm algo, bool run) {
      if (run) {
        std::fill_n(out.data(), c.out_count, poison);
        std::fill_n(peer_out.data(), c.out_count, poison);
        mt::CollectiveOptions o;
        o.algorithm = algo;
        c.mine(o);
        c.theirs();
      }
      std::string err = first_difference(out.data(), peer_out.data(), c.out_count, c.want);
      if (!err.empty()) {
        err = fmt::format("{} {} (f32, {} bytes, {} ranks, algorithm {}, {}), rank {}: {}", c.name,
                          size_label(bytes), bytes, nranks, mt::algorithm_name(algo),
                          run ? "checked before timing" : "output of the last timed call",
                          bench.rank, err);
      }
      agree(mpi, bench.rank, err);
    };

    for (size_t bytes = size_t{4} << 10; bytes <= max_bytes; bytes *= 4) {
      const size_t count = bytes / 4;
      const size_t block = count / static_cast<size_t>(bench.size);
      const int r = bench.rank;
      std::vector<Case> cases;
      // all-reduce: `bytes` is the buffer.
      cases.push_back({"allreduce", Collective::all_reduce, "MPI_Allreduce", 2 * (n - 1) / n, count,
                       [&](const mt::CollectiveOptions& o) {
                         comm->all_reduce(in.data(), out.data(), count, mt::DType::f32,
                                          mt::ReduceOp::sum, o);
                       },
                       [&] {
                         MPI_Allreduce(in.data(), peer_out.data(), static_cast<int>(count),
                                       MPI_FLOAT, MPI_SUM, mpi);
                       },
                       [&](size_t i) { return sum_over_ranks(nranks, i); }});
      // all-gather: `bytes` is the gathered buffer.
      cases.push_back(
          {"allgather", Collective::all_gather, "MPI_Allgather", (n - 1) / n,
           block * static_cast<size_t>(nranks),
           [&](const mt::CollectiveOptions& o) {
             comm->all_gather(in.data(), out.data(), block, mt::DType::f32, o);
           },
           [&] {
             MPI_Allgather(in.data(), static_cast<int>(block), MPI_FLOAT, peer_out.data(),
                           static_cast<int>(block), MPI_FLOAT, mpi);
           },
           [&](size_t i) { return input_value(static_cast<int>(i / block), i % block); }});
      // reduce-scatter: `bytes` is the scattered input.
      cases.push_back(
          {"reducescatter", Collective::reduce_scatter, "MPI_Reduce_scatter_block", (n - 1) / n,
           block,
           [&](const mt::CollectiveOptions& o) {
             comm->reduce_scatter(in.data(), out.data(), block, mt::DType::f32, mt::ReduceOp::sum,
                                  o);
           },
           [&] {
             MPI_Reduce_scatter_block(in.data(), peer_out.data(), static_cast<int>(block),
                                      MPI_FLOAT, MPI_SUM, mpi);
           },
           [&](size_t i) { return sum_over_ranks(nranks, static_cast<size_t>(r) * block + i); }});

      for (const Case& c : cases) {
        if (!only.empty() && only != c.name) continue;
        const CommAlgorithm chosen = comm->choose_algorithm(c.kind, bytes);
        check(c, bytes, chosen, true);
        auto [t_mt, t_peer] =
            bench.compare([&] { c.mine(mt::CollectiveOptions{}); }, [&] { c.theirs(); });
        check(c, bytes, chosen, false);
        emit(c.name, bytes, c.factor, t_mt, t_peer, c.peer_call, chosen);
      }
      if (algorithms) {
        for (CommAlgorithm a : {CommAlgorithm::ring, CommAlgorithm::halving_doubling,
                                CommAlgorithm::shared_memory, CommAlgorithm::native}) {
          mt::CollectiveOptions o;
          o.algorithm = a;
          for (const Case& c : cases) {
            if (!only.empty() && only != c.name) continue;
            check(c, bytes, a, true);
            const Bench::Stats t = bench.measure([&] { c.mine(o); });
            check(c, bytes, a, false);
            emit_value(c.name, bytes, c.factor, t, a);
          }
        }
      }
    }
    MPI_Comm_free(&mpi);
    comm.reset();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "comm_bench rank %d: %s\n", rank, e.what());
    if (rank == 0) {
      std::printf("{\"suite\": \"comm\", \"name\": \"comm_bench\", \"error\": \"%s\"}\n",
                  json_escape(e.what()).c_str());
      std::fflush(stdout);
    }
    return 1;
  }
}
