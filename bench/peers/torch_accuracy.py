#!/usr/bin/env python3
"""PyTorch peer of the accuracy suite: trains the MLP, CNN or GPT on the real
data meshtrain trains on (Fashion-MNIST idx.gz files, byte-level text) with the
same model, batch, optimizer, learning-rate schedule and length, evaluates on
the same test split, and prints one JSON line with test accuracy and loss.

Run by `bench/run accuracy`, which passes the values of meshtrain's config
file; by hand, e.g.

    build/bench-venv/bin/python bench/peers/torch_accuracy.py --model mlp --epochs 5 \\
        --threads 2 --opt sgd --lr 0.05 --nesterov --weight-decay 0.0005 \\
        --schedule cosine --warmup-steps 100

What is the same as meshtrain (src/meshtrain/data, train): the training split
cut into batches of --batch, the last partial batch dropped, a fresh random
order every epoch (seeded; not meshtrain's permutation, which uses its own
generator); Fashion-MNIST pixels as (x/255 - mean) / std; text as the sorted
plain-text files of the directory concatenated, the last --test-fraction held
out, windows of seq+1 bytes at stride seq; the learning rate per step
lr * (s+1)/warmup during warm-up, then constant or cosine down to --min-lr at
the last step; weight decay only on parameters of rank >= 2 (meshtrain's
default filter: not biases, not layer-norm gains); SGD's weight decay added to
the gradient, AdamW's decoupled. The test loss is the mean over all test
examples (text: all test tokens), the accuracy the share of arg-max hits.
"""

import argparse
import gzip
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torch_train import VOCAB, build_model, set_threads, torch_context  # noqa: E402


def int_list(text):
    return [int(x) for x in text.split(",") if x]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["mlp", "cnn", "gpt"], required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--steps", type=int, default=0, help="> 0: stop after this many steps")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--eval-batch", type=int, default=1000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--text", default="/usr/share/games/fortunes")
    p.add_argument("--test-fraction", type=float, default=0.1)
    p.add_argument("--mean", type=float, default=0.2860)
    p.add_argument("--std", type=float, default=0.3530)
    p.add_argument("--hidden", type=int_list, default=[512, 512])
    p.add_argument("--conv-channels", type=int_list, default=[32, 64])
    p.add_argument("--fc", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--opt", choices=["sgd", "adamw"], default="sgd")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--nesterov", action="store_true")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.999)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--clip-grad-norm", type=float, default=0.0)
    p.add_argument("--schedule", choices=["constant", "cosine"], default="constant")
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--min-lr", type=float, default=0.0)
    return p.parse_args(argv)


def read_idx(path):
    """An idx(.gz) file as a numpy array (u8 images or labels)."""
    import numpy as np

    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def idx_file(directory, stem):
    for name in (f"{stem}.gz", stem):
        if (Path(directory) / name).exists():
            return Path(directory) / name
    raise SystemExit(f"torch_accuracy: {directory}/{stem}(.gz) not found "
                     "(Debian package dataset-fashion-mnist)")


def fashion(a, split):
    import numpy as np
    import torch

    prefix = "train" if split == "train" else "t10k"
    x = read_idx(idx_file(a.data_dir, f"{prefix}-images-idx3-ubyte")).astype(np.float32) / 255.0
    y = read_idx(idx_file(a.data_dir, f"{prefix}-labels-idx1-ubyte")).astype(np.int64)
    x = (x - a.mean) / a.std
    x = torch.from_numpy(x.copy())
    x = x.reshape(len(x), 784) if a.model == "mlp" else x.reshape(len(x), 1, 28, 28)
    return x, torch.from_numpy(y.copy())


