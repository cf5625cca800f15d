#!/usr/bin/env python3
"""Checks every step of compiled MLP/GPT training against PyTorch, and dp=2/4 against dp=1."""

# What must hold (the acceptance criteria of the compiled training step):
#
# 1. Against PyTorch (tests/e2e/torch_ref.py, float32, the same initial
#    weights, data, optimizer, schedule and clipping): the MLP and the GPT,
#    20 AdamW steps with PyTorch's defaults; the MLP, 20 SGD steps with
#    momentum; the GPT once more with weight decay, gradient clipping and a
#    warmup + cosine schedule, reading uint16 tokens. Every step's loss within
#    LOSS_RTOL of PyTorch's, the logged learning rate within LR_RTOL, and the
#    final weights within WEIGHT_RTOL (max over tensors of ||delta|| / ||w||,
#    `train --save DIR`'s DIR/model.safetensors against the oracle's).
# 2. Data parallel: the MLP (AdamW and SGD) and the scheduled, clipped GPT
#    compiled again with plans {"dp": 2} and {"dp": 4} and launched with
#    `carve run OUT -n N`: every step's loss within DP_RTOL of the single-rank
#    program's.
# 3. The dynamic-batch GPT export bound with `--set-dim batch=4`: against
#    PyTorch as in 1, and with {"dp": 2} against its single-rank program.
#
# Every compiled program is also checked for what `carve compile -o OUT` must
# write: OUT/src/*.cpp, OUT/bin/train, OUT/plan.json with the plan's dp and
# OUT/init.safetensors holding exactly the ONNX initializers.
#
# A run that cannot happen (no carve binary, a compile or launch failure, a
# missing log or checkpoint) is a failure, never a skip.

import argparse
import glob
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import data_gen  # noqa: E402
import st  # noqa: E402
import torch_ref  # noqa: E402
from torch_ref import Hyper  # noqa: E402
import harness  # noqa: E402

STEPS = 20

# Tolerances. Both sides compute in float32 but not in the same order: carve's
# GEMMs, reductions (softmax, layer norm, cross-entropy, the gradient sums over
# the batch) and fused kernels accumulate in a different order than PyTorch's
# (MKL/OpenBLAS blocking), so each op differs by a few ulp (~1e-7 relative),
# and 20 steps of Adam carry every difference forward: Adam divides each
# gradient by its own running RMS, so a parameter with a tiny, noisy gradient
# moves by up to ~lr either way.
#
# Measured on these runs with the oracle itself, float32 against float64 (and 1
# against 2 threads): losses agree to 1.2e-7; final weights to 4e-7 (MLP) but
# only 5e-4 (GPT), all of it in attn.c_attn.bias, whose key third has a zero
# gradient in exact arithmetic (softmax ignores a per-row constant), so its
# float32 gradient is pure rounding noise that Adam turns into updates of
# ~lr * noise / eps.
#
# What the limits catch, measured by perturbing the oracle: Adam's L2 decay in
# place of AdamW's decoupled decay (loss 2e-3 from step 1), nesterov or
# dampening in SGD (loss 7e-2 from step 2), the schedule one step early (loss
# 5e-3 from step 1), a wrong min-lr ratio (7e-3), no clipping (loss 4e-4,
# weights 3e-2), a wrong eps or beta2 (weights 5e-2, 9e-3), no weight decay
# in gpt-schedule (loss 4e-4, weights 3e-3). Not caught: ignoring AdamW's
# default decay of 0.01 at lr 1e-3 (loss 6e-5, weights 6e-4); gpt-schedule's
# explicit --weight-decay covers the decay itself.
LOSS_RTOL = 1e-4
WEIGHT_RTOL = 1e-3
# Data parallelism changes only where the batch is split and the order of the
# gradient sum (the all-reduce adds the ranks' partial sums: a few ulp per
# element); every rank runs the same kernels on a slice of the same batch, so
# the loss stays within ~1e-7 (one float32 rounding of the loss), and a wrong
# gradient average (a sum instead of a mean, a rank left out) is off by 1e-3
# or more within a few steps.
DP_RTOL = 1e-5
# The learning rate is a closed-form function of the step; the log may print
# it with ~7 significant digits.
LR_RTOL = 1e-5

