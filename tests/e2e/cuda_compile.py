#!/usr/bin/env python3
"""`carve compile --target cuda`: the generated CUDA programs compile and link.

What must hold wherever the CUDA target is built (nvcc, cuBLAS and NCCL found
at configure time; no GPU needed):

1. The GPT- and Llama-style reference models compile with --target cuda under
   dp=2, tp=2 (with sequence parallelism for the GPT) and pp=2 (two
   micro-batches) plans, in fp32, bf16 and fp16, two of them with full
   activation recomputation (the recomputed ops are ordinary ops and fused
   groups) and one with ZeRO-3 and prefetched gathers (asynchronous
   all-gathers inside the captured forward and backward): nvcc builds each
   OUT/src/programN.cu and the link gives OUT/bin/train.
2. The sources are the CUDA target's: they use carve::gpu, point the Program
   at kCudaTarget, keep constants in managed memory, and set the plan's
   precision; their elementwise chains are fused into kernels the program
   defines (gpu_fused.cuh); the gradient norm is summed on the device and
   read once; OUT/plan.json records target and precision. The forward and
   backward (what train --cuda-graph captures) are a function of their own,
   called once through gpu::graphStep, that reads no per-step host value
   (loss scale, step, learning rate), never waits on the host and waits for
   every collective it starts; pipeline stages are not captured.
3. bin/train holds device code for exactly the architectures asked for
   (its fat binaries, read with objcopy: sm_80 and sm_90 by default; the
   program's alone sm_90 with --cuda-arch 90) and needs cuBLAS, NCCL and the
   CUDA runtime.
4. On a machine without a GPU the program stops at start-up with one line
   naming the rank and the cause (no CUDA device visible), exit 1, no hang —
   for 1 rank and for 2 (every rank agrees before any work).
5. Bad input: an unknown target, a malformed --cuda-arch, --cuda-arch
   without --target cuda each exit 1 with one 'carve: error:' line and leave
   no output behind.
6. Custom ops: the Llama with the fused SwiGLU of models/custom/ compiles
   under tp=2 with the rules file's CUDA kernels (swiglu.cu, built by nvcc for
   the same architectures): the program calls them on this rank's shapes
   (the hidden dimension halved) with the compute stream, checks each launch
   naming the op, and does so inside the captured forwardBackward. A rules
   file without a "cuda" section, a CUDA kernel that does not compile and a
   kernel name the sources do not define are each one error line naming the
   op or file, with no output left behind.

7. GELU under bf16: `carve compile` says which GELUs and GELU gradients run
   in their GEMMs' cuBLASLt epilogues and what that does to the numbers
   (a GPT with the tanh GELU: GELU_AUX_BIAS and DGELU, one per layer), that
   the erf form runs as carve's kernels and why, and that tanh GELUs whose
   rows are not a multiple of 8 do too; the notes match the calls the
   program makes; --quiet and fp32 plans say nothing of GELU.

Where the CUDA target is not built, the test says so and exits 77 (ctest
reports it as skipped, never as passed).
"""

import argparse
import copy
import json
import os
import re
import shutil
import struct
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen_source  # noqa: E402
import harness  # noqa: E402

PLANS = {
    "dp2": {"dp": 2},
    "tp2": {"tp": 2},
    "pp2": {"pp": 2, "num_micro_batches": 2},
}
# (model, plan, precision): every plan on both models, each precision somewhere.
CASES = [
    ("gpt", "dp2", "bf16"),
    ("gpt", "tp2", "fp32"),
    ("gpt", "pp2", "fp16"),
    ("llama", "dp2", "fp32"),
    ("llama", "tp2", "bf16"),
    ("llama", "pp2", "bf16"),
]
# Cases compiled with "recompute": "full": the whole step and pipeline stages.
RECOMPUTE = {("gpt", "dp2"), ("llama", "pp2")}
# Cases compiled with ZeRO-3 and zero3_prefetch_layers = 1.
PREFETCH = {("llama", "dp2")}
# Pipeline cases on dp2 x pp2 with ZeRO-2 or 3 (per micro-batch reduce-scatters
# into chunk accumulators; ZeRO-3 also gathers inside each stage's passes).
PIPE_ZERO = {("gpt", "pp2"): 2, ("llama", "pp2"): 3}
TIMEOUT_S = 600


