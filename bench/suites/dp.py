"""Data parallel, 2 processes x 1 thread: meshtrain --nproc 2 vs PyTorch DDP over gloo.

Both train with the same global batch as the core suite (per-rank batch =
global / 2). For each model it prints
  <model>_dp2_throughput          samples/s (tokens/s for GPT), ratio = meshtrain/peer
  <model>_dp2_scaling_efficiency  value = 2-process rate / (2 x own 1-process rate),
                                  one line per system ("system": meshtrain | peer name)
"""

import socket

import meshtrain
from common import MODEL_PLAN as PLAN
from common import (PEERS, meshtrain_engine_context, parse_models, ratio, steps_for, thread_env,
                    transport_context)

WORLD = 2


def add_args(p):
    p.add_argument("--models", default="mlp,cnn,gpt", help="comma-separated subset of mlp,cnn,gpt")
    p.add_argument("--peer-only", action="store_true", help="skip meshtrain (peer figures only)")


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peer_ddp(ctx, model, steps, warmup, setup_args):
    """Starts WORLD ranks of torch_train.py (torchrun's environment: MASTER_ADDR,
    MASTER_PORT; rank on the command line); returns (rank 0's result, error,
    max peak RSS over ranks in KiB)."""
    py = ctx.torch_python()
    env = thread_env(1)
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                "WORLD_SIZE": str(WORLD)})
    started = []
    for rank in range(WORLD):
        env_r = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
        started.append(ctx.start([py, PEERS / "torch_train.py", "--model", model, "--threads", "1",
                                  "--steps", str(steps), "--warmup", str(warmup),
                                  "--world", str(WORLD), "--rank", str(rank), *setup_args],
                                 env_r, f"torch-ddp-{model}-r{rank}", wait_idle=rank == 0))
    results = ctx.finish(started)
    bad = [r for r in results if not r.ok]
    if bad:
        return None, "; ".join(r.failure() for r in bad), results[0]
    lines = [r.json_lines() for r in results]
    if not all(lines):
        return None, "a DDP rank printed no result line", results[0]
    res = dict(lines[0][-1], max_rank_rss_kib=max(r.maxrss_kib for r in results))
    return res, None, results[0]


def peer_single(ctx, model, steps, warmup, setup_args):
    res, r = ctx.peer(["--model", model, "--threads", "1", "--steps", str(steps),
                       "--warmup", str(warmup), *setup_args], 1, f"torch-{model}-t1")
    return res, (None if res else r.failure()), r


def run(ctx):
    models = parse_models(ctx.args.models)
    ctx.torch_python()
    ctx.add_context(transport_context(distributed=True))
    for model in models:
        plan = PLAN[model]
        steps, warmup = steps_for(ctx, model)
        setup = meshtrain.peer_setup(model, plan["batch"])
        batch, seq, setup_args = setup["batch"], setup["seq"], setup["args"]
        if ctx.args.peer_only:
            mt1 = mt2 = meshtrain.MeshtrainRun(None, [], None, None, 0.0)
        else:
            mt1 = meshtrain.train(ctx, model, steps + warmup, 1)
            mt2 = meshtrain.train(ctx, model, steps + warmup, 1, nproc=WORLD)
        p1, err1, c1 = peer_single(ctx, model, steps, warmup, setup_args)
        p2, err2, c2 = peer_ddp(ctx, model, steps, warmup, setup_args)
        version = (p2 or p1 or {}).get("torch_version", "?")
        peer_name = f"pytorch-{version} DDP gloo eager"
        for label, res in (("1 process", p1), (f"DDP {WORLD} processes", p2)):
            if res:
                ctx.log(f"peer {model} {label}: {res['samples_per_s']:.1f} samples/s")
        def scaled(x):
            return x * seq if x else None

        def peer_fast(res):
            return res["batch"] / res["step_ms_p10"] * 1e3 * seq if res else None

        mt1_fast, mt2_fast = scaled(mt1.fast_samples_per_s(warmup)), scaled(
            mt2.fast_samples_per_s(warmup))
        p1_fast, p2_fast = peer_fast(p1), peer_fast(p2)
        mt1_rate = mt1.samples_per_s * seq if mt1.samples_per_s else None
        mt2_rate = mt2.samples_per_s * seq if mt2.samples_per_s else None
        p1_rate = p1["samples_per_s"] * seq if p1 else None
        p2_rate = p2["samples_per_s"] * seq if p2 else None
        ctx_fields = {"model": model, "processes": WORLD, "threads_per_process": 1,
                      "batch": batch, "local_batch": batch // WORLD,
                      "steps": steps, "warmup": warmup}
        if seq > 1:
            ctx_fields["seq"] = seq
        line = {"name": f"{model}_dp2_throughput", "unit": plan["unit"], "meshtrain": mt2_rate,
                "peer": p2_rate, "ratio": ratio(mt2_rate, p2_rate), "peer_name": peer_name,
                **ctx_fields, "meshtrain_fast": mt2_fast, "peer_fast": p2_fast,
                "ratio_fast": ratio(mt2_fast, p2_fast)}
        line["meshtrain_others_cpu"] = mt2.others_cpu
        line["peer_others_cpu"] = c2.others_cpu
        matmul = ctx.peer_matmul(model, 1, setup_args)
        line.update(meshtrain_engine_context(mt2.summary))
        line["peer_engines"] = (p2 or {}).get("peer_engines", matmul.get("peer_engines"))
        line["meshtrain_matmul_gflops"] = mt2.get("matmul_gflops")
        for key in ("peer_matmul_gflops", "peer_matmul_error"):
            if key in matmul:
                line[key] = matmul[key]
        if p2:
            line["peer_max_rank_rss_mib"] = round(p2["max_rank_rss_kib"] / 1024.0, 1)
        line["note"] = ("peer: torch DistributedDataParallel, gloo on 127.0.0.1, synthetic "
                        "random data; rank 0's median step time after warm-up")
        err = "; ".join(e for e in (mt2.error, f"peer: {err2}" if err2 else None) if e)
        if err:
            line["error"] = err
        ctx.emit(line)
        for system, two, one, fast, errs, busy in (
                ("meshtrain", mt2_rate, mt1_rate, (mt2_fast, mt1_fast), (mt1.error, mt2.error),
                 (mt1.others_cpu, mt2.others_cpu)),
                (peer_name, p2_rate, p1_rate, (p2_fast, p1_fast), (err1, err2),
                 (c1.others_cpu, c2.others_cpu))):
            line = {"name": f"{model}_dp2_scaling_efficiency", "unit": "fraction",
                    "value": ratio(two, None if one is None else WORLD * one),
                    "value_fast": ratio(fast[0], None if fast[1] is None else WORLD * fast[1]),
                    "system": system,
                    "rate_1proc": one, "rate_2proc": two, "rate_unit": plan["unit"],
                    "others_cpu_1proc": busy[0], "others_cpu_2proc": busy[1], **ctx_fields}
            err = "; ".join(e for e in errs if e)
            if err:
                line["error"] = err
            ctx.emit(line)
