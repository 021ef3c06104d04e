"""Collectives over MPI: runs build/bench/comm/comm_bench on 2 ranks and passes its lines through.

comm_bench prints its own JSON lines (one per collective and size, each
result checked before and after timing, see bench/comm/comm_bench.cpp); this
suite adds "suite": "comm" where a line lacks it, the CPU (cpu_vendor,
cpu_model, cpu_isa) and, to comparison lines, meshtrain_others_cpu =
peer_others_cpu (other processes' share of the CPUs over the whole
comm_bench run, in which the two sides alternate), and forwards the rest of its
output to stderr. mpirun is told the Open MPI transport the mpi tests use
(pml ob1, btl self,vader: shared memory), and comm_bench reports it on each
line. --quick sets MT_BENCH_QUICK=1 in comm_bench's environment. --choice
measured makes meshtrain's side use the measured algorithm choice (the
collective probe, comm/probe.h); each line says which ("algorithm_choice").
"""

import json
import sys

from common import cpu_context, mpi_env

NPROC = 2


def add_args(p):
    p.add_argument("--np", type=int, default=NPROC, help="MPI ranks (default 2)")
    p.add_argument("--algorithms", action="store_true",
                   help="passed to comm_bench: also value lines for each explicit algorithm")
    p.add_argument("--choice", choices=["static", "measured"], default="static",
                   help="passed to comm_bench: meshtrain's algorithm choice (dist.algorithm_choice); "
                        "measured runs the collective probe first (default static)")


def run(ctx):
    exe = ctx.ensure_built("bench/comm/comm_bench")
    # The same Open MPI transport as tests/comm (MT_MPIRUN): shared memory only.
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--mca", "pml", "ob1",
           "--mca", "btl", "self,vader", "-np", str(ctx.args.np), exe]
    if ctx.args.algorithms:
        cmd.append("--algorithms")
    cmd += ["--choice", ctx.args.choice]
    env = mpi_env()
    if ctx.quick:
        env["MT_BENCH_QUICK"] = "1"
    ctx.log(" ".join(str(c) for c in cmd))
    r = ctx.run(cmd, env, "comm_bench")
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
        line.setdefault("suite", "comm")
        line.update(cpu)
        # Both sides alternate sample by sample within one comm_bench run, so
        # the run's figure is each side's (and the closing table shows it).
        if "ratio" in line:
            line["meshtrain_others_cpu"] = line["peer_others_cpu"] = r.others_cpu
        print(json.dumps(line), flush=True)
        ctx.lines.append(line)  # for the closing table
        passed += 1
        if line.get("error"):
            ctx.errors += 1
    sys.stderr.write(r.stderr)
    if not r.ok or passed == 0:
        ctx.emit({"name": "comm_bench", "unit": "lines", "value": passed, "np": ctx.args.np,
                  "error": r.failure() if not r.ok else "comm_bench printed no JSON line"})
