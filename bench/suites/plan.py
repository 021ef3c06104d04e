"""Planner validation: `meshtrain simulate`'s predicted step time and peak memory against `meshtrain train`'s measured ones, on this machine.

First `meshtrain calibrate --nproc 2` (--quick with --quick) writes this
machine's cluster file (one node of 2 ranks); the 4-rank plans use the same
file with `ranks_per_node = 4` (same machine, same intra-node link fits,
memory_gb left as measured for 2 ranks). Then, for each plan below (MLP =
configs/mlp_fashion.toml, GPT = configs/gpt_text.toml, 1 thread per rank,
no evaluation, no checkpoint): `meshtrain simulate --cluster FILE --config
CONFIG --set ...` and `meshtrain train --nproc N --metrics FILE --set ...`
with the same settings.

One line per plan (name plan_<model>_<plan>, unit ms), value = measured
step time, with:
  predicted_step_ms / measured_step_ms / step_rel_err  measured = global
      batch / the summary's samples_per_s (the trainer's median over the
      steps after its warm-up); rel_err = (predicted - measured) / measured
  predicted_peak_mib_rank0 / measured_peak_mib / mem_rel_err  rank 0's:
      predicted = simulate's peak for rank 0's program (the trainer's own
      memory plan: arenas, parameters, gradients, optimizer state, DP
      buffers); measured = rank 0's allocator peak over all categories
      together (summary mem_peak_total_bytes). predicted_peak_mib is
      simulate's "max peak memory" over all ranks.
  predicted_peak_mib_per_program  simulate's per-program peaks (first rank
      of each program)
  measured_category_peaks_sum_mib_per_rank, peak_rss_mib_per_rank  per
      rank: the sum of the allocator's per-category peaks (an upper bound of
      its peak) and the process's peak RSS, as the summary reports them.
      The pipeline trainer reports neither per rank (rank 0's RSS and the
      activation stash only): its lines have no memory error.
  measured_fast_step_ms / step_rel_err_fast  the same against the 90th
      percentile of the per-step rates (the steps others left alone)
  (plans with more ranks than cores: the calibrated file's `[[nodes]]
      cores` has the model price each rank's kernels on ranks / cores of a
      core; until i12-model the line carried that as a second prediction,
      predicted_step_ms_cores_shared, every rank slowed by ranks / cores)
A plan that fails in simulate or train keeps its line, with "error".

Then `meshtrain plan --nproc 2` for the GPT on the calibrated file: its
first-ranked plan is trained as written (`train --plan`) and compared with
the fastest measured 2-rank GPT plan (line plan_search_first; goal <=
1.05). The two are then trained again in turn, --pair-rounds times (first,
fastest, first, ...: both see the same machine), and value = median of the
first plan's runs / median of the fastest plan's runs from those rounds
(the first plan's run above is its first round); "unpaired" is the first
run against the fastest plan's own line, minutes apart.

Lines plan_uneven_speedup_<plan>: with dist.slowdown = [1, 2], the uneven
plan's speedup over its even twin, predicted and measured (goal >= 1.3).

Lines plan_hetero_<model>_slow<factors> (`--only hetero` runs these
alone; the MLP is 784-2048-2048-10 here, model_sets, see HETERO_SETS):
with dist.slowdown = [1, 2] (2 ranks) and [1, 1, 2, 3] (4 ranks),
`meshtrain plan` on the calibrated file; its first plan (the planner's
pick: LP shares, ratios or layers, and which devices form which stage or
tensor group) is trained as written (`train --plan`), and so is the best
even plan it lists (no shares, ratios, stage layers or device order:
`--set parallel.*`). value = measured step of the even plan / of the pick
(goal >= 1.3); compute_spread = max / min over the ranks of the summary's
measured compute_s_per_step (the rank's kernels' wall time, the
slowdown's sleeps included, plus its optimizer update; pipelines: its
passes' wall time), for the pick (goal <= 1.10: the LP's ratios equalise
the measured compute) and the even plan; compute_cpu_spread the same from
compute_cpu_s_per_step (the kernels' and update's thread CPU time times
the slowdown: the rank's compute had it a core of its own, without the
waits for a core that the wall time holds on a shared machine);
compute_spread_before_update / compute_cpu_spread_before_update the
same without the rank's optimizer update (summary update_s_per_step /
update_cpu_s_per_step): the forward and backward that the shares move and
the LP balances (the update follows the gradient sync, and a slowed
rank's stretched update is in the step whatever the shares, i12-model);
pick_predicted_compute_spread the model's (`meshtrain simulate` of the
pick: its compute per rank program), which whole examples / layers / heads
keep above 1; load = the 1-minute load average
before and after, others_cpu = the other processes' CPU share during the
runs.

Last line plan_summary: median |rel_err| of time and of memory over the
plans that ran (goals 0.10 and 0.05), with how many met each.
No peer: nothing else here predicts these plans.
"""

