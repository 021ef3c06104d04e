"""How replicas agree, on the CNN and 4 ranks: every scheme and codec under three emulated networks, a slowed rank, PyTorch's DDP hooks, the unified DP / ZeRO-3 / PS table, the plot.

The budget (one figure = one `meshtrain train --nproc 4` run): the CNN of
configs/cnn_fashion.toml (conv32-conv64-fc128, SGD Nesterov 0.9, lr 0.05,
cosine over the run, 100 warm-up steps) on Fashion-MNIST, global batch 120
(so that 4 replicas and a parameter server's 3 workers split it evenly),
STEPS = 600 optimizer steps (1.2 epochs; --quick: 120), train.threads=1,
the whole test split evaluated every EVAL_EVERY = 50 steps (--quick: 40;
outside the step clock), checkpoints off. Time (estimates from runs under
load, not a measured full suite): about 45 min for everything but the 100
Mbit/s grid on a quiet 2-core machine; that grid alone takes over an hour,
its per-step latencies dominating (measured wall times of one run: dense
all-reduce 13 min at 1.17 s a step, DiLoCo H=50 2 min, local SGD H=8 5
min; PowerSGD rank 4 about 35 min at 3.5 s a step, top-k 1% about 18 min
at 1.8 s): `--networks free,1gbit` keeps the suite near 45 min. `--only` / `--runs` / `--networks` / `--steps` select.

Parts (--only, comma-separated; default all but `report`):

  grid     every scheme (dense gradients), every codec (on all-reduce; and
           top-k 1% compact with momentum correction, CODED_OPTIONS) and
           gossip with top-k 10% / 1% (GOSSIP_CODED) under each network of
           --networks:
             free      no emulation
             1gbit     every rank its own node, links 1 Gbit/s, 1 ms
             100mbit   ... 100 Mbit/s, 50 ms
           (a cluster file with node_size = 1 and [links.inter_node],
           docs/cluster.md: the delays are emulated in the transport)
  refused  every scheme x codec pair tried for one step: the pairs that
           meshtrain refuses before training are listed with its message
  slow     every scheme, no emulation, dist.slowdown = [1, 1, 3, 1] (rank 2
           computes 3x slower; under PS ranks 0-2 are the workers), no
           periodic evaluation (it would be a barrier for the asynchronous
           schemes): a fast worker's (rank 0's) examples per second, the
           median over steps after 10, against BSP's
  peers    PyTorch (bench/peers/torch_sync.py, gloo, the same CNN, data,
           batch, steps, optimizer and schedule): DDP, DDP with the fp16
           and PowerSGD (rank 4) communication hooks, post-local SGD
           (PeriodicModelAverager, period 8 after 100 synchronous steps),
           next to meshtrain's dense / f16 / powersgd:4 / local_sgd runs
  unified  plain DP, ZeRO-3, PS BSP and PS ASP (ASP with staleness-scaled
           learning rates) on the CNN (200 steps; --quick 120) and the GPT
           (configs/gpt_text.toml, batch 12, GPT_STEPS = 60 steps, --quick
           15; no gradient clipping, 10 warm-up steps, the first 10 test
           batches): throughput (global examples or tokens per second:
           steps x batch over rank 0's step times), peak RSS of the largest
           process (the ranks' ru_maxrss), bytes per step, final accuracy
  report   (with --from FILE...) the markdown tables and the plot from
           saved lines instead of running anything

Lines (name cnn_np4_<network>_<run>, unit "s to 88%"): meshtrain = the time
to 88% test accuracy (rank 0's step times summed up to the first evaluation
at or above TARGET; null if never), peer = dense all-reduce's on the same
network, ratio = peer / meshtrain (> 1: sooner). Also test_accuracy (the
last evaluation, the replicas' mean where they drift), accuracy_delta
(points against dense), bytes_per_rank_step (rank 0's synchronization
bytes per step: the communicator's counters, from the summary),
bytes_ratio (dense's / this: how many times fewer), train_s (rank 0's step
times), wall_s (the whole command), curve ([step, train seconds, bytes so
far = step x bytes per step, accuracy] per evaluation). A run that fails is
an error line; a pair meshtrain refuses is a line with "refused"; a run
that ends under 50% test accuracy (it did not learn) is an error line.
Goal lines (goal_*) check the figures against issue 11's goals;
goal_100mbit_5x also gives ratio_bounds, [dense's last evaluation under
88% / the best's first at or above it, dense's first at or above / the
best's last under]: where the true crossings lie, the evaluations being
EVAL_EVERY steps apart.
"""

import json
import os
import re
import socket
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
from common import PEERS, REPO, BenchError, mpi_env, thread_env  # noqa: E402

CONFIG = REPO / "configs" / "cnn_fashion.toml"
GPT_CONFIG = REPO / "configs" / "gpt_text.toml"
BATCH = 120
STEPS, QUICK_STEPS = 600, 120
EVAL_EVERY, QUICK_EVAL_EVERY = 50, 40
TARGET = 0.88
GPT_BATCH, GPT_STEPS, QUICK_GPT_STEPS = 12, 60, 15
SLOW = [1, 1, 3, 1]
# One run's limit: dense all-reduce over the 100 Mbit/s, 50 ms links takes
# about 1.1 s a step here (2.5 MB and 6 latencies per step), 600 steps 11 min.
RUN_TIMEOUT_S = 1800
UNIFIED_TIMEOUT_S = 240
PS = ["sync.servers=1"]

