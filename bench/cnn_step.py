#!/usr/bin/env python3
"""A convolutional network's training step on the CPU: carve against PyTorch eager.

    /usr/bin/python3 bench/cnn_step.py [--model vgg|resnet18] [--carve build/bin/carve]
        [--workdir build/bench-cnn] [--batch 32] [--steps 5] [--warmup 2] [--threads N]

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
"""

import argparse
import datetime
import os
import platform
import statistics
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


def eager(model, data, threads, warmup, steps, dtype=None):
    import torch

    torch.set_num_threads(threads)
    net = build(model).train()
    if dtype is not None:
        net = net.to(dtype)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.01)
    xs, ys = data["x"], data["y"]
    times, losses = [], []
    for k in range(warmup + steps):
        t = time.perf_counter()
        x = torch.from_numpy(xs[k % len(xs)])
        loss = net(x if dtype is None else x.to(dtype), torch.from_numpy(ys[k % len(ys)]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t)
        losses.append(float(loss))
    return statistics.median(times[warmup:]), losses


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["vgg", "resnet18"], default="vgg")
    ap.add_argument("--carve", default=os.path.join(ROOT, "build", "bin", "carve"))
    ap.add_argument("--workdir", default=os.path.join(ROOT, "build", "bench-cnn"))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    import torch
    from export import export_for_carve

    onnx_path = os.path.join(a.workdir, f"{a.model}.onnx")
    example = (torch.zeros(a.batch, 3, 32, 32), torch.zeros(a.batch, dtype=torch.int64))
    export_for_carve(build(a.model).train(), example, onnx_path, input_names=["x", "y"])
    flops = flops_per_step(build(a.model).train(), *example)
    n = a.warmup + a.steps
    rng = np.random.default_rng(0)
    data = {"x": rng.standard_normal((n, a.batch, 3, 32, 32)).astype(np.float32),
            "y": rng.integers(0, 10, (n, a.batch)).astype(np.int64)}
    data_path = os.path.join(a.workdir, f"{a.model}-images.safetensors")
    st.save(data_path, data)

    peak = gemm_peak(a.threads)
    t_torch, ref = eager(a.model, data, a.threads, a.warmup, a.steps)
    work = os.path.join(a.workdir, a.model)
    os.makedirs(work, exist_ok=True)
    t_carve, mine = carve_runs(a.carve, onnx_path, data_path, work, 1, a.threads, a.warmup,
                               a.steps)
    worst = max(abs(x - y) / abs(y) for x, y in zip(mine, ref))
    print(f"## CNN training step on the CPU ({datetime.date.today()}, {platform.node()}, "
          f"{a.threads} threads)\n")
    what = ("VGG-style CNN (5 conv 3x3" if a.model == "vgg" else
            "ResNet-18 (width 64, batch norm in training mode")
    print(f"{what}, 32x32 images), batch {a.batch}, AdamW; "
          f"{flops / 1e9:.2f} GFLOP per step; sgemm peak {peak:.1f} GFLOP/s "
          f"(torch.mm 2048^3, best of 5).\n")
    print("| Run | ms/step | GFLOP/s | % of sgemm peak | vs PyTorch |")
    print("|---|---|---|---|---|")
    for name, t in [("PyTorch eager", t_torch), ("carve (im2col)", t_carve)]:
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
    drift = lambda run: max(abs(x - y) / abs(y) for x, y in zip(run, exact))  # noqa: E731
    mine64, torch64 = drift(mine), drift(ref)
    print(f"Over the limit, so against PyTorch in float64: carve {mine64:.2e}, PyTorch's float32 "
          f"{torch64:.2e} (carve's limit: twice PyTorch's).")
    if mine64 > 2 * torch64:
        print(f"cnn_step: error: carve's losses differ from PyTorch's by {worst:.2e}, and from "
              f"float64's by {mine64:.2e}, more than twice PyTorch's float32 ({torch64:.2e})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
