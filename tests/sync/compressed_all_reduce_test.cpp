// CompressedAllReduce over local ranks (threads): "none" equals the plain
// all-reduce bitwise; every codec gives every rank the same bits, equal to
// the average of what the ranks sent; the byte counters equal
// predict_traffic() exactly (with and without shared memory, 1..4 ranks);
// sparse codecs go as an all-gather, never as an all-reduce; PowerSGD is
// exact on a matrix of rank r at rank >= r, its warm start converges to the
// best rank-r approximation, and its residual + result == input.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "meshtrain/base/error.h"
#include "meshtrain/base/random.h"
#include "meshtrain/comm/backends/local/local_world.h"
#include "meshtrain/sync/compressed_all_reduce.h"

namespace mt {
namespace {

std::vector<float> normal_vector(size_t n, uint64_t seed, double scale = 1.0) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(scale * rng.normal());
  return v;
}

LocalWorldOptions world(int n, bool shm) {
  LocalWorldOptions o;
  o.size = n;
  o.shm_bytes_per_rank = shm ? 64 * 1024 : 0;
  o.comm.timeout = std::chrono::milliseconds(30'000);
  return o;
}

CompressedAllReduceOptions with(const char* codec) {
  CompressedAllReduceOptions o;
  o.codec = parse_codec_spec(codec);
  return o;
}

// Every rank's `v`, gathered (rank-major).
std::vector<float> gather(Communicator& c, std::span<const float> v) {
  std::vector<float> all(v.size() * static_cast<size_t>(c.size()));
  c.all_gather(v.data(), all.data(), v.size(), DType::f32);
  return all;
}

const char* const kCodecs[] = {"none",
                               "f16",
                               "bf16",
                               "topk:0.01",
                               "topk:37",
                               "randk:0.02",
                               "qsgd:4",
                               "qsgd:2:0",
                               "sign",
                               "sign:100",
                               "powersgd:2",
                               "topk:0.01:compact",
                               "randk:0.02:compact"};

TEST(CompressedAllReduce, NoneEqualsThePlainAllReduce) {
  for (bool shm : {false, true}) {
    LocalWorld::run(world(3, shm), [&](Communicator& c) {
      const Shape shape{50, 41};
      CompressedAllReduce car(c, "w", shape, with("none"));
      for (uint64_t step = 0; step < 2; ++step) {
        const std::vector<float> g = normal_vector(2050, 10 * step + c.rank());
        std::vector<float> out(g.size()), plain = g;
        car.run(g, out);
        c.all_reduce(plain.data(), plain.data(), plain.size(), DType::f32, ReduceOp::avg);
        ASSERT_EQ(out, plain);
      }
      EXPECT_TRUE(car.residual().empty());
    });
  }
}

// Runs `steps` calls of `codec` on `shape` and checks that every rank gets
// the same bits, and that they are the average of what the ranks sent: rank
// r sent e_r - residual_r (e_r = its gradient + its residual before the
// call; exact for the payload codecs by the error-feedback identity).
// PowerSGD sends factors, not a per-rank tensor: only the first check.
void check_average(Communicator& c, const char* codec, const Shape& shape, int steps) {
  const int n = c.size();
  const auto numel = static_cast<size_t>(shape.numel());
  const std::string where =
      fmt::format("{} on {} elements at {} ranks, rank {}", codec, numel, n, c.rank());
  CompressedAllReduce car(c, "w", shape, with(codec));
  std::vector<float> residual(numel, 0.0f);
  for (int step = 0; step < steps; ++step) {
    const std::vector<float> g = normal_vector(numel, 1000 * step + c.rank(), 0.1);
    std::vector<float> out(numel, -1.0f);
    car.run(g, out);
    const std::vector<float> all = gather(c, out);
    for (int q = 0; q < n; ++q) {
      for (size_t i = 0; i < numel; ++i) {
        if (all[q * numel + i] != out[i]) {
          throw std::runtime_error(fmt::format("{} step {}: rank {} has {} at {}, this rank {}",
                                               where, step, q, all[q * numel + i], i, out[i]));
        }
      }
    }
    if (car.options().codec.kind == CodecKind::powersgd) continue;
    std::vector<float> sent = g;
    if (!car.residual().empty()) {
      for (size_t i = 0; i < numel; ++i) sent[i] = g[i] + residual[i] - car.residual()[i];
      residual.assign(car.residual().begin(), car.residual().end());
    }
    const std::vector<float> sents = gather(c, sent);
    double max_err = 0, max_mag = 0;
    for (size_t i = 0; i < numel; ++i) {
      double avg = 0;
      for (int q = 0; q < n; ++q) avg += sents[q * numel + i];
      avg /= n;
      max_err = std::max(max_err, std::fabs(avg - out[i]));
      max_mag = std::max(max_mag, std::fabs(avg));
    }
    // f32 sums (and, for the casts reduced in 16 bits, one rounding to the
    // cast's precision per combine, up to n - 1 of them).
    const CodecKind k = car.options().codec.kind;
    const double tol = k == CodecKind::bf16  ? 8 * 0x1p-8 * max_mag
                       : k == CodecKind::f16 ? 8 * 0x1p-11 * max_mag
                                             : 1e-5 * max_mag;
    if (!(max_err <= tol)) {
      throw std::runtime_error(
          fmt::format("{} step {}: result differs from the average of what was sent by {} "
                      "(tolerance {})",
                      where, step, max_err, tol));
    }
  }
}

TEST(CompressedAllReduce, EveryRankGetsTheAverageOfWhatWasSent) {
  for (const char* codec : kCodecs) {
    for (int n : {1, 2, 3, 4}) {
      LocalWorld::run(world(n, n != 3), [&](Communicator& c) {
        check_average(c, codec, Shape{40, 30}, 3);
      });
    }
  }
}

// Bit-packing tails, a single element, k == numel, PowerSGD's dense fallback.
TEST(CompressedAllReduce, TinyTensors) {
  LocalWorld::run(world(3, true), [&](Communicator& c) {
    for (const Shape& shape : {Shape{1}, Shape{7}, Shape{3, 3}, Shape{}}) {
      for (const char* codec : {"none", "f16", "bf16", "topk:1", "randk:1", "topk:1.0", "qsgd:3",
                                "qsgd:8:2", "sign", "sign:4", "powersgd:1"}) {
        check_average(c, codec, shape, 2);
      }
    }
  });
}

// Error feedback with QSGD stays bounded: QSGD's error variance is up to
// omega ||e||^2 with omega > 1 here (b = 1200 elements, s = 7 levels:
// omega = min(b / s^2, sqrt(b) / s) = 4.95), so unscaled the residual grew
// by about sqrt(omega) per call (inf within 100 calls; the MLP on
// Fashion-MNIST diverged near step 88). Scaled by 1 / (1 + omega) it is a
// contraction with delta = 1 / (1 + omega), and for a constant gradient g
// the residual stays below about 2 (1 + omega) ||g||; what the ranks
// received over T calls is T x the average g minus the average residual.
TEST(CompressedAllReduce, QsgdErrorFeedbackStaysBounded) {
  for (const char* codec : {"qsgd:4", "qsgd:4:256", "qsgd:2"}) {
    LocalWorld::run(world(2, true), [&](Communicator& c) {
      const Shape shape{40, 30};
      const auto numel = static_cast<size_t>(shape.numel());
      const CodecSpec spec = parse_codec_spec(codec);
      const double b = spec.chunk == 0 ? static_cast<double>(numel)
                                       : static_cast<double>(std::min(spec.chunk, numel));
      const double s = (1 << (spec.bits - 1)) - 1;
      const double omega = std::min(b / (s * s), std::sqrt(b) / s);
      ASSERT_GT(omega, 1.0) << codec;  // where unscaled QSGD does not contract
      CompressedAllReduce car(c, "w", shape, with(codec));
      const std::vector<float> g = normal_vector(numel, 7 + c.rank(), 0.1);
      double g2 = 0;
      for (float x : g) g2 += static_cast<double>(x) * x;
      std::vector<double> sum(numel, 0.0);
      std::vector<float> out(numel);
      constexpr int kCalls = 100;
      double worst = 0;
      for (int t = 0; t < kCalls; ++t) {
        car.run(g, out);
        for (size_t i = 0; i < numel; ++i) sum[i] += out[i];
        double r2 = 0;
        for (float x : car.residual()) r2 += static_cast<double>(x) * x;
        worst = std::max(worst, std::sqrt(r2 / g2));
      }
      EXPECT_LE(worst, 2 * (1 + omega)) << codec << ": ||residual|| / ||g|| over the calls";
      // The average over calls approaches the ranks' average gradient.
      const std::vector<float> all = gather(c, g);
      double err = 0, mag = 0;
      for (size_t i = 0; i < numel; ++i) {
        const double want = (all[i] + all[numel + i]) / 2.0;
        err += (sum[i] / kCalls - want) * (sum[i] / kCalls - want);
        mag += want * want;
      }
      EXPECT_LE(std::sqrt(err / mag), 2 * (1 + omega) / kCalls * 1.5) << codec;
    });
  }
}

// The byte counters of the calls of run() equal predict_traffic() exactly,
// per collective and for the handshake, for both exchanges of the casts and
// of the sparse codecs, with and without a shared-memory window, at sizes
// on both sides of the algorithm policy's thresholds.
TEST(CompressedAllReduce, CountedBytesEqualThePrediction) {
  struct Variant {
    const char* codec;
    CastExchange cast = CastExchange::all_reduce;
    SparseExchange sparse = SparseExchange::all_gather;
    CommAlgorithm algorithm = CommAlgorithm::automatic;
  };
  std::vector<Variant> variants;
  for (const char* codec : kCodecs) variants.push_back({codec});
  variants.push_back({"f16", CastExchange::all_gather});
  variants.push_back({"bf16", CastExchange::all_gather});
  variants.push_back({"topk:0.01", CastExchange::all_reduce, SparseExchange::dense_all_reduce});
  variants.push_back({"powersgd:40", CastExchange::all_reduce});  // not worth it: dense
  // An algorithm the caller names instead of the policy's choice.
  for (CommAlgorithm a : {CommAlgorithm::ring, CommAlgorithm::halving_doubling}) {
    variants.push_back({"bf16", CastExchange::all_reduce, SparseExchange::all_gather, a});
    variants.push_back({"topk:0.01", CastExchange::all_reduce, SparseExchange::all_gather, a});
    variants.push_back({"powersgd:2", CastExchange::all_reduce, SparseExchange::all_gather, a});
  }
  for (int n : {1, 2, 3, 4}) {
    for (bool shm : {false, true}) {
      LocalWorld::run(world(n, shm), [&](Communicator& c) {
        for (const Shape& shape : {Shape{40, 30}, Shape{400, 300}}) {
          const auto numel = static_cast<size_t>(shape.numel());
          for (const Variant& v : variants) {
            CompressedAllReduceOptions o = with(v.codec);
            o.cast_exchange = v.cast;
            o.sparse_exchange = v.sparse;
            o.collective.algorithm = v.algorithm;
            CompressedAllReduce car(c, "w", shape, o);
            const std::vector<float> g = normal_vector(numel, c.rank());
            std::vector<float> out(numel);
            c.reset_counters();
            car.run(g, out);
            car.run(g, out);
            const CommCounters got = c.counters();
            const CodecTraffic want = car.predicted_traffic();
            uint64_t sent = 0, received = 0, hs_sent = 0, hs_received = 0, calls = 0;
            for (const auto& [key, counter] : got.by_collective) {
              if (key == "handshake") {
                hs_sent += counter.bytes_sent;
                hs_received += counter.bytes_received;
              } else {
                sent += counter.bytes_sent;
                received += counter.bytes_received;
                calls += counter.calls;
              }
            }
            const std::string where =
                fmt::format("{} algorithm {} {} ranks shm {} shape {}x{} rank {}", v.codec,
                            algorithm_name(v.algorithm), n, shm, shape[0], shape[1], c.rank());
            if (sent != 2 * want.bytes_sent || received != 2 * want.bytes_received ||
                hs_sent != 2 * want.handshake_bytes_sent ||
                hs_received != 2 * want.handshake_bytes_received ||
                calls != 2 * static_cast<uint64_t>(want.calls) ||
                got.total_sent() != 2 * want.total_sent()) {
              throw std::runtime_error(fmt::format(
                  "{}: counted {} sent / {} received / {} handshake / {} calls over 2 runs, "
                  "predicted {} / {} / {} / {} per run",
                  where, sent, received, hs_sent, calls, want.bytes_sent, want.bytes_received,
                  want.handshake_bytes_sent, want.calls));
            }
            // The pure prediction (no communicator) says the same; the
            // local backend's slot is half of shm_bytes_per_rank.
            const CodecTraffic pure =
                predict_traffic(car.plan(), n, c.rank(), shm ? 64 * 1024 / 2 : 0,
                                c.options().policy, c.options().handshake, v.algorithm);
            if (pure.bytes_sent != want.bytes_sent || pure.bytes_received != want.bytes_received ||
                pure.handshake_bytes_sent != want.handshake_bytes_sent ||
                pure.handshake_bytes_received != want.handshake_bytes_received) {
              throw std::runtime_error(fmt::format(
                  "{}: the pure prediction says {} / {} / {}, the communicator's {} / {} / {}",
                  where, pure.bytes_sent, pure.bytes_received, pure.handshake_bytes_sent,
                  want.bytes_sent, want.bytes_received, want.handshake_bytes_sent));
            }
            // The sparse codecs travel as (index, value) pairs in an
            // all-gather unless the densified all-reduce was asked for: 8k
            // bytes a rank, or in the compact format 2k for the bf16 values
            // and the Elias-Fano bound for the indices (L = floor(log2(numel
            // / k)): k (L + 1) + (numel - 1) >> L bits).
            const CodecKind k = o.codec.kind;
            if ((k == CodecKind::topk || k == CodecKind::randk) &&
                v.sparse == SparseExchange::all_gather) {
              const size_t kk = o.codec.k_for(numel);
              size_t L = 0;
              while ((size_t{2} << L) <= numel / kk) ++L;
              const size_t per_rank =
                  o.codec.compact ? 2 * kk + (kk * (L + 1) + ((numel - 1) >> L) + 7) / 8 : 8 * kk;
              if (got.by_collective.count("all_reduce") != 0 ||
                  got.by_collective.at("all_gather").payload_bytes !=
                      2 * per_rank * static_cast<uint64_t>(n)) {
                throw std::runtime_error(
                    fmt::format("{}: not an all-gather of {} bytes per rank", where, per_rank));
              }
            }
            if (n > 1 && k != CodecKind::none && o.codec.to_string() != "powersgd:40" &&
                v.sparse == SparseExchange::all_gather &&
                !(k == CodecKind::f16 || k == CodecKind::bf16)) {
              // Compression sends less than a dense f32 all-reduce would.
              const CodecTraffic dense = predict_traffic(
                  c, std::vector<PlannedCollective>{{Collective::all_reduce, numel, DType::f32}});
              if (n == 2 && !(want.bytes_sent < dense.bytes_sent)) {
                throw std::runtime_error(fmt::format("{}: {} bytes, dense {}", where,
                                                     want.bytes_sent, dense.bytes_sent));
              }
            }
          }
        }
      });
    }
  }
}

TEST(CompressedAllReduce, PlansWhatEachCodecSends) {
  auto plan = [](const char* codec, Shape shape) {
    return compressed_all_reduce_plan(with(codec), shape);
  };
  const Shape s{100, 30};
  auto one = [](Collective k, size_t count, DType t) {
    return std::vector<PlannedCollective>{{k, count, t}};
  };
  auto eq = [](const std::vector<PlannedCollective>& a, const std::vector<PlannedCollective>& b) {
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i) {
      if (a[i].kind != b[i].kind || a[i].count != b[i].count || a[i].dtype != b[i].dtype) {
        return false;
      }
    }
    return true;
  };
  EXPECT_TRUE(eq(plan("none", s), one(Collective::all_reduce, 3000, DType::f32)));
  EXPECT_TRUE(eq(plan("bf16", s), one(Collective::all_reduce, 3000, DType::bf16)));
  EXPECT_TRUE(eq(plan("topk:0.01", s), one(Collective::all_gather, 8 * 30, DType::u8)));
  // 30 of 3000: 60 bytes of bf16 values, L = 6, 30 x 7 + 2999 >> 6 = 256 bits.
  EXPECT_TRUE(eq(plan("topk:0.01:compact", s), one(Collective::all_gather, 60 + 32, DType::u8)));
  EXPECT_TRUE(eq(plan("qsgd:4", s), one(Collective::all_gather, 6 * 4 + 1500, DType::u8)));
  EXPECT_TRUE(eq(plan("sign", s), one(Collective::all_gather, 4 + 375, DType::u8)));
  EXPECT_TRUE(eq(plan("powersgd:4", s),
                 (std::vector<PlannedCollective>{{Collective::all_reduce, 400, DType::f32},
                                                 {Collective::all_reduce, 120, DType::f32}})));
  EXPECT_TRUE(eq(plan("powersgd:4", Shape{3000}), one(Collective::all_reduce, 3000, DType::f32)));
  EXPECT_TRUE(plan("topk:0.5", Shape{0, 4}).empty());
}

// M_r = U A_r^T with one U (rows x rank) for all ranks: the average has rank
// <= `true_rank`, so PowerSGD at rank >= true_rank reproduces it (float
// tolerance), at a lower rank it cannot.
TEST(CompressedAllReduce, PowerSgdIsExactOnALowRankMatrix) {
  const size_t rows = 36, cols = 28;
  const int true_rank = 3;
  for (int n : {1, 3}) {
    for (int r : {2, 3, 5}) {
      LocalWorld::run(world(n, true), [&](Communicator& c) {
        const std::vector<float> u = normal_vector(rows * true_rank, 99);  // shared
        const std::vector<float> a = normal_vector(cols * true_rank, 7 + c.rank());
        std::vector<float> m(rows * cols, 0.0f);
        powersgd_expand(u, a, rows, cols, true_rank, m);
        std::vector<float> avg = m;
        c.all_reduce(avg.data(), avg.data(), avg.size(), DType::f32, ReduceOp::avg);
        CompressedAllReduceOptions o = with(fmt::format("powersgd:{}", r).c_str());
        o.codec.error_feedback = false;
        CompressedAllReduce car(c, "w",
                                Shape{static_cast<int64_t>(rows), static_cast<int64_t>(cols)}, o);
        std::vector<float> out(m.size());
        double err = 0, mag = 0;
        for (int step = 0; step < 2; ++step) {  // the first Q, then the warm start
          car.run(m, out);
          for (size_t i = 0; i < m.size(); ++i) {
            err = std::max(err, static_cast<double>(std::fabs(out[i] - avg[i])));
            mag = std::max(mag, static_cast<double>(std::fabs(avg[i])));
          }
        }
        const std::string where = fmt::format("rank {} of {}, powersgd:{}", c.rank(), n, r);
        if (r >= true_rank && !(err <= 2e-5 * mag)) {
          throw std::runtime_error(fmt::format("{}: max error {} (max |M| {})", where, err, mag));
        }
        if (r < true_rank && !(err > 1e-2 * mag)) {
          throw std::runtime_error(
              fmt::format("{}: a rank-{} matrix came out exact at rank {}?", where, true_rank, r));
        }
      });
    }
  }
}

// Singular values 10, 3, 1 (orthonormal u, v): warm-started rank-1 PowerSGD
// is a power iteration, so repeated calls on the same matrix (no error
// feedback) converge to the best rank-1 approximation, whose Frobenius
// error is sqrt(3^2 + 1^2); a fresh Q every step would not get there.
TEST(CompressedAllReduce, PowerSgdWarmStartConvergesToTheBestApproximation) {
  LocalWorld::run(world(2, true), [&](Communicator& c) {
    const size_t rows = 30, cols = 20;
    std::vector<float> u = normal_vector(rows * 3, 5), v = normal_vector(cols * 3, 6);
    orthogonalize_columns(u, rows, 3);
    orthogonalize_columns(v, cols, 3);
    const float sigma[3] = {10, 3, 1};
    for (size_t i = 0; i < rows; ++i) {
      for (int k = 0; k < 3; ++k) u[i * 3 + k] *= sigma[k];
    }
    std::vector<float> m(rows * cols);
    powersgd_expand(u, v, rows, cols, 3, m);
    CompressedAllReduceOptions o = with("powersgd:1");
    o.codec.error_feedback = false;
    CompressedAllReduce car(c, "w", Shape{30, 20}, o);
    std::vector<float> out(m.size());
    auto error = [&] {
      double s = 0;
      for (size_t i = 0; i < m.size(); ++i) s += std::pow(double{m[i]} - out[i], 2);
      return std::sqrt(s);
    };
    car.run(m, out);
    const double first = error();
    for (int step = 0; step < 15; ++step) car.run(m, out);
    EXPECT_NEAR(error(), std::sqrt(10.0), 1e-3);
    EXPECT_GT(first, error() + 1e-3);
  });
}

TEST(CompressedAllReduce, PowerSgdResidualPlusResultIsTheInput) {
  LocalWorld::run(world(2, true), [&](Communicator& c) {
    CompressedAllReduce car(c, "w", Shape{24, 16}, with("powersgd:2"));
    std::vector<float> residual(384, 0.0f), out(384);
    for (uint64_t step = 0; step < 3; ++step) {
      const std::vector<float> g = normal_vector(384, 50 + step + 10 * c.rank());
      car.run(g, out);
      for (size_t i = 0; i < 384; ++i) {
        const float e = g[i] + residual[i];
        ASSERT_NEAR(car.residual()[i] + out[i], e, 1e-6 * (std::fabs(e) + std::fabs(out[i]))) << i;
      }
      residual.assign(car.residual().begin(), car.residual().end());
    }
  });
}

TEST(CompressedAllReduce, RejectsACodecThatDoesNotFitAndMisfitBuffers) {
  LocalWorld::run(world(2, true), [&](Communicator& c) {
    try {
      CompressedAllReduce car(c, "fc.bias", Shape{10}, with("topk:11"));
      throw std::runtime_error("topk:11 on 10 elements was accepted");
    } catch (const ConfigError& e) {
      EXPECT_EQ(std::string(e.what()),
                "sync.codec: \"topk:11\": k = 11 does not fit tensor 'fc.bias' (10 elements); "
                "expected k from 1 to 10");
    }
    CompressedAllReduce car(c, "fc.bias", Shape{10}, with("topk:2"));
    std::vector<float> g(9), out(10);
    EXPECT_THROW(car.run(g, out), ShapeError);
  });
}

}  // namespace
}  // namespace mt
