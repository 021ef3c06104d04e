#include "meshtrain/sync/data_parallel.h"

#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "meshtrain/base/timer.h"
#include "meshtrain/sync/data_parallel_impl.h"
#include "meshtrain/tensor/memory_stats.h"

namespace mt {

namespace {

size_t idx(int64_t i) {
  return static_cast<size_t>(i);
}

// More staging buffers than this are allocated only when none of the busy
// ones belongs to a launched bucket that could be waited for: one bucket
// being filled while the previous one is reduced, as DeepSpeed does.
constexpr int kStagingBuffers = 2;

const char* grad_collective(int stage) {
  return stage <= 1 ? "all_reduce" : "reduce_scatterv";
}

}  // namespace

DataParallel::DataParallel(Communicator& comm, ParamLayout layout, Tensor flat_params,
                           DataParallelOptions options) {
  if (options.stage < 0 || options.stage > 3) {
    throw ConfigError(
        fmt::format("data-parallel: stage must be 0, 1, 2 or 3, got {}", options.stage));
  }
  if (options.accumulation_steps < 1) {
    throw ConfigError(fmt::format("data-parallel: accumulation_steps must be >= 1, got {}",
                                  options.accumulation_steps));
  }
  if (flat_params.dtype() != DType::f32 || flat_params.rank() != 1) {
    throw ShapeError(fmt::format("data-parallel: the flat parameter buffer must be 1-D f32, got {}",
                                 flat_params.desc()));
  }
  if (flat_params.raw() == nullptr && flat_params.numel() > 0 && options.stage != 3) {
    throw ShapeError(fmt::format(
        "data-parallel: stage {} works on the caller's parameter buffer, but {} has no memory",
        options.stage, flat_params.desc()));
  }
  BucketPlan plan(layout, flat_params.numel(), options.bucket_bytes, comm.size(), comm.rank());
  impl_ = std::make_unique<Impl>(comm, std::move(options), std::move(plan));
  Impl& m = *impl_;
  const BucketPlan& p = m.plan;
  const int stage = m.stage();
  const int64_t F = p.flat_numel(), S = p.shard_numel();
  const int K = m.opt.accumulation_steps;
  const bool sharded_grads = stage >= 2;

  if (stage <= 2) m.flat_params = flat_params;
  {
    MemoryScope tag(MemoryCategory::grads);
    if (stage <= 1) m.full_grads = Tensor::zeros({F}, DType::f32);
    if (sharded_grads) m.shard_grads = Tensor::zeros({S}, DType::f32);
  }
  if (sharded_grads && K > 1 && m.world() > 1) {
    MemoryScope tag(MemoryCategory::comm);  // a buffer: nothing is sent before the K-th micro-step
    m.accum = Tensor::zeros({F}, DType::f32);
  }
  if (stage == 3) {
    // Each rank keeps only its chunks; the caller may drop the full buffer
    // (or pass one without memory and fill the shard through
    // param_pieces(PieceUse::load)).
    MemoryScope tag(MemoryCategory::params);
    m.shard_params = Tensor::zeros({S}, DType::f32);
    const float* src = static_cast<const float*>(flat_params.raw());
    float* dst = m.shard_params.data<float>();
    for (const BucketInfo& b : p.buckets()) {
      if (src == nullptr) break;
      const int64_t n = static_cast<int64_t>(b.counts[idx(p.rank())]);
      std::memcpy(dst + b.shard_offset, src + b.chunk_begin[idx(p.rank())], idx(n) * 4);
    }
  }
  m.bound_grads = grad_memory(m.opt) == GradMemory::bound;
  m.runs.assign(p.buckets().size(), {});
  m.gathered.assign(p.buckets().size(), {});
  m.has_grad.assign(p.layout().size(), false);
  m.grad_params.assign(p.buckets().size(), 0);

  for (size_t i = 0; i < p.layout().size(); ++i) {
    const ParamLayoutEntry& e = p.layout()[i];
    const OwnedRange& o = p.owned(static_cast<int>(i));
    ParamSlice s;
    s.name = e.name;
    s.full_shape = e.shape;
    const bool whole_param = stage == 0;
    s.begin = whole_param ? 0 : o.begin;
    s.end = whole_param ? e.shape.numel() : o.end;
    const int64_t n = s.end - s.begin;
    const Shape shape = s.begin == 0 && s.end == e.shape.numel() ? e.shape : Shape{n};
    float* param_at = stage == 3 ? m.shard_params.data<float>() + o.shard_offset
                                 : m.flat_params.data<float>() + e.offset + s.begin;
    float* grad_at = sharded_grads ? m.shard_grads.data<float>() + o.shard_offset
                                   : m.full_grads.data<float>() + e.offset + s.begin;
    s.param = Tensor::wrap(param_at, shape, DType::f32);
    s.grad = Tensor::wrap(grad_at, shape, DType::f32);
    m.slices.push_back(std::move(s));
  }
}

DataParallel::~DataParallel() {
  if (!impl_) return;
  // The communicator's progress thread may still read or write our buffers.
  auto quiet_wait = [](const CommHandle& h) {
    if (!h.valid()) return;
    try {
      h.wait();
    } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): already reported or moot
    }
  };
  for (const Impl::BucketRun& r : impl_->runs) quiet_wait(r.handle);
  for (const Impl::Gathered& g : impl_->gathered) quiet_wait(g.handle);
}

