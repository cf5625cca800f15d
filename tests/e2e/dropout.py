#!/usr/bin/env python3
"""Dropout in training mode: the same masks under every plan, PyTorch's arithmetic.

The model is written as people write one: nn.Embedding, a learned position
table, nn.TransformerEncoder of two nn.TransformerEncoderLayer(dropout=0.1)
(sequence-first, so the batch sits in dimension 1 and, inside the attention,
in the B*H of [T, B*H, D]), nn.Dropout, F.dropout, an nn.Linear head and
F.cross_entropy, exported with models/export.py in training mode. It has
8 dropout nodes: per layer the attention weights', dropout1, the
feed-forward's and dropout2, plus the two of the model.

Each mask element is a function of (seed, step, node, the element's index in
the full tensor) only (runtime/include/carve/rt/philox.h; tests/e2e/philox.py
is an independent NumPy implementation). What must hold:

1. PyTorch: the 1-rank program trains as PyTorch does when PyTorch's
   F.dropout is replaced by philox.py's masks (node = call order, which is
   the export's node order): 6 AdamW steps from the same weights on the same
   Markov-chain tokens, losses within 1e-5 relative and every weight within
   1e-5 of its tensor's largest entry (fp32 arithmetic in a different order).
   With masks drawn from another seed the losses differ by more than 1e-3, so
   the comparison sees the masks.
2. Plans: `carve verify` passes (losses within 1e-6 relative, weights within
   1e-5) for dp=2, dp=2 with 2 micro-batches, dp=4 (one sample per rank),
   tp=2, tp=2 with sequence parallelism, dp=2 x tp=2 with ZeRO-2, pp=2 with
   2 micro-batches, and recomputation. A rank drawing any piece's mask at the
   wrong place would put a whole piece's masks off (the runtime's
   Dropout.PiecesDrawTheFullTensorsMask test checks the places element by
   element), far outside these tolerances. Recomputation redraws the same
   masks: the recomputing program draws the layers' 8 masks a second time in
   backward, and its losses and weights are bitwise those without it.
3. The seed: `train --seed` changes the masks (losses differ), the manifest
   records {"generator": "philox4x32-10", "seed": S}, and a run resumed from
   a checkpoint without --seed continues with the checkpoint's seed: its
   losses and final weights are bitwise those of the unbroken run (dp=2).
4. It learns: under dp=2 with dropout 0.1 (AdamW, lr 1e-2) the loss on the
   Markov-chain tokens (data_gen.make_tokens: about 1.4 nats per token can be
   learned, against ln(64) = 4.16 for a uniform guess) falls below 2.5 (the
   mean of the last 5 of 60 steps; about 2.17 when written).
5. Bad input: a dropout with p = 1 (nn.Dropout(1.0)) is refused at compile
   with one line naming the node and the probability, exit 1, no output
   folder; `train --seed -1` is refused with one line.
"""

import argparse
import copy
import json
import os
import re
import shutil
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "models"))
import data_gen  # noqa: E402
import philox  # noqa: E402
import st  # noqa: E402
import harness  # noqa: E402

TIMEOUT_S = 600
VOCAB, D, HEADS, LAYERS, SEQ, BATCH, P = 64, 32, 4, 2, 16, 8, 0.1
TORCH_STEPS = 6
LEARN_STEPS, LEARNED_LOSS, LEARN_LR = 60, 2.5, "1e-2"


Failure = harness.Failure


def build(p=P, top_p=P):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(VOCAB, D)
            self.pos = nn.Parameter(torch.randn(SEQ, 1, D) * 0.02)
            layer = nn.TransformerEncoderLayer(D, HEADS, 2 * D, dropout=p)
            self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
            self.drop = nn.Dropout(top_p)
            self.head = nn.Linear(D, VOCAB)
            self.register_buffer(
                "causal", torch.triu(torch.full((SEQ, SEQ), float("-inf")), diagonal=1))

        def forward(self, x, y):
            h = self.drop(self.emb(x).transpose(0, 1) + self.pos)  # [T, B, D]
            h = self.encoder(h, mask=self.causal)
            logits = self.head(F.dropout(h, p, self.training)).transpose(0, 1)
            return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))

    return Net()


def export(path, **kw):
    import torch
    from export import export_for_carve

    net = build(**kw).train()
    x = torch.zeros(BATCH, SEQ, dtype=torch.int64)
    export_for_carve(net, (x, x), path, input_names=["x", "y"])
    return net


def run(cmd, timeout=TIMEOUT_S):
    return harness.run(cmd, timeout=timeout, merge=True)


def must(what, cmd):
    rc, out = run(cmd)
    if rc != 0:
        raise Failure("%s failed (exit %d): %s\n%s" % (what, rc, " ".join(cmd), out))
    return out


