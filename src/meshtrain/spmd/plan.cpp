#include "meshtrain/spmd/plan.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "meshtrain/base/error.h"

namespace mt {

using Json = nlohmann::ordered_json;

namespace {

const ShardingSpec kReplicated{};

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

// " (did you mean 'x'?)" for the closest of `names`, or "".
std::string did_you_mean(std::string_view name, const std::vector<std::string>& names) {
  std::string best;
  size_t best_d = std::max<size_t>(2, name.size() / 3) + 1;
  for (const std::string& n : names) {
    const size_t d = edit_distance(name, n);
    if (d < best_d) {
      best_d = d;
      best = n;
    }
  }
  return best.empty() ? "" : fmt::format(" (did you mean '{}'?)", best);
}

}  // namespace

const ShardingSpec& Plan::spec(std::string_view value) const {
  for (const auto& [name, s] : specs) {
    if (name == value) return s;
  }
  return kReplicated;
}

void Plan::set_spec(const std::string& value, ShardingSpec s) {
  for (auto& [name, old] : specs) {
    if (name == value) {
      old = std::move(s);
      return;
    }
  }
  specs.emplace_back(value, std::move(s));
}

int Plan::pipeline_stages() const {
  if (stages.empty()) return 1;
  return std::max(1, static_cast<int>(stages.size()) / std::max(1, virtual_stages));
}

int Plan::device_of(int m) const {
  return devices.empty() ? m : devices.at(static_cast<size_t>(m));
}

bool Plan::devices_in_order() const {
  for (size_t m = 0; m < devices.size(); ++m) {
    if (devices[m] != static_cast<int>(m)) return false;
  }
  return true;
}

bool Plan::stage_meshes() const {
  return std::ranges::any_of(stages, [](const StagePlan& st) { return st.has_mesh; });
}

namespace {

std::string layer_of(const std::string& value) {
  return value.substr(0, value.find('.'));
}

}  // namespace

Plan stage_view(const Plan& plan, int s) {
  const StagePlan& st = plan.stages.at(static_cast<size_t>(s));
  Plan v;
  v.mesh = st.has_mesh ? st.mesh : plan.mesh;
  v.model = plan.model;
  v.sequence_parallel = plan.sequence_parallel;
  for (const auto& [name, spec] : plan.specs) {
    if (std::ranges::find(st.layers, layer_of(name)) != st.layers.end()) v.set_spec(name, spec);
  }
  for (const auto& [name, spec] : st.specs) v.set_spec(name, spec);
  return v;
}

bool Plan::data_parallel_only(const Graph& g) const {
  if (pipeline_stages() > 1 || stages.size() > 1 || microbatches != 1 || sequence_parallel ||
      stage_meshes())
    return false;
  // One axis of more than one rank at most: the data-parallel one.
  std::string dp_axis;
  for (const MeshAxis& a : mesh.axes()) {
    if (a.size == 1) continue;
    if (!dp_axis.empty()) return false;
    dp_axis = a.name;
  }
  for (const auto& [name, s] : specs) {
    if (!s.partial.empty()) return false;
    const auto id = g.find(name);
    if (!id || g.value(*id).role != ValueRole::input) {
      if (!s.replicated()) return false;
      continue;
    }
    for (size_t d = 1; d < s.dims.size(); ++d) {
      if (s.dims[d].split()) return false;
    }
  }
  // Every rank reads its own slice of the batch, as data parallelism does.
  if (!dp_axis.empty()) {
    for (const char* in : {"x", "y"}) {
      if (g.find(in) && spec(in).dim(0).axis != dp_axis) return false;
    }
  }
  return true;
}

std::vector<std::string> model_layers(const Graph& g) {
  std::vector<std::string> out;
  for (ValueId p : g.params()) {
    const std::string& n = g.value(p).name;
    const std::string layer = n.substr(0, n.find('.'));
    if (std::find(out.begin(), out.end(), layer) == out.end()) out.push_back(layer);
  }
  return out;
}

namespace {

// Stages on different meshes (StagePlan::has_mesh): each stage's mesh
// covers exactly its ranks and has tensor axes only; the values its
// lowering uses (stage_view) exist and fit the stage's mesh.
void validate_stage_meshes(const Plan& plan, const Graph& g, const std::vector<std::string>& names,
                           std::string_view where) {
  const int n = static_cast<int>(plan.stages.size());
  int with = -1;
  for (int s = 0; s < n; ++s) {
    if (plan.stages[static_cast<size_t>(s)].has_mesh) with = s;
  }
  const int p = std::max(1, n / std::max(1, plan.virtual_stages));
  for (int s = 0; s < n; ++s) {
    const StagePlan& st = plan.stages[static_cast<size_t>(s)];
    const std::string at = fmt::format("{}: stages[{}]", where, s);
    if (!st.has_mesh) {
      throw ConfigError(fmt::format(
          "{}: no \"mesh\", but stages[{}] has one (in a plan whose stages carry meshes every "
          "stage gives its own, e.g. [{{\"name\": \"tp\", \"size\": 1}}])",
          at, with));
    }
    // Virtual stages: a rank's chunks run on one mesh (their executors
    // share one collective runner over its groups); their values may differ.
    if (const int first = stage_owner(plan.schedule, p, s);
        s >= p && plan.stages[static_cast<size_t>(first)].has_mesh &&
        !(st.mesh == plan.stages[static_cast<size_t>(first)].mesh)) {
      throw ConfigError(fmt::format(
          "{}.mesh: {}, but virtual stage {} runs on the ranks of stages[{}], whose mesh is {} "
          "(the virtual stages of one physical stage share its mesh; give them other values "
          "instead)",
          at, st.mesh.describe(), s, first,
          plan.stages[static_cast<size_t>(first)].mesh.describe()));
    }
    if (st.mesh.size() != static_cast<int>(st.ranks.size())) {
      throw ConfigError(fmt::format(
          "{}.mesh: {} has {} device{} but the stage has {} rank{} ({}); expected a mesh of {}", at,
          st.mesh.describe(), st.mesh.size(), st.mesh.size() == 1 ? "" : "s", st.ranks.size(),
          st.ranks.size() == 1 ? "" : "s", fmt::join(st.ranks, ", "), st.ranks.size()));
    }
    for (const MeshAxis& a : st.mesh.axes()) {
      if ((a.name == "dp" || a.name == "pp") && a.size > 1) {
        throw ConfigError(fmt::format(
            "{}.mesh: axis {} of size {}: a stage's mesh holds tensor axes only (the pipeline "
            "is the stages; data parallelism is a dp axis of the plan's mesh, over whole model "
            "replicas)",
            at, a.name, a.size));
      }
    }
    std::set<std::string> seen;
    for (const auto& [name, spec] : st.specs) {
      if (!seen.insert(name).second)
        throw ConfigError(fmt::format("{}.values.{}: named twice", at, name));
      const auto id = g.find(name);
      if (!id || g.value(*id).role == ValueRole::grad) {
        throw ConfigError(fmt::format(
            "{}.values.{}: the model's graph has no value of that name{} (`meshtrain inspect` "
            "lists the parameters)",
            at, name, did_you_mean(name, names)));
      }
    }
    for (const auto& [name, spec] : stage_view(plan, s).specs) {
      const auto id = g.find(name);
      if (!id) continue;  // a plan-level name: reported above
      const bool own =
          std::ranges::any_of(st.specs, [&](const auto& e) { return e.first == name; });
      try {
        validate_sharding(name, g.value(*id).shape, spec, st.mesh);
      } catch (const ConfigError& e) {
        throw ConfigError(
            fmt::format("{}: {} ({}): {}{}", at, own ? "its values." + name : "values." + name,
                        own ? "the stage's override" : "a parameter of its layers", e.what(),
                        own ? ""
                            : fmt::format(" (give the stage's mesh that axis, or override {} in "
                                          "stages[{}].values)",
                                          name, s)));
      }
    }
  }
}

}  // namespace

void validate_plan(const Plan& plan, const Graph& g, int world, int64_t global_batch,
                   std::string_view where) {
  plan.mesh.check_world(world, fmt::format("{}: mesh", where));
  if (!plan.devices.empty()) {
    if (static_cast<int>(plan.devices.size()) != world) {
      throw ConfigError(
          fmt::format("{}: devices: {} entries for {} ranks (one world rank per mesh position, a "
                      "permutation of 0..{})",
                      where, plan.devices.size(), world, world - 1));
    }
    std::vector<int> at(static_cast<size_t>(world), -1);
    for (int m = 0; m < world; ++m) {
      const int d = plan.devices[static_cast<size_t>(m)];
      if (d < 0 || d >= world) {
        throw ConfigError(fmt::format(
            "{}: devices[{}]: world rank {} is not in [0, {}) (a permutation of the job's ranks)",
            where, m, d, world));
      }
      if (at[static_cast<size_t>(d)] >= 0) {
        throw ConfigError(fmt::format(
            "{}: devices[{}]: world rank {} already runs mesh rank {} (a permutation of the "
            "job's ranks: each once)",
            where, m, d, at[static_cast<size_t>(d)]));
      }
      at[static_cast<size_t>(d)] = m;
    }
  }
  std::vector<std::string> names;
  for (int v = 0; v < g.num_values(); ++v) {
    if (g.value(v).role != ValueRole::grad) names.push_back(g.value(v).name);
  }
  std::set<std::string> seen;
  for (const auto& [name, spec] : plan.specs) {
    if (!seen.insert(name).second)
      throw ConfigError(fmt::format("{}: values.{}: named twice", where, name));
    const auto id = g.find(name);
    if (!id || g.value(*id).role == ValueRole::grad) {
      throw ConfigError(fmt::format(
          "{}: values.{}: the model's graph has no value of that name{} (`meshtrain inspect` "
          "lists the parameters)",
          where, name, did_you_mean(name, names)));
    }
    // Under stage meshes a parameter's spec refers to its stage's mesh
    // (checked below, with the stages).
    if (plan.stage_meshes() && g.value(*id).role == ValueRole::param) continue;
    validate_sharding(name, g.value(*id).shape, spec, plan.mesh);
  }

  const int v = plan.virtual_stages;
  if (plan.mesh.axis_size("pp") > 1 &&
      static_cast<int>(plan.stages.size()) != plan.mesh.axis_size("pp") * std::max(1, v)) {
    throw ConfigError(fmt::format(
        "{}: stages: the mesh's pp axis has size {} but the plan lists {} stage{} (expected {}: "
        "pp x virtual_stages)",
        where, plan.mesh.axis_size("pp"), plan.stages.size(), plan.stages.size() == 1 ? "" : "s",
        plan.mesh.axis_size("pp") * std::max(1, v)));
  }
  if (v < 1) throw ConfigError(fmt::format("{}: virtual_stages: {} (expected >= 1)", where, v));
  if (!plan.stages.empty()) {
    const int n = static_cast<int>(plan.stages.size());
    if (n % v != 0) {
      throw ConfigError(fmt::format(
          "{}: stages: {} stages listed for virtual_stages = {} (expected a multiple of {}: "
          "every physical stage holds {} virtual stages)",
          where, n, v, v, v));
    }
    const std::vector<std::string> layers = model_layers(g);
    std::map<std::string, int> owner;
    size_t next = 0;  // layers must come in model order
    const int p = n / v;
    // Under stage meshes with a dp axis the stages list the ranks of one
    // model replica (0 .. world / dp - 1): replica d runs them on the world
    // ranks whose dp coordinate is d, in the same order.
    const int dp = plan.stage_meshes() ? std::max(1, plan.mesh.axis_size("dp")) : 1;
    const int stage_world = world / dp;
    std::vector<int> rank_stage(static_cast<size_t>(stage_world), -1);
    for (int s = 0; s < n; ++s) {
      const StagePlan& st = plan.stages[static_cast<size_t>(s)];
      if (st.layers.empty()) {
        throw ConfigError(
            fmt::format("{}: stages[{}]: stage {} has no layers (expected at least "
                        "one of the model's layers: {})",
                        where, s, s, fmt::join(layers, ", ")));
      }
      for (const std::string& l : st.layers) {
        auto it = std::find(layers.begin(), layers.end(), l);
        if (it == layers.end()) {
          throw ConfigError(fmt::format("{}: stages[{}]: unknown layer '{}'{} (layers: {})", where,
                                        s, l, did_you_mean(l, layers), fmt::join(layers, ", ")));
        }
        if (auto o = owner.find(l); o != owner.end()) {
          throw ConfigError(fmt::format("{}: stages[{}]: layer {} is already in stage {}", where, s,
                                        l, o->second));
        }
        const size_t at = static_cast<size_t>(it - layers.begin());
        if (at != next) {
          throw ConfigError(fmt::format(
              "{}: stages[{}]: layer {} comes out of model order (expected {} next; stages "
              "hold consecutive layers)",
              where, s, l, layers[next]));
        }
        ++next;
        owner[l] = s;
      }
      if (st.ranks.empty()) {
        throw ConfigError(
            fmt::format("{}: stages[{}]: no ranks (give \"ranks\", or a mesh axis pp of size {})",
                        where, s, p));
      }
      for (int r : st.ranks) {
        if (r < 0 || r >= stage_world) {
          throw ConfigError(
              dp > 1 ? fmt::format("{}: stages[{}]: rank {} outside a model replica's {} ranks "
                                   "(the job's {} ranks over dp = {}; stages list the ranks of one "
                                   "replica)",
                                   where, s, r, stage_world, world, dp)
                     : fmt::format("{}: stages[{}]: rank {} outside the job's {} ranks", where, s,
                                   r, world));
        }
        const int phys = stage_owner(plan.schedule, p, s);
        int& rs = rank_stage[static_cast<size_t>(r)];
        if (rs >= 0 && rs != phys) {
          throw ConfigError(fmt::format(
              "{}: stages[{}]: rank {} already runs physical stage {} (a rank runs one stage{})",
              where, s, r, rs, v > 1 ? ", whose virtual stages are s, s+p, ..." : ""));
        }
        rs = phys;
      }
      if (const int first = stage_owner(plan.schedule, p, s);
          s >= p && st.ranks != plan.stages[static_cast<size_t>(first)].ranks) {
        throw ConfigError(fmt::format(
            "{}: stages[{}]: virtual stage {} runs on physical stage {} but names other ranks "
            "than stages[{}]",
            where, s, s, first, first));
      }
    }
    if (next != layers.size()) {
      throw ConfigError(
          fmt::format("{}: stages: layer {} is in no stage (every layer must be in "
                      "one)",
                      where, layers[next]));
    }
    for (int r = 0; r < stage_world; ++r) {
      if (rank_stage[static_cast<size_t>(r)] < 0) {
        throw ConfigError(fmt::format("{}: stages: rank {} is in no stage{}", where, r,
                                      dp > 1 ? " (of a model replica)" : ""));
      }
    }
  }
  if (plan.stage_meshes()) validate_stage_meshes(plan, g, names, where);
  check_schedule(plan.schedule, plan.pipeline_stages(), plan.microbatches, v, where);
  check_warmup_extra(plan.schedule, plan.warmup_extra, where);
  check_async(plan.async, plan.schedule, where);
  for (size_t s = 0; s < plan.stages.size() && plan.async != AsyncMode::none; ++s) {
    if (plan.stages[s].recompute) {
      throw ConfigError(fmt::format(
          "{}: stages[{}].recompute: not with async {} (a recomputed forward would have to "
          "rerun with the forward's weights)",
          where, s, async_name(plan.async)));
    }
  }
  if (global_batch % plan.microbatches != 0) {
    throw ConfigError(fmt::format(
        "{}: microbatches: the global batch of {} (train.batch_size) does not divide into {} "
        "micro-batches",
        where, global_batch, plan.microbatches));
  }
}

// ---------------------------------------------------------------------------
// JSON

namespace {

std::string type_of(const Json& j) {
  switch (j.type()) {
    case Json::value_t::null:
      return "null";
    case Json::value_t::boolean:
      return fmt::format("boolean {}", j.get<bool>());
    case Json::value_t::string:
      return fmt::format("string \"{}\"", j.get<std::string>());
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned:
    case Json::value_t::number_float:
      return fmt::format("number {}", j.dump());
    case Json::value_t::array:
      return "a list";
    case Json::value_t::object:
      return "an object";
    default:
      return "something else";
  }
}

struct Reader {
  const std::string& source;
  [[noreturn]] void fail(const std::string& path, const std::string& msg) const {
    throw ConfigError(fmt::format("plan {}: {}: {}", source, path, msg));
  }
  void keys(const Json& j, const std::string& path, std::initializer_list<std::string_view> known) {
    if (!j.is_object()) fail(path, fmt::format("expected an object, got {}", type_of(j)));
    std::vector<std::string> names(known.begin(), known.end());
    for (auto it = j.begin(); it != j.end(); ++it) {
      if (std::find(names.begin(), names.end(), it.key()) == names.end()) {
        fail(path.empty() ? it.key() : path + "." + it.key(),
             fmt::format("unknown key{} (known: {})", did_you_mean(it.key(), names),
                         fmt::join(names, ", ")));
      }
    }
  }
  int64_t integer(const Json& j, const std::string& path, int64_t min) {
    if (!j.is_number_integer()) fail(path, fmt::format("expected an integer, got {}", type_of(j)));
    const int64_t v = j.get<int64_t>();
    if (v < min) fail(path, fmt::format("expected an integer >= {}, got {}", min, v));
    return v;
  }
  std::string string(const Json& j, const std::string& path) {
    if (!j.is_string()) fail(path, fmt::format("expected a string, got {}", type_of(j)));
    return j.get<std::string>();
  }
  const Json& list(const Json& j, const std::string& path) {
    if (!j.is_array()) fail(path, fmt::format("expected a list, got {}", type_of(j)));
    return j;
  }

