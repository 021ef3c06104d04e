// CompressedAllReduce over the mpi backend (mpirun -np 2 and 4): for every
// codec, every rank gets the same bits, equal to the average of what the
// ranks sent, and the byte counters equal predict_traffic() exactly, over
// the shared window and over MPI point-to-point.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "meshtrain/base/random.h"
#include "meshtrain/comm/backends/mpi/mpi_communicator.h"
#include "meshtrain/sync/compressed_all_reduce.h"

namespace mt {
namespace {

std::unique_ptr<Communicator> world(bool shm) {
  CommOptions o;
  o.timeout = std::chrono::milliseconds(60'000);
  MpiOptions m;
  m.shared_memory = shm;
  m.shm_bytes_per_rank = 64 * 1024;
  return make_mpi_communicator(o, m);
}

TEST(CompressedAllReduceMpi, EveryCodecAgreesOnEveryRankAndCountsWhatItPredicts) {
  for (bool shm : {true, false}) {
    auto c = world(shm);
    const int n = c->size();
    for (const char* codec : {"none", "f16", "bf16", "topk:0.01", "randk:50", "qsgd:4", "sign",
                              "powersgd:4", "topk:0.01:compact", "randk:50:compact"}) {
      const std::string where = fmt::format("{} shm {} rank {}/{}", codec, shm, c->rank(), n);
      SCOPED_TRACE(where);
      const Shape shape{96, 64};
      const size_t numel = 96 * 64;
      CompressedAllReduceOptions o;
      o.codec = parse_codec_spec(codec);
      CompressedAllReduce car(*c, "w", shape, o);
      std::vector<float> residual(numel, 0.0f), out(numel);
      for (uint64_t step = 0; step < 2; ++step) {
        Rng rng(100 * step + static_cast<uint64_t>(c->rank()));
        std::vector<float> g(numel);
        for (float& v : g) v = static_cast<float>(0.1 * rng.normal());
        c->reset_counters();
        car.run(g, out);
        const CommCounters got = c->counters();
        const CodecTraffic want = car.predicted_traffic();
        ASSERT_EQ(got.total_sent(), want.total_sent());
        ASSERT_EQ(got.total_received(), want.bytes_received + want.handshake_bytes_received);

        std::vector<float> all(numel * static_cast<size_t>(n));
        c->all_gather(out.data(), all.data(), numel, DType::f32);
        for (int q = 0; q < n; ++q) {
          for (size_t i = 0; i < numel; ++i) ASSERT_EQ(all[q * numel + i], out[i]) << q << " " << i;
        }
        if (o.codec.kind == CodecKind::powersgd) continue;  // not a per-rank payload
        std::vector<float> sent = g;
        if (!car.residual().empty()) {
          for (size_t i = 0; i < numel; ++i) sent[i] = g[i] + residual[i] - car.residual()[i];
          residual.assign(car.residual().begin(), car.residual().end());
        }
        c->all_gather(sent.data(), all.data(), numel, DType::f32);
        double max_err = 0, max_mag = 0;
        for (size_t i = 0; i < numel; ++i) {
          double avg = 0;
          for (int q = 0; q < n; ++q) avg += all[q * numel + i];
          avg /= n;
          max_err = std::max(max_err, std::fabs(avg - out[i]));
          max_mag = std::max(max_mag, std::fabs(avg));
        }
        const double tol = o.codec.kind == CodecKind::bf16  ? 8 * 0x1p-8 * max_mag
                           : o.codec.kind == CodecKind::f16 ? 8 * 0x1p-11 * max_mag
                                                            : 1e-5 * max_mag;
        EXPECT_LE(max_err, tol);
      }
    }
  }
}

}  // namespace
}  // namespace mt
