#!/usr/bin/env python3
"""The CUDA target's training step against the CPU target's (needs a GPU).

What must hold on any machine with a CUDA GPU (`make test-gpu`):

1. The GPT- and Llama-style reference models, compiled for 1 rank with the
   same weights and data, train 10 steps (AdamW, the default schedule) on
   the GPU and on the CPU with per-step losses within 1e-4 relative in fp32
   (the issue's bound: cuBLAS and the fused kernels sum in other orders than
   OpenBLAS and the CPU loops, a few fp32 ulps per op) and within 2e-2 in
   bf16 (the issue's bound; both targets round the same matmul and attention
   inputs to bf16, so the gap is normally far smaller). And the GPT with the
   tanh GELU (GPT-2's) in bf16, whose GELUs the MLPs' input projections
   apply (matmul16_bias_gelu: cuBLASLt's GELU_AUX_BIAS epilogue, GELU of the
   unrounded sum, one rounding fewer than the CPU target) and whose GELU
   gradients the output projections' data-gradient GEMMs compute
   (matmul16_dgelu: DGELU), one of each per layer, within the same 2e-2. And
   the BERT-style encoder in bf16, whose padding mask ([B, 1, 1, T], from its
   attention_mask input) cuDNN's attention adds as its 16-bit bias (two
   forward and two backward calls, none refused), within 2e-2. The final weights
   agree within 1e-3 of each tensor's largest entry in fp32. The GPT's fp32
   program under the plan field tf32 (its GEMMs' inputs rounded to TF32)
   calls setTf32(true), stays within 2.5e-3 of the CPU's fp32 losses (2e-2
   scaled by TF32's rounding against bf16's) and differs from the GPU's fp32
   losses (the rounding took effect).
2. The 1-rank run goes through the NCCL communicator (1-rank communicators
   for dp, tp and pp): the start-up succeeded and the loss was all-reduced.
3. With 2 or more GPUs visible, dp=2, tp=2 and pp=2 (2 micro-batches) plans
   of the GPT in fp32 and bf16 (its bias gradients summed by the weight
   gradients' GEMMs, which the gradient all-reduce must follow), of the
   tanh-GELU GPT in bf16 (its GELUs and their gradients in the GEMMs'
   epilogues, on tp's column shards too) and of the
   Llama and the BERT-style encoder in bf16 on 2 GPUs match the 1-rank GPU
   program of the same model and precision within the parallel tests' 1e-5
   (fp32) and precision.py's 1e-4 (bf16: the ranks sum 16-bit-rounded
   partial results in another order). With 4 GPUs, the reference MLP under
   pp=4 (4 micro-batches) against 1 GPU within 1e-5: its stages exchange
   messages in both parts of the step, skip a stage, and receive a weight's
   gradient whole, all through NCCL, which matches messages by order alone.
   And a 4-layer GPT under an interleaved schedule (pp=2, 2 virtual stages,
   4 micro-batches) on 2 GPUs against 1 within 1e-5: forward and backward
   messages share each direction between the two ranks.
   With fewer GPUs these parts print that they were not run.
4. train's default for CUDA programs, the forward and backward captured in
   a CUDA graph from the second step on (the run says so), gives bitwise
   the losses and final checkpoint of the eager run (train --no-cuda-graph,
   which captures nothing): GPT and Llama in fp32, bf16 and fp16 (from loss
   scale 2^24, so that skipped steps and a changing scale go through the
   graph), and dp=2 and tp=2 of both on 2 GPUs where there are 2 (pipelines
   are not captured).
5. A custom op: the Llama with the fused SwiGLU of models/custom/, its
   CUDA kernels (swiglu.cu) against its CPU kernels (swiglu.cpp), fp32, within
   the fp32 bounds of 1 (trained with SGD, as 8. says why); the CUDA graph
   (which captures the user's kernels) bitwise equal to the eager run. And
   the same op with a forward kernel that synchronizes its stream (which no
   capture allows): the run says that its step cannot be captured, naming
   the op and CUDA's reason, runs every step eagerly, and trains bitwise as
   the good kernels' eager run.
6. Start-up failures: a plan that needs more memory than the GPU has
   (--set-dim to a huge batch) stops with one line naming the rank, the GPU
   and the memory needed; more ranks on this host than visible GPUs stops
   with one line saying so. Both exit 1 without hanging.
7. train --eval-data on the GPT's fp32 programs: the GPU's evaluation
   losses within the fp32 bound of the CPU's (the training step computes
   its loss with the gradient, so the forward's own loss runs only when
   evaluating), the training losses unchanged bit for bit.
7b. CARVE_GPU_PROFILE=1 on the GPT fp32 program: one table of GPU time by
   kernel name at the end, over the steps after the first (which loads and
   tunes the kernels), with the cuBLAS GEMMs, attention and AdamW among its
   rows, and (on a GPU) more than 0 ms in all.
8. Dropout: tests/e2e/dropout.py's model (8 dropout nodes) draws the CPU
   program's masks on the GPU (the fp32 bounds of 1), the CUDA graph replays
   each step's masks (bitwise the eager run), and with 2 GPUs tp=2 equals
   1 GPU within 1e-5. Trained with SGD: AdamW's first steps move an entry by
   about lr whatever its gradient's size, so where a gradient is small
   against its rounding (nn.MultiheadAttention's query bias: a sum of
   softmax gradients that cancel) the CPU's and the GPU's GEMMs, which round
   differently, drift apart by a fraction of lr (6e-5 of a 4e-3 bias on one
   machine's OpenBLAS kernels, where another's stayed within 1e-3); SGD
   moves each weight by lr times its gradient, so their weights stay within
   the gradients' rounding.
9. Convolutions: tests/e2e/convolution.py's CNNs (batch norm with its
   running statistics) train on the GPU, their convolutions through cuDNN,
   as on the CPU (im2col; the fp32 bounds of 1), and so do carve's direct
   convolution kernels (CARVE_CUDNN_CONVOLUTION=off) and the im2col program
   (--convolution carve); bf16 within 1.'s bf16 bound; with 2 GPUs the CNN
   under dp=2 and pp=2, and the batch-norm CNN under dp=2 with
   sync_batch_norm, equal 1 GPU within 1e-5.

Exits 77 (ctest: skipped, and `make test-gpu` fails) when no GPU is visible.

For a GPU machine without carve's build tools (no MLIR there): --phase
prepare, here, compiles every program for one GPU and runs the CPU
programs; the workdir then travels to the GPU machine, where
--phase device runs the CUDA programs (OUT/bin/train directly, one rank:
without mpirun the parts on several GPUs print that they were not run) and
makes every comparison. --phase all (the default) is both on one machine.

A failed check is reported and the next one runs; the script exits 1 at the
end if any failed.

With --emulated CONFIG (ctest gpu-emu-train-vs-cpu in `make test`) the CUDA
programs are built against the CPU emulation of tests/gpu-emu
(CARVE_CUDA_EMULATION=CONFIG, build/lib/carve-runtime-emu.txt) and run there
on EMU_GPUS emulated GPUs (one process per rank, NCCL between them over
the emulation's sockets), for EMU_STEPS steps: every part runs, the custom
op's kernels with their launches rewritten for the emulation by carve
compile.
"""

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "e2e"))
import st  # noqa: E402