COMPILE_TIMEOUT_S = 600
TRAIN_TIMEOUT_S = 600


class Run:
    """One compiled program trained for STEPS steps and what it is compared with."""

    def __init__(self, name, model, hyper, data, dp=1, against=None, note="",
                 variant="opset17", set_dims=None):
        self.name = name
        self.model = model          # reference model name: mlp, gpt
        self.variant = variant      # folder of the export under --models
        self.set_dims = set_dims or {}
        self.hyper = hyper
        self.data = data            # key into the data files
        self.dp = dp
        self.against = against      # name of the dp=1 run (DP runs), else None: PyTorch
        self.note = note


SGD_MOMENTUM = Hyper(optimizer="sgd", lr=0.05, momentum=0.9)
# Clipping at 1.5 clips some steps and not others (the oracle's gradient norms
# are 1.0-1.8); warmup 5 + cosine 10 reaches the floor at step 15.
SCHEDULE = Hyper(lr=3e-3, weight_decay=0.1, clip_grad_norm=1.5, warmup_steps=5,
                 decay_steps=10, min_lr_ratio=0.1)
DYNAMIC = dict(variant="dynamic", set_dims={"batch": 4})

RUNS = [
    Run("mlp-adamw", "mlp", Hyper(), "mlp", note="AdamW, PyTorch defaults (no flags)"),
    Run("mlp-sgd", "mlp", SGD_MOMENTUM, "mlp", note="SGD lr 0.05, momentum 0.9"),
    Run("gpt-adamw", "gpt", Hyper(), "tokens", note="AdamW, PyTorch defaults (no flags)"),
    Run("gpt-schedule", "gpt", SCHEDULE, "tokens-u16",
        note="AdamW lr 3e-3, wd 0.1, clip 1.5, warmup 5, cosine 10 to 0.1; uint16 data"),
    Run("gpt-dynamic", "gpt", Hyper(), "tokens", **DYNAMIC,
        note="dynamic-batch export, --set-dim batch=4, AdamW defaults"),
    # Adam is invariant to the scale of the gradient, so a gradient summed
    # over the ranks instead of averaged changes its losses by ~1e-7 only;
    # SGD's change by the factor dp, and the clipped GPT's depend on the
    # global norm being taken after the all-reduce.
    Run("mlp-adamw-dp2", "mlp", Hyper(), "mlp", dp=2, against="mlp-adamw"),
    Run("mlp-adamw-dp4", "mlp", Hyper(), "mlp", dp=4, against="mlp-adamw"),
    Run("mlp-sgd-dp2", "mlp", SGD_MOMENTUM, "mlp", dp=2, against="mlp-sgd"),
    Run("mlp-sgd-dp4", "mlp", SGD_MOMENTUM, "mlp", dp=4, against="mlp-sgd"),
    Run("gpt-schedule-dp2", "gpt", SCHEDULE, "tokens-u16", dp=2, against="gpt-schedule"),
    Run("gpt-schedule-dp4", "gpt", SCHEDULE, "tokens-u16", dp=4, against="gpt-schedule"),
    # --set-dim and a plan together: each rank's share of the bound batch.
    Run("gpt-dynamic-dp2", "gpt", Hyper(), "tokens", dp=2, against="gpt-dynamic", **DYNAMIC),
]


Failure = harness.Failure


# --- Processes ----------------------------------------------------------------

