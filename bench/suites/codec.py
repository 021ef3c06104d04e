"""Gradient codecs over MPI: runs build/bench/comm/codec_bench on 2 ranks (--np) and passes its lines through.

codec_bench (bench/comm/codec_bench.cpp) measures the compressed all-reduce
of sync/compressed_all_reduce.h: the sparse codecs' (index, value)
all-gather against a dense all-reduce of the densified result at densities
0.001..0.5 (the crossover), the 16-bit casts reduced in their dtype against
all-gathered and summed in f32, and each codec's time and bytes sent per rank
on a 1024 x 1024 tensor (the communicator's counters, checked against the
prediction). Every comparison is verified before it is timed. This suite adds
"suite": "codec" where a line lacks it and the CPU (cpu_vendor, cpu_model,
cpu_isa); mpirun gets the transport of the mpi tests (pml ob1, btl
self,vader). --quick sets MT_BENCH_QUICK=1 (1M elements only, fewer samples).
"""

import json
import sys

from common import cpu_context, mpi_env

NPROC = 2


def add_args(p):
    p.add_argument("--np", type=int, default=NPROC, help="MPI ranks (default 2)")


def run(ctx):
    exe = ctx.ensure_built("bench/comm/codec_bench")
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--mca", "pml", "ob1",
           "--mca", "btl", "self,vader", "-np", str(ctx.args.np), exe]
    env = mpi_env()
    if ctx.quick:
        env["MT_BENCH_QUICK"] = "1"
    ctx.log(" ".join(str(c) for c in cmd))
    r = ctx.run(cmd, env, "codec_bench")
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
        line.setdefault("suite", "codec")
        line.update(cpu)
        line["others_cpu"] = r.others_cpu
        print(json.dumps(line), flush=True)
        ctx.lines.append(line)
        passed += 1
        if line.get("error"):
            ctx.errors += 1
    sys.stderr.write(r.stderr)
    if not r.ok or passed == 0:
        ctx.emit({"name": "codec_bench", "unit": "lines", "value": passed, "np": ctx.args.np,
                  "error": r.failure() if not r.ok else "codec_bench printed no JSON line"})
