#!/usr/bin/env python3
"""A classifier with 100,000 classes under tensor parallelism (TorchShard's case).

The model is written and exported as a user would: nn.Linear(64, 128), ReLU,
nn.Linear(128, 100000), F.cross_entropy, one plain torch.onnx.export. Under tp
the partitioner splits the head by classes and feeds the vocab-parallel
cross-entropy, so no rank holds all logits (docs/partition.md).

What must hold:
1. `carve verify` passes (its 1e-5 loss and 1e-4 weight tolerances over 3 steps
   from the same weights) for tp=2, tp=4 and dp=2 x tp=2, against one rank.
2. Under tp=T each rank holds 1/T of the head: the run's memory line counts
   (128/T) x 64 + 128/T + (100000/T) x 128 + 100000/T parameter elements per
   rank (fc1 column-parallel, the head by classes) and as many gradient bytes
   as parameter bytes; one rank alone holds 12,908,320.
3. Each rank's logits are [8, 100000/T]: the generated step calls
   cross_entropy_vocab_parallel on them (and its gradient), and no collective
   moves a tensor with 100000 or 100000/T elements in a dimension (the logits
   are never gathered or all-reduced).
4. With 10 classes (logits smaller than the head's input) the head stays
   row-parallel as in Megatron's MLP (its weight [10, 128/T] per rank) and
   trains equal to one rank.
"""

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st  # noqa: E402
import harness  # noqa: E402

TIMEOUT_S = 600
BATCH = 8
IN, HIDDEN = 64, 128


Failure = harness.Failure


def export(path, classes):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    torch.manual_seed(0)

    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(IN, HIDDEN)
            self.head = nn.Linear(HIDDEN, classes)

        def forward(self, x, y):
            return F.cross_entropy(self.head(F.relu(self.fc1(x))), y)

    x = torch.randn(BATCH, IN)
    y = torch.randint(0, classes, (BATCH,))
    torch.onnx.export(Classifier().train(), (x, y), path, input_names=["x", "y"],
                      output_names=["loss"], opset_version=17,
                      training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)


def write_data(path, classes, steps=4):
    import numpy as np

    rng = np.random.default_rng(1)
    st.save(path, {"x": rng.standard_normal((steps, BATCH, IN)).astype(np.float32),
                   "y": rng.integers(0, classes, (steps, BATCH)).astype(np.int64)})


def run(cmd):
    return harness.run(cmd, timeout=TIMEOUT_S, merge=True)


def write_plan(work, name, plan):
    path = os.path.join(work, name + ".json")
    with open(path, "w") as f:
        json.dump(plan, f)
    return path


def verify(carve, work, model, data, name, plan):
    rc, out = run([carve, "verify", model, "--plan", write_plan(work, name, plan), "--data",
                   data, "--steps", "3"])
    last = out.strip().splitlines()[-1] if out.strip() else ""
    if rc != 0 or not last.startswith("PASS"):
        raise Failure("%s %s: carve verify did not pass (exit %d):\n%s" %
                      (name, json.dumps(plan), rc, out))
    print("ok: %s %s: %s" % (name, json.dumps(plan), last))


def compile_and_run(carve, work, model, data, name, plan):
    """Compiles `plan`, trains one step; returns (per-rank (parameter elements,
    parameter bytes, gradient bytes), the generated step's source)."""
    out = os.path.join(work, name)
    rc, text = run([carve, "compile", model, "--plan", write_plan(work, name, plan), "-o", out,
                    "--quiet"])
    if rc != 0:
        raise Failure("%s: compile failed:\n%s" % (name, text))
    ranks = plan.get("dp", 1) * plan.get("tp", 1)
    rc, text = run([carve, "run", out, "-n", str(ranks), "--", "--steps", "1", "--data", data,
                    "--progress", "none"])
    if rc != 0:
        raise Failure("%s: train failed:\n%s" % (name, text))
    memory = {int(r): (int(e), int(pb), int(gb)) for r, pb, e, gb in re.findall(
        r"memory rank (\d+) \(dp \d+, tp \d+\): parameters (\d+) bytes \((\d+) elements\), "
        r"gradients (\d+) bytes", text)}
    if len(memory) != ranks:
        raise Failure("%s: %d memory lines for %d ranks:\n%s" % (name, len(memory), ranks, text))
    with open(os.path.join(out, "src", "program0.cpp")) as f:
        source = f.read()
    return memory, source


