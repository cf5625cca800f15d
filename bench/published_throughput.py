#!/usr/bin/env python3
"""The planner's predicted step time against published Megatron-LM and DeepSpeed runs."""

# Run by hand, not a test:
#
#     /usr/bin/python3 bench/published_throughput.py [--carve build/bin/carve]
#         [--calibration FILE] [--markdown]
#
# For each published run below, `carve plan` prices the run's own
# configuration (the builtin GPT of its size, its tensor, pipeline and data
# parallel sizes, its recomputation, ZeRO stage and sequence parallelism,
# fixed with --fixed; the planner picks what the paper leaves open: the
# micro-batch size where unstated and the schedule) on A100-80GB nodes of 8,
# priced with the published mixed-precision storage (`--storage published`:
# 16-bit weights, gradients and collectives, as these runs had), and the
# script prints the predicted step time beside the published one, as
# teraFLOP/s per GPU by the paper's own FLOP count where the paper reports
# that, and the ratio predicted / published (above 1: the planner is
# optimistic). Nothing is run on a GPU; every published number is the
# paper's (sources in SOURCES).

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SOURCES = {
    "N21": "Narayanan et al., Efficient Large-Scale Language Model Training on GPU Clusters "
           "Using Megatron-LM (SC 2021), Table 1: weak scaling, full recomputation, "
           "interleaved schedule, fp16, s 2048, V 51200, A100-80GB (Selene)",
    "K22": "Korthikanti et al., Reducing Activation Recomputation in Large Transformer Models "
           "(2022), Tables 3 and 5: no data parallelism, s 2048, V 51200, interleaved with 3 "
           "virtual stages for 175B and 530B",
    "S22": "Smith et al., Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B "
           "(2022), Section 2.4 (read in secondary sources only): tp 8, pp 35, ZeRO-1, batch "
           "1920, s 2048",
}

# (source, label, layers, hidden, heads, tp, pp, gpus, batch, fixed extras,
#  published step time in seconds or None, published TFLOP/s per GPU or None)
N21 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
K22 = [  # label, heads, hidden, layers, tp, pp, gpus, batch, v, full (s), selective (s)
    ("22B", 64, 6144, 48, 8, 1, 8, 4, 1, 1.42, 1.10),
    ("175B", 96, 12288, 96, 8, 8, 64, 64, 3, 18.13, 13.75),
    ("530B", 128, 20480, 105, 8, 35, 280, 280, 3, 49.05, 37.83),
    ("1T", 160, 25600, 128, 8, 64, 512, 512, 1, 94.42, 71.49),
]
S22 = [  # gpus, step time (s), TFLOP/s per GPU
    (2240, 60.1, 126), (2800, 50.2, 121), (3360, 44.4, 113),
]
SEQ, VOCAB = 2048, 51200


