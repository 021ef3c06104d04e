// Shared by reshard_test.cpp (local ranks) and reshard_mpi_test.cpp
// (mpirun): the layouts every pair of which is resharded, the tensor's
// values, each rank's source piece, the minimal bytes computed from the
// layouts alone, and one rank's run of a plan with its checks.
#pragma once

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "meshtrain/spmd/reshard.h"

namespace mt::test {

inline float value_at(int64_t flat) {
  return static_cast<float>(flat % 97 + 1);
}

// The tensor's elements in box b, row-major.
inline Tensor box_values(const Shape& shape, const Box& b) {
  Tensor whole = Tensor::empty(shape, DType::f32);
  for (int64_t i = 0; i < shape.numel(); ++i) whole.data<float>()[i] = value_at(i);
  Tensor piece = Tensor::empty(b.shape(), DType::f32);
  copy_box_out(whole, b, piece);
  return piece;
}

// What `rank` holds under layout l: its box's values, or for a partial
// layout its addend (integers: holder j of k holds j + 1, the last one the
// rest, so the sum is exact).
inline Tensor source_piece(const Shape& shape, const TensorLayout& l, int rank) {
  const Box& b = *l.box_of(rank);
  Tensor t = box_values(shape, b);
  if (!l.partial) return t;
  std::vector<int> holders;
  for (size_t i = 0; i < l.ranks.size(); ++i) {
    if (l.boxes[i] == b) holders.push_back(l.ranks[i]);
  }
  const int k = static_cast<int>(holders.size());
  const int j = static_cast<int>(std::ranges::find(holders, rank) - holders.begin());
  for (int64_t i = 0; i < t.numel(); ++i) {
    const float others = static_cast<float>((k - 1) * k / 2);  // 1 + 2 + ... + (k - 1)
    t.data<float>()[i] = j + 1 < k ? static_cast<float>(j + 1) : t.data<float>()[i] - others;
  }
  return t;
}

struct NamedLayout {
  std::string name;
  std::function<TensorLayout(std::vector<int>)> make;
  bool source_only = false;  // partial layouts
};

inline std::vector<NamedLayout> layouts(const Shape& kShape) {
  std::vector<NamedLayout> v;
  v.push_back({"replicated", [kShape](std::vector<int> r) {
                 return TensorLayout::replicated(kShape, std::move(r));
               }});
  v.push_back({"split0", [kShape](std::vector<int> r) {
                 return TensorLayout::split(kShape, std::move(r), 0);
               }});
  v.push_back({"split1", [kShape](std::vector<int> r) {
                 return TensorLayout::split(kShape, std::move(r), 1);
               }});
  v.push_back({"split0_ratios", [kShape](std::vector<int> r) {
                 std::vector<int64_t> q;
                 for (size_t i = 0; i < r.size(); ++i) q.push_back(static_cast<int64_t>(i) + 1);
                 return TensorLayout::split(kShape, std::move(r), 0, q);
               }});
  v.push_back({"split1_ratios", [kShape](std::vector<int> r) {
                 std::vector<int64_t> q;
                 for (size_t i = 0; i < r.size(); ++i)
                   q.push_back(static_cast<int64_t>(r.size() - i));
                 return TensorLayout::split(kShape, std::move(r), 1, q);
               }});
  // Even rank counts: split over the first half of a 2-axis mesh,
  // replicated over the second (k replicas of each box).
  v.push_back({"split1_replicas", [kShape](std::vector<int> r) {
                 if (r.size() % 2 != 0) return TensorLayout::split(kShape, std::move(r), 1);
                 const Mesh mesh({MeshAxis{"a", 2}, MeshAxis{"b", static_cast<int>(r.size()) / 2}});
                 ShardingSpec spec;
                 spec.dims = {DimSharding{}, DimSharding::over("a")};
                 return TensorLayout::of(kShape, spec, mesh, std::move(r));
               }});
  v.push_back(
      {"partial",
       [kShape](std::vector<int> r) { return TensorLayout::partial_sum(kShape, std::move(r)); },
       true});
  v.push_back({"partial_split0",
               [kShape](std::vector<int> r) {
                 if (r.size() % 2 != 0) return TensorLayout::partial_sum(kShape, std::move(r));
                 const Mesh mesh({MeshAxis{"a", 2}, MeshAxis{"b", static_cast<int>(r.size()) / 2}});
                 ShardingSpec spec;
                 spec.dims = {DimSharding::over("a")};
                 spec.partial = {"b"};
                 return TensorLayout::of(kShape, spec, mesh, std::move(r));
               },
               true});
  return v;
}

// The minimal bytes, from the layouts alone (see reshard.h).
inline uint64_t minimal_bytes(const TensorLayout& from, const TensorLayout& to) {
  uint64_t n = 0;
  if (!from.partial) {
    for (size_t i = 0; i < to.ranks.size(); ++i) {
      const Box* own = from.box_of(to.ranks[i]);
      const int64_t have = own != nullptr ? intersect_boxes(to.boxes[i], *own).elements() : 0;
      n += static_cast<uint64_t>(to.boxes[i].elements() - have);
    }
    return n * 4;
  }
  std::map<std::vector<int64_t>, std::pair<Box, std::vector<int>>> groups, sources;
  auto key = [](const Box& b) {
    std::vector<int64_t> k = b.begin;
    k.insert(k.end(), b.end.begin(), b.end.end());
    return k;
  };
  for (size_t i = 0; i < to.ranks.size(); ++i) {
    auto& g = groups[key(to.boxes[i])];
    g.first = to.boxes[i];
    g.second.push_back(to.ranks[i]);
  }
  for (size_t i = 0; i < from.ranks.size(); ++i) {
    auto& s = sources[key(from.boxes[i])];
    s.first = from.boxes[i];
    s.second.push_back(from.ranks[i]);
  }
  for (const auto& [gk, g] : groups) {
    for (const auto& [sk, s] : sources) {
      const int64_t shared = intersect_boxes(g.first, s.first).elements();
      bool keeper = false;
      for (int h : s.second) keeper |= std::ranges::find(g.second, h) != g.second.end();
      const uint64_t hops = s.second.size() - 1 + g.second.size() - (keeper ? 1 : 0);
      n += static_cast<uint64_t>(shared) * hops;
    }
  }
  return n * 4;
}

inline std::vector<std::vector<int>> rank_sets(int world) {
  std::vector<int> all;
  for (int r = 0; r < world; ++r) all.push_back(r);
  std::vector<std::vector<int>> s = {all, std::vector<int>(all.rbegin(), all.rend())};
  if (world >= 2) {
    s.push_back(std::vector<int>(all.begin(), all.begin() + world / 2));
    s.push_back(std::vector<int>(all.begin() + world / 2, all.end()));
  }
  if (world == 4) {
    s.push_back({0, 1, 2});
    s.push_back({3, 2, 1});
  }
  return s;
}

inline std::string set_name(const std::vector<int>& r) {
  std::string s;
  for (int x : r) s += std::to_string(x);
  return s;
}

// Runs `plan` on this rank (source piece from `shape`'s values, a zeroed
// destination) and returns what is wrong ("" if nothing): the destination's
// values against the tensor's box, bitwise, and the bytes this rank sent
// (the communicator's counters) against the plan's.
inline std::string run_reshard_on_rank(Communicator& comm, const Shape& shape,
                                       const ReshardPlan& plan) {
  const int me = comm.rank();
  const Tensor src =
      plan.from.box_of(me) != nullptr ? source_piece(shape, plan.from, me) : Tensor();
  const Box* db = plan.to.box_of(me);
  Tensor dst = db != nullptr ? Tensor::zeros(db->shape(), DType::f32) : Tensor();
  comm.reset_counters();
  execute_reshard(comm, plan, src, dst);
  const uint64_t sent = comm.counters().total_sent();
  std::string wrong;
  if (db != nullptr) {
    const Tensor want = box_values(shape, *db);
    if (std::memcmp(want.raw(), dst.raw(), want.nbytes()) != 0) {
      wrong = fmt::format("wrong values on rank {} box {}", me, db->str());
    }
  }
  if (sent != plan.bytes_sent(me)) {
    wrong += fmt::format(" rank {} sent {} bytes, the plan says {}", me, sent, plan.bytes_sent(me));
  }
  return wrong;
}

}  // namespace mt::test