# Schemes, dense gradients.
SCHEMES = [
    ("dense", ['sync.scheme="allreduce"']),
    ("ps_bsp", ['sync.scheme="ps"', *PS, 'sync.ps_mode="bsp"']),
    ("ps_asp", ['sync.scheme="ps"', *PS, 'sync.ps_mode="asp"', "sync.staleness_lr=true"]),
    ("ps_ssp2", ['sync.scheme="ps"', *PS, 'sync.ps_mode="ssp"', "sync.staleness=2",
                 "sync.staleness_lr=true"]),
    ("dpsgd_ring", ['sync.scheme="gossip"', 'sync.topology="ring"']),
    ("adpsgd_ring", ['sync.scheme="adpsgd"', 'sync.topology="ring"']),
    ("local_sgd_h8", ['sync.scheme="local_sgd"', "sync.period=8", "sync.sync_until=100"]),
    ("diloco_h50_4bit", ['sync.scheme="diloco"', "sync.period=50", "sync.outer_bits=4"]),
    ("diloco_h50_4bit_rs", ['sync.scheme="diloco"', "sync.period=50", "sync.outer_bits=4",
                            'sync.outer_exchange="reduce_scatter"']),
    ("partial_p4", ['sync.scheme="partial"', "sync.period=4"]),
]
# Codecs on the all-reduce exchange (error feedback: the default, on).
CODECS = [
    ("f16", "f16"),
    ("bf16", "bf16"),
    ("topk1pct_ef", "topk:0.01"),
    # The same k in the compact wire format (bf16 values, Elias-Fano indices).
    ("topk1pct_ef_compact", "topk:0.01:compact"),
    ("randk1pct_ef", "randk:0.01"),
    ("qsgd4", "qsgd:4"),
    ("sign", "sign"),
    ("powersgd4", "powersgd:4"),
]
# Codecs under gossip (CHOCO-SGD: each replica sends the compression of its
# parameters' difference from its public copy, docs/sync.md "Compressed
# gossip"), with the consensus step sync.gossip_gamma that sparse codecs need.
# Codecs with options beyond the codec text: top-k 1% compact with Deep
# Gradient Compression's momentum correction and momentum factor masking
# (sync.codec_momentum: optim.momentum / optim.nesterov applied before the
# codec, the optimizer without momentum; docs/codecs.md).
CODED_OPTIONS = [
    ("topk1pct_ef_compact_dgc", ['sync.scheme="allreduce"', 'sync.codec="topk:0.01:compact"',
                                 "sync.codec_momentum=true"]),
    # Momentum correction without the masking.
    ("topk1pct_ef_compact_mc", ['sync.scheme="allreduce"', 'sync.codec="topk:0.01:compact"',
                                "sync.codec_momentum=true", "sync.codec_momentum_masking=false"]),
    # ... and DGC's sparsity warm-up: 100 steps from 4% down to 1% (its
    # bytes count: about 53x fewer than dense over the run instead of 65x).
    ("topk1pct_ef_compact_mc_wu", ['sync.scheme="allreduce"', 'sync.codec="topk:0.01:compact"',
                                   "sync.codec_momentum=true", "sync.codec_momentum_masking=false",
                                   "sync.codec_warmup_steps=100", "sync.codec_warmup_density=0.04"]),
    # PowerSGD rank 4 with every tensor's P in one all-reduce and every Q in
    # another (2 latencies a step instead of one or two per tensor).
    ("powersgd4_batched", ['sync.scheme="allreduce"', 'sync.codec="powersgd:4"',
                           "sync.powersgd_batched=true"]),
]
GOSSIP_CODED = [
    ("dpsgd_ring_topk10pct", ['sync.scheme="gossip"', 'sync.topology="ring"',
                              'sync.codec="topk:0.1"', "sync.gossip_gamma=0.5"]),
    ("dpsgd_ring_topk1pct", ['sync.scheme="gossip"', 'sync.topology="ring"',
                             'sync.codec="topk:0.01"', "sync.gossip_gamma=0.2"]),
]
NETWORKS = {"free": None, "1gbit": (1.0, 1.0), "100mbit": (0.1, 50.0)}
# PyTorch peers: (hook, torch_sync.py options, meshtrain run it sits next to).
PEER_RUNS = [
    ("none", [], "dense"),
    ("fp16", [], "f16"),
    ("powersgd", ["--powersgd-rank", "4"], "powersgd4"),
    ("postlocal", ["--period", "8", "--sync-until", "100"], "local_sgd_h8"),
]
UNIFIED = [
    ("dp", ['sync.scheme="allreduce"', "dist.zero_stage=0"]),
    ("zero3", ['sync.scheme="allreduce"', "dist.zero_stage=3"]),
    ("ps_bsp", ['sync.scheme="ps"', *PS, 'sync.ps_mode="bsp"']),
    ("ps_asp", ['sync.scheme="ps"', *PS, 'sync.ps_mode="asp"', "sync.staleness_lr=true"]),
]
PARTS = ("grid", "refused", "slow", "peers", "unified")


def all_runs():
    return ([n for n, _ in SCHEMES] + [n for n, _ in CODECS] + [n for n, _ in CODED_OPTIONS] +
            [n for n, _ in GOSSIP_CODED])


def run_sets(name):
    for n, sets in SCHEMES + CODED_OPTIONS + GOSSIP_CODED:
        if n == name:
            return sets
    for n, spec in CODECS:
        if n == name:
            return ['sync.scheme="allreduce"', f'sync.codec="{spec}"']
    raise BenchError(f"--runs: unknown run '{name}' (expected {', '.join(all_runs())})")