Failure = harness.Failure


def runtime_config(path):
    cfg = {}
    with open(path) as f:
        for line in f:
            if "=" in line:
                k, v = line.rstrip("\n").split("=", 1)
                cfg[k] = v
    return cfg


def run(cmd, timeout=TIMEOUT_S):
    return harness.run(cmd, timeout=timeout)


def expect_error(cmd, needle, out):
    rc, so, se = run(cmd)
    lines = [l for l in se.splitlines() if l.strip()]
    if rc == 0 or not lines or not lines[-1].startswith("carve: error:") or needle not in se:
        raise Failure("%s: expected exit 1 with an error about %r, got %d:\n%s%s" %
                      (" ".join(cmd), needle, rc, so, se))
    if os.path.exists(out):
        raise Failure("%s failed but left %s behind" % (" ".join(cmd), out))


def fatbins(binary, workdir):
    """The sm architectures of the device code (ELF cubins) in each fat binary
    of `binary`'s .nv_fatbin section: one set per linked CUDA object group.
    The section is read with objcopy and its fat-binary headers parsed (magic
    0xBA55ED50; per entry: kind 2 = cubin, the architecture at byte 28)."""
    raw = os.path.join(workdir, "fatbin.bin")
    rc, so, se = run(["objcopy", "-O", "binary", "--only-section=.nv_fatbin", binary, raw])
    if rc != 0:
        raise Failure("objcopy could not read %s's .nv_fatbin: %s" % (binary, se))
    data = open(raw, "rb").read()
    os.remove(raw)
    sets, off = [], 0
    while off + 16 <= len(data):
        magic, _, hsz, fsz = struct.unpack_from("<IHHQ", data, off)
        if magic != 0xBA55ED50:
            raise Failure("%s: unexpected fat binary header at byte %d" % (binary, off))
        e, end, archs = off + hsz, off + hsz + fsz, set()
        while e < end:
            kind, _, ehsz, size = struct.unpack_from("<HHIQ", data, e)
            if kind == 2:
                archs.add("sm_%d" % struct.unpack_from("<I", data, e + 28)[0])
            e += ehsz + size
        sets.append(archs)
        off = end
    if not sets:
        raise Failure("%s holds no device code" % binary)
    return sets


def check_graph_split(text, where, pipelined):
    """The forward and backward that train --cuda-graph captures: their own
    function, called once through gpu::graphStep, reading no value of the
    host's that changes between steps (a captured graph would replay the
    first one), never waiting on the host, and waiting for every collective
    it starts (a graph must join the collectives' stream back)."""
    if pipelined:
        if "graphStep" in text:
            raise Failure("%s: a pipeline stage's program calls graphStep" % where)
        return
    begin = text.find("void forwardBackward(StepContext &ctx) {")
    end = text.find("\n}\n", begin)
    if begin < 0 or end < 0 or text.count("gpu::graphStep(ctx, forwardBackward);") != 1:
        raise Failure("%s: no forwardBackward function run once through gpu::graphStep" % where)
    # What the graph replays: forwardBackward and the functions it calls (forward, the
    # layers' functions).
    body = gen_source.reach(text, "forwardBackward")
    for bad in ["ctx.lossScale", "ctx.step", "ctx.hooks", "ctx.loss", "readScalar",
                "gpu::sumSquares", "allReduce(&", "scheduledLr"]:
        if bad in body:
            raise Failure("%s: forwardBackward, which a CUDA graph replays, uses %r" %
                          (where, bad))
    for handle in re.findall(r"CommHandle (bucket\d+)", body):
        if ("wait(%s)" % handle) not in body and ("&h : %s)" % handle) not in body:
            raise Failure("%s: forwardBackward starts %s and does not wait for it" %
                          (where, handle))
    if "lossScale" in text and "loss_seed" not in body:
        raise Failure("%s: forwardBackward does not declare the loss seed it reads" % where)


