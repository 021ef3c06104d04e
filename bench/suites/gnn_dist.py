"""Graph-parallel full-graph GNN training: meshtrain --nproc 2 vs its own single process.

For each graph (a CSBM graph from configs/gcn_csbm.toml with --vertices;
the Fashion-MNIST kNN graph, --knn-k neighbours of every image, whose exact
search takes ~20 s; an R-MAT graph of 2^--rmat-scale vertices), written once
by `meshtrain graph-gen`, the 2-layer GCN of configs/gcn_csbm.toml trains
--epochs epochs in one process (1 thread) and with gnn.parallel = "graph"
over 2 ranks x 1 thread for each partitioner (contiguous, random, locality).
One line per (graph, partitioner):
  gnn_graph_parallel_epoch  ms; meshtrain = median epoch of the 2-rank run,
                            peer = the single process's ("peer_name":
                            "meshtrain 1 process"), ratio = peer / meshtrain
                            (the speed-up), halo and gradient all-reduce bytes
                            each rank sent per epoch (the communicator's
                            counters), the partition's edge cut (`inspect`).
The 2-rank run must end with the single process's loss and accuracies (to
the printed 4 and 3 decimals): otherwise the line is an error.

Then the deep model (--deep-layers residual GCN blocks, on the kNN graph if
it is among --graphs, else the first graph), --deep-epochs epochs over 2
ranks, graph parallel (locality partition) against layer pipelining
(gnn.parallel = "layer", --chunks locality chunks after 2 startup epochs):
  gnn_layer_pipeline_bytes  bytes per rank per epoch; meshtrain = the layer
                            pipeline's (largest rank), peer = graph
                            parallelism's halo + gradient bytes (largest
                            rank), ratio = peer / meshtrain (how many times
                            fewer bytes); both epoch times and test
                            accuracies beside (accuracy is reported, not
                            required equal: historical embeddings are stale).

Then the same deep model over --hybrid-ranks ranks (default 4), three ways:
graph parallel (locality), pure layer pipelining (one stage per rank) and
GNNPipe's hybrid (gnn.graph_parts = 2: ranks / 2 stages x 2 graph parts),
the pipelines with --chunks locality chunks after 2 startup epochs:
  gnn_hybrid_bytes          bytes per rank per epoch; meshtrain = the
                            hybrid's between stages + halo + gradient
                            all-reduce (largest rank), peer = graph
                            parallelism's halo + gradients (largest rank),
                            ratio = peer / meshtrain; the pure pipeline's
                            bytes, the three epoch times and test
                            accuracies beside.

Then the same comparison from the exact byte counts, for every graph,
partitioner and rank count in --ratio-ranks (no training: `inspect` gives
each rank's halo rows of the --deep-layers residual GCN):
  gnn_layer_pipeline_bytes_analytic
                            bytes per rank per epoch (largest rank);
                            meshtrain = layer pipeline c n h 4 (c = 1 at 2
                            ranks, 2 beyond: a middle stage sends its output
                            forward and its input gradient backward), peer =
                            graph parallel L (in_r + out_r) h 4 + the ring
                            all-reduce of the gradients 2 (P-1)/P params 4,
                            ratio = peer / meshtrain ~ L max_r(in_r + out_r)
                            / (c n): the layer count times the halo fraction,
                            independent of the width.
  gnn_bytes_analytic_check  the formulas against the communicator's counters
                            after one epoch of each scheme on a 3,000-vertex
                            CSBM graph at each rank count (halo and
                            between-stage bytes exactly, the all-reduce
                            within 64 bytes of ring's chunk rounding): an
                            error line if they differ.
--parts chooses among epoch (the 2-layer lines), deep (the measured 32-layer
line and the hybrid comparison) and ratios (the two above);
`bench/run gnn_dist --parts ratios` takes about a minute plus the kNN search.
"""

import json
import re

from common import REPO, cpu_context, ratio, thread_env

CONFIG = REPO / "configs" / "gcn_csbm.toml"
PARTITIONS = ("contiguous", "random", "locality")
SUMMARY = re.compile(r"loss [0-9.]+, accuracy train [0-9.]+ val [0-9.]+ test [0-9.]+")
BYTES = re.compile(r"halo exchange \[([0-9, ]+)\], gradient all-reduce \[([0-9, ]+)\]")
STAGE_BYTES = re.compile(r"between stages \[([0-9, ]+)\]")
CUT = re.compile(r"edge cut: ([0-9]+) of ([0-9]+) entries")
HALO_PRED = re.compile(r"halo bytes each rank sends per epoch \(gnn.parallel = graph, [a-z]+\): "
                       r"\[([0-9, ]+)\]")
