// What goes wrong between ranks: mismatching calls (the same MismatchError on
// every rank, communicator still usable), a rank that never calls (a
// TimeoutError naming it, communicator unusable afterwards), a rank whose
// thread is gone (a CommError naming it, long before the timeout), the stall
// callback, bad arguments and async handles that time out.
#include <atomic>
#include <chrono>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "meshtrain/base/timer.h"
#include "meshtrain/comm/backends/local/local_world.h"
#include "meshtrain/comm/backends/self/self_transport.h"
#include "meshtrain/comm/communicator.h"

namespace mt {
namespace {

using ::testing::HasSubstr;

LocalWorldOptions world(int n, bool shm, int timeout_ms = 20'000) {
  LocalWorldOptions o;
  o.size = n;
  o.comm.timeout = std::chrono::milliseconds(timeout_ms);
  o.shm_bytes_per_rank = shm ? 64 * 1024 : 0;
  return o;
}

std::string message_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  }
}

template <class E>
bool is(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const E&) {
    return true;
  } catch (...) {
    return false;
  }
}

// Waits (bounded) until `flag` reaches `value`; the test fails if it never does.
void await(const std::atomic<int>& flag, int value) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (flag.load() < value && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

class CommErrors : public ::testing::TestWithParam<bool> {};

TEST_P(CommErrors, MismatchedCountRaisesTheSameErrorOnEveryRank) {
  std::vector<std::string> messages(3);
  auto errors = LocalWorld::run_collect(world(3, GetParam()), [&](Communicator& c) {
    std::vector<float> buf(1000, 1.0f);
    const size_t count = c.rank() == 2 ? 999 : 1000;
    try {
      c.all_reduce(buf.data(), buf.data(), count, DType::f32);
    } catch (const MismatchError& e) {
      messages[static_cast<size_t>(c.rank())] = e.what();
    }
    // The communicator is still usable after a mismatch.
    c.all_reduce(buf.data(), buf.data(), 1000, DType::f32);
    if (buf[0] != static_cast<float>(c.size()))
      throw std::runtime_error("wrong sum after mismatch");
  });
  for (const auto& e : errors) EXPECT_FALSE(e) << message_of(e);
  for (const auto& m : messages) {
    EXPECT_EQ(m, messages[0]);
    EXPECT_THAT(m, HasSubstr("ranks 0, 1 called all_reduce #1 (f32 x 1000, sum"));
    EXPECT_THAT(m, HasSubstr("rank 2 called all_reduce #1 (f32 x 999, sum"));
  }
}

TEST_P(CommErrors, DifferentCollectivesDtypesAndRootsAreMismatches) {
  auto errors = LocalWorld::run_collect(world(4, GetParam()), [&](Communicator& c) {
    std::vector<float> buf(64, 1.0f), out(64 * 4);
    auto expect_mismatch = [&](auto&& call, const char* needle) {
      try {
        call();
      } catch (const MismatchError& e) {
        if (std::string(e.what()).find(needle) == std::string::npos) {
          throw std::runtime_error(
              fmt::format("mismatch message lacks '{}': {}", needle, e.what()));
        }
        return;
      }
      throw std::runtime_error(fmt::format("rank {}: no MismatchError for {}", c.rank(), needle));
    };
    expect_mismatch(
        [&] {
          if (c.rank() == 1)
            c.all_gather(buf.data(), out.data(), 64, DType::f32);
          else
            c.all_reduce(buf.data(), buf.data(), 64, DType::f32);
        },
        "rank 1 called all_gather #1");
    expect_mismatch(
        [&] { c.all_reduce(buf.data(), buf.data(), 32, c.rank() == 3 ? DType::i32 : DType::f32); },
        "rank 3 called all_reduce #2 (i32 x 32");
    expect_mismatch([&] { c.broadcast(buf.data(), 64, DType::f32, c.rank() == 0 ? 1 : 0); },
                    "rank 0 called broadcast #3 (f32 x 64, root 1");
    expect_mismatch(
        [&] {
          c.all_reduce(buf.data(), buf.data(), 64, DType::f32,
                       c.rank() == 2 ? ReduceOp::max : ReduceOp::sum);
        },
        "rank 2 called all_reduce #4 (f32 x 64, max");
  });
  for (const auto& e : errors) EXPECT_FALSE(e) << message_of(e);
}

TEST_P(CommErrors, TimeoutNamesTheRankThatNeverCalls) {
  std::atomic<int> caught{0};
  std::vector<std::string> messages(3);
  auto errors = LocalWorld::run_collect(world(3, GetParam(), 300), [&](Communicator& c) {
    if (c.rank() == 2) {
      await(caught, 2);  // stays alive but never enters the collective
      return;
    }
    std::vector<float> buf(4096, 1.0f);
    Stopwatch sw;
    try {
      c.all_reduce(buf.data(), buf.data(), buf.size(), DType::f32);
    } catch (const TimeoutError& e) {
      messages[static_cast<size_t>(c.rank())] = e.what();
      if (sw.seconds() > 10) throw std::runtime_error("timeout took far longer than 300 ms");
    }
    caught.fetch_add(1);
    await(caught, 2);  // no rank is "gone" before both have timed out
    // After a timeout the communicator refuses further calls.
    try {
      c.barrier();
    } catch (const TimeoutError&) {
      throw std::runtime_error("barrier after a timeout waited instead of refusing");
    } catch (const CommError& e) {
      if (std::string(e.what()).find("unusable") == std::string::npos) throw;
      return;
    }
    throw std::runtime_error("barrier after a timeout did not throw");
  });
  for (const auto& e : errors) EXPECT_FALSE(e) << message_of(e);
  for (int r = 0; r < 2; ++r) {
    const std::string& m = messages[static_cast<size_t>(r)];
    EXPECT_THAT(m, HasSubstr(fmt::format("comm 'world' rank {} of 3", r)));
    EXPECT_THAT(m, HasSubstr("all_reduce #1 (f32 x 4096 = 16384 bytes"));
    EXPECT_THAT(m, HasSubstr("timed out after 0.300 s"));
    EXPECT_THAT(m, HasSubstr("rank 2"));
    if (GetParam()) {
      EXPECT_THAT(m, HasSubstr("ranks that have not entered all_reduce #1: rank 2 (has not "
                               "entered any collective yet)"));
    } else {
      EXPECT_THAT(m, HasSubstr("recv of 48 bytes from rank 2"));
    }
  }
}

TEST_P(CommErrors, TimeoutWithoutHandshakeNamesWhoIsMissingAfterEarlierCalls) {
  std::atomic<int> caught{0};
  std::vector<std::string> messages(3);
  LocalWorldOptions o = world(3, GetParam(), 300);
  o.comm.handshake = false;
  auto errors = LocalWorld::run_collect(o, [&](Communicator& c) {
    std::vector<float> buf(100, 1.0f);
    c.barrier();
    if (c.rank() == 1) {
      await(caught, 2);
      return;
    }
    CollectiveOptions ring;
    ring.algorithm = CommAlgorithm::ring;
    try {
      c.all_reduce(buf.data(), buf.data(), buf.size(), DType::f32, ReduceOp::sum, ring);
    } catch (const TimeoutError& e) {
      messages[static_cast<size_t>(c.rank())] = e.what();
    }
    caught.fetch_add(1);
    // Neither waiting rank returns before the other has timed out: a rank
    // whose thread has returned is "gone", which its peer would report
    // instead of its own timeout.
    await(caught, 2);
  });
  for (const auto& e : errors) EXPECT_FALSE(e) << message_of(e);
  for (int r : {0, 2}) {
    const std::string& m = messages[static_cast<size_t>(r)];
    EXPECT_THAT(m, HasSubstr("all_reduce #2"));
    if (GetParam()) {
      // The status board knows where every rank is.
      EXPECT_THAT(m, HasSubstr("ranks that have not entered all_reduce #2: rank 1 (last: "
                               "completed barrier #1"));
    }
  }
  // Without it, each rank names the peer it waits for: rank 2's left
  // neighbour in the ring is the missing rank 1 (rank 0 waits for rank 2).
  EXPECT_THAT(messages[2], HasSubstr("from rank 1"));
  EXPECT_THAT(messages[0], HasSubstr("from rank 2"));
}

TEST_P(CommErrors, LostPeerIsReportedBeforeTheTimeout) {
  std::vector<std::string> messages(3);
  auto errors = LocalWorld::run_collect(world(3, GetParam(), 20'000), [&](Communicator& c) {
    if (c.rank() == 1) throw std::runtime_error("rank 1 crashed on purpose");
    std::vector<float> buf(1000, 1.0f);
    Stopwatch sw;
    try {
      c.all_reduce(buf.data(), buf.data(), buf.size(), DType::f32);
    } catch (const TimeoutError&) {
      throw std::runtime_error("a lost peer was reported as a timeout");
    } catch (const CommError& e) {
      messages[static_cast<size_t>(c.rank())] = e.what();
      if (sw.seconds() > 5) throw std::runtime_error("lost peer took longer than 5 s to notice");
    }
  });
  EXPECT_FALSE(errors[0]) << message_of(errors[0]);
  EXPECT_FALSE(errors[2]) << message_of(errors[2]);
  for (int r : {0, 2}) {
    EXPECT_THAT(messages[static_cast<size_t>(r)],
                HasSubstr("rank 1 (local world rank 1) is gone: its thread ended with an error: "
                          "rank 1 crashed on purpose"));
  }
}

INSTANTIATE_TEST_SUITE_P(Arena, CommErrors, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& p) {
                           return p.param ? "shm" : "noshm";
                         });

