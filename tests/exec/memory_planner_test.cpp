// Arena offset assignment (plan_arena) and the executor's compiled plan
// (liveness, views, recomputation) checked for safety on real graphs.
#include <gtest/gtest.h>

#include <random>

#include "meshtrain/exec/exec_plan.h"
#include "meshtrain/exec/memory_planner.h"
#include "meshtrain/graph/autodiff.h"
#include "meshtrain/graph/builder.h"
#include "test_models.h"

namespace mt {
namespace {

bool overlap(int64_t a, int64_t asz, int64_t b, int64_t bsz) {
  return a < b + bsz && b < a + asz;
}

TEST(PlanArena, ReusesMemoryOfDeadBuffers) {
  // A [0,1], B [1,2], C [2,3]: C can take A's place, B cannot.
  ArenaLayout l = plan_arena({{100, 0, 1}, {100, 1, 2}, {100, 2, 3}});
  EXPECT_EQ(l.peak, 2 * 128);
  EXPECT_EQ(l.offset[0], l.offset[2]);
  EXPECT_NE(l.offset[0], l.offset[1]);
  for (int64_t off : l.offset) EXPECT_EQ(off % kArenaAlign, 0);
}

TEST(PlanArena, MergesNeighbouringHoles) {
  // A and B die at step 0; together they make room for the larger C while D
  // still holds the memory above them.
  ArenaLayout l = plan_arena({{64, 0, 0}, {64, 0, 0}, {64, 0, 1}, {128, 1, 1}});
  EXPECT_EQ(l.offset[3], 0);
  EXPECT_EQ(l.peak, 192);
  // A buffer that fits no hole starts at the top.
  l = plan_arena({{64, 0, 2}, {64, 0, 0}, {192, 1, 2}});
  EXPECT_EQ(l.offset[2], 64);
  EXPECT_EQ(l.peak, 256);
  EXPECT_EQ(plan_arena({}).peak, 0);
  EXPECT_EQ(plan_arena({{0, 0, 3}}).peak, 0);
}

TEST(PlanArena, LargestFirstAvoidsFragmentation) {
  // In schedule order, A's hole (64 B) is too small for C, which then goes on
  // top (256 B). Placing C first fits A below it and B above: 192 B, which
  // is what B and C alive together need.
  ArenaLayout l = plan_arena({{64, 0, 0}, {64, 0, 2}, {128, 1, 2}});
  EXPECT_EQ(l.peak, 192);
  EXPECT_FALSE(overlap(l.offset[1], 64, l.offset[2], 128));
}

TEST(PlanArena, RandomLifetimesNeverShareLiveMemory) {
  std::mt19937 rng(7);
  for (int round = 0; round < 50; ++round) {
    std::vector<BufferLife> b;
    const int n = 1 + static_cast<int>(rng() % 60);
    for (int i = 0; i < n; ++i) {
      int first = static_cast<int>(rng() % 40);
      b.push_back(
          {static_cast<int64_t>(rng() % 5000), first, first + static_cast<int>(rng() % 10)});
    }
    ArenaLayout l = plan_arena(b);
    int64_t max_live = 0;
    for (int step = 0; step < 50; ++step) {
      int64_t live = 0;
      for (const BufferLife& x : b)
        live += (x.first <= step && step <= x.last) ? align_up(x.bytes) : 0;
      max_live = std::max(max_live, live);
    }
    EXPECT_GE(l.peak, max_live);
    for (int i = 0; i < n; ++i) {
      EXPECT_LE(l.offset[i] + align_up(b[i].bytes), l.peak);
      for (int j = i + 1; j < n; ++j) {
        const bool alive_together = b[i].first <= b[j].last && b[j].first <= b[i].last;
        if (alive_together) {
          EXPECT_FALSE(
              overlap(l.offset[i], align_up(b[i].bytes), l.offset[j], align_up(b[j].bytes)))
              << "round " << round << ": buffers " << i << " and " << j;
        }
      }
    }
  }
}

// Every step reads slots that are alive, and no two arena slots alive at the
// same step share bytes: the plan is safe whatever the graph.
void expect_plan_is_safe(const Graph& g, const ExecPlan& p) {
  for (size_t pos = 0; pos < p.steps.size(); ++pos) {
    for (int s : p.steps[pos].in) {
      const PlanSlot& r = p.slots[static_cast<size_t>(p.root(s))];
      if (r.bound) continue;
      EXPECT_LE(r.first, static_cast<int>(pos)) << g.value(r.value).name;
      EXPECT_GE(r.last, static_cast<int>(pos)) << g.value(r.value).name;
    }
  }
  std::vector<size_t> arena;
  for (size_t s = 0; s < p.slots.size(); ++s) {
    if (!p.slots[s].bound && p.slots[s].view_of < 0 && p.slots[s].first >= 0) arena.push_back(s);
  }
  auto bytes = [&](size_t s) {
    const Value& v = g.value(p.slots[s].value);
    return static_cast<int64_t>(v.shape.numel() * static_cast<int64_t>(dtype_size(v.dtype)));
  };
  for (size_t i = 0; i < arena.size(); ++i) {
    const PlanSlot& a = p.slots[arena[i]];
    EXPECT_LE(a.offset + bytes(arena[i]), p.memory.arena_bytes);
    for (size_t j = i + 1; j < arena.size(); ++j) {
      const PlanSlot& b = p.slots[arena[j]];
      if (a.first <= b.last && b.first <= a.last) {
        EXPECT_FALSE(overlap(a.offset, bytes(arena[i]), b.offset, bytes(arena[j])))
            << g.value(a.value).name << " and " << g.value(b.value).name;
      }
    }
  }
}

PlanRequest request_for(const Graph& g, bool recompute) {
  PlanRequest r;
  r.recompute = recompute;
  r.bound.assign(static_cast<size_t>(g.num_values()), false);
  for (ValueId v : g.inputs()) r.bound[static_cast<size_t>(v)] = true;
  for (ValueId v : g.params()) r.bound[static_cast<size_t>(v)] = true;
  r.kept.push_back(g.loss());
  for (const auto& [p, gv] : g.grads()) r.kept.push_back(gv);
  return r;
}

TEST(ExecPlan, TransformerPlanIsSafeWithAndWithoutRecompute) {
  testing_models::Model m = testing_models::tiny_transformer(DType::f32);
  for (bool recompute : {false, true}) {
    ExecPlan p = make_exec_plan(m.g, request_for(m.g, recompute));
    expect_plan_is_safe(m.g, p);
    EXPECT_LT(p.memory.arena_bytes, p.memory.unplanned_bytes);
    EXPECT_EQ(p.memory.recompute_steps > 0, recompute);
  }
}

TEST(ExecPlan, ReshapeIsAViewThatKeepsItsRootAlive) {
  Graph g;
  Builder b(g);
  ValueId x = b.input("x", {4, 6});
  ValueId a = b.relu(x);
  ValueId r = b.reshape(a, {6, 4});
  ValueId big = b.tanh(b.input("y", {64, 64}));  // runs while only the view is pending
  ValueId out = b.sigmoid(r);
  (void)big;
  PlanRequest req;
  req.bound.assign(static_cast<size_t>(g.num_values()), false);
  req.bound[static_cast<size_t>(x)] = true;
  req.bound[static_cast<size_t>(*g.find("y"))] = true;
  req.kept = {out};
  ExecPlan p = make_exec_plan(g, req);
  EXPECT_EQ(p.memory.offset[static_cast<size_t>(r)], p.memory.offset[static_cast<size_t>(a)]);
  EXPECT_EQ(p.slots[static_cast<size_t>(r)].view_of, a);
  // a is read (through its view) by the last node.
  EXPECT_EQ(p.slots[static_cast<size_t>(a)].last, g.value(out).producer);
  expect_plan_is_safe(g, p);
}

}  // namespace
}  // namespace mt
