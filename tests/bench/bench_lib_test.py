"""Checks of bench/lib and the accuracy suite's peer settings that need no
PyTorch and time nothing: every line gets the CPU and the suite's context,
a line's own fields win, transports and engines are named, the PyTorch
peer gets the config's optimizer and schedule, and its learning rate per
step follows meshtrain's formula (src/meshtrain/train/lr_schedule.cpp), and
the plan suite reads `meshtrain simulate`'s report."""

import argparse
import contextlib
import io
import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "bench" / "lib"), str(REPO / "bench" / "suites"),
                str(REPO / "bench" / "peers")]

import common  # noqa: E402

failures = []


def check(cond, what):
    if not cond:
        failures.append(what)


import os  # noqa: E402
cpu = common.cpu_context()
check(set(cpu) == {"cpu_vendor", "cpu_model", "cpu_family_model", "cpu_isa"},
      f"cpu_context keys: {sorted(cpu)}")
check(os.uname().machine != "x86_64" or cpu["cpu_family_model"].startswith("family "),
      f"cpu_family_model on x86: {cpu}")
import os  # noqa: E402
check(cpu["cpu_isa"].split()[0] == os.uname().machine, f"cpu_isa starts with the arch: {cpu}")

one = common.transport_context(distributed=False)
check(one == {"meshtrain_transport": "none (one process)", "peer_transport": "none (one process)"},
      f"one-process transport: {one}")
many = common.transport_context(distributed=True)
check("shared-memory window" in many["meshtrain_transport"], f"meshtrain transport: {many}")
check("gloo" in many["peer_transport"] and "127.0.0.1" in many["peer_transport"],
      f"peer transport: {many}")

eng = common.meshtrain_engine_context({"matmul_engine": "onednn"})
check("matmul_engine: onednn" in eng["meshtrain_engines"], f"reported engine: {eng}")
eng = common.meshtrain_engine_context({"samples_per_s": 1.0})
check("exec.matmul=measure" in eng["meshtrain_engines"] and "does not report" in
      eng["meshtrain_engines"], f"unreported engine: {eng}")

args = argparse.Namespace(quick=False, idle_wait=0.0)
ctx = common.Context("selftest", args)
try:
    ctx.add_context({"meshtrain_transport": "T", "skipped": None})
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ctx.emit({"name": "x", "unit": "u", "value": 1.0, "cpu_model": "given"})
    line = json.loads(out.getvalue())
    check(line["cpu_vendor"] == cpu["cpu_vendor"], f"emit adds the CPU: {line}")
    check(line["cpu_model"] == "given", f"a line's own field wins: {line}")
    check(line["meshtrain_transport"] == "T" and "skipped" not in line,
          f"add_context fields (None left out): {line}")
    check(list(line)[0] == "suite" and "loadavg_1m" in line, f"suite first, load added: {line}")
finally:
    ctx.cleanup()

import core  # noqa: E402
import meshtrain  # noqa: E402

# The matmuls' share of the f32 step (behind the bf16 bound) is a mean over a
# mean: 8 ms of matmuls per step against steps of 10 ms, with one slow step
# (30 ms) that moves the mean but not the median; warm-up steps left out.
steps = [{"step": i, "samples_per_s": 128 / 0.5} for i in range(1, 7)]  # warm-up
steps += [{"step": i, "samples_per_s": 128 / 0.010} for i in range(7, 16)]
steps += [{"step": 16, "samples_per_s": 128 / 0.030}]
f32 = meshtrain.MeshtrainRun({"samples_per_s": 12800.0, "matmul_s_per_step": 0.0096}, steps,
                             None, None, 1.0)
bf = meshtrain.MeshtrainRun({"matmul_s_per_step": 0.0048}, [], None, None, 1.0)
fields = core.matmul_fields(bf, f32, 128)
check(abs(core.mean_step_s(f32, 128) - 0.012) < 1e-9, f"mean step: {core.mean_step_s(f32, 128)}")
check(fields["f32_matmul_share"] == 0.8 and fields["matmul_speedup"] == 2.0,
      f"matmul share from mean step time: {fields}")
