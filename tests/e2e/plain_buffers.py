#!/usr/bin/env python3
"""Plain exports: masks an export makes parameters, initializers it merges.

A plain torch.onnx.export in training mode (no constant folding: the way
to keep parameter names) writes a module's float buffers, such as GPT-2's
causal mask `attn.bias` or an additive `-inf` mask, as initializers, which
carve reads as trainable parameters. No gradient reaches them: carve trains
them as PyTorch does (not at all; an optimizer skips a parameter whose
.grad stays None) and says so in one note. An additive mask becomes the
mask operand of carve.attention, which gives it no gradient; that used to
stop the compile.

What must hold, for two models (masked_fill with a `tril` buffer, two
layers; an additive mask raised to carve.attention):
1. `carve compile` exits 0, notes once that it guessed what is trainable
   (no metadata), and prints one note naming exactly the buffers.
2. 1 rank against PyTorch: STEPS plain SGD steps from the export's weights
   on the same samples; losses within LOSS_RTOL, weights within
   WEIGHT_RTOL of each tensor's largest entry, the buffers bitwise
   unchanged in the checkpoint.
3. A tensor used both as a mask and elsewhere (so its gradient would be
   incomplete) still fails, naming the op and the parameter.
4. An eval-mode export (PyTorch's default for a module in eval mode) merges
   initializers of equal value, here two LayerNorms' weights and biases,
   into one reached through Identity nodes. carve keeps them apart (10
   parameters, as the module has), says so in one note, and trains the
   module's model: against PyTorch as in 2, ln2's tensors ending different
   from ln1's.
5. A tied output projection (`head.weight = emb.weight`) in a plain export
   with constant folding (torch.onnx.export's default) leaves the head a
   transposed copy of the embedding as an initializer of its own. carve
   trains the two as one tensor, as PyTorch trains the tie, says so in one
   note naming the copy, matches PyTorch as in 2 (trained apart they ended
   7.8e-4 from it), and `carve ckpt merge --model` writes the copy under its
   name too, the embedding transposed.
"""

import argparse
import os
import shutil
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import st  # noqa: E402 (checkpoints)
from torch_compare import (Failure, check_well_posed, read_losses, sgd_losses,  # noqa: E402
                           token_file, well_posed_reference, worst_loss_gap, worst_weight_gap)
import harness  # noqa: E402

STEPS = 5
BATCH, T, VOCAB, D = 4, 16, 64, 32
LR = 0.1
LOSS_RTOL = 1e-5
WEIGHT_RTOL = 1e-4
TIMEOUT_S = 300


def run(cmd):
    return harness.run(cmd, timeout=TIMEOUT_S)


