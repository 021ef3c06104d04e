"""Shipped configs trained to their documented lengths (f32, bf16): test accuracy vs PyTorch.

Trains, one after the other:
  mlp  configs/mlp_fashion.toml, 5 epochs, 1 process (train.threads of the config)
  cnn  configs/cnn_fashion.toml, 5 epochs, 2 ranks x 1 thread (as scripts/run)
  gpt  configs/gpt_text.toml, 300 steps (train.steps=300), 1 process
each in f32 and bf16 (--precisions), and PyTorch (f32, bench/peers/
torch_accuracy.py) on the same training and test data with the same model,
batch, optimizer, learning-rate schedule and length. Lines:
  <model>_test_accuracy   % of the test split, ratio = meshtrain / peer
                          (mlp, cnn; test_loss beside)
  gpt_test_loss           nats per token over the test split, ratio = peer /
                          meshtrain (lower is better; test_accuracy beside)
For f32 the peer is PyTorch; for bf16 it is meshtrain's own f32 run
("peer_name": "meshtrain f32"). Accuracy differs between the two frameworks
by the random initialisation and data order (each side's own seeded
generator), so a ratio within a few tenths of a percent of 1 is a tie.
"""


import meshtrain
from common import PEERS, meshtrain_engine_context, mpi_env, ratio, summary_line, thread_env, transport_context

# Per model: the documented length (--set values), ranks, and the headline metric.
PLAN = {
    "mlp": {"sets": [], "nproc": None, "metric": "test_accuracy"},
    "cnn": {"sets": ["train.threads=1"], "nproc": 2, "metric": "test_accuracy"},
    "gpt": {"sets": ["train.steps=300"], "nproc": None, "metric": "test_loss"},
}
QUICK = {"mlp": ["train.epochs=1"], "cnn": ["train.epochs=1"], "gpt": ["train.steps=60"]}
TIMEOUT_S = 1200


def add_args(p):
    p.add_argument("--models", default="mlp,cnn,gpt", help="comma-separated subset of mlp,cnn,gpt")
    p.add_argument("--precisions", default="f32,bf16", help="meshtrain precisions (f32 first)")
    p.add_argument("--no-peer", action="store_true", help="meshtrain only (no PyTorch runs)")
    p.add_argument("--threads", type=int, default=0,
                   help="meshtrain's threads for the 1-process models (default: the config's "
                        "train.threads; the CNN always runs 2 ranks x 1 thread)")
    p.add_argument("--peer-threads", type=int, default=1,
                   help="PyTorch's threads (default 1: accuracy does not depend on it, and one "
                        "thread is not stalled by a neighbour's build the way two are)")


def read_config(model):
    import tomllib

    return tomllib.loads(meshtrain.config_path(model).read_text())


def sets_for(ctx, model):
    return PLAN[model]["sets"] + (QUICK[model] if ctx.quick else [])


def train_meshtrain(ctx, model, precision):
    """Trains with the config plus the plan's --set values; returns (summary or None, error,
    ChildResult or None)."""
    try:
        exe = ctx.ensure_built("meshtrain")
    except Exception as e:  # BenchError: report on the line, keep going
        return None, f"meshtrain unavailable: {e}", None
    name = f"meshtrain-{model}-{precision}"
    metrics = ctx.workdir / f"{name}.jsonl"
    cmd = [exe, "train", "--config", meshtrain.config_path(model), "--quiet"]
    if PLAN[model]["nproc"]:
        cmd += ["--nproc", str(PLAN[model]["nproc"])]
    for kv in sets_for(ctx, model) + [f"train.precision={precision}", 'train.checkpoint=""']:
        cmd += ["--set", kv]
    cmd += ["--metrics", metrics]
    threads = 1 if PLAN[model]["nproc"] else (
        ctx.args.threads or int(read_config(model)["train"].get("threads", 1)))
    if not PLAN[model]["nproc"] and ctx.args.threads:
        cmd[-2:-2] = ["--set", f"train.threads={threads}"]
    env = thread_env(threads)
    env.update(mpi_env())
    ctx.log(f"{name}: {' '.join(str(c) for c in cmd[1:])}")
    r = ctx.run(cmd, env, name, timeout_s=TIMEOUT_S)
    summary = summary_line(metrics)
    if not r.ok:
        return None, f"meshtrain: {r.failure()}", r
    if summary is None or summary.get(PLAN[model]["metric"]) is None:
        return None, f"meshtrain: no {PLAN[model]['metric']} in the summary of {metrics.name}", r
    ctx.log(f"{name}: test accuracy {summary.get('test_accuracy')}, test loss "
            f"{summary.get('test_loss')} after {summary.get('steps')} steps ({r.wall_s:.0f} s)")
    return summary, None, r


