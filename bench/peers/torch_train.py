#!/usr/bin/env python3
"""PyTorch peer for the meshtrain benchmarks: trains the same MLP / CNN / GPT
that meshtrain trains, on synthetic data of the same shapes, and prints one
JSON line with the median step throughput. bench/run passes the model sizes,
batch and optimizer settings of meshtrain's config file; the defaults here are
the benchmark models with SGD (momentum 0.9, lr 0.01) / AdamW (lr 3e-4).

Run by bench/run (core and dp suites), also usable by hand:

    build/bench-venv/bin/python bench/peers/torch_train.py --model gpt \
        --threads 1 --mode compile --steps 20 --warmup 5

Throughput does not depend on the values of the data, so the inputs are random
tensors generated before timing starts. Each step is timed on its own
(zero_grad, forward, loss, backward, optimizer step); the first --warmup steps
(which include torch.compile's compilation) are dropped, and samples/s is the
global batch divided by the median of the remaining step times.

Data parallel (--world 2): each process is one rank of a DistributedDataParallel
group over gloo (MASTER_ADDR / MASTER_PORT from the environment, --rank from the
command line); it trains on batch/world samples and every rank prints its line
(rank 0's step times are the group's: DDP's all-reduce keeps ranks in lock-step).
With --fsdp the group is PyTorch FSDP2 instead (`fully_shard` on each GPT block
and on the root, over a CPU device mesh): ZeRO-3's layout, parameters gathered
per block for forward and backward.

Tensor parallel (--tp N, GPT only, --world N): PyTorch's own tensor parallelism
(torch.distributed.tensor.parallel, Megatron's plan): each block's q, k, v and
fc ColwiseParallel, its proj and fc_proj RowwiseParallel, over a CPU device
mesh on gloo; every rank trains the whole global batch (the same batches on
every rank); embeddings, layer norms and the tied head stay replicated.
"""

import argparse
import json
import math
import os
import resource
import statistics
import sys
import time

# Must be decided before torch is imported: compile workers would otherwise be
# forked as separate processes, which on a 2-core box compete with the timed
# run and escape the peak-RSS measurement of this process.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# Defaults when run by hand; bench/run passes the values of meshtrain's config
# file (configs/*.toml) so both sides train the same model the same way.
MODELS = {
    "mlp": {"batch": 128, "opt": "sgd", "lr": 0.01},
    "cnn": {"batch": 128, "opt": "sgd", "lr": 0.01},
    "gpt": {"batch": 16, "opt": "adamw", "lr": 3e-4},
}
VOCAB = 256  # byte-level text


def int_list(text):
    return [int(x) for x in text.split(",") if x]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), required=True)
    p.add_argument("--mode", choices=["eager", "compile"], default="eager")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=30, help="timed steps after warm-up")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument("--batch", type=int, default=0, help="global batch (0: model default)")
    p.add_argument("--world", type=int, default=1, help="data-parallel processes")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree (GPT; --world must equal it)")
    p.add_argument("--fsdp", action="store_true",
                   help="with --world > 1: FSDP2 (fully_shard per GPT block and the root, "
                        "parameters, gradients and optimizer state sharded) instead of DDP")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--matmul-probe", action="store_true",
                   help="instead of timing training: record the matrix products of one eager "
                        "training step (forward and backward) and time torch's kernels on "
                        "exactly those shapes and strides; prints their GFLOP/s")
    m = p.add_argument_group("model (defaults: the benchmark models)")
    m.add_argument("--hidden", type=int_list, default=[512, 512], help="MLP hidden sizes")
    m.add_argument("--conv-channels", type=int_list, default=[32, 64], help="CNN conv channels")
    m.add_argument("--fc", type=int, default=128, help="CNN hidden fc size")
    m.add_argument("--layers", type=int, default=4)
    m.add_argument("--d-model", type=int, default=256)
    m.add_argument("--heads", type=int, default=4)
    m.add_argument("--seq", type=int, default=128)
    o = p.add_argument_group("optimizer (defaults: SGD momentum 0.9 lr 0.01; AdamW lr 3e-4)")
    o.add_argument("--opt", choices=["sgd", "adamw"], default=None)
    o.add_argument("--lr", type=float, default=None)
    o.add_argument("--momentum", type=float, default=0.9)
    o.add_argument("--nesterov", action="store_true")
    o.add_argument("--weight-decay", type=float, default=None,
                   help="default 0 for SGD, 0.01 for AdamW")
    o.add_argument("--beta1", type=float, default=0.9)
    o.add_argument("--beta2", type=float, default=0.999)
    o.add_argument("--eps", type=float, default=1e-8)
    o.add_argument("--clip-grad-norm", type=float, default=0.0, help="0: no clipping")
    a = p.parse_args(argv)
    spec = MODELS[a.model]
    a.opt = a.opt or spec["opt"]
    a.lr = a.lr if a.lr is not None else spec["lr"]
    if a.weight_decay is None:
        a.weight_decay = 0.0 if a.opt == "sgd" else 0.01
    return a


