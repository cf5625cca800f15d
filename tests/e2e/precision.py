#!/usr/bin/env python3
"""Plan field `precision` on the CPU target (the CUDA target's rounding, emulated).

What must hold:

1. The GPT- and Llama-style models compiled with precision fp32, bf16 and
   fp16 train 10 steps (SGD, lr 0.1, the same data) with bf16 and fp16
   losses within 2e-2 relative of fp32's — the issue's bound for bf16
   against fp32. Justification: every matmul and attention input is rounded
   to 8 (bf16) or 11 (fp16) significant bits, a relative error of at most
   2^-9 = 2e-3 (bf16) per element before fp32 accumulation; the loss moves
   by a small multiple of that.
2. The rounding really happens: bf16 and fp16 losses are not all bitwise
   equal to fp32's, and bf16 differs from fp16.
3. A bf16 plan under dp=2, tp=2, pp=2 with micro-batches (GPT; dp=2 x pp=2
   with ZeRO-2 too, dp=2 with ZeRO-1 and ZeRO-3, dp=2 with 2 micro-batches
   accumulating in 16 bits, whole and under ZeRO-2; Llama pp=2 with 4
   micro-batches) matches the 1-rank bf16 program within 1e-4 relative per
   step. Not the fp32 plans' 1e-5: the ranks sum in another order, and an
   element whose fp32 value moves by one ulp can round to a neighbouring
   bf16 value (a 2^-8 relative step) -- in a matmul's input, in the
   activations the plan stores in 16 bits, in the 16-bit weight copies (7.),
   and in the 16-bit gradients (8.): dp's 16-bit all-reduce rounds each
   partial sum, so the replicas' sum differs from the 1-rank gradient by up
   to an ulp per element, and 16-bit accumulation over 2 micro-batches adds
   one more rounding. Such flips move a run no further than bf16 rounding of
   the whole step does: bf16 is within 4.9e-5 (GPT) and 9.1e-5 (Llama) of
   fp32 over these 10 steps (1.), so two bf16 runs that differ in some of
   their roundings stay within about that much of each other; the limit is
   2x the GPT's (most plans here are the GPT's) and 1.1x the Llama's. If a
   new plan exceeded it, the cause would be a wrong sum, not rounding.
   Measured: 4.7e-5 (dp2, ZeRO-1, ZeRO-3: 16-bit gradient all-reduces and
   reduce-scatters), 4.9e-5 (tp2), 6e-5 (pp2), 5.7e-5 (dp2 x pp2 ZeRO-2:
   16-bit reduce-scatters into fp32 accumulators), 5.1e-5 (dp2, 16-bit
   accumulation), 3.8e-5 (dp2 ZeRO-2, 16-bit chunks), 2.8e-5 (Llama pp2 with
   4 micro-batches, fp32 accumulation).
4. fp16 dynamic loss scaling: with --loss-scale 2^24 the scaled gradients
   overflow fp16 (65504): those steps are skipped on every rank, reported on
   stdout and in the JSONL (skipped, loss_scale halving each time), the
   weights stay exactly the initial ones while every step overflows, and
   training then proceeds at a scale where nothing overflows, with finite,
   falling losses. Under dp=2 the same steps are skipped. The scale is saved
   in the checkpoint (manifest.json "loss_scale"): a run resumed from it
   equals the unbroken run step for step, and --loss-scale overrides it.
5. A precision other than fp32, bf16 or fp16 is refused naming the field.
6. Against PyTorch on the same weights and data (tests/e2e/torch_ref.py): the
   fp32 program within 1e-5 relative per step (train_vs_torch.py's bound;
   measured 1.2e-7), and the bf16 program within 2e-2 of PyTorch's forward
   under torch.autocast("cpu", bfloat16) with the backward autocast derives.
   They round different things: autocast runs each linear in bf16 and keeps
   its output in bf16 (and the ops it feeds read that), and computes norms,
   softmax and the loss in fp32; carve rounds the inputs of every matmul and
   attention and the activations it keeps for backward, and computes
   everything in fp32 in between, with weights read from their bf16 copies.
   Both are bf16 rounding noise around the fp32 run, so they are about as
   far from each other as each is from fp32 (measured over 10 steps: carve
   bf16 6e-5 from autocast, autocast 3.3e-5 and carve bf16 6.3e-5 from
   fp32, GPT; Llama 8.7e-5, 2.6e-5, 7.5e-5), far inside the bound.
7. Mixed-precision storage (mixed_storage below): 16-bit weight copies,
   fp32 masters with the optimizer state, checkpoints of the masters that
   resume bitwise and load into other plans and precisions.
8. 16-bit gradients (gradient_storage below): without micro-batches the
   gradients are 16-bit and reduced in 16 bits; with them, plan field
   grad_accumulation keeps fp32 gradients (ZeRO-0/1) or fp32 chunk
   accumulators (ZeRO-2/3) by default and 16-bit ones with "16bit", in
   the bytes and reduction types each choice says; "16bit" under fp32 is
   refused. (Their numerics are in 3.; fp16's overflow checks in 4. run on
   16-bit fp16 gradients under dp=2.)
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st  # noqa: E402
import harness  # noqa: E402

STEPS = 10
CLOSE_RTOL = 2e-2
FP32_TORCH_RTOL = 1e-5
PARALLEL_RTOL = 1e-4
TIMEOUT_S = 300
MODEL_ONNX = {}


# The bf16 plans compared with the 1-rank bf16 program (3.): name, plan, ranks.
# The pipelines send and keep their activations in 16 bits.
PARALLEL_PLANS = {
    "gpt": [("dp2", {"dp": 2}, 2), ("tp2", {"tp": 2}, 2),
            ("pp2-m2", {"pp": 2, "num_micro_batches": 2}, 2),
            ("dp2-pp2-m2-zero2", {"dp": 2, "pp": 2, "num_micro_batches": 2, "zero": 2}, 4),
            # The 16-bit weight copies' gathers: ZeRO-1's all-gather after the
            # update, ZeRO-3's before each use (prefetched).
            ("dp2-zero1", {"dp": 2, "zero": 1}, 2),
            ("dp2-zero3", {"dp": 2, "zero": 3, "zero3_prefetch_layers": 1}, 2),
            # 16-bit accumulation over micro-batches (8.): the whole gradient
            # (ZeRO-0) and ZeRO-2's chunks.
            ("dp2-m2-16bit", {"dp": 2, "num_micro_batches": 2, "grad_accumulation": "16bit"}, 2),
            ("dp2-m2-zero2-16bit",
             {"dp": 2, "num_micro_batches": 2, "zero": 2, "grad_accumulation": "16bit"}, 2)],
    "llama": [("pp2-m4", {"pp": 2, "num_micro_batches": 4}, 2)],
}


Failure = harness.Failure


def run(cmd):
    return harness.run(cmd, timeout=TIMEOUT_S)


def compile_(carve, onnx, plan, out):
    pj = out + ".plan.json"
    with open(pj, "w") as f:
        json.dump(plan, f)
    rc, so, se = run([carve, "compile", onnx, "--plan", pj, "-o", out, "--quiet",
                      "--optimizer", "sgd", "--lr", "0.1"])
    if rc != 0:
        raise Failure("compile %s %s failed:\n%s%s" % (onnx, plan, so, se))


def train(carve, out, ranks, data, log, extra=()):
    rc, so, se = run([carve, "run", out, "-n", str(ranks), "--", "--steps", str(STEPS),
                      "--data", data, "--log", log, "--progress", "none"] + list(extra))
    if rc != 0:
        raise Failure("run %s failed:\n%s%s" % (out, so, se))
    return [json.loads(l) for l in open(log)], so


def worst_rel(a, b):
    return max(abs(x - y) / abs(x) for x, y in zip(a, b))


def against_pytorch(model, onnx, data, losses):
    """6.: the 1-rank programs against PyTorch (tests/e2e/torch_ref.py) on the
    same weights and data, SGD lr 0.1: fp32 against fp32, bf16 against
    torch.autocast("cpu", bfloat16)."""
    import torch_ref
    hyper = torch_ref.Hyper(optimizer="sgd", lr=0.1)
    ref = {}
    for name, cast in [("fp32", None), ("bf16", "bf16")]:
        records, _ = torch_ref.train(onnx, model, data, STEPS, hyper, autocast=cast)
        ref[name] = [r["loss"] for r in records]
    # Well posed first: PyTorch's float32 run within the fp32 bound of its float64 run.
    records, _ = torch_ref.train(onnx, model, data, STEPS, hyper, float64=True)
    posed = worst_rel([r["loss"] for r in records], ref["fp32"])
    if posed > FP32_TORCH_RTOL:
        raise Failure("%s: not well posed in float32: PyTorch's own float32 losses are %.3g from "
                      "its float64 run's (the test allows carve %g)" % (model, posed,
                                                                       FP32_TORCH_RTOL))
    d32 = worst_rel(ref["fp32"], losses["fp32"])
    if d32 > FP32_TORCH_RTOL:
        raise Failure("%s fp32: losses differ from PyTorch's by %.3g (limit %g)" %
                      (model, d32, FP32_TORCH_RTOL))
    d16 = worst_rel(ref["bf16"], losses["bf16"])
    if d16 > CLOSE_RTOL:
        raise Failure("%s bf16: losses differ from PyTorch autocast bf16's by %.3g (limit %g)"
                      % (model, d16, CLOSE_RTOL))
    print("ok: %s against PyTorch: fp32 within %.2g; bf16 within %.2g of autocast bf16 "
          "(autocast is %.2g from PyTorch fp32, carve bf16 %.2g from carve fp32); well posed "
          "(PyTorch fp32 %.2g from fp64)" %
          (model, d32, d16, worst_rel(ref["fp32"], ref["bf16"]),
           worst_rel(losses["fp32"], losses["bf16"]), posed))
    return 2


def program_tables(out):
    """paramBytes, stateBytes and the kParams rows of OUT's program0."""
    text = open(os.path.join(out, "src", "program0.cpp")).read()
    m = re.search(r"/\*paramBytes=\*/(\d+), /\*gradBytes=\*/(\d+), /\*stateBytes=\*/(\d+)", text)
    rows = re.findall(r'^    \{"([^"]+)", DType::(\w+), .*?, (true|false), -?\d+, '
                      r'\{-?\d+, -?\d+\}.*?(?:, (\d+), DType::(\w+)(?:, DType::(\w+))?)?\},$',
                      text.split("kParams[]")[1].split("};")[0], re.M)
    return int(m.group(1)), int(m.group(3)), rows, int(m.group(2))