STEPS = 10
EMU_STEPS = 4  # the emulation runs a step of these models in about 2 s
EMU_GPUS = 4
FP32_RTOL = 1e-4
BF16_RTOL = 2e-2
# Plan field tf32: fp32 GEMMs with inputs rounded to 10 mantissa bits. bf16's
# bound scaled by the ratio of the formats' relative rounding errors (2^-10,
# truncation included, against bf16's 2^-7).
TF32_RTOL = BF16_RTOL * 2.0 ** -3
WEIGHT_RTOL = 1e-3
PARALLEL_RTOL = 1e-5
BF16_PARALLEL_RTOL = 1e-4
TIMEOUT_S = 900


class Failure(Exception):
    pass


def run(cmd, timeout=TIMEOUT_S, env=None):
    """Runs `cmd`; prints how long it took (where the test's minutes go)."""
    t = time.time()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       timeout=timeout, env=env)
    print("  %6.1f s  %s" % (time.time() - t, " ".join(os.path.basename(c) if i == 0 else c
                                                        for i, c in enumerate(cmd[:6]))),
          flush=True)
    return p.returncode, p.stdout, p.stderr


EMULATED = None  # --emulated: the emulation's runtime settings
CARVE = None  # --carve
PHASE = "all"  # --phase: all, prepare (compile, CPU runs) or device (CUDA runs)
CUDA_OUTS = set()  # the output directories compiled for the CUDA target


FAILURES = []  # the checks that failed; the others still run


@contextlib.contextmanager
def going_on():
    """Records a Failure of the block and goes on with the next check (each
    run on a GPU is precious): main exits 1 at the end if any failed."""
    try:
        yield
    except Failure as e:
        FAILURES.append(str(e).splitlines()[0])
        print("FAIL: %s" % e, flush=True)


def cuda_pending(out):
    """Whether `out` is a CUDA program that --phase prepare compiles but does
    not run: its results are None, and the checks that need them wait for
    --phase device."""
    return PHASE == "prepare" and out in CUDA_OUTS


def pending(*results):
    return any(r is None for r in results)


def load_checkpoint(path):
    return None if PHASE == "prepare" and not os.path.exists(path) else st.load_checkpoint(path)


def run_train(out, ranks, args, timeout=TIMEOUT_S):
    """`carve run OUT -n RANKS -- ARGS`; under --phase device (no carve there),
    OUT/bin/train itself, as carve run starts one rank."""
    if PHASE != "device":
        return run([CARVE, "run", out, "-n", str(ranks), "--"] + list(args), timeout)
    if ranks != 1:
        raise Failure("--phase device runs one rank only (no mpirun): %s on %d" % (out, ranks))
    env = dict(os.environ, CARVE_STDOUT_TTY="0")
    env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    env.setdefault("OPENBLAS_NUM_THREADS", env["OMP_NUM_THREADS"])
    p = subprocess.run([os.path.join(out, "bin", "train")] + list(args), stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, timeout=timeout, env=env)
    return p.returncode, p.stdout, p.stderr


