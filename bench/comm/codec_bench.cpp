// Compressed all-reduce benchmark (sync/compressed_all_reduce.h): the
// measurements behind its choices, and each codec's time and bytes.
//
//   mpirun -np 2 build/bench/comm/codec_bench [--quick]
//   bench/run codec [--np 4] [--quick]
//
// Rank 0 prints one JSON line per case:
//   sparse_exchange_<elements>_d<density>: a sparse codec at that density,
//     the whole run() (error feedback, selection, exchange, decode) with the
//     (index, value) all-gather ("value", ms) against the densified f32
//     all-reduce ("dense_all_reduce_ms"); "winner" names the faster. The
//     codec is rand-k without error feedback, whose selection is cheap (k
//     draws into a bitmap), so the time is the exchange's; top-k has the
//     same payload and exchange plus its selection and the residual passes,
//     "topk_encode_ms" (the same cost on both sides of the comparison).
//   cast_exchange_<dtype>_<elements>: f16 / bf16 all-reduced in the 16-bit
//     dtype ("value", ms) against all-gathered and summed in f32
//     ("all_gather_ms").
//   codec_<spec>_<elements>: each codec's run() on a 1024 x 1024 tensor (ms)
//     and the bytes this rank sent ("bytes_sent", the communicator's
//     counters, handshake included) next to "none"'s.
// Times: the median ("value", "..._ms") and the best ("value_best",
// "..._best_ms") over 21 samples (--quick: 5) of the slowest rank's time per
// call, ~5 ms of calls per sample, the two sides of a comparison sampled
// alternately so both see the same machine load.
//
// Every comparison is verified before it is timed: fresh instances of both
// exchanges run once on the same gradients and must agree (sparse: within
// f32 summation order, 1e-6 of the largest value; casts: within 8 roundings
// of the 16-bit dtype), and every rank must hold the same bits. A failure
// prints a line with an "error" and exits 1 on every rank.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "meshtrain/base/random.h"
#include "meshtrain/base/timer.h"
#include "meshtrain/comm/backends/mpi/mpi_communicator.h"
#include "meshtrain/sync/compressed_all_reduce.h"

namespace {

using namespace mt;

struct Bench {
  Communicator& comm;
  int samples;

