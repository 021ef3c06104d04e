// The executor's side of collectives (exec/collective_runner.h), with a
// runner that records what it is asked and acts as a group of one rank
// (all_reduce = copy): where start and wait fall in the schedule, that the
// memory plan keeps in-flight buffers alive between them, that a parameter
// gradient produced by a collective is announced at its wait, and the error
// without a runner.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/base/error.h"
#include "meshtrain/exec/exec_plan.h"
#include "meshtrain/exec/executor.h"
#include "meshtrain/graph/autodiff.h"
#include "meshtrain/graph/builder.h"

namespace mt {
namespace {

class RecordingRunner : public CollectiveRunner {
 public:
  std::vector<std::string> events;
  CollectiveHandle start(const CollectiveCall& call) override {
    events.push_back("start " + call.node);
    calls.push_back(call);
    return CollectiveHandle{calls.size()};
  }
  void wait(CollectiveHandle h) override {
    CollectiveCall& c = calls.at(h.id - 1);
    events.push_back("wait " + c.node);
    // A group of one rank: the sum over the group is the input itself.
    std::memcpy(c.out[0].raw(), c.in[0].raw(), c.in[0].nbytes());
  }
  std::vector<CollectiveCall> calls;
};

std::vector<std::string> step_names(const Executor& ex) {
  std::vector<std::string> names;
  for (const OpProfile& p : ex.profile()) names.push_back(p.name);
  return names;
}

TEST(CollectiveExec, StartsInPlaceAndWaitsBeforeTheFirstReader) {
  Graph g;
  Builder b(g);
  ValueId p = b.param("p", {4, 8}, ParamInit{ParamInit::Kind::ones, 0});
  ValueId q = b.param("q", {4, 8}, ParamInit{ParamInit::Kind::ones, 0});
  ValueId x = b.name(b.scale(p, 2.0), "x");
  ValueId y = b.name(b.all_reduce(x, 0), "y");
  ValueId z = b.name(b.relu(q), "z");  // independent of y: overlaps the collective
  ValueId out = b.name(b.add(y, z), "out");
  auto runner = std::make_shared<RecordingRunner>();
  ExecOptions o;
  o.backend = "reference";
  o.collectives = runner;
  Executor ex(g, o);
  EXPECT_EQ(step_names(ex), (std::vector<std::string>{"x", "y", "z", "y/wait", "out"}));
  // x is read by the in-flight call until its wait, so z may not take its bytes.
  const MemoryPlan& mp = ex.memory_plan();
  const int64_t bytes = 4 * 8 * 4;
  auto overlaps = [&](ValueId a, ValueId c) {
    const int64_t oa = mp.offset[static_cast<size_t>(a)], oc = mp.offset[static_cast<size_t>(c)];
    return oa < oc + bytes && oc < oa + bytes;
  };
  EXPECT_FALSE(overlaps(x, z));
  EXPECT_FALSE(overlaps(y, z));
  Tensor pt = Tensor::full({4, 8}, DType::f32, 1.5), qt = Tensor::full({4, 8}, DType::f32, -2);
  ex.bind(p, pt);
  ex.bind(q, qt);
  ex.run();
  EXPECT_EQ(runner->events, (std::vector<std::string>{"start y", "wait y"}));
  EXPECT_EQ(ex.get(out).item(5), 3.0);  // 2 * 1.5 + relu(-2)
  ASSERT_EQ(runner->calls.size(), 1u);
  EXPECT_EQ(runner->calls[0].attrs.group, 0);
  EXPECT_EQ(runner->calls[0].op, OpKind::all_reduce);
}

// Built after an independent node, the collective still starts right after
// its input, but never ahead of an earlier collective.
TEST(CollectiveExec, StartsAsSoonAsItsInputIsWrittenInGraphOrder) {
  Graph g;
  Builder b(g);
  ValueId p = b.param("p", {4}, ParamInit{});
  ValueId q = b.param("q", {4}, ParamInit{});
  ValueId x = b.name(b.scale(p, 2.0), "x");
  ValueId z = b.name(b.relu(q), "z");
  ValueId u = b.name(b.tanh(q), "u");
  ValueId y1 = b.name(b.all_reduce(z, 0), "y1");  // input written by z
  ValueId y2 = b.name(b.all_reduce(x, 0), "y2");  // input ready at once, but y1 comes first
  b.name(b.add(b.name(b.add(y1, y2), "s"), u), "out");
  ExecOptions o;
  o.backend = "reference";
  o.collectives = std::make_shared<RecordingRunner>();
  Executor ex(g, o);
  EXPECT_EQ(step_names(ex), (std::vector<std::string>{"x", "z", "y1", "y2", "u", "y1/wait",
                                                      "y2/wait", "s", "out"}));
}

TEST(CollectiveExec, WithoutReadersTheWaitComesAtTheEnd) {
  Graph g;
  Builder b(g);
  ValueId p = b.param("p", {3}, ParamInit{});
  ValueId y = b.name(b.all_gather(p, 1, 0, {3, 2}, 0), "y");
  b.name(b.relu(p), "r");
  auto runner = std::make_shared<RecordingRunner>();
  ExecOptions o;
  o.backend = "reference";
  o.collectives = runner;
  o.outputs = {y};
  Executor ex(g, o);
  EXPECT_EQ(step_names(ex), (std::vector<std::string>{"y", "r", "y/wait"}));
}

// Backward of f (copy_to_group) is g: the gradient of a parameter read through
// f comes out of a collective, and on_grad_ready fires at its wait.
TEST(CollectiveExec, GradientFromACollectiveIsAnnouncedAtItsWait) {
  Graph g;
  Builder b(g);
  ValueId w = b.param("w", {2, 3}, ParamInit{});
  ValueId a = b.copy_to_group(w, 0);
  ValueId loss = b.sum_to(b.mul(a, a), {});
  build_backward(g, loss);
  auto runner = std::make_shared<RecordingRunner>();
  ExecOptions o;
  o.backend = "reference";
  o.collectives = runner;
  Executor ex(g, o);
  Tensor wt = Tensor::full({2, 3}, DType::f32, 0.5);
  ex.bind(w, wt);
  std::vector<std::string> seen;
  ex.on_grad_ready([&](ValueId param) {
    seen.push_back(runner->events.empty() ? "none" : runner->events.back());
    EXPECT_EQ(ex.get(g.grad_of(param)).item(0), 1.0);  // d(w^2)/dw, through g
  });
  ex.run();
  ASSERT_EQ(runner->calls.size(), 1u);
  EXPECT_EQ(runner->calls[0].op, OpKind::reduce_from_group);
  EXPECT_EQ(seen, (std::vector<std::string>{"wait " + runner->calls[0].node}));
}

TEST(CollectiveExec, WithoutARunnerTheErrorNamesTheNode) {
  Graph g;
  Builder b(g);
  ValueId p = b.param("p", {3}, ParamInit{});
  b.name(b.reduce_from_group(p, 2), "partial_sum");
  ExecOptions o;
  o.backend = "reference";
  Executor ex(g, o);  // planning needs no runner
  EXPECT_GT(ex.memory_plan().arena_bytes, 0);
  ex.bind(p, Tensor::zeros({3}, DType::f32));
  try {
    ex.run();
    FAIL() << "ran a collective without a runner";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("node 'partial_sum' (reduce_from_group, group 2)"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("ExecOptions::collectives"), std::string::npos);
  }
}

// A step that throws while a collective is in flight: the executor still
// waits for it before the error leaves run().
TEST(CollectiveExec, InFlightCallsAreWaitedForWhenAStepThrows) {
  Graph g;
  Builder b(g);
  ValueId p = b.param("p", {3}, ParamInit{});
  ValueId y = b.all_reduce(p, 0);
  ValueId r = b.relu(p);
  b.add(y, r);
  auto runner = std::make_shared<RecordingRunner>();
  ExecOptions o;
  o.backend = "reference";
  o.collectives = runner;
  Executor ex(g, o);
  ex.bind(p, Tensor::zeros({3}, DType::f32));
  ex.on_node_done([](const std::string& name, OpKind op, bool, int64_t, int64_t) {
    if (op == OpKind::relu) throw ConfigError("stop at " + name);
  });
  EXPECT_THROW(ex.run(), ConfigError);
  EXPECT_EQ(runner->events.size(), 2u);
  EXPECT_EQ(runner->events.back().rfind("wait", 0), 0u);
}

}  // namespace
}  // namespace mt
