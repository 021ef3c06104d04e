#!/usr/bin/env python3
"""PyTorch pipelining peer for `bench/run spmd`: the GPT of torch_train.py cut
into pipeline stages and trained with torch.distributed.pipelining over gloo
(one process per stage), printing one JSON line per rank with the median step
throughput, like torch_train.py.

    MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 WORLD_SIZE=2 RANK=r \\
        build/bench-venv/bin/python bench/peers/torch_pipe.py --rank r --world 2 \\
        --schedule 1f1b --microbatches 4 --layers 4 --d-model 256 --heads 4 --seq 128

Stages: the blocks are split evenly over world x virtual stages chunks; the
first chunk also holds the embeddings, the last the final layer norm and the
output head. PyTorch's pipelining cannot tie a weight across stages, so the
head is its own copy of the token embedding (meshtrain keeps them tied and
sums their gradients between the first and last stage). Schedules: gpipe
(ScheduleGPipe), 1f1b (Schedule1F1B), interleaved (ScheduleInterleaved1F1B,
2 chunks per rank), zero_bubble (ScheduleInterleavedZeroBubble, 2 chunks per
rank: PyTorch has no one-chunk zero-bubble schedule), zbv (ScheduleZBVZeroBubble:
2 chunks per rank in a V, rank r holding chunks r and 2*world-1-r, the loss on
rank 0), dualpipev (ScheduleDualPipeV: the same V, DualPipeV's order).
"""

import argparse
import json
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch_train  # noqa: E402  (the same GPT, thread pinning, engines)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved", "zero_bubble", "zbv",
                                                 "dualpipev"],
                   default="1f1b")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-4)
    return p.parse_args(argv)


def main(argv):
    a = parse_args(argv)
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleaved1F1B,
                                              ScheduleInterleavedZeroBubble,
                                              ScheduleDualPipeV, ScheduleZBVZeroBubble)

    threads = torch_train.set_threads(a.threads)
    torch.manual_seed(0)
    ta = argparse.Namespace(model="gpt", layers=a.layers, d_model=a.d_model, heads=a.heads,
                            seq=a.seq, hidden=[], conv_channels=[], fc=0, tp=1)
    gpt = torch_train.build_model(ta)
    v = 2 if a.schedule in ("interleaved", "zero_bubble", "zbv", "dualpipev") else 1
    v_shaped = a.schedule in ("zbv", "dualpipev")
    chunks = a.world * v
    if a.layers % chunks != 0:
        raise SystemExit(f"torch_pipe: {a.layers} layers do not split into {chunks} chunks")
    per = a.layers // chunks

    class Chunk(nn.Module):
        def __init__(self, index):
            super().__init__()
            self.first, self.last = index == 0, index == chunks - 1
            if self.first:
                self.wte, self.wpe = gpt.wte, gpt.wpe
                self.register_buffer("pos", torch.arange(a.seq), persistent=False)
            self.blocks = nn.ModuleList(gpt.blocks[index * per:(index + 1) * per])
            if self.last:
                self.ln_f = gpt.ln_f
                self.head = nn.Linear(a.d_model, torch_train.VOCAB, bias=False)
                self.head.weight.data.copy_(gpt.wte.weight.data)  # untied copy

        def forward(self, x):
            if self.first:
                x = self.wte(x) + self.wpe(self.pos)
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.ln_f(x)) if self.last else x

    dist.init_process_group("gloo", rank=a.rank, world_size=a.world)
    mine = ([a.rank, 2 * a.world - 1 - a.rank] if v_shaped else
            [a.rank + k * a.world for k in range(v)])
    mb = a.batch // a.microbatches
    stages, params = [], []
    for idx in mine:
        mod = Chunk(idx)
        params += list(mod.parameters())
        example = (torch.zeros(mb, a.seq, dtype=torch.long) if idx == 0 else
                   torch.zeros(mb, a.seq, a.d_model))
        stages.append(PipelineStage(mod, idx, chunks, torch.device("cpu"), input_args=example))

    def loss_fn(logits, y):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
           "zero_bubble": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble,
           "dualpipev": ScheduleDualPipeV}[a.schedule]
    schedule = cls(stages[0] if v == 1 else stages, a.microbatches, loss_fn=loss_fn)
    opt = torch.optim.AdamW(params, lr=a.lr)
    gen = torch.Generator().manual_seed(1000)
    batches = []
    for _ in range(4):
        tok = torch.randint(0, torch_train.VOCAB, (a.batch, a.seq + 1), generator=gen)
        batches.append((tok[:, :-1].contiguous(), tok[:, 1:].contiguous()))
    last_rank = 0 if v_shaped else (chunks - 1) % a.world
    times = []
    for i in range(a.warmup + a.steps):
        x, y = batches[i % len(batches)]
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if a.rank == 0 and a.rank == last_rank:
            schedule.step(x, target=y)
        elif a.rank == 0:
            schedule.step(x)
        elif a.rank == last_rank:
            schedule.step(target=y)
        else:
            schedule.step()
        opt.step()
        times.append(time.perf_counter() - t0)
    timed = times[a.warmup:]
    med = statistics.median(timed)
    result = {"model": "gpt", "parallel": "pp", "schedule": a.schedule, "world": a.world,
              "rank": a.rank, "microbatches": a.microbatches, "virtual_stages": v,
              "threads": a.threads, "peer_threads": threads, "batch": a.batch, "seq": a.seq,
              "steps": a.steps, "warmup": a.warmup, "samples_per_s": a.batch / med,
              "tokens_per_s": a.batch * a.seq / med, "step_ms_median": med * 1e3,
              "torch_version": torch.__version__, **torch_train.torch_context(),
              "self_maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}
    dist.destroy_process_group()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
