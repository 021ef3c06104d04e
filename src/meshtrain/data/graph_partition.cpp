#include "meshtrain/data/graph_partition.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "meshtrain/base/error.h"
#include "meshtrain/base/random.h"

namespace mt {

PartitionMethod parse_partition_method(std::string_view text) {
  if (text == "contiguous") return PartitionMethod::contiguous;
  if (text == "random") return PartitionMethod::random;
  if (text == "locality") return PartitionMethod::locality;
  throw ConfigError(
      fmt::format("partition method '{}' is not one of contiguous, random, locality", text));
}

std::string_view partition_method_name(PartitionMethod m) {
  switch (m) {
    case PartitionMethod::contiguous:
      return "contiguous";
    case PartitionMethod::random:
      return "random";
    case PartitionMethod::locality:
      return "locality";
  }
  return "?";
}

std::vector<int64_t> Partition::sizes() const {
  std::vector<int64_t> s(static_cast<size_t>(parts), 0);
  for (int32_t o : owner) ++s[static_cast<size_t>(o)];
  return s;
}

std::vector<std::vector<int32_t>> Partition::members() const {
  std::vector<std::vector<int32_t>> m(static_cast<size_t>(parts));
  for (size_t v = 0; v < owner.size(); ++v) {
    m[static_cast<size_t>(owner[v])].push_back(static_cast<int32_t>(v));
  }
  return m;
}

namespace {

using Counts = std::vector<int64_t>;

// Neighbour counts per part of v's placed neighbours (owner >= 0), into
// `count` (all zero on entry); returns the parts touched, so the caller can
// clear them in O(degree).
void count_neighbours(const Csr& a, int64_t v, const std::vector<int32_t>& owner, Counts& count,
                      std::vector<int32_t>& touched) {
  touched.clear();
  for (int32_t e = a.row_ptr[static_cast<size_t>(v)]; e < a.row_ptr[static_cast<size_t>(v) + 1];
       ++e) {
    const int32_t u = a.col_idx[static_cast<size_t>(e)];
    if (u == v) continue;
    const int32_t p = owner[static_cast<size_t>(u)];
    if (p < 0) continue;
    if (count[static_cast<size_t>(p)]++ == 0) touched.push_back(p);
  }
}

// Breadth-first order over the whole graph, each component started at its
// lowest unvisited id.
std::vector<int32_t> bfs_order(const Csr& a) {
  const int64_t n = a.rows;
  std::vector<int32_t> order;
  order.reserve(static_cast<size_t>(n));
  std::vector<uint8_t> seen(static_cast<size_t>(n), 0);
  for (int64_t s = 0; s < n; ++s) {
    if (seen[static_cast<size_t>(s)] != 0) continue;
    seen[static_cast<size_t>(s)] = 1;
    size_t head = order.size();
    order.push_back(static_cast<int32_t>(s));
    while (head < order.size()) {
      const int32_t v = order[head++];
      for (int32_t e = a.row_ptr[static_cast<size_t>(v)]; e < a.row_ptr[static_cast<size_t>(v) + 1];
           ++e) {
        const int32_t u = a.col_idx[static_cast<size_t>(e)];
        if (seen[static_cast<size_t>(u)] == 0) {
          seen[static_cast<size_t>(u)] = 1;
          order.push_back(u);
        }
      }
    }
  }
  return order;
}

Partition locality(const Csr& a, const PartitionOptions& o) {
  const int64_t n = a.rows, k = o.parts;
  const auto capacity = static_cast<int64_t>(
      std::ceil(static_cast<double>(n) / static_cast<double>(k) * (1 + o.imbalance)));
  Partition p;
  p.parts = k;
  p.owner.assign(static_cast<size_t>(n), -1);
  Counts size(static_cast<size_t>(k), 0), count(static_cast<size_t>(k), 0);
  std::vector<int32_t> touched;
  // LDG: argmax over parts of placed neighbours * (1 - size / capacity);
  // parts without placed neighbours score 0, so a vertex with none goes to
  // the emptiest part (lowest id among equals). Later passes restream
  // (Nishimura & Ugander, KDD 2013): each vertex leaves its part and is
  // placed again, now seeing where all its neighbours are.
  const std::vector<int32_t> order = bfs_order(a);
  for (int64_t pass = 0; pass < 1 + o.rounds; ++pass) {
    for (int32_t v : order) {
      int32_t& own = p.owner[static_cast<size_t>(v)];
      if (own >= 0 && size[static_cast<size_t>(own)] == 1) continue;  // no part runs empty
      if (own >= 0) {
        --size[static_cast<size_t>(own)];
        own = -1;
      }
      count_neighbours(a, v, p.owner, count, touched);
      int64_t best = -1;
      double best_score = -1;
      for (int32_t q : touched) {
        if (size[static_cast<size_t>(q)] >= capacity) continue;
        const double score =
            static_cast<double>(count[static_cast<size_t>(q)]) *
            (1 - static_cast<double>(size[static_cast<size_t>(q)]) / static_cast<double>(capacity));
        if (score > best_score || (score == best_score && q < best)) {
          best = q;
          best_score = score;
        }
      }
      if (best < 0 || best_score <= 0) {
        best = std::min_element(size.begin(), size.end()) - size.begin();
      }
      for (int32_t q : touched) count[static_cast<size_t>(q)] = 0;
      own = static_cast<int32_t>(best);
      ++size[static_cast<size_t>(best)];
    }
  }
  // Label propagation: move to the part with strictly more neighbours while
  // it has room (the cut shrinks with every move; balance stays bounded).
  for (int64_t round = 0; round < o.rounds; ++round) {
    int64_t moved = 0;
    for (int64_t v = 0; v < n; ++v) {
      count_neighbours(a, v, p.owner, count, touched);
      const int32_t mine = p.owner[static_cast<size_t>(v)];
      int32_t best = mine;
      for (int32_t q : touched) {
        if (q == mine || size[static_cast<size_t>(q)] >= capacity) continue;
        const int64_t cq = count[static_cast<size_t>(q)], cb = count[static_cast<size_t>(best)];
        if (cq > cb || (cq == cb && best != mine && q < best)) best = q;
      }
      for (int32_t q : touched) count[static_cast<size_t>(q)] = 0;
      if (best != mine && size[static_cast<size_t>(mine)] > 1) {
        --size[static_cast<size_t>(mine)];
        ++size[static_cast<size_t>(best)];
        p.owner[static_cast<size_t>(v)] = best;
        ++moved;
      }
    }
    if (moved == 0) break;
  }
  // Tiny graphs (parts close to n) can leave a part empty when capacity
  // lets another take two; hand it the highest id of the largest part.
  for (int64_t q = 0; q < k; ++q) {
    if (size[static_cast<size_t>(q)] > 0) continue;
    const auto big =
        static_cast<int32_t>(std::max_element(size.begin(), size.end()) - size.begin());
    for (int64_t v = n - 1; v >= 0; --v) {
      if (p.owner[static_cast<size_t>(v)] == big) {
        p.owner[static_cast<size_t>(v)] = static_cast<int32_t>(q);
        --size[static_cast<size_t>(big)];
        ++size[static_cast<size_t>(q)];
        break;
      }
    }
  }
  return p;
}

}  // namespace

Partition partition_graph(const Csr& adj, const PartitionOptions& o) {
  const int64_t n = adj.rows;
  if (adj.rows != adj.cols) {
    throw ShapeError(
        fmt::format("partition: the adjacency is {}x{}, not square", adj.rows, adj.cols));
  }
  if (o.parts < 1 || o.parts > n) {
    throw ConfigError(fmt::format(
        "partition: {} parts (dist.nproc / gnn.replication) for a graph of {} vertices (every "
        "part must own at least one vertex: use at most {} parts)",
        o.parts, n, n));
  }
  if (!(o.imbalance >= 0) || o.rounds < 0) {
    throw ConfigError(
        fmt::format("partition: imbalance {:g} and rounds {} must be >= 0", o.imbalance, o.rounds));
  }
  const int64_t k = o.parts;
  if (o.method == PartitionMethod::locality && k > 1) return locality(adj, o);
  Partition p;
  p.parts = k;
  p.owner.resize(static_cast<size_t>(n));
  // Even blocks: part q holds [q * base + min(q, extra), ...).
  const int64_t base = n / k, extra = n % k;
  int64_t v = 0;
  for (int64_t q = 0; q < k; ++q) {
    for (int64_t i = 0; i < base + (q < extra ? 1 : 0); ++i) {
      p.owner[static_cast<size_t>(v++)] = static_cast<int32_t>(q);
    }
  }
  if (o.method == PartitionMethod::random) {
    // A seeded shuffle of the even blocks: uniform and exactly balanced.
    Rng rng(Rng::derive(o.seed, "partition.random"));
    for (int64_t i = n - 1; i > 0; --i) {
      std::swap(p.owner[static_cast<size_t>(i)],
                p.owner[rng.next() % static_cast<uint64_t>(i + 1)]);
    }
  }
  return p;
}

int64_t PartitionStats::halo_in(int64_t p) const {
  int64_t s = 0;
  for (int64_t q = 0; q < parts; ++q) s += halo_of(p, q);
  return s;
}

int64_t PartitionStats::halo_out(int64_t p) const {
  int64_t s = 0;
  for (int64_t q = 0; q < parts; ++q) s += halo_of(q, p);
  return s;
}

int64_t PartitionStats::halo_total() const {
  int64_t s = 0;
  for (int64_t h : halo) s += h;
  return s;
}

std::string PartitionStats::describe() const {
  std::string s =
      fmt::format("edge cut: {} of {} entries ({:.1f}%; an undirected edge is two entries)\n",
                  cut_entries, entries, 100 * cut_fraction());
  s += fmt::format("halo rows (vertices a part receives from the others, per layer): {} in all\n",
                   halo_total());
  s += "  part  vertices  halo in  halo out  from part 0..\n";
  for (int64_t p = 0; p < parts; ++p) {
    std::string row;
    for (int64_t q = 0; q < parts && q < 16; ++q) row += fmt::format(" {}", halo_of(p, q));
    if (parts > 16) row += " ...";
    s += fmt::format("  {:>4}  {:>8}  {:>7}  {:>8} {}\n", p, vertices[static_cast<size_t>(p)],
                     halo_in(p), halo_out(p), row);
  }
  return s;
}

PartitionStats partition_stats(const Csr& adj, const Partition& p) {
  PartitionStats s;
  s.parts = p.parts;
  s.vertices = p.sizes();
  s.halo.assign(static_cast<size_t>(p.parts * p.parts), 0);
  MT_CHECK_EQ(static_cast<int64_t>(p.owner.size()), adj.rows);
  std::vector<int32_t> stamp(static_cast<size_t>(adj.cols), -1);
  const std::vector<std::vector<int32_t>> members = p.members();
  for (int64_t q = 0; q < p.parts; ++q) {
    for (int32_t v : members[static_cast<size_t>(q)]) {
      for (int32_t e = adj.row_ptr[static_cast<size_t>(v)];
           e < adj.row_ptr[static_cast<size_t>(v) + 1]; ++e) {
        const int32_t u = adj.col_idx[static_cast<size_t>(e)];
        if (u == v) continue;
        ++s.entries;
        const int32_t r = p.owner[static_cast<size_t>(u)];
        if (r == q) continue;
        ++s.cut_entries;
        if (stamp[static_cast<size_t>(u)] != q) {
          stamp[static_cast<size_t>(u)] = static_cast<int32_t>(q);
          ++s.halo[static_cast<size_t>(q * p.parts + r)];
        }
      }
    }
  }
  return s;
}

}  // namespace mt
