#!/usr/bin/env python3
"""A convolutional network's training step on the CPU: carve against PyTorch eager.

    /usr/bin/python3 bench/cnn_step.py [--model vgg|resnet18] [--carve build/bin/carve]
        [--workdir build/bench-cnn] [--batch 32] [--steps 5] [--warmup 2] [--threads N]
        [--no-fuse-row]

`--model vgg` (the default) is a VGG-style CNN written with PyTorch's modules
(no batch norm): five 3x3 convolutions with padding 1 (3->32->32,
pool, ->64->64, pool, ->128), ReLU, nn.MaxPool2d(2), nn.AdaptiveAvgPool2d(1),
nn.Linear(128, 10), on 32x32 images. `--model resnet18` is ResNet-18 as
torchvision writes it (models/reference.py's ResNet18 at torchvision's width
64: 11.2M parameters, a 7x7 stride-2 stem, max pool, four stages of two
BasicBlocks with batch norm in training mode, strided 1x1 downsampling), 10
classes, on 32x32 images. carve trains the convolutions as im2col
(a gather of the windows, then a GEMM; compiler/frontend/LowerConvolutions.cpp),
PyTorch with its own convolution kernels (oneDNN on x86). Both run AdamW from
the same weights on the same batches, with `--threads` threads (default: all
cores) for OpenMP, OpenBLAS and PyTorch alike.

Prints a markdown section for docs/performance.md: ms/step, GFLOP/s (the
convolutions' and the head's multiply-adds, counted by forward hooks on the
PyTorch modules, times 2 x 3 for forward and backward; batch norm, pooling
and the optimizer are not counted),
percent of the measured sgemm peak, carve against PyTorch (PyTorch's step
time / carve's), and the largest relative loss difference (it must be below
1e-4, or the script exits 1).

On a GPU, in two halves (the GPU machine has no MLIR, so no carve compiler):

    /usr/bin/python3 bench/cnn_step.py --prepare-device --model M --workdir W [--batch 256]
    python3 bench/cnn_step.py --device --workdir W          # there, same checkout

--prepare-device exports the model and compiles it with `--target cuda` four
times, in float32 and with plan {"precision": "bf16"}, each with cuDNN's
convolutions (the default) and as im2col GEMMs (`--convolution carve`), and
keeps only the programs and init.safetensors' header (the weights are rebuilt
there). --device rebuilds the weights from seed 0 with that machine's PyTorch
and writes the images, runs the four programs (per-step times from their logs)
and PyTorch on the same
GPU from the same weights on the same batches: strict float32 (TF32 off: the
loss reference, the precision carve's float32 GEMMs compute in), PyTorch's
defaults with cudnn.benchmark (TF32 convolutions), and bf16 autocast. Prints
the section for docs/performance.md, with the GPU's float32 and bf16 GEMM
rates measured by torch.mm at 8192^3. carve float32 must be within 1e-4 of
strict float32 (or pass the float64 check below); carve bf16 within 5e-2 of
strict float32 (bf16 keeps 8 bits of mantissa: 3.9e-3 per rounding, and the
loss is a sum over many roundings through 20 layers; gpt2_cuda.py's bound).
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))
sys.path.insert(0, os.path.join(ROOT, "models"))
import st  # noqa: E402
from train_step import carve_runs, gemm_peak  # noqa: E402

LOSS_RTOL = 1e-4
BF16_LOSS_RTOL = 5e-2
CONVS = [(3, 32, 32), (32, 32, 32), (32, 64, 16), (64, 64, 16), (64, 128, 8)]  # C, O, H=W


def build(model):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    torch.manual_seed(0)
    if model == "resnet18":
        from reference import ResNet18
        return ResNet18(width=64)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.convs = nn.ModuleList(nn.Conv2d(c, o, 3, padding=1) for c, o, _ in CONVS)
            self.pool = nn.MaxPool2d(2)
            self.gap = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(128, 10)

        def forward(self, x, y):
            for k, conv in enumerate(self.convs):
                x = F.relu(conv(x))
                if k in (1, 3):
                    x = self.pool(x)
            return F.cross_entropy(self.fc(torch.flatten(self.gap(x), 1)), y)

    return Net()


def flops_per_step(net, x, y):
    """2 x 3 x the multiply-adds of every Conv2d and Linear in one forward."""
    import torch
    import torch.nn as nn

    macs = [0]

    def hook(m, inputs, out):
        if isinstance(m, nn.Conv2d):
            macs[0] += out.numel() * (m.in_channels // m.groups) * m.kernel_size[0] * m.kernel_size[1]
        else:
            macs[0] += out.numel() * m.in_features

    hooks = [m.register_forward_hook(hook) for m in net.modules()
             if isinstance(m, (nn.Conv2d, nn.Linear))]
    with torch.no_grad():
        net(x, y)
    for h in hooks:
        h.remove()
    return 3 * 2 * macs[0]


def eager(model, data, threads, warmup, steps, dtype=None, device="cpu", bf16=False,
          state=None):
    """(median seconds of the timed steps, losses of every step) of PyTorch
    eager: `dtype` the model's and the images' (None: float32), `bf16` under
    bf16 autocast (CUDA), `state` the initial weights (None: build()'s)."""
    import torch

    if device == "cpu":
        torch.set_num_threads(threads)
    net = build(model)
    if state is not None:
        net.load_state_dict(state)
    net = net.train().to(device)
    if dtype is not None:
        net = net.to(dtype)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.01)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    xs, ys = data["x"], data["y"]
    times, losses = [], []
    for k in range(warmup + steps):
        x = torch.from_numpy(xs[k % len(xs)]).to(device)
        y = torch.from_numpy(ys[k % len(ys)]).to(device)
        sync()
        t = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
            loss = net(x if dtype is None else x.to(dtype), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())  # waits for the step, as carve's does
        times.append(time.perf_counter() - t)
    return statistics.median(times[warmup:]), losses