import json
import re
import statistics

import meshtrain
from common import REPO, transport_context

# (name, model, nproc, sets); sets are applied to both simulate and train.
UNEVEN = "dist.slowdown=[1,2]"
PLANS = [
    ("mlp_dp2_zero0", "mlp", 2, ["dist.zero_stage=0"]),
    ("mlp_dp2_zero2", "mlp", 2, ["dist.zero_stage=2"]),
    ("mlp_dp2_zero3", "mlp", 2, ["dist.zero_stage=3"]),
    ("mlp_dp2_slow12_even", "mlp", 2, [UNEVEN]),
    ("mlp_dp2_slow12_shares21", "mlp", 2, [UNEVEN, "dist.batch_shares=[2,1]"]),
    ("mlp_tp2", "mlp", 2, ["parallel.tp=2"]),
    ("gpt_dp2_zero0", "gpt", 2, ["dist.zero_stage=0"]),
    ("gpt_dp2_zero2", "gpt", 2, ["dist.zero_stage=2"]),
    ("gpt_dp2_zero3", "gpt", 2, ["dist.zero_stage=3"]),
    ("gpt_tp2", "gpt", 2, ["parallel.tp=2"]),
    ("gpt_tp2_sp", "gpt", 2, ["parallel.tp=2", "parallel.sp=true"]),
    ("gpt_tp2_slow12_even", "gpt", 2, ["parallel.tp=2", UNEVEN]),
    ("gpt_tp2_slow12_ratios21", "gpt", 2, ["parallel.tp=2", "parallel.tp_ratios=[2,1]", UNEVEN]),
    ("gpt_pp2_gpipe", "gpt", 2, ["parallel.pp=2", "parallel.microbatches=4",
                                 "parallel.schedule=gpipe"]),
    ("gpt_pp2_1f1b", "gpt", 2, ["parallel.pp=2", "parallel.microbatches=4",
                                "parallel.schedule=1f1b"]),
    ("gpt_pp2_1f1b_slow12_even", "gpt", 2, ["parallel.pp=2", "parallel.microbatches=4",
                                            "parallel.schedule=1f1b", UNEVEN]),
    ("gpt_pp2_1f1b_slow12_layers31", "gpt", 2, ["parallel.pp=2", "parallel.microbatches=4",
                                                "parallel.schedule=1f1b",
                                                "parallel.stage_layers=[3,1]", UNEVEN]),
    ("gpt_dp2_tp2", "gpt", 4, ["parallel.dp=2", "parallel.tp=2"]),
    ("gpt_dp2_pp2_1f1b", "gpt", 4, ["parallel.dp=2", "parallel.pp=2", "parallel.microbatches=4",
                                    "parallel.schedule=1f1b"]),
]


def add_args(p):
    p.add_argument("--steps", type=int, default=0,
                   help="training steps per plan (0: 30 MLP / 12 GPT; --quick: 12 / 6)")
    p.add_argument("--only", default="", help="comma-separated plan names (default: all)")
    p.add_argument("--cluster", default="",
                   help="use this cluster file instead of calibrating (2 ranks per node)")
    p.add_argument("--save-cluster", default="",
                   help="copy the calibrated cluster file here (the predictions' inputs)")
    p.add_argument("--pair-rounds", type=int, default=3,
                   help="interleaved runs of the search's first plan and the fastest plan line")


