// The parameter server (sync.scheme = "ps", sync/param_server.h) through the
// Trainer under mpirun (4 ranks: 3 workers and 1 server, or 2 and 2), on the
// MLP:
// - BSP equals all-reduce data parallelism over 4 ranks with the same global
//   batch step by step: the loss of every step and the final parameters
//   within 1e-5 relative (the server sums share x (the worker's own mean
//   gradient), all-reduce sums share-weighted gradients in another order:
//   re-association of 3-4 terms per element per step, and the scaling by
//   1 / share and back), with SGD momentum whose state lives on the servers;
//   a learning rate 1% off is seen (test of the test);
// - the bytes the communicator counts equal the analytic push + pull volume;
// - SSP(1) never lets a worker compute more than 1 step ahead of the slowest
//   (each worker's per-step log) and does run ahead; ASP with one worker
//   slowed lets the fast worker do more steps than the slow one;
// - sync.staleness_lr changes the run (SSP(0): the 3rd push of a round is
//   2 updates stale);
// - ps_switch "after:5" handles exactly the first 5 steps in BSP;
//   "straggler" switches after the step a straggler is announced;
// - bad settings are refused before any step, naming the key.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "meshtrain/base/error.h"
#include "meshtrain/sync/param_server.h"
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

ModelSpec spec(int64_t hidden = 32) {
  return test::sync_mlp(hidden);
}

// A global batch of 12: 3 per rank under all-reduce, 4 (or 6) per worker under ps.
TrainerOptions options(const SyncOptions& sync, int64_t steps = kSteps) {
  TrainerOptions o =
      test::sync_options(sync, {.batch = 12, .steps = steps, .lr = 0.05, .momentum = 0.9});
  o.dist.consistency_every = 0;
  return o;
}

struct Outcome {
  std::vector<double> losses;
  std::vector<float> params;
  uint64_t bytes = 0;
  std::vector<PsStepLog> log;
  bool server = false;
  int64_t layout_numel = 0;
  DataParallelStats stats;  // after the warm-up steps
};

Outcome train(const SyncOptions& sync, TrainerOptions o, const ModelSpec& s = spec()) {
  auto data = std::make_shared<test::SyntheticData>(s, 480, 9);
  Trainer t(s, data, nullptr, o, &world());
  Outcome out;
  out.losses = t.run().losses;
  out.server = t.replica_sync().is_server();
  const Tensor p = t.gather_params();
  out.params.assign(p.data<float>(), p.data<float>() + p.numel());
  out.bytes = t.replica_sync().bytes_sent();
  out.log = ps_step_log(t.replica_sync());
  out.stats = t.replica_sync().stats();
  (void)sync;
  return out;
}

Outcome train(const SyncOptions& sync) {
  return train(sync, options(sync));
}

using test::divergence;

SyncOptions ps(const std::string& mode, int64_t servers = 1) {
  SyncOptions s;
  s.scheme = "ps";
  s.ps_mode = mode;
  s.servers = servers;
  return s;
}

// The model's parameter layout (names, shapes) as the Trainer builds it.
ParamLayout layout_of_model() {
  auto data = std::make_shared<test::SyntheticData>(spec(), 480, 9);
  TrainerOptions o = options(SyncOptions{});
  Trainer t(spec(), data, nullptr, o, nullptr);  // one process: no communication
  ParamLayout layout;
  for (const auto& e : t.params().entries()) layout.push_back({e.name, e.shape, e.offset});
  return layout;
}