PARAMS = re.compile(r"model: .*?([0-9]+) parameters;")
VERTICES = re.compile(r"([0-9]+) vertices")


def add_args(p):
    p.add_argument("--graphs", default="csbm,knn,rmat", help="subset of csbm,knn,rmat")
    p.add_argument("--vertices", type=int, default=100000, help="CSBM vertices (default 100000)")
    p.add_argument("--knn-k", type=int, default=10, help="kNN neighbours (default 10)")
    p.add_argument("--rmat-scale", type=int, default=18, help="R-MAT 2^scale vertices (default 18)")
    p.add_argument("--epochs", type=int, default=20, help="timed epochs (default 20)")
    p.add_argument("--deep-layers", type=int, default=32, help="resgcn blocks (default 32)")
    p.add_argument("--deep-epochs", type=int, default=30, help="deep model epochs (default 30)")
    p.add_argument("--chunks", type=int, default=4, help="layer pipeline chunks (default 4)")
    p.add_argument("--ratio-ranks", default="2,4", help="ranks for the analytic byte ratios")
    p.add_argument("--parts", default="epoch,deep,ratios", help="subset of epoch,deep,ratios")
    p.add_argument("--hybrid-ranks", type=int, default=4,
                   help="ranks of the hybrid comparison (default 4; 0 skips it)")


def graph_sets(ctx, name):
    if name == "csbm":
        return ["--set", f"data.vertices={5000 if ctx.quick else ctx.args.vertices}"]
    if name == "knn":
        sets = ["--set", 'data.graph="knn"', "--set", f"data.knn_k={ctx.args.knn_k}",
                "--set", "train.threads=2"]
        if ctx.quick:
            sets += ["--set", "data.limit_train=5000", "--set", "data.limit_test=1000"]
        return sets
    return ["--set", 'data.graph="rmat"', "--set",
            f"data.rmat_scale={12 if ctx.quick else ctx.args.rmat_scale}"]


def run(ctx):
    exe = ctx.ensure_built("meshtrain")
    epochs = 5 if ctx.quick else ctx.args.epochs
    cpu = cpu_context()
    parts = ctx.args.parts.split(",")
    for gname in ctx.args.graphs.split(","):
        graph = ctx.workdir / f"{gname}.safetensors"
        r = ctx.run([exe, "graph-gen", "--config", CONFIG, *graph_sets(ctx, gname), "--out", graph],
                    name=f"graph-gen-{gname}")
        base = {"name": "gnn_graph_parallel_epoch", "unit": "ms", "graph": gname, "model": "gcn",
                "ranks": 2, "threads": 1, "epochs": epochs, **cpu}
        if not r.ok:
            ctx.emit({**base, "error": r.failure()})
            continue
        ctx.log(r.stdout.strip())
        if "epoch" not in parts:
            continue
        common = ["--config", CONFIG, "--set", 'data.graph="file"', "--set",
                  f'data.graph_file="{graph}"', "--set", "train.threads=1"]
        train = [exe, "train", *common, "--quiet", "--set", f"train.epochs={epochs + 2}",
                 "--set", f"train.log_every={epochs + 2}"]
        metrics = ctx.workdir / f"{gname}_single.jsonl"
        s = ctx.run([*train, "--metrics", metrics], thread_env(1), f"single-{gname}")
        single = json.loads(metrics.read_text().splitlines()[-1]) if s.ok else None
        single_summary = SUMMARY.search(s.stdout).group(0) if s.ok and SUMMARY.search(s.stdout) else None
        for part in PARTITIONS:
            line = {**base, "partition": part, "peer_name": "meshtrain 1 process"}
            insp = ctx.run([exe, "inspect", *common, "--set", "dist.nproc=2",
                            "--set", f'gnn.partition="{part}"'], name=f"inspect-{gname}-{part}")
            cut = CUT.search(insp.stdout) if insp.ok else None
            if cut:
                line["edge_cut_fraction"] = round(int(cut.group(1)) / max(int(cut.group(2)), 1), 4)
            metrics = ctx.workdir / f"{gname}_{part}.jsonl"
            d = ctx.run([*train, "--nproc", "2", "--metrics", metrics, "--set",
                         'gnn.parallel="graph"', "--set", f'gnn.partition="{part}"'],
                        thread_env(1), f"graph-{gname}-{part}")
            if single is None or not d.ok:
                line["error"] = s.failure() if single is None else d.failure()
                ctx.emit(line)
                continue
            dist = json.loads(metrics.read_text().splitlines()[-1])
            b = BYTES.search(d.stdout)
            line.update({"meshtrain": 1e3 * dist["median_epoch_s"],
                         "peer": 1e3 * single["median_epoch_s"],
                         "ratio": ratio(single["median_epoch_s"], dist["median_epoch_s"]),
                         "test_acc": dist["test_acc"]})
            if b:
                line["halo_bytes_per_rank_epoch"] = [int(x) for x in b.group(1).split(",")]
                line["allreduce_bytes_per_rank_epoch"] = [int(x) for x in b.group(2).split(",")]
            dist_summary = SUMMARY.search(d.stdout)
            if dist_summary is None or dist_summary.group(0) != single_summary:
                line["error"] = (f"graph parallel ended with '{dist_summary and dist_summary.group(0)}'"
                                 f", one process with '{single_summary}'")
            elif not b:
                line["error"] = "no bytes line printed"
            ctx.emit(line)

    if "deep" in parts:
        deep_graph(ctx, exe, cpu)
        if ctx.args.hybrid_ranks > 0:
            deep_hybrid(ctx, exe, cpu)
    if "ratios" in parts:
        byte_ratios(ctx, exe, cpu)
        check_bytes(ctx, exe, cpu)


