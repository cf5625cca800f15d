#!/usr/bin/env python3
"""The GPU cost model against the emulated GPU: what it says a step launches is what runs.

For each program below, `carve compile --target cuda --gpu-model REPORT` writes what the
model (compiler/lower/GpuCost.cpp) reads off the lowered IR: the launches of one training
step per kernel and the GEMMs' FLOPs. The same program, built against the CPU emulation
of the CUDA runtime (tests/gpu-emu), trains 2 steps with CARVE_GPU_PROFILE=shapes, whose
table counts every kernel launch and every cuBLAS GEMM (with its shape) of step 2. The
two must agree exactly: the same kernels, each launched as often, and the same GEMM
FLOPs. Programs: a GPT in fp32 and bf16 (layer norm, GELU, causal attention, fused
chains, AdamW with fp32 masters), the GPT with the tanh GELU in bf16 (GELU and its
gradient in the GEMMs' cuBLASLt epilogues), a Llama-style decoder in bf16 (RMS norm, SwiGLU,
rotary, grouped-query attention), a BERT-style encoder in bf16 (its padding mask cuDNN's
16-bit bias), the GPT under SGD with momentum, and a small CNN
exported with PyTorch in fp32 and bf16 (its convolutions cuDNN's, forward and gradients:
the convolution class; batch norm's general reductions) and in fp32 with
`--convolution carve` (im2col gathers computed inside their GEMMs).

The bf16 programs' attention is cuDNN's fused flash attention (attention_stats_cudnn,
run by tests/gpu-emu's cuDNN emulation); the GPT in bf16 is also checked compiled with
`--attention carve` (carve's kernel), and its cuDNN program is run again with the
emulated cuDNN refusing every graph (CARVE_EMU_CUDNN=unsupported): it must say so once
per shape and call, and train to the `--attention carve` program's losses (its fallback
is that kernel, reading and writing the 16-bit tensors the program keeps: the first loss
equal, the second within the effect of those roundings; check_cudnn_fallback says why).

Then the bad inputs: --gpu-model without --target cuda, and on a pipelined plan (the
model prices one-stage programs): one line naming the cause, exit 1, no report and no
output directory written.

Without the CUDA toolkit (no --emulated) the programs cannot be built: the script says
so and exits 77, which ctest reports as skipped.
"""

import argparse
import json
import os
import re
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from data_gen import write_tokens  # noqa: E402
import harness  # noqa: E402

GPT = "builtin:gpt:layers=2,hidden=64,heads=4,seq=16,vocab=128,batch=8"
LLAMA = "builtin:llama:layers=2,hidden=64,heads=4,kv_heads=2,seq=16,vocab=128,batch=4"
ROW = re.compile(r"^\s*([\d.]+)\s+([\d.]+)\s+(\d+)\s+([\d.]+)\s\s(.+)$")
GEMM = re.compile(r"^cuBLAS GEMM, .* m (\d+) n (\d+) k (\d+) x (\d+)$")


Failure = harness.Failure


def run(cmd, env=None, timeout=900):
    return harness.run(cmd, timeout=timeout, env=env)


def profile_table(stderr):
    """The CARVE_GPU_PROFILE table: launches per kernel (template arguments left out,
    GEMMs as one 'cuBLAS GEMM' row) and the GEMMs' FLOPs."""
    lines = stderr.splitlines()
    head = [i for i, l in enumerate(lines) if "GPU time by kernel (CARVE_GPU_PROFILE)" in l]
    if len(head) != 1:
        raise Failure("expected one CARVE_GPU_PROFILE table, got %d:\n%s" % (len(head), stderr))
    if "over 1 step from step 2" not in lines[head[0]]:
        raise Failure("the table does not cover step 2 alone: " + lines[head[0]])
    counts, flops = {}, 0
    for line in lines[head[0] + 2:]:
        m = ROW.match(line)
        if not m:
            break
        calls, name = int(m.group(3)), m.group(5).strip()
        g = GEMM.match(name)
        if g:
            mm, nn, kk, batch = (int(x) for x in g.groups())
            flops += 2 * mm * nn * kk * batch * calls
            name = "cuBLAS GEMM"
        elif name.startswith("cuBLAS GEMM"):
            raise Failure("a GEMM row without its shape (CARVE_GPU_PROFILE=shapes?): " + name)
        name = re.sub(r"<.*>$", "", name)
        counts[name] = counts.get(name, 0) + calls
    if not counts:
        raise Failure("the CARVE_GPU_PROFILE table has no rows:\n" + stderr)
    return counts, flops


