// Codecs (sync.codec) on the other schemes' exchanges, through the Trainer
// under mpirun (4 ranks), on the MLP:
// - local_sgd, diloco and partial compress the pseudo-gradient of each
//   synchronization (the parameters' change since the last one; partial:
//   of the layer group synchronized at that step): with
//   topk:1.0 (every element sent, nothing held back) each equals its
//   uncompressed run step by step (loss of every step and the final
//   parameters within 1e-5 relative: the mean is taken as anchor - mean of
//   the changes instead of the mean of the parameters); the bytes the
//   communicator counts equal the compressed all-reduce's prediction, per
//   parameter and synchronization, exactly;
// - error feedback conserves what was not sent: after local_sgd's first
//   synchronization with topk:0.1, the parameters minus the ranks' mean
//   residual are the replicas' plain mean (the uncompressed run's), and the
//   residual is not zero;
// - ps: workers push their gradients through the codec (payloads, with the
//   residual on the worker), the server decodes and sums them: BSP with
//   topk:1.0 is plain BSP within 1e-6 relative, and the bytes are the header plus
//   the payloads, exactly; BSP with topk:0.1 and ASP with qsgd:4 learn;
// - combinations that do not compose are refused, naming the key and why
//   (ps + PowerSGD, Streaming DiLoCo's options,
//   ZeRO 1-2).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/base/error.h"
#include "meshtrain/sync/codecs.h"
#include "meshtrain/sync/compressed_all_reduce.h"
#include "meshtrain/sync/param_server.h"
#include "meshtrain/sync/replica_sync.h"
#include "meshtrain/train/param_store.h"
#include "meshtrain/train/trainer.h"
#include "sync/dp_harness.h"
#include "train/mpi_world.h"
#include "train/sync_scheme_harness.h"

namespace mt {
namespace {

constexpr int kSteps = 12;

Communicator& world() {
  return test::mpi_world();
}

ModelSpec spec() {
  return test::sync_mlp();
}

TrainerOptions options(const SyncOptions& sync, int64_t steps) {
  TrainerOptions o = test::sync_options(sync, {.steps = steps});
  o.dist.consistency_every = 0;
  return o;
}

struct Outcome {
  std::vector<double> losses;
  std::vector<float> params;  // the replicas' mean (ps: the servers' final ones)
  std::vector<float> own;     // this rank's own parameters
  std::vector<float> residual;
  std::vector<ParamStore::Entry> entries;
  uint64_t bytes = 0;
  bool server = false;
};

Outcome train(const SyncOptions& sync, int64_t steps = kSteps, double momentum = 0) {
  auto data = std::make_shared<test::SyntheticData>(spec(), 480, 9);
  TrainerOptions o = options(sync, steps);
  o.optim.sgd.momentum = momentum;
  Trainer t(spec(), data, nullptr, o, &world());
  Outcome out;
  out.losses = t.run().losses;
  if (t.replica_sync().agreement_period() > 1) {
    // Between agreements each rank reports its own mean loss: the mean of
    // the ranks' (equal batches) is the global one the checks read.
    world().all_reduce(out.losses.data(), out.losses.data(), out.losses.size(), DType::f64);
    for (double& x : out.losses) x /= world().size();
  }
  out.server = t.replica_sync().is_server();
  const Tensor own = t.params().flat_values();
  out.own.assign(own.data<float>(), own.data<float>() + own.numel());
  out.entries = t.params().entries();
  out.residual = t.replica_sync().codec_residual();
  out.bytes = t.replica_sync().bytes_sent();
  const Tensor mean = t.gather_params();
  out.params.assign(mean.data<float>(), mean.data<float>() + mean.numel());
  return out;
}

double divergence(const Outcome& want, const Outcome& got) {
  double worst = 0;
  for (size_t i = 0; i < want.losses.size(); ++i) {
    worst = std::max(worst, std::abs(got.losses[i] - want.losses[i]) / std::abs(want.losses[i]));
  }
  double diff = 0, mag = 0;
  for (size_t i = 0; i < want.params.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(got.params[i]) - want.params[i]));
    mag = std::max(mag, std::abs(static_cast<double>(want.params[i])));
  }
  return std::max(worst, diff / mag);
}

