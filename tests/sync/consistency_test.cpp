// Silent-divergence check: the checksum notices every single-word change
// wherever it sits; identical replicas pass at world sizes 1..4; one flipped
// float on one rank makes every rank throw the same MismatchError naming the
// step, the first differing tensor and the odd rank; no rank hangs when every
// rank differs or when the replicas hold different parameter lists.
#include <gtest/gtest.h>

#include <cstring>
#include <exception>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "meshtrain/comm/backends/local/local_world.h"
#include "meshtrain/sync/consistency.h"

namespace mt {
namespace {

using NamedTensors = ConsistencyChecker::NamedTensors;

LocalWorldOptions world(int size) {
  LocalWorldOptions o;
  o.size = size;
  // A hang would show up as a TimeoutError, which the tests reject.
  o.comm.timeout = std::chrono::milliseconds(10'000);
  return o;
}

// The same parameters on every replica: values depend only on the name's index.
NamedTensors make_params() {
  NamedTensors p;
  const std::vector<std::pair<std::string, Shape>> specs = {{"embed.w", Shape({7, 5})},
                                                            {"block0.attn.q.w", Shape({5, 5})},
                                                            {"block0.attn.q.b", Shape({5})},
                                                            {"head.w", Shape({5, 3})}};
  for (size_t i = 0; i < specs.size(); ++i) {
    Tensor t = Tensor::empty(specs[i].second, DType::f32);
    for (int64_t k = 0; k < t.numel(); ++k) {
      t.set_item(k, 0.01 * static_cast<double>(k) - 0.3 * static_cast<double>(i));
    }
    p.emplace_back(specs[i].first, t);
  }
  return p;
}

ConsistencyOptions every(int64_t steps) {
  ConsistencyOptions o;
  o.every_steps = steps;
  return o;
}

// Every rank must have thrown MismatchError, all with the same message.
std::string expect_all_mismatch(const std::vector<std::exception_ptr>& errors) {
  std::set<std::string> messages;
  for (size_t r = 0; r < errors.size(); ++r) {
    EXPECT_TRUE(errors[r] != nullptr) << "rank " << r << " did not throw";
    if (!errors[r]) continue;
    try {
      std::rethrow_exception(errors[r]);
    } catch (const MismatchError& e) {
      messages.insert(e.what());
    } catch (const std::exception& e) {
      ADD_FAILURE() << "rank " << r << " threw something else: " << e.what();
    }
  }
  EXPECT_EQ(messages.size(), 1u) << "ranks disagree on the message";
  return messages.empty() ? std::string() : *messages.begin();
}

TEST(Checksum, EverySingleByteChangeIsNoticedAtAnyLengthAndOffset) {
  std::vector<unsigned char> buf(200);
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<unsigned char>(i * 37 + 11);
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{31}, size_t{32}, size_t{33},
                   size_t{64}, size_t{100}, size_t{199}}) {
    const uint64_t base = checksum_bytes(buf.data(), n);
    EXPECT_EQ(base, checksum_bytes(buf.data(), n)) << "not deterministic at n=" << n;
    // Same bytes at another (unaligned) address give the same checksum.
    std::vector<unsigned char> shifted(n + 1);
    if (n > 0) std::memcpy(shifted.data() + 1, buf.data(), n);
    EXPECT_EQ(base, checksum_bytes(shifted.data() + 1, n)) << "n=" << n;
    for (size_t i = 0; i < n; ++i) {
      for (unsigned char bit : {0x01, 0x80}) {
        buf[i] ^= bit;
        EXPECT_NE(base, checksum_bytes(buf.data(), n)) << "n=" << n << " byte " << i;
        buf[i] ^= bit;
      }
    }
  }
}

TEST(Checksum, LengthSeedAndSwappedWordsChangeIt) {
  std::vector<unsigned char> zeros(64, 0);
  std::set<uint64_t> seen;
  for (size_t n = 0; n <= 64; ++n) seen.insert(checksum_bytes(zeros.data(), n));
  EXPECT_EQ(seen.size(), 65u) << "runs of zeros of different lengths collide";
  EXPECT_NE(checksum_bytes(zeros.data(), 16, 0), checksum_bytes(zeros.data(), 16, 1));

  std::vector<uint64_t> words = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  const uint64_t base = checksum_bytes(words.data(), words.size() * 8);
  std::swap(words[0], words[4]);  // the same lane, consecutive blocks
  EXPECT_NE(base, checksum_bytes(words.data(), words.size() * 8));
  std::swap(words[0], words[4]);
  std::swap(words[0], words[1]);  // two lanes of one block
  EXPECT_NE(base, checksum_bytes(words.data(), words.size() * 8));
}

TEST(Checksum, TensorChecksumCoversTheRawBytes) {
  Tensor a = Tensor::full(Shape({3, 4}), DType::f32, 1.5);
  Tensor b = a.clone();
  EXPECT_EQ(tensor_fingerprint(a), tensor_fingerprint(b));
  b.set_item(11, 1.5000001);
  EXPECT_NE(tensor_fingerprint(a), tensor_fingerprint(b));
  Tensor pos = Tensor::full(Shape({2}), DType::f32, 0.0);
  Tensor neg = Tensor::full(Shape({2}), DType::f32, -0.0);
  EXPECT_NE(tensor_fingerprint(pos), tensor_fingerprint(neg)) << "comparison must be bitwise";
  EXPECT_EQ(tensor_fingerprint(Tensor::empty(Shape({0}), DType::f32)), checksum_bytes(nullptr, 0));
}

TEST(FormatRankList, CollapsesRunsOfThree) {
  const auto f = [](std::vector<int> v) { return format_rank_list(v); };
  EXPECT_EQ(f({1}), "1");
  EXPECT_EQ(f({0, 2}), "0,2");
  EXPECT_EQ(f({0, 1}), "0,1");
  EXPECT_EQ(f({0, 1, 2, 3, 5}), "0-3,5");
  EXPECT_EQ(f({0, 2, 3, 4, 7, 8}), "0,2-4,7,8");
}

TEST(Consistency, IdenticalReplicasPassAtEverySize) {
  for (int size = 1; size <= 4; ++size) {
    std::mutex mu;
    std::set<std::vector<uint64_t>> sums;
    LocalWorld::run(world(size), [&](Communicator& comm) {
      ConsistencyChecker checker(comm, make_params(), every(10));
      for (int64_t step = 0; step <= 30; ++step) checker.maybe_check(step);
      EXPECT_EQ(checker.checks_done(), 4);  // steps 0, 10, 20, 30
      EXPECT_EQ(checker.last_checksums().size(), 4u);
      std::lock_guard lock(mu);
      sums.insert(checker.last_checksums());
    });
    EXPECT_EQ(sums.size(), 1u) << "size " << size;
  }
}

TEST(Consistency, OneFlippedFloatMakesEveryRankNameTheTensorAndTheRank) {
  for (int size = 2; size <= 4; ++size) {
    for (int odd = 0; odd < size; ++odd) {
      const auto errors = LocalWorld::run_collect(world(size), [&](Communicator& comm) {
        NamedTensors params = make_params();
        ConsistencyChecker checker(comm, params, every(20));
        checker.check(20);  // all equal so far
        if (comm.rank() == odd) {
          float* q = params[1].second.data<float>();
          uint32_t bits;
          std::memcpy(&bits, &q[7], 4);
          bits ^= 1u;  // the lowest mantissa bit: an invisible difference
          std::memcpy(&q[7], &bits, 4);
        }
        checker.maybe_check(30);  // not a check step
        checker.maybe_check(40);
      });
      const std::string msg = expect_all_mismatch(errors);
      SCOPED_TRACE(msg);
      EXPECT_NE(msg.find("parameter divergence at step 40"), std::string::npos);
      EXPECT_NE(msg.find("'block0.attn.q.w'"), std::string::npos);
      EXPECT_EQ(msg.find("'embed.w'"), std::string::npos);
      EXPECT_NE(msg.find(fmt::format("rank {} has", odd)), std::string::npos);
      EXPECT_NE(msg.find("1 of 4 tensors differ"), std::string::npos);
      if (size == 3 && odd == 1) {
        EXPECT_NE(msg.find("ranks 0,2 have"), std::string::npos);
      }
      if (size == 4 && odd == 2) {
        EXPECT_NE(msg.find("ranks 0,1,3 have"), std::string::npos);
      }
    }
  }
}

TEST(Consistency, NamesTheFirstDifferingTensorInListOrder) {
  const auto errors = LocalWorld::run_collect(world(2), [&](Communicator& comm) {
    NamedTensors params = make_params();
    if (comm.rank() == 1) {
      params[3].second.set_item(0, 42.0);  // head.w
      params[2].second.set_item(4, 42.0);  // block0.attn.q.b, earlier in the list
    }
    ConsistencyChecker(comm, params).check(7);
  });
  const std::string msg = expect_all_mismatch(errors);
  EXPECT_NE(msg.find("step 7: 'block0.attn.q.b' (f32[5]) differs"), std::string::npos) << msg;
  EXPECT_NE(msg.find("2 of 4 tensors differ, also: 'head.w'"), std::string::npos) << msg;
}

TEST(Consistency, EveryRankDifferentStillFailsEverywhereWithoutHanging) {
  const auto errors = LocalWorld::run_collect(world(4), [&](Communicator& comm) {
    NamedTensors params = make_params();
    params[0].second.set_item(0, comm.rank());
    ConsistencyChecker(comm, params).check(3);
  });
  const std::string msg = expect_all_mismatch(errors);
  EXPECT_NE(msg.find("'embed.w'"), std::string::npos) << msg;
  for (int r = 0; r < 4; ++r) {
    EXPECT_NE(msg.find(fmt::format("rank {} has", r)), std::string::npos) << msg;
  }
}

TEST(Consistency, DifferentParameterListsAreNamedNotCompared) {
  const auto errors = LocalWorld::run_collect(world(3), [&](Communicator& comm) {
    NamedTensors params = make_params();
    if (comm.rank() == 2) params[2].second = Tensor::zeros(Shape({6}), DType::f32);
    ConsistencyChecker(comm, params).check(0);
  });
  const std::string msg = expect_all_mismatch(errors);
  EXPECT_NE(msg.find("different parameter lists: entry #2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("ranks 0,1 have 'block0.attn.q.b' f32[5]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("rank 2 has 'block0.attn.q.b' f32[6]"), std::string::npos) << msg;

  const auto shorter = LocalWorld::run_collect(world(2), [&](Communicator& comm) {
    NamedTensors params = make_params();
    if (comm.rank() == 0) params.pop_back();
    ConsistencyChecker(comm, params).check(0);
  });
  const std::string msg2 = expect_all_mismatch(shorter);
  EXPECT_NE(msg2.find("rank 0 has (no tensor)"), std::string::npos) << msg2;
  EXPECT_NE(msg2.find("rank 0 has 3 tensors"), std::string::npos) << msg2;
}

TEST(Consistency, CheckerKeepsWorkingAfterAMismatch) {
  LocalWorld::run(world(2), [&](Communicator& comm) {
    NamedTensors params = make_params();
    ConsistencyChecker checker(comm, params, every(1));
    const double saved = params[0].second.item(3);
    if (comm.rank() == 1) params[0].second.set_item(3, saved + 1);
    EXPECT_THROW(checker.check(1), MismatchError);
    if (comm.rank() == 1) params[0].second.set_item(3, saved);  // repaired, e.g. re-broadcast
    EXPECT_TRUE(checker.maybe_check(2));
    EXPECT_EQ(checker.checks_done(), 2);
  });
}

TEST(Consistency, RejectsNegativeInterval) {
  LocalWorld::run(world(1), [&](Communicator& comm) {
    EXPECT_THROW(ConsistencyChecker(comm, {}, every(-1)), ConfigError);
    ConsistencyChecker never(comm, make_params(), every(0));
    EXPECT_FALSE(never.maybe_check(0));
    ConsistencyChecker empty(comm, {});
    empty.check(0);  // nothing to compare is not an error
  });
}

}  // namespace
}  // namespace mt
