"""ZeRO memory and communication overlap: data-parallel state per rank for
stages 0-3 at 2 and 4 ranks, measured next to the analytic expectation, and
the share of collective time hidden behind compute (from the timeline).

Memory lines: bytes per rank of parameters + gradients + optimizer state
(DataParallel::memory(), from what is allocated), value = measured, with
"expected" = P+G+O, P+G+O/N, P+G/N+O/N or (P+G+O)/N for stages 0-3 and
"of_stage0" = measured / stage 0. Buffers (bucket staging, gathered
parameters; 1 MiB buckets here) are reported separately. Overlap lines: comm_hidden_fraction of
the summary with overlap on and off (bucket size 1 MiB).
"""

import json

from common import mpi_env, thread_env
from meshtrain import config_path

STEPS = 8


def add_args(p):
    p.add_argument("--model", default="gpt", choices=["mlp", "cnn", "gpt"],
                   help="model to measure (default gpt, AdamW)")


def train(ctx, model, nproc, sets, name, trace=False):
    exe = ctx.ensure_built("meshtrain")
    metrics = ctx.workdir / f"{name}.jsonl"
    cmd = [exe, "train", "--config", config_path(model), "--nproc", str(nproc), "--quiet"]
    for kv in [f"train.steps={STEPS}", "train.eval=false", "train.threads=1",
               'train.checkpoint=""', "optim.name=adamw"] + sets:
        cmd += ["--set", kv]
    cmd += ["--metrics", metrics]
    if trace:
        cmd += ["--trace", ctx.workdir / f"{name}.trace.json"]
    env = thread_env(1)
    env.update(mpi_env())
    ctx.log(f"{name}: {' '.join(str(c) for c in cmd[1:])}")
    r = ctx.run(cmd, env, name)
    summary = None
    if metrics.exists():
        for text in metrics.read_text(errors="replace").splitlines():
            try:
                line = json.loads(text)
            except json.JSONDecodeError:
                continue
            if line.get("summary") is True:
                summary = line
    error = None if r.ok and summary else f"meshtrain: {r.failure() if not r.ok else 'no summary'}"
    return summary, error


def run(ctx):
    model = ctx.args.model
    for n in (2, 4):
        stage0 = None
        for stage in range(4):
            s, err = train(ctx, model, n, [f"dist.zero_stage={stage}", "dist.bucket_mb=1"],
                           f"{model}-np{n}-zero{stage}")
            line = {"name": f"{model}_zero{stage}_np{n}_state_bytes_per_rank", "unit": "bytes",
                    "model": model, "ranks": n, "stage": stage}
            if err:
                line.update({"value": None, "error": err})
                ctx.emit(line)
                continue
            p = s["param_bytes"]
            o = 2 * p  # AdamW: two f32 moments per parameter
            expected = [p + p + o, p + p + o / n, p + p / n + o / n, (p + p + o) / n][stage]
            total = s["dp_param_bytes"] + s["dp_grad_bytes"] + s["dp_optimizer_bytes"]
            if stage == 0:
                stage0 = total
            line.update({"value": total, "expected": round(expected),
                         "of_stage0": round(total / stage0, 4) if stage0 else None,
                         "params": s["dp_param_bytes"], "grads": s["dp_grad_bytes"],
                         "optimizer": s["dp_optimizer_bytes"], "buffers": s["dp_buffer_bytes"]})
            ctx.emit(line)
    for overlap in ("true", "false"):
        s, err = train(ctx, model, 2, [f"dist.overlap={overlap}", "dist.bucket_mb=1"],
                       f"{model}-np2-overlap-{overlap}", trace=True)
        line = {"name": f"{model}_np2_comm_hidden_fraction_overlap_{overlap}", "unit": "fraction",
                "model": model, "ranks": 2}
        if err:
            line.update({"value": None, "error": err})
        else:
            line.update({"value": s.get("comm_hidden_fraction"),
                         "samples_per_s": s.get("samples_per_s"),
                         "comm_wait_s_per_step": s.get("comm_wait_s_per_step")})
        ctx.emit(line)
