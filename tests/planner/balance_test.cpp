// The balance LP (planner/balance.h) against hand solutions: the optimum
// equalises finish times where no bound binds, respects memory bounds, and
// says which bound fails when none fits; the whole-unit rounding keeps the
// total and stays within one unit of the LP per device.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <numeric>

#include "meshtrain/base/error.h"
#include "meshtrain/planner/balance.h"

namespace mt::planner {
namespace {

using ::testing::HasSubstr;

BalanceProblem problem(std::vector<double> time_per_unit, double total) {
  BalanceProblem p;
  p.time_per_unit = std::move(time_per_unit);
  p.total = total;
  return p;
}

TEST(Balance, EqualisesFinishTimesOnUnequalDevices) {
  // Speeds 1 : 1 : 1/2 (time per unit 1, 1, 2): T = 10 / (1 + 1 + 0.5) = 4.
  BalanceProblem p = problem({1, 1, 2}, 10);
  const Balance b = balance_lp(p);
  ASSERT_EQ(b.units.size(), 3u);
  EXPECT_NEAR(b.units[0], 4, 1e-9);
  EXPECT_NEAR(b.units[1], 4, 1e-9);
  EXPECT_NEAR(b.units[2], 2, 1e-9);
  EXPECT_NEAR(b.time, 4, 1e-9);
  for (size_t i = 0; i < 3; ++i) EXPECT_NEAR(p.time_per_unit[i] * b.units[i], b.time, 1e-9);
  EXPECT_EQ(round_shares(p, b), (std::vector<int64_t>{4, 4, 2}));
}

TEST(Balance, FixedTimesShiftTheSplit) {
  // x0 + 1 = x1, x0 + x1 = 3: x = (1, 2), T = 2.
  BalanceProblem p = problem({1, 1}, 3);
  p.fixed_time = {1, 0};
  const Balance b = balance_lp(p);
  EXPECT_NEAR(b.units[0], 1, 1e-9);
  EXPECT_NEAR(b.units[1], 2, 1e-9);
  EXPECT_NEAR(b.time, 2, 1e-9);
}

TEST(Balance, MemoryBoundsBind) {
  // The fast device would take 2 of 3 but holds only 1: x = (1, 2), T = 4.
  BalanceProblem p = problem({1, 2}, 3);
  p.max_units = {1, 10};
  const Balance b = balance_lp(p);
  EXPECT_NEAR(b.units[0], 1, 1e-9);
  EXPECT_NEAR(b.units[1], 2, 1e-9);
  EXPECT_NEAR(b.time, 4, 1e-9);
  // Lower bounds (a stage needs a layer) bind too.
  BalanceProblem q = problem({1, 100}, 5);
  q.min_units = {0, 1};
  const Balance c = balance_lp(q);
  EXPECT_NEAR(c.units[1], 1, 1e-9);
  EXPECT_NEAR(c.time, 100, 1e-9);
}

TEST(Balance, RoundingKeepsTheTotalAndIsNearTheLp) {
  // Speeds 3 : 2 : 2 over 16 units: LP 6.857, 4.571, 4.571.
  BalanceProblem p = problem({1.0 / 3, 0.5, 0.5}, 16);
  const Balance b = balance_lp(p);
  const std::vector<int64_t> x = round_shares(p, b);
  EXPECT_EQ(std::accumulate(x.begin(), x.end(), int64_t{0}), 16);
  for (size_t i = 0; i < 3; ++i) EXPECT_LE(std::abs(static_cast<double>(x[i]) - b.units[i]), 1.0);
  // From the floors (6, 4, 4) each remaining unit goes where it finishes
  // first: device 0 (7/3 < 2.5), then device 1 (2.5, tied with 2: lower index).
  EXPECT_EQ(x, (std::vector<int64_t>{7, 5, 4}));
  EXPECT_NEAR(finish_time(p, x), 2.5, 1e-12);
  // No whole split does better: every split of 16 has some device at >= 2.5.
  double best = 1e9;
  for (int64_t a = 0; a <= 16; ++a) {
    for (int64_t c = 0; a + c <= 16; ++c) {
      best = std::min(best, finish_time(p, {a, c, 16 - a - c}));
    }
  }
  EXPECT_NEAR(finish_time(p, x), best, 1e-12);
}

TEST(Balance, InfeasibleSaysWhichBoundAndByHowMuch) {
  BalanceProblem p = problem({1, 1}, 16);
  p.max_units = {4, 8};
  p.what = "examples";
  EXPECT_THAT([&] { balance_lp(p); },
              ::testing::ThrowsMessage<ConfigError>(
                  HasSubstr("memory allows at most 12 examples in all, 4 short of the 16")));
  BalanceProblem q = problem({1, 1}, 4);
  q.max_units = {0.5, 8};
  q.min_units = {1, 0};
  q.what = "layers";
  EXPECT_THAT([&] { balance_lp(q); },
              ::testing::ThrowsMessage<ConfigError>(HasSubstr(
                  "device 0 needs at least 1 layers but memory allows at most 0.5 (0.5 short)")));
  BalanceProblem r = problem({1, 0}, 4);
  EXPECT_THROW(balance_lp(r), ConfigError);
}

}  // namespace
}  // namespace mt::planner
