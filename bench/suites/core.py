"""Single-process training (MLP, CNN, GPT at 1 and 2 threads) vs PyTorch eager and torch.compile.

For each model and thread count it trains meshtrain, PyTorch eager and
PyTorch torch.compile one after the other, then prints, per peer mode:
  <model>_train_throughput  samples/s (tokens/s for GPT), ratio = meshtrain/peer
  <model>_peak_rss          MiB of the child process, ratio = peer/meshtrain
  <model>_peak_rss_increment  the same less what the process holds before
                            training (PyTorch: after `import torch`; meshtrain:
                            `meshtrain --version`), ratio = peer/meshtrain
Throughput lines carry both sides' matmul GFLOP/s: meshtrain's inside its step
(summary matmul_gflops), PyTorch's from torch's own kernels timed on the
matrix products of one eager step of the same model (torch_train.py
--matmul-probe), with the peer's BLAS (peer_engines) and meshtrain's engines.
At 1 thread it also prints sgemm_peak (GFLOP/s of the big square SGEMM, with
the bf16 GEMM peak beside it) and
mlp_train_matmul_gflops (meshtrain's matmul rate inside the MLP step), and
<model>_bf16_vs_f32_*, <model>_auto_vs_f32_throughput and <model>_f16_vs_f32_*
lines for meshtrain's own mixed precision (and train.precision = auto) against
its f32 (MLP, GPT), with the matmuls' own speed-up inside the step; the bf16 and
auto lines add the bound the machine allows (from the f32 step's matmul share
and the bf16/f32 GEMM ratio measured on the model's shapes) and the fraction of
it reached. <model>_bf16_storage_vs_f32_* (MLP, CNN, GPT): f32 compute with
the activations the backward reads stored in bf16; throughput against own f32
with the casts' share of the step, and planned arena and peak RSS against
own f32 (--mixed-only skips the peers and prints only these own-f32 lines).
"""

import meshtrain
from common import MODEL_PLAN as PLAN
from common import (BenchError, PEERS, meshtrain_engine_context, mib, parse_models, ratio,
                    steps_for, thread_env, transport_context)

NOTE = ("peer trains on synthetic random data of the same shapes (throughput does not depend "
        "on values), with the model sizes, batch, optimizer and clipping of meshtrain's config; "
        "median step time after warm-up; torch.compile compiles the model, the optimizer step "
        "runs eagerly")


# The trainer's warm-up steps (kWarmupSteps in train/trainer.cpp) plus the
# step at which it resets its profile.
MEAN_SKIP_STEPS = 6


def add_args(p):
    p.add_argument("--models", default="mlp,cnn,gpt", help="comma-separated subset of mlp,cnn,gpt")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    p.add_argument("--peer-only", action="store_true",
                   help="skip meshtrain (peer figures only, e.g. before meshtrain builds)")
    p.add_argument("--precisions", default="bf16,auto,f16,bf16_storage",
                   help="meshtrain precisions compared with its own f32 at 1 thread")
    p.add_argument("--mixed-only", action="store_true",
                   help="only meshtrain's precisions against its own f32 (no peers)")


def run_peer(ctx, model, mode, threads, steps, warmup, setup_args):
    res, r = ctx.peer(["--model", model, "--mode", mode, "--threads", str(threads),
                       "--steps", str(steps), "--warmup", str(warmup), *setup_args],
                      threads, f"torch-{model}-{mode}-t{threads}")
    if res is None:
        ctx.log(f"peer {model} {mode} t{threads} failed: {r.failure()}")
        return None, r.failure(), r
    ctx.log(f"peer {model} {mode} t{threads}: {res['samples_per_s']:.1f} samples/s "
            f"(median step {res['step_ms_median']:.1f} ms, warm-up {res['warmup_s']:.1f} s)")
    return res, None, r


def run_meshtrain(ctx, model, threads, steps, warmup, precision="f32"):
    if ctx.args.peer_only:
        return meshtrain.MeshtrainRun(None, [], None, None, 0.0)
    run = meshtrain.train(ctx, model, steps + warmup, threads, precision)
    if run.samples_per_s:
        ctx.log(f"meshtrain {model} {precision} t{threads}: {run.samples_per_s:.1f} samples/s")
    return run