def peer_args(ctx, model):
    """torch_accuracy.py arguments from meshtrain's config (and the plan's --set values)."""
    cfg = read_config(model)
    m, d, t, o = (cfg.get(k, {}) for k in ("model", "data", "train", "optim"))
    for kv in sets_for(ctx, model):
        key, _, value = kv.partition("=")
        section, _, field = key.partition(".")
        if section == "train" and field in ("epochs", "steps"):
            t[field] = int(value)
    args = ["--model", model, "--epochs", str(t.get("epochs", 1)),
            "--steps", str(t.get("steps", 0)),
            "--batch", str(t.get("batch_size", 128)),
            "--eval-batch", str(t.get("eval_batch_size", 1000)), "--seed", str(t.get("seed", 1))]
    if model == "gpt":
        args += ["--text", d.get("path", "/usr/share/games/fortunes"),
                 "--test-fraction", str(d.get("test_fraction", 0.1))]
        for key, flag in (("layers", "--layers"), ("d_model", "--d-model"), ("heads", "--heads"),
                          ("seq_len", "--seq")):
            if key in m:
                args += [flag, str(m[key])]
    else:
        args += ["--data-dir", d.get("dir", "/usr/share/datasets/fashion-mnist")]
        if d.get("normalize", "mean_std") == "none":
            args += ["--mean", "0", "--std", "1"]
        else:
            args += ["--mean", str(d.get("mean", 0.2860)), "--std", str(d.get("std", 0.3530))]
        if model == "mlp":
            args += ["--hidden", ",".join(str(h) for h in m.get("hidden", [512, 512]))]
        else:
            args += ["--conv-channels", ",".join(str(c) for c in m.get("conv_channels", [32, 64])),
                     "--fc", str(m.get("fc", 128))]
    name = o.get("name", "sgd")
    args += ["--opt", name, "--lr", str(o.get("lr", 0.01)),
             "--weight-decay", str(o.get("weight_decay", 0.0 if name == "sgd" else 0.01)),
             "--clip-grad-norm", str(o.get("clip_grad_norm", 0.0)),
             "--schedule", o.get("schedule", "constant"),
             "--warmup-steps", str(o.get("warmup_steps", 0)), "--min-lr", str(o.get("min_lr", 0.0))]
    if name == "sgd":
        args += ["--momentum", str(o.get("momentum", 0.9))]
        if o.get("nesterov", False):
            args.append("--nesterov")
    elif name == "adamw":
        args += ["--beta1", str(o.get("beta1", 0.9)), "--beta2", str(o.get("beta2", 0.999)),
                 "--eps", str(o.get("eps", 1e-8))]
    else:
        return None
    return args


def train_peer(ctx, model):
    args = peer_args(ctx, model)
    if args is None:
        return None, "the config's optimizer has no PyTorch peer here (sgd, adamw)", None
    threads = ctx.args.peer_threads
    ctx.log(f"peer {model}: torch_accuracy.py {' '.join(args)}")
    r = ctx.run([ctx.torch_python(), PEERS / "torch_accuracy.py", *args, "--threads", str(threads)],
                thread_env(threads), f"torch-acc-{model}", timeout_s=TIMEOUT_S)
    lines = r.json_lines()
    if not r.ok or not lines:
        return None, f"peer: {r.failure()}", r
    res = lines[-1]
    ctx.log(f"peer {model}: test accuracy {res['test_accuracy']:.4f}, test loss "
            f"{res['test_loss']:.4f} after {res['steps']} steps ({r.wall_s:.0f} s)")
    return res, None, r