SyncOptions scheme(const std::string& name, int64_t period = 1, const std::string& codec = "none") {
  SyncOptions s;
  s.scheme = name;
  s.period = period;
  s.codec = codec;
  return s;
}

// This rank's bytes for one compressed exchange of every parameter (the
// scheme's communicator is a split of the world with the same ranks and
// collective options), handshakes left out as bytes_sent() leaves them.
uint64_t predicted_exchange(const std::vector<ParamStore::Entry>& entries,
                            const std::string& codec) {
  CompressedAllReduceOptions co;
  co.codec = parse_codec_spec(codec);
  uint64_t b = 0;
  for (const ParamStore::Entry& e : entries) {
    b += predict_traffic(world(), compressed_all_reduce_plan(co, e.shape)).bytes_sent;
  }
  return b;
}

bool mean3_falls(const std::vector<double>& v) {
  const size_t n = v.size();
  return v[n - 1] + v[n - 2] + v[n - 3] < v[0] + v[1] + v[2];
}

TEST(CodecSchemesMpi, IdentityCodecOnPseudoGradientsEqualsTheScheme) {
  // local_sgd, diloco: period 4, three synchronizations of every parameter
  // in 12 steps; partial: period 3 (the MLP's 3 layers one per step), each
  // layer synchronized 4 times.
  struct Case {
    const char* name;
    int64_t period, rounds;
  };
  for (const Case& k : {Case{"local_sgd", 4, 3}, Case{"diloco", 4, 3}, Case{"partial", 3, 4}}) {
    const char* name = k.name;
    const uint64_t rounds = static_cast<uint64_t>(k.rounds);
    SCOPED_TRACE(name);
    const SyncOptions plain = scheme(name, k.period);
    const Outcome a = train(plain);
    const Outcome b = train(scheme(name, k.period, "topk:1.0"));
    ASSERT_EQ(b.losses.size(), static_cast<size_t>(kSteps));
    const double d = divergence(a, b);
    if (world().rank() == 0) {
      std::printf("%s (period %lld) + topk:1.0 vs %s: worst relative difference %.3g\n", name,
                  static_cast<long long>(k.period), name, d);
    }
    EXPECT_LE(d, 1e-5);
    // Each synchronization one compressed exchange per parameter: exactly
    // the prediction.
    EXPECT_EQ(b.bytes, rounds * predicted_exchange(b.entries, "topk:1.0"));
    if (k.rounds == 3) {
      EXPECT_EQ(b.own, b.params);  // step 12 synchronized everything
    }
    for (float r : b.residual) ASSERT_EQ(r, 0.0F);  // nothing held back
    // 10% of each tensor: fewer bytes (the all-gather of (index, value)
    // pairs sends 3 x 8 x 0.1 d at 4 ranks, the ring 1.5 x 4 d: 2.5x), the
    // same count of exchanges, learns.
    const Outcome c = train(scheme(name, k.period, "topk:0.1"));
    EXPECT_EQ(c.bytes, rounds * predicted_exchange(c.entries, "topk:0.1"));
    EXPECT_LT(c.bytes * 2, a.bytes) << c.bytes << " vs dense " << a.bytes;
    EXPECT_TRUE(mean3_falls(c.losses));
    EXPECT_GT(divergence(a, c), 1e-4);  // the codec is used
  }
  // The 16-bit casts and QSGD on DiLoCo's pseudo-gradient with momentum.
  for (const char* codec : {"bf16", "qsgd:4"}) {
    SyncOptions s = scheme("diloco", 4, codec);
    const Outcome o = train(s);
    EXPECT_EQ(o.bytes, 3 * predicted_exchange(o.entries, codec)) << codec;
    EXPECT_TRUE(mean3_falls(o.losses)) << codec;
  }
}