def check_program(a, name, model, plan, extra, data):
    out = os.path.join(a.workdir, name)
    report = out + ".gpu.json"
    plan_path = out + ".plan.json"
    with open(plan_path, "w") as f:
        json.dump(plan, f)
    env = dict(os.environ, CARVE_CUDA_EMULATION=a.emulated)
    rc, so, se = run([a.carve, "compile", model, "--target", "cuda", "--plan", plan_path,
                      "-o", out, "--gpu-model", report, "--quiet"] + extra, env=env)
    if rc != 0:
        raise Failure("%s: carve compile failed:\n%s%s" % (name, so, se))
    with open(report) as f:
        r = json.load(f)
    if r["unpriced"]:
        raise Failure("%s: the model left calls unpriced: %s" % (name, r["unpriced"]))
    env = dict(os.environ, CARVE_GPU_PROFILE="shapes", ASAN_OPTIONS="detect_leaks=0")
    rc, so, se = run([os.path.join(out, "bin", "train"), "--steps", "2", "--data", data,
                      "--progress", "none"], env=env)
    if rc != 0:
        raise Failure("%s: training failed:\n%s%s" % (name, so, se))
    cudnn = sum(v for k, v in r["launches_by_kernel"].items()
                if k.startswith("cuDNN flash attention"))
    want_cudnn = (plan.get("precision") in ("bf16", "fp16") and "--attention" not in extra
                  and not name.startswith("cnn"))
    if (cudnn > 0) != want_cudnn:
        raise Failure("%s: %d cuDNN attention calls a step, expected %s"
                      % (name, cudnn, "some" if want_cudnn else "none"))
    conv = sum(v for k, v in r["launches_by_kernel"].items()
               if k.startswith("cuDNN convolution"))
    want_conv = name.startswith("cnn") and "--convolution" not in extra
    if (conv > 0) != want_conv:
        raise Failure("%s: %d cuDNN convolution calls a step, expected %s"
                      % (name, conv, "some" if want_conv else "none"))
    ran, ran_flops = profile_table(se)
    model = r["launches_by_kernel"]
    diff = ["%s: model %d, ran %d" % (k, model.get(k, 0), ran.get(k, 0))
            for k in sorted(set(model) | set(ran)) if model.get(k, 0) != ran.get(k, 0)]
    if diff:
        raise Failure("%s: the model's launches differ from the emulated step's:\n  %s"
                      % (name, "\n  ".join(diff)))
    if r["gemm_flops"] != ran_flops:
        raise Failure("%s: GEMM FLOPs: model %d, ran %d" % (name, r["gemm_flops"], ran_flops))
    total = sum(ran.values())
    h100 = r["predictions"]["h100"]
    if h100["launches"] != total:
        raise Failure("%s: the prediction counts %d launches, the step ran %d"
                      % (name, h100["launches"], total))
    print("ok   %s: %d launches of %d kernels and %.3g GEMM FLOPs a step, as the emulated GPU "
          "ran them (predicted on an H100: %.3f ms)"
          % (name, total, len(ran), ran_flops, h100["ms"]), flush=True)


def train_losses(out, data, env):
    log = out + ".log.jsonl"
    if os.path.exists(log):
        os.remove(log)
    rc, so, se = run([os.path.join(out, "bin", "train"), "--steps", "2", "--data", data,
                      "--log", log, "--progress", "none"], env=env)
    if rc != 0:
        raise Failure("%s: training failed:\n%s%s" % (out, so, se))
    with open(log) as f:
        return [json.loads(l)["loss"] for l in f if '"loss"' in l], se


