// `meshtrain calibrate`: measures this machine and writes its cluster file
// (docs/cluster.md, docs/planner-search.md):
//   - kernel throughput per operator kind and size, from the executor's own
//     per-operator profile (exec/executor.h) over forward + backward of a few
//     model graphs at a few sizes (the fastest of a few runs); the device's f32 peak is taken to be
//     the best matmul throughput measured (a CPU has no datasheet figure the kernels reach), and
//     every operator's efficiency is its throughput over that peak;
//   - memory bandwidth (a large copy) and memory per rank (MemAvailable /
//     ranks);
//   - alpha / beta of each collective algorithm over the link kind the job's
//     ranks share (intra_node on one machine), from the communicator's own
//     algorithms at a few sizes: a least-squares fit of
//     time = steps x latency + bytes / bandwidth, with steps and bytes from
//     the algorithm's cost function (comm/cost.h), the form the cost model
//     prices them in.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mt {

struct CalibrationFit {
  double latency_s = 0;
  double bandwidth_bytes_s = 0;
  double rms_rel_error = 0;  // of the fit over the measurements
};

// Least squares of t_k = steps_k x L + bytes_k / W over the measurements
// (relative: weighted by 1 / t_k^2),
// with L >= 0 and W > 0 (L = 0 refitted when the free fit gives L < 0).
// Throws ConfigError when the bytes do not determine W (all 0, or W <= 0).
CalibrationFit fit_alpha_beta(const std::vector<double>& steps, const std::vector<double>& bytes,
                              const std::vector<double>& seconds);

}  // namespace mt
