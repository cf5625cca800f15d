#!/usr/bin/env python3
"""Per-device bytes of the plans `carve plan` chooses, compiled, beside the published formulas."""

# Run by hand, not a test:
#
#     /usr/bin/python3 bench/memory_table.py [--carve build/bin/carve]
#         [--only 124M,1.3B] [--devices 8,64] [--workdir build/bench-memory-table]
#
# For GPT-2 124M, GPT-3 1.3B, 6.7B ("7B") and 175B (builtin GPTs) on 8, 64 and
# 1024 A100-80GB (a100-80gb:1x8, 8x8, 128x8) at the GPT-3 paper's global
# batches: `carve plan` (what it predicts), then `carve compile --no-weights`
# of that plan and the memory plan every pipeline rank's generated step
# states (bench/compiled_memory.py reads it), beside
#   - ZeRO's model states (Rajbhandari et al. 2020: 2 + 2 + 12 bytes per
#     parameter, the 12 divided over dp from ZeRO-1, the gradients' 2 from
#     ZeRO-2, the parameters' 2 from ZeRO-3) for the rank's parameters;
#   - Megatron's activations (Korthikanti et al. 2022, 16-bit, with dropout:
#     sbh(34 + 5as/h) per layer without parallelism; sbh(34/t + 5as/(ht)) with
#     tp t and sequence parallelism; 34sbh/t with selective recomputation;
#     2sbh/t with full) times the layers and micro-batches the rank keeps in
#     flight under the plan's schedule.
# Everything is a byte count; nothing is timed or run.

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from compiled_memory import ROOT, gb, read_rank  # noqa: E402

MODELS = [  # name, builtin spec, global batch (sequences)
    ("124M", "layers=12,hidden=768,heads=12,seq=1024,vocab=50304", 512),
    ("1.3B", "layers=24,hidden=2048,heads=16,seq=2048,vocab=51200", 512),
    ("7B", "layers=32,hidden=4096,heads=32,seq=2048,vocab=51200", 1024),
    ("175B", "layers=96,hidden=12288,heads=96,seq=2048,vocab=51200", 1536),
]
CLUSTERS = {8: "a100-80gb:1x8", 64: "a100-80gb:8x8", 1024: "a100-80gb:128x8"}


def read_program(path):
    """A rank's memory plan: a pipeline rank's regions (compiled_memory), or
    the one arena of a program without stages (its activations region holds
    what is kept and every transient, shared by liveness)."""
    step = open(path).read()
    if "//   pool (what the micro-batches in flight keep)" in step:
        return read_rank(path)
    r = {"sends": 0, "scratch": 0}
    for key, label in (("params", "parameters and buffers"), ("grads", "gradients"),
                       ("optimizer", "optimizer state"), ("inputs", "inputs and loss seed"),
                       ("pool", "activations")):
        m = re.search(r"//   %s\s+\[(\d+), (\d+)\)" % re.escape(label), step)
        r[key] = int(m.group(2)) - int(m.group(1)) if m else 0
    r["arena"] = sum(r[k] for k in ("params", "grads", "optimizer", "pool", "inputs"))
    return r


def config(spec):
    return {k: int(v) for k, v in (kv.split("=") for kv in spec.split(","))}


def in_flight(plan, m, r=0):
    """Chunk-micro-batches pipeline rank r keeps (the planner's inFlight)."""
    p, v = plan.get("pp", 1), plan.get("virtual_stages", 1)
    schedule = plan.get("schedule", "1f1b")
    if p == 1:
        return 1
    if schedule == "gpipe":
        return m
    if schedule == "interleaved" and v > 1:
        return min(2 * (p - r - 1) + (v - 1) * p + 1, m * v)
    return min(p - r, m)


def megatron_activations(cfg, plan, b):
    """Korthikanti et al.'s bytes for what pipeline rank 0 keeps."""
    s, h, a, L = cfg["seq"], cfg["hidden"], cfg["heads"], cfg["layers"]
    t = plan.get("tp", 1)
    sp = plan.get("sequence_parallel", False)
    rec = plan.get("recompute", "none")
    sbh = s * b * h
    if rec == "full":
        per = 2 * sbh / (t if sp else 1)
    elif rec == "selective":
        per = sbh * (34 / t if sp else 10 + 24 / t)
    else:
        per = sbh * ((34 / t if sp else 10 + 24 / t) + 5 * a * s / (h * t))
    p, v = plan.get("pp", 1), plan.get("virtual_stages", 1)
    m = plan.get("num_micro_batches", 1)
    return per * (L / (p * v)) * in_flight(plan, m)