def rel_worst(mine, ref):
    if len(mine) != len(ref):
        return float("inf")
    return max(abs(x - y) / abs(y) for x, y in zip(mine, ref))


def images(n, batch):
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((n, batch, 3, 32, 32)).astype(np.float32),
            "y": rng.integers(0, 10, (n, batch)).astype(np.int64)}


def model_label(model):
    return ("VGG-style CNN (5 conv 3x3" if model == "vgg" else
            "ResNet-18 (width 64, batch norm in training mode")


# --- On a GPU --------------------------------------------------------------------

PRECISIONS = {"fp32": {}, "bf16": {"precision": "bf16"}}
# The CUDA programs --prepare-device compiles: each precision with cuDNN's
# convolutions (the default) and as im2col GEMMs (--convolution carve), side by
# side in one run.
CUDA_PROGRAMS = {name + suffix: (plan, extra) for name, plan in PRECISIONS.items()
                 for suffix, extra in (("", []), (" im2col", ["--convolution", "carve"]))}


def prepare_device(a):
    """Here: the export and the four CUDA programs, without their weights."""
    import torch
    from export import export_for_carve
    from train_step import run_checked

    work = os.path.abspath(a.workdir)
    os.makedirs(work, exist_ok=True)
    onnx_path = os.path.join(work, f"{a.model}.onnx")
    example = (torch.zeros(a.batch, 3, 32, 32), torch.zeros(a.batch, dtype=torch.int64))
    export_for_carve(build(a.model).train(), example, onnx_path, input_names=["x", "y"])
    for name, (plan, extra) in CUDA_PROGRAMS.items():
        out = os.path.join(work, "carve-" + name.replace(" ", "-"))
        plan_path = out + ".plan.json"
        with open(plan_path, "w") as f:
            json.dump(plan, f)
        t = time.perf_counter()
        run_checked([a.carve, "compile", onnx_path, "--target", "cuda", "--plan", plan_path,
                     "-o", out] + extra)
        print(f"compiled {out} in {time.perf_counter() - t:.0f} s", flush=True)
        init = os.path.join(out, "init.safetensors")
        header, meta, _ = st.read_header(init)
        with open(os.path.join(out, "init.header.json"), "w") as f:
            json.dump(dict(header, __metadata__=meta), f)
        os.remove(init)
    os.remove(onnx_path)
    with open(os.path.join(work, "prepared.json"), "w") as f:
        json.dump({"model": a.model, "batch": a.batch, "steps": a.steps, "warmup": a.warmup}, f)
    print(f"then, on a machine with a GPU: python3 bench/cnn_step.py --device --workdir {work}")
    return 0


