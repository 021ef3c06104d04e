// Checkpoints under the synchronization schemes whose ranks hold state of
// their own (docs/sync.md "Checkpoints"), through the Trainer under mpirun
// (4 ranks), on the MLP: a run stopped after step k (train.halt_after) with
// a checkpoint and resumed from it equals the uninterrupted run BITWISE on
// every rank: the loss of every step and the rank's own parameters (its
// replica; a server's shard). Covered: local SGD (period 3, SGD with
// momentum: the per-replica momentum is part of the state), post-local SGD,
// DiLoCo (AdamW inner, Nesterov outer: start and outer momentum), Streaming
// DiLoCo (fragments, overlap, 4-bit by all-gather and by reduce-scatter:
// checkpoints taken while a fragment's exchange is in flight), D-PSGD on a
// ring, partial (layer-wise) synchronization, and the parameter server in
// BSP (3 workers + 1 server, 2 + 2). ASP resumes and trains (it is
// nondeterministic by design). A checkpoint that saves mid-run
// (checkpoint_every) leaves the run itself unchanged. Refused, naming the
// key: another scheme, another number of ranks, other DiLoCo fragments,
// sync.servers; adpsgd; checkpoint_every under ps. All-reduce and
// parameter-server checkpoints (whole tensors) resume under other schemes.
// All-reduce with a codec: each rank's codec state (residuals, PowerSGD's
// Q, DGC's velocity) resumes bitwise too.
#include <gtest/gtest.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/base/error.h"
#include "meshtrain/sync/param_server.h"
#include "meshtrain/sync/replica_sync.h"
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
  TrainerOptions o =
      test::sync_options(sync, {.batch = 12, .steps = kSteps, .lr = 0.05, .momentum = 0.9});
  o.dist.consistency_every = 0;
  return o;
}

struct Outcome {
  std::vector<double> losses;
  std::vector<float> own;  // this rank's own parameters
  int64_t steps = 0;       // a parameter server: those of its checkpoint (it runs none)
  bool server = false;
};

Outcome train(const TrainerOptions& o, Communicator* group = &world()) {
  auto data = std::make_shared<test::SyntheticData>(spec(), 480, 9);
  Trainer t(spec(), data, nullptr, o, group);
  Outcome out;
  const TrainResult r = t.run();
  out.losses = r.losses;
  out.steps = r.steps;
  out.server = t.replica_sync().is_server();
  const Tensor own = t.params().flat_values();
  out.own.assign(own.data<float>(), own.data<float>() + own.numel());
  if (out.server) {
    // A server's own parameters are its shard (the others it never updates,
    // and a resumed server read them from the checkpoint).
    ParamLayout layout;
    for (const auto& e : t.params().entries()) layout.push_back({e.name, e.shape, e.offset});
    const int servers = static_cast<int>(o.dist.sync.servers);
    const std::vector<int> shard = ps_shards(layout, servers);
    const int me = world().rank() - (world().size() - servers);
    for (size_t i = 0; i < layout.size(); ++i) {
      if (shard[i] == me) continue;
      std::fill_n(out.own.begin() + layout[i].offset, layout[i].shape.numel(), 0.0F);
    }
  }
  return out;
}

// A fresh directory name, the same on every rank.
std::string temp_dir(const std::string& tag) {
  int64_t id = world().rank() == 0 ? static_cast<int64_t>(getpid()) : 0;
  world().broadcast(&id, 1, DType::i64, 0);
  static int n = 0;
  return fmt::format("/tmp/meshtrain_sync_ckpt_{}_{}_{}", tag, id, n++);
}

void remove_dir(const std::string& dir) {
  world().barrier();
  if (world().rank() == 0) std::filesystem::remove_all(dir);
}

