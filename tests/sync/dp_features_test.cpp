// DataParallel beyond equivalence:
// - memory: per-rank parameter / gradient / optimizer bytes follow P+G+O,
//   P+G+O/N, P+G/N+O/N, (P+G+O)/N; ZeRO-3 holds at most 1/N of stage 0
//   plus 10% for N = 2 and 4; staging and gathered buffers stay a few buckets;
// - byte counters: what the group's communicators moved in one step equals
//   step_cost() on every rank, and for ring algorithms the closed forms
//   2(N-1)L (all-reduce), (N-1)L (reduce-scatter, all-gather) summed over ranks;
// - overlap: with overlap on every bucket starts during backward, off none;
// - ZeRO-3 gathers each bucket once per phase that reads it (no more), and a
//   forward-only executor attached for evaluation sees the whole parameters;
// - world size 1 communicates nothing at any stage;
// - checkpoint pieces: saved pieces of all ranks cover every parameter and
//   optimizer-state element exactly once; loading them into another world
//   size and stage continues training exactly like the uninterrupted run;
// - gradients from outside an executor (use_external_grads / add_grad, as
//   the pipeline runtime hands them over): stages 0-3 reduce them to the
//   weighted sum, in place where they are full_grad() itself, the bytes
//   moved equal step_cost() (stage 3 gathering once per step); misuse is a
//   ConfigError;
// - errors: a stalled peer gives a TimeoutError naming step, bucket and
//   parameters; ranks that disagree on buckets get a MismatchError; misuse of
//   the micro-step protocol is a ConfigError.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "dp_harness.h"
#include "meshtrain/graph/autodiff.h"

