#include "meshtrain/train/graph_parallel.h"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "meshtrain/base/error.h"

namespace mt {

bool graph_parallel_supports(const ModelSpec& spec, int64_t replication) {
  return is_gnn(spec.kind) && (replication <= 1 || !gnn_needs_whole_rows(spec));
}

void check_graph_parallel_model(const ModelSpec& spec, int64_t replication) {
  if (graph_parallel_supports(spec, replication)) return;
  throw ConfigError(fmt::format(
      "gnn.replication = {}: model.kind {}{} needs each vertex's whole neighbourhood in one "
      "place, which 1.5D splits over the replicas; use gnn.replication = 1",
      replication, spec.kind, spec.kind == "sage" ? " with max aggregation" : ""));
}

std::vector<std::vector<int>> graph_parallel_groups(int ranks, int replication) {
  std::vector<std::vector<int>> groups(1);
  for (int r = 0; r < ranks; ++r) groups[0].push_back(r);
  if (replication <= 1) return groups;
  const int parts = ranks / replication;
  for (int j = 0; j < replication; ++j) {  // exchange groups: one rank per row block
    groups.emplace_back();
    for (int k = 0; k < parts; ++k) groups.back().push_back(k * replication + j);
  }
  for (int i = 0; i < parts; ++i) {  // replica groups: the ranks of one row block
    groups.emplace_back();
    for (int j = 0; j < replication; ++j) groups.back().push_back(i * replication + j);
  }
  return groups;
}

int64_t replica_of(int64_t recv_part, int64_t src_part, int64_t replication) {
  if (recv_part == src_part) return recv_part % replication;
  return (recv_part + src_part) % replication;
}

void number_halo_rows(std::vector<std::vector<int32_t>>& from, std::vector<int64_t>& recv_counts,
                      std::vector<int32_t>& halo_id, std::vector<int32_t>& halo_vertices) {
  recv_counts.assign(from.size(), 0);
  for (size_t q = 0; q < from.size(); ++q) {
    auto& f = from[q];
    std::sort(f.begin(), f.end());
    recv_counts[q] = static_cast<int64_t>(f.size());
    for (int32_t u : f) {
      halo_id[static_cast<size_t>(u)] = static_cast<int32_t>(halo_vertices.size());
      halo_vertices.push_back(u);
    }
  }
}

GraphShard make_graph_shard(const GraphData& g, const ModelSpec& spec, const Partition& p,
                            int64_t rank, int64_t replication) {
  const int64_t n = g.num_vertices(), parts = p.parts, c = replication;
  const int64_t ranks = parts * c;
  MT_CHECK(c >= 1 && rank >= 0 && rank < ranks, "rank {} of {} parts x {} replicas", rank, parts,
           c);
  MT_CHECK_EQ(static_cast<int64_t>(p.owner.size()), n);
  const GnnAdjacency whole = gnn_adjacency(spec, g.adj);
  const Csr& a = whole.a;
  const bool has_values = !whole.values.empty();
  const std::vector<std::vector<int32_t>> members = p.members();
  auto owner = [&](int32_t v) { return static_cast<int64_t>(p.owner[static_cast<size_t>(v)]); };
  check_graph_parallel_model(spec, c);
  const int64_t part = rank / c, replica = rank % c;
  // Does this replica compute the terms of rows of part `recv` that read part `src`?
  auto mine = [&](int64_t recv, int64_t src) { return replica_of(recv, src, c) == replica; };

  GraphShard out;
  GnnShard& s = out.shard;
  s.group = 0;
  s.rank = rank;
  s.ranks = ranks;
  s.replication = c;
  s.exchange_group = c > 1 ? 1 + replica : 0;
  s.exchange_rank = part;
  s.exchange_ranks = parts;
  s.replica_group = c > 1 ? 1 + c + part : -1;
  out.local_vertices = members[static_cast<size_t>(part)];
  s.local = static_cast<int64_t>(out.local_vertices.size());
  std::vector<int32_t> local_id(static_cast<size_t>(n), -1);
  for (size_t i = 0; i < out.local_vertices.size(); ++i) {
    local_id[static_cast<size_t>(out.local_vertices[i])] = static_cast<int32_t>(i);
  }

  // Halo: what my rows read from the other parts assigned to me, by part
  // then id.
  std::vector<std::vector<int32_t>> from(static_cast<size_t>(parts));
  std::vector<int32_t> halo_id(static_cast<size_t>(n), -1);
  for (int32_t v : out.local_vertices) {
    for (int32_t e = a.row_ptr[static_cast<size_t>(v)]; e < a.row_ptr[static_cast<size_t>(v) + 1];
         ++e) {
      const int32_t u = a.col_idx[static_cast<size_t>(e)];
      const int64_t k = owner(u);
      if (k != part && mine(part, k) && halo_id[static_cast<size_t>(u)] < 0) {
        halo_id[static_cast<size_t>(u)] = 0;
        from[static_cast<size_t>(k)].push_back(u);
      }
    }
  }
  number_halo_rows(from, s.recv_counts, halo_id, out.halo_vertices);
  s.halo = static_cast<int64_t>(out.halo_vertices.size());

  // My rows' terms, split by where each column lives (terms another
  // replica computes left out); entries keep the row's order.
  s.local_adj.rows = s.local_adj.cols = s.local;
  s.halo_adj.rows = s.local;
  s.halo_adj.cols = s.halo;
  s.local_adj.row_ptr.assign(1, 0);
  s.halo_adj.row_ptr.assign(1, 0);
  const bool local_mine = mine(part, part);
  for (int32_t v : out.local_vertices) {
    for (int32_t e = a.row_ptr[static_cast<size_t>(v)]; e < a.row_ptr[static_cast<size_t>(v) + 1];
         ++e) {
      const int32_t u = a.col_idx[static_cast<size_t>(e)];
      const int64_t k = owner(u);
      const bool local = k == part;
      if (local ? !local_mine : !mine(part, k)) continue;
      (local ? s.local_adj : s.halo_adj)
          .col_idx.push_back(local ? local_id[static_cast<size_t>(u)]
                                   : halo_id[static_cast<size_t>(u)]);
      if (has_values) {
        (local ? s.local_values : s.halo_values).push_back(whole.values[static_cast<size_t>(e)]);
      }
    }
    s.local_adj.row_ptr.push_back(static_cast<int32_t>(s.local_adj.col_idx.size()));
    s.halo_adj.row_ptr.push_back(static_cast<int32_t>(s.halo_adj.col_idx.size()));
  }

  // What the rows of each other part read from mine, where this replica
  // serves that pair, ascending: the order in which the receiver lists its
  // halo rows from my part.
  s.send_counts.assign(static_cast<size_t>(parts), 0);
  std::vector<int32_t> stamp(static_cast<size_t>(n), -1);
  for (int64_t q = 0; q < parts; ++q) {
    if (q == part || !mine(q, part)) continue;
    std::vector<int32_t> wanted;
    for (int32_t v : members[static_cast<size_t>(q)]) {
      for (int32_t e = a.row_ptr[static_cast<size_t>(v)]; e < a.row_ptr[static_cast<size_t>(v) + 1];
           ++e) {
        const int32_t u = a.col_idx[static_cast<size_t>(e)];
        if (owner(u) == part && stamp[static_cast<size_t>(u)] != q) {
          stamp[static_cast<size_t>(u)] = static_cast<int32_t>(q);
          wanted.push_back(u);
        }
      }
    }
    std::sort(wanted.begin(), wanted.end());
    s.send_counts[static_cast<size_t>(q)] = static_cast<int64_t>(wanted.size());
    for (int32_t u : wanted) s.send_rows.push_back(local_id[static_cast<size_t>(u)]);
  }

  for (size_t i = 0; i < out.local_vertices.size(); ++i) {
    const auto v = static_cast<size_t>(out.local_vertices[i]);
    const auto li = static_cast<int32_t>(i);
    if (g.train_mask[v] != 0) out.loss_vertices.push_back(li);
    if (g.val_mask[v] != 0) out.val_vertices.push_back(li);
    if (g.test_mask[v] != 0) out.test_vertices.push_back(li);
  }
  s.loss_total = static_cast<int64_t>(std::count(g.train_mask.begin(), g.train_mask.end(), 1));
  return out;
}

Tensor gather_rows(const Tensor& features, const std::vector<int32_t>& vertices) {
  const int64_t f = features.shape()[1];
  Tensor t = Tensor::empty(Shape{static_cast<int64_t>(vertices.size()), f}, DType::f32);
  const float* src = features.data<float>();
  float* dst = t.data<float>();
  for (size_t i = 0; i < vertices.size(); ++i) {
    std::memcpy(dst + static_cast<int64_t>(i) * f, src + static_cast<int64_t>(vertices[i]) * f,
                static_cast<size_t>(f) * sizeof(float));
  }
  return t;
}

int64_t halo_bytes_per_epoch(const ModelSpec& spec, const GnnShard& s, int64_t features,
                             int64_t classes) {
  if (s.ranks <= 1 || s.exchange_ranks <= 1) return 0;
  // Forward sends the rows other ranks read from this one; backward sends
  // the gradients of the halo rows this one read back to their owners.
  int64_t out = 0, back = 0;
  for (int64_t c : s.send_counts) out += c;
  for (int64_t c : s.recv_counts) back += c;
  const int64_t hid = spec.gnn_hidden, layers = spec.gnn_layers;
  int64_t fwd = 0, bwd = 0;  // elements per row over the epoch
  if (spec.kind == "gcn") {
    for (int64_t l = 0; l < layers; ++l) fwd += l + 1 == layers ? classes : hid;
    bwd = fwd;
  } else if (spec.kind == "resgcn") {
    fwd = bwd = layers * hid;
  } else if (spec.kind == "gat") {  // each head's z = h W_k: width out / heads, or out last
    for (int64_t l = 0; l < layers; ++l) {
      const bool last = l + 1 == layers;
      fwd += last ? classes * spec.gat_heads : hid;
    }
    bwd = fwd;
  } else {  // sage: the layer's message (its input, or h W_neigh for mean where narrower)
    for (int64_t l = 0; l < layers; ++l) {
      const int64_t w = gnn_message_width(spec, l, features, classes);
      fwd += w;
      if (gnn_message_has_grad(spec, l, features, classes)) bwd += w;
    }
  }
  return (out * fwd + back * bwd) * static_cast<int64_t>(sizeof(float));
}

}  // namespace mt
