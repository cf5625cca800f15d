#!/usr/bin/env python3
"""The cost of activation recomputation on the CPU: step time and activation memory."""

# Run by hand, not a test:
#
#     /usr/bin/python3 bench/recompute.py [--carve build/bin/carve] [--workdir build/bench-recompute]
#         [--config JSON] [--batch 8] [--seq 128] [--steps 6] [--warmup 2] [--threads 1]
#
# 1. Exports a GPT with models/export.py (default 4 layers, width 256, 4 heads,
#    vocab 8192, T = 128, batch 8: the model of bench/train_step.py) and writes
#    a token file.
# 2. Compiles it for 1 rank with {"recompute": "none"}, {"recompute": "full"}
#    and {"recompute": "selective"}, runs each program for WARMUP and for
#    WARMUP + STEPS steps, one after another in this session, and takes the
#    step time as the difference of the two wall times over STEPS (start-up and
#    loading left out, as bench/train_step.py does).
# 3. Reads each program's activation bytes (OUT/src/README.md) and the number
#    of forward ops it runs again (the compile summary).
# 4. The expected cost: full recomputation runs the layers' forward again,
#    2 P_layers + 4 L T d FLOPs per token (P_layers: the parameters of the
#    numbered layers' matrix products; the second term attention's QK^T and
#    AV), against 6 P + 12 L T d for the step (bench/train_step.py), so the
#    step's FLOPs grow by that ratio; the measured ratio of step times is
#    printed beside it.
#
# Correctness is part of the benchmark: the recomputed programs' losses must
# equal the plain program's bit for bit (the recomputed ops are the same
# kernels on the same inputs), and the script exits non-zero otherwise.

import argparse
import datetime
import json
import os
import platform
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))
sys.path.insert(0, os.path.join(ROOT, "models"))

from train_step import DEFAULT_CONFIG, thread_env  # noqa: E402
from train_step import run_output as run_checked  # noqa: E402

MODES = ("none", "full", "selective")


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--carve", default=os.path.join(ROOT, "build", "bin", "carve"))
    ap.add_argument("--workdir", default=os.path.join(ROOT, "build", "bench-recompute"))
    ap.add_argument("--config", type=json.loads, default=DEFAULT_CONFIG)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=6, help="timed steps (6)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    import data_gen
    import reference

    work = os.path.abspath(args.workdir)
    os.makedirs(work, exist_ok=True)
    run_checked([sys.executable, os.path.join(ROOT, "models", "export.py"), "gpt", "--out", work,
                 "--batch", str(args.batch), "--seq", str(args.seq),
                 "--config", json.dumps(args.config)])
    onnx_path = os.path.join(work, "gpt.onnx")
    model, _, _ = reference.build("gpt", batch=args.batch, seq=args.seq, config=args.config)
    cfg = dict(vars(model.cfg))
    L, d, T = cfg["n_layer"], cfg["n_embd"], args.seq
    layer_params = sum(p.numel() for n, p in model.named_parameters()
                       if n.startswith("h.") and p.dim() == 2)
    matmul_params = sum(p.numel() for n, p in model.named_parameters()
                        if p.dim() == 2 and n != "wpe.weight")
    del model
    data = os.path.join(work, "tokens.i32")
    need = (args.warmup + args.steps) * args.batch * T + T + 2
    data_gen.write_tokens(data, data_gen.make_tokens(need, cfg["vocab_size"]))

    step_flops = 6 * matmul_params + 12 * L * T * d
    extra_flops = 2 * layer_params + 4 * L * T * d
    rows = {}
    for mode in MODES:
        out = os.path.join(work, mode)
        plan = out + ".plan.json"
        with open(plan, "w") as f:
            json.dump({"recompute": mode}, f)
        _, summary = run_checked([args.carve, "compile", onnx_path, "--plan", plan, "-o", out])
        m = re.search(r"(\d+) forward ops run again", summary)
        again = int(m.group(1)) if m else 0
        readme = open(os.path.join(out, "src", "README.md")).read()
        acts = int(re.search(r"activations take (\d+) bytes", readme).group(1))
        walls = []
        for n in (args.warmup, args.warmup + args.steps):
            log = out + f"-{n}.jsonl"
            secs, _ = run_checked([os.path.join(out, "bin", "train"), "--steps", str(n), "--data",
                                   data, "--log", log, "--quiet"], env=thread_env(args.threads))
            walls.append(secs)
        with open(log) as f:
            losses = [json.loads(line)["loss"] for line in f if line.strip()]
        rows[mode] = dict(ms=(walls[1] - walls[0]) / args.steps * 1e3, acts=acts, again=again,
                          losses=losses)
        print(f"{mode}: {rows[mode]['ms']:.1f} ms/step, activations {acts} bytes, "
              f"{again} forward ops again", flush=True)
    for mode in MODES[1:]:
        if rows[mode]["losses"] != rows["none"]["losses"]:
            sys.exit(f"recompute: error: the {mode} program's losses differ from the plain "
                     f"program's: {rows[mode]['losses']} vs {rows['none']['losses']}")

    base = rows["none"]
    print(f"\n## Activation recomputation, CPU, 1 rank ({datetime.date.today()})\n")
    print(f"Command: `/usr/bin/python3 bench/recompute.py --steps {args.steps} --warmup "
          f"{args.warmup} --threads {args.threads}` (GPT {json.dumps(args.config)}, "
          f"T = {T}, batch {args.batch}). Machine: {platform.machine()}, "
          f"{os.cpu_count()} cores ({platform.node()}).\n")
    print("| Plan | ms/step | vs none | activation bytes | vs none | forward ops run again |")
    print("|------|---------|---------|------------------|---------|-----------------------|")
    for mode in MODES:
        r = rows[mode]
        print(f"| `{mode}` | {r['ms']:.1f} | {r['ms'] / base['ms']:.2f}x | {r['acts']:,} | "
              f"{r['acts'] / base['acts']:.2f}x | {r['again']} |")
    print(f"\nExpected step FLOPs under `full`: (6 P + 12 L T d + 2 P_layers + 4 L T d) / "
          f"(6 P + 12 L T d) = {(step_flops + extra_flops) / step_flops:.2f}x "
          f"(P = {matmul_params:,}, P_layers = {layer_params:,}). Losses of all three "
          f"programs equal bit for bit.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
