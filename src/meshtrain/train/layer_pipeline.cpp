#include "meshtrain/train/layer_pipeline.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>

#include <fmt/format.h>

#include "meshtrain/base/error.h"
#include "meshtrain/data/graph_partition.h"
#include "meshtrain/exec/executor.h"
#include "meshtrain/graph/autodiff.h"
#include "meshtrain/graph/builder.h"
#include "meshtrain/train/grad_clip.h"
#include "meshtrain/train/graph_parallel.h"
#include "meshtrain/train/lr_schedule.h"
#include "meshtrain/train/metrics.h"
#include "meshtrain/train/optimizer.h"
#include "meshtrain/train/param_store.h"

namespace mt {

std::vector<std::pair<int64_t, int64_t>> layer_pipeline_stages(int64_t layers, int stages) {
  if (stages < 1 || layers < stages) {
    throw ConfigError(fmt::format(
        "gnn.parallel = \"layer\": model.gnn_layers = {} cannot be cut into {} stages (one per "
        "rank, each holding at least one graph layer)",
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

namespace {

// Vertices grouped into chunks by a partitioner (contiguous, random or
// locality: fewer edges between chunks, fewer historical messages read).
struct Chunks {
  std::vector<std::vector<int32_t>> rows;  // per chunk, ascending ids
  std::vector<int32_t> chunk_of;           // per vertex
  int64_t count() const { return static_cast<int64_t>(rows.size()); }
};

Chunks make_chunks(const GraphData& g, PartitionOptions po, int64_t k) {
  po.parts = k;
  const Partition p = partition_graph(g.adj, po);
  return Chunks{p.members(), p.owner};
}

// One chunk's graph on this stage, compiled, with the tensors bound to it.
struct ChunkRun {
  GnnChunkGraph cg;
  ValueId dh_out = kNoValue, dh_in = kNoValue;  // seed of h_out; gradient of h_in
  std::vector<ValueId> dmsg, dother;            // seeds of messages; gradients of messages_other
  std::unique_ptr<Executor> ex;
  Tensor h_in, dh_out_t, y;
  std::vector<Tensor> dmsg_t;
};

struct Stage {
  int index = 0, stages = 1;
  int64_t first = 0, last = 0;
  bool is_first() const { return index == 0; }
  bool is_last() const { return index + 1 == stages; }
};

// Splits the chunk's rows of `a` into entries inside the chunk (chunk-local
// columns) and outside (global columns).
void split_rows(const GnnAdjacency& a, const Chunks& ch, int64_t k, GnnLayerChunk& c) {
  const auto& rows = ch.rows[static_cast<size_t>(k)];
  std::vector<int32_t> local(ch.chunk_of.size(), -1);
  for (size_t i = 0; i < rows.size(); ++i)
    local[static_cast<size_t>(rows[i])] = static_cast<int32_t>(i);
  c.adj_in.rows = c.adj_in.cols = c.adj_out.rows = static_cast<int64_t>(rows.size());
  c.adj_out.cols = a.a.cols;
  c.adj_in.row_ptr.assign(1, 0);
  c.adj_out.row_ptr.assign(1, 0);
  for (int32_t v : rows) {
    const auto r = static_cast<size_t>(v);
    for (int32_t e = a.a.row_ptr[r]; e < a.a.row_ptr[r + 1]; ++e) {
      const int32_t u = a.a.col_idx[static_cast<size_t>(e)];
      const float w = a.values[static_cast<size_t>(e)];
      if (ch.chunk_of[static_cast<size_t>(u)] == k) {
        c.adj_in.col_idx.push_back(local[static_cast<size_t>(u)]);
        c.values_in.push_back(w);
      } else {
        c.adj_out.col_idx.push_back(u);
        c.values_out.push_back(w);
      }
    }
    c.adj_in.row_ptr.push_back(static_cast<int32_t>(c.adj_in.col_idx.size()));
    c.adj_out.row_ptr.push_back(static_cast<int32_t>(c.adj_out.col_idx.size()));
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
  const int64_t n = g.num_vertices(), features = g.feature_dim(), classes = g.classes;
  const auto ranges = layer_pipeline_stages(spec.gnn_layers, comm.size());
  Stage st;
  st.index = comm.rank();
  st.stages = comm.size();
  st.first = ranges[static_cast<size_t>(st.index)].first;
  st.last = ranges[static_cast<size_t>(st.index)].second;
  const int64_t hid = spec.gnn_hidden;
  const GnnAdjacency whole = gnn_adjacency(spec, g.adj);
  const std::vector<int32_t> train_v = GraphData::members(g.train_mask);
  const auto loss_total = static_cast<int64_t>(train_v.size());
  if (loss_total == 0) {
    throw ConfigError("build_gnn: no vertex is in the training mask, so the loss is empty");
  }
  // Stage-to-stage messages on a communicator of their own, so its
  // counters hold exactly the pipeline's bytes.
  std::unique_ptr<Communicator> pipe = comm.split(0, comm.rank(), "layer_pipeline");

  // Message buffers per layer of this stage: this epoch's, the previous
  // epoch's (the historical embeddings), their gradients, and the
  // `messages_other` input every chunk graph of the layer reads.
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

  auto build_runs = [&](const Chunks& ch) {
    std::vector<ChunkRun> runs(static_cast<size_t>(ch.count()));
    for (int64_t k = 0; k < ch.count(); ++k) {
      ChunkRun& r = runs[static_cast<size_t>(k)];
      GnnLayerChunk c;
      c.first_layer = st.first;
      c.last_layer = st.last;
      c.vertices = n;
      c.rows = ch.rows[static_cast<size_t>(k)];
      split_rows(whole, ch, k, c);
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
      if (r.cg.y != kNoValue) {
        r.y = Tensor::empty(Shape{static_cast<int64_t>(labels.size())}, DType::i32);
        std::copy(labels.begin(), labels.end(), r.y.data<int32_t>());
        r.ex->bind(r.cg.y, r.y);
      }
    }
    return runs;
  };

  const Chunks one = make_chunks(g, par.partition, 1);
  std::vector<ChunkRun> one_runs = build_runs(one);
  const Chunks many = par.chunks > 1 ? make_chunks(g, par.partition, par.chunks) : Chunks{};
  std::vector<ChunkRun> many_runs;
  if (par.chunks > 1 && par.startup_epochs < opts.epochs) many_runs = build_runs(many);

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
  // The stages hold disjoint parameters: a norm is the sum over the ranks.
  NormReducer over_stages = [&](std::span<double> v) {
    Tensor t = Tensor::empty(Shape{static_cast<int64_t>(v.size())}, DType::f64);
    std::copy(v.begin(), v.end(), t.data<double>());
    comm.all_reduce(t);
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
  const std::vector<int32_t> val_v = GraphData::members(g.val_mask);
  const std::vector<int32_t> test_v = GraphData::members(g.test_mask);

  // Forward (train: then backward) of every chunk, pipelined over the
  // stages; the last stage's loss and accuracies on every rank.
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
    Tensor s = Tensor::zeros(Shape{4}, DType::f64);
    if (st.is_last()) {
      double* p = s.data<double>();
      p[0] = loss;
      p[1] = masked_accuracy(logits_all, g.labels, train_v);
      p[2] = masked_accuracy(logits_all, g.labels, val_v);
      p[3] = masked_accuracy(logits_all, g.labels, test_v);
    }
    comm.broadcast(s, st.stages - 1);
    ep.loss = s.item(0);
    ep.train_acc = s.item(1);
    ep.val_acc = s.item(2);
    ep.test_acc = s.item(3);
  };

  FullGraphResult r;
  r.first_layer = st.first;
  r.last_layer = st.last;
  const CommCounters before = pipe->counters();
  for (int64_t epoch = 1; epoch <= opts.epochs; ++epoch) {
    const auto t0 = std::chrono::steady_clock::now();
    const bool chunked = par.chunks > 1 && epoch > par.startup_epochs;
    GraphEpoch ep;
    ep.epoch = epoch;
    pass(chunked ? many : one, chunked ? many_runs : one_runs, true, ep);
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
  if (opts.epochs > 0) {
    r.pipeline_bytes_sent_per_epoch =
        (pipe->counters().total_sent() - before.total_sent()) / static_cast<uint64_t>(opts.epochs);
  }
  r.expected_pipeline_bytes_per_epoch =
      layer_pipeline_bytes_per_epoch(spec, n, st.index, st.stages);

  // Final evaluation: one chunk, no staleness.
  GraphEpoch fin;
  pass(one, one_runs, false, fin);

  // Every stage's parameters on every rank, stage by stage (shapes from the
  // stage's graph for a one-vertex chunk).
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
      if (s == st.index) {
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
