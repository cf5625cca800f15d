#!/usr/bin/env python3
"""Times carve's compiled GPT step against PyTorch eager (1 rank) and DDP with gloo (dp=2)."""

# Run by hand, not a test:
#
#     /usr/bin/python3 bench/train_step.py [--carve build/bin/carve] [--workdir build/bench]
#
# 1. Exports a GPT (default 4 layers, width 256, 4 heads, vocab 8192, T = 128,
#    batch 8: 5.3 M parameters) with models/export.py and writes a token file.
# 2. Measures the machine's float32 GEMM peak: torch.mm of 2048 x 2048 at the
#    benchmark's thread count, best of several repetitions.
# 3. PyTorch eager, one process: the reference module with the exported
#    weights, AdamW (PyTorch defaults), the same batches as `train --data`;
#    median of the timed steps after warm-up.
# 4. PyTorch DDP, gloo, 2 processes (torch.multiprocessing), each with half of
#    the global batch, the same threads per process.
# 5. carve: `carve compile` for 1 rank (also with --no-fuse, whose losses must
#    equal the fused program's bit for bit) and for {"dp": 2}; each program runs
#    WARMUP and WARMUP + STEPS steps, and the step time is the difference of
#    the wall times over STEPS, which removes start-up and loading.
#
# Correctness is part of the benchmark: every carve run's losses are compared
# with PyTorch's for the same steps (limit LOSS_RTOL, as in
# tests/e2e/train_vs_torch.py), and the script exits non-zero when they differ.
#
# FLOPs per step = 6 * P * tokens + 12 * L * T * d * tokens, where P counts
# the parameters that take part in matrix products (all but the position
# table; the tied token table counts once, as the lm head), tokens = B * T,
# and the second term is attention's QK^T and AV (forward 4*T*d per token and
# layer, backward twice that; the causal mask is not exploited).

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))
sys.path.insert(0, os.path.join(ROOT, "models"))

DEFAULT_CONFIG = {"n_layer": 4, "n_embd": 256, "n_head": 4, "vocab_size": 8192}
LOSS_RTOL = 1e-4


def thread_env(threads):
    """Environment that pins OpenMP and OpenBLAS pools to `threads`."""
    n = str(threads)
    return {"OMP_NUM_THREADS": n, "OPENBLAS_NUM_THREADS": n, "MKL_NUM_THREADS": n}


def run_output(cmd, env=None, timeout=1800):
    """Runs `cmd`; exits naming the benchmark script when it fails. Returns
    (wall seconds, stdout + stderr)."""
    who = os.path.splitext(os.path.basename(sys.argv[0]))[0]
    start = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                           env=dict(os.environ, **(env or {})))
    except (OSError, subprocess.TimeoutExpired) as e:
        sys.exit(f"{who}: error: {' '.join(cmd)}: {e}")
    secs = time.perf_counter() - start
    if p.returncode != 0:
        sys.exit(f"{who}: error: {' '.join(cmd)} failed (exit {p.returncode}):\n"
                 f"{(p.stderr or p.stdout).strip()[-2000:]}")
    return secs, p.stdout + p.stderr


def run_checked(cmd, env=None, timeout=1800):
    return run_output(cmd, env, timeout)[0]


# --- Measurements --------------------------------------------------------------

def gemm_peak(threads, n=2048, reps=5, inner=3):
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    c = torch.empty(n, n)
    torch.mm(a, b, out=c)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(inner):
            torch.mm(a, b, out=c)
        best = min(best, (time.perf_counter() - t) / inner)
    return 2 * n**3 / best / 1e9


def flops_per_step(params, cfg, batch, seq):
    tokens = batch * seq
    matmul_params = params - cfg["block_size"] * cfg["n_embd"]
    return (6 * matmul_params * tokens
            + 12 * cfg["n_layer"] * seq * cfg["n_embd"] * tokens)


def eager(onnx_path, config, data, threads, warmup, steps):
    """(median step seconds, losses of every step) of PyTorch eager."""
    import torch
    import torch_ref

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model, inputs = torch_ref.build_model(onnx_path, "gpt", config)
    batches = torch_ref.Batches(data, inputs)
    opt = torch.optim.AdamW(model.parameters())
    times, losses = [], []
    for k in range(warmup + steps):
        t = time.perf_counter()
        x, y = (torch.from_numpy(a) for a in batches(k))
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - t)
    return statistics.median(times[warmup:]), losses


