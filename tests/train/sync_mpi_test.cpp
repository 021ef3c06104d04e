// Synchronization schemes (sync/replica_sync.h) through the Trainer under
// mpirun (4 ranks), on the MLP with plain SGD:
// - the exact equivalences: local SGD with period 1, DiLoCo with period 1,
//   outer learning rate 1 and no outer momentum, and gossip on the complete
//   graph each equal all-reduce data parallelism step by step (loss of every
//   step and the final parameters, within 1e-5 relative: the schemes average
//   parameters where all-reduce sums gradients, which re-associates one sum
//   of 4 terms per element per step);
// - local SGD with period 4 sends exactly a quarter of period 1's bytes (the
//   communicator's counters) and its replicas agree after a synchronization;
// - partial (layer-wise) synchronization with period 1 equals all-reduce DP
//   and local SGD with period 1; with period 3 it sends a third of period
//   1's bytes, and right after a layer's averaging step that layer (and only
//   it) is equal on every rank;
// - gossip on a ring lets replicas differ (consensus distance > 0) and still
//   learns;
// - Streaming DiLoCo (sync.fragments, sync.overlap_steps, sync.outer_bits):
//   one fragment without overlap at 32 bits is DiLoCo (outer lr 1, mu 0:
//   local SGD with the same period); fragments synchronize on their
//   staggered schedule (right after its step a fragment, and only it, is
//   equal on every rank; one fragment's exchange is 1/F of the full one's
//   bytes); the 4-bit quantizer stays within its bound and is unbiased;
//   overlapped runs learn and send exactly the predicted bytes;
// - local SGD and DiLoCo agree on the loss once a period (step lines between
//   are each rank's own);
// - bad settings are refused before any step, naming the key.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "meshtrain/base/error.h"
#include "meshtrain/sync/compressed_all_reduce.h"
#include "meshtrain/sync/local_steps.h"
#include "meshtrain/sync/outer_quant.h"
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

TrainerOptions options(const SyncOptions& sync) {
  return test::sync_options(sync, {.steps = kSteps});
}

struct Outcome {
  std::vector<double> losses;
  std::vector<float> params;  // the replicas' mean
  std::vector<float> own;     // this rank's own parameters
  std::vector<ParamStore::Entry> entries;
  uint64_t bytes = 0;
  ReplicaSync::Consensus consensus;
};

Outcome train(const SyncOptions& sync, int64_t steps = kSteps) {
  auto data = std::make_shared<test::SyntheticData>(spec(), 256, 9);
  TrainerOptions o = options(sync);
  o.max_steps = steps;
  Trainer t(spec(), data, nullptr, o, &world());
  Outcome out;
  out.losses = t.run().losses;
  const Tensor own = t.params().flat_values();
  out.own.assign(own.data<float>(), own.data<float>() + own.numel());
  out.entries = t.params().entries();
  const Tensor mean = t.gather_params();
  out.params.assign(mean.data<float>(), mean.data<float>() + mean.numel());
  out.bytes = t.replica_sync().bytes_sent();
  out.consensus = t.replica_sync().consensus();
  return out;
}

// The global mean loss of every step: local SGD and DiLoCo report each
// rank's own between their agreements (ReplicaSync::agreement_period); the
// ranks' batches are equal, so the mean of their means is the global one.
std::vector<double> global_losses(const Outcome& o) {
  std::vector<double> l = o.losses;
  world().all_reduce(l.data(), l.data(), l.size(), DType::f64);
  for (double& x : l) x /= world().size();
  return l;
}

using test::divergence;

SyncOptions scheme(const std::string& name) {
  SyncOptions s;
  s.scheme = name;
  return s;
}

