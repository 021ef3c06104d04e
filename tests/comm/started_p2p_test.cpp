// Communicator::send_now / recv_now (local backend, threads as ranks): the
// messages arrive in order and intact, matched by tag; each is counted as a
// send / recv call with its exact bytes and reported to the call observer
// once, when its handle finds it complete; behind a queued async call a
// started one waits its turn (issue order); a receive nobody answers times
// out naming the communicator, the peer and the bytes, and leaves the
// communicator refusing further calls (one from a peer that is gone
// fails naming it, at once); a send whose handle was dropped is
// still delivered and counted; without shared memory (ranks on several
// nodes) they queue for the progress thread and deliver all the same.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "meshtrain/base/error.h"
#include "meshtrain/comm/backends/local/local_world.h"
#include "meshtrain/comm/communicator.h"

namespace mt {
namespace {

using namespace std::chrono_literals;

TEST(StartedP2P, DeliversInOrderAndCountsExactly) {
  LocalWorld::run(2, [](Communicator& c) {
    std::atomic<int> observed{0};
    c.set_call_observer([&](const CallEvent& e) {
      if (e.kind == Collective::send || e.kind == Collective::recv) ++observed;
    });
    CollectiveOptions a, b;
    a.tag = 3;
    b.tag = 4;
    if (c.rank() == 0) {
      std::vector<float> x(1000), y(10);
      for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i);
      for (size_t i = 0; i < y.size(); ++i) y[i] = -static_cast<float>(i);
      // Tag 4 first: the receiver waits for tag 3 first, matching by tag.
      CommHandle hy = c.send_now(y.data(), y.size(), DType::f32, 1, b);
      CommHandle hx = c.send_now(x.data(), x.size(), DType::f32, 1, a);
      Tensor t = Tensor::empty(Shape{7}, DType::f32);
      for (int i = 0; i < 7; ++i) t.data<float>()[i] = 0.5f * static_cast<float>(i);
      CommHandle ht = c.send_now(t, 1, a);  // the handle keeps t alive
      t = Tensor();
      hx.wait();
      hy.wait();
      ht.wait();
      EXPECT_TRUE(hx.done());
      const CommCounters k = c.counters();
      ASSERT_TRUE(k.by_collective.count("send"));
      EXPECT_EQ(k.by_collective.at("send").calls, 3u);
      EXPECT_EQ(k.by_collective.at("send").bytes_sent, 4u * (1000 + 10 + 7));
      EXPECT_EQ(k.by_peer[1].bytes_sent, 4u * (1000 + 10 + 7));
      EXPECT_EQ(k.total_sent(), 4u * (1000 + 10 + 7));
      EXPECT_EQ(observed.load(), 3);
    } else {
      std::vector<float> x(1000, 7.0f), y(10, 7.0f);
      Tensor t = Tensor::empty(Shape{7}, DType::f32);
      CommHandle hx = c.recv_now(x.data(), x.size(), DType::f32, 0, a);
      CommHandle ht = c.recv_now(t, 0, a);
      CommHandle hy = c.recv_now(y.data(), y.size(), DType::f32, 0, b);
      hx.wait();
      ht.wait();
      hy.wait();
      for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(x[i], static_cast<float>(i)) << i;
      for (size_t i = 0; i < y.size(); ++i) ASSERT_EQ(y[i], -static_cast<float>(i)) << i;
      for (int i = 0; i < 7; ++i) EXPECT_EQ(t.data<float>()[i], 0.5f * static_cast<float>(i));
      const CommCounters k = c.counters();
      ASSERT_TRUE(k.by_collective.count("recv"));
      EXPECT_EQ(k.by_collective.at("recv").calls, 3u);
      EXPECT_EQ(k.by_collective.at("recv").bytes_received, 4u * (1000 + 10 + 7));
      EXPECT_EQ(k.total_sent(), 0u);
      EXPECT_EQ(observed.load(), 3);
    }
    c.set_call_observer(nullptr);
  });
}

TEST(StartedP2P, WithoutSharedMemoryTheyQueueAndStillDeliver) {
  LocalWorldOptions o;
  o.size = 2;
  o.shm_bytes_per_rank = 0;  // as ranks on several nodes
  LocalWorld::run(o, [](Communicator& c) {
    ASSERT_FALSE(c.has_shared_memory());
    CollectiveOptions tag;
    tag.tag = 2;
    std::vector<int32_t> v(300);
    if (c.rank() == 0) {
      for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<int32_t>(i);
      c.send_now(v.data(), v.size(), DType::i32, 1, tag).wait();
      EXPECT_EQ(c.counters().by_collective.at("send").bytes_sent, 1200u);
    } else {
      c.recv_now(v.data(), v.size(), DType::i32, 0, tag).wait();
      EXPECT_EQ(v[299], 299);
      EXPECT_EQ(c.counters().by_collective.at("recv").bytes_received, 1200u);
    }
  });
}

TEST(StartedP2P, QueuesBehindAsyncCallsInIssueOrder) {
  LocalWorld::run(2, [](Communicator& c) {
    CollectiveOptions tag;
    tag.tag = 9;
    std::vector<int32_t> v(64);
    if (c.rank() == 0) {
      // An all-reduce still queued or running: the started sends go behind it.
      Tensor s = Tensor::empty(Shape{256}, DType::f32);
      s.fill(1.0f);
      CommHandle ar = c.all_reduce_async(s);
      std::vector<CommHandle> hs;
      for (int i = 0; i < 4; ++i) {
        std::vector<int32_t> w(64, i);
        hs.push_back(c.send_now(w.data(), w.size(), DType::i32, 1, tag));
        hs.back().wait();  // w goes out of scope
      }
      ar.wait();
      EXPECT_EQ(s.data<float>()[0], 2.0f);
    } else {
      Tensor s = Tensor::empty(Shape{256}, DType::f32);
      s.fill(1.0f);
      c.all_reduce(s);
      for (int i = 0; i < 4; ++i) {
        CommHandle h = c.recv_now(v.data(), v.size(), DType::i32, 0, tag);
        h.wait();
        EXPECT_EQ(v[0], i);
        EXPECT_EQ(v[63], i);
      }
    }
  });
}

TEST(StartedP2P, UnansweredReceiveTimesOutAndBreaksTheCommunicator) {
  LocalWorldOptions o;
  o.size = 2;
  o.comm.timeout = 300ms;
  std::atomic<bool> finished{false};
  LocalWorld::run(o, [&](Communicator& c) {
    if (c.rank() == 0) {
      // Alive, but silent, until rank 1 is done (a returned rank is "gone").
      while (!finished.load()) std::this_thread::sleep_for(1ms);
    } else {
      std::vector<float> x(16);
      CommHandle h = c.recv_now(x.data(), x.size(), DType::f32, 0);
      try {
        h.wait();
        ADD_FAILURE() << "no TimeoutError";
      } catch (const TimeoutError& e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find("rank 1 of 2"), std::string::npos) << msg;
        EXPECT_NE(msg.find("recv of 64 bytes from rank 0"), std::string::npos) << msg;
        EXPECT_NE(msg.find("timed out"), std::string::npos) << msg;
      }
      EXPECT_TRUE(h.done());
      EXPECT_THROW(h.wait(), TimeoutError);  // the handle keeps its error
      EXPECT_TRUE(c.broken().has_value());
      EXPECT_THROW(c.recv_now(x.data(), x.size(), DType::f32, 0), CommError);
      EXPECT_EQ(c.counters().total_received(), 0u);
      finished = true;
    }
  });
}

