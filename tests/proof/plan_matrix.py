#!/usr/bin/env python3
"""The proof that a change of carve's back end changed nothing: a plan matrix over the GPT and
Llama reference models (4 layers), ResNet-18, Mixtral under expert parallelism and the Llama
with the custom SwiGLU op, recorded before the change and checked after.

Two depths:
  --sources   compiles every plan (`carve compile --no-build`, both targets) and records the
              SHA-256 of every generated source: a change that prints the same C++ is proven
              by equal hashes alone.
  --train     also builds and trains every CPU plan (3 steps) and records each step's loss and
              gradient norm (exact floats) and the SHA-256 of every final weight: where the
              printed C++ differs, the numbers must still be bitwise those of before.

Usage (run by hand around a back-end change; not a ctest, since bitwise results belong to one
machine's kernels and the baseline needs the old compiler; `diff -r BEFORE/KEY/src AFTER/KEY/src`
shows how the printed C++ of a case changed):
  tests/proof/plan_matrix.py --carve build/bin/carve --workdir /tmp/pm --train --record before.json
  ... change ...
  tests/proof/plan_matrix.py --carve build/bin/carve --workdir /tmp/pm --train --check before.json
Exit 0 when every recorded entry matches (or after --record), 1 otherwise, naming each
mismatch.
"""
import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))
import data_gen  # noqa: E402
import st  # noqa: E402

STEPS = 3
TIMEOUT_S = 900
TOKEN_MODELS = ["gpt", "llama"]

# (name, plan, ranks); every plan but the ones marked applies to both token models.
TOKEN_PLANS = [
    ("1rank", {}, 1),
    ("dp4-zero2", {"dp": 4, "zero": 2}, 4),
    ("dp2-tp2-sp-zero1", {"dp": 2, "tp": 2, "sequence_parallel": True, "zero": 1}, 4),
    ("dp2-pp2-1f1b", {"dp": 2, "pp": 2, "num_micro_batches": 2, "schedule": "1f1b"}, 4),
    ("pp2-interleaved", {"pp": 2, "virtual_stages": 2, "num_micro_batches": 4}, 2),
    ("dp4-zero3-prefetch", {"dp": 4, "zero": 3, "zero3_prefetch_layers": 1}, 4),
    ("dp2-bf16", {"dp": 2, "precision": "bf16"}, 2),
    ("dp2-fp16-zero2", {"dp": 2, "zero": 2, "precision": "fp16"}, 2),
    ("tp2-pp2-bf16", {"tp": 2, "pp": 2, "num_micro_batches": 2, "precision": "bf16"}, 4),
    # The optimizer's tail: fp16 unscaling, clipping, SGD with Nesterov momentum, a
    # schedule, ZeRO-2's chunks; and clipping with weight decay in a pipeline.
    ("dp2-zero2-fp16-sgd", {"dp": 2, "zero": 2, "precision": "fp16",
                            "optimizer": {"name": "sgd", "momentum": 0.9, "nesterov": True,
                                          "clip_grad_norm": 1.0, "warmup_steps": 10,
                                          "decay_steps": 100, "min_lr_ratio": 0.1}}, 2),
    ("pp2-fp16-clip", {"pp": 2, "num_micro_batches": 2, "precision": "fp16",
                       "optimizer": {"clip_grad_norm": 0.5, "weight_decay": 0.1}}, 2),
    ("tp2-bf16", {"tp": 2, "precision": "bf16"}, 2),
]
RESNET_PLANS = [
    ("1rank", {}, 1),
    ("dp2-zero2", {"dp": 2, "zero": 2}, 2),
    ("dp2-bf16", {"dp": 2, "precision": "bf16"}, 2),
]
MIXTRAL_PLANS = [("dp2-ep2", {"dp": 2, "ep": 2}, 2), ("dp2-ep2-tp2", {"dp": 2, "ep": 2, "tp": 2}, 4)]
SWIGLU_PLANS = [("tp2", {"tp": 2}, 2)]
# The CUDA target is compiled (sources hashed), not run: runs need a GPU or the emulation.
CUDA_PLANS = {"gpt": ["1rank", "dp4-zero2", "dp2-tp2-sp-zero1", "dp2-pp2-1f1b", "dp2-bf16",
                      "tp2-bf16", "pp2-interleaved", "dp4-zero3-prefetch", "dp2-fp16-zero2",
                      "dp2-zero2-fp16-sgd", "pp2-fp16-clip", "tp2-pp2-bf16"],
              "llama": ["1rank", "dp2-bf16"], "resnet18": ["1rank", "dp2-bf16"],
              "mixtral": ["dp2-ep2"], "swiglu": ["tp2"]}


def run(cmd, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, **kw)
    if p.returncode != 0:
        raise RuntimeError("%s failed (%d):\n%s%s" % (" ".join(cmd), p.returncode, p.stdout,
                                                       p.stderr))
    return p.stdout


def sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def sources_of(out):
    src = os.path.join(out, "src")
    return {os.path.relpath(os.path.join(d, n), src): sha(os.path.join(d, n))
            for d, _, names in sorted(os.walk(src)) for n in sorted(names)}


def losses_of(log):
    rows = []
    with open(log) as f:
        for line in f:
            r = json.loads(line)
            if "loss" in r and "step" in r:
                rows.append([float(r["loss"]).hex(), float(r.get("grad_norm", 0.0)).hex()])
    return rows


def weights_of(ckpt):
    return {k: hashlib.sha256(v.tobytes()).hexdigest() for k, v in
            sorted(st.load_checkpoint(ckpt).items())}