TEST(SyncSchemesMpi, ExactEquivalencesWithAllReduce) {
  const Outcome dp = train(scheme("allreduce"));
  ASSERT_EQ(dp.losses.size(), static_cast<size_t>(kSteps));
  SyncOptions local = scheme("local_sgd");
  SyncOptions diloco = scheme("diloco");
  diloco.outer_lr = 1.0;
  diloco.outer_momentum = 0.0;
  SyncOptions gossip = scheme("gossip");
  gossip.topology = "complete";
  SyncOptions partial = scheme("partial");  // period 1: every layer every step
  for (const SyncOptions& s : {local, diloco, gossip, partial}) {
    const Outcome got = train(s);
    const double d = divergence(dp, got);
    if (world().rank() == 0) {
      std::printf("%s (period 1) vs allreduce, %d ranks: worst relative difference %.3g\n",
                  s.scheme.c_str(), world().size(), d);
    }
    EXPECT_LE(d, 1e-5) << s.scheme;
  }
  // Test of the test: a learning rate 1% off is seen.
  SyncOptions off = local;
  auto data = std::make_shared<test::SyntheticData>(spec(), 256, 9);
  TrainerOptions o = options(off);
  o.schedule.lr *= 1.01;
  Trainer t(spec(), data, nullptr, o, &world());
  Outcome got;
  got.losses = t.run().losses;
  const Tensor p = t.gather_params();
  got.params.assign(p.data<float>(), p.data<float>() + p.numel());
  EXPECT_GT(divergence(dp, got), 1e-4);
}

TEST(SyncSchemesMpi, LocalSgdSendsOnceEveryPeriod) {
  SyncOptions every = scheme("local_sgd");
  SyncOptions fourth = every;
  fourth.period = 4;
  const Outcome a = train(every), b = train(fourth);
  ASSERT_GT(a.bytes, 0u);
  EXPECT_EQ(b.bytes * 4, a.bytes) << "period 4 sends " << b.bytes << ", period 1 " << a.bytes;
  // 12 steps: the last step synchronized, so every replica holds the mean.
  EXPECT_EQ(b.own, b.params);
  EXPECT_EQ(b.consensus.distance, 0.0);
  // Between synchronizations replicas differ; the losses show it differs from period 1.
  EXPECT_NE(a.losses.back(), b.losses.back());
}

// Periodic schemes agree on the loss (and a stop request) only once a
// period (ReplicaSync::agreement_period), so that a slow link's latency is
// not paid by every step: at the steps that end a period every rank
// reports the same global mean loss; between them each rank its own.
TEST(SyncSchemesMpi, PeriodicSchemesAgreeOnTheLossOncePerPeriod) {
  for (const char* name : {"local_sgd", "diloco"}) {
    SyncOptions s = scheme(name);
    s.period = 4;
    const Outcome o = train(s);
    ASSERT_EQ(o.losses.size(), static_cast<size_t>(kSteps));
    for (int i = 0; i < kSteps; ++i) {
      double lo = o.losses[static_cast<size_t>(i)], hi = lo;
      world().all_reduce(&lo, &lo, 1, DType::f64, ReduceOp::min);
      world().all_reduce(&hi, &hi, 1, DType::f64, ReduceOp::max);
      if ((i + 1) % 4 == 0) {
        EXPECT_EQ(lo, hi) << name << ": step " << i + 1 << " ends a period";
      } else {
        EXPECT_NE(lo, hi) << name << ": step " << i + 1 << " is inside a period";
      }
    }
  }
}