def torch_mm_gflops(ctx):
    """torch.mm on 2048x2048 f32 at 1 thread, median of 7: returns
    (GFLOP/s, None), or (None, error)."""
    code = ("import torch,time,statistics;torch.set_num_threads(1);n=2048;"
            "a=torch.rand(n,n);b=torch.rand(n,n);c=a@b;ts=[]\n"
            "for _ in range(7):\n t=time.perf_counter();torch.mm(a,b,out=c);"
            "ts.append(time.perf_counter()-t)\n"
            "print(2*n**3/statistics.median(ts)/1e9)")
    r = ctx.run([ctx.torch_python(), "-c", code], thread_env(1), "torch-mm")
    if not r.ok:
        return None, r.failure()
    return float(r.stdout.strip().splitlines()[-1]), None


def sgemm_peak(ctx):
    """Peak single-thread SGEMM GFLOP/s: the largest square sgemm case of
    build/bench/kernels_bench, or torch.mm 2048^3 when that binary is missing.
    torch.mm's rate is measured either way and reported beside it: it is the
    GEMM the PyTorch peer's linear layers run on."""
    mm, mm_err = torch_mm_gflops(ctx)
    exe = ctx.binary("bench/kernels_bench")
    why = "build/bench/kernels_bench is missing"
    if exe.exists():
        r = ctx.run([exe, "--benchmark_filter=^(sgemm|bf16gemm)_", "--benchmark_format=json"],
                    thread_env(1), "kernels_bench")
        best = pick_square_sgemm(r.stdout) if r.ok else None
        if best:
            bf16 = pick_square_sgemm(r.stdout, "bf16gemm")
            return {"value": best[1], "source": f"kernels_bench {best[0]}",
                    "peer_torch_mm_2048_gflops": mm,
                    "bf16_peak_gflops": bf16[1] if bf16 else None,
                    "bf16_source": f"kernels_bench {bf16[0]}" if bf16 else None,
                    **kernels_bench_machine(r.stdout)}
        why = r.failure() if not r.ok else "no square sgemm case with a GFLOP/s counter"
        ctx.log(f"kernels_bench: {why}; falling back to torch.mm")
    out = {"value": mm, "source": f"torch.mm 2048x2048x2048 (fallback: {why})"}
    if mm_err:
        out["error"] = mm_err
    return out


def kernels_bench_machine(stdout):
    """cpu, isa, onednn_isa and openblas_core from kernels_bench's JSON context."""
    import json

    try:
        context = json.loads(stdout).get("context", {})
    except json.JSONDecodeError:
        return {}
    return {k: context[k] for k in ("cpu", "isa", "onednn_isa", "openblas_core") if k in context}


def pick_square_sgemm(stdout, kind="sgemm"):
    """From Google Benchmark JSON, the (name, GFLOP/s) of the fastest case
    among the largest square ones whose name starts with `kind` (sgemm: f32,
    bf16gemm: bf16; several engines may run that size).
    Sizes come from the name's numeric arguments (x/2048 or x/M/N/K); the rate
    from a counter whose name mentions flop."""
    import json
    import re

    try:
        doc = json.loads(stdout)
    except json.JSONDecodeError:
        return None
    best = None
    for b in doc.get("benchmarks", []):
        if b.get("run_type") == "aggregate" or not b.get("name", "").lower().startswith(kind):
            continue
        dims = [int(x) for x in re.findall(r"/(\d+)", b["name"])]
        if not dims or len(set(dims[:3])) != 1:
            continue
        rate = None
        for k, v in b.items():
            if "flop" in k.lower() and isinstance(v, (int, float)):
                rate = v / 1e9 if v > 1e6 else v  # counters may be FLOP/s or GFLOP/s
                break
        if rate and (best is None or (dims[0], rate) > (best[2], best[1])):
            best = (b["name"], rate, dims[0])
    return best[:2] if best else None


