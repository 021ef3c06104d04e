"""Shared machinery of bench/run: where the binaries and the PyTorch venv are,
how children are started (thread pinning, time limit, peak RSS through
os.wait4), and how result lines are printed.

stdout carries only JSON lines; everything meant for a person goes to stderr.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PEERS = REPO / "bench" / "peers"

# Seconds a single child may run before it is killed; keeps a suite bounded
# when something hangs (a rank that never joins, a stuck compile).
DEFAULT_CHILD_TIMEOUT_S = 420


class BenchError(Exception):
    """A failure that ends the suite (not one measurement): missing build,
    venv that cannot be created, unknown suite."""


# Per model: the global batch when its config does not say, timed steps and
# warm-up steps (normal, --quick), and the unit of its throughput lines (GPT's
# samples are sequences of model.seq_len tokens).
MODEL_PLAN = {
    "mlp": {"batch": 128, "steps": (60, 20), "warmup": (10, 3), "unit": "samples/s"},
    "cnn": {"batch": 128, "steps": (30, 8), "warmup": (5, 2), "unit": "samples/s"},
    "gpt": {"batch": 16, "steps": (20, 6), "warmup": (5, 2), "unit": "tokens/s"},
}


def parse_models(text):
    """Model names from a comma-separated --models value."""
    models = [m for m in text.split(",") if m]
    for m in models:
        if m not in MODEL_PLAN:
            raise BenchError(f"--models: unknown model '{m}' (expected {', '.join(MODEL_PLAN)})")
    return models


def steps_for(ctx, model):
    """(timed steps, warm-up steps) for model under ctx's --quick."""
    q = 1 if ctx.quick else 0
    return MODEL_PLAN[model]["steps"][q], MODEL_PLAN[model]["warmup"][q]


class ChildResult:
    """What one finished child process left: exit status, its output files,
    peak RSS in KiB (ru_maxrss of the child and the descendants it reaped),
    wall time in seconds, and others_cpu: the share of the machine's CPUs
    (0..1) that other processes used while it ran."""

    def __init__(self, cmd, rc, stdout, stderr, maxrss_kib, wall_s, timed_out):
        self.cmd = cmd
        self.rc = rc
        self.stdout = stdout
        self.stderr = stderr
        self.maxrss_kib = maxrss_kib
        self.wall_s = wall_s
        self.timed_out = timed_out
        self.others_cpu = None

    @property
    def ok(self):
        return self.rc == 0 and not self.timed_out

    def failure(self):
        """One-line reason for a failed child, with the tail of its stderr."""
        what = "timed out" if self.timed_out else f"exit status {self.rc}"
        tail = " | ".join(line for line in self.stderr.strip().splitlines()[-4:])
        return f"{Path(self.cmd[0]).name} {what}" + (f": {tail}" if tail else "")

    def json_lines(self):
        """The JSON objects this child printed on stdout, in order."""
        out = []
        for line in self.stdout.splitlines():
            line = line.strip()
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
        return out


def thread_env(n):
    """Environment that pins every BLAS / OpenMP runtime to n threads."""
    return {"OMP_NUM_THREADS": str(n), "MKL_NUM_THREADS": str(n), "OPENBLAS_NUM_THREADS": str(n)}


