"""Where a 2-stage pipeline's idle time goes, from `meshtrain train --trace`.

The run's idle fraction is 1 - busy / (p x makespan) per step: busy is the
executor passes' wall time, the makespan runs from the first pass's start to
the last pass's end over both ranks. Everything else counts as idle; this
splits it, per step after the warm-up, into fractions of p x makespan:
  overhead  the runtime's work around the passes (binding inputs, copying
            the stash, adding gradients; the spans' overhead_ms);
  bubble    waits for a message whose sender's pass had not ended yet (the
            schedule's own bubble, as the formula counts it);
  inflight  waits after the sender's pass had ended: the message was
            computed but on its way (transfer latency; the formula assumes 0);
  edges     a rank before its first pass and after its last one, not waiting
            for a message (warm-up / cool-down; also the formula's);
  rest      what is left (0 up to rounding when the lanes are complete).
and measures the transfer time: the receiving rank's recv completing minus
the sending pass's end (activations F(i) on rank 0 -> rank 1, gradients B(i)
on rank 1 -> rank 0). The pipeline's receives complete when the receiving
rank's thread tests them (Communicator::recv_now), so this includes time the
receiver spent in a pass; `wait_latency_act_ms` / `wait_latency_grad_ms` are
what the lock-step path pays: over the waits that began before the sending
pass ended, the wait's end minus that pass's end. Two ranks, one virtual
stage each (gpipe, 1f1b).

The formula (p-1)/(m+p-1) assumes equal stages. `idle_replay` is the formula
with the measured stage times: each rank's pass order of the step replayed
with that rank's median forward / backward wall time (over the steps after
`skip`), no transfer time and no runtime overhead; with equal stages it is the
formula. `stage_ms` gives those medians ([forward, backward] per rank)."""

import json
import re
import statistics


def _steps(events):
    steps = {}
    for e in events:
        if e.get("cat") == "step":
            steps.setdefault(e["name"], []).append((e["ts"], e["ts"] + e["dur"]))
    return [steps[n] for n in sorted(steps, key=lambda n: int(n.split()[1]))]