def write_plan(work, name, plan):
    path = os.path.join(work, name + ".json")
    with open(path, "w") as f:
        json.dump(plan, f)
    return path


def compile_plan(carve, work, model, name, plan, extra=()):
    out = os.path.join(work, name)
    shutil.rmtree(out, ignore_errors=True)
    must("compile " + name, [carve, "compile", model, "--plan", write_plan(work, name, plan),
                             "-o", out, "--quiet"] + list(extra))
    return out


def train(carve, out, ranks, data, steps, log, extra=()):
    must("train " + out, [carve, "run", out, "-n", str(ranks), "--", "--steps", str(steps),
                          "--data", data, "--log", log, "--progress", "none"] + list(extra))
    with open(log) as f:
        return [json.loads(line) for line in f if line.strip()]


def losses(rows):
    return [r["loss"] for r in rows]


# --- 1. PyTorch with the same masks ----------------------------------------

def torch_losses(net, tokens, steps, seed):
    import torch
    import torch.nn.functional as F

    original = F.dropout
    state = {"step": 0, "node": 0}

    def masked(input, p=0.5, training=True, inplace=False):
        if not training or p == 0:
            return input
        m = philox.dropout_mask(tuple(input.shape), seed, state["step"], state["node"],
                                float(np.float32(p)))
        state["node"] += 1
        return input * torch.from_numpy(m).to(input.dtype)

    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.01)
    out = []
    F.dropout = masked
    try:
        for step in range(steps):
            state["step"], state["node"] = step, 0
            x, y = data_gen.token_batch(tokens, step, BATCH, SEQ)
            loss = net(torch.from_numpy(x), torch.from_numpy(y))
            if state["node"] != 2 + 4 * LAYERS:
                raise Failure("PyTorch drew %d masks in a step, expected %d" %
                              (state["node"], 2 + 4 * LAYERS))
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(float(loss))
    finally:
        F.dropout = original
    return out


def check_torch(carve, work, model, data, tokens):
    out = compile_plan(carve, work, model, "one", {"dp": 1})
    src = open(os.path.join(out, "src", "program0.cpp")).read()
    nodes = sorted(set(int(n) for n in re.findall(r"// Dropout p=[0-9.]+ \(node (\d+)\)", src)))
    if nodes != list(range(2 + 4 * LAYERS)):
        raise Failure("the program draws masks for nodes %s, expected 0..%d" %
                      (nodes, 1 + 4 * LAYERS))
    save = os.path.join(work, "one-save")
    shutil.rmtree(save, ignore_errors=True)
    mine = losses(train(carve, out, 1, data, TORCH_STEPS, os.path.join(work, "one.jsonl"),
                        ["--save", save]))
    net = build().train()
    exact = copy.deepcopy(net).double()
    ref = torch_losses(net, tokens, TORCH_STEPS, 0)
    worst = max(abs(a - b) / abs(b) for a, b in zip(mine, ref))
    for k, (a, b) in enumerate(zip(mine, ref)):
        print("  step %d: carve %.8f  PyTorch %.8f" % (k, a, b))
    if worst > 1e-5:
        raise Failure("1 rank vs PyTorch with the same masks: losses differ by %.2e relative "
                      "(tolerance 1e-5)" % worst)
    def weight_gap(weights, module):
        worst_w, worst_name = 0.0, ""
        for name, t in module.state_dict().items():
            if name not in weights:
                continue
            ref_w = t.detach().double().numpy()
            mine_w = np.asarray(weights[name], dtype=np.float64)
            if name.endswith("self_attn.in_proj_bias"):
                # The key bias's gradient is zero in exact arithmetic (softmax
                # ignores a shift of every score of a row), so both sides' are
                # rounding noise, which AdamW's normalization turns into steps of
                # about lr with arbitrary signs: compare the query and value
                # sections only.
                ref_w = np.concatenate([ref_w[:D], ref_w[2 * D:]])
                mine_w = np.concatenate([mine_w[:D], mine_w[2 * D:]])
            gap = float(np.max(np.abs(mine_w - ref_w))) / max(1e-12,
                                                               float(np.max(np.abs(ref_w))))
            if gap > worst_w:
                worst_w, worst_name = gap, name
        return worst_w, worst_name

    # Well posed: PyTorch's own float32 run within these tolerances of its float64 run.
    ref64 = torch_losses(exact, tokens, TORCH_STEPS, 0)  # token ids in: the module decides
    posed = max(abs(a - b) / abs(b) for a, b in zip(ref, ref64))
    posed_w, posed_at = weight_gap({n: t.detach().numpy() for n, t in net.state_dict().items()},
                                   exact)
    if posed > 1e-5 or posed_w > 1e-5:
        raise Failure("not well posed in float32: PyTorch's own float32 run is %.2e (losses) and "
                      "%.2e (%s) from its float64 run; the test allows carve 1e-5" %
                      (posed, posed_w, posed_at))
    weights = st.load_checkpoint(save)
    worst_w, worst_name = weight_gap(weights, net)
    if worst_w > 1e-5:
        raise Failure("1 rank vs PyTorch: weight %s differs by %.2e of its largest entry "
                      "(tolerance 1e-5)" % (worst_name, worst_w))
    other = torch_losses(build().train(), tokens, 2, 1)
    moved = max(abs(a - b) / abs(b) for a, b in zip(other, ref[:2]))
    if moved <= 1e-3:
        raise Failure("masks from seed 1 change the losses by only %.2e; the comparison would "
                      "not see the masks" % moved)
    print("ok: 1 rank equals PyTorch with philox.py's masks over %d steps (losses within %.1e "
          "relative, weights within %.1e of their largest entry, worst %s); another seed's "
          "masks move the losses by %.1e; well posed (PyTorch float32 to float64: losses %.1e, "
          "weights %.1e)" % (TORCH_STEPS, worst, worst_w, worst_name, moved, posed, posed_w))