def deep_graph(ctx, exe, cpu):
    names = ctx.args.graphs.split(",")
    gname = "knn" if "knn" in names else names[0]
    graph = ctx.workdir / f"{gname}.safetensors"
    epochs = 3 if ctx.quick else ctx.args.deep_epochs
    layers = 4 if ctx.quick else ctx.args.deep_layers
    line = {"name": "gnn_layer_pipeline_bytes", "unit": "bytes/epoch", "graph": gname,
            "model": f"resgcn x{layers}", "ranks": 2, "threads": 1, "epochs": epochs,
            "chunks": ctx.args.chunks, "peer_name": "meshtrain graph parallel (locality)", **cpu}
    if not graph.exists():
        ctx.emit({**line, "error": f"no {gname} graph file"})
        return
    train = [exe, "train", "--config", CONFIG, "--quiet", "--nproc", "2",
             "--set", 'data.graph="file"', "--set", f'data.graph_file="{graph}"',
             "--set", "train.threads=1", "--set", 'model.kind="resgcn"',
             "--set", f"model.gnn_layers={layers}", "--set", f"train.epochs={epochs}",
             "--set", f"train.log_every={epochs}", "--set", 'gnn.partition="locality"']
    runs = {}
    for mode, extra in (("graph", []),
                        ("layer", ["--set", f"gnn.chunks={ctx.args.chunks}",
                                   "--set", "gnn.startup_epochs=2"])):
        metrics = ctx.workdir / f"deep_{mode}.jsonl"
        r = ctx.run([*train, "--metrics", metrics, "--set", f'gnn.parallel="{mode}"', *extra],
                    thread_env(1), f"deep-{mode}")
        if not r.ok:
            ctx.emit({**line, "error": r.failure()})
            return
        runs[mode] = (json.loads(metrics.read_text().splitlines()[-1]), r.stdout)
    g, gout = runs["graph"]
    lp, lout = runs["layer"]
    b = BYTES.search(gout)
    sb = STAGE_BYTES.search(lout)
    if not b or not sb:
        ctx.emit({**line, "error": "no bytes line printed"})
        return
    halo = [int(x) for x in b.group(1).split(",")]
    grads = [int(x) for x in b.group(2).split(",")]
    gp = max(h + a for h, a in zip(halo, grads))
    pipe = max(int(x) for x in sb.group(1).split(","))
    line.update({"meshtrain": pipe, "peer": gp, "ratio": ratio(gp, pipe),
                 "layer_epoch_ms": 1e3 * lp["median_epoch_s"],
                 "graph_epoch_ms": 1e3 * g["median_epoch_s"],
                 "layer_test_acc": lp["test_acc"], "graph_test_acc": g["test_acc"]})
    ctx.emit(line)