def replay(orders, dur):
    """Makespan-based idle fraction of running each rank's pass names
    (`orders[pid]`, "F<i>@<s>" / "B<i>@<s>") in order with `dur[pid][kind]`
    ms per pass: F(i)@s waits for F(i)@s-1, B(i)@s for B(i)@s+1; nothing
    else costs time."""
    p = len(orders)
    done, pos, clock, busy = {}, [0] * p, [0.0] * p, [0.0] * p
    while any(pos[r] < len(orders[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while pos[r] < len(orders[r]):
                name = orders[r][pos[r]]
                kind, mb = name[0], int(name[1:].split("@")[0])
                dep = (f"F{mb}@{r - 1}" if kind == "F" and r > 0 else
                       f"B{mb}@{r + 1}" if kind == "B" and r + 1 < p else None)
                if dep is not None and dep not in done:
                    break
                start = max(clock[r], done.get(dep, 0.0))
                clock[r] = start + dur[r][kind]
                busy[r] += dur[r][kind]
                done[f"{kind}{mb}@{r}"] = clock[r]
                pos[r] += 1
                moved = True
        if not moved:
            raise ValueError("replay: the pass orders deadlock")
    return 1 - sum(busy) / (p * max(clock))


def analyse(trace_path, skip=5):
    """{"idle", "overhead", "bubble", "inflight", "edges", "rest" (medians over
    the steps after `skip`), "transfer_act_ms", "transfer_grad_ms" (medians),
    "steps"}; None when the trace has no 2-stage pipeline steps."""
    data = json.load(open(trace_path))
    events = data["traceEvents"] if isinstance(data, dict) else data
    rows, lat, wlat = [], {"act": [], "grad": []}, {"act": [], "grad": []}
    orders, pass_ms = None, {(pid, k): [] for pid in (0, 1) for k in "FB"}
    for bounds in _steps(events)[skip:]:
        lo = min(b[0] for b in bounds)
        hi = max(b[1] for b in bounds)
        inside = [e for e in events if e.get("ph") == "X" and lo <= e["ts"] < hi]
        spans = [e for e in inside if e.get("cat") in ("forward", "backward")]
        if not spans or {e["pid"] for e in spans} != {0, 1}:
            continue
        first = min(e["ts"] for e in spans)
        last = max(e["ts"] + e["dur"] for e in spans)
        if orders is None:
            orders = [[e["name"] for e in sorted((e for e in spans if e["pid"] == pid),
                                                 key=lambda e: e["ts"])] for pid in (0, 1)]
        for e in spans:
            if e["name"][:1] in ("F", "B"):
                pass_ms[(e["pid"], e["name"][0])].append(e["dur"] / 1e3)
        cap = 2 * (last - first)
        busy = sum(e["dur"] for e in spans)
        overhead = sum(e.get("args", {}).get("overhead_ms", 0) * 1e3 for e in spans)
        end_of = {(e["pid"], e["name"]): e["ts"] + e["dur"] for e in spans}
        bubble = inflight = edges = 0.0
        for pid in (0, 1):
            mine = [e for e in spans if e["pid"] == pid]
            r0 = min(e["ts"] for e in mine)
            r1 = max(e["ts"] + e["dur"] for e in mine)
            edges += (r0 - first) + (last - r1)
            arrivals = sorted(e["ts"] + e["dur"] for e in inside
                              if e["pid"] == pid and e.get("cat") == "comm"
                              and e["name"].startswith("recv ") and e.get("dur", 0) > 0)
            waits = [e for e in inside if e["pid"] == pid and e.get("cat") == "wait"]
            for e in waits:
                m = re.match(r"wait recv_(act|grad)(\d+)@\d+$", e["name"])
                if not m:
                    continue
                kind, mb = m.group(1), int(m.group(2))
                sender = f"F{mb}@0" if kind == "act" else f"B{mb}@1"
                s_end = end_of.get((1 - pid, sender))
                w0, w1 = max(first, e["ts"]), min(last, e["ts"] + e["dur"])
                if s_end is None or w1 <= w0:
                    continue
                # the part of the wait outside the rank's own passes is in edges
                edges -= max(0.0, min(w1, r0) - w0) + max(0.0, w1 - max(w0, r1))
                if e["ts"] < s_end <= e["ts"] + e["dur"]:
                    wlat[kind].append(e["ts"] + e["dur"] - s_end)
                bubble += max(0.0, min(w1, s_end) - w0)
                inflight += max(0.0, w1 - max(w0, s_end))
            # each message: the first receive on this rank to complete after its pass ended
            kind = "act" if pid == 1 else "grad"
            sender_pid = 1 - pid
            sends = sorted(end_of[(sender_pid, n)] for (p, n) in end_of
                           if p == sender_pid and n.startswith("F" if kind == "act" else "B"))
            for s_end in sends:
                later = [a for a in arrivals if a >= s_end]
                if later:
                    lat[kind].append(later[0] - s_end)
        rows.append({"idle": 1 - busy / cap, "overhead": overhead / cap, "bubble": bubble / cap,
                     "inflight": inflight / cap, "edges": edges / cap,
                     "rest": (cap - busy - overhead - bubble - inflight - edges) / cap})
    if not rows:
        return None
    out = {k: round(statistics.median(r[k] for r in rows), 4) for k in rows[0]}
    for kind, v in lat.items():
        out[f"transfer_{kind}_ms"] = round(statistics.median(v) / 1e3, 3) if v else None
    for kind, v in wlat.items():
        out[f"wait_latency_{kind}_ms"] = round(statistics.median(v) / 1e3, 3) if v else None
    out["steps"] = len(rows)
    stage = [[round(statistics.median(pass_ms[(pid, k)]), 3) if pass_ms[(pid, k)] else None
              for k in "FB"] for pid in (0, 1)]
    out["stage_ms"] = stage
    if all(v is not None for row in stage for v in row):
        out["idle_replay"] = round(replay(orders, [dict(zip("FB", row)) for row in stage]), 4)
    return out


if __name__ == "__main__":
    import sys
    print(json.dumps(analyse(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 5)))