// residual + sent == input, at the scheme's level: before local_sgd's first
// synchronization the compressed run is the plain one; at it, rank r sends
// e_r - res_r of e_r = anchor - theta_r and every rank takes anchor -
// mean(sent) = mean(theta_r) + mean(res_r).
TEST(CodecSchemesMpi, ErrorFeedbackKeepsWhatThePseudoGradientDidNotSend) {
  for (const char* name : {"local_sgd", "diloco"}) {
    SCOPED_TRACE(name);
    SyncOptions plain = scheme(name, 4);
    plain.outer_lr = 1.0;  // diloco: the outer step is the mean
    plain.outer_momentum = 0.0;
    SyncOptions sparse = plain;
    sparse.codec = "topk:0.1";
    const Outcome a = train(plain, 4), b = train(sparse, 4);
    ASSERT_EQ(b.residual.size(), b.own.size());
    std::vector<float> mean_res = b.residual;
    world().all_reduce(mean_res.data(), mean_res.data(), mean_res.size(), DType::f32,
                       ReduceOp::avg);
    double worst = 0, mag = 0, held = 0;
    for (size_t i = 0; i < a.params.size(); ++i) {
      worst = std::max(worst, std::abs(static_cast<double>(b.own[i]) - mean_res[i] - a.params[i]));
      mag = std::max(mag, std::abs(static_cast<double>(a.params[i])));
      held = std::max(held, std::abs(static_cast<double>(mean_res[i])));
    }
    if (world().rank() == 0) {
      std::printf(
          "%s + topk:0.1: |theta - mean residual - plain mean| <= %.3g (params up to %.3g, "
          "residual up to %.3g)\n",
          name, worst, mag, held);
    }
    EXPECT_LE(worst, 1e-6 * mag);
    EXPECT_GT(held, 1e-4 * mag);  // something was held back
  }
}

// ---- parameter server

TrainerOptions ps_options(const SyncOptions& sync) {
  TrainerOptions o = options(sync, kSteps);
  o.batch_size = 12;
  o.optim.sgd.momentum = 0.9;
  o.schedule.lr = 0.05;
  return o;
}

Outcome train_ps(const SyncOptions& sync) {
  auto data = std::make_shared<test::SyntheticData>(spec(), 480, 9);
  Trainer t(spec(), data, nullptr, ps_options(sync), &world());
  Outcome out;
  out.losses = t.run().losses;
  out.server = t.replica_sync().is_server();
  out.entries = t.params().entries();
  out.residual = t.replica_sync().codec_residual();
  out.bytes = t.replica_sync().bytes_sent();
  const Tensor p = t.gather_params();
  out.params.assign(p.data<float>(), p.data<float>() + p.numel());
  return out;
}

SyncOptions ps(const std::string& mode, const std::string& codec, int64_t servers = 1) {
  SyncOptions s = scheme("ps", 1, codec);
  s.ps_mode = mode;
  s.servers = servers;
  return s;
}

// A worker's bytes over the run: one push per step and the "done" push to
// every server, each a 48-byte header and its parameters' payloads.
uint64_t predicted_pushes(const std::vector<ParamStore::Entry>& entries, const std::string& codec,
                          int servers) {
  ParamLayout layout;
  for (const auto& e : entries) layout.push_back({e.name, e.shape, e.offset});
  const std::vector<int> shard = ps_shards(layout, servers);
  const CodecSpec c = parse_codec_spec(codec);
  uint64_t per_step = 48 * static_cast<uint64_t>(servers);
  for (size_t i = 0; i < layout.size(); ++i) {
    const auto n = static_cast<size_t>(layout[i].shape.numel());
    per_step += c.kind == CodecKind::none ? 4 * n : make_payload_codec(c, n)->payload_bytes();
  }
  (void)shard;  // every parameter goes to exactly one server
  return (kSteps + 1) * per_step;
}

