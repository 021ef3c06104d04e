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

DiLoCo and Streaming DiLoCo against dense data parallelism, the same MLP,
4 ranks, no slowdown, evaluation of the whole test split at the end, inner
optimizer the config's (SGD, Nesterov momentum 0.9, cosine schedule), outer
Nesterov lr 0.7, momentum 0.9 (the defaults), STREAM_STEPS steps:

  dp_dense      sync.scheme = "allreduce" (the baseline)
  diloco_h50    diloco, period 50, 32-bit, one fragment
  diloco_h50_4bit            ... 4-bit outer exchange
  streaming_h50_f3_tau5_4bit ... 3 fragments, each exchange overlapped
                             with 5 inner steps (merge_alpha 0.5), 4-bit
  *_rs          the same with sync.outer_exchange = "reduce_scatter"
                (the 4-bit pieces reduced at their owner, re-quantized,
                all-gathered) instead of an all-gather of every payload

Lines: mlp_np4_<run>_bytes_per_rank: rank 0's synchronization bytes over
the whole run (the communicator's counters, from the summary's bytes per
step x steps); peer = dp_dense's, ratio = meshtrain / peer (< 1: fewer
bytes); test_accuracy, final_loss (mean of the last 20 steps), wall_s (the
whole command, start-up and evaluation included).
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


STREAM_STEPS = 600
STREAM_RUNS = [
    ("dp_dense", ['sync.scheme="allreduce"']),
    ("diloco_h50", ['sync.scheme="diloco"', "sync.period=50"]),
    ("diloco_h50_4bit", ['sync.scheme="diloco"', "sync.period=50", "sync.outer_bits=4"]),
    ("streaming_h50_f3_tau5_4bit", ['sync.scheme="diloco"', "sync.period=50", "sync.fragments=3",
                                    "sync.overlap_steps=5", "sync.outer_bits=4"]),
    ("diloco_h50_4bit_rs", ['sync.scheme="diloco"', "sync.period=50", "sync.outer_bits=4",
                            'sync.outer_exchange="reduce_scatter"']),
    ("streaming_h50_f3_tau5_4bit_rs", ['sync.scheme="diloco"', "sync.period=50",
                                       "sync.fragments=3", "sync.overlap_steps=5",
                                       "sync.outer_bits=4",
                                       'sync.outer_exchange="reduce_scatter"']),
]


def add_args(p):
    names = [n for n, _ in RUNS] + [n for n, _ in STREAM_RUNS]
    p.add_argument("--runs", default=",".join(names),
                   help="comma-separated subset of " + ",".join(names))


def train(ctx, steps, sets, name, slowdown=True, evaluate=False):
    """Returns (per-step lines of rank 0, error); with evaluate, the summary
    line is the last of them."""
    import json

    exe = ctx.ensure_built("meshtrain")
    metrics = ctx.workdir / f"{name}.jsonl"
    cmd = [exe, "train", "--config", REPO / "configs" / "mlp_fashion.toml", "--nproc", "4",
           "--quiet"]
    kvs = [f"train.steps={steps}", f"train.eval={'true' if evaluate else 'false'}",
           "train.threads=1", f"train.batch_size={BATCH}", 'train.checkpoint=""',
           "train.log_every=1"]
    if slowdown:
        kvs.append("dist.slowdown=[1, 1, 3, 1]")
    for kv in kvs + sets:
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
    summary = [ln for ln in lines if ln.get("summary")]
    if evaluate:
        if not summary:
            return None, "meshtrain: no summary line"
        steps_logged.append(summary[-1])
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
    run_streaming(ctx, wanted)


def run_streaming(ctx, wanted):
    import time

    steps = 200 if ctx.quick else STREAM_STEPS
    base = None
    for name, sets in STREAM_RUNS:
        if name not in wanted:
            continue
        line = {"name": f"mlp_np4_{name}_bytes_per_rank", "unit": "bytes", "model": "mlp",
                "scheme": name, "batch": BATCH, "steps": steps, "sets": sets}
        t0 = time.monotonic()
        got, err = train(ctx, steps, sets, f"sync-{name}", slowdown=False, evaluate=True)
        wall = time.monotonic() - t0
        if err:
            line["error"] = err
            ctx.emit(line)
            continue
        summary, got = got[-1], got[:-1]
        losses = [s["loss"] for s in got]
        first = sum(losses[:WINDOW]) / WINDOW
        final = sum(losses[-WINDOW:]) / WINDOW
        sync = summary.get("sync") or {}
        per_step = sync.get("bytes_sent_per_step")
        if per_step is None:
            line["error"] = "the summary has no sync.bytes_sent_per_step"
            ctx.emit(line)
            continue
        total = per_step * summary.get("steps_run", steps)
        if not (math.isfinite(final) and final < first):
            line["error"] = f"did not learn: loss {first:.4f} over the first {WINDOW} steps, " \
                            f"{final:.4f} over the last"
        line.update({"meshtrain": total, "test_accuracy": summary.get("test_accuracy"),
                     "final_loss": final, "wall_s": wall,
                     "consensus_relative": sync.get("consensus_relative")})
        if name == "dp_dense":
            base = total
        elif base:
            line.update({"peer": base, "peer_name": "meshtrain allreduce (dense DP, same run)",
                         "ratio": total / base})
        ctx.emit(line)