TEST(StartedP2P, ReceiveFromAPeerThatIsGoneFailsNamingIt) {
  LocalWorld::run_collect({}, [](Communicator& c) {
    if (c.rank() == 1) {
      std::vector<float> x(16);
      CommHandle h = c.recv_now(x.data(), x.size(), DType::f32, 0);
      try {
        h.wait();
        ADD_FAILURE() << "no CommError";
      } catch (const TimeoutError& e) {
        ADD_FAILURE() << "a timeout instead of the lost peer: " << e.what();
      } catch (const CommError& e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find("rank 0"), std::string::npos) << msg;
        EXPECT_NE(msg.find("gone"), std::string::npos) << msg;
      }
      EXPECT_TRUE(c.broken().has_value());
    }
  });
}

TEST(StartedP2P, DroppedSendHandleIsStillDeliveredAndCounted) {
  LocalWorld::run(2, [](Communicator& c) {
    CollectiveOptions tag;
    tag.tag = 1;
    if (c.rank() == 0) {
      Tensor t = Tensor::empty(Shape{100}, DType::f32);
      t.fill(3.0f);
      c.send_now(t, 1, tag);  // handle dropped at once
      int32_t done = 0;
      c.recv(&done, 1, DType::i32, 1, tag);  // the receiver has it
      // A later started call drives the earlier one to its end.
      int32_t x = 5;
      c.send_now(&x, 1, DType::i32, 1, tag).wait();
      EXPECT_EQ(c.counters().by_collective.at("send").calls, 2u);
      EXPECT_EQ(c.counters().by_collective.at("send").bytes_sent, 404u);
    } else {
      Tensor t = Tensor::empty(Shape{100}, DType::f32);
      c.recv_now(t, 0, tag).wait();
      EXPECT_EQ(t.data<float>()[99], 3.0f);
      int32_t done = 1;
      c.send(&done, 1, DType::i32, 0, tag);
      int32_t x = 0;
      c.recv(&x, 1, DType::i32, 0, tag);
      EXPECT_EQ(x, 5);
    }
  });
}

}  // namespace
}  // namespace mt
