// Codecs (sync.codec) on the other schemes' exchanges, through the Trainer
// under mpirun (2 and 4 ranks; the ps test at 4 only), on the MLP:
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
//   PowerSGD: each worker pushes its own factors P, Q (its own warm-started
//   Q and residual), the server decodes P Q^T: BSP learns, the bytes are
//   the factors' exactly, and the encoding is exact on a rank-r matrix;
// - Streaming DiLoCo: each fragment's pseudo-gradient through the codec
//   (one exchange per piece of a parameter in it), with and without
//   overlap: topk:1.0 equals the f32 fragments step by step, bytes exactly
//   the pieces' predictions per exchange; topk:0.1, bf16, PowerSGD send less;
// - combinations that do not compose are refused, naming the key and why
//   (DiLoCo's 4-bit exchange + a codec, PowerSGD under ZeRO; gossip and
//   adpsgd compose: tests/train/gossip_codec_mpi_test.cpp);
// - ZeRO 1-3: each bucket's reduce-scatter is a compressed one (each chunk
//   encoded for its owner with its own residual, all-to-all, decoded and
//   summed there): topk:1.0 equals ZeRO without a codec step by step, and
//   bf16 / topk:0.1 learn; the bytes differ from ZeRO's by exactly the
//   predicted reduction bytes (the payloads against ZeRO's own collective).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/base/error.h"
#include "meshtrain/sync/buckets.h"
#include "meshtrain/sync/codecs.h"
#include "meshtrain/sync/compressed_all_reduce.h"
#include "meshtrain/sync/compressed_reduce_scatter.h"
#include "meshtrain/sync/local_steps.h"
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

using Outcome = test::SyncOutcome;

// Between agreements (local_sgd, diloco) each rank reports its own mean
// loss: the mean of the ranks' is the global one the checks read.
Outcome train(const SyncOptions& sync, int64_t steps = kSteps, double momentum = 0, int zero = 0) {
  TrainerOptions o = options(sync, steps);
  o.optim.sgd.momentum = momentum;
  o.dist.dp.stage = zero;
  return test::train_sync(o, {.own_losses = test::OwnLosses::between_agreements});
}

using test::divergence;
using test::mean3_falls;
using test::predicted_exchange;