TEST(CommErrorsStall, CallbackReportsWhoHasNotEntered) {
  std::atomic<int> caught{0};
  std::mutex mu;
  std::vector<std::string> reports;
  LocalWorldOptions o = world(3, true, 800);
  o.comm.stall_warning = std::chrono::milliseconds(50);
  o.comm.on_stall = [&](const std::string& report) {
    std::lock_guard<std::mutex> lock(mu);
    reports.push_back(report);
  };
  auto errors = LocalWorld::run_collect(o, [&](Communicator& c) {
    if (c.rank() == 0) {
      await(caught, 2);
      return;
    }
    std::vector<double> buf(10);
    try {
      c.all_reduce(buf.data(), buf.data(), buf.size(), DType::f64);
    } catch (const TimeoutError&) {
    }
    caught.fetch_add(1);
    await(caught, 2);  // no rank is "gone" before both have timed out
  });
  for (const auto& e : errors) EXPECT_FALSE(e) << message_of(e);
  ASSERT_EQ(reports.size(), 2u);
  for (const auto& r : reports) {
    EXPECT_THAT(r, HasSubstr("is stalled"));
    EXPECT_THAT(r, HasSubstr("ranks that have not entered all_reduce #1: rank 0"));
  }
}

TEST(CommErrorsArgs, BadArgumentsAreRejectedOnEveryRank) {
  auto errors = LocalWorld::run_collect(world(2, false), [&](Communicator& c) {
    Tensor in = Tensor::zeros(Shape{4}, DType::f32);
    Tensor wrong = Tensor::zeros(Shape{7}, DType::f32);
    EXPECT_THROW(c.all_gather(in, wrong), ShapeError);
    Tensor other = Tensor::zeros(Shape{8}, DType::f64);
    EXPECT_THROW(c.all_gather(in, other), ShapeError);
    EXPECT_THROW(c.send(in, c.rank()), ConfigError);
    EXPECT_THROW(c.send(in, 5), ConfigError);
    EXPECT_THROW(c.broadcast(in, 2), ConfigError);
    CollectiveOptions big_tag;
    big_tag.tag = kMaxUserTag + 1;
    EXPECT_THROW(c.barrier(big_tag), ConfigError);
    // Algorithms that do not apply, or that the transport lacks: every rank
    // agrees first, then every rank throws, and the communicator stays usable.
    CollectiveOptions ring;
    ring.algorithm = CommAlgorithm::ring;
    EXPECT_THROW(c.all_to_all(in, in, ring), ConfigError);
    CollectiveOptions shm;
    shm.algorithm = CommAlgorithm::shared_memory;
    EXPECT_THROW(c.all_reduce(in, ReduceOp::sum, shm), ConfigError);
    CollectiveOptions native;
    native.algorithm = CommAlgorithm::native;
    EXPECT_THROW(c.barrier(native), ConfigError);
    in.fill(1);
    c.all_reduce(in);
    EXPECT_EQ(in.item(3), 2);
  });
  for (const auto& e : errors) EXPECT_FALSE(e) << message_of(e);
}