def meshtrain_baseline_kib(ctx):
    """Peak RSS of `meshtrain --version` (KiB): the binary and its shared
    libraries loaded, no model or data, the counterpart of the peer's RSS
    after `import torch`. None when it cannot be run. Measured once."""
    if not hasattr(ctx, "_mt_baseline"):
        ctx._mt_baseline = None
        try:
            r = ctx.run([ctx.ensure_built("meshtrain"), "--version"], thread_env(1),
                        "meshtrain-version")
            if r.ok:
                ctx._mt_baseline = r.maxrss_kib
        except BenchError:
            pass
    return ctx._mt_baseline


def minus(a, b):
    return None if a is None or b is None else a - b


def compare(ctx, model, threads, steps, warmup, setup, mt, peers, matmul):
    """Prints throughput and RSS lines of meshtrain against each peer mode;
    `matmul` is the peer's matmul probe (Context.peer_matmul)."""
    plan = PLAN[model]
    seq, batch = setup["seq"], setup["batch"]
    mt_rate = mt.samples_per_s * seq if mt.samples_per_s else None
    mt_fast = mt.fast_samples_per_s(warmup)
    mt_fast = mt_fast * seq if mt_fast else None
    for mode, (res, err, child) in peers.items():
        rss = child.maxrss_kib if res else None
        peer_rate = res["samples_per_s"] * seq if res else None
        peer_fast = res["batch"] / res["step_ms_p10"] * 1e3 * seq if res else None
        version = res["torch_version"] if res else "?"
        ctx_fields = {
            "model": model, "threads": threads,
            "peer_threads": res["peer_threads"] if res else None,
            "batch": batch, "steps": steps, "warmup": warmup,
        }
        if seq > 1:
            ctx_fields["seq"] = seq
        ctx_fields["meshtrain_others_cpu"] = mt.others_cpu
        ctx_fields["peer_others_cpu"] = child.others_cpu
        ctx_fields.update(meshtrain_engine_context(mt.summary))
        ctx_fields["peer_engines"] = (res or {}).get("peer_engines", matmul.get("peer_engines"))
        error = "; ".join(e for e in (mt.error, f"peer: {err}" if err else None) if e) or None
        line = {"name": f"{model}_train_throughput", "unit": plan["unit"],
                "meshtrain": mt_rate, "peer": peer_rate, "ratio": ratio(mt_rate, peer_rate),
                "peer_name": f"pytorch-{version} {mode}", **ctx_fields,
                "meshtrain_fast": mt_fast, "peer_fast": peer_fast,
                "ratio_fast": ratio(mt_fast, peer_fast)}
        line["meshtrain_matmul_gflops"] = mt.get("matmul_gflops")
        for key in ("peer_matmul_gflops", "peer_matmul_gflop_per_step", "peer_matmul_shapes",
                    "peer_matmul_error"):
            if key in matmul:
                line[key] = matmul[key]
        line["matmul_gflops_ratio"] = ratio(mt.get("matmul_gflops"),
                                            matmul.get("peer_matmul_gflops"))
        if res:
            line["peer_warmup_s"] = res["warmup_s"]
            line["peer_optimizer"] = res["optimizer"]
        line["note"] = NOTE
        if error:
            line["error"] = error
        ctx.emit(line)
        line = {"name": f"{model}_peak_rss", "unit": "MiB", "meshtrain": mib(mt.maxrss_kib),
                "peer": mib(rss), "ratio": ratio(rss, mt.maxrss_kib),
                "peer_name": f"pytorch-{version} {mode}", **ctx_fields}
        base = meshtrain_baseline_kib(ctx) if mt.maxrss_kib else None
        peer_import = res["import_maxrss_kib"] if res else None
        line["meshtrain_baseline_rss_mib"] = mib(base)
        line["peer_import_rss_mib"] = mib(peer_import)
        for key in ("planned_arena_bytes", "allocated_arena_bytes"):
            if mt.get(key) is not None:
                line[f"meshtrain_{key}"] = mt.get(key)
        line["note"] = ("ru_maxrss of the child process, all it holds (the total); "
                        "peer_import_rss_mib is what `import torch` alone costs (the PyPI wheel "
                        "maps its CUDA libraries), meshtrain_baseline_rss_mib what `meshtrain "
                        "--version` costs; <model>_peak_rss_increment compares the rest")
        if error:
            line["error"] = error
        ctx.emit(line)
        mt_inc, peer_inc = minus(mt.maxrss_kib, base), minus(rss, peer_import)
        line = {"name": f"{model}_peak_rss_increment", "unit": "MiB", "meshtrain": mib(mt_inc),
                "peer": mib(peer_inc), "ratio": ratio(peer_inc, mt_inc),
                "peer_name": f"pytorch-{version} {mode}", **ctx_fields,
                "meshtrain_total_mib": mib(mt.maxrss_kib), "meshtrain_baseline_rss_mib": mib(base),
                "peer_total_mib": mib(rss), "peer_import_rss_mib": mib(peer_import),
                "note": ("peak RSS less what the process holds before training: PyTorch's after "
                         "`import torch`, meshtrain's `meshtrain --version` (binary and shared "
                         "libraries loaded). meshtrain's includes the real data set it reads "
                         "(Fashion-MNIST: 47 MB of u8 pixels; text: the corpus), the peer's only "
                         "4 synthetic batches")}
        if base is None and mt.maxrss_kib:
            line["error"] = "meshtrain --version could not be run for the baseline RSS"
        if error:
            line["error"] = error
        ctx.emit(line)


