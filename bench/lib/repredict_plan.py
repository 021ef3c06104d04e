"""Re-predict `bench/run plan`'s lines with today's model, against the
measurements of saved runs: how a change of the cost model moves the
per-line errors without training again (the trainings are the machine's;
the predictions are the model's).

  python3 bench/lib/repredict_plan.py --cluster SAVED-CLUSTER.toml RUN.jsonl [RUN.jsonl ...]
      [--cores N] [--device KEY=VALUE ...] [--efficiency OP=VALUE ...]

For each plan line of bench/suites/plan.py: `meshtrain simulate` with the
suite's settings on the saved calibrated cluster file as it is ("old"),
and on the same file with `cores = N` on its node and each --device
KEY=VALUE added to [devices.cpu] and each --efficiency OP=VALUE set in its
[devices.cpu.efficiency] ("new"). Each run's line is then
re-predicted as its own prediction x new / old (a run whose cluster file
was not saved keeps its own calibration that way) and compared with its
measured step. Prints the per-line errors and each run's median absolute
error before and after. MT_BUILD_DIR chooses the binary (default build/).
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench" / "suites"))
sys.path.insert(0, str(REPO / "bench" / "lib"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cluster", required=True)
    ap.add_argument("--cores", type=int, default=0)
    ap.add_argument("--device", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--efficiency", action="append", default=[], metavar="OP=VALUE")
    ap.add_argument("runs", nargs="+")
    a = ap.parse_args()
    import plan  # the suite's PLANS
    exe = REPO / os.environ.get("MT_BUILD_DIR", "build") / "meshtrain"
    base = Path(a.cluster).read_text()
    tmp = Path(tempfile.mkdtemp(prefix="repredict-"))

    def cluster(n, new):
        t = re.sub(r"(?m)^ranks_per_node = \d+", f"ranks_per_node = {n}", base)
        if new:
            t = re.sub(r"(?m)^cores = \d+\n", "", t)
            if a.cores:
                t = re.sub(r"(?m)^ranks_per_node = \d+", lambda m: f"{m.group(0)}\ncores = {a.cores}", t)
            for kv in a.device:
                k, _ = kv.split("=", 1)
                t = re.sub(rf"(?m)^{re.escape(k)} = .*\n", "", t)
                t = t.replace("[devices.cpu]\n", f"[devices.cpu]\n{kv}\n", 1)
            for kv in a.efficiency:
                k, v = kv.split("=", 1)
                t, n = re.subn(rf'(?m)^"{re.escape(k)}" = .*$', f'"{k}" = {v}', t)
                if n != 1:
                    sys.exit(f"--efficiency {kv}: no single efficiency line for {k}")
        p = tmp / f"c{n}{'new' if new else 'old'}.toml"
        p.write_text(t)
        return p

    def simulate(model, n, sets, c):
        cmd = [str(exe), "simulate", "--config", str(plan.meshtrain.config_path(model)),
               "--cluster", str(c)]
        for kv in ["train.eval=false", "train.threads=1", 'train.checkpoint=""', f"dist.nproc={n}"] + sets:
            cmd += ["--set", kv]
        out = subprocess.run(cmd, capture_output=True, text=True).stdout
        m = re.search(r"predicted step time: ([0-9.]+) (s|ms|us)", out)
        return float(m.group(1)) * {"s": 1e3, "ms": 1.0, "us": 1e-3}[m.group(2)] if m else None

    runs = {}
    for f in a.runs:
        for line in open(f):
            d = json.loads(line)
            if d.get("measured_step_ms") and d.get("predicted_step_ms"):
                runs.setdefault(f, {})[d["name"][len("plan_"):]] = (d["predicted_step_ms"],
                                                                     d["measured_step_ms"])
    errs = {f: ([], []) for f in runs}
    print(f"{'plan':34s} {'old ms':>8s} {'new ms':>8s}  " +
          "  ".join(f"{Path(f).stem}: before -> after" for f in runs))
    for name, model, n, sets in plan.PLANS:
        old = simulate(model, n, sets, cluster(n, False))
        new = simulate(model, n, sets, cluster(n, True))
        cols = []
        for f, lines in runs.items():
            if name not in lines or not old or not new:
                continue
            p, m = lines[name]
            b, af = (p - m) / m, (p * new / old - m) / m
            errs[f][0].append(abs(b))
            errs[f][1].append(abs(af))
            cols.append(f"{100 * b:+7.1f}% -> {100 * af:+7.1f}%")
        print(f"{name:34s} {old or 0:8.2f} {new or 0:8.2f}  " + "  ".join(cols))
    for f, (b, af) in errs.items():
        print(f"{Path(f).stem}: median |error| {100 * statistics.median(b):.1f}% "
              f"({sum(e <= 0.10 for e in b)} of {len(b)} within 10%) -> "
              f"{100 * statistics.median(af):.1f}% ({sum(e <= 0.10 for e in af)} within 10%)")


if __name__ == "__main__":
    main()