def write_init(out, state):
    """OUT/init.safetensors from `state` (a state_dict), in the tensors, order
    and metadata of the header --prepare-device kept."""
    try:
        st.save_like(os.path.join(out, "init.header.json"),
                     {k: v.detach().cpu().numpy() for k, v in state.items()},
                     os.path.join(out, "init.safetensors"))
    except (OSError, ValueError, st.SafetensorsError) as e:
        raise SystemExit(f"cnn_step: error: {out}: {e}")


def gpu_gemm_rates(torch, n=8192, reps=10):
    """TFLOP/s of torch.mm at n^3: float32 (TF32 off), TF32 and bf16."""
    rates = {}
    for name, dtype in [("fp32", torch.float32), ("tf32", torch.float32),
                        ("bf16", torch.bfloat16)]:
        torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
        a = torch.randn(n, n, device="cuda", dtype=dtype)
        b = torch.randn(n, n, device="cuda", dtype=dtype)
        torch.mm(a, b)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b)
        torch.cuda.synchronize()
        rates[name] = 2 * n**3 * reps / (time.perf_counter() - t) / 1e12
        del a, b
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.cuda.empty_cache()
    return rates


def device(a):
    """There: carve's four programs and PyTorch on the same GPU."""
    import torch

    work = os.path.abspath(a.workdir)
    try:
        with open(os.path.join(work, "prepared.json")) as f:
            p = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"cnn_step: error: {work}: {e} (prepare it with --prepare-device)")
    if not torch.cuda.is_available():
        raise SystemExit("cnn_step: error: PyTorch sees no GPU here (--device needs one)")
    model, batch, steps, warmup = p["model"], p["batch"], p["steps"], p["warmup"]
    n = warmup + steps
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    state = {k: v.clone() for k, v in build(model).state_dict().items()}
    example = (torch.zeros(batch, 3, 32, 32), torch.zeros(batch, dtype=torch.int64))
    flops = flops_per_step(build(model).train(), *example)
    data = images(n, batch)
    data_path = os.path.join(work, "images.safetensors")
    st.save(data_path, data)
    rates = gpu_gemm_rates(torch)
    rows, failures = [], []

    def row(name, t, losses, peak):
        rows.append({"run": name, "ms_per_step": t * 1e3, "tflops": flops / t / 1e12,
                     "peak": peak, "losses": losses})
        print(f"{name}: {t * 1e3:.2f} ms/step, losses {losses[0]:.5f} .. {losses[-1]:.5f}",
              flush=True)

    t, strict = eager(model, data, 1, warmup, steps, device="cuda", state=state)
    row("PyTorch eager, float32 (TF32 off)", t, strict, "fp32")
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = True
    t, losses = eager(model, data, 1, warmup, steps, device="cuda", state=state)
    row("PyTorch eager, defaults + cudnn.benchmark (TF32 convolutions)", t, losses, "tf32")
    t, losses = eager(model, data, 1, warmup, steps, device="cuda", bf16=True, state=state)
    row("PyTorch eager, bf16 autocast, cudnn.benchmark", t, losses, "bf16")
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.allow_tf32 = False
    for name in CUDA_PROGRAMS:
        out = os.path.join(work, "carve-" + name.replace(" ", "-"))
        write_init(out, state)
        log = os.path.join(work, "carve-" + name.replace(" ", "-") + ".jsonl")
        cmd = [os.path.join(out, "bin", "train"), "--steps", str(n), "--data", data_path,
               "--log", log, "--progress", "none"]
        print("$ " + " ".join(cmd), flush=True)
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
        if r.returncode != 0:
            failures.append(f"carve {name}: exit {r.returncode}: "
                            f"{(r.stderr or r.stdout).strip()[-2000:]}")
            continue
        with open(log) as f:
            records = [json.loads(line) for line in f if line.strip()]
        if len(records) != n:
            failures.append(f"carve {name}: {len(records)} steps logged, expected {n}")
            continue
        times = [r["time_s"] for r in records]
        row(f"carve, CUDA, {name}", statistics.median(times[warmup:]),
            [r["loss"] for r in records], name.split()[0])
    print(f"\n## CNN training step on one GPU ({datetime.date.today()}, "
          f"{torch.cuda.get_device_name()}, PyTorch {torch.__version__})\n")
    print(f"{model_label(model)}, 32x32 images), batch {batch}, AdamW, {warmup} warm-up and "
          f"{steps} timed steps (median); {flops / 1e9:.2f} GFLOP per step. torch.mm 8192^3: "
          f"float32 {rates['fp32']:.1f}, TF32 {rates['tf32']:.1f}, bf16 {rates['bf16']:.1f} "
          "TFLOP/s.\n")
    print("| Run | ms/step | TFLOP/s | % of the GEMM rate | vs PyTorch float32 | "
          "max loss rel diff vs float32 |")
    print("|---|---|---|---|---|---|")
    base = rows[0]["ms_per_step"]
    for r in rows:
        d = rel_worst(r["losses"], strict)
        r["loss_rel_diff"] = d
        print(f"| {r['run']} | {r['ms_per_step']:.2f} | {r['tflops']:.2f} | "
              f"{100 * r['tflops'] / rates[r['peak']]:.1f}% ({r['peak']}) | "
              f"{base / r['ms_per_step']:.2f}x | {d:.1e} |")
    for r in rows:
        if r["run"].startswith("carve, CUDA, bf16") and r["loss_rel_diff"] > BF16_LOSS_RTOL:
            failures.append(f"carve bf16: losses differ from PyTorch float32 by "
                            f"{r['loss_rel_diff']:.2e} (limit {BF16_LOSS_RTOL:.0e})")
        if r["run"].startswith("carve, CUDA, fp32") and r["loss_rel_diff"] > LOSS_RTOL:
            _, exact = eager(model, data, 1, warmup, steps, dtype=torch.float64,
                             device="cuda", state=state)
            mine64, torch64 = rel_worst(r["losses"], exact), rel_worst(strict, exact)
            print(f"carve float32 over {LOSS_RTOL:.0e}, so against PyTorch in float64: "
                  f"carve {mine64:.2e}, PyTorch float32 {torch64:.2e} (limit: twice PyTorch's)")
            if mine64 > 2 * torch64:
                failures.append(f"carve fp32: {r['loss_rel_diff']:.2e} from PyTorch float32 "
                                f"and {mine64:.2e} from float64, over twice PyTorch's "
                                f"{torch64:.2e}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": model, "batch": batch, "gpu": torch.cuda.get_device_name(),
                       "gemm_tflops": rates, "gflop_per_step": flops / 1e9, "rows": rows,
                       "failures": failures}, f, indent=1)
    for why in failures:
        print(f"cnn_step: error: {why}")
    return 1 if failures else 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["vgg", "resnet18"], default="vgg")
    ap.add_argument("--carve", default=os.path.join(ROOT, "build", "bin", "carve"))
    ap.add_argument("--workdir", default=os.path.join(ROOT, "build", "bench-cnn"))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--no-fuse-row", action="store_true",
                    help="also time the program compiled with --no-fuse (every op its own "
                         "kernel: no fused elementwise chains, the convolutions' input "
                         "gradients as matmul then gather_grad), in the same run")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--prepare-device", action="store_true",
                      help="compile the CUDA programs here, for --device on a GPU machine")
    mode.add_argument("--device", action="store_true",
                      help="run a --prepare-device workdir on this machine's GPU")
    ap.add_argument("--json", help="--device: write the results here too")
    ap.add_argument("--timeout", type=float, default=600, help="--device: per carve run (s)")
    a = ap.parse_args()
    if a.prepare_device:
        return prepare_device(a)
    if a.device:
        return device(a)
    os.makedirs(a.workdir, exist_ok=True)
    import torch
    from export import export_for_carve

    onnx_path = os.path.join(a.workdir, f"{a.model}.onnx")
    example = (torch.zeros(a.batch, 3, 32, 32), torch.zeros(a.batch, dtype=torch.int64))
    export_for_carve(build(a.model).train(), example, onnx_path, input_names=["x", "y"])
    flops = flops_per_step(build(a.model).train(), *example)
    n = a.warmup + a.steps
    data = images(n, a.batch)
    data_path = os.path.join(a.workdir, f"{a.model}-images.safetensors")
    st.save(data_path, data)

    peak = gemm_peak(a.threads)
    t_torch, ref = eager(a.model, data, a.threads, a.warmup, a.steps)
    work = os.path.join(a.workdir, a.model)
    os.makedirs(work, exist_ok=True)
    t_carve, mine = carve_runs(a.carve, onnx_path, data_path, work, 1, a.threads, a.warmup,
                               a.steps)
    rows = [("PyTorch eager", t_torch), ("carve (im2col)", t_carve)]
    if a.no_fuse_row:
        t_nofuse, unfused = carve_runs(a.carve, onnx_path, data_path, work, 1, a.threads,
                                       a.warmup, a.steps, fuse=False)
        rows.append(("carve, `--no-fuse`", t_nofuse))
        print(f"fused against --no-fuse: largest relative loss difference "
              f"{rel_worst(mine, unfused):.2e}", file=sys.stderr)
    worst = rel_worst(mine, ref)
    print(f"## CNN training step on the CPU ({datetime.date.today()}, {platform.node()}, "
          f"{a.threads} threads)\n")
    print(f"{model_label(a.model)}, 32x32 images), batch {a.batch}, AdamW; "
          f"{flops / 1e9:.2f} GFLOP per step; sgemm peak {peak:.1f} GFLOP/s "
          f"(torch.mm 2048^3, best of 5).\n")
    print("| Run | ms/step | GFLOP/s | % of sgemm peak | vs PyTorch |")
    print("|---|---|---|---|---|")
    for name, t in rows:
        print(f"| {name} | {t * 1e3:.1f} | {flops / t / 1e9:.1f} | {100 * flops / t / 1e9 / peak:.0f}% "
              f"| {t_torch / t:.2f}x |")
    print(f"\nLargest relative loss difference over {n} steps: {worst:.2e} (limit {LOSS_RTOL:.0e}).")
    if worst <= LOSS_RTOL:
        return 0
    # Some models amplify float32 rounding step by step (AdamW's first steps
    # move every weight by about lr whatever its gradient's size, so weights
    # whose gradient is rounding noise move either way): then PyTorch's own
    # float32 drifts from the exact (float64) run as far. carve passes when
    # it is no further from float64 than twice PyTorch's float32 is.
    _, exact = eager(a.model, data, a.threads, a.warmup, a.steps, dtype=torch.float64)
    mine64, torch64 = rel_worst(mine, exact), rel_worst(ref, exact)
    print(f"Over the limit, so against PyTorch in float64: carve {mine64:.2e}, PyTorch's float32 "
          f"{torch64:.2e} (carve's limit: twice PyTorch's).")
    if mine64 > 2 * torch64:
        print(f"cnn_step: error: carve's losses differ from PyTorch's by {worst:.2e}, and from "
              f"float64's by {mine64:.2e}, more than twice PyTorch's float32 ({torch64:.2e})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