def layers_of(ctx):
    return 4 if ctx.quick else ctx.args.deep_layers


def resgcn_sets(layers):
    return ["--set", 'model.kind="resgcn"', "--set", f"model.gnn_layers={layers}"]


def analytic(ctx, exe, graph_args, ranks, part, layers):
    """(per-rank halo bytes, parameters, vertices) from `inspect`, or an error string."""
    r = ctx.run([exe, "inspect", "--config", CONFIG, *graph_args, *resgcn_sets(layers),
                 "--set", f"dist.nproc={ranks}", "--set", f'gnn.partition="{part}"'],
                name=f"inspect-{ranks}-{part}")
    halo, params, verts = (HALO_PRED.search(r.stdout), PARAMS.search(r.stdout),
                           VERTICES.search(r.stdout)) if r.ok else (None, None, None)
    if not (halo and params and verts):
        return r.failure() if not r.ok else "inspect printed no halo bytes / parameters / vertices"
    return ([int(x) for x in halo.group(1).split(",")], int(params.group(1)), int(verts.group(1)))


def ring_allreduce_bytes(ranks, params):
    return round(2 * (ranks - 1) / ranks * params * 4)


def pipeline_bytes(ranks, vertices, hidden):
    return (1 if ranks == 2 else 2) * vertices * hidden * 4


def byte_ratios(ctx, exe, cpu):
    layers = layers_of(ctx)
    hidden = 64  # configs/gcn_csbm.toml's model.gnn_hidden
    for gname in ctx.args.graphs.split(","):
        graph = ctx.workdir / f"{gname}.safetensors"
        if not graph.exists():
            continue
        graph_args = ["--set", 'data.graph="file"', "--set", f'data.graph_file="{graph}"']
        for ranks in [int(x) for x in ctx.args.ratio_ranks.split(",")]:
            for part in PARTITIONS:
                line = {"name": "gnn_layer_pipeline_bytes_analytic", "unit": "bytes/epoch",
                        "graph": gname, "model": f"resgcn x{layers}", "hidden": hidden,
                        "ranks": ranks, "partition": part,
                        "peer_name": f"graph parallel ({part})", **cpu}
                got = analytic(ctx, exe, graph_args, ranks, part, layers)
                if isinstance(got, str):
                    ctx.emit({**line, "error": got})
                    continue
                halo, params, n = got
                gp = max(halo) + ring_allreduce_bytes(ranks, params)
                lp = pipeline_bytes(ranks, n, hidden)
                halo_rows = max(halo) // (layers * hidden * 4)  # in_r + out_r, largest rank
                line.update({"meshtrain": lp, "peer": gp, "ratio": ratio(gp, lp), "vertices": n,
                             "halo_rows_in_out_max": halo_rows,
                             "halo_fraction": round(halo_rows / n, 4),
                             "goal_8x_met": gp >= 8 * lp})
                ctx.emit(line)


def check_bytes(ctx, exe, cpu):
    """The analytic byte counts against the communicator's, one epoch of each scheme."""
    layers = layers_of(ctx)
    graph_args = ["--set", "data.vertices=3000"]
    for ranks in [int(x) for x in ctx.args.ratio_ranks.split(",")]:
        line = {"name": "gnn_bytes_analytic_check", "graph": "csbm", "vertices": 3000,
                "model": f"resgcn x{layers}", "ranks": ranks, "partition": "locality", **cpu}
        got = analytic(ctx, exe, graph_args, ranks, "locality", layers)
        if isinstance(got, str):
            ctx.emit({**line, "error": got})
            continue
        halo, params, n = got
        train = [exe, "train", "--config", CONFIG, "--quiet", "--nproc", str(ranks), *graph_args,
                 *resgcn_sets(layers), "--set", "train.epochs=1", "--set", "train.threads=1",
                 "--set", 'gnn.partition="locality"']
        g = ctx.run([*train, "--set", 'gnn.parallel="graph"'], thread_env(1), f"check-graph-{ranks}")
        lp = ctx.run([*train, "--set", 'gnn.parallel="layer"', "--set", "gnn.startup_epochs=0"],
                     thread_env(1), f"check-layer-{ranks}")
        b = BYTES.search(g.stdout) if g.ok else None
        sb = STAGE_BYTES.search(lp.stdout) if lp.ok else None
        if not b or not sb:
            ctx.emit({**line, "error": g.failure() if not b else lp.failure()})
            continue
        m_halo = [int(x) for x in b.group(1).split(",")]
        m_grad = [int(x) for x in b.group(2).split(",")]
        m_stage = [int(x) for x in sb.group(1).split(",")]
        want_stage = max(pipeline_bytes(ranks, n, 64), 0)
        ring = ring_allreduce_bytes(ranks, params)
        line.update({"halo_measured": m_halo, "halo_analytic": halo,
                     "allreduce_measured": m_grad, "allreduce_analytic": ring,
                     "stage_measured": m_stage, "stage_analytic_max": want_stage})
        if m_halo != halo:
            line["error"] = "halo bytes differ from inspect's prediction"
        elif max(abs(x - ring) for x in m_grad) > 64:
            line["error"] = "all-reduce bytes differ from the ring formula"
        elif max(m_stage) != want_stage:
            line["error"] = "between-stage bytes differ from c n h 4"
        ctx.emit(line)