// Runs `o` uninterrupted, then stopped after `k` steps with a checkpoint and
// resumed: every rank's losses and own parameters must be equal, bit for bit.
void expect_resume_is_exact(const TrainerOptions& o, int64_t k, const std::string& what) {
  SCOPED_TRACE(what);
  const Outcome full = train(o);
  EXPECT_EQ(full.steps, full.server ? 0 : kSteps);
  const std::string dir = temp_dir("exact");
  TrainerOptions a = o;
  a.halt_after = k;
  a.checkpoint_path = dir;
  const Outcome first = train(a);
  TrainerOptions b = o;
  b.resume_path = dir;
  const Outcome second = train(b);
  remove_dir(dir);
  EXPECT_EQ(second.steps, second.server ? k : kSteps);
  std::vector<double> stitched = first.losses;
  stitched.insert(stitched.end(), second.losses.begin(), second.losses.end());
  EXPECT_EQ(stitched, full.losses) << "rank " << world().rank();
  EXPECT_EQ(second.own, full.own) << "rank " << world().rank() << ": own parameters differ";
  // Test of the test: the replicas (or shards) moved after the checkpoint.
  EXPECT_NE(first.own, full.own) << "rank " << world().rank();
  if (world().rank() == 0) {
    std::printf("%s: stopped after step %lld, resumed: bitwise equal to the uninterrupted run\n",
                what.c_str(), static_cast<long long>(k));
  }
}

SyncOptions scheme(const std::string& name, int64_t period = 1) {
  SyncOptions s;
  s.scheme = name;
  s.period = period;
  return s;
}

TEST(SyncCheckpointMpi, LocalSgdAndPostLocalResumeExactly) {
  // Step 5 is between synchronizations (every 3 steps): replicas differ.
  expect_resume_is_exact(options(scheme("local_sgd", 3)), 5, "local_sgd period 3");
  SyncOptions post = scheme("local_sgd", 4);
  post.sync_until = 3;
  expect_resume_is_exact(options(post), 2, "post-local SGD (sync_until 3, period 4)");
  // f16: each replica's loss scaler is its own (a row of the checkpoint).
  TrainerOptions f16 = options(scheme("local_sgd", 3));
  f16.precision = DType::f16;
  f16.loss_scaler.init_scale = std::ldexp(1.0, 27);
  f16.loss_scaler.max_scale = std::ldexp(1.0, 40);
  f16.loss_scaler.growth_interval = 1;
  // (With uneven batch shares too. Each replica's scaler is saved as its
  // own row; in this run they happen to agree, as far as seen.)
  f16.dist.batch_shares = {1, 2, 3, 6};
  expect_resume_is_exact(f16, 5, "local_sgd period 3, f16 with dynamic loss scaling");
}

TEST(SyncCheckpointMpi, DilocoAndStreamingDilocoResumeExactly) {
  SyncOptions d = scheme("diloco", 4);
  TrainerOptions o = options(d);
  o.optimizer = "adamw";
  o.schedule.lr = 0.01;
  expect_resume_is_exact(o, 6, "diloco period 4, AdamW inner");
  // Fragments at phases 0 and 2 of period 4, each exchange landing one step
  // later: after step 6 fragment 1's exchange (started at 6) is in flight.
  SyncOptions s = d;
  s.fragments = 2;
  s.overlap_steps = 1;
  o.dist.sync = s;
  expect_resume_is_exact(o, 6, "streaming diloco, 2 fragments, overlap 1, f32");
  s.outer_bits = 4;
  o.dist.sync = s;
  expect_resume_is_exact(o, 6, "streaming diloco, 4-bit all-gather");
  s.outer_exchange = "reduce_scatter";
  o.dist.sync = s;
  expect_resume_is_exact(o, 6, "streaming diloco, 4-bit reduce-scatter");
}

TEST(SyncCheckpointMpi, GossipAndPartialResumeExactly) {
  SyncOptions g = scheme("gossip");
  g.topology = "ring";
  expect_resume_is_exact(options(g), 5, "gossip (D-PSGD) ring");
  // Period 3: the average of group 1 started after step 5 is in flight.
  expect_resume_is_exact(options(scheme("partial", 3)), 5, "partial period 3");
}

SyncOptions ps(const std::string& mode, int64_t servers) {
  SyncOptions s = scheme("ps");
  s.ps_mode = mode;
  s.servers = servers;
  return s;
}

TEST(SyncCheckpointMpi, ParameterServerBspResumesExactly) {
  expect_resume_is_exact(options(ps("bsp", 1)), 5, "ps bsp, 1 server");
  expect_resume_is_exact(options(ps("bsp", 2)), 7, "ps bsp, 2 servers");
  SyncOptions sw = ps("bsp", 1);
  sw.ps_switch = "after:3";  // resumed in ASP: the mode is part of the state
  TrainerOptions o = options(sw);
  const std::string dir = temp_dir("switch");
  o.halt_after = 5;
  o.checkpoint_path = dir;
  train(o);
  TrainerOptions b = options(sw);
  b.resume_path = dir;
  const Outcome r = train(b);
  remove_dir(dir);
  EXPECT_EQ(r.steps, r.server ? 5 : kSteps);
}

