#include "meshtrain/train/layer_pipeline.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>

#include <fmt/format.h>

#include "meshtrain/base/error.h"
#include "meshtrain/data/graph_partition.h"
#include "meshtrain/exec/executor.h"
#include "meshtrain/graph/autodiff.h"
#include "meshtrain/graph/builder.h"
#include "meshtrain/spmd/collective_runner.h"
#include "meshtrain/train/grad_clip.h"
#include "meshtrain/train/graph_parallel.h"
#include "meshtrain/train/lr_schedule.h"
#include "meshtrain/train/metrics.h"
#include "meshtrain/train/optimizer.h"
#include "meshtrain/train/param_store.h"

namespace mt {

std::vector<std::pair<int64_t, int64_t>> layer_pipeline_stages(int64_t layers, int stages) {
  if (stages < 1 || layers < stages) {
    throw ConfigError(
        fmt::format("gnn.parallel = \"layer\": model.gnn_layers = {} cannot be cut into {} stages "
                    "(dist.nproc / gnn.graph_parts, each holding at least one graph layer)",
                    layers, stages));
  }
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t at = 0;
  for (int s = 0; s < stages; ++s) {
    const int64_t n = layers / stages + (s < layers % stages ? 1 : 0);
    out.emplace_back(at, at + n);
    at += n;
  }
  return out;
}

int64_t layer_pipeline_bytes_per_epoch(const ModelSpec& spec, int64_t vertices, int stage,
                                       int stages) {
  const int64_t rows = vertices * spec.gnn_hidden * static_cast<int64_t>(sizeof(float));
  return (stage + 1 < stages ? rows : 0) + (stage > 0 ? rows : 0);
}

void check_graph_parts(const GraphParallelOptions& par) {
  if (par.graph_parts == 1 || par.mode == GnnParallel::layer) return;
  throw ConfigError(fmt::format(
      "gnn.graph_parts = {}: only with gnn.parallel = \"layer\" (the hybrid of layer pipelining "
      "with graph parallelism); gnn.parallel = \"{}\" {}",
      par.graph_parts, par.mode == GnnParallel::graph ? "graph" : "none",
      par.mode == GnnParallel::graph ? "partitions the graph over every rank already"
                                     : "trains in one process"));
}

int hybrid_stages(const GraphParallelOptions& par, int ranks) {
  const int64_t g = par.graph_parts;
  if (g < 1 || ranks % g != 0) {
    throw ConfigError(fmt::format(
        "gnn.graph_parts = {} must be >= 1 and divide the {} ranks (pipeline stages = ranks / "
        "graph_parts)",
        g, ranks));
  }
  if (g > 1 && par.replication != 1) {
    throw ConfigError(
        fmt::format("gnn.replication = {}: the hybrid of layer pipelining with graph parallelism "
                    "(gnn.graph_parts = {}) partitions each stage 1D; use gnn.replication = 1",
                    par.replication, g));
  }
  return static_cast<int>(ranks / g);
}

int64_t hybrid_halo_bytes_per_epoch(const ModelSpec& spec, int64_t send_rows, int64_t recv_rows,
                                    int64_t first, int64_t last, int64_t features,
                                    int64_t classes) {
  int64_t out = 0;
  for (int64_t l = first; l < last; ++l) {
    const int64_t w = gnn_message_width(spec, l, features, classes);
    const bool has_grad = gnn_message_has_grad(spec, l, features, classes);
    out += 2 * send_rows * w + (has_grad ? recv_rows * w : 0);
  }
  return out * static_cast<int64_t>(sizeof(float));
}

HybridBlocks hybrid_blocks(const Csr& adj, PartitionOptions po, int64_t parts, int64_t chunks) {
  const int64_t n = adj.rows;
  if (parts * chunks > n) {
    throw ConfigError(fmt::format(
        "gnn.chunks = {} x gnn.graph_parts = {} = {} vertex blocks for a graph of {} vertices "
        "(every block must hold a vertex)",
        chunks, parts, parts * chunks, n));
  }
  HybridBlocks out;
  po.parts = parts;
  out.part_of = partition_graph(adj, po).owner;
  out.chunk_of.assign(static_cast<size_t>(n), 0);
  if (chunks == 1) return out;
  std::vector<std::vector<int32_t>> members(static_cast<size_t>(parts));
  for (int32_t v = 0; v < n; ++v)
    members[static_cast<size_t>(out.part_of[static_cast<size_t>(v)])].push_back(v);
  std::vector<int32_t> local(static_cast<size_t>(n), -1);
  for (int64_t q = 0; q < parts; ++q) {
    const auto& m = members[static_cast<size_t>(q)];
    if (static_cast<int64_t>(m.size()) < chunks) {
      throw ConfigError(fmt::format(
          "gnn.chunks = {}: graph part {} of gnn.graph_parts = {} holds {} vertices (gnn.partition "
          "\"{}\"), fewer than the chunks",
          chunks, q, parts, m.size(), partition_method_name(po.method)));
    }
    // The part's induced subgraph, cut into chunks by the same partitioner.
    for (size_t i = 0; i < m.size(); ++i)
      local[static_cast<size_t>(m[i])] = static_cast<int32_t>(i);
    Csr sub;
    sub.rows = sub.cols = static_cast<int64_t>(m.size());
    sub.row_ptr.assign(1, 0);
    for (int32_t v : m) {
      for (int32_t e = adj.row_ptr[static_cast<size_t>(v)];
           e < adj.row_ptr[static_cast<size_t>(v) + 1]; ++e) {
        const int32_t u = adj.col_idx[static_cast<size_t>(e)];
        if (out.part_of[static_cast<size_t>(u)] == q)
          sub.col_idx.push_back(local[static_cast<size_t>(u)]);
      }
      sub.row_ptr.push_back(static_cast<int32_t>(sub.col_idx.size()));
    }
    PartitionOptions cpo = po;
    cpo.parts = chunks;
    const Partition c = partition_graph(sub, cpo);
    std::vector<int64_t> sizes(static_cast<size_t>(chunks), 0);
    for (size_t i = 0; i < m.size(); ++i) {
      out.chunk_of[static_cast<size_t>(m[i])] = c.owner[i];
      ++sizes[static_cast<size_t>(c.owner[i])];
    }
    for (int64_t k = 0; k < chunks; ++k) {
      if (sizes[static_cast<size_t>(k)] > 0) continue;
      throw ConfigError(fmt::format(
          "gnn.chunks = {} x gnn.graph_parts = {}: gnn.partition \"{}\" left chunk {} of graph "
          "part {} without a vertex; use fewer chunks or graph parts, or another gnn.partition",
          chunks, parts, partition_method_name(po.method), k, q));
    }
  }
  return out;
}

namespace {

// This rank's part's vertices by chunk; one chunk (startup epochs, final
// evaluation) is the whole part, with the same parts, so a rank's vertices
// never change.
struct Chunks {
  std::vector<std::vector<int32_t>> rows;  // this part's, per chunk, ascending ids
  std::vector<int32_t> chunk_of;           // per vertex of the graph (every part)
  int64_t count() const { return static_cast<int64_t>(rows.size()); }
};

struct Layout {
  std::vector<int32_t> part_of;  // per vertex
  Chunks one, many;              // many: empty when never chunked
};

Layout make_layout(const GraphData& g, const PartitionOptions& po, int64_t parts, int64_t chunks,
                   int64_t part) {
  const HybridBlocks hb = hybrid_blocks(g.adj, po, parts, chunks);
  const int64_t n = g.num_vertices();
  Layout out;
  out.part_of = hb.part_of;
  out.one.rows.resize(1);
  out.one.chunk_of.assign(static_cast<size_t>(n), 0);
  if (chunks > 1) {
    out.many.rows.resize(static_cast<size_t>(chunks));
    out.many.chunk_of = hb.chunk_of;
  }
  for (int32_t v = 0; v < n; ++v) {
    if (hb.part_of[static_cast<size_t>(v)] != part) continue;
    out.one.rows[0].push_back(v);
    if (chunks > 1)
      out.many.rows[static_cast<size_t>(hb.chunk_of[static_cast<size_t>(v)])].push_back(v);
  }
  return out;
}

// One chunk's graph on this stage, compiled, with the tensors bound to it.
struct ChunkRun {
  GnnChunkGraph cg;
  ValueId dh_out = kNoValue, dh_in = kNoValue;  // seed of h_out; gradient of h_in
  std::vector<ValueId> dmsg, dother;            // seeds of messages; gradients of messages_other
  std::unique_ptr<Executor> ex;
  Tensor h_in, dh_out_t, y;
  std::vector<Tensor> dmsg_t;
  // The hybrid: the halo rows this chunk's exchange receives (vertex ids),
  // the seeds of their gradients (kNoValue where none), and the bytes of
  // the parameter gradients' all-reduce per run.
  std::vector<int32_t> halo_vertices;
  std::vector<ValueId> drecv;
  std::vector<Tensor> drecv_t;
  uint64_t allreduce_bytes = 0;
};

struct Stage {
  int index = 0, stages = 1;
  int64_t first = 0, last = 0;
  bool is_first() const { return index == 0; }
  bool is_last() const { return index + 1 == stages; }
};

// Splits chunk k's rows of `a` (this part's share) by where each
// in-neighbour's message comes from: this chunk of this part (adj_in,
// chunk-local columns), this chunk of another part (the halo the stage's
// exchange brings in, with parts > 1: shard, halo_vertices), or another
// chunk (adj_out, global columns, read from messages_other). With parts >
// 1 the exchange of chunk k carries every row of chunk k that the other
// parts read anywhere (not only in chunk k), so later chunks find them
// fresh in the message buffer; its lists are computed the same way on
// both ends, ascending by part then id, as make_graph_shard's are.
void split_rows(const GnnAdjacency& a, const Layout& lay, const Chunks& ch, int64_t k, int64_t part,
                int64_t parts, int64_t group, GnnLayerChunk& c, GnnShard& s,
                std::vector<int32_t>& halo_vertices) {
  const auto& rows = ch.rows[static_cast<size_t>(k)];
  const auto n = static_cast<int64_t>(ch.chunk_of.size());
  auto part_of = [&](int32_t v) {
    return static_cast<int64_t>(lay.part_of[static_cast<size_t>(v)]);
  };
  auto chunk_of = [&](int32_t v) {
    return static_cast<int64_t>(ch.chunk_of[static_cast<size_t>(v)]);
  };
  std::vector<int32_t> local(static_cast<size_t>(n), -1);
  for (size_t i = 0; i < rows.size(); ++i)
    local[static_cast<size_t>(rows[i])] = static_cast<int32_t>(i);
  std::vector<int32_t> halo_id(static_cast<size_t>(n), -1);
  halo_vertices.clear();
  if (parts > 1) {
    // Halo: chunk k's rows of other parts read by any row of this part.
    std::vector<std::vector<int32_t>> from(static_cast<size_t>(parts));
    for (int32_t v = 0; v < n; ++v) {
      if (part_of(v) != part) continue;
      for (int32_t e = a.a.row_ptr[static_cast<size_t>(v)];
           e < a.a.row_ptr[static_cast<size_t>(v) + 1]; ++e) {
        const int32_t u = a.a.col_idx[static_cast<size_t>(e)];
        if (part_of(u) != part && chunk_of(u) == k && halo_id[static_cast<size_t>(u)] < 0) {
          halo_id[static_cast<size_t>(u)] = 0;
          from[static_cast<size_t>(part_of(u))].push_back(u);
        }
      }
    }
    number_halo_rows(from, s.recv_counts, halo_id, halo_vertices);
    // Sends: this chunk's rows each other part reads anywhere, ascending.
    s.send_counts.assign(static_cast<size_t>(parts), 0);
    std::vector<int64_t> stamp(static_cast<size_t>(n), -1);
    for (int64_t q = 0; q < parts; ++q) {
      if (q == part) continue;
      std::vector<int32_t> wanted;
      for (int32_t v = 0; v < n; ++v) {
        if (part_of(v) != q) continue;
        for (int32_t e = a.a.row_ptr[static_cast<size_t>(v)];
             e < a.a.row_ptr[static_cast<size_t>(v) + 1]; ++e) {
          const int32_t u = a.a.col_idx[static_cast<size_t>(e)];
          if (local[static_cast<size_t>(u)] >= 0 && stamp[static_cast<size_t>(u)] != q) {
            stamp[static_cast<size_t>(u)] = q;
            wanted.push_back(u);
          }
        }
      }
      std::sort(wanted.begin(), wanted.end());
      s.send_counts[static_cast<size_t>(q)] = static_cast<int64_t>(wanted.size());
      for (int32_t u : wanted) s.send_rows.push_back(local[static_cast<size_t>(u)]);
    }
    s.group = s.exchange_group = group;
    s.rank = s.exchange_rank = part;
    s.ranks = s.exchange_ranks = parts;
    s.replication = 1;
    s.replica_group = -1;
    s.local = static_cast<int64_t>(rows.size());
    s.halo = static_cast<int64_t>(halo_vertices.size());
    s.halo_adj.rows = s.local;
    s.halo_adj.cols = s.halo;
    s.halo_adj.row_ptr.assign(1, 0);
  }
  c.adj_in.rows = c.adj_in.cols = c.adj_out.rows = static_cast<int64_t>(rows.size());
  c.adj_out.cols = a.a.cols;
  c.adj_in.row_ptr.assign(1, 0);
  c.adj_out.row_ptr.assign(1, 0);
  for (int32_t v : rows) {
    const auto r = static_cast<size_t>(v);
    for (int32_t e = a.a.row_ptr[r]; e < a.a.row_ptr[r + 1]; ++e) {
      const int32_t u = a.a.col_idx[static_cast<size_t>(e)];
      const float w = a.values[static_cast<size_t>(e)];
      if (chunk_of(u) != k) {
        c.adj_out.col_idx.push_back(u);
        c.values_out.push_back(w);
      } else if (part_of(u) == part) {
        c.adj_in.col_idx.push_back(local[static_cast<size_t>(u)]);
        c.values_in.push_back(w);
      } else {
        s.halo_adj.col_idx.push_back(halo_id[static_cast<size_t>(u)]);
        s.halo_values.push_back(w);
      }
    }
    c.adj_in.row_ptr.push_back(static_cast<int32_t>(c.adj_in.col_idx.size()));
    c.adj_out.row_ptr.push_back(static_cast<int32_t>(c.adj_out.col_idx.size()));
    if (parts > 1) s.halo_adj.row_ptr.push_back(static_cast<int32_t>(s.halo_adj.col_idx.size()));
  }
  if (parts > 1) {
    s.local_adj = c.adj_in;
    s.local_values = c.values_in;
  }
}

void copy_rows(const Tensor& src, const std::vector<int32_t>& rows, Tensor& dst, bool scatter) {
  // scatter: dst[rows[i]] = src[i]; else dst[i] = src[rows[i]].
  const int64_t w = dst.shape()[1];
  const float* s = src.data<float>();
  float* d = dst.data<float>();
  const auto bytes = static_cast<size_t>(w) * sizeof(float);
  for (size_t i = 0; i < rows.size(); ++i) {
    const int64_t a = static_cast<int64_t>(i), b = rows[i];
    if (scatter) {
      std::memcpy(d + b * w, s + a * w, bytes);
    } else {
      std::memcpy(d + a * w, s + b * w, bytes);
    }
  }
}

}  // namespace

FullGraphResult train_layer_pipeline(const ModelSpec& spec, const GraphData& g,
                                     const TrainerOptions& opts,
                                     const std::function<void(const std::string&)>& log,
                                     const GraphParallelOptions& par, Communicator& comm) {
  check_layer_chunk_model(spec);
  if (par.chunks < 1) {
    throw ConfigError(fmt::format("gnn.chunks = {}: expected >= 1", par.chunks));
  }
  if (par.startup_epochs < 0) {
    throw ConfigError(fmt::format("gnn.startup_epochs = {}: expected >= 0", par.startup_epochs));
  }
  const int stages = hybrid_stages(par, comm.size());
  const int64_t parts = par.graph_parts;
  const int64_t n = g.num_vertices(), features = g.feature_dim(), classes = g.classes;
  const auto ranges = layer_pipeline_stages(spec.gnn_layers, stages);
  // Rank = part x stages + stage: a graph part's stages are consecutive
  // ranks (a column), the ranks of one stage are `stages` apart.
  Stage st;
  st.index = comm.rank() % stages;
  st.stages = stages;
  st.first = ranges[static_cast<size_t>(st.index)].first;
  st.last = ranges[static_cast<size_t>(st.index)].second;
  const int64_t part = comm.rank() / stages;
  const int64_t hid = spec.gnn_hidden;
  const GnnAdjacency whole = gnn_adjacency(spec, g.adj);
  const std::vector<int32_t> train_v = GraphData::members(g.train_mask);
  const auto loss_total = static_cast<int64_t>(train_v.size());
  if (loss_total == 0) {
    throw ConfigError("build_gnn: no vertex is in the training mask, so the loss is empty");
  }
  // Stage-to-stage messages on a communicator of their own (the column of
  // this graph part, rank = stage), so its counters hold exactly the
  // pipeline's bytes.
  std::unique_ptr<Communicator> pipe =
      comm.split(static_cast<int>(part), st.index, "layer_pipeline");
  // The hybrid: each stage's graph parts exchange halo rows and all-reduce
  // parameter gradients over collective group `stage` (the graph's
  // collectives, run by this runner); gradient norms sum over the column.
  std::shared_ptr<CommCollectiveRunner> runner;
  std::unique_ptr<Communicator> column;
  if (parts > 1) {
    std::vector<std::vector<int>> groups(static_cast<size_t>(stages));
    for (int s = 0; s < stages; ++s) {
      for (int64_t q = 0; q < parts; ++q) {
        groups[static_cast<size_t>(s)].push_back(static_cast<int>(q) * stages + s);
      }
    }
    runner = std::make_shared<CommCollectiveRunner>(comm, groups);
    column = comm.split(static_cast<int>(part), st.index, "layer_pipeline_norms");
  }
  Communicator& norms = column ? *column : comm;

  // Message buffers per layer of this stage: this epoch's, the previous
  // epoch's (the historical embeddings), their gradients, and the
  // `messages_other` input every chunk graph of the layer reads. Indexed by
  // vertex id; a rank fills its part's rows and the halo rows it received.
  const int64_t nl = st.last - st.first;
  std::vector<Tensor> cur, prev, grad, other;
  for (int64_t l = st.first; l < st.last; ++l) {
    const Shape s{n, gnn_message_width(spec, l, features, classes)};
    cur.push_back(Tensor::zeros(s, DType::f32));
    prev.push_back(Tensor::zeros(s, DType::f32));
    grad.push_back(Tensor::zeros(s, DType::f32));
    other.push_back(Tensor::zeros(s, DType::f32));
  }

  std::unique_ptr<ParamStore> store;
  std::map<std::string, Tensor> scratch;  // one chunk's parameter gradients
  ExecOptions eo = opts.exec;
  eo.num_threads = opts.threads;
  eo.collectives = runner;
  // The halo rows' messages have a gradient unless they are sage's
  // features (layer 0's message the input itself, where it does not
  // project first).
  auto halo_has_grad = [&](int64_t l) { return gnn_message_has_grad(spec, l, features, classes); };
  int64_t halo_send_rows = 0, halo_recv_rows = 0;  // of the one-chunk exchange

  auto build_runs = [&](const Layout& lay, const Chunks& ch) {
    std::vector<ChunkRun> runs(static_cast<size_t>(ch.count()));
    for (int64_t k = 0; k < ch.count(); ++k) {
      ChunkRun& r = runs[static_cast<size_t>(k)];
      GnnLayerChunk c;
      GnnShard shard;
      c.first_layer = st.first;
      c.last_layer = st.last;
      c.vertices = n;
      c.rows = ch.rows[static_cast<size_t>(k)];
      split_rows(whole, lay, ch, k, part, parts, st.index, c, shard, r.halo_vertices);
      if (parts > 1) {
        shard.loss_total = loss_total;
        c.shard = &shard;
        if (ch.count() == 1) {
          halo_send_rows = static_cast<int64_t>(shard.send_rows.size());
          halo_recv_rows = shard.halo;
        }
      }
      std::vector<int32_t> labels;
      for (size_t i = 0; i < c.rows.size(); ++i) {
        const auto v = static_cast<size_t>(c.rows[i]);
        if (g.train_mask[v] != 0) {
          c.loss_rows.push_back(static_cast<int32_t>(i));
          labels.push_back(g.labels[v]);
        }
      }
      c.loss_total = loss_total;
      r.cg = build_gnn_layer_chunk(spec, c, features, classes);
      Graph& gr = r.cg.graph;
      const auto rows = static_cast<int64_t>(c.rows.size());
      std::vector<BackwardSeed> seeds;
      {
        Builder b(gr);
        if (st.is_last()) {
          seeds.push_back({r.cg.loss, kNoValue});
        } else {
          r.dh_out = b.input("dh_out", {rows, hid});
          seeds.push_back({r.cg.h_out, r.dh_out});
        }
        for (size_t l = 0; l < r.cg.messages.size(); ++l) {
          r.dmsg.push_back(b.input(fmt::format("dmessage{}", l), gr.value(r.cg.messages[l]).shape));
          seeds.push_back({r.cg.messages[l], r.dmsg.back()});
        }
        // Received halo rows that later chunks read from the buffer: the
        // gradient they gathered goes back with the exchange's backward.
        for (size_t l = 0; l < r.cg.halo_in.size(); ++l) {
          const ValueId h = r.cg.halo_in[l];
          if (h == kNoValue || ch.count() == 1 ||
              !halo_has_grad(st.first + static_cast<int64_t>(l))) {
            r.drecv.push_back(kNoValue);
            continue;
          }
          r.drecv.push_back(b.input(fmt::format("dhalo{}", l), gr.value(h).shape));
          seeds.push_back({h, r.drecv.back()});
        }
      }
      std::vector<ValueId> wrt = r.cg.messages_other;
      if (!st.is_first()) wrt.push_back(r.cg.h_in);
      std::vector<ValueId> grads = build_backward(gr, seeds, wrt);
      r.dother.assign(grads.begin(), grads.begin() + static_cast<int64_t>(nl));
      if (!st.is_first()) r.dh_in = grads.back();

      if (!store) {
        store = std::make_unique<ParamStore>(gr, opts.seed, /*with_grads=*/true);
        for (const auto& e : store->entries()) scratch[e.name] = Tensor::zeros(e.shape, DType::f32);
      }
      ExecOptions o = eo;
      for (ValueId v : {r.cg.h_out, r.cg.logits, r.cg.loss, r.dh_in}) {
        if (v != kNoValue) o.outputs.push_back(v);
      }
      for (ValueId v : r.cg.messages) o.outputs.push_back(v);
      for (ValueId v : r.cg.halo_in) {
        if (v != kNoValue) o.outputs.push_back(v);
      }
      for (ValueId v : r.dother) {
        if (v != kNoValue) o.outputs.push_back(v);
      }
      r.ex = std::make_unique<Executor>(gr, o);
      for (ValueId id : gr.params()) {
        const std::string& name = gr.value(id).name;
        const ParamStore::Entry* e = nullptr;
        for (const auto& en : store->entries()) {
          if (en.name == name) e = &en;
        }
        MT_CHECK(e != nullptr, "parameter {} not in the stage's store", name);
        r.ex->bind(id, e->value);
        if (gr.grad_of(id) != kNoValue) r.ex->bind(gr.grad_of(id), scratch.at(name));
      }
      for (auto& [v, t] : r.cg.constants) r.ex->bind(v, t);
      for (size_t l = 0; l < r.cg.messages_other.size(); ++l) {
        r.ex->bind(r.cg.messages_other[l], other[l]);
      }
      if (st.is_first()) {
        r.h_in = gather_rows(g.features, c.rows);
      } else {
        r.h_in = Tensor::zeros(Shape{rows, hid}, DType::f32);
      }
      r.ex->bind(r.cg.h_in, r.h_in);
      if (r.dh_out != kNoValue) {
        r.dh_out_t = Tensor::zeros(Shape{rows, hid}, DType::f32);
        r.ex->bind(r.dh_out, r.dh_out_t);
      }
      for (size_t l = 0; l < r.dmsg.size(); ++l) {
        r.dmsg_t.push_back(Tensor::zeros(gr.value(r.dmsg[l]).shape, DType::f32));
        r.ex->bind(r.dmsg[l], r.dmsg_t.back());
      }
      for (size_t l = 0; l < r.drecv.size(); ++l) {
        r.drecv_t.push_back(r.drecv[l] == kNoValue
                                ? Tensor()
                                : Tensor::zeros(gr.value(r.drecv[l]).shape, DType::f32));
        if (r.drecv[l] != kNoValue) r.ex->bind(r.drecv[l], r.drecv_t.back());
      }
      if (r.cg.y != kNoValue) {
        r.y = Tensor::empty(Shape{static_cast<int64_t>(labels.size())}, DType::i32);
        std::copy(labels.begin(), labels.end(), r.y.data<int32_t>());
        r.ex->bind(r.cg.y, r.y);
      }
      // What the parameter gradients' all-reduce over the stage's graph
      // parts costs per run, as the runner's communicator counts it.
      if (runner) {
        for (const Node& node : gr.nodes()) {
          if (node.op == OpKind::all_reduce || node.op == OpKind::reduce_from_group) {
            r.allreduce_bytes += runner->cost_of(gr, node).bytes_sent;
          }
        }
      }
    }
    return runs;
  };

  const bool chunked_ever = par.chunks > 1 && par.startup_epochs < opts.epochs;
  const Layout lay = make_layout(g, par.partition, parts, chunked_ever ? par.chunks : 1, part);
  std::vector<ChunkRun> one_runs = build_runs(lay, lay.one);
  std::vector<ChunkRun> many_runs;
  if (chunked_ever) many_runs = build_runs(lay, lay.many);

  // messages_other of layer l for chunk k: this epoch's messages of earlier
  // chunks, the previous epoch's of later ones, zero on the chunk's rows.
  auto fill_other = [&](const Chunks& ch, int64_t k) {
    for (int64_t l = 0; l < nl; ++l) {
      Tensor& o = other[static_cast<size_t>(l)];
      if (ch.count() == 1) {
        o.fill(0);
        continue;
      }
      const int64_t w = o.shape()[1];
      const auto bytes = static_cast<size_t>(w) * sizeof(float);
      float* d = o.data<float>();
      const float* c = cur[static_cast<size_t>(l)].data<float>();
      const float* p = prev[static_cast<size_t>(l)].data<float>();
      for (int64_t v = 0; v < n; ++v) {
        const int32_t at = ch.chunk_of[static_cast<size_t>(v)];
        if (at == k) {
          std::memset(d + v * w, 0, bytes);
        } else {
          std::memcpy(d + v * w, (at < k ? c : p) + v * w, bytes);
        }
      }
    }
  };

  std::vector<ParamRef> refs;
  for (auto& e : store->entries()) refs.push_back(ParamRef{e.name, e.value, e.grad});
  std::unique_ptr<Optimizer> opt = make_optimizer(opts.optimizer, opts.optim);
  // The stages hold disjoint parameters (a stage's graph parts the same,
  // all-reduced): a norm is the sum over one column of stages.
  NormReducer over_stages = [&](std::span<double> v) {
    Tensor t = Tensor::empty(Shape{static_cast<int64_t>(v.size())}, DType::f64);
    std::copy(v.begin(), v.end(), t.data<double>());
    norms.all_reduce(t);
    std::copy(t.data<double>(), t.data<double>() + v.size(), v.begin());
  };
  opt->set_norm_reducer(over_stages);
  LrScheduleOptions so = opts.schedule;
  so.total_steps = opts.epochs;
  LrSchedule schedule(so);
  const bool leader = comm.rank() == 0;
  auto metrics = opts.metrics_path.empty() || !leader
                     ? std::make_unique<MetricsWriter>()
                     : std::make_unique<MetricsWriter>(opts.metrics_path);
  Tensor logits_all = st.is_last() ? Tensor::zeros(Shape{n, classes}, DType::f32) : Tensor();
  // This part's vertices of each mask (the last stage counts their right
  // answers; the counts are summed over the ranks).
  std::vector<int32_t> mine[3];
  const std::vector<uint8_t>* masks[3] = {&g.train_mask, &g.val_mask, &g.test_mask};
  double totals[3] = {0, 0, 0};
  for (int m = 0; m < 3; ++m) {
    for (int32_t v : GraphData::members(*masks[m])) {
      totals[m] += 1;
      if (lay.part_of[static_cast<size_t>(v)] == part) mine[m].push_back(v);
    }
  }

  // Forward (train: then backward) of every chunk, pipelined over the
  // stages; the last stages' loss and accuracies on every rank.
  auto pass = [&](const Chunks& ch, std::vector<ChunkRun>& runs, bool train, GraphEpoch& ep) {
    std::vector<CommHandle> sends;
    std::vector<Tensor> sent;  // alive until the sends complete
    double loss = 0;
    for (int64_t k = 0; k < ch.count(); ++k) {
      ChunkRun& r = runs[static_cast<size_t>(k)];
      if (!st.is_first()) {
        pipe->recv(r.h_in.raw(), static_cast<size_t>(r.h_in.numel()), DType::f32, st.index - 1);
      }
      fill_other(ch, k);
      r.ex->run_forward();
      if (!st.is_last()) {
        sent.push_back(r.ex->get(r.cg.h_out).clone());
        sends.push_back(pipe->send_async(
            sent.back().raw(), static_cast<size_t>(sent.back().numel()), DType::f32, st.index + 1));
      } else {
        loss += r.ex->get(r.cg.loss).item();
        copy_rows(r.ex->get(r.cg.logits), ch.rows[static_cast<size_t>(k)], logits_all, true);
      }
      for (int64_t l = 0; l < nl; ++l) {
        copy_rows(r.ex->get(r.cg.messages[static_cast<size_t>(l)]), ch.rows[static_cast<size_t>(k)],
                  cur[static_cast<size_t>(l)], true);
        const ValueId h = r.cg.halo_in[static_cast<size_t>(l)];
        if (h != kNoValue)
          copy_rows(r.ex->get(h), r.halo_vertices, cur[static_cast<size_t>(l)], true);
      }
    }
    if (train) {
      for (auto& e : store->entries()) e.grad.fill(0);
      for (int64_t k = ch.count() - 1; k >= 0; --k) {
        ChunkRun& r = runs[static_cast<size_t>(k)];
        const auto& rows = ch.rows[static_cast<size_t>(k)];
        if (!st.is_last()) {
          pipe->recv(r.dh_out_t.raw(), static_cast<size_t>(r.dh_out_t.numel()), DType::f32,
                     st.index + 1);
        }
        for (int64_t l = 0; l < nl; ++l) {
          copy_rows(grad[static_cast<size_t>(l)], rows, r.dmsg_t[static_cast<size_t>(l)], false);
          if (r.drecv[static_cast<size_t>(l)] != kNoValue) {
            copy_rows(grad[static_cast<size_t>(l)], r.halo_vertices,
                      r.drecv_t[static_cast<size_t>(l)], false);
          }
        }
        fill_other(ch, k);
        r.ex->run();
        for (auto& e : store->entries()) {
          const Tensor& s = scratch.at(e.name);
          float* d = e.grad.data<float>();
          const float* a = s.data<float>();
          for (int64_t i = 0; i < s.numel(); ++i) d[i] += a[i];
        }
        if (ch.count() > 1) {
          // Gradients of the earlier chunks' messages this chunk read (this
          // part's and, in the hybrid, received halo rows).
          for (int64_t l = 0; l < nl; ++l) {
            const ValueId dv = r.dother[static_cast<size_t>(l)];
            if (dv == kNoValue) continue;
            const Tensor dO = r.ex->get(dv);
            Tensor& gz = grad[static_cast<size_t>(l)];
            const int64_t w = gz.shape()[1];
            const float* s = dO.data<float>();
            float* d = gz.data<float>();
            for (int64_t v = 0; v < n; ++v) {
              if (ch.chunk_of[static_cast<size_t>(v)] >= k) continue;
              for (int64_t j = 0; j < w; ++j) d[v * w + j] += s[v * w + j];
            }
          }
        }
        if (!st.is_first()) {
          sent.push_back(r.ex->get(r.dh_in).clone());
          sends.push_back(pipe->send_async(sent.back().raw(),
                                           static_cast<size_t>(sent.back().numel()), DType::f32,
                                           st.index - 1));
        }
      }
      for (auto& t : grad) t.fill(0);
    }
    for (auto& h : sends) h.wait();
    std::swap(cur, prev);  // this epoch's messages are the next one's history
    // Loss and right answers of every graph part's last stage, summed (the
    // other ranks add zeros, so with one part the sums are exact).
    Tensor s = Tensor::zeros(Shape{4}, DType::f64);
    if (st.is_last()) {
      double* p = s.data<double>();
      p[0] = loss;
      for (int m = 0; m < 3; ++m) {
        p[m + 1] = std::round(masked_accuracy(logits_all, g.labels, mine[m]) *
                              static_cast<double>(mine[m].size()));
      }
    }
    comm.all_reduce(s);
    ep.loss = s.item(0);
    ep.train_acc = totals[0] > 0 ? s.item(1) / totals[0] : 0;
    ep.val_acc = totals[1] > 0 ? s.item(2) / totals[1] : 0;
    ep.test_acc = totals[2] > 0 ? s.item(3) / totals[2] : 0;
  };

  // Counters of the stage group's communicator (halo exchange, gradient
  // all-reduce), per collective.
  auto group_sent = [&](const char* key) -> uint64_t {
    Communicator* gc = runner ? runner->comm_of(st.index) : nullptr;
    if (gc == nullptr) return 0;
    const CommCounters cc = gc->counters();
    auto it = cc.by_collective.find(key);
    return it == cc.by_collective.end() ? uint64_t{0} : it->second.bytes_sent;
  };

  FullGraphResult r;
  r.first_layer = st.first;
  r.last_layer = st.last;
  const CommCounters before = pipe->counters();
  const uint64_t halo_before = group_sent("all_to_allv"), reduce_before = group_sent("all_reduce");
  uint64_t expected_reduce = 0;
  for (int64_t epoch = 1; epoch <= opts.epochs; ++epoch) {
    const auto t0 = std::chrono::steady_clock::now();
    const bool chunked = par.chunks > 1 && epoch > par.startup_epochs;
    GraphEpoch ep;
    ep.epoch = epoch;
    auto& runs = chunked ? many_runs : one_runs;
    pass(chunked ? lay.many : lay.one, runs, true, ep);
    for (const ChunkRun& cr : runs) expected_reduce += cr.allreduce_bytes;
    if (opts.clip_grad_norm > 0) clip_grad_norm(refs, opts.clip_grad_norm, over_stages);
    opt->step(refs, schedule.lr_at(epoch - 1));
    ep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    r.epochs.push_back(ep);
    const bool logged = opts.log_every > 0 && (epoch % opts.log_every == 0 || epoch == opts.epochs);
    if (logged) {
      metrics->write({{"epoch", epoch},
                      {"loss", ep.loss},
                      {"train_acc", ep.train_acc},
                      {"val_acc", ep.val_acc},
                      {"test_acc", ep.test_acc},
                      {"epoch_s", ep.seconds},
                      {"chunks", chunked ? par.chunks : 1}});
      if (log && leader) {
        log(fmt::format("epoch {} loss {:.4f} train {:.3f} val {:.3f} test {:.3f} ({:.1f} ms{})",
                        epoch, ep.loss, ep.train_acc, ep.val_acc, ep.test_acc, 1e3 * ep.seconds,
                        chunked ? fmt::format(", {} chunks", par.chunks) : ", 1 chunk"));
      }
    }
  }
  const auto part_rows = static_cast<int64_t>(lay.one.rows[0].size());
  if (opts.epochs > 0) {
    const auto e = static_cast<uint64_t>(opts.epochs);
    r.pipeline_bytes_sent_per_epoch = (pipe->counters().total_sent() - before.total_sent()) / e;
    r.halo_bytes_sent_per_epoch = (group_sent("all_to_allv") - halo_before) / e;
    r.allreduce_bytes_sent_per_epoch = (group_sent("all_reduce") - reduce_before) / e;
    r.expected_allreduce_bytes_per_epoch = expected_reduce / e;
  }
  r.expected_pipeline_bytes_per_epoch =
      layer_pipeline_bytes_per_epoch(spec, part_rows, st.index, st.stages);
  if (parts > 1) {
    r.local_vertices = part_rows;
    r.halo_vertices = halo_recv_rows;
    r.expected_halo_bytes_per_epoch = hybrid_halo_bytes_per_epoch(
        spec, halo_send_rows, halo_recv_rows, st.first, st.last, features, classes);
  }

  // Final evaluation: one chunk, no staleness.
  GraphEpoch fin;
  pass(lay.one, one_runs, false, fin);

  // Every stage's parameters on every rank, stage by stage (shapes from the
  // stage's graph for a one-vertex chunk), from graph part 0's rank of the
  // stage (the parts hold the same values).
  for (int s = 0; s < st.stages; ++s) {
    GnnLayerChunk c;
    c.first_layer = ranges[static_cast<size_t>(s)].first;
    c.last_layer = ranges[static_cast<size_t>(s)].second;
    c.vertices = 1;
    c.rows = {0};
    c.adj_in.rows = c.adj_in.cols = c.adj_out.rows = c.adj_out.cols = 1;
    c.adj_in.row_ptr = c.adj_out.row_ptr = {0, 0};
    c.loss_rows = {0};
    c.loss_total = 1;
    const GnnChunkGraph shape = build_gnn_layer_chunk(spec, c, features, classes);
    for (ValueId id : shape.graph.params()) {
      const Value& v = shape.graph.value(id);
      Tensor t = Tensor::zeros(v.shape, DType::f32);
      if (s == st.index && part == 0) {
        for (const auto& e : store->entries()) {
          if (e.name == v.name) t = e.value.clone();
        }
      }
      comm.broadcast(t, s);
      r.final_params.emplace_back(v.name, t);
      r.params += t.numel();
    }
  }
  finish_full_graph(r, fin, *metrics);
  return r;
}

}  // namespace mt
