"""Published large-run throughput against `meshtrain simulate` on the same plans.

Source: D. Narayanan et al., "Efficient Large-Scale Language Model Training
on GPU Clusters Using Megatron-LM", SC21 (arXiv:2104.04473), on Selene
(DGX A100 80GB nodes of 8, NVLink/NVSwitch inside a node, 8x 200 Gbit/s HDR
InfiniBand per node) -- the shipped configs/cluster/a100_ib200.toml with its
node count set to the run's GPUs / 8. All models: vocabulary 51,200,
sequence 2048, mixed precision (bf16 here; the same 312 TFLOP/s peak),
activation recomputation on every stage (parallel.recompute = true).
Priced as Megatron-LM ran them (megatron_runtime below: 16-bit
activations, fused element-wise kernels, attention dropout, blocking
pipeline p2p; NCCL's achieved bus bandwidth and the A100's achieved
memory bandwidth, both the cluster file's own values with their sources;
--without leaves any of the four out; --runtime meshtrain prices
meshtrain's own executor instead); Table 1's rows interleaved, as the
paper's Section 5.1 says (v chunks per stage: interleave_chunks), Table 2's
1F1B (--schedule 1f1b: every row 1F1B).

  t2_*  Table 2, the PTD-P rows: GPT-3 175B (96 layers, h 12288, 96 heads)
        and 530B (105 layers, h 20480, 128 heads), batch 1536 / 2240,
        micro-batch 1 as the table states; the table gives the model-
        parallel size M = t x p (96, 280), split as t = 8 (Table 1's t for
        these models) and p = M / 8; d = GPUs / M.
  t1_*  Table 1, the rows with pipelines (39.1B .. 1008B): t, p, GPUs and
        batch as the table states; the micro-batch size is not in the
        table: 1 is assumed (line field "assumed").
Table 1's rows without a pipeline (1.7B .. 18.4B) are left out: their
published FLOP/s count a recomputed forward, and without a pipeline the
trainer's recomputation (exec.recompute) recomputes only cheap
activations, not the forward, so the plans would not be the same work.

Lines (unit "TFLOP/s per GPU"): peer = the published achieved TFLOP/s per
GPU; meshtrain = the same FLOP count (the paper's Eq. 3,
96 B s l h^2 (1 + s/6h + V/16lh), which counts the recomputed forward) over
the predicted step time and the GPUs; ratio = meshtrain / peer (so it is
the published step time over the predicted one). Besides: the predicted
and published step times, rank 0's compute / communication / idle split,
and the simulator's own wall time. Nothing here is measured on this
machine; no constant is tuned per configuration: the cluster file's device
numbers are the A100 datasheet's, its matmul efficiency (0.859) the public
maximum-achievable-matmul measurement the file cites, every other operator
at the cost model's default; --matmul-efficiency E overrides the matmuls'
(e.g. 0.5, the default before, or 1.0, the datasheet peak, as bounds).
"""

import re

from common import REPO

S, V = 2048, 51200

# name, layers, hidden, heads, t, p, gpus, batch, micro-batch, published TFLOP/s per GPU, source
CASES = [
    ("t2_gpt175b_384gpus", 96, 12288, 96, 8, 12, 384, 1536, 1, 153.0, "Table 2 (PTD-P)"),
    ("t2_gpt175b_768gpus", 96, 12288, 96, 8, 12, 768, 1536, 1, 149.0, "Table 2 (PTD-P)"),
    ("t2_gpt175b_1536gpus", 96, 12288, 96, 8, 12, 1536, 1536, 1, 141.0, "Table 2 (PTD-P)"),
    ("t2_gpt530b_560gpus", 105, 20480, 128, 8, 35, 560, 2240, 1, 171.0, "Table 2 (PTD-P)"),
    ("t2_gpt530b_1120gpus", 105, 20480, 128, 8, 35, 1120, 2240, 1, 167.0, "Table 2 (PTD-P)"),
    ("t2_gpt530b_2240gpus", 105, 20480, 128, 8, 35, 2240, 2240, 1, 159.0, "Table 2 (PTD-P)"),
    ("t1_gpt39b_512gpus", 48, 8192, 64, 8, 2, 512, 1536, 1, 138.0, "Table 1"),
    ("t1_gpt76b_1024gpus", 60, 10240, 80, 8, 4, 1024, 1792, 1, 140.0, "Table 1"),
    ("t1_gpt146b_1536gpus", 80, 12288, 96, 8, 8, 1536, 2304, 1, 148.0, "Table 1"),
    ("t1_gpt310b_1920gpus", 96, 16384, 128, 8, 16, 1920, 2160, 1, 155.0, "Table 1"),
    ("t1_gpt530b_2520gpus", 105, 20480, 128, 8, 35, 2520, 2520, 1, 163.0, "Table 1"),
    ("t1_gpt1008b_3072gpus", 128, 25600, 160, 8, 64, 3072, 3072, 1, 163.0, "Table 1"),
]
QUICK = {"t2_gpt175b_384gpus", "t2_gpt530b_560gpus"}
PAPER = ("Narayanan et al., Efficient Large-Scale Language Model Training on GPU Clusters "
         "Using Megatron-LM, SC21")


