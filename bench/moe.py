#!/usr/bin/env python3
"""Mixture of experts on the CPU: the routed form at its bound against the dense
form, and expert parallelism's bytes and step time beside dp alone."""

# Run by hand, not a test:
#
#     /usr/bin/python3 bench/moe.py [--carve build/bin/carve] [--steps 20]
#         [--workdir build/bench-moe]
#
# The Mixtral-style decoder of models/reference.py at width 128, SwiGLU
# experts of 256, 8 experts top-2, 2 layers, 32 tokens a sample, batch 8:
#
# 1. The routed form (torch.where, index_add_; NonZero at its bound) and the
#    dense form (every expert on every token, einsum), each on 1 rank: step
#    time from `train`'s tokens/s. At its bound each routed expert computes
#    k * tokens rows, so both forms do E times the routed work (docs/moe.md).
# 2. The routed form under dp2 and dp2 x ep2 (2 ranks): tokens/s, parameter
#    elements per rank (train's start-up report), and the bytes each rank's
#    all-to-alls send per step, read from the generated exchanges' shapes
#    (dispatch and combine, forward and backward: 4 per layer).
#
# Timings on a shared 2-core machine are noisy: compare within one run.

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "models"))

CONFIG = {"n_layer": 2, "dim": 128, "hidden_dim": 256, "n_heads": 4, "n_kv_heads": 2,
          "vocab_size": 512, "num_experts": 8, "top_k": 2, "block_size": 32}
BATCH, SEQ = 8, 32


def run(cmd):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        sys.exit("`%s` exited %d:\n%s%s" % (" ".join(cmd), p.returncode, p.stdout[-2000:],
                                            p.stderr[-2000:]))
    return p.stdout + p.stderr


def export(form, path):
    import torch
    import reference
    from export import export_for_carve
    torch.manual_seed(0)
    net = reference.Mixtral(reference.MixtralConfig(form=form, **CONFIG))
    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ))
    export_for_carve(net, (ids, ids), path, input_names=["input_ids", "targets"])


def exchange_bytes(src_dir, programs):
    """Bytes one rank's all-to-alls send per step: each exchange's input,
    less the piece it keeps ((ep-1)/ep of it), over the step function only."""
    total = 0
    for p in programs:
        text = open(os.path.join(src_dir, p)).read()
        step = text[text.find("void step("):text.find("void evaluate(")]
        rank_total = 0
        for dims, parts in re.findall(r"allToAllSplit\(\*ctx\.epComm, \w+, \{([\d, ]+)\}, "
                                      r"Split\{\d+, 1, (\d+)\}", step):
            n = int(np.prod([int(d) for d in dims.split(",")]))
            rank_total += n * 4 * (int(parts) - 1) // int(parts)
        total = max(total, rank_total)
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--carve", default=os.path.join(ROOT, "build", "bin", "carve"))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--workdir", default=os.path.join(ROOT, "build", "bench-moe"))
    a = ap.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    w = a.workdir
    rng = np.random.default_rng(0)
    tokens = os.path.join(w, "tokens.bin")
    rng.integers(0, CONFIG["vocab_size"], 1 << 16).astype("<i4").tofile(tokens)
    rows = []
    for form in ["routed", "dense"]:
        path = os.path.join(w, form + ".onnx")
        export(form, path)
        plans = [("1 rank", None, 1)]
        if form == "routed":
            plans += [("dp2", {"dp": 2}, 2), ("dp2 x ep2", {"dp": 2, "ep": 2}, 2)]
        for name, plan, ranks in plans:
            out = os.path.join(w, form + "-" + name.replace(" ", ""))
            cmd = [a.carve, "compile", path, "-o", out, "--quiet"]
            if plan:
                with open(out + ".json", "w") as f:
                    json.dump(plan, f)
                cmd += ["--plan", out + ".json"]
            run(cmd)
            text = run([a.carve, "run", out, "-n", str(ranks), "--", "--steps", str(a.steps),
                        "--data", tokens, "--progress", "none"])
            tps = float(re.search(r"\(([\d.]+) tokens/s on average\)", text).group(1))
            elems = [int(x) for x in re.findall(r"parameters \d+ bytes \((\d+) elements\)", text)]
            progs = sorted(p for p in os.listdir(os.path.join(out, "src"))
                           if re.match(r"program\d+\.cpp$", p))
            xb = exchange_bytes(os.path.join(out, "src"), progs)
            rows.append((form, name, tps, max(elems), xb))
    print("## Mixture of experts, CPU (%s)\n" % datetime.date.today().isoformat())
    print("Machine: %s, %d cores; %s; batch %d x %d tokens, %d steps.\n"
          % (platform.machine(), os.cpu_count(), json.dumps(CONFIG), BATCH, SEQ, a.steps))
    print("| form | plan | tokens/s | parameter elements per rank | all-to-all bytes per rank per step |")
    print("|---|---|---|---|---|")
    for form, name, tps, el, xb in rows:
        print("| %s | %s | %.0f | %d | %d |" % (form, name, tps, el, xb))
    base = {r[1]: r[2] for r in rows if r[0] == "routed"}
    dense = [r[2] for r in rows if r[0] == "dense"][0]
    print("\nrouted / dense on 1 rank: %.2f; dp2 x ep2 / dp2: %.2f"
          % (base["1 rank"] / dense, base["dp2 x ep2"] / base["dp2"]))


if __name__ == "__main__":
    main()
