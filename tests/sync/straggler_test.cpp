// Straggler detection: a rank that really sleeps longer each step is found
// and named, equal ranks are not; with given times the window, threshold,
// once-only announcement, recovery and relapse, batched exchanges and the
// per-step times for metrics are exact; bad input and desynchronised ranks
// fail on every rank.
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "meshtrain/comm/backends/local/local_world.h"
#include "meshtrain/sync/straggler.h"

namespace mt {
namespace {

LocalWorldOptions world(int size) {
  LocalWorldOptions o;
  o.size = size;
  o.comm.timeout = std::chrono::milliseconds(10'000);
  return o;
}

// Without persistence and rate limit (announced as soon as a full window
// says so), unless the tests ask for them.
StragglerOptions options(int window, int64_t every_steps = 1, double threshold = 1.2,
                         double recover_threshold = 0, int persist_windows = 0,
                         int64_t repeat_gap_steps = 0) {
  StragglerOptions o;
  o.window = window;
  o.every_steps = every_steps;
  o.threshold = threshold;
  o.recover_threshold = recover_threshold;
  o.persist_windows = persist_windows;
  o.repeat_gap_steps = repeat_gap_steps;
  return o;
}

TEST(MedianOf, OddEvenAndUnsorted) {
  EXPECT_EQ(median_of({3.0}), 3.0);
  EXPECT_EQ(median_of({5.0, 1.0, 3.0}), 3.0);
  EXPECT_EQ(median_of({4.0, 1.0, 3.0, 2.0}), 2.5);
  EXPECT_THROW(median_of({}), InternalError);
}

// Runs `steps` steps on `size` ranks with time(rank, step) and returns rank
// 0's reports (every rank's reports are checked to be equal).
// summary, if given, receives rank 0's summary() at the end.
std::vector<StragglerReport> run_given(int size, int steps, const StragglerOptions& opts,
                                       const std::function<double(int rank, int step)>& time,
                                       std::vector<std::string>* summary = nullptr) {
  std::mutex mu;
  std::vector<std::vector<StragglerReport>> by_rank(static_cast<size_t>(size));
  LocalWorld::run(world(size), [&](Communicator& comm) {
    StragglerDetector det(comm, opts);
    std::vector<StragglerReport> mine;
    for (int s = 0; s < steps; ++s) mine.push_back(det.report(100 + s, time(comm.rank(), s)));
    std::lock_guard lock(mu);
    if (summary != nullptr && comm.rank() == 0) *summary = det.summary();
    by_rank[static_cast<size_t>(comm.rank())] = std::move(mine);
  });
  for (int r = 1; r < size; ++r) {
    for (int s = 0; s < steps; ++s) {
      const auto& a = by_rank[0][static_cast<size_t>(s)];
      const auto& b = by_rank[static_cast<size_t>(r)][static_cast<size_t>(s)];
      EXPECT_EQ(a.messages, b.messages) << "rank " << r << " step " << s;
      EXPECT_EQ(a.stragglers, b.stragglers) << "rank " << r << " step " << s;
      EXPECT_EQ(a.seconds, b.seconds) << "rank " << r << " step " << s;
    }
  }
  return by_rank[0];
}

TEST(Straggler, SlowRankIsAnnouncedOnceWhenTheWindowFills) {
  const auto reports = run_given(3, 12, options(5), [](int rank, int step) {
    return (rank == 2 ? 0.040 : 0.020) + 0.0001 * (step % 3);
  });
  for (int s = 0; s < 4; ++s) {
    EXPECT_TRUE(reports[static_cast<size_t>(s)].exchanged);
    EXPECT_TRUE(reports[static_cast<size_t>(s)].window_median.empty()) << "window not full yet";
    EXPECT_TRUE(reports[static_cast<size_t>(s)].stragglers.empty());
  }
  const StragglerReport& first = reports[4];
  ASSERT_EQ(first.new_stragglers, std::vector<int>{2});
  ASSERT_EQ(first.messages.size(), 1u);
  EXPECT_EQ(first.messages[0],
            "rank 2 is a straggler: median step 40.1 ms vs 20.1 ms for the others (2.00x) over "
            "the last 5 steps");
  ASSERT_EQ(first.ratio.size(), 3u);
  EXPECT_NEAR(first.ratio[2], 0.0401 / 0.0201, 1e-12);
  EXPECT_LT(first.ratio[0], 1.0);
  for (size_t s = 5; s < reports.size(); ++s) {
    EXPECT_EQ(reports[s].stragglers, std::vector<int>{2}) << "still slow at step " << s;
    EXPECT_TRUE(reports[s].new_stragglers.empty()) << "announced twice at step " << s;
    EXPECT_TRUE(reports[s].messages.empty());
  }
  // The per-step times for the metrics log.
  ASSERT_EQ(reports[6].steps, std::vector<int64_t>{106});
  ASSERT_EQ(reports[6].seconds.size(), 1u);
  EXPECT_EQ(reports[6].seconds[0], (std::vector<double>{0.020, 0.020, 0.040}));
}

TEST(Straggler, EqualRanksWithJitterAreNotReported) {
  const auto reports = run_given(4, 30, options(10), [](int rank, int step) {
    return 0.020 * (1.0 + 0.15 * (((rank * 7 + step * 13) % 11) / 10.0 - 0.5));
  });
  for (const auto& r : reports) {
    EXPECT_TRUE(r.stragglers.empty());
    EXPECT_TRUE(r.messages.empty());
  }
}

TEST(Straggler, ThresholdIsStrictAndMedianIgnoresSpikes) {
  // Rank 1 is exactly 1.2x (0.75 / 0.625 rounds to the double 1.2): not a
  // straggler. Rank 0 has rare huge spikes: the median does not see them.
  const auto reports = run_given(3, 10, options(10), [](int rank, int step) {
    if (rank == 1) return 0.75;
    if (rank == 0 && step % 4 == 0) return 100.0;
    return 0.625;
  });
  EXPECT_TRUE(reports.back().stragglers.empty());
  EXPECT_NEAR(reports.back().ratio[1], 1.2, 1e-12);
}

TEST(Straggler, RecoveryAndRelapseAreAnnounced) {
  // Rank 1: slow for steps 0-9, normal for 10-19, slow again from 20.
  const auto reports = run_given(2, 30, options(4), [](int rank, int step) {
    const bool slow = rank == 1 && (step < 10 || step >= 20);
    return slow ? 0.030 : 0.010;
  });
  std::vector<std::pair<int, std::string>> events;
  for (size_t s = 0; s < reports.size(); ++s) {
    for (const auto& m : reports[s].messages) events.emplace_back(static_cast<int>(s), m);
  }
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[0].first, 3);
  EXPECT_EQ(events[0].second,
            "rank 1 is a straggler: median step 30.0 ms vs 10.0 ms for the others (3.00x) over "
            "the last 4 steps");
  // Recovered once the median of the last 4 steps is normal again: at step 11
  // the window holds two slow and two normal samples (median 20 ms, still 2x),
  // at step 12 one slow and three normal. The relapse shows at the first 2:2.
  EXPECT_EQ(events[1].first, 12);
  EXPECT_NE(events[1].second.find("rank 1 recovered: median step 10.0 ms"), std::string::npos)
      << events[1].second;
  EXPECT_EQ(events[2].first, 21);
  EXPECT_NE(events[2].second.find("rank 1 is a straggler"), std::string::npos);
  EXPECT_EQ(reports[12].recovered, std::vector<int>{1});
}

TEST(Straggler, BatchedExchangesCarryEveryStep) {
  const auto reports =
      run_given(3, 9, options(4, 4), [](int rank, int step) { return 0.001 * (rank + 1) + step; });
  for (int s = 0; s < 9; ++s) {
    EXPECT_EQ(reports[static_cast<size_t>(s)].exchanged, s == 3 || s == 7) << s;
  }
  const StragglerReport& r = reports[7];
  EXPECT_EQ(r.steps, (std::vector<int64_t>{104, 105, 106, 107}));
  ASSERT_EQ(r.seconds.size(), 4u);
  ASSERT_EQ(r.seconds[2].size(), 3u);
  for (int rank = 0; rank < 3; ++rank)
    EXPECT_DOUBLE_EQ(r.seconds[2][rank], 6.0 + 0.001 * (rank + 1));
  ASSERT_EQ(r.window_median.size(), 3u);
  EXPECT_DOUBLE_EQ(r.window_median[1], 5.502);
}

TEST(Straggler, SleepingRankIsFoundAndEqualRanksAreNot) {
  using std::chrono::duration;
  using std::chrono::milliseconds;
  using Clock = std::chrono::steady_clock;
  for (int slow : {1, -1}) {
    std::mutex mu;
    std::vector<std::string> messages;
    std::vector<int> found;
    LocalWorld::run(world(3), [&](Communicator& comm) {
      StragglerDetector det(comm, options(10));
      for (int s = 0; s < 12; ++s) {
        const auto t0 = Clock::now();
        std::this_thread::sleep_for(milliseconds(comm.rank() == slow ? 15 : 5));
        // Equal ranks report the time they were asked to take: measured
        // 5 ms sleeps of three threads on a loaded 2-core machine differ by
        // more than the threshold (7.1 vs 5.1 ms seen), which is the
        // scheduler, not the detector. The slow rank's 3x stays measured.
        const double seconds = slow >= 0 ? duration<double>(Clock::now() - t0).count() : 5e-3;
        const StragglerReport rep = det.report(s, seconds);
        if (comm.rank() == 0) {
          std::lock_guard lock(mu);
          messages.insert(messages.end(), rep.messages.begin(), rep.messages.end());
          found.insert(found.end(), rep.new_stragglers.begin(), rep.new_stragglers.end());
        }
      }
    });
    if (slow >= 0) {
      ASSERT_EQ(found, std::vector<int>{slow});
      ASSERT_EQ(messages.size(), 1u);
      EXPECT_NE(messages[0].find("rank 1 is a straggler: median step"), std::string::npos)
          << messages[0];
    } else {
      EXPECT_TRUE(found.empty()) << (messages.empty() ? "" : messages[0]);
    }
  }
}

// Step times of a busy machine: every step jitters (log-normal, 15%), one
// step in 50 spikes to 4x, and a third of the 20-step windows make one random
// rank 1.6x slower for the whole window -- sometimes the same rank two windows
// running, never three. `slow_rank` (if >= 0) is 1.5x slower throughout.
std::vector<std::vector<double>> busy_machine(int size, int steps, int slow_rank, unsigned seed) {
  std::mt19937 rng(seed);
  std::lognormal_distribution<double> jitter(0.0, 0.15);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::uniform_int_distribution<int> pick(0, size - 1);
  std::vector<std::vector<double>> t(static_cast<size_t>(size),
                                     std::vector<double>(static_cast<size_t>(steps)));
  int prev = -1, prev2 = -1;  // ranks slowed in the last two windows (-1: none)
  for (int block = 0; block * 20 < steps; ++block) {
    int slowed = -1;
    if (u(rng) < 1.0 / 3) {
      slowed = pick(rng);
      if (slowed == prev && slowed == prev2) slowed = (slowed + 1) % size;
    }
    prev2 = prev;
    prev = slowed;
    for (int s = block * 20; s < std::min(steps, block * 20 + 20); ++s) {
      for (int r = 0; r < size; ++r) {
        double x = 0.020 * jitter(rng);
        if (u(rng) < 0.02) x *= 4;
        if (r == slowed) x *= 1.6;
        if (r == slow_rank) x *= 1.5;
        t[static_cast<size_t>(r)][static_cast<size_t>(s)] = x;
      }
    }
  }
  return t;
}

std::vector<std::string> all_messages(const std::vector<StragglerReport>& reports) {
  std::vector<std::string> m;
  for (const auto& r : reports) m.insert(m.end(), r.messages.begin(), r.messages.end());
  return m;
}

StragglerOptions defaults() {
  StragglerOptions o;  // window 20, threshold 1.2, persist 3 windows, gap 200 steps
  return o;
}

TEST(Straggler, NoiseOnRandomRanksStaysQuiet) {
  for (int size : {2, 4}) {
    for (unsigned seed : {1u, 2u, 3u}) {
      const auto t = busy_machine(size, 850, -1, seed);
      const auto time = [&](int r, int s) {
        return t[static_cast<size_t>(r)][static_cast<size_t>(s)];
      };
      std::vector<std::string> summary;
      const auto reports = run_given(size, 850, defaults(), time, &summary);
      const auto messages = all_messages(reports);
      EXPECT_TRUE(messages.empty()) << size << " ranks, seed " << seed << ": " << messages.size()
                                    << " messages, first: " << messages[0];
      EXPECT_TRUE(summary.empty()) << summary[0];
      // The same noise without persistence and rate limit is reported: the
      // noise is real, the defaults are what keeps it quiet.
      const auto eager = all_messages(run_given(size, 850, options(20), time));
      EXPECT_GE(eager.size(), 4u) << size << " ranks, seed " << seed;
    }
  }
}

TEST(Straggler, PersistentStragglerAmidNoiseIsAnnouncedOnce) {
  for (unsigned seed : {1u, 2u, 3u}) {
    const auto t = busy_machine(4, 850, 2, seed);
    std::vector<std::string> summary;
    const auto reports = run_given(
        4, 850, defaults(),
        [&](int r, int s) { return t[static_cast<size_t>(r)][static_cast<size_t>(s)]; }, &summary);
    std::vector<std::pair<size_t, std::string>> events;
    for (size_t s = 0; s < reports.size(); ++s) {
      for (const auto& m : reports[s].messages) events.emplace_back(s, m);
    }
    ASSERT_EQ(events.size(), 1u) << "seed " << seed << ": " << events.back().second;
    EXPECT_EQ(events[0].second.rfind("rank 2 is a straggler: median step", 0), 0u)
        << events[0].second;
    // Persistence delays the announcement by three windows, not more: the
    // first full window is at step 19, then 3 x 20 steps of slow judgements.
    EXPECT_GE(events[0].first, 79u);
    EXPECT_LE(events[0].first, 120u);
    ASSERT_EQ(summary.size(), 1u);
    EXPECT_NE(summary[0].find("rank 2 was a straggler"), std::string::npos) << summary[0];
    EXPECT_NE(summary[0].find("not recovered by the end"), std::string::npos) << summary[0];
  }
}

TEST(Straggler, PersistenceNeedsSlowJudgementsThroughWholeWindows) {
  // Window 4, persist 2 windows (8 steps). Rank 1 slow for steps 10-16 (a
  // burst of 7 steps): judged slow from step 11 (2 of 4 slow: median 20 ms,
  // 2x) to 18, not long enough. Slow from step 24 on: judged slow from step
  // 25, announced 8 steps later.
  const auto reports = run_given(2, 40, options(4, 1, 1.2, 0, 2), [](int rank, int step) {
    return rank == 1 && ((step >= 10 && step < 17) || step >= 24) ? 0.030 : 0.010;
  });
  std::vector<std::pair<size_t, std::string>> events;
  for (size_t s = 0; s < reports.size(); ++s) {
    for (const auto& m : reports[s].messages) events.emplace_back(s, m);
  }
  ASSERT_EQ(events.size(), 1u) << events[0].second;
  EXPECT_EQ(events[0].first, 33u);
  EXPECT_EQ(reports[33].new_stragglers, std::vector<int>{1});
  EXPECT_EQ(reports[18].stragglers, std::vector<int>{1}) << "slow now, but not persistent";
  EXPECT_TRUE(reports[18].new_stragglers.empty());
  EXPECT_TRUE(reports[19].stragglers.empty());
}

TEST(Straggler, RepeatedAnnouncementsAreRateLimited) {
  // Rank 1 alternates 10 slow and 10 normal steps; window 2, no persistence:
  // without a limit every flip is announced, with a 50-step gap at most one
  // message per 50 steps (at 1, 51, 101, 151), and the last announced state
  // is the true one.
  const auto flapping = [](int rank, int step) {
    return rank == 1 && (step / 10) % 2 == 0 ? 0.030 : 0.010;
  };
  const auto unlimited = all_messages(run_given(2, 200, options(2), flapping));
  EXPECT_EQ(unlimited.size(), 20u);
  const auto reports = run_given(2, 200, options(2, 1, 1.2, 0, 0, 50), flapping);
  std::vector<size_t> at;
  for (size_t s = 0; s < reports.size(); ++s) {
    if (!reports[s].messages.empty()) at.push_back(s);
  }
  ASSERT_GE(at.size(), 2u);
  for (size_t i = 1; i < at.size(); ++i) EXPECT_GE(at[i] - at[i - 1], 50u) << i;
  EXPECT_LE(at.size(), 4u);
  EXPECT_EQ(reports[at.back()].messages[0].rfind("rank 1 recovered", 0), 0u)
      << reports[at.back()].messages[0];
}

TEST(Straggler, BadInputIsNamed) {
  LocalWorld::run(world(1), [&](Communicator& comm) {
    EXPECT_THROW(StragglerDetector(comm, options(20, 0)), ConfigError);
    EXPECT_THROW(StragglerDetector(comm, options(0)), ConfigError);
    EXPECT_THROW(StragglerDetector(comm, options(20, 1, 1.0)), ConfigError);
    EXPECT_THROW(StragglerDetector(comm, options(20, 1, 1.5, 1.6)), ConfigError);
    EXPECT_THROW(StragglerDetector(comm, options(20, 1, 1.5, 0, -1)), ConfigError);
    EXPECT_THROW(StragglerDetector(comm, options(20, 1, 1.5, 0, 0, -2)), ConfigError);
    StragglerDetector det(comm, options(1));
    EXPECT_THROW(det.report(0, -0.5), ConfigError);
    EXPECT_THROW(det.report(0, std::nan("")), ConfigError);
    // A single rank has nobody to be slower than.
    const StragglerReport r = det.report(1, 0.5);
    EXPECT_EQ(r.window_median, std::vector<double>{0.5});
    EXPECT_TRUE(r.stragglers.empty());
  });
}

TEST(Straggler, RanksAtDifferentStepsFailEverywhere) {
  const auto errors = LocalWorld::run_collect(world(3), [&](Communicator& comm) {
    StragglerDetector det(comm);
    det.report(comm.rank() == 1 ? 6 : 5, 0.01);
  });
  for (size_t r = 0; r < errors.size(); ++r) {
    ASSERT_TRUE(errors[r]) << "rank " << r;
    EXPECT_THROW(std::rethrow_exception(errors[r]), MismatchError) << "rank " << r;
  }
}

}  // namespace
}  // namespace mt