def run_cmd(cmd, timeout, env=None):
    """Runs `cmd` in its own process group; on timeout kills the group.
    Returns (exit code or None on timeout, stdout + stderr text, seconds)."""
    start = time.time()
    try:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True, env=env)
    except OSError as e:
        return 127, f"cannot start {cmd[0]}: {e}", 0.0
    try:
        out, _ = p.communicate(timeout=timeout)
        code = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        code = None
    return code, out.decode(errors="replace"), time.time() - start


def must_succeed(what, cmd, timeout):
    code, out, secs = run_cmd(cmd, timeout)
    if code != 0:
        why = f"no exit within {timeout} s" if code is None else f"exit {code}"
        tail = "\n".join("    " + line for line in out.strip().splitlines()[-15:])
        raise Failure(f"{what} failed ({why}): {' '.join(cmd)}\n{tail}")
    return secs


# --- Compiling and training -----------------------------------------------------

def compile_program(carve, onnx_path, run, out):
    cmd = [carve, "compile", onnx_path, *run.hyper.carve_flags(), "-o", out]
    for name, size in run.set_dims.items():
        cmd[3:3] = ["--set-dim", f"{name}={size}"]
    if run.dp != 1:
        plan = out + ".plan.json"
        with open(plan, "w") as f:
            json.dump({"dp": run.dp}, f)
        cmd[3:3] = ["--plan", plan]
    secs = must_succeed("carve compile", cmd, COMPILE_TIMEOUT_S)
    check_artifacts(onnx_path, run, out)
    return secs


def check_artifacts(onnx_path, run, out):
    """What `carve compile -o OUT` writes, besides a working binary."""
    if not glob.glob(os.path.join(out, "src", "*.cpp")):
        raise Failure(f"{out}/src holds no .cpp file")
    train = os.path.join(out, "bin", "train")
    if not os.access(train, os.X_OK):
        raise Failure(f"{train} is missing or not executable")
    plan_path = os.path.join(out, "plan.json")
    try:
        with open(plan_path) as f:
            plan = json.load(f)
    except (OSError, ValueError) as e:
        raise Failure(f"{plan_path}: cannot read: {e}") from None
    # The file records the plan it was compiled with (and more beside it).
    inner = plan.get("plan", plan) if isinstance(plan, dict) else {}
    if not isinstance(inner, dict) or inner.get("dp", 1) != run.dp:
        raise Failure(f"{plan_path}: records the plan {json.dumps(inner)}, compiled with "
                      f"{{\"dp\": {run.dp}}}")
    init_path = os.path.join(out, "init.safetensors")
    try:
        init = st.load(init_path)
    except (OSError, ValueError) as e:
        raise Failure(f"{init_path}: cannot read: {e}") from None
    params, _, inits = torch_ref.read_onnx(onnx_path)
    for name in params:
        if name not in init:
            raise Failure(f"{init_path}: no tensor '{name}'")
        if init[name].shape != inits[name].shape or not np.array_equal(init[name],
                                                                       inits[name]):
            raise Failure(f"{init_path}: '{name}' differs from the ONNX initializer")


def train_program(carve, run, out, data, data_dtype, work):
    log = os.path.join(work, "log.jsonl")
    save = os.path.join(work, "ckpt")
    args = ["--steps", str(STEPS), "--data", data, "--log", log, "--save", save,
            "--quiet"]
    if data_dtype != "int32":
        args += ["--data-dtype", data_dtype]
    if run.dp == 1:
        cmd = [os.path.join(out, "bin", "train"), *args]
    else:
        cmd = [carve, "run", out, "-n", str(run.dp), "--", *args]
    secs = must_succeed("training", cmd, TRAIN_TIMEOUT_S)
    return read_log(log), read_weights(save), secs


