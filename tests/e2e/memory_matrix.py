#!/usr/bin/env python3
"""The planner's per-rank memory against the compiled programs', over a plan matrix.

What must hold, for the GPT- and Llama-style builtin models (small: 4 layers,
width 64) and every plan of the matrix

    precision {fp32, bf16, fp16} x ZeRO {0, 1, 2, 3} x recompute {none,
    selective, full} x {1 rank, dp=2, tp=2 with sequence parallelism,
    pp=2 with 2 micro-batches, dp=2 x tp=2 x pp=2 with 2 micro-batches}

(ZeRO only where dp > 1: 99 plans per model), and where micro-batches
accumulate under bf16/fp16, grad_accumulation "16bit" too (without
recomputation: 10 more; the default "fp32" keeps fp32 gradients under
ZeRO-0/1 and fp32 chunk accumulators under ZeRO-2/3, "16bit" 16-bit ones):

1. `carve plan --fixed` (every field fixed) reports each pipeline rank's
   parameters, gradients, optimizer state, activations and arena as
   compiled (`memory_compiled_per_pipeline_rank`: it runs carve compile's
   passes and emitter on the plan, without the C++ build), and the program
   `carve compile --no-build` generates for that plan holds exactly those
   bytes (its tables, which the program's start-up report prints;
   tests/e2e/planner.py checks that report against a run). Its model, which
   the search prices every candidate with, predicts the parameters,
   gradients and optimizer state to the byte as well, up to the arena's
   alignment: the model counts elements, the program starts every tensor
   at a multiple of 64 bytes, so the program may hold up to 63 bytes more
   per tensor (never less). Under bf16/fp16 (2-byte weight copies) a ZeRO
   chunk of a 16-element bias is 32 bytes and takes 64; at GPT sizes the
   difference is below 1e-6 of the total.
2. The activations: the planner's kept activations, buffers and workspace
   against the compiled program's activation region (the liveness-planned
   arena of a program without stages; a pipeline rank's pool, backward-send
   buffers and scratch). The planner adds the peak of what is kept, the
   buffers and the peak of the transients (Profile's transientPeaks: per
   part, the values alive at once, some per sample and some of a fixed size,
   such as a weight's gradient summed over the batch), where the compiler
   places each value over its lifetime and lets them share, so the two
   cannot agree to the byte; the sum is an upper bound. What must hold is
   that the planner is never optimistic -- predicted at least ACT_LOW times
   the compiled, so a plan it says fits does (ACT_LOW = 0.98: the pool and
   scratch placements of a pipeline rank round to alignment; GPT-3 175B on
   64 A100s is 0.9996x) -- and not more than ACT_HIGH times it (2.25).
   Measured on this matrix: 1.00x-1.91x (many pipeline ranks exactly; the
   upper end: ZeRO-3 with full recomputation under pp, where the whole
   bucket of gradients and the gathered parameters of the largest part are
   charged on top of peaks they do not coincide with, and, under bf16/fp16,
   the fp32 views of a part's 16-bit weight copies, charged all at once, at
   widths where such fixed-size terms weigh most); the plans chosen for GPT
   sizes (3. below) 1.02x-1.66x of their compiled arenas
   (bench/memory_table.py, docs/performance.md).

Also: every plan compiles (the planner can print no plan `carve compile`
refuses).

4. CNNs (check_cnns): the activations of tests/e2e/convolution.py's cnnbn
   and ResNet-18 and bench/cnn_step.py's VGG-style CNN under 1 rank, dp=2,
   tp=2 and pp=2, fp32 and bf16, as compiled to the byte, and predicted
   within [ACT_LOW, CNN_HIGH] (1.25, issue 50's bound) on every rank; every
   rank's parameters, gradients and optimizer state to the byte up to
   alignment (pipeline stages modelled as carve-split-stages cuts them).

3. The plans `carve plan` chooses for GPT-2 124M and GPT-3 1.3B, 6.7B and
   175B (builtin, at the GPT-3 paper's global batches) on 8, 64 and 1024
   A100-80GB compile (the spec without `batch=`: the plan's planned global
   batch is taken), and every pipeline rank's compiled arena fits the
   80 GB device and is at most the planner's total over ACT_LOW: the issue's
   "done when" (GPT-3 175B on 1024 A100-80GB fits as compiled) is part of
   `make test`. (A ZeRO-3 plan of the 6.7B on 64 devices once crashed the
   emitter; bench/memory_table.py prints the same comparison as a table.)
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from parallel import Failure, run_cmd  # noqa: E402

MODELS = {
    "gpt": "builtin:gpt:layers=4,hidden=64,heads=4,seq=32,vocab=128",
    "llama": "builtin:llama:layers=4,hidden=64,heads=4,kv_heads=2,seq=32,vocab=128",
}
BATCH = 8
MESHES = [  # name, fixed fields (without zero, recompute, precision)
    ("1 rank", "dp=1,tp=1,pp=1"),
    ("dp2", "dp=2,tp=1,pp=1"),
    ("tp2+sp", "dp=1,tp=2,pp=1,sequence_parallel=true"),
    ("pp2 m2", "dp=1,tp=1,pp=2,num_micro_batches=2,schedule=1f1b"),
    ("dp2xtp2xpp2 m2", "dp=2,tp=2,pp=2,num_micro_batches=2,schedule=1f1b,"
                       "sequence_parallel=false"),
]
PRECISIONS = ["fp32", "bf16", "fp16"]
RECOMPUTES = ["none", "selective", "full"]
ACT_LOW, ACT_HIGH = 0.98, 2.25
CNN_HIGH = 1.25  # every CNN plan (check_cnns; issue 50's bound)
# The plans are for A100s, whose programs are CUDA programs: the as-compiled check
# compiles for the cluster's target, and so does this test (the CUDA target keeps
# attention's output and row statistics for its gradient; the CPU target does not).
TARGET = "cuda"


def variants(mesh, precision, dp):
    """(zero, recompute, grad_accumulation) of a mesh and precision: every
    ZeRO stage (where dp > 1) and recomputation with fp32 accumulation; with
    micro-batches under bf16/fp16 also 16-bit accumulation, without
    recomputation (it changes the gradients' bytes only)."""
    out = []
    for zero in range(4) if dp > 1 else [0]:
        for rc in RECOMPUTES:
            out.append((zero, rc, "fp32"))
        if precision != "fp32" and "m2" in mesh:
            out.append((zero, "none", "16bit"))
    return out


def world(fixed):
    f = dict(kv.split("=") for kv in fixed.split(","))
    return int(f["dp"]) * int(f["tp"]) * int(f["pp"]), int(f["dp"])


def read_programs(src):
    """{pp rank: {params, grads, optimizer, activations}} from the generated
    programs' tables and memory plans."""
    ranks = {}
    for name in sorted(os.listdir(src)):
        if not re.match(r"program\d+\.(cpp|cu)$", name):
            continue
        text = open(os.path.join(src, name)).read()
        m = re.search(r"/\*paramBytes=\*/(\d+), /\*gradBytes=\*/(\d+), /\*stateBytes=\*/(\d+)",
                      text)
        if not m:
            raise Failure("%s: no parameter, gradient and state bytes in its table" % name)
        rec = {"params": int(m.group(1)), "grads": int(m.group(2)),
               "optimizer": int(m.group(3)),
               "arena": int(re.search(r"/\*arenaBytes=\*/(\d+)", text).group(1))}
        pm = re.search(r"/\*ppRank=\*/(\d+), /\*numMicroBatches=\*/\d+, "
                       r"/\*activationBytes=\*/(\d+)", text)
        am = re.search(r"//   activations\s+\[(\d+), (\d+)\)", text)
        if am:  # a program without stages: its activation region
            rec["activations"] = int(am.group(2)) - int(am.group(1))
        elif pm:
            rec["activations"] = int(pm.group(2))
        else:
            raise Failure("%s: no activation region" % name)
        # Tensors per role, for the alignment slack of the model's prediction:
        # each parameter's row; gradients and optimizer tensors (state slots
        # and an fp32 master) of the trainable ones.
        rows = re.findall(r'^    \{"[^"]+", DType::\w+, .*?, (true|false), (-?\d+), '
                          r'\{(-?\d+), (-?\d+)\}.*?(, \d+, DType::\w+)?\},$',
                          text.split("kParams[]")[1].split("};")[0], re.M)
        rec["tensors"] = {
            "params": len(rows),
            "grads": sum(1 for r in rows if r[0] == "true"),
            "optimizer": sum((int(r[2]) >= 0) + (int(r[3]) >= 0) + bool(r[4])
                             for r in rows if r[0] == "true")}
        rank = int(pm.group(1)) if pm else 0
        if rank in ranks and ranks[rank] != rec:
            raise Failure("%s: pipeline rank %d's programs differ: %r vs %r" % (
                name, rank, ranks[rank], rec))
        ranks[rank] = rec
    return ranks


GPTS = [  # builtin spec, global batch
    ("layers=12,hidden=768,heads=12,seq=1024,vocab=50304", 512),
    ("layers=24,hidden=2048,heads=16,seq=2048,vocab=51200", 512),
    ("layers=32,hidden=4096,heads=32,seq=2048,vocab=51200", 1024),
    ("layers=96,hidden=12288,heads=96,seq=2048,vocab=51200", 1536),
]
DEVICE_BYTES = 80e9


def check_chosen_plans(carve, workdir):
    """Part 3: the planner's own choices compile and fit as compiled."""
    ratios = []
    for spec, batch in GPTS:
        model = "builtin:gpt:" + spec
        for nodes in (1, 8, 128):
            key = "%s on a100-80gb:%dx8" % (spec, nodes)
            pj = os.path.join(workdir, "chosen.plan.json")
            p = subprocess.run([carve, "plan", model, "--cluster", "a100-80gb:%dx8" % nodes,
                                "--global-batch", str(batch), "-o", pj],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            if p.returncode != 0:
                if "no plan fits" in p.stderr and nodes == 1 and "12288" in spec:
                    continue  # 175B on one node: nothing fits, and the planner says so
                raise Failure("carve plan %s failed:\n%s" % (key, p.stderr[-2000:]))
            with open(pj) as f:
                total = json.load(f)["predicted"]["memory_per_device"]["total"]
            out = os.path.join(workdir, "chosen")
            # No batch= in the spec: carve compile takes the plan's planned
            # global batch (its "planner" record), as the report promised.
            run_cmd([carve, "compile", model, "--plan", pj, "--no-build", "--no-weights",
                     "--target", TARGET, "-o", out])
            with open(os.path.join(out, "plan.json")) as f:
                compiled_batch = json.load(f).get("global_batch")
            if compiled_batch != batch:
                raise Failure("%s: compiled for a global batch of %r, planned for %d" % (
                    key, compiled_batch, batch))
            arena = max(r["arena"] for r in read_programs(os.path.join(out, "src")).values())
            if arena > DEVICE_BYTES:
                raise Failure("%s: the chosen plan's largest arena is %.2f GB as compiled, over "
                              "the 80 GB device (predicted %.2f GB)" % (key, arena / 1e9,
                                                                       total / 1e9))
            if total < ACT_LOW * arena:
                raise Failure("%s: predicted %.2f GB, compiled %.2f GB: the planner is "
                              "optimistic" % (key, total / 1e9, arena / 1e9))
            ratios.append(total / arena)
            if nodes == 1 and "768" in spec:
                # A --no-build directory has no bin/train; carve run says so.
                p = subprocess.run([carve, "run", out, "-n", "1", "--", "--steps", "1"],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                if p.returncode == 0 or "--no-build" not in p.stderr:
                    raise Failure("carve run on a --no-build directory: exit %d, %r" % (
                        p.returncode, p.stderr))
            shutil.rmtree(out)
    return ratios


# CNNs: tests/e2e/convolution.py's, exported here (PyTorch's own modules).
CNNS = ["cnnbn", "resnet18", "vgg"]


def export_cnn(kind, path):
    """tests/e2e/convolution.py's models, or bench/cnn_step.py's VGG-style CNN
    (five 3x3 convolutions `convs.<k>` with functional ReLU and pooling
    between them) at batch 8 on 32x32 images."""
    if kind != "vgg":
        import convolution
        convolution.export(kind, path)
        return
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for sub in ("bench", "models"):
        if os.path.join(root, sub) not in sys.path:
            sys.path.insert(0, os.path.join(root, sub))
    import torch
    import cnn_step
    from export import export_for_carve
    export_for_carve(cnn_step.build("vgg").train(),
                     (torch.zeros(8, 3, 32, 32), torch.zeros(8, dtype=torch.int64)), path,
                     input_names=["x", "y"])
CNN_MESHES = [
    ("1 rank", "dp=1,tp=1,pp=1"),
    ("dp2", "dp=2,tp=1,pp=1"),
    ("tp2", "dp=1,tp=2,pp=1"),
    ("pp2 m2", "dp=1,tp=1,pp=2,num_micro_batches=2,schedule=1f1b"),
]


def check_cnns(carve, workdir):
    """Part 4: the activations of convolutional networks. Under im2col carve
    compile keeps a convolution's image for the GEMMs that gather its windows
    (in fp32 under every precision) and never stores the windows or their gradient
    (docs/fusion.md); the planner's profile reads the same marks
    (carve-fold-transposes), and counts a weight's gradient, summed over
    the batch, at its size (once, not per sample). ResNet-18's layer1 ..
    layer4 are four numbered prefixes: the profile, full recomputation and
    carve-split-stages all take their eight blocks as the layers, and the
    planner cuts pipeline stages where carve-split-stages does (by the same
    FLOPs), so every rank is modelled: its parameters, gradients and
    optimizer state to the byte up to alignment, its activations within
    [ACT_LOW, CNN_HIGH]. bench/cnn_step.py's VGG-style CNN (one prefix,
    `convs.0` .. `convs.4`, functional ReLU and pooling between them, which
    join the layer before) likewise, and cnnbn, which has no numbered
    layers: the profile takes the pieces carve-split-stages cuts it into
    (where exactly one tensor crosses; crossingUnits). The CUDA programs run
    their convolutions whole, as cuDNN's, where tp = 1 (their image kept
    as any saved activation; carve-split-stages prices them by their
    FLOPs), and the planner profiles those plans with the convolutions
    whole too; under tp = 2 both have im2col. Measured on all 40 plans:
    1.00x-1.24x (2026-12-08; 1.00x-1.19x with im2col everywhere)."""
    ratios = []
    for kind in CNNS:
        onnx = os.path.join(workdir, kind + ".onnx")
        export_cnn(kind, onnx)
        for mesh, fixed in CNN_MESHES:
            n, _ = world(fixed)
            pp = int(dict(kv.split("=") for kv in fixed.split(","))["pp"])
            for precision in ("fp32", "bf16"):
                for rc in ("none", "full") if kind == "resnet18" else ("none",):
                    key = "%s %s %s recompute=%s" % (kind, mesh, precision, rc)
                    tag = re.sub(r"[^a-z0-9]+", "_", key)
                    pj = os.path.join(workdir, tag + ".plan.json")
                    run_cmd([carve, "plan", onnx, "--cluster", "a100-80gb:1x%d" % n,
                             "--no-op-search", "--fixed",
                             "%s,zero=0,recompute=%s,precision=%s" % (fixed, rc, precision),
                             "-o", pj])
                    with open(pj) as f:
                        predicted = json.load(f)["predicted"]
                    out = os.path.join(workdir, tag)
                    run_cmd([carve, "compile", onnx, "--plan", pj, "--no-build", "--no-weights",
                             "--target", TARGET, "-o", out])
                    programs = read_programs(os.path.join(out, "src"))
                    as_compiled = predicted["memory_compiled_per_pipeline_rank"]
                    pred = predicted["memory_per_pipeline_rank"]
                    if sorted(programs) != list(range(len(pred))) or \
                            len(as_compiled) != len(pred):
                        raise Failure("%s: %d pipeline ranks predicted, %d as compiled, "
                                      "programs for %r" % (key, len(pred), len(as_compiled),
                                                           sorted(programs)))
                    for r, p in enumerate(pred):
                        got = programs[r]
                        if as_compiled[r]["activations"] != got["activations"]:
                            raise Failure("%s, pipeline rank %d: carve plan's activations as "
                                          "compiled %d, the program's %d" % (
                                              key, r, as_compiled[r]["activations"],
                                              got["activations"]))
                        # Modelled stage by stage: to the byte up to each
                        # tensor's 64-byte alignment, as in part 1.
                        for field in ("params", "grads", "optimizer"):
                            slack = 63 * got["tensors"][field]
                            if not 0 <= got[field] - int(p[field]) <= slack:
                                raise Failure(
                                    "%s, pipeline rank %d: %s predicted %d bytes, the program "
                                    "holds %d (its %d tensors' alignment allows 0 to %d more)" % (
                                        key, r, field, int(p[field]), got[field],
                                        got["tensors"][field], slack))
                        act = p["activations"] + p["buffers"] + p["workspace"]
                        ratio = act / got["activations"]
                        ratios.append((ratio, key, r, act, got["activations"]))
                        high = CNN_HIGH
                        if ratio < ACT_LOW or (high and ratio > high):
                            raise Failure("%s, pipeline rank %d: activations predicted %d "
                                          "bytes, the program plans %d (%.2fx; limits %.2fx%s)"
                                          % (key, r, act, got["activations"], ratio, ACT_LOW,
                                             "-%.2fx" % high if high else ""))
                    shutil.rmtree(out)
    return ratios


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--carve", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--only", help="a model name (gpt, llama); leaves out the CNNs")
    args = ap.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    plans = 0
    ratios = []
    worst_align = 0
    for model, spec in MODELS.items():
        if args.only and model != args.only:
            continue
        for mesh, fixed in MESHES:
            n, dp = world(fixed)
            for precision in PRECISIONS:
                for zero, rc, acc in variants(mesh, precision, dp):
                    key = "%s %s %s zero=%d recompute=%s" % (model, mesh, precision, zero, rc)
                    if acc != "fp32":
                        key += " grad_accumulation=" + acc
                    tag = re.sub(r"[^a-z0-9]+", "_", key)
                    pj = os.path.join(args.workdir, tag + ".plan.json")
                    run_cmd([args.carve, "plan", spec, "--cluster", "a100-80gb:1x%d" % n,
                             "--global-batch", str(BATCH), "--no-op-search", "--fixed",
                             "%s,zero=%d,recompute=%s,precision=%s,grad_accumulation=%s" % (
                                 fixed, zero, rc, precision, acc),
                             "-o", pj])
                    with open(pj) as f:
                        predicted = json.load(f)["predicted"]
                    pred = predicted["memory_per_pipeline_rank"]
                    as_compiled = predicted.get("memory_compiled_per_pipeline_rank")
                    out = os.path.join(args.workdir, tag)
                    run_cmd([args.carve, "compile", "%s,batch=%d" % (spec, BATCH), "--plan",
                             pj, "--no-build", "--no-weights", "--target", TARGET, "-o", out])
                    got = read_programs(os.path.join(out, "src"))
                    if sorted(got) != list(range(len(pred))):
                        raise Failure("%s: %d pipeline ranks predicted, programs for %r" % (
                            key, len(pred), sorted(got)))
                    if as_compiled is None or len(as_compiled) != len(got):
                        raise Failure("%s: carve plan reported no memory as compiled for "
                                      "every pipeline rank: %r" % (key, as_compiled))
                    for r, p in enumerate(pred):
                        g = got[r]
                        for field in ("params", "grads", "optimizer", "activations", "arena"):
                            if as_compiled[r][field] != g[field]:
                                raise Failure(
                                    "%s, pipeline rank %d: carve plan says %s is %d bytes as "
                                    "compiled, the program holds %d" % (
                                        key, r, field, as_compiled[r][field], g[field]))
                        for field in ("params", "grads", "optimizer"):
                            slack = 63 * g["tensors"][field]
                            if not 0 <= g[field] - int(p[field]) <= slack:
                                raise Failure(
                                    "%s, pipeline rank %d: %s predicted %d bytes, the "
                                    "program holds %d (its %d tensors' alignment allows "
                                    "0 to %d more)" % (key, r, field, int(p[field]),
                                                       g[field], g["tensors"][field], slack))
                            worst_align = max(worst_align, g[field] - int(p[field]))
                        act = p["activations"] + p["buffers"] + p["workspace"]
                        ratios.append((act / g["activations"], key, r, act,
                                       g["activations"]))
                    shutil.rmtree(out)
                    plans += 1
    chosen = check_chosen_plans(args.carve, args.workdir)
    cnn = [] if args.only else check_cnns(args.carve, args.workdir)
    ratios.sort()
    if os.environ.get("CARVE_MATRIX_ALL"):
        for ratio, key, r, act, got in ratios:
            print("  %.3f %s rank %d %d %d" % (ratio, key, r, act, got))
    for lo_hi in (ratios[:5], ratios[-5:]):
        for ratio, key, r, act, got in lo_hi:
            print("  activations %-55s rank %d: predicted %8d, compiled %8d (%.2fx)" % (
                key, r, act, got, ratio))
    print("ok: %d plans compile; every pipeline rank's parameters, gradients, optimizer state, "
          "activations and arena as carve plan reports them compiled equal the program's to the "
          "byte; the model predicts parameters, gradients and optimizer state to the byte up "
          "to the 64-byte alignment of each tensor (at most %d bytes short on any rank) and "
          "activations at %.2fx-%.2fx of the compiled" % (plans, worst_align, ratios[0][0],
                                                           ratios[-1][0]))
    cnn.sort()
    if cnn:
        for ratio, key, r, act, got in cnn:
            print("  activations %-55s rank %d: predicted %8d, compiled %8d (%.2fx)" % (
                key, r, act, got, ratio))
        print("ok: %d CNN plans (%s; 1 rank, dp2, tp2, pp2; fp32 and bf16): activations as carve "
              "plan reports them compiled equal the program's; the model predicts %.2fx-%.2fx "
              "of the compiled" % (len(cnn), ", ".join(CNNS), cnn[0][0], cnn[-1][0]))
    print("ok: the plans carve plan chooses for GPT 124M-175B on 8-1024 A100-80GB compile "
          "and fit 80 GB as compiled (planner / compiled arena %.3fx-%.3fx)" % (
              min(chosen), max(chosen)))
    if ratios[0][0] < ACT_LOW:
        raise Failure("%s, pipeline rank %d: activations predicted %d bytes, the program plans "
                      "%d: the planner is optimistic (limit %.2fx)" % (
                          ratios[0][1], ratios[0][2], ratios[0][3], ratios[0][4], ACT_LOW))
    if ratios[-1][0] > ACT_HIGH:
        raise Failure("%s, pipeline rank %d: activations predicted %d bytes, the program plans "
                      "%d (limit %.2fx)" % (ratios[-1][1], ratios[-1][2], ratios[-1][3],
                                            ratios[-1][4], ACT_HIGH))


if __name__ == "__main__":
    try:
        main()
    except Failure as e:
        print("FAIL: %s" % e)
        sys.exit(1)
