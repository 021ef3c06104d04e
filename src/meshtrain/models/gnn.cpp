// Graph neural networks for full-graph node classification (see model.h).
// The adjacency enters as i32 inputs bound once (ModelGraph::constants), so
// the same graph code runs for any graph the model was built for. Under
// graph parallelism (GnnGraph::shard) every aggregation also reads the halo
// rows that one uneven all_to_all brings in, and parameters enter through
// copy_to_group.
#include <numeric>

#include <fmt/format.h>

#include "meshtrain/base/error.h"
#include "meshtrain/graph/builder.h"
#include "meshtrain/models/layers.h"
#include "meshtrain/models/model.h"

namespace mt {

namespace {

// One adjacency as graph inputs: row_ptr, col_idx and per-entry values.
struct AdjInputs {
  ValueId row_ptr = kNoValue, col_idx = kNoValue, values = kNoValue, rows = kNoValue;
};

AdjInputs bind_adj(Builder& b, ModelGraph& m, const std::string& name, const Csr& a,
                   const std::vector<float>* values, bool entry_rows_too) {
  AdjInputs in;
  in.row_ptr = b.input(name + ".row_ptr", {a.rows + 1}, DType::i32);
  m.constants.emplace_back(in.row_ptr, tensor_from(a.row_ptr));
  in.col_idx = b.input(name + ".col_idx", {a.nnz()}, DType::i32);
  m.constants.emplace_back(in.col_idx, tensor_from(a.col_idx));
  if (values != nullptr) {
    in.values = b.input(name + ".values", {a.nnz()});
    m.constants.emplace_back(in.values, tensor_from(*values));
  }
  if (entry_rows_too) {
    in.rows = b.input(name + ".entry_rows", {a.nnz()}, DType::i32);
    m.constants.emplace_back(in.rows, tensor_from(entry_rows(a)));
  }
  return in;
}

// What the layers share: the builder, the adjacency (local part, and the
// halo part with its exchange under graph parallelism).
struct Net {
  Builder& b;
  ModelGraph& m;
  const GnnShard* shard = nullptr;
  AdjInputs adj, halo_adj;
  ValueId send_rows = kNoValue;
  // Under graph parallelism, for operators that need a row's whole
  // neighbourhood (GAT's edge softmax, sage's max): the local and halo
  // entries of each row in one adjacency [local, local + halo] (halo columns
  // shifted by local), and the two selection matrices that place local rows
  // and received halo rows into one [local + halo, F] block.
  AdjInputs joined_adj, place_local, place_halo;
  // The halo rows the last aggregate() received (kNoValue without an exchange).
  ValueId last_recv = kNoValue;

  // A parameter; replicated over the shard's group (its gradient is all-reduced).
  ValueId param(const std::string& name, const Shape& shape, ParamInit init) {
    ValueId p = b.param(name, shape, init);
    return distributed() ? b.copy_to_group(p, shard->group) : p;
  }
  bool distributed() const { return shard != nullptr && shard->ranks > 1; }

  // sum over in-neighbours j of w_ij h_j: the local rows' part, plus, under
  // graph parallelism, the halo part over the rows the exchange brings in
  // (issued first, so the local product overlaps it).
  ValueId aggregate(ValueId h) {
    if (!distributed()) return b.spmm(adj.row_ptr, adj.col_idx, h, adj.values);
    ValueId y = kNoValue;
    last_recv = kNoValue;
    if (shard->exchange_ranks > 1) {
      ValueId send = b.embedding(h, send_rows);
      ValueId recv = b.all_to_allv(send, shard->exchange_group, 0, shard->send_counts,
                                   shard->recv_counts, shard->exchange_rank);
      last_recv = recv;
      ValueId local = b.spmm(adj.row_ptr, adj.col_idx, h, adj.values);
      y = b.add(local, b.spmm(halo_adj.row_ptr, halo_adj.col_idx, recv, halo_adj.values));
    } else {
      y = b.spmm(adj.row_ptr, adj.col_idx, h, adj.values);
    }
    // 1.5D: each replica summed its share of the row's terms.
    return shard->replication > 1 ? b.all_reduce(y, shard->replica_group) : y;
  }

