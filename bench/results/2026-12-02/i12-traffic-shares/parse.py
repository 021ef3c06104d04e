import json, glob, statistics, sys
res = {}
for f in sorted(glob.glob(sys.argv[1] + "/*.jsonl")):
    which = f.split("/")[-1].split("-")[0]
    summ = None
    for l in open(f):
        d = json.loads(l)
        if d.get("ranks"):
            summ = d
    if not summ:
        print(f, "no summary"); continue
    per = [r["compute_cpu_s_per_step"] - r["update_cpu_s_per_step"] for r in summ["ranks"]]
    wall = [r["compute_s_per_step"] - r["update_s_per_step"] for r in summ["ranks"]]
    step = summ.get("step_s_median") or summ.get("median_step_s")
    sp = max(per) / min(per)
    res.setdefault(which, []).append((sp, max(wall) / min(wall)))
    print(f.split("/")[-1], "cpu before update ms", [round(p * 1e3, 2) for p in per], "spread %.3f" % sp,
          "wall spread %.3f" % (max(wall) / min(wall)), "step", {k: v for k, v in summ.items() if "step" in k and not isinstance(v, (list, dict))})
for w, v in res.items():
    print(w, "median cpu spread %.3f, wall spread %.3f" % (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)))