def gpus():
    if EMULATED:
        return int(os.environ["CARVE_EMU_GPUS"])
    if PHASE == "prepare":
        return 1  # the programs of one GPU (what --phase device runs)
    try:
        rc, so, _ = run(["nvidia-smi", "-L"], timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return len([l for l in so.splitlines() if l.startswith("GPU ")]) if rc == 0 else 0


def compile_(carve, onnx, plan, target, out, extra=()):
    if target == "cuda":
        CUDA_OUTS.add(out)
    if PHASE == "device":
        # Compiled by --phase prepare with these arguments.
        need = os.path.join(out, "bin", "train") if target == "cuda" else out + ".jsonl"
        if not os.path.exists(need):
            raise Failure("%s was not prepared (no %s: run --phase prepare and bring its "
                          "workdir)" % (out, need))
        return
    pj = out + ".plan.json"
    with open(pj, "w") as f:
        json.dump(plan, f)
    cmd = [carve, "compile", onnx, "--plan", pj, "--target", target, "-o", out,
           "--quiet"] + list(extra)
    if EMULATED and target == "cuda":
        rc, so, se = run(cmd, env=dict(os.environ, CARVE_CUDA_EMULATION=EMULATED))
    else:
        rc, so, se = run(cmd)
    if rc != 0:
        raise Failure("compile %s %s --target %s failed:\n%s%s" % (onnx, plan, target, so, se))


def train(carve, out, ranks, data, save, extra=(), log_suffix=""):
    log = out + log_suffix + ".jsonl"
    if cuda_pending(out):
        return None
    if PHASE == "device" and out not in CUDA_OUTS:
        # A CPU program, run by --phase prepare.
        return [r["loss"] for r in map(json.loads, open(log)) if "loss" in r]
    rc, so, se = run_train(out, ranks, ["--steps", str(STEPS), "--data", data, "--log", log,
                                        "--save", save, "--progress", "none"] + list(extra))
    if rc != 0:
        raise Failure("run %s on %d rank(s) failed:\n%s%s" % (out, ranks, so, se))
    STDOUT[log] = so
    STDERR[log] = se
    return [r["loss"] for r in map(json.loads, open(log)) if "loss" in r]


# The standard output and error of each train run, by its log's path.
STDOUT = {}
STDERR = {}
CAPTURED = "forward and backward captured in a CUDA graph of"


def check_graph(carve, out, ranks, data, graph_losses, graph_ckpt, label, extra=()):
    """The default run of a CUDA program (train(out, ...) with `extra`)
    replays a CUDA graph of the same kernels and collectives, in the same
    order, as the eager run (train --no-cuda-graph), so its losses and final
    checkpoint must be bitwise the eager run's."""
    if pending(graph_losses):
        return
    graph_out = STDOUT.get(out + ".jsonl", "")
    if PHASE != "prepare" and CAPTURED not in graph_out:
        raise Failure("%s: the default run did not capture its step in a CUDA graph:\n%s"
                      % (label, graph_out))
    ckpt = out + ".eager.ckpt"
    losses = train(carve, out, ranks, data, ckpt, ["--no-cuda-graph"] + list(extra), ".eager")
    if pending(losses):
        return
    if CAPTURED in STDOUT[out + ".eager.jsonl"]:
        raise Failure("%s --no-cuda-graph captured a CUDA graph:\n%s"
                      % (label, STDOUT[out + ".eager.jsonl"]))
    if losses != graph_losses:
        raise Failure("%s: CUDA graph losses differ from the eager run's\n  eager %s\n  graph %s"
                      % (label, losses, graph_losses))
    eager = load_checkpoint(ckpt)
    for k, t in eager.items():
        if k not in graph_ckpt or not (graph_ckpt[k] == t).all():
            raise Failure("%s: tensor %s of the CUDA graph run differs from the eager run's"
                          % (label, k))
    print("ok: %s: CUDA graph (the default): losses and checkpoint bitwise equal to the eager "
          "run" % label)


def check_eval(carve, w, model, data, cuda_losses):
    """train --eval-data on the fp32 programs: the CUDA training step computes
    its loss together with the loss's gradient (carve-select-kernels' rule
    3j), and the forward's own cross-entropy runs only when evaluating, so
    the evaluation's losses must be the CPU program's within FP32_RTOL (a
    forward that skipped it would report the last training step's loss,
    another batch's before the update), and evaluating must leave the
    training losses bit for bit as they were."""
    ev = ["--eval-data", data, "--eval-every", "2", "--eval-batches", "2"]
    got = {}
    for target in ["cpu", "cuda"]:
        out = os.path.join(w, "%s-fp32-%s" % (model, target))
        losses = train(carve, out, 1, data, out + ".eval.ckpt", ev, ".eval")
        if pending(losses):
            return 0
        evals = [r["eval_loss"] for r in map(json.loads, open(out + ".eval.jsonl"))
                 if "eval_loss" in r]
        got[target] = (losses, evals)
    if got["cuda"][0] != cuda_losses:
        raise Failure("%s fp32: --eval-data changed the GPU's training losses\n  without %s\n"
                      "  with    %s" % (model, cuda_losses, got["cuda"][0]))
    e_cpu, e_gpu = got["cpu"][1], got["cuda"][1]
    if not e_gpu or len(e_gpu) != len(e_cpu):
        raise Failure("%s fp32: %d evaluations on the GPU, %d on the CPU"
                      % (model, len(e_gpu), len(e_cpu)))
    d = worst_rel(e_cpu, e_gpu)
    if d > FP32_RTOL:
        raise Failure("%s fp32: the GPU's evaluation losses differ from the CPU's by %.3g "
                      "(limit %g)\n  cpu %s\n  gpu %s" % (model, d, FP32_RTOL, e_cpu, e_gpu))
    print("ok: %s fp32 --eval-data: %d GPU evaluation losses within %.2g of the CPU's; the "
          "training losses unchanged" % (model, len(e_gpu), d))
    return 1


def check_profile(out, data):
    """CARVE_GPU_PROFILE=1: the program prints the GPU time of its kernels by
    name when it closes the device: the GEMMs through cuBLAS, the attention
    kernels and the optimizer's among them, each with its calls. (The
    emulation keeps no device clock: its times are 0 ms.)"""
    os.environ["CARVE_GPU_PROFILE"] = "1"
    try:
        rc, so, se = run_train(out, 1, ["--steps", "2", "--data", data, "--progress", "none"])
    finally:
        del os.environ["CARVE_GPU_PROFILE"]
    if rc != 0:
        raise Failure("CARVE_GPU_PROFILE=1: the run failed:\n%s%s" % (so, se))
    lines = se.splitlines()
    head = [i for i, l in enumerate(lines) if "GPU time by kernel (CARVE_GPU_PROFILE)" in l]
    if len(head) != 1:
        raise Failure("CARVE_GPU_PROFILE=1: expected one table of GPU time by kernel, got %d:\n%s"
                      % (len(head), se))
    # The first step's launches (cuBLAS's loading and tuning) are left out.
    if "over 1 step from step 2 (step 1, " not in lines[head[0]]:
        raise Failure("CARVE_GPU_PROFILE=1: the table does not say that it leaves step 1 out:\n%s"
                      % lines[head[0]])
    rows = {}
    for l in lines[head[0] + 2:]:
        f = l.split(None, 4)
        if len(f) != 5:
            break
        rows[f[4]] = (float(f[0]), int(f[2]))
    # AdamW: adamwMultiKernel (one launch over every parameter; adamwKernel per
    # parameter where the tail has no multi-tensor call).
    for name in ["cuBLAS GEMM, fp32", "attnForward<", "adamw"]:
        hit = [k for k in rows if k.startswith(name)]
        if not hit or any(rows[k][1] < 1 for k in hit):
            raise Failure("CARVE_GPU_PROFILE=1: no row for %s in the table:\n%s" % (name, se))
    total = sum(ms for ms, _ in rows.values())
    if not EMULATED and total <= 0:
        raise Failure("CARVE_GPU_PROFILE=1: the kernels took no time on a GPU:\n%s" % se)
    print("ok: CARVE_GPU_PROFILE=1: %d kernels timed by name over step 2 of 2, %.3f ms of GPU "
          "time%s"
          % (len(rows), total, " (the emulation's clock is 0)" if EMULATED else ""))


def worst_rel(a, b):
    return max(abs(x - y) / abs(x) for x, y in zip(a, b))


# carve compile's default AdamW learning rate (what these runs use).
DEFAULT_LR = 1e-3


def weight_gap(a, b, floor=2 * DEFAULT_LR * STEPS):
    """The largest difference of a tensor between two checkpoints, relative to
    the larger of its largest entry and `floor`, by default 2 * lr * steps:
    AdamW moves an entry whose exact gradient is zero (the key third of GPT's
    fused QKV bias: the softmax ignores a per-row constant) by up to lr per
    step on rounding noise alone, in either direction, whatever the kernels
    (parallel.py; the CPU emulation of the CUDA target showed it, 0.0011 of
    such a bias's largest entry after 4 steps)."""
    worst, name = 0.0, ""
    for k, t in a.items():
        if k not in b:
            raise Failure("tensor %s is missing from one checkpoint" % k)
        scale = max(float(abs(t).max()), floor) or 1.0
        d = float(abs(t - b[k]).max()) / scale
        if d > worst:
            worst, name = d, k
    return worst, name


def check_masked_attention(carve, w, models, data_gen, one_rank):
    """1. for a mask: the BERT-style reference encoder (a [B, 1, 1, T] padding
    mask from its attention_mask input, (1 - m) * -10000) in bf16, whose
    attention runs as cuDNN's fused flash attention with the mask as its
    16-bit bias (docs/cuda.md, "Attention through cuDNN"): two forward and
    two backward calls in the program, none refused by cuDNN when it runs,
    its losses within 1.'s bf16 bound of the CPU target's (which adds the
    f32 mask); 3. runs its dp, tp and pp plans against it."""
    onnx = os.path.join(models, "opset17", "bert.onnx")
    data = os.path.join(w, "bert.st")
    if PHASE != "device":
        subprocess.run([sys.executable, data_gen, "tensors", data, "--model", onnx, "--name",
                        "bert", "--steps", str(STEPS)], check=True, stdout=subprocess.DEVNULL)
    runs = {}
    for target in ["cpu", "cuda"]:
        out = os.path.join(w, "bert-bf16-%s" % target)
        compile_(carve, onnx, {"precision": "bf16"}, target, out)
        if target == "cuda" and PHASE != "device":
            with open(os.path.join(out, "src", "program0.cu")) as f:
                src = f.read()
            for call in ("attention_stats_cudnn", "attention_grad_stats_cudnn"):
                calls = src.count("gpu::%s(" % call)
                if calls != 2:  # one per layer
                    raise Failure("bert bf16: %d %s calls in the CUDA program, not 2 (one per "
                                  "layer)" % (calls, call))
        runs[target] = train(carve, out, 1, data, out + ".ckpt")
    out = os.path.join(w, "bert-bf16-cuda")
    if pending(runs["cuda"]):
        return 0
    refused = [l for l in STDERR.get(out + ".jsonl", "").splitlines() if "carve's kernel" in l]
    if refused:
        raise Failure("bert bf16: cuDNN did not take its masked attention:\n  " +
                      "\n  ".join(refused))
    d = worst_rel(runs["cpu"], runs["cuda"])
    if d > BF16_RTOL:
        raise Failure("bert bf16: GPU losses differ from the CPU's by %.3g relative (limit %g)\n"
                      "  cpu %s\n  gpu %s" % (d, BF16_RTOL, runs["cpu"], runs["cuda"]))
    print("ok: bert bf16 (a padding mask through cuDNN's bias): GPU within %.2g of the CPU over "
          "%d steps" % (d, STEPS))
    one_rank[("bert", "bf16")] = runs["cuda"]
    return 1


def check_custom_op(carve, w, data_gen):
    custom = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "models",
                          "custom")
    sys.path.insert(0, custom)
    data = os.path.join(w, "swiglu.tokens")
    onnx = None  # --phase device: compiled and written by --phase prepare
    if PHASE != "device":
        import swiglu
        onnx = swiglu.export(w)
        subprocess.run([sys.executable, data_gen, "tokens", "--model", onnx, "--tokens",
                        "16384", data], check=True, stdout=subprocess.DEVNULL)
    rules = ["--rules", os.path.join(custom, "swiglu.json")]
    # Trained with SGD, as 8.'s dropout model and for its reason: under AdamW an
    # entry whose gradient is small against its rounding moves by about lr on
    # either side, and the CPU's packed AVX-512 GEMMs round otherwise than the
    # emulated cuBLAS (layers.0.attention.wo.weight 1.3e-3 apart after 4 steps).
    sgd = {"optimizer": {"name": "sgd", "lr": 0.05}}
    runs = {}
    for target in ["cpu", "cuda"]:
        out = os.path.join(w, "swiglu-" + target)
        compile_(carve, onnx, sgd, target, out, rules)
        runs[target] = (train(carve, out, 1, data, out + ".ckpt"),
                        load_checkpoint(out + ".ckpt"))
    if pending(runs["cuda"][0]):
        return 0
    d = worst_rel(runs["cpu"][0], runs["cuda"][0])
    gap, name = weight_gap(runs["cpu"][1], runs["cuda"][1])
    if d > FP32_RTOL or gap > WEIGHT_RTOL:
        raise Failure("custom op (SwiGLU kernels): GPU losses differ from the CPU's by %.3g "
                      "(limit %g), weights of %s by %.3g (limit %g)\n  cpu %s\n  gpu %s" %
                      (d, FP32_RTOL, name, gap, WEIGHT_RTOL, runs["cpu"][0], runs["cuda"][0]))
    print("ok: custom op with CUDA kernels: GPU within %.2g of the CPU over %d steps; weights "
          "within %.2g (%s)" % (d, STEPS, gap, name))
    check_graph(carve, os.path.join(w, "swiglu-cuda"), 1, data, runs["cuda"][0], runs["cuda"][1],
                "custom op (SwiGLU kernels)")
    check_capture_fallback(carve, w, custom, onnx, sgd, data, runs["cuda"][0])
    return 3