def mixed_storage(carve, w):
    """7.: mixed-precision storage (carve-store-params16). The bf16 and fp16
    programs store each trainable weight as a 16-bit copy (half the fp32
    program's parameter bytes) and its fp32 master with the optimizer state
    (4 more bytes per parameter: SGD without momentum keeps no other state);
    a checkpoint holds the fp32 masters (not bf16-representable values);
    a bf16 dp=2 ZeRO-1 run (masters chunked over dp, copies gathered in 16
    bits) resumed from its checkpoint equals the unbroken run bitwise; the
    checkpoint loads into the 1-rank bf16 program, whose first loss equals
    the unbroken run's within PARALLEL_RTOL (same weights, the batch summed
    in another order), and into the 1-rank fp32 program (master weights read
    unrounded: within CLOSE_RTOL)."""
    import numpy as np
    onnx_dir = os.path.join(w, "gpt-fp32")
    p32, s32, rows32, g32 = program_tables(onnx_dir)
    trainable = [r for r in rows32 if r[2] == "true"]
    for pr, copy in (("bf16", "BF16"), ("fp16", "F16")):
        p16, s16, rows16, g16 = program_tables(os.path.join(w, "gpt-" + pr))
        bad = [r[0] for r in rows16 if r[2] == "true" and (r[1] != "F32" or r[4] != copy)]
        if bad or any(r[3] for r in rows32):
            raise Failure("%s: trainable rows without an fp32 master and a %s copy: %s" %
                          (pr, copy, bad))
        if not p16 * 2 <= p32 + 64 * len(rows16):
            raise Failure("%s program keeps %d parameter bytes, fp32 %d: the copies are not "
                          "16-bit" % (pr, p16, p32))
        # 8.: one micro-batch, so the gradients are 16-bit too.
        bad = [r[0] for r in rows16 if r[2] == "true" and r[5] != copy]
        if bad or not g16 * 2 <= g32 + 64 * len(rows16):
            raise Failure("%s program keeps %d gradient bytes (fp32 %d); rows whose gradient "
                          "is not %s: %s" % (pr, g16, g32, copy, bad))
    numel = sum(int(np.prod(t.shape)) for n, t in
                st.load(os.path.join(onnx_dir, "init.safetensors")).items()
                if n in {r[0] for r in trainable})
    if not s16 - s32 >= 4 * numel:
        raise Failure("the fp16 program's optimizer state is %d bytes, fp32's %d: no fp32 "
                      "masters of %d parameters" % (s16, s32, numel))
    print("ok: bf16/fp16 programs store 16-bit weight copies (%d parameter bytes, fp32 %d), "
          "16-bit gradients (%d bytes, fp32 %d) and fp32 masters with the optimizer state "
          "(+%d bytes)" % (p16, p32, g16, g32, s16 - s32))

    data = os.path.join(w, "gpt.tokens")
    out = os.path.join(w, "gpt-bf16-dp2-zero1")
    compile_(carve, MODEL_ONNX["gpt"], {"precision": "bf16", "dp": 2, "zero": 1}, out)
    full, _ = train(carve, out, 2, data, out + ".jsonl")
    k = 4
    ck = os.path.join(w, "ckpt-bf16")
    rc, so, se = run([carve, "run", out, "-n", "2", "--", "--steps", str(k), "--data", data,
                      "--save", ck, "--progress", "none"])
    if rc != 0:
        raise Failure("bf16 dp=2 ZeRO-1 run with --save failed:\n%s%s" % (so, se))
    saved = st.load_checkpoint(ck)
    rounded = 0
    for name, t in saved.items():
        x = np.ascontiguousarray(t, dtype=np.float32).view(np.uint32)
        rounded += int(np.count_nonzero(x & 0xFFFF))
    if rounded == 0:
        raise Failure("the checkpoint's weights are all bf16 values: it saved the 16-bit "
                      "copies, not the fp32 masters")
    resumed, _ = train(carve, out, 2, data, out + "-resumed.jsonl", ["--load", ck])
    want = [(r["step"], r["loss"]) for r in full[k:]]
    got = [(r["step"], r["loss"]) for r in resumed][:len(want)]
    if got != want:
        raise Failure("bf16 dp=2 ZeRO-1 resumed from step %d: %s, the unbroken run %s" %
                      (k, got, want))
    one, _ = train(carve, os.path.join(w, "gpt-bf16"), 1, data, out + "-1rank.jsonl",
                   ["--load", ck])
    d = abs(one[0]["loss"] - full[k]["loss"]) / abs(full[k]["loss"])
    if d > PARALLEL_RTOL:
        raise Failure("the bf16 dp=2 checkpoint loaded into 1 rank: loss %.9g, the unbroken "
                      "run %.9g (%.3g relative, limit %g)" % (one[0]["loss"], full[k]["loss"], d,
                                                                 PARALLEL_RTOL))
    f32, _ = train(carve, onnx_dir, 1, data, out + "-fp32.jsonl", ["--load", ck])
    d32 = abs(f32[0]["loss"] - full[k]["loss"]) / abs(full[k]["loss"])
    if d32 > CLOSE_RTOL:
        raise Failure("the bf16 checkpoint loaded into the fp32 program: loss %.9g, bf16 %.9g" %
                      (f32[0]["loss"], full[k]["loss"]))
    print("ok: bf16 dp=2 ZeRO-1 checkpoints hold fp32 masters (%d elements not bf16 values); "
          "resumed bitwise; loaded into 1-rank bf16 (%.2g) and fp32 (%.2g) programs" %
          (rounded, d, d32))
    return 5