def mpi_env():
    """Lets Open MPI's launcher run as root, as it does on CI and here."""
    return {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


# ISA extensions worth naming on a result line (the ones kernels and copies use).
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
             "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "asimd", "sve")


def cpu_context():
    """{"cpu_vendor", "cpu_model", "cpu_family_model", "cpu_isa"} of this
    machine from /proc/cpuinfo (family and model number say which core it is
    where a virtual machine shortens the brand string; the ISA as the
    architecture and the notable extensions it lists); "unknown" where a
    field cannot be read."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("vendor_id", "model name", "cpu family", "model", "flags",
                           "Features") and key not in info:
                    info[key] = value.strip()
    except OSError:
        pass
    flags = set((info.get("flags") or info.get("Features") or "").split())
    isa = " ".join([os.uname().machine] + [f for f in ISA_FLAGS if f in flags])
    family_model = (f"family {info['cpu family']}, model {info['model']}"
                    if "cpu family" in info and "model" in info else "unknown")
    return {"cpu_vendor": info.get("vendor_id", "unknown"),
            "cpu_model": info.get("model name", "unknown"), "cpu_family_model": family_model,
            "cpu_isa": isa}


# Where the two sides' bytes travel, for the transport fields of comparison
# lines. One process moves none; meshtrain's ranks run under `meshtrain train
# --nproc` (cli/launch.cpp: mpirun --mca btl self,vader), the PyTorch peer's
# under DistributedDataParallel over gloo.
SINGLE_PROCESS = "none (one process)"
MESHTRAIN_MPI = ("Open MPI{version}, btl self,vader (shared memory): collectives chosen by size "
                 "among an MPI-3 shared-memory window (MPI_Win_allocate_shared, 1 MiB per rank), "
                 "ring / halving-doubling over MPI point-to-point and Open MPI's own")
PEER_GLOO = "gloo over TCP on 127.0.0.1 (loopback)"


def mpi_version():
    """" x.y.z" of the mpirun on PATH, or "" when it cannot be asked."""
    try:
        out = subprocess.run(["mpirun", "--version"], capture_output=True, text=True,
                             timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    words = out.split()
    return next((" " + w for w in words if w[:1].isdigit()), "")


def transport_context(distributed):
    """{"meshtrain_transport", "peer_transport"} of a line: what carries the
    bytes between ranks on each side (a one-process line moves none)."""
    if not distributed:
        return {"meshtrain_transport": SINGLE_PROCESS, "peer_transport": SINGLE_PROCESS}
    return {"meshtrain_transport": MESHTRAIN_MPI.format(version=mpi_version()),
            "peer_transport": PEER_GLOO}


# Summary keys by which meshtrain may name the kernel libraries it chose
# (the engine choice itself is the fast backend's business).
ENGINE_KEYS = ("engines", "engine", "matmul_engine", "matmul_engines", "conv_engine",
               "matmul_library", "cpu_engines")


def summary_line(metrics_path):
    """The `{"summary": true, ...}` line of a meshtrain metrics file (JSON
    lines), or None when the file or the line is missing."""
    if not metrics_path.exists():
        return None
    summary = None
    for text in metrics_path.read_text(errors="replace").splitlines():
        try:
            line = json.loads(text)
        except json.JSONDecodeError:
            continue
        if isinstance(line, dict) and line.get("summary") is True:
            summary = line
    return summary


def meshtrain_engine_context(summary, exec_matmul="measure"):
    """{"meshtrain_engines": text}: the engines meshtrain's run reports in its
    summary line when it does (any of ENGINE_KEYS), else what its
    configuration allows (exec.matmul) and that the run did not say which it
    picked. OPENBLAS_CORETYPE, which pins OpenBLAS's kernels, is named when
    set."""
    reported = {k: summary[k] for k in ENGINE_KEYS if summary and summary.get(k) is not None}
    if reported:
        text = "; ".join(f"{k}: {v if isinstance(v, str) else json.dumps(v)}"
                         for k, v in reported.items())
    elif exec_matmul == "measure":
        text = ("f32 matmul oneDNN or OpenBLAS, picked per shape by timing (exec.matmul=measure; "
                "the run does not report which), convolution oneDNN, element-wise AVX-512")
    else:
        text = f"f32 matmul {exec_matmul}, convolution oneDNN, element-wise AVX-512"
    core = os.environ.get("OPENBLAS_CORETYPE")
    if core:
        text += f"; OPENBLAS_CORETYPE={core}"
    return {"meshtrain_engines": text}


def busy_cpu_seconds():
    """CPU seconds all processes have spent busy since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    # guest time is already counted in user; count it once.
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def fast_rate(rates):
    """The 90th percentile of per-step rates: the speed of the steps that the
    machine's other users left alone. None for no rates."""
    if not rates:
        return None
    return sorted(rates)[int(0.9 * (len(rates) - 1))]


def ratio(num, den):
    if num is None or den is None or den == 0:
        return None
    return num / den


def mib(kib):
    return None if kib is None else round(kib / 1024.0, 1)


class Context:
    """One invocation of bench/run: the options, the build and venv it uses,
    a scratch directory, and the printer of result lines. Not thread-safe."""

    def __init__(self, suite, args):
        self.suite = suite
        self.args = args
        self.quick = args.quick
        self.build_dir = Path(os.environ.get("MT_BUILD_DIR", REPO / "build")).resolve()
        self.default_build = self.build_dir == (REPO / "build").resolve()
        self.venv = Path(os.environ.get("MT_BENCH_VENV", self.build_dir / "bench-venv")).resolve()
        self.workdir = Path(tempfile.mkdtemp(prefix=f"mt-bench-{suite}-"))
        self.errors = 0
        self.lines = []
        self.started = time.monotonic()
        self.ncpu = os.cpu_count() or 1
        self.idle_wait_s = getattr(args, "idle_wait", 0.0)
        self.idle_budget_s = 4 * self.idle_wait_s  # for the whole suite
        self._built = set()
        self._torch_python = None
        # Merged into every line emit() prints (a line's own fields win): the
        # CPU, so no figure goes out without the machine that produced it.
        # Suites add their own (transport, engines) with add_context().
        self.line_context = cpu_context()
        self._peer_matmul = {}

    def add_context(self, fields):
        """Adds fields to every line printed from now on (see line_context)."""
        self.line_context.update({k: v for k, v in fields.items() if v is not None})

    # ---- output -----------------------------------------------------------

    def emit(self, line):
        """Prints one result line; "suite" first, floats rounded for reading,
        the load average added."""
        out = {"suite": self.suite}
        for k, v in line.items():
            if isinstance(v, float):
                v = round(v, 4) if abs(v) < 100 else round(v, 1)
            out[k] = v
        for k, v in self.line_context.items():
            out.setdefault(k, v)
        # The box is shared: the 1-minute load average, taken as the line is
        # printed (right after its runs), tells a reader how noisy it was.
        out["loadavg_1m"] = round(os.getloadavg()[0], 2)
        if out.get("error"):
            self.errors += 1
        self.lines.append(out)
        print(json.dumps(out), flush=True)

    def summary_table(self):
        """The comparison lines as a table for a person (stderr), one row each."""
        rows = [ln for ln in self.lines if "ratio" in ln]
        if not rows:
            return
        def fmt(v):
            if v is None:
                return "-"
            return f"{v:.3g}" if isinstance(v, float) and abs(v) < 100 else f"{v:.0f}"
        print(f"\n{'name':30s} {'thr':>3s} {'peer':34s} {'meshtrain':>10s} {'peer':>10s} "
              f"{'ratio':>6s} {'fast':>6s} {'busy':>9s} {'matmul GF/s':>11s}", file=sys.stderr)
        for ln in rows:
            thr = ln.get("threads", ln.get("processes", ""))
            busy = "/".join(fmt(ln.get(k)) for k in ("meshtrain_others_cpu", "peer_others_cpu"))
            mm_keys = ("meshtrain_matmul_gflops", "peer_matmul_gflops")
            mm = ("/".join(fmt(ln.get(k)) for k in mm_keys)
                  if "meshtrain_matmul_gflops" in ln else "")
            print(f"{ln['name'][:30]:30s} {str(thr):>3s} {str(ln.get('peer_name'))[:34]:34s} "
                  f"{fmt(ln.get('meshtrain')):>10s} {fmt(ln.get('peer')):>10s} "
                  f"{fmt(ln.get('ratio')):>6s} {fmt(ln.get('ratio_fast')):>6s} {busy:>9s} {mm:>11s}"
                  + ("  ERROR" if ln.get("error") else ""), file=sys.stderr)
        print("(ratio > 1: meshtrain better; fast: p90 step rates; busy: others' CPU share "
              "during meshtrain/peer; matmul: meshtrain/peer GFLOP/s)", file=sys.stderr)
        cpu = self.line_context
        print(f"CPU: {cpu.get('cpu_vendor')} {cpu.get('cpu_model')} "
              f"({cpu.get('cpu_family_model')}; {cpu.get('cpu_isa')})",
              file=sys.stderr)

    def log(self, msg):
        t = time.monotonic() - self.started
        print(f"[bench {self.suite} {t:6.1f}s] {msg}", file=sys.stderr, flush=True)

    def cleanup(self):
        shutil.rmtree(self.workdir, ignore_errors=True)

    # ---- children ---------------------------------------------------------

    def wait_idle(self):
        """Waits (up to --idle-wait seconds per run, 4x that per suite) until
        the rest of the machine uses under a quarter of its CPUs, so that a
        measurement does not start in the middle of someone else's build."""
        waited = 0.0
        while True:
            b0, t0 = busy_cpu_seconds(), time.monotonic()
            time.sleep(1.0)
            busy = (busy_cpu_seconds() - b0) / ((time.monotonic() - t0) * self.ncpu)
            if busy < 0.25 or waited >= min(self.idle_wait_s, self.idle_budget_s):
                break
            waited += 1.0
        if waited:
            self.idle_budget_s -= waited
            self.log(f"waited {waited:.0f} s for the machine to quieten (now {100 * busy:.0f}% "
                     f"busy; {self.idle_budget_s:.0f} s of waiting left)")

    def start(self, cmd, env_extra=None, name="child", wait_idle=True):
        """Starts cmd in its own process group with stdout/stderr to files in
        the scratch directory, after wait_idle() unless told not to."""
        if wait_idle and self.idle_wait_s > 0:
            self.wait_idle()
        env = dict(os.environ)
        env.update(env_extra or {})
        out_path = self.workdir / f"{name}.out"
        err_path = self.workdir / f"{name}.err"
        t0, busy0 = time.monotonic(), busy_cpu_seconds()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            p = subprocess.Popen([str(c) for c in cmd], stdout=out, stderr=err, env=env,
                                 cwd=REPO, start_new_session=True)
        return p, out_path, err_path, t0, busy0

    def finish(self, started, timeout_s=DEFAULT_CHILD_TIMEOUT_S):
        """Waits for children from start() with os.wait4 (for ru_maxrss),
        killing a child's process group when its time is up. The children
        of one call are taken to have run together: others_cpu is the same
        for all of them."""
        t0 = min(s[3] for s in started)
        busy0 = min(s[4] for s in started)
        results, own_cpu = [], 0.0
        for p, out_path, err_path, _, _ in started:
            timed_out = threading.Event()

            def kill(proc=p, flag=timed_out):
                flag.set()
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

            left = max(1.0, timeout_s - (time.monotonic() - t0))
            timer = threading.Timer(left, kill)
            timer.start()
            try:
                _, status, ru = os.wait4(p.pid, 0)
            finally:
                timer.cancel()
            own_cpu += ru.ru_utime + ru.ru_stime
            p.returncode = os.waitstatus_to_exitcode(status)  # Popen must not wait again
            results.append(ChildResult(p.args, p.returncode,
                                       out_path.read_text(errors="replace"),
                                       err_path.read_text(errors="replace"), ru.ru_maxrss,
                                       time.monotonic() - t0, timed_out.is_set()))
        wall = time.monotonic() - t0
        others = max(0.0, busy_cpu_seconds() - busy0 - own_cpu) / max(wall * self.ncpu, 1e-9)
        for r in results:
            r.others_cpu = round(min(others, 1.0), 3)
        return results

    def run(self, cmd, env_extra=None, name="child", timeout_s=DEFAULT_CHILD_TIMEOUT_S):
        return self.finish([self.start(cmd, env_extra, name)], timeout_s)[0]

    # ---- what the suites need ---------------------------------------------

    def binary(self, rel):
        return self.build_dir / rel

    def ensure_built(self, rel):
        """Returns the path of build_dir/rel, building meshtrain first when it
        is missing (scripts/setup for the default build/, else the CMake target
        of that name). Raises BenchError if it still is not there."""
        path = self.binary(rel)
        if path.exists():
            return path
        key = "setup" if self.default_build else rel
        if key in self._built:
            raise BenchError(f"{path} does not exist after building")
        self._built.add(key)
        if self.default_build:
            self.log(f"{path} is missing: running scripts/setup (apt packages + build)")
            cmd = [str(REPO / "scripts" / "setup")]
        else:
            target = Path(rel).name
            self.log(f"{path} is missing: building target {target} in {self.build_dir}")
            cmd = ["cmake", "--build", str(self.build_dir), "--target", target]
        rc = subprocess.call(cmd, cwd=REPO, stdout=sys.stderr, stderr=sys.stderr)
        if rc != 0 or not path.exists():
            raise BenchError(f"{path} does not exist ({' '.join(cmd)} exited with {rc})")
        return path

    def torch_python(self):
        """Path of the venv's python with torch and numpy; creates the venv
        and installs them from PyPI on first use (a multi-GB download)."""
        if self._torch_python:
            return self._torch_python
        py = self.venv / "bin" / "python"
        marker = self.venv / ".bench-ready"
        if not marker.exists():
            self.log(f"creating the PyTorch venv in {self.venv} (first use only)")
            if not py.exists():
                rc = subprocess.call([sys.executable, "-m", "venv", str(self.venv)],
                                     stdout=sys.stderr, stderr=sys.stderr)
                if rc != 0:
                    raise BenchError(f"python3 -m venv {self.venv} failed (exit {rc}); "
                                     "install python3-venv")
            self.log("pip install torch numpy: the PyPI torch wheel for linux x86_64 brings "
                     "its CUDA libraries, about 3 GB to download and 5 GB on disk")
            rc = subprocess.call([str(py), "-m", "pip", "install", "--progress-bar", "on",
                                  "torch", "numpy"], stdout=sys.stderr, stderr=sys.stderr)
            if rc != 0:
                raise BenchError(f"pip install torch numpy into {self.venv} failed (exit {rc})")
            check = subprocess.run([str(py), "-c", "import torch, numpy; print(torch.__version__)"],
                                   capture_output=True, text=True)
            if check.returncode != 0:
                raise BenchError(f"torch does not import in {self.venv}: {check.stderr.strip()}")
            marker.write_text(check.stdout)
            self.log(f"torch {check.stdout.strip()} ready")
        self._torch_python = py
        return py

    def peer(self, args, threads, name, env_extra=None, timeout_s=DEFAULT_CHILD_TIMEOUT_S):
        """Runs bench/peers/torch_train.py with args, pinned to `threads`;
        returns (its JSON result or None, ChildResult)."""
        env = thread_env(threads)
        env.update(env_extra or {})
        r = self.run([self.torch_python(), PEERS / "torch_train.py", *args], env, name, timeout_s)
        lines = r.json_lines()
        return (lines[-1] if r.ok and lines else None), r

    def peer_matmul(self, model, threads, setup_args):
        """The peer's matrix-product rate on `model`'s own shapes at `threads`
        threads (torch_train.py --matmul-probe: the mm/addmm/bmm calls of one
        eager training step, forward and backward, timed again on the same
        shapes and strides), with the peer's BLAS context; a dict of
        peer_* fields, {"peer_matmul_error": why} when the probe failed.
        Measured once per (model, threads) and suite."""
        key = (model, threads)
        if key not in self._peer_matmul:
            res, r = self.peer(["--model", model, "--threads", str(threads), "--matmul-probe",
                                *setup_args], threads, f"torch-mm-{model}-t{threads}")
            if res is None:
                out = {"peer_matmul_error": r.failure()}
            else:
                out = {k: v for k, v in res.items()
                       if k.startswith("peer_") and k != "peer_threads"}
                self.log(f"peer torch matmuls of the {model} step at {threads} thread(s): "
                         f"{out.get('peer_matmul_gflops') or 0:.1f} GFLOP/s "
                         f"({out.get('peer_engines')})")
            self._peer_matmul[key] = out
        return self._peer_matmul[key]
