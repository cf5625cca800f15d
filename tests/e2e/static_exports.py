#!/usr/bin/env python3
"""Static-batch exports under every plan: constants the exporter built with the
export's batch, the same for every sample, written the way the popular model
libraries write them.

A plain torch.onnx.export with example inputs of batch B hard-codes B wherever
the model builds something from the batch's size. Under data parallelism (and
micro-batches) a rank imports its share of the batch, so each such constant
must be carried to the share where it meets the batch (compiler/frontend/
BatchTracking.cpp). The forms:

- opt: positions from the cumulative sum of an all-ones attention mask
  (`torch.ones(B, T)`, OPT's learned positions), gathered from a table;
- bloom: an ALiBi bias built from that mask, [B * heads, 1, T], added to the
  attention scores (BLOOM's baddbmm);
- bert: a token-type buffer of zeros expanded to the batch and embedded
  (BERT's `token_type_ids` default);
- shuffle: a channel shuffle whose view shape is built from the sizes
  (ShuffleNet's `x.view(b, groups, c // groups, h, w)`).

What must hold, for each form:
1. 1 rank against PyTorch: the same weights and samples, plain SGD, STEPS
   steps, losses within LOSS_RTOL and final weights within WEIGHT_RTOL (after
   checking that PyTorch's own float32 run is within those of its float64 run).
2. dp=2, dp=4 (a share of one sample) and pp=2 with 2 micro-batches pass
   `carve verify` against 1 rank (its 1e-5 and 1e-4).
3. The same export with constant folding on (torch.onnx.export's default,
   which folds more of those constants and renames the transposed weights)
   passes `carve verify` under dp=2.

Exported without constant folding for 1 and 2, so that the parameters keep
the module's names and the final weights can be compared by name.
"""

import argparse
import math
import os
import shutil
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import st  # noqa: E402
from torch_compare import Failure, token_file, train_like_torch, verify_plans  # noqa: E402

STEPS = 6
BATCH = 4
VOCAB, SEQ, WIDTH = 32, 8, 16
LR = 0.1
LOSS_RTOL = 1e-5
WEIGHT_RTOL = 1e-4
PLANS = [("dp2", {"dp": 2}), ("dp4", {"dp": 4}), ("pp2", {"pp": 2, "num_micro_batches": 2})]