def gradient_storage(carve, w):
    """8.: 16-bit gradients (carve-store-grads16). Without micro-batches the
    bf16/fp16 gradients are 16-bit (7. checks the 1-rank programs) and dp
    all-reduces them in 16 bits. With micro-batches, plan field
    grad_accumulation says where they accumulate: "fp32" (the default) keeps
    fp32 gradients under ZeRO-0/1 (reduced in fp32) and fp32 chunk
    accumulators under ZeRO-2/3, whose reduce-scatters move 16 bits; "16bit"
    keeps 16-bit gradients (or chunks) throughout. Each program's tables
    and reductions say so, and its gradient bytes are those of the choice.
    grad_accumulation "16bit" under fp32 is refused naming the field."""
    onnx = MODEL_ONNX["gpt"]
    base = {"precision": "bf16", "dp": 2}
    cases = [  # plan, gradient dtype in the tables, bytes per element, reductions' CommType
        ({}, "BF16", 2, "BF16"),
        ({"num_micro_batches": 2}, "F32", 4, "F32"),
        ({"num_micro_batches": 2, "grad_accumulation": "16bit"}, "BF16", 2, "BF16"),
        ({"num_micro_batches": 2, "zero": 2}, "F32", 2, "BF16"),
        ({"num_micro_batches": 2, "zero": 2, "grad_accumulation": "16bit"}, "BF16", 1, "BF16"),
    ]
    _, _, rows32, g32 = program_tables(os.path.join(w, "gpt-fp32"))
    n = len([r for r in rows32 if r[2] == "true"])
    for extra, dtype, per, comm in cases:
        plan = dict(base, **extra)
        out = os.path.join(w, "grads-" + "-".join("%s%s" % kv for kv in sorted(extra.items())))
        pj = out + ".plan.json"
        with open(pj, "w") as f:
            json.dump(plan, f)
        rc, so, se = run([carve, "compile", onnx, "--plan", pj, "-o", out, "--no-build",
                          "--no-weights", "--quiet"])
        if rc != 0:
            raise Failure("compile %s failed:\n%s%s" % (plan, so, se))
        _, _, rows, g = program_tables(out)
        got = {r[5] or "F32" for r in rows if r[2] == "true"}
        # per: bytes per parameter element of the kept gradient (fp32's 4;
        # a ZeRO-2 chunk over dp=2 halves it).
        if got != {dtype} or not 0 <= g - g32 * per // 4 <= 64 * n:
            raise Failure("%s: gradients kept as %s in %d bytes; expected %s in about %d (fp32 "
                          "whole: %d)" % (plan, sorted(got), g, dtype, g32 * per // 4, g32))
        src = open(os.path.join(out, "src", "program0.cpp")).read()
        reductions = set(re.findall(r"(?:allReduceAsync|reduceScatterAsync)\(.*CommType::(\w+)",
                                    src))
        if reductions != {comm}:
            raise Failure("%s: the gradient reductions move %s, expected %s" %
                          (plan, sorted(reductions), comm))
        print("ok: bf16 dp2 %s: gradients kept as %s (%d bytes), reduced as %s" %
              (extra or "one micro-batch", dtype, g, comm))
    pj = os.path.join(w, "bad-accumulation.json")
    with open(pj, "w") as f:
        json.dump({"grad_accumulation": "16bit"}, f)
    never = os.path.join(w, "never-accumulation")
    rc, so, se = run([carve, "compile", onnx, "--plan", pj, "-o", never])
    if rc == 0 or '"grad_accumulation": "16bit"' not in se or os.path.exists(never):
        raise Failure("grad_accumulation 16bit under fp32: expected a clear error and nothing "
                      "written, got %d:\n%s" % (rc, se))
    print("ok: grad_accumulation 16bit under fp32 refused")
    return len(cases) + 1


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

    for model in ["gpt", "llama"]:
        onnx = os.path.join(a.models, "opset17", model + ".onnx")
        MODEL_ONNX[model] = onnx
        data = os.path.join(w, model + ".tokens")
        subprocess.run([sys.executable, data_gen, "tokens", "--model", onnx, "--tokens", "8192",
                        data], check=True, stdout=subprocess.DEVNULL)
        losses = {}
        for pr in ["fp32", "bf16", "fp16"]:
            out = os.path.join(w, "%s-%s" % (model, pr))
            compile_(a.carve, onnx, {"precision": pr}, out)
            log, _ = train(a.carve, out, 1, data, out + ".jsonl")
            losses[pr] = [r["loss"] for r in log]
        for pr in ["bf16", "fp16"]:
            d = worst_rel(losses["fp32"], losses[pr])
            if d > CLOSE_RTOL:
                raise Failure("%s %s: losses differ from fp32 by %.3g relative (limit %g)" %
                              (model, pr, d, CLOSE_RTOL))
            if losses[pr] == losses["fp32"]:
                raise Failure("%s %s: losses bitwise equal to fp32's: no rounding happened" %
                              (model, pr))
            print("ok: %s %s within %.2g of fp32 over %d steps (and not equal to it)" %
                  (model, pr, d, STEPS))
            checks += 2
        if losses["bf16"] == losses["fp16"]:
            raise Failure("%s: bf16 and fp16 give the same losses" % model)
        checks += 1
        checks += against_pytorch(model, onnx, data, losses)

        for name, plan, ranks in PARALLEL_PLANS[model]:
            out = os.path.join(w, "%s-bf16-%s" % (model, name))
            compile_(a.carve, onnx, dict(plan, precision="bf16"), out)
            log, _ = train(a.carve, out, ranks, data, out + ".jsonl")
            d = worst_rel(losses["bf16"], [r["loss"] for r in log])
            if d > PARALLEL_RTOL:
                raise Failure("%s bf16 %s: losses differ from 1 rank by %.3g (limit %g)" %
                              (model, name, d, PARALLEL_RTOL))
            print("ok: %s bf16 under %s within %.2g of 1 rank" % (model, name, d))
            checks += 1

    # 4. fp16 loss scaling.
    onnx = os.path.join(a.models, "opset17", "gpt.onnx")
    data = os.path.join(w, "gpt.tokens")
    out = os.path.join(w, "gpt-fp16")
    big = 2.0 ** 24
    log, so = train(a.carve, out, 1, data, out + "-scaled.jsonl",
                    ["--loss-scale", str(int(big))])
    skipped = [r for r in log if r.get("skipped")]
    k = len(skipped)
    if k == 0 or k >= STEPS or any(not r.get("skipped") for r in log[:k]):
        raise Failure("--loss-scale 2^24: expected the first steps (and only they) skipped, got "
                      "%s" % [(r["step"], r.get("skipped"), r.get("loss_scale")) for r in log])
    scales = [r["loss_scale"] for r in log]
    if scales[:k + 1] != [big / 2 ** i for i in range(k + 1)] or scales[k:] != [scales[k]] * (
            STEPS - k):
        raise Failure("loss scales %s: expected halving on each overflow, then constant" % scales)
    if so.count("fp16 gradients overflowed") != k:
        raise Failure("stdout reports %d overflows, the log %d:\n%s" %
                      (so.count("fp16 gradients overflowed"), k, so))
    tail = [r["loss"] for r in log[k:]]
    if not all(x == x and abs(x) < 1e9 for x in tail) or not tail[-1] < log[0]["loss"]:
        raise Failure("after the overflows the losses %s are not finite and falling" % tail)
    print("ok: fp16 at loss scale 2^24: %d steps skipped, scale halved to 2^%d, then training "
          "(loss %.4f -> %.4f)" % (k, 24 - k, log[0]["loss"], tail[-1]))
    checks += 3
    # The skipped steps left the weights alone.
    ck = os.path.join(w, "ckpt")
    rc, so2, se = run([a.carve, "run", out, "-n", "1", "--", "--steps", str(k), "--data", data,
                       "--loss-scale", str(int(big)), "--save", ck, "--progress", "none"])
    if rc != 0:
        raise Failure("fp16 run with --save failed:\n%s%s" % (so2, se))
    saved = st.load_checkpoint(ck)
    init = st.load(os.path.join(out, "init.safetensors"))
    for name, t in init.items():
        if name in saved and not (saved[name] == t).all():
            raise Failure("%s changed during steps that were all skipped" % name)
    print("ok: weights unchanged over %d skipped steps (%d tensors compared)" % (k, len(init)))
    checks += 1
    # The scale is saved with the checkpoint and resumed (unless --loss-scale
    # is given): a run saved after step k and resumed equals the unbroken run.
    ck2 = os.path.join(w, "ckpt-resume")
    rc, so2, se = run([a.carve, "run", out, "-n", "1", "--", "--steps", str(k + 1), "--data",
                       data, "--loss-scale", str(int(big)), "--save", ck2, "--progress", "none"])
    if rc != 0:
        raise Failure("fp16 run with --save failed:\n%s%s" % (so2, se))
    manifest = json.load(open(os.path.join(st.checkpoint_folder(ck2), "manifest.json")))
    if manifest.get("loss_scale", {}).get("scale") != scales[k + 1]:
        raise Failure("manifest.json records loss_scale %s, the run was at %g" %
                      (manifest.get("loss_scale"), scales[k + 1]))
    resumed, so3 = train(a.carve, out, 1, data, out + "-resumed.jsonl", ["--load", ck2])
    tail_rows = [(r["step"], r["loss"], r["loss_scale"]) for r in log[k + 1:]]
    got_rows = [(r["step"], r["loss"], r["loss_scale"]) for r in resumed]
    if got_rows[:len(tail_rows)] != tail_rows or "loss scale %g" % scales[k + 1] not in so3:
        raise Failure("resumed fp16 run %s differs from the unbroken run %s (stdout:\n%s)" %
                      (got_rows, tail_rows, so3))
    forced, _ = train(a.carve, out, 1, data, out + "-forced.jsonl",
                      ["--load", ck2, "--loss-scale", "1024"])
    if forced[0]["loss_scale"] != 1024:
        raise Failure("--loss-scale 1024 with --load: the run used %g" % forced[0]["loss_scale"])
    print("ok: the loss scale (2^%d) is saved in the checkpoint; the resumed run equals the "
          "unbroken one; --loss-scale overrides it" % (24 - k))
    checks += 2
    out2 = os.path.join(w, "gpt-fp16-dp2")
    compile_(a.carve, onnx, {"precision": "fp16", "dp": 2}, out2)
    log2, _ = train(a.carve, out2, 2, data, out2 + ".jsonl", ["--loss-scale", str(int(big))])
    k2 = len([r for r in log2 if r.get("skipped")])
    if k2 != k:
        raise Failure("dp=2 skipped %d steps at loss scale 2^24, 1 rank %d" % (k2, k))
    print("ok: dp=2 skips the same %d steps" % k2)
    checks += 1

    checks += mixed_storage(a.carve, w)
    checks += gradient_storage(a.carve, w)

    # 5. Bad precision.
    pj = os.path.join(w, "bad.json")
    with open(pj, "w") as f:
        json.dump({"precision": "fp8"}, f)
    rc, so, se = run([a.carve, "compile", onnx, "--plan", pj, "-o", os.path.join(w, "never")])
    if rc == 0 or '"precision" must be "fp32", "bf16" or "fp16"' not in se:
        raise Failure("precision fp8: expected a clear error, got %d:\n%s" % (rc, se))
    print("ok: precision fp8 refused")
    checks += 1
    print("precision: %d checks passed" % checks)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Failure as e:
        print("FAIL: %s" % e)
        sys.exit(1)
