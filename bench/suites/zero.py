"""ZeRO memory per rank as the process holds it, next to PyTorch FSDP, and
communication overlap.

For each model (--models; default the GPT of configs/gpt_text.toml and the
wider configs/gpt_medium.toml, AdamW) at 1, 2 and 4 ranks and ZeRO stages
0-3 (stages 0 and 3 at 1 rank, where they hold the same), a short
`meshtrain train --nproc N` run (train.threads=1, evaluation and checkpoints
off) reports, per rank, from its summary line:

  <model>_zero<S>_np<N>_state_bytes_per_rank   bytes
      value: the largest rank's parameters + gradients + optimizer state as
      the allocator counts them live at the end (tensor/memory_stats.h);
      expected: P+G+O, P+G+O/N, P+G/N+O/N, (P+G+O)/N for stages 0-3 (P =
      4 bytes x parameters, G = P, O = 2P for AdamW's two moments);
      within: value / expected; buffers (bucket staging, gathered
      parameters: "comm") and expected_buffers beside it (1 MiB buckets);
      peak_rss_mib per rank (ru_maxrss), mem_live_bytes / mem_peak_bytes of
      rank 0 by category, activations included; of_stage0: value / stage 0's.

  <model>_zero3_rss_by_ranks                   MiB
      the largest rank's peak RSS at stage 3 for 1, 2 and 4 ranks, and the
      model state per rank beside it: what falls as N grows.

  <model>_zero3_np<N>_vs_fsdp_peak_rss         MiB, ratio = peer / meshtrain (goal >= 2),
                                               meshtrain_of_peer = its inverse (goal <= 0.5)
  <model>_zero3_np<N>_vs_fsdp_throughput       tokens/s, ratio = meshtrain / peer (goal >= 1.3)
      meshtrain ZeRO-3 against PyTorch FSDP2 (`fully_shard` per block and
      root, gloo on CPU, bench/peers/torch_train.py --fsdp) with the same
      model, optimizer, global batch and ranks, run right after it. RSS: the
      largest rank's ru_maxrss; the peer's `import torch` alone
      (peer_import_rss_mib) is part of what it holds, and is given beside.
      Throughput: meshtrain's median step rate of rank 0 (after 5 warm-up
      steps when the run has more) vs the peer's rank-0 median.

Overlap lines (GPT only, 2 ranks): comm_hidden_fraction of the summary with
overlap on and off (1 MiB buckets), as before.
"""

import socket
import tomllib

from common import PEERS, REPO, mib, mpi_env, ratio, summary_line, thread_env

MODELS = {
    # name: config, steps (normal, --quick)
    "gpt": {"config": "gpt_text", "steps": (12, 6)},
    "gpt_medium": {"config": "gpt_medium", "steps": (4, 3)},
}
BUCKET_MB = 1


def add_args(p):
    p.add_argument("--models", default="gpt,gpt_medium",
                   help="comma-separated subset of " + ",".join(MODELS))
    p.add_argument("--ranks", default="1,2,4", help="comma-separated world sizes")
    p.add_argument("--stages", default="0,1,2,3", help="comma-separated ZeRO stages")
    p.add_argument("--steps", type=int, default=0,
                   help="training steps per run (0: the model's default, 12 gpt, 4 gpt_medium)")
    p.add_argument("--no-peer", action="store_true", help="skip PyTorch FSDP")
    p.add_argument("--no-overlap", action="store_true", help="skip the overlap lines")


def config_file(model):
    return REPO / "configs" / f"{MODELS[model]['config']}.toml"


def peer_args(model):
    """torch_train.py arguments for the GPT of model's config: sizes, batch, AdamW."""
    cfg = tomllib.loads(config_file(model).read_text())
    m, t, o = cfg.get("model", {}), cfg.get("train", {}), cfg.get("optim", {})
    args = ["--batch", str(t.get("batch_size", 16))]
    for key, flag in (("layers", "--layers"), ("d_model", "--d-model"), ("heads", "--heads"),
                      ("seq_len", "--seq")):
        if key in m:
            args += [flag, str(m[key])]
    args += ["--opt", "adamw", "--lr", str(o.get("lr", 3e-4)),
             "--weight-decay", str(o.get("weight_decay", 0.01)),
             "--beta1", str(o.get("beta1", 0.9)), "--beta2", str(o.get("beta2", 0.999)),
             "--eps", str(o.get("eps", 1e-8)),
             "--clip-grad-norm", str(o.get("clip_grad_norm", 0.0))]
    return args, int(t.get("batch_size", 16)), int(m.get("seq_len", 128))


