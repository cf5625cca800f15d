#!/usr/bin/env python3
"""Elementwise fusion (docs/fusion.md): fused programs compute exactly what unfused ones do.

What must hold, for the GPT-style (erf and tanh GELU) and Llama-style models and the MLP, on
1 rank and under dp=2 with ZeRO-3 (GPT, MLP), tp=2 (sequence parallel for
the GPT) and pp=2 with two micro-batches (GPT, Llama):

1. `carve compile` fuses: the program has fewer kernel calls than the same
   model compiled with `--no-fuse`, and its source defines the functors it
   calls (`struct FusedK` and `fused(... FusedK{} ...)`).
2. Bit for bit the same training: 6 steps of the fused and the unfused
   program on the same data give bitwise equal losses and gradient norms
   (the JSONL, to the last printed digit) and bitwise equal weights and
   optimizer state in the final checkpoint. No tolerance: the fused kernels
   call the same scalar functions as the unfused ones (elementwise.h), the
   runtime and the programs are compiled without FMA contraction, and every
   intermediate is a float either way, so every rounding is the same.
3. The chains that matter are fused: the GPT's bias-add + GELU is one kernel
   that also writes the pre-activation (backward reads it), and the Llama's
   SiLU(gate) * up is one kernel.
"""

import argparse
import json
import os
import re
import shutil
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st  # noqa: E402
import harness  # noqa: E402

STEPS = 6
TIMEOUT_S = 300

PLANS = {
    "1rank": ({}, 1),
    "dp2-zero3": ({"dp": 2, "zero": 3}, 2),
    "tp2": ({"tp": 2}, 2),
    "pp2": ({"pp": 2, "num_micro_batches": 2}, 2),
}
MODELS = {
    "gpt": ["1rank", "dp2-zero3", "tp2", "pp2"],
    "llama": ["1rank", "tp2", "pp2"],
    "gpt_tanh": ["1rank"],
    "mlp": ["1rank", "dp2-zero3"],
}


Failure = harness.Failure


def run(cmd):
    return harness.run(cmd, timeout=TIMEOUT_S)


def compile_(carve, onnx, plan, out, fuse):
    pj = out + ".plan.json"
    with open(pj, "w") as f:
        json.dump(plan, f)
    cmd = [carve, "compile", onnx, "--plan", pj, "-o", out, "--optimizer", "adamw", "--lr",
           "0.01"]
    if not fuse:
        cmd.append("--no-fuse")
    rc, so, se = run(cmd)
    if rc != 0:
        raise Failure("compile %s %s%s failed:\n%s%s" %
                      (onnx, plan, "" if fuse else " --no-fuse", so, se))
    m = re.search(r"(\d+) kernel calls per (?:step|micro-batch)", so + se)
    if not m:
        raise Failure("compile %s: no kernel-call count in its output:\n%s%s" % (onnx, so, se))
    return int(m.group(1))


def train(carve, out, ranks, data):
    log, ck = out + ".jsonl", out + ".ckpt"
    rc, so, se = run([carve, "run", out, "-n", str(ranks), "--", "--steps", str(STEPS), "--data",
                      data, "--log", log, "--save", ck, "--save-every", str(STEPS),
                      "--progress", "none"])
    if rc != 0:
        raise Failure("run %s failed:\n%s%s" % (out, so, se))
    rows = [json.loads(l) for l in open(log)]
    return [(r["step"], r["loss"], r["grad_norm"]) for r in rows], \
        st.load_checkpoint(ck, roles=("parameter", "buffer", "optimizer_state"))


def sources(out):
    src = os.path.join(out, "src")
    return "".join(open(os.path.join(src, f)).read() for f in sorted(os.listdir(src))
                   if f.startswith("program") and f[len("program"):-4].isdigit())