def zero_model_states(psi, dp, zero):
    """ZeRO's 2 + 2 + 12 bytes per parameter, divided as the stage says."""
    if zero == 0:
        return 16 * psi
    if zero == 1:
        return 4 * psi + 12 * psi / dp
    if zero == 2:
        return 2 * psi + 14 * psi / dp
    return 16 * psi / dp


def plan_text(plan, b):
    parts = ["dp%d tp%d pp%d" % (plan.get("dp", 1), plan.get("tp", 1), plan.get("pp", 1))]
    if plan.get("virtual_stages", 1) > 1:
        parts.append("v%d" % plan["virtual_stages"])
    parts.append("m%d mbs%d" % (plan.get("num_micro_batches", 1), b))
    parts.append("zero%d" % plan.get("zero", 0))
    if plan.get("sequence_parallel"):
        parts.append("sp")
    if plan.get("recompute", "none") != "none":
        parts.append(plan["recompute"])
    parts.append(plan.get("precision", "fp32"))
    return " ".join(parts)


def one(carve, name, spec, batch, devices, workdir):
    model = "builtin:gpt:" + spec
    d = os.path.join(workdir, "%s-%d" % (name, devices))
    os.makedirs(d, exist_ok=True)
    plan_path = os.path.join(d, "plan.json")
    p = subprocess.run([carve, "plan", model, "--cluster", CLUSTERS[devices], "--global-batch",
                        str(batch), "--json", "-o", plan_path], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        why = (p.stderr.strip().splitlines() or ["exit %d" % p.returncode])[-1]
        return "| %s | %d | no plan fits: %s |||||||" % (name, devices, why.replace("|", "/"))
    report = json.loads(p.stdout)
    pred = report["predicted"]["memory_per_device"]
    b = int(report["predicted"].get("micro_batch_size", 1))
    plan = json.load(open(plan_path))
    out = os.path.join(d, "out")
    c = subprocess.run([carve, "compile", model + ",batch=%d" % batch, "--plan", plan_path,
                        "--no-weights", "--no-build", "-o", out, "--quiet"], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
    if c.returncode != 0:  # a plan the compiler refuses is a finding: its row says so
        why = (c.stderr.strip().splitlines() or ["exit %d" % c.returncode])[-1]
        return "| %s | %d | %s | %s | **carve compile refused it**: %s ||||||" % (
            name, devices, plan_text(plan, b), gb(pred["total"]), why.replace("|", "/"))
    ranks = [read_program(os.path.join(out, "src", "program%d.cpp" % r))
             for r in range(plan.get("pp", 1))]
    r0 = ranks[0]
    largest = max(x["arena"] for x in ranks)
    dp, zero = plan.get("dp", 1), plan.get("zero", 0)
    # Parameters per rank from the compiled parameter region: 16-bit copies
    # under bf16/fp16 (their fp32 masters are with the optimizer state).
    per = 2 if plan.get("precision", "fp32") != "fp32" else 4
    psi = r0["params"] / per * (dp if zero == 3 else 1)
    states = r0["params"] + r0["grads"] + r0["optimizer"]
    kept = r0["pool"] + r0["sends"]
    return "| %s | %d | %s | %s | %s | %s | %s | %s | %s | %s |" % (
        name, devices, plan_text(plan, b), gb(pred["total"]), gb(largest), gb(states),
        gb(zero_model_states(psi, dp, zero)), gb(kept), gb(megatron_activations(
            config(spec), plan, b)), "yes" if largest <= pred["capacity"] else "**no**")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--carve", default=os.path.join(ROOT, "build", "bin", "carve"))
    ap.add_argument("--only", help="comma-separated model names (124M,1.3B,7B,175B)")
    ap.add_argument("--devices", default="8,64,1024")
    ap.add_argument("--workdir", default=os.path.join(ROOT, "build", "bench-memory-table"))
    a = ap.parse_args()
    only = set(a.only.split(",")) if a.only else None
    print("# %s, %s; GB = 10^9 bytes; pipeline rank 0 unless said" %
          (datetime.date.today(), platform.node()))
    print("| model | devices | plan `carve plan` chose | planner total | compiled largest arena"
          " | compiled model states | ZeRO formula | compiled activations (pp: kept pool + sends)"
          " | Megatron formula | fits 80 GB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, spec, batch in MODELS:
        if only and name not in only:
            continue
        for devices in [int(x) for x in a.devices.split(",")]:
            print(one(a.carve, name, spec, batch, devices, a.workdir), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
