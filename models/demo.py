#!/usr/bin/env python3
"""`make demo`: compiles the GPT for 1 rank, for dp=4, for dp=2 x tp=2 with sequence
parallelism and ZeRO-1, and for dp=2 x pp=2 with a 1F1B pipeline over 4 micro-batches,
trains all four, compares the losses."""

# Usage: /usr/bin/python3 models/demo.py [--carve build/bin/carve] [--workdir build/demo]
#
# The token file is written in the format `train --data` reads, by the same
# generator the tests use (tests/e2e/data_gen.py): a seeded Markov chain over
# the model's 64-token vocabulary, so that the loss has something to learn.

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))
import data_gen  # noqa: E402

BATCH = 8
LR = "3e-3"
TIMEOUT_S = 900


def show(arg):
    """A command-line argument as the user would type it from here."""
    if arg == sys.executable:
        return "python3"
    return os.path.relpath(arg) if arg.startswith(os.getcwd() + os.sep) else arg


def step(title, cmd):
    """Runs one command, shown as the user would type it; exits on failure."""
    print("$ " + " ".join(show(a) for a in cmd))
    sys.stdout.flush()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        sys.exit(f"demo: error: {title} did not finish within {TIMEOUT_S} s")
    except OSError as e:
        sys.exit(f"demo: error: {title}: cannot start {cmd[0]}: {e}")
    if p.returncode != 0:
        sys.exit(f"demo: error: {title} failed (exit {p.returncode}):\n"
                 + (p.stderr or p.stdout).strip())


def losses(path):
    with open(path) as f:
        return [json.loads(line)["loss"] for line in f if line.strip()]


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--carve", default=os.path.join(ROOT, "build", "bin", "carve"))
    ap.add_argument("--workdir", default=os.path.join(ROOT, "build", "demo"))
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    carve, work = os.path.abspath(args.carve), os.path.abspath(args.workdir)
    if not os.access(carve, os.X_OK):
        sys.exit(f"demo: error: {carve} is missing or not executable (build it first)")
    os.makedirs(work, exist_ok=True)
    w = lambda *p: os.path.join(work, *p)

    step("export", [sys.executable, os.path.join(ROOT, "models", "export.py"), "gpt",
                    "--batch", str(BATCH), "--out", work])
    model = w("gpt.onnx")
    tokens = w("tokens.bin")
    data_gen.write_tokens(tokens, data_gen.make_tokens(20000, data_gen.vocab_size(model)))
    print(f"# wrote {show(tokens)}: 20000 tokens")
    with open(w("dp4.json"), "w") as f:
        json.dump({"dp": 4}, f)
    mesh = {"dp": 2, "tp": 2, "sequence_parallel": True, "zero": 1}
    with open(w("dp2tp2.json"), "w") as f:
        json.dump(mesh, f)
    with open(w("dp2pp2.json"), "w") as f:
        json.dump({"dp": 2, "pp": 2, "num_micro_batches": 4, "schedule": "1f1b"}, f)

    step("compile (1 rank)", [carve, "compile", model, "--lr", LR, "-o", w("gpt-1")])
    step("compile (dp=4)", [carve, "compile", model, "--plan", w("dp4.json"), "--lr", LR,
                            "-o", w("gpt-dp4")])
    step("compile (dp=2 x tp=2, sequence parallel, ZeRO-1)",
         [carve, "compile", model, "--plan", w("dp2tp2.json"), "--lr", LR, "--emit-mlir",
          w("gpt-dp2tp2.mlir"), "-o", w("gpt-dp2tp2")])
    step("compile (dp=2 x pp=2, 1F1B over 4 micro-batches)",
         [carve, "compile", model, "--plan", w("dp2pp2.json"), "--lr", LR, "--timeline-svg",
          w("gpt-dp2pp2.svg"), "-o", w("gpt-dp2pp2")])
    train = ["--steps", str(args.steps), "--data", tokens, "--quiet"]
    step("training (1 rank)", [w("gpt-1", "bin", "train"), *train, "--log", w("gpt-1.jsonl")])
    step("training (dp=4)", [carve, "run", w("gpt-dp4"), "-n", "4", "--", *train,
                             "--log", w("gpt-dp4.jsonl")])

    step("training (dp=2 x tp=2)", [carve, "run", w("gpt-dp2tp2"), "-n", "4", "--", *train,
                                     "--log", w("gpt-dp2tp2.jsonl")])

    step("training (dp=2 x pp=2)", [carve, "run", w("gpt-dp2pp2"), "-n", "4", "--", *train,
                                     "--log", w("gpt-dp2pp2.jsonl")])

    one, four = losses(w("gpt-1.jsonl")), losses(w("gpt-dp4.jsonl"))
    mesh_losses = losses(w("gpt-dp2tp2.jsonl"))
    pipe = losses(w("gpt-dp2pp2.jsonl"))
    if any(len(x) != args.steps for x in (one, four, mesh_losses, pipe)):
        sys.exit(f"demo: error: expected {args.steps} log records, got {len(one)} (1 rank), "
                 f"{len(four)} (dp=4), {len(mesh_losses)} (dp=2 x tp=2) and {len(pipe)} "
                 f"(dp=2 x pp=2)")
    print()
    print(f"GPT, batch {BATCH} x 16 tokens, AdamW lr {LR}: loss per step")
    print(f"{'step':>5}  {'1 rank':>10}  {'dp=4':>10}  {'dp2 x tp2':>10}  {'dp2 x pp2':>10}")
    shown = sorted(set(range(0, args.steps, 5)) | {args.steps - 1})
    for k in shown:
        print(f"{k:>5}  {one[k]:>10.6f}  {four[k]:>10.6f}  {mesh_losses[k]:>10.6f}  "
              f"{pipe[k]:>10.6f}")
    for name, other in (("dp=4", four), ("dp=2 x tp=2", mesh_losses), ("dp=2 x pp=2", pipe)):
        worst = max(abs(a - b) / abs(a) for a, b in zip(one, other))
        print(f"{name}: max relative difference from 1 rank over {args.steps} steps: {worst:.1e}")
    print(f"the partitioned program (collectives, local shapes): {show(w('gpt-dp2tp2.mlir'))}")
    print(f"the pipeline's schedule: {show(w('gpt-dp2pp2', 'src', 'program0.cpp'))} (stage 0), "
          f"{show(w('gpt-dp2pp2.svg'))} (timeline)")

    # The planner: a plan for a model far larger than this machine, in a fraction of a second.
    print()
    plan = [carve, "plan", "builtin:gpt:layers=96,hidden=12288,heads=96,seq=2048,vocab=51200",
            "--cluster", "a100-80gb:128x8", "--global-batch", "1536", "-o", w("gpt3.plan.json")]
    print("$ " + " ".join(show(a) for a in plan))
    p = subprocess.run(plan, capture_output=True, text=True, timeout=TIMEOUT_S)
    if p.returncode != 0:
        sys.exit("demo: error: carve plan failed:\n" + p.stderr.strip())
    lines = p.stdout.splitlines()
    keep = [ln for ln in lines if ln.startswith(("carve plan:", "  searched", "Plan:",
                                                  "  step time", "  throughput", "  per device",
                                                  "  total"))]
    print("\n".join(keep))
    print(f"the whole report: carve plan ... (docs/planner.md); the plan: {show(w('gpt3.plan.json'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