// A worker pushes each bucket's part of every server's shard as soon as the
// bucket's gradients are final, during the backward (one message per bucket
// and server holding part of it, the first with the header): the same
// bytes as one message per server, and the same run bit for bit as pushing
// after the backward (dist.overlap = false; BSP sums in worker order).
// With sync.codec each parameter is encoded into its place in its piece as
// its bucket is final: the same again (seeds follow the step).
TEST(ParamServerMpi, PushesPerBucketOverlapTheBackward) {
  for (const std::string codec : {"none", "topk:0.1"}) {
    for (int64_t servers : {1, 2}) {
      SCOPED_TRACE(fmt::format("{} server(s), sync.codec = {}", servers, codec));
      SyncOptions s = ps("bsp", servers);
      s.codec = codec;
      const Outcome on = train(s);
      TrainerOptions o = options(s);
      o.dist.dp.overlap = false;
      const Outcome off = train(s, o);
      EXPECT_EQ(on.losses, off.losses);
      EXPECT_EQ(on.params, off.params);
      EXPECT_EQ(on.bytes, off.bytes);
      if (!on.server) {
        // 1 KiB buckets: the MLP's parameters fill several, so each server
        // gets several pieces per step.
        const int64_t steps = on.stats.steps;  // counted after the warm-up steps
        ASSERT_GT(steps, 0);
        // 2 buckets (fc2 and the head; fc1), so at least 2 pieces per step.
        EXPECT_GE(on.stats.collectives, 2 * steps) << "pieces pushed";
        EXPECT_EQ(on.stats.overlapped, on.stats.collectives) << "every piece left during backward";
        EXPECT_EQ(off.stats.overlapped, 0);
        EXPECT_EQ(off.stats.collectives, on.stats.collectives);
        if (world().rank() == 0) {
          std::printf(
              "ps bsp (%lld server(s), codec %s): %lld pushes per step per worker, %lld during "
              "backward\n",
              static_cast<long long>(servers), codec.c_str(),
              static_cast<long long>(on.stats.collectives / steps),
              static_cast<long long>(on.stats.overlapped / steps));
        }
      }
    }
  }
}

TEST(ParamServerMpi, BspEqualsAllReduceStepByStepAndCountsItsBytes) {
  ASSERT_EQ(world().size(), 4);
  SyncOptions ar;
  const Outcome dp = train(ar);
  ASSERT_EQ(dp.losses.size(), static_cast<size_t>(kSteps));
  const ParamLayout layout = layout_of_model();
  for (int64_t servers : {1, 2}) {
    SCOPED_TRACE(fmt::format("{} server(s)", servers));
    const Outcome got = train(ps("bsp", servers));
    if (!got.server) {
      ASSERT_EQ(got.losses.size(), static_cast<size_t>(kSteps));
      const double d = divergence(dp, got);
      if (world().rank() == 0) {
        std::printf("ps bsp (%lld server(s)) vs allreduce: worst relative difference %.3g\n",
                    static_cast<long long>(servers), d);
      }
      EXPECT_LE(d, 1e-5);
      for (const PsStepLog& e : got.log) EXPECT_EQ(e.mode, "bsp");
    }
    // Bytes: per step and worker, one push to and one reply from every
    // server (48-byte header + the shard in f32), plus the final "done" push
    // and parameters. A worker sends pushes, a server replies.
    const std::vector<int> shard = ps_shards(layout, static_cast<int>(servers));
    std::vector<uint64_t> msg(static_cast<size_t>(servers), 48);
    for (size_t i = 0; i < layout.size(); ++i) {
      msg[static_cast<size_t>(shard[i])] += 4 * static_cast<uint64_t>(layout[i].shape.numel());
    }
    const int workers = world().size() - static_cast<int>(servers);
    const int me = world().rank();
    uint64_t want = 0;
    if (!got.server) {
      for (uint64_t m : msg) want += (kSteps + 1) * m;
    } else {
      want = static_cast<uint64_t>(workers) * (kSteps + 1) * msg[static_cast<size_t>(me - workers)];
    }
    EXPECT_EQ(got.bytes, want) << "rank " << me;
  }
  // Shards are balanced by bytes: with 2 servers neither holds more than the
  // largest parameter beyond the other.
  const std::vector<int> two = ps_shards(layout, 2);
  int64_t load[2] = {0, 0}, largest = 0;
  for (size_t i = 0; i < layout.size(); ++i) {
    load[two[i]] += layout[i].shape.numel();
    largest = std::max(largest, layout[i].shape.numel());
  }
  EXPECT_LE(std::abs(load[0] - load[1]), largest);
  EXPECT_GT(load[0], 0);
  EXPECT_GT(load[1], 0);

  // Test of the test: a learning rate 1% off is seen.
  SyncOptions bsp = ps("bsp");
  TrainerOptions o = options(bsp);
  o.schedule.lr *= 1.01;
  const Outcome off = train(bsp, o);
  if (!off.server) {
    EXPECT_GT(divergence(dp, off), 1e-4);
  }
}