def parse_simulate(text):
    """Predicted step (ms), max peak (MiB) and per-program peaks from
    `meshtrain simulate`'s report."""
    out = {}
    m = re.search(r"predicted step time: ([0-9.]+) (ms|s|us)\b", text)
    if m:
        out["predicted_step_ms"] = float(m.group(1)) * {"s": 1e3, "ms": 1.0, "us": 1e-3}[m.group(2)]
    m = re.search(r"max peak memory ([0-9.]+) (KiB|MiB|GiB)", text)
    if m:
        out["predicted_peak_mib"] = to_mib(float(m.group(1)), m.group(2))
    per = []
    for m in re.finditer(r"(?m)^\s+rank (\d+)(?: \+\d+)?\s.*?([0-9.]+) (KiB|MiB|GiB)\s+"
                         r"[0-9.]+ (?:B|KiB|MiB|GiB)\s*$", text):
        per.append([int(m.group(1)), to_mib(float(m.group(2)), m.group(3))])
    if per:
        out["predicted_peak_mib_per_program"] = per
    return out


def to_mib(v, unit):
    return round(v * {"KiB": 1 / 1024, "MiB": 1.0, "GiB": 1024.0}[unit], 3)


def rel(pred, meas):
    if pred is None or not meas:
        return None
    return (pred - meas) / meas


def simulate(ctx, exe, name, config, cluster, sets, plan_file=None):
    cmd = [exe, "simulate", "--config", config, "--cluster", cluster]
    if plan_file:
        cmd += ["--plan", plan_file]
    for kv in sets:
        cmd += ["--set", kv]
    r = ctx.run(cmd, name=f"sim-{name}", timeout_s=300)
    if not r.ok:
        return {"error": f"simulate: {r.failure()}"}
    out = parse_simulate(r.stdout)
    if "predicted_step_ms" not in out or "predicted_peak_mib" not in out:
        return {"error": "simulate: no step time or peak memory in its report"}
    return out


def measured(run, batch):
    s = run.summary
    fast = run.fast_samples_per_s(2)
    ranks = s.get("ranks") or []
    per = [round(sum((r.get("mem_peak_bytes") or {}).values()) / 2**20, 3) for r in ranks
           if "mem_peak_bytes" in r]
    out = {
        "measured_step_ms": 1e3 * batch / s["samples_per_s"],
        # The 90th percentile of per-step rates after 2 steps: the steps
        # the machine's other users left alone (calibration keeps its
        # fastest repetition too).
        "measured_fast_step_ms": 1e3 * batch / fast if fast else None,
        "samples_per_s_includes_warmup": s.get("samples_per_s_includes_warmup"),
        # Rank 0's allocator peak of all categories together (the summary's
        # mem_peak_total_bytes); the other ranks report per-category peaks
        # only, whose sum is an upper bound (transient "other" buffers peak
        # apart from the rest).
        "measured_peak_mib": (round(s["mem_peak_total_bytes"] / 2**20, 3)
                              if s.get("mem_peak_total_bytes") else None),
        "measured_category_peaks_sum_mib_per_rank": per,
        "peak_rss_mib_per_rank": [round(r.get("peak_rss_bytes", 0) / 2**20, 1) for r in ranks],
        "final_loss": s.get("final_loss"),
        "others_cpu": run.others_cpu,
    }
    plan = s.get("plan") if isinstance(s.get("plan"), dict) else {}
    if not any("mem_peak_bytes" in r for r in ranks):
        # The pipeline trainer's summary has no per-rank allocator counters:
        # rank 0's peak RSS and the measured activation stash only.
        out["peak_rss_mib_rank0"] = round(s.get("peak_rss_bytes", 0) / 2**20, 1)
        out["measured_peak_mib_missing"] = ("the pipeline trainer's summary reports no "
                                            "allocator counters per rank")
    if "peak_stash_bytes" in plan:
        out["measured_peak_stash_mib"] = round(plan["peak_stash_bytes"] / 2**20, 3)
        out["planned_peak_stash_mib"] = round(plan.get("planned_peak_stash_bytes", 0) / 2**20, 3)
        out["pipeline_idle_fraction"] = plan.get("pipeline_idle_fraction")
    return out


