#!/usr/bin/env python3
"""Common ONNX ops that carve builds from others: LeakyRelu, Softplus, Clip,
ReduceL2, Einsum, OneHot, CumSum, TopK, HardSigmoid and HardSwish, in a model
written with PyTorch's own modules and functions (nn.LeakyReLU, F.softplus,
torch.clamp, F.normalize, F.hardtanh, F.hardswish, F.hardsigmoid, torch.einsum with a parameter, batch indices, contractions,
outer products and `...`, F.one_hot, torch.cumsum of floats and of int64,
torch.topk in a top-2 mixture of experts), exported by a plain
torch.onnx.export.

What must hold:
1. The import holds each op (carve import --summary lists no unsupported op),
   and the exported graph really has them (checked with onnx).
2. 1 rank against PyTorch: the same weights (the export's initializers) and
   samples, plain SGD (lr 0.1, no momentum, no clipping), STEPS steps: every
   step's loss within LOSS_RTOL of PyTorch's and every final weight within
   WEIGHT_RTOL of its tensor's largest entry. The composites compute in
   float32 like PyTorch but not op for op (Softplus as relu(x) +
   log(1 + e^-|x|), ReduceL2 as sqrt(sum(x^2))), a few ulp per op; measured
   below 1e-6.
3. dp=2 and tp=2 (the hidden layers split, so the norm is a sum over split
   columns) pass `carve verify` against 1 rank (its 1e-5 and 1e-4).
4. An einsum carve cannot build (a diagonal, `ii->i`) fails the import with
   one line naming the node and the index, exit 1.
5. Tables a model builds from its input's shape, which the exporter leaves
   as LessOrEqual (T5's causal mask), Tile and GatherElements (GPT-J-style
   rotary tables) and carve evaluates at import: 1 rank against PyTorch as
   in 2.
5b. Slice assignments, exported as ScatterND with constant indices (T5's shift
   right of floats and of int64 targets, a parameter written into a computed
   tensor, index_put_ with accumulate): 1 rank against PyTorch as in 2; dp=2
   of that model, whose shift of the targets mixes samples, refused naming the
   node; a per-sample variant exported with its static batch under dp=2, tp=2
   and pp=2 (2 micro-batches) passes `carve verify` against 1 rank.
6. With --emulated CONFIG (the CUDA target's CPU emulation, tests/gpu-emu):
   the CUDA programs for 1 GPU and tp=2 on 2 emulated GPUs, and the per-sample
   slice assignments of 5b on 1 GPU, train the same steps within
   FP32_CUDA_RTOL of the CPU target's 1-rank losses
   (train_vs_cpu.py's fp32 bound: cuBLAS and the CPU sum in other orders).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import st  # noqa: E402
from torch_compare import Failure, run, train_like_torch  # noqa: E402

STEPS = 8
BATCH = 8
LR = 0.1
LOSS_RTOL = 1e-5
WEIGHT_RTOL = 1e-4
OPS = ["LeakyRelu", "Softplus", "Clip", "ReduceL2", "Einsum", "OneHot", "CumSum", "TopK",
       "HardSigmoid", "HardSwish"]
TIMEOUT_S = 300
FP32_CUDA_RTOL = 1e-4


def model():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(16, 32)
            self.act = nn.LeakyReLU(0.1)
            self.fc2 = nn.Linear(32, 32)
            self.head = nn.Linear(32, 10)
            self.proj = nn.Parameter(torch.randn(32, 32) * 0.2)
            self.gate = nn.Parameter(torch.randn(4) * 0.5)
            self.router = nn.Linear(32, 4)
            self.experts = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))

        def forward(self, x, y):
            h = self.act(self.fc1(x))
            h = F.softplus(self.fc2(h))
            h = torch.clamp(h, 0.1, 2.5)
            h = F.normalize(h, dim=-1) * 4.0
            h = F.hardtanh(h, -0.9, 0.9)
            # MobileNetV3's activations: over [-3.6, 3.6], so both kinks are crossed.
            h = F.hardswish(4.0 * h) * 0.25 + F.hardsigmoid(4.0 * h)
            h = torch.einsum("bi,ij->bj", h, self.proj)
            q = h.reshape(-1, 4, 8)
            att = torch.softmax(torch.einsum("bqd,bkd->bqk", q, q), -1)
            q = torch.einsum("bqk,bkd->bqd", att, q)
            q = q * torch.einsum("q,d->qd", self.gate, torch.ones(8)).sigmoid()
            scale = torch.einsum("...d,...d->...", q, q).sum(-1, keepdim=True)
            h = q.reshape(-1, 32) / (1.0 + scale)
            h = h + 0.1 * torch.cumsum(h, dim=-1)
            # torch.split, which torch 1.13 exports as Split (and the dynamo
            # exporter as SplitToSequence + SequenceAt: section 5).
            lo, hi = torch.split(h, [12, 20], dim=-1)
            h = torch.cat([hi * 0.5, lo], dim=-1)
            # A mixture of 4 experts with top-2 routing (computed densely):
            # torch.topk, F.one_hot and einsum, as MoE layers write them.
            top, idx = torch.topk(F.softmax(self.router(h), -1), 2)
            top = top / top.sum(-1, keepdim=True)
            weights = (F.one_hot(idx, 4).float() * top.unsqueeze(-1)).sum(1)
            outs = torch.stack([e(h) for e in self.experts], 1)
            h = h + torch.einsum("be,bed->bd", weights, outs)
            logits = self.head(h)
            # An additive margin on the target's logit (AM-softmax), over
            # F.one_hot's mask.
            # and a mask of the classes from the target's on (an integer
            # cumulative sum). Along the batch it would couple samples, which
            # data parallelism runs per replica, as PyTorch DDP does.
            onehot = F.one_hot(y, 10)
            seen = torch.cumsum(onehot, dim=-1).float()
            return F.cross_entropy(logits - 0.3 * onehot.float() - 0.01 * seen, y)

    torch.manual_seed(0)
    return Net()


def tables_model():
    """Tables computed from the input's shape, which the exporter leaves as ops and carve
    evaluates at import: T5's causal mask (LessOrEqual of two ranges), GPT-J-style rotary
    tables (Tile, GatherElements)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Tables(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.head = nn.Linear(8, 10)

        def forward(self, x, y):  # x [B, T, 8]
            t = torch.arange(x.shape[1], device=x.device)
            mask = (t[None, :] <= t[:, None]).to(x.dtype)
            freqs = torch.arange(4, device=x.device).float().repeat(x.shape[1] // 4)
            idx = t.flip(0).unsqueeze(0).repeat(8, 1)
            perm = torch.gather(t.unsqueeze(0).repeat(8, 1).float(), 1, idx)
            # 2-D, so that the export keeps fc.weight as the Gemm's (a 3-D
            # input makes it a MatMul of a folded transposed copy).
            h = torch.tanh(self.fc(x.reshape(-1, 8))).reshape(x.shape)
            h = torch.einsum("st,btd->bsd", mask / mask.sum(-1, keepdim=True), h)
            h = h * torch.cos(freqs)[None, :, None] + 0.01 * perm.t()[None, :, :]
            return F.cross_entropy(self.head(h.mean(1)), y)

    torch.manual_seed(0)
    return Tables()


def scatter_model(per_sample=False):
    """Slice assignments, which the exporter writes as ScatterND with constant indices:
    T5's shift right (of floats, and of the int64 targets, whose start token is a
    constant), a parameter written into a computed tensor, and index_put_ with
    accumulate. The shift of the targets and the index_put_ into 4 samples mix samples
    of the batch; `per_sample` keeps every sample's writes within it instead, so that a
    plan may split the batch."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Scatter(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.head = nn.Linear(8, 10)
            self.start = nn.Parameter(torch.randn(8) * 0.3)
            self.table = nn.Parameter(torch.randn(10, 8) * 0.3)

        def forward(self, x, y):  # x [B, T, 8], y [B]
            h = torch.tanh(self.fc(x))
            shifted = torch.zeros_like(h)
            shifted[:, 1:] = h[:, :-1]
            shifted[:, 0] = self.start
            acc = h.clone()
            if per_sample:
                prev = y * 0 + 3  # from y: a folded constant of the export's batch would be
                # carried through Gather, which batch tracking does not do yet (issue: static
                # exports under every plan)
                rows = torch.arange(x.shape[0])[:, None]
                acc.index_put_((rows, torch.tensor([0, 2, 5])[None, :]), shifted[:, 1:4],
                               accumulate=True)
            else:
                prev = torch.zeros_like(y)
                prev[1:] = y[:-1]
                prev[0] = 3
                acc.index_put_((torch.arange(4), torch.tensor([0, 2, 2, 5])), shifted[:4, 1],
                               accumulate=True)
            z = shifted * acc + F.embedding(prev, self.table)[:, None, :]
            return F.cross_entropy(self.head(z.mean(1)), y)

    torch.manual_seed(0)
    return Scatter()


def dynamo_forms(src, dst):
    """Writes `src` with the ops torch 2.x's dynamo exporter uses in place of torch 1.13's
    (opset 17 has them all): Split -> SplitToSequence + one SequenceAt per output, Cast to
    FLOAT -> CastLike of the graph's float input x, plus a CastLike of an int64 constant 1
    multiplying the loss (x1.0)."""
    import onnx
    from onnx import TensorProto, helper

    m = onnx.load(src)
    g = m.graph
    nodes = []
    for n in g.node:
        if n.op_type == "Split":
            axis = [a.i for a in n.attribute if a.name == "axis"] or [0]
            seq = n.name + "_seq"
            nodes.append(helper.make_node("SplitToSequence", list(n.input[:2]), [seq],
                                          name=n.name + "_tosequence", axis=axis[0]))
            for k, out in enumerate(n.output):
                pos = "%s_pos%d" % (n.name, k)
                nodes.append(helper.make_node("Constant", [], [pos], name=pos,
                                              value=helper.make_tensor(pos, TensorProto.INT64,
                                                                       [], [k])))
                nodes.append(helper.make_node("SequenceAt", [seq, pos], [out],
                                              name="%s_at%d" % (n.name, k)))
        elif n.op_type == "Cast" and [a.i for a in n.attribute if a.name == "to"] == \
                [TensorProto.FLOAT]:
            nodes.append(helper.make_node("CastLike", [n.input[0], "x"], list(n.output),
                                          name=n.name + "_like"))
        else:
            nodes.append(n)
    loss = g.output[0].name
    one = helper.make_node("Constant", [], ["one_i64"], name="one_i64",
                           value=helper.make_tensor("one_i64", TensorProto.INT64, [], [1]))
    like = helper.make_node("CastLike", ["one_i64", "x"], ["one_f32"], name="one_like")
    times = helper.make_node("Mul", ["loss_unscaled", "one_f32"], [loss], name="loss_times_one")
    for n in nodes:
        for k, o in enumerate(n.output):
            if o == loss:
                n.output[k] = "loss_unscaled"
    del g.node[:]
    g.node.extend(nodes + [one, like, times])
    onnx.save(m, dst)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--carve", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--emulated", help="build/lib/carve-runtime-emu.txt: also the CUDA target, "
                    "on the CPU emulation")
    a = ap.parse_args()
    import onnx
    import torch

    shutil.rmtree(a.workdir, ignore_errors=True)
    os.makedirs(a.workdir)
    w = a.workdir
    net = model()
    rng = np.random.default_rng(1)
    xs = rng.standard_normal((STEPS * BATCH, 16)).astype(np.float32)
    ys = rng.integers(0, 10, STEPS * BATCH).astype(np.int64)
    onnx_path = os.path.join(w, "net.onnx")
    torch.onnx.export(net, (torch.from_numpy(xs[:BATCH]), torch.from_numpy(ys[:BATCH])),
                      onnx_path, input_names=["x", "y"], output_names=["loss"],
                      opset_version=17)
    found = {n.op_type for n in onnx.load(onnx_path).graph.node}
    missing = [op for op in OPS if op not in found]
    if missing:
        raise Failure("the export has no %s node(s); ops: %s" % (missing, sorted(found)))
    data = os.path.join(w, "data.safetensors")
    st.save(data, {"x": xs, "y": ys})  # sample-major: [N, ...]
    summary = run([a.carve, "import", onnx_path, "--summary"])
    lines = [l.strip() for l in summary.splitlines()]
    params = [l for l in lines if l.startswith("parameters:")]
    if params != ["parameters: 18 trainable, 7314 elements"]:
        raise Failure("the import should find the 8 tensors of the module as parameters:\n%s"
                      % summary)
    print("ok: import (%s; %s)" % (params[0], [l for l in lines if l.startswith("ops:")][0]))

    # 2. Against PyTorch.
    losses, worst, gap, where, _ = train_like_torch(a.carve, onnx_path, net, data, xs, ys,
                                                    os.path.join(w, "one"), BATCH, STEPS, LR,
                                                    LOSS_RTOL, WEIGHT_RTOL)
    print("ok: 1 rank against PyTorch, %d SGD steps: losses within %.2g, weights within %.2g (%s)"
          % (STEPS, worst, gap, where))

    # 2b. The forms torch 2.x's dynamo exporter writes for the same ops: every Split as
    # SplitToSequence + SequenceAt, every Cast to float as CastLike of a float tensor, and a
    # CastLike of a constant scalar. The same math: the losses of section 2, bitwise.
    seq_path = os.path.join(w, "net-dynamo-forms.onnx")
    dynamo_forms(onnx_path, seq_path)
    found = {n.op_type for n in onnx.load(seq_path).graph.node}
    if not {"CastLike", "SplitToSequence", "SequenceAt"} <= found or "Split" in found:
        raise Failure("the rewritten export should use CastLike, SplitToSequence and "
                      "SequenceAt instead of Split: %s" % sorted(found))
    seq_losses, worst2, gap2, where2, _ = train_like_torch(
        a.carve, seq_path, model(), data, xs, ys, os.path.join(w, "dynamo-forms"), BATCH, STEPS,
        LR, LOSS_RTOL, WEIGHT_RTOL)
    if seq_losses != losses:
        raise Failure("CastLike / SplitToSequence forms: losses %s, the Split / Cast export's %s"
                      % (seq_losses, losses))
    print("ok: CastLike, SplitToSequence and SequenceAt (the dynamo exporter's forms): the "
          "Split / Cast export's losses bitwise, weights within %.2g of PyTorch (%s)"
          % (gap2, where2))

    # 3. Plans against 1 rank.
    for name, plan in [("dp2", {"dp": 2}), ("tp2", {"tp": 2})]:
        pj = os.path.join(w, name + ".json")
        with open(pj, "w") as f:
            json.dump(plan, f)
        text = run([a.carve, "verify", onnx_path, "--plan", pj, "--steps", "3", "--data", data,
                    "--workdir", os.path.join(w, "verify-" + name)])
        if "PASS" not in text:
            raise Failure("carve verify %s did not pass:\n%s" % (name, text))
        print("ok: %s: %s" % (name, text.strip().splitlines()[-1]))
    # 4. A diagonal.
    class Diagonal(torch.nn.Module):
        def forward(self, m):
            return torch.einsum("ii->i", m).sum()

    bad = os.path.join(w, "diagonal.onnx")
    torch.onnx.export(Diagonal(), (torch.ones(3, 3),), bad, input_names=["m"],
                      output_names=["s"], opset_version=17)
    p = subprocess.run([a.carve, "import", bad], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True, timeout=TIMEOUT_S)
    lines = p.stderr.strip().splitlines()
    if p.returncode != 1 or len(lines) != 1 or "(Einsum)" not in lines[0] or \
            "repeats the index 'i'" not in lines[0]:
        raise Failure("an einsum with a diagonal: expected exit 1 and one line naming the node "
                      "and the index, got %d:\n%s" % (p.returncode, p.stderr))
    print("ok: a diagonal einsum: %s" % lines[0])
    # 5. Tables from the input's shape, evaluated at import.
    tables = tables_model()
    txs = rng.standard_normal((STEPS * BATCH, 8, 8)).astype(np.float32)
    tys = rng.integers(0, 10, STEPS * BATCH).astype(np.int64)
    tables_onnx = os.path.join(w, "tables.onnx")
    torch.onnx.export(tables, (torch.from_numpy(txs[:BATCH]), torch.from_numpy(tys[:BATCH])),
                      tables_onnx, input_names=["x", "y"], output_names=["loss"],
                      opset_version=17)
    found = {n.op_type for n in onnx.load(tables_onnx).graph.node}
    missing = [op for op in ["LessOrEqual", "Tile", "GatherElements"] if op not in found]
    if missing:
        raise Failure("the tables' export has no %s node(s); ops: %s" % (missing, sorted(found)))
    tdata = os.path.join(w, "tables.safetensors")
    st.save(tdata, {"x": txs, "y": tys})
    _, worst, gap, where, _ = train_like_torch(a.carve, tables_onnx, tables, tdata, txs, tys,
                                               os.path.join(w, "tables"), BATCH, STEPS, LR,
                                               LOSS_RTOL, WEIGHT_RTOL)
    print("ok: LessOrEqual, Tile and GatherElements on constants: 1 rank against PyTorch, %d SGD "
          "steps: losses within %.2g, weights within %.2g (%s)" % (STEPS, worst, gap, where))
    # 5b. Slice assignments (ScatterND with constant indices) on computed floats, on the
    # int64 targets and with a parameter as the update.
    scatter = scatter_model()
    scatter_onnx = os.path.join(w, "scatter.onnx")
    torch.onnx.export(scatter, (torch.from_numpy(txs[:BATCH]), torch.from_numpy(tys[:BATCH])),
                      scatter_onnx, input_names=["x", "y"], output_names=["loss"],
                      opset_version=17, do_constant_folding=False)  # keeps the parameters' names
    found = [n.op_type for n in onnx.load(scatter_onnx).graph.node]
    if found.count("ScatterND") < 4:
        raise Failure("the slice assignments' export has %d ScatterND nodes, expected 4 or "
                      "more; ops: %s" % (found.count("ScatterND"), sorted(set(found))))
    _, worst, gap, where, _ = train_like_torch(a.carve, scatter_onnx, scatter, tdata, txs, tys,
                                               os.path.join(w, "scatter"), BATCH, STEPS, LR,
                                               LOSS_RTOL, WEIGHT_RTOL)
    print("ok: ScatterND (%d slice assignments: shift right of floats and of int64 targets, a "
          "parameter written into a computed tensor, index_put_ with accumulate): 1 rank "
          "against PyTorch, %d SGD steps: losses within %.2g, weights within %.2g (%s)"
          % (found.count("ScatterND"), STEPS, worst, gap, where))
    # Under a plan that splits the batch: the model whose scatters mix samples is refused
    # naming the node; the one whose scatters keep each sample's writes within it, exported
    # with its static batch (indices and zeros built for all 8 samples), trains as 1 rank.
    dp2 = os.path.join(w, "dp2.json")
    p = subprocess.run([a.carve, "compile", scatter_onnx, "--plan", dp2, "-o",
                        os.path.join(w, "scatter-dp2")], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, timeout=TIMEOUT_S)
    lines = [l for l in p.stderr.splitlines() if l.startswith("carve: error:")]
    if p.returncode != 1 or len(lines) != 1 or "samples are independent" not in lines[0] or \
            "node '/" not in lines[0]:
        raise Failure("dp=2 of a model whose slice assignments mix samples: expected exit 1 and "
                      "one line naming the node, got %d:\n%s" % (p.returncode, p.stderr))
    print("ok: dp2 of slice assignments that mix samples: %s" % lines[0][-160:])
    per = scatter_model(per_sample=True)
    per_onnx = os.path.join(w, "scatter-per-sample.onnx")
    torch.onnx.export(per, (torch.from_numpy(txs[:BATCH]), torch.from_numpy(tys[:BATCH])),
                      per_onnx, input_names=["x", "y"], output_names=["loss"],
                      opset_version=17, do_constant_folding=False)
    per_losses, worst, gap, where, _ = train_like_torch(a.carve, per_onnx, per, tdata, txs, tys,
                                               os.path.join(w, "scatter-per-sample"), BATCH,
                                               STEPS, LR, LOSS_RTOL, WEIGHT_RTOL)
    print("ok: per-sample slice assignments: 1 rank against PyTorch, losses within %.2g, "
          "weights within %.2g (%s)" % (worst, gap, where))
    for name, plan in [("dp2", {"dp": 2}), ("tp2", {"tp": 2}),
                       ("pp2", {"pp": 2, "num_micro_batches": 2})]:
        pj = os.path.join(w, "scatter-%s.json" % name)
        with open(pj, "w") as f:
            json.dump(plan, f)
        text = run([a.carve, "verify", per_onnx, "--plan", pj, "--steps", "3", "--data", tdata,
                    "--workdir", os.path.join(w, "verify-scatter-" + name)])
        if "PASS" not in text:
            raise Failure("carve verify %s of the per-sample slice assignments did not pass:\n%s"
                          % (name, text))
        print("ok: per-sample slice assignments (static batch), %s: %s"
              % (name, text.strip().splitlines()[-1]))
    # 6. The CUDA target on the emulation.
    if a.emulated:
        env = dict(os.environ, CARVE_CUDA_EMULATION=os.path.abspath(a.emulated),
                   CARVE_EMU_GPUS="2", ASAN_OPTIONS="detect_leaks=0")
        for name, model_path, model_data, plan, ranks, ref in [
                ("cuda-1", onnx_path, data, None, 1, losses),
                ("cuda-tp2", onnx_path, data, {"tp": 2}, 2, losses),
                ("cuda-scatter", per_onnx, tdata, None, 1, per_losses)]:
            out = os.path.join(w, name)
            cmd = [a.carve, "compile", model_path, "-o", out, "--quiet", "--target", "cuda",
                   "--optimizer", "sgd", "--lr", str(LR), "--clip-grad-norm", "0"]
            if plan:
                with open(out + ".json", "w") as f:
                    json.dump(plan, f)
                cmd += ["--plan", out + ".json"]
            for c in [cmd, [a.carve, "run", out, "-n", str(ranks), "--", "--steps", str(STEPS),
                            "--data", model_data, "--log", out + ".jsonl", "--progress",
                            "none"]]:
                p = subprocess.run(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   timeout=TIMEOUT_S, env=env)
                if p.returncode != 0:
                    raise Failure("`%s` exited %d:\n%s%s" % (" ".join(c), p.returncode,
                                                             p.stdout[-2000:], p.stderr[-2000:]))
            got = [json.loads(l)["loss"] for l in open(out + ".jsonl")]
            d = max(abs(m - r) / abs(r) for m, r in zip(got, ref))
            if len(got) != STEPS or d > FP32_CUDA_RTOL:
                raise Failure("%s: losses differ from the CPU target's by %.3g (limit %g)\n"
                              "  cuda %s\n  cpu  %s" % (name, d, FP32_CUDA_RTOL, got, ref))
            print("ok: %s (CUDA target, emulated): losses within %.2g of the CPU target's"
                  % (name, d))
    else:
        print("not run: the CUDA target (no --emulated: the build has no CUDA toolkit)")
    print("common-ops: all checks passed")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (Failure, subprocess.TimeoutExpired) as e:
        print("FAIL: %s" % e)
        sys.exit(1)
