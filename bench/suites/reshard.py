"""Cross-mesh resharding over MPI: runs build/bench/comm/reshard_bench on 4 ranks and passes its lines through.

reshard_bench (bench/comm/reshard_bench.cpp) moves a 1024 x 1024 f32 tensor
from a layout on ranks {0, 1} to one on ranks {2, 3} (replicated to
replicated, partial sum to replicated, rows split to columns split) with
spmd/reshard.h's plan ("meshtrain") and with the plain way ("peer": source
rank 0 assembles the whole tensor and sends it whole to each destination);
times, bytes sent and bytes crossing between the two rank sets, each side
verified bitwise before it is timed. No PyTorch peer: PyTorch's DTensor
redistributes within one mesh only. This suite adds "suite": "reshard"
where a line lacks it and the CPU (cpu_vendor, cpu_model, cpu_isa); mpirun
gets the transport of the mpi tests (pml ob1, btl self,vader). --quick sets
MT_BENCH_QUICK=1 (512 x 512, fewer samples).
"""

import json
import sys

from common import cpu_context, mpi_env


def run(ctx):
    exe = ctx.ensure_built("bench/comm/reshard_bench")
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--mca", "pml", "ob1",
           "--mca", "btl", "self,vader", "-np", "4", exe]
    env = mpi_env()
    if ctx.quick:
        env["MT_BENCH_QUICK"] = "1"
    ctx.log(" ".join(str(c) for c in cmd))
    r = ctx.run(cmd, env, "reshard_bench")
    passed = 0
    cpu = cpu_context()
    for text in r.stdout.splitlines():
        try:
            line = json.loads(text) if text.lstrip().startswith("{") else None
        except json.JSONDecodeError:
            line = None
        if not isinstance(line, dict):
            print(text, file=sys.stderr)
            continue
        line.setdefault("suite", "reshard")
        line.update(cpu)
        line["others_cpu"] = r.others_cpu
        print(json.dumps(line), flush=True)
        ctx.lines.append(line)
        passed += 1
        if line.get("error"):
            ctx.errors += 1
    sys.stderr.write(r.stderr)
    if not r.ok or passed == 0:
        ctx.emit({"name": "reshard_bench", "unit": "lines", "value": passed, "np": 4,
                  "error": r.failure() if not r.ok else "reshard_bench printed no JSON line"})
