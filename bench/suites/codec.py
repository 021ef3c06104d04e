"""Gradient codecs over MPI: runs build/bench/comm/codec_bench on 2 ranks (--np) and passes its lines through.

codec_bench (bench/comm/codec_bench.cpp) measures the compressed all-reduce
of sync/compressed_all_reduce.h: the sparse codecs' (index, value)
all-gather against a dense all-reduce of the densified result at densities
0.001..0.5 (the crossover), the 16-bit casts reduced in their dtype against
all-gathered and summed in f32, and each codec's time and bytes sent per rank
on a 1024 x 1024 tensor (the communicator's counters, checked against the
prediction). Every comparison is verified before it is timed. This suite adds
"suite": "codec" where a line lacks it and the CPU (cpu_vendor, cpu_model,
cpu_isa); mpirun gets the transport of the mpi tests (pml ob1, btl
self,vader). --quick sets MT_BENCH_QUICK=1 (1M elements only, fewer samples).

Part "pseudo" (after the payload part; --parts chooses): codecs on DiLoCo's
pseudo-gradients (sync.codec with sync.scheme = "diloco"), in training:
`meshtrain train --nproc 4` of the MLP of configs/mlp_fashion.toml
(train.threads=1, global batch 120, PSEUDO_STEPS steps, evaluation of the
whole test split at the end, no slowdown, inner optimizer the config's, outer
Nesterov lr 0.7, momentum 0.9):

  dp_dense            sync.scheme = "allreduce" (the baseline)
  diloco_h50          period 50, the pseudo-gradient in f32
  diloco_h50_topk1pct ... through topk:0.01 with error feedback
  diloco_h50_topk10pct ... through topk:0.1
  diloco_h50_qsgd4    ... through qsgd:4 (512-element buckets)
  diloco_h50_qsgd8    ... through qsgd:8
  diloco_h50_bf16     ... through bf16
  diloco_h50_powersgd4 ... through powersgd:4

Lines: mlp_np4_pseudo_<run>_bytes_per_rank: rank 0's synchronization bytes
over the run (the summary's bytes per step x steps: the communicator's
counters); peer = dp_dense's, ratio = meshtrain / peer (< 1: fewer bytes);
test_accuracy, accuracy_drop (dp_dense's minus this run's, points),
final_loss (mean of the last 20 steps' losses), wall_s (the whole command).
A run that did not learn (final loss not below the first 20 steps') is an
error line.
"""

import json
import math
import sys
import time

from common import REPO, cpu_context, mpi_env, thread_env

NPROC = 2
PSEUDO_STEPS = 600
PSEUDO_BATCH = 120
PSEUDO_WINDOW = 20
PSEUDO_RUNS = [
    ("dp_dense", ['sync.scheme="allreduce"']),
    ("diloco_h50", ['sync.scheme="diloco"', "sync.period=50"]),
    ("diloco_h50_topk1pct", ['sync.scheme="diloco"', "sync.period=50", 'sync.codec="topk:0.01"']),
    ("diloco_h50_topk10pct", ['sync.scheme="diloco"', "sync.period=50",
                              'sync.codec="topk:0.1"']),
    ("diloco_h50_qsgd4", ['sync.scheme="diloco"', "sync.period=50", 'sync.codec="qsgd:4"']),
    ("diloco_h50_qsgd8", ['sync.scheme="diloco"', "sync.period=50", 'sync.codec="qsgd:8"']),
    ("diloco_h50_bf16", ['sync.scheme="diloco"', "sync.period=50", 'sync.codec="bf16"']),
    ("diloco_h50_powersgd4", ['sync.scheme="diloco"', "sync.period=50",
                              'sync.codec="powersgd:4"']),
]


def add_args(p):
    p.add_argument("--np", type=int, default=NPROC, help="MPI ranks (default 2)")
    p.add_argument("--parts", default="payload,pseudo",
                   help="payload (codec_bench), pseudo (codecs on DiLoCo's pseudo-gradients)")


def run(ctx):
    parts = set(ctx.args.parts.split(","))
    if "payload" in parts:
        run_payload(ctx)
    if "pseudo" in parts:
        run_pseudo(ctx)


