#!/usr/bin/env python3
"""Mixture of experts as PyTorch code writes it: the Mixtral-style decoder of
models/reference.py (RMSNorm, rotary, grouped-query attention, a sparse MoE
of 4 SwiGLU experts in every block) in the forms its config selects, exported
with export_for_carve.

What must hold:
1. The routed form's export really routes by data: it has NonZero and
   ScatterElements (torch.where on each expert's mask, index_add_ back).
2. Each form at 1 rank against PyTorch: the same weights (the export's
   initializers) and samples, plain SGD (lr 0.1), STEPS steps; every step's
   loss within LOSS_RTOL of PyTorch's and every final weight within
   WEIGHT_RTOL of its tensor's largest entry. Both sides compute in float32,
   in different orders (a few ulp per op); the routing is the same as long as
   no two router scores tie within that, which these seeds do not. Forms:
     top2        routed, top-2, softmax before top-k (Mixtral), 2 layers
     top1-after  routed, top-1, softmax over the top-k logits
     capacity    routed, top-2, capacity factor 1.0 (tokens are dropped: the
                 test checks PyTorch drops some)
     aux         routed, top-2, the load-balancing loss added (coef 0.01)
     dense       one_hot dispatch/combine and einsum (GShard), capacity 1.25,
                 with the load-balancing loss
3. Plans against 1 rank (`carve verify`, its 1e-5 on losses and 1e-4 on
   weights): top2 under dp2, tp2, pp2 with 2 micro-batches and dp2 x tp2;
   top1-after under dp2; the others under tp2. Capacity and the auxiliary
   loss are computed over the tokens one forward pass sees, so under dp or
   micro-batches they are per replica or micro-batch, as in PyTorch DDP, and
   not the 1-rank program's (docs/moe.md): those forms are checked against 1
   rank where the tokens are all there (tp2), and under dp2, dp2 x ep2 and 2
   micro-batches against PyTorch run that way (each step's loss the mean of
   the losses of the batch's 2 shares; losses within LOSS_RTOL, weights
   within WEIGHT_RTOL, 5 SGD steps).
4. Expert parallelism on top2 (docs/moe.md): dp2 x ep2, dp4 x ep2,
   dp2 x ep2 x tp2 and dp2 x ep2 x pp2 (2 micro-batches) against 1 rank
   (`carve verify`); under dp4 x ep2 every rank holds the non-expert
   parameters and exactly half of the experts' (the start-up report), program
   r holds experts [2r, 2r+2) and makes 6 all-to-alls per layer over ep
   (dispatch and combine in forward, backward and evaluate); its checkpoint
   resumes on 1 rank, and a 1-rank checkpoint resumes under it, both within
   1e-5 of the unbroken 1-rank run; `carve plan --fixed ep=2` prices the
   exchanges; 3 experts over ep=2, ep=3 over dp=4 and ep on the dense form
   fail with one line.
5. Bad input, one line naming the node and the cause, exit 1, nothing
   written: a NonZero whose rows reach a reduction; a ScatterElements with a
   reduction carve lacks; an einsum whose '...' broadcasts; a NonZero result
   as a graph output.
6. With --emulated CONFIG: the CUDA program of top2 on 1 emulated GPU, and
   of dp2 x ep2 on 2, train within FP32_CUDA_RTOL of the CPU target's 1 rank.
"""

import argparse
import copy
import json
import os
import shutil
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "models"))
from gen_source import step_count  # noqa: E402
from torch_compare import Failure, run, train_like_torch  # noqa: E402

STEPS = 10
BATCH = 4
SEQ = 8
LR = 0.1
LOSS_RTOL = 1e-5
WEIGHT_RTOL = 1e-4
FP32_CUDA_RTOL = 1e-4
TIMEOUT_S = 300

