#!/usr/bin/env python3
"""Planned against compiled: per-device bytes of the plan `carve plan` chooses."""

# Run by hand, not a test:
#
#     /usr/bin/python3 bench/compiled_memory.py [--carve build/bin/carve]
#         [--model builtin:gpt:layers=96,hidden=12288,heads=96,seq=2048,vocab=51200]
#         [--cluster a100-80gb:128x8] [--global-batch 1536] [--workdir build/bench-memory]
#
# 1. `carve plan MODEL --cluster C --global-batch B --json -o PLAN.json`: the
#    plan and its predicted memory per device (the pipeline rank that needs
#    the most).
# 2. `carve compile MODEL,batch=B --plan PLAN.json --no-weights`: the
#    programs, without weights (a 175B model's would not fit this machine).
# 3. Reads every pipeline rank's memory plan from the head of its generated
#    step (OUT/src/program{r}.cpp): parameters, gradients and optimizer state
#    of each of its stages, the activation slots (what each micro-batch keeps
#    from forward to backward, one slot per micro-batch the schedule holds
#    per chunk), the scratch every call shares, the inputs; the arena is
#    their sum, the bytes the program allocates.
# 4. Also prints what the slots would take if the rank's chunks shared one
#    pool (the most bytes the schedule keeps at once), the next step.
#
# Everything is a byte count read from the programs; nothing is timed.

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(cmd):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        sys.exit("%s failed (%d):\n%s%s" % (" ".join(cmd), p.returncode, p.stdout, p.stderr))
    return p.stdout


def read_rank(path):
    step = open(path).read()
    step = step[step.index("void step(StepContext &ctx)"):]
    r = {"params": 0, "grads": 0, "optimizer": 0, "slots": 0, "scratch": 0, "inputs": 0}
    for m in re.finditer(r"//   stage \d+: parameters \[(\d+), (\d+)\), gradients \[(\d+), (\d+)\), "
                         r"optimizer state \[(\d+), (\d+)\)", step):
        a = [int(x) for x in m.groups()]
        r["params"] += a[1] - a[0]
        r["grads"] += a[3] - a[2]
        r["optimizer"] += a[5] - a[4]
    sizes = {}
    for m in re.finditer(r"//   stage (\d+) activations: (\d+) slot\(s\) of [^ ]+ [KMG]?i?B at "
                         r"\[(\d+), (\d+)\)", step):
        stage, n, a, b = (int(x) for x in m.groups())
        r["slots"] += b - a
        sizes[stage] = (b - a) // n
    m = re.search(r"//   scratch \(every call's transients\) [^ ]+ [KMG]?i?B at \[(\d+), (\d+)\)", step)
    if m:
        r["scratch"] = int(m.group(2)) - int(m.group(1))
    m = re.search(r"//   inputs \(\d+ micro-batch\(es\)\)\s+\[0, (\d+)\)", step)
    if m:
        r["inputs"] = int(m.group(1))
    r["arena"] = sum(r[k] for k in ("params", "grads", "optimizer", "slots", "scratch", "inputs"))
    # The most the schedule keeps at once, if the chunks' slots shared one pool.
    pp_stage = sorted(sizes)
    live = peak = 0
    for m in re.finditer(r"c(\d+)::(forward|backward)\(ctx, \d+,", step):
        size = sizes[pp_stage[int(m.group(1))]] if pp_stage else 0
        live += size if m.group(2) == "forward" else -size
        peak = max(peak, live)
    r["pooled"] = peak
    return r


def gb(x):
    return "%.2f" % (x / 1e9)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--carve", default=os.path.join(ROOT, "build", "bin", "carve"))
    ap.add_argument("--model",
                    default="builtin:gpt:layers=96,hidden=12288,heads=96,seq=2048,vocab=51200")
    ap.add_argument("--cluster", default="a100-80gb:128x8")
    ap.add_argument("--global-batch", type=int, default=1536)
    ap.add_argument("--workdir", default=os.path.join(ROOT, "build", "bench-memory"))
    a = ap.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    plan_path = os.path.join(a.workdir, "plan.json")
    report = json.loads(run([a.carve, "plan", a.model, "--cluster", a.cluster, "--global-batch",
                             str(a.global_batch), "--json", "-o", plan_path]))
    pred = report["predicted"]["memory_per_device"]
    plan = json.load(open(plan_path))
    out = os.path.join(a.workdir, "out")
    t0 = time.time()
    run([a.carve, "compile", a.model + ",batch=%d" % a.global_batch, "--plan", plan_path,
         "--no-weights", "-o", out, "--quiet"])
    compile_s = time.time() - t0
    pp = plan.get("pp", 1)
    ranks = [read_rank(os.path.join(out, "src", "program%d.cpp" % r)) for r in range(pp)]
    fields = {k: plan[k] for k in ("dp", "tp", "pp", "zero", "num_micro_batches", "schedule",
                                   "virtual_stages", "recompute", "precision",
                                   "sequence_parallel") if k in plan}
    print("# %s, %s, %s, %s" % (datetime.date.today(), platform.node(), a.model, a.cluster))
    print("# plan: %s" % json.dumps(fields))
    print("# carve compile --no-weights: %.0f s" % compile_s)
    print("| pipeline rank | parameters | gradients | optimizer | activation slots | scratch | "
          "inputs | arena (GB) | slots pooled | arena with pooled slots |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r, x in enumerate(ranks):
        print("| %d | %s | %s | %s | %s | %s | %s | **%s** | %s | %s |" % (
            r, gb(x["params"]), gb(x["grads"]), gb(x["optimizer"]), gb(x["slots"]),
            gb(x["scratch"]), gb(x["inputs"]), gb(x["arena"]), gb(x["pooled"]),
            gb(x["arena"] - x["slots"] + x["pooled"])))
    r = int(pred["pipeline_rank"])
    print("\nplanner, pipeline rank %d: parameters %s, gradients %s, optimizer %s, activations %s, "
          "buffers %s, workspace %s, total %s GB of %s" % (
              r, gb(pred["params"]), gb(pred["grads"]), gb(pred["optimizer"]),
              gb(pred["activations"]), gb(pred["buffers"]), gb(pred["workspace"]),
              gb(pred["total"]), gb(pred["capacity"])))
    x = ranks[r]
    print("compiled, pipeline rank %d: parameters %s, gradients %s, optimizer %s, "
          "activations %s (slots %s + scratch %s + inputs %s), arena %s GB (%.2fx the prediction)"
          % (r, gb(x["params"]), gb(x["grads"]), gb(x["optimizer"]),
             gb(x["slots"] + x["scratch"] + x["inputs"]), gb(x["slots"]), gb(x["scratch"]),
             gb(x["inputs"]), gb(x["arena"]), x["arena"] / pred["total"]))
    worst = max(x["arena"] for x in ranks)
    print("largest arena %s GB: %s the %s GB of the device" % (
        gb(worst), "fits" if worst <= pred["capacity"] else "exceeds", gb(pred["capacity"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
