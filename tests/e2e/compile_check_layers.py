#!/usr/bin/env python3
"""carve plan's as-compiled check from fewer layers equals the whole compile.

For a builtin model under a plan without pipeline stages, `carve plan`
compiles the model at 4, 5, 6 and 7 layers and extrapolates every pipeline
rank's regions (parameters, gradients, optimizer state, activations, arena)
to the model's layer count where all of them are affine in it
(compiledMemoryByLayers, tools/carve/Compile.h). What must hold, plan by plan
(GPT and Llama; fp32, bf16 and fp16; ZeRO 0-3; recomputation none, selective
and full; dp, tp with and without sequence parallelism, micro-batches; the
CPU and the CUDA target):

1. The extrapolated bytes equal `--full-compile-check`'s (the whole model
   compiled) to the byte, on every rank; the report says which layer counts
   it compiled (`compiled_from_layers`).
2. Where the shortcut does not apply (pipeline stages, an ONNX file, a model
   of few layers), the whole model is compiled (`compiled_from_layers` is
   empty) and the bytes are again those of --full-compile-check.

A plan that fails to compile, or a report without the as-compiled bytes, is a
failure, never a skip.
"""

import argparse
import json
import subprocess
import sys

GPT = "builtin:gpt:layers={L},hidden=256,heads=4,seq=128,vocab=512,batch=8"
LLAMA = "builtin:llama:layers={L},hidden=256,heads=4,kv_heads=2,seq=128,vocab=512,batch=8"

# (model, layers, cluster, fixed plan, whether the shortcut applies: True,
# False, or None where it may or may not, the regions being affine or not)
CASES = []
for precision in ("fp32", "bf16", "fp16"):
    for zero in (0, 1, 2, 3):
        for recompute in ("none", "selective", "full"):
            # At this width, some ZeRO-2/3 plans are not affine over 4-7
            # layers (the whole is compiled): either way, the bytes.
            either = zero >= 2
            CASES.append((GPT, 12, "a100-80gb:1x2",
                          f"dp=2,tp=1,pp=1,zero={zero},precision={precision},"
                          f"recompute={recompute},num_micro_batches=1", None if either else True))
CASES += [
    (GPT, 12, "a100-80gb:1x4", "dp=2,tp=2,pp=1,zero=1,precision=bf16,recompute=none,"
     "sequence_parallel=true,num_micro_batches=2", True),
    (GPT, 12, "a100-80gb:1x2", "dp=1,tp=2,pp=1,zero=0,precision=fp32,recompute=selective,"
     "sequence_parallel=false,num_micro_batches=1", True),
    (GPT, 16, "a100-80gb:1x8", "dp=4,tp=2,pp=1,zero=3,precision=bf16,recompute=full,"
     "sequence_parallel=true,num_micro_batches=2", None),
    (GPT, 24, "a100-80gb:1x4", "dp=4,tp=1,pp=1,zero=1,precision=bf16,recompute=selective,"
     "num_micro_batches=2", True),
    (LLAMA, 12, "a100-80gb:1x4", "dp=2,tp=2,pp=1,zero=2,precision=bf16,recompute=none,"
     "sequence_parallel=true,num_micro_batches=1", True),
    (LLAMA, 10, "a100-80gb:1x2", "dp=2,tp=1,pp=1,zero=0,precision=fp32,recompute=full,"
     "num_micro_batches=4", True),
    (GPT, 12, "cpu:1x2", "dp=2,tp=1,pp=1,zero=1,precision=bf16,recompute=none,"
     "num_micro_batches=1", True),
    (GPT, 12, "cpu:1x4", "dp=1,tp=2,pp=2,zero=0,precision=fp32,recompute=none,"
     "num_micro_batches=4", False),
    (GPT, 12, "a100-80gb:1x4", "dp=2,tp=1,pp=2,zero=1,precision=bf16,recompute=none,"
     "num_micro_batches=4", False),
    (GPT, 6, "a100-80gb:1x2", "dp=2,tp=1,pp=1,zero=0,precision=bf16,recompute=none,"
     "num_micro_batches=1", False),
]


def plan(carve, model, cluster, fixed, full):
    cmd = [carve, "plan", model, "--cluster", cluster, "--fixed", fixed, "--json",
           "--no-op-search"]
    if full:
        cmd.append("--full-compile-check")
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       timeout=600)
    if p.returncode != 0:
        raise SystemExit(f"FAIL: {' '.join(cmd)} exited {p.returncode}: {p.stderr.strip()}")
    j = json.loads(p.stdout)
    ranks = j.get("predicted", {}).get("memory_compiled_per_pipeline_rank")
    if not ranks:
        raise SystemExit(f"FAIL: {' '.join(cmd)}: no as-compiled bytes "
                         f"({j.get('compiled_not_checked')})")
    return ranks, j.get("compiled_from_layers", []), j["phase_seconds"]["compile_check"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--carve", required=True)
    ap.add_argument("--workdir", default=None)  # (the harness passes one; nothing is written)
    args = ap.parse_args()
    failures = passed = extrapolated = 0
    for model, layers, cluster, fixed, shortcut in CASES:
        m = model.format(L=layers)
        fast, used, t_fast = plan(args.carve, m, cluster, fixed, False)
        whole, used_whole, t_whole = plan(args.carve, m, cluster, fixed, True)
        what = f"{m.split(':')[1]} L={layers} {cluster} {fixed}"
        problems = []
        if used_whole:
            problems.append(f"--full-compile-check compiled {used_whole} layers, not the whole")
        if used not in ([], [4, 5, 6, 7]):
            problems.append(f"compiled from {used}, expected layers 4 to 7 or the whole")
        if shortcut and used != [4, 5, 6, 7]:
            problems.append(f"compiled from {used}, expected layers 4 to 7")
        if shortcut is False and used:
            problems.append(f"compiled from {used}, expected the whole model")
        if fast != whole:
            problems.append(f"bytes differ: {fast} against the whole compile's {whole}")
        if problems:
            failures += 1
            print(f"FAIL {what}: " + "; ".join(problems))
        else:
            passed += 1
            extrapolated += bool(used)
            print(f"ok   {what}: {len(whole)} rank(s), arena {whole[0]['arena']} B, "
                  f"{'layers ' + str(used[0]) + '-' + str(used[-1]) if used else 'whole'} "
                  f"{t_fast:.3f} s, whole {t_whole:.3f} s")
    print(f"{extrapolated} of {len(CASES)} plans extrapolated from 4-7 layers, "
          f"the rest compiled whole; every one equal to the whole compile")
    print(f"{passed} passed, {failures} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
