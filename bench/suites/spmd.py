"""SPMD plans, 2 processes x 1 thread: tensor parallelism against PyTorch's own
and against meshtrain's data parallelism, and uneven shards on unequal devices.

Lines (GPT = configs/gpt_text.toml, the core benchmark's GPT; gpt_medium =
configs/gpt_medium.toml, GPT-2-small sized):
  gpt_tp2_throughput          tokens/s, meshtrain [parallel] tp=2 vs PyTorch
                              tensor parallelism (ColwiseParallel / RowwiseParallel
                              on each block, gloo), same model, global batch,
                              threads; ratio = meshtrain / peer
  gpt_tp2_sp_throughput       the same with sequence parallelism on meshtrain's
                              side (the peer as above)
  gpt_medium_tp2_vs_dp2       value = meshtrain TP=2 tokens/s / meshtrain DP=2
                              tokens/s on gpt_medium (goal >= 0.9)
  gpt_medium_tp2_state_per_rank  value = per-rank parameter + gradient + optimizer
                              bytes (allocator counters) under TP=2 / under DP=2
                              (goal <= 0.55)
  gpt_tp2_uneven_speedup      with dist.slowdown = [1, 2]: TP=2 with tp_ratios
                              [2, 1] tokens/s / even TP=2 tokens/s (goal >= 1.3);
                              its 4 heads split 2:2 (whole heads), so also
  gpt_tp2_uneven_speedup_whole_heads, gpt_tp2_sp_uneven_speedup_whole_heads
                              the same on a GPT with d_model 384 and 6 heads
                              (4:2), without and with sequence parallelism;
                              each with the split share s of the step's
                              compute (against a 1-process run), the bound
                              (2 - s) / (2 - 4s/3) and the ranks' CPU-time
                              balance
  gpt_pp2_uneven_speedup      with dist.slowdown = [1, 2]: PP=2 1F1B with
                              stage_layers [3, 1] tokens/s / even [2, 2] (goal >= 1.3)
  gpt_pp2_1f1b_warmup_extra1, gpt_pp2_1f1b_recompute  meshtrain only: 1F1B with
                              one extra warm-up forward / with per-stage
                              recomputation: tokens/s, idle fraction (and plain
                              1F1B's), measured and planned peak stash
  gpt_pp2_<schedule>_throughput  tokens/s, meshtrain [parallel] pp=2, 4
                              micro-batches (interleaved: 2 chunks per rank) vs
                              PyTorch's torch.distributed.pipelining with the same
                              schedule (zero_bubble: PyTorch's interleaved
                              zero-bubble, 2 chunks per rank; zbv: both sides'
                              V-shaped zero-bubble, 2 chunks per rank); the line
                              carries the measured pipeline idle fraction and the
                              formula, the passes' CPU / wall time (below 1: the
                              cores were shared) and the runtime's overhead;
                              GPipe and 1F1B also pipeline_idle_split
                              (bench/lib/pipeline_idle.py: overhead, bubble,
                              in flight, edges, and idle_replay: the formula
                              with the measured stage times)
Every meshtrain line carries the tensor groups' bytes per step as counted and
as the lowering predicts, and peak RSS per rank.
"""

import socket

import meshtrain
import pipeline_idle
from common import PEERS, REPO, meshtrain_engine_context, ratio, thread_env, transport_context

WORLD = 2


def add_args(p):
    p.add_argument("--steps", type=int, default=0,
                   help="timed steps (0: 20 for gpt, 4 for gpt_medium; --quick: fewer)")
    p.add_argument("--no-peer", action="store_true", help="skip PyTorch (meshtrain lines only)")
    p.add_argument("--only", default="",
                   help="comma-separated groups: tp, pp, pp_options, hetero, medium (default: all)")
    p.add_argument("--schedules", default="",
                   help="pp group: comma-separated schedules to run (default: all six)")


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peer_tp(ctx, steps, warmup, setup_args):
    """PyTorch tensor parallelism on WORLD ranks; returns (rank 0's result, error)."""
    py = ctx.torch_python()
    env = thread_env(1)
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                "WORLD_SIZE": str(WORLD)})
    started = []
    for rank in range(WORLD):
        started.append(ctx.start([py, PEERS / "torch_train.py", "--model", "gpt", "--threads", "1",
                                  "--steps", str(steps), "--warmup", str(warmup),
                                  "--world", str(WORLD), "--rank", str(rank), "--tp", str(WORLD),
                                  *setup_args],
                                 dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                                 f"torch-tp-r{rank}", wait_idle=rank == 0))
    results = ctx.finish(started)
    bad = [r for r in results if not r.ok]
    if bad:
        return None, "; ".join(r.failure() for r in bad)
    lines = [r.json_lines() for r in results]
    if not all(lines):
        return None, "a tensor-parallel rank printed no result line"
    return dict(lines[0][-1], max_rank_rss_kib=max(r.maxrss_kib for r in results)), None


