#include "meshtrain/train/timeline.h"

#include <unistd.h>

#include <algorithm>
#include <climits>
#include <fstream>
#include <set>
#include <utility>

#include "meshtrain/base/error.h"
#include "meshtrain/base/timer.h"
#include "meshtrain/sync/consistency.h"
#include "meshtrain/train/atomic_file.h"

namespace mt {

namespace {

// Identifies the clock behind steady_clock: processes of one kernel boot share
// CLOCK_MONOTONIC. The boot id is unique per boot; the host name is the
// fallback where /proc is not readable (it can only err towards "different").
uint64_t clock_domain_id() {
  std::string id;
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  if (boot) std::getline(boot, id);
  if (id.empty()) {
    char host[HOST_NAME_MAX + 1] = {};
    if (::gethostname(host, sizeof host - 1) == 0) id = std::string("host:") + host;
  }
  if (id.empty()) id = "pid:" + std::to_string(::getpid());  // only this process
  return checksum_bytes(id.data(), id.size());
}

// Spread (max - min) of one value per rank.
double spread_of(const std::vector<int64_t>& v) {
  const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
  return static_cast<double>(*hi - *lo);
}

constexpr std::string_view kHeader = "{\"traceEvents\":[\n";
constexpr std::string_view kFooter = "\n],\"displayTimeUnit\":\"ms\"}\n";

}  // namespace

std::string_view alignment_name(Timeline::Alignment a) {
  switch (a) {
    case Timeline::Alignment::none:
      return "none";
    case Timeline::Alignment::shared_clock:
      return "shared_clock";
    case Timeline::Alignment::barrier:
      return "barrier";
  }
  return "?";
}

Timeline::Timeline() : Timeline(TimelineOptions{false, TimelineOptions{}.max_events, true}) {}

Timeline::Timeline(TimelineOptions options)
    : enabled_(options.enabled),
      max_events_(options.max_events),
      use_shared_clock_(options.use_shared_clock),
      epoch_ns_(now_ns()) {
  lane_names_[kCompute] = "compute";
  lane_names_[kComm] = "comm";
  lane_names_[kWait] = "wait";
}

void Timeline::align(Communicator& comm, const CollectiveOptions& opts) {
  const auto n = static_cast<size_t>(comm.size());
  const auto domain = static_cast<int64_t>(clock_domain_id());
  comm.barrier(opts);
  const int64_t exit_ns = now_ns();
  const int64_t mine[2] = {domain, exit_ns};
  std::vector<int64_t> all(2 * n);
  comm.all_gather(mine, all.data(), 2, DType::i64, opts);

  bool shared = use_shared_clock_;
  std::vector<int64_t> exits(n);
  for (size_t r = 0; r < n; ++r) {
    shared = shared && all[2 * r] == all[0];
    exits[r] = all[2 * r + 1];
  }
  pid_ = comm.rank();
  if (shared) {
    // One clock: rank 0's reading is a valid zero for everybody, and the
    // exit readings themselves show how far apart a barrier lets ranks go.
    epoch_ns_ = exits[0];
    alignment_ = Alignment::shared_clock;
    alignment_skew_us_ = spread_of(exits) / 1e3;
    return;
  }
  epoch_ns_ = exit_ns;
  alignment_ = Alignment::barrier;
  // The readings of different clocks cannot be compared; a second barrier,
  // read relative to each rank's new epoch, shows the exit spread instead.
  comm.barrier(opts);
  const int64_t since = now_ns() - epoch_ns_;
  std::vector<int64_t> second(n);
  comm.all_gather(&since, second.data(), 1, DType::i64, opts);
  alignment_skew_us_ = spread_of(second) / 1e3;
}

double Timeline::now_us() const {
  return static_cast<double>(now_ns() - epoch_ns_) / 1e3;
}

void Timeline::add(std::string_view name, std::string_view category, int64_t start_ns,
                   int64_t end_ns, int lane, nlohmann::json args) {
  if (!enabled()) return;
  MT_CHECK_GE(end_ns, start_ns);
  MT_CHECK(args.is_null() || args.is_object(), "timeline args must be a JSON object, got {}",
           args.dump());
  std::lock_guard lock(mu_);
  if (events_.size() >= max_events_) {
    ++dropped_;
    return;
  }
  events_.push_back(TimelineEvent{std::string(name), std::string(category), start_ns,
                                  end_ns - start_ns, lane, std::move(args)});
}

Timeline::Span::Span(Timeline* tl, std::string_view name, std::string_view category, int lane,
                     nlohmann::json args)
    : timeline_(tl),
      name_(name),
      category_(category),
      lane_(lane),
      start_ns_(now_ns()),
      args_(std::move(args)) {}

Timeline::Span::Span(Span&& other) noexcept
    : timeline_(std::exchange(other.timeline_, nullptr)),
      name_(std::move(other.name_)),
      category_(std::move(other.category_)),
      lane_(other.lane_),
      start_ns_(other.start_ns_),
      args_(std::move(other.args_)) {}

Timeline::Span& Timeline::Span::operator=(Span&& other) noexcept {
  if (this != &other) {
    end();
    timeline_ = std::exchange(other.timeline_, nullptr);
    name_ = std::move(other.name_);
    category_ = std::move(other.category_);
    lane_ = other.lane_;
    start_ns_ = other.start_ns_;
    args_ = std::move(other.args_);
  }
  return *this;
}

void Timeline::Span::set_arg(const std::string& key, nlohmann::json value) {
  if (timeline_ == nullptr) return;
  args_[key] = std::move(value);
}

void Timeline::Span::end() {
  if (timeline_ == nullptr) return;
  Timeline* tl = std::exchange(timeline_, nullptr);
  tl->add(name_, category_, start_ns_, now_ns(), lane_, std::move(args_));
}

Timeline::Span Timeline::span(std::string_view name, std::string_view category, int lane,
                              nlohmann::json args) {
  if (!enabled()) return Span();
  // Checked here, not when the span ends: ending runs in a destructor.
  MT_CHECK(args.is_null() || args.is_object(), "timeline args must be a JSON object, got {}",
           args.dump());
  return Span(this, name, category, lane, std::move(args));
}

void Timeline::set_lane_name(int lane, std::string name) {
  std::lock_guard lock(mu_);
  lane_names_[lane] = std::move(name);
}

size_t Timeline::size() const {
  std::lock_guard lock(mu_);
  return events_.size();
}

size_t Timeline::dropped() const {
  std::lock_guard lock(mu_);
  return dropped_;
}

std::vector<TimelineEvent> Timeline::events() const {
  std::lock_guard lock(mu_);
  return events_;
}

void Timeline::clear() {
  std::lock_guard lock(mu_);
  events_.clear();
  dropped_ = 0;
}

std::string Timeline::serialize(int pid) const {
  std::lock_guard lock(mu_);
  std::string out;
  const auto append = [&](const nlohmann::json& j) {
    if (!out.empty()) out += ",\n";
    out += j.dump();
  };
  const auto meta = [&](const char* name, int tid, nlohmann::json args) {
    append({{"name", name}, {"ph", "M"}, {"pid", pid}, {"tid", tid}, {"args", std::move(args)}});
  };
  meta("process_name", 0, {{"name", fmt::format("rank {}", pid)}});
  meta("process_sort_index", 0, {{"sort_index", pid}});
  std::string clock;
  switch (alignment_) {
    case Alignment::none:
      clock = "clock not aligned (zero = timeline creation)";
      break;
    case Alignment::shared_clock:
      clock = fmt::format("one clock for all ranks (exact); barrier exit skew {:.1f} us",
                          alignment_skew_us_);
      break;
    case Alignment::barrier:
      clock =
          fmt::format("clock aligned at a barrier exit, error about {:.1f} us", alignment_skew_us_);
      break;
  }
  meta("process_labels", 0, {{"labels", fmt::format("{}; {} events dropped", clock, dropped_)}});
  std::set<int> lanes;
  for (const auto& [lane, name] : lane_names_) lanes.insert(lane);
  for (const auto& e : events_) lanes.insert(e.lane);
  for (int lane : lanes) {
    const auto it = lane_names_.find(lane);
    meta("thread_name", lane,
         {{"name", it != lane_names_.end() ? it->second : fmt::format("lane {}", lane)}});
    meta("thread_sort_index", lane, {{"sort_index", lane}});
  }
  for (const auto& e : events_) {
    nlohmann::json j = {{"name", e.name},
                        {"cat", e.category},
                        {"ph", "X"},
                        {"ts", static_cast<double>(e.start_ns - epoch_ns_) / 1e3},
                        {"dur", static_cast<double>(e.duration_ns) / 1e3},
                        {"pid", pid},
                        {"tid", e.lane}};
    if (!e.args.is_null()) j["args"] = e.args;
    append(j);
  }
  return out;
}

void write_trace_file(const std::string& path, const std::vector<std::string>& bodies) {
  write_file_atomically(path, [&](const ByteSink& sink) {
    sink(kHeader.data(), kHeader.size());
    bool first = true;
    for (const std::string& b : bodies) {
      if (b.empty()) continue;
      if (!first) sink(",\n", 2);
      sink(b.data(), b.size());
      first = false;
    }
    sink(kFooter.data(), kFooter.size());
  });
}

void Timeline::write(const std::string& path) const {
  const std::string body = serialize(pid_);
  write_file_atomically(path, [&](const ByteSink& sink) {
    sink(kHeader.data(), kHeader.size());
    sink(body.data(), body.size());
    sink(kFooter.data(), kFooter.size());
  });
}

void Timeline::merge_and_write(Communicator& comm, const std::string& path,
                               const CollectiveOptions& opts) const {
  const auto n = static_cast<size_t>(comm.size());
  const std::string mine = serialize(comm.rank());
  const auto my_length = static_cast<int64_t>(mine.size());
  std::vector<int64_t> lengths(n);
  comm.all_gather(&my_length, lengths.data(), 1, DType::i64, opts);

  // Point-to-point to rank 0 rather than an all-gather: only the writer needs
  // the text, and traces can be large.
  std::string status;
  if (comm.rank() != 0) {
    if (my_length > 0) comm.send(mine.data(), mine.size(), DType::u8, 0, opts);
  } else {
    std::vector<std::string> parts(n);
    parts[0] = mine;
    for (size_t r = 1; r < n; ++r) {
      parts[r].resize(static_cast<size_t>(lengths[r]));
      if (lengths[r] > 0) {
        comm.recv(parts[r].data(), parts[r].size(), DType::u8, static_cast<int>(r), opts);
      }
    }
    try {
      write_file_atomically(path, [&](const ByteSink& sink) {
        sink(kHeader.data(), kHeader.size());
        bool first = true;
        for (const auto& p : parts) {
          if (p.empty()) continue;
          if (!first) sink(",\n", 2);
          sink(p.data(), p.size());
          first = false;
        }
        sink(kFooter.data(), kFooter.size());
      });
    } catch (const FileError& e) {
      status = e.what();
    }
  }
  // Every rank learns whether the file was written, so a failure surfaces
  // everywhere instead of only in rank 0's log.
  int64_t status_length = static_cast<int64_t>(status.size());
  comm.broadcast(&status_length, 1, DType::i64, 0, opts);
  status.resize(static_cast<size_t>(status_length));
  if (status_length > 0) comm.broadcast(status.data(), status.size(), DType::u8, 0, opts);
  if (!status.empty()) {
    throw FileError(fmt::format("timeline {} (written by rank 0): {}", path, status));
  }
}

}  // namespace mt
