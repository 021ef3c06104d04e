// SpMM bandwidth next to a STREAM-like ceiling measured in the same process
// (`bench/run gnn` runs it; see bench/suites/gnn.py).
//
//   build/bench/spmm_stream_bench --graph G.safetensors --threads 2 [--width 64]
//       [--reps 10] [--stream-mb 256]
//
// STREAM-like: copy (c[i] = a[i]) and triad (a[i] = b[i] + s * c[i]) over f32
// arrays of --stream-mb MiB each (far larger than the last-level cache), on
// --threads OpenMP threads, each thread first-touching the part it later
// streams; bytes counted as STREAM does (copy 2, triad 3 array sweeps; the
// write-allocate read is not counted).
//
// SpMM: the fast backend's kernel (what GCN runs) on the graph's adjacency
// with self-loops and GCN's normalisation values, times a random [n, width]
// matrix, on --threads threads. The bytes it must move: row pointers
// (n + 1) x 4, column indices and values nnz x 4 each, one gathered dense
// row per entry nnz x width x 4, the output n x width x 4. A second count,
// the compulsory traffic, reads each dense row once (n x width x 4 instead
// of the gathers): the gathers that hit in cache are the gap between them.
//
// Both are timed --reps times after one untimed pass; the medians (and the
// best) are printed as one JSON line, from wall time and (the *_cpu fields)
// from the process's CPU time per thread, which leaves out the time slices
// other processes took on a shared machine. The SpMM result is checked against a
// plain double-precision loop on a sample of rows, the STREAM arrays against
// their closed form: a wrong result is an error (exit 1), not a figure.
#include <omp.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "meshtrain/tensor/backends/fast/fast_kernels.h"
#include "meshtrain/tensor/sparse.h"
#include "meshtrain/train/graph_file.h"

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double process_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// One timed region: wall seconds, and the process's CPU seconds divided by
// the thread count -- the time the region would take had its threads had
// the cores to themselves (on a shared machine the wall time also counts
// the slices other processes took; cache and memory contention stay in both).
struct Interval {
  Clock::time_point w0 = Clock::now();
  double c0 = process_cpu_seconds();
  std::pair<double, double> stop(int threads) const {
    return {seconds_since(w0), (process_cpu_seconds() - c0) / threads};
  }
};

struct Stats {
  double median = 0, best = 0;
};

Stats stats(std::vector<double> t) {
  std::sort(t.begin(), t.end());
  const size_t n = t.size();
  return {n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]), t.front()};
}

struct Args {
  std::string graph;
  int threads = 1;
  int64_t width = 64;
  int reps = 10;
  int64_t stream_mb = 256;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "spmm_stream_bench: %s\nusage: spmm_stream_bench --graph FILE [--threads N] "
               "[--width F] [--reps R] [--stream-mb M]\n",
               why.c_str());
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (i + 1 >= argc) usage("option '" + k + "' needs a value");
    const std::string v = argv[++i];
    if (k == "--graph")
      a.graph = v;
    else if (k == "--threads")
      a.threads = std::atoi(v.c_str());
    else if (k == "--width")
      a.width = std::atoll(v.c_str());
    else if (k == "--reps")
      a.reps = std::atoi(v.c_str());
    else if (k == "--stream-mb")
      a.stream_mb = std::atoll(v.c_str());
    else
      usage("unknown option '" + k + "'");
  }
  if (a.graph.empty()) usage("--graph is required");
  if (a.threads < 1 || a.width < 1 || a.reps < 1 || a.stream_mb < 1)
    usage("--threads, --width, --reps and --stream-mb must be positive");
  return a;
}

struct StreamRates {
  Stats copy, triad;           // bytes/s from wall time: median, best
  double copy_cpu, triad_cpu;  // bytes/s from CPU time per thread, median
};

double median_of(std::vector<double> v) {
  return stats(std::move(v)).median;
}