def emit(ctx, model, precision, mt, mt_err, mt_child, peer, peer_err, peer_child, peer_name):
    metric = PLAN[model]["metric"]
    if metric == "test_accuracy":
        name, unit = f"{model}_test_accuracy", "%"
        mine = None if mt is None else 100.0 * mt["test_accuracy"]
        theirs = None if peer is None else 100.0 * peer["test_accuracy"]
        r = ratio(mine, theirs)
        other = "test_loss"
    else:
        name, unit = f"{model}_test_loss", "nats/token"
        mine = None if mt is None else mt["test_loss"]
        theirs = None if peer is None else peer["test_loss"]
        r = ratio(theirs, mine)  # lower is better
        other = "test_accuracy"
    line = {"name": name, "unit": unit, "meshtrain": mine, "peer": theirs, "ratio": r,
            "peer_name": peer_name, "model": model, "precision": precision,
            "config": str(meshtrain.config_path(model).relative_to(meshtrain.REPO)),
            "sets": sets_for(ctx, model), "quick": ctx.quick,
            "processes": PLAN[model]["nproc"] or 1, "threads": mt.get("threads") if mt else None,
            "steps": mt.get("steps") if mt else None,
            "peer_steps": peer.get("steps") if peer else None,
            f"meshtrain_{other}": mt.get(other) if mt else None,
            f"peer_{other}": peer.get(other) if peer else None,
            "test_examples": mt.get("test_examples") if mt else None,
            "meshtrain_wall_s": round(mt_child.wall_s, 1) if mt_child else None,
            "peer_wall_s": round(peer_child.wall_s, 1) if peer_child else None,
            "meshtrain_others_cpu": mt_child.others_cpu if mt_child else None,
            "peer_others_cpu": peer_child.others_cpu if peer_child else None,
            **meshtrain_engine_context(mt)}
    if peer and "peer_engines" in peer:
        line["peer_engines"] = peer["peer_engines"]
        line["peer_threads"] = peer.get("peer_threads")
    if model == "cnn":
        line.update(transport_context(distributed=True))
        if peer_name.startswith("pytorch"):
            line["peer_transport"] = "none (one process)"
    if peer is None and not peer_err:
        line["note"] = "not compared (--no-peer)"
    errors = [e for e in (mt_err, peer_err) if e]
    if errors:
        line["error"] = "; ".join(errors)
    ctx.emit(line)


def run(ctx):
    models = [m for m in ctx.args.models.split(",") if m]
    for m in models:
        if m not in PLAN:
            raise SystemExit(f"bench/run accuracy: unknown model '{m}' (mlp, cnn, gpt)")
    precisions = [p for p in ctx.args.precisions.split(",") if p]
    ctx.add_context(transport_context(distributed=False))
    for model in models:
        runs = {p: train_meshtrain(ctx, model, p) for p in precisions}
        if ctx.args.no_peer:
            peer, peer_err, peer_child = None, "not compared (--no-peer)", None
        else:
            peer, peer_err, peer_child = train_peer(ctx, model)
        version = peer.get("torch_version") if peer else "?"
        for p in precisions:
            mt, mt_err, mt_child = runs[p]
            if p == "f32" or "f32" not in runs:
                emit(ctx, model, p, mt, mt_err, mt_child, peer,
                     None if ctx.args.no_peer else peer_err, peer_child,
                     f"pytorch-{version} eager f32")
            else:
                f32, f32_err, f32_child = runs["f32"]
                emit(ctx, model, p, mt, mt_err, mt_child, f32, f32_err, f32_child,
                     "meshtrain f32")
