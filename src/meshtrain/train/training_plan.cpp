#include "meshtrain/train/training_plan.h"

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "meshtrain/data/loader.h"
#include "meshtrain/graph/autodiff.h"
#include "meshtrain/graph/builder.h"
#include "meshtrain/train/optimizer.h"
#include "meshtrain/train/param_store.h"

namespace mt {

namespace {

// This rank's slice [begin, end) of n examples split by `shares` (equal when empty).
std::pair<int64_t, int64_t> slice(int64_t n, const std::vector<int64_t>& shares, int rank,
                                  int world) {
  const std::vector<int64_t> s = shares.empty() ? std::vector<int64_t>(world, 1) : shares;
  if (static_cast<int>(s.size()) != world) {
    throw ConfigError(fmt::format("dist.batch_shares: {} shares for {} ranks", s.size(), world));
  }
  const std::vector<int64_t> b = shard_bounds(n, s);
  return {b[static_cast<size_t>(rank)], b[static_cast<size_t>(rank) + 1]};
}

// The config keys and values that size a model, for messages.
std::string model_values(const ModelSpec& s) {
  if (s.kind == "gpt") {
    return fmt::format("model.seq_len={}, model.d_model={}, model.heads={}, model.layers={}",
                       s.seq_len, s.d_model, s.heads, s.layers);
  }
  if (s.kind == "cnn") {
    return fmt::format("model.conv_channels=[{}], model.fc={}", fmt::join(s.conv_channels, ", "),
                       s.fc);
  }
  return fmt::format("model.hidden=[{}]", fmt::join(s.hidden, ", "));
}

}  // namespace

std::string format_bytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (bytes < 1024) return fmt::format("{} B", bytes);
  if (b < 1024.0 * 1024) return fmt::format("{:.2f} KiB", b / 1024);
  if (b < 1024.0 * 1024 * 1024) return fmt::format("{:.2f} MiB", b / (1024.0 * 1024));
  if (b < 1024.0 * 1024 * 1024 * 1024) return fmt::format("{:.1f} GiB", b / (1024.0 * 1024 * 1024));
  return fmt::format("{:.1f} TiB", b / (1024.0 * 1024 * 1024 * 1024));
}

BatchSplit split_batch(const TrainerOptions& o, int rank, int world) {
  const auto [lb, le] = slice(o.batch_size, o.dist.batch_shares, rank, world);
  BatchSplit s;
  s.local_batch = le - lb;
  const int k = o.dist.dp.accumulation_steps;
  if (k < 1 || s.local_batch % k != 0) {
    throw ConfigError(fmt::format(
        "dist.accumulation_steps: rank {} gets {} of each global batch of {} (train.batch_size, "
        "dist.batch_shares), which {} micro-steps cannot split evenly",
        rank, s.local_batch, o.batch_size, k));
  }
  s.micro_batch = s.local_batch / k;
  return s;
}

DataParallelPlace data_parallel_place(const TrainerOptions& o, int rank, int world) {
  DataParallelPlace p{rank, world, false};
  if (!o.dist.plan || !needs_lowering(*o.dist.plan)) return p;
  const Mesh& mesh = o.dist.plan->mesh;
  mesh.check_world(world, "the plan's mesh");
  p.rank = mesh.coord(rank, "dp");
  p.world = mesh.axis_size("dp");
  p.lowered = true;
  return p;
}

ModelGraph build_rank_model(const ModelSpec& spec, int64_t batch, const TrainerOptions& o, int rank,
                            LoweredProgram* lowered, bool whole_logits) {
  ModelGraph m = build_model(spec, batch);
  if (!o.dist.plan || !needs_lowering(*o.dist.plan)) return m;
  std::vector<ValueId> outputs = {m.loss};
  if (whole_logits) outputs.push_back(m.logits);
  LoweredProgram lp = lower(m.graph, *o.dist.plan, rank, outputs);
  ModelGraph r;
  r.x = lp[m.x];
  r.y = lp[m.y];
  r.logits = whole_logits ? lp[m.logits] : kNoValue;
  r.loss = lp[m.loss];
  for (auto& [id, t] : m.constants) r.constants.emplace_back(lp[id], t);
  r.batch = m.batch;
  r.graph = std::move(lp.graph);
  lp.graph = Graph{};
  if (lowered != nullptr) *lowered = std::move(lp);
  return r;
}

