// The plan search (planner/search.h) on small models and clusters: it never
// returns a plan over memory; when nothing fits it names the closest plan and
// by how much it is over; on unequal devices the LP's shares equalise the
// predicted compute time and beat the even split; the result is the same on
// every run.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>

#include "meshtrain/base/error.h"
#include "meshtrain/planner/balance.h"
#include "meshtrain/planner/search.h"
#include "meshtrain/train/training_plan.h"

namespace mt::planner {
namespace {

using ::testing::HasSubstr;

DeviceKind kind(std::string name, double flops, double memory) {
  DeviceKind k;
  k.name = std::move(name);
  k.peak_flops_f32 = flops;
  k.memory_bytes = memory;
  k.memory_bandwidth = 1e11;
  k.default_efficiency = 0.5;
  return k;
}

// n ranks, node_size per node, links 10 us / 10 GB/s.
ClusterModel cluster(int n, double memory, int node_size = 2) {
  ClusterModel c;
  c.source = "test";
  c.kinds = {kind("dev", 1e11, memory)};
  c.kind_of.assign(static_cast<size_t>(n), 0);
  c.layout = ClusterLayout::by_node_size(n, node_size);
  c.layout.intra_node = {1e-5, 1e10};
  c.layout.inter_node = {1e-5, 1e10};
  return c;
}

ModelSpec mlp() {
  ModelSpec s;
  s.kind = "mlp";
  s.hidden = {256, 256};
  return s;
}

TrainerOptions options(int64_t batch) {
  TrainerOptions o;
  o.batch_size = batch;
  o.eval = false;
  o.optimizer = "adamw";
  return o;
}

// The search settings of the LP tests: every plan listed, no
// recomputation, ZeRO-0 only.
SearchOptions lp_search() {
  SearchOptions o;
  o.top = 1000;
  o.recompute = false;
  o.zero_stages = {0};
  return o;
}

// A search's even and uneven twins of the shape `pick` selects (the last
// of each listed).
struct Twins {
  SearchResult r;
  const PlanCandidate* even = nullptr;
  const PlanCandidate* uneven = nullptr;
};
Twins twins(SearchResult r, const std::function<bool(const PlanCandidate&)>& pick) {
  Twins t{std::move(r)};
  for (const PlanCandidate& p : t.r.best) {
    if (pick(p)) (p.uneven ? t.uneven : t.even) = &p;
  }
  return t;
}
Twins dp_twins(SearchResult r, int dp) {
  return twins(std::move(r), [dp](const PlanCandidate& p) { return p.shape.dp == dp; });
}

// A rank's predicted forward + backward: its compute before the update.
double before_update(const RankEstimate& e) {
  return e.compute_s - e.optimizer_s;
}

TEST(PlanSearch, NeverReturnsAPlanOverMemory) {
  // Find the memory range the plans span, then give the devices memory in
  // the middle of it: some plans fit, some do not.
  const ModelSpec spec = mlp();
  const SearchResult all = search_plans(spec, options(32), cluster(4, 1e12));
  ASSERT_FALSE(all.best.empty());
  EXPECT_EQ(all.over_memory, 0);
  EXPECT_EQ(all.unpriced, 0) << all.unpriced_reasons.front();
  SearchOptions every;
  every.top = 1000;
  // Under pipelines recomputation and ZeRO 1-2 are priced only where their
  // twin without them is over memory, so the roomy run would not hold the
  // plans the tight one prices: off here (PipelinesRecomputeOnlyWhereTheyWouldNotFit).
  every.recompute = false;
  every.zero_pipelines = false;
  const SearchResult wide = search_plans(spec, options(32), cluster(4, 1e12), every);
  int64_t lo = INT64_MAX, hi = 0;
  for (const PlanCandidate& p : wide.best) {
    lo = std::min(lo, p.estimate.max_peak_memory_bytes());
    hi = std::max(hi, p.estimate.max_peak_memory_bytes());
  }
  ASSERT_LT(lo, hi) << "the plans should differ in memory (ZeRO stages, tensor parallelism)";
  const double middle = 0.5 * static_cast<double>(lo + hi);
  const SearchResult r = search_plans(spec, options(32), cluster(4, middle), every);
  EXPECT_GT(r.over_memory, 0);
  ASSERT_FALSE(r.best.empty());
  for (const PlanCandidate& p : r.best) {
    for (const RankEstimate& e : p.estimate.ranks) {
      EXPECT_LE(static_cast<double>(e.peak_memory_bytes), middle) << p.describe();
    }
  }
  EXPECT_EQ(r.fitting + r.over_memory + r.refused + r.unpriced + r.dominated, r.candidates);
  // Over-memory plans are not simulated, only their memory taken: the
  // closest miss needs what the least-over plan needs when fully priced.
  int64_t least_over = INT64_MAX;
  for (const PlanCandidate& p : wide.best) {
    const int64_t need = p.estimate.max_peak_memory_bytes();
    if (static_cast<double>(need) > middle) least_over = std::min(least_over, need);
  }
  ASSERT_TRUE(r.closest.has_value());
  EXPECT_FALSE(r.closest->lower_bound);
  EXPECT_EQ(r.closest->need_bytes, least_over) << r.closest->plan;
}

TEST(PlanSearch, NothingFitsSaysWhichConstraintAndByHowMuch) {
  // 100 kB per device: the parameters and gradients alone (the bound) rule
  // out every shape before pricing.
  const ClusterModel tiny = cluster(2, 1e5);
  const SearchResult r = search_plans(mlp(), options(32), tiny);
  EXPECT_TRUE(r.best.empty());
  EXPECT_EQ(r.pruned, r.candidates);
  ASSERT_TRUE(r.closest.has_value());
  EXPECT_TRUE(r.closest->lower_bound);
  EXPECT_GT(r.closest->need_bytes, r.closest->have_bytes);
  const std::string m = nothing_fits_message(r, tiny);
  EXPECT_THAT(m, HasSubstr("no plan fits"));
  EXPECT_THAT(m, HasSubstr("exceed device memory"));
  EXPECT_THAT(m, HasSubstr("the closest (" + r.closest->plan + ") needs at least"));
  EXPECT_THAT(m, HasSubstr(format_bytes(r.closest->need_bytes - r.closest->have_bytes) + " over"));
  // 2.3 MB: above the bound of the sharded shapes (the mlp's 269k
  // parameters, AdamW: (4 + 4 + 8) / 2 x 269k = 2.15 MB at ZeRO-3 on 2
  // ranks), below what they need with buffers and activations: priced, and
  // the message names the rank and its device.
  const ClusterModel small = cluster(2, 2.3e6);
  const SearchResult q = search_plans(mlp(), options(32), small);
  EXPECT_TRUE(q.best.empty());
  EXPECT_LT(q.pruned, q.over_memory);
  ASSERT_TRUE(q.closest.has_value());
  EXPECT_FALSE(q.closest->lower_bound);
  EXPECT_THAT(nothing_fits_message(q, small),
              HasSubstr(fmt::format("on rank {} (dev, {} of memory): {} over", q.closest->rank,
                                    format_bytes(q.closest->have_bytes),
                                    format_bytes(q.closest->need_bytes - q.closest->have_bytes))));
}

TEST(PlanSearch, LpSharesEqualiseComputeOnUnequalDevices) {
  // Two ranks, the second twice as slow (slowdown 2): the LP gives it a
  // third of the batch, and the predicted compute times agree within 10%.
  ClusterModel c = cluster(2, 1e12);
  c.slowdown = {1, 2};
  SearchOptions o = lp_search();
  const Twins tw = dp_twins(search_plans(mlp(), options(48), c, o), 2);
  const PlanCandidate* even = tw.even;
  const PlanCandidate* uneven = tw.uneven;
  ASSERT_NE(even, nullptr);
  ASSERT_NE(uneven, nullptr);
  EXPECT_EQ(uneven->shape.batch_shares, (std::vector<int64_t>{32, 16}));
  const double c0 = uneven->estimate.ranks[0].compute_s;
  const double c1 = uneven->estimate.ranks[1].compute_s;
  EXPECT_NEAR(c0 / c1, 1.0, 0.1) << c0 << " vs " << c1;
  // The even split leaves the fast rank waiting.
  EXPECT_GT(even->estimate.ranks[1].compute_s / even->estimate.ranks[0].compute_s, 1.5);
  EXPECT_LT(uneven->estimate.step_s, even->estimate.step_s);
  // The uneven plan carries its shares: the settings and the plan's batch split.
  const std::vector<std::string> s = uneven->settings(2);
  EXPECT_NE(std::find(s.begin(), s.end(), "dist.batch_shares=[32,16]"), s.end());
  EXPECT_THAT(plan_to_json(uneven->plan), HasSubstr("[32,16]"));
}

// The LP's constant term (i12-model): what a replica computes before the
// gradient sync is a_i x_i per example plus the runtime's per-kernel time,
// which no share moves (b_i); the optimizer's update follows the sync and
// is left out. Hand-computed: the shares are the LP's optimum of
// a_i x_i + b_i = T, x_0 + x_1 = batch, with a_i, b_i from the even
// plan's predicted forward + backward; the uneven plan's predicted forward
// + backward are equal within 10%; and its step is shorter than both the
// split that counts the per-kernel time per example (as before i12-model)
// and the split that also balances the update (which gives the slow rank,
// whose update is stretched 3x, fewer examples: the others' backward, and
// so the sync, end later, and the slow update still follows it).
TEST(PlanSearch, LpSharesCountTheFixedCostsAsAConstant) {
  ClusterModel c = cluster(2, 1e12);
  c.kinds[0].memory_bandwidth = 1e10;  // an update of over 20% of the compute
  c.kinds[0].op_overhead_s = 1e-4;     // a large per-kernel time
  c.slowdown = {1, 3};
  SearchOptions o = lp_search();
  const int64_t batch = 96;
  const Twins tw = dp_twins(search_plans(mlp(), options(batch), c, o), 2);
  const PlanCandidate* even = tw.even;
  const PlanCandidate* uneven = tw.uneven;
  ASSERT_NE(even, nullptr);
  ASSERT_NE(uneven, nullptr);
  double a[2], b[2], whole[2];
  for (int i = 0; i < 2; ++i) {
    const RankEstimate& e = even->estimate.ranks[static_cast<size_t>(i)];
    b[i] = e.overhead_s;
    a[i] = (before_update(e) - b[i]) / (static_cast<double>(batch) / 2);
    whole[i] = e.compute_s;
    EXPECT_GT(e.overhead_s, 0.2 * before_update(e)) << i;
    EXPECT_GT(e.optimizer_s, 0.2 * e.compute_s) << i;
  }
  EXPECT_DOUBLE_EQ(b[0], b[1]);  // not slowed: the emulation stretches kernels only
  // By hand: a0 x0 + b0 = a1 x1 + b1 = T, x0 + x1 = batch.
  const double t = (static_cast<double>(batch) + b[0] / a[0] + b[1] / a[1]) / (1 / a[0] + 1 / a[1]);
  const double x1 = (t - b[1]) / a[1];
  ASSERT_EQ(uneven->shape.batch_shares.size(), 2u);
  EXPECT_NEAR(static_cast<double>(uneven->shape.batch_shares[1]), x1, 1.0);
  const double u0 = before_update(uneven->estimate.ranks[0]);
  const double u1 = before_update(uneven->estimate.ranks[1]);
  EXPECT_LT(std::max(u0, u1) / std::min(u0, u1), 1.10) << u0 << " vs " << u1;
  // The two other splits, priced the same way.
  auto price = [&](double slow_share) {
    TrainerOptions po = options(batch);
    const auto s1 = static_cast<int64_t>(std::llround(slow_share));
    po.dist.batch_shares = {batch - s1, s1};
    return estimate_step(mlp(), po, c).step_s;
  };
  // Counting the per-kernel time per example gives the slow rank more; the
  // LP that also balances the update (b_i + the rank's update) fewer.
  const double per_example = static_cast<double>(batch) * (1 / (a[1] + b[1] / 48)) /
                             (1 / (a[0] + b[0] / 48) + 1 / (a[1] + b[1] / 48));
  const double f0 = b[0] + even->estimate.ranks[0].optimizer_s;
  const double f1 = b[1] + even->estimate.ranks[1].optimizer_s;
  const double tu = (static_cast<double>(batch) + f0 / a[0] + f1 / a[1]) / (1 / a[0] + 1 / a[1]);
  const double with_update = (tu - f1) / a[1];
  EXPECT_GT(per_example, x1 + 1.5);
  EXPECT_LT(with_update, x1 - 1.5);
  // Before i12-model: the whole compute, update included, per example.
  const double whole_per_example =
      static_cast<double>(batch) * (1 / whole[1]) / (1 / whole[0] + 1 / whole[1]);
  EXPECT_LT(uneven->estimate.step_s, price(whole_per_example));
  EXPECT_LT(uneven->estimate.step_s, price(per_example));
  EXPECT_LT(uneven->estimate.step_s, price(with_update));
}

// DeviceKind::weight_bandwidth: every replica reads all the weights and
// writes all their gradients whatever its share of the batch, so that time
// joins the per-kernel time in the LP's constant term b_i. By hand: the
// shares from a_i x_i + b_i = T with b_i = overhead + traffic (the traffic
// slowed with the rank), and they equalise the predicted compute better
// than the LP that counts the traffic per example (i12-traffic: the 4-rank
// MLP's measured spread 1.18-1.40 with the traffic per example).
TEST(PlanSearch, LpConstantTermHoldsTheWeightTraffic) {
  ClusterModel c = cluster(2, 1e12);
  c.kinds[0].weight_bandwidth = 4e9;  // 0.6 ms of weights per step, the FLOPs 1.6 ms
  c.kinds[0].op_overhead_s = 1e-5;
  c.slowdown = {1, 2};
  SearchOptions o = lp_search();
  const int64_t batch = 96;
  const Twins tw = dp_twins(search_plans(mlp(), options(batch), c, o), 2);
  const PlanCandidate* even = tw.even;
  const PlanCandidate* uneven = tw.uneven;
  ASSERT_NE(even, nullptr);
  ASSERT_NE(uneven, nullptr);
  double a[2], b[2], a_old[2], b_old[2];
  // MLP 784-256-256-10: each weight read once forward, once by the input
  // gradient (not the first layer's: its input needs none), its gradient
  // written once.
  const double w_elems = 784.0 * 256 + 256.0 * 256 + 256.0 * 10;
  const double first = 784.0 * 256;
  const double traffic = (3 * w_elems - first) * 4 / 4e9;
  for (int i = 0; i < 2; ++i) {
    const RankEstimate& e = even->estimate.ranks[static_cast<size_t>(i)];
    EXPECT_NEAR(e.traffic_s, traffic * c.slowdown[static_cast<size_t>(i)], 1e-9) << i;
    EXPECT_GT(e.traffic_s, 0.2 * before_update(e)) << i;
    b[i] = e.overhead_s + e.traffic_s;
    a[i] = (before_update(e) - b[i]) / (static_cast<double>(batch) / 2);
    b_old[i] = e.overhead_s;
    a_old[i] = (before_update(e) - b_old[i]) / (static_cast<double>(batch) / 2);
  }
  auto lp_slow_share = [&](const double* ai, const double* bi) {
    const double t =
        (static_cast<double>(batch) + bi[0] / ai[0] + bi[1] / ai[1]) / (1 / ai[0] + 1 / ai[1]);
    return (t - bi[1]) / ai[1];
  };
  const double x1 = lp_slow_share(a, b);
  // Counted per example (the constant the per-kernel time alone), the
  // traffic hands the slow rank more.
  EXPECT_GT(lp_slow_share(a_old, b_old), x1 + 1.5);
  ASSERT_EQ(uneven->shape.batch_shares.size(), 2u);
  EXPECT_NEAR(static_cast<double>(uneven->shape.batch_shares[1]), x1, 1.0);
  const double u0 = before_update(uneven->estimate.ranks[0]);
  const double u1 = before_update(uneven->estimate.ranks[1]);
  EXPECT_LT(std::max(u0, u1) / std::min(u0, u1), 1.05) << u0 << " vs " << u1;
  // The search on the model before (the traffic hidden under the FLOPs)
  // hands the slow rank more, which priced with the traffic is unbalanced.
  ClusterModel hidden = c;
  hidden.kinds[0].weight_bandwidth = 0;
  const SearchResult rh = search_plans(mlp(), options(batch), hidden, o);
  const PlanCandidate* before = nullptr;
  for (const PlanCandidate& p : rh.best) {
    if (p.shape.dp == 2 && p.uneven) before = &p;
  }
  ASSERT_NE(before, nullptr);
  EXPECT_GT(static_cast<double>(before->shape.batch_shares[1]), x1 + 1.5);
  TrainerOptions po = options(batch);
  po.dist.batch_shares = before->shape.batch_shares;
  const StepEstimate old = estimate_step(mlp(), po, c);
  const double o0 = before_update(old.ranks[0]), o1 = before_update(old.ranks[1]);
  EXPECT_GT(std::max(o0, o1) / std::min(o0, o1), 1.05) << o0 << " vs " << o1;
  EXPECT_LT(uneven->estimate.step_s, old.step_s);
}

// The model's compute is not linear in a replica's examples (a matmul's
// weight bytes do not shrink with the batch: max(FLOPs, bytes) turns
// bytes-bound on a small share), so the shares from the even plan's slope
// leave the slowest rank's predicted compute long. The search prices the
// LP's shares, takes each replica's secant through the two priced points
// (a_i, b_i) and solves again, keeping the new shares when they price a
// step at least 1% shorter: by hand here, the refined shares are that
// LP's, and they balance the predicted compute better than the first ones.
TEST(PlanSearch, LpSharesRefinedFromTwoPricedPoints) {
  ClusterModel c = cluster(4, 1e12, 4);
  c.kinds[0].memory_bandwidth = 4e9;  // dW of 1024 x 1024 bytes-bound below ~25 examples
  c.slowdown = {1, 1, 2, 6};
  SearchOptions o = lp_search();
  ModelSpec m = mlp();
  m.hidden = {1024, 1024};
  const int64_t batch = 256;
  const Twins tw = dp_twins(search_plans(m, options(batch), c, o), 4);
  const PlanCandidate* even = tw.even;
  const PlanCandidate* uneven = tw.uneven;
  ASSERT_NE(even, nullptr);
  ASSERT_NE(uneven, nullptr);
  // The first LP, by hand from the even plan (per-kernel time constant).
  BalanceProblem first;
  first.total = static_cast<double>(batch);
  first.min_units.assign(4, 1);
  for (int i = 0; i < 4; ++i) {
    const RankEstimate& e = even->estimate.ranks[static_cast<size_t>(i)];
    first.time_per_unit.push_back((before_update(e) - e.overhead_s) /
                                  (static_cast<double>(batch) / 4));
    first.fixed_time.push_back(e.overhead_s);
  }
  const std::vector<int64_t> x1 = round_shares(first, balance_lp(first));
  TrainerOptions o1 = options(batch);
  o1.dist.batch_shares = x1;
  const StepEstimate e1 = estimate_step(m, o1, c);
  auto spread = [&](const StepEstimate& e) {
    double lo = 1e300, hi = 0;
    for (const RankEstimate& x : e.ranks)
      lo = std::min(lo, before_update(x)), hi = std::max(hi, before_update(x));
    return hi / lo;
  };
  // The secant LP, by hand.
  BalanceProblem second = first;
  for (size_t i = 0; i < 4; ++i) {
    const double x = static_cast<double>(x1[i]), per = static_cast<double>(batch) / 4;
    if (std::abs(x - per) < 0.5) continue;
    const double a =
        (before_update(e1.ranks[i]) - before_update(even->estimate.ranks[i])) / (x - per);
    second.time_per_unit[i] = a;
    second.fixed_time[i] = std::max(0.0, before_update(even->estimate.ranks[i]) - a * per);
  }
  const std::vector<int64_t> x2 = round_shares(second, balance_lp(second));
  EXPECT_NE(x2, x1) << "the first shares are already the secant's";
  EXPECT_EQ(uneven->shape.batch_shares, x2);
  EXPECT_LT(spread(uneven->estimate), spread(e1));
  EXPECT_LT(uneven->estimate.step_s, 0.99 * e1.step_s);
}

TEST(PlanSearch, LpLayersBalanceUnequalPipelineStages) {
  // A 4-block GPT on two ranks, the second 3x slower: the pipeline's uneven
  // twin gives the fast stage 3 blocks and the slow one 1, and is faster
  // than the even 2 + 2 cut.
  ModelSpec gpt;
  gpt.kind = "gpt";
  gpt.layers = 4, gpt.d_model = 64, gpt.heads = 4, gpt.seq_len = 32;
  ClusterModel c = cluster(2, 1e12);
  c.slowdown = {1, 3};
  SearchOptions o = lp_search();
  o.schedules = {ScheduleKind::one_f_one_b};
  o.microbatch_factors = {2};
  // The cluster's device order: the fast stage first.
  const Twins tw = twins(search_plans(gpt, options(16), c, o), [](const PlanCandidate& p) {
    return p.shape.pp == 2 && p.devices.empty();
  });
  const SearchResult& r = tw.r;
  const PlanCandidate* even = tw.even;
  const PlanCandidate* uneven = tw.uneven;
  ASSERT_NE(even, nullptr) << (r.refusals.empty() ? "" : r.refusals.front());
  ASSERT_NE(uneven, nullptr);
  EXPECT_EQ(uneven->shape.stage_layers, (std::vector<int64_t>{3, 1}));
  EXPECT_LT(uneven->estimate.step_s, even->estimate.step_s);
}

// Under pipelines the search adds recomputation (every stage) and ZeRO 1-2
// only where the plan without them is over memory: with
// memory between a 2-stage GPT pipeline's peak with and without
// recomputation, the pipeline is proposed recomputing, its plan file says
// so (not exec.recompute), and where everything fits neither is priced.
TEST(PlanSearch, PipelinesRecomputeOnlyWhereTheyWouldNotFit) {
  ModelSpec gpt;
  gpt.kind = "gpt";
  gpt.layers = 4, gpt.d_model = 64, gpt.heads = 4, gpt.seq_len = 32;
  SearchOptions o;
  o.top = 1000;
  o.schedules = {ScheduleKind::one_f_one_b};
  o.microbatch_factors = {2};
  o.tp_within_node = true;
  auto pipelines = [](const SearchResult& r) {
    std::vector<const PlanCandidate*> v;
    for (const PlanCandidate& p : r.best) {
      if (p.shape.pp == 2 && p.shape.tp == 1) v.push_back(&p);
    }
    return v;
  };
  const SearchResult roomy = search_plans(gpt, options(16), cluster(2, 1e12, 1), o);
  ASSERT_EQ(pipelines(roomy).size(), 1u);
  const PlanCandidate plain = *pipelines(roomy).front();
  EXPECT_FALSE(plain.recompute);
  EXPECT_GT(roomy.dominated, 0);  // its recomputing twin was not priced

  // The same plan recomputing, priced directly: less memory.
  TrainerOptions ro = options(16);
  Plan rp = plain.plan;
  for (StagePlan& st : rp.stages) st.recompute = true;
  ro.dist.plan = std::make_shared<const Plan>(rp);
  const ClusterModel big = cluster(2, 1e12, 1);
  const int64_t with = estimate_step(gpt, ro, big).max_peak_memory_bytes();
  const int64_t without = plain.estimate.max_peak_memory_bytes();
  ASSERT_LT(with, without);
  const double middle = 0.5 * static_cast<double>(with + without);
  const SearchResult tight = search_plans(gpt, options(16), cluster(2, middle, 1), o);
  const std::vector<const PlanCandidate*> found = pipelines(tight);
  ASSERT_EQ(found.size(), 1u) << nothing_fits_message(tight, cluster(2, middle, 1));
  const PlanCandidate& p = *found.front();
  EXPECT_TRUE(p.recompute);
  EXPECT_LE(static_cast<double>(p.estimate.max_peak_memory_bytes()), middle);
  for (const StagePlan& st : p.plan.stages) EXPECT_TRUE(st.recompute);
  for (const std::string& set : p.settings(2))
    EXPECT_THAT(set, ::testing::Not(HasSubstr("exec.recompute")));
  EXPECT_GT(p.estimate.step_s, plain.estimate.step_s);  // the extra forwards
}

TEST(PlanSearch, LpHeadsBalanceUnequalTensorRanks) {
  // The same GPT over tp = 2 with the second rank 3x slower: 3 heads and 1.
  ModelSpec gpt;
  gpt.kind = "gpt";
  gpt.layers = 2, gpt.d_model = 64, gpt.heads = 4, gpt.seq_len = 32;
  ClusterModel c = cluster(2, 1e12);
  c.slowdown = {1, 3};
  SearchOptions o = lp_search();
  const Twins tw = twins(search_plans(gpt, options(8), c, o),
                         [](const PlanCandidate& p) { return p.shape.tp == 2; });
  const PlanCandidate* even = tw.even;
  const PlanCandidate* uneven = tw.uneven;
  ASSERT_NE(even, nullptr);
  ASSERT_NE(uneven, nullptr);
  EXPECT_EQ(uneven->shape.tp_ratios, (std::vector<int64_t>{3, 1}));
  EXPECT_LT(uneven->estimate.step_s, even->estimate.step_s);
}

// Pipelines whose step is above the `top` runnable plans already priced by
// a lower bound (each rank's compute tasks in a row) are not simulated:
// the best plans are those of a search that simulates everything, on any
// number of threads, and the cut does take effect.
TEST(PlanSearch, PipelineBoundCutKeepsTheBest) {
  ModelSpec gpt;
  gpt.kind = "gpt";
  gpt.layers = 4, gpt.d_model = 64, gpt.heads = 4, gpt.seq_len = 32;
  const ClusterModel c = cluster(4, 1e12, 4);
  SearchOptions all;
  all.top = 1000;  // nothing is ever cut: 1000 plans are never priced here
  const SearchResult full = search_plans(gpt, options(16), c, all);
  EXPECT_EQ(full.not_simulated, 0);
  for (int threads : {1, 4}) {
    SearchOptions o;
    o.top = 2;
    o.threads = threads;
    const SearchResult r = search_plans(gpt, options(16), c, o);
    EXPECT_EQ(r.fitting, full.fitting);
    EXPECT_EQ(r.candidates, full.candidates);
    ASSERT_EQ(r.best.size(), 2u);
    for (size_t i = 0; i < r.best.size(); ++i) {
      EXPECT_EQ(r.best[i].describe(), full.best[i].describe()) << threads << " threads";
      EXPECT_EQ(r.best[i].estimate.step_s, full.best[i].estimate.step_s);
    }
    if (threads == 1) {
      EXPECT_GT(r.not_simulated, 0);
    }
  }
}

TEST(PlanSearch, DeviceOrdersGroupLikeDevices) {
  // Four ranks on one node, fast and slow devices interleaved (ranks 0 and
  // 2 four times faster). In the cluster's order a dp=2 x tp=2 plan pairs a
  // fast and a slow device in each tensor group, so both groups run at the
  // slow one's pace; sorted fastest first, the fast devices form one tensor
  // group (mesh ranks 0, 1 = world ranks 0, 2) and the slow ones the other,
  // whose replica the LP then gives fewer examples: faster than any plan in
  // the cluster's order. A pipeline puts the fast pair on stage 0.
  ClusterModel c = cluster(4, 1e12, 4);
  c.kinds = {kind("fast", 4e11, 1e12), kind("slow", 1e11, 1e12)};
  c.kind_of = {0, 1, 0, 1};
  SearchOptions o = lp_search();
  o.schedules = {ScheduleKind::one_f_one_b};
  o.microbatch_factors = {2};
  const SearchResult r = search_plans(mlp(), options(48), c, o);
  const PlanCandidate* grouped = nullptr;  // dp=2 tp=2, fastest first, LP shares
  double in_order_best = 0;                // dp=2 tp=2 in the cluster's order
  const PlanCandidate* stages = nullptr;   // pp=2 dp=2, fastest first
  for (const PlanCandidate& p : r.best) {
    if (p.shape.dp == 2 && p.shape.tp == 2) {
      if (p.devices.empty()) {
        if (in_order_best == 0 || p.estimate.step_s < in_order_best)
          in_order_best = p.estimate.step_s;
      } else if (p.device_order == "fast-first" && p.uneven) {
        grouped = &p;
      }
    }
    if (p.shape.pp == 2 && p.shape.dp == 2 && p.device_order == "fast-first" && !p.uneven)
      stages = &p;
  }
  ASSERT_NE(grouped, nullptr);
  ASSERT_GT(in_order_best, 0);
  EXPECT_EQ(grouped->devices, (std::vector<int>{0, 2, 1, 3}));
  EXPECT_EQ(grouped->plan.devices, grouped->devices);  // in the plan file the runtime reads
  EXPECT_THAT(plan_to_json(grouped->plan), HasSubstr("\"devices\""));
  // Every tensor group holds one kind of device.
  for (const std::vector<int>& g : grouped->plan.mesh.groups("tp")) {
    for (int m : g) {
      EXPECT_EQ(c.kind_of[static_cast<size_t>(grouped->plan.device_of(m))],
                c.kind_of[static_cast<size_t>(grouped->plan.device_of(g[0]))])
          << "mesh rank " << m;
    }
  }
  // The fast replica (dp 0) gets more of the batch.
  ASSERT_EQ(grouped->shape.batch_shares.size(), 2u);
  EXPECT_GT(grouped->shape.batch_shares[0], grouped->shape.batch_shares[1]);
  EXPECT_LT(grouped->estimate.step_s, in_order_best);
  EXPECT_THAT(grouped->describe(), HasSubstr("devices=fast-first"));
  // The pipeline's first stage (mesh ranks 0, 1) on the fast devices.
  ASSERT_NE(stages, nullptr);
  for (int m : stages->plan.stages.front().ranks)
    EXPECT_EQ(c.kind_of[static_cast<size_t>(stages->plan.device_of(m))], 0) << "mesh rank " << m;
}

TEST(PlanSearch, DeterministicAndRankedByStepTime) {
  ClusterModel c = cluster(4, 1e12);
  c.slowdown = {1, 1, 1, 3};
  SearchOptions o;
  o.top = 8;
  o.threads = 1;
  const SearchResult a = search_plans(mlp(), options(32), c, o);
  o.threads = 4;  // the same on any number of threads
  const SearchResult b = search_plans(mlp(), options(32), c, o);
  EXPECT_EQ(a.candidates, b.candidates);
  EXPECT_EQ(a.fitting, b.fitting);
  EXPECT_EQ(a.refused, b.refused);
  EXPECT_EQ(a.unpriced, b.unpriced);
  EXPECT_EQ(a.refusals, b.refusals);
  ASSERT_EQ(a.best.size(), b.best.size());
  ASSERT_FALSE(a.best.empty());
  for (size_t i = 0; i < a.best.size(); ++i) {
    EXPECT_EQ(a.best[i].describe(), b.best[i].describe());
    EXPECT_EQ(a.best[i].estimate.step_s, b.best[i].estimate.step_s);
    EXPECT_EQ(plan_to_json(a.best[i].plan), plan_to_json(b.best[i].plan));
    if (i > 0) {
      EXPECT_LE(a.best[i - 1].estimate.step_s, a.best[i].estimate.step_s);
    }
  }
}

}  // namespace
}  // namespace mt::planner
