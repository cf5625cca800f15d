#!/usr/bin/env python3
"""Data parallelism and ZeRO on a model written with PyTorch's own modules.

The passes after the stage split (carve-fuse-elementwise,
carve-fold-transposes, carve-data-parallel, carve-plan-memory) decide
buckets, ZeRO chunks and gathers and the arena from the IR alone. This test
runs them on a model carve's reference models do not resemble: an
nn.Embedding, one nn.TransformerEncoderLayer (nn.MultiheadAttention's fused
in_proj_weight, batch_first, dropout 0) and an nn.Linear head with
F.cross_entropy, exported by a plain torch.onnx.export with a dynamic batch.

What must hold: `carve verify` passes (exit 0, PASS, its default 1e-5 loss and
1e-4 weight tolerances over 3 steps from the same weights) for dp=2 with
ZeRO-2, dp=2 with ZeRO-3, and dp=2 with two micro-batches and ZeRO-1, 2 and 3
(the stage-function path: ZeRO-2/3 reduce-scatter each micro-batch into fp32
chunk accumulators, ZeRO-3 gathers per micro-batch), each against one rank.
"""

import argparse
import json
import os
import subprocess
import sys

PLANS = {
    "zero2": {"dp": 2, "zero": 2},
    "zero3": {"dp": 2, "zero": 3},
    "microbatches_zero1": {"dp": 2, "num_micro_batches": 2, "zero": 1},
    "microbatches_zero2": {"dp": 2, "num_micro_batches": 2, "zero": 2},
    "microbatches_zero3": {"dp": 2, "num_micro_batches": 2, "zero": 3},
}
TIMEOUT_S = 300


def export(path, layers=None):
    """The encoder exported with a dynamic batch; `layers`: an
    nn.TransformerEncoder of that many layers (node names `layers.0`, ...)
    instead of the one nn.TransformerEncoderLayer."""
    import torch
    import torch.nn as nn

    torch.manual_seed(0)

    class Encoder(nn.Module):
        def __init__(self, vocab=64, d=32):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            layer = nn.TransformerEncoderLayer(d, 4, 64, dropout=0.0, batch_first=True)
            self.enc = layer if layers is None else nn.TransformerEncoder(
                layer, layers, enable_nested_tensor=False)
            self.head = nn.Linear(d, vocab)

        def forward(self, input_ids, labels):
            logits = self.head(self.enc(self.emb(input_ids)))
            return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                               labels.reshape(-1))

    ids = torch.randint(0, 64, (8, 16))
    torch.onnx.export(Encoder().train(), (ids, ids.clone()), path,
                      input_names=["input_ids", "labels"], output_names=["loss"],
                      dynamic_axes={"input_ids": {0: "batch"}, "labels": {0: "batch"}},
                      opset_version=17)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--carve", required=True)
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    model = os.path.join(args.workdir, "encoder.onnx")
    export(model)
    failures = 0
    for name, plan in PLANS.items():
        pj = os.path.join(args.workdir, name + ".json")
        with open(pj, "w") as f:
            json.dump(plan, f)
        p = subprocess.run([args.carve, "verify", model, "--plan", pj, "--steps", "3",
                            "--set-dim", "batch=8"], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT_S)
        last = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
        ok = p.returncode == 0 and last.startswith("PASS")
        print(f"{'ok  ' if ok else 'FAIL'} {name} {json.dumps(plan)}: {last}")
        if not ok:
            print(p.stdout)
            failures += 1
    print(f"{len(PLANS) - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