SyncOptions scheme(const std::string& name, int64_t period = 1, const std::string& codec = "none") {
  SyncOptions s;
  s.scheme = name;
  s.period = period;
  s.codec = codec;
  return s;
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

// The asynchronous halves (Streaming DiLoCo's overlap uses them): start()
// then finish() gives run()'s bits and residual, the same bytes; PowerSGD
// has no asynchronous form.
TEST(CodecSchemesMpi, StartFinishIsRun) {
  const Shape shape{37, 5};
  std::vector<float> g(185);
  for (size_t i = 0; i < g.size(); ++i) {
    g[i] = static_cast<float>(std::sin(0.3 * static_cast<double>(i) + world().rank()));
  }
  for (const char* codec : {"bf16", "topk:0.1", "qsgd:4", "sign", "randk:0.2:compact"}) {
    SCOPED_TRACE(codec);
    CompressedAllReduceOptions co;
    co.codec = parse_codec_spec(codec);
    CompressedAllReduce a(world(), "a", shape, co), b(world(), "b", shape, co);
    ASSERT_TRUE(b.can_start());
    std::vector<float> ra(g.size()), rb(g.size());
    for (int round = 0; round < 2; ++round) {  // the second with a residual
      a.run(g, ra);
      const uint64_t before = sync_bytes_sent(world());
      b.start(g);
      EXPECT_TRUE(b.started());
      b.finish(rb);
      EXPECT_EQ(sync_bytes_sent(world()) - before, b.predicted_traffic().bytes_sent);
      EXPECT_EQ(ra, rb);
      EXPECT_EQ(std::vector<float>(a.residual().begin(), a.residual().end()),
                std::vector<float>(b.residual().begin(), b.residual().end()));
    }
  }
  CompressedAllReduceOptions co;
  co.codec = parse_codec_spec("powersgd:2");
  EXPECT_FALSE(CompressedAllReduce(world(), "p", shape, co).can_start());
}

// Streaming DiLoCo (period 4, 2 fragments, phases 0 and 2: each fragment
// exchanged 3 times in 12 steps) with a codec on each fragment's pieces.
uint64_t predicted_fragments(const Outcome& o, const SyncOptions& s, int64_t steps) {
  ParamLayout layout;
  for (const auto& e : o.entries) layout.push_back({e.name, e.shape, e.offset});
  const auto flat = static_cast<int64_t>(o.own.size());
  const std::vector<DilocoFragment> frags = diloco_fragments(flat, s.fragments, s.period);
  CompressedAllReduceOptions co;
  co.codec = parse_codec_spec(s.codec);
  uint64_t b = 0;
  for (const CodecPiece& p : diloco_codec_pieces(layout, flat, s.fragments, s.period)) {
    uint64_t runs = 0;
    for (int64_t t = 1; t <= steps; ++t) {
      runs += (t - frags[static_cast<size_t>(p.fragment)].phase) % s.period == 0 ? 1 : 0;
    }
    b += runs * predict_traffic(world(), compressed_all_reduce_plan(co, p.shape)).bytes_sent;
  }
  return b;
}

TEST(CodecSchemesMpi, StreamingDilocoFragmentsGoThroughTheCodec) {
  for (int64_t overlap : {0, 1}) {
    SCOPED_TRACE(fmt::format("overlap_steps {}", overlap));
    SyncOptions plain = scheme("diloco", 4);
    plain.fragments = 2;
    plain.overlap_steps = overlap;
    SyncOptions whole = plain;
    whole.codec = "topk:1.0";
    const Outcome a = train(plain), b = train(whole);
    const double d = divergence(a, b);
    if (world().rank() == 0) {
      std::printf(
          "diloco (period 4, 2 fragments, overlap %lld) + topk:1.0 vs without: worst relative "
          "difference %.3g\n",
          static_cast<long long>(overlap), d);
    }
    EXPECT_LE(d, 1e-5);
    for (float r : b.residual) ASSERT_EQ(r, 0.0F);
    EXPECT_EQ(b.bytes, predicted_fragments(b, whole, kSteps));
    for (const char* codec : {"topk:0.1", "bf16", "powersgd:2"}) {
      SyncOptions c = plain;
      c.codec = codec;
      const Outcome o = train(c);
      EXPECT_EQ(o.bytes, predicted_fragments(o, c, kSteps)) << codec;
      EXPECT_LT(o.bytes, a.bytes) << codec;
      EXPECT_GT(divergence(a, o), 1e-6) << codec;  // the codec is used
      if (std::string(codec) != "powersgd:2") {
        EXPECT_TRUE(mean3_falls(o.losses)) << codec;
      }
      for (double l : o.losses) ASSERT_TRUE(std::isfinite(l)) << codec;
      if (world().rank() == 0) {
        std::printf("  + %s: %llu bytes vs f32 %llu, loss %.4f -> %.4f (f32 %.4f)\n", codec,
                    static_cast<unsigned long long>(o.bytes),
                    static_cast<unsigned long long>(a.bytes), o.losses.front(), o.losses.back(),
                    a.losses.back());
      }
    }
  }
  // The pieces: every element of every fragment in exactly one piece; a
  // parameter cut between rows stays a matrix.
  ParamLayout layout = {{"w", Shape{6, 4}, 0}, {"b", Shape{6}, 24}, {"v", Shape{5, 3}, 30}};
  const std::vector<CodecPiece> pieces = diloco_codec_pieces(layout, 45, 3, 6);
  // fragments [0, 15), [15, 30), [30, 45)
  ASSERT_EQ(pieces.size(), 4U);
  EXPECT_EQ(pieces[0].shape, (Shape{15}));  // w[0:15]: not whole rows
  EXPECT_EQ(pieces[1].shape, (Shape{9}));   // w[15:24]
  EXPECT_EQ(pieces[2].shape, (Shape{6}));   // b, whole
  EXPECT_EQ(pieces[3].shape, (Shape{5, 3}));
  const std::vector<CodecPiece> rows = diloco_codec_pieces({{"w", Shape{6, 4}, 0}}, 24, 2, 4);
  ASSERT_EQ(rows.size(), 2U);
  EXPECT_EQ(rows[0].shape, (Shape{3, 4}));  // 12 of 24: 3 whole rows
  EXPECT_EQ(rows[1].name, "w[12:24] (fragment 1)");
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

// ---- ZeRO 1-3 with a codec: the compressed reduce-scatter

// The exchange alone, on uneven chunks (10, 9, 9, 9 of 37 elements): every
// rank's chunk of the sum of what the ranks sent, residual + sent == input,
// and the all-to-all's bytes exactly the prediction.
TEST(CodecSchemesMpi, CompressedReduceScatterSumsWhatEachRankSent) {
  const int n = world().size(), me = world().rank();
  std::vector<size_t> counts(static_cast<size_t>(n), 9);
  counts[0] = 10;
  const size_t numel = 9 * static_cast<size_t>(n) + 1;
  auto input = [&](int q, size_t i) {
    return static_cast<float>(std::sin(0.37 * static_cast<double>(i) + q) * (1 + q));
  };
  for (const char* codec : {"topk:1.0", "topk:0.25", "bf16", "qsgd:4", "sign"}) {
    SCOPED_TRACE(codec);
    CompressedAllReduceOptions co;
    co.codec = parse_codec_spec(codec);
    CompressedReduceScatter rs(world(), "test bucket", counts, co);
    std::vector<float> in(numel);
    for (size_t i = 0; i < numel; ++i) in[i] = input(me, i);
    std::vector<float> out(counts[static_cast<size_t>(me)]);
    const uint64_t before = world().counters().by_collective["all_to_allv"].bytes_sent;
    rs.run(in, out);
    const uint64_t sent = world().counters().by_collective["all_to_allv"].bytes_sent - before;
    EXPECT_EQ(sent, rs.predicted_traffic().bytes_sent);
    uint64_t want = 0;
    for (int q = 0; q < n; ++q) {
      if (q != me)
        want += make_payload_codec(co.codec, counts[static_cast<size_t>(q)])->payload_bytes();
    }
    EXPECT_EQ(sent, want);
    // sum over q of (input_q - residual_q) on this rank's chunk == out
    std::vector<float> all(numel * static_cast<size_t>(n));
    const std::vector<float> res = rs.residual();
    ASSERT_EQ(res.size(), numel);
    world().all_gather(res.data(), all.data(), numel, DType::f32);
    const size_t lo = me == 0 ? 0 : 10 + 9 * static_cast<size_t>(me - 1);
    double worst = 0, held = 0;
    for (size_t i = 0; i < out.size(); ++i) {
      double sum = 0;
      for (int q = 0; q < n; ++q) {
        const float r = all[static_cast<size_t>(q) * numel + lo + i];
        sum += static_cast<double>(input(q, lo + i)) - r;
        held = std::max(held, static_cast<double>(std::abs(r)));
      }
      worst = std::max(worst, std::abs(sum - out[i]));
    }
    EXPECT_LE(worst, 1e-5) << codec;
    if (std::string(codec) == "topk:1.0") {
      EXPECT_EQ(held, 0.0);
    } else {
      EXPECT_GT(held, 0.0);  // the codec held something back somewhere
    }
  }
}

// This rank's bytes per step on the scheme's communicator (which carries
// nothing else, as with every codec): the compressed reduce-scatter's
// all-to-all of payloads per bucket, and at stages 1-2 ZeRO's all-gather
// of the updated parameters (f32). Stage 3's gathers in forward and
// backward are left out (`gathers` false): the test compares them across
// codecs instead.
uint64_t zero_step_bytes(const std::vector<ParamStore::Entry>& entries, int stage,
                         const std::string& codec) {
  ParamLayout layout;
  int64_t flat = 0;
  for (const auto& e : entries) {
    layout.push_back({e.name, e.shape, e.offset});
    flat = std::max(flat, e.offset + e.shape.numel());
  }
  const TrainerOptions o = options(scheme("allreduce"), 1);
  const BucketPlan plan(layout, flat, o.dist.dp.bucket_bytes, world().size(), world().rank());
  const CodecSpec c = parse_codec_spec(codec);
  uint64_t bytes = 0;
  for (const BucketInfo& b : plan.buckets()) {
    for (int q = 0; q < world().size(); ++q) {
      const size_t m = b.counts[static_cast<size_t>(q)];
      if (q != world().rank() && m > 0) bytes += make_payload_codec(c, m)->payload_bytes();
    }
    if (stage <= 2) {
      const Collective kind = Collective::all_gatherv;
      const CommAlgorithm a = world().choose_algorithm(kind, static_cast<size_t>(b.numel()) * 4);
      bytes += world().cost(kind, a, 0, DType::f32, b.counts).bytes_sent;
    }
  }
  return bytes;
}

// ZeRO's own reduction per step (all-reduce at stage 1, reduce-scatter at
// 2-3), for comparison.
uint64_t zero_reduction_bytes(const std::vector<ParamStore::Entry>& entries, int stage) {
  ParamLayout layout;
  int64_t flat = 0;
  for (const auto& e : entries) {
    layout.push_back({e.name, e.shape, e.offset});
    flat = std::max(flat, e.offset + e.shape.numel());
  }
  const TrainerOptions o = options(scheme("allreduce"), 1);
  const BucketPlan plan(layout, flat, o.dist.dp.bucket_bytes, world().size(), world().rank());
  uint64_t bytes = 0;
  for (const BucketInfo& b : plan.buckets()) {
    const auto numel = static_cast<size_t>(b.numel());
    const Collective kind = stage <= 1 ? Collective::all_reduce : Collective::reduce_scatterv;
    const CommAlgorithm a = world().choose_algorithm(kind, numel * 4);
    bytes += world()
                 .cost(kind, a, stage <= 1 ? numel : 0, DType::f32,
                       stage <= 1 ? std::span<const size_t>() : std::span<const size_t>(b.counts))
                 .bytes_sent;
  }
  return bytes;
}

TEST(CodecSchemesMpi, ZeroWithACodecReduceScattersCompressedChunks) {
  for (int stage : {1, 2, 3}) {
    SCOPED_TRACE(fmt::format("ZeRO-{}", stage));
    const Outcome plain = train(scheme("allreduce"), kSteps, 0.9, stage);
    const Outcome whole = train(scheme("allreduce", 1, "topk:1.0"), kSteps, 0.9, stage);
    const double d = divergence(plain, whole);
    if (world().rank() == 0) {
      std::printf("ZeRO-%d + topk:1.0 vs ZeRO-%d: worst relative difference %.3g\n", stage, stage,
                  d);
    }
    EXPECT_LE(d, 1e-5);
    for (float r : whole.residual) ASSERT_EQ(r, 0.0F);
    const uint64_t whole_step = zero_step_bytes(whole.entries, stage, "topk:1.0");
    if (stage <= 2) {
      EXPECT_EQ(whole.bytes, kSteps * whole_step);
    }
    const uint64_t gathers = whole.bytes - kSteps * whole_step;  // stage 3's parameter gathers
    const uint64_t dense = zero_reduction_bytes(whole.entries, stage);
    for (const char* codec : {"bf16", "topk:0.1"}) {
      const Outcome c = train(scheme("allreduce", 1, codec), kSteps, 0.9, stage);
      const uint64_t step = zero_step_bytes(c.entries, stage, codec);
      EXPECT_EQ(c.bytes, kSteps * step + gathers) << codec;
      const uint64_t payloads = zero_step_bytes(c.entries, 3, codec);
      // bf16: 2 bytes for ZeRO-2/3's 4 (ZeRO-1 all-reduces: 8); topk:0.1: 0.8.
      EXPECT_LE(payloads * 2, dense) << codec;
      EXPECT_TRUE(mean3_falls(c.losses)) << codec;
      EXPECT_GT(divergence(plain, c), 1e-6) << codec;  // the codec is used
      if (world().rank() == 0) {
        std::printf(
            "ZeRO-%d + %s: gradient bytes per step %llu (ZeRO's own %llu), loss %.4f -> %.4f "
            "(plain %.4f)\n",
            stage, codec, static_cast<unsigned long long>(payloads),
            static_cast<unsigned long long>(dense), c.losses.front(), c.losses.back(),
            plain.losses.back());
      }
    }
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
  return test::train_sync(ps_options(sync));
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
    const Shape& s = layout[i].shape;
    const auto n = static_cast<size_t>(s.numel());
    if (c.kind == CodecKind::powersgd) {  // P (rows x r) and Q (cols x r) in f32, or the tensor
      const auto rows = static_cast<size_t>(s[0]), cols = n / rows;
      const auto r = static_cast<size_t>(c.rank);
      per_step += 4 * (powersgd_compresses(rows, cols, c.rank) ? (rows + cols) * r : n);
      continue;
    }
    per_step += c.kind == CodecKind::none ? 4 * n : make_payload_codec(c, n)->payload_bytes();
  }
  (void)shard;  // every parameter goes to exactly one server
  return (kSteps + 1) * per_step;
}

TEST(CodecSchemesMpi, ParamServerPushesGoThroughTheCodec) {
  if (world().size() != 4) GTEST_SKIP() << "3 workers (batch 4 each) and a server: 4 ranks";
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
  // PowerSGD: each worker pushes its own rank-r factors (its own Q, warm
  // started, its own residual); the server decodes P Q^T and sums. A
  // worker's batch is 4 examples (12 over 3 workers), so each weight
  // gradient, a sum of 4 outer products, has rank <= 4: powersgd:8 is
  // exact there and equals plain BSP step by step (at rank 4 exactly, one
  // power iteration from the warm-started Q leaves columns whose remainder
  // falls under orthogonalize_columns' 1e-6 dependence cut, held back in
  // the residual: 1e-2 apart; rank 5 is exact, 2.8e-7); powersgd:1 is not
  // and still learns. Bytes: the factors (and the f32 vectors) exactly.
  for (const char* codec : {"powersgd:8", "powersgd:1"}) {
    const Outcome low = train_ps(ps("bsp", codec));
    if (!low.server) {
      EXPECT_EQ(low.bytes, predicted_pushes(low.entries, codec, 1)) << codec;
      EXPECT_LT(low.bytes, dense.bytes) << codec;
      EXPECT_TRUE(mean3_falls(low.losses)) << codec;
      const double d = divergence(dense, low);
      if (std::string(codec) == "powersgd:8") {
        EXPECT_LE(d, 1e-5) << codec;
      } else {
        EXPECT_GT(d, 1e-4) << codec;
      }
      if (world().rank() == 0) {
        std::printf(
            "ps bsp + %s: push bytes %llu vs f32 %llu, worst relative difference to f32 %.3g, "
            "loss %.4f -> %.4f\n",
            codec, static_cast<unsigned long long>(low.bytes),
            static_cast<unsigned long long>(dense.bytes), d, low.losses.front(), low.losses.back());
      }
    }
  }
  {
    const size_t rows = 12, cols = 9;  // M = a b^T + c d^T: rank 2
    std::vector<float> m(rows * cols);
    for (size_t i = 0; i < rows; ++i) {
      for (size_t j = 0; j < cols; ++j) {
        m[i * cols + j] = static_cast<float>(std::sin(1.0 + i) * std::cos(0.5 * j) +
                                             0.3 * std::cos(2.0 * i) * std::sin(1.0 + j));
      }
    }
    FeedbackEncoder enc(make_low_rank_payload_codec(parse_codec_spec("powersgd:2"), rows, cols),
                        true);
    std::vector<std::byte> payload(enc.codec().payload_bytes());
    EXPECT_EQ(payload.size(), 4 * (rows + cols) * 2);
    enc.encode(m, 7, payload);
    double worst = 0;
    for (float r : enc.residual()) worst = std::max(worst, static_cast<double>(std::abs(r)));
    EXPECT_LE(worst, 1e-5);
    std::vector<float> q0(enc.state().begin(), enc.state().end());
    enc.encode(m, 8, payload);  // warm start: Q is the previous one's, not drawn
    std::vector<float> decoded(rows * cols, 0.0f);
    enc.codec().decode_add(payload, 1.0f, decoded);
    for (size_t i = 0; i < m.size(); ++i) EXPECT_NEAR(decoded[i], m[i], 1e-5);
    EXPECT_NE(std::vector<float>(enc.state().begin(), enc.state().end()), q0);
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
  SyncOptions s = scheme("diloco", 4, "sign");
  s.outer_bits = 4;
  s.fragments = 2;
  EXPECT_NE(error_of(s).find("sync.codec = \"sign\" with sync.outer_bits = 4: the 4-bit outer "
                             "exchange is a codec of its own"),
            std::string::npos)
      << error_of(s);
  s = scheme("local_sgd", 4, "topk:100000");  // more than a parameter holds
  EXPECT_NE(error_of(s).find("does not fit tensor"), std::string::npos) << error_of(s);
  s = scheme("ps", 1, "topk:100000");
  EXPECT_NE(error_of(s).find("does not fit"), std::string::npos) << error_of(s);
  // ZeRO: PowerSGD has no chunk payload; a count k larger than a chunk.
  s = scheme("allreduce", 1, "powersgd:2");
  EXPECT_NE(error_of(s, 2).find("sync.codec = \"powersgd:2\" under ZeRO (dist.zero_stage > 0)"),
            std::string::npos)
      << error_of(s, 2);
  s = scheme("allreduce", 1, "topk:100000");
  EXPECT_NE(error_of(s, 1).find("chunk of rank"), std::string::npos) << error_of(s, 1);
  EXPECT_EQ(error_of(scheme("allreduce", 1, "topk:0.01"), 2), "no error");
  EXPECT_EQ(error_of(scheme("local_sgd", 4, "qsgd:4")), "no error");
}

}  // namespace
}  // namespace mt

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  mt::world();  // initialise MPI before any test
  return RUN_ALL_TESTS();
}
