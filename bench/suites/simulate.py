"""The simulator at scale: `meshtrain simulate` on GPT-3-175B-shaped plans.

GPT-3 175B's shape (96 layers, d_model 12288, 96 heads, seq 2048; the
model's byte-level vocabulary of 256), bf16, AdamW, TP=8 x PP=16 with 1F1B
over 192 micro-batches, on A100 80GB nodes of 8 (the shipped
configs/cluster/a100_ib200.toml with its node count raised):

  gpt3_175b_1024ranks   DP=8,  global batch 1536, 128 nodes
  gpt3_175b_4096ranks   DP=32, global batch 6144, 512 nodes (not with --quick)

Lines (unit s): meshtrain = wall time of the whole command (reading the
config, building, lowering and cutting the graphs of the distinct rank
programs, simulating every rank), with build_s / simulate_s as the command
prints them, peak RSS of the process (MiB), the distinct rank programs, and
the prediction itself (step_s, mfu). No peer: nothing else here simulates
these plans. Verified: exit status 0, 128 distinct programs (2 per tensor
coordinate and stage, whatever the data-parallel degree), a positive step
time, and the trace file (first 64 ranks) parses as JSON with events.
"""

import json
import re

from common import REPO

CASES = [
    ("gpt3_175b_1024ranks", 8, 1536, 128),
    ("gpt3_175b_4096ranks", 32, 6144, 512),
]


def run(ctx):
    exe = ctx.ensure_built("meshtrain")
    base = (REPO / "configs" / "cluster" / "a100_ib200.toml").read_text()
    for name, dp, batch, nodes in CASES[:1] if ctx.quick else CASES:
        cluster = ctx.workdir / f"{name}.toml"
        text, n = re.subn(r"(?m)^count = \d+", f"count = {nodes}", base)
        if n != 1:
            ctx.emit({"name": name, "unit": "s", "error": "a100_ib200.toml has no `count =` line"})
            continue
        cluster.write_text(text)
        config = ctx.workdir / f"{name}-model.toml"
        config.write_text(
            "[model]\nkind = \"gpt\"\nlayers = 96\nd_model = 12288\nheads = 96\nseq_len = 2048\n"
            f"[train]\nbatch_size = {batch}\nprecision = \"bf16\"\neval = false\n"
            "[optim]\nname = \"adamw\"\n"
            f"[parallel]\ntp = 8\npp = 16\ndp = {dp}\nmicrobatches = 192\n")
        trace = ctx.workdir / f"{name}-trace.json"
        cmd = [exe, "simulate", "--config", config, "--cluster", cluster, "--trace", trace]
        ctx.log(f"{name}: {' '.join(str(c) for c in cmd[1:])}")
        r = ctx.run(cmd, name=name, timeout_s=600)
        line = {"name": name, "unit": "s", "ranks": 8 * 16 * dp, "peer": None,
                "peer_name": "none (no other simulator of these plans here)"}
        if not r.ok:
            line["error"] = r.failure()
            ctx.emit(line)
            continue
        out = r.stdout

        def grab(pattern, conv=float):
            m = re.search(pattern, out)
            return conv(m.group(1)) if m else None

        step = grab(r"predicted step time: ([0-9.]+) s\b")
        programs = grab(r"distinct rank programs: (\d+)", int)
        line.update({
            "meshtrain": r.wall_s,
            "build_s": grab(r"built the programs in ([0-9.]+) s"),
            "simulate_s": grab(r"simulated in ([0-9.]+) s"),
            "maxrss_mib": r.maxrss_kib / 1024.0,
            "distinct_programs": programs,
            "predicted_step_s": step,
            "predicted_mfu_percent": grab(r"MFU: ([0-9.]+)%"),
            "others_cpu": r.others_cpu,
        })
        errors = []
        if programs != 128:
            errors.append(f"{programs} distinct programs, expected 128")
        if not step or step <= 0:
            errors.append("no positive predicted step time in seconds")
        try:
            events = json.loads(trace.read_text()).get("traceEvents", [])
            if len(events) < 1000:
                errors.append(f"the trace has only {len(events)} events")
        except (OSError, ValueError) as e:
            errors.append(f"the trace does not parse: {e}")
        if errors:
            line["error"] = "; ".join(errors)
        ctx.emit(line)
