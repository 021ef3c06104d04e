"""bench/run SUITE [--quick] [options]: runs one benchmark suite and prints
its result lines (JSON, one per line) on stdout; progress goes to stderr.

A suite is a module bench/suites/<name>.py with a docstring (its first line is
the description `bench/run --help` shows), an optional add_args(parser) and
run(ctx). Adding a suite is adding such a file.
"""

import argparse
import importlib
import sys
import time

from common import REPO, BenchError, Context

SUITES_DIR = REPO / "bench" / "suites"


def available_suites():
    return sorted(p.stem for p in SUITES_DIR.glob("*.py") if not p.stem.startswith("_"))


def load_suite(name):
    sys.path.insert(0, str(SUITES_DIR))
    return importlib.import_module(name)


def describe(name):
    doc = (load_suite(name).__doc__ or "").strip().splitlines()
    return doc[0] if doc else ""


def main(argv):
    suites = available_suites()
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: bench/run SUITE [--quick] [suite options]\n\nsuites:", file=sys.stderr)
        for s in suites:
            print(f"  {s:8s} {describe(s)}", file=sys.stderr)
        print("\nbench/run SUITE --help lists a suite's options; see bench/README.md",
              file=sys.stderr)
        return 0 if argv else 2
    name = argv[0]
    if name not in suites:
        print(f"bench/run: unknown suite '{name}'; suites are: {', '.join(suites)}",
              file=sys.stderr)
        return 2
    suite = load_suite(name)
    parser = argparse.ArgumentParser(prog=f"bench/run {name}", description=describe(name))
    parser.add_argument("--quick", action="store_true",
                        help="fewer steps, for a smoke test (figures are noisier)")
    parser.add_argument("--idle-wait", type=float, default=20.0, metavar="S",
                        help="before each run, wait up to S seconds (4*S per suite) for the "
                             "rest of the machine to use under 25%% of its CPUs; 0: never wait")
    if hasattr(suite, "add_args"):
        suite.add_args(parser)
    args = parser.parse_args(argv[1:])
    ctx = Context(name, args)
    t0 = time.monotonic()
    try:
        suite.run(ctx)
    except BenchError as e:
        print(f"bench/run {name}: {e}", file=sys.stderr)
        return 1
    finally:
        ctx.cleanup()
    ctx.summary_table()
    ctx.log(f"done in {time.monotonic() - t0:.0f} s, {ctx.errors} line(s) with errors")
    return 1 if ctx.errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