ROW = re.compile(r"^\s*(\d+)\s+([0-9.]+) (ms|s|us)\s.*?\s(dp=\d+ tp=\d+ pp=\d+.*)$")


def plan_sets(desc):
    """`meshtrain plan`'s plan description ("dp=2 tp=1 pp=2 mb=4 1f1b zero=0
    recompute stage_layers=[3,1]") as --set overrides; None for a device
    order (only the plan file carries it)."""
    sets = []
    toks = desc.split()
    for i, t in enumerate(toks):
        k, _, v = t.partition("=")
        if k in ("dp", "tp", "pp"):
            sets.append(f"parallel.{k}={v}")
        elif k == "mb":
            sets += [f"parallel.microbatches={v}", f"parallel.schedule={toks[i + 1]}"]
        elif k == "zero":
            sets.append(f"dist.zero_stage={v}")
        elif t == "recompute":
            sets.append("exec.recompute=true")
        elif k == "shares":
            sets.append(f"dist.batch_shares={v}")
        elif k in ("tp_ratios", "stage_layers"):
            sets.append(f"parallel.{k}={v}")
        elif k == "devices":
            return None
    return sets


def compute_spread(run, key="compute_s_per_step", minus=None):
    ranks = (run.summary or {}).get("ranks") or []
    if minus and not all(minus in r for r in ranks):
        return None, []  # a trainer without the split (pipelines)
    per = [r.get(key) - (r.get(minus) or 0 if minus else 0) for r in ranks if r.get(key)]
    per = [c for c in per if c > 0]
    if not per:
        return None, []
    return max(per) / min(per), [round(c * 1e3, 2) for c in per]


def load1():
    try:
        return float(open("/proc/loadavg").read().split()[0])
    except OSError:
        return None


# Global batch of the heterogeneous lines, by model and rank count: 3x / 6x
# / 4x the configs' own, so that whole examples can come near the LP's
# shares (at GPT's 16, [1,1,2,3] rounds to [6,6,2,2], compute 6:6:4:6
# before anything is measured; at 48 the best whole split, [17,17,8,6],
# still spreads 18:16 = 1.125, above the 10% goal; at 96, [34,34,17,11]:
# 1.03) and the MLP's kernels are not all per-call overhead.
HETERO_BATCH = {"gpt": {2: 48, 4: 96}, "mlp": {2: 512, 4: 512}}
# The MLP of the heterogeneous lines is wider than configs/mlp_fashion.toml
# (784-2048-2048-10, 5.8M parameters, instead of 784-512-512-10): at 512
# hidden units its step is ~2 ms on 2 ranks, and the fixed per-step costs
# that batch shares do not move (optimizer, all-reduce, the executor's per
# operator overhead, sleeps of the slowdown emulation) are much of it, so the
# lines measured the runtime's fixed costs rather than the planner's
# balancing. The plan lines above keep the config's own MLP.
HETERO_SETS = {"mlp": ["model.hidden=[2048,2048]"]}
SIM_RANK = re.compile(r"(?m)^\s+rank (\d+)(?: \+\d+)?\s+([0-9.]+) (ms|s|us)\s")


