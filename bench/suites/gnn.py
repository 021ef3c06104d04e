"""Full-graph GNN training in one process: meshtrain vs PyTorch Geometric.

`meshtrain graph-gen` writes a CSBM graph (configs/gcn_csbm.toml with
data.vertices from --vertices) to a file both sides read, so they train on
identical data. For each model (gcn, sage, gat, and gat4: GAT with 4 heads,
hidden layers concatenating them, the last averaging, as PyG's GATConv with
concat=True / False) and thread count (1, 2):
meshtrain `train` on that file (median epoch time and accuracies from its
metrics file) and bench/peers/pyg_train.py (same widths, layers, AdamW
settings, epochs). One comparison line per pair: epoch time in ms, ratio =
peer / meshtrain (above 1: meshtrain is faster), both test accuracies beside.
A side whose test accuracy is not above 0.5 (chance is 0.25) makes the line
an error: the timed run must also have learned.

PyG is installed into the bench venv on first use (pip, pure-Python wheel;
its optional compiled extensions are not used).
"""

import json
import subprocess

from common import REPO, cpu_context, ratio, thread_env

CONFIG = REPO / "configs" / "gcn_csbm.toml"


def add_args(p):
    p.add_argument("--vertices", type=int, default=100000, help="CSBM vertices (default 100000)")
    p.add_argument("--epochs", type=int, default=50, help="timed epochs (default 50)")
    p.add_argument("--models", default="gcn,sage,gat,gat4")
    p.add_argument("--threads", default="1,2")


def ensure_pyg(ctx, py):
    if subprocess.run([str(py), "-c", "import torch_geometric"], capture_output=True).returncode:
        ctx.log("pip install torch_geometric into the bench venv (pure-Python wheel)")
        subprocess.check_call([str(py), "-m", "pip", "install", "--only-binary=:all:",
                               "torch_geometric"])


def run(ctx):
    exe = ctx.ensure_built("meshtrain")
    py = ctx.torch_python()
    ensure_pyg(ctx, py)
    vertices = 5000 if ctx.quick else ctx.args.vertices
    epochs = 10 if ctx.quick else ctx.args.epochs
    graph = ctx.workdir / "csbm.safetensors"
    r = ctx.run([exe, "graph-gen", "--config", CONFIG, "--set", f"data.vertices={vertices}",
                 "--out", graph], name="graph-gen")
    if not r.ok:
        ctx.emit({"name": "gnn_graph_gen", "error": r.failure()})
        return
    ctx.log(r.stdout.strip())
    cpu = cpu_context()
    for model in ctx.args.models.split(","):
        kind, heads = ("gat", 4) if model == "gat4" else (model, 1)
        for threads in [int(t) for t in ctx.args.threads.split(",")]:
            metrics = ctx.workdir / f"{model}_{threads}.jsonl"
            m = ctx.run([exe, "train", "--config", CONFIG, "--quiet", "--metrics", metrics,
                         "--set", f"model.kind={kind}", "--set", f"model.gat_heads={heads}",
                         "--set", "data.graph=file",
                         "--set", f'data.graph_file="{graph}"', "--set", f"train.threads={threads}",
                         "--set", f"train.epochs={epochs + 3}", "--set", f"train.log_every={epochs + 3}"],
                        thread_env(threads), f"meshtrain_{model}_{threads}")
            line = {"name": f"gnn_{model}_epoch", "unit": "ms", "model": model,
                    "threads": threads, "peer_threads": threads, "vertices": vertices,
                    "epochs": epochs, "graph": "csbm", **cpu}
            mine = None
            if m.ok:
                mine = json.loads(metrics.read_text().splitlines()[-1])
            peer_r = ctx.run([py, REPO / "bench" / "peers" / "pyg_train.py", "--graph", graph,
                              "--model", kind, "--heads", str(heads), "--epochs", str(epochs),
                              "--threads", str(threads)],
                             thread_env(threads), f"pyg_{model}_{threads}")
            peer = peer_r.json_lines()[-1] if peer_r.ok and peer_r.json_lines() else None
            if mine is None or peer is None:
                line["error"] = (m.failure() if mine is None else peer_r.failure())
                ctx.emit(line)
                continue
            line.update({"meshtrain": 1e3 * mine["median_epoch_s"],
                         "peer": 1e3 * peer["median_epoch_s"],
                         "ratio": ratio(peer["median_epoch_s"], mine["median_epoch_s"]),
                         "peer_name": peer["peer_name"],
                         "meshtrain_test_acc": mine["test_acc"], "peer_test_acc": peer["test_acc"]})
            if mine["test_acc"] <= 0.5 or peer["test_acc"] <= 0.5:
                line["error"] = "a side did not learn (test accuracy <= 0.5)"
            ctx.emit(line)