TEST(SyncCheckpointMpi, AsynchronousParameterServerResumesAndTrains) {
  const std::string dir = temp_dir("asp");
  // Staleness-scaled learning rates: unscaled ASP with momentum 0.9 could
  // blow up on a loaded machine (how stale a push is depends on timing).
  SyncOptions asp = ps("asp", 1);
  asp.staleness_lr = true;
  TrainerOptions o = options(asp);
  o.max_steps = 30;
  o.halt_after = 10;
  o.checkpoint_path = dir;
  const Outcome first = train(o);
  TrainerOptions b = options(asp);
  b.max_steps = 30;
  b.resume_path = dir;
  const Outcome second = train(b);
  remove_dir(dir);
  if (!first.server) {
    EXPECT_EQ(first.steps, 10);
    EXPECT_EQ(second.steps, 30);  // workers report their own losses
    ASSERT_EQ(second.losses.size(), 20u);
    for (double l : second.losses) EXPECT_TRUE(std::isfinite(l));
    // Training went on from where it stopped, not from the start: the
    // resumed run's last 5 losses (each one worker's own batch of 4) are
    // on average below the first run's first 5.
    const auto mean5 = [](auto from) {
      return (from[0] + from[1] + from[2] + from[3] + from[4]) / 5;
    };
    EXPECT_LT(mean5(second.losses.end() - 5), mean5(first.losses.begin()))
        << "rank " << world().rank();
  }
}

// A checkpoint saved mid-run (checkpoint_every, landing exchanges early)
// does not change the run that goes on.
TEST(SyncCheckpointMpi, SavingMidRunLeavesTheRunUnchanged) {
  SyncOptions s = scheme("diloco", 4);
  s.fragments = 2;
  s.overlap_steps = 1;
  s.outer_bits = 4;
  s.outer_exchange = "reduce_scatter";
  TrainerOptions o = options(s);
  const Outcome plain = train(o);
  const std::string dir = temp_dir("every");
  o.checkpoint_path = dir;
  o.checkpoint_every = 3;
  const Outcome saving = train(o);
  remove_dir(dir);
  EXPECT_EQ(saving.losses, plain.losses);
  EXPECT_EQ(saving.own, plain.own);
}