def peer_pipe(ctx, schedule, steps, warmup, batch, model):
    """PyTorch pipelining on WORLD ranks; returns (rank 0's tokens/s, error)."""
    py = ctx.torch_python()
    env = thread_env(1)
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                "WORLD_SIZE": str(WORLD)})
    args = ["--schedule", schedule, "--microbatches", "4", "--steps", str(steps), "--warmup",
            str(warmup), "--batch", str(batch), "--world", str(WORLD)]
    for key, flag in (("layers", "--layers"), ("d_model", "--d-model"), ("heads", "--heads"),
                      ("seq_len", "--seq")):
        if key in model:
            args += [flag, str(model[key])]
    started = [ctx.start([py, PEERS / "torch_pipe.py", "--rank", str(r), *args],
                         dict(env, RANK=str(r), LOCAL_RANK=str(r)), f"torch-pp-{schedule}-r{r}",
                         wait_idle=r == 0) for r in range(WORLD)]
    results = ctx.finish(started)
    bad = [r for r in results if not r.ok]
    if bad:
        return None, "; ".join(r.failure() for r in bad)
    lines = [r.json_lines() for r in results]
    if not all(lines):
        return None, "a pipeline rank printed no result line"
    return lines[0][-1]["tokens_per_s"], None


def tokens_per_s(run):
    return run.get("tokens_per_s") if run.summary else None


def rank_cpu(run):
    """Each rank's kernels' CPU time x slowdown per step (the summary's ranks), or []."""
    ranks = (run.summary or {}).get("ranks") or []
    return [round(r["compute_cpu_s_per_step"], 4) for r in ranks if "compute_cpu_s_per_step" in r]


def plan_fields(run):
    """Bytes per step and memory per rank from a meshtrain summary."""
    if not run.summary:
        return {}
    s = run.summary
    out = {}
    plan = s.get("plan") or {}
    if plan:
        out["mesh"] = plan.get("mesh")
        out["tensor_bytes_per_step"] = plan.get("tensor_bytes_sent_per_step")
        out["tensor_bytes_per_step_predicted"] = plan.get("tensor_bytes_sent_per_step_predicted")
    ranks = s.get("ranks") or []
    out["peak_rss_mib_per_rank"] = [round(r["peak_rss_bytes"] / 2**20, 1) for r in ranks]
    out["state_mib_per_rank"] = [round(state_bytes(r) / 2**20, 2) for r in ranks]
    out["planned_arena_mib"] = round(s.get("planned_arena_bytes", 0) / 2**20, 2)
    return out


def state_bytes(rank_line):
    """Parameters + gradients + optimizer state live on a rank (allocator counters)."""
    live = rank_line.get("mem_live_bytes", {})
    return sum(live.get(k, 0) for k in ("params", "grads", "optimizer"))


def run(ctx):
    ctx.add_context(transport_context(distributed=True))
    quick = ctx.quick
    gpt_steps = ctx.args.steps or (6 if quick else 20)
    med_steps = ctx.args.steps or (2 if quick else 4)
    warmup = 2 if quick else 5
    med_warmup = 2
    setup = meshtrain.peer_setup("gpt", 16)
    seq = setup["seq"]
    tp2 = ["parallel.tp=2"]
    only = {g for g in ctx.args.only.split(",") if g}
    version = "?"
    if not only or "tp" in only:
        version = run_tp(ctx, gpt_steps, warmup, setup, seq, tp2)
    idle = {}
    if not only or "pp" in only:
        run_pp(ctx, gpt_steps, warmup, setup, version, idle)
    if not only or "pp_options" in only:
        run_pp_options(ctx, gpt_steps, warmup, idle)
    if not only or "hetero" in only:
        run_hetero(ctx, gpt_steps, warmup, tp2)
    if not only or "medium" in only:
        run_medium(ctx, med_steps, med_warmup, tp2)


