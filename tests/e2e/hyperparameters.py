#!/usr/bin/env python3
"""Run-time hyperparameters: `train --lr ... --clip` without recompiling.

What must hold (docs/training.md#hyperparameters), on the GPT-style reference
model with AdamW:

1. Under 1 rank, dp=2, tp=2 and pp=2 with 2 micro-batches, a program compiled
   with the defaults and run with --lr --min-lr --warmup-steps --decay-steps
   --weight-decay --beta1 --beta2 --eps --clip gives bitwise the losses and
   learning rates of the program compiled with those values and run without
   flags: the step reads the same numbers either way. (The values are chosen
   so that --min-lr / --lr is exact in binary: 2^-10 / 2^-8 = 0.25, the ratio
   carve compile --min-lr-ratio takes.) And they differ from the defaults'.
2. --schedule linear, constant and wsd log the learning rates of their
   formulas (warm-up, then a straight line to --min-lr over --decay-steps;
   lr; stable until --decay-steps before the run's end, then the line),
   within float rounding (the JSONL's lr is the float the step used).
3. A checkpoint records the values its run used (manifest.json
   "hyperparameters"); resuming with the same values says nothing and equals
   the unbroken run bitwise; resuming with another --lr prints one line naming
   it and the checkpoint's value.
4. `train --help` lists the program's compiled values.
5. Bad values (--schedule exponential, --beta1 1, --lr 0, --min-lr above the
   lr, --warmup-steps -1, --beta1 for an SGD program) exit 1 with one line
   naming the flag, and write no log.
"""

import argparse
import json
import math
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st  # noqa: E402
import harness  # noqa: E402

STEPS = 8
TIMEOUT_S = 300
LR, MIN_LR = 2.0 ** -8, 2.0 ** -10
# The run-time flags, and the same values as carve compile flags.
RUN_FLAGS = ["--lr", repr(LR), "--min-lr", repr(MIN_LR), "--warmup-steps", "2",
             "--decay-steps", "4", "--weight-decay", "0.1", "--beta1", "0.8", "--beta2", "0.99",
             "--eps", "1e-06", "--clip", "0.05"]
COMPILE_FLAGS = ["--lr", repr(LR), "--min-lr-ratio", "0.25", "--warmup-steps", "2",
                 "--decay-steps", "4", "--weight-decay", "0.1", "--beta1", "0.8", "--beta2",
                 "0.99", "--eps", "1e-06", "--clip-grad-norm", "0.05"]
PLANS = [("1rank", {}, 1), ("dp2", {"dp": 2}, 2), ("tp2", {"tp": 2}, 2),
         ("pp2", {"pp": 2, "num_micro_batches": 2}, 2)]


Failure = harness.Failure


def run(cmd):
    return harness.run(cmd, timeout=TIMEOUT_S)


def compile_(carve, onnx, plan, out, flags=()):
    pj = out + ".plan.json"
    with open(pj, "w") as f:
        json.dump(plan, f)
    rc, so, se = run([carve, "compile", onnx, "--plan", pj, "-o", out, "--quiet"] + list(flags))
    if rc != 0:
        raise Failure("compile %s %s %s failed:\n%s%s" % (onnx, plan, flags, so, se))


def train(carve, out, ranks, data, log, extra=(), steps=STEPS):
    rc, so, se = run([carve, "run", out, "-n", str(ranks), "--", "--steps", str(steps), "--data",
                      data, "--log", log, "--progress", "none"] + list(extra))
    if rc != 0:
        raise Failure("run %s %s failed:\n%s%s" % (out, list(extra), so, se))
    return [json.loads(l) for l in open(log)], so


def rows(log):
    return [(r["step"], r["loss"], r["lr"]) for r in log]