  double slowest(double t) const {
    comm.all_reduce(&t, &t, 1, DType::f64, ReduceOp::max);
    return t;
  }
  double sample(const std::function<void()>& fn, int reps) const {
    comm.barrier();
    const int64_t t0 = now_ns();
    for (int i = 0; i < reps; ++i) fn();
    return slowest(static_cast<double>(now_ns() - t0) * 1e-9 / reps);
  }
  int reps_for(const std::function<void()>& fn) const {
    for (int i = 0; i < 2; ++i) fn();
    const double t = sample(fn, 2);
    return static_cast<int>(std::clamp(5e-3 / std::max(t, 1e-7), 1.0, 1000.0));
  }
  struct Stats {
    double median;
    double best;
  };
  static Stats stats(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return {v[v.size() / 2], v.front()};
  }
  std::pair<Stats, Stats> compare(const std::function<void()>& a,
                                  const std::function<void()>& b) const {
    const int ra = reps_for(a), rb = reps_for(b);
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

double load_average() {
  double l = -1;
  if (FILE* f = std::fopen("/proc/loadavg", "r")) {
    if (std::fscanf(f, "%lf", &l) != 1) l = -1;
    std::fclose(f);
  }
  return l;
}

std::vector<float> gradient(size_t n, int rank) {
  Rng rng(1234 + static_cast<uint64_t>(rank));
  std::vector<float> g(n);
  for (float& v : g) v = static_cast<float>(0.01 * rng.normal());
  return g;
}

std::string elements_label(size_t n) {
  if (n >= (size_t{1} << 20)) return fmt::format("{}M", n >> 20);
  return fmt::format("{}K", n >> 10);
}

class Failure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Throws Failure on every rank when any rank's outputs differ by more than
// `tol` or the ranks' first outputs differ.
void verify(Communicator& c, const std::string& what, const std::vector<float>& a,
            const std::vector<float>& b, double tol_rel) {
  double err = 0, mag = 0;
  size_t at = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = std::fabs(double{a[i]} - b[i]);
    if (d > err) {
      err = d;
      at = i;
    }
    mag = std::max(mag, std::fabs(double{a[i]}));
  }
  std::vector<float> all(a.size() * static_cast<size_t>(c.size()));
  c.all_gather(a.data(), all.data(), a.size(), DType::f32);
  int bad_rank = -1;
  for (int q = 0; q < c.size() && bad_rank < 0; ++q) {
    if (std::memcmp(all.data() + q * a.size(), a.data(), a.size() * 4) != 0) bad_rank = q;
  }
  double worst[2] = {err > tol_rel * mag ? 1.0 : 0.0, bad_rank >= 0 ? 1.0 : 0.0};
  c.all_reduce(worst, worst, 2, DType::f64, ReduceOp::max);
  if (worst[0] > 0 || worst[1] > 0) {
    throw Failure(
        fmt::format("{}: the two exchanges differ by up to {} (element {}, largest "
                    "value {}, tolerance {} relative) or ranks disagree (rank {})",
                    what, err, at, mag, tol_rel, bad_rank));
  }
}

void emit(Communicator& c, const std::string& json) {
  if (c.rank() == 0) std::printf("%s\n", json.c_str());
  std::fflush(stdout);
}

std::string context(Communicator& c) {
  return fmt::format(
      "\"ranks\": {}, \"meshtrain_transport\": \"{}\", \"loadavg_1m\": {:.2f}", c.size(),
      c.has_shared_memory() ? "Open MPI ranks, MPI-3 shared window (1 MiB per rank) and MPI "
                              "point-to-point, algorithm by size"
                            : "MPI point-to-point",
      load_average());
}

void sparse_crossover(Communicator& c, const Bench& b, size_t n) {
  const std::vector<float> g = gradient(n, c.rank());
  for (double density : {0.001, 0.003, 0.01, 0.03, 0.1, 0.2, 0.3, 0.5}) {
    CompressedAllReduceOptions ga, dn;
    ga.codec = dn.codec = parse_codec_spec(fmt::format("randk:{}", density));
    // Without error feedback run() is rand-k's O(k) draw plus the exchange:
    // the time is the exchange's, not the O(d) residual passes both share.
    ga.codec.error_feedback = dn.codec.error_feedback = false;
    dn.sparse_exchange = SparseExchange::dense_all_reduce;
    const Shape shape{static_cast<int64_t>(n)};
    const std::string name = fmt::format("sparse_exchange_{}_d{}", elements_label(n), density);
    {
      CompressedAllReduce a(c, "g", shape, ga), d(c, "g", shape, dn);
      std::vector<float> oa(n), od(n);
      a.run(g, oa);
      d.run(g, od);
      verify(c, name, oa, od, 1e-6);
    }
    CompressedAllReduce a(c, "g", shape, ga), d(c, "g", shape, dn);
    std::vector<float> out(n);
    const auto [t_gather, t_dense] = b.compare([&] { a.run(g, out); }, [&] { d.run(g, out); });
    FeedbackEncoder enc(make_payload_codec(parse_codec_spec(fmt::format("topk:{}", density)), n),
                        true);
    std::vector<std::byte> payload(enc.codec().payload_bytes());
    const double t_encode = b.measure([&] { enc.encode(g, 0, payload); }).median;
    const uint64_t sent_gather = a.predicted_traffic().bytes_sent;
    const uint64_t sent_dense = d.predicted_traffic().bytes_sent;
    emit(c, fmt::format("{{\"suite\": \"codec\", \"name\": \"{}\", \"unit\": \"ms\", "
                        "\"value\": {:.4f}, \"dense_all_reduce_ms\": {:.4f}, "
                        "\"value_best\": {:.4f}, \"dense_all_reduce_best_ms\": {:.4f}, "
                        "\"gather_over_dense\": {:.3f}, \"winner\": \"{}\", "
                        "\"topk_encode_ms\": {:.4f}, \"density\": {}, \"elements\": {}, "
                        "\"bytes_sent_all_gather\": {}, \"bytes_sent_dense\": {}, {}}}",
                        name, 1e3 * t_gather.median, 1e3 * t_dense.median, 1e3 * t_gather.best,
                        1e3 * t_dense.best, t_gather.median / t_dense.median,
                        t_gather.median <= t_dense.median ? "all_gather" : "dense_all_reduce",
                        1e3 * t_encode, density, n, sent_gather, sent_dense, context(c)));
  }
}

void cast_exchange(Communicator& c, const Bench& b, size_t n) {
  const std::vector<float> g = gradient(n, c.rank());
  for (const char* codec : {"f16", "bf16"}) {
    CompressedAllReduceOptions ar, ag;
    ar.codec = ag.codec = parse_codec_spec(codec);
    ag.cast_exchange = CastExchange::all_gather;
    const Shape shape{static_cast<int64_t>(n)};
    const std::string name = fmt::format("cast_exchange_{}_{}", codec, elements_label(n));
    {
      CompressedAllReduce x(c, "g", shape, ar), y(c, "g", shape, ag);
      std::vector<float> ox(n), oy(n);
      x.run(g, ox);
      y.run(g, oy);
      verify(c, name, ox, oy, 8 * (ar.codec.kind == CodecKind::f16 ? 0x1p-11 : 0x1p-8));
    }
    CompressedAllReduce x(c, "g", shape, ar), y(c, "g", shape, ag);
    std::vector<float> out(n);
    const auto [t_ar, t_ag] = b.compare([&] { x.run(g, out); }, [&] { y.run(g, out); });
    emit(c, fmt::format("{{\"suite\": \"codec\", \"name\": \"{}\", \"unit\": \"ms\", "
                        "\"value\": {:.4f}, \"all_gather_ms\": {:.4f}, \"value_best\": {:.4f}, "
                        "\"all_gather_best_ms\": {:.4f}, \"winner\": \"{}\", "
                        "\"elements\": {}, \"bytes_sent_all_reduce\": {}, "
                        "\"bytes_sent_all_gather\": {}, {}}}",
                        name, 1e3 * t_ar.median, 1e3 * t_ag.median, 1e3 * t_ar.best,
                        1e3 * t_ag.best, t_ar.median <= t_ag.median ? "all_reduce" : "all_gather",
                        n, x.predicted_traffic().bytes_sent, y.predicted_traffic().bytes_sent,
                        context(c)));
  }
}

void codecs(Communicator& c, const Bench& b) {
  const Shape shape{1024, 1024};
  const size_t n = 1024 * 1024;
  const std::vector<float> g = gradient(n, c.rank());
  uint64_t none_bytes = 0;
  for (const char* text : {"none", "f16", "bf16", "topk:0.01", "randk:0.01", "qsgd:4", "qsgd:2",
                           "sign", "powersgd:4"}) {
    CompressedAllReduceOptions o;
    o.codec = parse_codec_spec(text);
    CompressedAllReduce car(c, "g", shape, o);
    std::vector<float> out(n);
    car.run(g, out);
    c.reset_counters();
    car.run(g, out);
    const uint64_t sent = c.counters().total_sent();
    if (sent != car.predicted_traffic().total_sent()) {
      throw Failure(fmt::format("codec {}: counted {} bytes sent, predicted {}", text, sent,
                                car.predicted_traffic().total_sent()));
    }
    verify(c, text, out, out, 0);  // every rank the same bits
    if (o.codec.kind == CodecKind::none) none_bytes = sent;
    const Bench::Stats t = b.measure([&] { car.run(g, out); });
    emit(c,
         fmt::format("{{\"suite\": \"codec\", \"name\": \"codec_{}_1M\", \"unit\": \"ms\", "
                     "\"value\": {:.4f}, \"value_best\": {:.4f}, \"bytes_sent\": {}, "
                     "\"bytes_sent_none\": {}, "
                     "\"compression\": {:.1f}, \"elements\": {}, {}}}",
                     text, 1e3 * t.median, 1e3 * t.best, sent, none_bytes,
                     static_cast<double>(none_bytes) / static_cast<double>(sent), n, context(c)));
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = std::getenv("MT_BENCH_QUICK") != nullptr;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--quick") quick = true;
  }
  auto comm = make_mpi_communicator();
  Bench b{*comm, quick ? 5 : 21};
  try {
    const std::vector<size_t> sizes =
        quick ? std::vector<size_t>{size_t{1} << 20}
              : std::vector<size_t>{size_t{1} << 18, size_t{1} << 20, size_t{1} << 22};
    for (size_t n : sizes) sparse_crossover(*comm, b, n);
    for (size_t n : sizes) cast_exchange(*comm, b, n);
    codecs(*comm, b);
  } catch (const Failure& e) {
    std::string msg = e.what();
    std::replace(msg.begin(), msg.end(), '"', '\'');
    emit(*comm, fmt::format(
                    "{{\"suite\": \"codec\", \"name\": \"codec_bench\", \"error\": \"{}\"}}", msg));
    return 1;
  }
  return 0;
}