// Layer-wise partial synchronization: the MLP's layers fc1, fc2, head
// (layout order) go to groups 0, 1, 2 with period 3; step t averages group
// (t - 1) % 3.
TEST(SyncSchemesMpi, PartialSyncAveragesOneLayerGroupPerStep) {
  const Outcome local = train(scheme("local_sgd"));
  const Outcome every = train(scheme("partial"));
  const double d = divergence(local, every);
  if (world().rank() == 0) {
    std::printf("partial (period 1) vs local_sgd (period 1): worst relative difference %.3g\n", d);
  }
  EXPECT_LE(d, 1e-6);
  SyncOptions third = scheme("partial");
  third.period = 3;
  const Outcome b = train(third);
  ASSERT_GT(every.bytes, 0u);
  if (world().rank() == 0) {
    std::printf("partial bytes over %d steps: period 1 %llu, period 3 %llu\n", kSteps,
                static_cast<unsigned long long>(every.bytes),
                static_cast<unsigned long long>(b.bytes));
  }
  // 12 steps = 4 rounds of the 3 groups: one full average per round. Per
  // rank the ring's chunk boundaries differ with the count; summed over
  // ranks each all-reduce sends 2 (n - 1) x its bytes, so the totals match.
  double sums[2] = {static_cast<double>(every.bytes), static_cast<double>(b.bytes)};
  world().all_reduce(sums, sums, 2, DType::f64);
  if (world().rank() == 0) {
    std::printf("partial bytes over %d steps, all ranks: period 1 %.0f, period 3 %.0f\n", kSteps,
                sums[0], sums[1]);
  }
  EXPECT_NEAR(sums[1] * 3 / sums[0], 1.0, 0.005) << sums[1] << " x 3 vs " << sums[0];

  // Which layers agree across ranks after 11 steps (step 11 averaged group
  // 1 = fc2) and after 12 (group 2 = head).
  for (int64_t steps : {int64_t{11}, int64_t{12}}) {
    const Outcome o = train(third, steps);
    ASSERT_EQ(o.entries.size(), 6u);
    const int n = world().size();
    std::vector<float> all(o.own.size() * static_cast<size_t>(n));
    world().all_gather(o.own.data(), all.data(), o.own.size(), DType::f32);
    const std::string averaged = steps == 11 ? "fc2" : "head";
    for (const ParamStore::Entry& e : o.entries) {
      bool equal = true;
      for (int64_t i = 0; i < e.shape.numel(); ++i) {
        const size_t at = static_cast<size_t>(e.offset + i);
        for (int r = 1; r < n; ++r) equal = equal && all[at] == all[r * o.own.size() + at];
      }
      const bool in_layer = e.name.starts_with(averaged + ".");
      EXPECT_EQ(equal, in_layer) << e.name << " after " << steps << " steps";
    }
  }
}

TEST(SyncSchemesMpi, GossipOnARingLetsReplicasDriftAndLearns) {
  SyncOptions ring = scheme("gossip");
  const Outcome g = train(ring);
  EXPECT_GT(g.consensus.distance, 0.0);
  EXPECT_LT(g.consensus.relative, 0.1);
  EXPECT_LT(g.losses.back(), g.losses.front());
  const Outcome dp = train(scheme("allreduce"));
  EXPECT_NE(g.losses.back(), dp.losses.back());
}

// Gradient codecs on the all-reduce exchange (sync.codec): top-k keeping
// every element is all-reduce DP (the average of whole gradients); top-k
// 1% sends over 20x fewer bytes; top-k 10% with error feedback learns; the
// same in the compact wire format, which sends under half the bytes.
TEST(SyncSchemesMpi, CodecsOnTheAllReduceExchange) {
  const Outcome dp = train(scheme("allreduce"));
  SyncOptions all = scheme("allreduce");
  all.codec = "topk:1.0";
  const Outcome whole = train(all);
  const double d = divergence(dp, whole);
  if (world().rank() == 0) {
    std::printf("allreduce + topk:1.0 vs allreduce: worst relative difference %.3g\n", d);
  }
  EXPECT_LE(d, 1e-5);
  SyncOptions sparse = all;
  sparse.codec = "topk:0.01";
  const Outcome few = train(sparse);
  EXPECT_EQ(few.own, few.params);  // every replica holds the same parameters
  EXPECT_GT(whole.bytes, 20 * few.bytes) << whole.bytes << " vs " << few.bytes;
  // In 12 steps 1% moves too little to show; 10% with error feedback learns.
  SyncOptions tenth = all;
  tenth.codec = "topk:0.1";
  const Outcome part = train(tenth);
  const auto mean3 = [](const std::vector<double>& v, size_t from) {
    return (v[from] + v[from + 1] + v[from + 2]) / 3;
  };
  EXPECT_LT(mean3(part.losses, part.losses.size() - 3), mean3(part.losses, 0));
  // The compact wire format (bf16 values, Elias-Fano indices): replicas
  // still agree, the 1% exchange sends under half the (index, value) pairs'
  // bytes (3.07 against 8 bytes an element on large tensors), and 10% learns.
  SyncOptions compact = all;
  compact.codec = "topk:0.01:compact";
  const Outcome small = train(compact);
  EXPECT_EQ(small.own, small.params);
  if (world().rank() == 0) {
    std::printf("topk:0.01 %lld bytes, topk:0.01:compact %lld, dense all-reduce %lld (%.1fx)\n",
                static_cast<long long>(few.bytes), static_cast<long long>(small.bytes),
                static_cast<long long>(dp.bytes),
                static_cast<double>(dp.bytes) / static_cast<double>(small.bytes));
  }
  EXPECT_LT(2 * small.bytes, few.bytes) << small.bytes << " vs " << few.bytes;
  compact.codec = "topk:0.1:compact";
  const Outcome part_compact = train(compact);
  EXPECT_LT(mean3(part_compact.losses, part_compact.losses.size() - 3),
            mean3(part_compact.losses, 0));
}

