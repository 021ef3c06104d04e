"""Hierarchical vs flat all-reduce over emulated links: 4 ranks as 2 nodes of 2.

A short `meshtrain train --nproc 4` run of a model (--models, default the MLP
of configs/mlp_fashion.toml; train.threads=1, evaluation and checkpoints
off) under three networks between the two nodes, each run twice: with the
hierarchical all-reduce (reduce-scatter in each node, all-reduce across,
all-gather in each node) and flat (dist.hierarchical = false: ring /
halving-doubling over all 4 ranks). The links are emulated by the transport
(docs/cluster.md: latency + bytes / bandwidth per message, serialised per
rank pair; shared memory off under emulation):

  unconstrained   dist.node_size = 2 (no emulation; the nodes' own
                  sub-calls use the shared window, the flat run does not)
  1gbit_1ms       node_size = 2, links.inter_node 1 ms, 1 Gbit/s
  100mbit_50ms    node_size = 2, links.inter_node 50 ms, 0.1 Gbit/s
(cluster files written to the work directory; --sharing rank_pair and/or
node_pair: whether the two ranks of a node share its link to the other
node; lines for node_pair carry the suffix _node_pair)

Lines:
  <model>_np4_2nodes_<net>_step_time   ms per step, meshtrain = hierarchical,
      peer = flat (the same binary), ratio = flat / hierarchical (> 1:
      hierarchical faster); from each run's median samples/s and the global
      batch. Both runs' final losses are compared (relative 1e-3: the
      summation orders differ); a mismatch is an error line.
  <model>_np4_one_node_step_time      ms per step of the plain 4-rank run
      (all on one node: flat shared-memory all-reduce), for scale.

Not a peer comparison: PyTorch has no link emulation here; the point is the
algorithm's effect under each network.
"""

import tomllib

from common import REPO, mpi_env, summary_line, thread_env

# name, (latency ms, bandwidth Gbit/s) between the nodes or None, steps (normal, --quick)
NETS = [
    ("unconstrained", None, (40, 20)),
    ("1gbit_1ms", (1, 1), (30, 15)),
    ("100mbit_50ms", (50, 0.1), (12, 6)),
]
CONFIGS = {"mlp": "mlp_fashion", "cnn": "cnn_fashion"}


def add_args(p):
    p.add_argument("--models", default="mlp", help="comma-separated subset of mlp,cnn")
    p.add_argument("--nets", default=",".join(n for n, _, _ in NETS),
                   help="comma-separated subset of " + ",".join(n for n, _, _ in NETS))
    p.add_argument("--sharing", default="rank_pair",
                   help="comma-separated links.sharing values: rank_pair (one link per rank "
                        "pair), node_pair (a node's ranks share its link to the other node)")


def cluster_sets(ctx, net, link, sharing):
    """The --set arguments for one network: dist.node_size alone when
    unconstrained, else a cluster file written to the work directory."""
    if link is None:
        return ["dist.node_size=2"]
    path = ctx.workdir / f"cluster-{net}-{sharing}.toml"
    path.write_text(f'node_size = 2\n[links]\nsharing = "{sharing}"\n[links.inter_node]\n'
                    f"latency_ms = {link[0]}\nbandwidth_gbit_s = {link[1]}\n")
    return [f'dist.cluster="{path}"']


def batch_of(model):
    with open(REPO / "configs" / f"{CONFIGS[model]}.toml", "rb") as f:
        return int(tomllib.load(f).get("train", {}).get("batch_size", 128))


def train(ctx, model, steps, sets, name):
    exe = ctx.ensure_built("meshtrain")
    metrics = ctx.workdir / f"{name}.jsonl"
    cmd = [exe, "train", "--config", REPO / "configs" / f"{CONFIGS[model]}.toml", "--nproc", "4",
           "--quiet"]
    for kv in [f"train.steps={steps}", "train.eval=false", "train.threads=1",
               'train.checkpoint=""', "train.log_every=1"] + sets:
        cmd += ["--set", kv]
    cmd += ["--metrics", metrics]
    env = thread_env(1)
    env.update(mpi_env())
    ctx.log(f"{name}: {' '.join(str(c) for c in cmd[1:])}")
    r = ctx.run(cmd, env, name)
    summary = summary_line(metrics)
    if not r.ok or not summary or not summary.get("samples_per_s"):
        return None, f"meshtrain: {r.failure() if not r.ok else 'no summary with samples_per_s'}"
    if summary.get("world_size") != 4:
        return None, f"meshtrain: world_size {summary.get('world_size')}, expected 4"
    return summary, None


def step_ms(summary, batch):
    return 1000.0 * batch / summary["samples_per_s"]


def run(ctx):
    models = [m for m in ctx.args.models.split(",") if m]
    nets = set(ctx.args.nets.split(","))
    for model in models:
        batch = batch_of(model)
        base_steps = 20 if ctx.quick else 40
        one, err = train(ctx, model, base_steps, [], f"{model}-np4-one-node")
        line = {"name": f"{model}_np4_one_node_step_time", "unit": "ms", "model": model,
                "algorithm": "flat shared_memory", "steps": base_steps}
        if err:
            line["error"] = err
        else:
            line["meshtrain"] = step_ms(one, batch)
            line["final_loss"] = one.get("final_loss")
        ctx.emit(line)
        sharings = ctx.args.sharing.split(",")
        for net, link, (steps, quick_steps) in NETS:
            if net not in nets:
                continue
            for sharing in sharings if link else sharings[:1]:
                run_net(ctx, model, batch, net, link, quick_steps if ctx.quick else steps, sharing)


def run_net(ctx, model, batch, net, link, n, sharing):
    """Hierarchical and flat runs on one network; emits their line."""
    sets = cluster_sets(ctx, net, link, sharing)
    tag = net if link is None or sharing == "rank_pair" else f"{net}_{sharing}"
    hier, err_h = train(ctx, model, n, sets, f"{model}-np4-{tag}-hierarchical")
    flat, err_f = train(ctx, model, n, sets + ["dist.hierarchical=false"],
                        f"{model}-np4-{tag}-flat")
    line = {"name": f"{model}_np4_2nodes_{tag}_step_time", "unit": "ms", "model": model,
            "network": net, "sharing": sharing if link else None, "steps": n, "batch": batch,
            "peer_name": "meshtrain flat all-reduce (ring / halving-doubling)"}
    if err_h or err_f:
        line["error"] = "; ".join(e for e in (err_h, err_f) if e)
        ctx.emit(line)
        return
    lh, lf = hier.get("final_loss"), flat.get("final_loss")
    line.update({"meshtrain": step_ms(hier, batch), "peer": step_ms(flat, batch),
                 "final_loss_hierarchical": lh, "final_loss_flat": lf,
                 "comm_wait_s_per_step_hierarchical": hier.get("comm_wait_s_per_step"),
                 "comm_wait_s_per_step_flat": flat.get("comm_wait_s_per_step")})
    line["ratio"] = line["peer"] / line["meshtrain"]
    if lh is None or lf is None or abs(lh - lf) > 1e-3 * max(1.0, abs(lf)):
        line["error"] = f"final losses differ: hierarchical {lh}, flat {lf}"
    ctx.emit(line)
