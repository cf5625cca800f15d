#!/usr/bin/env python3
"""Exports the reference models for the test suite: every model at opsets 13-17,
plus dynamic-batch and external-data variants. Runs once per `ctest` run."""
import argparse
import os
import subprocess
import sys
import time

VARIANTS = [(f"opset{n}", ["all", "--opset", str(n)]) for n in range(13, 18)] + [
    ("opset17", ["gpt_tanh"]),
    ("opset17", ["gpt_untied"]),
    ("dynamic", ["gpt", "--dynamic-batch"]),
    ("dynamic", ["llama", "--dynamic-batch"]),
    ("external", ["mlp", "--external-data"]),
    ("external", ["gpt", "--external-data"]),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--export", required=True, help="models/export.py")
    ap.add_argument("--out", required=True, help="output folder")
    args = ap.parse_args()
    start = time.time()
    for sub, argv in VARIANTS:
        out = os.path.join(args.out, sub)
        os.makedirs(out, exist_ok=True)
        cmd = [sys.executable, args.export, *argv, "--out", out]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            print(f"FAILED: {' '.join(cmd)}\n{r.stdout}{r.stderr}")
            return 1
        print(f"exported {' '.join(argv)} -> {out}")
    print(f"exported all reference models in {time.time() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