def models():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class OptPositions(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(VOCAB, WIDTH)
            self.pos = nn.Embedding(SEQ + 2, WIDTH)
            self.fc = nn.Linear(WIDTH, WIDTH)
            self.head = nn.Linear(WIDTH, VOCAB)

        def forward(self, ids, targets):
            mask = torch.ones(ids.shape[0], ids.shape[1], dtype=torch.long)
            positions = (torch.cumsum(mask, dim=1) * mask).long() - 1 + 2
            h = self.tok(ids) + self.pos(positions)
            h = torch.tanh(self.fc(h))
            return F.cross_entropy(self.head(h).reshape(-1, VOCAB), targets.reshape(-1))

    class BloomAlibi(nn.Module):
        heads = 2

        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(VOCAB, WIDTH)
            self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
            self.head = nn.Linear(WIDTH, VOCAB)

        def forward(self, ids, targets):
            b, t = ids.shape
            nh, hd = self.heads, WIDTH // self.heads
            mask = torch.ones(b, t)
            slopes = torch.tensor([2 ** (-8 * (i + 1) / nh) for i in range(nh)])
            arange = ((mask.cumsum(-1) - 1) * mask)[:, None, :]
            alibi = (slopes[None, :, None] * arange).reshape(b * nh, 1, t)
            q, k, v = self.qkv(self.tok(ids)).split(WIDTH, -1)

            def heads(x):
                return x.reshape(b, t, nh, hd).transpose(1, 2).reshape(b * nh, t, hd)

            scores = torch.baddbmm(alibi, heads(q), heads(k).transpose(1, 2), beta=1.0,
                                   alpha=1 / math.sqrt(hd))
            causal = torch.triu(torch.full((t, t), -1e9), 1)
            p = torch.softmax(scores + causal, -1)
            o = (p @ heads(v)).reshape(b, nh, t, hd).transpose(1, 2).reshape(b, t, WIDTH)
            return F.cross_entropy(self.head(o).reshape(-1, VOCAB), targets.reshape(-1))

    class BertTokenType(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(VOCAB, WIDTH)
            self.typ = nn.Embedding(2, WIDTH)
            self.head = nn.Linear(WIDTH, VOCAB)
            self.register_buffer("token_type_ids", torch.zeros((1, 64), dtype=torch.long),
                                 persistent=False)

        def forward(self, ids, targets):
            b, t = ids.shape
            types = self.token_type_ids[:, :t].expand(b, t)
            h = torch.tanh(self.tok(ids) + self.typ(types))
            return F.cross_entropy(self.head(h).reshape(-1, VOCAB), targets.reshape(-1))

    class ChannelShuffle(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.conv2 = nn.Conv2d(8, 8, 1, groups=2)
            self.head = nn.Linear(8, 10)

        def forward(self, x, y):
            h = torch.relu(self.conv(x))
            b, c, hh, ww = h.size()
            h = h.view(b, 2, c // 2, hh, ww).transpose(1, 2).contiguous().view(b, -1, hh, ww)
            h = torch.relu(self.conv2(h))
            return F.cross_entropy(self.head(h.mean((2, 3))), y)

    return {"opt": OptPositions, "bloom": BloomAlibi, "bert": BertTokenType,
            "shuffle": ChannelShuffle}


def samples(name, rng, w):
    """(inputs, targets, input names, data file) of STEPS global batches."""
    n = STEPS * BATCH
    if name == "shuffle":
        xs = rng.standard_normal((n, 3, 8, 8)).astype(np.float32)
        ys = rng.integers(0, 10, n).astype(np.int64)
        data = os.path.join(w, "data.safetensors")
        st.save(data, {"x": xs, "y": ys})  # sample-major: [N, ...]
        return xs, ys, ["x", "y"], data
    data = os.path.join(w, "tokens.bin")
    ids, targets = token_file(data, rng.integers(0, VOCAB, 2000), BATCH, SEQ, STEPS)
    return ids, targets, ["ids", "targets"], data


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--carve", required=True)
    ap.add_argument("--workdir", required=True)
    a = ap.parse_args()
    import torch

    shutil.rmtree(a.workdir, ignore_errors=True)
    os.makedirs(a.workdir)
    rng = np.random.default_rng(3)
    for name, cls in models().items():
        w = os.path.join(a.workdir, name)
        os.makedirs(w)
        torch.manual_seed(0)
        net = cls()
        xs, ys, names, data = samples(name, rng, w)
        onnx_path = os.path.join(w, name + ".onnx")
        torch.onnx.export(net, (torch.from_numpy(xs[:BATCH]), torch.from_numpy(ys[:BATCH])),
                          onnx_path, input_names=names, output_names=["loss"],
                          opset_version=17, do_constant_folding=False)
        _, worst, gap, where, _ = train_like_torch(a.carve, onnx_path, net, data, xs, ys,
                                                   os.path.join(w, "one"), BATCH, STEPS, LR,
                                                   LOSS_RTOL, WEIGHT_RTOL)
        print("ok: %s (static batch of %d): 1 rank against PyTorch, %d SGD steps: losses "
              "within %.2g, weights within %.2g (%s)" % (name, BATCH, STEPS, worst, gap, where))
        verify_plans(a.carve, name, onnx_path, data, PLANS, w)
        folded = os.path.join(w, name + "-folded.onnx")
        torch.manual_seed(0)
        torch.onnx.export(cls(), (torch.from_numpy(xs[:BATCH]), torch.from_numpy(ys[:BATCH])),
                          folded, input_names=names, output_names=["loss"], opset_version=17)
        os.makedirs(os.path.join(w, "folded"))
        verify_plans(a.carve, name + " with constant folding", folded, data, PLANS[:1],
                     os.path.join(w, "folded"))
    print("static-exports: all checks passed")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Failure as e:
        print("FAIL: %s" % e)
        sys.exit(1)