def read_log(path):
    """The records of a --log file; exactly steps 0..STEPS-1 with finite losses."""
    try:
        with open(path) as f:
            lines = [line for line in f if line.strip()]
    except OSError as e:
        raise Failure(f"{path}: cannot read the training log: {e}") from None
    records = []
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            raise Failure(f"{path}:{i + 1}: not JSON: {line.strip()[:120]}") from None
        for key in ("step", "loss", "lr"):
            if key not in rec:
                raise Failure(f"{path}:{i + 1}: no '{key}' in {line.strip()[:120]}")
        records.append(rec)
    steps = [r["step"] for r in records]
    if steps != list(range(1, STEPS + 1)):
        raise Failure(f"{path}: steps {steps[:5]}{'...' if len(steps) > 5 else ''} "
                      f"({len(steps)} records), expected 1..{STEPS}")
    for r in records:
        if not math.isfinite(r["loss"]):
            raise Failure(f"{path}: step {r['step']} loss is {r['loss']}")
    return records


def read_weights(path):
    try:
        tensors = st.load_checkpoint(path)
    except (OSError, ValueError) as e:
        raise Failure(f"{path}: cannot read the saved weights: {e}") from None
    for name, t in tensors.items():
        if t.dtype != np.float32:
            raise Failure(f"{path}: '{name}' is {t.dtype}, expected F32")
    return tensors


# --- Comparing ----------------------------------------------------------------

def rel(a, b):
    return abs(a - b) / abs(b) if b != 0 else abs(a - b)


def loss_table(run, mine, ref, ref_name, tol):
    """Prints step, carve loss, reference loss, rel diff; returns failure messages."""
    show_lr = run.hyper.has_schedule()
    print(f"  {'step':>4}  {'carve loss':>12}  {ref_name + ' loss':>12}  {'rel diff':>8}"
          + (f"  {'lr':>10}" if show_lr else ""))
    worst, worst_step, lr_bad = 0.0, 0, []
    for a, b in zip(mine, ref):
        d = rel(a["loss"], b["loss"])
        if d > worst:
            worst, worst_step = d, a["step"]
        mark = "  <-- over" if d > tol else ""
        lr_d = rel(a["lr"], b["lr"])
        if lr_d > LR_RTOL:
            lr_bad.append(f"step {a['step']}: lr {a['lr']:.8g}, {ref_name} {b['lr']:.8g}")
        print(f"  {a['step']:>4}  {a['loss']:>12.8f}  {b['loss']:>12.8f}  {d:>8.1e}"
              + (f"  {a['lr']:>10.4e}" if show_lr else "") + mark)
    print(f"  max loss rel diff {worst:.2e} at step {worst_step} (limit {tol:.0e})")
    failures = []
    if worst > tol:
        over = [a["step"] for a, b in zip(mine, ref) if rel(a["loss"], b["loss"]) > tol]
        failures.append(f"loss differs from {ref_name} by {worst:.2e} relative at step "
                        f"{worst_step} (limit {tol:.0e}); steps over the limit: {over}")
    if lr_bad:
        failures.append(f"learning rate differs from {ref_name} (limit {LR_RTOL:.0e}) at "
                        + "; ".join(lr_bad[:4]) + (" ..." if len(lr_bad) > 4 else ""))
    return failures


def weight_diff(mine, ref, names):
    """(max over `names` of ||mine - ref|| / ||ref||, its name, missing names)."""
    worst, worst_name, missing = 0.0, None, []
    for name in names:
        if name not in mine:
            missing.append(name)
            continue
        a, b = mine[name].astype(np.float64), ref[name].astype(np.float64)
        if a.shape != b.shape:
            missing.append(f"{name} (shape {list(a.shape)}, expected {list(b.shape)})")
            continue
        d = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
        if d > worst or worst_name is None:
            worst, worst_name = d, name
    return worst, worst_name, missing


# --- The runs ------------------------------------------------------------------

