#include "meshtrain/sync/replica_sync.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "meshtrain/base/error.h"
#include "meshtrain/sync/codec_spec.h"
#include "meshtrain/sync/data_parallel_sync.h"
#include "meshtrain/sync/local_steps.h"
#include "meshtrain/sync/param_server.h"

namespace mt {

namespace {

// Synchronous all-reduce data parallelism (ZeRO 0-3): DataParallel itself.
class AllReduceSync : public DataParallelSync {
 public:
  AllReduceSync(Communicator& group, ParamLayout layout, Tensor flat, DataParallelOptions o)
      : group_(group), dp_(group, std::move(layout), std::move(flat), std::move(o)) {}

  std::string name() const override { return "allreduce"; }
  uint64_t bytes_sent() const override { return sync_bytes_sent(group_); }

 protected:
  DataParallel& dp() override { return dp_; }
  const DataParallel& dp() const override { return dp_; }

 private:
  Communicator& group_;
  DataParallel dp_;
};

}  // namespace

void ReplicaSync::serve(const ServerUpdate& /*update*/) {
  throw ConfigError(fmt::format("sync.scheme = \"{}\" has no server ranks", name()));
}

double codec_warmup_fraction(const SyncOptions& o, double f, int64_t step) {
  if (step >= o.codec_warmup_steps) return f;
  // Stage s covers steps [s N / S, (s + 1) N / S) rounded up at both ends.
  int s = 0;
  while (s + 1 < kCodecWarmupStages &&
         step * kCodecWarmupStages >= (s + 1) * o.codec_warmup_steps) {
    ++s;
  }
  const double d0 = o.codec_warmup_density;
  return std::min(1.0, d0 * std::pow(f / d0, static_cast<double>(s) / kCodecWarmupStages));
}

uint64_t sync_bytes_sent(const Communicator& c) {
  uint64_t n = 0;
  for (const auto& [kind, counter] : c.counters().by_collective) {
    if (kind != "handshake") n += counter.bytes_sent;
  }
  return n;
}

namespace {

// Which schemes a codec composes with, and why the others refuse it.
void validate_codec_scheme(const SyncOptions& o, const CodecSpec& spec) {
  if ((o.scheme == "gossip" || o.scheme == "adpsgd") && !o.codec_error_feedback) {
    throw ConfigError(fmt::format(
        "sync.codec_error_feedback = false with sync.scheme = \"{}\" and sync.codec = \"{}\": "
        "compressed gossip (CHOCO-SGD) sends the difference between a replica's parameters and "
        "its public copy, and that difference is its error feedback; there is no variant "
        "without it (set it to true)",
        o.scheme, o.codec));
  }
  if (o.scheme == "diloco" && o.outer_bits != 32) {
    // Fragments and overlap compose (each fragment's pieces through the
    // codec, sync/local_steps.h); the 4-bit exchange would compress twice.
    throw ConfigError(fmt::format(
        "sync.codec = \"{}\" with sync.outer_bits = {}: the 4-bit outer exchange is a codec of "
        "its own, so a codec on DiLoCo's pseudo-gradient needs sync.outer_bits = 32 (or drop "
        "sync.codec)",
        o.codec, o.outer_bits));
  }
}

}  // namespace

void validate_sync_options(const SyncOptions& o) {
  static const std::set<std::string> schemes = {"allreduce", "local_sgd", "diloco", "gossip",
                                                "ps",        "partial",   "adpsgd"};
  if (!schemes.count(o.scheme)) {
    throw ConfigError(fmt::format(
        "sync.scheme: unknown scheme '{}' (expected allreduce, local_sgd, diloco, gossip, "
        "adpsgd, partial or ps)",
        o.scheme));
  }
  if (o.servers < 1) {
    throw ConfigError(
        fmt::format("sync.servers: the parameter-server ranks must be >= 1, got {}", o.servers));
  }
  if (o.ps_mode != "bsp" && o.ps_mode != "asp" && o.ps_mode != "ssp") {
    throw ConfigError(
        fmt::format("sync.ps_mode: unknown mode '{}' (expected bsp, asp or ssp)", o.ps_mode));
  }
  if (o.staleness < 0) {
    throw ConfigError(fmt::format(
        "sync.staleness: the SSP staleness bound must be >= 0 steps, got {}", o.staleness));
  }
  if (!o.ps_switch.empty() && o.ps_switch != "straggler") {
    int64_t n = -1;
    size_t used = 0;
    try {
      if (o.ps_switch.starts_with("after:")) n = std::stoll(o.ps_switch.substr(6), &used);
    } catch (const std::exception&) {
      n = -1;
    }
    if (n < 1 || used != o.ps_switch.size() - 6) {
      throw ConfigError(
          fmt::format("sync.ps_switch: expected \"\", \"after:N\" (N >= 1 BSP steps, then ASP) or "
                      "\"straggler\", got '{}'",
                      o.ps_switch));
    }
  }
  if (!o.ps_switch.empty() && o.ps_mode != "bsp") {
    throw ConfigError(fmt::format(
        "sync.ps_switch = \"{}\": switching starts synchronous, so sync.ps_mode must be "
        "\"bsp\" (got \"{}\")",
        o.ps_switch, o.ps_mode));
  }
  if (o.period < 1) {
    throw ConfigError(fmt::format(
        "sync.period: the steps between synchronizations must be >= 1, got {}", o.period));
  }
  if (o.sync_until < 0) {
    throw ConfigError(fmt::format("sync.sync_until: must be >= 0, got {}", o.sync_until));
  }
  if (!(o.outer_lr > 0) || !std::isfinite(o.outer_lr)) {
    throw ConfigError(
        fmt::format("sync.outer_lr: DiLoCo's outer learning rate must be > 0, got {}", o.outer_lr));
  }
  if (!(o.outer_momentum >= 0 && o.outer_momentum < 1)) {
    throw ConfigError(
        fmt::format("sync.outer_momentum: must be in [0, 1), got {}", o.outer_momentum));
  }
  if (o.fragments < 1) {
    throw ConfigError(fmt::format(
        "sync.fragments: Streaming DiLoCo's fragments must be >= 1 (1 = the whole model at "
        "once), got {}",
        o.fragments));
  }
  if (o.overlap_steps < 0 || o.overlap_steps >= o.period) {
    throw ConfigError(fmt::format(
        "sync.overlap_steps: the inner steps a fragment's exchange overlaps must be in [0, "
        "sync.period) = [0, {}) so it lands before the fragment's next synchronization, got {}",
        o.period, o.overlap_steps));
  }
  if (!(o.merge_alpha >= 0 && o.merge_alpha <= 1)) {
    throw ConfigError(
        fmt::format("sync.merge_alpha: the local parameters' weight in the merge must be in "
                    "[0, 1], got {}",
                    o.merge_alpha));
  }
  if (o.outer_bits != 32 && o.outer_bits != 4) {
    throw ConfigError(fmt::format(
        "sync.outer_bits: the outer exchange sends 32-bit floats or 4-bit codes, so 32 or 4, "
        "got {}",
        o.outer_bits));
  }
  if (o.outer_exchange != "all_gather" && o.outer_exchange != "reduce_scatter") {
    throw ConfigError(
        fmt::format("sync.outer_exchange: expected \"all_gather\" or \"reduce_scatter\", got '{}'",
                    o.outer_exchange));
  }
  if (o.outer_exchange != "all_gather" && o.outer_bits != 4) {
    throw ConfigError(
        fmt::format("sync.outer_exchange = \"{}\": chooses how 4-bit payloads travel, so it needs "
                    "sync.outer_bits = 4 (got {}; 32-bit exchanges are one f32 all-reduce)",
                    o.outer_exchange, o.outer_bits));
  }
  if (o.scheme != "diloco") {
    const char* key = o.fragments != 1       ? "sync.fragments"
                      : o.overlap_steps != 0 ? "sync.overlap_steps"
                      : o.outer_bits != 32   ? "sync.outer_bits"
                                             : nullptr;
    if (key != nullptr) {
      throw ConfigError(fmt::format(
          "{}: Streaming DiLoCo's options apply to sync.scheme = \"diloco\" only, not \"{}\"", key,
          o.scheme));
    }
  }
  static const std::set<std::string> topologies = {"ring", "torus", "exponential", "complete"};
  if (!topologies.count(o.topology)) {
    throw ConfigError(fmt::format(
        "sync.topology: unknown topology '{}' (expected ring, torus, exponential or complete)",
        o.topology));
  }
  {
    const CodecSpec spec = parse_codec_spec(o.codec);  // ConfigError naming sync.codec
    if (spec.kind != CodecKind::none) validate_codec_scheme(o, spec);
    if (!(o.codec_momentum >= 0 && o.codec_momentum < 1)) {
      throw ConfigError(fmt::format(
          "sync.codec_momentum: the momentum factor must be in [0, 1), got {}", o.codec_momentum));
    }
    if (o.codec_momentum > 0 && (o.scheme != "allreduce" || spec.kind != CodecKind::topk)) {
      throw ConfigError(fmt::format(
          "sync.codec_momentum: momentum correction (Deep Gradient Compression) applies to "
          "sync.scheme = \"allreduce\" with a topk sync.codec, not to sync.scheme = \"{}\" with "
          "sync.codec = \"{}\"",
          o.scheme, o.codec));
    }
  }
  if (o.powersgd_batched &&
      (o.scheme != "allreduce" || parse_codec_spec(o.codec).kind != CodecKind::powersgd)) {
    throw ConfigError(fmt::format(
        "sync.powersgd_batched: batching PowerSGD's factors applies to sync.scheme = "
        "\"allreduce\" with sync.codec = \"powersgd:R\", not to sync.scheme = \"{}\" with "
        "sync.codec = \"{}\"",
        o.scheme, o.codec));
  }
  if (o.codec_warmup_steps < 0) {
    throw ConfigError(
        fmt::format("sync.codec_warmup_steps: the sparsity warm-up's steps must be >= 0, got {}",
                    o.codec_warmup_steps));
  }
  if (o.codec_warmup_steps > 0) {
    const CodecSpec spec = parse_codec_spec(o.codec);
    if (o.scheme != "allreduce" || spec.kind != CodecKind::topk || spec.k_count > 0) {
      throw ConfigError(fmt::format(
          "sync.codec_warmup_steps: the sparsity warm-up applies to sync.scheme = \"allreduce\" "
          "with a topk sync.codec whose k is a fraction (e.g. \"topk:0.01\"), not to "
          "sync.scheme = \"{}\" with sync.codec = \"{}\"",
          o.scheme, o.codec));
    }
    if (!(o.codec_warmup_density >= spec.k_fraction && o.codec_warmup_density <= 1)) {
      throw ConfigError(fmt::format(
          "sync.codec_warmup_density: the warm-up's first density must be in [{}, 1] (from the "
          "codec's fraction up to every element), got {}",
          spec.k_fraction, o.codec_warmup_density));
    }
  }
  if (!(o.gossip_gamma > 0 && o.gossip_gamma <= 1)) {
    throw ConfigError(fmt::format(
        "sync.gossip_gamma: the consensus step size of compressed gossip must be in (0, 1], got "
        "{}",
        o.gossip_gamma));
  }
  if (o.gossip_gamma != 1 && ((o.scheme != "gossip" && o.scheme != "adpsgd") ||
                              parse_codec_spec(o.codec).kind == CodecKind::none)) {
    throw ConfigError(fmt::format(
        "sync.gossip_gamma = {}: the consensus step size applies to sync.scheme = \"gossip\" or "
        "\"adpsgd\" with a sync.codec (CHOCO-SGD), not to sync.scheme = \"{}\" with "
        "sync.codec = \"{}\"",
        o.gossip_gamma, o.scheme, o.codec));
  }
  if (o.consensus_every < 0) {
    throw ConfigError(fmt::format("sync.consensus_every: must be >= 0 (0 = at the end), got {}",
                                  o.consensus_every));
  }
}

std::vector<int> gossip_neighbours(const std::string& topology, int rank, int n) {
  std::set<int> out;
  auto add = [&](int q) {
    q = ((q % n) + n) % n;
    if (q != rank) out.insert(q);
  };
  if (topology == "ring") {
    add(rank - 1);
    add(rank + 1);
  } else if (topology == "torus") {
    int a = 1;
    for (int d = 1; d * d <= n; ++d) {
      if (n % d == 0) a = d;
    }
    const int b = n / a;  // a rows x b columns
    const int row = rank / b, col = rank % b;
    auto at = [&](int r, int c) { return ((r + a) % a) * b + ((c + b) % b); };
    add(at(row - 1, col));
    add(at(row + 1, col));
    add(at(row, col - 1));
    add(at(row, col + 1));
  } else if (topology == "exponential") {
    for (int k = 1; k < n; k *= 2) {
      add(rank + k);
      add(rank - k);
    }
  } else if (topology == "complete") {
    for (int q = 0; q < n; ++q) add(q);
  } else {
    throw ConfigError(fmt::format("sync.topology: unknown topology '{}'", topology));
  }
  return {out.begin(), out.end()};
}

std::unique_ptr<ReplicaSync> make_replica_sync(const SyncOptions& o, Communicator& group,
                                               ParamLayout layout, Tensor flat_params,
                                               DataParallelOptions dp, double local_share) {
  validate_sync_options(o);
  if (o.scheme == "allreduce" && parse_codec_spec(o.codec).kind != CodecKind::none) {
    return make_compressed_sync(o, group, std::move(layout), std::move(flat_params), std::move(dp),
                                local_share);
  }
  if (o.scheme == "allreduce") {
    return std::make_unique<AllReduceSync>(group, std::move(layout), std::move(flat_params),
                                           std::move(dp));
  }
  if (o.scheme == "ps") {
    return make_param_server_sync(o, group, std::move(layout), std::move(flat_params),
                                  std::move(dp), local_share);
  }
  return make_local_steps_sync(o, group, std::move(layout), std::move(flat_params), std::move(dp),
                               local_share);
}

}  // namespace mt
