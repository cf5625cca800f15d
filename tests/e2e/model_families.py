#!/usr/bin/env python3
"""The model families people train that carve's first references did not
cover (models/families.py): a T5-style encoder-decoder (relative position
buckets, the targets shifted right by a slice assignment, cross-attention; the
head tied to the embedding and untied), a Swin-style stage (window attention,
shifted windows with torch.roll and their mask, relative position bias
tables), a MobileNetV3-style network (depthwise convolutions, Hardswish,
squeeze-excitation with Hardsigmoid, batch norm) and a GPT-J-style decoder
(attention and MLP in parallel, rotary by interleaved pairs with tables built
by Tile), each exported by models/export.py's export_for_carve.

What must hold, for each:
1. 1 rank against PyTorch: the same weights and samples, plain SGD, STEPS
   steps: losses within LOSS_RTOL, every parameter within WEIGHT_RTOL of its
   largest entry, after checking that PyTorch's own float32 run is within
   those of its float64 run. The learned biases of T5 and Swin (tables read
   by a gather, added to the attention scores) are among the parameters
   compared: they must train.
2. dp=2, tp=2 and pp=2 with 2 micro-batches pass `carve verify` against 1
   rank (its 1e-5 and 1e-4); T5 also with the stages cut at the decoder
   (`"cuts": ["/decoder/*"]`), so that the encoder and the decoder run on
   different pipeline ranks.
"""

import argparse
import json
import os
import shutil
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "models"))
from torch_compare import Failure, run, token_file, train_like_torch, verify_plans  # noqa: E402

STEPS = 6
LR = 0.1
LOSS_RTOL = 1e-5
WEIGHT_RTOL = 1e-4
TOKEN_BATCH, SEQ = 4, 16
IMAGE_BATCH = 8
PLANS = [("dp2", {"dp": 2}), ("tp2", {"tp": 2}), ("pp2", {"pp": 2, "num_micro_batches": 2})]
MODELS = {
    "t5": PLANS + [("pp2-cut", {"pp": 2, "num_micro_batches": 2, "cuts": ["/decoder/*"]})],
    "t5_untied": [("dp2", {"dp": 2})],
    "swin": PLANS,
    "mobilenet": [("tp2", {"tp": 2})],
    "gptj": PLANS,
}
# Batch norm normalizes by the statistics of the batch a rank (or a micro-batch)
# sees, as PyTorch's DDP without SyncBatchNorm does: these plans are compared
# with PyTorch training on the mean of the losses of that many shares.
PER_SHARE = {"mobilenet": [("dp2", {"dp": 2}, 2, 2),
                           ("pp2", {"pp": 2, "num_micro_batches": 2}, 2, 2)]}
# Parameters that must be compared (and so train as PyTorch trains them).
MUST = {
    "t5": ["encoder.layers.0.attn.relative_attention_bias.weight",
           "decoder.layers.0.self_attn.relative_attention_bias.weight", "shared.weight"],
    "swin": ["blocks.0.attn.relative_position_bias_table",
             "blocks.1.attn.relative_position_bias_table"],
}


def samples(name, specs, rng, w):
    """(inputs, targets, batch, data file) of STEPS global batches."""
    if specs[0].name == "images":
        n = STEPS * IMAGE_BATCH
        xs = rng.standard_normal((n,) + tuple(specs[0].shape[1:])).astype(np.float32)
        ys = rng.integers(0, specs[1].high, n).astype(np.int64)
        import st
        data = os.path.join(w, "data.safetensors")
        st.save(data, {"images": xs, "targets": ys})  # sample-major: [N, ...]
        return xs, ys, IMAGE_BATCH, data
    data = os.path.join(w, "tokens.bin")
    ids, targets = token_file(data, rng.integers(0, specs[0].high, 4000), TOKEN_BATCH, SEQ,
                              STEPS)
    return ids, targets, TOKEN_BATCH, data