def set_threads(n):
    """Pins intra-op threads to n and inter-op threads to 1; returns what torch
    reports, so the caller can refuse to run with a different count."""
    import torch

    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        if os.environ.get(var) != str(n):
            raise SystemExit(f"torch_train: {var}={os.environ.get(var)!r} in the environment, "
                             f"expected {n} (set it before starting the process)")
    torch.set_num_threads(n)
    torch.set_num_interop_threads(1)
    got = torch.get_num_threads()
    if got != n:
        raise SystemExit(f"torch_train: torch.get_num_threads() is {got} after set_num_threads({n})")
    return got


def build_model(a):
    """The model a describes: MLP 784-hidden...-10, CNN (conv3x3 pad 1, relu,
    maxpool 2)* then fc-relu-fc to 10 classes on 1x28x28, or the GPT."""
    import torch
    from torch import nn
    import torch.nn.functional as F

    if a.model == "mlp":
        layers, width = [], 784
        for h in a.hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        return nn.Sequential(*layers, nn.Linear(width, 10))
    if a.model == "cnn":
        layers, ch, size = [], 1, 28
        for out in a.conv_channels:
            layers += [nn.Conv2d(ch, out, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
            ch, size = out, size // 2
        return nn.Sequential(*layers, nn.Flatten(), nn.Linear(ch * size * size, a.fc), nn.ReLU(),
                             nn.Linear(a.fc, 10))

    c = {"layers": a.layers, "d_model": a.d_model, "heads": a.heads, "seq": a.seq, "vocab": VOCAB}

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            d = c["d_model"]
            self.ln1 = nn.LayerNorm(d)
            self.q = nn.Linear(d, d)
            self.k = nn.Linear(d, d)
            self.v = nn.Linear(d, d)
            self.proj = nn.Linear(d, d)
            self.ln2 = nn.LayerNorm(d)
            self.fc = nn.Linear(d, 4 * d)
            self.fc_proj = nn.Linear(4 * d, d)

        def forward(self, x):
            b, t, d = x.shape
            h = self.ln1(x)
            hd = c["d_model"] // c["heads"]
            q, k, v = self.q(h), self.k(h), self.v(h)
            nh = q.shape[-1] // hd  # this rank's heads under tensor parallelism

            def split(z):
                return z.view(b, t, nh, hd).transpose(1, 2)

            a = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, nh * hd))
            return x + self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(c["vocab"], c["d_model"])
            self.wpe = nn.Embedding(c["seq"], c["d_model"])
            self.blocks = nn.ModuleList(Block() for _ in range(c["layers"]))
            self.ln_f = nn.LayerNorm(c["d_model"])
            self.register_buffer("pos", torch.arange(c["seq"]), persistent=False)

        def forward(self, idx):
            x = self.wte(idx) + self.wpe(self.pos)
            for blk in self.blocks:
                x = blk(x)
            return self.ln_f(x) @ self.wte.weight.t()  # tied output head

    gpt = GPT()
    # GPT-2's initialisation (as meshtrain's GPT): with PyTorch's default N(0, 1)
    # embeddings the tied head starts with logits of size ~16 and a loss of ~150.
    for mod in gpt.modules():
        if isinstance(mod, nn.Linear):
            nn.init.normal_(mod.weight, std=0.02)
            nn.init.zeros_(mod.bias)
    for blk in gpt.blocks:
        for proj in (blk.proj, blk.fc_proj):
            nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * c["layers"]))
    nn.init.normal_(gpt.wte.weight, std=0.02)
    nn.init.normal_(gpt.wpe.weight, std=0.01)
    return gpt


def make_batches(a, batch, count, gen):
    """Returns `count` random (input, target) pairs shaped like the real data."""
    import torch

    out = []
    for _ in range(count):
        if a.model == "mlp":
            x = torch.rand(batch, 784, generator=gen)
            y = torch.randint(0, 10, (batch,), generator=gen)
        elif a.model == "cnn":
            x = torch.rand(batch, 1, 28, 28, generator=gen)
            y = torch.randint(0, 10, (batch,), generator=gen)
        else:
            tok = torch.randint(0, VOCAB, (batch, a.seq + 1), generator=gen)
            x, y = tok[:, :-1].contiguous(), tok[:, 1:].contiguous()
        out.append((x, y))
    return out