def mean_step_s(run, batch, skip=MEAN_SKIP_STEPS):
    """Mean step time in seconds over the run's step lines after the first
    `skip` (the steps whose matmuls the summary's matmul_s_per_step, a mean,
    covers: the trainer's profile starts after its warm-up); None without
    them. A mean against a mean: the median step rate against the mean
    matmul time gave shares above 1 on a loaded machine."""
    lines = sorted((s for s in run.steps if s.get("samples_per_s")), key=lambda s: s.get("step", 0))
    times = [batch / s["samples_per_s"] for s in lines[skip:]]
    return sum(times) / len(times) if times else None


def matmul_fields(bf, f32, batch, precision="bf16"):
    """What bounds the bf16 speed-up: matmul time per step in each precision
    (from the runs' summaries), their ratio, and the share of the f32 step
    the matmuls take. The step cannot speed up by more than the matmuls do
    unless everything else speeds up more."""
    b_mm, f_mm = bf.get("matmul_s_per_step"), f32.get("matmul_s_per_step")

    def ms(sec):
        return round(sec * 1e3, 3) if sec else None

    share = None
    step_s = mean_step_s(f32, batch)
    if f_mm and step_s:
        share = round(f_mm / step_s, 4)
    elif f_mm and f32.samples_per_s:
        share = round(f_mm * f32.samples_per_s / batch, 4)
    return {f"matmul_ms_per_step_{precision}": ms(b_mm), "matmul_ms_per_step_f32": ms(f_mm),
            "matmul_speedup": ratio(f_mm, b_mm), "f32_matmul_share": share}


def op_profile_line(ctx, model, threads, setup, mt):
    """<model>_op_profile: where meshtrain's f32 step time goes (ms per step
    by operator kind, from the summary's op_profile_ms_per_step; `value` is
    the median step time)."""
    prof = mt.get("op_profile_ms_per_step")
    if ctx.args.peer_only or not prof or not mt.samples_per_s:
        return
    step_ms = 1e3 * setup["batch"] / mt.samples_per_s
    ops = {k: round(v, 3) for k, v in sorted(prof.items(), key=lambda kv: -kv[1]) if v >= 0.005}
    share = {k: round(v / step_ms, 4) for k, v in ops.items()}
    line = {"name": f"{model}_op_profile", "unit": "ms/step", "value": round(step_ms, 3),
            "threads": threads, "model": model, "batch": setup["batch"], "ms_per_step": ops,
            "share_of_step": share, "meshtrain_others_cpu": mt.others_cpu,
            "note": "executor time per operator kind (forward and backward; matmul_batched = "
                    "attention's), optimizer = the optimizer step with gradient sync"}
    for key in ("cpu", "isa"):
        if mt.get(key):
            line[key] = mt.get(key)
    ctx.emit(line)