namespace mt::test {
namespace {

LocalWorldOptions local(int world, int timeout_ms = 20'000) {
  LocalWorldOptions o;
  o.size = world;
  o.comm.timeout = std::chrono::milliseconds(timeout_ms);
  return o;
}

TrainSetup wide_mlp(const std::string& optimizer) {
  TrainSetup s;
  s.spec = small_mlp();
  s.spec.image_size = 8;
  s.spec.hidden = {96, 96};
  s.spec.classes = 10;
  s.global_batch = 8;
  s.steps = 2;
  s.optimizer = optimizer;
  s.lr = 0.01;
  return s;
}

TEST(DataParallelMemory, ShardedStateFollowsTheZeroFormulas) {
  const TrainSetup s = wide_mlp("adamw");  // two state tensors per parameter
  for (int world : {2, 4}) {
    std::vector<DataParallelMemory> by_stage;
    for (int stage = 0; stage <= 3; ++stage) {
      DpRun run;
      run.world = world;
      run.dp.stage = stage;
      run.dp.bucket_bytes = 16 << 10;
      run.local = local(world);
      const DpResult got = run_data_parallel(s, run);
      for (const DataParallelMemory& m : got.memory) {
        // Measured within 3% of the analytic expectation (ParamStore pads
        // each parameter to 64 bytes; chunks round up by an element).
        auto near = [](int64_t measured, int64_t expected) {
          return std::abs(static_cast<double>(measured - expected)) <=
                 0.03 * static_cast<double>(expected) + 64;
        };
        EXPECT_TRUE(near(m.param_bytes, m.expected_param_bytes)) << m.to_string();
        EXPECT_TRUE(near(m.grad_bytes, m.expected_grad_bytes)) << m.to_string();
        EXPECT_TRUE(near(m.optimizer_bytes, m.expected_optimizer_bytes)) << m.to_string();
        EXPECT_LE(m.buffer_bytes(), m.expected_buffer_bytes + m.expected_buffer_bytes / 2)
            << m.to_string();
        if (stage <= 1) {
          EXPECT_EQ(m.staging_bytes, 0) << m.to_string();
        }
        if (stage == 3) {
          EXPECT_GT(m.gathered_bytes, 0) << m.to_string();
        }
      }
      std::printf("%s\n", got.memory[0].to_string().c_str());
      by_stage.push_back(got.memory[0]);
    }
    const double s0 = static_cast<double>(by_stage[0].model_state_bytes());
    const double s3 = static_cast<double>(by_stage[3].model_state_bytes());
    EXPECT_LE(s3, s0 / world * 1.10) << "world " << world;
    EXPECT_LT(by_stage[1].optimizer_bytes, by_stage[0].optimizer_bytes);
    EXPECT_LT(by_stage[2].grad_bytes, by_stage[1].grad_bytes);
    EXPECT_LT(by_stage[3].param_bytes, by_stage[2].param_bytes);
  }
}

// ZeRO-2/3 never hold a full gradient with overlap on: staging buffers are
// reused, a few buckets at a time; with overlap off every bucket waits.
// ZeRO-3 holds a few gathered buckets at a time, never the whole model.
TEST(DataParallelMemory, StagingStaysAFewBucketsWithOverlap) {
  TrainSetup s = wide_mlp("sgd");
  s.spec.hidden = {32, 32, 32, 32, 32, 32, 32, 32};
  for (int stage : {2, 3}) {
    int64_t with_overlap = 0;
    for (bool overlap : {true, false}) {
      DpRun run;
      run.world = 2;
      run.dp.stage = stage;
      run.dp.overlap = overlap;
      run.dp.bucket_bytes = 2 << 10;  // many buckets
      run.local = local(2);
      const DpResult got = run_data_parallel(s, run);
      ModelGraph mg = build_model(s.spec, 1);
      ParamStore store(mg.graph, s.seed);
      const BucketPlan plan(layout_of(store), store.flat_values().numel(), run.dp.bucket_bytes, 2,
                            0);
      ASSERT_GT(plan.buckets().size(), 6u);
      const int64_t bucket = plan.max_bucket_numel() * 4;
      const int64_t staging = got.memory[0].staging_bytes;
      std::printf(
          "stage %d, overlap %d: %zu buckets (largest %lld bytes), staging peak %lld bytes\n",
          stage, overlap, plan.buckets().size(), static_cast<long long>(bucket),
          static_cast<long long>(staging));
      if (stage == 3) {
        // Gathered parameters: the bucket in use and the prefetched next one.
        std::printf("  gathered parameters peak %lld bytes\n",
                    static_cast<long long>(got.memory[0].gathered_bytes));
        EXPECT_LE(got.memory[0].gathered_bytes, 3 * bucket);
      }
      if (overlap) {
        EXPECT_LE(staging, 3 * bucket);
        with_overlap = staging;
      } else {
        EXPECT_GT(staging, 2 * with_overlap);
      }
    }
  }
}

uint64_t collective_bytes(const CommCounters& c, bool sent) {
  uint64_t n = 0;
  for (const auto& [name, cc] : c.by_collective) {
    if (name == "all_reduce" || name == "reduce_scatterv" || name == "all_gatherv") {
      n += sent ? cc.bytes_sent : cc.bytes_received;
    }
  }
  return n;
}

TEST(DataParallelCounters, BytesMovedMatchTheStatedCostAndTheRingClosedForms) {
  const TrainSetup base = wide_mlp("sgd");
  for (int world : {2, 3}) {
    for (int stage = 0; stage <= 3; ++stage) {
      for (bool ring : {false, true}) {
        DpRun run;
        run.world = world;
        run.dp.stage = stage;
        run.dp.bucket_bytes = 8 << 10;
        run.local = local(world);
        if (ring) {
          run.dp.collective.algorithm = CommAlgorithm::ring;
          run.local.shm_bytes_per_rank = 0;
        }
        const DpResult got = run_data_parallel(base, run);
        uint64_t sent = 0, received = 0;
        for (int r = 0; r < world; ++r) {
          const auto i = static_cast<size_t>(r);
          EXPECT_EQ(collective_bytes(got.counters[i], true), got.step_cost[i].bytes_sent)
              << "rank " << r << " stage " << stage << " world " << world;
          EXPECT_EQ(collective_bytes(got.counters[i], false), got.step_cost[i].bytes_received)
              << "rank " << r << " stage " << stage << " world " << world;
          sent += collective_bytes(got.counters[i], true);
          received += collective_bytes(got.counters[i], false);
        }
        EXPECT_EQ(sent, received);
        if (!ring) continue;
        // Closed forms over all ranks, L = the bucketed elements (bytes).
        ModelGraph mg = build_model(base.spec, 1);
        ParamStore store(mg.graph, base.seed);
        const BucketPlan plan(layout_of(store), store.flat_values().numel(), run.dp.bucket_bytes,
                              world, 0);
        uint64_t L = 0;
        for (const BucketInfo& b : plan.buckets()) L += static_cast<uint64_t>(b.numel()) * 4;
        const uint64_t n1 = static_cast<uint64_t>(world - 1);
        uint64_t want = stage <= 1 ? 2 * n1 * L : n1 * L;
        if (stage == 1 || stage == 2) want += n1 * L;
        if (stage == 3) {
          // One all-gather per bucket and phase that reads one of its
          // parameters, as the executor announces its reads.
          ModelGraph tg = build_model(base.spec, base.global_batch / world);
          build_backward(tg.graph, tg.loss);
          ExecOptions eo;
          eo.backend = "reference";
          Executor ex(tg.graph, eo);
          std::set<std::pair<int, bool>> read;
          for (const ParamUse& u : ex.param_uses(false)) {
            const int q = plan.find(tg.graph.value(u.param).name);
            read.insert({plan.bucket_of(q), u.backward});
          }
          uint64_t gathered = 0;
          for (const auto& [b, phase] : read) {
            gathered += static_cast<uint64_t>(plan.buckets()[static_cast<size_t>(b)].numel()) * 4;
          }
          want += n1 * gathered;
          EXPECT_EQ(got.stats[0].gathers, static_cast<int64_t>(read.size()) * base.steps);
        }
        EXPECT_EQ(sent, want) << "stage " << stage << " world " << world;
      }
    }
  }
}

TEST(DataParallelOverlap, BucketsStartDuringBackwardOnlyWithOverlapOn) {
  TrainSetup s = wide_mlp("sgd");
  for (int stage : {0, 2}) {
    for (bool overlap : {true, false}) {
      DpRun run;
      run.world = 2;
      run.dp.stage = stage;
      run.dp.overlap = overlap;
      run.dp.bucket_bytes = 8 << 10;
      run.local = local(2);
      const DpResult got = run_data_parallel(s, run);
      const int64_t launched = got.buckets[0] * s.steps;
      EXPECT_EQ(got.stats[0].overlapped, overlap ? launched : 0)
          << "stage " << stage << ", overlap " << overlap;
    }
  }
}

TEST(DataParallelWorldOne, NoCommunicationAtAnyStage) {
  for (int stage = 0; stage <= 3; ++stage) {
    for (int K : {1, 2}) {
      TrainSetup s = wide_mlp("lamb");  // LAMB calls the norm reducer every step
      DpRun run;
      run.world = 1;
      run.dp.stage = stage;
      run.dp.accumulation_steps = K;
      run.dp.bucket_bytes = 4 << 10;
      run.local = local(1);
      const DpResult got = run_data_parallel(s, run);
      EXPECT_EQ(got.stats[0].collectives, 0) << "stage " << stage;
      EXPECT_EQ(got.counters[0].by_collective.size(), 0u) << got.counters[0].to_json();
      EXPECT_EQ(got.memory[0].buffer_bytes(), 0) << got.memory[0].to_string();
    }
  }
}

// A forward-only executor (evaluation) attached to a ZeRO-3 DataParallel
// gathers parameters too: its loss equals a plain executor's on the whole
// parameters, bitwise.
TEST(DataParallelZero3, EvaluationGraphSeesWholeParameters) {
  const TrainSetup s = wide_mlp("adamw");
  DpRun run;
  run.world = 2;
  run.dp.stage = 3;
  run.dp.bucket_bytes = 8 << 10;
  std::vector<double> got(2), want(2);
  LocalWorld::run(local(2), [&](Communicator& comm) {
    RankTrainer t(comm, s, run);
    for (int i = 0; i < 3; ++i) t.step();
    ModelGraph eval = build_model(s.spec, 5);
    ExecOptions eo;
    eo.backend = "reference";
    Executor ex(eval.graph, eo);
    t.dp->attach(ex, eval.graph);
    // The same 5 examples on both ranks.
    SyntheticData data(s.spec, 64, 3);
    std::vector<int64_t> idx = {1, 2, 3, 4, 5};
    const Batch e = data.gather(idx);
    ex.bind(eval.x, e.x);
    ex.bind(eval.y, e.y);
    const int64_t gathers = t.dp->stats().gathers;
    ex.run_forward();
    EXPECT_GT(t.dp->stats().gathers, gathers);
    got[static_cast<size_t>(comm.rank())] = ex.get(eval.loss).item();

    const std::vector<float> full = t.full_params();
    Executor plain(eval.graph, eo);
    ParamStore store(eval.graph, s.seed);
    std::copy(full.begin(), full.end(), store.flat_values().data<float>());
    store.bind(plain, eval.graph, false);
    plain.bind(eval.x, e.x);
    plain.bind(eval.y, e.y);
    plain.run_forward();
    want[static_cast<size_t>(comm.rank())] = plain.get(eval.loss).item();
  });
  EXPECT_EQ(got[0], want[0]);
  EXPECT_EQ(got[1], want[1]);
  EXPECT_EQ(got[0], got[1]);
}

// Elements [begin, end) of named tensors, assembled from every rank's pieces.
struct Assembled {
  std::map<std::string, std::vector<float>> values;
  std::map<std::string, std::vector<int>> hits;
  std::map<std::string, Shape> shapes;
  std::mutex mu;

