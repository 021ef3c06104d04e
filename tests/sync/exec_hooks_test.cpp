// The executor features ZeRO-2/3 rely on (exec/executor.h):
// - parameter residency hooks: every parameter a phase reads is acquired
//   before its first reader and released after its last one, once per phase,
//   views and recomputation included; parameters bound only inside acquire
//   and poisoned with NaN after release give bitwise the same loss and
//   gradients as a plainly bound run (so nothing reads a released parameter),
//   and fewer parameters are live at a time than the model has;
// - re-binding inputs between runs patches the step arguments correctly;
// - transient gradients: readable with get() inside on_grad_ready, equal to
//   bound gradients, not kept after run(), and a smaller arena.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <utility>

#include "meshtrain/base/random.h"
#include "meshtrain/exec/executor.h"
#include "meshtrain/graph/autodiff.h"
#include "meshtrain/models/model.h"

namespace mt {
namespace {

struct Fixture {
  ModelGraph m;
  std::map<ValueId, Tensor> params;  // the values every run uses
  Tensor x, y;

  Fixture(const ModelSpec& spec, int64_t batch) : m(build_model(spec, batch)) {
    build_backward(m.graph, m.loss);
    Rng rng(5);
    for (ValueId p : m.graph.params()) {
      Tensor t = Tensor::empty(m.graph.value(p).shape, DType::f32);
      for (int64_t i = 0; i < t.numel(); ++i)
        t.data<float>()[i] = static_cast<float>(0.2 * rng.normal());
      params[p] = t;
    }
    const Shape xs = m.graph.value(m.x).shape;
    const Shape ys = m.graph.value(m.y).shape;
    y = Tensor::empty(ys, DType::i32);
    const int64_t classes = spec.kind == "gpt" ? spec.vocab : spec.classes;
    for (int64_t i = 0; i < y.numel(); ++i) {
      y.data<int32_t>()[i] = static_cast<int32_t>(rng.uniform(0, static_cast<double>(classes)));
    }
    x = Tensor::empty(xs, m.graph.value(m.x).dtype);
    for (int64_t i = 0; i < x.numel(); ++i) {
      if (x.dtype() == DType::i32) {
        x.data<int32_t>()[i] =
            static_cast<int32_t>(rng.uniform(0, static_cast<double>(spec.vocab)));
      } else {
        x.data<float>()[i] = static_cast<float>(rng.normal());
      }
    }
  }

  std::unique_ptr<Executor> executor(bool recompute) const {
    ExecOptions o;
    o.backend = "reference";
    o.recompute = recompute;
    auto ex = std::make_unique<Executor>(m.graph, o);
    for (const auto& [id, t] : m.constants) ex->bind(id, t);
    ex->bind(m.x, x);
    ex->bind(m.y, y);
    return ex;
  }

