#!/usr/bin/env python3
"""The generated sources of a matrix of plans, for checking a compiler refactor.

A change to the compiler's back half that should not change what programs
compute is checked by compiling the same models under the same plans before
and after it and comparing the generated sources byte for byte:

    python3 tests/e2e/generated_sources.py --carve OLD/bin/carve --out /tmp/before
    python3 tests/e2e/generated_sources.py --carve build/bin/carve --out /tmp/after
    python3 tests/e2e/generated_sources.py --compare /tmp/before /tmp/after

The matrix: the GPT- and Llama-style reference models (4 layers, batch 8,
sequence 16) under 1 rank; dp=4 ZeRO-2; dp=2 x tp=2 with sequence parallelism
and ZeRO-1; dp=2 x pp=2 1F1B; pp=2 interleaved with v=2; dp=4 ZeRO-3;
--target cuda tp=2 bf16 (where this carve has the CUDA target); dp=2 ZeRO-2
fp16 with clipped, scheduled SGD (Nesterov); pp=2 fp16 with clipping and
weight decay 0.1; and the Llama
with the custom SwiGLU op of models/custom/ under tp=2. Each case keeps OUT/src
(the programs, programs.cpp, README.md), OUT/plan.json and the training step's
IR (--emit-mlir). --compare prints every difference of a generated file in
full and exits 1 when there is one (each must be explained in the change's
description); it names the IR files that differ without failing, since a
change to the passes changes the IR by design.

This is a developer's tool, not a ctest: the baseline needs the old compiler.
"""

import argparse
import difflib
import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PY = "/usr/bin/python3"

PLANS = {
    "r1": {"dp": 1},
    "dp4_z2": {"dp": 4, "zero": 2},
    "dp2tp2_sp_z1": {"dp": 2, "tp": 2, "sequence_parallel": True, "zero": 1},
    "dp2pp2_1f1b": {"dp": 2, "pp": 2, "num_micro_batches": 2, "schedule": "1f1b"},
    "pp2_interleaved": {"pp": 2, "num_micro_batches": 4, "virtual_stages": 2},
    "dp4_z3": {"dp": 4, "zero": 3},
    "tp2_bf16_cuda": {"tp": 2, "precision": "bf16"},
    # The optimizer's tail: fp16 unscaling, clipping, SGD with Nesterov
    # momentum, a schedule, ZeRO-2's chunks; and the same in a pipeline.
    "dp2_z2_fp16_sgd": {"dp": 2, "zero": 2, "precision": "fp16",
                        "optimizer": {"name": "sgd", "momentum": 0.9, "nesterov": True,
                                      "clip_grad_norm": 1.0, "warmup_steps": 10,
                                      "decay_steps": 100, "min_lr_ratio": 0.1}},
    "pp2_fp16_clip": {"pp": 2, "num_micro_batches": 2, "precision": "fp16",
                      "optimizer": {"clip_grad_norm": 0.5, "weight_decay": 0.1}},
}
CONFIG = {"n_layer": 4}


def run(cmd, **kw):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)
    if p.returncode != 0:
        sys.exit("failed: " + " ".join(cmd) + "\n" + p.stdout)
    return p.stdout


def generate(args):
    carve = os.path.abspath(args.carve)
    out = os.path.abspath(args.out)
    work = os.path.join(out, ".work")
    os.makedirs(work, exist_ok=True)
    for model in ("gpt", "llama"):
        if not os.path.exists(os.path.join(work, model + ".onnx")):
            run([PY, os.path.join(ROOT, "models", "export.py"), model, "--out", work,
                 "--batch", "8", "--seq", "16", "--config", json.dumps(CONFIG)])
    if not os.path.exists(os.path.join(work, "llama_swiglu.onnx")):
        run([PY, os.path.join(ROOT, "models", "custom", "swiglu.py"), "--out", work])
    cases = [(m, p) for m in ("gpt", "llama") for p in PLANS]
    cases.append(("llama_swiglu", "tp2_custom"))
    for model, plan_name in cases:
        plan = {"tp": 2} if plan_name == "tp2_custom" else PLANS[plan_name]
        name = f"{model}_{plan_name}"
        plan_path = os.path.join(work, name + ".json")
        with open(plan_path, "w") as f:
            json.dump(plan, f)
        build = os.path.join(work, name)
        dest = os.path.join(out, name)
        shutil.rmtree(dest, ignore_errors=True)
        os.makedirs(dest)
        cmd = [carve, "compile", os.path.join(work, model + ".onnx"), "--plan", plan_path,
               "-o", build, "--quiet", "--emit-mlir", os.path.join(dest, "step.mlir")]
        if plan_name.endswith("_cuda"):
            cmd += ["--target", "cuda"]
        if plan_name == "tp2_custom":
            cmd += ["--rules", os.path.join(ROOT, "models", "custom", "swiglu.json")]
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if p.returncode != 0 and "built without the CUDA target" in p.stdout:
            print(f"{name}: skipped (this carve has no CUDA target)")
            shutil.rmtree(dest)
            continue
        if p.returncode != 0:
            sys.exit("failed: " + " ".join(cmd) + "\n" + p.stdout)
        for entry in sorted(os.listdir(os.path.join(build, "src"))):
            src = os.path.join(build, "src", entry)
            if os.path.isfile(src):
                shutil.copy(src, os.path.join(dest, entry))
        shutil.copy(os.path.join(build, "plan.json"), os.path.join(dest, "plan.json"))
        print(f"{name}: {len(os.listdir(dest))} files")


def compare(a, b):
    """Prints every difference of a program, table, README or plan.json in
    full, and names each IR file (step.mlir) that differs; returns 1 when a
    file other than the IR differs (the IR is expected to change when passes
    do; the programs are not)."""
    programs = ir = 0
    cases = sorted(c for c in set(os.listdir(a)) | set(os.listdir(b))
                   if os.path.isdir(os.path.join(a, c)) or os.path.isdir(os.path.join(b, c)))
    cases = [c for c in cases if c != ".work"]
    for case in cases:
        da, db = os.path.join(a, case), os.path.join(b, case)
        if not (os.path.isdir(da) and os.path.isdir(db)):
            print(f"{case}: only in {a if os.path.isdir(da) else b}")
            programs += 1
            continue
        for f in sorted(set(os.listdir(da)) | set(os.listdir(db))):
            fa, fb = os.path.join(da, f), os.path.join(db, f)
            if not (os.path.exists(fa) and os.path.exists(fb)):
                print(f"{case}/{f}: only in {a if os.path.exists(fa) else b}")
                programs += 1
                continue
            with open(fa) as x, open(fb) as y:
                la, lb = x.readlines(), y.readlines()
            if la == lb:
                continue
            diff = list(difflib.unified_diff(la, lb, fa, fb, n=1))
            changed = sum(1 for l in diff[2:] if l[:1] in "+-")
            if f.endswith(".mlir"):
                ir += 1
                print(f"{case}/{f}: the IR differs ({changed} lines)")
                continue
            programs += 1
            print(f"{case}/{f}: {changed} lines differ")
            sys.stdout.writelines(diff[:80])
    print(f"{len(cases)} cases: {programs} generated files differ, {ir} IR files differ")
    return 1 if programs else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--carve", help="the carve binary whose sources to collect")
    ap.add_argument("--out", help="folder for the collected sources")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = ap.parse_args()
    if args.compare:
        sys.exit(compare(*args.compare))
    if not (args.carve and args.out):
        ap.error("give --carve and --out, or --compare BEFORE AFTER")
    generate(args)


if __name__ == "__main__":
    main()