def per_share(carve, w, name, onnx_path, data, xs, ys, batch, plan_name, plan, ranks, shares):
    """A plan whose ranks (or micro-batches) normalize by their own share's
    batch statistics, against PyTorch training on the mean of the shares'
    losses (each share a forward of its own, as DDP runs it)."""
    import copy
    import torch
    import reference
    from torch_compare import (check_well_posed, read_losses, worst_loss_gap,
                               worst_weight_gap)

    out = os.path.join(w, "share-" + plan_name)
    with open(out + ".json", "w") as f:
        json.dump(plan, f)
    run([carve, "compile", onnx_path, "--plan", out + ".json", "-o", out, "--quiet",
         "--optimizer", "sgd", "--lr", str(LR), "--clip-grad-norm", "0"])
    run([carve, "run", out, "-n", str(ranks), "--", "--steps", str(STEPS), "--data", data,
         "--log", out + ".jsonl", "--save", out + ".ckpt", "--progress", "none"])

    def losses(net, dtype):
        opt = torch.optim.SGD(net.parameters(), lr=LR)
        net.train()
        got = []
        for k in range(STEPS):
            x, y = xs[k * batch:(k + 1) * batch].astype(dtype), ys[k * batch:(k + 1) * batch]
            n = batch // shares
            opt.zero_grad()
            loss = sum(net(torch.from_numpy(x[s * n:(s + 1) * n]),
                           torch.from_numpy(y[s * n:(s + 1) * n])) for s in range(shares))
            loss = loss / shares
            loss.backward()
            opt.step()
            got.append(loss.item())
        return got

    net, _, _ = reference.build(name, batch=batch, seq=SEQ)
    exact = copy.deepcopy(net).double()
    ref = losses(net, np.float32)
    check_well_posed(net, ref, exact, losses(exact, np.float64), LOSS_RTOL, WEIGHT_RTOL)
    worst = worst_loss_gap("%s %s" % (name, plan_name), read_losses(out + ".jsonl"), ref,
                           LOSS_RTOL)
    # The running statistics are not compared: PyTorch's module updates them once per
    # share, a rank once per step from its own share.
    buffers = [n for n, _ in net.named_buffers()]
    gap, where, compared = worst_weight_gap("%s %s" % (name, plan_name), out + ".ckpt", net,
                                            WEIGHT_RTOL, skip=buffers, require_all=False)
    print("ok: %s %s: against PyTorch on the mean of %d shares' losses (batch norm by each "
          "share's statistics), %d SGD steps: losses within %.2g, %d tensors within %.2g (%s)"
          % (name, plan_name, shares, STEPS, worst, compared, gap, where))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--carve", required=True)
    ap.add_argument("--workdir", required=True)
    a = ap.parse_args()
    import reference
    import st
    from export import export_for_carve

    shutil.rmtree(a.workdir, ignore_errors=True)
    os.makedirs(a.workdir)
    rng = np.random.default_rng(5)
    for name, plans in MODELS.items():
        w = os.path.join(a.workdir, name)
        os.makedirs(w)
        specs = reference.MODELS[name][1]
        xs, ys, batch, data = samples(name, specs, rng, w)
        net, inputs, names = reference.build(name, batch=batch, seq=SEQ)
        onnx_path = os.path.join(w, name + ".onnx")
        export_for_carve(net, inputs, onnx_path, input_names=names)
        _, worst, gap, where, compared = train_like_torch(
            a.carve, onnx_path, net, data, xs, ys, os.path.join(w, "one"), batch, STEPS, LR,
            LOSS_RTOL, WEIGHT_RTOL, require_all=False)
        # Tied names (T5's lm_head.weight) are not in the checkpoint; every
        # parameter named in the export is.
        saved = st.load_checkpoint(os.path.join(w, "one.ckpt"))
        missing = [n for n, _ in net.named_parameters() if n not in saved]
        if missing or any(m not in saved for m in MUST.get(name, [])):
            raise Failure("%s: the checkpoint lacks %s" % (name, missing or MUST[name]))
        print("ok: %s: 1 rank against PyTorch, %d SGD steps: losses within %.2g, %d tensors "
              "within %.2g (worst %s)" % (name, STEPS, worst, compared, gap, where))
        verify_plans(a.carve, name, onnx_path, data, plans, w)
        for plan_name, plan, ranks, shares in PER_SHARE.get(name, []):
            per_share(a.carve, w, name, onnx_path, data, xs, ys, batch, plan_name, plan, ranks,
                      shares)
    print("model-families: all checks passed")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Failure as e:
        print("FAIL: %s" % e)
        sys.exit(1)
