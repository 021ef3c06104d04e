// Communicator::post_recv / wait_any (local backend, threads as ranks): a
// rank with receives posted from several peers gets whichever message
// arrives first, its bytes counted as a "recv" call; a timeout returns
// nullopt naming nobody (the caller knows whom it waits for); a second post
// to the same peer and a bad peer are refused; nothing posted returns at once.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>
#include <vector>

#include "meshtrain/base/error.h"
#include "meshtrain/comm/backends/local/local_world.h"
#include "meshtrain/comm/communicator.h"

namespace mt {
namespace {

using namespace std::chrono_literals;

TEST(PostedRecv, AnswersWhicheverPeerSendsFirst) {
  LocalWorld::run(3, [](Communicator& c) {
    CollectiveOptions tag;
    tag.tag = 7;
    if (c.rank() == 0) {
      std::vector<int32_t> from1(4, 0), from2(4, 0);
      c.post_recv(from1.data(), 4, DType::i32, 1, tag);
      c.post_recv(from2.data(), 4, DType::i32, 2, tag);
      EXPECT_TRUE(c.recv_posted(1));
      EXPECT_THROW(c.post_recv(from1.data(), 4, DType::i32, 1, tag), ConfigError);
      EXPECT_THROW(c.post_recv(from1.data(), 4, DType::i32, 0, tag), ConfigError);
      // Rank 2 sends at once, rank 1 only after rank 0 told it to go.
      auto first = c.wait_any(10'000ms);
      ASSERT_TRUE(first.has_value());
      EXPECT_EQ(first->peer, 2);
      EXPECT_FALSE(first->lost);
      EXPECT_EQ(from2, (std::vector<int32_t>{20, 21, 22, 23}));
      EXPECT_FALSE(c.recv_posted(2));
      // Only rank 1's receive is left, and it has not sent: a timeout.
      EXPECT_FALSE(c.wait_any(50ms).has_value());
      int32_t go = 1;
      c.send(&go, 1, DType::i32, 1, tag);
      auto second = c.wait_any(10'000ms);
      ASSERT_TRUE(second.has_value());
      EXPECT_EQ(second->peer, 1);
      EXPECT_EQ(from1, (std::vector<int32_t>{10, 11, 12, 13}));
      // Nothing posted: returns at once.
      const auto t0 = std::chrono::steady_clock::now();
      EXPECT_FALSE(c.wait_any(5'000ms).has_value());
      EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s);
      const CommCounters k = c.counters();
      ASSERT_TRUE(k.by_collective.count("recv"));
      EXPECT_EQ(k.by_collective.at("recv").calls, 2u);
      EXPECT_EQ(k.by_collective.at("recv").bytes_received, 32u);
      EXPECT_EQ(k.by_peer[1].bytes_received, 16u);
      EXPECT_EQ(k.by_peer[2].bytes_received, 16u);
    } else if (c.rank() == 1) {
      int32_t go = 0;
      c.recv(&go, 1, DType::i32, 0, tag);
      std::vector<int32_t> v = {10, 11, 12, 13};
      c.send(v.data(), 4, DType::i32, 0, tag);
    } else {
      std::vector<int32_t> v = {20, 21, 22, 23};
      c.send(v.data(), 4, DType::i32, 0, tag);
    }
  });
}

}  // namespace
}  // namespace mt
