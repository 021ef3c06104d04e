#include "meshtrain/spmd/schedule.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <tuple>

#include "meshtrain/base/error.h"

namespace mt {
namespace {

constexpr ScheduleKind kAll[] = {ScheduleKind::gpipe,       ScheduleKind::one_f_one_b,
                                 ScheduleKind::interleaved, ScheduleKind::zero_bubble,
                                 ScheduleKind::zbv,         ScheduleKind::dualpipev};

// An independent check of a schedule's lists (not through simulate()):
// every (micro-batch, virtual stage) is forwarded once and backwarded once
// (or has one input- and one weight-gradient pass: always under zero_bubble
// and zbv, never under the others but dualpipev), on the stage that owns
// it; every send has exactly one matching recv on the peer; on each stage a
// recv comes before the compute that needs it and a send after the compute
// that produced it.
void check_lists(const PipelineSchedule& s) {
  SCOPED_TRACE(fmt::format("{} p={} m={} v={}", schedule_name(s.kind), s.stages, s.microbatches,
                           s.virtual_stages));
  const int S = s.virtual_count(), m = s.microbatches;
  const bool split = s.kind == ScheduleKind::zero_bubble || s.kind == ScheduleKind::zbv;
  const bool mixed = s.kind == ScheduleKind::dualpipev;
  std::map<std::tuple<int, int, int>, int> count;  // (kind, mb, stage)
  std::map<std::tuple<int, int, int, int, int>, int> sends,
      recvs;  // (what, mb, from-stage, src, dst)
  for (int r = 0; r < s.stages; ++r) {
    const auto& l = s.actions[static_cast<size_t>(r)];
    for (size_t i = 0; i < l.size(); ++i) {
      const PipelineAction& a = l[i];
      if (a.is_compute()) {
        EXPECT_EQ(s.owner(a.stage), r) << describe(a);
        ++count[{static_cast<int>(a.kind), a.microbatch, a.stage}];
        continue;
      }
      // The compute the transfer belongs to is the neighbour in the list.
      auto find = [&](ActionKind k, bool before) {
        if (before) {
          for (size_t j = 0; j < i; ++j)
            if (l[j].kind == k && l[j].microbatch == a.microbatch && l[j].stage == a.stage)
              return true;
        } else {
          for (size_t j = i + 1; j < l.size(); ++j)
            if (l[j].kind == k && l[j].microbatch == a.microbatch && l[j].stage == a.stage)
              return true;
        }
        return false;
      };
      auto found_back = [&](bool before) {
        return find(ActionKind::backward, before) || find(ActionKind::backward_input, before);
      };
      switch (a.kind) {
        case ActionKind::send_activation:
          EXPECT_TRUE(find(ActionKind::forward, true)) << describe(a);
          ++sends[{0, a.microbatch, a.stage, r, a.peer}];
          EXPECT_EQ(a.peer, s.owner(a.stage + 1));
          break;
        case ActionKind::recv_activation:
          EXPECT_TRUE(find(ActionKind::forward, false)) << describe(a);
          ++recvs[{0, a.microbatch, a.stage - 1, a.peer, r}];
          break;
        case ActionKind::send_grad:
          EXPECT_TRUE(found_back(true)) << describe(a);
          ++sends[{1, a.microbatch, a.stage, r, a.peer}];
          EXPECT_EQ(a.peer, s.owner(a.stage - 1));
          break;
        case ActionKind::recv_grad:
          EXPECT_TRUE(found_back(false)) << describe(a);
          ++recvs[{1, a.microbatch, a.stage + 1, a.peer, r}];
          break;
        default:
          break;
      }
    }
  }
  EXPECT_EQ(sends, recvs);
  for (const auto& [k, n] : sends) EXPECT_EQ(n, 1);
  for (int i = 0; i < m; ++i) {
    for (int st = 0; st < S; ++st) {
      EXPECT_EQ((count[{static_cast<int>(ActionKind::forward), i, st}]), 1) << i << "@" << st;
      const int whole = count[{static_cast<int>(ActionKind::backward), i, st}];
      const int input = count[{static_cast<int>(ActionKind::backward_input), i, st}];
      const int weight = count[{static_cast<int>(ActionKind::backward_weight), i, st}];
      EXPECT_EQ(whole + input, 1) << i << "@" << st;
      EXPECT_EQ(weight, input) << i << "@" << st;
      if (split) {
        EXPECT_EQ(whole, 0) << i << "@" << st;
      }
      if (!split && !mixed) {
        EXPECT_EQ(input, 0) << i << "@" << st;
      }
    }
  }
  int total = 0, weights = 0;
  for (const auto& [k, n] : count) {
    total += n;
    if (std::get<0>(k) == static_cast<int>(ActionKind::backward_weight)) weights += n;
  }
  EXPECT_EQ(total, m * S * 2 + weights);
}

// The simulated start times respect every dependency (checked here from
// the times, independently of how simulate() orders its work).
void check_times(const PipelineSchedule& s, const ScheduleSimulation& sim, const ActionCosts& c) {
  std::map<std::tuple<int, int, int>, std::pair<double, double>>
      when;  // kind, mb, st -> start, end
  for (int r = 0; r < s.stages; ++r) {
    double last_end = 0;
    const auto& l = s.actions[static_cast<size_t>(r)];
    for (size_t i = 0; i < l.size(); ++i) {
      const PipelineAction& a = l[i];
      if (!a.is_compute()) continue;
      const double st = sim.start[static_cast<size_t>(r)][i];
      const double cost = a.kind == ActionKind::forward    ? c.forward
                          : a.kind == ActionKind::backward ? c.backward_input + c.backward_weight
                          : a.kind == ActionKind::backward_input ? c.backward_input
                                                                 : c.backward_weight;
      EXPECT_GE(st, last_end - 1e-9) << "stage " << r << " overlaps itself at " << describe(a);
      last_end = st + cost;
      when[{static_cast<int>(a.kind), a.microbatch, a.stage}] = {st, st + cost};
    }
  }
  const int last = s.virtual_count() - 1;
  auto end_of = [&](ActionKind k, int mb, int st) {
    auto it = when.find({static_cast<int>(k), mb, st});
    return it == when.end() ? -1.0 : it->second.second;
  };
  for (const auto& [key, t] : when) {
    const auto [k, mb, st] = key;
    const ActionKind kind = static_cast<ActionKind>(k);
    // The next stage's backward of this micro-batch, whole or its input part.
    auto back_end = [&](int b_mb, int b_st) {
      return std::max(end_of(ActionKind::backward, b_mb, b_st),
                      end_of(ActionKind::backward_input, b_mb, b_st));
    };
    if (kind == ActionKind::forward && st > 0) {
      EXPECT_GE(t.first, end_of(kind, mb, st - 1));
    }
    if (kind == ActionKind::backward || kind == ActionKind::backward_input) {
      EXPECT_GE(t.first, end_of(ActionKind::forward, mb, st));
      if (st < last) {
        EXPECT_GE(t.first, back_end(mb, st + 1));
      }
    }
    if (kind == ActionKind::backward_weight) {
      EXPECT_GE(t.first, end_of(ActionKind::backward_input, mb, st));
    }
  }
}

TEST(Schedule, EveryScheduleIsCompleteAndRespectsDependencies) {
  for (ScheduleKind k : kAll) {
    for (int p = 1; p <= 4; ++p) {
      for (int m = 1; m <= 9; ++m) {
        for (int v : {1, 2, 3}) {
          try {
            check_schedule(k, p, m, v, "t");
          } catch (const ConfigError&) {
            continue;
          }
          const PipelineSchedule s = make_schedule(k, p, m, v);
          check_lists(s);
          const ScheduleSimulation sim = simulate(s);
          check_times(s, sim, {});
          // Busy time is the work, whatever the order.
          for (double b : sim.busy) EXPECT_DOUBLE_EQ(b, 3.0 * m * v);
        }
      }
    }
  }
}

TEST(Schedule, GpipeAndOneFOneBBubbleIsTheFormula) {
  for (int p = 1; p <= 6; ++p) {
    for (int m = p; m <= 16; ++m) {
      const double want = static_cast<double>(p - 1) / (m + p - 1);
      const auto g = simulate(make_schedule(ScheduleKind::gpipe, p, m));
      const auto f = simulate(make_schedule(ScheduleKind::one_f_one_b, p, m));
      EXPECT_NEAR(g.idle_fraction, want, 1e-12) << "gpipe p=" << p << " m=" << m;
      EXPECT_NEAR(f.idle_fraction, want, 1e-12) << "1f1b p=" << p << " m=" << m;
      EXPECT_NEAR(formula_idle_fraction(ScheduleKind::gpipe, p, m, 1), want, 1e-12);
      // Other costs: the bubble is still (p-1) slots of forward + backward.
      const ActionCosts c{1.0, 1.5, 0.75};
      EXPECT_NEAR(simulate(make_schedule(ScheduleKind::one_f_one_b, p, m), c).idle_fraction, want,
                  1e-12);
      // 1F1B holds at most p - stage micro-batches; GPipe holds all m.
      for (int s = 0; s < p; ++s) {
        EXPECT_LE(f.peak_in_flight[static_cast<size_t>(s)], p - s);
        EXPECT_EQ(g.peak_in_flight[static_cast<size_t>(s)], m);
      }
    }
  }
}

TEST(Schedule, InterleavedBubbleShrinksByTheVirtualStages) {
  for (int p : {2, 3, 4}) {
    for (int v : {2, 3, 4}) {
      for (int m = p; m <= 4 * p; m += p) {
        const auto sim = simulate(make_schedule(ScheduleKind::interleaved, p, m, v));
        const double want = static_cast<double>(p - 1) / (v * m + p - 1);
        EXPECT_NEAR(sim.idle_fraction, want, 1e-12) << "p=" << p << " m=" << m << " v=" << v;
        EXPECT_LT(sim.idle_fraction, formula_idle_fraction(ScheduleKind::one_f_one_b, p, m, 1));
      }
    }
  }
}

TEST(Schedule, ZeroBubbleBeatsOneFOneB) {
  for (int p = 2; p <= 6; ++p) {
    for (int m = p; m <= 3 * p; ++m) {
      const auto z = simulate(make_schedule(ScheduleKind::zero_bubble, p, m));
      const auto f = simulate(make_schedule(ScheduleKind::one_f_one_b, p, m));
      EXPECT_LT(z.idle_fraction, f.idle_fraction - 1e-9) << "p=" << p << " m=" << m;
      // Never below ZB-H1's ideal (weight passes cannot fill the warm-up).
      EXPECT_GE(z.idle_fraction, static_cast<double>(p - 1) / (3 * m + p - 1) - 1e-12);
      for (int held : z.peak_in_flight) EXPECT_LE(held, 2 * p);
    }
  }
  const auto z = simulate(make_schedule(ScheduleKind::zero_bubble, 4, 8));
  EXPECT_NEAR(z.idle_fraction, 0.2, 1e-12);  // the figure docs/plan.md quotes
}

// ZBV: the V places virtual stages r and 2p-1-r on rank r (the loss on rank
// 0, the turn on rank p-1 without a transfer), and its bubble is below
// 1F1B's and interleaved's with two chunks, holding at most 2p chunk
// passes' activations per rank (1F1B's p whole stages).
TEST(Schedule, ZbvIsAVAndBeatsOneFOneBAndInterleaved) {
  for (int p = 2; p <= 5; ++p) {
    for (int vs = 0; vs < 2 * p; ++vs) {
      EXPECT_EQ(stage_owner(ScheduleKind::zbv, p, vs), vs < p ? vs : 2 * p - 1 - vs);
    }
    for (int m = p; m <= 3 * p; ++m) {
      const PipelineSchedule s = make_schedule(ScheduleKind::zbv, p, m, 2);
      const auto z = simulate(s);
      const auto f = simulate(make_schedule(ScheduleKind::one_f_one_b, p, m));
      EXPECT_LT(z.idle_fraction, f.idle_fraction - 1e-9) << "p=" << p << " m=" << m;
      EXPECT_LE(z.idle_fraction, formula_idle_fraction(ScheduleKind::zbv, p, m, 2) + 1e-12)
          << "p=" << p << " m=" << m;
      for (int held : z.peak_in_flight) EXPECT_LE(held, 2 * p) << "p=" << p << " m=" << m;
      for (const PipelineAction& a : s.actions[static_cast<size_t>(p - 1)]) {
        const bool turn = (a.kind == ActionKind::send_activation && a.stage == p - 1) ||
                          (a.kind == ActionKind::send_grad && a.stage == p);
        EXPECT_FALSE(turn) << describe(a);
      }
    }
  }
  std::printf("zbv p=4 m=8: idle %.3f (1f1b %.3f, interleaved v=2 %.3f)\n",
              simulate(make_schedule(ScheduleKind::zbv, 4, 8, 2)).idle_fraction,
              formula_idle_fraction(ScheduleKind::one_f_one_b, 4, 8, 1),
              formula_idle_fraction(ScheduleKind::interleaved, 4, 8, 2));
}

// DualPipeV: the same V as zbv, every micro-batch through both chunks of
// each rank, and a bubble below 1F1B's (its fixed order pairs forwards of
// one chunk with backwards of the other once the V is full).
TEST(Schedule, DualPipeVIsAVAndBeatsOneFOneB) {
  for (int p = 2; p <= 5; ++p) {
    for (int vs = 0; vs < 2 * p; ++vs) {
      EXPECT_EQ(stage_owner(ScheduleKind::dualpipev, p, vs), vs < p ? vs : 2 * p - 1 - vs);
    }
    for (int m = 2 * p; m <= 4 * p; ++m) {
      const PipelineSchedule s = make_schedule(ScheduleKind::dualpipev, p, m, 2);
      check_lists(s);
      const auto d = simulate(s);
      check_times(s, d, {});
      const auto f = simulate(make_schedule(ScheduleKind::one_f_one_b, p, m));
      EXPECT_LT(d.idle_fraction, f.idle_fraction - 1e-9) << "p=" << p << " m=" << m;
      EXPECT_LE(d.idle_fraction, formula_idle_fraction(ScheduleKind::dualpipev, p, m, 2) + 1e-12)
          << "p=" << p << " m=" << m;
    }
  }
  std::printf("dualpipev p=4 m=8: idle %.3f (zbv %.3f, 1f1b %.3f)\n",
              simulate(make_schedule(ScheduleKind::dualpipev, 4, 8, 2)).idle_fraction,
              simulate(make_schedule(ScheduleKind::zbv, 4, 8, 2)).idle_fraction,
              formula_idle_fraction(ScheduleKind::one_f_one_b, 4, 8, 1));
}

// Transfers that take time: plain 1F1B at p = 2 pays two transfers per
// micro-batch (the stages alternate in lock-step); one extra warm-up forward
// keeps an activation in flight and pays them about once per step, back
// near the formula, for one more micro-batch held on each stage but the last.
TEST(Schedule, ExtraWarmupHidesTransferLatency) {
  const ActionCosts slow{1.0, 1.0, 1.0, 0.2};
  for (int p = 2; p <= 4; ++p) {
    for (int m = p; m <= 4 * p; ++m) {
      const PipelineSchedule plain = make_schedule(ScheduleKind::one_f_one_b, p, m);
      const PipelineSchedule eager = make_schedule(ScheduleKind::one_f_one_b, p, m, 1, 1);
      check_lists(eager);
      const auto e = simulate(eager, slow);
      check_times(eager, e, slow);
      const auto f = simulate(plain, slow);
      // (m = p: the extra forward has no later micro-batch to start.)
      if (m > p) {
        EXPECT_LT(e.idle_fraction, f.idle_fraction - 1e-9) << "p=" << p << " m=" << m;
      } else {
        EXPECT_LE(e.idle_fraction, f.idle_fraction + 1e-12) << "p=" << p << " m=" << m;
      }
      // Without latency the extra warm-up costs nothing in time.
      EXPECT_NEAR(simulate(eager).idle_fraction, simulate(plain).idle_fraction, 1e-12);
      for (int s = 0; s < p; ++s) {
        EXPECT_LE(e.peak_in_flight[static_cast<size_t>(s)], std::min(m, p - s + (s < p - 1)));
      }
    }
  }
  const auto plain = simulate(make_schedule(ScheduleKind::one_f_one_b, 2, 4), slow);
  const auto eager = simulate(make_schedule(ScheduleKind::one_f_one_b, 2, 4, 1, 1), slow);
  std::printf(
      "p=2 m=4, transfer 0.2 of a forward: 1f1b idle %.3f, with one extra warm-up %.3f "
      "(formula %.3f)\n",
      plain.idle_fraction, eager.idle_fraction,
      formula_idle_fraction(ScheduleKind::one_f_one_b, 2, 4, 1));
  EXPECT_THROW(check_warmup_extra(ScheduleKind::gpipe, 1, "parallel"), ConfigError);
  EXPECT_THROW(check_warmup_extra(ScheduleKind::one_f_one_b, -1, "parallel"), ConfigError);
}

TEST(Schedule, OneStageHasNoBubbleAndNoTransfers) {
  for (ScheduleKind k : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b}) {
    const PipelineSchedule s = make_schedule(k, 1, 3);
    EXPECT_EQ(simulate(s).idle_fraction, 0.0);
    for (const PipelineAction& a : s.actions[0]) EXPECT_TRUE(a.is_compute());
  }
}

TEST(Schedule, DescribesActions) {
  const PipelineSchedule s = make_schedule(ScheduleKind::one_f_one_b, 2, 2);
  std::vector<std::string> d;
  for (const PipelineAction& a : s.actions[1]) d.push_back(describe(a));
  EXPECT_EQ(d, (std::vector<std::string>{"recv_act0@1<-0", "F0@1", "B0@1", "send_grad0@1->0",
                                         "recv_act1@1<-0", "F1@1", "B1@1", "send_grad1@1->0"}));
}

std::string schedule_error(ScheduleKind k, int p, int m, int v) {
  try {
    check_schedule(k, p, m, v, "parallel");
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "no error";
}

TEST(Schedule, RequirementsNameTheKeyAndTheNeed) {
  EXPECT_EQ(schedule_error(ScheduleKind::one_f_one_b, 4, 2, 1),
            "parallel.microbatches: schedule 1f1b with 4 stages needs at least 4 micro-batches "
            "(one per stage to fill the pipeline), got 2");
  EXPECT_EQ(schedule_error(ScheduleKind::zero_bubble, 3, 2, 1),
            "parallel.microbatches: schedule zero_bubble with 3 stages needs at least 3 "
            "micro-batches (one per stage to fill the pipeline), got 2");
  EXPECT_EQ(schedule_error(ScheduleKind::interleaved, 4, 6, 2),
            "parallel.microbatches: schedule interleaved with 4 stages needs a multiple of 4 "
            "micro-batches (each round sends 4 through every model chunk), got 6");
  EXPECT_EQ(schedule_error(ScheduleKind::interleaved, 2, 4, 1),
            "parallel.virtual_stages: schedule interleaved needs at least 2 virtual stages per "
            "stage, got 1");
  EXPECT_EQ(schedule_error(ScheduleKind::gpipe, 2, 4, 2),
            "parallel.virtual_stages: 2 virtual stages need schedule interleaved, zbv or dualpipev "
            "(schedule gpipe runs one stage per rank)");
  EXPECT_EQ(schedule_error(ScheduleKind::zbv, 2, 4, 1),
            "parallel.virtual_stages: schedule zbv runs exactly 2 model chunks per stage (rank r "
            "holds virtual stages r and 2p-1-r), got 1 (set virtual_stages = 2)");
  EXPECT_EQ(schedule_error(ScheduleKind::zbv, 3, 2, 2),
            "parallel.microbatches: schedule zbv with 3 stages needs at least 3 micro-batches "
            "(one per stage to fill the pipeline), got 2");
  EXPECT_EQ(parse_schedule_kind("zbv", "x"), ScheduleKind::zbv);
  EXPECT_EQ(schedule_error(ScheduleKind::dualpipev, 2, 3, 2),
            "parallel.microbatches: schedule dualpipev with 2 stages needs at least 4 "
            "micro-batches (one per model chunk: its steady phase pairs each forward with a "
            "backward), got 3");
  EXPECT_EQ(parse_schedule_kind("dualpipev", "x"), ScheduleKind::dualpipev);
  EXPECT_EQ(schedule_error(ScheduleKind::gpipe, 4, 1, 1), "no error");
  EXPECT_THROW(parse_schedule_kind("1F1B", "parallel.schedule"), ConfigError);
  EXPECT_EQ(parse_schedule_kind("zero_bubble", "x"), ScheduleKind::zero_bubble);
}

}  // namespace
}  // namespace mt