def runs():
    out = []
    for p, a, h, l, t, pp, n, B, x in N21:
        out.append({"source": "N21", "label": "%gB" % p, "layers": l, "hidden": h, "heads": a,
                    "gpus": n, "batch": B,
                    "fixed": "tp=%d,pp=%d,dp=%d,recompute=full,zero=0,sequence_parallel=false,"
                             "precision=fp16" % (t, pp, n // (t * pp)),
                    "published_s": None, "published_tflops": x, "flops": "N21"})
    for label, a, h, l, t, pp, n, B, v, full, sel in K22:
        sched = ",schedule=interleaved,virtual_stages=%d" % v if v > 1 else ""
        for name, extra, ts in (("full", "recompute=full,sequence_parallel=false", full),
                                ("selective+sp", "recompute=selective,sequence_parallel=true",
                                 sel)):
            out.append({"source": "K22", "label": "%s %s" % (label, name), "layers": l,
                        "hidden": h, "heads": a, "gpus": n, "batch": B,
                        "fixed": "tp=%d,pp=%d,dp=%d,micro_batch_size=%d,zero=0,precision=bf16,%s%s"
                                 % (t, pp, n // (t * pp), 4 if label == "22B" else 1, extra,
                                    sched),
                        "published_s": ts, "published_tflops": None, "flops": "K22"})
    for n, ts, x in S22:
        out.append({"source": "S22", "label": "530B on %d" % n, "layers": 105, "hidden": 20480,
                    "heads": 128, "gpus": n, "batch": 1920,
                    "fixed": "tp=8,pp=35,dp=%d,recompute=full,zero=1,sequence_parallel=false,"
                             "precision=bf16" % (n // 280),
                    "published_s": ts, "published_tflops": x, "flops": "N21"})
    return out


def paper_flops(r):
    """The FLOPs per step the paper counts: Narayanan et al.'s
    96 B s l h^2 (1 + s/6h + V/16lh), which includes full recomputation's extra
    forward pass (MT-NLG's throughput is counted the same way); Korthikanti et
    al.'s model FLOPs 72 B l s h^2 (1 + s/6h + V/12hl), which does not."""
    B, l, h, s, V = r["batch"], r["layers"], r["hidden"], SEQ, VOCAB
    if r["flops"] == "N21":
        return 96.0 * B * s * l * h * h * (1 + s / (6.0 * h) + V / (16.0 * l * h))
    return 72.0 * B * l * s * h * h * (1 + s / (6.0 * h) + V / (12.0 * h * l))


def plan(carve, r, calibration, auto=False):
    """carve plan's (plan, prediction, fits) for the run's published plan, or
    with `auto` for the plan it chooses itself at the run's precision."""
    spec = "builtin:gpt:layers=%d,hidden=%d,heads=%d,seq=%d,vocab=%d" % (
        r["layers"], r["hidden"], r["heads"], SEQ, VOCAB)
    fixed = r["fixed"]
    if auto:
        fixed = ",".join(f for f in fixed.split(",") if f.startswith("precision="))
    cmd = [carve, "plan", spec, "--cluster", "a100-80gb:%dx8" % (r["gpus"] // 8),
           "--global-batch", str(r["batch"]), "--fixed", fixed, "--storage", "published",
           "--no-op-search", "--json"]
    if calibration:
        cmd += ["--calibration", calibration]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        rep = json.loads(p.stdout)
    except ValueError:
        raise SystemExit("carve plan failed for %s:\n%s" % (r["label"], p.stderr))
    if rep.get("fits"):
        return rep["plan"], rep["predicted"], True
    if "closest" not in rep:
        raise SystemExit("carve plan found no plan for %s:\n%s" % (r["label"], p.stderr))
    return rep["closest"]["plan"], rep["closest"]["predicted"], False


def describe(p):
    s = "dp%d tp%d pp%d" % (p["dp"], p["tp"], p["pp"])
    if p.get("virtual_stages"):
        s += " v%d" % p["virtual_stages"]
    s += " m%d" % p.get("num_micro_batches", 1)
    return s


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--carve", default=os.path.join(ROOT, "build", "bin", "carve"))
    ap.add_argument("--calibration", help="a calibration table for carve plan")
    ap.add_argument("--only", help="comma-separated sources (N21, K22, S22)")
    args = ap.parse_args()
    only = set(args.only.split(",")) if args.only else None
    # These runs reduced their gradients after the backward pass, not behind it:
    # Megatron-LM's default "local" DDP of 2021 all-reduces in train_step once
    # the backward is done, and DeepSpeed's overlap_comm defaults to false.
    # carve's programs overlap it bucket by bucket (the planner's default).
    cal = {}
    if args.calibration:
        with open(args.calibration) as f:
            cal = json.load(f)
    cal.setdefault("gradient_overlap", False)
    tmp = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump(cal, tmp)
    tmp.close()
    args.calibration = tmp.name
    print("date %s, machine %s (%s); carve plan --storage published on a100-80gb:Nx8" % (
        datetime.date.today(), platform.node(), platform.machine()))
    print()
    print("| source | run | plan (planner's micro-batches) | published step (s) | predicted "
          "step (s) | published TFLOP/s/GPU | predicted TFLOP/s/GPU | predicted / published "
          "throughput | predicted MFU | memory (GB) | automatic plan: predicted step (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    ratios = {}
    slower = []
    for r in runs():
        if only and r["source"] not in only:
            continue
        p, pred, fits = plan(args.carve, r, args.calibration)
        t = pred["step_time_s"]
        tflops = paper_flops(r) / t / r["gpus"] / 1e12
        pub_s = r["published_s"]
        if pub_s is None:
            pub_s = paper_flops(r) / (r["published_tflops"] * 1e12) / r["gpus"]
        ratio = pub_s / t
        ratios.setdefault(r["source"], []).append(ratio)
        ap_, apred, afits = plan(args.carve, r, args.calibration, auto=True)
        at = apred["step_time_s"]
        if not afits or at > t * (1 + 1e-9):
            slower.append(r["label"])
        print("| %s | %s | %s | %.2f | %.2f | %s | %.0f | %.2f | %.1f%% | %.1f%s | %.2f (%s) |" % (
            r["source"], r["label"], describe(p), pub_s, t,
            "%d" % r["published_tflops"] if r["published_tflops"] else "—", tflops, ratio,
            100 * pred["mfu"], pred["memory_per_device"]["total"] / 1e9,
            "" if fits else " (does not fit)", at, describe(ap_)))
        sys.stdout.flush()
    print()
    print("the automatic plan is predicted no slower than the published plan: %s" % (
        "every run" if not slower else "not for " + ", ".join(slower)))
    for src, rs in ratios.items():
        print("%s: predicted / published throughput, mean %.2f, range %.2f-%.2f over %d runs"
              % (src, sum(rs) / len(rs), min(rs), max(rs), len(rs)))
    print()
    for key, text in SOURCES.items():
        if not only or key in only:
            print("%s: %s" % (key, text))


if __name__ == "__main__":
    main()
