// DataParallel's side of the executor: parameter bindings, the gradient
// callback, and ZeRO-3's gather-on-demand through the parameter hooks.
#include <unordered_map>

#include <fmt/format.h>

#include "meshtrain/base/timer.h"
#include "meshtrain/sync/data_parallel_impl.h"

namespace mt {

namespace {

size_t idx(int64_t i) {
  return static_cast<size_t>(i);
}

// Per bucket, the element ranges (relative to the bucket start) that no
// gradient is written to: padding between parameters and parameters without
// a gradient in the training graph.
std::vector<std::pair<int64_t, int64_t>> unwritten_ranges(const BucketPlan& p, int bucket,
                                                          const std::vector<bool>& has_grad) {
  const BucketInfo& b = p.buckets()[idx(bucket)];
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t at = b.begin;
  for (int q = b.first_param; q <= b.last_param; ++q) {
    if (!has_grad[idx(q)]) continue;
    const ParamLayoutEntry& e = p.layout()[idx(q)];
    if (e.offset > at) out.emplace_back(at - b.begin, e.offset - b.begin);
    at = e.offset + e.shape.numel();
  }
  if (b.end > at) out.emplace_back(at - b.begin, b.end - b.begin);
  return out;
}

}  // namespace

void DataParallel::attach(Executor& exec, const Graph& graph) {
  Impl& m = *impl_;
  const BucketPlan& p = m.plan;
  const size_t L = p.layout().size();
  std::unordered_map<std::string, int> by_name;
  for (size_t i = 0; i < L; ++i) by_name.emplace(p.layout()[i].name, static_cast<int>(i));

  auto a = std::make_unique<DpAttachment>();
  a->exec = &exec;
  a->param_of.assign(idx(graph.num_values()), -1);
  a->grad_value.assign(L, kNoValue);
  a->param_value.assign(L, kNoValue);
  for (ValueId v : graph.params()) {
    const Value& val = graph.value(v);
    auto it = by_name.find(val.name);
    if (it == by_name.end()) {
      throw ShapeError(fmt::format(
          "data-parallel attach: graph parameter '{}' ({}) is not in the parameter layout",
          val.name, val.shape.str()));
    }
    const int q = it->second;
    const ParamLayoutEntry& e = p.layout()[idx(q)];
    if (!(e.shape == val.shape) || val.dtype != DType::f32) {
      throw ShapeError(fmt::format(
          "data-parallel attach: parameter '{}': graph wants {}{}, the layout holds f32{}",
          val.name, dtype_name(val.dtype), val.shape.str(), e.shape.str()));
    }
    a->param_of[idx(v)] = q;
    a->param_value[idx(q)] = v;
    const ValueId gv = graph.grad_of(v);
    if (gv != kNoValue) {
      a->grad_value[idx(q)] = gv;
      a->training = true;
    }
  }

  if (a->training && m.external) {
    throw ConfigError(
        "data-parallel attach: a training executor after use_external_grads() (its gradients "
        "come through add_grad())");
  }
  if (a->training) {
    for (size_t q = 0; q < L; ++q) m.has_grad[q] = a->grad_value[q] != kNoValue;
    m.set_grad_params();
    if (m.bound_grads) {
      exec.set_transient_grads(false);
      for (size_t q = 0; q < L; ++q) {
        if (a->grad_value[q] == kNoValue) continue;
        const ParamLayoutEntry& e = p.layout()[q];
        exec.bind(a->grad_value[q],
                  Tensor::wrap(m.full_grads.data<float>() + e.offset, e.shape, DType::f32));
      }
    } else {
      // Each gradient is copied (scaled) into its bucket as soon as it is
      // ready, so the executor need not keep it.
      exec.set_transient_grads(true);
    }
    DpAttachment* ap = a.get();
    exec.on_grad_ready([&m, ap](ValueId param) { m.on_grad(*ap, param); });
    m.training = ap;
  }

  if (m.stage() <= 2 || m.world() == 1) {
    for (size_t q = 0; q < L; ++q) {
      if (a->param_value[q] == kNoValue) continue;
      const ParamLayoutEntry& e = p.layout()[q];
      float* at = m.stage() <= 2
                      ? m.flat_params.data<float>() + e.offset
                      : m.shard_params.data<float>() + p.owned(static_cast<int>(q)).shard_offset;
      exec.bind(a->param_value[q], Tensor::wrap(at, e.shape, DType::f32));
    }
  } else {
    const size_t nb = p.buckets().size();
    for (int ph = 0; ph < 2; ++ph) {
      a->users[ph].assign(nb, 0);
      a->next[ph].assign(nb, -1);
    }
    for (const ParamUse& u : exec.param_uses(false)) {
      if (!u.acquire) continue;
      const int q = a->param_of[idx(u.param)];
      if (q < 0) continue;
      const int ph = u.backward ? 1 : 0;
      const int b = p.bucket_of(q);
      if (a->users[ph][idx(b)]++ == 0) a->order[ph].push_back(b);
    }
    for (int ph = 0; ph < 2; ++ph) {
      for (size_t i = 0; i + 1 < a->order[ph].size(); ++i) {
        a->next[ph][idx(a->order[ph][i])] = a->order[ph][i + 1];
      }
    }
    DpAttachment* ap = a.get();
    ParamHooks hooks;
    hooks.acquire = [&m, ap](ValueId v, bool backward) { m.acquire(*ap, v, backward); };
    hooks.release = [&m, ap](ValueId v, bool backward) { m.release(*ap, v, backward); };
    exec.set_param_hooks(std::move(hooks));
  }
  m.attachments.push_back(std::move(a));
}

void DataParallel::Impl::set_grad_params() {
  unwritten.clear();
  for (size_t b = 0; b < plan.buckets().size(); ++b) {
    const BucketInfo& info = plan.buckets()[b];
    int n = 0;
    for (int q = info.first_param; q <= info.last_param; ++q) n += has_grad[idx(q)] ? 1 : 0;
    grad_params[b] = n;
    unwritten.push_back(unwritten_ranges(plan, static_cast<int>(b), has_grad));
  }
}

void DataParallel::Impl::start_gather(DpAttachment& a, int bucket, int phase) {
  Gathered& gs = gathered[idx(bucket)];
  const BucketInfo& b = plan.buckets()[idx(bucket)];
  gs.buffer = gather_pool.acquire(b.numel());
  gs.users_left = a.users[phase][idx(bucket)];
  gs.pending = true;
  gs.used = false;
  with_comm_context([&] { return context(bucket, "all_gatherv of parameters"); },
                    [&] {
                      gs.handle = comm.all_gatherv_async(
                          shard_params.data<float>() + b.shard_offset, gather_pool.data(gs.buffer),
                          b.counts, DType::f32, opt.collective);
                    });
  ++stats.gathers;
  ++stats.collectives;
}

void DataParallel::Impl::wait_gather(int bucket) {
  Gathered& gs = gathered[idx(bucket)];
  if (!gs.pending) return;
  const int64_t t0 = now_ns();
  with_comm_context([&] { return context(bucket, "all_gatherv of parameters"); },
                    [&] { gs.handle.wait(); });
  gs.handle = CommHandle();
  gs.pending = false;
  stats.wait_seconds += static_cast<double>(now_ns() - t0) * 1e-9;
}

void DataParallel::Impl::acquire(DpAttachment& a, ValueId param, bool backward) {
  const int q = a.param_of[idx(param)];
  MT_CHECK(q >= 0, "acquire of value {}, which is not a layout parameter", param);
  const int phase = backward ? 1 : 0;
  const int bucket = plan.bucket_of(q);
  Gathered& gs = gathered[idx(bucket)];
  if (gs.buffer < 0) start_gather(a, bucket, phase);
  wait_gather(bucket);
  const ParamLayoutEntry& e = plan.layout()[idx(q)];
  const BucketInfo& b = plan.buckets()[idx(bucket)];
  a.exec->bind(
      param, Tensor::wrap(gather_pool.data(gs.buffer) + (e.offset - b.begin), e.shape, DType::f32));
  // Prefetch only at a bucket's first use in the phase: the next bucket in
  // first-use order has not been used yet then. Later uses of a long-lived
  // bucket (a tied embedding read at both ends of forward) must not gather
  // again a successor that was already used and freed: nobody would read it.
  if (gs.used) return;
  gs.used = true;
  if (opt.prefetch) {
    const int nb = a.next[phase][idx(bucket)];
    if (nb >= 0 && gathered[idx(nb)].buffer < 0) start_gather(a, nb, phase);
  }
}

void DataParallel::Impl::release(DpAttachment& a, ValueId param, bool backward) {
  const int q = a.param_of[idx(param)];
  MT_CHECK(q >= 0, "release of value {}, which is not a layout parameter", param);
  const int bucket = plan.bucket_of(q);
  Gathered& gs = gathered[idx(bucket)];
  MT_CHECK(gs.buffer >= 0 && gs.users_left > 0,
           "release of '{}' ({} phase) in bucket {}, "
           "which is not gathered",
           plan.layout()[idx(q)].name, backward ? "backward" : "forward", bucket);
  if (--gs.users_left > 0) return;
  MT_CHECK(!gs.pending, "bucket {} freed while its gather is in flight", bucket);
  gather_pool.release(gs.buffer);
  gs.buffer = -1;
}

}  // namespace mt