def add_args(p):
    p.add_argument("--only", default=",".join(PARTS),
                   help="comma-separated parts: " + ", ".join(PARTS) + ", report")
    p.add_argument("--runs", default=",".join(all_runs()),
                   help="comma-separated schemes / codecs of grid and slow: " + ",".join(all_runs()))
    p.add_argument("--networks", default=",".join(NETWORKS),
                   help="comma-separated networks of grid: " + ",".join(NETWORKS))
    p.add_argument("--steps", type=int, default=0, help="> 0: instead of the budget's steps")
    p.add_argument("--from", dest="from_files", nargs="*", default=[],
                   help="with --only report: JSON-lines files of earlier runs")
    p.add_argument("--plot", default=str(REPO / "bench" / "results" / "sync.png"),
                   help="where the plot goes (PNG; '' = no plot)")


# ---- running meshtrain -------------------------------------------------------------


def cluster_file(ctx, net):
    bw, lat = NETWORKS[net]
    path = ctx.workdir / f"cluster-{net}.toml"
    path.write_text(f"# bench/run sync: every rank its own node; {bw} Gbit/s, {lat} ms\n"
                    f"node_size = 1\n[links.inter_node]\nlatency_ms = {lat}\n"
                    f"bandwidth_gbit_s = {bw}\n")
    return path


def train(ctx, name, sets, steps, eval_every, config=CONFIG, batch=BATCH,
          timeout_s=None):
    """Runs meshtrain; returns dict(steps=[step lines], evals=[eval lines],
    summary=..., result=ChildResult) or dict(error=..., refused=...)."""
    exe = ctx.ensure_built("meshtrain")
    metrics = ctx.workdir / f"{name}.jsonl"
    metrics.unlink(missing_ok=True)
    cmd = [exe, "train", "--config", config, "--nproc", "4", "--quiet"]
    kvs = [f"train.steps={steps}", "train.eval=true", f"train.eval_every={eval_every}",
           "train.threads=1", f"train.batch_size={batch}", 'train.checkpoint=""',
           "train.log_every=1"]
    for kv in kvs + sets:
        cmd += ["--set", kv]
    cmd += ["--metrics", metrics]
    env = thread_env(1)
    env.update(mpi_env())
    ctx.log(f"{name}: {' '.join(str(c) for c in cmd[1:])}")
    timeout_s = timeout_s or RUN_TIMEOUT_S
    r = ctx.run(cmd, env, name, timeout_s=timeout_s)
    lines = []
    if metrics.exists():
        for text in metrics.read_text(errors="replace").splitlines():
            try:
                lines.append(json.loads(text))
            except json.JSONDecodeError:
                continue
    step_lines = [ln for ln in lines if "loss" in ln and "samples_per_s" in ln
                  and not ln.get("summary")]
    summary = [ln for ln in lines if ln.get("summary")]
    if r.timed_out and summary and len(step_lines) >= steps:
        # Every step and the summary written, then no exit (seen with the
        # GPT under a parameter server: the ranks' teardown waits in
        # MPI_Win_free): the figures, and an error that says so.
        evals = [ln for ln in lines if "test_accuracy" in ln and not ln.get("summary")]
        return {"steps": step_lines, "evals": evals, "summary": summary[-1], "result": r,
                "hang": f"meshtrain wrote its summary but did not exit within {timeout_s} s "
                        "(killed)"}
    if not r.ok:
        msg = f"meshtrain: {r.failure()}"
        # Refused before training: no step taken, meshtrain's message names
        # a key (docs/errors.md), e.g. "meshtrain: error: sync.codec = ...".
        m = re.search(r"meshtrain: error: ([a-z_]+\.[a-z_]+\b[^|\n]*)", r.stderr)
        if not step_lines and not r.timed_out and m:
            return {"refused": m.group(1).strip(), "result": r}
        return {"error": msg, "result": r}
    if len(step_lines) < steps or not summary:
        return {"error": f"meshtrain: {len(step_lines)} step lines of {steps}, "
                         f"{'a' if summary else 'no'} summary", "result": r}
    evals = [ln for ln in lines if "test_accuracy" in ln and not ln.get("summary")]
    return {"steps": step_lines, "evals": evals, "summary": summary[-1], "result": r}


def step_seconds(steps, batch):
    return [batch / s["samples_per_s"] for s in steps]  # the trainer's rate is batch / step time