// ---- Streaming DiLoCo

SyncOptions diloco(int64_t period, int64_t fragments, int64_t overlap = 0, int64_t bits = 32) {
  SyncOptions s = scheme("diloco");
  s.period = period;
  s.fragments = fragments;
  s.overlap_steps = overlap;
  s.outer_bits = bits;
  return s;
}

int64_t flat_numel(const Outcome& o) {
  return static_cast<int64_t>(o.own.size());
}

// Whether elements [offset, offset + numel) of every rank's own parameters
// are equal.
bool equal_on_all_ranks(const Outcome& o, int64_t offset, int64_t numel) {
  const int n = world().size();
  std::vector<float> all(o.own.size() * static_cast<size_t>(n));
  world().all_gather(o.own.data(), all.data(), o.own.size(), DType::f32);
  bool equal = true;
  for (int64_t i = offset; i < offset + numel; ++i) {
    for (int r = 1; r < n; ++r) {
      equal =
          equal && all[static_cast<size_t>(i)] == all[r * o.own.size() + static_cast<size_t>(i)];
    }
  }
  return equal;
}

double summed_over_ranks(uint64_t bytes) {
  double b = static_cast<double>(bytes);
  world().all_reduce(&b, &b, 1, DType::f64);
  return b;
}

// This rank's bytes for one fragment exchange of `numel` elements, by the
// communicator's cost model (the scheme's communicator is a split of the
// world with the same ranks and collective options).
uint64_t predicted_exchange(int64_t numel, int64_t bits, bool reduce_scatter = false) {
  PlannedCollective c;
  if (reduce_scatter) {
    // all_to_all of one slot per rank (a piece of ceil(numel / ranks)
    // values), then all_gather of one slot
    const auto piece = static_cast<size_t>((numel + world().size() - 1) / world().size());
    const std::vector<PlannedCollective> plan = {
        {Collective::all_to_all, Int4Quantizer::payload_bytes(piece), DType::u8},
        {Collective::all_gather, Int4Quantizer::payload_bytes(piece), DType::u8}};
    return predict_traffic(world(), plan).bytes_sent;
  }
  if (bits == 32) {
    c.kind = Collective::all_reduce;
    c.count = static_cast<size_t>(numel);
    c.dtype = DType::f32;
  } else {
    c.kind = Collective::all_gather;
    c.count = Int4Quantizer::payload_bytes(static_cast<size_t>(numel));
    c.dtype = DType::u8;
  }
  const std::vector<PlannedCollective> plan = {c};
  return predict_traffic(world(), plan).bytes_sent;
}

TEST(StreamingDilocoMpi, OneFragmentWithoutOverlapIsDiloco) {
  // DiLoCo with outer lr 1 and no momentum: start - mean(start - theta_r)
  // = mean(theta_r), local SGD's average, every 4 steps.
  SyncOptions s = diloco(4, 1);
  s.outer_lr = 1.0;
  s.outer_momentum = 0.0;
  SyncOptions local = scheme("local_sgd");
  local.period = 4;
  const Outcome a = train(local), b = train(s);
  const double d = divergence(a, b);
  if (world().rank() == 0) {
    std::printf("diloco (1 fragment, period 4, lr 1, mu 0) vs local_sgd (period 4): %.3g\n", d);
  }
  EXPECT_LE(d, 1e-5);
  EXPECT_EQ(a.bytes, b.bytes);
  EXPECT_EQ(b.own, b.params);  // step 12 synchronized
  // With momentum it is not local SGD (the test sees the difference).
  const Outcome c = train(diloco(4, 1));
  EXPECT_GT(divergence(a, c), 1e-4);
}

