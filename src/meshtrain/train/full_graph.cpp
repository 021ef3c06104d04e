#include "meshtrain/train/full_graph.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "meshtrain/base/error.h"
#include "meshtrain/exec/executor.h"
#include "meshtrain/graph/autodiff.h"
#include "meshtrain/graph/collective.h"
#include "meshtrain/spmd/collective_runner.h"
#include "meshtrain/train/grad_clip.h"
#include "meshtrain/train/graph_parallel.h"
#include "meshtrain/train/layer_pipeline.h"
#include "meshtrain/train/lr_schedule.h"
#include "meshtrain/train/metrics.h"
#include "meshtrain/train/param_store.h"

namespace mt {

double masked_accuracy(const Tensor& logits, const std::vector<int32_t>& labels,
                       const std::vector<int32_t>& vertices) {
  if (vertices.empty()) return 0;
  const int64_t c = logits.shape()[1];
  const float* p = logits.data<float>();
  int64_t right = 0;
  for (int32_t v : vertices) {
    const float* row = p + static_cast<int64_t>(v) * c;
    const auto best = std::max_element(row, row + c) - row;
    right += best == labels[static_cast<size_t>(v)] ? 1 : 0;
  }
  return static_cast<double>(right) / static_cast<double>(vertices.size());
}

void finish_full_graph(FullGraphResult& r, const GraphEpoch& final_pass, MetricsWriter& metrics) {
  r.final_loss = final_pass.loss;
  r.train_acc = final_pass.train_acc;
  r.val_acc = final_pass.val_acc;
  r.test_acc = final_pass.test_acc;
  std::vector<double> times;
  for (const auto& e : r.epochs) times.push_back(e.seconds);
  if (!times.empty()) {
    std::nth_element(times.begin(), times.begin() + static_cast<int64_t>(times.size() / 2),
                     times.end());
    r.median_epoch_seconds = times[times.size() / 2];
  }
  metrics.write({{"final", true},
                 {"loss", r.final_loss},
                 {"train_acc", r.train_acc},
                 {"val_acc", r.val_acc},
                 {"test_acc", r.test_acc},
                 {"median_epoch_s", r.median_epoch_seconds}});
}

namespace {

void refuse(bool bad, const char* key, const char* why) {
  if (bad) {
    throw ConfigError(
        fmt::format("{}: not supported by full-graph GNN training yet ({})", key, why));
  }
}

}  // namespace

FullGraphResult train_full_graph(const ModelSpec& spec, const GraphData& g,
                                 const TrainerOptions& opts,
                                 const std::function<void(const std::string&)>& log,
                                 const GraphParallelOptions& par, Communicator* comm) {
  refuse(opts.precision != DType::f32 || opts.bf16_storage, "train.precision",
         "sparse kernels are f32");
  refuse(opts.max_steps > 0, "train.steps", "one step per epoch: use train.epochs");
  refuse(!opts.checkpoint_path.empty(), "train.checkpoint", "no checkpoints yet");
  refuse(!opts.resume_path.empty(), "train.resume", "no checkpoints yet");
  refuse(!opts.init_path.empty(), "train.init", "no weight import yet");
  check_graph_parts(par);
  if (par.mode == GnnParallel::layer) {
    if (comm == nullptr) {
      throw ConfigError("gnn.parallel = \"layer\" needs a communicator (run under mpirun)");
    }
    g.validate(g.name);
    return train_layer_pipeline(spec, g, opts, log, par, *comm);
  }
  const bool graph_parallel = par.mode == GnnParallel::graph;
  if (graph_parallel && comm == nullptr) {
    throw ConfigError("gnn.parallel = \"graph\" needs a communicator (run under mpirun)");
  }
  if (!graph_parallel && comm != nullptr && comm->size() > 1) {
    throw ConfigError(
        fmt::format("gnn.parallel = \"none\" trains in one process, but there are {} ranks; set "
                    "gnn.parallel = \"graph\"",
                    comm->size()));
  }
  g.validate(g.name);
  const int ranks = graph_parallel ? comm->size() : 1;
  const bool leader = !graph_parallel || comm->rank() == 0;

  // The rows this rank computes (all, in one process) and their masks.
  std::optional<GraphShard> shard;
  std::vector<int32_t> train_v, val_v, test_v, labels;
  GnnGraph gg;
  gg.features = g.feature_dim();
  gg.classes = g.classes;
  Tensor x = g.features;
  const int64_t c = graph_parallel ? par.replication : 1;
  if (c < 1 || ranks % c != 0) {
    throw ConfigError(fmt::format(
        "gnn.replication = {} must be >= 1 and divide the {} ranks (row blocks = ranks / "
        "replication)",
        c, ranks));
  }
  if (graph_parallel) {
    PartitionOptions po = par.partition;
    po.parts = ranks / c;
    const Partition part = partition_graph(g.adj, po);
    shard = make_graph_shard(g, spec, part, comm->rank(), c);
    train_v = shard->loss_vertices;
    val_v = shard->val_vertices;
    test_v = shard->test_vertices;
    for (int32_t v : shard->local_vertices) labels.push_back(g.labels[static_cast<size_t>(v)]);
    gg.shard = &shard->shard;
    x = gather_rows(g.features, shard->local_vertices);
  } else {
    train_v = GraphData::members(g.train_mask);
    val_v = GraphData::members(g.val_mask);
    test_v = GraphData::members(g.test_mask);
    labels = g.labels;
    gg.adj = &g.adj;
  }
  gg.loss_vertices = train_v;
  ModelGraph m = build_gnn(spec, gg);
  build_backward(m.graph, m.loss);

  ExecOptions eo = opts.exec;
  eo.num_threads = opts.threads;
  eo.outputs.push_back(m.logits);
  std::shared_ptr<CommCollectiveRunner> runner;
  if (graph_parallel && ranks > 1) {
    runner = std::make_shared<CommCollectiveRunner>(
        *comm, graph_parallel_groups(ranks, static_cast<int>(c)));
    eo.collectives = runner;
  }
  Executor ex(m.graph, eo);
  // No DataParallel: the store owns the gradients, which the graph itself
  // all-reduces under graph parallelism (copy_to_group on every parameter).
  ParamStore store(m.graph, opts.seed, /*with_grads=*/true);
  store.bind(ex, m.graph, true);
  for (auto& [v, t] : m.constants) ex.bind(v, t);
  ex.bind(m.x, x);
  Tensor y = Tensor::empty(Shape{static_cast<int64_t>(train_v.size())}, DType::i32);
  for (size_t i = 0; i < train_v.size(); ++i) {
    y.data<int32_t>()[i] = labels[static_cast<size_t>(train_v[i])];
  }
  ex.bind(m.y, y);

  std::unique_ptr<Optimizer> opt = make_optimizer(opts.optimizer, opts.optim);
  LrScheduleOptions so = opts.schedule;
  so.total_steps = opts.epochs;
  LrSchedule schedule(so);
  std::vector<ParamRef> refs;
  for (auto& e : store.entries()) refs.push_back(ParamRef{e.name, e.value, e.grad});
  auto metrics = opts.metrics_path.empty() || !leader
                     ? std::make_unique<MetricsWriter>()
                     : std::make_unique<MetricsWriter>(opts.metrics_path);

  // Global loss and accuracies: this rank's loss share and right counts,
  // summed over the ranks (f64, so the sums are exact).
  const double totals[3] = {
      static_cast<double>(std::count(g.train_mask.begin(), g.train_mask.end(), 1)),
      static_cast<double>(std::count(g.val_mask.begin(), g.val_mask.end(), 1)),
      static_cast<double>(std::count(g.test_mask.begin(), g.test_mask.end(), 1))};
  auto evaluate = [&](GraphEpoch& ep) {
    const Tensor logits = ex.get(m.logits);
    Tensor sums = Tensor::empty(Shape{4}, DType::f64);
    double* s = sums.data<double>();
    s[0] = ex.get(m.loss).item();
    const std::vector<int32_t>* sets[3] = {&train_v, &val_v, &test_v};
    for (int k = 0; k < 3; ++k) {
      // 1.5D: the c replicas of a block count its vertices c times.
      s[k + 1] = masked_accuracy(logits, labels, *sets[k]) * static_cast<double>(sets[k]->size()) /
                 static_cast<double>(c);
    }
    if (graph_parallel && ranks > 1) comm->all_reduce(sums);
    ep.loss = s[0];
    ep.train_acc = totals[0] > 0 ? s[1] / totals[0] : 0;
    ep.val_acc = totals[1] > 0 ? s[2] / totals[1] : 0;
    ep.test_acc = totals[2] > 0 ? s[3] / totals[2] : 0;
  };
  // Counters of the groups' communicators: parameters (0), the halo
  // exchange's and, under 1.5D, the replica group's.
  auto group_counters = [&](int64_t id) {
    Communicator* gc = runner ? runner->comm_of(id) : nullptr;
    return gc != nullptr ? gc->counters() : CommCounters{};
  };
  const int64_t exchange_id = shard ? shard->shard.exchange_group : 0;
  const int64_t replica_id = shard ? shard->shard.replica_group : -1;
  const CommCounters before[3] = {group_counters(0), group_counters(exchange_id),
                                  group_counters(replica_id)};

  FullGraphResult r;
  r.params = m.graph.param_count();
  for (int64_t epoch = 1; epoch <= opts.epochs; ++epoch) {
    const auto t0 = std::chrono::steady_clock::now();
    ex.run();
    if (opts.clip_grad_norm > 0) clip_grad_norm(refs, opts.clip_grad_norm);
    opt->step(refs, schedule.lr_at(epoch - 1));
    GraphEpoch ep;
    ep.epoch = epoch;
    ep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    evaluate(ep);
    r.epochs.push_back(ep);
    const bool logged = opts.log_every > 0 && (epoch % opts.log_every == 0 || epoch == opts.epochs);
    if (logged) {
      metrics->write({{"epoch", epoch},
                      {"loss", ep.loss},
                      {"train_acc", ep.train_acc},
                      {"val_acc", ep.val_acc},
                      {"test_acc", ep.test_acc},
                      {"epoch_s", ep.seconds}});
      if (log && leader) {
        log(fmt::format("epoch {} loss {:.4f} train {:.3f} val {:.3f} test {:.3f} ({:.1f} ms)",
                        epoch, ep.loss, ep.train_acc, ep.val_acc, ep.test_acc, 1e3 * ep.seconds));
      }
    }
  }
  if (runner && opts.epochs > 0) {
    const CommCounters after[3] = {group_counters(0), group_counters(exchange_id),
                                   group_counters(replica_id)};
    auto sent = [&](int i, const char* k) {
      auto at = [&](const CommCounters& cc) {
        auto it = cc.by_collective.find(k);
        return it == cc.by_collective.end() ? uint64_t{0} : it->second.bytes_sent;
      };
      return (at(after[i]) - at(before[i])) / static_cast<uint64_t>(opts.epochs);
    };
    r.halo_bytes_sent_per_epoch = sent(1, "all_to_allv");
    r.allreduce_bytes_sent_per_epoch = sent(0, "all_reduce");
    if (replica_id >= 0) {
      r.replica_bytes_sent_per_epoch = sent(2, "all_reduce");
      for (const Node& node : m.graph.nodes()) {
        if (node.op == OpKind::all_reduce && CollectiveAttrs::of(node).group == replica_id) {
          r.expected_replica_bytes_per_epoch += runner->cost_of(m.graph, node).bytes_sent;
        }
      }
    }
  }
  if (shard) {
    r.local_vertices = shard->shard.local;
    r.halo_vertices = shard->shard.halo;
    r.expected_halo_bytes_per_epoch =
        halo_bytes_per_epoch(spec, shard->shard, g.feature_dim(), g.classes);
  }
  ex.run_forward();
  GraphEpoch fin;
  evaluate(fin);
  for (auto& e : store.entries()) r.final_params.emplace_back(e.name, e.value.clone());
  finish_full_graph(r, fin, *metrics);
  return r;
}

}  // namespace mt
