#include "meshtrain/spmd/shorthand.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <limits>
#include <map>
#include <numeric>

#include "meshtrain/base/error.h"
#include "meshtrain/graph/cost.h"

namespace mt {

namespace {

bool starts_with(const std::string& s, const std::string& prefix) {
  return s.rfind(prefix, 0) == 0;
}
bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}
std::string layer_of(const std::string& param) {
  return param.substr(0, param.find('.'));
}

// Forward FLOPs per layer: a node that reads a parameter belongs to that
// parameter's layer; the nodes after it (activations, pooling) belong to the
// same layer until another layer's parameter is read.
std::map<std::string, double> layer_flops(const Graph& g) {
  std::map<std::string, double> flops;
  std::string current;
  for (const Node& n : g.nodes()) {
    if (n.backward) continue;
    for (ValueId in : n.inputs) {
      // Casts of parameters (mixed precision) count as reading them.
      ValueId v = in;
      const Value& val = g.value(v);
      if (val.role == ValueRole::param) {
        current = layer_of(val.name);
        break;
      }
    }
    if (!current.empty()) flops[current] += op_cost(g, n).flops;
  }
  return flops;
}

// Splits `costs` into `parts` contiguous runs minimising the largest run
// (exact dynamic programme; a model has few layers). Returns run lengths.
std::vector<int64_t> balanced_cut(const std::vector<double>& costs, int parts) {
  const int n = static_cast<int>(costs.size());
  std::vector<double> prefix(static_cast<size_t>(n) + 1, 0.0);
  for (int i = 0; i < n; ++i)
    prefix[static_cast<size_t>(i) + 1] =
        prefix[static_cast<size_t>(i)] + costs[static_cast<size_t>(i)];
  const double inf = std::numeric_limits<double>::infinity();
  // best[k][i]: the smallest largest run cutting the first i layers into k runs.
  std::vector<std::vector<double>> best(static_cast<size_t>(parts) + 1,
                                        std::vector<double>(static_cast<size_t>(n) + 1, inf));
  std::vector<std::vector<int>> from(best.size(), std::vector<int>(static_cast<size_t>(n) + 1, 0));
  best[0][0] = 0;
  for (int k = 1; k <= parts; ++k) {
    for (int i = k; i <= n; ++i) {
      for (int j = k - 1; j < i; ++j) {
        const double c = std::max(best[static_cast<size_t>(k) - 1][static_cast<size_t>(j)],
                                  prefix[static_cast<size_t>(i)] - prefix[static_cast<size_t>(j)]);
        if (c < best[static_cast<size_t>(k)][static_cast<size_t>(i)]) {
          best[static_cast<size_t>(k)][static_cast<size_t>(i)] = c;
          from[static_cast<size_t>(k)][static_cast<size_t>(i)] = j;
        }
      }
    }
  }
  std::vector<int64_t> runs(static_cast<size_t>(parts));
  int i = n;
  for (int k = parts; k >= 1; --k) {
    const int j = from[static_cast<size_t>(k)][static_cast<size_t>(i)];
    runs[static_cast<size_t>(k) - 1] = i - j;
    i = j;
  }
  return runs;
}

DimSharding tp_split(const ParallelShorthand& sh, int64_t unit = 1) {
  return DimSharding{"tp", sh.tp_ratios, unit};
}

// Column-parallel linear: w [in, out] split on out, its bias with it.
// Row-parallel: w split on in, the bias replicated (added after the sum).
void column(Plan& plan, const Graph& g, const std::string& layer, const ParallelShorthand& sh,
            int64_t unit = 1) {
  plan.set_spec(layer + ".w", ShardingSpec{{DimSharding{}, tp_split(sh, unit)}, {}});
  if (g.find(layer + ".b")) plan.set_spec(layer + ".b", ShardingSpec{{tp_split(sh, unit)}, {}});
}
void row(Plan& plan, const std::string& layer, const ParallelShorthand& sh, int64_t unit = 1) {
  plan.set_spec(layer + ".w", ShardingSpec{{tp_split(sh, unit)}, {}});
}

void tensor_parallel_specs(Plan& plan, const ParallelShorthand& sh, const ShorthandModel& model,
                           const Graph& g) {
  if (model.kind == "gpt") {
    for (ValueId p : g.params()) {
      const std::string& n = g.value(p).name;
      if (n == "wte") plan.set_spec(n, ShardingSpec{{tp_split(sh)}, {}});  // vocabulary-parallel
      if (!starts_with(n, "block") || !ends_with(n, ".w")) continue;
      const std::string layer = n.substr(0, n.size() - 2);
      if (ends_with(layer, ".attn.q") || ends_with(layer, ".attn.k") ||
          ends_with(layer, ".attn.v")) {
        column(plan, g, layer, sh, model.head_size);  // by whole heads
      } else if (ends_with(layer, ".attn.proj")) {
        row(plan, layer, sh, model.head_size);
      } else if (ends_with(layer, ".fc")) {
        column(plan, g, layer, sh);
      } else if (ends_with(layer, ".proj")) {
        row(plan, layer, sh);
      }
    }
    return;
  }
  std::vector<std::string> linears;  // in order, with a 2-d weight
  for (ValueId p : g.params()) {
    const Value& v = g.value(p);
    if (ends_with(v.name, ".w") && v.shape.rank() == 2) linears.push_back(layer_of(v.name));
  }
  if (model.kind == "cnn") {
    // The classifier: its first linear column-, the head row-parallel.
    for (size_t i = 0; i < linears.size(); ++i) {
      if (i + 2 == linears.size()) column(plan, g, linears[i], sh);
      if (i + 1 == linears.size() && linears.size() >= 2) row(plan, linears[i], sh);
    }
    return;
  }
  for (size_t i = 0; i < linears.size(); ++i) {
    if (i % 2 == 0) {
      column(plan, g, linears[i], sh);
    } else {
      row(plan, linears[i], sh);
    }
  }
}

}  // namespace

