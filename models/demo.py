#!/usr/bin/env python3
"""`make demo`: one GPT-style model written in PyTorch, trained by four differently
parallelized programs that must all follow the 1-rank run; a change of plan in the
middle of training; `carve verify`; a plan for a 175B model on 1024 GPUs."""

# Usage: /usr/bin/python3 models/demo.py [--carve build/bin/carve] [--workdir build/demo]
#                                        [--steps 50] [--verbose]
#
# Each part prints what it shows and one line of result; --verbose also prints every
# command as you would type it. The token file is written in the format `train --data`
# reads, by the same generator the tests use (tests/e2e/data_gen.py): a seeded Markov
# chain over the model's 64-token vocabulary, so that the loss has something to learn.

import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))
import data_gen  # noqa: E402

BATCH = 8
LR = "3e-3"
TIMEOUT_S = 900

# name, plan, what it is
PLANS = [
    ("dp4", {"dp": 4}, "dp=4: four data-parallel replicas"),
    ("dp2tp2", {"dp": 2, "tp": 2, "sequence_parallel": True, "zero": 1},
     "dp=2 x tp=2: Megatron tensor + sequence parallel, ZeRO-1"),
    ("dp2pp2", {"dp": 2, "pp": 2, "num_micro_batches": 4, "schedule": "1f1b"},
     "dp=2 x pp=2: two pipeline stages, 1F1B over 4 micro-batches"),
]

verbose = False


def show(arg):
    """A command-line argument as the user would type it from here."""
    if arg == sys.executable:
        return "python3"
    return os.path.relpath(arg) if arg.startswith(os.getcwd() + os.sep) else arg


def run(title, cmd):
    """Runs one command; returns its stdout and the seconds it took; exits on failure."""
    if verbose:
        print("    $ " + " ".join(show(a) for a in cmd))
        sys.stdout.flush()
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        sys.exit(f"demo: error: {title} did not finish within {TIMEOUT_S} s")
    except OSError as e:
        sys.exit(f"demo: error: {title}: cannot start {cmd[0]}: {e}")
    if p.returncode != 0:
        sys.exit(f"demo: error: {title} failed (exit {p.returncode}):\n"
                 + (p.stderr or p.stdout).strip())
    return p.stdout, time.time() - t0


def losses(path, expect):
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if len(rows) != expect:
        sys.exit(f"demo: error: {path}: {len(rows)} steps logged, expected {expect}")
    return [r["loss"] for r in rows]


def worst(a, b):
    return max(abs(x - y) / abs(x) for x, y in zip(a, b))