def run_tp(ctx, gpt_steps, warmup, setup, seq, tp2):
    """GPT: TP=2 (and SP) against PyTorch's tensor parallelism; returns the peer's version."""
    mt_tp = meshtrain.train(ctx, "gpt", gpt_steps + warmup, 1, nproc=WORLD, sets=tp2,
                            name="meshtrain-gpt-tp2")
    mt_sp = meshtrain.train(ctx, "gpt", gpt_steps + warmup, 1, nproc=WORLD,
                            sets=tp2 + ["parallel.sp=true"], name="meshtrain-gpt-tp2-sp")
    peer, perr = (None, "skipped (--no-peer)") if ctx.args.no_peer else peer_tp(
        ctx, gpt_steps, warmup, setup["args"])
    peer_rate = peer["samples_per_s"] * seq if peer else None
    version = (peer or {}).get("torch_version", "?")
    for name, run_ in (("gpt_tp2_throughput", mt_tp), ("gpt_tp2_sp_throughput", mt_sp)):
        rate = tokens_per_s(run_)
        line = {"name": name, "unit": "tokens/s", "meshtrain": rate, "peer": peer_rate,
                "ratio": ratio(rate, peer_rate),
                "peer_name": f"pytorch-{version} tensor parallel (Colwise/Rowwise) gloo eager",
                "model": "gpt", "processes": WORLD, "threads_per_process": 1,
                "batch": setup["batch"], "seq": seq, "steps": gpt_steps, "warmup": warmup,
                **plan_fields(run_), **meshtrain_engine_context(run_.summary)}
        if peer:
            line["peer_engines"] = peer.get("peer_engines")
            line["peer_max_rank_rss_mib"] = round(peer["max_rank_rss_kib"] / 1024.0, 1)
        line["note"] = ("meshtrain: vocabulary-split wte (vocabulary-parallel lookup and loss); "
                        "peer: embeddings and tied head replicated; both: every rank trains the "
                        "whole global batch; rank 0's median step after warm-up")
        err = "; ".join(e for e in (run_.error, f"peer: {perr}" if perr else None) if e)
        if err:
            line["error"] = err
        ctx.emit(line)
    return version