def hetero(ctx, exe, model, factors, cluster, base, batch):
    """The planner's pick and the best even plan it lists under
    dist.slowdown = factors, both trained; their measured step times and
    per-rank compute. Where the pick is an even plan, the best uneven plan
    listed is trained too (line field uneven_*)."""
    n = len(factors)
    slow = "dist.slowdown=[" + ",".join(str(f) for f in factors) + "]"
    bset = f"train.batch_size={batch}"
    msets = HETERO_SETS.get(model, [])
    base = base + [bset] + msets
    bset = [bset] + msets
    name = f"plan_hetero_{model}_slow{''.join(str(f) for f in factors)}"
    line = {"name": name, "unit": "ratio", "model": model, "nproc": n, "slowdown": factors,
            "batch": batch, "model_sets": HETERO_SETS.get(model, []),
            "peer": None, "goal": 1.3, "goal_compute_spread": 1.10, "load_before": load1()}
    steps = ctx.args.steps or ((12 if ctx.quick else 30) if model == "mlp"
                               else (6 if ctx.quick else 12))
    cfg = meshtrain.config_path(model)
    plan_file = ctx.workdir / f"{name}.json"
    cmd = [exe, "plan", "--config", cfg, "--cluster", cluster, "--nproc", str(n), "--top", "400",
           "--out", plan_file, "--quiet"]
    for kv in base + [slow]:
        cmd += ["--set", kv]
    r = ctx.run(cmd, name=f"plan-{name}", timeout_s=600)
    if not r.ok:
        line["error"] = f"plan: {r.failure()}"
        ctx.emit(line)
        return
    rows = []
    for ln in r.stdout.splitlines():
        m = ROW.match(ln)
        if m:
            ms = float(m.group(2)) * {"s": 1e3, "ms": 1.0, "us": 1e-3}[m.group(3)]
            rows.append((ms, m.group(4).strip()))
    uneven_keys = ("shares=", "tp_ratios=", "stage_layers=", "devices=")
    even = next((x for x in rows if not any(k in x[1] for k in uneven_keys)), None)
    if not rows or even is None:
        line["error"] = "plan: no plan rows, or no even plan among them"
        ctx.emit(line)
        return
    line.update({"pick": rows[0][1], "pick_predicted_ms": rows[0][0],
                 "even": even[1], "even_predicted_ms": even[0],
                 "predicted": even[0] / rows[0][0],
                 "pick_is_even": rows[0] is even})
    m = re.search(r"--plan \S+((?: --set \S+)*)", r.stdout)
    extra = [kv for kv in (re.findall(r"--set (\S+)", m.group(1)) if m else [])
             if not kv.startswith("dist.nproc=")]
    # The model's compute per rank program for the pick (spread: max / min).
    sim = ctx.run([exe, "simulate", "--config", cfg, "--cluster", cluster, "--plan", plan_file]
                  + [a for kv in base + extra + [slow] for a in ("--set", kv)],
                  name=f"sim-{name}", timeout_s=300)
    pred = [float(v) * {"s": 1e3, "ms": 1.0, "us": 1e-3}[u]
            for _, v, u in SIM_RANK.findall(sim.stdout)] if sim.ok else []
    if pred:
        line["pick_predicted_compute_ms_per_program"] = pred
        line["pick_predicted_compute_spread"] = max(pred) / min(pred)
    pick = meshtrain.train(ctx, model, steps, 1, nproc=n, sets=bset + extra + [slow],
                           name=f"train-{name}-pick", extra_args=["--plan", plan_file])
    ev = meshtrain.train(ctx, model, steps, 1, nproc=n,
                         sets=bset + plan_sets(even[1]) + [slow], name=f"train-{name}-even")
    runs = [pick, ev]
    uneven = None
    if rows[0] is even:
        # The planner prefers an even plan: measure its best uneven one too.
        uneven = next((x for x in rows if any(k in x[1] for k in uneven_keys[:3])
                       and plan_sets(x[1]) is not None), None)
        if uneven:
            un = meshtrain.train(ctx, model, steps, 1, nproc=n,
                                 sets=bset + plan_sets(uneven[1]) + [slow],
                                 name=f"train-{name}-uneven")
            runs.append(un)
    line["load_after"] = load1()
    line["others_cpu"] = [x.others_cpu for x in runs]
    errs = [x.error for x in runs if x.error]
    if errs:
        line["error"] = "; ".join(errs)
        ctx.emit(line)
        return
    pm = 1e3 * batch / pick.summary["samples_per_s"]
    em = 1e3 * batch / ev.summary["samples_per_s"]
    ps, pc = compute_spread(pick)
    es, ec = compute_spread(ev)
    psc, pcc = compute_spread(pick, "compute_cpu_s_per_step")
    esc, ecc = compute_spread(ev, "compute_cpu_s_per_step")
    # Before the update: the forward and backward the shares move (the
    # update follows the gradient sync; the LP leaves it out, i12-model).
    pfs, pfc = compute_spread(pick, "compute_cpu_s_per_step", "update_cpu_s_per_step")
    pfw, pfwc = compute_spread(pick, "compute_s_per_step", "update_s_per_step")
    line.update({"compute_cpu_spread_before_update": pfs,
                 "pick_compute_cpu_before_update_ms_per_rank": pfc,
                 "compute_spread_before_update": pfw,
                 "pick_compute_before_update_ms_per_rank": pfwc})
    line.update({"pick_measured_ms": pm, "even_measured_ms": em, "value": em / pm,
                 "measured": em / pm,
                 "compute_spread": ps, "pick_compute_ms_per_rank": pc,
                 "even_compute_spread": es, "even_compute_ms_per_rank": ec,
                 "compute_cpu_spread": psc, "pick_compute_cpu_ms_per_rank": pcc,
                 "even_compute_cpu_spread": esc, "even_compute_cpu_ms_per_rank": ecc})
    if uneven:
        um = 1e3 * batch / runs[2].summary["samples_per_s"]
        us, uc = compute_spread(runs[2])
        line.update({"uneven": uneven[1], "uneven_predicted_ms": uneven[0],
                     "uneven_measured_ms": um, "uneven_speedup_measured": em / um,
                     "uneven_speedup_predicted": even[0] / uneven[0],
                     "uneven_compute_spread": us, "uneven_compute_ms_per_rank": uc})
    ctx.emit(line)