std::vector<std::string> stage_units(const ShorthandModel& model, const Graph& g) {
  std::vector<std::string> units;
  for (const std::string& l : model_layers(g)) {
    if (model.kind != "gpt" || starts_with(l, "block")) units.push_back(l);
  }
  return units;
}

Plan expand_shorthand(const ParallelShorthand& sh, const ShorthandModel& model, const Graph& g,
                      int world) {
  const int tp_pp = sh.tp * sh.pp;
  int dp = sh.dp;
  if (dp == 0) {
    if (world % tp_pp != 0) {
      throw ConfigError(
          fmt::format("parallel: tp = {} x pp = {} = {} does not divide the job's {} rank{} (set "
                      "parallel.dp, or run a multiple of {} ranks)",
                      sh.tp, sh.pp, tp_pp, world, world == 1 ? "" : "s", tp_pp));
    }
    dp = world / tp_pp;
  }
  Plan plan;
  plan.model = model.kind;
  std::vector<MeshAxis> axes;
  if (sh.pp > 1) axes.push_back({"pp", sh.pp});
  axes.push_back({"dp", dp});
  if (sh.tp > 1) axes.push_back({"tp", sh.tp});
  plan.mesh = Mesh(axes);

  if (!sh.tp_ratios.empty()) {
    if (static_cast<int>(sh.tp_ratios.size()) != sh.tp) {
      throw ConfigError(fmt::format(
          "parallel.tp_ratios: {} ratio{} [{}] for tp = {} (expected {}, one per tp rank)",
          sh.tp_ratios.size(), sh.tp_ratios.size() == 1 ? "" : "s", fmt::join(sh.tp_ratios, ", "),
          sh.tp, sh.tp));
    }
  }
  if (sh.sp && sh.tp < 2) {
    throw ConfigError(
        "parallel.sp: sequence parallelism splits the layer-norm regions over the tp axis, so it "
        "needs parallel.tp > 1");
  }
  if (sh.sp && model.kind != "gpt") {
    throw ConfigError(fmt::format(
        "parallel.sp: sequence parallelism needs a sequence dimension (model.kind gpt), not {}",
        model.kind));
  }
  plan.sequence_parallel = sh.sp;

  // The batch is split over dp (also when dp = 1, so the plan says so), as
  // the data loader splits it: by dist.batch_shares, or in equal shares
  // rounded down when dp does not divide it. y holds `unit` labels per
  // example (the gpt's seq_len tokens), so it splits at the same examples.
  std::vector<int64_t> shares = sh.batch_shares;
  if (!shares.empty() && static_cast<int>(shares.size()) != dp) {
    throw ConfigError(fmt::format(
        "dist.batch_shares: {} shares [{}] for a data-parallel degree of {} (one share per "
        "data-parallel rank)",
        shares.size(), fmt::join(shares, ", "), dp));
  }
  const auto x = g.find("x");
  if (x) {
    const int64_t batch = g.value(*x).shape[0];
    if (shares.empty() && batch % dp != 0) shares.assign(static_cast<size_t>(dp), 1);
    plan.set_spec("x", ShardingSpec{{DimSharding{"dp", shares, 1}}, {}});
    if (const auto y = g.find("y"); y && g.value(*y).shape[0] % batch == 0) {
      plan.set_spec("y",
                    ShardingSpec{{DimSharding{"dp", shares, g.value(*y).shape[0] / batch}}, {}});
    }
  }
  if (sh.tp > 1) tensor_parallel_specs(plan, sh, model, g);

  plan.microbatches = sh.microbatches;
  plan.schedule = sh.schedule;
  plan.virtual_stages = sh.virtual_stages;
  plan.warmup_extra = sh.warmup_extra;
  plan.async = sh.async;
  if (sh.pp == 1) {
    if (sh.microbatches != 1) {
      throw ConfigError(
          fmt::format("parallel.microbatches: {} micro-batches need a pipeline (parallel.pp > 1); "
                      "data-parallel runs split a step with dist.accumulation_steps",
                      sh.microbatches));
    }
    if (sh.virtual_stages != 1) {
      throw ConfigError(fmt::format(
          "parallel.virtual_stages: {} virtual stages need a pipeline (parallel.pp > 1)",
          sh.virtual_stages));
    }
    if (!sh.stage_layers.empty()) {
      throw ConfigError("parallel.stage_layers: stages need a pipeline (parallel.pp > 1)");
    }
    if (sh.warmup_extra != 0) {
      throw ConfigError(
          "parallel.warmup_extra: extra warm-up forwards need a pipeline "
          "(parallel.pp > 1)");
    }
    if (sh.async != AsyncMode::none) {
      throw ConfigError(fmt::format(
          "parallel.async: {} is asynchronous pipelining and needs a pipeline (parallel.pp > 1)",
          async_name(sh.async)));
    }
    if (sh.recompute || !sh.recompute_stages.empty()) {
      throw ConfigError(
          "parallel.recompute: per-stage recomputation needs a pipeline (parallel.pp > 1); "
          "without one, train.recompute recomputes the whole model's activations");
    }
    return plan;
  }
  check_schedule(sh.schedule, sh.pp, sh.microbatches, sh.virtual_stages, "parallel");
  check_warmup_extra(sh.schedule, sh.warmup_extra, "parallel");
  check_async(sh.async, sh.schedule, "parallel");
  if (sh.async != AsyncMode::none && (sh.recompute || !sh.recompute_stages.empty())) {
    throw ConfigError(fmt::format(
        "parallel.async: {} with parallel.recompute is not supported (a recomputed forward "
        "would have to rerun with the forward's weights)",
        async_name(sh.async)));
  }
  const int stages = sh.pp * sh.virtual_stages;
  const std::vector<std::string> units = stage_units(model, g);
  std::vector<int64_t> runs = sh.stage_layers;
  const std::string what = model.kind == "gpt" ? "transformer blocks" : "layers";
  if (!runs.empty()) {
    if (static_cast<int>(runs.size()) != stages) {
      throw ConfigError(fmt::format(
          "parallel.stage_layers: {} entries [{}] for {} stage{} (expected one per stage: pp = "
          "{} x virtual_stages = {})",
          runs.size(), fmt::join(runs, ", "), stages, stages == 1 ? "" : "s", sh.pp,
          sh.virtual_stages));
    }
    for (size_t s = 0; s < runs.size(); ++s) {
      if (runs[s] < 1) {
        throw ConfigError(
            fmt::format("parallel.stage_layers: stage {} gets {} {} in [{}] (expected at least 1)",
                        s, runs[s], what, fmt::join(runs, ", ")));
      }
    }
    const int64_t sum = std::accumulate(runs.begin(), runs.end(), int64_t{0});
    if (sum != static_cast<int64_t>(units.size())) {
      throw ConfigError(fmt::format(
          "parallel.stage_layers: [{}] adds up to {} but the {} has {} {} ({})",
          fmt::join(runs, ", "), sum, model.kind, units.size(), what, fmt::join(units, ", ")));
    }
  } else {
    if (static_cast<int>(units.size()) < stages) {
      throw ConfigError(fmt::format(
          "parallel.pp: {} stage{} but the {} has only {} {} (expected at least one per stage)",
          stages, stages == 1 ? "" : "s", model.kind, units.size(), what));
    }
    const auto flops = layer_flops(g);
    std::vector<double> costs;
    for (const std::string& u : units) {
      auto it = flops.find(u);
      costs.push_back(it == flops.end() ? 0.0 : it->second);
    }
    runs = balanced_cut(costs, stages);
  }
  // Layers outside the units (gpt's embeddings, final norm) join the stage
  // of the unit next to them.
  const std::vector<std::string> layers = model_layers(g);
  std::vector<int> unit_stage;
  for (int s = 0; s < stages; ++s) {
    for (int64_t k = 0; k < runs[static_cast<size_t>(s)]; ++k) unit_stage.push_back(s);
  }
  plan.stages.resize(static_cast<size_t>(stages));
  size_t u = 0;
  for (const std::string& l : layers) {
    int s = 0;
    if (u < units.size() && units[u] == l) {
      s = unit_stage[u++];
    } else {
      s = u == 0 ? 0 : stages - 1;
    }
    plan.stages[static_cast<size_t>(s)].layers.push_back(l);
  }
  for (int64_t s : sh.recompute_stages) {
    if (s < 0 || s >= stages) {
      throw ConfigError(fmt::format(
          "parallel.recompute: stage {} in [{}] (expected virtual stages 0 .. {}: pp = {} x "
          "virtual_stages = {})",
          s, fmt::join(sh.recompute_stages, ", "), stages - 1, sh.pp, sh.virtual_stages));
    }
    plan.stages[static_cast<size_t>(s)].recompute = true;
  }
  if (sh.recompute) {
    for (StagePlan& st : plan.stages) st.recompute = true;
  }
  for (int s = 0; s < stages; ++s) {
    for (int r = 0; r < plan.mesh.size(); ++r) {
      if (plan.mesh.coord(r, "pp") == stage_owner(sh.schedule, sh.pp, s))
        plan.stages[static_cast<size_t>(s)].ranks.push_back(r);
    }
  }
  return plan;
}

}  // namespace mt