TrainingGraph build_training_graph(const ModelSpec& model_spec, const TrainerOptions& o,
                                   int64_t micro_batch, int rank) {
  ModelSpec spec = model_spec;
  spec.compute = o.precision;
  TrainingGraph t;
  t.model = build_rank_model(spec, micro_batch, o, rank, &t.lowered, /*whole_logits=*/false);
  t.objective = t.model.loss;
  if (o.precision == DType::f16) {
    Builder b(t.model.graph);
    t.loss_scale_in = b.input("loss_scale", {}, DType::f32);
    t.objective = b.mul(t.model.loss, t.loss_scale_in);
  }
  build_backward(t.model.graph, t.objective);
  if (o.bf16_storage) {
    if (o.precision != DType::f32) {
      throw ConfigError(
          fmt::format("train.precision: bf16 activation storage runs around f32 compute, not {}",
                      dtype_name(o.precision)));
    }
    if (o.exec.recompute) {
      throw ConfigError(
          "train.precision = \"bf16_storage\" with exec.recompute = true: both shrink the "
          "activations the backward reads (one stores them in bf16, the other recomputes "
          "them); pick one");
    }
  }
  t.exec = o.exec;
  t.exec.outputs.push_back(t.model.loss);  // the unscaled loss, for metrics
  if (o.bf16_storage) {
    // Kept only where it lowers the planned peak: in a shallow model the
    // backward widens the last layers' values again right at the boundary,
    // and the bf16 copies beside them can make the peak larger.
    Graph g = t.model.graph;
    Bf16StashReport r = stash_in_bf16(g);
    const GradMemory gm = DataParallel::grad_memory(o.dist.dp);
    const int64_t before = plan_memory(t.model.graph, t.exec, gm).arena_bytes;
    const int64_t after = r.stashed.empty() ? before : plan_memory(g, t.exec, gm).arena_bytes;
    r.arena_bytes_f32 = before;
    r.arena_bytes = after;
    if (after < before) {
      t.model.graph = std::move(g);
    } else {
      r.kept_f32 = !r.stashed.empty();
      r.stashed.clear();
      r.elements = r.f32_bytes = 0;
    }
    t.stash = std::move(r);
  }
  return t;
}

int64_t TrainingPlan::model_state_bytes() const {
  return state.expected_model_state_bytes() + state.expected_buffer_bytes;
}

int64_t TrainingPlan::total_bytes() const {
  return activations.arena_bytes + eval_arena_bytes + model_state_bytes();
}

std::string TrainingPlan::describe() const {
  std::string out =
      fmt::format("planned memory per rank (rank {} of {}, ZeRO stage {}, micro-batch {}):\n", rank,
                  world, state.stage, batch.micro_batch);
  auto line = [&](const char* what, int64_t bytes, const std::string& note = "") {
    out += fmt::format("  {:<34} {:>12}{}\n", what, format_bytes(bytes),
                       note.empty() ? "" : "  (" + note + ")");
  };
  line("activations, training", activations.arena_bytes,
       fmt::format("{} bytes; largest {}", activations.arena_bytes, largest_activation));
  line("activations, evaluation", eval_arena_bytes,
       eval_batch > 0 ? fmt::format("batch {}", eval_batch) : "no evaluation");
  line("parameters", state.expected_param_bytes);
  line("gradients", state.expected_grad_bytes);
  line("optimizer state", state.expected_optimizer_bytes);
  line("data-parallel buffers", state.expected_buffer_bytes);
  line("total", total_bytes());
  return out;
}