std::string DataParallel::Impl::context(int bucket, std::string_view what) const {
  const BucketInfo& b = plan.buckets()[idx(bucket)];
  return fmt::format(
      "data-parallel (ZeRO stage {}, rank {} of {}) step {}: {} of bucket {} ({} elements; params "
      "{})",
      opt.stage, plan.rank(), plan.world_size(), step, what, bucket, b.numel(),
      plan.bucket_params(bucket));
}

float* DataParallel::Impl::grad_target(int bucket) {
  const BucketInfo& b = plan.buckets()[idx(bucket)];
  if (stage() <= 1) return full_grads.data<float>() + b.begin;
  if (world() == 1) return shard_grads.data<float>() + b.shard_offset;  // the chunk is the bucket
  if (accum.raw() != nullptr) return accum.data<float>() + b.begin;
  BucketRun& r = runs[idx(bucket)];
  if (r.staging < 0) {
    reclaim_staging(false);
    while (!staging.has_free(b.numel()) && staging.busy() >= kStagingBuffers &&
           !in_flight.empty()) {
      reclaim_staging(true);
    }
    r.staging = staging.acquire(b.numel());
    float* buf = staging.data(r.staging);
    for (const auto& [lo, hi] : unwritten[idx(bucket)]) {
      std::memset(buf + lo, 0, idx(hi - lo) * 4);
    }
  }
  return staging.data(r.staging);
}

// Gives back the staging buffers of launched buckets whose reduce-scatter
// finished; with wait_one, first waits for the oldest.
void DataParallel::Impl::reclaim_staging(bool wait_one) {
  if (wait_one && !in_flight.empty()) wait_bucket(in_flight.front(), "reduce_scatterv");
  while (!in_flight.empty()) {
    BucketRun& r = runs[idx(in_flight.front())];
    if (!r.handle.done()) break;
    // done() does not rethrow: a failure is reported by the wait at the end
    // of the micro-step; the buffer is no longer read either way.
    staging.release(r.staging);
    r.staging = -1;
    in_flight.pop_front();
  }
}

void DataParallel::Impl::on_grad(DpAttachment& a, ValueId param) {
  const int p = a.param_of[idx(param)];
  if (p < 0) return;
  if (!in_micro) {
    throw ConfigError(
        fmt::format("data-parallel: the gradient of '{}' became ready outside a micro-step; call "
                    "begin_micro_step() before run() and end_micro_step() after",
                    plan.layout()[idx(p)].name));
  }
  // Bound: the executor wrote straight into full_grads.
  take_grad(p, bound_grads ? nullptr : a.exec->get(a.grad_value[idx(p)]).data<float>());
}