  // The adjacency whose rows hold every entry of a vertex's neighbourhood,
  // and the rows its columns index: h itself in one process; under graph
  // parallelism [h; the halo rows of h] -- one exchange, then two
  // selection products (exact: each output element is one input element,
  // or 0 + it), so no concatenation operator is needed and the gradient
  // flows back through spmm's transposed product.
  std::pair<const AdjInputs*, ValueId> whole_rows(ValueId h) {
    if (!distributed() || shard->exchange_ranks <= 1) return {&adj, h};
    ValueId send = b.embedding(h, send_rows);
    ValueId recv = b.all_to_allv(send, shard->exchange_group, 0, shard->send_counts,
                                 shard->recv_counts, shard->exchange_rank);
    ValueId joined = b.add(b.spmm(place_local.row_ptr, place_local.col_idx, h),
                           b.spmm(place_halo.row_ptr, place_halo.col_idx, recv));
    return {&joined_adj, joined};
  }
};

// The local and halo parts of a shard's rows in one CSR [local, local +
// halo]: a row's local entries, then its halo entries (columns + local).
Csr join_rows(const Csr& local, const Csr& halo) {
  Csr j;
  j.rows = local.rows;
  j.cols = local.cols + halo.cols;
  j.row_ptr.assign(1, 0);
  for (int64_t r = 0; r < local.rows; ++r) {
    const auto i = static_cast<size_t>(r);
    for (int32_t e = local.row_ptr[i]; e < local.row_ptr[i + 1]; ++e) {
      j.col_idx.push_back(local.col_idx[static_cast<size_t>(e)]);
    }
    for (int32_t e = halo.row_ptr[i]; e < halo.row_ptr[i + 1]; ++e) {
      j.col_idx.push_back(halo.col_idx[static_cast<size_t>(e)] + static_cast<int32_t>(local.cols));
    }
    j.row_ptr.push_back(static_cast<int32_t>(j.col_idx.size()));
  }
  return j;
}

// [rows, count] selection: row offset + k holds one entry, column k.
Csr placement(int64_t rows, int64_t offset, int64_t count) {
  Csr p;
  p.rows = rows;
  p.cols = count;
  p.row_ptr.assign(static_cast<size_t>(rows) + 1, 0);
  for (int64_t r = 0; r < rows; ++r) {
    const bool has = r >= offset && r < offset + count;
    p.row_ptr[static_cast<size_t>(r) + 1] = p.row_ptr[static_cast<size_t>(r)] + (has ? 1 : 0);
    if (has) p.col_idx.push_back(static_cast<int32_t>(r - offset));
  }
  return p;
}

ValueId bias_add(Net& n, ValueId h, int64_t width, const std::string& name) {
  return n.b.add(h, n.param(name + ".b", {width}, ParamInit{ParamInit::Kind::zeros, 0}));
}

ValueId weight(Net& n, const std::string& name, int64_t in, int64_t out) {
  return n.param(name, {in, out}, layers::fan_in_uniform(in));
}

ValueId gcn_conv(Net& n, ValueId h, int64_t in, int64_t out, const std::string& name) {
  ValueId z = n.b.matmul(h, weight(n, name + ".w", in, out));
  return bias_add(n, n.aggregate(z), out, name);
}

ValueId sage_conv(Net& n, ValueId h, int64_t in, int64_t out, const std::string& name, bool max) {
  Builder& b = n.b;
  ValueId self = b.matmul(h, weight(n, name + ".w_self", in, out));
  ValueId w_neigh = weight(n, name + ".w_neigh", in, out);
  ValueId neigh = kNoValue;
  if (max) {
    auto [a, rows] = n.whole_rows(h);
    neigh = b.matmul(b.spmm_max(a->row_ptr, a->col_idx, rows), w_neigh);
  } else if (sage_projects_first(in, out)) {
    // mean(h) W = mean(h W): aggregate the narrower projection.
    neigh = n.aggregate(b.matmul(h, w_neigh));
  } else {
    neigh = b.matmul(n.aggregate(h), w_neigh);
  }
  return bias_add(n, b.add(self, neigh), out, name);
}

// One attention head over the rows `rows` that adjacency `a` indexes (z's
// own rows in one process; [local; halo] under graph parallelism).
ValueId gat_head(Net& n, ValueId h, int64_t in, int64_t out, const std::string& name) {
  Builder& b = n.b;
  ValueId z = b.matmul(h, weight(n, name + ".w", in, out));
  auto [a, rows] = n.whole_rows(z);
  const int64_t e = n.m.graph.value(a->col_idx).shape[0];
  ValueId s_src = b.matmul(rows, weight(n, name + ".att_src", out, 1));  // [rows, 1]
  ValueId s_dst = b.matmul(z, weight(n, name + ".att_dst", out, 1));     // [N, 1]
  // Per entry (i <- j): s_dst[i] + s_src[j], gathered with embedding lookups.
  ValueId score = b.add(b.embedding(s_dst, a->rows), b.embedding(s_src, a->col_idx));  // [E, 1]
  score = b.reshape(score, {e});
  // leaky_relu(x, 0.2) = 0.8 relu(x) + 0.2 x
  score = b.add(b.scale(b.relu(score), 0.8), b.scale(score, 0.2));
  ValueId alpha = b.edge_softmax(a->row_ptr, score);
  return b.spmm(a->row_ptr, a->col_idx, rows, alpha);
}

// heads == 1: one head of width `out` (parameters conv.w, conv.att_src,
// conv.att_dst). Otherwise heads of width out / heads placed side by side
// (concat) or of width out averaged (the last layer), parameters
// conv.head<k>.*; the placement is a product with a constant 0/1 matrix.
ValueId gat_conv(Net& n, ValueId h, int64_t in, int64_t out, int64_t heads, bool concat,
                 const std::string& name) {
  Builder& b = n.b;
  if (heads == 1) return bias_add(n, gat_head(n, h, in, out, name), out, name);
  const int64_t width = concat ? out / heads : out;
  ValueId sum = kNoValue;
  for (int64_t k = 0; k < heads; ++k) {
    const std::string hn = fmt::format("{}.head{}", name, k);
    ValueId y = gat_head(n, h, in, width, hn);
    if (concat) {
      std::vector<float> place(static_cast<size_t>(width * out), 0.0f);
      for (int64_t c = 0; c < width; ++c) place[static_cast<size_t>(c * out + k * width + c)] = 1;
      ValueId p = b.input(hn + ".place", {width, out});
      n.m.constants.emplace_back(p, tensor_from(place).reshape(Shape{width, out}));
      y = b.matmul(y, p);
    }
    sum = sum == kNoValue ? y : b.add(sum, y);
  }
  if (!concat) sum = b.scale(sum, 1.0 / static_cast<double>(heads));
  return bias_add(n, sum, out, name);
}

void check_shard(const ModelSpec& spec, const GnnShard& s) {
  if (gnn_needs_whole_rows(spec) && s.replication > 1) {
    throw ConfigError(fmt::format(
        "gnn.replication = {}: model.kind {}{} needs each vertex's whole neighbourhood in one "
        "place, which 1.5D splits over the replicas; use gnn.replication = 1",
        s.replication, spec.kind, spec.kind == "sage" ? " with max aggregation" : ""));
  }
  const auto ranks = static_cast<size_t>(s.exchange_ranks);
  MT_CHECK(s.rank >= 0 && s.rank < s.ranks, "shard rank {} of {}", s.rank, s.ranks);
  MT_CHECK(s.send_counts.size() == ranks && s.recv_counts.size() == ranks,
           "shard counts for {} exchange ranks", s.exchange_ranks);
  MT_CHECK(s.replication >= 1 && s.ranks % s.replication == 0, "replication {} of {} ranks",
           s.replication, s.ranks);
  MT_CHECK_EQ(std::accumulate(s.send_counts.begin(), s.send_counts.end(), int64_t{0}),
              static_cast<int64_t>(s.send_rows.size()));
  MT_CHECK_EQ(std::accumulate(s.recv_counts.begin(), s.recv_counts.end(), int64_t{0}), s.halo);
  MT_CHECK(s.local_adj.rows == s.local && s.local_adj.cols == s.local &&
               s.halo_adj.rows == s.local && s.halo_adj.cols == s.halo,
           "shard adjacency {}x{} and {}x{} for {} local and {} halo rows", s.local_adj.rows,
           s.local_adj.cols, s.halo_adj.rows, s.halo_adj.cols, s.local, s.halo);
}

}  // namespace

bool gnn_needs_whole_rows(const ModelSpec& spec) {
  return spec.kind == "gat" || (spec.kind == "sage" && spec.sage_aggregation == "max");
}

bool is_gnn(const std::string& kind) {
  return kind == "gcn" || kind == "sage" || kind == "gat" || kind == "resgcn";
}

GnnAdjacency gnn_adjacency(const ModelSpec& spec, const Csr& adj) {
  GnnAdjacency g;
  if (spec.kind == "gcn" || spec.kind == "resgcn") {
    g.a = with_self_loops(adj);
    g.values = gcn_norm_values(g.a);
  } else if (spec.kind == "sage") {
    g.a = adj;
    if (spec.sage_aggregation != "max") g.values = mean_values(adj);
  } else {
    g.a = with_self_loops(adj);
  }
  return g;
}

ModelGraph build_gnn(const ModelSpec& spec, const GnnGraph& g) {
  if (!is_gnn(spec.kind)) {
    throw ConfigError(
        fmt::format("model.kind: '{}' is not a graph neural network (expected gcn, "
                    "sage, gat or resgcn)",
                    spec.kind));
  }
  if (spec.compute != DType::f32) {
    throw ConfigError(
        fmt::format("model.kind {}: sparse operators compute in f32 only; set "
                    "train.precision = \"f32\"",
                    spec.kind));
  }
  if (spec.kind == "sage" && spec.sage_aggregation != "mean" && spec.sage_aggregation != "max") {
    throw ConfigError(
        fmt::format("model.sage_aggregation: '{}' (expected mean or max)", spec.sage_aggregation));
  }
  if (spec.gnn_layers < 1 || spec.gnn_hidden < 1) {
    throw ConfigError(fmt::format("model.gnn_layers ({}) and model.gnn_hidden ({}) must be >= 1",
                                  spec.gnn_layers, spec.gnn_hidden));
  }
  if (spec.kind == "gat" &&
      (spec.gat_heads < 1 || (spec.gnn_layers > 1 && spec.gnn_hidden % spec.gat_heads != 0))) {
    throw ConfigError(fmt::format(
        "model.gat_heads = {}: expected >= 1 and a divisor of model.gnn_hidden ({}), whose "
        "columns the heads of a hidden layer share",
        spec.gat_heads, spec.gnn_hidden));
  }
  const GnnShard* shard = g.shard;
  GnnAdjacency whole;
  if (shard != nullptr) {
    check_shard(spec, *shard);
  } else {
    MT_CHECK(g.adj != nullptr, "build_gnn: no adjacency");
    if (g.adj->rows != g.adj->cols) {
      throw ConfigError(
          fmt::format("build_gnn: adjacency is {}x{}, not square", g.adj->rows, g.adj->cols));
    }
    whole = gnn_adjacency(spec, *g.adj);
  }
  // A rank may own no training vertex; one process must have some.
  if (g.loss_vertices.empty() && shard == nullptr) {
    throw ConfigError("build_gnn: no vertex is in the training mask, so the loss is empty");
  }
  const Csr& a = shard != nullptr ? shard->local_adj : whole.a;
  const std::vector<float>& values = shard != nullptr ? shard->local_values : whole.values;
  const int64_t n = a.rows, f = g.features, c = g.classes, hid = spec.gnn_hidden;
  ModelGraph m;
  m.batch = static_cast<int64_t>(g.loss_vertices.size());
  Builder b(m.graph);
  m.x = b.input("x", {n, f});
  m.y = b.input("y", {m.batch}, DType::i32);

  Net net{b, m, shard, {}, {}, kNoValue, {}, {}, {}, kNoValue};
  net.adj = bind_adj(b, m, "adj", a, values.empty() ? nullptr : &values, spec.kind == "gat");
  if (net.distributed() && shard->exchange_ranks > 1) {
    net.halo_adj = bind_adj(b, m, "halo_adj", shard->halo_adj,
                            shard->halo_values.empty() ? nullptr : &shard->halo_values, false);
    net.send_rows =
        b.input("halo.send_rows", {static_cast<int64_t>(shard->send_rows.size())}, DType::i32);
    m.constants.emplace_back(net.send_rows, tensor_from(shard->send_rows));
    if (gnn_needs_whole_rows(spec)) {
      const int64_t joined = shard->local + shard->halo;
      net.joined_adj = bind_adj(b, m, "joined_adj", join_rows(shard->local_adj, shard->halo_adj),
                                nullptr, spec.kind == "gat");
      net.place_local =
          bind_adj(b, m, "place_local", placement(joined, 0, shard->local), nullptr, false);
      net.place_halo = bind_adj(b, m, "place_halo", placement(joined, shard->local, shard->halo),
                                nullptr, false);
    }
  }

  ValueId h = m.x;
  if (spec.kind == "gcn") {
    int64_t width = f;
    for (int64_t l = 0; l < spec.gnn_layers; ++l) {
      const bool last = l + 1 == spec.gnn_layers;
      const int64_t out = last ? c : hid;
      h = gcn_conv(net, h, width, out, fmt::format("conv{}", l + 1));
      if (!last) h = b.relu(h);
      width = out;
    }
  } else if (spec.kind == "resgcn") {
    h = b.matmul(h, weight(net, "input.w", f, hid));
    auto norm = [&](ValueId v, const std::string& name) {
      ValueId gm = net.param(name + ".gamma", {hid}, ParamInit{ParamInit::Kind::ones, 0});
      ValueId bt = net.param(name + ".beta", {hid}, ParamInit{ParamInit::Kind::zeros, 0});
      return b.relu(b.layer_norm(v, gm, bt));
    };
    for (int64_t l = 0; l < spec.gnn_layers; ++l) {
      const std::string name = fmt::format("block{}", l + 1);
      h = b.add(h, gcn_conv(net, norm(h, name + ".norm"), hid, hid, name + ".conv"));
    }
    h = bias_add(net, b.matmul(norm(h, "final_norm"), weight(net, "head.w", hid, c)), c, "head");
  } else if (spec.kind == "sage") {
    const bool max = spec.sage_aggregation == "max";
    int64_t width = f;
    for (int64_t l = 0; l < spec.gnn_layers; ++l) {
      const bool last = l + 1 == spec.gnn_layers;
      const int64_t out = last ? c : hid;
      h = sage_conv(net, h, width, out, fmt::format("conv{}", l + 1), max);
      if (!last) h = b.relu(h);
      width = out;
    }
  } else {  // gat
    int64_t width = f;
    for (int64_t l = 0; l < spec.gnn_layers; ++l) {
      const bool last = l + 1 == spec.gnn_layers;
      const int64_t out = last ? c : hid;
      h = gat_conv(net, h, width, out, spec.gat_heads, !last, fmt::format("conv{}", l + 1));
      if (!last) h = b.relu(h);
      width = out;
    }
  }
  m.logits = b.name(h, "logits");
  if (shard == nullptr) {
    ValueId idx = b.input("loss_vertices", {m.batch}, DType::i32);
    m.constants.emplace_back(idx, tensor_from(g.loss_vertices));
    m.loss = b.cross_entropy(b.embedding(m.logits, idx), m.y);
  } else if (m.batch > 0) {
    // This rank's share of the global mean: (its mean) x (its count / total).
    ValueId idx = b.input("loss_vertices", {m.batch}, DType::i32);
    m.constants.emplace_back(idx, tensor_from(g.loss_vertices));
    m.loss = b.scale(b.cross_entropy(b.embedding(m.logits, idx), m.y),
                     static_cast<double>(m.batch) / (static_cast<double>(shard->loss_total) *
                                                     static_cast<double>(shard->replication)));
  } else {
    // No loss vertex here: a zero loss that still differentiates to the
    // logits (zeros), so backward -- and its halo exchanges -- run as on the
    // other ranks.
    m.loss = b.scale(b.sum_to(m.logits, {}), 0.0);
  }
  return m;
}

bool sage_projects_first(int64_t in, int64_t out) {
  return out < in;
}

int64_t gnn_message_width(const ModelSpec& spec, int64_t layer, int64_t features, int64_t classes) {
  const int64_t hid = spec.gnn_hidden;
  const int64_t out = layer + 1 == spec.gnn_layers ? classes : hid;
  if (spec.kind == "resgcn") return hid;
  if (spec.kind == "sage") {
    const int64_t in = layer == 0 ? features : hid;
    return spec.sage_aggregation != "max" && sage_projects_first(in, out) ? out : in;
  }
  return out;  // gcn: act(h) W
}

bool gnn_message_has_grad(const ModelSpec& spec, int64_t layer, int64_t features, int64_t classes) {
  if (spec.kind != "sage" || layer != 0) return true;
  // sage's layer-0 message: the features themselves (no gradient) unless
  // it projects first.
  const int64_t out = spec.gnn_layers == 1 ? classes : spec.gnn_hidden;
  return spec.sage_aggregation != "max" && sage_projects_first(features, out);
}

void check_layer_chunk_model(const ModelSpec& spec) {
  if (!(spec.kind == "gcn" || spec.kind == "resgcn" ||
        (spec.kind == "sage" && spec.sage_aggregation == "mean"))) {
    throw ConfigError(fmt::format(
        "gnn.parallel = \"layer\": model.kind {}{} is not supported (layer pipelining splits a "
        "layer into per-vertex messages summed over in-neighbours; gcn, resgcn and sage with "
        "mean aggregation are)",
        spec.kind, spec.kind == "sage" ? " with max aggregation" : ""));
  }
}

GnnChunkGraph build_gnn_layer_chunk(const ModelSpec& spec, const GnnLayerChunk& c, int64_t features,
                                    int64_t classes) {
  check_layer_chunk_model(spec);
  const int64_t layers = spec.gnn_layers, hid = spec.gnn_hidden;
  MT_CHECK(c.first_layer >= 0 && c.first_layer < c.last_layer && c.last_layer <= layers,
           "layers [{}, {}) of {}", c.first_layer, c.last_layer, layers);
  const auto rows = static_cast<int64_t>(c.rows.size());
  MT_CHECK(c.adj_in.rows == rows && c.adj_in.cols == rows && c.adj_out.rows == rows &&
               c.adj_out.cols == c.vertices,
           "chunk adjacency {}x{} and {}x{} for {} rows of {}", c.adj_in.rows, c.adj_in.cols,
           c.adj_out.rows, c.adj_out.cols, rows, c.vertices);
  const bool first = c.first_layer == 0, last = c.last_layer == layers;
  const bool resgcn = spec.kind == "resgcn", sage = spec.kind == "sage";

  const GnnShard* shard = c.shard;
  if (shard != nullptr) {
    MT_CHECK(shard->replication == 1 && shard->exchange_ranks == shard->ranks,
             "hybrid chunk shard: 1D only");
    MT_CHECK(shard->halo_adj.rows == rows && shard->halo_adj.cols == shard->halo,
             "hybrid chunk halo adjacency {}x{} for {} rows and {} halo rows", shard->halo_adj.rows,
             shard->halo_adj.cols, rows, shard->halo);
    MT_CHECK_EQ(std::accumulate(shard->send_counts.begin(), shard->send_counts.end(), int64_t{0}),
                static_cast<int64_t>(shard->send_rows.size()));
    MT_CHECK_EQ(std::accumulate(shard->recv_counts.begin(), shard->recv_counts.end(), int64_t{0}),
                shard->halo);
  }

  ModelGraph m;
  Builder b(m.graph);
  Net net{b, m, shard, {}, {}, kNoValue, {}, {}, {}, kNoValue};
  const AdjInputs inside = bind_adj(b, m, "adj_in", c.adj_in, &c.values_in, false);
  const AdjInputs outside = bind_adj(b, m, "adj_out", c.adj_out, &c.values_out, false);
  // The chunk's own rows are the "local" part of graph parallelism's
  // aggregation; with a shard its halo part and exchange come with them.
  net.adj = inside;
  if (net.distributed() && shard->exchange_ranks > 1) {
    net.halo_adj = bind_adj(b, m, "halo_adj", shard->halo_adj,
                            shard->halo_values.empty() ? nullptr : &shard->halo_values, false);
    net.send_rows =
        b.input("halo.send_rows", {static_cast<int64_t>(shard->send_rows.size())}, DType::i32);
    m.constants.emplace_back(net.send_rows, tensor_from(shard->send_rows));
  }

  GnnChunkGraph out;
  const int64_t width_in = first ? features : hid;
  out.h_in = b.input(first ? "x" : "h_in", {rows, width_in});
  ValueId h = out.h_in;
  auto norm = [&](ValueId v, const std::string& name) {
    ValueId gm = net.param(name + ".gamma", {hid}, ParamInit{ParamInit::Kind::ones, 0});
    ValueId bt = net.param(name + ".beta", {hid}, ParamInit{ParamInit::Kind::zeros, 0});
    return b.relu(b.layer_norm(v, gm, bt));
  };
  if (first && resgcn) h = b.matmul(h, weight(net, "input.w", features, hid));
  for (int64_t l = c.first_layer; l < c.last_layer; ++l) {
    const int64_t mw = gnn_message_width(spec, l, features, classes);
    const int64_t in = l == 0 && !resgcn ? features : hid;
    const bool out_last = l + 1 == layers;
    const std::string name = resgcn ? fmt::format("block{}", l + 1) : fmt::format("conv{}", l + 1);
    // The message of the chunk's rows.
    ValueId act = l > 0 && !resgcn ? b.relu(h) : h;
    ValueId msg = kNoValue;
    if (resgcn) {
      msg = b.matmul(norm(h, name + ".norm"), weight(net, name + ".conv.w", hid, hid));
    } else if (sage) {
      // The neighbour projection before the aggregation when it is narrower
      // (sage_projects_first), as build_gnn does.
      const int64_t o = out_last ? classes : hid;
      msg = sage_projects_first(in, o) ? b.matmul(act, weight(net, name + ".w_neigh", in, o)) : act;
    } else {
      msg = b.matmul(act, weight(net, name + ".w", in, out_last ? classes : hid));
    }
    ValueId other = b.input(fmt::format("messages_other{}", l), {c.vertices, mw});
    out.messages_other.push_back(other);
    out.messages.push_back(msg);
    // Over the in-neighbours: those outside the chunk (from the buffer),
    // then those inside (this chunk's messages).
    // With a shard the inside part is graph parallelism's aggregation:
    // the chunk's rows plus the halo rows its exchange brings in.
    ValueId agg =
        b.add(b.spmm(outside.row_ptr, outside.col_idx, other, outside.values), net.aggregate(msg));
    out.halo_in.push_back(net.last_recv);
    if (resgcn) {
      h = b.add(h, bias_add(net, agg, hid, name + ".conv"));
    } else if (sage) {
      const int64_t o = out_last ? classes : hid;
      ValueId self = b.matmul(act, weight(net, name + ".w_self", in, o));
      ValueId neigh =
          sage_projects_first(in, o) ? agg : b.matmul(agg, weight(net, name + ".w_neigh", in, o));
      h = bias_add(net, b.add(self, neigh), o, name);
    } else {
      h = bias_add(net, agg, out_last ? classes : hid, name);
    }
  }
  if (!last) {
    out.h_out = b.name(h, "h_out");
  } else {
    if (resgcn) {
      h = bias_add(net, b.matmul(norm(h, "final_norm"), weight(net, "head.w", hid, classes)),
                   classes, "head");
    }
    out.logits = b.name(h, "logits");
    const auto t = static_cast<int64_t>(c.loss_rows.size());
    MT_CHECK(c.loss_total > 0, "no training vertex in the graph");
    if (t > 0) {
      out.y = b.input("y", {t}, DType::i32);
      ValueId idx = b.input("loss_rows", {t}, DType::i32);
      m.constants.emplace_back(idx, tensor_from(c.loss_rows));
      out.loss = b.scale(b.cross_entropy(b.embedding(out.logits, idx), out.y),
                         static_cast<double>(t) / static_cast<double>(c.loss_total));
    } else {
      // No training vertex in this chunk: a zero loss that still
      // differentiates (to zeros), so the backward runs as for the others.
      out.loss = b.scale(b.sum_to(out.logits, {}), 0.0);
    }
  }
  out.graph = std::move(m.graph);
  out.constants = std::move(m.constants);
  return out;
}

}  // namespace mt