def main():
    global verbose
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--carve", default=os.path.join(ROOT, "build", "bin", "carve"))
    ap.add_argument("--workdir", default=os.path.join(ROOT, "build", "demo"))
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--verbose", action="store_true", help="print every command")
    args = ap.parse_args()
    verbose = args.verbose
    steps, half = args.steps, args.steps // 2
    if steps < 2:
        sys.exit("demo: error: --steps must be at least 2 (the resume starts half-way)")
    carve, work = os.path.abspath(args.carve), os.path.abspath(args.workdir)
    if not os.access(carve, os.X_OK):
        sys.exit(f"demo: error: {carve} is missing or not executable (build it first)")
    os.makedirs(work, exist_ok=True)
    w = lambda *p: os.path.join(work, *p)
    t_start = time.time()

    print("carve demo: a GPT-style model written in PyTorch (models/reference.py: 2 layers, "
          "width 32,\nvocabulary 64), trained by programs for 1 rank and for three 4-rank "
          "plans.\n")

    print("1. Export the PyTorch model to ONNX")
    out, _ = run("export", [sys.executable, os.path.join(ROOT, "models", "export.py"), "gpt",
                            "--batch", str(BATCH), "--out", work])
    model = w("gpt.onnx")
    tokens = w("tokens.bin")
    data_gen.write_tokens(tokens, data_gen.make_tokens(20000, data_gen.vocab_size(model)))
    print(f"   {show(model)}, global batch {BATCH} x 16 tokens; {show(tokens)}: 20000 "
          "tokens of a Markov chain")

    print("2. Compile: one C++ program per plan, linked against the runtime")
    names = [("1", {"dp": 1}, "1 rank")] + PLANS
    for name, plan, what in names:
        with open(w(name + ".json"), "w") as f:
            json.dump(plan, f)
        extra = (["--emit-mlir", w("gpt-dp2tp2.mlir")] if name == "dp2tp2" else
                 ["--timeline-svg", w("gpt-dp2pp2.svg")] if name == "dp2pp2" else [])
        _, took = run("compile " + what, [carve, "compile", model, "--plan", w(name + ".json"),
                                          "--lr", LR, "--quiet", "-o", w("gpt-" + name)] + extra)
        print(f"   {what:<60} {took:4.1f} s  {show(w('gpt-' + name, 'src'))}")

    print(f"3. Train each {steps} steps on the same tokens (AdamW, lr {LR})")
    train = ["--steps", str(steps), "--data", tokens, "--quiet"]
    run("training (1 rank)", [w("gpt-1", "bin", "train"), *train, "--log", w("gpt-1.jsonl")])
    one = losses(w("gpt-1.jsonl"), steps)
    print(f"   1 rank: loss {one[0]:.4f} at step 0 -> {one[-1]:.4f} at step {steps - 1}")
    for name, _, what in PLANS:
        run("training " + what, [carve, "run", w("gpt-" + name), "-n", "4", "--", *train,
                                 "--log", w(f"gpt-{name}.jsonl")])
        other = losses(w(f"gpt-{name}.jsonl"), steps)
        print(f"   {what.split(':')[0]:<12} every step's loss within {worst(one, other):.1e} "
              "of the 1-rank run's (float32 sums in another order)")

    print(f"4. Change the plan mid-run: dp=2 x tp=2 to step {half}, then resume its "
          "checkpoint under dp=2 x pp=2")
    ckpt = w("ckpt")
    run("training to the checkpoint", [carve, "run", w("gpt-dp2tp2"), "-n", "4", "--",
                                       "--steps", str(half), "--data", tokens, "--quiet",
                                       "--save", ckpt])
    run("resuming under another plan", [carve, "run", w("gpt-dp2pp2"), "-n", "4", "--",
                                        "--steps", str(steps - half), "--data", tokens,
                                        "--quiet", "--load", ckpt, "--log", w("resumed.jsonl")])
    resumed = losses(w("resumed.jsonl"), steps - half)
    print(f"   steps {half}-{steps - 1} after the switch: loss within "
          f"{worst(one[half:], resumed):.1e} of the uninterrupted 1-rank run")

    print("5. carve verify: a plan against one rank, weights too (docs/verify.md)")
    out, took = run("carve verify", [carve, "verify", model, "--plan", w("dp2tp2.json"),
                                     "--steps", "3"])
    m = re.search(r"^PASS: losses within \S+ \(worst (\S+)\), weights within \S+ \(worst "
                  r"(\S+), ", out, re.M)
    if not m:
        sys.exit("demo: error: carve verify did not pass:\n" + out)
    print(f"   dp=2 x tp=2, 3 steps: PASS, losses within {m.group(1)} and every weight within "
          f"{m.group(2)} of one rank's ({took:.0f} s)")

    print("6. carve plan: GPT-3 175B on 128 nodes x 8 A100-80GB, batch 1536 (docs/planner.md)")
    out, took = run("carve plan", [carve, "plan",
                                   "builtin:gpt:layers=96,hidden=12288,heads=96,seq=2048,"
                                   "vocab=51200", "--cluster", "a100-80gb:128x8",
                                   "--global-batch", "1536", "-o", w("gpt3.plan.json")])
    best = re.search(r"^Plan: (.*)$", out, re.M)
    step_time = re.search(r"^  step time\s+(.*)$", out, re.M)
    mfu = re.search(r"MFU ([\d.]+%)", out)
    if not (best and step_time and mfu):
        sys.exit("demo: error: carve plan's report lacks the plan, step time or MFU:\n" + out)
    print(f"   {best.group(1)}")
    print(f"   predicted step {step_time.group(1)}, MFU {mfu.group(1)}; planned in {took:.1f} s")

    print(f"\nDone in {time.time() - t_start:.0f} s. To read: {show(w('gpt-dp2tp2', 'src'))} "
          f"(generated C++), {show(w('gpt-dp2tp2.mlir'))}\n(partitioned IR), "
          f"{show(w('gpt-dp2pp2.svg'))} (pipeline timeline). Commands: --verbose. "
          "Walk-through: docs/tutorial.md.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
