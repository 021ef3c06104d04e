// DataParallel's checkpoint pieces and memory report.
#include <fmt/format.h>

#include <algorithm>

#include "meshtrain/sync/data_parallel_impl.h"
#include "meshtrain/tensor/memory_stats.h"

namespace mt {

namespace {

size_t idx(int64_t i) {
  return static_cast<size_t>(i);
}

// Flat f32 view of elements [begin, end) of t (which holds whole or part of a tensor).
Tensor flat_view(const Tensor& t, int64_t begin, int64_t end) {
  return Tensor::wrap(static_cast<float*>(const_cast<void*>(t.raw())) + begin, Shape{end - begin},
                      DType::f32);
}

}  // namespace

std::vector<ShardPiece> DataParallel::param_pieces(PieceUse use) {
  Impl& m = *impl_;
  const BucketPlan& p = m.plan;
  std::vector<ShardPiece> out;
  for (size_t q = 0; q < p.layout().size(); ++q) {
    const ParamLayoutEntry& e = p.layout()[q];
    const OwnedRange& o = p.owned(static_cast<int>(q));
    ShardPiece piece;
    piece.name = e.name;
    piece.full_shape = e.shape;
    if (use == PieceUse::load && m.stage() <= 2) {
      piece.begin = 0;
      piece.end = e.shape.numel();
      piece.data = Tensor::wrap(m.flat_params.data<float>() + e.offset, e.shape, DType::f32);
    } else {
      if (o.numel() == 0) continue;
      piece.begin = o.begin;
      piece.end = o.end;
      float* at = m.stage() == 3 ? m.shard_params.data<float>() + o.shard_offset
                                 : m.flat_params.data<float>() + e.offset + o.begin;
      piece.data = Tensor::wrap(at, Shape{o.numel()}, DType::f32);
    }
    if (piece.end > piece.begin) out.push_back(std::move(piece));
  }
  return out;
}

std::vector<ShardPiece> DataParallel::state_pieces(const std::map<std::string, Tensor>& state,
                                                   PieceUse use) const {
  const Impl& m = *impl_;
  const BucketPlan& p = m.plan;
  std::vector<ShardPiece> out;
  for (const auto& [key, t] : state) {
    const size_t dot = key.rfind('.');
    const int q = dot == std::string::npos ? -1 : p.find(key.substr(0, dot));
    if (q < 0) {
      throw CheckpointError(fmt::format(
          "data-parallel: optimizer state '{}' is not '<param>.<kind>' for a parameter of the "
          "layout",
          key));
    }
    const ParamSlice& s = m.slices[idx(q)];
    const int64_t held = s.end - s.begin;
    if (t.dtype() != DType::f32 || t.numel() != held) {
      throw CheckpointError(fmt::format(
          "data-parallel: optimizer state '{}' is {}, but this rank holds {} elements of '{}' "
          "(elements [{}, {}) of {})",
          key, t.desc(), held, s.name, s.begin, s.end, s.full_shape.str()));
    }
    if (held == 0) continue;
    ShardPiece piece;
    piece.name = key;
    piece.full_shape = s.full_shape;
    const OwnedRange& o = p.owned(q);
    if (use == PieceUse::save && m.stage() == 0) {
      // Replicated state: every rank writes only its chunk of it.
      if (o.numel() == 0) continue;
      piece.begin = o.begin;
      piece.end = o.end;
      piece.data = flat_view(t, o.begin, o.end);
    } else {
      piece.begin = s.begin;
      piece.end = s.end;
      piece.data = t;
    }
    out.push_back(std::move(piece));
  }
  return out;
}

std::vector<ShardPiece> DataParallel::new_state_pieces(std::span<const std::string> kinds) const {
  const Impl& m = *impl_;
  std::vector<ShardPiece> out;
  for (const ParamSlice& s : m.slices) {
    if (s.end == s.begin) continue;
    for (const std::string& kind : kinds) {
      ShardPiece piece;
      piece.name = s.name + "." + kind;
      piece.full_shape = s.full_shape;
      piece.begin = s.begin;
      piece.end = s.end;
      MemoryScope tag(MemoryCategory::optimizer);
      piece.data = Tensor::zeros(s.param.shape(), DType::f32);
      out.push_back(std::move(piece));
    }
  }
  return out;
}

DataParallelMemory DataParallel::memory(int state_kinds, int64_t optimizer_bytes) const {
  const Impl& m = *impl_;
  const BucketPlan& p = m.plan;
  const int N = m.world();
  auto bytes = [](const Tensor& t) {
    return t.raw() != nullptr ? static_cast<int64_t>(t.nbytes()) : int64_t{0};
  };
  DataParallelMemory r;
  r.stage = m.stage();
  r.world_size = N;
  r.param_bytes = bytes(m.flat_params) + bytes(m.shard_params);
  r.grad_bytes = bytes(m.full_grads) + bytes(m.shard_grads);
  r.optimizer_bytes = optimizer_bytes;
  r.staging_bytes = m.staging.peak_bytes() + bytes(m.accum);
  r.gathered_bytes = m.gather_pool.peak_bytes();

  const DataParallelMemory e = expected_memory(p, m.opt, state_kinds);
  r.expected_param_bytes = e.expected_param_bytes;
  r.expected_grad_bytes = e.expected_grad_bytes;
  r.expected_optimizer_bytes = e.expected_optimizer_bytes;
  r.expected_buffer_bytes = e.expected_buffer_bytes;
  return r;
}

DataParallelMemory DataParallel::expected_memory(const BucketPlan& p,
                                                 const DataParallelOptions& opt, int state_kinds) {
  DataParallelMemory r;
  r.stage = opt.stage;
  r.world_size = p.world_size();
  const int N = p.world_size();
  const int64_t P = p.param_numel() * 4;
  const int64_t O = int64_t{state_kinds} * P;
  r.expected_param_bytes = opt.stage == 3 ? P / N : P;
  r.expected_grad_bytes = opt.stage >= 2 ? P / N : P;
  r.expected_optimizer_bytes = opt.stage >= 1 ? O / N : O;
  // Two buckets in flight (one when the model fits in one), each in a
  // buffer of the largest bucket's size (the pool reuses buffers across
  // buckets of different sizes).
  const int64_t two_buckets =
      std::min<int64_t>(2, static_cast<int64_t>(p.buckets().size())) * p.max_bucket_numel() * 4;
  if (N > 1 && opt.stage >= 2) {
    const bool all_staged = opt.accumulation_steps > 1 || !opt.overlap;
    r.expected_buffer_bytes = all_staged ? p.flat_numel() * 4 : two_buckets;
  }
  if (N > 1 && opt.stage == 3) r.expected_buffer_bytes += two_buckets;
  return r;
}

GradMemory DataParallel::grad_memory(const DataParallelOptions& opt) {
  return opt.stage <= 1 && opt.accumulation_steps == 1 ? GradMemory::bound : GradMemory::transient;
}

std::string DataParallelMemory::to_string() const {
  auto mib = [](int64_t b) { return static_cast<double>(b) / (1024.0 * 1024.0); };
  return fmt::format(
      "ZeRO stage {} on {} ranks, per rank (MiB, measured / expected): parameters {:.3f} / "
      "{:.3f}, gradients {:.3f} / {:.3f}, optimizer state {:.3f} / {:.3f}, buffers {:.3f} / "
      "{:.3f} (staging {:.3f}, gathered parameters {:.3f})",
      stage, world_size, mib(param_bytes), mib(expected_param_bytes), mib(grad_bytes),
      mib(expected_grad_bytes), mib(optimizer_bytes), mib(expected_optimizer_bytes),
      mib(buffer_bytes()), mib(expected_buffer_bytes), mib(staging_bytes), mib(gathered_bytes));
}

}  // namespace mt