def precision_bound(f32_share, gemm_ratio, floor=None):
    """The most the step can speed up when only its matmuls change speed:
    1 / ((1 - s) + s / r), s = the matmuls' share of the f32 step, r = the
    bf16/f32 GEMM rate ratio measured on the model's shapes (the run's
    precision_decision). `floor` 1.0 for auto, which may keep f32."""
    if not f32_share or not gemm_ratio:
        return None
    b = 1.0 / ((1.0 - f32_share) + f32_share / gemm_ratio)
    return round(max(b, floor) if floor else b, 3)


def mixed_lines(ctx, model, steps, warmup, setup, f32, precision="bf16"):
    """<model>_<precision>_vs_f32_throughput and _peak_rss: meshtrain with
    train.precision=precision against its own f32 run `f32` (1 thread)."""
    bf = run_meshtrain(ctx, model, 1, steps, warmup, precision=precision)
    plan = PLAN[model]
    seq, batch = setup["seq"], setup["batch"]
    error = "; ".join(e for e in (f32.error, bf.error) if e) or None
    common = {"peer_name": "meshtrain f32", "model": model, "threads": 1, "precision": precision,
              "batch": batch, "steps": steps, "warmup": warmup,
              "meshtrain_others_cpu": bf.others_cpu, "peer_others_cpu": f32.others_cpu}
    for key in ("cpu", "isa"):
        if bf.get(key):
            common[key] = bf.get(key)
    b_rate = bf.samples_per_s * seq if bf.samples_per_s else None
    f_rate = f32.samples_per_s * seq if f32.samples_per_s else None
    b_fast, f_fast = bf.fast_samples_per_s(warmup), f32.fast_samples_per_s(warmup)
    b_fast = b_fast * seq if b_fast else None
    f_fast = f_fast * seq if f_fast else None
    mm = matmul_fields(bf, f32, batch, precision)
    line = {"name": f"{model}_{precision}_vs_f32_throughput", "unit": plan["unit"],
            "meshtrain": b_rate, "peer": f_rate, "ratio": ratio(b_rate, f_rate), **common,
            "meshtrain_fast": b_fast, "peer_fast": f_fast, "ratio_fast": ratio(b_fast, f_fast),
            "meshtrain_matmul_gflops": bf.get("matmul_gflops"),
            "peer_matmul_gflops": f32.get("matmul_gflops"),
            **mm, **meshtrain_engine_context(bf.summary)}
    if precision == "bf16_storage":
        # The casts are the mode's only extra work; the step cannot beat f32.
        prof = bf.get("op_profile_ms_per_step") or {}
        cast_ms = prof.get("cast")
        step_ms = 1e3 * batch / bf.samples_per_s if bf.samples_per_s else None
        f_mm = mm["f32_matmul_share"]
        line.update({
            "cast_ms_per_step": round(cast_ms, 3) if cast_ms is not None else None,
            "cast_share_of_step": ratio(cast_ms, step_ms),
            "bound": round(1.0 - cast_ms / step_ms, 3) if cast_ms and step_ms else None,
            # What bf16 compute would give where bf16 GEMMs run at 0.65x f32
            # (issue 10's Intel Xeon without AMX), from this f32 step's
            # matmul share: the figure storage is to beat there.
            "bf16_bound_at_intel_gemm_ratio_0_65": precision_bound(f_mm, 0.65),
            "bound_note": "storage: 1 - cast share of the step (the casts are its only extra "
                          "work); bf16 compute at 0.65x GEMM rate: 1/((1-s)+s/0.65)"})
    if precision in ("bf16", "auto"):
        decision = bf.get("precision_decision") or {}
        gemm_ratio = decision.get("bf16_over_f32")
        bound = precision_bound(mm["f32_matmul_share"], gemm_ratio,
                                1.0 if precision == "auto" else None)
        line.update({
            "precision_chosen": decision.get("chosen"),
            "bf16_over_f32_gemm_model_shapes": round(gemm_ratio, 3) if gemm_ratio else None,
            "bound": bound,
            "fraction_of_bound": ratio(ratio(b_rate, f_rate), bound),
            "bound_note": "1/((1-s)+s/r): s = matmul share of the f32 step, r = bf16/f32 GEMM "
                          "rate on the model's shapes at 1 thread (precision_decision)"
                          + ("; auto: at least 1 (it may keep f32)" if precision == "auto" else "")})
    if error:
        line["error"] = error
    ctx.emit(line)
    if precision == "auto":
        return  # its memory is bf16's or f32's, both measured
    line = {"name": f"{model}_{precision}_vs_f32_peak_rss", "unit": "MiB",
            "meshtrain": mib(bf.maxrss_kib), "peer": mib(f32.maxrss_kib),
            "ratio": ratio(f32.maxrss_kib, bf.maxrss_kib), **common,
            "meshtrain_planned_arena_bytes": bf.get("planned_arena_bytes"),
            "peer_planned_arena_bytes": f32.get("planned_arena_bytes")}
    if error:
        line["error"] = error
    ctx.emit(line)