// Rank 2 (a worker) computes 4x slower (a larger hidden layer so compute,
// not messaging, sets the pace) and also sleeps 40 ms after every step: a
// relative slowdown alone left the ranks' pace to the machine's load (on a
// crowded 2-core machine the fast workers' messaging can take as long as
// the slowed compute), a fixed pause does not.
TrainerOptions slowed(const SyncOptions& s, int64_t steps) {
  TrainerOptions o = options(s, steps);
  o.dist.slowdown = {1.0, 1.0, 4.0, 1.0};
  o.dist.after_step = [](int64_t, int rank) {
    if (rank == 2) std::this_thread::sleep_for(std::chrono::milliseconds(40));
  };
  o.optim.sgd.momentum = 0;
  return o;
}

TEST(ParamServerMpi, SspBoundsHowFarAWorkerRunsAheadAndAspDoesNotWait) {
  const ModelSpec big = spec(384);
  SyncOptions ssp = ps("ssp");
  ssp.staleness = 1;
  const Outcome s = train(ssp, slowed(ssp, 20), big);
  if (!s.server) {
    ASSERT_EQ(s.log.size(), 20u);
    int64_t ahead = 0;
    for (const PsStepLog& e : s.log) {
      // After its push of step e.step the worker computes step e.step + 1,
      // which the slowest worker's pushes (e.slowest) may trail by at most 1.
      EXPECT_LE(e.step + 1 - e.slowest, 1) << "rank " << world().rank() << " step " << e.step;
      EXPECT_EQ(e.mode, "ssp");
      ahead = std::max(ahead, e.step + 1 - e.slowest);
    }
    // The fast workers do run ahead (up to the bound), unlike BSP.
    if (world().rank() == 0) {
      EXPECT_EQ(ahead, 1) << "worker 0 never ran ahead";
    }
  }
  SyncOptions asp = ps("asp");
  const Outcome a = train(asp, slowed(asp, 20), big);
  if (!a.server) {
    ASSERT_EQ(a.log.size(), 20u);
    EXPECT_LT(a.losses.back(), a.losses.front() * 1.5);  // finite and sane
    if (world().rank() == 0) {
      // When the fast worker pushed its last step, the slowed one (the
      // slowest) had pushed far fewer.
      const PsStepLog& last = a.log.back();
      std::printf("asp: when worker 0 pushed step %lld, the slowest worker had pushed %lld\n",
                  static_cast<long long>(last.step), static_cast<long long>(last.slowest));
      EXPECT_LE(last.slowest, 15);
      EXPECT_GT(last.step + 1 - last.slowest, 1) << "ASP waited like SSP(1)";
    }
  }
}

// sync.staleness_lr: under SSP(0) the 3 workers pull together each round,
// so the 2nd and 3rd push of a round are 1 and 2 updates stale and the 3rd
// is applied with half the learning rate: the run must differ from the
// unscaled one. (Whether it learns better is a question for a benchmark.)
TEST(ParamServerMpi, StalenessScalesTheLearningRate) {
  SyncOptions plain = ps("ssp");
  plain.staleness = 0;
  SyncOptions scaled = plain;
  scaled.staleness_lr = true;
  TrainerOptions o = options(plain);
  o.optim.sgd.momentum = 0;
  const Outcome a = train(plain, o);
  o.dist.sync = scaled;
  const Outcome b = train(scaled, o);
  if (!a.server) {
    EXPECT_NE(a.params, b.params);
    EXPECT_TRUE(std::isfinite(b.losses.back()));
    for (const PsStepLog& e : b.log) EXPECT_EQ(e.step + 1 - e.slowest, 0);  // SSP(0): lock step
  }
}