# The runtime these runs used, as the cost model prices it (the cluster
# file's [devices.a100_80gb.runtime], docs/cluster.md): fp16 mixed precision
# keeps activations 16-bit, and Megatron-LM fuses bias+GeLU, bias+dropout+add
# and scale+mask+softmax (the paper's Section 4.2, "Computation
# Optimizations"); its attention dropout (0.1 in its GPT defaults) is a
# kernel of its own after the fused softmax; its pipeline exchange
# (megatron/p2p_communication.py, `_communicate`: batch_isend_irecv, every
# request waited, then torch.cuda.synchronize()) blocks the stage until its
# messages are through.
def megatron_runtime(without):
    lines = ["", "[devices.a100_80gb.runtime]", "half_activations = true",
             "fused_elementwise = true"]
    what = ["fp16 mixed precision (16-bit activations), fused element-wise kernels (Section 4.2)"]
    if "dropout" not in without:
        lines.append("attention_dropout = true")
        what.append("attention dropout after the fused softmax")
    if "p2p" not in without:
        lines.append("blocking_p2p = true")
        what.append("blocking pipeline p2p (megatron/p2p_communication.py)")
    lines.append(f'source = "Megatron-LM as in {PAPER}: {"; ".join(what)}"')
    return "\n".join(lines) + "\n"


# NCCL's achieved bus bandwidth and the A100's achieved memory bandwidth
# are the shipped cluster file's own values (configs/cluster/a100_ib200.toml,
# its [collectives.ALGORITHM.KIND] fits and memory_bandwidth_gb_s, with
# their sources there). --without takes them back out of this run's copy:
# nccl drops the collective fits (the links' line rates then price every
# collective), hbm puts back the datasheet figure the file's comment names.
def without_nccl(text):
    """The file without its [collectives.*] sections."""
    return re.sub(r"(?ms)^\[collectives\.[^\]]*\]\n(?:(?!\[)[^\n]*\n)*", "", text)


def datasheet_hbm(text):
    """The datasheet memory bandwidth named in the file's comment, or None."""
    m = re.search(r"(?m)^memory_bandwidth_gb_s = [0-9.]+\s*#.*datasheet's \[A100\] is ([0-9.]+)",
                  text)
    return float(m.group(1)) if m else None


def interleave_chunks(layers, p):
    """Model chunks per stage for Table 1's interleaved schedule: the paper
    does not give v; the smallest v >= 2 dividing the layers per stage (the
    fewest extra pipeline messages that interleave), one rule for every row."""
    per = layers // p
    for v in range(2, per + 1):
        if per % v == 0:
            return v
    return 1


def add_args(parser):
    parser.add_argument("--only", default="", help="comma-separated case names")
    parser.add_argument("--runtime", choices=("megatron", "meshtrain"), default="megatron",
                        help="megatron (default): price the runtime these runs used (16-bit "
                             "activations, fused element-wise kernels); meshtrain: meshtrain's "
                             "own executor (each operator one pass, activations at graph dtypes)")
    parser.add_argument("--schedule", choices=("paper", "1f1b"), default="paper",
                        help="paper (default): Table 1 rows interleaved (Section 5.1), Table 2 "
                             "rows 1F1B; 1f1b: every row 1F1B without interleaving")
    parser.add_argument("--without", default="", metavar="LIST",
                        help="comma-separated priced overheads to leave out (megatron runtime): "
                             "nccl (links at line rate), hbm (datasheet memory bandwidth), "
                             "dropout, p2p (sends overlapped)")
    parser.add_argument("--matmul-efficiency", type=float, default=None, metavar="E",
                        help="fraction of the bf16 peak every matmul reaches (default: the "
                             "cluster file's, 0.859 from its [MAMF] source)")


def megatron_flops(batch, layers, hidden):
    """Eq. 3 of the paper: FLOPs per iteration, recomputation included."""
    return 96.0 * batch * S * layers * hidden * hidden * (
        1.0 + S / (6.0 * hidden) + V / (16.0 * layers * hidden))