# --- 2. Plans --------------------------------------------------------------

PLANS = [
    ("dp2", {"dp": 2}),
    ("dp2-micro2", {"dp": 2, "num_micro_batches": 2}),
    ("dp4", {"dp": 4}),
    ("tp2", {"tp": 2}),
    ("tp2-sp", {"tp": 2, "sequence_parallel": True}),
    ("dp2tp2-zero2", {"dp": 2, "tp": 2, "zero": 2}),
    ("pp2", {"pp": 2, "num_micro_batches": 2}),
    ("recompute", {"recompute": "full"}),
]


def check_plan(carve, work, model, data, name, plan):
    rc, out = run([carve, "verify", model, "--plan", write_plan(work, name, plan), "--data", data,
                   "--steps", "3", "--tolerance-loss", "1e-6", "--tolerance-weights", "1e-5"])
    last = out.strip().splitlines()[-1] if out.strip() else ""
    if rc != 0 or not last.startswith("PASS"):
        raise Failure("%s %s: carve verify did not pass (exit %d):\n%s" %
                      (name, json.dumps(plan), rc, out))
    print("ok: %s %s: %s" % (name, json.dumps(plan), last))


def check_recompute_bitwise(carve, work, model, data):
    runs = {}
    for name, plan in [("rc-none", {}), ("rc-full", {"recompute": "full"})]:
        out = compile_plan(carve, work, model, name, plan)
        save = os.path.join(work, name + "-save")
        shutil.rmtree(save, ignore_errors=True)
        rows = train(carve, out, 1, data, 3, os.path.join(work, name + ".jsonl"),
                     ["--save", save])
        runs[name] = (losses(rows), st.load_checkpoint(save))
    (l0, w0), (l1, w1) = runs["rc-none"], runs["rc-full"]
    draws = {}
    for name in runs:
        with open(os.path.join(work, name, "src", "program0.cpp")) as f:
            draws[name] = len(re.findall(r"// Dropout p=", f.read()))
    if draws["rc-full"] - draws["rc-none"] != 4 * LAYERS:
        raise Failure("recompute=full draws %d masks, without it %d: expected the layers' %d "
                      "again" % (draws["rc-full"], draws["rc-none"], 4 * LAYERS))
    if l0 != l1:
        raise Failure("recomputation changed the losses: %s vs %s" % (l1, l0))
    diff = [k for k in w0 if not np.array_equal(w0[k], w1[k])]
    if diff:
        raise Failure("recomputation changed weights %s" % diff[:3])
    print("ok: recompute=full draws the layers' %d masks again in backward (%d draws, %d "
          "without); 3 steps' losses and every weight bitwise those without recomputation" %
          (4 * LAYERS, draws["rc-full"], draws["rc-none"]))


# --- 3. The seed and resuming ----------------------------------------------

def manifest_rng(save):
    with open(os.path.join(st.checkpoint_folder(save), "manifest.json")) as f:
        return json.load(f)["rng"]