TEST(ParamServerMpi, SwitchesFromBspToAspWhereConfigured) {
  SyncOptions sw = ps("bsp");
  sw.ps_switch = "after:5";
  const Outcome got = train(sw);
  if (!got.server) {
    ASSERT_EQ(got.log.size(), static_cast<size_t>(kSteps));
    for (const PsStepLog& e : got.log) {
      EXPECT_EQ(e.mode, e.step < 5 ? "bsp" : "asp") << "step " << e.step;
      if (e.step < 5) {
        EXPECT_EQ(e.slowest, e.step + 1);  // everyone pushed: lock step
      }
    }
  }
  // "straggler": BSP until the straggler report announces a straggler, then
  // ASP. The report's verdict depends on the machine's load (20-step
  // windows, persistent for 3 more), so here worker 0 is told "a straggler
  // was announced" after its step 30, as the trainer does when the report
  // says so: its push of step 30 carries the flag, the server finishes that
  // BSP step and every worker's step 31 on is ASP. Without ps_switch the
  // same call changes nothing.
  for (const std::string& rule : {std::string("straggler"), std::string()}) {
    SyncOptions st = ps("bsp");
    st.ps_switch = rule;
    TrainerOptions o = options(st, 40);
    Trainer* running = nullptr;
    o.dist.after_step = [&running](int64_t step, int rank) {
      if (rank == 0 && step == 30) running->replica_sync().persistent_straggler();
    };
    auto data = std::make_shared<test::SyntheticData>(spec(), 480, 9);
    Trainer t(spec(), data, nullptr, o, &world());
    running = &t;
    t.run();
    if (t.replica_sync().is_server()) continue;
    const std::vector<PsStepLog> log = ps_step_log(t.replica_sync());
    ASSERT_EQ(log.size(), 40u);
    for (const PsStepLog& e : log) {
      EXPECT_EQ(e.mode, !rule.empty() && e.step > 30 ? "asp" : "bsp")
          << "ps_switch '" << rule << "' step " << e.step;
    }
  }
}

std::string error_of(const SyncOptions& s, int zero = 0) {
  try {
    auto data = std::make_shared<test::SyntheticData>(spec(), 480, 9);
    TrainerOptions o = options(s);
    o.dist.dp.stage = zero;
    Trainer t(spec(), data, nullptr, o, &world());
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "no error";
}

TEST(ParamServerMpi, BadSettingsAreRefusedNamingTheKey) {
  SyncOptions s = ps("ssp");
  s.staleness = -1;
  EXPECT_NE(error_of(s).find("sync.staleness: the SSP staleness bound must be >= 0 steps, got -1"),
            std::string::npos)
      << error_of(s);
  s = ps("bsp", 4);
  EXPECT_NE(error_of(s).find("sync.servers = 4: needs at least one worker besides the servers, "
                             "but the job has 4 ranks"),
            std::string::npos)
      << error_of(s);
  s = ps("fast");
  EXPECT_NE(error_of(s).find("sync.ps_mode: unknown mode 'fast'"), std::string::npos);
  s = ps("bsp");
  s.ps_switch = "after:0";
  EXPECT_NE(error_of(s).find("sync.ps_switch: expected"), std::string::npos) << error_of(s);
  s = ps("asp");
  s.ps_switch = "after:3";
  EXPECT_NE(error_of(s).find("sync.ps_mode must be \"bsp\""), std::string::npos) << error_of(s);
  EXPECT_NE(error_of(ps("bsp"), 1).find("dist.zero_stage = 1"), std::string::npos)
      << error_of(ps("bsp"), 1);
  s = ps("bsp", 3);  // 1 worker, 3 servers: fine for ranks, but the MLP has 6 parameters
  EXPECT_EQ(error_of(s), "no error");
  EXPECT_THROW(ps_shards(layout_of_model(), 7), ConfigError);
}

}  // namespace
}  // namespace mt

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  mt::world();  // initialise MPI before any test
  return RUN_ALL_TESTS();
}