// STREAM-like copy and triad.
StreamRates stream(const Args& a) {
  const int64_t n = a.stream_mb * (int64_t{1} << 20) / 4;
  // Untouched allocations: the first parallel sweep places the pages.
  std::unique_ptr<float[]> pa(new float[n]), pb(new float[n]), pc(new float[n]);
  float *x = pa.get(), *y = pb.get(), *z = pc.get();
  const int t = a.threads;
#pragma omp parallel for num_threads(t) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    x[i] = 1.0f;
    y[i] = 2.0f;
    z[i] = 0.0f;
  }
  const float s = 3.0f;
  std::vector<double> copy, triad, copy_cpu, triad_cpu;
  for (int r = 0; r <= a.reps; ++r) {
    const Interval ic;
#pragma omp parallel for num_threads(t) schedule(static)
    for (int64_t i = 0; i < n; ++i) z[i] = x[i];
    const auto [tc, tc_cpu] = ic.stop(t);
    const Interval it;
#pragma omp parallel for num_threads(t) schedule(static)
    for (int64_t i = 0; i < n; ++i) x[i] = y[i] + s * z[i];
    const auto [tt, tt_cpu] = it.stop(t);
    if (r > 0) {
      copy.push_back(2.0 * 4 * static_cast<double>(n) / tc);
      triad.push_back(3.0 * 4 * static_cast<double>(n) / tt);
      copy_cpu.push_back(2.0 * 4 * static_cast<double>(n) / tc_cpu);
      triad_cpu.push_back(3.0 * 4 * static_cast<double>(n) / tt_cpu);
    }
    // After this pass z = 1 (the copy of x) and x = y + s z: check a strided sample.
    for (int64_t i = 0; i < n; i += 4099) {
      if (z[i] != 1.0f || x[i] != 2.0f + s * 1.0f) {
        std::fprintf(stderr, "spmm_stream_bench: STREAM arrays wrong at %lld\n",
                     static_cast<long long>(i));
        std::exit(1);
      }
    }
    // Reset x for the next pass's copy.
#pragma omp parallel for num_threads(t) schedule(static)
    for (int64_t i = 0; i < n; ++i) x[i] = 1.0f;
  }
  // Rates: the median of the rates is the rate at the median time.
  Stats c = stats(copy), tr = stats(triad);
  std::sort(copy.begin(), copy.end());
  std::sort(triad.begin(), triad.end());
  c.best = copy.back();
  tr.best = triad.back();
  return {c, tr, median_of(copy_cpu), median_of(triad_cpu)};
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  mt::GraphData g;
  try {
    g = mt::load_graph(a.graph);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "spmm_stream_bench: %s\n", e.what());
    return 1;
  }
  const mt::Csr adj = mt::with_self_loops(g.adj);
  const std::vector<float> w = mt::gcn_norm_values(adj);
  const int64_t n = adj.rows, nnz = adj.nnz(), f = a.width;
  mt::Tensor rp = mt::tensor_from(adj.row_ptr), ci = mt::tensor_from(adj.col_idx),
             wt = mt::tensor_from(w);
  mt::Tensor x = mt::Tensor::empty(mt::Shape{n, f}, mt::DType::f32);
  mt::Tensor y = mt::Tensor::empty(mt::Shape{n, f}, mt::DType::f32);
  {
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    float* px = x.data<float>();
    for (int64_t i = 0; i < n * f; ++i) px[i] = u(rng);
  }
  std::vector<double> times, cpu_times;
  for (int r = 0; r <= a.reps; ++r) {
    const Interval iv;
    mt::fast::spmm(rp, ci, wt, x, y, a.threads);
    const auto [wall, cpu] = iv.stop(a.threads);
    if (r > 0) {
      times.push_back(wall);
      cpu_times.push_back(cpu);
    }
  }
  // Check a sample of rows (every row of a small graph) in double precision.
  {
    const float* px = x.data<float>();
    const float* py = y.data<float>();
    const int64_t step = std::max<int64_t>(1, n / 2000);
    for (int64_t i = 0; i < n; i += step) {
      for (int64_t j = 0; j < f; ++j) {
        double want = 0, mag = 0;
        for (int32_t e = adj.row_ptr[i]; e < adj.row_ptr[i + 1]; ++e) {
          const double term = static_cast<double>(w[e]) * px[adj.col_idx[e] * f + j];
          want += term;
          mag += std::fabs(term);
        }
        if (std::fabs(py[i * f + j] - want) > 1e-5 * (mag + 1e-30) + 1e-30) {
          std::fprintf(stderr, "spmm_stream_bench: spmm row %lld column %lld is %g, want %g\n",
                       static_cast<long long>(i), static_cast<long long>(j), py[i * f + j], want);
          return 1;
        }
      }
    }
  }
  const Stats st = stats(times);
  const double must = 4.0 * static_cast<double>((n + 1) + 2 * nnz + nnz * f + n * f);
  const double compulsory = 4.0 * static_cast<double>((n + 1) + 2 * nnz + 2 * n * f);
  const double spmm_cpu_s = median_of(cpu_times);
  const StreamRates sr = stream(a);
  const Stats& copy = sr.copy;
  const Stats& triad = sr.triad;
  const double spmm_bw = must / st.median;
  std::printf(
      "{\"graph_name\": \"%s\", \"vertices\": %lld, \"entries\": %lld, \"width\": %lld, "
      "\"threads\": %d, \"spmm_median_ms\": %.4f, \"spmm_best_ms\": %.4f, "
      "\"spmm_bytes\": %.0f, \"spmm_compulsory_bytes\": %.0f, "
      "\"spmm_gbs\": %.3f, \"spmm_compulsory_gbs\": %.3f, \"spmm_best_gbs\": %.3f, "
      "\"stream_copy_gbs\": %.3f, \"stream_triad_gbs\": %.3f, "
      "\"stream_copy_best_gbs\": %.3f, \"stream_triad_best_gbs\": %.3f, "
      "\"stream_array_mib\": %lld, \"fraction_of_triad\": %.4f, "
      "\"compulsory_fraction_of_triad\": %.4f, \"spmm_cpu_ms\": %.4f, \"spmm_cpu_gbs\": %.3f, "
      "\"stream_triad_cpu_gbs\": %.3f, \"stream_copy_cpu_gbs\": %.3f, "
      "\"fraction_of_triad_cpu\": %.4f, \"reps\": %d}\n",
      g.name.c_str(), static_cast<long long>(n), static_cast<long long>(nnz),
      static_cast<long long>(f), a.threads, 1e3 * st.median, 1e3 * st.best, must, compulsory,
      1e-9 * spmm_bw, 1e-9 * compulsory / st.median, 1e-9 * must / st.best, 1e-9 * copy.median,
      1e-9 * triad.median, 1e-9 * copy.best, 1e-9 * triad.best, static_cast<long long>(a.stream_mb),
      spmm_bw / triad.median, compulsory / st.median / triad.median, 1e3 * spmm_cpu_s,
      1e-9 * must / spmm_cpu_s, 1e-9 * sr.triad_cpu, 1e-9 * sr.copy_cpu,
      must / spmm_cpu_s / sr.triad_cpu, a.reps);
  return 0;
}