def linear(n, warm, decay, begin):
    """The learning rate of step n (numbered from 1, as the log numbers steps)."""
    t = n - 1
    if t < warm:
        return LR * (t + 1) / warm
    if t < begin:
        return LR
    d = t - begin
    if d >= decay:
        return MIN_LR
    return LR * (0.25 + 0.75 * (1 - d / decay))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--carve", required=True)
    ap.add_argument("--models", required=True)
    ap.add_argument("--workdir", required=True)
    a = ap.parse_args()
    shutil.rmtree(a.workdir, ignore_errors=True)
    os.makedirs(a.workdir)
    w = a.workdir
    onnx = os.path.join(a.models, "opset17", "gpt.onnx")
    data = os.path.join(w, "gpt.tokens")
    subprocess.run([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                 "data_gen.py"),
                    "tokens", "--model", onnx, "--tokens", "8192", data], check=True,
                   stdout=subprocess.DEVNULL)

    # 1. Run-time values equal compiled ones, bitwise, under every kind of plan.
    for name, plan, ranks in PLANS:
        base = os.path.join(w, "gpt-%s" % name)
        compiled = os.path.join(w, "gpt-%s-compiled" % name)
        compile_(a.carve, onnx, plan, base)
        compile_(a.carve, onnx, plan, compiled, COMPILE_FLAGS)
        defaults, _ = train(a.carve, base, ranks, data, base + "-defaults.jsonl")
        flagged, so = train(a.carve, base, ranks, data, base + "-flags.jsonl", RUN_FLAGS)
        want, _ = train(a.carve, compiled, ranks, data, compiled + ".jsonl")
        if rows(flagged) != rows(want):
            raise Failure("%s: run-time hyperparameters give %s, the program compiled with them "
                          "%s" % (name, rows(flagged), rows(want)))
        if [r["loss"] for r in flagged][1:] == [r["loss"] for r in defaults][1:]:
            raise Failure("%s: the flags changed no loss" % name)
        if "hyperparameters of this run: lr 0.00390625 (compiled 0.001)" not in so:
            raise Failure("%s: the start-up report does not name the overridden values:\n%s" %
                          (name, so))
        print("ok: %s: train --lr ... --clip equals the program compiled with them, bitwise "
              "(%d steps; lr %.6g -> %.6g)" % (name, STEPS, flagged[0]["lr"], flagged[-1]["lr"]))
    base1 = os.path.join(w, "gpt-1rank")

    # 2. Schedules.
    for sched in ["linear", "constant", "wsd"]:
        log, _ = train(a.carve, base1, 1, data, base1 + "-%s.jsonl" % sched,
                       ["--lr", repr(LR), "--min-lr", repr(MIN_LR), "--warmup-steps", "2",
                        "--decay-steps", "4", "--schedule", sched], steps=10)
        for r in log:
            n = r["step"]
            if sched == "linear":
                want = linear(n, 2, 4, 2)
            elif sched == "constant":
                want = linear(n, 2, 4, 10 ** 9)
            else:
                want = linear(n, 2, 4, max(2, 10 - 4))
            if abs(r["lr"] - want) > 1e-7 * want:
                raise Failure("--schedule %s: step %d lr %.9g, expected %.9g" %
                              (sched, n, r["lr"], want))
        print("ok: --schedule %s: %s" % (sched, " ".join("%.4g" % r["lr"] for r in log)))

    # 3. Checkpoints record the values; resuming says when they change.
    ck = os.path.join(w, "ckpt")
    rc, so, se = run([a.carve, "run", base1, "-n", "1", "--", "--steps", "4", "--data", data,
                      "--save", ck, "--progress", "none"] + RUN_FLAGS)
    if rc != 0:
        raise Failure("run with --save failed:\n%s%s" % (so, se))
    manifest = json.load(open(os.path.join(st.checkpoint_folder(ck), "manifest.json")))
    h = manifest.get("hyperparameters", {})
    want_h = {"lr": LR, "min_lr": MIN_LR, "warmup_steps": 2, "decay_steps": 4,
              "weight_decay": 0.1, "beta1": 0.8, "beta2": 0.99, "eps": 1e-6, "clip": 0.05,
              "schedule": "cosine"}
    if h != want_h:
        raise Failure("manifest.json hyperparameters %s, the run used %s" % (h, want_h))
    full, _ = train(a.carve, base1, 1, data, base1 + "-full.jsonl", RUN_FLAGS)
    same, so = train(a.carve, base1, 1, data, base1 + "-same.jsonl", RUN_FLAGS + ["--load", ck],
                     steps=STEPS - 4)
    if "other hyperparameters" in so:
        raise Failure("resuming with the checkpoint's own values printed:\n%s" % so)
    if rows(same) != rows(full)[4:]:
        raise Failure("resumed with the same values: %s, the unbroken run %s" %
                      (rows(same), rows(full)[4:]))
    other, so = train(a.carve, base1, 1, data, base1 + "-other.jsonl",
                      RUN_FLAGS + ["--load", ck, "--lr", "0.001"], steps=2)
    lines = [l for l in so.splitlines() if "other hyperparameters" in l]
    if len(lines) != 1 or "lr 0.001 (the checkpoint's run used 0.00390625)" not in lines[0]:
        raise Failure("resuming with --lr 0.001: expected one line naming it, got:\n%s" % so)
    print("ok: the checkpoint records the run's hyperparameters; resumed with them bitwise; "
          "with another lr: %s" % lines[0])

    # 4. --help lists the compiled values.
    rc, so, se = run([a.carve, "run", os.path.join(w, "gpt-1rank-compiled"), "-n", "1", "--",
                      "--help"])
    if rc != 0 or "--lr 0.00390625  --min-lr 0.0009765625  --warmup-steps 2  --decay-steps 4" \
            not in so or "--clip 0.05" not in so:
        raise Failure("train --help does not list the compiled values:\n%s%s" % (so, se))
    print("ok: train --help lists the compiled hyperparameters")

    # 5. Bad values.
    sgd = os.path.join(w, "gpt-sgd")
    compile_(a.carve, onnx, {}, sgd, ["--optimizer", "sgd", "--lr", "0.1"])
    cases = [(base1, ["--schedule", "exponential"],
              "--schedule is cosine, linear, constant or wsd, not 'exponential'"),
             (base1, ["--beta1", "1"], "--beta1 needs a number in [0, 1), not '1'"),
             (base1, ["--lr", "0"], "--lr needs a number > 0, not '0'"),
             (base1, ["--lr", "0.001", "--min-lr", "0.01"],
              "--min-lr 0.01 is above the learning rate 0.001"),
             (base1, ["--warmup-steps", "-1"], "--warmup-steps needs an integer >= 0, not '-1'"),
             (sgd, ["--beta1", "0.8"],
              "--beta1: this program's optimizer is SGD, which has no betas or eps")]
    for out, flags, message in cases:
        log = os.path.join(w, "bad.jsonl")
        if os.path.exists(log):
            os.remove(log)
        rc, so, se = run([a.carve, "run", out, "-n", "1", "--", "--steps", "2", "--data", data,
                          "--log", log] + flags)
        errors = [l for l in se.splitlines() if "error" in l]
        if rc == 0 or message not in se or len(errors) != 1 or os.path.exists(log):
            raise Failure("%s: expected exit 1 with one line '%s' and no log, got %d:\n%s%s" %
                          (flags, message, rc, so, se))
    print("ok: %d bad hyperparameters refused, one line each, nothing written" % len(cases))


if __name__ == "__main__":
    try:
        main()
    except (Failure, subprocess.TimeoutExpired) as e:
        print("FAIL: %s" % e)
        sys.exit(1)