def text_windows(a, split):
    """(inputs, targets) of every window of the split, as meshtrain's ByteText."""
    import numpy as np
    import torch

    path = Path(a.text)
    if path.is_dir():
        parts = []
        for f in sorted(p for p in path.iterdir() if p.is_file() and not p.is_symlink()):
            s = f.read_bytes()
            if s and b"\0" not in s:
                parts.append(s)
        data = b"".join(parts)
    else:
        data = path.read_bytes()
    cut = math.floor(len(data) * (1.0 - a.test_fraction))
    data = data[:cut] if split == "train" else data[cut:]
    t = a.seq
    n = (len(data) - (t + 1)) // t + 1
    buf = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).astype(np.int64))
    idx = torch.arange(n).unsqueeze(1) * t + torch.arange(t + 1).unsqueeze(0)
    w = buf[idx]
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def lr_at(a, step, total):
    if step < a.warmup_steps:
        return a.lr * (step + 1) / a.warmup_steps
    if a.schedule == "constant":
        return a.lr
    if step >= total:
        return a.min_lr
    progress = (step - a.warmup_steps) / (total - a.warmup_steps)
    return a.min_lr + (a.lr - a.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def evaluate(model, x, y, batch):
    import torch
    import torch.nn.functional as F

    loss_sum, correct, count = 0.0, 0, 0
    model.eval()
    with torch.no_grad():
        for i in range(0, len(x), batch):
            logits = model(x[i:i + batch])
            logits = logits.reshape(-1, logits.shape[-1])
            target = y[i:i + batch].reshape(-1)
            loss_sum += float(F.cross_entropy(logits, target, reduction="sum"))
            correct += int((logits.argmax(dim=1) == target).sum())
            count += target.numel()
    model.train()
    return loss_sum / count, correct / count, count


def main(argv):
    a = parse_args(argv)
    import torch
    import torch.nn.functional as F

    peer_threads = set_threads(a.threads)
    torch.manual_seed(a.seed)
    if a.model == "gpt":
        xtr, ytr = text_windows(a, "train")
        xte, yte = text_windows(a, "test")
    else:
        xtr, ytr = fashion(a, "train")
        xte, yte = fashion(a, "test")
    model = build_model(a)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": a.weight_decay},
              {"params": rest, "weight_decay": 0.0}]
    if a.opt == "sgd":
        opt = torch.optim.SGD(groups, lr=a.lr, momentum=a.momentum, nesterov=a.nesterov)
    else:
        opt = torch.optim.AdamW(groups, lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps)

    per_epoch = len(xtr) // a.batch
    total = a.epochs * per_epoch
    if a.steps > 0:
        total = min(total, a.steps)
    gen = torch.Generator().manual_seed(a.seed)
    step, t0, loss = 0, time.perf_counter(), float("nan")
    while step < total:
        epoch = step // per_epoch
        gen.manual_seed(a.seed + epoch)
        order = torch.randperm(len(xtr), generator=gen)
        for s in range(per_epoch):
            if step >= total:
                break
            idx = order[s * a.batch:(s + 1) * a.batch]
            for g in opt.param_groups:
                g["lr"] = lr_at(a, step, total)
            opt.zero_grad(set_to_none=True)
            logits = model(xtr[idx])
            out = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ytr[idx].reshape(-1))
            out.backward()
            if a.clip_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip_grad_norm)
            opt.step()
            loss = float(out.detach())
            if not math.isfinite(loss):
                raise SystemExit(f"torch_accuracy: loss is {loss} at step {step}")
            step += 1
    train_s = time.perf_counter() - t0
    test_loss, test_acc, examples = evaluate(model, xte, yte, a.eval_batch)
    print(json.dumps({
        "model": a.model, "threads": a.threads, "peer_threads": peer_threads, "steps": step,
        "epochs": step / per_epoch, "batch": a.batch, "final_loss": loss,
        "test_loss": test_loss, "test_accuracy": test_acc,
        "test_examples": len(xte), "test_targets": examples, "train_s": train_s,
        "torch_version": torch.__version__, **torch_context(),
    }), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    sys.exit(main(sys.argv[1:]))
