#!/usr/bin/env python3
"""How long `carve plan` takes on the largest published configurations.

Plans, with the full search space (dp x tp x pp factorizations with tp inside a
node, ZeRO 0-3, micro-batch size and count, 1F1B and interleaved schedules
with v = 2..8, recomputation none / selective / full, sequence parallelism):

  - a 1T-parameter GPT (128 layers, hidden 25600, 160 heads, seq 2048,
    vocab 51200) on 3072 A100-80GB (384 nodes x 8), global batch 3072;
  - GPT-3 175B (96 layers, hidden 12288, 96 heads, seq 2048, vocab 51200) on
    1024 A100-80GB (128 x 8), global batch 1536.

The target (the planner issue; docs/planner.md): under 1 s each on a 2-core
machine, the as-compiled check of the chosen plan included. Each configuration
runs `--repeat` times as a whole process (model build, profiles, search,
per-op search, as-compiled check, report); the median wall time is reported
with the planner's own phase times (`phase_seconds` of `--json`) and the chosen
plan, and the predicted TFLOP/s per
GPU is set beside the figure published for a hand-tuned Megatron-LM run of
the same model on the same number of A100s (*Efficient Large-Scale Language
Model Training on GPU Clusters*, SC'21, Table 1: 163 TFLOP/s for 1T on 3072
GPUs, 153 for 175B on 1024 GPUs).

Exits non-zero if a run fails or a target is missed, so the recorded numbers
are the ones that were checked.
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

CONFIGS = [
    ("1T GPT, 3072 x A100-80GB",
     "builtin:gpt:layers=128,hidden=25600,heads=160,seq=2048,vocab=51200",
     "a100-80gb:384x8", 3072, 1.0, 163),
    ("GPT-3 175B, 1024 x A100-80GB",
     "builtin:gpt:layers=96,hidden=12288,heads=96,seq=2048,vocab=51200",
     "a100-80gb:128x8", 1536, 1.0, 153),
]


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--carve", default="build/bin/carve")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    rows = []
    ok = True
    for name, model, cluster, batch, target, published in CONFIGS:
        walls = []
        rep = None
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            p = subprocess.run([args.carve, "plan", model, "--cluster", cluster,
                                "--global-batch", str(batch), "--json"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            walls.append(time.perf_counter() - t0)
            if p.returncode != 0:
                print("FAILED: %s: %s" % (name, p.stderr.strip()))
                return 1
            rep = json.loads(p.stdout)
        wall = statistics.median(walls)
        plan = " ".join("%s=%s" % (k, v) for k, v in rep["plan"].items())
        pred = rep["predicted"]
        phases = rep["phase_seconds"]
        rows.append((name, wall, phases, rep["searched"], plan,
                     pred["step_time_s"], pred["tflops_per_device"], pred["mfu"], published,
                     target))
        if wall >= target:
            ok = False
    print("## Planning speed (%s)" % datetime.date.today().isoformat())
    print()
    print("Machine: %s, %d cores (`nproc`), %s. Command: `/usr/bin/python3 "
          "bench/plan_speed.py` (median of %d whole `carve plan ... --json` processes)." %
          (cpu_model(), os.cpu_count(), platform.platform(), args.repeat))
    print()
    print("| Configuration | wall (median) | target | search / per-op search / as-compiled "
          "check (last run) | plans priced | chosen plan | predicted step | predicted TFLOP/s "
          "per GPU (MFU) | published Megatron-LM TFLOP/s per GPU |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (name, wall, ph, n, plan, step, tf, mfu, pub, target) in rows:
        print("| %s | %.2f s | < %.0f s | %.3f / %.3f / %.3f s | %d | `%s` | %.1f s | %.0f (%.0f%%) "
              "| %d |" % (name, wall, target, ph["search"], ph["op_search"], ph["compile_check"],
                          n, plan, step, tf, mfu * 100, pub))
    if not ok:
        print("\nFAILED: a configuration missed its target")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