void DataParallel::Impl::take_grad(int p, const float* src) {
  const int64_t t0 = now_ns();
  const ParamLayoutEntry& e = plan.layout()[idx(p)];
  const int bucket = plan.bucket_of(p);
  const int64_t n = e.shape.numel();
  const float w = static_cast<float>(weight);
  if (src == nullptr) {
    if (weight != 1.0) {
      float* g = full_grads.data<float>() + e.offset;
      for (int64_t i = 0; i < n; ++i) g[i] *= w;
    }
  } else {
    float* dst = grad_target(bucket) + (e.offset - plan.buckets()[idx(bucket)].begin);
    if (micro == 0) {
      for (int64_t i = 0; i < n; ++i) dst[i] = w * src[i];
    } else {
      for (int64_t i = 0; i < n; ++i) dst[i] += w * src[i];
    }
  }
  stats.copy_seconds += static_cast<double>(now_ns() - t0) * 1e-9;
  BucketRun& r = runs[idx(bucket)];
  MT_CHECK(r.pending > 0, "gradient of '{}' ready twice in one micro-step", e.name);
  --r.pending;
  const bool last_micro = micro + 1 == opt.accumulation_steps;
  if (last_micro && opt.overlap && r.pending == 0) {
    const int64_t before = stats.collectives;
    launch_ready();
    stats.overlapped += stats.collectives - before;
  }
}

void DataParallel::use_external_grads() {
  Impl& m = *impl_;
  if (m.training != nullptr) {
    throw ConfigError("data-parallel: use_external_grads() after a training executor was attached");
  }
  m.external = true;
  m.bound_grads = false;
  m.has_grad.assign(m.plan.layout().size(), true);
  m.set_grad_params();
}

void DataParallel::add_grad(const std::string& name, const Tensor& grad) {
  Impl& m = *impl_;
  const int p = m.plan.find(name);
  if (!m.external || p < 0) {
    throw ConfigError(fmt::format(
        "data-parallel: add_grad('{}'): {}", name,
        !m.external ? "call use_external_grads() first" : "not a parameter of the layout"));
  }
  if (!m.in_micro) {
    throw ConfigError(fmt::format(
        "data-parallel: add_grad('{}') outside a micro-step; call begin_micro_step() first", name));
  }
  const ParamLayoutEntry& e = m.plan.layout()[idx(p)];
  if (grad.dtype() != DType::f32 || grad.numel() != e.shape.numel()) {
    throw ConfigError(fmt::format("data-parallel: add_grad('{}'): expected f32{}, got {}", name,
                                  e.shape.str(), grad.desc()));
  }
  if (m.added[idx(p)]) {
    throw ConfigError(
        fmt::format("data-parallel step {}: add_grad('{}') twice in one micro-step", m.step, name));
  }
  const float* src = grad.data<float>();
  const bool in_place = m.stage() <= 1 && src == m.full_grads.data<float>() + e.offset;
  if (in_place && m.opt.accumulation_steps != 1) {
    throw ConfigError(fmt::format(
        "data-parallel: add_grad('{}') of full_grad() itself needs accumulation_steps 1", name));
  }
  m.added[idx(p)] = true;
  m.take_grad(p, in_place ? nullptr : src);
}

Tensor DataParallel::full_grad(const std::string& name) {
  Impl& m = *impl_;
  const int p = m.plan.find(name);
  if (p < 0) {
    throw ConfigError(
        fmt::format("data-parallel: full_grad('{}'): not a parameter of the layout", name));
  }
  if (m.stage() >= 2) return {};
  const ParamLayoutEntry& e = m.plan.layout()[idx(p)];
  return Tensor::wrap(m.full_grads.data<float>() + e.offset, e.shape, DType::f32);
}