TEST(StreamingDilocoMpi, FragmentsSynchronizeOnAStaggeredSchedule) {
  // period 4, 2 fragments: fragment 0 at steps 4, 8, 12; fragment 1 at 2, 6, 10.
  const SyncOptions two = diloco(4, 2);
  const Outcome ten = train(two, 10), twelve = train(two, 12);
  const std::vector<DilocoFragment> f = diloco_fragments(flat_numel(ten), 2, 4);
  ASSERT_EQ(f.size(), 2u);
  EXPECT_EQ(f[1].phase, 2);
  EXPECT_LE(std::abs(f[0].numel - f[1].numel), 1);
  EXPECT_EQ(f[0].numel + f[1].numel, flat_numel(ten));
  EXPECT_TRUE(equal_on_all_ranks(ten, f[1].offset, f[1].numel));
  EXPECT_FALSE(equal_on_all_ranks(ten, f[0].offset, f[0].numel));
  EXPECT_TRUE(equal_on_all_ranks(twelve, f[0].offset, f[0].numel));
  EXPECT_FALSE(equal_on_all_ranks(twelve, f[1].offset, f[1].numel));

  // Bytes: after 2 steps only fragment 1 has been exchanged once; after 4
  // steps plain DiLoCo has exchanged everything once.
  const Outcome first = train(two, 2), full = train(diloco(4, 1), 4);
  EXPECT_EQ(first.bytes, predicted_exchange(f[1].numel, 32));
  EXPECT_EQ(full.bytes, predicted_exchange(flat_numel(full), 32));
  const double one = summed_over_ranks(first.bytes), all = summed_over_ranks(full.bytes);
  if (world().rank() == 0) {
    std::printf(
        "diloco period 4: one of 2 fragments %.0f bytes, the whole model %.0f (all ranks)\n", one,
        all);
  }
  EXPECT_NEAR(one * 2 / all, 1.0, 0.005);
  // Over whole periods the fragments send what plain DiLoCo sends.
  const Outcome plain = train(diloco(4, 1), 12);
  EXPECT_NEAR(summed_over_ranks(twelve.bytes) / summed_over_ranks(plain.bytes), 1.0, 0.005);
  // Four fragments over one period: one exchange every step.
  const Outcome four = train(diloco(4, 4), 4);
  uint64_t want = 0;
  for (const DilocoFragment& g : diloco_fragments(flat_numel(four), 4, 4)) {
    want += predicted_exchange(g.numel, 32);
  }
  EXPECT_EQ(four.bytes, want);
}

TEST(StreamingDiloco, FourBitQuantizerIsBoundedAndUnbiased) {
  constexpr size_t kN = 1000;  // 16 chunks, the last one short
  std::mt19937_64 gen(7);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  std::vector<float> x(kN);
  for (size_t i = 0; i < kN; ++i) x[i] = normal(gen) * (i < 64 ? 100.0F : 1.0F);
  x[70] = 0.0F;
  std::vector<float> scale(kN);
  for (size_t k = 0; k < kN; k += Int4Quantizer::kChunk) {
    float m = 0;
    for (size_t i = k; i < std::min(kN, k + Int4Quantizer::kChunk); ++i)
      m = std::max(m, std::abs(x[i]));
    for (size_t i = k; i < std::min(kN, k + Int4Quantizer::kChunk); ++i) scale[i] = m;
  }
  EXPECT_EQ(Int4Quantizer::payload_bytes(kN), 16 * 4 + 500u);
  std::vector<std::byte> payload(Int4Quantizer::payload_bytes(kN));
  constexpr int kSeeds = 4000;
  std::vector<double> mean(kN, 0.0);
  size_t moved = 0;
  std::vector<float> first;
  for (int seed = 0; seed < kSeeds; ++seed) {
    Int4Quantizer::encode(x, static_cast<uint64_t>(seed) * 7919 + 1, payload);
    std::vector<float> y(kN, 0.0F);
    Int4Quantizer::decode_add(payload, y);
    for (size_t i = 0; i < kN; ++i) {
      // The stated bound: within one level, scale / 7.
      ASSERT_LT(std::abs(y[i] - x[i]), scale[i] / 7 * 1.0001F + 1e-30F) << i << " seed " << seed;
      mean[i] += y[i] / kSeeds;
    }
    if (seed == 0) first = y;
    for (size_t i = 0; i < kN; ++i) moved += y[i] != first[i];
  }
  EXPECT_EQ(mean[70], 0.0);
  // Unbiased: each decoded value is one of two adjacent levels, so its
  // standard deviation is at most scale / 14; the mean over 4000 seeds is
  // within 6 of its standard errors of x.
  int outside = 0;
  for (size_t i = 0; i < kN; ++i) {
    const double se = scale[i] / 14.0 / std::sqrt(static_cast<double>(kSeeds));
    outside += std::abs(mean[i] - x[i]) > 6 * se + 1e-6 * scale[i];
  }
  EXPECT_EQ(outside, 0);
  EXPECT_GT(moved, kN);  // the rounding is random (a fixed rounding would be biased)
  // A diverged replica is named, not sent.
  x[5] = std::nanf("");
  try {
    Int4Quantizer::encode(x, 1, payload);
    ADD_FAILURE() << "NaN encoded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("training diverged: sync.outer_bits = 4"),
              std::string::npos)
        << e.what();
  }
}