def run(ctx):
    models = parse_models(ctx.args.models)
    threads_list = [int(t) for t in ctx.args.threads.split(",") if t]
    if not (PEERS / "torch_train.py").exists():
        raise BenchError("bench/peers/torch_train.py is missing")
    ctx.torch_python()  # create the venv up front, not in the middle of timings
    ctx.add_context(transport_context(distributed=False))
    for model in models:
        steps, warmup = steps_for(ctx, model)
        setup = meshtrain.peer_setup(model, PLAN[model]["batch"])
        precisions = [p for p in ctx.args.precisions.split(",") if p]
        if model == "cnn":  # mixed-precision matmuls are the MLP's and GPT's
            precisions = [p for p in precisions if p == "bf16_storage"]
        for threads in threads_list:
            mt = run_meshtrain(ctx, model, threads, steps, warmup)
            op_profile_line(ctx, model, threads, setup, mt)
            if ctx.args.mixed_only:
                if threads == 1:
                    for precision in precisions:
                        mixed_lines(ctx, model, steps, warmup, setup, mt, precision)
                continue
            peers = {mode: run_peer(ctx, model, mode, threads, steps, warmup, setup["args"])
                     for mode in ("eager", "compile")}
            matmul = ctx.peer_matmul(model, threads, setup["args"])
            compare(ctx, model, threads, steps, warmup, setup, mt, peers, matmul)
            if model == "mlp" and threads == 1:
                peak = sgemm_peak(ctx)
                line = {"name": "sgemm_peak", "unit": "GFLOP/s", "value": peak["value"],
                        "threads": 1, "source": peak["source"]}
                for key in ("peer_torch_mm_2048_gflops", "bf16_peak_gflops", "bf16_source",
                            "cpu", "isa", "onednn_isa", "openblas_core"):
                    if key in peak:
                        line[key] = peak[key]
                line["peer_engines"] = matmul.get("peer_engines")
                if peak.get("bf16_peak_gflops") and peak["value"]:
                    # The most a bf16 matmul can gain over f32 on this CPU.
                    line["bf16_over_f32_peak"] = round(peak["bf16_peak_gflops"] / peak["value"], 3)
                if peak.get("error"):
                    line["error"] = peak["error"]
                ctx.emit(line)
                if ctx.args.peer_only:
                    continue
                gf = mt.get("matmul_gflops")
                line = {"name": "mlp_train_matmul_gflops", "unit": "GFLOP/s", "value": gf,
                        "threads": 1, "model": "mlp", "batch": setup["batch"],
                        "fraction_of_sgemm_peak": ratio(gf, peak["value"]),
                        "note": "matmul FLOPs / matmul time inside meshtrain's training step "
                                "(summary metrics line)"}
                if mt.error:
                    line["error"] = mt.error
                ctx.emit(line)
            if threads == 1 and not ctx.args.peer_only:
                for precision in precisions:
                    mixed_lines(ctx, model, steps, warmup, setup, mt, precision)