def check_custom_ops(carve, workdir):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    custom = os.path.join(root, "models", "custom")
    sys.path.insert(0, custom)
    import swiglu  # needs torch, as the models fixture does
    w = os.path.join(workdir, "custom")
    os.makedirs(w)
    onnx = swiglu.export(w)
    rules_json = json.load(open(os.path.join(custom, "swiglu.json")))
    op = rules_json["ops"][0]
    op["cpu"]["sources"] = [os.path.join(custom, s) for s in op["cpu"]["sources"]]
    op["cuda"]["sources"] = [os.path.join(custom, s) for s in op["cuda"]["sources"]]

    def write(name, value):
        path = os.path.join(w, name)
        with open(path, "w") as f:
            f.write(value if isinstance(value, str) else json.dumps(value))
        return path

    rules = write("swiglu.json", rules_json)
    plan = write("tp2.json", {"tp": 2})
    out = os.path.join(w, "tp2")
    rc, so, se = run([carve, "compile", onnx, "--rules", rules, "--plan", plan, "--target",
                      "cuda", "-o", out, "--quiet"])
    if rc != 0:
        raise Failure("the custom-op model under tp=2 with --target cuda failed (%d):\n%s%s" %
                      (rc, so, se))
    text = open(os.path.join(out, "src", "program0.cu")).read()
    if not os.path.exists(os.path.join(out, "src", "custom", "swiglu.cu")) or \
            os.path.exists(os.path.join(out, "src", "custom", "swiglu.cpp")):
        raise Failure("%s/src/custom/ should hold swiglu.cu (the CUDA kernels) and not "
                      "swiglu.cpp" % out)
    # forwardBackward and what it calls (the forward, the layers' functions).
    body = gen_source.reach(text, "forwardBackward")
    for fn, role in [("swiglu_forward_cuda", "forward"), ("swiglu_backward_cuda", "backward")]:
        calls = re.findall(r"::%s\((.*)\);\n\s*gpu::checkLaunch\(\"carve\.example::SwiGLU "
                           r"\(the user's %s kernel\)\"\);" % (fn, role), body)
        # 2 layers a step (a layer's function prints the call once); each call ends with the
        # compute stream and is followed by its launch check.
        runs = gen_source.step_count(text, "::%s(" % fn, "forwardBackward")
        if runs != 2 or not calls or text.count("::%s(" % fn) != len(calls) or \
                any(not c.endswith("(CarveStream)gpu::computeStream()") for c in calls):
            raise Failure("%s/src/program0.cu: expected 2 calls of %s a step with the compute "
                          "stream, each followed by a launch check naming the op, in "
                          "forwardBackward; found %s, run %d times" % (out, fn, calls, runs))
        if ('extern "C" void %s(' % fn) not in text:
            raise Failure("%s/src/program0.cu does not declare %s" % (out, fn))
    if "swiglu_forward(" in text.replace("swiglu_forward_cuda(", ""):
        raise Failure("%s/src/program0.cu calls the CPU kernel" % out)
    # The gate is [4, 16, 64] (batch, sequence, the Llama's hidden_dim); tp=2 halves the last.
    if "{4, 16, 32}" not in body or "{4, 16, 64}" in body:
        raise Failure("%s/src/program0.cu: the kernels do not get the tp-split shape {4, 16, 32}"
                      % out)
    if not os.access(os.path.join(out, "bin", "train"), os.X_OK):
        raise Failure("%s/bin/train is missing" % out)
    print("ok: custom op under tp=2 with its CUDA kernels: compiled, linked, called with the "
          "compute stream on local shapes inside the captured forward and backward")

    # Bad input.
    cpu_only = copy.deepcopy(rules_json)
    del cpu_only["ops"][0]["cuda"]
    broken = copy.deepcopy(rules_json)
    broken["ops"][0]["cuda"]["sources"] = [write("broken.cu", "__global__ void k() { return 1 +; }\n")]
    undefined = copy.deepcopy(rules_json)
    undefined["ops"][0]["cuda"]["forward"] = "swiglu_fwd_cuda"
    for name, r, needles in [
            ("cpu-only", cpu_only, ["carve.example::SwiGLU", "no CUDA kernels", '"cuda"',
                                    "--target cpu"]),
            ("broken", broken, ["broken.cu", "the CUDA compiler (nvcc) failed"]),
            ("undefined", undefined, ["undefined reference", "swiglu_fwd_cuda", '"cuda"'])]:
        bad = os.path.join(w, "bad-" + name)
        rc, so, se = run([carve, "compile", onnx, "--rules", write(name + ".json", r),
                          "--target", "cuda", "-o", bad, "--quiet"])
        lines = [l for l in se.splitlines() if l.strip()]
        missing = [n for n in needles if n not in se]
        if rc != 1 or len(lines) != 1 or not lines[0].startswith("carve: error:") or missing:
            raise Failure("custom op, %s: expected exit 1 and one error line mentioning %s, got "
                          "%d:\n%s%s" % (name, missing or needles, rc, so, se))
        if os.path.exists(bad):
            raise Failure("custom op, %s: the failed compile left %s behind" % (name, bad))
        print("ok: custom op, %s: %s" % (name, lines[0]))
    return 4


