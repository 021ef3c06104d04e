// Collective benchmark: meshtrain's all-reduce, all-gather and reduce-scatter
// against Open MPI's MPI_Allreduce / MPI_Allgather / MPI_Reduce_scatter_block
// on the same f32 buffers, sizes 4 KiB .. 64 MiB (powers of 4).
//
//   mpirun -np 2 build/bench/comm/comm_bench [--algorithms] [--only allreduce]
//       [--shm-bytes N]
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
// (automatic algorithm, handshake on). --algorithms adds value lines for each
// explicit algorithm (the measurements behind the automatic policy).
// MT_BENCH_QUICK=1 stops at 4 MiB with fewer samples.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "meshtrain/comm/backends/mpi/mpi_communicator.h"
#include "meshtrain/comm/backends/mpi/mpi_runtime.h"

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

}  // namespace

int main(int argc, char** argv) {
  try {
    mt::MpiRuntime& rt = mt::MpiRuntime::instance();
    const bool quick = std::getenv("MT_BENCH_QUICK") != nullptr;
    bool algorithms = false;
    std::string only;
    mt::MpiOptions mpi_options;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--algorithms") {
        algorithms = true;
      } else if (a == "--only" && i + 1 < argc) {
        only = argv[++i];
      } else if (a == "--shm-bytes" && i + 1 < argc) {
        mpi_options.shm_bytes_per_rank = std::stoull(argv[++i]);

      } else {
        throw mt::ConfigError(
            fmt::format("unknown argument '{}' (expected --algorithms, --only allreduce|allgather|"
                        "reducescatter, --shm-bytes N)",
                        a));
      }
    }
    auto wanted = [&](const char* name) { return only.empty() || only == name; };
    mt::CommOptions options;
    options.name = "bench";
    auto comm = mt::make_mpi_communicator(options, mpi_options);
    MPI_Comm mpi;
    MPI_Comm_dup(MPI_COMM_WORLD, &mpi);
    Bench bench{mpi, comm->rank(), comm->size(), quick ? 7 : 21};
    const double n = comm->size();
    const size_t max_bytes = quick ? (size_t{4} << 20) : (size_t{64} << 20);
    const std::string peer = rt.library();

    std::vector<float> in(max_bytes / 4), out(max_bytes / 4);
    for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<float>(i % 1000) * 0.25f;

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
          "\"dtype\": \"f32\", \"samples\": %d, \"loadavg_1m\": %.2f}\n",
          name.c_str(), size_label(bytes).c_str(), bw(mine.median), bw(theirs.median),
          theirs.median / mine.median, peer.c_str(), peer_call.c_str(), bench.size, bytes,
          mine.median * 1e6, theirs.median * 1e6, bw(mine.min), bw(theirs.min),
          std::string(mt::algorithm_name(algo)).c_str(), bench.samples, load_average());
      std::fflush(stdout);
    };
    auto emit_value = [&](const std::string& name, size_t bytes, double factor, Bench::Stats t,
                          CommAlgorithm algo) {
      if (bench.rank != 0) return;
      auto bw = [&](double x) { return factor * static_cast<double>(bytes) / x / 1e9; };
      std::printf(
          "{\"suite\": \"comm\", \"name\": \"%s_bus_bw_%s_%s\", \"unit\": \"GB/s\", "
          "\"value\": %.3f, \"best\": %.3f, \"ranks\": %d, \"bytes\": %zu, \"us\": %.2f, "
          "\"algorithm\": \"%s\", \"loadavg_1m\": %.2f}\n",
          name.c_str(), size_label(bytes).c_str(), std::string(mt::algorithm_name(algo)).c_str(),
          bw(t.median), bw(t.min), bench.size, bytes, t.median * 1e6,
          std::string(mt::algorithm_name(algo)).c_str(), load_average());
      std::fflush(stdout);
    };

    for (size_t bytes = size_t{4} << 10; bytes <= max_bytes; bytes *= 4) {
      const size_t count = bytes / 4;
      const size_t block = count / static_cast<size_t>(bench.size);
      // all-reduce: `bytes` is the buffer.
      if (wanted("allreduce")) {
        auto mine = [&] { comm->all_reduce(in.data(), out.data(), count, mt::DType::f32); };
        auto theirs = [&] {
          MPI_Allreduce(in.data(), out.data(), static_cast<int>(count), MPI_FLOAT, MPI_SUM, mpi);
        };
        auto [t_mt, t_peer] = bench.compare(mine, theirs);
        emit("allreduce", bytes, 2 * (n - 1) / n, t_mt, t_peer, "MPI_Allreduce",
             comm->choose_algorithm(Collective::all_reduce, bytes));
      }
      // all-gather: `bytes` is the gathered buffer.
      if (wanted("allgather")) {
        auto mine = [&] { comm->all_gather(in.data(), out.data(), block, mt::DType::f32); };
        auto theirs = [&] {
          MPI_Allgather(in.data(), static_cast<int>(block), MPI_FLOAT, out.data(),
                        static_cast<int>(block), MPI_FLOAT, mpi);
        };
        auto [t_mt, t_peer] = bench.compare(mine, theirs);
        emit("allgather", bytes, (n - 1) / n, t_mt, t_peer, "MPI_Allgather",
             comm->choose_algorithm(Collective::all_gather, bytes));
      }
      // reduce-scatter: `bytes` is the scattered input.
      if (wanted("reducescatter")) {
        auto mine = [&] { comm->reduce_scatter(in.data(), out.data(), block, mt::DType::f32); };
        auto theirs = [&] {
          MPI_Reduce_scatter_block(in.data(), out.data(), static_cast<int>(block), MPI_FLOAT,
                                   MPI_SUM, mpi);
        };
        auto [t_mt, t_peer] = bench.compare(mine, theirs);
        emit("reducescatter", bytes, (n - 1) / n, t_mt, t_peer, "MPI_Reduce_scatter_block",
             comm->choose_algorithm(Collective::reduce_scatter, bytes));
      }
      if (algorithms) {
        for (CommAlgorithm a : {CommAlgorithm::ring, CommAlgorithm::halving_doubling,
                                CommAlgorithm::shared_memory, CommAlgorithm::native}) {
          mt::CollectiveOptions o;
          o.algorithm = a;
          emit_value("allreduce", bytes, 2 * (n - 1) / n, bench.measure([&] {
            comm->all_reduce(in.data(), out.data(), count, mt::DType::f32, mt::ReduceOp::sum, o);
          }),
                     a);
          emit_value("allgather", bytes, (n - 1) / n, bench.measure([&] {
            comm->all_gather(in.data(), out.data(), block, mt::DType::f32, o);
          }),
                     a);
          emit_value("reducescatter", bytes, (n - 1) / n, bench.measure([&] {
            comm->reduce_scatter(in.data(), out.data(), block, mt::DType::f32, mt::ReduceOp::sum,
                                 o);
          }),
                     a);
        }
      }
    }
    MPI_Comm_free(&mpi);
    comm.reset();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "comm_bench: %s\n", e.what());
    return 1;
  }
}