  void add(const std::vector<ShardPiece>& pieces) {
    std::lock_guard<std::mutex> lock(mu);
    for (const ShardPiece& p : pieces) {
      const auto n = static_cast<size_t>(p.full_shape.numel());
      values[p.name].resize(n);
      hits[p.name].resize(n);
      shapes[p.name] = p.full_shape;
      ASSERT_EQ(p.data.numel(), p.end - p.begin) << p.name;
      for (int64_t i = p.begin; i < p.end; ++i) {
        values[p.name][static_cast<size_t>(i)] = p.data.data<float>()[i - p.begin];
        ++hits[p.name][static_cast<size_t>(i)];
      }
    }
  }
  void fill(std::vector<ShardPiece>& pieces) {
    std::lock_guard<std::mutex> lock(mu);
    for (ShardPiece& p : pieces) {
      ASSERT_TRUE(values.count(p.name)) << p.name;
      for (int64_t i = p.begin; i < p.end; ++i) {
        p.data.data<float>()[i - p.begin] = values[p.name][static_cast<size_t>(i)];
      }
    }
  }
};

// Save at world 3 / stage `from`, load at world 2 / stage `to`: training goes
// on exactly as if uninterrupted (within roundoff, world sizes differ).
TEST(DataParallelCheckpoint, PiecesCoverEverythingOnceAndReloadAtAnotherWorldSize) {
  const TrainSetup s = wide_mlp("adamw");
  for (const auto& [from, to] : {std::pair{0, 3}, std::pair{3, 1}, std::pair{2, 0}}) {
    Assembled params, state;
    std::map<std::string, int64_t> adam_steps;
    std::vector<float> continued;
    DpRun save_run;
    save_run.world = 3;
    save_run.dp.stage = from;
    save_run.dp.bucket_bytes = 8 << 10;
    std::mutex mu;
    LocalWorld::run(local(3), [&](Communicator& comm) {
      RankTrainer t(comm, s, save_run);
      for (int i = 0; i < 3; ++i) t.step();
      params.add(t.dp->param_pieces(PieceUse::save));
      state.add(t.dp->state_pieces(t.opt->state().tensors, PieceUse::save));
      {
        std::lock_guard<std::mutex> lock(mu);
        adam_steps = t.opt->state().steps;
      }
      for (int i = 0; i < 2; ++i) t.step();
      std::vector<float> full = t.full_params();
      if (comm.rank() == 0) continued = full;
    });
    // Every element of every parameter and state tensor written exactly once.
    ModelGraph mg = build_model(s.spec, 1);
    ParamStore ref(mg.graph, s.seed);
    ASSERT_EQ(params.values.size(), ref.entries().size());
    ASSERT_EQ(state.values.size(), 2 * ref.entries().size());
    for (auto* a : {&params, &state}) {
      for (const auto& [name, hits] : a->hits) {
        for (size_t i = 0; i < hits.size(); ++i) {
          ASSERT_EQ(hits[i], 1) << name << "[" << i << "], saved from stage " << from;
        }
      }
    }

    DpRun load_run;
    load_run.world = 2;
    load_run.dp.stage = to;
    load_run.dp.bucket_bytes = 4 << 10;
    std::vector<float> resumed;
    LocalWorld::run(local(2), [&](Communicator& comm) {
      RankTrainer t(comm, s, load_run);
      t.next_step = 3;  // batches continue where the saved run stopped
      std::vector<ShardPiece> p = t.dp->param_pieces(PieceUse::load);
      // Poisoned first: whatever the load leaves out would show as NaN.
      for (ShardPiece& piece : p) piece.data.fill(std::nan(""));
      params.fill(p);
      std::vector<ShardPiece> st = t.dp->new_state_pieces(t.opt->state_kinds());
      state.fill(st);
      OptimizerState os;
      for (ShardPiece& piece : st) os.tensors[piece.name] = piece.data;
      os.steps = adam_steps;
      t.opt->load_state(os);
      for (int i = 0; i < 2; ++i) t.step();
      std::vector<float> full = t.full_params();
      if (comm.rank() == 0) resumed = full;
    });
    TrainSetup two = s;
    const Divergence d = compare(two, {resumed}, {continued});
    EXPECT_LE(d.worst, 1e-5) << "saved at stage " << from << ", loaded at stage " << to << ": "
                             << d.where;
  }
}

TEST(DataParallelErrors, StalledPeerIsATimeoutNamingStepBucketAndParameters) {
  const TrainSetup s = wide_mlp("sgd");
  DpRun run;
  run.world = 2;
  run.dp.stage = 2;
  run.dp.bucket_bytes = 8 << 10;
  LocalWorldOptions lw = local(2, 300);
  std::atomic<bool> stop{false};
  const auto errors = LocalWorld::run_collect(lw, [&](Communicator& comm) {
    RankTrainer t(comm, s, run);
    t.step();
    if (comm.rank() == 1) {
      // Stalls before step 1's collectives.
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));
      return;
    }
    t.step();
  });
  ASSERT_TRUE(errors[0] != nullptr);
  try {
    std::rethrow_exception(errors[0]);
  } catch (const TimeoutError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("step 1"), std::string::npos) << msg;
    EXPECT_NE(msg.find("bucket 0"), std::string::npos) << msg;
    EXPECT_NE(msg.find("head.b"), std::string::npos) << msg;
    EXPECT_NE(msg.find("reduce_scatterv"), std::string::npos) << msg;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected a TimeoutError, got: " << e.what();
  }
}