// Buckets start strictly in index order, so that every rank issues the same
// collectives in the same order even if gradients became ready differently.
void DataParallel::Impl::launch_ready() {
  const int nb = static_cast<int>(runs.size());
  while (next_launch < nb && runs[idx(next_launch)].pending == 0) launch(next_launch++);
}

void DataParallel::Impl::launch(int bucket) {
  BucketRun& r = runs[idx(bucket)];
  r.launched = true;
  if (world() == 1) {  // the sum over one rank is what we hold
    if (opt.on_bucket_final) opt.on_bucket_final(bucket, in_micro);
    return;
  }
  const BucketInfo& b = plan.buckets()[idx(bucket)];
  if (opt.reduce_bucket) {  // the caller's reduction, done when this returns
    MT_CHECK(stage() >= 1, "reduce_bucket needs ZeRO stage 1-3, not {}", stage());
    const int64_t t0 = now_ns();
    const std::span<const float> g(grad_target(bucket), idx(b.numel()));
    float* chunk = stage() == 1 ? full_grads.data<float>() + b.chunk_begin[idx(plan.rank())]
                                : shard_grads.data<float>() + b.shard_offset;
    with_comm_context([&] { return context(bucket, "compressed reduce-scatter"); },
                      [&] {
                        opt.reduce_bucket(bucket, g, {chunk, b.counts[idx(plan.rank())]});
                      });
    ++stats.collectives;
    stats.wait_seconds += static_cast<double>(now_ns() - t0) * 1e-9;
    if (r.staging >= 0) {  // nothing in flight reads it any more
      staging.release(r.staging);
      r.staging = -1;
    }
    return;
  }
  with_comm_context([&] { return context(bucket, grad_collective(stage())); },
                    [&] {
                      if (stage() <= 1) {
                        float* g = full_grads.data<float>() + b.begin;
                        r.handle = comm.all_reduce_async(g, g, idx(b.numel()), DType::f32,
                                                         ReduceOp::sum, opt.collective);
                      } else {
                        r.handle = comm.reduce_scatterv_async(
                            grad_target(bucket), shard_grads.data<float>() + b.shard_offset,
                            b.counts, DType::f32, ReduceOp::sum, opt.collective);
                      }
                    });
  ++stats.collectives;
  if (r.staging >= 0) in_flight.push_back(bucket);
}

void DataParallel::Impl::wait_bucket(int bucket, const char* what) {
  BucketRun& r = runs[idx(bucket)];
  if (!r.handle.valid()) return;
  const int64_t t0 = now_ns();
  with_comm_context([&] { return context(bucket, what); }, [&] { r.handle.wait(); });
  r.handle = CommHandle();
  stats.wait_seconds += static_cast<double>(now_ns() - t0) * 1e-9;
}

void DataParallel::begin_micro_step(double grad_weight) {
  Impl& m = *impl_;
  if (!std::isfinite(grad_weight) || grad_weight < 0) {
    throw ConfigError(fmt::format(
        "data-parallel: the gradient weight (this rank's share of the global batch) must be "
        "finite and >= 0, got {}",
        grad_weight));
  }
  if (m.grads_ready) {
    throw ConfigError(fmt::format(
        "data-parallel: begin_micro_step() at step {}: the synchronised gradients of the "
        "previous micro-steps were not consumed; call step() or finish_step() first",
        m.step));
  }
  if (m.in_micro) {
    throw ConfigError("data-parallel: begin_micro_step() twice without end_micro_step()");
  }
  m.in_micro = true;
  m.weight = grad_weight;
  m.added.assign(m.external ? m.plan.layout().size() : 0, false);
  for (size_t b = 0; b < m.runs.size(); ++b) m.runs[b].pending = m.grad_params[b];
  if (m.micro == 0) m.next_launch = 0;
}

