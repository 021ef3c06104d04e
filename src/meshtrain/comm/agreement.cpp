#include "meshtrain/comm/agreement.h"

#include <cstring>

#include <fmt/format.h>
#include <vector>

namespace mt::comm {

uint64_t hash_counts(std::span<const size_t> counts) {
  // FNV-1a over the count values; collisions only weaken a diagnostic.
  uint64_t h = 1469598103934665603ull;
  for (size_t c : counts) {
    for (int b = 0; b < 8; ++b) {
      h ^= (static_cast<uint64_t>(c) >> (8 * b)) & 0xff;
      h *= 1099511628211ull;
    }
  }
  return h;
}

CallRecord make_record(const CallInfo& call, uint64_t counts_hash, CommAlgorithm requested) {
  CallRecord r;
  r.seq = call.seq;
  r.kind = static_cast<uint8_t>(call.kind);
  r.dtype = static_cast<uint8_t>(call.dtype);
  r.count = call.count;
  r.counts_hash = counts_hash;
  r.bytes = call.bytes;
  r.tag = call.tag;
  r.algorithm = static_cast<uint8_t>(requested);
  const bool reduces = call.kind == Collective::all_reduce ||
                       call.kind == Collective::reduce_scatter ||
                       call.kind == Collective::reduce_scatterv;
  r.op = reduces ? static_cast<uint8_t>(call.op) : 0;
  r.root = call.kind == Collective::broadcast ? call.root : -1;
  return r;
}

std::string describe_record(const CallRecord& r) {
  const auto kind = static_cast<Collective>(r.kind);
  std::string s = fmt::format("{} #{} ({} x {}", collective_name(kind), r.seq,
                              dtype_name(static_cast<DType>(r.dtype)), r.count);
  if (kind == Collective::all_gatherv || kind == Collective::reduce_scatterv) {
    s += fmt::format(", counts hash {:016x}", r.counts_hash);
  }
  if (kind == Collective::all_reduce || kind == Collective::reduce_scatter ||
      kind == Collective::reduce_scatterv) {
    s += fmt::format(", {}", reduce_op_name(static_cast<ReduceOp>(r.op)));
  }
  if (kind == Collective::broadcast) s += fmt::format(", root {}", r.root);
  if (r.tag != 0) s += fmt::format(", tag {}", r.tag);
  return s +
         fmt::format(", algorithm {})", algorithm_name(static_cast<CommAlgorithm>(r.algorithm)));
}

namespace {
bool same_call(const CallRecord& a, const CallRecord& b) {
  return a.seq == b.seq && a.kind == b.kind && a.dtype == b.dtype && a.count == b.count &&
         a.counts_hash == b.counts_hash && a.tag == b.tag && a.root == b.root && a.op == b.op &&
         a.algorithm == b.algorithm;
}
}  // namespace

std::optional<std::string> find_mismatch(const std::string& comm_name,
                                         std::span<const CallRecord> records) {
  bool all_same = true;
  for (const CallRecord& r : records) all_same = all_same && same_call(r, records[0]);
  if (all_same) return std::nullopt;
  // Group ranks by the call they made, in order of first appearance.
  std::vector<std::vector<size_t>> groups;
  for (size_t i = 0; i < records.size(); ++i) {
    bool placed = false;
    for (auto& g : groups) {
      if (same_call(records[g[0]], records[i])) {
        g.push_back(i);
        placed = true;
        break;
      }
    }
    if (!placed) groups.push_back({i});
  }
  std::string msg =
      fmt::format("collective mismatch in comm '{}' ({} ranks): ", comm_name, records.size());
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    const auto& g = groups[gi];
    std::string ranks;
    for (size_t i = 0; i < g.size(); ++i) ranks += fmt::format("{}{}", i ? ", " : "", g[i]);
    msg += fmt::format("{}{} {} called {}", gi ? "; " : "", g.size() == 1 ? "rank" : "ranks", ranks,
                       describe_record(records[g[0]]));
  }
  return msg;
}

}  // namespace mt::comm