def per_rank(pattern, text):
    m = re.search(pattern + r" \[([0-9, ]+)\]", text)
    return [int(x) for x in m.group(1).split(",")] if m else None


def deep_hybrid(ctx, exe, cpu):
    names = ctx.args.graphs.split(",")
    gname = "knn" if "knn" in names else names[0]
    graph = ctx.workdir / f"{gname}.safetensors"
    epochs = 3 if ctx.quick else ctx.args.deep_epochs
    layers = 4 if ctx.quick else ctx.args.deep_layers
    ranks = ctx.args.hybrid_ranks
    line = {"name": "gnn_hybrid_bytes", "unit": "bytes/epoch", "graph": gname,
            "model": f"resgcn x{layers}", "ranks": ranks, "graph_parts": 2,
            "stages": ranks // 2, "threads": 1, "epochs": epochs, "chunks": ctx.args.chunks,
            "peer_name": "meshtrain graph parallel (locality)", **cpu}
    if not graph.exists():
        ctx.emit({**line, "error": f"no {gname} graph file"})
        return
    train = [exe, "train", "--config", CONFIG, "--quiet", "--nproc", str(ranks),
             "--set", 'data.graph="file"', "--set", f'data.graph_file="{graph}"',
             "--set", "train.threads=1", "--set", 'model.kind="resgcn"',
             "--set", f"model.gnn_layers={layers}", "--set", f"train.epochs={epochs}",
             "--set", f"train.log_every={epochs}", "--set", 'gnn.partition="locality"']
    pipe = ["--set", 'gnn.parallel="layer"', "--set", f"gnn.chunks={ctx.args.chunks}",
            "--set", "gnn.startup_epochs=2"]
    runs = {}
    for mode, extra in (("graph", ["--set", 'gnn.parallel="graph"']),
                        ("layer", pipe),
                        ("hybrid", [*pipe, "--set", "gnn.graph_parts=2"])):
        metrics = ctx.workdir / f"hybrid_{mode}.jsonl"
        r = ctx.run([*train, "--metrics", metrics, *extra], thread_env(1), f"hybrid-{mode}")
        if not r.ok:
            ctx.emit({**line, "error": r.failure()})
            return
        runs[mode] = (json.loads(metrics.read_text().splitlines()[-1]), r.stdout)
    zero = [0] * ranks
    sums = {}
    for mode, (_, out) in runs.items():
        parts = [per_rank("halo exchange", out) or zero,
                 per_rank("gradient all-reduce", out) or zero,
                 per_rank("between stages", out) or zero]
        if all(p is zero for p in parts):
            ctx.emit({**line, "error": f"{mode}: no bytes line printed"})
            return
        sums[mode] = max(sum(col) for col in zip(*parts))
    line.update({"meshtrain": sums["hybrid"], "peer": sums["graph"],
                 "ratio": ratio(sums["graph"], sums["hybrid"]),
                 "layer_pipeline_bytes": sums["layer"],
                 **{f"{m}_epoch_ms": 1e3 * runs[m][0]["median_epoch_s"] for m in runs},
                 **{f"{m}_test_acc": runs[m][0]["test_acc"] for m in runs}})
    ctx.emit(line)
