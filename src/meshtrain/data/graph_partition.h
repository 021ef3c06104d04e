// Graph partitioning for distributed full-graph training: which part (rank)
// owns each vertex, and what that costs in communication.
//
// - contiguous: part p owns an even block of consecutive vertex ids (the
//   first n mod parts parts one vertex more). Free, and as good as the id
//   order is local.
// - random: each vertex goes to a uniformly drawn part, then parts are
//   evened out (seeded); the baseline every locality-aware method must beat.
// - locality: a streaming pass of LDG (linear deterministic greedy, Stanton
//   & Kliot, KDD 2012) in breadth-first order -- each vertex joins the part
//   holding most of its already placed neighbours, weighted by (1 - size /
//   capacity) -- then rounds of label propagation that move a vertex to the
//   part holding strictly more of its neighbours while that part has room.
//   No part ever exceeds capacity = ceil(n / parts * (1 + imbalance)). METIS
//   is not available here (no Debian package may be added), so this is the
//   locality-aware method; it costs O(E) per pass.
//
// The partition's cost: the edge cut (entries i <- j of the adjacency whose
// endpoints have different owners; an undirected edge stored both ways
// counts twice) and the halo matrix: halo(p, q) = the distinct vertices of
// part q that rows of part p read, i.e. the rows p must receive from q in
// every layer's exchange (graph-parallel training, train/graph_parallel.h).
//
// Pure functions; plain data.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "meshtrain/tensor/sparse.h"

namespace mt {

enum class PartitionMethod : uint8_t { contiguous, random, locality };

// "contiguous", "random", "locality"; ConfigError naming the choices otherwise.
PartitionMethod parse_partition_method(std::string_view text);
std::string_view partition_method_name(PartitionMethod m);

struct PartitionOptions {
  PartitionMethod method = PartitionMethod::contiguous;
  int64_t parts = 1;
  uint64_t seed = 1;        // random
  double imbalance = 0.05;  // locality: a part holds at most ceil(n / parts * (1 + imbalance))
  int64_t rounds = 8;       // locality: label-propagation rounds after the streaming pass
};

struct Partition {
  int64_t parts = 0;
  std::vector<int32_t> owner;  // per vertex, in [0, parts)
  // Vertices per part.
  std::vector<int64_t> sizes() const;
  // Part p's vertices, ascending.
  std::vector<std::vector<int32_t>> members() const;
};

// ConfigError when parts < 1 or parts > the vertex count (every part must
// own a vertex), naming both, or for a bad imbalance / rounds. adj must be
// square.
Partition partition_graph(const Csr& adj, const PartitionOptions& o);

struct PartitionStats {
  int64_t parts = 0;
  int64_t entries = 0;            // adjacency entries, self-loops excluded
  int64_t cut_entries = 0;        // those whose endpoints have different owners
  std::vector<int64_t> vertices;  // per part
  std::vector<int64_t> halo;      // [parts * parts], halo[p * parts + q]; 0 on the diagonal

  double cut_fraction() const {
    return entries == 0 ? 0 : static_cast<double>(cut_entries) / static_cast<double>(entries);
  }
  int64_t halo_of(int64_t p, int64_t q) const { return halo[static_cast<size_t>(p * parts + q)]; }
  // Rows part p receives from all others / sends to all others.
  int64_t halo_in(int64_t p) const;
  int64_t halo_out(int64_t p) const;
  int64_t halo_total() const;
  // A few lines: edge cut, vertices per part, the halo matrix.
  std::string describe() const;
};

PartitionStats partition_stats(const Csr& adj, const Partition& p);

}  // namespace mt