def figures(got, batch=BATCH):
    """Time to TARGET, train seconds, accuracy, bytes per step, the curve."""
    dts = step_seconds(got["steps"], batch)
    cum = [0.0]
    for dt in dts:
        cum.append(cum[-1] + dt)
    sync = got["summary"].get("sync") or {}
    per_step = sync.get("bytes_sent_per_step")
    curve, reached = [], None
    for ev in got["evals"]:
        s = int(ev["step"])
        t = cum[min(s, len(cum) - 1)]
        curve.append([s, round(t, 3), None if per_step is None else round(s * per_step),
                      ev["test_accuracy"]])
        if reached is None and ev["test_accuracy"] >= TARGET:
            reached = t
    acc = got["summary"].get("test_accuracy")
    rates = sorted(1.0 / dt for dt in dts[10:]) or [1.0 / dts[-1]]
    return {"time_to_target_s": reached, "train_s": cum[-1], "test_accuracy": acc,
            "bytes_per_rank_step": per_step, "curve": curve,
            "steps_per_s": rates[len(rates) // 2],
            "consensus_relative": sync.get("consensus_relative"),
            "scheme_name": sync.get("scheme")}


# ---- parts -------------------------------------------------------------------------


def run_grid(ctx, runs, networks, steps, eval_every, results):
    for net in networks:
        cluster = [f'dist.cluster="{cluster_file(ctx, net)}"'] if NETWORKS[net] else []
        base = None
        # Dense first: the others' baseline (a run without it gets its
        # relative figures in `--only report` from a file that has it).
        for name in (["dense"] if "dense" in runs else []) + [r for r in runs if r != "dense"]:
            line = {"name": f"cnn_np4_{net}_{name}", "unit": "s to 88%", "model": "cnn",
                    "network": net, "run": name, "batch": BATCH, "steps": steps,
                    "eval_every": eval_every, "target_accuracy": TARGET,
                    "sets": run_sets(name) + cluster}
            got = train(ctx, f"sync-{net}-{name}", run_sets(name) + cluster, steps, eval_every)
            if "refused" in got:
                line["refused"] = got["refused"]
                ctx.emit(line)
                continue
            if "error" in got:
                line["error"] = got["error"]
                ctx.emit(line)
                continue
            f = figures(got)
            if got.get("hang"):
                line["error"] = got["hang"]
            line.update({"meshtrain": f["time_to_target_s"], **f,
                         "wall_s": got["result"].wall_s,
                         "others_cpu": got["result"].others_cpu})
            if f["test_accuracy"] is None or f["test_accuracy"] < 0.5:
                line["error"] = f"did not learn: test accuracy {f['test_accuracy']}"
            if name == "dense":
                base = f
            elif base:
                line.update({"peer": base["time_to_target_s"],
                             "peer_name": "meshtrain dense all-reduce (same network)",
                             "ratio": ratio_of(base["time_to_target_s"], f["time_to_target_s"]),
                             "accuracy_delta": pts(f["test_accuracy"], base["test_accuracy"]),
                             "bytes_ratio": ratio_of(base["bytes_per_rank_step"],
                                                     f["bytes_per_rank_step"])})
            results[(net, name)] = f
            ctx.emit(line)


def ratio_of(num, den):
    if num is None or den is None or den == 0:
        return None
    return num / den


def pts(a, b):
    return None if a is None or b is None else 100.0 * (a - b)


def run_refused(ctx, runs):
    """Every scheme x codec pair of --runs (a scheme with every codec when
    --runs names none), two steps each: refused or accepted."""
    table = {}
    codecs = [c for c in CODECS if c[0] in runs] or CODECS
    for scheme, ssets in SCHEMES:
        if scheme == "dense" or scheme not in runs:
            continue
        for codec, spec in codecs:
            sets = ssets + [f'sync.codec="{spec}"']
            got = train(ctx, f"sync-pair-{scheme}-{codec}", sets, 2, 0)
            state = ("refused" if "refused" in got else "error" if "error" in got
                     else "accepted")
            table[(scheme, codec)] = state
            line = {"name": f"cnn_np4_pair_{scheme}_{codec}", "unit": "state", "model": "cnn",
                    "scheme": scheme, "codec": spec, "state": state, "sets": sets}
            if state == "refused":
                line["refused"] = got["refused"]
            elif state == "error":
                line["error"] = got["error"]
            ctx.emit(line)
    return table


def run_slow(ctx, runs, steps):
    base = None
    for name in ["ps_bsp"] + [r for r in runs if r != "ps_bsp" and r in dict(SCHEMES)]:
        sets = run_sets(name) + [f"dist.slowdown={SLOW}"]
        workers = 3 if name.startswith("ps_") else 4
        line = {"name": f"cnn_np4_slow3_{name}_examples_per_s", "unit": "examples/s",
                "model": "cnn", "run": name, "slowdown": SLOW, "batch": BATCH, "steps": steps,
                "sets": sets}
        got = train(ctx, f"sync-slow-{name}", sets, steps, 0)
        if "error" in got or "refused" in got:
            line["error"] = got.get("error") or got.get("refused")
            ctx.emit(line)
            continue
        f = figures(got)
        # Rank 0 is a fast worker; each of its steps is its own share of the
        # global batch (a quarter, or a third under a parameter server).
        per_step = BATCH / workers
        rate = f["steps_per_s"] * per_step
        line.update({"meshtrain": rate, "rank0_steps_per_s": f["steps_per_s"],
                     "rank0_examples_per_step": per_step,
                     "test_accuracy": f["test_accuracy"], "train_s": f["train_s"],
                     "bytes_per_rank_step": f["bytes_per_rank_step"],
                     "wall_s": got["result"].wall_s, "others_cpu": got["result"].others_cpu})
        if f["test_accuracy"] is None or f["test_accuracy"] < 0.5:
            line["error"] = f"did not learn: test accuracy {f['test_accuracy']}"
        if name == "ps_bsp":
            base = (rate, f["test_accuracy"])
        elif base:
            line.update({"peer": base[0], "peer_name": "meshtrain PS BSP (same slowdown)",
                         "ratio": rate / base[0],
                         "accuracy_delta": pts(f["test_accuracy"], base[1])})
        ctx.emit(line)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torch_args():
    """torch_sync.py options from configs/cnn_fashion.toml's values."""
    return ["--model", "cnn", "--conv-channels", "32,64", "--fc", "128", "--lr", "0.05",
            "--momentum", "0.9", "--nesterov", "--weight-decay", "0.0005",
            "--schedule", "cosine", "--warmup-steps", "100"]


def run_peers(ctx, runs, steps, eval_every, results):
    py = ctx.torch_python()
    for hook, extra, ours in PEER_RUNS:
        if ours not in runs:
            continue
        line = {"name": f"cnn_np4_free_torch_{hook}", "unit": "s to 88%", "model": "cnn",
                "network": "free", "hook": hook, "meshtrain_run": ours, "batch": BATCH,
                "steps": steps, "eval_every": eval_every, "target_accuracy": TARGET}
        env = thread_env(1)
        env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
        started = [ctx.start([py, PEERS / "torch_sync.py", "--hook", hook, "--world", "4",
                              "--rank", str(r), "--steps", str(steps), "--eval-every",
                              str(eval_every), "--batch", str(BATCH), *torch_args(), *extra],
                             env, f"torch-sync-{hook}-r{r}", wait_idle=(r == 0))
                   for r in range(4)]
        rs = ctx.finish(started, RUN_TIMEOUT_S)
        r0 = rs[0]
        got = r0.json_lines()
        if not all(r.ok for r in rs) or not got:
            bad = next((r for r in rs if not r.ok), r0)
            line["error"] = f"torch_sync.py: {bad.failure()}"
            ctx.emit(line)
            continue
        p = got[-1]
        reached = next((e["train_s"] for e in p["evals"] if e["test_accuracy"] >= TARGET), None)
        sps = sorted(1.0 / dt for dt in p["step_s"][10:])
        rate = sps[len(sps) // 2] if sps else None
        mine = results.get(("free", ours))
        line.update({"peer": reached, "peer_name": f"pytorch-{p['torch_version']} DDP gloo "
                     f"hook={hook}", "peer_test_accuracy": p["test_accuracy"],
                     "peer_train_s": p["train_s"], "peer_steps_per_s": rate,
                     "peer_curve": [[e["step"], round(e["train_s"], 3), None,
                                     e["test_accuracy"]] for e in p["evals"]],
                     "peer_wall_s": r0.wall_s, "peer_others_cpu": r0.others_cpu})
        if mine:
            line.update({"meshtrain": mine["time_to_target_s"],
                         "ratio": ratio_of(reached, mine["time_to_target_s"]),
                         "test_accuracy": mine["test_accuracy"],
                         "steps_per_s": mine["steps_per_s"],
                         "speed_ratio": ratio_of(mine["steps_per_s"], rate),
                         "accuracy_delta": pts(mine["test_accuracy"], p["test_accuracy"])})
        else:
            line["note"] = f"meshtrain's {ours} (free network) was not run in this invocation"
        ctx.emit(line)


def run_unified(ctx, quick):
    for model, config, batch, steps in (
            ("cnn", CONFIG, BATCH, QUICK_STEPS if quick else 200),
            ("gpt", GPT_CONFIG, GPT_BATCH, QUICK_GPT_STEPS if quick else GPT_STEPS)):
        base = None
        for name, sets in UNIFIED:
            unit = "tokens/s" if model == "gpt" else "samples/s"
            line = {"name": f"{model}_np4_unified_{name}", "unit": unit, "model": model,
                    "run": name, "batch": batch, "steps": steps, "sets": sets}
            # (The GPT config clips the global gradient norm, which a
            # parameter server does not offer yet: off for all four runs;
            # 10 warm-up steps instead of 100 for the short run; the first
            # 10 test batches of 64 sequences evaluated.)
            extra = (["optim.clip_grad_norm=0", "optim.warmup_steps=10", "train.eval_batches=10"]
                     if model == "gpt" else [])
            got = train(ctx, f"sync-unified-{model}-{name}", sets + extra, steps, 0, config,
                        batch, timeout_s=UNIFIED_TIMEOUT_S // (2 if quick else 1))
            if "error" in got or "refused" in got:
                line["error"] = got.get("error") or got.get("refused")
                ctx.emit(line)
                continue
            s = got["summary"]
            f = figures(got, batch)
            seq = 1
            if model == "gpt":
                seq = next((st.get("tokens_per_s") / st["samples_per_s"] for st in got["steps"]
                            if st.get("tokens_per_s")), 1)
            # Global examples per second: steps x batch over rank 0's training
            # seconds (an asynchronous worker pushes batch / 3 per step, the
            # three together steps x batch, as the synchronous ones).
            thr = steps * batch * seq / f["train_s"]
            ranks = s.get("ranks") or []
            rss = [rk.get("peak_rss_bytes") for rk in ranks if isinstance(rk, dict)]
            line.update({"meshtrain": thr, "peak_rss_mib_largest_process":
                         round(got["result"].maxrss_kib / 1024.0, 1),
                         "peak_rss_mib_per_rank": [round(b / 2**20, 1) for b in rss if b],
                         "bytes_per_rank_step": f["bytes_per_rank_step"],
                         "test_accuracy": f["test_accuracy"], "final_loss": s.get("final_loss"),
                         "wall_s": got["result"].wall_s,
                         "others_cpu": got["result"].others_cpu})
            if got.get("hang"):
                line["error"] = got["hang"]
            if name == "dp":
                base = thr
            elif base:
                line.update({"peer": base, "peer_name": "meshtrain plain DP (same run)",
                             "ratio": thr / base})
            ctx.emit(line)


# ---- goals, tables, plot ---------------------------------------------------------


def by_name(lines):
    return {ln["name"]: ln for ln in lines if "name" in ln}


def goals(lines):
    """Goal lines from result lines (issue 11's goals)."""
    d = by_name(lines)
    out = []

    def grid(net, run):
        ln = d.get(f"cnn_np4_{net}_{run}")
        return ln if ln and not ln.get("error") and not ln.get("refused") else None

    def goal(name, met, **kw):
        out.append({"name": name, "unit": "goal", "met": met, **kw})

    # Top-k 1% with momentum correction (no masking) in the compact wire
    # format where it ran, else plain error feedback compact, else the
    # (index, value) pairs; the line names the run.
    dense = grid("free", "dense")
    topk_run = next((r for r in ("topk1pct_ef_compact_mc", "topk1pct_ef_compact", "topk1pct_ef")
                     if grid("free", r)), None)
    topk = grid("free", topk_run) if topk_run else None
    if dense and topk:
        dp, br = topk.get("accuracy_delta"), topk.get("bytes_ratio")
        goal("goal_topk1pct_ef", dp is not None and br is not None and dp >= -1 and br >= 50,
             run=topk_run, accuracy_delta=dp, bytes_ratio=br,
             wanted="within 1 point, >= 50x fewer bytes")
    psgd, peer = grid("free", "powersgd4"), d.get("cnn_np4_free_torch_powersgd")
    if dense and psgd:
        dp = psgd.get("accuracy_delta")
        sr = peer.get("speed_ratio") if peer and not peer.get("error") else None
        goal("goal_powersgd4", None if sr is None else (dp >= -1 and sr >= 1),
             accuracy_delta=dp, speed_ratio_vs_torch_powersgd=sr,
             wanted="within 1 point, steps/s >= PyTorch's PowerSGD hook's")
    dl = grid("free", "diloco_h50_4bit")
    if dense and dl:
        dp, br = dl.get("accuracy_delta"), dl.get("bytes_ratio")
        goal("goal_diloco_h50_4bit", dp is not None and br is not None and dp >= -1.5
             and br >= 200, accuracy_delta=dp, bytes_ratio=br,
             wanted="within 1.5 points, >= 200x fewer bytes over the run")
    slow = [ln for ln in lines if ln.get("name", "").startswith("cnn_np4_100mbit_")]
    base = grid("100mbit", "dense")
    if base:
        best = max((ln for ln in slow if ln.get("ratio") and not ln.get("error")),
                   key=lambda ln: ln["ratio"], default=None)
        # Each run's highest evaluation and when (rank 0's training
        # seconds): what a run that never reaches 88% got, and how fast.
        peaks = {}
        for ln in slow:
            if ln.get("curve") and not ln.get("error"):
                step, secs, _, acc = max(ln["curve"], key=lambda c: (c[3], -c[0]))
                peaks[ln["run"]] = {"best_accuracy": acc, "at_step": step, "at_s": secs,
                                    "time_to_target_s": ln.get("meshtrain")}
        others = [r for r in peaks if r != "dense"]
        if not best and others:
            goal("goal_100mbit_5x", False if base.get("meshtrain") else None, best=None,
                 dense_time_to_target_s=base.get("meshtrain"), runs=peaks,
                 eval_every=base.get("eval_every"),
                 note="no run but dense reached 88%: runs = each one's best evaluation",
                 wanted="the best scheme reaches 88% >= 5x sooner than dense all-reduce")
        if best:
            # The evaluations bracket each crossing: it lies after the last
            # evaluation under TARGET and at or before the first one at or
            # above it, so the true ratio lies between these bounds.
            lo = ratio_of(last_below(base), best.get("meshtrain"))
            hi = ratio_of(base.get("meshtrain"), last_below(best))
            goal("goal_100mbit_5x", best["ratio"] >= 5 if base.get("meshtrain") else None,
                 best=best["run"], ratio=best["ratio"], dense_time_to_target_s=base.get("meshtrain"),
                 best_time_to_target_s=best.get("meshtrain"), ratio_bounds=[lo, hi],
                 eval_every=base.get("eval_every"), runs=peaks,
                 wanted="the best scheme reaches 88% >= 5x sooner than dense all-reduce")
    for run in ("ps_asp", "ps_ssp2", "adpsgd_ring"):
        ln = d.get(f"cnn_np4_slow3_{run}_examples_per_s")
        if ln and ln.get("ratio") is not None and not ln.get("error"):
            goal(f"goal_slow3_{run}", ln["ratio"] >= 1.8, ratio=ln["ratio"],
                 accuracy_delta=ln.get("accuracy_delta"),
                 wanted=">= 1.8x BSP's examples/s of a fast worker, rank 2 slowed 3x")
    return out


def last_below(ln):
    """Training seconds at a grid line's last evaluation under TARGET
    before its first one at or above it (0 if the first already was)."""
    t = 0.0
    for _, secs, _, acc in ln.get("curve") or []:
        if acc >= TARGET:
            return t
        t = secs
    return None


def fill_relative(lines):
    """Relative figures a line could not have when its baseline ran in
    another invocation: grid lines against dense all-reduce on the same
    network, peer lines against meshtrain's run of their scheme."""
    d = by_name(lines)
    for ln in lines:
        if ln.get("error") or ln.get("refused"):
            continue
        net, run = ln.get("network"), ln.get("run")
        if net and run and run != "dense" and "hook" not in ln and ln.get("peer") is None:
            base = d.get(f"cnn_np4_{net}_dense")
            if base and not base.get("error"):
                ln.update({"peer": base.get("meshtrain"),
                           "peer_name": "meshtrain dense all-reduce (same network; "
                                        "another invocation)",
                           "ratio": ratio_of(base.get("meshtrain"), ln.get("meshtrain")),
                           "accuracy_delta": pts(ln.get("test_accuracy"),
                                                 base.get("test_accuracy")),
                           "bytes_ratio": ratio_of(base.get("bytes_per_rank_step"),
                                                   ln.get("bytes_per_rank_step"))})
        if "hook" in ln and ln.get("meshtrain") is None and ln.get("test_accuracy") is None:
            mine = d.get(f"cnn_np4_free_{ln.get('meshtrain_run')}")
            if mine and not mine.get("error"):
                ln.pop("note", None)
                ln.update({"meshtrain": mine.get("meshtrain"),
                           "ratio": ratio_of(ln.get("peer"), mine.get("meshtrain")),
                           "test_accuracy": mine.get("test_accuracy"),
                           "steps_per_s": mine.get("steps_per_s"),
                           "speed_ratio": ratio_of(mine.get("steps_per_s"),
                                                   ln.get("peer_steps_per_s")),
                           "accuracy_delta": pts(mine.get("test_accuracy"),
                                                 ln.get("peer_test_accuracy"))})
    return lines


def fmt(v, spec=".3g"):
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (int, float)):
        return format(v, spec)
    return str(v)


def markdown(lines):
    """The tables (markdown) of a set of lines."""
    out = []
    grid = [ln for ln in lines if ln.get("name", "").startswith("cnn_np4_")
            and ln.get("network") and "hook" not in ln]
    if grid:
        out += ["| network | run | test acc. % | Δ vs dense (pts) | bytes/rank/step | "
                "fewer bytes (x) | time to 88% (s) | sooner (x) | train s | wall s |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for ln in grid:
            if ln.get("refused") or ln.get("error"):
                why = "refused" if ln.get("refused") else "error"
                out.append(f"| {ln['network']} | {ln['run']} | {why}: "
                           f"{(ln.get('refused') or ln.get('error'))[:80]} |||||||")
                continue
            acc = ln.get("test_accuracy")
            out.append(f"| {ln['network']} | {ln['run']} | {fmt(acc and 100 * acc, '.2f')} | "
                       f"{fmt(ln.get('accuracy_delta'), '+.2f')} | "
                       f"{fmt(ln.get('bytes_per_rank_step'), '.4g')} | "
                       f"{fmt(ln.get('bytes_ratio'), '.1f')} | {fmt(ln.get('meshtrain'), '.1f')} | "
                       f"{fmt(ln.get('ratio'), '.2f')} | {fmt(ln.get('train_s'), '.1f')} | "
                       f"{fmt(ln.get('wall_s'), '.0f')} |")
    peers = [ln for ln in lines if "hook" in ln]
    if peers:
        out += ["", "| PyTorch peer | meshtrain run | torch acc. % | meshtrain acc. % | "
                "torch time to 88% (s) | meshtrain (s) | steps/s torch | meshtrain / torch steps/s |",
                "|---|---|---|---|---|---|---|---|"]
        for ln in peers:
            if ln.get("error"):
                out.append(f"| {ln['hook']} | {ln['meshtrain_run']} | error: {ln['error'][:80]} "
                           "||||||")
                continue
            pa, ma = ln.get("peer_test_accuracy"), ln.get("test_accuracy")
            out.append(f"| {ln['hook']} | {ln['meshtrain_run']} | {fmt(pa and 100 * pa, '.2f')} | "
                       f"{fmt(ma and 100 * ma, '.2f')} | {fmt(ln.get('peer'), '.1f')} | "
                       f"{fmt(ln.get('meshtrain'), '.1f')} | {fmt(ln.get('peer_steps_per_s'), '.3g')} | "
                       f"{fmt(ln.get('speed_ratio'), '.2f')} |")
    slow = [ln for ln in lines if ln.get("name", "").startswith("cnn_np4_slow3_")]
    if slow:
        out += ["", "| rank 2 slowed 3x | rank 0 examples/s | vs BSP (x) | test acc. % | "
                "Δ vs BSP (pts) |", "|---|---|---|---|---|"]
        for ln in slow:
            if ln.get("error"):
                out.append(f"| {ln['run']} | error: {ln['error'][:80]} ||||")
                continue
            acc = ln.get("test_accuracy")
            out.append(f"| {ln['run']} | {fmt(ln.get('meshtrain'), '.0f')} | "
                       f"{fmt(ln.get('ratio'), '.2f')} | {fmt(acc and 100 * acc, '.2f')} | "
                       f"{fmt(ln.get('accuracy_delta'), '+.2f')} |")
    uni = [ln for ln in lines if "_unified_" in ln.get("name", "")]
    if uni:
        out += ["", "| model | scheme | throughput | peak RSS, largest rank (MiB) | "
                "bytes/rank/step | test acc. % |", "|---|---|---|---|---|---|"]
        for ln in uni:
            if ln.get("error"):
                out.append(f"| {ln['model']} | {ln['run']} | error: {ln['error'][:80]} ||||")
                continue
            acc = ln.get("test_accuracy")
            out.append(f"| {ln['model']} | {ln['run']} | {fmt(ln.get('meshtrain'), '.0f')} "
                       f"{ln['unit']} | {fmt(ln.get('peak_rss_mib_largest_process'), '.0f')} | "
                       f"{fmt(ln.get('bytes_per_rank_step'), '.4g')} | "
                       f"{fmt(acc and 100 * acc, '.2f')} |")
    pairs = [ln for ln in lines if ln.get("name", "").startswith("cnn_np4_pair_")]
    if pairs:
        codecs = [c for c, _ in CODECS]
        states = {(ln["scheme"], ln["name"].rsplit("_", 1)[-1]): ln["state"] for ln in pairs}
        states = {}
        for ln in pairs:
            for c, spec in CODECS:
                if ln["codec"] == spec:
                    states[(ln["scheme"], c)] = ln["state"]
        out += ["", "| scheme \\ codec | " + " | ".join(codecs) + " |",
                "|---" * (len(codecs) + 1) + "|"]
        for s, _ in SCHEMES[1:]:
            out.append(f"| {s} | " + " | ".join(states.get((s, c), "-") for c in codecs) + " |")
    gl = [ln for ln in lines if ln.get("unit") == "goal"]
    if gl:
        out += ["", "| goal | met | figures |", "|---|---|---|"]
        for ln in gl:
            figs = ", ".join(f"{k} {fmt(v, '.3g')}" for k, v in ln.items()
                             if k not in ("name", "unit", "met", "wanted", "suite")
                             and not k.startswith("cpu_") and k != "loadavg_1m")
            out.append(f"| {ln['name']}: {ln.get('wanted')} | {fmt(ln.get('met'))} | {figs} |")
    return "\n".join(out)


DEBIAN_PYTHON = "/usr/bin/python3"


def plot(lines, path):
    """Accuracy against train time and against bytes, one line per run, one
    row per network. Needs matplotlib (Debian: python3-matplotlib); when the
    python running bench/run has none (a pyenv one), Debian's python3 draws
    it (this file run as a script)."""
    try:
        import matplotlib
    except ImportError:
        if Path(DEBIAN_PYTHON).exists() and Path(sys.executable).resolve() != \
                Path(DEBIAN_PYTHON).resolve():
            import subprocess
            import tempfile
            with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
                f.write("\n".join(json.dumps(ln) for ln in lines))
            r = subprocess.run([DEBIAN_PYTHON, __file__, "--plot", path, f.name],
                               capture_output=True, text=True)
            os.unlink(f.name)
            if r.returncode == 0:
                return path if r.stdout.strip() else None
            raise BenchError(f"the plot: {DEBIAN_PYTHON} {__file__} failed: "
                             f"{r.stderr.strip()[-400:]}")
        raise BenchError("the plot needs matplotlib: apt-get install python3-matplotlib "
                         "(Debian package), or --plot ''")
    return draw(lines, path)


def draw(lines, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    nets = [n for n in NETWORKS if any(ln.get("network") == n and ln.get("curve")
                                        for ln in lines)]
    if not nets:
        return None
    fig, axes = plt.subplots(len(nets), 2, figsize=(13, 4.2 * len(nets)), squeeze=False)
    for row, net in enumerate(nets):
        ax_t, ax_b = axes[row]
        for ln in lines:
            if ln.get("network") != net or not ln.get("curve") or "hook" in ln:
                continue
            c = ln["curve"]
            # The load the run saw: times on a shared machine move with it.
            label = f"{ln['run']} (load {ln.get('loadavg_1m', 0):.0f})"
            ax_t.plot([p[1] for p in c], [100 * p[3] for p in c], marker=".", label=label)
            if all(p[2] for p in c):
                ax_b.plot([p[2] for p in c], [100 * p[3] for p in c], marker=".", label=label)
        for ln in lines:
            if net == "free" and ln.get("peer_curve") and not ln.get("error"):
                c = ln["peer_curve"]
                ax_t.plot([p[1] for p in c], [100 * p[3] for p in c], linestyle="--",
                          label=f"torch {ln['hook']} (load {ln.get('loadavg_1m', 0):.0f})")
        for ax in (ax_t, ax_b):
            ax.axhline(100 * TARGET, color="grey", linewidth=0.6)
            ax.set_ylabel("test accuracy (%)")
            ax.set_ylim(60, 95)
            ax.grid(alpha=0.3)
        ax_t.set_xlabel("rank 0's training time (s)")
        ax_b.set_xlabel("bytes sent by rank 0 (step x mean bytes per step)")
        ax_b.set_xscale("log")
        ax_t.set_title(f"CNN, 4 ranks, network: {net}")
        ax_b.set_title(f"CNN, 4 ranks, network: {net}")
        ax_t.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def read_lines(files):
    out = []
    for f in files:
        for text in Path(f).read_text().splitlines():
            try:
                ln = json.loads(text)
            except json.JSONDecodeError:
                continue
            if ln.get("suite") == "sync" and ln.get("unit") != "goal":
                out.append(ln)
    return out


def run(ctx):
    parts = [p for p in ctx.args.only.split(",") if p]
    for p in parts:
        if p not in PARTS + ("report",):
            raise BenchError(f"--only: unknown part '{p}' (expected {', '.join(PARTS)}, report)")
    runs = [r for r in ctx.args.runs.split(",") if r]
    for r in runs:
        run_sets(r)
    networks = [n for n in ctx.args.networks.split(",") if n]
    for n in networks:
        if n not in NETWORKS:
            raise BenchError(f"--networks: unknown network '{n}' (expected {', '.join(NETWORKS)})")
    steps = ctx.args.steps or (QUICK_STEPS if ctx.quick else STEPS)
    eval_every = QUICK_EVAL_EVERY if ctx.quick else EVAL_EVERY
    if "report" in parts:
        lines = read_lines(ctx.args.from_files)
        if not lines:
            raise BenchError("--only report: no sync lines in --from files")
    else:
        results = {}
        if "grid" in parts:
            run_grid(ctx, runs, networks, steps, eval_every, results)
        if "peers" in parts:
            run_peers(ctx, runs, steps, eval_every, results)
        if "slow" in parts:
            run_slow(ctx, runs, steps)
        if "unified" in parts:
            run_unified(ctx, ctx.quick)
        if "refused" in parts:
            run_refused(ctx, runs)
        lines = list(ctx.lines)
    fill_relative(lines)
    for g in goals(lines):
        ctx.emit(g)
    print("\n" + markdown(lines + [g for g in ctx.lines if g.get("unit") == "goal"]) + "\n",
          file=sys.stderr)
    if ctx.args.plot:
        where = plot(lines, ctx.args.plot)
        if where:
            ctx.log(f"plot: {where}")


if __name__ == "__main__":
    # sync.py --plot OUT.png FILE...: the plot from saved lines (see plot()).
    if len(sys.argv) < 4 or sys.argv[1] != "--plot":
        sys.exit("usage: sync.py --plot OUT.png LINES.jsonl... (bench/run sync runs the suite)")
    got = draw(read_lines(sys.argv[3:]), sys.argv[2])
    print(got or "")