def check_cudnn_fallback(a, data):
    """The cuDNN program where cuDNN refuses every graph: carve's kernel.

    Its forward is the --attention carve program's bit for bit (carve's kernel writes O in
    f32, rounded into the same 16-bit copy), so the first loss is equal. Its backward is
    carve's kernel too, but reading o, and writing dq, dk and dv, in the 16-bit tensors
    the program keeps (carve-fold-views: O's transpose and the QKV gradient's concat are
    written in place), where the --attention carve program keeps them in f32: o enters
    the row sums D rounded, and the QKV bias gradient sums rounded gradients (its matmuls
    round both programs' alike). Those roundings (relative u = 2^-8 each) reach the
    second loss only through AdamW's first update, lr * g / |g| per element, which they
    change only where they flip a gradient element's sign. The second losses must agree
    to 1e-4 relative: the measured difference is about 7e-6, and the first update itself
    moves the loss by about 1e-3 relative, so gradients written in the wrong places (a
    q, k or v exchanged) would not pass."""
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0")
    want, _ = train_losses(os.path.join(a.workdir, "gpt-bf16-carve-attention"), data, env)
    got, se = train_losses(os.path.join(a.workdir, "gpt-bf16"), data,
                           dict(env, CARVE_EMU_CUDNN="unsupported"))
    for call in ("attention_stats_cudnn", "attention_grad_stats_cudnn"):
        said = [l for l in se.splitlines() if l.startswith("carve: " + call + " [")]
        if len(said) != 1 or "cuDNN flash attention refused" not in said[0] \
                or "carve's kernel runs" not in said[0]:
            raise Failure("gpt-bf16 with cuDNN refusing: expected one refusal line for %s, got "
                          "%r:\n%s" % (call, said, se))
    if len(want) != 2 or len(got) != 2 or got[0] != want[0] \
            or abs(got[1] - want[1]) > 1e-4 * abs(want[1]):
        raise Failure("gpt-bf16 with cuDNN refusing trained to %r, the --attention carve "
                      "program to %r (the first loss must be equal, the second within 1e-4 "
                      "relative)" % (got, want))
    print("ok   gpt-bf16 with the emulated cuDNN refusing every graph: one line per call says "
          "so; its losses %r, the --attention carve program's %r (the first equal, the second "
          "within 1e-4 relative)" % (got, want), flush=True)


def cnn_model(a):
    """A small CNN as PyTorch writes it: Conv2d, BatchNorm2d, ReLU, MaxPool2d, Linear."""
    import torch
    import torch.nn as nn
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "models"))
    from export import export_for_carve

    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1 = nn.Conv2d(3, 8, 3, padding=1)
            self.bn = nn.BatchNorm2d(8)
            self.c2 = nn.Conv2d(8, 8, 3, padding=1)
            self.pool = nn.MaxPool2d(2)
            self.fc = nn.Linear(8 * 4 * 4, 10)

        def forward(self, x, y):
            x = self.pool(torch.relu(self.bn(self.c1(x))))
            x = torch.relu(self.c2(x))
            return nn.functional.cross_entropy(self.fc(torch.flatten(x, 1)), y)

    path = os.path.join(a.workdir, "cnn.onnx")
    example = (torch.zeros(4, 3, 8, 8), torch.zeros(4, dtype=torch.int64))
    export_for_carve(Net().train(), example, path, input_names=["x", "y"])
    return path