def train(ctx, model, nproc, steps, sets, name, trace=False):
    exe = ctx.ensure_built("meshtrain")
    metrics = ctx.workdir / f"{name}.jsonl"
    cmd = [exe, "train", "--config", config_file(model), "--nproc", str(nproc), "--quiet"]
    for kv in [f"train.steps={steps}", "train.eval=false", "train.threads=1",
               'train.checkpoint=""', "optim.name=adamw", f"dist.bucket_mb={BUCKET_MB}"] + sets:
        cmd += ["--set", kv]
    cmd += ["--metrics", metrics]
    if trace:
        cmd += ["--trace", ctx.workdir / f"{name}.trace.json"]
    env = thread_env(1)
    env.update(mpi_env())
    ctx.log(f"{name}: {' '.join(str(c) for c in cmd[1:])}")
    r = ctx.run(cmd, env, name)
    summary = summary_line(metrics)
    error = None if r.ok and summary else f"meshtrain: {r.failure() if not r.ok else 'no summary'}"
    return summary, error, r


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peer_fsdp(ctx, model, nproc, steps):
    """nproc ranks of torch_train.py --fsdp; (rank 0's line plus max_rank_rss_kib, error, child)."""
    py = ctx.torch_python()
    args, _, _ = peer_args(model)
    warmup = 2 if steps > 4 else 1
    env = thread_env(1)
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                "WORLD_SIZE": str(nproc)})
    started = []
    for rank in range(nproc):
        env_r = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
        started.append(ctx.start([py, PEERS / "torch_train.py", "--model", "gpt", "--threads", "1",
                                  "--steps", str(max(1, steps - warmup)), "--warmup", str(warmup),
                                  "--world", str(nproc), "--rank", str(rank), "--fsdp", *args],
                                 env_r, f"torch-fsdp-{model}-np{nproc}-r{rank}",
                                 wait_idle=rank == 0))
    results = ctx.finish(started)
    bad = [r for r in results if not r.ok]
    if bad:
        return None, "; ".join(r.failure() for r in bad), results[0]
    lines = [r.json_lines() for r in results]
    if not all(lines):
        return None, "an FSDP rank printed no result line", results[0]
    res = dict(lines[0][-1], max_rank_rss_kib=max(r.maxrss_kib for r in results),
               rank_rss_kib=[r.maxrss_kib for r in results],
               max_import_rss_kib=max(ln[-1]["import_maxrss_kib"] for ln in lines))
    return res, None, results[0]


def cat(summary, key, rank=0):
    """Rank `rank`'s allocator bytes by category from the summary."""
    for r in summary.get("ranks", []):
        if r.get("rank") == rank:
            return r.get(key, {})
    return summary.get(key, {}) if rank == 0 else {}


def state_bytes(c):
    return c.get("params", 0) + c.get("grads", 0) + c.get("optimizer", 0)


def run_model(ctx, model, ranks):
    steps = ctx.args.steps or MODELS[model]["steps"][1 if ctx.quick else 0]
    stages = [int(x) for x in ctx.args.stages.split(",") if x]
    rss_by_n, state_by_n, stage3 = {}, {}, {}
    for n in ranks:
        stage0 = None
        for stage in [st for st in stages if n > 1 or st in (0, 3)]:
            s, err, child = train(ctx, model, n, steps, [f"dist.zero_stage={stage}"],
                                  f"{model}-np{n}-zero{stage}")
            line = {"name": f"{model}_zero{stage}_np{n}_state_bytes_per_rank", "unit": "bytes",
                    "model": model, "config": f"configs/{MODELS[model]['config']}.toml",
                    "ranks": n, "stage": stage, "steps": steps, "bucket_mb": BUCKET_MB,
                    "others_cpu": child.others_cpu}
            if err:
                line.update({"value": None, "error": err})
                ctx.emit(line)
                continue
            p = s["param_bytes"]
            o = 2 * p  # AdamW: two f32 moments per parameter
            expected = [p + p + o, p + p + o / n, p + p / n + o / n, (p + p + o) / n][stage]
            per_rank = [state_bytes(r["mem_live_bytes"]) for r in s["ranks"]]
            value = max(per_rank)
            if stage == 0:
                stage0 = value
            rss = [round(r["peak_rss_bytes"] / 2**20, 1) for r in s["ranks"]]
            line.update({
                "value": value, "expected": round(expected),
                "within": round(value / expected, 4),
                "of_stage0": round(value / stage0, 4) if stage0 else None,
                "state_bytes_by_rank": per_rank,
                "buffers": max(r["mem_live_bytes"].get("comm", 0) for r in s["ranks"]),
                "expected_buffers": s.get("dp_expected_buffer_bytes"),
                "peak_rss_mib": rss, "max_peak_rss_mib": max(rss),
                "mem_live_bytes": cat(s, "mem_live_bytes"),
                "mem_peak_bytes": cat(s, "mem_peak_bytes"),
                "samples_per_s": s.get("samples_per_s"), "tokens_per_s": s.get("tokens_per_s"),
                "samples_per_s_includes_warmup": s.get("samples_per_s_includes_warmup")})
            ctx.emit(line)
            if stage == 3:
                rss_by_n[n], state_by_n[n] = max(rss), value
                stage3[n] = dict(s, others_cpu=child.others_cpu)
    if stage3:
        ctx.emit({"name": f"{model}_zero3_rss_by_ranks", "unit": "MiB", "model": model,
                  "ranks": sorted(rss_by_n),
                  "value": [rss_by_n[n] for n in sorted(rss_by_n)],
                  "state_mib": [round(state_by_n[n] / 2**20, 1) for n in sorted(state_by_n)],
                  "note": "largest rank's peak RSS at ZeRO-3 per world size, model state beside"})
    return steps, stage3