def run_pp(ctx, gpt_steps, warmup, setup, version, idle):
    """Pipelines: PP=2 under each schedule against PyTorch's pipelining."""
    cfg_gpt = meshtrain.config_path("gpt")
    import tomllib
    m = tomllib.loads(cfg_gpt.read_text()).get("model", {})
    pick = {x for x in ctx.args.schedules.split(",") if x}
    for schedule in ("gpipe", "1f1b", "interleaved", "zero_bubble", "zbv", "dualpipev"):
        if pick and schedule not in pick:
            continue
        sets = ["parallel.pp=2", "parallel.microbatches=4", f'parallel.schedule="{schedule}"']
        if schedule in ("interleaved", "zbv", "dualpipev"):
            sets.append("parallel.virtual_stages=2")
        # 1F1B's timeline, to split its idle time (bench/lib/pipeline_idle.py).
        trace = ctx.workdir / f"meshtrain-gpt-pp2-{schedule}.trace.json"
        traced = schedule in ("gpipe", "1f1b")
        run_ = meshtrain.train(ctx, "gpt", gpt_steps + warmup, 1, nproc=WORLD, sets=sets,
                               name=f"meshtrain-gpt-pp2-{schedule}",
                               extra_args=["--trace", trace] if traced else [])
        split = None
        if traced and run_.summary and trace.exists():
            try:
                split = pipeline_idle.analyse(trace, skip=warmup)
            except (OSError, ValueError, KeyError) as e:
                ctx.log(f"pipeline idle split of {trace.name}: {e}")
        prate, perr2 = (None, "skipped (--no-peer)") if ctx.args.no_peer else peer_pipe(
            ctx, schedule, gpt_steps, warmup, setup["batch"], m)
        rate = tokens_per_s(run_)
        plan = (run_.summary or {}).get("plan", {})
        idle[schedule] = plan.get("pipeline_idle_fraction")
        line = {"name": f"gpt_pp2_{schedule}_throughput", "unit": "tokens/s", "meshtrain": rate,
                "peer": prate, "ratio": ratio(rate, prate),
                "peer_name": f"pytorch-{version} torch.distributed.pipelining gloo eager",
                "model": "gpt", "processes": WORLD, "threads_per_process": 1, "microbatches": 4,
                "schedule": schedule, "steps": gpt_steps, "warmup": warmup,
                "pipeline_idle_fraction": idle[schedule],
                "pipeline_idle_fraction_formula": plan.get("pipeline_idle_fraction_formula"),
                "pipeline_pass_cpu_over_wall": plan.get("pipeline_pass_cpu_over_wall"),
                "pipeline_overhead_fraction": plan.get("pipeline_overhead_fraction"),
                "pipeline_bytes_per_step": plan.get("pipeline_bytes_sent_per_step"),
                "pipeline_bytes_per_step_predicted":
                    plan.get("pipeline_bytes_sent_per_step_predicted"),
                "peak_stash_mib": round(plan.get("peak_stash_bytes", 0) / 2**20, 2),
                "pipeline_idle_split": split,
                **meshtrain_engine_context(run_.summary),
                "note": "peer: head untied (pipelining cannot tie across stages); zero_bubble "
                        "peer is PyTorch's interleaved zero-bubble (2 chunks per rank)"}
        err = "; ".join(e for e in (run_.error, f"peer: {perr2}" if perr2 else None) if e)
        if err:
            line["error"] = err
        ctx.emit(line)


def run_pp_options(ctx, gpt_steps, warmup, idle):
    """1F1B's options, meshtrain only."""
    # 1F1B's options, meshtrain only: one extra warm-up forward (hides the
    # transfer latency that 1F1B's lock-step at p = 2 pays twice per
    # micro-batch) and per-stage recomputation (keeps only what a stage
    # received), next to plain 1F1B's idle fraction and stash.
    for opt_name, opt_sets in (("warmup_extra1", ["parallel.warmup_extra=1"]),
                               ("recompute", ["parallel.recompute=true"])):
        run_ = meshtrain.train(ctx, "gpt", gpt_steps + warmup, 1, nproc=WORLD,
                               sets=["parallel.pp=2", "parallel.microbatches=4",
                                     'parallel.schedule="1f1b"', *opt_sets],
                               name=f"meshtrain-gpt-pp2-1f1b-{opt_name}")
        plan = (run_.summary or {}).get("plan", {})
        line = {"name": f"gpt_pp2_1f1b_{opt_name}", "unit": "tokens/s", "system": "meshtrain",
                "value": tokens_per_s(run_), "option": opt_sets[0],
                "pipeline_idle_fraction": plan.get("pipeline_idle_fraction"),
                "pipeline_idle_fraction_1f1b": idle.get("1f1b"),
                "pipeline_idle_fraction_formula": plan.get("pipeline_idle_fraction_formula"),
                "pipeline_pass_cpu_over_wall": plan.get("pipeline_pass_cpu_over_wall"),
                "peak_stash_mib": round(plan.get("peak_stash_bytes", 0) / 2**20, 2),
                "planned_peak_stash_mib": round(plan.get("planned_peak_stash_bytes", 0) / 2**20, 2),
                "model": "gpt", "processes": WORLD, "microbatches": 4,
                **meshtrain_engine_context(run_.summary)}
        if run_.error:
            line["error"] = run_.error
        ctx.emit(line)
    if idle.get("zero_bubble") is not None and idle.get("1f1b") is not None:
        ctx.emit({"name": "gpt_pp2_zero_bubble_idle_vs_1f1b", "unit": "fraction",
                  "system": "meshtrain", "value": idle["zero_bubble"],
                  "idle_1f1b": idle["1f1b"], "goal": "below 1f1b's"})