def run(ctx):
    exe = ctx.ensure_built("meshtrain")
    base = (REPO / "configs" / "cluster" / "a100_ib200.toml").read_text()
    only = {s for s in ctx.args.only.split(",") if s}
    eff = ctx.args.matmul_efficiency
    without = {w for w in ctx.args.without.split(",") if w}
    unknown = without - {"nccl", "hbm", "dropout", "p2p"}
    if unknown:
        raise SystemExit(f"bench/run published: --without: unknown {sorted(unknown)} "
                         "(expected nccl, hbm, dropout, p2p)")
    for (name, layers, hidden, heads, t, p, gpus, batch, mb, published, table) in CASES:
        if only and name not in only:
            continue
        if ctx.quick and not only and name not in QUICK:
            continue
        d = gpus // (t * p)
        m = batch // d // mb
        v = interleave_chunks(layers, p) if table == "Table 1" and ctx.args.schedule == "paper" else 1
        schedule = "interleaved" if v > 1 else "1f1b"
        if v > 1 and m % p != 0:
            v, schedule = 1, "1f1b"
        line = {"name": name, "unit": "TFLOP/s per GPU", "peer": published,
                "peer_name": f"{PAPER}, {table}",
                "plan": {"tp": t, "pp": p, "dp": d, "gpus": gpus, "batch": batch,
                         "micro_batch": mb, "microbatches": m,
                         "schedule": schedule, "virtual_stages": v, "recompute": True, "layers": layers,
                         "hidden": hidden, "heads": heads, "vocab": V, "seq": S},
                "matmul_efficiency": eff if eff is not None else "a100_ib200.toml's (0.859)",
                "runtime": ctx.args.runtime,
                "priced_overheads": [] if ctx.args.runtime != "megatron" else
                [o for o in ("nccl", "hbm", "dropout", "p2p") if o not in without]}
        if table == "Table 1":
            line["assumed"] = "micro-batch size 1 (Table 1 does not state it)" + (
                f"; {v} model chunks per stage (the interleaved schedule's v is not stated)"
                if v > 1 else "")
        if t * p * d != gpus or batch % (d * mb) != 0:
            line["error"] = "the published plan does not divide"
            ctx.emit(line)
            continue
        text, n = re.subn(r"(?m)^count = \d+", f"count = {gpus // 8}", base)
        if n != 1:
            line["error"] = "a100_ib200.toml has no `count =` line"
            ctx.emit(line)
            continue
        if eff is not None:
            text, n = re.subn(r"(?m)^matmul = [0-9.]+", f"matmul = {eff}", text)
            if n != 1:
                line["error"] = "a100_ib200.toml has no `matmul =` efficiency line"
                ctx.emit(line)
                continue
        if ctx.args.runtime == "megatron":
            if "hbm" in without:
                sheet = datasheet_hbm(text)
                text, n = re.subn(r"(?m)^memory_bandwidth_gb_s = [0-9.]+",
                                  f"memory_bandwidth_gb_s = {sheet:g}", text) if sheet else (text, 0)
                if n != 1:
                    line["error"] = ("a100_ib200.toml has no `memory_bandwidth_gb_s =` line "
                                     "naming the datasheet's figure")
                    ctx.emit(line)
                    continue
            if "nccl" in without:
                text = without_nccl(text)
            text += megatron_runtime(without)
        cluster = ctx.workdir / f"{name}-cluster.toml"
        cluster.write_text(text)
        config = ctx.workdir / f"{name}.toml"
        config.write_text(
            f"[model]\nkind = \"gpt\"\nlayers = {layers}\nd_model = {hidden}\nheads = {heads}\n"
            f"seq_len = {S}\nvocab = {V}\n"
            f"[train]\nbatch_size = {batch}\nprecision = \"bf16\"\neval = false\n"
            "[optim]\nname = \"adamw\"\n"
            f"[parallel]\ntp = {t}\npp = {p}\ndp = {d}\nmicrobatches = {m}\n"
            f"schedule = \"{schedule}\"\nvirtual_stages = {v}\nrecompute = true\n")
        cmd = [exe, "simulate", "--config", config, "--cluster", cluster]
        ctx.log(f"{name}: {' '.join(str(c) for c in cmd[1:])}")
        r = ctx.run(cmd, name=name, timeout_s=900)
        if not r.ok:
            line["error"] = r.failure()
            ctx.emit(line)
            continue
        out = r.stdout
        m = re.search(r"predicted step time: ([0-9.]+) s\b", out)
        t = r"([0-9.]+) (s|ms|us)\s+"
        row = re.search(r"^\s*rank 0 \+\d+\s+" + t + t + t + r"([0-9.]+)%\s+([0-9.]+) GiB", out,
                        re.M)
        if not m or float(m.group(1)) <= 0:
            line["error"] = "no positive predicted step time"
            ctx.emit(line)
            continue
        step = float(m.group(1))
        flops = megatron_flops(batch, layers, hidden)
        predicted = flops / (step * gpus) / 1e12
        line.update({
            "meshtrain": round(predicted, 1),
            "ratio": round(predicted / published, 3),
            "predicted_step_s": step,
            "published_step_s": round(flops / (published * 1e12 * gpus), 3),
            "simulate_wall_s": round(r.wall_s, 2),
        })
        if row:
            scale = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
            sec = [float(row.group(i)) * scale[row.group(i + 1)] for i in (1, 3, 5)]
            line.update({"rank0_compute_s": sec[0], "rank0_comm_s": sec[1],
                         "rank0_idle_s": sec[2],
                         "rank0_peak_memory_gib": float(row.group(8))})
        ctx.emit(line)
