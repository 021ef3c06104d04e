#!/usr/bin/env python3
"""PyTorch peer of `bench/run sync`: data-parallel training of the MLP / CNN
on real Fashion-MNIST over gloo, with PyTorch's own communication schemes:

  --hook none       DistributedDataParallel, dense f32 all-reduce (one
                    bucket for every hook: see main())
  --hook fp16       DDP with default_hooks.fp16_compress_hook
  --hook powersgd   DDP with powerSGD_hook.powerSGD_hook (rank --powersgd-rank,
                    error feedback and warm start on, compression from step
                    --powersgd-start; PyTorch refuses a start <= 1 with error
                    feedback)
  --hook postlocal  PyTorch's post-local SGD: post_localSGD_hook (dense
                    all-reduce for the first --sync-until steps) plus
                    PeriodicModelAverager(period --period), each rank alone in
                    its subgroup afterwards (pure local SGD between averages)

One process per rank (--world, --rank; MASTER_ADDR / MASTER_PORT from the
environment, as torchrun sets them). The global batch --batch is one seeded
permutation per epoch (the same on every rank); rank r trains on its r-th
contiguous share. Model, data, optimizer and schedule as torch_accuracy.py
(the values of meshtrain's config). Every --eval-every steps rank 0
evaluates the whole test split (outside the step clock; the other ranks wait
for it at the next exchange, which is also outside their clock as far as
rank 0's times go). Rank 0 prints one JSON line: per-step seconds (rank 0's
step, the exchange included), the evaluations (step, train seconds so far,
accuracy), the final test accuracy. gloo does not count bytes: the line has
none.
"""

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torch_accuracy import evaluate, fashion, lr_at  # noqa: E402
from torch_train import build_model, set_threads, torch_context  # noqa: E402


def int_list(text):
    return [int(x) for x in text.split(",") if x]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["mlp", "cnn"], default="cnn")
    p.add_argument("--hook", choices=["none", "fp16", "powersgd", "postlocal"], default="none")
    p.add_argument("--powersgd-rank", type=int, default=4)
    p.add_argument("--powersgd-start", type=int, default=2)
    p.add_argument("--period", type=int, default=8, help="postlocal: steps between averages")
    p.add_argument("--sync-until", type=int, default=100,
                   help="postlocal: dense all-reduce for this many steps first")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--eval-batch", type=int, default=1000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--mean", type=float, default=0.2860)
    p.add_argument("--std", type=float, default=0.3530)
    p.add_argument("--hidden", type=int_list, default=[512, 512])
    p.add_argument("--conv-channels", type=int_list, default=[32, 64])
    p.add_argument("--fc", type=int, default=128)
    p.add_argument("--opt", choices=["sgd"], default="sgd")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--nesterov", action="store_true")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--schedule", choices=["constant", "cosine"], default="constant")
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--min-lr", type=float, default=0.0)
    a = p.parse_args(argv)
    if a.batch % a.world:
        p.error(f"--batch {a.batch} is not divisible by --world {a.world}")
    return a


def main(argv):
    a = parse_args(argv)
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    peer_threads = set_threads(a.threads)
    dist.init_process_group("gloo", rank=a.rank, world_size=a.world)
    torch.manual_seed(a.seed)  # the same initial parameters on every rank (DDP broadcasts too)
    xtr, ytr = fashion(a, "train")
    xte, yte = fashion(a, "test") if a.rank == 0 else (None, None)
    # One gradient bucket: the PowerSGD hook chains several collectives per
    # bucket through futures, and with two buckets (DDP's first one is 1 MiB)
    # the chains interleave in a different order on different ranks, which
    # gloo, matching collectives by issue order, cannot take ("Received data
    # size doesn't match expected size"). The CNN's 1.7 MB fit one bucket.
    dist._DEFAULT_FIRST_BUCKET_BYTES = 256 * 2**20
    model = DistributedDataParallel(build_model(a), bucket_cap_mb=256)
    averager = None
    if a.hook == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif a.hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
        state = powerSGD_hook.PowerSGDState(process_group=None,
                                            matrix_approximation_rank=a.powersgd_rank,
                                            start_powerSGD_iter=a.powersgd_start,
                                            use_error_feedback=True, warm_start=True)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif a.hook == "postlocal":
        from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        # Each rank alone in its subgroup: after --sync-until steps the hook's
        # per-step all-reduce covers one rank (nothing), and only the
        # averager's every --period steps crosses ranks.
        alone, _ = dist.new_subgroups(group_size=1)
        state = post_localSGD_hook.PostLocalSGDState(process_group=None, subgroup=alone,
                                                     start_localSGD_iter=a.sync_until)
        model.register_comm_hook(state, post_localSGD_hook.post_localSGD_hook)
        averager = PeriodicModelAverager(period=a.period, warmup_steps=a.sync_until)
    params = list(model.parameters())
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    opt = torch.optim.SGD([{"params": decay, "weight_decay": a.weight_decay},
                           {"params": rest, "weight_decay": 0.0}],
                          lr=a.lr, momentum=a.momentum, nesterov=a.nesterov)
    per_epoch = len(xtr) // a.batch
    local = a.batch // a.world
    gen = torch.Generator()
    step_s, evals, train_s, loss = [], [], 0.0, float("nan")
    total = a.steps
    step = 0
    wall0 = time.perf_counter()
    while step < total:
        epoch = step // per_epoch
        gen.manual_seed(a.seed + epoch)
        order = torch.randperm(len(xtr), generator=gen)
        for s in range(per_epoch):
            if step >= total:
                break
            idx = order[s * a.batch + a.rank * local:s * a.batch + (a.rank + 1) * local]
            t0 = time.perf_counter()
            for g in opt.param_groups:
                g["lr"] = lr_at(a, step, total)
            opt.zero_grad(set_to_none=True)
            out = F.cross_entropy(model(xtr[idx]), ytr[idx])
            out.backward()
            opt.step()
            if averager is not None:
                averager.average_parameters(params)
            loss = float(out.detach())
            dt = time.perf_counter() - t0
            if not math.isfinite(loss):
                raise SystemExit(f"torch_sync: loss is {loss} at step {step}")
            step += 1
            step_s.append(dt)
            train_s += dt
            if a.rank == 0 and (step % a.eval_every == 0 or step == total):
                # Post-local SGD's replicas drift between averages: rank 0's own
                # parameters are evaluated (the averaged ones right after an
                # average, when step % period == 0).
                _, acc, _ = evaluate(model.module, xte, yte, a.eval_batch)
                evals.append({"step": step, "train_s": train_s, "test_accuracy": acc})
    wall = time.perf_counter() - wall0
    if a.rank == 0:
        print(json.dumps({
            "model": a.model, "hook": a.hook, "world": a.world, "steps": step, "batch": a.batch,
            "peer_threads": peer_threads, "final_loss": loss, "step_s": step_s, "evals": evals,
            "test_accuracy": evals[-1]["test_accuracy"] if evals else None,
            "train_s": train_s, "wall_s": wall, "torch_version": torch.__version__,
            **torch_context(),
        }), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