def run_hetero(ctx, gpt_steps, warmup, tp2):
    """Heterogeneous ranks (dist.slowdown [1, 2]): uneven TP and PP against even."""
    # --- Heterogeneous: rank 1 half as fast; uneven 2:1 heads / columns vs even.
    # The core GPT's 4 heads cannot split 2:1 (whole heads, boundaries rounded
    # down: 2:2), so attention stays even there; a GPT with 6 heads (d_model
    # 384, as real GPT sizes have head counts that 2:1 divides) gets 4:2.
    # Each line also carries the ranks' compute in CPU time x slowdown (each
    # rank as if on a core of its own: the balance, whatever the load) and
    # the split share s of the step's compute, measured against a
    # one-process run of the same model: s = 2 (1 - T_tp2 / T_1).
    slow = ["dist.slowdown=[1,2]"]
    single = meshtrain.train(ctx, "gpt", gpt_steps + warmup, 1, sets=[],
                             name="meshtrain-gpt-1proc")
    wide = ["model.d_model=384", "model.heads=6"]
    single_wide = meshtrain.train(ctx, "gpt", gpt_steps + warmup, 1, sets=wide,
                                  name="meshtrain-gpt384h6-1proc")
    hetero = [("gpt_tp2_uneven_speedup", "gpt", [], [], single,
               "4 heads split 2:2 by whole heads (attention even), MLP columns 2:1"),
              ("gpt_tp2_uneven_speedup_whole_heads", "gpt384h6", wide, [], single_wide,
               "d_model 384, 6 heads: heads 4:2, MLP columns 1024:512"),
              ("gpt_tp2_sp_uneven_speedup_whole_heads", "gpt384h6", wide, ["parallel.sp=true"],
               single_wide, "as above with sequence parallelism on both sides")]
    for name, label, model_sets, extra, one, split in hetero:
        even = meshtrain.train(ctx, "gpt", gpt_steps + warmup, 1, nproc=WORLD,
                               sets=model_sets + tp2 + extra + slow,
                               name=f"meshtrain-{label}-tp2-slow-even{'-sp' if extra else ''}")
        uneven = meshtrain.train(ctx, "gpt", gpt_steps + warmup, 1, nproc=WORLD,
                                 sets=model_sets + tp2 + extra + slow +
                                 ["parallel.tp_ratios=[2,1]"],
                                 name=f"meshtrain-{label}-tp2-slow-2to1{'-sp' if extra else ''}")
        even_cpu, uneven_cpu = rank_cpu(even), rank_cpu(uneven)
        one_cpu = rank_cpu(one)
        # T_tp2: the even plan's per-rank compute without the slowdown (rank 0's).
        s = (2.0 * (1.0 - even_cpu[0] / one_cpu[0])
             if even_cpu and one_cpu and one_cpu[0] > 0 else None)
        line = {"name": name, "unit": "x", "system": "meshtrain",
                "value": ratio(tokens_per_s(uneven), tokens_per_s(even)),
                "tokens_per_s_even": tokens_per_s(even), "tokens_per_s_2to1": tokens_per_s(uneven),
                "slowdown": [1, 2], "goal": ">= 1.3", "model": label, "processes": WORLD,
                "model_sets": model_sets + extra, "split": split,
                "compute_cpu_s_per_step_even": even_cpu,
                "compute_cpu_s_per_step_2to1": uneven_cpu,
                "compute_cpu_s_per_step_1proc": one_cpu,
                "cpu_balance_speedup": (round(max(even_cpu) / max(uneven_cpu), 3)
                                        if even_cpu and uneven_cpu else None),
                "split_share_s": round(s, 3) if s is not None else None,
                "bound_2to1": (round((2 - s) / (2 - 4 * s / 3), 3) if s is not None else None),
                "note": "dist.slowdown stretches each rank's kernels by its factor (emulated "
                        "unequal devices); tp_ratios 2:1 gives rank 0 two thirds of the heads and "
                        "columns where whole heads allow; compute_cpu: kernels' thread CPU time x "
                        "slowdown per rank and step (cpu_balance_speedup: the slowest rank's, "
                        "even over 2:1); split_share_s from the 1-process run's kernel CPU time; "
                        "bound_2to1 = (2 - s) / (2 - 4s/3), communication left out"}
        err = "; ".join(e for e in (even.error, uneven.error, one.error) if e)
        if err:
            line["error"] = err
        ctx.emit(line)

    slow = ["dist.slowdown=[1,2]"]
    pp = ["parallel.pp=2", "parallel.microbatches=4", 'parallel.schedule="1f1b"']
    pp_even = meshtrain.train(ctx, "gpt", gpt_steps + warmup, 1, nproc=WORLD,
                              sets=pp + slow + ["parallel.stage_layers=[2,2]"],
                              name="meshtrain-gpt-pp2-slow-even")
    pp_uneven = meshtrain.train(ctx, "gpt", gpt_steps + warmup, 1, nproc=WORLD,
                                sets=pp + slow + ["parallel.stage_layers=[3,1]"],
                                name="meshtrain-gpt-pp2-slow-3to1")
    line = {"name": "gpt_pp2_uneven_speedup", "unit": "x", "system": "meshtrain",
            "value": ratio(tokens_per_s(pp_uneven), tokens_per_s(pp_even)),
            "tokens_per_s_even": tokens_per_s(pp_even),
            "tokens_per_s_3to1": tokens_per_s(pp_uneven), "slowdown": [1, 2], "goal": ">= 1.3",
            "model": "gpt", "processes": WORLD,
            "note": "stage_layers [3, 1] gives the fast rank 3 of the 4 blocks (the last stage "
                    "also holds the final norm, the head and the loss)"}
    err = "; ".join(e for e in (pp_even.error, pp_uneven.error) if e)
    if err:
        line["error"] = err
    ctx.emit(line)


