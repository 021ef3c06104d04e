"""Runs `build/meshtrain train` for the suites and reads its metrics file.

Contract with the CLI: `--metrics FILE` writes JSON lines, one per logged step
({"step", "loss", "samples_per_s", "lr"}) and at the end one line
{"summary": true, "samples_per_s": <median over steps after warm-up>,
 "matmul_gflops", "planned_arena_bytes", "allocated_arena_bytes",
 "cpu": "<vendor> <model name>", "isa": "<flags>; onednn <ISA>",
 "matmul_engines": {"openblas_core", "onednn_isa", "f32": {signature: engine},
                    "dropped": {engine: reason}},
 "precision_decision": {"requested", "chosen", "reason", "amx",
                        "f32_matmul_gflops_1t", "bf16_matmul_gflops_1t", "bf16_over_f32"}}.
samples_per_s counts samples of the global batch (for GPT a sample is one
sequence of seq_len tokens). A run with --nproc N > 1 must also carry
"world_size": N in its summary (the dp suite refuses it otherwise).
"""

import json
import tomllib

from common import BenchError, REPO, fast_rate, mpi_env, thread_env

CONFIGS = {"mlp": "mlp_fashion", "cnn": "cnn_fashion", "gpt": "gpt_text"}


class MeshtrainRun:
    """Outcome of one meshtrain training run: the summary line (or None),
    the per-step lines, peak RSS in KiB, an error string (or None), and the
    share of the CPUs other processes used meanwhile (see ChildResult)."""

    def __init__(self, summary, steps, maxrss_kib, error, wall_s, others_cpu=None):
        self.summary = summary
        self.steps = steps
        self.maxrss_kib = maxrss_kib
        self.error = error
        self.wall_s = wall_s
        self.others_cpu = others_cpu

    @property
    def samples_per_s(self):
        return self.summary.get("samples_per_s") if self.summary else None

    def fast_samples_per_s(self, warmup):
        """90th percentile of the per-step rates after `warmup` steps."""
        if not self.summary:
            return None
        return fast_rate([s["samples_per_s"] for s in self.steps
                          if s.get("step", 0) > warmup and "samples_per_s" in s])

    def get(self, key):
        return self.summary.get(key) if self.summary else None


def summary_world(summary):
    for key in ("world_size", "world", "nproc", "ranks"):
        if key in summary:
            return summary[key]
    return None


def train(ctx, model, steps, threads, precision="f32", nproc=None, name=None, config=None,
          sets=(), extra_args=()):
    """Trains `model` (mlp, cnn, gpt) for `steps` steps. Never raises: a run
    that fails, or a meshtrain that cannot be built, comes back with .error
    set, so the suite still prints the peer's figures. config: another config
    file than the model's; sets: extra "key=value" overrides (e.g. a
    [parallel] plan, dist.slowdown); extra_args: more command-line arguments
    (e.g. --plan FILE)."""
    name = name or f"meshtrain-{model}-t{threads}-{precision}" + (f"-np{nproc}" if nproc else "")
    try:
        exe = ctx.ensure_built("meshtrain")
    except BenchError as e:
        return MeshtrainRun(None, [], None, f"meshtrain unavailable: {e}", 0.0)
    config = config or config_path(model)
    metrics = ctx.workdir / f"{name}.jsonl"
    cmd = [exe, "train", "--config", config]
    if nproc:
        cmd += ["--nproc", str(nproc)]
    for kv in (f"train.steps={steps}", "train.eval=false", f"train.threads={threads}",
               "train.log_every=1",
               f"train.precision={precision}", 'train.checkpoint=""', *sets):
        cmd += ["--set", kv]
    cmd += ["--metrics", metrics, *extra_args]
    env = thread_env(threads)
    env.update(mpi_env())
    ctx.log(f"{name}: {' '.join(str(c) for c in cmd[1:])}")
    r = ctx.run(cmd, env, name)
    lines = []
    if metrics.exists():
        for text in metrics.read_text(errors="replace").splitlines():
            try:
                lines.append(json.loads(text))
            except json.JSONDecodeError:
                continue
    summary = next((ln for ln in reversed(lines) if ln.get("summary") is True), None)
    error = None
    if not r.ok:
        error = f"meshtrain: {r.failure()}"
    elif summary is None:
        error = f"meshtrain: no summary line in {metrics.name}"
    elif not summary.get("samples_per_s"):
        error = "meshtrain: summary line has no samples_per_s"
    elif nproc and nproc > 1 and summary_world(summary) != nproc:
        # Without it, a launcher that starts nproc independent single-process
        # trainings would pass for data parallel.
        error = (f"meshtrain: --nproc {nproc} run's summary says world_size="
                 f"{summary_world(summary)}, expected {nproc} (a data-parallel run's summary "
                 f"must carry world_size, and samples_per_s for the global batch)")
    steps_logged = [ln for ln in lines if "step" in ln and not ln.get("summary")]
    if error:
        ctx.log(error)
    return MeshtrainRun(summary if not error else None, steps_logged,
                        r.maxrss_kib if r.ok else None, error, r.wall_s, r.others_cpu)


def config_path(model):
    return REPO / "configs" / f"{CONFIGS[model]}.toml"


def peer_setup(model, default_batch):
    """Reads meshtrain's config for `model` and returns {"batch": global
    batch, "seq": tokens per sample (1 but for GPT), "args": the
    torch_train.py arguments that give the peer the same model dimensions,
    optimizer and clipping}. Defaults are meshtrain's own
    (cli/run_config.cpp). Raises BenchError for a config that cannot be read."""
    path = config_path(model)
    try:
        cfg = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise BenchError(f"cannot read {path}: {e}") from e
    m, t, o = cfg.get("model", {}), cfg.get("train", {}), cfg.get("optim", {})
    batch = int(t.get("batch_size", default_batch))
    args = ["--batch", str(batch)]
    if model == "mlp":
        args += ["--hidden", ",".join(str(h) for h in m.get("hidden", [512, 512]))]
    elif model == "cnn":
        args += ["--conv-channels", ",".join(str(c) for c in m.get("conv_channels", [32, 64])),
                 "--fc", str(m.get("fc", 128))]
    else:
        for key, flag in (("layers", "--layers"), ("d_model", "--d-model"), ("heads", "--heads"),
                          ("seq_len", "--seq")):
            if key in m:
                args += [flag, str(m[key])]
    name = o.get("name", "sgd")
    if name not in ("sgd", "adamw"):
        raise BenchError(f"{path}: optim.name '{name}' has no PyTorch peer here (sgd, adamw)")
    args += ["--opt", name, "--lr", str(o.get("lr", 0.01)),
             "--weight-decay", str(o.get("weight_decay", 0.0 if name == "sgd" else 0.01)),
             "--clip-grad-norm", str(o.get("clip_grad_norm", 0.0))]
    if name == "sgd":
        args += ["--momentum", str(o.get("momentum", 0.9))]
        if o.get("nesterov", False):
            args.append("--nesterov")
    else:
        args += ["--beta1", str(o.get("beta1", 0.9)), "--beta2", str(o.get("beta2", 0.999)),
                 "--eps", str(o.get("eps", 1e-8))]
    seq = int(m.get("seq_len", 128)) if model == "gpt" else 1
    return {"batch": batch, "seq": seq, "args": args}