template <typename E>
void expect_refused(const TrainerOptions& o, const std::string& needle,
                    Communicator* group = &world()) {
  try {
    train(o, group);
    ADD_FAILURE() << "not refused: " << needle;
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// sync.codec: each replica's error-feedback residuals (PowerSGD's Q too),
// its codecs' run counts (stochastic codecs' seeds) and the anchor of its
// next change are its own rows; resumed runs are bitwise the uninterrupted
// ones. Stopped between synchronizations, with residuals held back.
TEST(SyncCheckpointMpi, CodecStateResumesExactly) {
  SyncOptions l = scheme("local_sgd", 3);
  l.codec = "topk:0.1";
  expect_resume_is_exact(options(l), 5, "local_sgd period 3, topk:0.1");
  SyncOptions d = scheme("diloco", 2);
  d.codec = "qsgd:4";  // stochastic: its seeds follow the runs so far
  expect_resume_is_exact(options(d), 5, "diloco period 2, qsgd:4");
  d.codec = "powersgd:2";
  expect_resume_is_exact(options(d), 5, "diloco period 2, powersgd:2");
  SyncOptions f = scheme("diloco", 4);  // Streaming: 2 fragments, one landing late
  f.fragments = 2;
  f.overlap_steps = 1;
  f.codec = "topk:0.1";
  expect_resume_is_exact(options(f), 5, "diloco period 4, 2 fragments, overlap 1, topk:0.1");
  SyncOptions p = scheme("partial", 2);
  p.codec = "topk:0.1";
  expect_resume_is_exact(options(p), 5, "partial period 2, topk:0.1");
  SyncOptions q = ps("bsp", 2);
  q.codec = "topk:0.1";
  expect_resume_is_exact(options(q), 5, "ps bsp, 2 servers, topk:0.1");
  q.codec = "randk:0.2";
  expect_resume_is_exact(options(q), 5, "ps bsp, 2 servers, randk:0.2");
  q.codec = "powersgd:2";  // each worker's own warm-started Q is in its row
  expect_resume_is_exact(options(q), 5, "ps bsp, 2 servers, powersgd:2");

  // Another codec's residuals have no place: refused naming the key.
  const std::string dir = temp_dir("refuse_codec");
  TrainerOptions a = options(l);
  a.halt_after = 4;
  a.checkpoint_path = dir;
  train(a);
  TrainerOptions b = options(scheme("local_sgd", 3));
  b.resume_path = dir;
  expect_refused<CheckpointError>(b, "written with sync.codec = \"topk:0.1\"");
  remove_dir(dir);
}

// All-reduce with a codec (ZeRO 0): the replicas are identical, saved as
// all-reduce DP saves them, and each rank's exchanges' residuals (PowerSGD's
// Q), their run counts (qsgd's seeds) and DGC's velocity are its own rows;
// resumed runs are bitwise the uninterrupted ones (before, the residuals
// restarted at zero and the resumed run differed). Stopped mid-warm-up too.
// Resumed without a codec, or under another scheme, the whole tensors are
// read and the state starts afresh; another codec is refused naming the key.
TEST(SyncCheckpointMpi, AllReduceCodecStateResumesExactly) {
  SyncOptions a = scheme("allreduce");
  for (const char* codec : {"topk:0.1", "qsgd:4", "powersgd:2", "randk:0.2:compact"}) {
    a.codec = codec;
    expect_resume_is_exact(options(a), 5, std::string("allreduce, ") + codec);
  }
  SyncOptions m = scheme("allreduce");
  m.codec = "topk:0.1";
  m.codec_momentum = 0.9;    // DGC: the velocity is state too
  m.codec_warmup_steps = 8;  // stopped in the warm-up's third stage
  m.codec_warmup_density = 0.5;
  TrainerOptions mo = options(m);
  mo.optim.sgd.momentum = 0;  // the codec's momentum replaces the optimizer's
  expect_resume_is_exact(mo, 5, "allreduce, topk:0.1, DGC momentum and warm-up");

  // ZeRO with a codec: each rank's chunk residuals of every bucket.
  for (int64_t stage : {1, 2, 3}) {
    SyncOptions z = scheme("allreduce");
    z.codec = stage == 2 ? "qsgd:4" : "topk:0.1";
    TrainerOptions zo = options(z);
    zo.dist.dp.stage = stage;
    expect_resume_is_exact(zo, 5, fmt::format("allreduce ZeRO-{}, {}", stage, z.codec));
  }

  const std::string dir = temp_dir("allreduce_codec");
  TrainerOptions w = options(a);
  w.halt_after = 4;
  w.checkpoint_path = dir;
  train(w);
  TrainerOptions plain = options(scheme("allreduce"));
  plain.resume_path = dir;
  EXPECT_EQ(train(plain).steps, kSteps);
  TrainerOptions other = options(scheme("local_sgd", 3));
  other.resume_path = dir;
  EXPECT_EQ(train(other).steps, kSteps);
  SyncOptions t = scheme("allreduce");
  t.codec = "topk:0.2";
  TrainerOptions b = options(t);
  b.resume_path = dir;
  expect_refused<CheckpointError>(b, "written with sync.codec = \"randk:0.2:compact\"");
  TrainerOptions z = options(a);
  z.dist.dp.stage = 1;
  z.resume_path = dir;
  expect_refused<CheckpointError>(z, "written with dist.zero_stage = 0 and sync.codec");
  remove_dir(dir);
}

// gossip with a codec (CHOCO-SGD): each replica's public copy xhat and the
// weighted sum of its neighbours' are its own rows (choco.public,
// choco.mixed); the stochastic codec's draws follow the step counter.
TEST(SyncCheckpointMpi, CompressedGossipResumesExactly) {
  SyncOptions g = scheme("gossip");
  g.codec = "topk:0.1";
  g.gossip_gamma = 0.5;
  expect_resume_is_exact(options(g), 5, "gossip ring, topk:0.1, gamma 0.5");
  g.topology = "torus";
  g.codec = "qsgd:4";
  expect_resume_is_exact(options(g), 5, "gossip torus, qsgd:4");
}

TEST(SyncCheckpointMpi, MismatchedResumesAreRefusedNamingTheKey) {
  const std::string dir = temp_dir("refuse");
  SyncOptions d = scheme("diloco", 4);
  d.fragments = 2;
  TrainerOptions o = options(d);
  o.halt_after = 5;
  o.checkpoint_path = dir;
  train(o);
  TrainerOptions r = options(scheme("allreduce"));
  r.resume_path = dir;
  expect_refused<CheckpointError>(r, "written under sync.scheme = \"diloco\"");
  r.dist.sync = scheme("local_sgd", 4);
  expect_refused<CheckpointError>(r, "resume with sync.scheme = \"diloco\"");
  r.dist.sync = d;
  r.dist.sync.fragments = 3;
  expect_refused<CheckpointError>(r, "sync.fragments = 2");
  // Another number of ranks: 2 of the 4.
  const std::vector<int> pair = {0, 1};
  std::unique_ptr<Communicator> two = world().subgroup(pair, "two");
  if (two) {
    r.dist.sync = d;
    expect_refused<CheckpointError>(r, "written by 4 ranks", two.get());
  }
  world().barrier();
  remove_dir(dir);

  const std::string pdir = temp_dir("refuse_ps");
  TrainerOptions p = options(ps("bsp", 1));
  p.halt_after = 4;
  p.checkpoint_path = pdir;
  train(p);
  TrainerOptions q = options(ps("bsp", 2));
  q.resume_path = pdir;
  expect_refused<CheckpointError>(q, "sync.servers = 1");
  remove_dir(pdir);

  TrainerOptions ad = options(scheme("adpsgd"));
  ad.checkpoint_path = temp_dir("adpsgd");
  expect_refused<ConfigError>(ad, "sync.scheme = \"adpsgd\"");
  TrainerOptions every = options(ps("bsp", 1));
  every.checkpoint_path = temp_dir("every_ps");
  every.checkpoint_every = 2;
  expect_refused<ConfigError>(every, "train.checkpoint_every = 2");
}

// Checkpoints of whole tensors resume under other schemes: all-reduce DP's
// under local SGD with period 1 (which is all-reduce DP with SGD), the
// parameter server's (BSP: all-reduce DP step by step) under all-reduce.
// Both equal the uninterrupted all-reduce run within float tolerance
// (averaging parameters vs summing gradients re-associates the sums).
TEST(SyncCheckpointMpi, WholeTensorCheckpointsResumeUnderOtherSchemes) {
  TrainerOptions ar = options(scheme("allreduce"));
  const Outcome full = train(ar);
  auto close = [&](const Outcome& first, const Outcome& second, const std::string& what) {
    std::vector<double> l = first.losses;
    l.insert(l.end(), second.losses.begin(), second.losses.end());
    ASSERT_EQ(l.size(), full.losses.size()) << what;
    for (size_t i = 0; i < l.size(); ++i) {
      EXPECT_NEAR(l[i], full.losses[i], 1e-5 * std::abs(full.losses[i])) << what << " step " << i;
    }
  };
  for (const SyncOptions& from : {scheme("allreduce"), ps("bsp", 1)}) {
    const std::string dir = temp_dir("cross");
    TrainerOptions a = options(from);
    a.halt_after = 5;
    a.checkpoint_path = dir;
    const Outcome first = train(a);
    TrainerOptions b = options(from.scheme == "ps" ? scheme("allreduce") : scheme("local_sgd"));
    b.resume_path = dir;
    const Outcome second = train(b);
    remove_dir(dir);
    if (from.scheme == "ps") {
      // Workers report the global batch's loss in BSP; rank 3 is the server.
      Outcome w;
      w.losses.assign(5, 0.0);
      if (world().rank() == 0) w.losses = first.losses;
      world().broadcast(w.losses.data(), w.losses.size(), DType::f64, 0);
      close(w, second, "ps -> allreduce");
    } else {
      close(first, second, "allreduce -> local_sgd");
    }
  }
}

}  // namespace
}  // namespace mt

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  mt::test::mpi_world();  // initialise MPI before any test
  return RUN_ALL_TESTS();
}