def run_medium(ctx, med_steps, med_warmup, tp2):
    """gpt_medium: TP=2 against DP=2 (throughput and model state per rank)."""
    cfg = REPO / "configs" / "gpt_medium.toml"
    med = ["train.threads=1"]
    dp = meshtrain.train(ctx, "gpt", med_steps + med_warmup, 1, nproc=WORLD, config=cfg,
                         sets=med, name="meshtrain-gpt_medium-dp2")
    tp = meshtrain.train(ctx, "gpt", med_steps + med_warmup, 1, nproc=WORLD, config=cfg,
                         sets=med + tp2, name="meshtrain-gpt_medium-tp2")
    line = {"name": "gpt_medium_tp2_vs_dp2", "unit": "x", "system": "meshtrain",
            "value": ratio(tokens_per_s(tp), tokens_per_s(dp)),
            "tokens_per_s_tp2": tokens_per_s(tp), "tokens_per_s_dp2": tokens_per_s(dp),
            "goal": ">= 0.9", "model": "gpt_medium", "processes": WORLD,
            "threads_per_process": 1, "steps": med_steps, "warmup": med_warmup,
            "tp2": plan_fields(tp), "dp2": plan_fields(dp),
            "note": "short runs (each step is ~1 TFLOP): median of the steps after warm-up"}
    err = "; ".join(e for e in (tp.error, dp.error) if e)
    if err:
        line["error"] = err
    ctx.emit(line)
    tp_state = [state_bytes(r) for r in (tp.summary or {}).get("ranks", [])]
    dp_state = [state_bytes(r) for r in (dp.summary or {}).get("ranks", [])]
    line = {"name": "gpt_medium_tp2_state_per_rank", "unit": "x", "system": "meshtrain",
            "value": ratio(max(tp_state), max(dp_state)) if tp_state and dp_state else None,
            "tp2_state_mib_per_rank": [round(b / 2**20, 1) for b in tp_state],
            "dp2_state_mib_per_rank": [round(b / 2**20, 1) for b in dp_state],
            "goal": "<= 0.55", "model": "gpt_medium",
            "note": "parameters + gradients + optimizer state live at the end of the run, "
                    "from each rank's allocator counters (largest rank)"}
    if err:
        line["error"] = err
    ctx.emit(line)