def run(ctx):
    ctx.add_context(transport_context(distributed=True))
    exe = ctx.ensure_built("meshtrain")
    quick = ctx.quick
    only = {n for n in ctx.args.only.split(",") if n}

    # --- This machine's cluster file.
    if ctx.args.cluster:
        cluster2 = REPO / ctx.args.cluster
    else:
        cluster2 = ctx.workdir / "cluster.toml"
        cmd = [exe, "calibrate", "--nproc", "2", "--out", cluster2, "--quiet"]
        if quick:
            cmd.append("--quick")
        ctx.log("calibrating: " + " ".join(str(c) for c in cmd[1:]))
        r = ctx.run(cmd, env_extra=meshtrain.mpi_env(), name="calibrate", timeout_s=600)
        ctx.emit({"name": "plan_calibrate", "unit": "s", "value": round(r.wall_s, 2),
                  **({} if r.ok else {"error": f"calibrate: {r.failure()}"})})
        if not r.ok:
            return
    text = cluster2.read_text()
    if ctx.args.save_cluster:
        (REPO / ctx.args.save_cluster).write_text(text)
    cluster4 = ctx.workdir / "cluster4.toml"
    text4, n = re.subn(r"(?m)^ranks_per_node = \d+", "ranks_per_node = 4", text)
    cluster4.write_text(text4)
    if n != 1:
        ctx.log("the cluster file has no single `ranks_per_node =` line: 4-rank plans will fail")
    m = re.search(r"(?m)^peak_tflops_f32 = ([0-9.]+)", text)
    ctx.add_context({"cluster_peak_gflops_f32": float(m.group(1)) * 1e3 if m else None})

    base = ["train.eval=false", "train.threads=1", 'train.checkpoint=""']
    results = []
    for name, model, nproc, sets in PLANS:
        if only and name not in only:
            continue
        steps = ctx.args.steps or ((12 if quick else 30) if model == "mlp" else (6 if quick else 12))
        config = meshtrain.config_path(model)
        batch = meshtrain.peer_setup(model, 16)["batch"]
        line = {"name": f"plan_{name}", "unit": "ms", "model": model, "nproc": nproc,
                "plan_sets": sets, "steps": steps, "batch": batch, "peer": None}
        all_sets = base + [f"dist.nproc={nproc}"] + sets
        line.update(simulate(ctx, exe, name, config, cluster4 if nproc == 4 else cluster2,
                             all_sets))
        # More ranks than cores: the calibrated file's `cores` makes the
        # model price each rank's kernels on its share of a core.
        line["cores"] = ctx.ncpu
        mt = meshtrain.train(ctx, model, steps, 1, nproc=nproc, sets=sets,
                             name=f"train-{name}")
        if mt.error:
            line["error"] = "; ".join(e for e in (line.get("error"), mt.error) if e)
        else:
            line.update(measured(mt, batch))
        line["value"] = line.get("measured_step_ms")
        line["step_rel_err"] = rel(line.get("predicted_step_ms"), line.get("measured_step_ms"))
        line["step_rel_err_fast"] = rel(line.get("predicted_step_ms"),
                                        line.get("measured_fast_step_ms"))
        per_prog = line.get("predicted_peak_mib_per_program") or []
        line["predicted_peak_mib_rank0"] = next((p for r, p in per_prog if r == 0), None)
        line["mem_rel_err"] = rel(line["predicted_peak_mib_rank0"], line.get("measured_peak_mib"))
        ctx.emit(line)
        results.append(line)

    # --- The search's first plan, measured, against the fastest measured.
    if not only:
        plan_file = ctx.workdir / "best-gpt.json"
        cfg = meshtrain.config_path("gpt")
        cmd = [exe, "plan", "--config", cfg, "--cluster", cluster2, "--nproc", "2", "--top",
               "5", "--out", plan_file, "--quiet"]
        for kv in base:
            cmd += ["--set", kv]
        r = ctx.run(cmd, name="plan-gpt", timeout_s=300)
        line = {"name": "plan_search_first", "unit": "ratio", "model": "gpt", "nproc": 2,
                "peer": None}
        if not r.ok:
            line["error"] = f"plan: {r.failure()}"
        else:
            rows = [ln.strip() for ln in r.stdout.splitlines() if re.match(r"^\s*\d+\s+[0-9.]+ (ms|s)", ln)]
            line["search_top"] = rows[:5]
            m = re.search(r"--plan \S+((?: --set \S+)*)", r.stdout)
            extra = re.findall(r"--set (\S+)", m.group(1)) if m else []
            extra = [kv for kv in extra if not kv.startswith("dist.nproc=")]
            line["first_plan"] = json.loads(plan_file.read_text()) if plan_file.exists() else None
            line.update({f"first_{k}": v for k, v in
                         simulate(ctx, exe, "search-first", cfg, cluster2, base + extra,
                                  plan_file).items()})
            batch = meshtrain.peer_setup("gpt", 16)["batch"]
            mt = meshtrain.train(ctx, "gpt", ctx.args.steps or (6 if quick else 12), 1, nproc=2,
                                 sets=extra, name="train-search-first",
                                 extra_args=["--plan", plan_file])
            gpt2 = [x for x in results if x["model"] == "gpt" and x["nproc"] == 2
                    and x.get("measured_step_ms") and "slow12" not in x["name"]]
            if mt.error:
                line["error"] = mt.error
            elif not gpt2:
                line["error"] = "no even 2-rank GPT plan was measured"
            else:
                first = 1e3 * batch / mt.summary["samples_per_s"]
                fastest = min(gpt2, key=lambda x: x["measured_step_ms"])
                # The pair again, interleaved (first, fastest, first, ...),
                # so that both see the same machine: the plan lines ran
                # minutes apart, and on a shared machine two runs of one
                # plan differ by more than the 5% this checks (the quiet
                # run of 2026-12-02: the first plan, dp=2 ZeRO-2, measured
                # 142.0 ms, its own plan line 130.8 ms).
                firsts, fasts, loads = [first], [], [load1()]
                for k in range(ctx.args.pair_rounds):
                    if k > 0:
                        r1 = meshtrain.train(ctx, "gpt", ctx.args.steps or (6 if quick else 12),
                                             1, nproc=2, sets=extra,
                                             name=f"train-search-first-{k}",
                                             extra_args=["--plan", plan_file])
                        if r1.error:
                            break
                        firsts.append(1e3 * batch / r1.summary["samples_per_s"])
                    r2 = meshtrain.train(ctx, "gpt", ctx.args.steps or (6 if quick else 12), 1,
                                         nproc=2, sets=fastest["plan_sets"],
                                         name=f"train-search-fastest-{k}")
                    if r2.error:
                        break
                    fasts.append(1e3 * batch / r2.summary["samples_per_s"])
                    loads.append(load1())
                line.update({"first_measured_step_ms": first,
                             "fastest_measured": fastest["name"],
                             "fastest_measured_step_ms": fastest["measured_step_ms"],
                             "unpaired": first / fastest["measured_step_ms"],
                             "first_measured_step_ms_paired": firsts,
                             "fastest_measured_step_ms_paired": fasts,
                             "load_paired": loads,
                             "goal": 1.05})
                if fasts and len(firsts) >= len(fasts):
                    line["value"] = (statistics.median(firsts[:len(fasts)])
                                     / statistics.median(fasts))
                else:
                    line["value"] = line["unpaired"]
                    line["note"] = "the interleaved pair did not run: value is unpaired"
        ctx.emit(line)

    # --- Heterogeneous ranks: the planner's pick against the best even plan.
    # (`--only hetero` all four, `--only hetero_mlp_slow1123` one of them)
    for model, batch in HETERO_BATCH.items():
        for factors in ([1, 2], [1, 1, 2, 3]):
            one = f"hetero_{model}_slow{''.join(str(f) for f in factors)}"
            if not only or "hetero" in only or one in only:
                hetero(ctx, exe, model, factors, cluster2 if len(factors) == 2 else cluster4,
                       base, batch[len(factors)])

    # --- Uneven against even under dist.slowdown = [1, 2]: speedups.
    by = {x["name"]: x for x in results}
    for uneven, even in (("mlp_dp2_slow12_shares21", "mlp_dp2_slow12_even"),
                         ("gpt_tp2_slow12_ratios21", "gpt_tp2_slow12_even"),
                         ("gpt_pp2_1f1b_slow12_layers31", "gpt_pp2_1f1b_slow12_even")):
        u, e = by.get(f"plan_{uneven}"), by.get(f"plan_{even}")
        if not u or not e:
            continue
        line = {"name": f"plan_uneven_speedup_{uneven}", "unit": "ratio", "peer": None,
                "even": even, "goal": 1.3,
                "predicted": rel(e.get("predicted_step_ms"), u.get("predicted_step_ms")),
                "measured": rel(e.get("measured_step_ms"), u.get("measured_step_ms")),
                "measured_fast": rel(e.get("measured_fast_step_ms"),
                                     u.get("measured_fast_step_ms"))}
        for k in ("predicted", "measured", "measured_fast"):
            if line[k] is not None:
                line[k] += 1.0  # rel() is (a - b) / b; the speedup is a / b
        line["value"] = line["measured"]
        if u.get("error") or e.get("error"):
            line["error"] = "a plan of the pair failed (its line says why)"
        ctx.emit(line)

    ok_f = [abs(x["step_rel_err_fast"]) for x in results
            if x.get("step_rel_err_fast") is not None]
    ok_t = [abs(x["step_rel_err"]) for x in results if x.get("step_rel_err") is not None]
    ok_m = [abs(x["mem_rel_err"]) for x in results if x.get("mem_rel_err") is not None]
    ctx.emit({
        "name": "plan_summary", "unit": "relative error", "peer": None,
        "plans": len(results), "plans_failed": sum(1 for x in results if x.get("error")),
        "median_abs_step_rel_err": statistics.median(ok_t) if ok_t else None,
        "median_abs_mem_rel_err": statistics.median(ok_m) if ok_m else None,
        "step_within_10pct": sum(1 for e in ok_t if e <= 0.10),
        "median_abs_step_rel_err_fast": statistics.median(ok_f) if ok_f else None,
        "mem_within_5pct": sum(1 for e in ok_m if e <= 0.05),
        "goal_step": 0.10, "goal_mem": 0.05,
        "value": statistics.median(ok_t) if ok_t else None,
    })
