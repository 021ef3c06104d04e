#include "meshtrain/sync/straggler.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "meshtrain/base/error.h"

namespace mt {

double median_of(std::vector<double> values) {
  MT_CHECK(!values.empty(), "median of an empty list");
  const size_t mid = values.size() / 2;
  std::nth_element(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(mid), values.end());
  const double upper = values[mid];
  if (values.size() % 2 == 1) return upper;
  const double lower =
      *std::max_element(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(mid));
  return 0.5 * (lower + upper);
}

StragglerDetector::StragglerDetector(Communicator& comm, StragglerOptions options)
    : comm_(comm), options_(std::move(options)) {
  if (options_.every_steps < 1) {
    throw ConfigError(
        fmt::format("straggler detection: every_steps must be >= 1, got {}", options_.every_steps));
  }
  if (options_.window < 1) {
    throw ConfigError(
        fmt::format("straggler detection: window must be >= 1, got {}", options_.window));
  }
  if (!(options_.threshold > 1.0) || !std::isfinite(options_.threshold)) {
    throw ConfigError(fmt::format(
        "straggler detection: threshold must be a finite number > 1, got {}", options_.threshold));
  }
  if (options_.recover_threshold == 0) {
    options_.recover_threshold = 1.0 + (options_.threshold - 1.0) / 2;
  }
  if (!(options_.recover_threshold >= 1.0) || !(options_.recover_threshold <= options_.threshold)) {
    throw ConfigError(fmt::format(
        "straggler detection: recover_threshold must lie in [1, threshold = {}], got {}",
        options_.threshold, options_.recover_threshold));
  }
  if (options_.persist_windows < 0) {
    throw ConfigError(fmt::format("straggler detection: persist_windows must be >= 0, got {}",
                                  options_.persist_windows));
  }
  if (options_.repeat_gap_steps == -1) {
    options_.repeat_gap_steps = 10 * static_cast<int64_t>(options_.window);
  }
  if (options_.repeat_gap_steps < 0) {
    throw ConfigError(fmt::format(
        "straggler detection: repeat_gap_steps must be >= 0 (or -1 for 10 x window), got {}",
        options_.repeat_gap_steps));
  }
  const auto n = static_cast<size_t>(comm_.size());
  window_.resize(n);
  flagged_.assign(n, false);
  state_.assign(n, RankState{});
}

StragglerReport StragglerDetector::report(int64_t step, double compute_seconds) {
  if (!std::isfinite(compute_seconds) || compute_seconds < 0) {
    throw ConfigError(fmt::format(
        "straggler detection: rank {} reported step {} compute time {} s; expected a finite "
        "number >= 0",
        comm_.rank(), step, compute_seconds));
  }
  pending_steps_.push_back(step);
  pending_seconds_.push_back(compute_seconds);
  ++reports_;
  StragglerReport out;
  if (reports_ % options_.every_steps != 0) return out;
  exchange(out);
  judge(out);
  return out;
}

void StragglerDetector::exchange(StragglerReport& out) {
  const auto n = static_cast<size_t>(comm_.size());
  const size_t k = pending_steps_.size();
  // Step numbers travel with the times (exact as doubles below 2^53), so a
  // caller that desynchronises its ranks gets an error, not mixed-up windows.
  std::vector<double> mine(2 * k);
  for (size_t i = 0; i < k; ++i) {
    mine[2 * i] = static_cast<double>(pending_steps_[i]);
    mine[2 * i + 1] = pending_seconds_[i];
  }
  std::vector<double> all(2 * k * n);
  comm_.all_gather(mine.data(), all.data(), 2 * k, DType::f64, options_.collective);
  for (size_t r = 0; r < n; ++r) {
    for (size_t i = 0; i < k; ++i) {
      const double theirs = all[r * 2 * k + 2 * i];
      if (theirs != mine[2 * i]) {
        throw MismatchError(fmt::format(
            "straggler detection on communicator '{}': ranks report different steps: rank {} "
            "step {}, rank {} step {} (report() must be called at the same steps everywhere)",
            comm_.name(), comm_.rank(), pending_steps_[i], r, static_cast<int64_t>(theirs)));
      }
    }
  }
  out.exchanged = true;
  out.steps = pending_steps_;
  out.seconds.assign(k, std::vector<double>(n));
  const auto window = static_cast<size_t>(options_.window);
  for (size_t i = 0; i < k; ++i) {
    for (size_t r = 0; r < n; ++r) {
      const double s = all[r * 2 * k + 2 * i + 1];
      out.seconds[i][r] = s;
      window_[r].push_back(s);
      if (window_[r].size() > window) window_[r].pop_front();
    }
  }
  pending_steps_.clear();
  pending_seconds_.clear();
}

void StragglerDetector::judge(StragglerReport& out) {
  const auto n = static_cast<size_t>(comm_.size());
  if (window_[0].size() < static_cast<size_t>(options_.window)) return;
  out.window_median.resize(n);
  for (size_t r = 0; r < n; ++r) {
    out.window_median[r] = median_of({window_[r].begin(), window_[r].end()});
  }
  out.ratio.assign(n, 1.0);
  if (n < 2) return;
  const int64_t now = out.steps.back();
  const int64_t covered = last_judged_ < 0 ? 1 : now - last_judged_;
  last_judged_ = now;
  judged_steps_ += covered;
  // A change of state needs judgements that all disagree with the current
  // state from a first step to persist_windows windows later. The sliding
  // median turns once half a window disagrees and turns back once half of it
  // agrees again, so a burst of slow steps shorter than persist_windows
  // windows never changes the state.
  const int64_t persist_steps = static_cast<int64_t>(options_.persist_windows) * options_.window;
  for (size_t r = 0; r < n; ++r) {
    std::vector<double> others;
    for (size_t q = 0; q < n; ++q) {
      if (q != r) others.push_back(out.window_median[q]);
    }
    const double reference = median_of(std::move(others));
    const double mine = out.window_median[r];
    double ratio = 1.0;
    if (reference > 0) {
      ratio = mine / reference;
    } else if (mine > 0) {
      ratio = std::numeric_limits<double>::infinity();
    }
    out.ratio[r] = ratio;
    if (ratio > options_.threshold) out.stragglers.push_back(static_cast<int>(r));

    RankState& st = state_[r];
    st.last_ratio = ratio;
    // Between recover_threshold and threshold neither state is contradicted.
    const bool disagrees =
        st.straggler ? ratio <= options_.recover_threshold : ratio > options_.threshold;
    if (!disagrees) {
      st.change_since = -1;
    } else {
      if (st.change_since < 0) st.change_since = now;
      if (now - st.change_since >= persist_steps) {
        st.straggler = !st.straggler;
        st.change_since = -1;
        if (st.straggler) st.straggler_since = now;
      }
    }
    if (st.straggler) st.straggler_steps += covered;

    if (st.straggler == flagged_[r]) continue;
    if (options_.repeat_gap_steps > 0 && st.last_message >= 0 &&
        now - st.last_message < options_.repeat_gap_steps) {
      continue;  // announced when the gap ends, if the change still holds
    }
    flagged_[r] = st.straggler;
    st.last_message = now;
    const std::string what = st.straggler ? "is a straggler" : "recovered";
    out.messages.push_back(
        fmt::format("rank {} {}: median step {:.1f} ms vs {:.1f} ms for the others ({:.2f}x) "
                    "over the last {} steps",
                    r, what, mine * 1e3, reference * 1e3, ratio, options_.window));
    (st.straggler ? out.new_stragglers : out.recovered).push_back(static_cast<int>(r));
  }
}

std::vector<std::string> StragglerDetector::summary() const {
  std::vector<std::string> lines;
  for (size_t r = 0; r < state_.size(); ++r) {
    const RankState& st = state_[r];
    if (st.straggler_steps == 0) continue;
    lines.push_back(fmt::format(
        "straggler summary: rank {} was a straggler (median step over {:.2f}x the others') for "
        "{} of the {} steps judged; {}",
        r, options_.threshold, st.straggler_steps, judged_steps_,
        st.straggler
            ? fmt::format(
                  "not recovered by the end (last window {:.2f}x), a straggler since step {}",
                  st.last_ratio, st.straggler_since)
            : std::string("recovered")));
  }
  return lines;
}

}  // namespace mt