void DataParallel::end_micro_step() {
  Impl& m = *impl_;
  if (!m.in_micro) throw ConfigError("data-parallel: end_micro_step() without begin_micro_step()");
  m.in_micro = false;
  const BucketPlan& p = m.plan;
  if (m.training == nullptr && !m.external) {
    throw ConfigError(
        "data-parallel: end_micro_step() but no executor with gradients is attached (attach() "
        "the training graph's executor, or use_external_grads())");
  }
  std::string missing;
  for (size_t b = 0; b < m.runs.size(); ++b) {
    if (m.runs[b].pending == 0) continue;
    const BucketInfo& info = p.buckets()[b];
    for (int q = info.first_param; q <= info.last_param; ++q) {
      if (m.has_grad[idx(q)]) missing += (missing.empty() ? "" : ", ") + p.layout()[idx(q)].name;
    }
  }
  if (!missing.empty()) {
    throw ConfigError(fmt::format(
        "data-parallel step {}: gradients never became ready for {} (did the micro-step call "
        "run() on the attached training executor, or add_grad() for each?)",
        m.step, missing));
  }
  for (size_t b = 0; b < m.gathered.size(); ++b) {
    MT_CHECK(m.gathered[b].buffer < 0, "bucket {} ({}) is still gathered after backward", b,
             p.bucket_params(static_cast<int>(b)));
  }
  ++m.micro;
  ++m.stats.micro_steps;
  if (m.micro < m.opt.accumulation_steps) return;
  m.launch_ready();
  MT_CHECK_EQ(m.next_launch, static_cast<int>(m.runs.size()));
  for (size_t b = 0; b < m.runs.size(); ++b) {
    m.wait_bucket(static_cast<int>(b), grad_collective(m.stage()));
  }
  m.in_flight.clear();
  for (Impl::BucketRun& r : m.runs) {
    if (r.staging >= 0) m.staging.release(r.staging);
    r.staging = -1;
    r.launched = false;
  }
  m.micro = 0;
  m.grads_ready = true;
}

bool DataParallel::grads_ready() const {
  return impl_->grads_ready;
}

std::span<ParamSlice> DataParallel::slices() {
  return impl_->slices;
}

std::function<void(std::span<double>)> DataParallel::norm_reducer() {
  Impl& m = *impl_;
  if (m.stage() == 0 || m.world() == 1) return {};
  return [&m](std::span<double> values) {
    if (values.empty()) return;
    const int64_t t0 = now_ns();
    auto where = [&] {
      return fmt::format(
          "data-parallel (ZeRO stage {}, rank {} of {}) step {}: norm reduction "
          "of {} values",
          m.opt.stage, m.plan.rank(), m.plan.world_size(), m.step, values.size());
    };
    with_comm_context(where, [&] {
      m.comm.all_reduce(values.data(), values.data(), values.size(), DType::f64, ReduceOp::sum,
                        m.opt.collective);
    });
    ++m.stats.collectives;
    m.stats.wait_seconds += static_cast<double>(now_ns() - t0) * 1e-9;
  };
}

void DataParallel::finish_step() {
  Impl& m = *impl_;
  if (!m.grads_ready) {
    throw ConfigError(
        fmt::format("data-parallel: finish_step() at step {} before the last micro-step's "
                    "end_micro_step()",
                    m.step));
  }
  const BucketPlan& p = m.plan;
  if ((m.stage() == 1 || m.stage() == 2) && m.world() > 1) {
    // Every rank updated its chunks of the replicated buffer; gather them
    // in place (each rank's own block is already where it belongs).
    float* flat = m.flat_params.data<float>();
    for (size_t b = 0; b < p.buckets().size(); ++b) {
      const BucketInfo& info = p.buckets()[b];
      with_comm_context([&] { return m.context(static_cast<int>(b), "all_gatherv of parameters"); },
                        [&] {
                          m.runs[b].handle = m.comm.all_gatherv_async(
                              flat + info.chunk_begin[idx(p.rank())], flat + info.begin,
                              info.counts, DType::f32, m.opt.collective);
                        });
      ++m.stats.collectives;
    }
    for (size_t b = 0; b < p.buckets().size(); ++b) {
      m.wait_bucket(static_cast<int>(b), "all_gatherv of parameters");
    }
  }
  m.grads_ready = false;
  ++m.step;
  ++m.stats.steps;
}