  // Loss and every parameter gradient of one run with everything bound.
  std::map<ValueId, Tensor> plain_run(bool recompute, double* loss) const {
    auto ex = executor(recompute);
    for (const auto& [p, t] : params) ex->bind(p, t);
    ex->run();
    *loss = ex->get(m.loss).item();
    std::map<ValueId, Tensor> grads;
    for (const auto& [p, g] : m.graph.grads()) grads[p] = ex->get(g).clone();
    return grads;
  }
};

ModelSpec gpt() {
  ModelSpec s;
  s.kind = "gpt";
  s.layers = 2;
  s.d_model = 16;
  s.heads = 2;
  s.seq_len = 5;
  s.vocab = 20;
  return s;
}

ModelSpec mlp() {
  ModelSpec s;
  s.kind = "mlp";
  s.image_size = 4;
  s.hidden = {12, 12, 12};
  s.classes = 3;
  return s;
}

bool same(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

TEST(ExecutorParamHooks, EveryParameterIsAcquiredAndReleasedOncePerPhase) {
  for (bool recompute : {false, true}) {
    Fixture f(gpt(), 2);
    auto ex = f.executor(recompute);
    for (bool forward_only : {false, true}) {
      const std::vector<ParamUse> uses = ex->param_uses(forward_only);
      std::map<std::pair<ValueId, bool>, int> state;  // 1 acquired, 2 released
      bool seen_backward = false;
      for (const ParamUse& u : uses) {
        if (u.backward) seen_backward = true;
        EXPECT_TRUE(u.backward || !seen_backward) << "forward events come before backward ones";
        int& s = state[std::make_pair(u.param, u.backward)];
        EXPECT_EQ(s, u.acquire ? 0 : 1) << f.m.graph.value(u.param).name;
        s = u.acquire ? 1 : 2;
      }
      for (ValueId p : f.m.graph.params()) {
        EXPECT_EQ(state[std::make_pair(p, false)], 2)
            << "forward reads " << f.m.graph.value(p).name;
        if (forward_only) {
          EXPECT_EQ(state.count(std::make_pair(p, true)), 0u);
        }
      }
      EXPECT_EQ(seen_backward, !forward_only);
      // The gain of a layer norm is read by its backward node either way;
      // the tied embedding is needed from the first step to the head.
      const ValueId ln = *f.m.graph.find("block0.ln1.g");
      if (!forward_only) {
        EXPECT_EQ(state[std::make_pair(ln, true)], 2);
      }
      const ValueId wte = *f.m.graph.find("wte");
      const ValueId ln_f = *f.m.graph.find("ln_f.g");
      auto at = [&](ValueId p, bool acquire) {
        for (size_t i = 0; i < uses.size(); ++i) {
          if (uses[i].param == p && uses[i].acquire == acquire && !uses[i].backward) return i;
        }
        return uses.size();
      };
      EXPECT_LT(at(wte, true), at(ln, true)) << "the embedding is read first";
      EXPECT_GT(at(wte, false), at(ln_f, true)) << "and released only after the tied head";
    }
  }
}

// Parameters live only between acquire and release, in fresh memory that is
// poisoned when released: the results are bitwise those of a plain run.
TEST(ExecutorParamHooks, ParametersBoundOnlyWhileNeededGiveTheSameResults) {
  for (const ModelSpec& spec : {gpt(), mlp()}) {
    for (bool recompute : {false, true}) {
      Fixture f(spec, 3);
      double want_loss = 0;
      const std::map<ValueId, Tensor> want = f.plain_run(recompute, &want_loss);

      auto ex = f.executor(recompute);
      std::map<ValueId, Tensor> live;
      std::vector<Tensor> graveyard;  // released memory stays allocated, full of NaN
      size_t peak_live = 0;
      int acquires = 0;
      ParamHooks hooks;
      hooks.acquire = [&](ValueId p, bool) {
        ASSERT_EQ(live.count(p), 0u);
        Tensor t = f.params.at(p).clone();
        live[p] = t;
        ex->bind(p, Tensor::wrap(t.raw(), t.shape(), DType::f32));
        peak_live = std::max(peak_live, live.size());
        ++acquires;
      };
      hooks.release = [&](ValueId p, bool) {
        Tensor t = live.at(p);
        t.fill(std::numeric_limits<double>::quiet_NaN());
        graveyard.push_back(t);
        live.erase(p);
      };
      ex->set_param_hooks(hooks);
      for (int run = 0; run < 2; ++run) {
        ex->run();
        EXPECT_TRUE(live.empty());
        EXPECT_EQ(ex->get(f.m.loss).item(), want_loss) << spec.kind << " recompute " << recompute;
        for (const auto& [p, g] : f.m.graph.grads()) {
          EXPECT_TRUE(same(ex->get(g), want.at(p))) << spec.kind << " recompute " << recompute
                                                    << ": gradient of " << f.m.graph.value(p).name;
        }
      }
      // Two runs, each acquiring once per event pair of param_uses().
      EXPECT_EQ(static_cast<size_t>(acquires), ex->param_uses(false).size());
      EXPECT_LT(peak_live, f.m.graph.params().size()) << spec.kind;
      ex->run_forward();
      EXPECT_TRUE(live.empty());
      EXPECT_EQ(ex->get(f.m.loss).item(), want_loss);
    }
  }
}

TEST(ExecutorParamHooks, MisuseIsAConfigError) {
  Fixture f(mlp(), 2);
  auto ex = f.executor(false);
  ParamHooks lazy;
  lazy.acquire = [](ValueId, bool) {};  // binds nothing
  ex->set_param_hooks(lazy);
  try {
    ex->run();
    FAIL() << "an acquire hook that binds nothing must fail";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("fc1.w"), std::string::npos) << e.what();
  }
  // Gradients cannot be re-bound while the graph runs.
  auto ex2 = f.executor(false);
  for (const auto& [p, t] : f.params) ex2->bind(p, t);
  const ValueId g = f.m.graph.grads().begin()->second;
  ex2->on_grad_ready(
      [&](ValueId) { ex2->bind(g, Tensor::zeros(f.m.graph.value(g).shape, DType::f32)); });
  EXPECT_THROW(ex2->run(), ConfigError);
}

TEST(ExecutorInputs, RebindingBetweenRunsUsesTheNewMemory) {
  Fixture f(mlp(), 4);
  auto ex = f.executor(false);
  for (const auto& [p, t] : f.params) ex->bind(p, t);
  ex->run();
  const double first = ex->get(f.m.loss).item();
  Tensor x2 = f.x.clone();
  for (int64_t i = 0; i < x2.numel(); ++i) x2.data<float>()[i] *= -2.0f;
  ex->bind(f.m.x, x2);
  ex->run();
  const double second = ex->get(f.m.loss).item();
  auto fresh = f.executor(false);
  for (const auto& [p, t] : f.params) fresh->bind(p, t);
  fresh->bind(f.m.x, x2);
  fresh->run();
  EXPECT_EQ(second, fresh->get(f.m.loss).item());
  EXPECT_NE(first, second);
}

TEST(ExecutorTransientGrads, ReadableInTheCallbackOnlyAndSmallerArena) {
  Fixture f(gpt(), 3);
  double loss = 0;
  const std::map<ValueId, Tensor> want = f.plain_run(false, &loss);
  auto kept = f.executor(false);
  auto ex = f.executor(false);
  for (const auto& [p, t] : f.params) {
    kept->bind(p, t);
    ex->bind(p, t);
  }
  ex->set_transient_grads(true);
  std::map<ValueId, Tensor> seen;
  ex->on_grad_ready([&](ValueId p) { seen[p] = ex->get(f.m.graph.grad_of(p)).clone(); });
  ex->run();
  ASSERT_EQ(seen.size(), want.size());
  for (const auto& [p, g] : want) EXPECT_TRUE(same(seen.at(p), g)) << f.m.graph.value(p).name;
  EXPECT_THROW(ex->get(f.m.graph.grads().begin()->second), ConfigError);
  const int64_t transient = ex->memory_plan().arena_bytes;
  const int64_t all_kept = kept->memory_plan().arena_bytes;
  std::printf("arena with gradients kept %lld bytes, transient %lld bytes\n",
              static_cast<long long>(all_kept), static_cast<long long>(transient));
  EXPECT_LT(transient, all_kept);
}

}  // namespace
}  // namespace mt