  DimSharding dim(const Json& j, const std::string& path) {
    DimSharding d;
    if (j.is_null()) return d;
    if (j.is_string()) {
      d.axis = j.get<std::string>();
      return d;
    }
    if (!j.is_object()) {
      fail(path, fmt::format("expected null (replicated), an axis name or an object "
                             "{{\"axis\", \"ratios\", \"unit\"}}, got {}",
                             type_of(j)));
    }
    keys(j, path, {"axis", "ratios", "unit"});
    if (!j.contains("axis")) fail(path + ".axis", "missing (the mesh axis to split over)");
    d.axis = string(j["axis"], path + ".axis");
    if (j.contains("ratios")) {
      const Json& r = list(j["ratios"], path + ".ratios");
      for (size_t i = 0; i < r.size(); ++i)
        d.ratios.push_back(integer(r[i], fmt::format("{}.ratios[{}]", path, i), 1));
    }
    if (j.contains("unit")) d.unit = integer(j["unit"], path + ".unit", 1);
    return d;
  }

  ShardingSpec spec(const Json& j, const std::string& path) {
    keys(j, path, {"dims", "partial"});
    ShardingSpec s;
    if (j.contains("dims")) {
      const Json& d = list(j["dims"], path + ".dims");
      for (size_t i = 0; i < d.size(); ++i)
        s.dims.push_back(dim(d[i], fmt::format("{}.dims[{}]", path, i)));
    }
    if (j.contains("partial")) {
      const Json& p = list(j["partial"], path + ".partial");
      for (size_t i = 0; i < p.size(); ++i)
        s.partial.push_back(string(p[i], fmt::format("{}.partial[{}]", path, i)));
    }
    return s;
  }
};

constexpr std::string_view kFormat = "meshtrain-plan-v1";

}  // namespace

Plan plan_from_json(std::string_view text, const std::string& source) {
  Json j;
  try {
    j = Json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    throw ConfigError(fmt::format("plan {}: not valid JSON: {}", source, e.what()));
  }
  Reader rd{source};
  rd.keys(j, "",
          {"format", "model", "mesh", "values", "stages", "microbatches", "schedule",
           "virtual_stages", "warmup_extra", "async", "sequence_parallel", "devices"});
  Plan plan;
  if (j.contains("format")) {
    const std::string f = rd.string(j["format"], "format");
    if (f != kFormat) rd.fail("format", fmt::format("\"{}\" (expected \"{}\")", f, kFormat));
  }
  if (j.contains("model")) plan.model = rd.string(j["model"], "model");
  if (!j.contains("mesh")) rd.fail("mesh", "missing (a list of {\"name\", \"size\"} axes)");
  auto read_mesh = [&](const Json& jm, const std::string& key) {
    std::vector<MeshAxis> axes;
    const Json& m = rd.list(jm, key);
    for (size_t i = 0; i < m.size(); ++i) {
      const std::string path = fmt::format("{}[{}]", key, i);
      rd.keys(m[i], path, {"name", "size"});
      if (!m[i].contains("name") || !m[i].contains("size"))
        rd.fail(path, "expected {\"name\", \"size\"}");
      axes.push_back({rd.string(m[i]["name"], path + ".name"),
                      static_cast<int>(rd.integer(m[i]["size"], path + ".size", 1))});
    }
    try {
      return Mesh(axes);
    } catch (const ConfigError& e) {
      throw ConfigError(fmt::format("plan {}: {}: {}", source, key, e.what()));
    }
  };
  auto read_values = [&](const Json& v, const std::string& key) {
    std::vector<std::pair<std::string, ShardingSpec>> out;
    if (!v.is_object()) rd.fail(key, fmt::format("expected an object, got {}", type_of(v)));
    for (auto it = v.begin(); it != v.end(); ++it)
      out.emplace_back(it.key(), rd.spec(it.value(), key + "." + it.key()));
    return out;
  };
  plan.mesh = read_mesh(j["mesh"], "mesh");
  if (j.contains("values")) plan.specs = read_values(j["values"], "values");
  if (j.contains("microbatches"))
    plan.microbatches = static_cast<int>(rd.integer(j["microbatches"], "microbatches", 1));
  if (j.contains("virtual_stages"))
    plan.virtual_stages = static_cast<int>(rd.integer(j["virtual_stages"], "virtual_stages", 1));
  if (j.contains("warmup_extra"))
    plan.warmup_extra = static_cast<int>(rd.integer(j["warmup_extra"], "warmup_extra", 0));
  if (j.contains("async")) {
    plan.async =
        parse_async_mode(rd.string(j["async"], "async"), fmt::format("plan {}: async", source));
  }
  if (j.contains("schedule")) {
    plan.schedule = parse_schedule_kind(rd.string(j["schedule"], "schedule"),
                                        fmt::format("plan {}: schedule", source));
  }
  if (j.contains("sequence_parallel")) {
    if (!j["sequence_parallel"].is_boolean())
      rd.fail("sequence_parallel",
              fmt::format("expected true or false, got {}", type_of(j["sequence_parallel"])));
    plan.sequence_parallel = j["sequence_parallel"].get<bool>();
  }
  if (j.contains("devices")) {
    const Json& d = rd.list(j["devices"], "devices");
    for (size_t i = 0; i < d.size(); ++i)
      plan.devices.push_back(static_cast<int>(rd.integer(d[i], fmt::format("devices[{}]", i), 0)));
  }
  if (j.contains("stages")) {
    const Json& st = rd.list(j["stages"], "stages");
    const int n = static_cast<int>(st.size());
    const int p = std::max(1, n / std::max(1, plan.virtual_stages));
    for (int s = 0; s < n; ++s) {
      const std::string path = fmt::format("stages[{}]", s);
      const Json& e = st[static_cast<size_t>(s)];
      rd.keys(e, path, {"layers", "ranks", "recompute", "mesh", "values"});
      StagePlan sp;
      if (e.contains("mesh")) {
        sp.has_mesh = true;
        sp.mesh = read_mesh(e["mesh"], path + ".mesh");
      }
      if (e.contains("values")) {
        if (!sp.has_mesh) {
          rd.fail(path + ".values",
                  "spec overrides need the stage's own \"mesh\" (they refer to it)");
        }
        sp.specs = read_values(e["values"], path + ".values");
      }
      if (e.contains("recompute")) {
        if (!e["recompute"].is_boolean()) {
          rd.fail(path + ".recompute",
                  fmt::format("expected true or false, got {}", e["recompute"].dump()));
        }
        sp.recompute = e["recompute"].get<bool>();
      }
      if (e.contains("layers")) {
        const Json& l = rd.list(e["layers"], path + ".layers");
        for (size_t i = 0; i < l.size(); ++i)
          sp.layers.push_back(rd.string(l[i], fmt::format("{}.layers[{}]", path, i)));
      }
      if (e.contains("ranks")) {
        const Json& r = rd.list(e["ranks"], path + ".ranks");
        for (size_t i = 0; i < r.size(); ++i)
          sp.ranks.push_back(
              static_cast<int>(rd.integer(r[i], fmt::format("{}.ranks[{}]", path, i), 0)));
      } else if (plan.mesh.has_axis("pp")) {
        if (plan.mesh.axis_size("pp") != p) {
          rd.fail(path + ".ranks", fmt::format("missing, and the mesh's pp axis has size {} but "
                                               "the plan has {} physical stages",
                                               plan.mesh.axis_size("pp"), p));
        }
        for (int r = 0; r < plan.mesh.size(); ++r) {
          if (plan.mesh.coord(r, "pp") == stage_owner(plan.schedule, p, s)) sp.ranks.push_back(r);
        }
      } else if (n == 1) {
        for (int r = 0; r < plan.mesh.size(); ++r) sp.ranks.push_back(r);
      }
      plan.stages.push_back(std::move(sp));
    }
  }
  return plan;
}

Plan load_plan(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw FileError(fmt::format("--plan {}: cannot read the plan file", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return plan_from_json(ss.str(), path);
}

namespace {

Json mesh_json(const Mesh& mesh) {
  Json out = Json::array();
  for (const MeshAxis& a : mesh.axes()) out.push_back({{"name", a.name}, {"size", a.size}});
  return out;
}

Json specs_json(const std::vector<std::pair<std::string, ShardingSpec>>& specs) {
  Json values = Json::object();
  for (const auto& [name, s] : specs) {
    Json e = Json::object();
    Json dims = Json::array();
    for (const DimSharding& d : s.dims) {
      if (!d.split()) {
        dims.push_back(nullptr);
      } else if (d.ratios.empty() && d.unit == 1) {
        dims.push_back(d.axis);
      } else {
        Json o = {{"axis", d.axis}};
        if (!d.ratios.empty()) o["ratios"] = d.ratios;
        if (d.unit != 1) o["unit"] = d.unit;
        dims.push_back(o);
      }
    }
    if (!dims.empty()) e["dims"] = dims;
    if (!s.partial.empty()) e["partial"] = s.partial;
    values[name] = e;
  }
  return values;
}

std::string format_plan_json(const Json& j) {
  // One line per mesh axis, value and stage, so the file reads (and diffs)
  // like a table; the same JSON as j.dump().
  std::string out = "{\n";
  bool first = true;
  for (auto it = j.begin(); it != j.end(); ++it) {
    out += first ? "" : ",\n";
    first = false;
    out += fmt::format("  {}: ", Json(it.key()).dump());
    const Json& v = it.value();
    if ((v.is_array() || v.is_object()) && !v.empty()) {
      const bool obj = v.is_object();
      out += obj ? "{\n" : "[\n";
      bool first_item = true;
      for (auto e = v.begin(); e != v.end(); ++e) {
        out += first_item ? "    " : ",\n    ";
        first_item = false;
        if (obj) out += Json(e.key()).dump() + ": ";
        out += e.value().dump();
      }
      out += obj ? "\n  }" : "\n  ]";
    } else {
      out += v.dump();
    }
  }
  return out + "\n}\n";
}

}  // namespace

std::string plan_to_json(const Plan& plan) {
  Json j;
  j["format"] = kFormat;
  if (!plan.model.empty()) j["model"] = plan.model;
  j["mesh"] = mesh_json(plan.mesh);
  j["values"] = specs_json(plan.specs);
  Json stages = Json::array();
  for (const StagePlan& st : plan.stages) {
    Json e = {{"layers", st.layers}, {"ranks", st.ranks}};
    if (st.recompute) e["recompute"] = true;
    if (st.has_mesh) {
      e["mesh"] = mesh_json(st.mesh);
      if (!st.specs.empty()) e["values"] = specs_json(st.specs);
    }
    stages.push_back(e);
  }
  j["stages"] = stages;
  j["microbatches"] = plan.microbatches;
  j["schedule"] = schedule_name(plan.schedule);
  j["virtual_stages"] = plan.virtual_stages;
  if (plan.warmup_extra != 0) j["warmup_extra"] = plan.warmup_extra;
  if (plan.async != AsyncMode::none) j["async"] = async_name(plan.async);
  j["sequence_parallel"] = plan.sequence_parallel;
  if (!plan.devices.empty()) j["devices"] = plan.devices;
  return format_plan_json(j);
}

void write_plan(const Plan& plan, const std::string& path) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << plan_to_json(plan);
    out.close();
    if (!out) throw FileError(fmt::format("--write-plan {}: cannot write there", path));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw FileError(fmt::format("--write-plan {}: cannot write there", path));
  }
}

// ---------------------------------------------------------------------------
// describe

std::string describe_plan(const Plan& plan, const Graph& g) {
  std::string out;
  const Mesh& mesh = plan.mesh;
  out += fmt::format("mesh: {} ({} rank{}, last axis fastest)\n", mesh.describe(), mesh.size(),
                     mesh.size() == 1 ? "" : "s");
  for (int r = 0; r < mesh.size(); ++r) {
    const std::vector<int> c = mesh.coords(r);
    std::vector<std::string> coords, groups;
    for (size_t a = 0; a < c.size(); ++a) {
      coords.push_back(fmt::format("{}={}", mesh.axes()[a].name, c[a]));
      groups.push_back(fmt::format("{} [{}]", mesh.axes()[a].name,
                                   fmt::join(mesh.group(r, mesh.axes()[a].name), ", ")));
    }
    out += fmt::format("  rank {}: {}; groups: {}\n", r, fmt::join(coords, " "),
                       fmt::join(groups, "; "));
  }
  out +=
      "values (sharding spec; local shape [box] and bytes on the ranks that hold them; "
      "values not listed are replicated):\n";
  // Under a pipeline a parameter lives only on the ranks of its layer's stage.
  std::map<std::string, std::vector<int>> layer_ranks;
  for (const StagePlan& st : plan.stages) {
    for (const std::string& l : st.layers) layer_ranks[l] = st.ranks;
  }
  auto holders = [&](const Value& v) {
    if (v.role == ValueRole::param) {
      auto it = layer_ranks.find(v.name.substr(0, v.name.find('.')));
      if (it != layer_ranks.end()) return it->second;
    }
    std::vector<int> all(static_cast<size_t>(mesh.size()));
    for (int r = 0; r < mesh.size(); ++r) all[static_cast<size_t>(r)] = r;
    return all;
  };
  // A parameter's piece on rank r: under stage meshes, its box on the
  // stage's mesh (rank r is mesh rank m of the stage when ranks[m] = r).
  std::map<std::string, int> layer_stage;
  for (size_t s = 0; s < plan.stages.size(); ++s) {
    for (const std::string& l : plan.stages[s].layers) layer_stage[l] = static_cast<int>(s);
  }
  auto box_on = [&](const Value& v, const ShardingSpec& s, int r) {
    if (plan.stage_meshes() && v.role == ValueRole::param) {
      auto it = layer_stage.find(v.name.substr(0, v.name.find('.')));
      if (it != layer_stage.end()) {
        const Plan view = stage_view(plan, it->second);
        const auto& ranks = plan.stages[static_cast<size_t>(it->second)].ranks;
        const int m = static_cast<int>(std::ranges::find(ranks, r) - ranks.begin());
        return local_box(v.shape, view.spec(v.name), view.mesh, m);
      }
    }
    return local_box(v.shape, s, mesh, r);
  };
  int64_t total_params = 0;
  std::vector<int64_t> param_bytes(static_cast<size_t>(mesh.size()), 0);
  for (ValueId p : g.params()) {
    const Value& v = g.value(p);
    const int64_t elem = static_cast<int64_t>(dtype_size(v.dtype));
    total_params += v.shape.numel() * elem;
    const ShardingSpec& s = plan.spec(v.name);
    for (int r : holders(v))
      param_bytes[static_cast<size_t>(r)] += box_on(v, s, r).elements() * elem;
  }
  for (const auto& [name, s] : plan.specs) {
    const auto id = g.find(name);
    if (!id) continue;
    const Value& v = g.value(*id);
    const int64_t elem = static_cast<int64_t>(dtype_size(v.dtype));
    out += fmt::format("  {} {} {}: {}\n", name, v.shape.str(), dtype_name(v.dtype), s.describe());
    // Ranks with equal pieces are listed together.
    std::vector<std::pair<std::string, std::vector<int>>> rows;
    for (int r : holders(v)) {
      const Box b = box_on(v, s, r);
      std::vector<std::string> ranges;
      for (size_t d = 0; d < b.begin.size(); ++d)
        ranges.push_back(fmt::format("{}:{}", b.begin[d], b.end[d]));
      const std::string row = fmt::format("{} [{}] {} B", b.shape().str(), fmt::join(ranges, ", "),
                                          b.elements() * elem);
      auto it =
          std::find_if(rows.begin(), rows.end(), [&](const auto& x) { return x.first == row; });
      if (it == rows.end()) {
        rows.push_back({row, {r}});
      } else {
        it->second.push_back(r);
      }
    }
    for (const auto& [row, ranks] : rows)
      out += fmt::format("    rank{} {}: {}\n", ranks.size() == 1 ? "" : "s", fmt::join(ranks, ","),
                         row);
  }
  out += fmt::format("parameter bytes per rank (of {} in all):", total_params);
  for (int r = 0; r < mesh.size(); ++r)
    out += fmt::format(" {}:{}", r, param_bytes[static_cast<size_t>(r)]);
  out += "\n";
  const int p = plan.pipeline_stages();
  if (plan.stages.empty()) {
    out += "stages: 1 (every layer on every rank)\n";
  } else {
    out += fmt::format("stages: {} physical x {} virtual\n", p, plan.virtual_stages);
    for (size_t s = 0; s < plan.stages.size(); ++s) {
      const StagePlan& st = plan.stages[s];
      out += fmt::format("  stage {} (ranks {}{}): {}{}\n", s, fmt::join(st.ranks, ","),
                         st.has_mesh ? fmt::format("; mesh {}", st.mesh.describe()) : "",
                         fmt::join(st.layers, " "), st.recompute ? " (recomputed)" : "");
      for (const auto& [name, spec] : st.specs)
        out += fmt::format("    {}: {}\n", name, spec.describe());
    }
  }
  if (plan.sequence_parallel) out += "sequence parallelism: on (layer-norm regions over tp)\n";
  if (!plan.devices_in_order()) {
    out += fmt::format("devices (world rank of each mesh rank 0..{}): {}\n", mesh.size() - 1,
                       fmt::join(plan.devices, ","));
  }
  out += fmt::format("schedule: {}, {} micro-batch{}\n", schedule_name(plan.schedule),
                     plan.microbatches, plan.microbatches == 1 ? "" : "es");
  if (p > 1 || plan.microbatches > 1) {
    const PipelineSchedule sched = plan_schedule(plan);
    const ScheduleSimulation sim = simulate(sched);
    for (int s = 0; s < p; ++s) {
      std::vector<std::string> acts;
      for (const PipelineAction& a : sched.actions[static_cast<size_t>(s)])
        acts.push_back(describe(a));
      out += fmt::format("  stage {}: {}\n", s, fmt::join(acts, " "));
    }
    out += fmt::format(
        "  idle fraction {:.4f} (simulated with forward 1, backward 2 time units; formula "
        "{:.4f}{})\n",
        sim.idle_fraction,
        formula_idle_fraction(plan.schedule, p, plan.microbatches, plan.virtual_stages),
        plan.schedule == ScheduleKind::zero_bubble ? ", 1F1B's"
        : is_v_shaped(plan.schedule)               ? ", interleaved's with 2 chunks"
                                                   : "");
    if (plan.async != AsyncMode::none) {
      for (int s = 0; s < p; ++s) {
        out += fmt::format(
            "  async {}: stage {} weight-version gap per micro-batch (updates between its "
            "forward and backward): {} in the first step, then {} (no flush between steps)\n",
            async_name(plan.async), s, fmt::join(version_gaps(sched, s), ","),
            async_version_gap(p, s, plan.microbatches));
      }
    }
  }
  return out;
}

PipelineSchedule plan_schedule(const Plan& plan) {
  return make_schedule(plan.schedule, plan.pipeline_stages(), plan.microbatches,
                       plan.virtual_stages, plan.warmup_extra);
}

}  // namespace mt