TEST(CodecSchemesMpi, ParamServerPushesGoThroughTheCodec) {
  ASSERT_EQ(world().size(), 4);
  for (int64_t servers : {1, 2}) {
    SCOPED_TRACE(fmt::format("{} server(s)", servers));
    const Outcome plain = train_ps(ps("bsp", "none", servers));
    const Outcome whole = train_ps(ps("bsp", "topk:1.0", servers));
    if (!whole.server) {
      // The same sums in the same order; the compiler may fuse one of the
      // two multiply-adds (the loop over f32 pushes, the payload decoder)
      // and not the other, so equal within rounding, not bit for bit.
      const double d = divergence(plain, whole);
      if (world().rank() == 0) {
        std::printf(
            "ps bsp (%lld server(s)) + topk:1.0 vs ps bsp: worst relative difference "
            "%.3g\n",
            static_cast<long long>(servers), d);
      }
      EXPECT_LE(d, 1e-6);
      EXPECT_EQ(whole.bytes,
                predicted_pushes(whole.entries, "topk:1.0", static_cast<int>(servers)));
      EXPECT_EQ(plain.bytes, predicted_pushes(plain.entries, "none", static_cast<int>(servers)));
    } else {
      EXPECT_EQ(whole.bytes, plain.bytes);  // the replies stay f32 parameters
    }
  }
  const Outcome tenth = train_ps(ps("bsp", "topk:0.1"));
  const Outcome dense = train_ps(ps("bsp", "none"));
  if (!tenth.server) {
    EXPECT_EQ(tenth.bytes, predicted_pushes(tenth.entries, "topk:0.1", 1));
    EXPECT_LT(tenth.bytes * 4, dense.bytes);  // 8 x 0.1 d against 4 d per push
    EXPECT_TRUE(mean3_falls(tenth.losses));
    EXPECT_GT(divergence(dense, tenth), 1e-4);
    double held = 0;
    for (float r : tenth.residual) held = std::max(held, static_cast<double>(std::abs(r)));
    EXPECT_GT(held, 0.0);
  }
  // ASP: one worker's 12 losses are its own batches at whatever staleness
  // the timing gave it (it fell in about 3 of 4 runs alone); the workers'
  // first and last three losses summed over all of them are the check.
  const Outcome asp = train_ps(ps("asp", "qsgd:4"));
  double ends[2] = {0, 0};
  if (!asp.server) {
    EXPECT_EQ(asp.bytes, predicted_pushes(asp.entries, "qsgd:4", 1));
    const std::vector<double>& v = asp.losses;
    const size_t n = v.size();
    ends[0] = v[0] + v[1] + v[2];
    ends[1] = v[n - 1] + v[n - 2] + v[n - 3];
  }
  world().all_reduce(ends, ends, 2, DType::f64, ReduceOp::sum);
  EXPECT_LT(ends[1], ends[0]);
}

std::string error_of(const SyncOptions& s, int zero = 0) {
  try {
    auto data = std::make_shared<test::SyntheticData>(spec(), 256, 9);
    TrainerOptions o = options(s, kSteps);
    o.dist.dp.stage = zero;
    Trainer t(spec(), data, nullptr, o, &world());
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "no error";
}

TEST(CodecSchemesMpi, CombinationsThatDoNotComposeAreRefused) {
  // gossip and adpsgd compose (CHOCO-SGD: tests/train/gossip_codec_mpi_test.cpp).
  SyncOptions s = ps("bsp", "powersgd:2");
  EXPECT_NE(error_of(s).find("sync.codec = \"powersgd:2\": PowerSGD all-reduces its factors"),
            std::string::npos)
      << error_of(s);
  s = scheme("diloco", 4, "sign");
  s.outer_bits = 4;
  EXPECT_NE(error_of(s).find("sync.codec = \"sign\" with sync.outer_bits"), std::string::npos)
      << error_of(s);
  s = scheme("local_sgd", 4, "topk:100000");  // more than a parameter holds
  EXPECT_NE(error_of(s).find("does not fit tensor"), std::string::npos) << error_of(s);
  s = scheme("ps", 1, "topk:100000");
  EXPECT_NE(error_of(s).find("does not fit"), std::string::npos) << error_of(s);
  // ZeRO 1-2: no compressed reduce-scatter yet, said so.
  for (int zero : {1, 2}) {
    s = scheme("allreduce", 1, "topk:0.01");
    EXPECT_NE(error_of(s, zero).find(fmt::format(
                  "sync.codec = \"topk:0.01\" with dist.zero_stage = {}: the compressed exchange "
                  "leaves the whole averaged gradient on every rank (no compressed reduce-scatter "
                  "yet)",
                  zero)),
              std::string::npos)
        << error_of(s, zero);
  }
  EXPECT_EQ(error_of(scheme("local_sgd", 4, "qsgd:4")), "no error");
}

}  // namespace
}  // namespace mt

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  mt::world();  // initialise MPI before any test
  return RUN_ALL_TESTS();
}