def run_pseudo(ctx):
    """Codecs on DiLoCo's pseudo-gradients against dense DP (module docstring)."""
    steps = 200 if ctx.quick else PSEUDO_STEPS
    exe = ctx.ensure_built("meshtrain")
    base, base_acc = None, None
    for name, sets in PSEUDO_RUNS:
        line = {"name": f"mlp_np4_pseudo_{name}_bytes_per_rank",
                "unit": "bytes", "model": "mlp", "scheme": name, "batch": PSEUDO_BATCH,
                "steps": steps, "sets": sets}
        metrics = ctx.workdir / f"pseudo-{name}.jsonl"
        cmd = [exe, "train", "--config", REPO / "configs" / "mlp_fashion.toml", "--nproc", "4",
               "--quiet"]
        for kv in [f"train.steps={steps}", "train.eval=true", "train.threads=1",
                   f"train.batch_size={PSEUDO_BATCH}", 'train.checkpoint=""',
                   "train.log_every=1"] + sets:
            cmd += ["--set", kv]
        cmd += ["--metrics", metrics]
        env = thread_env(1)
        env.update(mpi_env())
        ctx.log(f"pseudo-{name}: {' '.join(str(c) for c in cmd[1:])}")
        t0 = time.monotonic()
        r = ctx.run(cmd, env, f"pseudo-{name}")
        wall = time.monotonic() - t0
        if not r.ok:
            line["error"] = f"meshtrain: {r.failure()}"
            ctx.emit(line)
            continue
        rows = []
        for text in metrics.read_text(errors="replace").splitlines():
            try:
                rows.append(json.loads(text))
            except json.JSONDecodeError:
                continue
        losses = [x["loss"] for x in rows if "loss" in x and not x.get("summary")]
        summary = ([x for x in rows if x.get("summary")] or [{}])[-1]
        per_step = (summary.get("sync") or {}).get("bytes_sent_per_step")
        if len(losses) < steps or per_step is None:
            line["error"] = f"meshtrain: {len(losses)} step lines of {steps}, summary " \
                            f"{'without' if per_step is None else 'with'} sync bytes"
            ctx.emit(line)
            continue
        first = sum(losses[:PSEUDO_WINDOW]) / PSEUDO_WINDOW
        final = sum(losses[-PSEUDO_WINDOW:]) / PSEUDO_WINDOW
        total = per_step * summary.get("steps_run", steps)
        acc = summary.get("test_accuracy")
        if not (math.isfinite(final) and final < first):
            line["error"] = f"did not learn: loss {first:.4f} over the first {PSEUDO_WINDOW} " \
                            f"steps, {final:.4f} over the last"
        line.update({"meshtrain": total, "test_accuracy": acc, "final_loss": final,
                     "wall_s": wall})
        if name == "dp_dense":
            base, base_acc = total, acc
        elif base:
            line.update({"peer": base, "peer_name": "meshtrain allreduce (dense DP, same run)",
                         "ratio": total / base})
            if acc is not None and base_acc is not None:
                line["accuracy_drop"] = round(100 * (base_acc - acc), 2)
        line["others_cpu"] = r.others_cpu
        ctx.emit(line)


def run_payload(ctx):
    exe = ctx.ensure_built("bench/comm/codec_bench")
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--mca", "pml", "ob1",
           "--mca", "btl", "self,vader", "-np", str(ctx.args.np), exe]
    env = mpi_env()
    if ctx.quick:
        env["MT_BENCH_QUICK"] = "1"
    ctx.log(" ".join(str(c) for c in cmd))
    r = ctx.run(cmd, env, "codec_bench")
    passed = 0
    cpu = cpu_context()
    for text in r.stdout.splitlines():
        try:
            line = json.loads(text) if text.lstrip().startswith("{") else None
        except json.JSONDecodeError:
            line = None
        if not isinstance(line, dict):
            print(text, file=sys.stderr)
            continue
        line.setdefault("suite", "codec")
        line.update(cpu)
        line["others_cpu"] = r.others_cpu
        print(json.dumps(line), flush=True)
        ctx.lines.append(line)
        passed += 1
        if line.get("error"):
            ctx.errors += 1
    sys.stderr.write(r.stderr)
    if not r.ok or passed == 0:
        ctx.emit({"name": "codec_bench", "unit": "lines", "value": passed, "np": ctx.args.np,
                  "error": r.failure() if not r.ok else "codec_bench printed no JSON line"})