TrainingPlan plan_training(const TrainingGraph& tg, const ModelSpec& spec, const TrainerOptions& o,
                           const BatchSplit& split, int rank, int world, int64_t eval_examples) {
  TrainingPlan p;
  p.rank = rank;
  p.world = world;
  p.batch = split;
  const Graph& g = tg.model.graph;
  p.param_count = g.param_count();
  p.activations = plan_memory(g, tg.exec, DataParallel::grad_memory(o.dist.dp));
  for (ValueId v = 0; v < g.num_values(); ++v) {
    const Value& val = g.value(v);
    if (val.role != ValueRole::activation) continue;
    const int64_t bytes = val.shape.numel() * static_cast<int64_t>(dtype_size(val.dtype));
    if (bytes > p.largest_activation_bytes) {
      p.largest_activation_bytes = bytes;
      p.largest_activation = fmt::format("'{}' {}{} {}", val.name, dtype_name(val.dtype),
                                         val.shape.str(), format_bytes(bytes));
    }
  }

  int64_t flat = 0;
  const ParamLayout layout = ParamStore::layout(g, &flat);
  const DataParallelPlace place = data_parallel_place(o, rank, world);
  const BucketPlan buckets(layout, flat, o.dist.dp.bucket_bytes, place.world, place.rank);
  const int kinds = static_cast<int>(make_optimizer(o.optimizer, o.optim)->state_kinds().size());
  p.state = DataParallel::expected_memory(buckets, o.dist.dp, kinds);

  if (o.eval) {
    const int64_t n =
        eval_examples >= 0 ? std::min(o.eval_batch_size, eval_examples) : o.eval_batch_size;
    const auto [eb, ee] = slice(n, {}, place.rank, place.world);
    p.eval_batch = ee - eb;
    if (p.eval_batch > 0) {
      ModelSpec es = spec;
      es.compute = o.precision;
      const ModelGraph em = build_rank_model(es, p.eval_batch, o, rank);
      ExecOptions eo = o.exec;
      eo.outputs = {em.logits, em.loss};
      eo.recompute = false;
      p.eval_arena_bytes = plan_memory(em.graph, eo, GradMemory::kept).arena_bytes;
    }
  }
  return p;
}

TrainingPlan plan_training(const ModelSpec& spec, const TrainerOptions& o, int rank, int world,
                           int64_t eval_examples) {
  const DataParallelPlace place = data_parallel_place(o, rank, world);
  const BatchSplit split = split_batch(o, place.rank, place.world);
  const TrainingGraph tg = build_training_graph(spec, o, split.micro_batch, rank);
  return plan_training(tg, spec, o, split, rank, world, eval_examples);
}

int64_t available_memory_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("MemAvailable:", 0) == 0) {
      std::istringstream ss(line.substr(13));
      int64_t kib = 0;
      if (ss >> kib && kib > 0) return kib * 1024;
    }
  }
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page : 0;
}

void check_memory_fits(const TrainingPlan& p, const ModelSpec& spec, const TrainerOptions& o,
                       int64_t available) {
  if (available <= 0 || p.total_bytes() <= available) return;
  std::string batch = fmt::format("train.batch_size={}", o.batch_size);
  if (o.dist.dp.accumulation_steps > 1 || p.world > 1) {
    batch += fmt::format(" (micro-batch {} per rank", p.batch.micro_batch);
    if (o.dist.dp.accumulation_steps > 1) {
      batch += fmt::format(", dist.accumulation_steps={}", o.dist.dp.accumulation_steps);
    }
    batch += ")";
  }
  struct Part {
    int64_t bytes;
    std::string text;  // with the config values that size it
    std::string brief;
  };
  std::vector<Part> parts = {
      {p.activations.arena_bytes,
       fmt::format("training activations {} at {}, {}; largest {}",
                   format_bytes(p.activations.arena_bytes), batch, model_values(spec),
                   p.largest_activation),
       fmt::format("training activations {}", format_bytes(p.activations.arena_bytes))},
      {p.eval_arena_bytes,
       fmt::format("evaluation activations {} at train.eval_batch_size={}, {}",
                   format_bytes(p.eval_arena_bytes), o.eval_batch_size, model_values(spec)),
       fmt::format("evaluation activations {}", format_bytes(p.eval_arena_bytes))},
      {p.model_state_bytes(),
       fmt::format("parameters, gradients and optimizer state {} for {} parameters ({}, "
                   "optim.name={}, dist.zero_stage={})",
                   format_bytes(p.model_state_bytes()), p.param_count, model_values(spec),
                   o.optimizer, o.dist.dp.stage),
       fmt::format("parameters, gradients and optimizer state {}",
                   format_bytes(p.model_state_bytes()))},
  };
  std::stable_sort(parts.begin(), parts.end(),
                   [](const Part& a, const Part& b) { return a.bytes > b.bytes; });
  std::string detail = parts[0].text;
  for (size_t i = 1; i < parts.size(); ++i) {
    if (parts[i].bytes > 0) detail += "; " + parts[i].brief;
  }
  throw ConfigError(fmt::format(
      "planned memory per rank {} exceeds available memory {}: {}. Lower the values named "
      "(or shard with dist.zero_stage / more ranks); `meshtrain inspect` shows the plan",
      format_bytes(p.total_bytes()), format_bytes(available), detail));
}

}  // namespace mt
