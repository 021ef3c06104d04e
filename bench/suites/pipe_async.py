"""Asynchronous pipelining: convergence of PipeDream and SpecTrain next to the synchronous GPipe and 1F1B on real data.

MLP 784-512-512-10 on Fashion-MNIST (configs/mlp_fashion.toml: SGD with
Nesterov momentum 0.9, lr 0.05, cosine schedule), [parallel] pp = 2, 4
micro-batches of 32 per step, 2 processes x 1 thread, the same seed and
data order for every run, `--steps` steps (default 468 = one epoch;
--quick 60), then the whole test set evaluated once.

One line per schedule (name mlp_pp2_<schedule>_convergence, unit
test_accuracy, system meshtrain, value = test accuracy after the steps):
  gpipe, 1f1b                    synchronous (equal to the single-process run)
  pipedream, spectrain           parallel.async on 1f1b: an update after every
                                 micro-batch (4 per step, each from 32 samples)
  pipedream_lr_over_m, spectrain_lr_over_m  the same at lr / 4, so that the
                                 step size per sample is the synchronous runs'
Each carries test_loss, the training loss every 25 steps and its mean over
the last 25 (loss_last25; an async run's loss is the mean of its
micro-batches' losses at the weights their forwards used), samples_per_s
(median step after warm-up), the pipeline idle fraction, peak stashed weight
bytes and versions (rank 0's), and each rank's allocator peak of the params
category (where the stash is allocated). Not equivalent by design: no
peer and no ratio; the synchronous lines are the baseline
(accuracy_minus_sync: against 1f1b's, or gpipe's when 1f1b has none; both
equal the single-process run).
"""

import meshtrain
from common import meshtrain_engine_context, transport_context

WORLD = 2
M = 4


def add_args(p):
    p.add_argument("--steps", type=int, default=0,
                   help="training steps (0: 468, one epoch; --quick: 60)")


def run(ctx):
    ctx.add_context(transport_context(distributed=True))
    steps = ctx.args.steps or (60 if ctx.quick else 468)
    base = ["parallel.pp=2", f"parallel.microbatches={M}", "train.eval=true"]
    runs = [("gpipe", ['parallel.schedule="gpipe"']),
            ("1f1b", ['parallel.schedule="1f1b"']),
            ("pipedream", ['parallel.schedule="1f1b"', 'parallel.async="pipedream"']),
            ("spectrain", ['parallel.schedule="1f1b"', 'parallel.async="spectrain"']),
            ("pipedream_lr_over_m", ['parallel.schedule="1f1b"', 'parallel.async="pipedream"',
                                     f"optim.lr={0.05 / M}"]),
            ("spectrain_lr_over_m", ['parallel.schedule="1f1b"', 'parallel.async="spectrain"',
                                     f"optim.lr={0.05 / M}"])]
    acc_sync = None  # 1f1b's, or gpipe's (the synchronous schedules agree step by step)
    for name, sets in runs:
        r = meshtrain.train(ctx, "mlp", steps, 1, nproc=WORLD, sets=base + sets,
                            name=f"meshtrain-mlp-pp2-{name}")
        s = r.summary or {}
        plan = s.get("plan", {})
        losses = [ln["loss"] for ln in r.steps if "loss" in ln]
        acc = s.get("test_accuracy")
        if name in ("gpipe", "1f1b") and acc is not None:
            acc_sync = acc
        line = {"name": f"mlp_pp2_{name}_convergence", "unit": "test_accuracy",
                "system": "meshtrain", "value": acc, "test_loss": s.get("test_loss"),
                "steps": steps, "microbatches": M, "async": plan.get("async", "none"),
                "schedule": plan.get("schedule"), "sets": sets,
                "loss_every_25": [round(x, 4) for x in losses[::25]],
                "loss_last25": round(sum(losses[-25:]) / len(losses[-25:]), 4) if losses else None,
                "samples_per_s": s.get("samples_per_s"),
                "pipeline_idle_fraction": plan.get("pipeline_idle_fraction"),
                "peak_weight_stash_bytes": plan.get("peak_weight_stash_bytes"),
                "peak_weight_versions": plan.get("peak_weight_versions"),
                "params_peak_bytes_per_rank": [rk.get("mem_peak_bytes", {}).get("params")
                                               for rk in s.get("ranks", [])],
                "model": "mlp", "data": "fashion_mnist", "processes": WORLD,
                "threads_per_process": 1, **meshtrain_engine_context(r.summary)}
        if acc is not None and acc_sync is not None and name not in ("gpipe", "1f1b"):
            line["accuracy_minus_sync"] = round(acc - acc_sync, 4)
        if r.error:
            line["error"] = r.error
        ctx.emit(line)