def make_data(models, work):
    gpt = os.path.join(models, "opset17", "gpt.onnx")
    mlp = os.path.join(models, "opset17", "mlp.onnx")
    tokens = data_gen.make_tokens(1000, data_gen.vocab_size(gpt), seed=0)
    files = {}
    # 1000 tokens hold 15 sequences of 64 (B = 4, T = 16) before the offsets
    # wrap: 20 steps exercise the "mod (N - T - 1)".
    files["tokens"] = (os.path.join(work, "tokens.i32"), "int32")
    data_gen.write_tokens(files["tokens"][0], tokens, "int32")
    files["tokens-u16"] = (os.path.join(work, "tokens.u16"), "uint16")
    data_gen.write_tokens(files["tokens-u16"][0], tokens, "uint16")
    # S = 7 leading entries, so that step k reading k mod S is exercised.
    files["mlp"] = (os.path.join(work, "mlp.safetensors"), "int32")
    inputs = data_gen.graph_inputs(mlp)
    data_gen.write_tensors(files["mlp"][0],
                           data_gen.make_tensors(inputs, 7, data_gen.class_counts("mlp")))
    return files


def do_run(carve, models, files, run, results):
    """Compiles, trains and compares one run; returns a list of failure messages."""
    onnx_path = os.path.join(models, run.variant, run.model + ".onnx")
    work = os.path.join(results["work"], run.name)
    out = os.path.join(work, "out")
    os.makedirs(work)
    data, data_dtype = files[run.data]
    compile_s = compile_program(carve, onnx_path, run, out)
    mine, weights, train_s = train_program(carve, run, out, data, data_dtype, work)
    results[run.name] = (mine, weights)
    print(f"  compiled in {compile_s:.1f} s, trained {STEPS} steps in {train_s:.1f} s")

    params, _, _ = torch_ref.read_onnx(onnx_path)
    if run.against is None:
        ref_log = os.path.join(work, "torch.jsonl")
        ref, ref_weights = torch_ref.train(onnx_path, run.model, data, STEPS, run.hyper,
                                           data_dtype, set_dims=run.set_dims,
                                           log_path=ref_log,
                                           save_path=os.path.join(work, "torch.safetensors"))
        if run.hyper.clip_grad_norm is not None:
            clipped = sum(r["grad_norm"] > run.hyper.clip_grad_norm for r in ref)
            print(f"  PyTorch clipped {clipped} of {STEPS} steps")
        # Well posed first: PyTorch's own float32 run within the tolerances of
        # its float64 run, or the comparison would test rounding, not carve.
        exact, exact_weights = torch_ref.train(onnx_path, run.model, data, STEPS, run.hyper,
                                               data_dtype, set_dims=run.set_dims, float64=True)
        posed = max(rel(r["loss"], e["loss"]) for r, e in zip(ref, exact))
        posed_w, posed_at, _ = weight_diff(ref_weights, exact_weights, params)
        print(f"  well posed: PyTorch float32 against float64: losses {posed:.1e}, weights "
              f"{posed_w:.1e} at {posed_at}")
        if posed > LOSS_RTOL or posed_w > WEIGHT_RTOL:
            return [f"not well posed in float32: PyTorch's own float32 run is {posed:.2e} "
                    f"(losses) and {posed_w:.2e} (weights, at '{posed_at}') from its float64 "
                    f"run; the test allows carve {LOSS_RTOL:.0e} and {WEIGHT_RTOL:.0e}: choose "
                    f"the batch, the learning rate or the steps so that it is well posed"]
        failures = loss_table(run, mine, ref, "torch", LOSS_RTOL)
        worst, name, missing = weight_diff(weights, ref_weights, params)
        if missing:
            failures.append("the saved model.safetensors lacks " + ", ".join(missing))
        print(f"  final weights: max ||delta||/||w|| {worst:.2e} at {name} "
              f"(limit {WEIGHT_RTOL:.0e})")
        if worst > WEIGHT_RTOL:
            failures.append(f"final weights differ from torch by {worst:.2e} relative at "
                            f"'{name}' (limit {WEIGHT_RTOL:.0e})")
        if failures:
            explain_with_float64(mine, ref, exact, weights, ref_weights, exact_weights, params)
        return failures

    if run.against not in results:
        return [f"the dp=1 run '{run.against}' it is compared with did not complete"]
    ref, ref_weights = results[run.against]
    failures = loss_table(run, mine, ref, "dp=1", DP_RTOL)
    worst, name, missing = weight_diff(weights, ref_weights, params)
    if missing:
        failures.append("the saved model.safetensors lacks " + ", ".join(missing))
    # Not an acceptance criterion, but it tells a rank that drifted apart.
    print(f"  final weights vs dp=1: max ||delta||/||w|| {worst:.2e} at {name} (not checked)")
    return failures


