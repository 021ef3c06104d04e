"""Synchronization schemes with one slow rank: the parameter server's BSP /
ASP / SSP against synchronous all-reduce, 4 ranks.

`meshtrain train --nproc 4` of the MLP of configs/mlp_fashion.toml
(train.threads=1, global batch 120 so that 3 workers and 4 replicas split it
evenly, evaluation and checkpoints off) with dist.slowdown = [1, 1, 3, 1]:
rank 2 computes 3x slower (docs/sync.md). Runs:

  allreduce   4 replicas, gradients all-reduced every step
  ps_bsp      ranks 0-2 workers, rank 3 the server, BSP (= all-reduce DP)
  ps_asp      ... ASP: each push applied as it comes
  ps_ssp2     ... SSP with staleness bound 2

Lines (one per run):
  mlp_np4_slow3_<run>_steps_per_s   worker (rank) 0's optimizer steps per
      second, the median over steps after 10 of warm-up; peer = the
      all-reduce run's, ratio = meshtrain / peer (> 1: more steps per second
      than all-reduce). Also: time_to_loss_s, the wall time of rank 0's steps
      until the mean loss of its last 20 steps first reaches TARGET_LOSS
      (null if never), final_loss (the mean of the last 20 steps' losses),
      steps. Under ASP / SSP a step is one worker's push of batch / 3
      examples and the loss is that worker's own; under all-reduce and BSP a
      step is the global batch and the loss its mean.
A run whose final loss is not below its first steps' (it did not learn) is
an error line. Not a peer comparison: PyTorch has no parameter server here.
"""

import math

from common import REPO, mpi_env, thread_env

BATCH = 120
TARGET_LOSS = 0.8
WINDOW = 20
RUNS = [
    ("allreduce", ['sync.scheme="allreduce"']),
    ("ps_bsp", ['sync.scheme="ps"', "sync.servers=1", 'sync.ps_mode="bsp"']),
    ("ps_asp", ['sync.scheme="ps"', "sync.servers=1", 'sync.ps_mode="asp"']),
    ("ps_ssp2", ['sync.scheme="ps"', "sync.servers=1", 'sync.ps_mode="ssp"', "sync.staleness=2"]),
]


def add_args(p):
    p.add_argument("--runs", default=",".join(n for n, _ in RUNS),
                   help="comma-separated subset of " + ",".join(n for n, _ in RUNS))


def train(ctx, steps, sets, name):
    """Returns (per-step lines of rank 0, error)."""
    import json

    exe = ctx.ensure_built("meshtrain")
    metrics = ctx.workdir / f"{name}.jsonl"
    cmd = [exe, "train", "--config", REPO / "configs" / "mlp_fashion.toml", "--nproc", "4",
           "--quiet"]
    for kv in [f"train.steps={steps}", "train.eval=false", "train.threads=1",
               f"train.batch_size={BATCH}", 'train.checkpoint=""', "train.log_every=1",
               "dist.slowdown=[1, 1, 3, 1]"] + sets:
        cmd += ["--set", kv]
    cmd += ["--metrics", metrics]
    env = thread_env(1)
    env.update(mpi_env())
    ctx.log(f"{name}: {' '.join(str(c) for c in cmd[1:])}")
    r = ctx.run(cmd, env, name)
    if not r.ok:
        return None, f"meshtrain: {r.failure()}"
    lines = []
    for text in metrics.read_text(errors="replace").splitlines():
        try:
            lines.append(json.loads(text))
        except json.JSONDecodeError:
            continue
    steps_logged = [ln for ln in lines if "loss" in ln and "samples_per_s" in ln
                    and not ln.get("summary")]
    if len(steps_logged) < steps:
        return None, f"meshtrain: {len(steps_logged)} step lines, expected {steps}"
    return steps_logged, None


def figures(steps):
    dts = [BATCH / s["samples_per_s"] for s in steps]  # the trainer's rate is batch / step time
    losses = [s["loss"] for s in steps]
    after = sorted(1.0 / dt for dt in dts[10:]) or [1.0 / dts[-1]]
    rate = after[len(after) // 2]
    t, reached = 0.0, None
    for i, dt in enumerate(dts):
        t += dt
        if i + 1 >= WINDOW and reached is None:
            if sum(losses[i + 1 - WINDOW:i + 1]) / WINDOW <= TARGET_LOSS:
                reached = t
    first = sum(losses[:WINDOW]) / WINDOW
    final = sum(losses[-WINDOW:]) / WINDOW
    return rate, reached, first, final


def run(ctx):
    wanted = set(ctx.args.runs.split(","))
    steps = 120 if ctx.quick else 300
    base = None
    for name, sets in RUNS:
        if name not in wanted:
            continue
        line = {"name": f"mlp_np4_slow3_{name}_steps_per_s", "unit": "steps/s", "model": "mlp",
                "scheme": name, "slowdown": [1, 1, 3, 1], "batch": BATCH, "steps": steps,
                "target_loss": TARGET_LOSS}
        got, err = train(ctx, steps, sets, f"sync-{name}")
        if err:
            line["error"] = err
            ctx.emit(line)
            continue
        rate, reached, first, final = figures(got)
        if not (math.isfinite(final) and final < first):
            line["error"] = f"did not learn: loss {first:.4f} over the first {WINDOW} steps, " \
                            f"{final:.4f} over the last"
        line.update({"meshtrain": rate, "time_to_loss_s": reached, "final_loss": final})
        if name == "allreduce":
            base = rate
        elif base:
            line.update({"peer": base, "peer_name": "meshtrain allreduce (same slowdown)",
                         "ratio": rate / base})
        ctx.emit(line)