def _ddp_worker(rank, world, onnx_path, config, data, threads, warmup, steps, init, result):
    import torch
    import torch.distributed as dist
    import torch_ref

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    model, inputs = torch_ref.build_model(onnx_path, "gpt", config)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    batches = torch_ref.Batches(data, inputs)
    opt = torch.optim.AdamW(ddp.parameters())
    per_rank = batches.batch // world
    times, losses = [], []
    for k in range(warmup + steps):
        dist.barrier()
        t = time.perf_counter()
        x, y = batches(k)
        sl = slice(rank * per_rank, (rank + 1) * per_rank)
        x, y = torch.from_numpy(x[sl]), torch.from_numpy(y[sl])
        opt.zero_grad(set_to_none=True)
        loss = ddp(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - t)
    # The global loss is the mean of the ranks' (equal-sized) batch means.
    mean = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(mean)
    if rank == 0:
        result.put((statistics.median(times[warmup:]), (mean / world).tolist()))
    dist.destroy_process_group()


def ddp(onnx_path, config, data, threads, warmup, steps, world=2):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    result = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init = "file://" + os.path.join(tmp, "rendezvous")
        mp.spawn(_ddp_worker, nprocs=world, join=True,
                 args=(world, onnx_path, config, data, threads, warmup, steps, init, result))
    return result.get()


def carve_runs(carve, onnx_path, data, work, dp, threads, warmup, steps, fuse=True):
    """(step seconds, losses of every step) of a compiled program (`fuse`
    False: compiled with --no-fuse, every elementwise op its own kernel)."""
    out = os.path.join(work, f"carve-dp{dp}" + ("" if fuse else "-nofuse"))
    cmd = [carve, "compile", onnx_path, "-o", out] + ([] if fuse else ["--no-fuse"])
    if dp > 1:
        plan = out + ".plan.json"
        with open(plan, "w") as f:
            json.dump({"dp": dp}, f)
        cmd[3:3] = ["--plan", plan]
    run_checked(cmd)
    walls = []
    for n in (warmup, warmup + steps):
        log = out + f"-{n}steps.jsonl"
        args = ["--steps", str(n), "--data", data, "--log", log, "--quiet"]
        launch = ([os.path.join(out, "bin", "train")] if dp == 1
                  else [carve, "run", out, "-n", str(dp), "--"])
        walls.append(run_checked(launch + args, env=thread_env(threads)))
    with open(log) as f:
        losses = [json.loads(line)["loss"] for line in f if line.strip()]
    return (walls[1] - walls[0]) / steps, losses


def compare(name, mine, ref):
    if len(mine) != len(ref):
        return f"{name}: {len(mine)} losses, PyTorch has {len(ref)}", float("inf")
    worst = max(abs(a - b) / abs(b) for a, b in zip(mine, ref))
    return (f"{name}: losses differ from PyTorch by {worst:.2e} relative "
            f"(limit {LOSS_RTOL:.0e})" if worst > LOSS_RTOL else None), worst


