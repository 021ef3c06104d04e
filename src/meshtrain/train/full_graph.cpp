#include "meshtrain/train/full_graph.h"

#include <algorithm>
#include <chrono>
#include <memory>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "meshtrain/base/error.h"
#include "meshtrain/exec/executor.h"
#include "meshtrain/graph/autodiff.h"
#include "meshtrain/train/grad_clip.h"
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
                                 const std::function<void(const std::string&)>& log) {
  refuse(opts.precision != DType::f32, "train.precision", "sparse kernels are f32");
  refuse(opts.max_steps > 0, "train.steps", "one step per epoch: use train.epochs");
  refuse(!opts.checkpoint_path.empty(), "train.checkpoint", "no checkpoints yet");
  refuse(!opts.resume_path.empty(), "train.resume", "no checkpoints yet");
  refuse(!opts.init_path.empty(), "train.init", "no weight import yet");
  g.validate(g.name);

  const std::vector<int32_t> train_v = GraphData::members(g.train_mask);
  const std::vector<int32_t> val_v = GraphData::members(g.val_mask);
  const std::vector<int32_t> test_v = GraphData::members(g.test_mask);
  GnnGraph gg;
  gg.adj = &g.adj;
  gg.features = g.feature_dim();
  gg.classes = g.classes;
  gg.loss_vertices = train_v;
  ModelGraph m = build_gnn(spec, gg);
  build_backward(m.graph, m.loss);

  ExecOptions eo = opts.exec;
  eo.num_threads = opts.threads;
  eo.outputs.push_back(m.logits);
  Executor ex(m.graph, eo);
  // One process and no DataParallel: the store owns the gradients too.
  ParamStore store(m.graph, opts.seed, /*with_grads=*/true);
  store.bind(ex, m.graph, true);
  for (auto& [v, t] : m.constants) ex.bind(v, t);
  ex.bind(m.x, g.features);
  Tensor y = Tensor::empty(Shape{static_cast<int64_t>(train_v.size())}, DType::i32);
  for (size_t i = 0; i < train_v.size(); ++i) {
    y.data<int32_t>()[i] = g.labels[static_cast<size_t>(train_v[i])];
  }
  ex.bind(m.y, y);

  std::unique_ptr<Optimizer> opt = make_optimizer(opts.optimizer, opts.optim);
  LrScheduleOptions so = opts.schedule;
  so.total_steps = opts.epochs;
  LrSchedule schedule(so);
  std::vector<ParamRef> refs;
  for (auto& e : store.entries()) refs.push_back(ParamRef{e.name, e.value, e.grad});
  auto metrics = opts.metrics_path.empty() ? std::make_unique<MetricsWriter>()
                                           : std::make_unique<MetricsWriter>(opts.metrics_path);

  FullGraphResult r;
  r.params = m.graph.param_count();
  for (int64_t epoch = 1; epoch <= opts.epochs; ++epoch) {
    const auto t0 = std::chrono::steady_clock::now();
    ex.run();
    GraphEpoch ep;
    ep.epoch = epoch;
    ep.loss = ex.get(m.loss).item();
    const Tensor logits = ex.get(m.logits);
    if (opts.clip_grad_norm > 0) clip_grad_norm(refs, opts.clip_grad_norm);
    opt->step(refs, schedule.lr_at(epoch - 1));
    ep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ep.train_acc = masked_accuracy(logits, g.labels, train_v);
    ep.val_acc = masked_accuracy(logits, g.labels, val_v);
    ep.test_acc = masked_accuracy(logits, g.labels, test_v);
    r.epochs.push_back(ep);
    const bool logged = opts.log_every > 0 && (epoch % opts.log_every == 0 || epoch == opts.epochs);
    if (logged) {
      metrics->write({{"epoch", epoch},
                      {"loss", ep.loss},
                      {"train_acc", ep.train_acc},
                      {"val_acc", ep.val_acc},
                      {"test_acc", ep.test_acc},
                      {"epoch_s", ep.seconds}});
      if (log) {
        log(fmt::format("epoch {} loss {:.4f} train {:.3f} val {:.3f} test {:.3f} ({:.1f} ms)",
                        epoch, ep.loss, ep.train_acc, ep.val_acc, ep.test_acc, 1e3 * ep.seconds));
      }
    }
  }
  ex.run_forward();
  r.final_loss = ex.get(m.loss).item();
  const Tensor logits = ex.get(m.logits);
  r.train_acc = masked_accuracy(logits, g.labels, train_v);
  r.val_acc = masked_accuracy(logits, g.labels, val_v);
  r.test_acc = masked_accuracy(logits, g.labels, test_v);
  std::vector<double> times;
  for (const auto& e : r.epochs) times.push_back(e.seconds);
  if (!times.empty()) {
    std::nth_element(times.begin(), times.begin() + static_cast<int64_t>(times.size() / 2),
                     times.end());
    r.median_epoch_seconds = times[times.size() / 2];
  }
  metrics->write({{"final", true},
                  {"loss", r.final_loss},
                  {"train_acc", r.train_acc},
                  {"val_acc", r.val_acc},
                  {"test_acc", r.test_acc},
                  {"median_epoch_s", r.median_epoch_seconds}});
  return r;
}

}  // namespace mt