TEST(CommErrorsAsync, HandleWaitTimesOutWhileThePeerIsLateThenCompletes) {
  std::atomic<int> step{0};
  auto errors = LocalWorld::run_collect(world(2, true), [&](Communicator& c) {
    Tensor t = Tensor::full(Shape{16}, DType::f32, c.rank() + 1);
    if (c.rank() == 1) {
      await(step, 1);  // rank 0's handle has timed out once
      c.all_reduce(t);
      return;
    }
    CommHandle h = c.all_reduce_async(t);
    EXPECT_THROW(h.wait(std::chrono::milliseconds(20)), TimeoutError);
    EXPECT_FALSE(h.done());
    step.store(1);
    h.wait(std::chrono::milliseconds(20'000));
    EXPECT_TRUE(h.done());
    EXPECT_EQ(t.item(0), 3);
  });
  for (const auto& e : errors) EXPECT_FALSE(e) << message_of(e);
}

TEST(CommErrorsP2p, ReceiveOfTheWrongSizeNamesBothSizes) {
  auto errors = LocalWorld::run_collect(world(2, false), [&](Communicator& c) {
    std::vector<float> buf(10);
    if (c.rank() == 0) {
      c.send(buf.data(), 10, DType::f32, 1);
      return;
    }
    try {
      c.recv(buf.data(), 5, DType::f32, 0);
    } catch (const CommError& e) {
      EXPECT_THAT(e.what(), HasSubstr("has 40 bytes but the receive expects 20"));
      return;
    }
    ADD_FAILURE() << "no error for a short receive";
  });
  for (const auto& e : errors) EXPECT_FALSE(e) << message_of(e);
}

TEST(CommSelf, WorldOfOneCopiesAndSplits) {
  auto c = make_self_communicator();
  EXPECT_EQ(c->size(), 1);
  EXPECT_EQ(c->backend(), "self");
  Tensor t = Tensor::full(Shape{3}, DType::bf16, 2.5);
  c->all_reduce(t, ReduceOp::avg);
  EXPECT_EQ(t.item(1), 2.5);
  Tensor out = Tensor::zeros(Shape{3}, DType::bf16);
  c->all_gather(t, out);
  EXPECT_EQ(out.item(2), 2.5);
  c->reduce_scatter(t, out);
  EXPECT_EQ(out.item(0), 2.5);
  c->barrier();
  auto sub = c->split(0, 0);
  ASSERT_NE(sub, nullptr);
  EXPECT_EQ(sub->size(), 1);
  EXPECT_EQ(c->split(-1, 0), nullptr);
}

}  // namespace
}  // namespace mt