# --- Main ----------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--carve", default=os.path.join(ROOT, "build", "bin", "carve"))
    ap.add_argument("--workdir", default=os.path.join(ROOT, "build", "bench"))
    ap.add_argument("--config", type=json.loads, default=DEFAULT_CONFIG, metavar="JSON",
                    help=f"GPT config overrides (default {json.dumps(DEFAULT_CONFIG)})")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10, help="timed steps (10)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (2)")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                    help="threads per rank/process (default: half the cores, so "
                         "that dp=2 fills the machine)")
    ap.add_argument("--torch-only", action="store_true",
                    help="skip carve (measure PyTorch and the GEMM peak only)")
    args = ap.parse_args()

    # Thread pools read these when torch is first imported, below.
    os.environ.update(thread_env(args.threads))
    import data_gen
    import torch
    import reference

    carve = os.path.abspath(args.carve)
    if not args.torch_only and not os.access(carve, os.X_OK):
        sys.exit(f"train_step: error: {carve} is missing or not executable "
                 "(or pass --torch-only)")
    work = os.path.abspath(args.workdir)
    os.makedirs(work, exist_ok=True)

    print(f"exporting gpt {json.dumps(args.config)}, batch {args.batch}, seq {args.seq}")
    run_checked([sys.executable, os.path.join(ROOT, "models", "export.py"), "gpt",
                 "--out", work, "--batch", str(args.batch), "--seq", str(args.seq),
                 "--config", json.dumps(args.config)])
    onnx_path = os.path.join(work, "gpt.onnx")
    model, _, _ = reference.build("gpt", batch=args.batch, seq=args.seq,
                                  config=args.config)
    cfg = dict(vars(model.cfg))
    params = sum(p.numel() for p in model.parameters())
    del model
    data = os.path.join(work, "tokens.i32")
    need = (args.warmup + args.steps) * args.batch * args.seq + args.seq + 2
    data_gen.write_tokens(data, data_gen.make_tokens(need, cfg["vocab_size"]))
    flops = flops_per_step(params, cfg, args.batch, args.seq)

    peak = gemm_peak(args.threads)
    print(f"sgemm 2048^3 peak at {args.threads} thread(s): {peak:.1f} GFLOP/s")
    rows, failures = [], []

    t_eager, l_eager = eager(onnx_path, args.config, data, args.threads, args.warmup,
                             args.steps)
    print(f"PyTorch eager: {t_eager * 1e3:.1f} ms/step")
    t_ddp, l_ddp = ddp(onnx_path, args.config, data, args.threads, args.warmup, args.steps)
    print(f"PyTorch DDP gloo x2: {t_ddp * 1e3:.1f} ms/step")
    # A check of the harness itself: DDP sees the same global batches.
    why, _ = compare("PyTorch DDP against eager", l_ddp, l_eager)
    if why:
        failures.append(why)
    carve1 = carve2 = None
    if not args.torch_only:
        carve1 = carve_runs(carve, onnx_path, data, work, 1, args.threads, args.warmup,
                            args.steps)
        print(f"carve 1 rank: {carve1[0] * 1e3:.1f} ms/step")
        carve1n = carve_runs(carve, onnx_path, data, work, 1, args.threads, args.warmup,
                             args.steps, fuse=False)
        print(f"carve 1 rank, --no-fuse: {carve1n[0] * 1e3:.1f} ms/step")
        if carve1n[1] != carve1[1]:
            failures.append("carve --no-fuse: losses differ from the fused program's "
                            "(they must be bitwise equal)")
        carve2 = carve_runs(carve, onnx_path, data, work, 2, args.threads, args.warmup,
                            args.steps)
        print(f"carve dp=2: {carve2[0] * 1e3:.1f} ms/step")

    def row(name, threads, secs, ranks, base, losses, ref):
        agree = "-"
        if losses is not None:
            why, worst = compare(name, losses, ref)
            agree = f"{worst:.1e}"
            if why:
                failures.append(why)
        rows.append((name, threads, f"{secs * 1e3:.1f}", f"{flops / secs / 1e9:.1f}",
                     f"{100 * flops / secs / 1e9 / (peak * ranks):.0f}%",
                     f"{base / secs:.2f}x" if base else "1.00x", agree))

    if carve1:
        row("carve, 1 rank", str(args.threads), carve1[0], 1, t_eager, carve1[1], l_eager)
        row("carve, 1 rank, `--no-fuse`", str(args.threads), carve1n[0], 1, t_eager,
            carve1n[1], l_eager)
    row("PyTorch eager", str(args.threads), t_eager, 1, None, None, None)
    if carve2:
        row("carve, dp=2 (`carve run -n 2`)", f"2x{args.threads}", carve2[0], 2, t_ddp,
            carve2[1], l_ddp)
    row("PyTorch DDP, gloo, 2 processes", f"2x{args.threads}", t_ddp, 2, None, None, None)

    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print()
    print(f"### GPT {cfg['n_layer']} layers, width {cfg['n_embd']}, {cfg['n_head']} heads, "
          f"vocab {cfg['vocab_size']}, T = {args.seq}, batch {args.batch} "
          f"({params / 1e6:.1f} M parameters)")
    print()
    print(f"{datetime.date.today()}, {cpu}, {os.cpu_count()} cores, PyTorch "
          f"{torch.__version__}; median of {args.steps} steps after {args.warmup} "
          f"warm-up (carve: wall-time difference of {args.warmup} and "
          f"{args.warmup + args.steps} steps).")
    print()
    print("| Run | Threads | ms/step | GFLOP/s | % of sgemm peak | Speed vs PyTorch "
          "| Max loss rel diff |")
    print("|-----|---------|---------|---------|-----------------|------------------"
          "|-------------------|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print()
    print(f"FLOPs per step = 6 P tokens + 12 L T d tokens = {flops / 1e9:.1f} GFLOP "
          f"(P = {params - cfg['block_size'] * cfg['n_embd']:,} parameters in matrix "
          f"products, tokens = {args.batch * args.seq}). sgemm peak: torch.mm 2048^3, "
          f"best of 5, {peak:.1f} GFLOP/s per {args.threads}-thread rank; the dp=2 rows "
          f"are against twice that. Speed vs PyTorch: PyTorch's step time / this one's; "
          f"max loss rel diff: against PyTorch eager (1 rank) or DDP (dp=2), same steps.")
    if args.torch_only:
        print("\n(--torch-only: carve rows not measured)")
    for f in failures:
        print(f"FAIL: {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