def head_elements(classes, tp, by_classes):
    fc1 = (HIDDEN // tp) * IN + HIDDEN // tp
    if by_classes:
        return fc1 + (classes // tp) * HIDDEN + classes // tp
    # Row-parallel head: its weight split along the contraction, its bias whole.
    return fc1 + classes * (HIDDEN // tp) + classes


def check_many(carve, work, model, data, classes):
    memory, _ = compile_and_run(carve, work, model, data, "one-rank", {"dp": 1})
    one = memory[0][0]
    if one != head_elements(classes, 1, True):
        raise Failure("1 rank holds %d parameter elements, expected %d" %
                      (one, head_elements(classes, 1, True)))
    for tp in (2, 4):
        name = "tp%d-layout" % tp
        memory, source = compile_and_run(carve, work, model, data, name, {"tp": tp})
        want = head_elements(classes, tp, True)
        for r, (elements, pbytes, gbytes) in memory.items():
            if elements != want:
                raise Failure("%s: rank %d holds %d parameter elements, expected %d (the head "
                              "split by classes)" % (name, r, elements, want))
            if gbytes != pbytes:
                raise Failure("%s: rank %d: gradients %d bytes, parameters %d" %
                              (name, r, gbytes, pbytes))
        local = classes // tp
        ce = re.findall(r"cross_entropy_vocab_parallel(?:_grad)?\(\*ctx\.tpComm, \w+, "
                        r"\{%d, (\d+)\}" % BATCH, source)
        if len(ce) < 2 or any(int(c) != local for c in ce):
            raise Failure("%s: expected the vocab-parallel cross-entropy and its gradient on "
                          "[%d, %d] logits, found %s" % (name, BATCH, local, ce))
        for line in source.splitlines():
            call = line.strip()
            if re.match(r"(allReduce|allGather\w*|reduceScatter\w*|broadcast\w*|allToAll\w*)\(",
                        call) and re.search(r"\b(%d|%d)\b" % (classes, local), call):
                raise Failure("%s: a collective moves the logits: %s" % (name, call))
        print("ok: %s: every rank holds %d parameter elements (the head's %d of %d) and as "
              "many gradient elements; logits [%d, %d] into cross_entropy_vocab_parallel, "
              "never gathered (1 rank: %d elements)" %
              (name, want, local * HIDDEN + local, classes * HIDDEN + classes, BATCH, local,
               one))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--carve", required=True)
    ap.add_argument("--workdir", required=True)
    a = ap.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    failures = []

    def attempt(fn, *args):
        try:
            fn(*args)
        except Failure as e:
            failures.append(str(e).splitlines()[0])
            print("FAIL: %s" % e, flush=True)

    classes = 100000
    model = os.path.join(a.workdir, "classifier100k.onnx")
    data = os.path.join(a.workdir, "classifier100k.safetensors")
    export(model, classes)
    write_data(data, classes)
    for name, plan in [("tp2", {"tp": 2}), ("tp4", {"tp": 4}), ("dp2tp2", {"dp": 2, "tp": 2})]:
        attempt(verify, a.carve, a.workdir, model, data, name, plan)
    attempt(check_many, a.carve, a.workdir, model, data, classes)

    few = os.path.join(a.workdir, "classifier10.onnx")
    few_data = os.path.join(a.workdir, "classifier10.safetensors")
    export(few, 10)
    write_data(few_data, 10)
    attempt(verify, a.carve, a.workdir, few, few_data, "few-tp2", {"tp": 2})

    def check_few():
        _, source = compile_and_run(a.carve, a.workdir, few, few_data, "few-tp2-layout",
                                    {"tp": 2})
        if not re.search(r"head_weight = .*// parameter \[10, %d\]" % (HIDDEN // 2), source):
            raise Failure("10 classes under tp=2: expected the row-parallel head weight "
                          "[10, %d] per rank" % (HIDDEN // 2))
        if "cross_entropy_vocab_parallel" in source:
            raise Failure("10 classes under tp=2: the cross-entropy should not be split")
        print("ok: 10 classes under tp=2: the head stays row-parallel ([10, %d] per rank)" %
              (HIDDEN // 2))

    attempt(check_few)
    if failures:
        print("classifier-head: %d FAILED:" % len(failures))
        for f in failures:
            print("  FAIL: %s" % f)
        return 1
    print("classifier-head: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