SMALL = {"n_layer": 1, "dim": 32, "hidden_dim": 32, "vocab_size": 64}
FORMS = {
    "top2": (dict(SMALL, n_layer=2), [("dp2", {"dp": 2}), ("tp2", {"tp": 2}),
                                     ("pp2", {"pp": 2, "num_micro_batches": 2}),
                                     ("dp2tp2", {"dp": 2, "tp": 2})]),
    "top1-after": (dict(SMALL, top_k=1, softmax="after"), [("dp2", {"dp": 2})]),
    "capacity": (dict(SMALL, capacity_factor=1.0), [("tp2", {"tp": 2})]),
    "aux": (dict(SMALL, aux_loss_coef=0.01), [("tp2", {"tp": 2})]),
    "dense": (dict(SMALL, form="dense", capacity_factor=1.25, aux_loss_coef=0.01),
              [("tp2", {"tp": 2})]),
}
# Forms whose loss depends on which tokens one forward pass sees (capacity,
# the load-balancing loss): under these plans each replica or micro-batch
# computes them on its share, as PyTorch DDP does, so they are checked
# against PyTorch run that way (the batch cut into `shares` consecutive
# shares, the mean of their losses): (name, plan, ranks, shares).
PER_SHARE = {
    "capacity": [("dp2", {"dp": 2}, 2, 2), ("dp2ep2", {"dp": 2, "ep": 2}, 2, 2),
                 ("m2", {"num_micro_batches": 2}, 1, 2)],
    "aux": [("dp2", {"dp": 2}, 2, 2), ("dp2ep2", {"dp": 2, "ep": 2}, 2, 2)],
    "dense": [("dp2", {"dp": 2}, 2, 2)],
}
SHARE_STEPS = 5




def build(config):
    import torch
    import reference
    torch.manual_seed(0)
    return reference.Mixtral(reference.MixtralConfig(block_size=SEQ, **config))


def net_for_shapes(config):
    """A fresh module of `config` (its parameter names and sizes)."""
    return build(config)


def export(net, ids, labels, path):
    import torch
    from export import export_for_carve
    export_for_carve(net, (torch.from_numpy(ids), torch.from_numpy(labels)), path,
                     input_names=["input_ids", "targets"])


def dropped_tokens(net, ids):
    """How many (token, choice) pairs PyTorch's capacity drops in the first block."""
    import torch
    import torch.nn.functional as F
    moe = net.layers[0].block_sparse_moe
    with torch.no_grad():
        x = net.layers[0].ffn_norm(net.tok_embeddings(torch.from_numpy(ids))).reshape(-1, 32)
        _, selected, _ = moe._route(x)
        kept = moe._choices(selected, x.shape[0]).sum().item()
        return F.one_hot(selected, 4).sum().item() - kept


def per_share_losses(net, batches, lr, shares):
    """PyTorch's plain SGD where each step's loss is the mean of the losses of
    `shares` consecutive shares of the batch (DDP's replicas, or micro-batches
    accumulated); `net` is trained in place."""
    import torch
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    losses = []
    for batch in batches:
        opt.zero_grad()
        n = len(batch[0]) // shares
        loss = sum(net(*(torch.from_numpy(a[k * n:(k + 1) * n]) for a in batch))
                   for k in range(shares)) / shares
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def per_share_check(carve, w, onnx_path, data, config, ids, labels):
    from torch_compare import check_well_posed, read_losses, worst_loss_gap, worst_weight_gap
    form = os.path.basename(w)
    batches = [(ids[k * BATCH:(k + 1) * BATCH], labels[k * BATCH:(k + 1) * BATCH])
               for k in range(SHARE_STEPS)]
    for name, plan, ranks, shares in PER_SHARE.get(form, []):
        out = os.path.join(w, "share-" + name)
        with open(out + ".json", "w") as f:
            json.dump(plan, f)
        run([carve, "compile", onnx_path, "--plan", out + ".json", "-o", out, "--quiet",
             "--optimizer", "sgd", "--lr", str(LR), "--clip-grad-norm", "0"])
        run([carve, "run", out, "-n", str(ranks), "--", "--steps", str(SHARE_STEPS), "--data",
             data, "--log", out + ".jsonl", "--save", out + ".ckpt", "--progress", "none"])
        net = build(config)
        # The export's capacity is a constant computed from its batch's
        # tokens, which each share then applies to its own.
        for layer in net.layers:
            layer.block_sparse_moe.capacity_tokens = BATCH * SEQ
        exact = copy.deepcopy(net).double()
        ref = per_share_losses(net, batches, LR, shares)
        # Well posed first: PyTorch's own float32 run within the limits of its float64 run.
        exact_losses = per_share_losses(exact, batches, LR, shares)
        check_well_posed(net, ref, exact, exact_losses, LOSS_RTOL, WEIGHT_RTOL)
        worst = worst_loss_gap("%s %s" % (form, name), read_losses(out + ".jsonl"), ref,
                               LOSS_RTOL)
        gap, where, _ = worst_weight_gap("%s %s" % (form, name), out + ".ckpt", net, WEIGHT_RTOL,
                                         require_all=False)
        print("ok: %s %s: against PyTorch with the loss of each of %d shares of the batch, %d "
              "SGD steps: losses within %.2g, weights within %.2g (%s)"
              % (form, name, shares, SHARE_STEPS, worst, gap, where))


