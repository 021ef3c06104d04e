#include "meshtrain/sync/compressed_all_reduce.h"

#include <algorithm>

#include <fmt/format.h>

#include "meshtrain/base/error.h"
#include "meshtrain/base/random.h"
#include "meshtrain/comm/algorithms.h"

namespace mt {
namespace {

// PowerSGD's matrix view: shape[0] x the rest (a scalar is 1 x 1).
void matrix_view(const Shape& shape, size_t& rows, size_t& cols) {
  const auto numel = static_cast<size_t>(shape.numel());
  rows = shape.rank() == 0 ? 1 : static_cast<size_t>(shape[0]);
  cols = rows == 0 ? 0 : numel / rows;
}

// A dense f32 all-reduce of n elements.
PlannedCollective dense(size_t n) {
  return {Collective::all_reduce, n, DType::f32};
}

}  // namespace

std::vector<PlannedCollective> compressed_all_reduce_plan(const CompressedAllReduceOptions& options,
                                                          const Shape& shape) {
  const CodecSpec& spec = options.codec;
  const auto numel = static_cast<size_t>(shape.numel());
  if (numel == 0) return {};
  switch (spec.kind) {
    case CodecKind::none:
      return {dense(numel)};
    case CodecKind::f16:
    case CodecKind::bf16: {
      const DType t = spec.kind == CodecKind::f16 ? DType::f16 : DType::bf16;
      return {{options.cast_exchange == CastExchange::all_reduce ? Collective::all_reduce
                                                                 : Collective::all_gather,
               numel, t}};
    }
    case CodecKind::topk:
    case CodecKind::randk:
      if (options.sparse_exchange == SparseExchange::dense_all_reduce) return {dense(numel)};
      [[fallthrough]];
    case CodecKind::qsgd:
    case CodecKind::sign:
      return {
          {Collective::all_gather, make_payload_codec(spec, numel)->payload_bytes(), DType::u8}};
    case CodecKind::powersgd: {
      size_t rows = 0, cols = 0;
      matrix_view(shape, rows, cols);
      if (!powersgd_compresses(rows, cols, spec.rank)) return {dense(numel)};
      const auto r = static_cast<size_t>(spec.rank);
      return {dense(rows * r), dense(cols * r)};
    }
  }
  return {};
}

CodecTraffic predict_traffic(const Communicator& comm, std::span<const PlannedCollective> plan,
                             const CollectiveOptions& opts) {
  CodecTraffic t;
  const auto n = static_cast<uint64_t>(comm.size());
  const bool handshake = opts.handshake.value_or(comm.options().handshake) && n > 1;
  for (const PlannedCollective& c : plan) {
    // The payload bytes the algorithm choice sees (comm/executor.cpp): the
    // whole buffer for an all-reduce, the gathered total for an all-gather.
    const size_t bytes = c.count * dtype_size(c.dtype) * (c.kind == Collective::all_gather ? n : 1);
    const CommAlgorithm a = opts.algorithm == CommAlgorithm::automatic
                                ? comm.choose_algorithm(c.kind, bytes)
                                : opts.algorithm;
    if (a != CommAlgorithm::native) {  // the engine reports no bytes for its own
      const CollectiveCost cost = comm.cost(c.kind, a, c.count, c.dtype);
      t.bytes_sent += cost.bytes_sent;
      t.bytes_received += cost.bytes_received;
    }
    if (handshake) {
      t.handshake_bytes_sent += 48 * (n - 1);
      t.handshake_bytes_received += 48 * (n - 1);
    }
    ++t.calls;
  }
  return t;
}

CodecTraffic predict_traffic(std::span<const PlannedCollective> plan, int world_size, int rank,
                             size_t shm_slot_bytes, const AlgorithmPolicy& policy, bool handshake,
                             CommAlgorithm algorithm) {
  using A = CommAlgorithm;
  CodecTraffic t;
  const int n = world_size;
  const bool shm = shm_slot_bytes > 0;
  // The handshake record (comm/agreement.h's CallRecord), exchanged directly
  // or through the arena.
  constexpr size_t kRecord = 48;
  for (const PlannedCollective& c : plan) {
    const size_t elem = dtype_size(c.dtype);
    const size_t bytes =
        c.count * elem * (c.kind == Collective::all_gather ? static_cast<size_t>(n) : 1);
    const A a = algorithm == A::automatic ? policy.choose(c.kind, bytes, n, shm, false) : algorithm;
    const std::vector<size_t> blocks(static_cast<size_t>(n), c.count);
    CollectiveCost cost;
    if (c.kind == Collective::all_reduce) {
      cost = a == A::ring               ? comm::ring_all_reduce_cost(n, rank, c.count, elem)
             : a == A::halving_doubling ? comm::hd_all_reduce_cost(n, rank, c.count, elem)
             : a == A::shared_memory
                 ? comm::shm_all_reduce_cost(n, rank, c.count, elem, shm_slot_bytes)
                 : CollectiveCost{};
    } else {
      cost = a == A::ring               ? comm::ring_all_gatherv_cost(n, rank, blocks, elem)
             : a == A::halving_doubling ? comm::hd_all_gatherv_cost(n, rank, blocks, elem)
             : a == A::shared_memory
                 ? comm::shm_all_gatherv_cost(n, rank, blocks, elem, shm_slot_bytes)
                 : CollectiveCost{};
    }
    t.bytes_sent += cost.bytes_sent;
    t.bytes_received += cost.bytes_received;
    if (handshake && n > 1) {
      const CollectiveCost h = shm ? comm::shm_exchange_cost(n, rank, kRecord)
                                   : comm::direct_exchange_cost(n, rank, kRecord);
      t.handshake_bytes_sent += h.bytes_sent;
      t.handshake_bytes_received += h.bytes_received;
    }
    ++t.calls;
  }
  return t;
}

CompressedAllReduce::CompressedAllReduce(Communicator& comm, std::string name, Shape shape,
                                         CompressedAllReduceOptions options)
    : comm_(comm),
      name_(std::move(name)),
      shape_(std::move(shape)),
      numel_(static_cast<size_t>(shape_.numel())),
      options_(std::move(options)) {
  const CodecSpec& spec = options_.codec;
  spec.check_fits(numel_, fmt::format("tensor '{}'", name_));
  plan_ = compressed_all_reduce_plan(options_, shape_);
  switch (spec.kind) {
    case CodecKind::none:
      break;
    case CodecKind::powersgd: {
      matrix_view(shape_, rows_, cols_);
      low_rank_ = powersgd_compresses(rows_, cols_, spec.rank);
      residual_.assign(numel_, 0.0f);
      e_.resize(numel_);
      if (low_rank_) {
        const auto r = static_cast<size_t>(spec.rank);
        p_.resize(rows_ * r);
        q_.assign(cols_ * r, 0.0f);  // drawn at the first run()
      }
      break;
    }
    default:
      encoder_ = std::make_unique<FeedbackEncoder>(
          make_payload_codec(spec, numel_), spec.error_feedback, contraction_factor(spec, numel_));
      payload_.resize(encoder_->codec().payload_bytes());
      if (!plan_.empty() && plan_[0].kind == Collective::all_gather) {
        gathered_.resize(payload_.size() * static_cast<size_t>(comm_.size()));
      }
      break;
  }
}

CompressedAllReduce::~CompressedAllReduce() {
  try {
    if (handle_.valid()) handle_.wait();  // it writes into our buffers
  } catch (...) {                         // the communicator reports it to whoever uses it next
  }
}

bool CompressedAllReduce::can_start() const {
  if (!encoder_ || plan_.empty()) return false;
  const PlannedCollective& call = plan_.front();
  return call.kind == Collective::all_gather || call.dtype != DType::f32;
}

void CompressedAllReduce::start(std::span<const float> grad) {
  MT_CHECK(can_start(), "compressed all-reduce of '{}': codec {} has no asynchronous form", name_,
           options_.codec.to_string());
  MT_CHECK(!started_, "compressed all-reduce of '{}': start() twice without finish()", name_);
  if (grad.size() != numel_) {
    throw ShapeError(fmt::format(
        "compressed all-reduce of '{}' ({} elements, codec {}): got a gradient of {} elements",
        name_, numel_, options_.codec.to_string(), grad.size()));
  }
  encoder_->encode(grad, codec_seed(options_.codec.seed, comm_.rank(), step_), payload_);
  const PlannedCollective& call = plan_.front();
  const CollectiveOptions& co = options_.collective;
  handle_ =
      call.kind == Collective::all_gather
          ? comm_.all_gather_async(payload_.data(), gathered_.data(), call.count, call.dtype, co)
          : comm_.all_reduce_async(payload_.data(), payload_.data(), numel_, call.dtype,
                                   ReduceOp::avg, co);
  started_ = true;
  ++step_;
}

void CompressedAllReduce::wait() {
  if (!handle_.valid()) return;
  const CommHandle h = handle_;
  handle_ = CommHandle();
  h.wait();
}

void CompressedAllReduce::finish(std::span<float> out) {
  MT_CHECK(started_, "compressed all-reduce of '{}': finish() without start()", name_);
  MT_CHECK_EQ(out.size(), numel_);
  wait();
  started_ = false;
  std::fill(out.begin(), out.end(), 0.0f);
  if (plan_.front().kind == Collective::all_reduce) {  // a cast, reduced in its own dtype
    encoder_->codec().decode_add(payload_, encoder_->scale(), out);
    return;
  }
  decode_payloads(out);
}

void CompressedAllReduce::decode_payloads(std::span<float> out) {
  const PayloadCodec& codec = encoder_->codec();
  const size_t bytes = payload_.size();
  const int n = comm_.size();
  for (int r = 0; r < n; ++r) {
    codec.decode_add(
        std::span<const std::byte>(gathered_).subspan(static_cast<size_t>(r) * bytes, bytes),
        encoder_->scale(), out);
  }
  if (n > 1) {
    const auto fn = static_cast<float>(n);
    for (float& v : out) v /= fn;
  }
}

std::span<const float> CompressedAllReduce::residual() const {
  if (encoder_) return encoder_->residual();
  return residual_;
}

size_t CompressedAllReduce::state_numel() const {
  return residual().size() + q_.size();
}

void CompressedAllReduce::save_state(std::span<float> out) const {
  MT_CHECK_EQ(out.size(), state_numel());
  const std::span<const float> r = residual();
  std::copy(r.begin(), r.end(), out.begin());
  std::copy(q_.begin(), q_.end(), out.begin() + static_cast<std::ptrdiff_t>(r.size()));
}

void CompressedAllReduce::load_state(std::span<const float> in, uint64_t steps) {
  MT_CHECK_EQ(in.size(), state_numel());
  const size_t nr = residual().size();
  if (encoder_) {
    encoder_->set_residual(in.first(nr));
  } else {
    std::copy(in.begin(), in.begin() + static_cast<std::ptrdiff_t>(nr), residual_.begin());
  }
  std::copy(in.begin() + static_cast<std::ptrdiff_t>(nr), in.end(), q_.begin());
  step_ = steps;
}

CodecTraffic CompressedAllReduce::predicted_traffic() const {
  return predict_traffic(comm_, plan_, options_.collective);
}

void CompressedAllReduce::run(std::span<const float> grad, std::span<float> out) {
  if (grad.size() != numel_ || out.size() != numel_) {
    throw ShapeError(fmt::format(
        "compressed all-reduce of '{}' ({} elements, codec {}): got a gradient of {} and an "
        "output of {} elements",
        name_, numel_, options_.codec.to_string(), grad.size(), out.size()));
  }
  if (numel_ > 0) {
    switch (options_.codec.kind) {
      case CodecKind::none:
        if (out.data() != grad.data()) std::copy(grad.begin(), grad.end(), out.begin());
        comm_.all_reduce(out.data(), out.data(), numel_, DType::f32, ReduceOp::avg,
                         options_.collective);
        break;
      case CodecKind::powersgd:
        run_powersgd(grad, out);
        break;
      default:
        run_payload(grad, out);
        break;
    }
  }
  ++step_;
}

void CompressedAllReduce::run_payload(std::span<const float> grad, std::span<float> out) {
  const CodecSpec& spec = options_.codec;
  const PayloadCodec& codec = encoder_->codec();
  const CollectiveOptions& co = options_.collective;
  encoder_->encode(grad, codec_seed(spec.seed, comm_.rank(), step_), payload_);
  std::fill(out.begin(), out.end(), 0.0f);
  const PlannedCollective& call = plan_.front();
  if (call.kind == Collective::all_reduce) {
    if (call.dtype == DType::f32) {  // sparse, densified on request
      codec.decode_add(payload_, encoder_->scale(), out);
      comm_.all_reduce(out.data(), out.data(), numel_, DType::f32, ReduceOp::avg, co);
    } else {  // a cast, reduced in its own dtype
      comm_.all_reduce(payload_.data(), payload_.data(), numel_, call.dtype, ReduceOp::avg, co);
      codec.decode_add(payload_, encoder_->scale(), out);
    }
    return;
  }
  // All-gather of n payloads, decoded and summed in rank order (the same
  // arithmetic on every rank, so the same bits), then / n.
  comm_.all_gather(payload_.data(), gathered_.data(), call.count, call.dtype, co);
  decode_payloads(out);
}

void CompressedAllReduce::run_powersgd(std::span<const float> grad, std::span<float> out) {
  const CollectiveOptions& co = options_.collective;
  std::span<float> p = powersgd_project(grad);
  comm_.all_reduce(p.data(), p.data(), p.size(), DType::f32, ReduceOp::avg, co);
  if (low_rank_) {
    std::span<float> q = powersgd_back_project();
    comm_.all_reduce(q.data(), q.data(), q.size(), DType::f32, ReduceOp::avg, co);
  }
  powersgd_expand(out);
}

std::span<float> CompressedAllReduce::powersgd_project(std::span<const float> grad) {
  MT_CHECK(options_.codec.kind == CodecKind::powersgd);
  MT_CHECK_EQ(grad.size(), numel_);
  const CodecSpec& spec = options_.codec;
  for (size_t i = 0; i < numel_; ++i) {
    e_[i] = spec.error_feedback ? grad[i] + residual_[i] : grad[i];
  }
  if (!low_rank_) return e_;  // averaged whole; nothing held back
  const int r = spec.rank;
  const auto R = static_cast<size_t>(r);
  // Q columns that are zero (the first step; or a direction that vanished
  // from P) are drawn afresh. Q is identical on every rank (the same draw,
  // or the previous all-reduced Q), so the draw keys on the step alone.
  for (size_t c = 0; c < R; ++c) {
    bool zero = true;
    for (size_t j = 0; j < cols_ && zero; ++j) zero = q_[j * R + c] == 0.0f;
    if (!zero) continue;
    Rng rng(codec_seed(spec.seed, -1, step_ * R + c));
    for (size_t j = 0; j < cols_; ++j) q_[j * R + c] = static_cast<float>(rng.normal());
  }
  mt::powersgd_project(e_, rows_, cols_, q_, r, p_);
  return p_;
}

std::span<float> CompressedAllReduce::powersgd_back_project() {
  MT_CHECK(low_rank_);
  const int r = options_.codec.rank;
  orthogonalize_columns(p_, rows_, r);
  mt::powersgd_back_project(e_, rows_, cols_, p_, r, q_);
  return q_;
}

void CompressedAllReduce::powersgd_expand(std::span<float> out) {
  MT_CHECK_EQ(out.size(), numel_);
  if (!low_rank_) {
    std::copy(e_.begin(), e_.end(), out.begin());
    return;
  }
  mt::powersgd_expand(p_, q_, rows_, cols_, options_.codec.rank, out);
  if (options_.codec.error_feedback) {
    for (size_t i = 0; i < numel_; ++i) residual_[i] = e_[i] - out[i];
  }
}

void CompressedAllReduce::powersgd_count_step() {
  ++step_;
}

}  // namespace mt
