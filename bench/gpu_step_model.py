#!/usr/bin/env python3
"""carve's GPU cost model, run on the CPU: predicted step times of carve's own CUDA programs.

    /usr/bin/python3 bench/gpu_step_model.py [--gpu h100|h200] [--carve build/bin/carve]
        [--workdir build/bench-gpu-model] [--no-cnn] [--json FILE] [--top N]

1. Compiles GPT-2 small (builtin:gpt, 12 layers, width 768, 12 heads, T = 1024,
   vocab 50304, batch 8, GPT-2's tanh GELU; the model bench/gpt2_cuda.py exports) for
   the CUDA target
   with the plan {"precision": "bf16"}, without building or weights, with
   `--gpu-model`: the lowered program's launches, FLOPs and bytes per kernel, and the
   predicted time per kernel class (compiler/lower/GpuCost.cpp, docs/gpu-model.md).
   Prints `predicted ms per step: X` for --gpu, one line per kernel class, and the
   --top N costliest calls (op, kernel, model node; the layers' alike together).
2. Compiles every program of the recorded GPU runs below (GPT-2 small on both GPUs;
   ResNet-18 and the VGG-style CNN of bench/cnn_step.py at batch 256, fp32 and bf16,
   exported here with PyTorch unless --no-cnn) and prints each run's prediction
   against its measured step and the line
   `calibration: max error E% over N recorded runs`.

Nothing runs on a GPU: the measured times are the runs recorded in
docs/performance.md (device, date, commit there). Every program has changed since its
run (the convolutions' windows gathered inside their GEMMs, 2026-12-02; attention's
backward from the forward's saved statistics, 2026-12-06): each row compares today's
program with the measured one, and says what changed. The GPT-2 runs ran carve's own
attention kernel, so their rows price today's program compiled with `--attention carve`,
and the CNN runs ran their convolutions as im2col GEMMs, so theirs compile with
`--convolution carve` (the default, cuDNN's convolutions, is printed beside them);
the headline prediction is the default program, whose attention is cuDNN's fused flash
attention priced at published cuDNN rates (docs/gpu-model.md), not yet a measurement.
The recorded GPT-2 runs' model had the erf GELU (bench/gpt2_cuda.py's default until
2026-12-07), which their rows keep; the headline's has GPT-2's own tanh GELU, whose
gradient cuBLASLt's DGELU epilogue computes (matmul16_dgelu).

Exits 1 when a compile fails or the model leaves calls of these programs unpriced.
"""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "models"))

GPT2_SMALL = "builtin:gpt:layers=12,hidden=768,heads=12,seq=1024,vocab=50304,batch=8,gelu_tanh=1"
# The model of the recorded GPT-2 runs: the same with the erf GELU.
GPT2_SMALL_ERF = "builtin:gpt:layers=12,hidden=768,heads=12,seq=1024,vocab=50304,batch=8"
# A Llama-style model of GPT-2 small's size (RMSNorm, rotary embeddings,
# grouped-query attention with 4 key/value heads, SwiGLU), the second model
# of the GPU issues' benchmarks; no run of it is recorded yet.
LLAMA_SMALL = ("builtin:llama:layers=12,hidden=768,heads=12,kv_heads=4,ffn=2048,seq=1024,"
               "vocab=32000,batch=8")

# What changed in a program since its run (the row compares today's program with it).
# GPT-2's rows compile today's program with --attention carve, as the runs had it: the
# headline prediction (cuDNN's fused flash attention) is priced from published cuDNN
# rates that no carve run has measured yet.
ATTENTION_STATS = ("since: the attention backward reads the forward's saved log-sum-exp instead of "
                   "running the forward again, matmuls read 16-bit tensors as stored, AdamW "
                   "writes the 16-bit parameter copies, AdamW and the gradient norm as "
                   "multi-tensor launches (2026-12-06); each matmul operand rounded once, "
                   "roundings done by the copies, logits and gradients written in 16 bits, "
                   "fused chains writing their copies (2026-12-06, later); norms, GELU's "
                   "gradient, bias adds, fused chains and embeddings reading 16-bit tensors, "
                   "16-bit copies written by the ops that write the values (norms, transposes, "
                   "gradients), a split's gradient as one concat (2026-12-06, eighth session); "
                   "q, k and v's slices read in place by their transposes, cuDNN writing dq, dk, dv and "
                   "reading dy in place (2026-12-06, ninth); the norms' gradients adding the "
                   "residual's gradient, column reductions in one launch (2026-12-07, tenth); "
                   "GELU's output and q, k, v never stored in f32, cuDNN writing O, dq, dk, dv "
                   "in 16 bits in place and reading o and dy there (2026-12-07, eleventh); "
                   "q, k and v read by cuDNN in place in the QKV projection's 16-bit copy, "
                   "its bias and the MLP's added by cuBLASLt's epilogue "
                   "(2026-12-07, twelfth)")
