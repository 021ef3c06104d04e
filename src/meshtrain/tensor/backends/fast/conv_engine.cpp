// oneDNN convolution with a measured choice between plain NCHW and blocked
// layouts (see conv_engine.h).
#include "meshtrain/tensor/backends/fast/conv_engine.h"

#include <string>
#include <unordered_map>

#include "meshtrain/base/timer.h"
#include "meshtrain/tensor/backends/fast/fast_common.h"

namespace mt::fast {

namespace {

using dnnl::memory;
using tag = memory::format_tag;
constexpr memory::data_type kF32 = memory::data_type::f32;

}  // namespace

ConvEngine::ConvEngine(OneDnnContext& ctx, ConvLayoutChoice layout) : ctx_(ctx), layout_(layout) {}
ConvEngine::~ConvEngine() = default;

ConvEngine::Key ConvEngine::key_of(Kind kind, const ConvGeom& g, const Conv2dParams& p, bool bias,
                                   int threads) {
  return Key{kind, g, p.stride_h, p.stride_w, p.pad_h, p.pad_w, bias, threads};
}

ConvEngine::Variant ConvEngine::make_variant(const Key& key, bool blocked, bool& same_as_plain) {
  const ConvGeom& g = key.g;
  const memory::dims src{g.n, g.ci, g.h, g.w}, wei{g.co, g.ci, g.kh, g.kw}, bia{g.co},
      dst{g.n, g.co, g.oh, g.ow}, strides{key.sh, key.sw}, pad{key.ph, key.pw};
  const memory::desc x_user(src, kF32, tag::nchw), w_user(wei, kF32, tag::oihw),
      b_user(bia, kF32, tag::x), y_user(dst, kF32, tag::nchw);
  const memory::desc x_md = blocked ? memory::desc(src, kF32, tag::any) : x_user;
  const memory::desc w_md = blocked ? memory::desc(wei, kF32, tag::any) : w_user;
  const memory::desc y_md = blocked ? memory::desc(dst, kF32, tag::any) : y_user;
  const auto algo = dnnl::algorithm::convolution_direct;
  const auto prop = dnnl::prop_kind::forward_training;
  // The forward primitive descriptor is also the hint backward ones need.
  // Right padding equals left padding: oneDNN's output-size rule then matches
  // window_out_extent's integer division.
  const dnnl::convolution_forward::primitive_desc fwd(
      key.bias && key.kind == Kind::forward
          ? dnnl::convolution_forward::desc(prop, algo, x_md, w_md, b_user, y_md, strides, pad, pad)
          : dnnl::convolution_forward::desc(prop, algo, x_md, w_md, y_md, strides, pad, pad),
      ctx_.engine);

  Variant v;
  same_as_plain = true;
  auto add = [&](int id, bool output, const memory::desc& user, const memory::desc& prim) {
    Arg a{id, output, user, std::nullopt, std::nullopt};
    if (prim != user) {
      same_as_plain = false;
      a.internal.emplace(prim, ctx_.engine);
      a.reorder.emplace(output
                            ? dnnl::reorder::primitive_desc(ctx_.engine, prim, ctx_.engine, user)
                            : dnnl::reorder::primitive_desc(ctx_.engine, user, ctx_.engine, prim));
    }
    v.args.push_back(std::move(a));
  };
  switch (key.kind) {
    case Kind::forward:
      v.prim.emplace(dnnl::convolution_forward(fwd));
      add(DNNL_ARG_SRC, false, x_user, fwd.src_desc());
      add(DNNL_ARG_WEIGHTS, false, w_user, fwd.weights_desc());
      if (key.bias) add(DNNL_ARG_BIAS, false, b_user, fwd.bias_desc());
      add(DNNL_ARG_DST, true, y_user, fwd.dst_desc());
      break;
    case Kind::backward_data: {
      const dnnl::convolution_backward_data::primitive_desc pd(
          dnnl::convolution_backward_data::desc(algo, x_md, w_md, y_md, strides, pad, pad),
          ctx_.engine, fwd);
      v.prim.emplace(dnnl::convolution_backward_data(pd));
      add(DNNL_ARG_DIFF_DST, false, y_user, pd.diff_dst_desc());
      add(DNNL_ARG_WEIGHTS, false, w_user, pd.weights_desc());
      add(DNNL_ARG_DIFF_SRC, true, x_user, pd.diff_src_desc());
      break;
    }
    case Kind::backward_weight: {
      const dnnl::convolution_backward_weights::primitive_desc pd(
          key.bias
              ? dnnl::convolution_backward_weights::desc(algo, x_md, w_md, b_user, y_md, strides,
                                                         pad, pad)
              : dnnl::convolution_backward_weights::desc(algo, x_md, w_md, y_md, strides, pad, pad),
          ctx_.engine, fwd);
      v.prim.emplace(dnnl::convolution_backward_weights(pd));
      add(DNNL_ARG_SRC, false, x_user, pd.src_desc());
      add(DNNL_ARG_DIFF_DST, false, y_user, pd.diff_dst_desc());
      add(DNNL_ARG_DIFF_WEIGHTS, true, w_user, pd.diff_weights_desc());
      if (key.bias) add(DNNL_ARG_DIFF_BIAS, true, b_user, pd.diff_bias_desc());
      break;
    }
  }
  return v;
}

ConvEngine::Plan& ConvEngine::plan_for(const Key& key) {
  auto it = plans_.find(key);
  if (it != plans_.end()) return *it->second;
  if (plans_.size() >= 1024) plans_.clear();  // bounds a pathological caller only
  auto plan = std::make_unique<Plan>();
  bool same = true;
  try {
    plan->variants[0] = make_variant(key, false, same);
  } catch (const dnnl::error& e) {
    throw InternalError(fmt::format(
        "conv: oneDNN cannot build a convolution for x [{}, {}, {}, {}], "
        "w [{}, {}, {}, {}]: {}",
        key.g.n, key.g.ci, key.g.h, key.g.w, key.g.co, key.g.ci, key.g.kh, key.g.kw, e.what()));
  }
  if (layout_ != ConvLayoutChoice::plain) {
    try {
      plan->variants[1] = make_variant(key, true, same);
    } catch (const dnnl::error&) {
      same = true;  // no blocked implementation: plain it is
    }
  }
  // When oneDNN's preferred layouts are the caller's, there is nothing to choose.
  plan->count = same ? 1 : 2;
  if (plan->count == 1 || layout_ == ConvLayoutChoice::plain) plan->chosen = 0;
  if (plan->count == 2 && layout_ == ConvLayoutChoice::blocked) plan->chosen = 1;
  return *plans_.emplace(key, std::move(plan)).first->second;
}

void ConvEngine::execute(Variant& v, const std::vector<void*>& ptrs) {
  std::unordered_map<int, memory> args;
  std::vector<memory> user(v.args.size());
  for (size_t i = 0; i < v.args.size(); ++i) {
    Arg& a = v.args[i];
    user[i] = wrap_memory(a.user_md, ctx_, ptrs[i]);
    if (!a.reorder) {
      args.emplace(a.id, user[i]);
      continue;
    }
    if (!a.output) {
      a.reorder->execute(ctx_.stream, {{DNNL_ARG_FROM, user[i]}, {DNNL_ARG_TO, *a.internal}});
    }
    args.emplace(a.id, *a.internal);
  }
  v.prim->execute(ctx_.stream, args);
  for (size_t i = 0; i < v.args.size(); ++i) {
    Arg& a = v.args[i];
    if (a.output && a.reorder) {
      a.reorder->execute(ctx_.stream, {{DNNL_ARG_FROM, *a.internal}, {DNNL_ARG_TO, user[i]}});
    }
  }
  ctx_.stream.wait();
}

void ConvEngine::run(const Key& key, const std::vector<std::pair<int, void*>>& buffers) {
  Plan& plan = plan_for(key);
  const int pick = plan.chosen >= 0 ? plan.chosen : plan.trials % 2;
  Variant& v = plan.variants[static_cast<size_t>(pick)];
  std::vector<void*> ptrs;
  for (const Arg& a : v.args) {
    void* p = nullptr;
    for (const auto& [id, ptr] : buffers) {
      if (id == a.id) p = ptr;
    }
    MT_CHECK(p != nullptr, "conv: no buffer for oneDNN argument {}", a.id);
    ptrs.push_back(p);
  }
  if (plan.chosen >= 0) {
    execute(v, ptrs);
    return;
  }
  const double t0 = trial_clock_s(key.threads);
  execute(v, ptrs);
  const double t = trial_clock_s(key.threads) - t0;
  double& best = plan.best[static_cast<size_t>(pick)];
  best = std::min(best, t);
  if (++plan.trials == 2 * kTrials) plan.chosen = plan.best[0] <= plan.best[1] ? 0 : 1;
}

void ConvEngine::forward(const ConvGeom& g, const Conv2dParams& p, const Tensor& x, const Tensor& w,
                         const Tensor& bias, Tensor& y, int threads) {
  std::vector<std::pair<int, void*>> bufs{{DNNL_ARG_SRC, const_cast<void*>(x.raw())},
                                          {DNNL_ARG_WEIGHTS, const_cast<void*>(w.raw())},
                                          {DNNL_ARG_DST, y.raw()}};
  if (bias.defined()) bufs.emplace_back(DNNL_ARG_BIAS, const_cast<void*>(bias.raw()));
  run(key_of(Kind::forward, g, p, bias.defined(), threads), bufs);
}

void ConvEngine::backward_data(const ConvGeom& g, const Conv2dParams& p, const Tensor& dy,
                               const Tensor& w, Tensor& dx, int threads) {
  run(key_of(Kind::backward_data, g, p, false, threads),
      {{DNNL_ARG_DIFF_DST, const_cast<void*>(dy.raw())},
       {DNNL_ARG_WEIGHTS, const_cast<void*>(w.raw())},
       {DNNL_ARG_DIFF_SRC, dx.raw()}});
}

void ConvEngine::backward_weight(const ConvGeom& g, const Conv2dParams& p, const Tensor& dy,
                                 const Tensor& x, Tensor& dw, Tensor& dbias, int threads) {
  std::vector<std::pair<int, void*>> bufs{{DNNL_ARG_SRC, const_cast<void*>(x.raw())},
                                          {DNNL_ARG_DIFF_DST, const_cast<void*>(dy.raw())},
                                          {DNNL_ARG_DIFF_WEIGHTS, dw.raw()}};
  if (dbias.defined()) bufs.emplace_back(DNNL_ARG_DIFF_BIAS, dbias.raw());
  run(key_of(Kind::backward_weight, g, p, dbias.defined(), threads), bufs);
}

const char* ConvEngine::chosen_forward_variant(const ConvGeom& g, const Conv2dParams& p, bool bias,
                                               int threads) const {
  auto it = plans_.find(key_of(Kind::forward, g, p, bias, threads));
  if (it == plans_.end() || it->second->chosen < 0) return "undecided";
  return it->second->chosen == 0 ? "plain" : "blocked";
}

}  // namespace mt::fast
