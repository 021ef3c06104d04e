#include "meshtrain/sync/consistency.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <map>

#include "meshtrain/base/error.h"
#include "meshtrain/base/timer.h"

namespace mt {

namespace {

// Odd multipliers (so multiplication is a bijection mod 2^64) with well-mixed
// bits; any such constants would do.
constexpr uint64_t kMulA = 0x9E3779B97F4A7C15ull;
constexpr uint64_t kMulB = 0xC2B2AE3D27D4EB4Full;
constexpr uint64_t kMulC = 0xD6E8FEB86659FD93ull;

inline uint64_t load64(const unsigned char* p) {
  uint64_t w;
  std::memcpy(&w, p, sizeof w);
  return w;
}

// For a fixed word this is a bijection of acc, and for a fixed acc a
// bijection of the word: a changed word always changes the lane.
inline uint64_t absorb(uint64_t acc, uint64_t word) {
  return std::rotl(acc ^ (word * kMulB), 29) * kMulA;
}

// Bijective avalanche: xor-shifts and odd multiplications.
inline uint64_t avalanche(uint64_t h) {
  h ^= h >> 32;
  h *= kMulC;
  h ^= h >> 29;
  h *= kMulA;
  h ^= h >> 32;
  return h;
}

std::string describe_entry(const std::string& name, const Tensor& t) {
  return fmt::format("'{}' {}", name, t.desc());
}

// Gathers one string per rank (lengths first, then the bytes).
std::vector<std::string> gather_strings(Communicator& comm, const std::string& mine,
                                        const CollectiveOptions& opts) {
  const auto n = static_cast<size_t>(comm.size());
  std::vector<int64_t> lengths(n);
  const int64_t my_length = static_cast<int64_t>(mine.size());
  comm.all_gather(&my_length, lengths.data(), 1, DType::i64, opts);
  std::vector<size_t> counts(n);
  size_t total = 0;
  for (size_t r = 0; r < n; ++r) {
    counts[r] = static_cast<size_t>(lengths[r]);
    total += counts[r];
  }
  std::string all(total, '\0');
  comm.all_gatherv(mine.data(), all.data(), counts, DType::u8, opts);
  std::vector<std::string> out(n);
  size_t offset = 0;
  for (size_t r = 0; r < n; ++r) {
    out[r] = all.substr(offset, counts[r]);
    offset += counts[r];
  }
  return out;
}

std::vector<std::string> split_lines(const std::string& s) {
  std::vector<std::string> lines;
  size_t start = 0;
  while (start < s.size()) {
    size_t end = s.find('\n', start);
    if (end == std::string::npos) end = s.size();
    lines.push_back(s.substr(start, end - start));
    start = end + 1;
  }
  return lines;
}

// "ranks 0,2 have A, rank 1 has B": groups of ranks with equal values, the
// largest group first (the odd one out reads last), ties by lowest rank.
template <class Value, class Format>
std::string describe_groups(const std::vector<Value>& per_rank, Format format) {
  std::map<Value, std::vector<int>> groups;
  for (size_t r = 0; r < per_rank.size(); ++r) groups[per_rank[r]].push_back(static_cast<int>(r));
  std::vector<std::pair<Value, std::vector<int>>> ordered(groups.begin(), groups.end());
  std::sort(ordered.begin(), ordered.end(), [](const auto& a, const auto& b) {
    if (a.second.size() != b.second.size()) return a.second.size() > b.second.size();
    return a.second.front() < b.second.front();
  });
  std::string out;
  for (const auto& [value, ranks] : ordered) {
    if (!out.empty()) out += ", ";
    out += fmt::format("{} {} {} {}", ranks.size() == 1 ? "rank" : "ranks", format_rank_list(ranks),
                       ranks.size() == 1 ? "has" : "have", format(value));
  }
  return out;
}

}  // namespace

uint64_t checksum_bytes(const void* data, size_t n, uint64_t seed) {
  const auto* p = static_cast<const unsigned char*>(data);
  // Four independent lanes keep four multiply chains in flight.
  uint64_t a = seed ^ kMulA, b = seed ^ kMulB, c = seed ^ kMulC, d = seed + kMulA + kMulB;
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    a = absorb(a, load64(p + i));
    b = absorb(b, load64(p + i + 8));
    c = absorb(c, load64(p + i + 16));
    d = absorb(d, load64(p + i + 24));
  }
  uint64_t h = (seed ^ (static_cast<uint64_t>(n) * kMulC));
  h = (h ^ avalanche(a)) * kMulA;
  h = (h ^ avalanche(b)) * kMulA;
  h = (h ^ avalanche(c)) * kMulA;
  h = (h ^ avalanche(d)) * kMulA;
  for (; i + 8 <= n; i += 8) h = absorb(h, load64(p + i));
  if (i < n) {
    uint64_t last = 0;
    std::memcpy(&last, p + i, n - i);
    h = absorb(h, last);
  }
  return avalanche(h ^ n);
}

uint64_t tensor_fingerprint(const Tensor& t) {
  if (t.nbytes() == 0) return checksum_bytes(nullptr, 0);
  return checksum_bytes(t.raw(), t.nbytes());
}