def expect_error(carve, onnx_path, workdir, needles):
    out = os.path.join(workdir, "never")
    p = subprocess.run([carve, "compile", onnx_path, "-o", out, "--quiet"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       timeout=TIMEOUT_S)
    lines = p.stderr.strip().splitlines()
    if p.returncode != 1 or len(lines) != 1 or not all(n in lines[0] for n in needles):
        raise Failure("%s: expected exit 1 and one line with %s, got %d:\n%s"
                      % (onnx_path, needles, p.returncode, p.stderr))
    if os.path.exists(out):
        raise Failure("%s: a failed compile left %s behind" % (onnx_path, out))
    return lines[0]


def bad_inputs(carve, w):
    import onnx
    import torch
    from onnx import TensorProto, helper

    class SumOfRouted(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(4))

        def forward(self, x):
            rows = torch.where(x[:, 0] > 0)[0]
            return (x[rows] * self.w).sum()

    path = os.path.join(w, "reduce.onnx")
    torch.onnx.export(SumOfRouted(), (torch.randn(6, 4),), path, input_names=["x"],
                      output_names=["loss"], opset_version=17)
    line = expect_error(carve, path, w, ["ReduceSum", "NonZero", "reduces over that dimension",
                                         "docs/moe.md"])
    print("ok: a reduction over NonZero's rows: %s" % line)

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3])
    i = helper.make_tensor_value_info("i", TensorProto.INT64, [2, 3])
    u = helper.make_tensor_value_info("u", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 3])
    g = helper.make_graph([helper.make_node("ScatterElements", ["x", "i", "u"], ["y"],
                                            name="my_scatter", axis=0, reduction="mul")],
                          "g", [x, i, u], [y])
    path = os.path.join(w, "scatter_mul.onnx")
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    line = expect_error(carve, path, w, ["'my_scatter'", "reduction 'mul'"])
    print("ok: ScatterElements with reduction 'mul': %s" % line)

    class Broadcast(torch.nn.Module):
        def forward(self, a, b):
            return torch.einsum("...ij,...jk->...ik", a, b).sum()

    path = os.path.join(w, "einsum_broadcast.onnx")
    torch.onnx.export(Broadcast(), (torch.ones(2, 3, 4), torch.ones(1, 4, 5)), path,
                      input_names=["a", "b"], output_names=["s"], opset_version=17)
    line = expect_error(carve, path, w, ["(Einsum)", "a dimension of '...'",
                                         "broadcasting is not supported"])
    print("ok: an einsum whose '...' broadcasts: %s" % line)

    m = helper.make_tensor_value_info("m", TensorProto.BOOL, [5])
    p_out = helper.make_tensor_value_info("p", TensorProto.INT64, [1, None])
    g = helper.make_graph([helper.make_node("NonZero", ["m"], ["p"], name="where_mask")],
                          "g", [m], [p_out])
    path = os.path.join(w, "nonzero_out.onnx")
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    line = expect_error(carve, path, w, ["graph output 'p'", "'where_mask'", "run time"])
    print("ok: NonZero's positions as a graph output: %s" % line)