def check_capture_fallback(carve, w, custom, onnx, plan, data, eager_losses):
    """The SwiGLU op with a forward kernel that synchronizes its stream,
    which a CUDA graph capture does not allow: the default run says which
    op broke the capture and why, then trains every step eagerly, bitwise as
    the good kernels' eager run (the synchronization changes no value)."""
    with open(os.path.join(custom, "swiglu.cu")) as f:
        src = f.read()
    entry = "CarveStream stream) {\n  requireF32(in[0], \"a\");"
    if src.count(entry) != 1:
        raise Failure("models/custom/swiglu.cu: the forward entry to patch was not found")
    bad = src.replace(entry, "CarveStream stream) {\n  cudaStreamSynchronize(static_cast<"
                      "cudaStream_t>(stream));\n  requireF32(in[0], \"a\");")
    with open(os.path.join(custom, "swiglu.json")) as f:
        rules = json.load(f)
    op = rules["ops"][0]
    op["cuda"]["sources"] = ["swiglu_sync.cu"]
    op["cpu"]["sources"] = [os.path.abspath(os.path.join(custom, "swiglu.cpp"))]
    if PHASE != "device":
        with open(os.path.join(w, "swiglu_sync.cu"), "w") as f:
            f.write("#include <cuda_runtime.h>\n" + bad)
        with open(os.path.join(w, "swiglu_sync.json"), "w") as f:
            json.dump(rules, f)
    out = os.path.join(w, "swiglu-sync-cuda")
    compile_(carve, onnx, plan, "cuda", out, ["--rules", os.path.join(w, "swiglu_sync.json")])
    losses = train(carve, out, 1, data, out + ".ckpt")
    if pending(losses, eager_losses):
        return
    so = STDOUT[out + ".jsonl"]
    if CAPTURED in so:
        raise Failure("a forward kernel that synchronizes was captured in a CUDA graph:\n" + so)
    told = [l for l in so.splitlines() if "cannot be captured in a CUDA graph" in l]
    if not told or "the user's forward kernel" not in told[0] or "SwiGLU" not in told[0]:
        raise Failure("the run did not say that the SwiGLU op's forward kernel broke the "
                      "capture:\n" + so)
    if "every step runs eagerly" not in so:
        raise Failure("the run did not say that it goes on eagerly:\n" + so)
    if losses != eager_losses:
        raise Failure("after the failed capture the losses differ from the eager run's\n  "
                      "eager %s\n  got   %s" % (eager_losses, losses))
    print("ok: custom op whose kernel synchronizes: the capture fails naming it (%s), every "
          "step runs eagerly, bitwise the eager run" % told[0].split("CUDA graph: ", 1)[-1])