GATHERED = ("since: the convolutions' windows are gathered inside their GEMMs (2026-12-02), "
            "AdamW and the gradient norm as multi-tensor launches (2026-12-06), and under bf16 "
            "the 16-bit operand and copy changes and 16-bit reads (2026-12-06, later)")

# The measured steps (docs/performance.md): unprofiled, median or mean of the timed
# steps, carve's CUDA program as it was at the run's commit.
RECORDED = [
    {"model": "gpt2", "precision": "bf16", "gpu": "h200", "ms": 202.4,
     "run": "2026-11-27, H200, bench/gpt2_cuda.py (First numbers: one NVIDIA H200)",
     "changed": ATTENTION_STATS},
    {"model": "gpt2", "precision": "bf16", "gpu": "h100", "ms": 204.7,
     "run": "2026-11-28, H100, commit 9e47ef0, bench/gpt2_cuda.py", "changed": ATTENTION_STATS},
    {"model": "resnet18", "precision": "fp32", "gpu": "h200", "ms": 10.12,
     "run": "2026-11-28, H200, run 4 (d06863b), bench/cnn_step.py", "changed": GATHERED},
    {"model": "resnet18", "precision": "bf16", "gpu": "h200", "ms": 11.84,
     "run": "2026-11-28, H200, run 3 (ac68273), bench/cnn_step.py", "changed": GATHERED},
    {"model": "vgg", "precision": "fp32", "gpu": "h200", "ms": 5.49,
     "run": "2026-11-28, H200, run 4 (d06863b), bench/cnn_step.py", "changed": GATHERED},
    {"model": "vgg", "precision": "bf16", "gpu": "h200", "ms": 6.61,
     "run": "2026-11-28, H200, run 3 (ac68273), bench/cnn_step.py", "changed": GATHERED},
]
# Left out: the H100's CNN runs of 2026-11-28 (57.35 and 45.86 ms) ran before the
# general reduction was rewritten the same day (ad16668); no program like theirs is
# compiled any more.


def compile_model(carve, model, plan, workdir, name, extra=()):
    """`carve compile MODEL --target cuda --no-build --no-weights --gpu-model`: its report."""
    out = os.path.join(workdir, name)
    plan_path = out + ".plan.json"
    report = out + ".gpu.json"
    with open(plan_path, "w") as f:
        json.dump(plan, f)
    cmd = [carve, "compile", model, "--target", "cuda", "--plan", plan_path, "--no-build",
           "--no-weights", "--quiet", "-o", out, "--gpu-model", report] + list(extra)
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        raise SystemExit("gpu_step_model: %s failed:\n%s%s" % (" ".join(cmd), p.stdout, p.stderr))
    with open(report) as f:
        r = json.load(f)
    if r["unpriced"]:
        raise SystemExit("gpu_step_model: %s: calls the model does not price: %s"
                         % (name, "; ".join(r["unpriced"])))
    return r


def export_cnn(model, workdir):
    """bench/cnn_step.py's model at batch 256 on 32x32 images, exported as it does."""
    import torch
    from cnn_step import build
    from export import export_for_carve

    path = os.path.join(workdir, model + ".onnx")
    if not os.path.exists(path):
        example = (torch.zeros(256, 3, 32, 32), torch.zeros(256, dtype=torch.int64))
        export_for_carve(build(model).train(), example, path, input_names=["x", "y"])
    return path