TEST(DataParallelErrors, RanksWithDifferentBucketsGetAMismatchError) {
  const TrainSetup s = wide_mlp("sgd");
  const auto errors = LocalWorld::run_collect(local(2), [&](Communicator& comm) {
    DpRun run;
    run.world = 2;
    run.dp.bucket_bytes = comm.rank() == 0 ? 4 << 10 : 16 << 10;
    RankTrainer t(comm, s, run);
    t.step();
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(errors[static_cast<size_t>(r)] != nullptr) << "rank " << r;
    try {
      std::rethrow_exception(errors[static_cast<size_t>(r)]);
    } catch (const MismatchError& e) {
      EXPECT_NE(std::string(e.what()).find("bucket 0"), std::string::npos) << e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "rank " << r << ": expected a MismatchError, got: " << e.what();
    }
  }
}

TEST(DataParallelErrors, ProtocolMisuseIsAConfigError) {
  const TrainSetup s = wide_mlp("sgd");
  LocalWorld::run(local(1), [&](Communicator& comm) {
    DpRun run;
    RankTrainer t(comm, s, run);
    DataParallel& dp = *t.dp;
    const Batch b = t.loader->batch(0, 0);
    t.exec->bind(t.model->x, b.x.reshape(t.model->graph.value(t.model->x).shape));
    t.exec->bind(t.model->y, b.y);
    EXPECT_THROW(dp.end_micro_step(), ConfigError);
    EXPECT_THROW(dp.finish_step(), ConfigError);
    EXPECT_THROW(dp.begin_micro_step(-0.5), ConfigError);
    EXPECT_THROW(dp.begin_micro_step(std::nan("")), ConfigError);
    // A run without begin_micro_step: the first ready gradient complains.
    EXPECT_THROW(t.exec->run(), ConfigError);
    dp.begin_micro_step(1.0);
    EXPECT_THROW(dp.begin_micro_step(1.0), ConfigError);
    t.exec->run_forward();  // no gradients
    EXPECT_THROW(dp.end_micro_step(), ConfigError);
    dp.begin_micro_step(1.0);
    t.exec->run();
    dp.end_micro_step();
    EXPECT_THROW(dp.begin_micro_step(1.0), ConfigError) << "gradients not consumed";
    dp.finish_step();

    ModelSpec other = s.spec;
    other.hidden = {7};
    ModelGraph g = build_model(other, 2);
    Executor ex(g.graph, ExecOptions{});
    EXPECT_THROW(dp.attach(ex, g.graph), ShapeError);
    DataParallelOptions bad;
    bad.stage = 4;
    EXPECT_THROW(DataParallel(comm, layout_of(*t.store), t.store->flat_values(), bad), ConfigError);
  });
}

// Gradients handed over without an executor: every rank's slice holds the
// weighted sum over the ranks (ranks 0-2 give gradients k + 1 times a
// ramp), whole at stage 0, its chunk at 1, 2 and 3; at stage 1 a gradient
// that is full_grad() itself is reduced where it lies. Stage 3 (as a
// pipeline stage runs it) first gathers the whole parameters once with
// gather_params(); the bytes the group's communicator moved in the step
// equal step_cost() at every stage.
TEST(DataParallelExternalGrads, ReducedAsFromAnExecutor) {
  const ParamLayout layout = {{"a", Shape{5, 3}, 0}, {"b", Shape{7}, 15}};
  for (int stage = 0; stage <= 3; ++stage) {
    for (bool in_place : {false, true}) {
      if (in_place && stage >= 2) continue;
      LocalWorld::run(local(3), [&](Communicator& comm) {
        Tensor flat = Tensor::zeros({22}, DType::f32);
        for (int64_t i = 0; i < 22; ++i) flat.data<float>()[i] = static_cast<float>(i) - 7.0f;
        DataParallelOptions o;
        o.stage = stage;
        o.bucket_bytes = 20;  // two buckets: b, then a
        DataParallel dp(comm, layout, flat, o);
        dp.use_external_grads();
        if (stage == 3) {
          Tensor whole = Tensor::zeros({22}, DType::f32);
          dp.gather_params(whole);
          for (int64_t i = 0; i < 22; ++i) {
            EXPECT_EQ(whole.data<float>()[i], static_cast<float>(i) - 7.0f) << i;
          }
        }
        const auto k = static_cast<float>(comm.rank() + 1);
        dp.begin_micro_step(0.5);
        for (const std::string name : {"b", "a"}) {
          const ParamLayoutEntry& e = layout[name == "a" ? 0 : 1];
          Tensor g = in_place ? dp.full_grad(name) : Tensor::empty(e.shape, DType::f32);
          ASSERT_EQ(g.numel(), e.shape.numel());
          for (int64_t i = 0; i < g.numel(); ++i) g.data<float>()[i] = k * static_cast<float>(i);
          dp.add_grad(name, g);
        }
        EXPECT_THROW(dp.add_grad("a", Tensor::zeros({5, 3}, DType::f32)), ConfigError)
            << "twice in one micro-step";
        dp.end_micro_step();
        for (const ParamSlice& sl : dp.slices()) {
          for (int64_t i = sl.begin; i < sl.end; ++i) {
            // 0.5 x (1 + 2 + 3) x i
            EXPECT_FLOAT_EQ(sl.grad.data<float>()[i - sl.begin], 3.0f * static_cast<float>(i))
                << "stage " << stage << " in place " << in_place << " " << sl.name << "[" << i
                << "]";
          }
        }
        dp.finish_step();
        const CollectiveCost cost = dp.step_cost();
        EXPECT_GT(cost.bytes_sent, 0u);
        EXPECT_EQ(collective_bytes(comm.counters(), true), cost.bytes_sent) << "stage " << stage;
        EXPECT_EQ(collective_bytes(comm.counters(), false), cost.bytes_received)
            << "stage " << stage;
      });
    }
  }
  LocalWorld::run(local(2), [&](Communicator& comm) {
    DataParallelOptions o;
    o.stage = 2;
    DataParallel dp(comm, layout, Tensor::zeros({22}, DType::f32), o);
    EXPECT_EQ(dp.full_grad("a").raw(), nullptr);  // stage 2 has no full gradient buffer
    EXPECT_THROW(dp.add_grad("a", Tensor::zeros({5, 3}, DType::f32)), ConfigError)
        << "before use_external_grads";
    dp.use_external_grads();
    dp.begin_micro_step(1.0);
    EXPECT_THROW(dp.add_grad("c", Tensor::zeros({5, 3}, DType::f32)), ConfigError);
    EXPECT_THROW(dp.add_grad("a", Tensor::zeros({4}, DType::f32)), ConfigError);
    dp.add_grad("b", Tensor::zeros({7}, DType::f32));
    EXPECT_THROW(dp.add_grad("b", Tensor::zeros({7}, DType::f32)), ConfigError);
    EXPECT_THROW(dp.end_micro_step(), ConfigError) << "'a' never given";
  });
}

}  // namespace
}  // namespace mt::test