def check_resume(carve, work, model, data):
    out = compile_plan(carve, work, model, "resume-dp2", {"dp": 2})
    whole, half, rest = (os.path.join(work, n) for n in ("whole", "half", "rest"))
    for d in (whole, half, rest):
        shutil.rmtree(d, ignore_errors=True)
    a = losses(train(carve, out, 2, data, 6, os.path.join(work, "whole.jsonl"),
                     ["--seed", "5", "--save", whole]))
    train(carve, out, 2, data, 3, os.path.join(work, "half.jsonl"), ["--seed", "5", "--save", half])
    rng = manifest_rng(half)
    if rng != {"generator": "philox4x32-10", "seed": 5}:
        raise Failure("the manifest's rng is %s, expected the generator and seed 5" % rng)
    log = os.path.join(work, "rest.jsonl")
    rc, text = run([carve, "run", out, "-n", "2", "--", "--steps", "3", "--data", data, "--log",
                    log, "--progress", "none", "--load", half, "--save", rest])
    if rc != 0:
        raise Failure("resume failed:\n" + text)
    if "dropout masks from seed 5 (the checkpoint's)" not in text:
        raise Failure("the resumed run did not say it takes the checkpoint's seed:\n" + text)
    with open(log) as f:
        b = [json.loads(line)["loss"] for line in f if line.strip()]
    if b != a[3:]:
        raise Failure("resumed losses %s differ from the unbroken run's %s" % (b, a[3:]))
    wa, wb = st.load_checkpoint(whole), st.load_checkpoint(rest)
    diff = [k for k in wa if not np.array_equal(wa[k], wb[k])]
    if diff:
        raise Failure("resumed weights differ from the unbroken run's: %s" % diff[:3])
    seed0 = losses(train(carve, out, 2, data, 2, os.path.join(work, "seed0.jsonl")))
    if seed0 == a[:2]:
        raise Failure("--seed 5 and the default seed gave the same losses %s" % seed0)
    print("ok: dp=2 --seed 5: manifest rng %s; resumed without --seed at step 3, losses and "
          "weights bitwise those of the unbroken 6 steps; seed 0 draws other masks (step 0 "
          "loss %.6f vs %.6f)" % (json.dumps(rng), seed0[0], a[0]))


# --- 4. It learns -----------------------------------------------------------

def check_learns(carve, work, model, data):
    out = compile_plan(carve, work, model, "learn", {"dp": 2}, ["--lr", LEARN_LR])
    rows = train(carve, out, 2, data, LEARN_STEPS, os.path.join(work, "learn.jsonl"))
    got = losses(rows)
    tail = sum(got[-5:]) / 5
    if not tail < LEARNED_LOSS:
        raise Failure("with dropout %.1f the loss went from %.3f to %.3f (mean of the last 5 of "
                      "%d steps, AdamW lr %s), not below %.2f" %
                      (P, got[0], tail, LEARN_STEPS, LEARN_LR, LEARNED_LOSS))
    print("ok: with dropout %.1f the loss falls from %.3f to %.3f (mean of the last 5 of %d "
          "steps, AdamW lr %s, dp=2; bound %.2f)" %
          (P, got[0], tail, LEARN_STEPS, LEARN_LR, LEARNED_LOSS))


# --- 5. Bad input -------------------------------------------------------------

def check_bad(carve, work):
    bad = os.path.join(work, "p1.onnx")
    export(bad, top_p=1.0)
    out = os.path.join(work, "p1-out")
    shutil.rmtree(out, ignore_errors=True)
    rc, text = run([carve, "compile", bad, "-o", out, "--quiet"])
    lines = [l for l in text.strip().splitlines() if "error" in l]
    if rc != 1 or len(lines) != 1 or "/drop/Dropout" not in lines[0] or "[0, 1)" not in lines[0]:
        raise Failure("p = 1: expected exit 1 and one error line naming /drop/Dropout and [0, 1), "
                      "got exit %d:\n%s" % (rc, text))
    if os.path.exists(out):
        raise Failure("p = 1: the refused compile left %s" % out)
    print("ok: p = 1 refused: %s" % lines[0])
    prog = os.path.join(work, "one")
    rc, text = run([os.path.join(prog, "bin", "train"), "--steps", "1", "--data",
                    os.path.join(work, "tokens.bin"), "--seed", "-1"])
    if rc == 0 or "--seed" not in text:
        raise Failure("--seed -1: expected a refusal naming --seed, got exit %d:\n%s" % (rc, text))
    print("ok: --seed -1 refused: %s" % text.strip().splitlines()[-1])


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

    model = os.path.join(a.workdir, "dropout.onnx")
    export(model)
    tokens = data_gen.make_tokens(20000, VOCAB, seed=0)
    data = os.path.join(a.workdir, "tokens.bin")
    data_gen.write_tokens(data, tokens)
    attempt(check_torch, a.carve, a.workdir, model, data, tokens)
    for name, plan in PLANS:
        attempt(check_plan, a.carve, a.workdir, model, data, name, plan)
    attempt(check_recompute_bitwise, a.carve, a.workdir, model, data)
    attempt(check_resume, a.carve, a.workdir, model, data)
    attempt(check_learns, a.carve, a.workdir, model, data)
    attempt(check_bad, a.carve, a.workdir)
    if failures:
        print("FAILED: %d check(s): %s" % (len(failures), "; ".join(failures)))
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
