#!/usr/bin/env python3
"""Checks a `meshtrain export` file against PyTorch: builds the equivalent
torch module (MLP, CNN, or the nanoGPT-style GPT) from the file's recorded
model_config, loads the weights with load_state_dict (every tensor of the file
used, none of the module's missing except the GPT's lm_head, which is tied to
the token embedding), runs the inputs that `meshtrain export --logits-for N`
recorded, and compares the logits with meshtrain's. Prints one JSON line;
exit status 0 when they agree within the tolerance, 1 when not, 2 for bad
input.

    build/bench-venv/bin/python bench/peers/torch_export_check.py \\
        --weights build/mlp.safetensors --logits build/mlp.logits.safetensors

Reads safetensors with its own few lines (the venv has torch and numpy, not
the safetensors package). The module definitions here are the documented
equivalents of meshtrain's models (docs/export.md): a transposed or
misplaced weight changes the logits by far more than the tolerance.
"""

import argparse
import json
import math
import struct
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

DTYPES = {"F32": np.float32, "F64": np.float64, "I32": np.int32, "I64": np.int64,
          "U8": np.uint8, "F16": np.float16}


def read_safetensors(path):
    """{name: torch.Tensor}, {metadata}."""
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    meta = header.pop("__metadata__", {})
    data = memoryview(blob)[8 + n:]
    out = {}
    for name, e in header.items():
        b, end = e["data_offsets"]
        if e["dtype"] not in DTYPES:
            raise ValueError(f"{path}: {name}: dtype {e['dtype']} not handled here")
        a = np.frombuffer(data[b:end], dtype=DTYPES[e["dtype"]]).reshape(e["shape"])
        out[name] = torch.from_numpy(a.copy())
    return out, meta


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        width = c["image_channels"] * c["image_size"] ** 2
        self.names = []
        for i, h in enumerate(c["hidden"]):
            setattr(self, f"fc{i + 1}", nn.Linear(width, h))
            self.names.append(f"fc{i + 1}")
            width = h
        self.head = nn.Linear(width, c["classes"])

    def forward(self, x):
        x = x.flatten(1)
        for n in self.names:
            x = F.relu(getattr(self, n)(x))
        return self.head(x)


class CNN(nn.Module):
    def __init__(self, c):
        super().__init__()
        ch, s = c["image_channels"], c["image_size"]
        self.convs = []
        for i, out in enumerate(c["conv_channels"]):
            setattr(self, f"conv{i + 1}", nn.Conv2d(ch, out, 3, stride=1, padding=1))
            self.convs.append(f"conv{i + 1}")
            ch, s = out, s // 2
        self.fc1 = nn.Linear(ch * s * s, c["fc"])
        self.head = nn.Linear(c["fc"], c["classes"])

    def forward(self, x):
        for n in self.convs:
            x = F.max_pool2d(F.relu(getattr(self, n)(x)), 2)
        return self.head(F.relu(self.fc1(x.flatten(1))))


class Attention(nn.Module):
    def __init__(self, C, H):
        super().__init__()
        self.H = H
        self.c_attn = nn.Linear(C, 3 * C)
        self.c_proj = nn.Linear(C, C)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // self.H)
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        return self.c_proj(y)


class MLPBlock(nn.Module):
    def __init__(self, C):
        super().__init__()
        self.c_fc = nn.Linear(C, 4 * C)
        self.c_proj = nn.Linear(4 * C, C)

    def forward(self, x):
        # meshtrain's GELU is the tanh approximation (GPT-2's).
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, C, H):
        super().__init__()
        self.ln_1 = nn.LayerNorm(C, eps=1e-5)
        self.attn = Attention(C, H)
        self.ln_2 = nn.LayerNorm(C, eps=1e-5)
        self.mlp = MLPBlock(C)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's module layout (names and nn.Linear [out, in] weights)."""

    def __init__(self, c):
        super().__init__()
        C = c["d_model"]
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(c["vocab"], C), wpe=nn.Embedding(c["seq_len"], C),
            h=nn.ModuleList([Block(C, c["heads"]) for _ in range(c["layers"])]),
            ln_f=nn.LayerNorm(C, eps=1e-5)))
        self.lm_head = nn.Linear(C, c["vocab"], bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied, as in nanoGPT and meshtrain

    def forward(self, idx):
        B, T = idx.shape
        t = self.transformer
        x = t.wte(idx) + t.wpe(torch.arange(T))
        for block in t.h:
            x = block(x)
        return self.lm_head(t.ln_f(x)).reshape(B * T, -1)


MODULES = {"mlp": MLP, "cnn": CNN, "gpt": GPT}


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", required=True, help="file written by meshtrain export --out")
    p.add_argument("--logits", required=True, help="file written by --logits-for")
    p.add_argument("--rtol", type=float, default=1e-4,
                   help="max |torch - meshtrain| allowed, relative to 1 + max |meshtrain|")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)

    weights, meta = read_safetensors(a.weights)
    if meta.get("format") != "pt" or meta.get("layout") != "pytorch-v1":
        print(f"{a.weights}: not a pytorch-v1 export (metadata {meta})", file=sys.stderr)
        return 2
    cfg = json.loads(meta["model_config"])
    model = MODULES[cfg["kind"]](cfg)
    res = model.load_state_dict(weights, strict=False)
    allowed_missing = {"lm_head.weight"} if cfg["kind"] == "gpt" else set()
    if res.unexpected_keys or set(res.missing_keys) - allowed_missing:
        print(f"state_dict mismatch: missing {res.missing_keys}, unexpected "
              f"{res.unexpected_keys}", file=sys.stderr)
        return 1

    t, _ = read_safetensors(a.logits)
    with torch.no_grad():
        got = model(t["x"].long() if cfg["kind"] == "gpt" else t["x"])
    want = t["logits"]
    diff = (got - want).abs().max().item()
    scale = 1.0 + want.abs().max().item()
    agree = (got.argmax(dim=1) == want.argmax(dim=1)).float().mean().item()
    ok = diff <= a.rtol * scale
    print(json.dumps({"model": cfg["kind"], "torch": torch.__version__,
                      "examples": int(t["x"].shape[0]), "logits": list(want.shape),
                      "max_abs_diff": diff, "tolerance": a.rtol * scale,
                      "argmax_agreement": agree, "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