def models():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Attn(nn.Module):
        def __init__(self, additive, shared=False):
            super().__init__()
            self.additive, self.shared = additive, shared
            self.qkv = nn.Linear(D, 3 * D)
            self.proj = nn.Linear(D, D)
            if shared:
                self.mask = nn.Parameter(torch.full((T, T), -1e4).triu(1))
            elif additive:
                self.register_buffer("mask", torch.full((T, T), float("-inf")).triu(1))
            else:
                self.register_buffer("bias", torch.tril(torch.ones(T, T)).view(1, 1, T, T))

        def forward(self, x):
            B, _, C = x.shape
            q, k, v = self.qkv(x).split(C, 2)
            q, k, v = (t.view(B, T, 4, C // 4).transpose(1, 2) for t in (q, k, v))
            a = q @ k.transpose(-2, -1) * (1.0 / (C // 4) ** 0.5)
            if self.additive or self.shared:
                a = a + self.mask
            else:
                a = a.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            y = self.proj((F.softmax(a, -1) @ v).transpose(1, 2).reshape(B, T, C))
            return y + self.mask.mean() if self.shared else y

    class Net(nn.Module):
        def __init__(self, additive, layers, shared=False):
            super().__init__()
            self.emb = nn.Embedding(VOCAB, D)
            self.blocks = nn.ModuleList(Attn(additive, shared) for _ in range(layers))
            self.head = nn.Linear(D, VOCAB)

        def forward(self, ids, labels):
            x = self.emb(ids)
            for b in self.blocks:
                x = x + b(x)
            return F.cross_entropy(self.head(x).view(-1, VOCAB), labels.view(-1))

    torch.manual_seed(0)
    return {"masked_fill": (Net(False, 2), ["blocks.0.bias", "blocks.1.bias"]),
            "additive": (Net(True, 1), ["blocks.0.mask"]),
            "shared": (Net(False, 1, shared=True), None)}


def export(net, path):
    import torch
    ids = torch.zeros(BATCH, T, dtype=torch.int64)
    torch.onnx.export(net.train(), (ids, ids.clone()), path, input_names=["ids", "labels"],
                      output_names=["loss"], opset_version=17,
                      training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)


def check_merged(a):
    """Item 4."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.ln1 = nn.Linear(16, 32), nn.LayerNorm(32)
            self.fc2, self.ln2 = nn.Linear(32, 32), nn.LayerNorm(32)
            self.head = nn.Linear(32, 10)

        def forward(self, x, y):
            h = self.ln1(F.relu(self.fc1(x)))
            h = self.ln2(F.relu(self.fc2(h)))
            return F.cross_entropy(self.head(h), y)

    torch.manual_seed(0)
    net = Net().eval()
    rng = np.random.default_rng(4)
    xs = rng.standard_normal((STEPS * BATCH, 16)).astype(np.float32)
    ys = rng.integers(0, 10, STEPS * BATCH).astype(np.int64)
    onnx_path = os.path.join(a.workdir, "merged.onnx")
    torch.onnx.export(net, (torch.from_numpy(xs[:BATCH]), torch.from_numpy(ys[:BATCH])),
                      onnx_path, input_names=["x", "y"], output_names=["loss"],
                      opset_version=17, do_constant_folding=False)
    data = os.path.join(a.workdir, "merged.safetensors")
    st.save(data, {"x": xs, "y": ys})
    out = os.path.join(a.workdir, "merged")
    p = run([a.carve, "compile", onnx_path, "-o", out, "--quiet", "--optimizer", "sgd", "--lr",
             str(LR), "--clip-grad-norm", "0"])
    if p.returncode != 0:
        raise Failure("merged: compile failed:\n%s%s" % (p.stdout, p.stderr))
    notes = [l for l in p.stderr.splitlines()
             if l.startswith("carve: note:") and "merged into another" in l]
    if len(notes) != 1 or "ln2.bias (= ln1.bias), ln2.weight (= ln1.weight)" not in notes[0]:
        raise Failure("merged: expected one note naming ln2's tensors, got:\n%s" % p.stderr)
    print("ok: merged: %s" % notes[0])
    p = run([a.carve, "run", out, "-n", "1", "--", "--steps", str(STEPS), "--data", data,
             "--log", out + ".jsonl", "--save", out + ".ckpt", "--progress", "none"])
    if p.returncode != 0:
        raise Failure("merged: training failed:\n%s%s" % (p.stdout, p.stderr))
    losses = read_losses(out + ".jsonl")
    batches = [(xs[k * BATCH:(k + 1) * BATCH], ys[k * BATCH:(k + 1) * BATCH])
               for k in range(STEPS)]
    exact, exact_losses = well_posed_reference(net, batches, LR)
    ref = sgd_losses(net, batches, LR)
    check_well_posed(net, ref, exact, exact_losses, LOSS_RTOL, WEIGHT_RTOL)
    worst = worst_loss_gap("merged", losses, ref, LOSS_RTOL)
    mine = st.load_checkpoint(out + ".ckpt")
    if sorted(mine) != sorted(net.state_dict()):
        raise Failure("merged: checkpoint tensors %s, the module's %s"
                      % (sorted(mine), sorted(net.state_dict())))
    gap, _, _ = worst_weight_gap("merged", out + ".ckpt", net, WEIGHT_RTOL)
    if np.array_equal(mine["ln1.weight"], mine["ln2.weight"]):
        raise Failure("merged: ln1.weight and ln2.weight trained as one tensor")
    print("ok: merged: %d SGD steps against PyTorch: losses within %.2g, weights within %.2g, "
          "ln1 and ln2 apart" % (STEPS, worst, gap))


def check_tied(a, ids, labels, data):
    """Item 5."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(VOCAB, D)
            self.fc = nn.Linear(D, D)
            self.head = nn.Linear(D, VOCAB, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids, labels):
            h = torch.tanh(self.fc(self.emb(ids)))
            return F.cross_entropy(self.head(h).view(-1, VOCAB), labels.view(-1))

    torch.manual_seed(0)
    net = Tied()
    onnx_path = os.path.join(a.workdir, "tied.onnx")
    torch.onnx.export(net, (torch.from_numpy(ids[:BATCH]), torch.from_numpy(labels[:BATCH])),
                      onnx_path, input_names=["ids", "labels"], output_names=["loss"],
                      opset_version=17)  # constant folding on: the default
    out = os.path.join(a.workdir, "tied")
    p = run([a.carve, "compile", onnx_path, "-o", out, "--quiet", "--optimizer", "sgd", "--lr",
             str(LR), "--clip-grad-norm", "0"])
    if p.returncode != 0:
        raise Failure("tied: compile failed:\n%s%s" % (p.stdout, p.stderr))
    notes = [l for l in p.stderr.splitlines()
             if l.startswith("carve: note:") and "exactly another's transpose" in l]
    if len(notes) != 1 or "(= emb.weight transposed)" not in notes[0]:
        raise Failure("tied: expected one note naming the copy of emb.weight, got:\n%s"
                      % p.stderr)
    copy = notes[0].split("tie: ")[1].split(" (= emb.weight")[0]
    print("ok: tied: %s" % notes[0])
    ckpt = out + ".ckpt"
    p = run([a.carve, "run", out, "-n", "1", "--", "--steps", str(STEPS), "--data", data,
             "--log", out + ".jsonl", "--save", ckpt, "--progress", "none"])
    if p.returncode != 0:
        raise Failure("tied: training failed:\n%s%s" % (p.stdout, p.stderr))
    batches = [(ids[k * BATCH:(k + 1) * BATCH], labels[k * BATCH:(k + 1) * BATCH])
               for k in range(STEPS)]
    exact, exact_losses = well_posed_reference(net, batches, LR)
    ref = sgd_losses(net, batches, LR)
    check_well_posed(net, ref, exact, exact_losses, LOSS_RTOL, WEIGHT_RTOL)
    worst = worst_loss_gap("tied", read_losses(out + ".jsonl"), ref, LOSS_RTOL)
    mine = st.load_checkpoint(ckpt)
    if copy in mine:
        raise Failure("tied: the checkpoint holds the copy %s as a tensor of its own" % copy)
    want = net.emb.weight.detach().numpy()
    gap = float(np.max(np.abs(mine["emb.weight"] - want)) / np.max(np.abs(want)))
    if gap > WEIGHT_RTOL:
        raise Failure("tied: emb.weight %.3g from PyTorch's (limit %g)" % (gap, WEIGHT_RTOL))
    merged = os.path.join(a.workdir, "tied-merged.safetensors")
    p = run([a.carve, "ckpt", "merge", ckpt, "-o", merged, "--model", onnx_path])
    if p.returncode != 0:
        raise Failure("tied: ckpt merge failed:\n%s%s" % (p.stdout, p.stderr))
    full = st.load(merged)
    if copy not in full or not np.array_equal(full[copy], full["emb.weight"].T):
        raise Failure("tied: the merged file should hold %s as emb.weight transposed; it has %s"
                      % (copy, sorted(full)))
    print("ok: tied: %d SGD steps against PyTorch: losses within %.2g, emb.weight within %.2g; "
          "the merged file writes %s as emb.weight transposed" % (STEPS, worst, gap, copy))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--carve", required=True)
    ap.add_argument("--workdir", required=True)
    a = ap.parse_args()

    shutil.rmtree(a.workdir, ignore_errors=True)
    os.makedirs(a.workdir)
    rng = np.random.default_rng(3)
    data = os.path.join(a.workdir, "tokens.bin")
    ids, labels = token_file(data, rng.integers(0, VOCAB, 4000), BATCH, T, STEPS)
    for name, (net, buffers) in models().items():
        onnx_path = os.path.join(a.workdir, name + ".onnx")
        export(net, onnx_path)
        out = os.path.join(a.workdir, name)
        p = run([a.carve, "compile", onnx_path, "-o", out, "--quiet", "--optimizer", "sgd", "--lr",
                 str(LR), "--clip-grad-norm", "0"])
        if buffers is None:
            # 3. The mask is also used elsewhere: its gradient would be incomplete.
            if p.returncode == 0 or "gives no gradient to operand" not in p.stderr or \
                    "'blocks.0.mask', whose other uses need one" not in p.stderr:
                raise Failure("%s: expected a failure naming the op and blocks.0.mask, got %d:\n"
                              "%s%s" % (name, p.returncode, p.stdout, p.stderr))
            print("ok: %s: %s" % (name, p.stderr.strip().splitlines()[-1]))
            continue
        if p.returncode != 0:
            raise Failure("%s: compile failed:\n%s%s" % (name, p.stdout, p.stderr))
        notes = [l for l in p.stderr.splitlines() if l.startswith("carve: note:")]
        guessed = [l for l in notes if "no carve.parameters metadata" in l]
        notes = [l for l in notes if "no gradient" in l]
        if len(guessed) != 1 or len(notes) != 1 or \
                not notes[0].endswith(": " + ", ".join(buffers)):
            raise Failure("%s: expected a note on the guess and one naming %s, got:\n%s"
                          % (name, buffers, p.stderr))
        print("ok: %s: %s" % (name, notes[0]))
        log, ckpt = out + ".jsonl", out + ".ckpt"
        p = run([a.carve, "run", out, "-n", "1", "--", "--steps", str(STEPS), "--data", data,
                 "--log", log, "--save", ckpt, "--progress", "none"])
        if p.returncode != 0:
            raise Failure("%s: training failed:\n%s%s" % (name, p.stdout, p.stderr))
        losses = read_losses(log)
        initial = {k: v.detach().clone() for k, v in net.state_dict().items()}
        batches = [(ids[k * BATCH:(k + 1) * BATCH], labels[k * BATCH:(k + 1) * BATCH])
                   for k in range(STEPS)]
        exact, exact_losses = well_posed_reference(net, batches, LR)
        ref = sgd_losses(net, batches, LR)
        check_well_posed(net, ref, exact, exact_losses, LOSS_RTOL, WEIGHT_RTOL)
        worst = worst_loss_gap(name, losses, ref, LOSS_RTOL)
        mine = st.load_checkpoint(ckpt)
        for k in buffers:
            if not np.array_equal(mine[k], initial[k].numpy()):
                raise Failure("%s: buffer %s changed in training" % (name, k))
        gap, where, _ = worst_weight_gap(name, ckpt, net, WEIGHT_RTOL, skip=buffers)
        print("ok: %s: %d SGD steps against PyTorch: losses within %.2g, weights within %.2g "
              "(%s), buffers unchanged" % (name, STEPS, worst, gap, where))
    check_merged(a)
    check_tied(a, ids, labels, data)
    print("plain-buffers: all checks passed")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (Failure, subprocess.TimeoutExpired) as e:
        print("FAIL: %s" % e)
        sys.exit(1)