def compare_fsdp(ctx, model, steps, stage3):
    _, batch, seq = peer_args(model)
    for n in sorted(stage3):
        if n < 2:
            continue
        s = stage3[n]
        p, err, child = peer_fsdp(ctx, model, n, steps)
        version = (p or {}).get("torch_version", "?")
        common = {"model": model, "ranks": n, "batch": batch, "local_batch": batch // n,
                  "seq": seq, "steps": steps, "threads_per_process": 1,
                  "peer_name": f"pytorch-{version} FSDP2 fully_shard gloo eager",
                  "meshtrain_others_cpu": s.get("others_cpu"),
                  "peer_others_cpu": child.others_cpu}
        mt_rss = max(r["peak_rss_bytes"] for r in s["ranks"]) / 2**20
        line = {"name": f"{model}_zero3_np{n}_vs_fsdp_peak_rss", "unit": "MiB",
                "meshtrain": round(mt_rss, 1), **common,
                "note": "largest rank's ru_maxrss; the peer builds the whole model on every "
                        "rank before sharding it (fully_shard's usual CPU use)"}
        if p:
            line.update({"peer": mib(p["max_rank_rss_kib"]),
                         "ratio": round(ratio(p["max_rank_rss_kib"] / 1024.0, mt_rss), 3),
                         "meshtrain_of_peer": round(ratio(mt_rss, p["max_rank_rss_kib"] / 1024.0),
                                                    3),
                         "peer_rank_rss_mib": [mib(k) for k in p["rank_rss_kib"]],
                         "peer_import_rss_mib": mib(p["max_import_rss_kib"])})
        else:
            line.update({"peer": None, "ratio": None, "error": f"peer: {err}"})
        ctx.emit(line)
        mt_rate = s.get("tokens_per_s")
        line = {"name": f"{model}_zero3_np{n}_vs_fsdp_throughput", "unit": "tokens/s",
                "meshtrain": mt_rate, **common,
                "meshtrain_includes_warmup": s.get("samples_per_s_includes_warmup")}
        if p:
            line.update({"peer": p.get("tokens_per_s"),
                         "ratio": ratio(mt_rate, p.get("tokens_per_s"))})
        else:
            line.update({"peer": None, "ratio": None, "error": f"peer: {err}"})
        ctx.emit(line)


def run(ctx):
    models = [m for m in ctx.args.models.split(",") if m]
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"bench zero: --models: unknown '{m}' (expected {', '.join(MODELS)})")
    ranks = [int(x) for x in ctx.args.ranks.split(",") if x]
    for model in models:
        steps, stage3 = run_model(ctx, model, ranks)
        if not ctx.args.no_peer:
            compare_fsdp(ctx, model, steps, stage3)
    if ctx.args.no_overlap or "gpt" not in models:
        return
    for overlap in ("true", "false"):
        s, err, _ = train(ctx, "gpt", 2, 8, [f"dist.overlap={overlap}"],
                          f"gpt-np2-overlap-{overlap}", trace=True)
        line = {"name": f"gpt_np2_comm_hidden_fraction_overlap_{overlap}", "unit": "fraction",
                "model": "gpt", "ranks": 2}
        if err:
            line.update({"value": None, "error": err})
        else:
            line.update({"value": s.get("comm_hidden_fraction"),
                         "samples_per_s": s.get("samples_per_s"),
                         "comm_wait_s_per_step": s.get("comm_wait_s_per_step")})
        ctx.emit(line)