TEST(StreamingDilocoMpi, FourBitExchangeSendsItsPayloadsAndKeepsFragmentsEqual) {
  const SyncOptions q = diloco(4, 2, 0, 4);
  const Outcome ten = train(q, 10);
  const std::vector<DilocoFragment> f = diloco_fragments(flat_numel(ten), 2, 4);
  // Every rank decodes the same payloads in the same order.
  EXPECT_TRUE(equal_on_all_ranks(ten, f[1].offset, f[1].numel));
  EXPECT_FALSE(equal_on_all_ranks(ten, f[0].offset, f[0].numel));
  // Exchanges at steps 2, 4, 6, 8, 10: fragment 1 three times, fragment 0 twice.
  EXPECT_EQ(ten.bytes,
            3 * predicted_exchange(f[1].numel, 4) + 2 * predicted_exchange(f[0].numel, 4));
  const Outcome dense = train(diloco(4, 2), 10);
  if (world().rank() == 0) {
    std::printf("diloco 2 fragments, 10 steps: 32-bit %llu bytes, 4-bit %llu bytes (rank 0)\n",
                static_cast<unsigned long long>(dense.bytes),
                static_cast<unsigned long long>(ten.bytes));
  }
  EXPECT_GT(dense.bytes, 3 * ten.bytes);
}

// 4 bits by reduce-scatter: pieces to their owners (all_to_all), summed and
// re-quantized there, all-gathered.
TEST(StreamingDilocoMpi, FourBitReduceScatterSendsFewerBytesAndKeepsFragmentsEqual) {
  SyncOptions q = diloco(4, 2, 0, 4);
  q.outer_exchange = "reduce_scatter";
  const Outcome ten = train(q, 10);
  const std::vector<DilocoFragment> f = diloco_fragments(flat_numel(ten), 2, 4);
  EXPECT_TRUE(equal_on_all_ranks(ten, f[1].offset, f[1].numel));
  EXPECT_FALSE(equal_on_all_ranks(ten, f[0].offset, f[0].numel));
  EXPECT_EQ(ten.bytes, 3 * predicted_exchange(f[1].numel, 4, true) +
                           2 * predicted_exchange(f[0].numel, 4, true));
  const Outcome gathered = train(diloco(4, 2, 0, 4), 10);
  if (world().rank() == 0) {
    std::printf("diloco 2 fragments, 10 steps, 4-bit: all-gather %llu bytes, reduce-scatter %llu\n",
                static_cast<unsigned long long>(gathered.bytes),
                static_cast<unsigned long long>(ten.bytes));
  }
  EXPECT_GT(gathered.bytes, ten.bytes * 3 / 2);  // 2x at 4 ranks, less the padding
  // Overlapped: the all_to_all flies over one step, the all_gather over the next.
  q.overlap_steps = 2;
  const Outcome o = train(q, 16);
  const uint64_t want =
      4 * predicted_exchange(f[0].numel, 4, true) + 4 * predicted_exchange(f[1].numel, 4, true);
  EXPECT_EQ(o.bytes, want);
  const std::vector<double> l = global_losses(o);
  EXPECT_LT(l[13] + l[14] + l[15], l[0] + l[1] + l[2]);
}