def costliest_calls(report, gpu, top):
    """The report's calls grouped by (op, kernel, model node with layer numbers as *),
    the `top` costliest on `gpu` first."""
    import re
    groups = {}
    for c in report.get("calls", []):
        node = re.sub(r"(?<=[./])\d+(?=[./])", "*", c["node"])
        g = groups.setdefault((c["op"] or "(step)", c["kernel"], node),
                              {"us": 0.0, "launches": 0, "mb": 0.0})
        g["us"] += c["us"][gpu]
        g["launches"] += c["launches"]
        g["mb"] += c["mb"]
    return sorted(groups.items(), key=lambda kv: -kv[1]["us"])[:top]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", choices=["h100", "h200"], default="h100")
    ap.add_argument("--carve", default=os.path.join(ROOT, "build", "bin", "carve"))
    ap.add_argument("--workdir", default=os.path.join(ROOT, "build", "bench-gpu-model"))
    ap.add_argument("--no-cnn", action="store_true",
                    help="only GPT-2's runs (no PyTorch needed)")
    ap.add_argument("--json", help="write the predictions and the calibration here")
    ap.add_argument("--top", type=int, default=15, metavar="N",
                    help="list the N costliest calls of GPT-2's step (by op, kernel and model "
                         "node, the layers' alike taken together; 0: none)")
    a = ap.parse_args()
    os.makedirs(a.workdir, exist_ok=True)

    plans = {"fp32": {}, "bf16": {"precision": "bf16"}}
    now = compile_model(a.carve, GPT2_SMALL, plans["bf16"], a.workdir, "gpt2-bf16")
    # The recorded GPT-2 runs ran carve's own attention kernel: the calibration
    # compares them with today's program built the same way (--attention carve).
    reports = {("gpt2", "bf16"): compile_model(a.carve, GPT2_SMALL_ERF, plans["bf16"], a.workdir,
                                               "gpt2-bf16-carve-attention",
                                               ["--attention", "carve"])}
    # The recorded CNN runs ran the convolutions as im2col GEMMs: their rows
    # compile today's program that way (--convolution carve); the default
    # (cuDNN's convolutions, priced at carve's GEMM rates: not yet measured)
    # is printed beside them.
    cudnn_cnn = {}
    if not a.no_cnn:
        for model in ("resnet18", "vgg"):
            onnx = export_cnn(model, a.workdir)
            for prec in ("fp32", "bf16"):
                reports[(model, prec)] = compile_model(a.carve, onnx, plans[prec], a.workdir,
                                                       "%s-%s-im2col" % (model, prec),
                                                       ["--convolution", "carve"])
                cudnn_cnn[(model, prec)] = compile_model(a.carve, onnx, plans[prec], a.workdir,
                                                         "%s-%s" % (model, prec))

    g = now["predictions"][a.gpu]
    print("GPT-2 small (124M, B = 8, T = 1024), bf16, one %s (%s), carve's CUDA program as "
          "compiled now:" % (a.gpu.upper(), g["device"]))
    print("predicted ms per step: %.1f" % g["ms"])
    print("launches per step: %d" % g["launches"])
    for cls, v in g["classes"].items():
        if v["launches"] or v["ms"]:
            print("  %-14s %8.2f ms  %5.1f%%  %5d launches  %9.1f GFLOP  %9.1f MB"
                  % (cls, v["ms"], 100 * v["ms"] / g["ms"], v["launches"], v["gflop"], v["mb"]))
    llama = compile_model(a.carve, LLAMA_SMALL, plans["bf16"], a.workdir, "llama-bf16")
    gl = llama["predictions"][a.gpu]
    print("Llama-style (12 layers, width 768, 12 heads, 4 key/value heads, SwiGLU 2048, "
          "T = 1024, B = 8, vocab 32000), bf16: predicted %.1f ms per step, %d launches"
          % (gl["ms"], gl["launches"]))
    for (model, prec), r in sorted(cudnn_cnn.items()):
        im2col = reports[(model, prec)]["predictions"][a.gpu]
        p = r["predictions"][a.gpu]
        print("%s %s (B = 256, 32x32), convolutions through cuDNN: predicted %.2f ms per step, "
              "%d launches (as im2col GEMMs: %.2f ms, %d launches)"
              % ("ResNet-18" if model == "resnet18" else "VGG-style CNN", prec, p["ms"],
                 p["launches"], im2col["ms"], im2col["launches"]))
    if a.top > 0:
        print()
        print("the %d costliest calls (the 12 layers' alike together, node h.* for h.0 .. h.11):"
              % a.top)
        for key, v in costliest_calls(now, a.gpu, a.top):
            print("  %8.2f ms  %4d launches  %8.1f MB  %-26s %-30s %s"
                  % (v["us"] / 1e3, v["launches"], v["mb"], key[0], key[1], key[2]))

    print()
    print("| Recorded run | measured ms | predicted ms | error |")
    print("|---|---|---|---|")
    errors = []
    rows = []
    for r in RECORDED:
        rep = reports.get((r["model"], r["precision"]))
        if rep is None:
            continue
        pred = rep["predictions"][r["gpu"]]["ms"]
        err = (pred - r["ms"]) / r["ms"]
        errors.append(abs(err))
        note = " (%s)" % r["changed"] if r.get("changed") else ""
        print("| %s %s, %s: %s%s | %.2f | %.2f | %+.1f%% |"
              % (r["model"], r["precision"], r["gpu"].upper(), r["run"], note, r["ms"], pred,
                 100 * err))
        rows.append(dict(r, predicted_ms=pred, error=err))
    print()
    print("calibration: max error %.1f%% over %d recorded runs" % (100 * max(errors), len(errors)))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"gpu": a.gpu, "gpt2_small_bf16": g, "llama_small_bf16": gl, "runs": rows,
                       "max_error": max(errors)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