no_steps = core.matmul_fields(bf, meshtrain.MeshtrainRun(f32.summary, [], None, None, 1.0), 128)
check(no_steps["f32_matmul_share"] == 0.96, f"share without step lines (median rate): {no_steps}")

import accuracy  # noqa: E402

ctx = argparse.Namespace(quick=False)
peer = accuracy.peer_args(ctx, "mlp")


def arg(name):
    return peer[peer.index(name) + 1]


cfg = accuracy.read_config("mlp")
check(float(arg("--lr")) == cfg["optim"]["lr"] and arg("--schedule") == cfg["optim"]["schedule"],
      f"mlp peer optimizer: {peer}")
check(("--nesterov" in peer) == cfg["optim"].get("nesterov", False), f"nesterov: {peer}")
check(arg("--epochs") == str(cfg["train"]["epochs"]), f"mlp epochs: {peer}")
gpt = accuracy.peer_args(ctx, "gpt")
check(gpt[gpt.index("--steps") + 1] == "300", f"gpt runs the documented 300 steps: {gpt}")
check(gpt[gpt.index("--opt") + 1] == "adamw", f"gpt optimizer: {gpt}")
quick = accuracy.peer_args(argparse.Namespace(quick=True), "cnn")
check(quick[quick.index("--epochs") + 1] == "1", f"--quick cnn: {quick}")

import torch_accuracy  # noqa: E402

a = argparse.Namespace(lr=1.0, min_lr=0.1, warmup_steps=10, schedule="cosine")
check(math.isclose(torch_accuracy.lr_at(a, 0, 110), 0.1), "warm-up starts at lr/warmup")
check(math.isclose(torch_accuracy.lr_at(a, 9, 110), 1.0), "warm-up ends at lr")
check(math.isclose(torch_accuracy.lr_at(a, 60, 110), 0.55), "cosine half way: (lr+min)/2")
check(math.isclose(torch_accuracy.lr_at(a, 110, 110), 0.1), "cosine ends at min_lr")
a.schedule = "constant"
check(torch_accuracy.lr_at(a, 60, 110) == 1.0, "constant after warm-up")

# bench/run plan reads `meshtrain simulate`'s report (this is its format,
# from a run of configs/gpt_text.toml at tp=2 with ratios [2, 1]).
import plan  # noqa: E402

report = """predicted step time: 347.745 ms
throughput: 46.0 samples/s, 5890 tokens/s
per program (first rank shown): ranks / compute / comm (all lanes) / idle / utilisation / peak memory / sent per step
  rank 0         256.399 ms   2.336 ms  88.950 ms  73.7% 142.22 MiB  35.49 MiB
  rank 1         345.348 ms   2.336 ms     0.0 us  99.3% 106.42 MiB  34.76 MiB
max peak memory 142.22 MiB ; max sent per step 35.49 MiB
"""
got = plan.parse_simulate(report)
check(got == {"predicted_step_ms": 347.745, "predicted_peak_mib": 142.22,
              "predicted_peak_mib_per_program": [[0, 142.22], [1, 106.42]]},
      f"plan.parse_simulate: {got}")
got = plan.parse_simulate("predicted step time: 1.5 s\n  rank 0 +3   1.0 s  0 B  0 B  99.0%"
                          "  1.50 GiB  12.00 KiB\nmax peak memory 1.50 GiB ; max sent 12 KiB\n")
check(got.get("predicted_step_ms") == 1500.0 and got.get("predicted_peak_mib") == 1536.0
      and got.get("predicted_peak_mib_per_program") == [[0, 1536.0]],
      f"plan.parse_simulate with s / GiB and a shared program: {got}")
check(plan.rel(110.0, 100.0) == 0.1 and plan.rel(1.0, None) is None, "plan.rel")

for f in failures:
    print("FAILED:", f)
print(f"{len(failures)} failure(s)")
sys.exit(1 if failures else 0)