std::string format_rank_list(std::span<const int> ranks) {
  std::string out;
  size_t i = 0;
  while (i < ranks.size()) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (!out.empty()) out += ',';
    if (j >= i + 2) {
      out += fmt::format("{}-{}", ranks[i], ranks[j]);
    } else {
      for (size_t k = i; k <= j; ++k) out += fmt::format("{}{}", k == i ? "" : ",", ranks[k]);
    }
    i = j + 1;
  }
  return out;
}

ConsistencyChecker::ConsistencyChecker(Communicator& comm, NamedTensors params,
                                       ConsistencyOptions options)
    : comm_(comm), params_(std::move(params)), options_(std::move(options)) {
  if (options_.every_steps < 0) {
    throw ConfigError(
        fmt::format("consistency check: every_steps must be >= 0, got {}", options_.every_steps));
  }
  for (const auto& [name, t] : params_) layout_ += describe_entry(name, t) + "\n";
  layout_hash_ = checksum_bytes(layout_.data(), layout_.size());
}

bool ConsistencyChecker::maybe_check(int64_t step) {
  if (options_.every_steps == 0 || step % options_.every_steps != 0) return false;
  check(step);
  return true;
}

void ConsistencyChecker::agree_on_layout(int64_t step) {
  const auto n = static_cast<size_t>(comm_.size());
  const int64_t mine[2] = {static_cast<int64_t>(params_.size()),
                           static_cast<int64_t>(layout_hash_)};
  std::vector<int64_t> all(2 * n);
  comm_.all_gather(mine, all.data(), 2, DType::i64, options_.collective);
  bool same = true;
  for (size_t r = 1; r < n; ++r) same = same && all[2 * r + 1] == all[1];
  if (same) return;

  // Every rank saw the same gathered hashes, so every rank takes this path
  // and the gather of the full lists below is matched everywhere.
  const std::vector<std::string> layouts = gather_strings(comm_, layout_, options_.collective);
  std::vector<std::vector<std::string>> lines;
  size_t longest = 0;
  for (const auto& l : layouts) {
    lines.push_back(split_lines(l));
    longest = std::max(longest, lines.back().size());
  }
  for (size_t i = 0; i < longest; ++i) {
    std::vector<std::string> entry;
    for (const auto& l : lines) entry.push_back(i < l.size() ? l[i] : "(no tensor)");
    if (std::all_of(entry.begin(), entry.end(), [&](const auto& e) { return e == entry[0]; })) {
      continue;
    }
    std::vector<int64_t> counts;
    for (const auto& l : lines) counts.push_back(static_cast<int64_t>(l.size()));
    throw MismatchError(fmt::format(
        "parameter divergence check at step {}: replicas hold different parameter lists: "
        "entry #{}: {}; list lengths: {} (communicator '{}')",
        step, i, describe_groups(entry, [](const std::string& s) { return s; }),
        describe_groups(counts, [](int64_t c) { return fmt::format("{} tensors", c); }),
        comm_.name()));
  }
  // Equal text with unequal hashes cannot happen; equal hashes of unequal
  // text would have been missed above, which is the 2^-64 collision case.
  MT_CHECK(false, "layout hashes differ but layouts are equal");
}

void ConsistencyChecker::check(int64_t step) {
  Stopwatch watch;
  agree_on_layout(step);

  const size_t count = params_.size();
  last_checksums_.resize(count);
  for (size_t i = 0; i < count; ++i) last_checksums_[i] = tensor_fingerprint(params_[i].second);

  const auto n = static_cast<size_t>(comm_.size());
  std::vector<uint64_t> all(count * n);
  if (count > 0) {
    comm_.all_gather(last_checksums_.data(), all.data(), count, DType::i64, options_.collective);
  }
  ++checks_done_;
  last_seconds_ = watch.seconds();

  std::vector<size_t> differing;
  for (size_t i = 0; i < count; ++i) {
    for (size_t r = 1; r < n; ++r) {
      if (all[r * count + i] != all[i]) {
        differing.push_back(i);
        break;
      }
    }
  }
  if (differing.empty()) return;

  const size_t first = differing.front();
  std::vector<uint64_t> per_rank(n);
  for (size_t r = 0; r < n; ++r) per_rank[r] = all[r * count + first];
  std::string others;
  constexpr size_t kMaxNamed = 5;
  for (size_t k = 1; k < differing.size() && k <= kMaxNamed; ++k) {
    others += fmt::format("{}'{}'", k == 1 ? "" : ", ", params_[differing[k]].first);
  }
  if (differing.size() > kMaxNamed + 1) others += ", ...";
  throw MismatchError(fmt::format(
      "parameter divergence at step {}: '{}' ({}) differs: {}; {} of {} tensors differ{}{} "
      "(communicator '{}')",
      step, params_[first].first, params_[first].second.desc(),
      describe_groups(per_rank, [](uint64_t h) { return fmt::format("{:016x}", h); }),
      differing.size(), count, others.empty() ? "" : ", also: ", others, comm_.name()));
}

}  // namespace mt
