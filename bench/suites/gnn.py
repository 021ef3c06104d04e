"""Full-graph GNN training in one process: meshtrain vs PyTorch Geometric,
and the SpMM kernel's bandwidth against a STREAM ceiling.

Graphs (--graphs, each written once by `meshtrain graph-gen` to a file both
sides read, so they train on identical data): csbm (configs/gcn_csbm.toml
with data.vertices = --vertices), knn (the Fashion-MNIST k-nearest-neighbour
graph of all 70,000 images, k = --knn-k, the data set's own split; the exact
search takes ~20 s) and rmat (2^--rmat-scale vertices, edge factor 16;
features are noise and labels degree buckets, so its accuracy means little).
Default csbm,knn (about 10 minutes on 2 cores); the million-vertex R-MAT
figures take `--graphs rmat` (a few minutes more).

For each graph and thread count (--threads):
  gnn_spmm_bandwidth   GB/s; build/bench/spmm_stream_bench: the fast SpMM
                       kernel (GCN's normalised A + I times a random
                       [n, 64] matrix) and a STREAM-like copy / triad over
                       256 MiB arrays on the same threads in the same
                       process. meshtrain = SpMM's effective bandwidth
                       counting the bytes it must move (row pointers, column
                       indices, values, one gathered dense row per entry,
                       the output), peer = STREAM triad, ratio = the
                       fraction of the ceiling, all three from CPU time per
                       thread (on a shared machine the wall time counts the
                       slices others took; the wall-time figures, *_gbs and
                       fraction_of_triad, are beside); the compulsory-traffic
                       count (each dense row read once) too.
For each model (csbm: --models; knn and rmat: --big-models; gat4 = GAT
with 4 heads, hidden layers concatenating them, the last averaging, as
PyG's GATConv with concat=True / False) and thread count:
  gnn_<model>_epoch    ms; meshtrain `train` on the file (median epoch,
                       accuracies from its metrics file) against
                       bench/peers/pyg_train.py (same widths, layers, AdamW
                       settings, epochs; gcn and sage through a torch.sparse
                       adjacency unless --peer-adj edge_index). ratio =
                       peer / meshtrain (above 1: meshtrain is faster), both
                       test accuracies beside. On csbm and knn a side whose
                       test accuracy is not above 0.5 makes the line an
                       error: the timed run must also have learned.
  gnn_gcn_accuracy     test accuracy of GCN on csbm and knn after the same
                       epochs, widths and optimizer, same split, from the
                       lowest thread count's runs; meshtrain and peer are
                       the two accuracies, ratio = meshtrain / peer.

PyG is installed into the bench venv on first use (pip, pure-Python wheel;
its optional compiled extensions are not used).
"""

import json
import subprocess

from common import REPO, cpu_context, ratio, thread_env

CONFIG = REPO / "configs" / "gcn_csbm.toml"
LEARNS = {"csbm", "knn"}  # graphs whose labels a GCN can learn well above 0.5


def add_args(p):
    p.add_argument("--graphs", default="csbm,knn", help="subset of csbm,knn,rmat (default csbm,knn)")
    p.add_argument("--vertices", type=int, default=100000, help="CSBM vertices (default 100000)")
    p.add_argument("--knn-k", type=int, default=10, help="kNN neighbours (default 10)")
    p.add_argument("--rmat-scale", type=int, default=20, help="R-MAT 2^scale vertices (default 20)")
    p.add_argument("--epochs", type=int, default=50, help="timed epochs on csbm and knn (default 50)")
    p.add_argument("--rmat-epochs", type=int, default=3,
                   help="timed epochs on rmat, after 1 untimed (default 3; PyG takes over a "
                        "minute per epoch there)")
    p.add_argument("--models", default="gcn,sage,gat,gat4", help="models on csbm")
    p.add_argument("--big-models", default="gcn", help="models on knn and rmat (default gcn)")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--peer-adj", default="sparse", choices=["sparse", "edge_index"],
                   help="how PyG gets the graph for gcn and sage (default sparse)")
    p.add_argument("--width", type=int, default=64, help="SpMM bandwidth: dense width (default 64)")


def ensure_pyg(ctx, py):
    if subprocess.run([str(py), "-c", "import torch_geometric"], capture_output=True).returncode:
        ctx.log("pip install torch_geometric into the bench venv (pure-Python wheel)")
        subprocess.check_call([str(py), "-m", "pip", "install", "--only-binary=:all:",
                               "torch_geometric"])


def graph_sets(ctx, name):
    if name == "csbm":
        return ["--set", f"data.vertices={5000 if ctx.quick else ctx.args.vertices}"]
    if name == "knn":
        sets = ["--set", 'data.graph="knn"', "--set", f"data.knn_k={ctx.args.knn_k}",
                "--set", "train.threads=2"]
        if ctx.quick:
            sets += ["--set", "data.limit_train=5000", "--set", "data.limit_test=1000"]
        return sets
    if name == "rmat":
        return ["--set", 'data.graph="rmat"', "--set",
                f"data.rmat_scale={12 if ctx.quick else ctx.args.rmat_scale}",
                "--set", "data.rmat_edge_factor=16", "--set", "train.threads=2"]
    raise ValueError(f"--graphs: unknown graph '{name}' (csbm, knn, rmat)")