def explain_with_float64(mine, ref, exact, weights, ref_weights, exact_weights, params):
    """On a mismatch, says how far float32 PyTorch itself is from float64 and
    carve from float64, so that a report can tell rounding from a wrong
    result."""
    torch_err = max(rel(r["loss"], e["loss"]) for r, e in zip(ref, exact))
    carve_err = max(rel(m["loss"], e["loss"]) for m, e in zip(mine, exact))
    print(f"  diagnosis, against float64 PyTorch: max loss rel diff torch float32 "
          f"{torch_err:.2e}, carve {carve_err:.2e}")
    _, name, _ = weight_diff(weights, ref_weights, params)
    if name in weights:
        t, _, _ = weight_diff(ref_weights, exact_weights, [name])
        c, _, _ = weight_diff(weights, exact_weights, [name])
        print(f"  diagnosis, against float64 PyTorch: '{name}' ||delta||/||w|| torch "
              f"float32 {t:.2e}, carve {c:.2e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--carve", required=True, help="path to the carve binary")
    ap.add_argument("--models", required=True,
                    help="exported models (build/test-models); uses opset17/{mlp,gpt}.onnx "
                         "and dynamic/gpt.onnx")
    ap.add_argument("--workdir", required=True, help="scratch folder (recreated)")
    ap.add_argument("--only", action="append", metavar="RUN",
                    help="run only these runs (and the dp=1 runs they need)")
    args = ap.parse_args()

    carve = os.path.abspath(args.carve)
    models = os.path.abspath(args.models)
    if not os.access(carve, os.X_OK):
        print(f"FAIL: the carve binary {carve} is missing or not executable")
        return 1
    for path in sorted({os.path.join(models, r.variant, r.model + ".onnx") for r in RUNS}):
        if not os.path.isfile(path):
            print(f"FAIL: {path} is missing (run the export-models test)")
            return 1
    work = os.path.join(os.path.abspath(args.workdir), "train_vs_torch")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    files = make_data(models, work)

    runs = RUNS
    if args.only:
        wanted = set(args.only) | {r.against for r in RUNS if r.name in args.only}
        runs = [r for r in RUNS if r.name in wanted]
        unknown = set(args.only) - {r.name for r in RUNS}
        if unknown:
            print(f"FAIL: unknown runs {sorted(unknown)}; known: {[r.name for r in RUNS]}")
            return 1

    results = {"work": work}
    failed = []
    for run in runs:
        what = (f"dp={run.dp} vs {run.against}" if run.against
                else f"{run.note} vs PyTorch")
        print(f"== {run.name}: {run.model}, {STEPS} steps, {what}")
        sys.stdout.flush()
        try:
            failures = do_run(carve, models, files, run, results)
        except Failure as e:
            failures = [str(e)]
        except (torch_ref.OracleError, ValueError, OSError) as e:
            failures = [f"the PyTorch oracle failed: {e}"]
        for f in failures:
            print(f"  FAIL: {f}")
        print(f"  {'FAIL' if failures else 'PASS'} {run.name}")
        sys.stdout.flush()
        if failures:
            failed.append(run.name)
    print(f"{len(runs) - len(failed)} passed, {len(failed)} failed"
          + (f": {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