def cases(models_dir):
    """(key, onnx, plan, ranks, extra compile flags, data kind, target) for the whole matrix."""
    out = []
    for m in TOKEN_MODELS:
        for name, plan, ranks in TOKEN_PLANS:
            out.append((m + "/" + name, os.path.join(models_dir, m + ".onnx"), plan, ranks, [],
                        "tokens", "cpu"))
    for name, plan, ranks in RESNET_PLANS:
        out.append(("resnet18/" + name, os.path.join(models_dir, "resnet18.onnx"), plan, ranks,
                    [], "images", "cpu"))
    for name, plan, ranks in MIXTRAL_PLANS:
        out.append(("mixtral/" + name, os.path.join(models_dir, "mixtral.onnx"), plan, ranks, [],
                    "tokens", "cpu"))
    for name, plan, ranks in SWIGLU_PLANS:
        out.append(("swiglu/" + name, os.path.join(models_dir, "llama_swiglu.onnx"), plan, ranks,
                    ["--rules", os.path.join(ROOT, "models", "custom", "swiglu.json")], "tokens",
                    "cpu"))
    plans = {c[0]: c for c in out}
    for m, names in CUDA_PLANS.items():
        for n in names:
            key, onnx, plan, ranks, flags, kind, _ = plans[m + "/" + n]
            out.append((key + "/cuda", onnx, plan, ranks, flags, kind, "cuda"))
    return out


def export_models(models_dir):
    os.makedirs(models_dir, exist_ok=True)
    for m in TOKEN_MODELS + ["resnet18", "mixtral"]:
        if not os.path.exists(os.path.join(models_dir, m + ".onnx")):
            # Four layers: pp = 2 interleaved needs four stages.
            config = ["--config", json.dumps({"n_layer": 4})] if m in TOKEN_MODELS else []
            run([sys.executable, os.path.join(ROOT, "models", "export.py"), m, "--out",
                 models_dir] + config)
    if not os.path.exists(os.path.join(models_dir, "llama_swiglu.onnx")):
        run([sys.executable, os.path.join(ROOT, "models", "custom", "swiglu.py"), "--out",
             models_dir])


def data_for(models_dir, onnx, kind):
    if kind == "tokens":
        path = os.path.join(models_dir, os.path.basename(onnx) + ".tokens.bin")
        if not os.path.exists(path):
            data_gen.write_tokens(path, data_gen.make_tokens(4000, data_gen.vocab_size(onnx),
                                                             seed=1), "int32")
        return path
    path = os.path.join(models_dir, "resnet18.images.safetensors")
    if not os.path.exists(path):
        run([sys.executable, os.path.join(ROOT, "tests", "e2e", "data_gen.py"), "tensors", path,
             "--model", onnx, "--name", "resnet18", "--steps", str(STEPS)])
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--carve", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--train", action="store_true", help="build and train the CPU plans too")
    ap.add_argument("--only", default="", help="keys containing this string only")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--record", help="write the results to this JSON file")
    g.add_argument("--check", help="compare with a file --record wrote")
    a = ap.parse_args()
    models_dir = os.path.join(a.workdir, "models")
    export_models(models_dir)
    results = {}
    for key, onnx, plan, ranks, flags, kind, target in cases(models_dir):
        if a.only and a.only not in key:
            continue
        out = os.path.join(a.workdir, key.replace("/", "-"))
        with open(out + ".plan.json", "w") as f:
            json.dump(plan, f)
        train = a.train and target == "cpu"
        cmd = [a.carve, "compile", onnx, "--plan", out + ".plan.json", "-o", out, "--quiet",
               "--target", target] + flags
        if not train:
            cmd.append("--no-build")
        run(cmd)
        r = {"sources": sources_of(out)}
        if train:
            data = data_for(models_dir, onnx, kind)
            for f in (out + ".jsonl", out + ".ckpt"):
                if os.path.isdir(f):
                    subprocess.run(["rm", "-rf", f])
                elif os.path.exists(f):
                    os.remove(f)
            run([a.carve, "run", out, "-n", str(ranks), "--", "--steps", str(STEPS), "--data",
                 data, "--log", out + ".jsonl", "--save", out + ".ckpt"])
            r["losses"] = losses_of(out + ".jsonl")
            r["weights"] = weights_of(out + ".ckpt")
        results[key] = r
        print("%-40s %s" % (key, "trained" if train else "compiled"), flush=True)
    if a.record:
        with open(a.record, "w") as f:
            json.dump({"machine": platform.processor() or platform.machine(),
                       "results": results}, f, indent=1, sort_keys=True)
        print("recorded %d plans in %s" % (len(results), a.record))
        return 0
    with open(a.check) as f:
        base = json.load(f)["results"]
    bad = same_src = 0
    for key, r in results.items():
        b = base.get(key)
        if b is None:
            print("NEW  %s (not in %s)" % (key, a.check))
            continue
        if r["sources"] == b["sources"]:
            same_src += 1
        else:
            changed = sorted(n for n in set(r["sources"]) | set(b["sources"])
                             if r["sources"].get(n) != b["sources"].get(n))
            print("SRC  %s: the printed C++ differs (%s)" % (key, ", ".join(changed)))
        for what in ("losses", "weights"):
            if what in r and what in b and r[what] != b[what]:
                bad += 1
                diff = ([k for k in b[what] if r[what].get(k) != b[what][k]]
                        if what == "weights" else r[what])
                print("FAIL %s: %s differ from the record: %s" % (key, what, diff))
            elif what in b and what not in r and a.train:
                bad += 1
                print("FAIL %s: no %s" % (key, what))
    print("%d plans: %d with the same sources, %d numeric mismatches" %
          (len(results), same_src, bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