def torch_context():
    """What the peer computes with: torch version, the BLAS its f32 matrix
    products go through (BLAS_INFO of torch.__config__.show(): mkl, openblas,
    ...), MKL's and oneDNN's versions as the build reports them, and the CPU
    kernel level torch dispatches to (torch.backends.cpu.get_cpu_capability())."""
    import re

    import torch

    show = torch.__config__.show()

    def find(pattern):
        m = re.search(pattern, show)
        return m.group(1).strip() if m else None

    blas = find(r"BLAS_INFO=([^,\s]+)")
    mkl = None
    if torch.backends.mkl.is_available():
        mkl = find(r"Math Kernel Library Version ([0-9.]+)")
    onednn = find(r"MKL-DNN (v[^\s]+)") if torch.backends.mkldnn.is_available() else None
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except AttributeError:
        capability = None
    parts = [f"BLAS {blas or 'unknown'}" + (f" (MKL {mkl})" if blas == "mkl" and mkl else "")]
    if onednn:
        parts.append(f"oneDNN {onednn}")
    return {"peer_blas": blas, "peer_mkl_version": mkl, "peer_onednn_version": onednn,
            "peer_cpu_capability": capability,
            "peer_engines": ", ".join(parts) + f"; kernels for {capability or 'unknown'}"}


MATMUL_OPS = ("mm", "addmm", "bmm", "baddbmm")


def matmul_probe(a, model, opt, batch):
    """Records the matrix products (aten mm, addmm, bmm, baddbmm) one eager
    training step of `model` runs, forward and backward, then times each of
    them again on fresh tensors of the same shapes and strides (transposed
    operands stay transposed). Returns {"peer_matmul_gflops": FLOPs / time
    over all of them, median of 5 passes, ...}. These are the GEMMs under the
    peer's layers; attention inside scaled_dot_product_attention is a fused
    kernel, not counted here."""
    import torch
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = []

    def spec(t):
        return (tuple(t.shape), tuple(t.stride()), t.dtype) if isinstance(t, torch.Tensor) else t

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func.overloadpacket.__name__ in MATMUL_OPS:
                calls.append((func, [spec(x) for x in args], dict(kwargs)))
            return func(*args, **kwargs)

    x, y = batch
    opt.zero_grad(set_to_none=True)
    with Recorder():
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()

    def flops(func, specs):
        name = func.overloadpacket.__name__
        mats = [s for s in specs if isinstance(s, tuple) and len(s) == 3 and len(s[0]) >= 2]
        p, q = mats[-2][0], mats[-1][0]  # the two factors (addmm/baddbmm: after the bias)
        if name in ("mm", "addmm"):
            return 2.0 * p[0] * p[1] * q[1]
        return 2.0 * p[0] * p[1] * p[2] * q[2]

    gen = torch.Generator().manual_seed(7)
    replay = []
    for func, specs, kwargs in calls:
        args = []
        for s in specs:
            if isinstance(s, tuple) and len(s) == 3 and isinstance(s[2], torch.dtype):
                t = torch.empty_strided(s[0], s[1], dtype=s[2])
                t.copy_(torch.rand(s[0], generator=gen) - 0.5)
                args.append(t)
            else:
                args.append(s)
        replay.append((func, args, kwargs, flops(func, specs)))
    total_flops = sum(r[3] for r in replay)
    if not replay:
        return {"peer_matmul_gflops": None, "peer_matmul_calls": 0}

    def one_pass():
        for func, args, kwargs, _ in replay:
            func(*args, **kwargs)

    one_pass()
    t0 = time.perf_counter()
    one_pass()
    reps = max(1, int(0.2 / max(time.perf_counter() - t0, 1e-6)))
    rates = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            one_pass()
        rates.append(total_flops * reps / (time.perf_counter() - t0) / 1e9)
    shapes = sorted({" x ".join("x".join(str(d) for d in s[0]) for s in specs
                               if isinstance(s, tuple) and len(s) == 3 and len(s[0]) >= 2)
                     for _, specs, _ in calls})
    return {"peer_matmul_gflops": statistics.median(rates), "peer_matmul_calls": len(replay),
            "peer_matmul_gflop_per_step": total_flops / 1e9, "peer_matmul_shapes": shapes,
            "peer_matmul_ops": sorted({f.overloadpacket.__name__ for f, _, _ in calls})}