TEST(StreamingDilocoMpi, OverlappedExchangesLearnAndSendThePredictedBytes) {
  constexpr int64_t kRun = 16;  // one epoch of the synthetic data
  for (int64_t bits : {int64_t{32}, int64_t{4}}) {
    SyncOptions s = diloco(4, 2, 1, bits);
    // A measurement every step (a blocking collective on the scheme's
    // communicator, often while an exchange is in flight): its bytes are
    // left out, the exchanges' are not.
    s.consensus_every = 1;
    const Outcome o = train(s, kRun);
    ASSERT_EQ(o.losses.size(), static_cast<size_t>(kRun));
    const std::vector<DilocoFragment> f = diloco_fragments(flat_numel(o), 2, 4);
    // Fragment 0 at steps 4, 8, 12, 16 and fragment 1 at 2, 6, 10, 14: four
    // each (the one sent at step 16 lands at the end of the run).
    const uint64_t want =
        4 * predicted_exchange(f[0].numel, bits) + 4 * predicted_exchange(f[1].numel, bits);
    EXPECT_EQ(o.bytes, want) << bits << "-bit";
    const auto mean3 = [](const std::vector<double>& v, size_t from) {
      return (v[from] + v[from + 1] + v[from + 2]) / 3;
    };
    const std::vector<double> l = global_losses(o);
    const double early = mean3(l, 0), late = mean3(l, l.size() - 3);
    if (world().rank() == 0) {
      std::printf("diloco 2 fragments, overlap 1, %lld-bit: loss %.4f -> %.4f, %llu bytes\n",
                  static_cast<long long>(bits), early, late,
                  static_cast<unsigned long long>(o.bytes));
    }
    EXPECT_LT(late, early) << bits << "-bit";
    // The merge mixed local and global values: replicas differ.
    EXPECT_GT(o.consensus.distance, 0.0);
  }
  // merge_alpha changes the run (it is used).
  SyncOptions a = diloco(4, 2, 1);
  SyncOptions b = a;
  b.merge_alpha = 0.0;
  EXPECT_NE(train(a, 12).losses.back(), train(b, 12).losses.back());
}

TEST(SyncSchemes, NeighboursFormRegularSymmetricGraphs) {
  for (const char* topo : {"ring", "torus", "exponential", "complete"}) {
    for (int n : {2, 3, 4, 6, 8, 9}) {
      size_t degree = gossip_neighbours(topo, 0, n).size();
      for (int r = 0; r < n; ++r) {
        const std::vector<int> nb = gossip_neighbours(topo, r, n);
        EXPECT_EQ(nb.size(), degree) << topo << " n=" << n << " rank " << r;
        for (int q : nb) {
          const std::vector<int> back = gossip_neighbours(topo, q, n);
          EXPECT_TRUE(std::find(back.begin(), back.end(), r) != back.end())
              << topo << " n=" << n << ": " << r << " -> " << q << " but not back";
          EXPECT_NE(q, r);
        }
      }
    }
  }
  EXPECT_EQ(gossip_neighbours("torus", 0, 4), (std::vector<int>{1, 2}));  // 2 x 2 grid
  EXPECT_EQ(gossip_neighbours("ring", 0, 5), (std::vector<int>{1, 4}));
  EXPECT_EQ(gossip_neighbours("exponential", 0, 8), (std::vector<int>{1, 2, 4, 6, 7}));
}

