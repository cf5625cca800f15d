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
#    of each of its stages, the pool of activations (what the micro-batches
#    in flight keep from forward to backward, placed over the schedule), the
#    buffers backward sends, the scratch every call shares, the inputs; the arena is
#    their sum (checked against the arena size the program states), the
#    bytes the program allocates.
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
    r = {"params": 0, "grads": 0, "optimizer": 0, "pool": 0, "sends": 0, "scratch": 0, "inputs": 0}
    for m in re.finditer(r"//   stage \d+: parameters \[(\d+), (\d+)\), gradients \[(\d+), (\d+)\), "
                         r"optimizer state \[(\d+), (\d+)\)", step):
        a = [int(x) for x in m.groups()]
        r["params"] += a[1] - a[0]
        r["grads"] += a[3] - a[2]
        r["optimizer"] += a[5] - a[4]
    for m in re.finditer(r"backward's sends \d+ x [^ ]+ [KMG]?i?B at \[(\d+), (\d+)\)", step):
        r["sends"] += int(m.group(2)) - int(m.group(1))
    m = re.search(r"//   pool \(what the micro-batches in flight keep\) [^ ]+ [KMG]?i?B at "
                  r"\[(\d+), (\d+)\)", step)
    r["pool"] = int(m.group(2)) - int(m.group(1))
    m = re.search(r"//   scratch \(every call's transients\) [^ ]+ [KMG]?i?B at \[(\d+), (\d+)\)", step)
    if m:
        r["scratch"] = int(m.group(2)) - int(m.group(1))
    m = re.search(r"//   inputs \(\d+ micro-batch\(es\)\)\s+\[0, (\d+)\)", step)
    if m:
        r["inputs"] = int(m.group(1))
    r["arena"] = sum(r[k] for k in ("params", "grads", "optimizer", "pool", "sends", "scratch",
                                    "inputs"))
    arena = re.search(r"Memory plan \(one arena, ([\d.]+) ([KMG]?i?B)\)", step)
    scale = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[arena.group(2)]
    if abs(float(arena.group(1)) * scale - r["arena"]) > 0.001 * r["arena"] + 64 * 1024:
        sys.exit("%s: the regions add up to %d bytes, the arena is %s %s" %
                 (path, r["arena"], arena.group(1), arena.group(2)))
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
    ap.add_argument("--fixed", help="carve plan --fixed (e.g. grad_accumulation=16bit)")
    a = ap.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    plan_path = os.path.join(a.workdir, "plan.json")
    report = json.loads(run([a.carve, "plan", a.model, "--cluster", a.cluster, "--global-batch",
                             str(a.global_batch), "--json", "-o", plan_path] +
                            (["--fixed", a.fixed] if a.fixed else [])))
    pred = report["predicted"]["memory_per_device"]
    plan = json.load(open(plan_path))
    out = os.path.join(a.workdir, "out")
    t0 = time.time()
    run([a.carve, "compile", a.model + ",batch=%d" % a.global_batch, "--plan", plan_path,
         "--no-weights", "--no-build", "-o", out, "--quiet"])
    compile_s = time.time() - t0
    pp = plan.get("pp", 1)
    ranks = [read_rank(os.path.join(out, "src", "program%d.cpp" % r)) for r in range(pp)]
    fields = {k: plan[k] for k in ("dp", "tp", "pp", "zero", "num_micro_batches", "schedule",
                                   "virtual_stages", "recompute", "precision",
                                   "grad_accumulation", "sequence_parallel") if k in plan}
    print("# %s, %s, %s, %s" % (datetime.date.today(), platform.node(), a.model, a.cluster))
    print("# plan: %s" % json.dumps(fields))
    print("# carve compile --no-weights: %.0f s" % compile_s)
    print("| pipeline rank | parameters | gradients | optimizer | kept activations (pool) | "
          "backward's sends | scratch | inputs | arena (GB) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r, x in enumerate(ranks):
        print("| %d | %s | %s | %s | %s | %s | %s | %s | **%s** |" % (
            r, gb(x["params"]), gb(x["grads"]), gb(x["optimizer"]), gb(x["pool"]),
            gb(x["sends"]), gb(x["scratch"]), gb(x["inputs"]), gb(x["arena"])))
    r = int(pred["pipeline_rank"])
    print("\nplanner, pipeline rank %d: parameters %s, gradients %s, optimizer %s, activations %s, "
          "buffers %s, workspace %s, total %s GB of %s" % (
              r, gb(pred["params"]), gb(pred["grads"]), gb(pred["optimizer"]),
              gb(pred["activations"]), gb(pred["buffers"]), gb(pred["workspace"]),
              gb(pred["total"]), gb(pred["capacity"])))
    x = ranks[r]
    print("compiled, pipeline rank %d: parameters %s, gradients %s, optimizer %s, "
          "activations %s (pool %s + sends %s + scratch %s + inputs %s), arena %s GB "
          "(%.3fx the prediction)"
          % (r, gb(x["params"]), gb(x["grads"]), gb(x["optimizer"]),
             gb(x["pool"] + x["sends"] + x["scratch"] + x["inputs"]), gb(x["pool"]),
             gb(x["sends"]), gb(x["scratch"]), gb(x["inputs"]), gb(x["arena"]),
             x["arena"] / pred["total"]))
    worst = max(x["arena"] for x in ranks)
    print("largest arena %s GB: %s the %s GB of the device" % (
        gb(worst), "fits" if worst <= pred["capacity"] else "exceeds", gb(pred["capacity"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
