#!/usr/bin/env python3
"""PyTorch peer for the meshtrain benchmarks: trains the same MLP / CNN / GPT
that meshtrain trains, on synthetic data of the same shapes, and prints one
JSON line with the median step throughput.

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

MODELS = {
    # name: (global batch, optimizer, items per sample for the "tokens" unit)
    "mlp": {"batch": 128, "opt": "sgd"},
    "cnn": {"batch": 128, "opt": "sgd"},
    "gpt": {"batch": 16, "opt": "adamw", "seq": 128},
}

GPT_CFG = {"layers": 4, "d_model": 256, "heads": 4, "seq": 128, "vocab": 256}


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
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


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


def build_model(name):
    import torch
    from torch import nn
    import torch.nn.functional as F

    if name == "mlp":
        return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                             nn.Linear(512, 10))
    if name == "cnn":
        return nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))

    c = GPT_CFG

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
            nh = c["heads"]

            def split(z):
                return z.view(b, t, nh, d // nh).transpose(1, 2)

            a = F.scaled_dot_product_attention(split(self.q(h)), split(self.k(h)),
                                               split(self.v(h)), is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
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


def make_batches(name, batch, count, gen):
    """Returns `count` random (input, target) pairs shaped like the real data."""
    import torch

    out = []
    for _ in range(count):
        if name == "mlp":
            x = torch.rand(batch, 784, generator=gen)
            y = torch.randint(0, 10, (batch,), generator=gen)
        elif name == "cnn":
            x = torch.rand(batch, 1, 28, 28, generator=gen)
            y = torch.randint(0, 10, (batch,), generator=gen)
        else:
            tok = torch.randint(0, GPT_CFG["vocab"], (batch, GPT_CFG["seq"] + 1), generator=gen)
            x, y = tok[:, :-1].contiguous(), tok[:, 1:].contiguous()
        out.append((x, y))
    return out


def main(argv):
    a = parse_args(argv)
    spec = MODELS[a.model]
    global_batch = a.batch or spec["batch"]
    if global_batch % a.world != 0:
        raise SystemExit(f"torch_train: batch {global_batch} is not divisible by world {a.world}")
    local_batch = global_batch // a.world

    import torch
    import torch.nn.functional as F

    # What loading torch alone costs (its shared libraries, the CUDA ones of the
    # PyPI wheel included), so readers can tell it apart from training memory.
    import_maxrss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peer_threads = set_threads(a.threads)
    torch.manual_seed(a.seed + a.rank)

    model = build_model(a.model)
    params = sum(p.numel() for p in model.parameters())
    if a.world > 1:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group("gloo", rank=a.rank, world_size=a.world)
        model = DistributedDataParallel(model)
    if spec["opt"] == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    step_model = torch.compile(model) if a.mode == "compile" else model

    gen = torch.Generator().manual_seed(1000 + a.seed + a.rank)
    batches = make_batches(a.model, local_batch, 4, gen)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        logits = step_model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
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
        "rank": a.rank,
        "batch": global_batch,
        "local_batch": local_batch,
        "steps": a.steps,
        "warmup": a.warmup,
        "samples_per_s": global_batch / median,
        "step_ms_median": median * 1e3,
        "step_ms_min": min(timed) * 1e3,
        "step_ms_max": max(timed) * 1e3,
        "warmup_s": sum(times[:a.warmup]),
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "params": params,
        "torch_version": torch.__version__,
        "import_maxrss_kib": import_maxrss_kib,
        "self_maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }
    if "seq" in spec:
        result["seq"] = spec["seq"]
        result["tokens_per_s"] = result["samples_per_s"] * spec["seq"]
    if a.world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