def compile_run(carve, onnx_path, out, plan, ranks, steps, data, extra=()):
    """Compiles `onnx_path` under `plan` (None: 1 rank) with the default
    AdamW, trains `steps` steps on `ranks` ranks; the run's output and losses."""
    cmd = [carve, "compile", onnx_path, "-o", out, "--quiet"]
    if plan:
        with open(out + ".json", "w") as f:
            json.dump(plan, f)
        cmd += ["--plan", out + ".json"]
    run(cmd)
    text = run([carve, "run", out, "-n", str(ranks), "--", "--steps", str(steps), "--data", data,
                "--log", out + ".jsonl", "--progress", "none", *extra])
    return text, [json.loads(l)["loss"] for l in open(out + ".jsonl")]


def expert_parallel(carve, w, onnx_path, data, net):
    """ep plans against 1 rank, each rank's share of the experts, the
    exchanges in the generated code, checkpoints across plans, bad plans."""
    import re
    cfg = net.cfg
    E, layers = cfg.num_experts, cfg.n_layer
    expert_elems = sum(p.numel() for n, p in net.named_parameters() if ".experts." in n)
    all_elems = sum(p.numel() for p in net.parameters())
    for name, plan in [("dp2ep2", {"dp": 2, "ep": 2}), ("dp4ep2", {"dp": 4, "ep": 2}),
                       ("dp2ep2tp2", {"dp": 2, "ep": 2, "tp": 2}),
                       ("dp2ep2pp2", {"dp": 2, "ep": 2, "pp": 2, "num_micro_batches": 2})]:
        pj = os.path.join(w, name + ".json")
        with open(pj, "w") as f:
            json.dump(plan, f)
        text = run([carve, "verify", onnx_path, "--plan", pj, "--steps", "3", "--data", data,
                    "--workdir", os.path.join(w, "verify-" + name)])
        if "PASS" not in text:
            raise Failure("carve verify %s did not pass:\n%s" % (name, text))
        print("ok: top2 %s: %s" % (name, text.strip().splitlines()[-1]))

    # dp=4, ep=2: each rank holds its group's half of every layer's experts.
    ep = 2
    out = os.path.join(w, "dp4ep2")
    text, ep_losses = compile_run(carve, onnx_path, out, {"dp": 4, "ep": ep}, 4, 3, data,
                                  ["--save", out + ".ckpt"])
    held = {int(r): int(n) for r, n in
            re.findall(r"memory rank (\d+) \(dp \d+, tp \d+\): parameters \d+ bytes "
                       r"\((\d+) elements\)", text)}
    want = all_elems - expert_elems + expert_elems // ep
    if sorted(held) != [0, 1, 2, 3] or any(n != want for n in held.values()):
        raise Failure("dp4ep2: each rank should hold %d parameter elements (%d of the experts' "
                      "%d), got %s" % (want, expert_elems // ep, expert_elems, held))
    per = E // ep
    for r in range(ep):
        src = open(os.path.join(out, "src", "program%d.cpp" % r)).read()
        names = set(re.findall(r'"layers\.\d+\.block_sparse_moe\.experts\.(\d+)\.', src))
        mine = {str(e) for e in range(r * per, (r + 1) * per)}
        exchanges = step_count(src, "allToAllSplit(*ctx.epComm")
        # dispatch and combine per layer, in the step's forward and its backward.
        if names != mine or exchanges != 4 * layers:
            raise Failure("dp4ep2 program%d: experts %s (want %s), %d exchanges a step (want %d)"
                          % (r, sorted(names), sorted(mine), exchanges, 4 * layers))
    print("ok: top2 dp4ep2: every rank holds %d parameter elements (%d of %d expert elements); "
          "program r holds experts [%d r, %d r + %d) and makes %d all-to-alls over ep a step"
          % (want, expert_elems // ep, expert_elems, per, per, per, 4 * layers))

    # Its checkpoint resumes on 1 rank as the unbroken 1-rank run goes on,
    # and a 1-rank checkpoint resumes under dp4 x ep2.
    one = os.path.join(w, "ep-one")
    _, unbroken = compile_run(carve, onnx_path, one, None, 1, 5, data)
    run([carve, "run", one, "-n", "1", "--", "--steps", "3", "--data", data, "--save",
         one + ".ckpt", "--log", one + "-first.jsonl", "--progress", "none"])
    one_losses = [json.loads(l)["loss"] for l in open(one + "-first.jsonl")]
    for what, first, ckpt, prog, ranks in [
            ("dp4ep2's checkpoint after 3 steps resumes on 1 rank", ep_losses, out + ".ckpt",
             one, 1),
            ("a 1-rank checkpoint after 3 steps resumes under dp4ep2", one_losses,
             one + ".ckpt", out, 4)]:
        log = prog + "-resumed.jsonl"
        run([carve, "run", prog, "-n", str(ranks), "--", "--steps", "2", "--data", data,
             "--load", ckpt, "--log", log, "--progress", "none"])
        resumed = [json.loads(l)["loss"] for l in open(log)]
        d = max(abs(a - b) / abs(b) for a, b in zip(first + resumed, unbroken))
        if len(resumed) != 2 or d > 1e-5:
            raise Failure("%s: losses %s, the unbroken 1-rank run's %s (differ by %.3g, limit "
                          "1e-5)" % (what, first + resumed, unbroken, d))
        print("ok: %s: 5 losses within %.2g of the unbroken 1-rank run" % (what, d))

    # The planner: ep fixed, it prices the experts' share and the exchanges.
    rc = subprocess.run([carve, "plan", onnx_path, "--cluster", "cpu:1x4", "--fixed",
                         "dp=4,tp=1,pp=1,ep=2", "--json"], stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True, timeout=TIMEOUT_S)
    if rc.returncode != 0:
        raise Failure("carve plan --fixed ep=2 exited %d:\n%s" % (rc.returncode, rc.stderr))
    rep = json.loads(rc.stdout)
    best = rep["plan"]
    t = rep["predicted"]["time_s"]
    if best.get("ep") != 2 or not t.get("ep_comm", 0) > 0:
        raise Failure("carve plan --fixed ep=2: plan %s, time %s: want ep 2 and expert "
                      "all-to-all time" % (best, t))
    print("ok: carve plan --fixed ep=2 prices the expert all-to-alls (%.3g s of the step)"
          % t["ep_comm"])

    # Plans ep cannot carry out: 3 experts over ep=2, an ep that does not
    # divide dp.
    three = os.path.join(w, "three-experts.onnx")
    ids = np.zeros((BATCH, SEQ), dtype=np.int64)
    export(build(dict(SMALL, num_experts=3)), ids, ids, three)
    for path, plan, needles in [
            (three, {"dp": 2, "ep": 2}, ["\"ep\"", "has 3 experts", "do not divide by ep = 2"]),
            (onnx_path, {"dp": 4, "ep": 3}, ["\"ep\" (3) must divide \"dp\" (4)"])]:
        pj = os.path.join(w, "bad.json")
        with open(pj, "w") as f:
            json.dump(plan, f)
        p = subprocess.run([carve, "compile", path, "--plan", pj, "-o",
                            os.path.join(w, "never"), "--quiet"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, timeout=TIMEOUT_S)
        lines = p.stderr.strip().splitlines()
        if p.returncode != 1 or len(lines) != 1 or not all(n in lines[0] for n in needles) or \
                os.path.exists(os.path.join(w, "never")):
            raise Failure("plan %s: expected exit 1, one line with %s and nothing written, got "
                          "%d:\n%s" % (plan, needles, p.returncode, p.stderr))
        print("ok: plan %s: %s" % (json.dumps(plan), lines[0]))


def ep_without_experts(carve, w, onnx_path):
    pj = os.path.join(w, "ep-dense.json")
    with open(pj, "w") as f:
        json.dump({"dp": 2, "ep": 2}, f)
    p = subprocess.run([carve, "compile", onnx_path, "--plan", pj, "-o",
                        os.path.join(w, "never"), "--quiet"], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, timeout=TIMEOUT_S)
    lines = p.stderr.strip().splitlines()
    if p.returncode != 1 or len(lines) != 1 or "no routed mixture-of-experts layer" not in lines[0]:
        raise Failure("ep on the dense form: expected exit 1 and one line saying there is no "
                      "routed layer, got %d:\n%s" % (p.returncode, p.stderr))
    print("ok: ep on a model without routed experts (the dense form): %s" % lines[0])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--carve", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--emulated", help="build/lib/carve-runtime-emu.txt: also the CUDA target, "
                    "on the CPU emulation")
    ap.add_argument("--forms", default=",".join(FORMS), help="the forms to run (comma list)")
    a = ap.parse_args()
    import onnx

    shutil.rmtree(a.workdir, ignore_errors=True)
    os.makedirs(a.workdir)
    # A token file (int32 ids; `train --data` reads sequence j of step k
    # from o = ((k*B + j)*T) mod (N - T - 1), targets one token on), and the
    # same sequences for PyTorch.
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 64, 4096).astype("<i4")
    starts = [((k * BATCH + j) * SEQ) % (len(tokens) - SEQ - 1)
              for k in range(STEPS) for j in range(BATCH)]
    ids = np.stack([tokens[o:o + SEQ] for o in starts]).astype(np.int64)
    labels = np.stack([tokens[o + 1:o + SEQ + 1] for o in starts]).astype(np.int64)
    for form in a.forms.split(","):
        config, plans = FORMS[form]
        w = os.path.join(a.workdir, form)
        os.makedirs(w)
        net = build(config)
        onnx_path = os.path.join(w, "moe.onnx")
        export(net, ids[:BATCH], labels[:BATCH], onnx_path)
        ops = {n.op_type for n in onnx.load(onnx_path).graph.node}
        routed = config.get("form", "routed") == "routed"
        want = {"NonZero", "ScatterElements", "TopK"} if routed else {"Einsum", "TopK", "OneHot"}
        if not want <= ops:
            raise Failure("%s: the export lacks %s" % (form, sorted(want - ops)))
        if config.get("capacity_factor") and routed:
            dropped = dropped_tokens(net, ids[:BATCH])
            if dropped == 0:
                raise Failure("%s: the capacity drops no token; the check would prove nothing"
                              % form)
            capacity_note = ", PyTorch drops %d of %d choices in step 0" % (
                dropped, BATCH * SEQ * config.get("top_k", 2))
        else:
            capacity_note = ""
        data = os.path.join(w, "tokens.bin")
        tokens.tofile(data)
        # The buffers (rotary tables, causal mask) are constants, not in the
        # checkpoint; every parameter must be.
        _, worst, gap, where, compared = train_like_torch(
            a.carve, onnx_path, net, data, ids, labels, os.path.join(w, "one"), BATCH, STEPS, LR,
            LOSS_RTOL, WEIGHT_RTOL, require_all=False)
        if compared != len(list(net.parameters())):
            raise Failure("%s: the checkpoint holds %d of the module's %d parameters"
                          % (form, compared, len(list(net.parameters()))))
        print("ok: %s: 1 rank against PyTorch, %d SGD steps: losses within %.2g, weights within "
              "%.2g (%s)%s" % (form, STEPS, worst, gap, where, capacity_note))
        for name, plan in plans:
            pj = os.path.join(w, name + ".json")
            with open(pj, "w") as f:
                json.dump(plan, f)
            text = run([a.carve, "verify", onnx_path, "--plan", pj, "--steps", "3", "--data",
                        data, "--workdir", os.path.join(w, "verify-" + name)])
            if "PASS" not in text:
                raise Failure("%s: carve verify %s did not pass:\n%s" % (form, name, text))
            print("ok: %s %s: %s" % (form, name, text.strip().splitlines()[-1]))
        per_share_check(a.carve, w, onnx_path, data, config, ids, labels)
        if form == "top2":
            expert_parallel(a.carve, w, onnx_path, data, net_for_shapes(config))
        if form == "dense":
            ep_without_experts(a.carve, w, onnx_path)
        if form == "top2" and a.emulated:
            env = dict(os.environ, CARVE_CUDA_EMULATION=os.path.abspath(a.emulated),
                       CARVE_EMU_GPUS="1", ASAN_OPTIONS="detect_leaks=0")
            out = os.path.join(w, "cuda")
            cpu = [json.loads(l)["loss"] for l in open(os.path.join(w, "one.jsonl"))]
            for c in [[a.carve, "compile", onnx_path, "-o", out, "--quiet", "--target", "cuda",
                       "--optimizer", "sgd", "--lr", str(LR), "--clip-grad-norm", "0"],
                      [a.carve, "run", out, "-n", "1", "--", "--steps", str(STEPS), "--data",
                       data, "--log", out + ".jsonl", "--progress", "none"]]:
                run(c, env=env)
            got = [json.loads(l)["loss"] for l in open(out + ".jsonl")]
            d = max(abs(m - r) / abs(r) for m, r in zip(got, cpu))
            if len(got) != STEPS or d > FP32_CUDA_RTOL:
                raise Failure("top2 on the CUDA target (emulated): losses differ from the CPU "
                              "target's by %.3g (limit %g)\n  cuda %s\n  cpu  %s"
                              % (d, FP32_CUDA_RTOL, got, cpu))
            print("ok: top2 (CUDA target, emulated): losses within %.2g of the CPU target's" % d)
            # dp2 x ep2 on 2 emulated GPUs: the exchanges over NCCL's all-to-all.
            out = os.path.join(w, "cuda-ep")
            with open(out + ".json", "w") as f:
                json.dump({"dp": 2, "ep": 2}, f)
            env2 = dict(env, CARVE_EMU_GPUS="2")
            for c in [[a.carve, "compile", onnx_path, "-o", out, "--quiet", "--target", "cuda",
                       "--plan", out + ".json", "--optimizer", "sgd", "--lr", str(LR),
                       "--clip-grad-norm", "0"],
                      [a.carve, "run", out, "-n", "2", "--", "--steps", "3", "--data", data,
                       "--log", out + ".jsonl", "--progress", "none"]]:
                run(c, env=env2)
            got = [json.loads(l)["loss"] for l in open(out + ".jsonl")]
            d = max(abs(m - r) / abs(r) for m, r in zip(got, cpu))
            if len(got) != 3 or d > FP32_CUDA_RTOL:
                raise Failure("top2 dp2 x ep2 on the CUDA target (emulated): losses differ from "
                              "the CPU target's 1 rank by %.3g (limit %g)\n  cuda %s\n  cpu  %s"
                              % (d, FP32_CUDA_RTOL, got, cpu))
            print("ok: top2 dp2 x ep2 (CUDA target, 2 emulated GPUs): losses within %.2g of the "
                  "CPU target's 1 rank" % d)
        elif form == "top2":
            print("not run: the CUDA target (no --emulated: the build has no CUDA toolkit)")
    bad_inputs(a.carve, a.workdir)
    print("moe: all checks passed")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (Failure, subprocess.TimeoutExpired) as e:
        print("FAIL: %s" % e)
        sys.exit(1)
