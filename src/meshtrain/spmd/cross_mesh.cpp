#include "meshtrain/spmd/cross_mesh.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "meshtrain/base/error.h"
#include "meshtrain/graph/collective.h"
#include "meshtrain/spmd/schedule.h"

namespace mt {

namespace {

// The global value a lowered graph's value `name` holds (local[v] names it).
ValueId global_of(const LoweredProgram& lp, const Graph& lowered, const Graph& forward,
                  const std::string& name) {
  ValueId found = kNoValue;
  for (ValueId v = 0; v < forward.num_values(); ++v) {
    const ValueId l = lp.local[static_cast<size_t>(v)];
    if (l == kNoValue || lowered.value(l).name != name) continue;
    if (forward.value(v).name == name) return v;
    if (found == kNoValue) found = v;
  }
  return found;
}

// A lowering's layout of a value as boxes over the stage's world ranks.
TensorLayout layout_over(const Layout& l, const Shape& shape, const Mesh& mesh,
                         const std::vector<int>& ranks, const std::string& where) {
  ShardingSpec spec;
  if (l.partial()) spec.partial = {l.axis};
  if (l.split()) {
    int dim = -1;
    int64_t unit = 1;
    for (int d = 0; d < shape.rank(); ++d) {
      int64_t after = 1;
      for (int e = d + 1; e < shape.rank(); ++e) after *= shape[e];
      if (after == 0 || l.stride % after != 0) continue;
      const int64_t u = l.stride / after;
      if (u >= 1 && l.units * u == shape[d]) {
        dim = d;
        unit = u;
        break;
      }
    }
    if (dim < 0) {
      throw ConfigError(fmt::format(
          "{}: the value is {} (shape {}), not a split of one dimension; a boundary between "
          "stages on different meshes takes replicated, partial or one-dimension splits",
          where, l.describe(), shape.str()));
    }
    spec.dims.resize(static_cast<size_t>(dim + 1));
    const bool even = std::ranges::all_of(l.sizes, [&](int64_t s) { return s == l.sizes[0]; });
    spec.dims[static_cast<size_t>(dim)] =
        DimSharding::over(l.axis, even ? std::vector<int64_t>{} : l.sizes, unit);
  }
  return TensorLayout::of(shape, spec, mesh, ranks);
}

}  // namespace

CrossMeshPipeline plan_cross_mesh(const Graph& forward, ValueId loss, const Plan& plan, int rank) {
  const int n = static_cast<int>(plan.stages.size());
  CrossMeshPipeline out;
  std::vector<LoweredProgram> lps(static_cast<size_t>(n));
  std::vector<PipelineCut> cuts(static_cast<size_t>(n));
  for (int s = 0; s < n; ++s) {
    const StagePlan& st = plan.stages[static_cast<size_t>(s)];
    const Plan view = stage_view(plan, s);
    const auto me = std::ranges::find(st.ranks, rank);
    const int m = me == st.ranks.end() ? 0 : static_cast<int>(me - st.ranks.begin());
    LoweredProgram lp = lower(forward, view, m, {loss});
    for (std::vector<int>& g : lp.groups) {
      for (int& r : g) r = st.ranks.at(static_cast<size_t>(r));
    }
    out.groups.push_back(lp.groups);
    CutOptions co;
    co.collectives_join_consumers = true;
    // As the trainer cuts an ordinary pipeline: a parameter's narrowing
    // cast (f16 / bf16) runs in the stage that reads the copy.
    co.param_casts_join_consumers = plan.async == AsyncMode::none;
    cuts[static_cast<size_t>(s)] = cut_pipeline(lp.graph, lp[loss], plan.stages, co);
    if (me != st.ranks.end() && out.stage < 0) {
      out.stage = s;  // the first of its virtual stages: its physical stage
      out.mesh_rank = m;
    }
    if (me != st.ranks.end()) out.chunks.push_back(s);
    lps[static_cast<size_t>(s)] = std::move(lp);
  }
  // A parameter several stages hold: its layout in each holder's lowering,
  // and the plans that sum its gradient onto the first holder and back.
  out.cut.shared_params = cuts[0].shared_params;
  const int p = std::max(1, n / std::max(1, plan.virtual_stages));
  for (const auto& [name, holders] : cuts[0].shared_params) {
    const auto gv = forward.find(name);
    MT_CHECK(gv.has_value(), "plan_cross_mesh: shared parameter {} not in the model", name);
    const Shape& shape = forward.value(*gv).shape;
    CrossMeshPipeline::Shared sh;
    sh.holders = holders;
    sh.plans.name = name;
    std::vector<int> owners;  // the physical stage of each holder in plans.stages
    for (int h : holders) {
      const StagePlan& hs = plan.stages[static_cast<size_t>(h)];
      TensorLayout l =
          layout_over(lps[static_cast<size_t>(h)].layout[static_cast<size_t>(*gv)], shape,
                      stage_view(plan, h).mesh, hs.ranks,
                      fmt::format("plan: parameter {} (shared by stages {}) in stage {}", name,
                                  fmt::join(holders, ", "), h));
      // Virtual stages: two holders on the same ranks (ZBV's V ends) share
      // the runtime's one tensor of it, whose gradient both accumulate; so
      // they must hold it alike.
      const int owner = stage_owner(plan.schedule, p, h);
      if (const auto o = std::ranges::find(owners, owner); o != owners.end()) {
        const size_t k = static_cast<size_t>(o - owners.begin());
        if (!(sh.layouts[k].describe() == l.describe())) {
          throw ConfigError(fmt::format(
              "plan: parameter {} is read by stages {} and {}, which run on the same ranks ({}) "
              "but hold it differently ({} and {}); virtual stages of one physical stage share "
              "one copy of a parameter (give stages[{}].values.{} the spec stage {} uses)",
              name, sh.plans.stages[k], h, fmt::join(hs.ranks, ", "), sh.layouts[k].describe(),
              l.describe(), h, name, sh.plans.stages[k]));
        }
        continue;
      }
      owners.push_back(owner);
      sh.plans.stages.push_back(h);
      sh.layouts.push_back(std::move(l));
    }
    for (size_t k = 1; k < sh.layouts.size(); ++k) {
      sh.plans.to_first.push_back(
          plan_reshard(shape, DType::f32, sh.layouts[k], sh.layouts.front()));
      sh.plans.from_first.push_back(
          plan_reshard(shape, DType::f32, sh.layouts.front(), sh.layouts[k]));
    }
    out.shared.push_back(std::move(sh));
  }
  for (int s = 0; s < n; ++s) {
    out.cut.stages.push_back(cuts[static_cast<size_t>(s)].stages[static_cast<size_t>(s)]);
  }
  out.boundaries.resize(static_cast<size_t>(n));
  for (int s = 0; s + 1 < n; ++s) {
    PipelineStage& prod = out.cut.stages[static_cast<size_t>(s)];
    PipelineStage& cons = out.cut.stages[static_cast<size_t>(s + 1)];
    const StagePlan& ps = plan.stages[static_cast<size_t>(s)];
    const StagePlan& cs = plan.stages[static_cast<size_t>(s + 1)];
    const LoweredProgram& pl = lps[static_cast<size_t>(s)];
    const LoweredProgram& cl = lps[static_cast<size_t>(s + 1)];
    const std::string where = fmt::format("plan: boundary stages[{}] -> stages[{}]", s, s + 1);
    // The consumer's inputs by global value, put into the producer's order.
    std::vector<ValueId> cin;
    for (const StageBoundary& b : cons.inputs) {
      cin.push_back(global_of(cl, cl.graph, forward, b.name));
    }
    if (prod.outputs.size() != cons.inputs.size()) {
      throw ConfigError(fmt::format(
          "{}: stage {} sends {} value(s) but stage {} on its mesh reads {}; the two lowerings "
          "cut the model differently",
          where, s, prod.outputs.size(), s + 1, cons.inputs.size()));
    }
    std::vector<StageBoundary> inputs;
    std::vector<std::string> input_grads;
    for (const StageBoundary& b : prod.outputs) {
      const ValueId gv = global_of(pl, pl.graph, forward, b.name);
      const auto it = std::ranges::find(cin, gv);
      if (gv == kNoValue || it == cin.end()) {
        throw ConfigError(fmt::format(
            "{}: value {} that stage {} sends is not one stage {} reads on its mesh (or is "
            "a copy the lowering made); such boundaries are not supported yet",
            where, b.name, s, s + 1));
      }
      const size_t k = static_cast<size_t>(it - cin.begin());
      const StageBoundary& ci = cons.inputs[k];
      if (ci.has_grad != b.has_grad) {
        throw ConfigError(fmt::format(
            "{}: value {}: the two stages' lowerings disagree on whether its gradient flows back",
            where, b.name));
      }
      inputs.push_back(ci);
      if (ci.has_grad) {
        // input_grads lists the gradients of the inputs with has_grad, in order.
        size_t g = 0;
        for (size_t q = 0; q < k; ++q) g += cons.inputs[q].has_grad ? 1 : 0;
        input_grads.push_back(cons.input_grads.at(g));
      }
      const Value& v = forward.value(gv);
      CrossMeshBoundary cb;
      cb.stage = s;
      cb.value = v.name;
      cb.shape = v.shape;
      cb.dtype = v.dtype;
      cb.has_grad = b.has_grad;
      const std::string vwhere = fmt::format("{}: value {}", where, v.name);
      cb.producer =
          layout_over(pl.layout[static_cast<size_t>(gv)], v.shape, stage_view(plan, s).mesh,
                      ps.ranks, vwhere + " in stage " + std::to_string(s));
      cb.consumer =
          layout_over(cl.layout[static_cast<size_t>(gv)], v.shape, stage_view(plan, s + 1).mesh,
                      cs.ranks, vwhere + " in stage " + std::to_string(s + 1));
      if (cb.consumer.partial) {
        throw ConfigError(fmt::format(
            "{}: stage {} reads it as a partial sum; a boundary's consumer holds whole values "
            "(replicated or split)",
            vwhere, s + 1));
      }
      cb.plans = plan_boundary(v.shape, v.dtype, cb.producer, cb.consumer);
      out.boundaries[static_cast<size_t>(s)].push_back(std::move(cb));
    }
    cons.inputs = std::move(inputs);
    cons.input_grads = std::move(input_grads);
  }
  // The rank's program: its first chunk's lowering, each parameter of its
  // other chunks (virtual stages) in the layout of the chunk that holds it.
  LoweredProgram mine = std::move(lps[static_cast<size_t>(std::max(0, out.stage))]);
  for (int s : out.chunks) {
    if (s == out.stage) continue;
    const LoweredProgram& other = lps[static_cast<size_t>(s)];
    for (const std::string& name : out.cut.stages[static_cast<size_t>(s)].params) {
      const LoweredParam* lp = other.param(name);
      const auto it =
          std::ranges::find_if(mine.params, [&](const LoweredParam& q) { return q.name == name; });
      if (lp == nullptr || it == mine.params.end()) continue;
      *it = *lp;
      if (const auto gv = forward.find(name)) {
        mine.layout[static_cast<size_t>(*gv)] = other.layout[static_cast<size_t>(*gv)];
      }
    }
  }
  out.lowered = std::move(mine);
  return out;
}

uint64_t cross_mesh_bytes(const CrossMeshPipeline& p, int rank, int microbatches) {
  uint64_t b = 0;
  for (const auto& stage : p.boundaries) {
    for (const CrossMeshBoundary& cb : stage) {
      b += cb.plans.forward.bytes_sent(rank);
      if (cb.has_grad) b += cb.plans.backward.bytes_sent(rank);
    }
  }
  b *= static_cast<uint64_t>(microbatches);
  for (const CrossMeshPipeline::Shared& sh : p.shared) b += sh.plans.bytes_sent(rank);
  return b;
}

std::string describe_cross_mesh(const CrossMeshPipeline& p, const Plan& plan) {
  std::string out = "stages on different meshes:\n";
  if (const int dp = plan.mesh.axis_size("dp"); dp > 1) {
    out += fmt::format(
        "  (ranks of one model replica; {} replicas over dp, replica d on the world ranks whose "
        "dp coordinate is d, in order)\n",
        dp);
  }
  for (size_t s = 0; s < plan.stages.size(); ++s) {
    const StagePlan& st = plan.stages[s];
    out += fmt::format("  stage {}: mesh {} on ranks {}\n", s, st.mesh.describe(),
                       fmt::join(st.ranks, ","));
  }
  int world = 0;
  for (const StagePlan& st : plan.stages) {
    for (int r : st.ranks) world = std::max(world, r + 1);
  }
  for (const auto& stage : p.boundaries) {
    for (const CrossMeshBoundary& cb : stage) {
      // Two virtual stages of one physical stage: resharded inside its ranks.
      const std::vector<int>& from = plan.stages[static_cast<size_t>(cb.stage)].ranks;
      const bool inside = from == plan.stages[static_cast<size_t>(cb.stage + 1)].ranks;
      out += fmt::format("  boundary stage {} -> {}: {} {} {}{}\n", cb.stage, cb.stage + 1,
                         cb.value, cb.shape.str(), dtype_name(cb.dtype),
                         inside ? fmt::format(" (inside ranks {})", fmt::join(from, ",")) : "");
      out +=
          fmt::format("    from {}\n    to   {}\n", cb.producer.describe(), cb.consumer.describe());
      auto per_rank = [&](const ReshardPlan& rp) {
        std::vector<std::string> v;
        for (int r = 0; r < world; ++r) {
          if (rp.bytes_sent(r) > 0) v.push_back(fmt::format("{}:{}", r, rp.bytes_sent(r)));
        }
        return fmt::format("{} B in all ({})", rp.total_bytes(),
                           v.empty() ? std::string("none") : fmt::format("{}", fmt::join(v, " ")));
      };
      out += fmt::format("    forward per micro-batch: {}\n", per_rank(cb.plans.forward));
      if (cb.has_grad) {
        out += fmt::format("    backward per micro-batch: {}\n", per_rank(cb.plans.backward));
      }
    }
  }
  for (const CrossMeshPipeline::Shared& sh : p.shared) {
    out += fmt::format("  shared parameter {} (stages {}{}): its gradient summed over\n",
                       sh.plans.name, fmt::join(sh.holders, ", "),
                       sh.holders.size() == sh.plans.stages.size()
                           ? ""
                           : "; stages on the same ranks hold one copy");
    for (const TensorLayout& l : sh.layouts) out += fmt::format("    {}\n", l.describe());
    std::vector<std::string> v;
    for (int r = 0; r < world; ++r) {
      if (sh.plans.bytes_sent(r) > 0) v.push_back(fmt::format("{}:{}", r, sh.plans.bytes_sent(r)));
    }
    out += fmt::format("    per step: {}\n",
                       v.empty() ? std::string("none") : fmt::format("{}", fmt::join(v, " ")));
  }
  out += p.shared.empty() ? "  boundary bytes per rank per step:"
                          : "  boundary and shared-gradient bytes per rank per step:";
  for (int r = 0; r < world; ++r)
    out += fmt::format(" {}:{}", r, cross_mesh_bytes(p, r, plan.microbatches));
  return out + "\n";
}

std::string describe_cross_mesh_programs(const Graph& forward, ValueId loss, const Plan& plan) {
  int world = 0;
  for (const StagePlan& st : plan.stages) {
    for (int r : st.ranks) world = std::max(world, r + 1);
  }
  std::string out = "per-rank programs (each virtual stage lowered on its stage's mesh):\n";
  for (int r = 0; r < world; ++r) {
    const CrossMeshPipeline x = plan_cross_mesh(forward, loss, plan, r);
    if (x.stage < 0) continue;
    const Mesh& mesh = plan.stages[static_cast<size_t>(x.stage)].mesh;
    out += fmt::format("  rank {} (mesh rank {} of {}): virtual stage{} {}\n", r, x.mesh_rank,
                       mesh.describe(), x.chunks.size() == 1 ? "" : "s", fmt::join(x.chunks, ", "));
    for (int s : x.chunks) {
      const PipelineStage& st = x.cut.stages[static_cast<size_t>(s)];
      std::vector<std::string> params;
      for (const std::string& name : st.params) {
        const LoweredParam* lp = x.lowered.param(name);
        if (lp == nullptr || lp->axis.empty()) {
          params.push_back(name);
          continue;
        }
        std::vector<std::string> box;
        for (size_t d = 0; d < lp->box.begin.size(); ++d) {
          box.push_back(fmt::format("{}:{}", lp->box.begin[d], lp->box.end[d]));
        }
        params.push_back(fmt::format("{} {} -> [{}] over {}", name, lp->global.str(),
                                     fmt::join(box, ", "), lp->axis));
      }
      out += fmt::format("    stage {} ({}): {}\n", s, fmt::join(st.layers, ", "),
                         params.empty() ? std::string("no parameters")
                                        : fmt::format("{}", fmt::join(params, "; ")));
      // The collectives its passes run inside the stage's mesh, per micro-batch.
      for (const auto& [pass, what] :
           {std::pair{&st.forward, "forward"}, std::pair{&st.backward, "backward"}}) {
        for (const Node& n : pass->graph.nodes()) {
          if (!is_group_op(n.op)) continue;
          out +=
              fmt::format("      {} {} {} ({} bytes per micro-batch)\n", what, op_name(n.op),
                          n.name, static_cast<int64_t>(collective_payload_bytes(pass->graph, n)));
        }
      }
    }
  }
  return out;
}

}  // namespace mt