def run(ctx):
    exe = ctx.ensure_built("meshtrain")
    bw_exe = ctx.ensure_built("bench/spmm_stream_bench")
    py = ctx.torch_python()
    ensure_pyg(ctx, py)
    cpu = cpu_context()
    threads_list = [int(t) for t in ctx.args.threads.split(",")]
    for gname in ctx.args.graphs.split(","):
        graph = ctx.workdir / f"{gname}.safetensors"
        r = ctx.run([exe, "graph-gen", "--config", CONFIG, *graph_sets(ctx, gname),
                     "--out", graph], thread_env(2), name=f"graph-gen-{gname}")
        if not r.ok:
            ctx.emit({"name": "gnn_graph_gen", "graph": gname, "error": r.failure()})
            continue
        ctx.log(r.stdout.strip())
        for threads in threads_list:
            bandwidth(ctx, bw_exe, graph, gname, threads, cpu)
        epochs = ctx.args.rmat_epochs if gname == "rmat" else ctx.args.epochs
        epochs = min(epochs, 10) if ctx.quick else epochs
        warmup = 1 if gname == "rmat" else 3
        models = ctx.args.models if gname == "csbm" else ctx.args.big_models
        for model in models.split(","):
            for threads in threads_list:
                line = compare(ctx, exe, py, graph, gname, model, threads, epochs, warmup, cpu)
                if (model == "gcn" and threads == threads_list[0] and gname in LEARNS
                        and "meshtrain_test_acc" in line):
                    ctx.emit({"name": "gnn_gcn_accuracy", "unit": "test accuracy",
                              "graph": gname, "model": "gcn", "epochs": epochs + warmup,
                              "threads": threads, "vertices": line["vertices"],
                              "meshtrain": line["meshtrain_test_acc"],
                              "peer": line["peer_test_acc"],
                              "ratio": ratio(line["meshtrain_test_acc"], line["peer_test_acc"]),
                              "peer_name": line["peer_name"], **cpu})


def bandwidth(ctx, bw_exe, graph, gname, threads, cpu):
    reps = 3 if ctx.quick else 10
    r = ctx.run([bw_exe, "--graph", graph, "--threads", str(threads), "--width",
                 str(ctx.args.width), "--reps", str(reps), "--stream-mb", "256"],
                thread_env(threads), f"spmm-stream-{gname}-{threads}")
    line = {"name": "gnn_spmm_bandwidth", "unit": "GB/s", "graph": gname, "threads": threads,
            "peer_name": "STREAM-like triad, same threads and process", **cpu}
    got = r.json_lines()[-1] if r.ok and r.json_lines() else None
    if got is None:
        ctx.emit({**line, "error": r.failure()})
        return
    line.update({"meshtrain": got["spmm_cpu_gbs"], "peer": got["stream_triad_cpu_gbs"],
                 "ratio": got["fraction_of_triad_cpu"], **got, "others_cpu": r.others_cpu})
    ctx.emit(line)


def compare(ctx, exe, py, graph, gname, model, threads, epochs, warmup, cpu):
    kind, heads = ("gat", 4) if model == "gat4" else (model, 1)
    metrics = ctx.workdir / f"{gname}_{model}_{threads}.jsonl"
    m = ctx.run([exe, "train", "--config", CONFIG, "--quiet", "--metrics", metrics,
                 "--set", f"model.kind={kind}", "--set", f"model.gat_heads={heads}",
                 "--set", "data.graph=file",
                 "--set", f'data.graph_file="{graph}"', "--set", f"train.threads={threads}",
                 "--set", f"train.epochs={epochs + warmup}",
                 "--set", f"train.log_every={epochs + warmup}"],
                thread_env(threads), f"meshtrain_{gname}_{model}_{threads}")
    line = {"name": f"gnn_{model}_epoch", "unit": "ms", "graph": gname, "model": model,
            "threads": threads, "peer_threads": threads, "epochs": epochs, "warmup": warmup,
            **cpu}
    mine = None
    if m.ok:
        mine = json.loads(metrics.read_text().splitlines()[-1])
    peer_r = ctx.run([py, REPO / "bench" / "peers" / "pyg_train.py", "--graph", graph,
                      "--model", kind, "--heads", str(heads), "--epochs", str(epochs),
                      "--threads", str(threads), "--adj", ctx.args.peer_adj,
                      "--warmup", str(warmup)],
                     thread_env(threads), f"pyg_{gname}_{model}_{threads}")
    peer = peer_r.json_lines()[-1] if peer_r.ok and peer_r.json_lines() else None
    line["vertices"] = peer.get("vertices") if peer else None
    if mine is None or peer is None:
        line["error"] = (m.failure() if mine is None else peer_r.failure())
        ctx.emit(line)
        return line
    line.update({"vertices": peer["vertices"], "entries": peer["entries"],
                 "meshtrain": 1e3 * mine["median_epoch_s"],
                 "peer": 1e3 * peer["median_epoch_s"],
                 "ratio": ratio(peer["median_epoch_s"], mine["median_epoch_s"]),
                 "peer_name": peer["peer_name"], "peer_adj": peer["peer_adj"],
                 "meshtrain_test_acc": mine["test_acc"], "peer_test_acc": peer["test_acc"],
                 "meshtrain_others_cpu": m.others_cpu, "peer_others_cpu": peer_r.others_cpu})
    if gname in LEARNS and (mine["test_acc"] <= 0.5 or peer["test_acc"] <= 0.5):
        line["error"] = "a side did not learn (test accuracy <= 0.5)"
    ctx.emit(line)
    return line
