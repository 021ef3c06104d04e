// Timeline: three local ranks record spans (two threads each) and merge them
// into one Chrome trace that parses as JSON, with every rank's events under
// its pid, non-negative durations, process and lane metadata, and causal
// order across ranks kept by the clock alignment; disabled timelines record
// nothing; spans, args and the event cap behave; a failed write fails on
// every rank.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <thread>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "meshtrain/base/timer.h"
#include "meshtrain/comm/backends/local/local_world.h"
#include "meshtrain/comm/backends/self/self_transport.h"
#include "meshtrain/train/timeline.h"

namespace mt {
namespace {

// A scratch directory, removed at the end of the test.
class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = std::filesystem::temp_directory_path() /
            fmt::format("mt-timeline-{}-{}", info->name(), ::getpid());
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string str() const { return path_.string(); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

LocalWorldOptions world(int size) {
  LocalWorldOptions o;
  o.size = size;
  o.comm.timeout = std::chrono::milliseconds(10'000);
  return o;
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path;
  return nlohmann::json::parse(in);
}

TEST(Timeline, ThreeRanksMergeIntoOneTraceWithEveryRanksEvents) {
  TempDir dir;
  const std::string path = dir.file("trace.json");
  constexpr int kRanks = 3;
  constexpr int kSteps = 4;
  LocalWorld::run(world(kRanks), [&](Communicator& comm) {
    Timeline tl;
    tl.set_enabled(true);
    tl.align(comm);
    EXPECT_EQ(tl.alignment(), Timeline::Alignment::shared_clock);
    EXPECT_GE(tl.alignment_skew_us(), 0.0);
    // A second thread records at the same time, as the comm progress thread does.
    std::thread progress([&] {
      for (int s = 0; s < kSteps; ++s) {
        const int64_t t0 = now_ns();
        tl.add("all_reduce", "comm", t0, now_ns(), Timeline::kComm,
               {{"bytes", 4096 * (s + 1)}, {"step", s}});
      }
    });
    for (int s = 0; s < kSteps; ++s) {
      auto step = tl.span("step", "step", Timeline::kCompute, {{"step", s}});
      {
        auto op = tl.span("matmul", "op");
        op.set_arg("flops", 2.0e6);
      }
      const int64_t w0 = now_ns();
      comm.barrier();
      tl.add("barrier", "wait", w0, now_ns(), Timeline::kWait);
    }
    progress.join();
    EXPECT_EQ(tl.size(), size_t{kSteps * 4});
    tl.merge_and_write(comm, path);
  });

  ASSERT_TRUE(std::filesystem::exists(path));
  const nlohmann::json trace = read_json(path);
  EXPECT_EQ(trace.at("displayTimeUnit"), "ms");
  const auto& events = trace.at("traceEvents");
  ASSERT_TRUE(events.is_array());
  std::map<int, std::multiset<std::string>> names_by_pid;
  std::map<int, std::string> process_names;
  std::set<std::pair<int, int>> named_lanes;
  for (const auto& e : events) {
    const int pid = e.at("pid");
    const std::string ph = e.at("ph");
    if (ph == "M") {
      if (e.at("name") == "process_name") process_names[pid] = e.at("args").at("name");
      if (e.at("name") == "thread_name") named_lanes.insert({pid, e.at("tid")});
      continue;
    }
    ASSERT_EQ(ph, "X");
    EXPECT_GE(e.at("dur").get<double>(), 0.0) << e.dump();
    EXPECT_GT(e.at("ts").get<double>(), -1e6) << "more than a second before the epoch";
    names_by_pid[pid].insert(e.at("name").get<std::string>());
    const std::string name = e.at("name");
    if (name == "all_reduce") {
      EXPECT_EQ(e.at("tid"), Timeline::kComm);
      EXPECT_EQ(e.at("cat"), "comm");
      EXPECT_EQ(e.at("args").at("bytes").get<int>() % 4096, 0);
    } else if (name == "matmul") {
      EXPECT_EQ(e.at("args").at("flops"), 2.0e6);
      EXPECT_EQ(e.at("tid"), Timeline::kCompute);
    } else if (name == "step") {
      EXPECT_TRUE(e.at("args").contains("step"));
    }
  }
  ASSERT_EQ(names_by_pid.size(), size_t{kRanks});
  for (int r = 0; r < kRanks; ++r) {
    const auto& names = names_by_pid[r];
    EXPECT_EQ(names.count("step"), size_t{kSteps}) << "rank " << r;
    EXPECT_EQ(names.count("matmul"), size_t{kSteps}) << "rank " << r;
    EXPECT_EQ(names.count("all_reduce"), size_t{kSteps}) << "rank " << r;
    EXPECT_EQ(names.count("barrier"), size_t{kSteps}) << "rank " << r;
    EXPECT_EQ(process_names[r], fmt::format("rank {}", r));
    for (int lane : {Timeline::kCompute, Timeline::kComm, Timeline::kWait}) {
      EXPECT_TRUE(named_lanes.count({r, lane})) << "rank " << r << " lane " << lane;
    }
  }
  // Only the trace itself is left: the temporary was renamed over it.
  size_t files = 0;
  for ([[maybe_unused]] const auto& f : std::filesystem::directory_iterator(dir.str())) ++files;
  EXPECT_EQ(files, 1u);
}

TEST(Timeline, AlignmentKeepsCausalOrderAcrossRanks) {
  // Rank 0 ends a span, then sends; rank 1 starts its span after receiving.
  // On the merged time axis rank 1's span must not start before rank 0's ended.
  TempDir dir;
  const std::string path = dir.file("causal.json");
  LocalWorld::run(world(2), [&](Communicator& comm) {
    Timeline tl(TimelineOptions{});
    tl.align(comm);
    int32_t token = 7;
    for (int i = 0; i < 3; ++i) {
      if (comm.rank() == 0) {
        { auto s = tl.span("before_send", "op"); }
        comm.send(&token, 1, DType::i32, 1);
      } else {
        comm.recv(&token, 1, DType::i32, 0);
        auto s = tl.span("after_recv", "op");
      }
    }
    tl.merge_and_write(comm, path);
  });
  const nlohmann::json trace = read_json(path);
  std::vector<double> sent_end, received_start;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.at("name") == "before_send") {
      sent_end.push_back(e.at("ts").get<double>() + e.at("dur").get<double>());
    }
    if (e.at("name") == "after_recv") received_start.push_back(e.at("ts").get<double>());
  }
  ASSERT_EQ(sent_end.size(), 3u);
  ASSERT_EQ(received_start.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_LE(sent_end[i], received_start[i]) << i;
}

TEST(Timeline, BarrierAlignmentGivesEachRankItsOwnZero) {
  LocalWorld::run(world(3), [&](Communicator& comm) {
    TimelineOptions opts;
    opts.use_shared_clock = false;
    Timeline tl(opts);
    const int64_t before = now_ns();
    tl.align(comm);
    const int64_t after = now_ns();
    EXPECT_EQ(tl.alignment(), Timeline::Alignment::barrier);
    // The zero is this rank's own reading at the barrier exit.
    EXPECT_GE(tl.epoch_ns(), before);
    EXPECT_LE(tl.epoch_ns(), after);
    EXPECT_GE(tl.alignment_skew_us(), 0.0);
    EXPECT_LT(tl.alignment_skew_us(), 5e6) << "skew estimate of more than 5 s";
    EXPECT_GE(tl.now_us(), 0.0);
    EXPECT_NE(tl.serialize(comm.rank()).find("clock aligned at a barrier exit, error about"),
              std::string::npos);
  });
}

TEST(Timeline, DisabledRecordsNothingAndSpansAreCheap) {
  Timeline tl;
  EXPECT_FALSE(tl.enabled());
  tl.add("x", "op", 0, 10);
  { auto s = tl.span("y", "op"); }
  EXPECT_EQ(tl.size(), 0u);
  tl.set_enabled(true);
  tl.add("x", "op", 100, 250, Timeline::kCompute);
  EXPECT_EQ(tl.size(), 1u);
  tl.set_enabled(false);
  tl.add("x", "op", 100, 250);
  EXPECT_EQ(tl.size(), 1u);
  const auto events = tl.events();
  EXPECT_EQ(events[0].duration_ns, 150);
}

TEST(Timeline, SpansMoveAndEndOnceAndArgsMustBeObjects) {
  Timeline tl(TimelineOptions{});
  {
    auto a = tl.span("a", "op", 5, {{"k", 1}});
    Timeline::Span b = std::move(a);
    a.end();  // moved-from: nothing
    b.set_arg("k", 2);
    b.end();
    b.end();  // already ended: nothing
  }
  ASSERT_EQ(tl.size(), 1u);
  const TimelineEvent e = tl.events()[0];
  EXPECT_EQ(e.name, "a");
  EXPECT_EQ(e.lane, 5);
  EXPECT_EQ(e.args.at("k"), 2);
  EXPECT_GE(e.duration_ns, 0);
  EXPECT_THROW(tl.add("bad", "op", 10, 5), InternalError);
  EXPECT_THROW(tl.add("bad", "op", 0, 5, 0, nlohmann::json::array({1})), InternalError);
  EXPECT_THROW((void)tl.span("bad", "op", 0, nlohmann::json::array({1})), InternalError);
  EXPECT_EQ(tl.size(), 1u);
}

TEST(Timeline, ConcurrentRecordingLosesNothingAndTheCapCountsDrops) {
  Timeline tl(TimelineOptions{true, 3000});
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&tl, t] {
      for (int i = 0; i < 1000; ++i) tl.add("e", "op", i, i + 1, t);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(tl.size(), 3000u);
  EXPECT_EQ(tl.dropped(), 1000u);
  // The drop count is shown in the trace.
  EXPECT_NE(tl.serialize(0).find("1000 events dropped"), std::string::npos);
  tl.clear();
  EXPECT_EQ(tl.size(), 0u);
  EXPECT_EQ(tl.dropped(), 0u);
}

TEST(Timeline, SingleRankWriteAndCustomLaneNames) {
  TempDir dir;
  Timeline tl(TimelineOptions{});
  auto comm = make_self_communicator();
  tl.align(*comm);
  tl.set_lane_name(7, "data loader");
  const int64_t t0 = now_ns();
  tl.add("load", "data", t0, t0 + 2'500, 7);
  tl.add("odd \"name\"\n", "op", t0, t0 + 1, 9);  // escaped in JSON
  tl.write(dir.file("one.json"));
  const nlohmann::json trace = read_json(dir.file("one.json"));
  std::map<int, std::string> lanes;
  bool found = false;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.at("name") == "thread_name") lanes[e.at("tid")] = e.at("args").at("name");
    if (e.at("name") == "load") {
      EXPECT_DOUBLE_EQ(e.at("dur").get<double>(), 2.5);
      found = true;
    }
  }
  EXPECT_TRUE(found);
  EXPECT_EQ(lanes[7], "data loader");
  EXPECT_EQ(lanes[9], "lane 9");
  EXPECT_EQ(lanes[0], "compute");
}

TEST(Timeline, FailedWriteFailsOnEveryRank) {
  TempDir dir;
  const std::string path = dir.file("missing-dir/trace.json");
  const auto errors = LocalWorld::run_collect(world(3), [&](Communicator& comm) {
    Timeline tl(TimelineOptions{});
    tl.align(comm);
    const int64_t t0 = now_ns();
    tl.add("x", "op", t0, t0 + 10);
    tl.merge_and_write(comm, path);
  });
  for (size_t r = 0; r < errors.size(); ++r) {
    ASSERT_TRUE(errors[r]) << "rank " << r << " did not throw";
    try {
      std::rethrow_exception(errors[r]);
    } catch (const FileError& e) {
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "rank " << r << ": " << e.what();
    }
  }
  EXPECT_FALSE(std::filesystem::exists(path));
}

}  // namespace
}  // namespace mt
