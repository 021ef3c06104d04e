#!/usr/bin/env python3
"""PyTorch Geometric peer for `bench/run gnn`: full-graph training of the same
GCN / GraphSAGE (mean) / GAT (one head) that meshtrain trains, on the same
graph file (written by `meshtrain graph-gen`, docs/graph_format.md), with the
same widths, optimizer (AdamW) and thread count; prints one JSON line with the
median epoch time and the accuracies after the last epoch.

An epoch is what meshtrain's full-graph trainer does: zero_grad, forward over
the whole graph, cross-entropy over the training mask, backward, optimizer
step. The first --warmup epochs are not timed.

--adj says how PyG gets the graph: edge_index (a [2, E] index tensor;
message passing gathers an [E, width] message tensor and scatters it) or
sparse (a torch.sparse CSR adjacency, the file's own rows, which GCNConv
and SAGEConv aggregate with torch.sparse.mm and never materialise per-edge
messages: PyG's faster and leaner path, and the only one that fits a
million-vertex R-MAT graph in memory). GAT always takes edge_index (its
attention is per edge).
"""

import argparse
import json
import struct
import statistics
import sys
import time

import numpy as np
import torch


def read_graph(path):
    """The graph file's tensors as numpy arrays (safetensors read by hand)."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    kinds = {"I32": np.int32, "F32": np.float32, "U8": np.uint8}
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        b, t = e["data_offsets"]
        out[name] = np.frombuffer(data[base + b:base + t], dtype=kinds[e["dtype"]]).reshape(e["shape"])
    return out, header.get("__metadata__", {})


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--graph", required=True)
    p.add_argument("--model", choices=["gcn", "sage", "gat"], required=True)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=1, help="gat: hidden layers concatenate, the last averages")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--adj", choices=["edge_index", "sparse"], default="edge_index")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    import torch_geometric
    from torch_geometric.nn import GATConv, GCNConv, SAGEConv

    t, meta = read_graph(a.graph)
    rp = t["row_ptr"].astype(np.int64)
    dst = np.repeat(np.arange(len(rp) - 1), np.diff(rp))
    # PyG's edge_index is (source, target); the file's rows are targets.
    edge_index = torch.from_numpy(np.stack([t["col_idx"].astype(np.int64), dst]))
    adj = a.adj if a.model != "gat" else "edge_index"
    if adj == "sparse":
        n = len(rp) - 1
        # Row i = target i, its entries the sources: PyG's adj_t.
        edge_index = torch.sparse_csr_tensor(torch.from_numpy(rp), edge_index[0],
                                             torch.ones(edge_index.shape[1]), size=(n, n))
    x = torch.from_numpy(t["features"].copy())
    y = torch.from_numpy(t["labels"].astype(np.int64))
    masks = {k: torch.from_numpy(t[k].astype(bool)) for k in ("train_mask", "val_mask", "test_mask")}
    classes = int(meta["classes"])

    def conv(i, o, last):
        if a.model == "gcn":
            # cached: the normalised adjacency is computed once, as meshtrain
            # computes its edge values once (full-graph, transductive).
            return GCNConv(i, o, cached=True)
        if a.model == "sage":
            return SAGEConv(i, o, aggr="mean")
        if a.heads == 1:
            return GATConv(i, o, heads=1)
        return GATConv(i, o if last else o // a.heads, heads=a.heads, concat=not last)

    widths = [x.shape[1]] + [a.hidden] * (a.layers - 1) + [classes]
    convs = torch.nn.ModuleList(conv(widths[k], widths[k + 1], k + 1 == a.layers)
                                for k in range(a.layers))

    def forward():
        h = x
        for k, c in enumerate(convs):
            h = c(h, edge_index)
            if k + 1 < len(convs):
                h = torch.relu(h)
        return h

    opt = torch.optim.AdamW(convs.parameters(), lr=a.lr, weight_decay=a.weight_decay)
    times = []
    for epoch in range(a.warmup + a.epochs):
        t0 = time.perf_counter()
        opt.zero_grad()
        logits = forward()
        loss = torch.nn.functional.cross_entropy(logits[masks["train_mask"]], y[masks["train_mask"]])
        loss.backward()
        opt.step()
        if epoch >= a.warmup:
            times.append(time.perf_counter() - t0)
    with torch.no_grad():
        pred = forward().argmax(1)
    acc = {k.replace("_mask", "_acc"): float((pred[m] == y[m]).float().mean()) for k, m in masks.items()}
    print(json.dumps({"median_epoch_s": statistics.median(times), "loss": float(loss),
                      "peer_name": f"pyg-{torch_geometric.__version__} torch-{torch.__version__}",
                      "peer_adj": adj, "vertices": int(len(rp) - 1),
                      "entries": int(len(t["col_idx"])),
                      **acc}))


if __name__ == "__main__":
    main(sys.argv[1:])