void DataParallel::step(const std::function<void(std::span<ParamSlice>)>& update) {
  if (!impl_->grads_ready) {
    throw ConfigError(fmt::format(
        "data-parallel: step() at step {} before the last micro-step's end_micro_step()",
        impl_->step));
  }
  update(impl_->slices);
  finish_step();
}

void DataParallel::gather_params(Tensor& flat_out) {
  Impl& m = *impl_;
  const BucketPlan& p = m.plan;
  if (flat_out.dtype() != DType::f32 || flat_out.numel() < p.flat_numel()) {
    throw ShapeError(fmt::format(
        "data-parallel: gather_params needs an f32 buffer of at least {} elements, got {}",
        p.flat_numel(), flat_out.desc()));
  }
  float* out = flat_out.data<float>();
  if (m.stage() <= 2) {
    std::memcpy(out, m.flat_params.data<float>(), idx(p.flat_numel()) * 4);
    return;
  }
  const float* shard = m.shard_params.data<float>();
  for (size_t b = 0; b < p.buckets().size(); ++b) {
    const BucketInfo& info = p.buckets()[b];
    if (m.world() == 1) {
      std::memcpy(out + info.begin, shard + info.shard_offset, idx(info.numel()) * 4);
      continue;
    }
    with_comm_context([&] { return m.context(static_cast<int>(b), "all_gatherv of parameters"); },
                      [&] {
                        m.comm.all_gatherv(shard + info.shard_offset, out + info.begin, info.counts,
                                           DType::f32, m.opt.collective);
                      });
    ++m.stats.collectives;
  }
}

CollectiveCost DataParallel::step_cost() const {
  const Impl& m = *impl_;
  CollectiveCost total;
  if (m.world() == 1) return total;
  auto add = [&](Collective c, const BucketInfo& b) {
    const size_t bytes = idx(b.numel()) * 4;
    const CommAlgorithm alg = m.opt.collective.algorithm != CommAlgorithm::automatic
                                  ? m.opt.collective.algorithm
                                  : m.comm.choose_algorithm(c, bytes);
    const bool v = c != Collective::all_reduce;
    const CollectiveCost cc =
        m.comm.cost(c, alg, v ? 0 : idx(b.numel()), DType::f32,
                    v ? std::span<const size_t>(b.counts) : std::span<const size_t>());
    total.steps += cc.steps;
    total.bytes_sent += cc.bytes_sent;
    total.bytes_received += cc.bytes_received;
  };
  const auto& buckets = m.plan.buckets();
  for (const BucketInfo& b : buckets) {
    add(m.stage() <= 1 ? Collective::all_reduce : Collective::reduce_scatterv, b);
    if (m.stage() == 1 || m.stage() == 2) add(Collective::all_gatherv, b);
  }
  // Stage 3 with external gradients: the caller gathers the whole
  // parameters once per optimizer step (gather_params()).
  if (m.stage() == 3 && m.external) {
    for (const BucketInfo& b : buckets) add(Collective::all_gatherv, b);
  }
  if (m.stage() == 3 && m.training != nullptr) {
    for (int k = 0; k < m.opt.accumulation_steps; ++k) {
      for (const auto& order : m.training->order) {
        for (int b : order) add(Collective::all_gatherv, buckets[idx(b)]);
      }
    }
  }
  return total;
}

DataParallelStats DataParallel::stats() const {
  return impl_->stats;
}
void DataParallel::reset_stats() {
  impl_->stats = {};
}
const BucketPlan& DataParallel::plan() const {
  return impl_->plan;
}
const DataParallelOptions& DataParallel::options() const {
  return impl_->opt;
}
int DataParallel::world_size() const {
  return impl_->plan.world_size();
}
int DataParallel::rank() const {
  return impl_->plan.rank();
}
int64_t DataParallel::step_count() const {
  return impl_->step;
}

}  // namespace mt