def functors(text):
    """name -> body of every `struct FusedK { ... };` in a generated source."""
    return dict(re.findall(r"struct (Fused\d+) \{\n(.*?)\n\};", text, re.S))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--carve", required=True)
    ap.add_argument("--models", required=True)
    ap.add_argument("--workdir", required=True)
    a = ap.parse_args()
    shutil.rmtree(a.workdir, ignore_errors=True)
    os.makedirs(a.workdir)
    w = a.workdir
    data_gen = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data_gen.py")
    checks = 0

    for model, plans in MODELS.items():
        onnx = os.path.join(a.models, "opset17", model + ".onnx")
        data = os.path.join(w, model + ".data")
        gen = [sys.executable, data_gen]
        gen += ["tensors", "--model", onnx, "--name", model] if model == "mlp" else \
            ["tokens", "--model", onnx, "--tokens", "8192"]
        rc, so, se = run(gen + [data])
        if rc != 0:
            raise Failure("data_gen %s failed:\n%s%s" % (model, so, se))
        for name in plans:
            plan, ranks = PLANS[name]
            if model == "gpt" and name == "tp2":
                plan = dict(plan, sequence_parallel=True)
            tag = "%s-%s" % (model, name)
            fused_out, plain_out = os.path.join(w, tag), os.path.join(w, tag + "-nofuse")
            kf = compile_(a.carve, onnx, plan, fused_out, True)
            kp = compile_(a.carve, onnx, plan, plain_out, False)
            text = sources(fused_out)
            defs = functors(text)
            calls = set(re.findall(r"fused\(\"[^\"]*\", (Fused\d+)\{\}", text))
            if kf >= kp or not defs or calls != set(defs):
                raise Failure("%s: %d kernel calls fused, %d unfused; functors %s, called %s" %
                              (tag, kf, kp, sorted(defs), sorted(calls)))
            if "struct Fused" in sources(plain_out):
                raise Failure("%s --no-fuse: the source still fuses" % tag)
            checks += 1
            log_f, ck_f = train(a.carve, fused_out, ranks, data)
            log_p, ck_p = train(a.carve, plain_out, ranks, data)
            if log_f != log_p:
                raise Failure("%s: fused and unfused training differ:\n  fused   %s\n"
                              "  unfused %s" % (tag, log_f, log_p))
            if sorted(ck_f) != sorted(ck_p):
                raise Failure("%s: checkpoints hold different tensors: %s vs %s" %
                              (tag, sorted(ck_f), sorted(ck_p)))
            for t in ck_f:
                if ck_f[t].dtype != ck_p[t].dtype or ck_f[t].shape != ck_p[t].shape or \
                        not np.array_equal(ck_f[t].view(np.uint8), ck_p[t].view(np.uint8)):
                    diff = np.max(np.abs(ck_f[t].astype(np.float64) - ck_p[t]))
                    raise Failure("%s: tensor %s differs after %d steps (max |diff| %.3g)" %
                                  (tag, t, STEPS, diff))
            print("ok: %s: %d kernel calls fused (%d functors), %d unfused; %d steps bitwise "
                  "equal (losses %.6f..%.6f, %d checkpoint tensors)" %
                  (tag, kf, len(defs), kp, STEPS, log_f[0][1], log_f[-1][1], len(ck_f)))
            checks += 2

            if name == "1rank" and model == "gpt":
                gelu = [b for b in defs.values()
                        if "Unary::Gelu>" in b and "Binary::Add>" in b and "y[1]" in b]
                if not gelu:
                    raise Failure("gpt: no functor computes bias-add + GELU and keeps the "
                                  "pre-activation:\n%s" % "\n".join(defs.values()))
                print("ok: gpt: bias-add + GELU fused, writing the pre-activation for backward")
                checks += 1
            if name == "1rank" and model == "llama":
                swiglu = [b for b in defs.values()
                          if "Unary::Silu>" in b and "Binary::Mul>" in b]
                if not swiglu:
                    raise Failure("llama: no functor computes SiLU(gate) * up:\n%s" %
                                  "\n".join(defs.values()))
                print("ok: llama: SiLU(gate) * up fused")
                checks += 1

    print("fusion: %d checks passed" % checks)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Failure as e:
        print("FAIL: %s" % e)
        sys.exit(1)