std::string error_of(const SyncOptions& s, int zero = 0, std::string checkpoint = "") {
  try {
    auto data = std::make_shared<test::SyntheticData>(spec(), 256, 9);
    TrainerOptions o = options(s);
    o.dist.dp.stage = zero;
    o.checkpoint_path = std::move(checkpoint);
    Trainer t(spec(), data, nullptr, o, &world());
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "no error";
}

TEST(SyncSchemesMpi, BadSettingsAreRefusedNamingTheKey) {
  SyncOptions s = scheme("local_sgd");
  s.period = 0;
  EXPECT_NE(error_of(s).find("sync.period: the steps between synchronizations must be >= 1, got 0"),
            std::string::npos)
      << error_of(s);
  s = scheme("gossip");
  s.topology = "star";
  EXPECT_NE(error_of(s).find("sync.topology: unknown topology 'star'"), std::string::npos);
  s = scheme("diloco");
  s.outer_momentum = 1.0;
  EXPECT_NE(error_of(s).find("sync.outer_momentum: must be in [0, 1), got 1"), std::string::npos);
  s = scheme("paramserver");
  EXPECT_NE(error_of(s).find("sync.scheme: unknown scheme 'paramserver'"), std::string::npos);
  EXPECT_NE(error_of(scheme("local_sgd"), 2).find("dist.zero_stage must be 0 (got 2)"),
            std::string::npos);
  s = scheme("allreduce");
  s.codec = "topk:0";
  EXPECT_NE(error_of(s).find("sync.codec"), std::string::npos) << error_of(s);
  s.codec = "powersgd:2";  // ZeRO takes the payload codecs (codec_schemes_mpi_test.cpp)
  EXPECT_NE(error_of(s, 1).find("under ZeRO (dist.zero_stage > 0)"), std::string::npos)
      << error_of(s, 1);
  // Codecs under the other schemes: tests/train/codec_schemes_mpi_test.cpp.
  for (const char* name : {"partial", "adpsgd"}) {
    EXPECT_NE(error_of(scheme(name), 1).find("dist.zero_stage must be 0 (got 1)"),
              std::string::npos)
        << name;
  }
  s = diloco(4, 0);
  EXPECT_NE(error_of(s).find("sync.fragments: Streaming DiLoCo's fragments must be >= 1"),
            std::string::npos)
      << error_of(s);
  s = diloco(4, 7);  // the MLP has 6 parameter tensors
  EXPECT_NE(error_of(s).find("sync.fragments = 7: the model has 6 parameter tensors"),
            std::string::npos)
      << error_of(s);
  s = diloco(4, 2, 4);
  EXPECT_NE(error_of(s).find("sync.overlap_steps: the inner steps a fragment's exchange "
                             "overlaps must be in [0, sync.period) = [0, 4)"),
            std::string::npos)
      << error_of(s);
  s = diloco(4, 2, 0, 8);
  EXPECT_NE(error_of(s).find("sync.outer_bits: the outer exchange sends 32-bit floats or 4-bit "
                             "codes, so 32 or 4, got 8"),
            std::string::npos)
      << error_of(s);
  s = diloco(4, 2, 1);
  s.merge_alpha = 1.5;
  EXPECT_NE(error_of(s).find("sync.merge_alpha"), std::string::npos) << error_of(s);
  s = diloco(4, 2);
  s.outer_exchange = "reduce_scatter";
  EXPECT_NE(error_of(s).find("sync.outer_exchange = \"reduce_scatter\": chooses how 4-bit "
                             "payloads travel, so it needs sync.outer_bits = 4 (got 32"),
            std::string::npos)
      << error_of(s);
  s.outer_bits = 4;
  s.outer_exchange = "ring";
  EXPECT_NE(error_of(s).find("sync.outer_exchange: expected"), std::string::npos) << error_of(s);
  s = scheme("local_sgd");
  s.fragments = 2;
  EXPECT_NE(error_of(s).find("sync.fragments: Streaming DiLoCo's options apply to sync.scheme = "
                             "\"diloco\" only"),
            std::string::npos)
      << error_of(s);
  // Checkpoints under these schemes: tests/train/sync_checkpoint_mpi_test.cpp;
  // AD-PSGD's are refused.
  EXPECT_NE(error_of(scheme("adpsgd"), 0, "/tmp/never")
                .find("train.checkpoint: not available with sync.scheme = \"adpsgd\""),
            std::string::npos);
}

}  // namespace
}  // namespace mt

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  mt::world();  // initialise MPI before any test
  return RUN_ALL_TESTS();
}