def check_dropout(carve, w, data_gen, n):
    """tests/e2e/dropout.py's model (nn.TransformerEncoder with dropout 0.1,
    8 dropout nodes): the CUDA program draws the CPU program's masks (a
    different mask would move the losses by about 1e-2, far outside the fp32
    bound), --cuda-graph replays each step's masks (bitwise the eager run:
    the step and seed are read on the device, not captured), and with 2 GPUs
    tp=2 equals 1 GPU."""
    import numpy as np

    data = os.path.join(w, "dropout.tokens")
    onnx = os.path.join(w, "dropout.onnx")
    if PHASE != "device":
        import data_gen as tokens
        import dropout
        dropout.export(onnx)
        tokens.write_tokens(data, tokens.make_tokens(16384, dropout.VOCAB, seed=0))
    runs = {}
    sgd = {"optimizer": {"name": "sgd", "lr": 0.05}}  # (8. of the docstring says why)
    for target in ["cpu", "cuda"]:
        out = os.path.join(w, "dropout-" + target)
        compile_(carve, onnx, sgd, target, out)
        runs[target] = (train(carve, out, 1, data, out + ".ckpt", ["--seed", "3"]),
                        load_checkpoint(out + ".ckpt"))
    if pending(runs["cuda"][0]):
        return 0
    d = worst_rel(runs["cpu"][0], runs["cuda"][0])
    # nn.MultiheadAttention's key bias has a zero gradient in exact arithmetic
    # (see weight_gap); with this model's zero-initialized biases AdamW's steps
    # on its rounding noise are the whole tensor: compare the query and value
    # thirds only.
    import dropout
    qv = {}
    for run in ("cpu", "cuda"):
        qv[run] = {k: (t if not k.endswith("self_attn.in_proj_bias") else
                       np.concatenate([t[:dropout.D], t[2 * dropout.D:]]))
                   for k, t in runs[run][1].items()}
    gap, name = weight_gap(qv["cpu"], qv["cuda"], floor=0.0)
    if d > FP32_RTOL or gap > WEIGHT_RTOL:
        raise Failure("dropout: GPU losses differ from the CPU's by %.3g (limit %g), weights of "
                      "%s by %.3g (limit %g)\n  cpu %s\n  gpu %s" %
                      (d, FP32_RTOL, name, gap, WEIGHT_RTOL, runs["cpu"][0], runs["cuda"][0]))
    print("ok: dropout (8 nodes, p 0.1, seed 3, SGD): GPU within %.2g of the CPU over %d steps; "
          "weights within %.2g (%s)" % (d, STEPS, gap, name))
    out = os.path.join(w, "dropout-cuda")
    check_graph(carve, out, 1, data, runs["cuda"][0], runs["cuda"][1], "dropout",
                ["--seed", "3"])
    checks = 2
    if n >= 2:
        out = os.path.join(w, "dropout-tp2-cuda")
        compile_(carve, onnx, dict(sgd, tp=2), "cuda", out)
        losses = train(carve, out, 2, data, out + ".ckpt", ["--seed", "3"])
        d = worst_rel(runs["cuda"][0], losses)
        if d > PARALLEL_RTOL:
            raise Failure("dropout tp=2 on 2 GPUs: losses differ from 1 GPU's by %.3g (limit %g)"
                          % (d, PARALLEL_RTOL))
        print("ok: dropout tp=2 on 2 GPUs within %.2g of 1 GPU" % d)
        checks += 1
    else:
        print("not run: dropout tp=2 on 2 GPUs (%d visible)" % n)
    return checks


def conv_calls(out):
    """The cuDNN convolution calls (forward, data gradient, filter gradient) in
    a CUDA program's source."""
    with open(os.path.join(out, "src", "program0.cu")) as f:
        src = f.read()
    return [src.count("gpu::%s(" % c) for c in ("conv2d", "conv2d_grad_input",
                                                "conv2d_grad_weight")]


def carve_kernel_lines(log):
    """The lines of a run's standard error saying carve's kernel ran instead of
    a library call."""
    return [l for l in STDERR.get(log, "").splitlines() if "carve's kernel runs" in l]