def bert_model(a):
    """The BERT-style reference encoder (models/reference.py), exported, and two steps of
    its inputs (an attention mask with padded rows): its attention's padding mask is
    cuDNN's 16-bit bias, written by maskBias16Kernel before each call."""
    import subprocess
    import data_gen
    root = os.path.dirname(os.path.dirname(HERE))
    out = os.path.join(a.workdir, "bert")
    subprocess.run([sys.executable, os.path.join(root, "models", "export.py"), "bert", "--out",
                    out], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    onnx = os.path.join(out, "bert.onnx")
    data = os.path.join(a.workdir, "bert.safetensors")
    data_gen.main(["tensors", data, "--model", onnx, "--name", "bert", "--steps", "2"])
    return onnx, data


def check_bad_inputs(a):
    cases = [
        ("cpu target", [GPT, "--target", "cpu"], "--gpu-model prices CUDA programs"),
        ("pipeline", [GPT, "--target", "cuda", "--plan", os.path.join(a.workdir, "pp2.json"),
                      "--no-build", "--no-weights"], "one-stage programs"),
    ]
    with open(os.path.join(a.workdir, "pp2.json"), "w") as f:
        json.dump({"pp": 2}, f)
    for name, args, want in cases:
        out = os.path.join(a.workdir, "bad")
        report = os.path.join(a.workdir, "bad.gpu.json")
        for p in (out, report):
            if os.path.exists(p):
                shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
        env = dict(os.environ, CARVE_CUDA_EMULATION=a.emulated)
        rc, so, se = run([a.carve, "compile"] + args + ["-o", out, "--gpu-model", report],
                         env=env)
        errors = [l for l in se.splitlines() if l.startswith("carve: error")]
        if rc != 1 or len(errors) != 1 or want not in errors[0]:
            raise Failure("%s: expected exit 1 and one error with %r, got %d:\n%s%s"
                          % (name, want, rc, so, se))
        if os.path.exists(out) or os.path.exists(report):
            raise Failure("%s: the failed compile left %s behind"
                          % (name, out if os.path.exists(out) else report))
        print("ok   bad input (%s): %s" % (name, errors[0]), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--carve", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--emulated", help="build/lib/carve-runtime-emu.txt (CUDA on the CPU)")
    a = ap.parse_args()
    if not a.emulated:
        print("SKIPPED: no CUDA toolkit at configure time, so no emulated GPU to check the "
              "GPU model against; nothing was checked")
        return 77
    os.makedirs(a.workdir, exist_ok=True)
    import numpy as np
    data = os.path.join(a.workdir, "tokens.bin")
    write_tokens(data, np.random.default_rng(0).integers(0, 128, 20000))
    try:
        check_program(a, "gpt-fp32", GPT, {}, [], data)
        check_program(a, "gpt-bf16", GPT, {"precision": "bf16"}, [], data)
        # GPT-2's tanh GELU: GELU and its gradient in the GEMMs' cuBLASLt
        # epilogues (matmul16_bias_gelu, matmul16_dgelu).
        check_program(a, "gpt-tanh-bf16", GPT + ",gelu_tanh=1", {"precision": "bf16"}, [], data)
        check_program(a, "gpt-bf16-carve-attention", GPT, {"precision": "bf16"},
                      ["--attention", "carve"], data)
        check_cudnn_fallback(a, data)
        check_program(a, "gpt-sgd", GPT, {}, ["--optimizer", "sgd", "--momentum", "0.9"], data)
        check_program(a, "llama-bf16", LLAMA, {"precision": "bf16"}, [], data)
        bert, bert_data = bert_model(a)
        check_program(a, "bert-bf16", bert, {"precision": "bf16"}, [], bert_data)
        cnn = cnn_model(a)
        images = os.path.join(a.workdir, "images.safetensors")
        make_images(images)
        check_program(a, "cnn-fp32", cnn, {}, [], images)
        check_program(a, "cnn-bf16", cnn, {"precision": "bf16"}, [], images)
        check_program(a, "cnn-fp32-im2col", cnn, {}, ["--convolution", "carve"], images)
        check_bad_inputs(a)
    except Failure as e:
        print("FAIL " + str(e))
        return 1
    print("gpu_model: all checks passed")
    return 0


def make_images(path):
    """Two steps' batches of 4 images [3, 8, 8] and their classes (docs/data.md)."""
    import numpy as np
    import st
    rng = np.random.default_rng(1)
    st.save(path, {"x": rng.standard_normal((2, 4, 3, 8, 8)).astype(np.float32),
                   "y": rng.integers(0, 10, (2, 4)).astype(np.int64)})


if __name__ == "__main__":
    sys.exit(main())
