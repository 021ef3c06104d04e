// Timeline: spans of compute, communication and waiting, written as one
// Chrome trace / Perfetto JSON file for all ranks of a run
// ({"traceEvents": [...], "displayTimeUnit": "ms"}; open it in
// ui.perfetto.dev or chrome://tracing).
//
// Each span is a complete event ("ph": "X") with a name, a category ("op",
// "comm", "wait", "step", "optimizer", ...), start and duration in
// microseconds since a common epoch, pid = rank, tid = a lane (kCompute,
// kComm for the comm progress thread, kWait for waits on peers, or any other
// small integer) and optional args (bytes, step, FLOPs, ...).
//
// Clock alignment: align() (collective) defines the epoch. Ranks whose clocks
// are one clock (same kernel boot, so std::chrono::steady_clock is the same
// CLOCK_MONOTONIC in every process: threads of a LocalWorld, MPI ranks on one
// node) all take rank 0's barrier-exit time as the epoch, so their spans are
// exactly comparable. Otherwise each rank takes its own steady_clock time at
// the exit of a barrier as its zero; the error is then how far apart the
// ranks leave the barrier, about one message latency of the barrier's last
// round plus scheduling delay (microseconds on an idle network, more under
// load). alignment_skew_us() reports the measured exit spread: exact on one
// clock, an estimate from a second barrier otherwise; the merged trace labels
// every rank with its alignment. Without align() each rank's epoch is the
// Timeline's construction time.
//
// Ownership: one Timeline per rank, owned by the trainer. Thread-safe:
// add() and spans may be recorded from any thread (the comm progress thread
// records too); when disabled they cost one relaxed atomic load (build args
// only when enabled(), or add them with Span::set_arg, a no-op then). Events are
// kept in memory until written; after max_events further ones are dropped
// and counted. align() and merge_and_write() are collective and block.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "meshtrain/comm/communicator.h"

namespace mt {

struct TimelineOptions {
  bool enabled = true;
  size_t max_events = 2'000'000;  // per rank; later events are dropped and counted
  // false: align() always uses each rank's own barrier exit, even on one
  // clock (for tests, or processes in different time namespaces).
  bool use_shared_clock = true;
};

// One recorded span; times are steady_clock nanoseconds (now_ns()).
struct TimelineEvent {
  std::string name;
  std::string category;
  int64_t start_ns = 0;
  int64_t duration_ns = 0;
  int lane = 0;
  nlohmann::json args;  // null or an object
};

class Timeline {
 public:
  static constexpr int kCompute = 0;
  static constexpr int kComm = 1;
  static constexpr int kWait = 2;

  // How align() chose the epoch.
  enum class Alignment : uint8_t { none, shared_clock, barrier };

  // Disabled: records nothing.
  Timeline();
  explicit Timeline(TimelineOptions options);
  Timeline(const Timeline&) = delete;
  Timeline& operator=(const Timeline&) = delete;

  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }
  void set_enabled(bool on) { enabled_.store(on, std::memory_order_relaxed); }

  // Collective over comm: agrees on the epoch as described above and
  // remembers comm.rank() as this timeline's pid. Call it once, early (spans
  // recorded earlier are kept, with timestamps relative to the new epoch).
  void align(Communicator& comm, const CollectiveOptions& opts = {});
  Alignment alignment() const { return alignment_; }
  double alignment_skew_us() const { return alignment_skew_us_; }
  int64_t epoch_ns() const { return epoch_ns_; }
  // Microseconds since the epoch, now.
  double now_us() const;

  // Records a span [start_ns, end_ns] of steady_clock nanoseconds (now_ns()).
  // end_ns >= start_ns; args is null or a JSON object.
  void add(std::string_view name, std::string_view category, int64_t start_ns, int64_t end_ns,
           int lane = kCompute, nlohmann::json args = {});

  // Records from construction to end() or destruction. Movable.
  class Span {
   public:
    Span() = default;
    Span(Span&& other) noexcept;
    Span& operator=(Span&& other) noexcept;
    ~Span() { end(); }
    // Adds or replaces an arg (e.g. bytes known only at the end).
    void set_arg(const std::string& key, nlohmann::json value);
    void end();

   private:
    friend class Timeline;
    Span(Timeline* tl, std::string_view name, std::string_view category, int lane,
         nlohmann::json args);
    Timeline* timeline_ = nullptr;  // null: disabled or ended
    std::string name_;
    std::string category_;
    int lane_ = 0;
    int64_t start_ns_ = 0;
    nlohmann::json args_;
  };
  [[nodiscard]] Span span(std::string_view name, std::string_view category, int lane = kCompute,
                          nlohmann::json args = {});

  // Lane names shown in the trace; kCompute/kComm/kWait are named already.
  void set_lane_name(int lane, std::string name);

  size_t size() const;
  size_t dropped() const;
  std::vector<TimelineEvent> events() const;
  void clear();

  // This rank's metadata and events as comma-separated JSON objects (the
  // inside of the traceEvents array), with pid = `pid`.
  std::string serialize(int pid) const;
  // Writes this rank's events alone as a trace file, atomically.
  void write(const std::string& path) const;
  // Collective: gathers every rank's events to rank 0, which writes one trace
  // file atomically (temporary file + rename). When writing fails every rank
  // throws the same FileError; a failed transfer throws CommError.
  void merge_and_write(Communicator& comm, const std::string& path,
                       const CollectiveOptions& opts = {}) const;

 private:
  std::atomic<bool> enabled_{false};
  size_t max_events_ = 0;
  bool use_shared_clock_ = true;
  int64_t epoch_ns_ = 0;
  int pid_ = 0;
  Alignment alignment_ = Alignment::none;
  double alignment_skew_us_ = 0;

  mutable std::mutex mu_;
  std::vector<TimelineEvent> events_;
  size_t dropped_ = 0;
  std::map<int, std::string> lane_names_;
};

std::string_view alignment_name(Timeline::Alignment a);

// Writes a trace file from serialize() bodies (one per rank), atomically, in
// the format merge_and_write() writes (the planner's simulator uses it, so a
// predicted timeline and a measured one have one format). FileError on failure.
void write_trace_file(const std::string& path, const std::vector<std::string>& bodies);

}  // namespace mt