def check_convolution(carve, w, kind, n):
    """tests/e2e/convolution.py's CNNs (`cnn`: strided, padded, grouped and
    depthwise convolutions, max and average pooling; `cnnbn`: batch norm, its
    running statistics in the checkpoint). The CUDA program runs its
    convolutions as cuDNN's (forward, data and filter gradients: the program
    calls them, and cuDNN takes every call when it runs) and trains as the CPU
    program (im2col GEMMs) does, within the fp32 bounds of 1. For `cnn`: the
    same program with CARVE_CUDNN_CONVOLUTION=off (carve's direct kernels)
    and the im2col program (--convolution carve) within them too, bf16 within
    1.'s bf16 bound of the CPU's bf16, and on 2 GPUs dp=2 and pp=2 equal to
    1 GPU. On 2 GPUs, `cnnbn` under dp=2 with sync_batch_norm (the
    statistics' sums all-reduced over NCCL) equals 1 GPU."""
    import numpy as np

    onnx = os.path.join(w, kind + ".onnx")
    data = os.path.join(w, kind + ".safetensors")
    if PHASE != "device":
        import convolution
        shape = convolution.export(kind, onnx)
        rng = np.random.default_rng(1)
        st.save(data, {"x": rng.standard_normal((STEPS,) + shape).astype(np.float32),
                       "y": rng.integers(0, 10, (STEPS, shape[0])).astype(np.int64)})
    runs = {}
    for target in ["cpu", "cuda"]:
        out = os.path.join(w, kind + "-" + target)
        compile_(carve, onnx, {}, target, out)
        if target == "cuda" and PHASE != "device":
            calls = conv_calls(out)
            if min(calls) < 1:
                raise Failure("%s: the CUDA program calls cuDNN's convolutions %s times "
                              "(forward, data, filter), not each at least once" % (kind, calls))
        runs[target] = (train(carve, out, 1, data, out + ".ckpt"), load_checkpoint(out + ".ckpt"))
    if kind == "cnn":
        # Every program of the comparisons below (--phase prepare makes them
        # here, --phase device runs them there), and the CPU's bf16 run.
        compile_(carve, onnx, {}, "cuda", os.path.join(w, "cnn-cuda-im2col"),
                 ["--convolution", "carve"])
        b16 = {}
        for target in ["cpu", "cuda"]:
            out = os.path.join(w, "cnn-bf16-" + target)
            compile_(carve, onnx, {"precision": "bf16"}, target, out)
            b16[target] = train(carve, out, 1, data, out + ".ckpt")
    if pending(runs["cuda"][0]):
        return 0
    refused = carve_kernel_lines(os.path.join(w, kind + "-cuda.jsonl"))
    if refused:
        raise Failure("%s: cuDNN did not take every convolution:\n  %s" % (kind,
                                                                            "\n  ".join(refused)))

    def against(base, losses, ckpt, label, rtol=FP32_RTOL, wtol=WEIGHT_RTOL):
        d = worst_rel(base[0], losses)
        gap, name = weight_gap(base[1], ckpt) if ckpt is not None else (0.0, "-")
        if d > rtol or gap > wtol:
            raise Failure("%s: losses differ by %.3g (limit %g), weights of %s by %.3g (limit %g)"
                          "\n  base %s\n  this %s" % (label, d, rtol, name, gap, wtol, base[0],
                                                       losses))
        return d, gap, name

    d, gap, name = against(runs["cpu"], runs["cuda"][0], runs["cuda"][1],
                           "%s: GPU (cuDNN convolutions) against the CPU" % kind)
    print("ok: %s (cuDNN convolutions%s): GPU within %.2g of the CPU over %d steps; weights and "
          "buffers within %.2g (%s)" % (kind, ", batch norm" if kind == "cnnbn" else "", d, STEPS,
                                        gap, name))
    checks = 1
    if kind == "cnn":
        # carve's own direct kernels, where cuDNN is turned off.
        out = os.path.join(w, "cnn-cuda")
        os.environ["CARVE_CUDNN_CONVOLUTION"] = "off"
        try:
            losses = train(carve, out, 1, data, out + "-off.ckpt", log_suffix="-off")
        finally:
            del os.environ["CARVE_CUDNN_CONVOLUTION"]
        if len(carve_kernel_lines(out + "-off.jsonl")) < 3:
            raise Failure("cnn with CARVE_CUDNN_CONVOLUTION=off: the run did not say that "
                          "carve's kernels ran")
        d, gap, name = against(runs["cpu"], losses, load_checkpoint(out + "-off.ckpt"),
                               "cnn: carve's direct convolution kernels against the CPU")
        print("ok: cnn (carve's direct convolution kernels): GPU within %.2g of the CPU" % d)
        # The im2col program, as on the CPU.
        out = os.path.join(w, "cnn-cuda-im2col")
        if PHASE != "device" and max(conv_calls(out)) != 0:
            raise Failure("cnn --convolution carve: the CUDA program still calls cuDNN's "
                          "convolutions %s" % conv_calls(out))
        losses = train(carve, out, 1, data, out + ".ckpt")
        d, gap, name = against(runs["cpu"], losses, load_checkpoint(out + ".ckpt"),
                               "cnn --convolution carve (im2col) against the CPU")
        print("ok: cnn (--convolution carve: im2col GEMMs): GPU within %.2g of the CPU" % d)
        # bf16: cuDNN's 16-bit convolutions against the CPU's bf16 GEMMs.
        d, _, _ = against((b16["cpu"], None), b16["cuda"], None,
                          "cnn bf16: GPU (cuDNN convolutions) against the CPU", rtol=BF16_RTOL)
        print("ok: cnn bf16 (cuDNN's 16-bit convolutions): GPU within %.2g of the CPU" % d)
        checks += 3
        for plan in ({"dp": 2}, {"pp": 2}):
            label = "cnn %s on 2 GPUs" % json.dumps(plan)
            if n < 2:
                print("not run: %s (%d visible)" % (label, n))
                continue
            out = os.path.join(w, "cnn-%s-cuda" % "-".join("%s%s" % kv for kv in plan.items()))
            compile_(carve, onnx, plan, "cuda", out)
            losses = train(carve, out, 2, data, out + ".ckpt")
            d, gap, name = against(runs["cuda"], losses, load_checkpoint(out + ".ckpt"),
                                   label + " against 1 GPU", rtol=PARALLEL_RTOL)
            print("ok: %s within %.2g of 1 GPU (weights within %.2g, %s)" % (label, d, gap, name))
            checks += 1
        return checks
    if n < 2:
        print("not run: cnnbn dp=2 sync_batch_norm on 2 GPUs (%d visible)" % n)
        return checks
    out = os.path.join(w, "cnnbn-dp2-sync-cuda")
    compile_(carve, onnx, {"dp": 2, "sync_batch_norm": True}, "cuda", out)
    losses = train(carve, out, 2, data, out + ".ckpt")
    d, gap, name = against(runs["cuda"], losses, load_checkpoint(out + ".ckpt"),
                           "cnnbn dp=2 sync_batch_norm on 2 GPUs against 1 GPU",
                           rtol=PARALLEL_RTOL)
    print("ok: cnnbn dp=2 sync_batch_norm on 2 GPUs within %.2g of 1 GPU (weights and running "
          "statistics within %.2g, %s)" % (d, gap, name))
    return checks + 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--carve", required=True)
    ap.add_argument("--models", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--emulated", help="build/lib/carve-runtime-emu.txt: run on the CPU "
                    "emulation of tests/gpu-emu")
    ap.add_argument("--phase", choices=["all", "prepare", "device"], default="all",
                    help="prepare: compile and run the CPU programs here; device: run the "
                    "CUDA programs of a prepared workdir and compare (no carve needed)")
    a = ap.parse_args()
    global EMULATED, STEPS, PHASE, CARVE
    PHASE, CARVE = a.phase, a.carve
    if PHASE != "all" and a.emulated:
        ap.error("--phase prepare/device is for a real GPU, not --emulated")
    if a.emulated:
        EMULATED = os.path.abspath(a.emulated)
        STEPS = EMU_STEPS
        os.environ["ASAN_OPTIONS"] = "detect_leaks=0"
        os.environ["CARVE_EMU_GPUS"] = str(EMU_GPUS)
        print("train-vs-cpu: on the CPU emulation of the CUDA target (%s), %d steps per run" %
              (EMULATED, STEPS))
    n = gpus()
    if n == 0:
        print("train-vs-cpu: SKIPPED: no GPU visible (nvidia-smi -L); the CUDA training step was "
              "not checked")
        return 77
    if PHASE != "device":
        shutil.rmtree(a.workdir, ignore_errors=True)
        os.makedirs(a.workdir)
    elif not os.path.isdir(a.workdir):
        raise Failure("%s: no prepared workdir (run --phase prepare first)" % a.workdir)
    w = a.workdir
    data_gen = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "e2e",
                            "data_gen.py")
    checks = 0
    one_rank = {}  # (model, precision) -> the 1-rank GPU program's losses
    fp32_runs = {}  # model -> {"cpu": ..., "cuda": ...} of its fp32 programs
    for model in ["gpt", "llama", "gpt_tanh"]:
        onnx = os.path.join(a.models, "opset17", model + ".onnx")
        data = os.path.join(w, model + ".tokens")
        if PHASE != "device":
            subprocess.run([sys.executable, data_gen, "tokens", "--model", onnx, "--tokens",
                            "16384", data], check=True, stdout=subprocess.DEVNULL)
        # The GPT with the tanh GELU (GPT-2's): bf16 only, where GELU is
        # applied by the input projection's GEMM (matmul16_bias_gelu,
        # cuBLASLt's GELU_AUX_BIAS) and its gradient computed by the output
        # projection's data-gradient GEMM (matmul16_dgelu, DGELU; 1.'s bf16
        # bound).
        tanh = model == "gpt_tanh"
        for precision, rtol in ([("bf16", BF16_RTOL)] if tanh else
                                [("fp32", FP32_RTOL), ("bf16", BF16_RTOL)]):
            with going_on():
                runs = {}
                for target in ["cpu", "cuda"]:
                    out = os.path.join(w, "%s-%s-%s" % (model, precision, target))
                    compile_(a.carve, onnx, {"precision": precision}, target, out)
                    if tanh and target == "cuda" and PHASE != "device":
                        with open(os.path.join(out, "src", "program0.cu")) as f:
                            src = f.read()
                        for call in ("matmul16_bias_gelu", "matmul16_dgelu"):
                            calls = src.count("gpu::%s(" % call)
                            if calls != 2:  # one per layer
                                raise Failure("gpt_tanh bf16: %d %s calls in the CUDA program, "
                                              "not 2 (one per layer)" % (calls, call))
                    losses = train(a.carve, out, 1, data, out + ".ckpt")
                    runs[target] = (losses, load_checkpoint(out + ".ckpt"))
                out = os.path.join(w, "%s-%s-cuda" % (model, precision))
                if pending(runs["cuda"][0]):
                    continue
                d = worst_rel(runs["cpu"][0], runs["cuda"][0])
                if d > rtol:
                    raise Failure("%s %s: GPU losses differ from the CPU's by %.3g relative "
                                  "(limit %g)\n  cpu %s\n  gpu %s"
                                  % (model, precision, d, rtol, runs["cpu"][0], runs["cuda"][0]))
                gap, name = weight_gap(runs["cpu"][1], runs["cuda"][1])
                if precision == "fp32" and gap > WEIGHT_RTOL:
                    raise Failure("%s fp32: weights of %s differ by %.3g of their largest "
                                  "entry (limit %g)" % (model, name, gap, WEIGHT_RTOL))
                print("ok: %s %s: GPU within %.2g of the CPU over %d steps; weights within %.2g "
                      "(%s)" % (model, precision, d, STEPS, gap, name))
                checks += 2
                one_rank[(model, precision)] = runs["cuda"][0]
                if tanh:
                    continue
                if precision == "fp32":
                    fp32_runs[model] = runs
                check_graph(a.carve, out, 1, data, runs["cuda"][0], runs["cuda"][1],
                            "%s %s" % (model, precision))
                checks += 1
                if (model, precision) == ("gpt", "fp32"):
                    check_profile(out, data)
                    checks += 1
                    checks += check_eval(a.carve, w, model, data, runs["cuda"][0])
        # tf32: the GPT's fp32 program with its GEMMs through TF32 (1. of the
        # docstring's list, the plan field): against the CPU's fp32 within
        # TF32_RTOL, and not the GPU's fp32 losses (the rounding took effect).
        if model == "gpt" and model in fp32_runs:
            with going_on():
                out = os.path.join(w, "gpt-tf32-cuda")
                compile_(a.carve, onnx, {"tf32": True}, "cuda", out)
                if PHASE != "device":
                    with open(os.path.join(out, "src", "program0.cu")) as f:
                        if "gpu::setTf32(true);" not in f.read():
                            raise Failure("gpt tf32: src/program0.cu never calls setTf32(true)")
                losses = train(a.carve, out, 1, data, out + ".ckpt")
                if not pending(losses):
                    d = worst_rel(fp32_runs[model]["cpu"][0], losses)
                    if d > TF32_RTOL:
                        raise Failure("gpt tf32: GPU losses differ from the CPU's fp32 by %.3g "
                                      "relative (limit %g)\n  cpu %s\n  gpu %s"
                                      % (d, TF32_RTOL, fp32_runs[model]["cpu"][0], losses))
                    if losses == fp32_runs[model]["cuda"][0]:
                        raise Failure("gpt tf32: the losses are the fp32 GPU program's, bit for "
                                      "bit: the GEMMs did not round to TF32")
                    print("ok: gpt tf32: GPU within %.2g of the CPU's fp32 over %d steps (limit "
                          "%g), and not the GPU's fp32 losses" % (d, STEPS, TF32_RTOL))
                    checks += 1
        # fp16: the loss scale (the seed, set outside the captured graph) changes
        # between steps; at 2^24 the first steps overflow and are skipped.
        with going_on():
            out = os.path.join(w, "%s-fp16-cuda" % model)
            compile_(a.carve, onnx, {"precision": "fp16"}, "cuda", out)
            scale = ["--loss-scale", "16777216"]
            graph = train(a.carve, out, 1, data, out + ".ckpt", scale)
            check_graph(a.carve, out, 1, data, graph, load_checkpoint(out + ".ckpt"),
                        "%s fp16 from loss scale 2^24" % model, scale)
            checks += 0 if pending(graph) else 1

    with going_on():
        checks += check_masked_attention(a.carve, w, a.models, data_gen, one_rank)
    with going_on():
        checks += check_custom_op(a.carve, w, data_gen)
    with going_on():
        checks += check_dropout(a.carve, w, data_gen, 1 if PHASE != "all" else n)
    for kind in ["cnn", "cnnbn"]:
        with going_on():
            checks += check_convolution(a.carve, w, kind, 1 if PHASE != "all" else n)

    if PHASE != "all" and n >= 2:
        print("--phase %s: one rank per program (no mpirun on the GPU machine)" % PHASE)
        n = 1
    if n >= 2:
        for model, precision, rtol in [("gpt", "fp32", PARALLEL_RTOL),
                                       ("gpt", "bf16", BF16_PARALLEL_RTOL),
                                       ("llama", "bf16", BF16_PARALLEL_RTOL),
                                       ("gpt_tanh", "bf16", BF16_PARALLEL_RTOL),
                                       ("bert", "bf16", BF16_PARALLEL_RTOL)]:
            onnx = os.path.join(a.models, "opset17", model + ".onnx")
            data = os.path.join(w, model + (".st" if model == "bert" else ".tokens"))
            one = one_rank.get((model, precision))
            if one is None:
                print("not run: %s %s on 2 GPUs (its 1-GPU run failed above)" % (model, precision))
                continue
            for name, plan in [("dp2", {"dp": 2}), ("tp2", {"tp": 2}),
                               ("pp2", {"pp": 2, "num_micro_batches": 2})]:
                label = "%s %s %s on 2 GPUs" % (model, precision, name)
                out = os.path.join(w, "%s-%s-%s-cuda" % (model, precision, name))
                compile_(a.carve, onnx, dict(plan, precision=precision), "cuda", out)
                losses = train(a.carve, out, 2, data, out + ".ckpt")
                d = worst_rel(one, losses)
                if d > rtol:
                    raise Failure("%s: losses differ from 1 GPU by %.3g (limit %g)\n  1 GPU  %s"
                                  "\n  2 GPUs %s" % (label, d, rtol, one, losses))
                print("ok: %s within %.2g of 1 GPU" % (label, d))
                checks += 1
                if name != "pp2":
                    check_graph(a.carve, out, 2, data, losses, load_checkpoint(out + ".ckpt"),
                                label)
                    checks += 1
    else:
        print("not run: dp=2, tp=2 and pp=2 on 2 GPUs (this machine has %d GPU)" % n)
    if n >= 2:
        mdir = os.path.join(w, "gpt4")
        subprocess.run([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                     "..", "..", "models", "export.py"),
                        "gpt", "--out", mdir, "--config", '{"n_head": 4, "n_layer": 4}'],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        onnx = os.path.join(mdir, "gpt.onnx")
        data = os.path.join(w, "gpt.tokens")
        runs = {}
        for name, plan, ranks in [("1", {"dp": 1}, 1),
                                  ("interleaved", {"pp": 2, "virtual_stages": 2,
                                                   "num_micro_batches": 4,
                                                   "schedule": "interleaved"}, 2)]:
            out = os.path.join(w, "gpt4-%s-cuda" % name)
            compile_(a.carve, onnx, plan, "cuda", out)
            runs[name] = train(a.carve, out, ranks, data, out + ".ckpt")
        d = worst_rel(runs["1"], runs["interleaved"])
        if d > PARALLEL_RTOL:
            raise Failure("gpt (4 layers) interleaved pp2 x 2 on 2 GPUs: losses differ from 1 GPU "
                          "by %.3g (limit %g)\n  1 GPU  %s\n  2 GPUs %s"
                          % (d, PARALLEL_RTOL, runs["1"], runs["interleaved"]))
        print("ok: gpt (4 layers) interleaved pp=2 x 2 virtual stages on 2 GPUs within %.2g of "
              "1 GPU" % d)
        checks += 1
    if n >= 4:
        onnx = os.path.join(a.models, "opset17", "mlp.onnx")
        data = os.path.join(w, "mlp.safetensors")
        subprocess.run([sys.executable, data_gen, "tensors", "--model", onnx, "--name", "mlp",
                        "--steps", "8", data], check=True, stdout=subprocess.DEVNULL)
        runs = {}
        for name, plan, ranks in [("1", {"dp": 1}, 1), ("pp4", {"pp": 4, "num_micro_batches": 4}, 4)]:
            out = os.path.join(w, "mlp-%s-cuda" % name)
            compile_(a.carve, onnx, plan, "cuda", out)
            runs[name] = train(a.carve, out, ranks, data, out + ".ckpt")
        d = worst_rel(runs["1"], runs["pp4"])
        if d > PARALLEL_RTOL:
            raise Failure("mlp pp4 on 4 GPUs: losses differ from 1 GPU by %.3g (limit %g)\n"
                          "  1 GPU  %s\n  4 GPUs %s" % (d, PARALLEL_RTOL, runs["1"], runs["pp4"]))
        print("ok: mlp fp32 pp4 on 4 GPUs within %.2g of 1 GPU" % d)
        checks += 1
    else:
        print("not run: mlp pp=4 on 4 GPUs (this machine has %d GPU(s))" % n)

    # Start-up failures.
    data = os.path.join(w, "gpt.tokens")
    dynamic = os.path.join(a.models, "dynamic", "gpt.onnx")
    big = os.path.join(w, "gpt-huge")
    # 2^22 sequences: an arena of about 313 GiB (2^20 gives 78 GiB, which an H200 holds).
    compile_(a.carve, dynamic, {"dp": 1}, "cuda", big, ["--set-dim", "batch=4194304"])
    with going_on():
        if PHASE != "prepare":
            rc, so, se = run_train(big, 1, ["--steps", "1", "--data", data], timeout=300)
            if rc == 0 or "free" not in se or "needs" not in se:
                raise Failure("a plan too large for the GPU: expected one line about memory, got "
                              "%d:\n%s%s" % (rc, so, se))
            print("ok: too little GPU memory: %s" % se.strip().splitlines()[-1])
            checks += 1
    if PHASE != "all":
        print("not run: more ranks than GPUs (--phase %s: no mpirun on the GPU machine)" % PHASE)
        return summary(checks)
    many = os.path.join(w, "gpt-many")
    compile_(a.carve, dynamic, {"dp": n + 1}, "cuda", many, ["--set-dim",
                                                             "batch=%d" % (4 * (n + 1))])
    rc, so, se = run([a.carve, "run", many, "-n", str(n + 1), "--", "--steps", "1", "--data",
                      data], timeout=300)
    if rc == 0 or "GPU" not in se or "visible" not in se:
        raise Failure("%d ranks on %d GPU(s): expected one line about it, got %d:\n%s%s" %
                      (n + 1, n, rc, so, se))
    print("ok: more ranks than GPUs: %s" % se.strip().splitlines()[-1])
    checks += 1
    return summary(checks)


def summary(checks):
    """The last line, and the exit status: 1 if any check failed."""
    if FAILURES:
        print("train-vs-cpu: %d checks passed, %d FAILED:" % (checks, len(FAILURES)))
        for f in FAILURES:
            print("  FAIL: %s" % f)
        return 1
    print("train-vs-cpu: %d checks passed%s" % (
        checks, " (CPU side prepared; the CUDA programs run in --phase device)"
        if PHASE == "prepare" else ""))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Failure as e:
        print("FAIL: %s" % e)
        sys.exit(1)