def check_gelu_notes(carve, workdir):
    """7. of the docstring: the GELU notes of bf16 compiles, against the calls."""
    gpt = "builtin:gpt:layers=3,seq=16,vocab=128,batch=2,"
    cases = [  # (model, plan, the notes' first words expected, epilogue calls)
        (gpt + "hidden=64,heads=2,gelu_tanh=1", {"precision": "bf16"},
         ["3 GELUs (the tanh form) applied by their GEMM's cuBLASLt epilogue (GELU_AUX_BIAS)",
          "3 GELU gradients computed by their incoming gradient's GEMM (cuBLASLt's DGELU"], 3),
        (gpt + "hidden=64,heads=2", {"precision": "bf16"},
         ["3 GELUs of the erf form run as carve's kernels (cuBLASLt's GELU epilogues compute "
          "the tanh form"], 0),
        (gpt + "hidden=9,heads=1,gelu_tanh=1", {"precision": "bf16"},
         ["3 tanh GELUs run as carve's kernels (not alone after a GEMM's bias add, rows not a "
          "multiple of 8"], 0),
        (gpt + "hidden=64,heads=2,gelu_tanh=1", {}, [], 0),
    ]
    checks = 0
    for model, plan, want, calls in cases:
        for quiet in (False, True):
            out = os.path.join(workdir, "gelu-notes")
            pj = out + ".plan.json"
            with open(pj, "w") as f:
                json.dump(plan, f)
            cmd = [carve, "compile", model, "--target", "cuda", "--plan", pj, "--no-build",
                   "--no-weights", "-o", out] + (["--quiet"] if quiet else [])
            rc, so, se = run(cmd)
            if rc != 0:
                raise Failure("%s failed:\n%s%s" % (" ".join(cmd), so, se))
            notes = [l[len("carve: note: "):] for l in se.splitlines()
                     if l.startswith("carve: note: ") and "GELU" in l]
            expect = [] if quiet else want
            if len(notes) != len(expect) or any(not n.startswith(w)
                                                for n, w in zip(notes, expect)):
                raise Failure("%s: GELU notes %s, expected %s" % (" ".join(cmd), notes, expect))
            with open(os.path.join(out, "src", "program0.cu")) as f:
                src = f.read()
            for call in ("matmul16_bias_gelu", "matmul16_dgelu"):
                if src.count("gpu::%s(" % call) != calls:
                    raise Failure("%s: %d %s calls, the notes say %d"
                                  % (" ".join(cmd), src.count("gpu::%s(" % call), call, calls))
            checks += 1
    print("ok: GELU's notes (tanh GELU in the GEMMs' epilogues, the erf form and rows not a "
          "multiple of 8 as carve's kernels; none with --quiet or in fp32) match the calls")
    return checks


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--carve", required=True)
    ap.add_argument("--models", required=True)
    ap.add_argument("--runtime-config", required=True)
    ap.add_argument("--workdir", required=True)
    a = ap.parse_args()

    cfg = runtime_config(a.runtime_config)
    if "cuda_missing" in cfg:
        print("cuda-compile: SKIPPED: the CUDA target is not built (%s); the generated CUDA "
              "code was not compiled" % cfg["cuda_missing"])
        return 77

    shutil.rmtree(a.workdir, ignore_errors=True)
    os.makedirs(a.workdir)
    checks = 0
    tokens = os.path.join(a.workdir, "tokens.bin")
    data_gen = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data_gen.py")
    subprocess.run([sys.executable, data_gen, "tokens", "--model",
                    os.path.join(a.models, "opset17", "gpt.onnx"), "--tokens", "4096", tokens],
                   check=True, stdout=subprocess.DEVNULL)

    built = {}
    for model, plan_name, precision in CASES:
        plan = dict(PLANS[plan_name], precision=precision)
        if model == "gpt" and plan_name == "tp2":
            plan["sequence_parallel"] = True
        if (model, plan_name) in RECOMPUTE:
            plan["recompute"] = "full"
        if (model, plan_name) in PREFETCH:
            plan.update(zero=3, zero3_prefetch_layers=1)
        if (model, plan_name) in PIPE_ZERO:
            plan.update(dp=2, zero=PIPE_ZERO[(model, plan_name)])
        pj = os.path.join(a.workdir, "%s-%s-%s.json" % (model, plan_name, precision))
        with open(pj, "w") as f:
            json.dump(plan, f)
        out = os.path.join(a.workdir, "%s-%s-%s" % (model, plan_name, precision))
        rc, so, se = run([a.carve, "compile", os.path.join(a.models, "opset17", model + ".onnx"),
                          "--target", "cuda", "--plan", pj, "-o", out, "--quiet"])
        if rc != 0:
            raise Failure("%s under %s: carve compile --target cuda failed (%d):\n%s%s" %
                          (model, json.dumps(plan), rc, so, se))
        sources = sorted(f for f in os.listdir(os.path.join(out, "src")) if f.endswith(".cu"))
        want = 2 if plan_name == "pp2" else 1
        if len(sources) != want:
            raise Failure("%s: expected %d CUDA source(s), found %s" % (out, want, sources))
        for src in sources:
            text = open(os.path.join(out, "src", src)).read()
            for needle in ["using namespace carve::gpu;", "/*device=*/&kCudaTarget",
                           '/*precision=*/"%s"' % precision]:
                if needle not in text:
                    raise Failure("%s/src/%s lacks %r" % (out, src, needle))
            if precision != "fp32" and "setPrecision(Precision::" not in text:
                raise Failure("%s/src/%s does not set its precision" % (out, src))
            # Elementwise chains are fused into kernels of the program's own
            # (gpu_fused.cuh), which nvcc has just compiled for every architecture.
            if "struct Fused" not in text or "gpu::fused(" not in text or \
                    "CARVE_HD void operator()" not in text:
                raise Failure("%s/src/%s has no fused elementwise kernel" % (out, src))
            # The gradient norm is summed on the device (every gradient in
            # one multi-tensor call) and read once, not one host
            # synchronization per gradient; AdamW is one multi-tensor call.
            if "gpu::sumSquares(" in text or "gpu::sumSquaresMulti(" not in text or \
                    text.count("gpu::readScalars(") != 1 or "gpu::adamwMulti(" not in text:
                raise Failure("%s/src/%s does not sum the gradient norm on the device and "
                              "read it once" % (out, src))
            check_graph_split(text, "%s/src/%s" % (out, src), plan_name == "pp2")
            if "alignas(64)" in text and "__managed__ alignas(64)" not in text:
                raise Failure("%s/src/%s has a constant outside managed memory" % (out, src))
        meta = json.load(open(os.path.join(out, "plan.json")))
        if meta.get("target") != "cuda" or meta.get("precision") != precision:
            raise Failure("%s/plan.json: target %r, precision %r" %
                          (out, meta.get("target"), meta.get("precision")))
        binary = os.path.join(out, "bin", "train")
        if not os.access(binary, os.X_OK):
            raise Failure("%s is missing" % binary)
        built[(model, plan_name)] = out
        checks += 1
        print("ok: %s %s %s: %d CUDA source(s) compiled and linked" %
              (model, plan_name, precision, len(sources)))

    # 3. Device code for the architectures asked for; the libraries.
    gpt_dp2 = built[("gpt", "dp2")]
    sets = fatbins(os.path.join(gpt_dp2, "bin", "train"), a.workdir)
    if any(x != {"sm_80", "sm_90"} for x in sets):
        raise Failure("bin/train holds device code for %s, expected sm_80 and sm_90 in each "
                      "object" % sets)
    rc, so, se = run(["readelf", "-d", os.path.join(gpt_dp2, "bin", "train")])
    for lib in ["libcudart", "libcublas", "libnccl"]:
        if lib not in so:
            raise Failure("bin/train does not need %s:\n%s" % (lib, so))
    out90 = os.path.join(a.workdir, "gpt-sm90")
    rc, so, se = run([a.carve, "compile", os.path.join(a.models, "opset17", "gpt.onnx"), "--target", "cuda",
                      "--cuda-arch", "90", "-o", out90, "--quiet"])
    if rc != 0:
        raise Failure("--cuda-arch 90 failed:\n%s" % se)
    # The runtime library keeps its own architectures; the program's object
    # must hold sm_90 alone.
    sets = fatbins(os.path.join(out90, "bin", "train"), a.workdir)
    if {"sm_90"} not in sets or any(x - {"sm_80", "sm_90"} for x in sets):
        raise Failure("--cuda-arch 90 gave device code for %s" % sets)
    checks += 2
    print("ok: sm_80 + sm_90 by default, sm_90 alone with --cuda-arch 90; cuBLAS, NCCL and "
          "the CUDA runtime linked")

    # 4. No GPU here (or a GPU: then this part is the GPU tests' business).
    visible = run(["sh", "-c", "ls /dev/nvidia0 2>/dev/null"])[1].strip()
    if visible:
        print("note: a GPU device node exists; the no-GPU start-up check was not run")
    else:
        for ranks, out in [(1, out90), (2, gpt_dp2)]:
            rc, so, se = run([a.carve, "run", out, "-n", str(ranks), "--", "--steps", "1",
                              "--data", tokens], timeout=120)
            errors = [l for l in se.splitlines() if "carve: error:" in l]
            if rc == 0 or len(errors) != 1 or "no CUDA device is visible" not in errors[0]:
                raise Failure("%d rank(s) without a GPU: expected exit 1 and one line about no "
                              "CUDA device, got %d:\n%s%s" % (ranks, rc, so, se))
            if ranks > 1 and "rank 0" not in errors[0]:
                raise Failure("the no-GPU error does not name the rank: %s" % errors[0])
            checks += 1
            print("ok: %d rank(s) without a GPU: %s" % (ranks, errors[0].strip()))

    # 5. Bad input.
    bad = os.path.join(a.workdir, "never")
    onnx = os.path.join(a.models, "opset17", "gpt.onnx")
    expect_error([a.carve, "compile", onnx, "--target", "tpu", "-o", bad], "unknown target", bad)
    expect_error([a.carve, "compile", onnx, "--target", "cuda", "--cuda-arch", "8x", "-o", bad],
                 "not a GPU architecture", bad)
    expect_error([a.carve, "compile", onnx, "--cuda-arch", "90", "-o", bad],
                 "--target cuda only", bad)
    checks += 3
    print("ok: bad --target and --cuda-arch values are refused")

    # 6. Custom ops with CUDA kernels.
    checks += check_custom_ops(a.carve, a.workdir)

    # 7. GELU's notes (no build).
    checks += check_gelu_notes(a.carve, a.workdir)
    print("cuda-compile: %d checks passed" % checks)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Failure as e:
        print("FAIL: %s" % e)
        sys.exit(1)