def clip_tensor_parallel(model, max_norm):
    """clip_grad_norm_ for a model whose blocks are tensor-parallel DTensors
    and whose other parameters are plain replicated tensors (PyTorch's own
    clip refuses the mix): sharded gradients' squares are summed over the
    group, replicated ones counted once."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    sharded, replicated = torch.zeros(()), torch.zeros(())
    grads = []
    for p in model.parameters():
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            local = g.to_local()
            if any(pl.is_shard() for pl in g.placements):
                sharded += local.float().pow(2).sum()
            else:
                replicated += local.float().pow(2).sum()
            grads.append(local)
        else:
            replicated += g.float().pow(2).sum()
            grads.append(g)
    dist.all_reduce(sharded)
    total = (sharded + replicated).sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)


def describe_optimizer(a):
    if a.opt == "sgd":
        text = f"sgd lr={a.lr} momentum={a.momentum} nesterov={a.nesterov} wd={a.weight_decay}"
    else:
        text = f"adamw lr={a.lr} betas=({a.beta1},{a.beta2}) eps={a.eps} wd={a.weight_decay}"
    return text + (f" clip={a.clip_grad_norm}" if a.clip_grad_norm > 0 else "")


def main(argv):
    a = parse_args(argv)
    spec = MODELS[a.model]
    global_batch = a.batch or spec["batch"]
    if a.tp > 1 and (a.model != "gpt" or a.world != a.tp or a.fsdp):
        raise SystemExit("torch_train: --tp needs --model gpt and --world equal to --tp")
    dp = a.world // a.tp
    if global_batch % dp != 0:
        raise SystemExit(f"torch_train: batch {global_batch} is not divisible by world {a.world}")
    local_batch = global_batch // dp
    data_rank = a.rank if a.tp == 1 else 0  # tensor-parallel ranks read the same batches

    import torch
    import torch.nn.functional as F

    # What loading torch alone costs (its shared libraries, the CUDA ones of the
    # PyPI wheel included), so readers can tell it apart from training memory.
    import_maxrss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peer_threads = set_threads(a.threads)
    torch.manual_seed(a.seed + data_rank)

    model = build_model(a)
    params = sum(p.numel() for p in model.parameters())
    if a.world > 1:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group("gloo", rank=a.rank, world_size=a.world)
        if a.tp > 1:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                           parallelize_module)

            mesh = init_device_mesh("cpu", (a.tp,))
            for blk in model.blocks:
                parallelize_module(blk, mesh, {
                    "q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
                    "proj": RowwiseParallel(), "fc": ColwiseParallel(),
                    "fc_proj": RowwiseParallel()})
        elif a.fsdp:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (a.world,))
            for blk in getattr(model, "blocks", []):
                fully_shard(blk, mesh=mesh)
            fully_shard(model, mesh=mesh)
        else:
            model = DistributedDataParallel(model)
    if a.opt == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=a.momentum,
                              nesterov=a.nesterov, weight_decay=a.weight_decay)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps,
                                weight_decay=a.weight_decay)
    step_model = torch.compile(model) if a.mode == "compile" else model

    gen = torch.Generator().manual_seed(1000 + a.seed + data_rank)
    batches = make_batches(a, local_batch, 4, gen)

    if a.matmul_probe:
        result = {"model": a.model, "threads": a.threads, "peer_threads": peer_threads,
                  "batch": global_batch, "torch_version": torch.__version__, **torch_context(),
                  **matmul_probe(a, model, opt, batches[0])}
        print(json.dumps(result), flush=True)
        return 0

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        logits = step_model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        if a.clip_grad_norm > 0 and a.tp > 1:
            clip_tensor_parallel(model, a.clip_grad_norm)
        elif a.clip_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip_grad_norm)
        opt.step()
        return loss.detach()

    times, losses = [], []
    for i in range(a.warmup + a.steps):
        x, y = batches[i % len(batches)]
        t0 = time.perf_counter()
        loss = step(x, y)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
        if not math.isfinite(losses[-1]):
            raise SystemExit(f"torch_train: loss is {losses[-1]} at step {i}")

    timed = times[a.warmup:]
    median = statistics.median(timed)
    result = {
        "model": a.model,
        "mode": a.mode,
        "threads": a.threads,
        "peer_threads": peer_threads,
        "world": a.world,
        "parallel": ("tp" if a.tp > 1 else "fsdp" if a.fsdp else "ddp") if a.world > 1
                    else "none",
        "rank": a.rank,
        "batch": global_batch,
        "local_batch": local_batch,
        "steps": a.steps,
        "warmup": a.warmup,
        "samples_per_s": global_batch / median,
        "step_ms_median": median * 1e3,
        "step_ms_min": min(timed) * 1e3,
        # The fast end of the distribution: what the step costs when the
        # shared machine leaves it alone (bench/run's "best" figures).
        "step_ms_p10": sorted(timed)[int(0.1 * (len(timed) - 1))] * 1e3,
        "step_ms_max": max(timed) * 1e3,
        "warmup_s": sum(times[:a.warmup]),
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "params": params,
        "optimizer": describe_optimizer(a),
        "torch_version": torch.__version__,
        **torch_context(),
        "import_maxrss_kib": import_maxrss_kib,
        "self_maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }
    if a.model == "gpt":
        result["seq"] = a.seq
        result["tokens_per_s"] = result["samples_per_s"] * a.seq
    if a.world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
