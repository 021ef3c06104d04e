// Asynchronous pipelining (schedule.h's AsyncMode, the runtime's weight
// stash and prediction): against the sequential reference of
// pipeline_async.cpp on local threads (the same checks under mpirun in
// pipeline_async_mpi_test.cpp), the version gaps of 1F1B, and the
// combinations that are refused.
#include <gtest/gtest.h>

#include <string>

#include "meshtrain/base/error.h"
#include "meshtrain/comm/backends/local/local_world.h"
#include "meshtrain/models/model.h"
#include "meshtrain/spmd/pipeline_runtime.h"
#include "meshtrain/spmd/pipeline_stage.h"
#include "meshtrain/spmd/shorthand.h"
#include "pipeline_async.h"

namespace mt {
namespace {

void on_threads(int ranks, AsyncMode mode, std::vector<int64_t> stage_layers, int m,
                const std::string& kind = "mlp") {
  LocalWorldOptions o;
  o.size = ranks;
  o.comm.timeout = std::chrono::milliseconds(60'000);
  LocalWorld::run(o, [&](Communicator& world) {
    test::check_async_matches_reference(world, mode, stage_layers, m, kind);
  });
}

TEST(PipelineAsync, VersionGapsOf1f1bArePMinus1MinusStageInTheSteadyState) {
  for (int p : {2, 3, 4}) {
    for (int extra : {0, 1}) {
      const int m = 8;
      const PipelineSchedule s = make_schedule(ScheduleKind::one_f_one_b, p, m, 1, extra);
      for (int r = 0; r < p; ++r) {
        const int steady = r == p - 1 ? 0 : std::min(m, p - 1 - r + extra);
        const std::vector<int> gaps = version_gaps(s, r);
        ASSERT_EQ(gaps.size(), static_cast<size_t>(m));
        for (int i = 0; i < m; ++i) {
          EXPECT_EQ(gaps[static_cast<size_t>(i)], std::min(i, steady))
              << "p " << p << ", extra " << extra << ", stage " << r << ", micro-batch " << i;
        }
      }
    }
  }
}

TEST(PipelineAsync, WindowsWithoutTheFlushAreOneLong1f1b) {
  // Windows 0..T-1 and the drain, concatenated, run 1F1B's compute order
  // over T*m micro-batches (the warm-up once, no cool-down between steps),
  // the simulator finds no deadlock, and every micro-batch's gap is
  // min(g, p - 1 - r).
  for (int p : {2, 3, 4}) {
    const int m = 4, windows = 3;
    PipelineSchedule all;
    all.kind = ScheduleKind::one_f_one_b;
    all.stages = p;
    all.microbatches = windows * m;
    all.actions.resize(static_cast<size_t>(p));
    for (int w = 0; w <= windows; ++w) {
      const PipelineSchedule win = make_async_window(p, m, w, w == windows);
      for (int r = 0; r < p; ++r) {
        auto& to = all.actions[static_cast<size_t>(r)];
        const auto& from = win.actions[static_cast<size_t>(r)];
        to.insert(to.end(), from.begin(), from.end());
      }
    }
    const PipelineSchedule sync = make_schedule(ScheduleKind::one_f_one_b, p, windows * m);
    for (int r = 0; r < p; ++r) {
      std::vector<PipelineAction> a, b;
      for (const PipelineAction& x : all.actions[static_cast<size_t>(r)]) {
        if (x.is_compute()) a.push_back(x);
      }
      for (const PipelineAction& x : sync.actions[static_cast<size_t>(r)]) {
        if (x.is_compute()) b.push_back(x);
      }
      EXPECT_EQ(a, b) << "p " << p << ", stage " << r;
      const std::vector<int> gaps = version_gaps(all, r);
      for (int g = 0; g < windows * m; ++g) {
        EXPECT_EQ(gaps[static_cast<size_t>(g)], std::min(g, p - 1 - r));
        EXPECT_EQ(async_version_gap(p, r, g), std::min(g, p - 1 - r));
      }
    }
    const ScheduleSimulation sim = simulate(all);
    // One warm-up and one cool-down for the whole run: 1F1B's bubble over
    // T*m micro-batches, not over m.
    EXPECT_NEAR(sim.idle_fraction, static_cast<double>(p - 1) / (windows * m + p - 1), 1e-9);
  }
}

TEST(PipelineAsync, OneStageEqualsPerMicroBatchSgd) {
  // One stage: no gap, so both modes are plain SGD after every micro-batch.
  on_threads(1, AsyncMode::pipedream, {3}, 4);
  on_threads(1, AsyncMode::spectrain, {3}, 4);
}

TEST(PipelineAsync, PipeDreamBackwardUsesTheWeightsItsForwardUsed) {
  // Stage 0 holds fc1 and fc2: its backward reads fc2's weight (the input
  // gradient of fc2), so a backward at any other version than the
  // forward's gives another gradient for fc1.
  on_threads(2, AsyncMode::pipedream, {2, 1}, 4);
  on_threads(3, AsyncMode::pipedream, {1, 1, 1}, 6);
}

TEST(PipelineAsync, SpecTrainForwardUsesPredictedWeights) {
  on_threads(2, AsyncMode::spectrain, {1, 2}, 4);
}

TEST(PipelineAsync, PipeDreamGptTiedEmbeddingIsOneParameter) {
  // GPT's wte is held by the first stage (embedding) and the last (head):
  // the first stage updates it with both parts of each micro-batch's
  // gradient, the last stage reads the value the first stage's forward of
  // the same micro-batch read. Equal to the whole model's gradient at the
  // versions PipeDream prescribes; the stages' copies equal at the end.
  on_threads(2, AsyncMode::pipedream, {3, 2}, 4, "gpt");
  on_threads(3, AsyncMode::pipedream, {2, 2, 1}, 6, "gpt");
}

ModelSpec tiny(const std::string& kind) {
  ModelSpec s;
  s.kind = kind;
  if (kind == "gpt") {
    s.layers = 2;
    s.d_model = 8;
    s.heads = 2;
    s.seq_len = 4;
    s.vocab = 12;
  } else {
    s.image_size = 4;
    s.hidden = {12, 10};
    s.classes = 5;
  }
  return s;
}

TEST(PipelineAsync, BadCombinationsAreRefusedNamingTheKey) {
  const ModelSpec mlp = tiny("mlp");
  const ModelGraph g = build_model(mlp, 8);
  ParallelShorthand sh;
  sh.pp = 2;
  sh.microbatches = 4;
  sh.async = AsyncMode::pipedream;
  sh.schedule = ScheduleKind::gpipe;
  auto message = [&](const ParallelShorthand& x, int world) {
    try {
      expand_shorthand(x, ShorthandModel{"mlp", 1}, g.graph, world);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  EXPECT_NE(message(sh, 2).find("parallel.async: pipedream runs on schedule 1f1b"),
            std::string::npos)
      << message(sh, 2);
  sh.schedule = ScheduleKind::one_f_one_b;
  EXPECT_EQ(message(sh, 2), "(accepted)");
  sh.recompute = true;
  EXPECT_NE(message(sh, 2).find("parallel.async"), std::string::npos) << message(sh, 2);
  ParallelShorthand one;
  one.async = AsyncMode::spectrain;
  EXPECT_NE(message(one, 1).find("parallel.async: spectrain"), std::string::npos)
      << message(one, 1);
  EXPECT_THROW(parse_async_mode("stale", "parallel.async"), ConfigError);

  // The plan file carries the mode; a file asking for it on GPipe is refused.
  sh.recompute = false;
  Plan plan = expand_shorthand(sh, ShorthandModel{"mlp", 1}, g.graph, 2);
  EXPECT_EQ(plan_from_json(plan_to_json(plan), "p.json").async, AsyncMode::pipedream);
  plan.schedule = ScheduleKind::gpipe;
  try {
    validate_plan(plan, g.graph, 2, 8, "plan p.json");
    ADD_FAILURE() << "accepted async on gpipe";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("plan p.json.async: pipedream runs on schedule 1f1b"),
              std::string::npos)
        << e.what();
  }

  // GPT's tied wte on the first and last stage runs (above); the runtime
  // refuses a tied parameter on stages with meshes of their own and one
  // mirrored on a stage other than the last (neither built by the shorthand).
}

}  // namespace
}  // namespace mt
