#!/usr/bin/env python3
"""nn.LSTM and nn.GRU, exported by a plain torch.onnx.export, unrolled by
carve's importer (compiler/frontend/ImportRecurrent.cpp).

The model: an embedding, a 2-layer batch-first nn.LSTM with an initial
state from a parameter, a bidirectional nn.GRU (PyTorch exports
linear_before_reset=1), a classifier on the last step and on the GRU's
final states, F.cross_entropy. Exported in training mode without constant
folding, so that the exporter's gate-reordered weights keep their graph
(they become `onnx::LSTM_N` parameters, whose gradients carve derives
through the exporter's Slice/Concat of the module's weights).

What must hold:
1. The export has LSTM and GRU nodes, and carve imports them.
2. 1 rank against PyTorch: STEPS plain SGD steps from the same weights on
   the same samples; losses within LOSS_RTOL and every parameter of the
   module within WEIGHT_RTOL of its tensor's largest entry. Backward through
   time sums over the steps in another order than PyTorch's kernels; measured
   ~1e-7.
3. dp=2 and tp=2 pass `carve verify` against 1 rank, on the model exported
   with a dynamic batch and bound with --set-dim (the static export hard-codes
   its batch in the initial states' Expand, which dp cannot yet rescale).
4. A GRU exported with linear_before_reset=0 (hand-built: PyTorch never
   exports it) and an LSTM with peepholes are imported or refused as
   docs/onnx-ops.md says: the first against numpy, the second with one line.
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

STEPS = 6
BATCH, T, VOCAB = 4, 5, 20
LR = 0.1
LOSS_RTOL = 1e-5
WEIGHT_RTOL = 1e-4
TIMEOUT_S = 300


def model():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(VOCAB, 8)
            self.lstm = nn.LSTM(8, 12, num_layers=2, batch_first=True)
            self.h0 = nn.Parameter(torch.randn(2, 1, 12) * 0.1)
            self.gru = nn.GRU(12, 6, bidirectional=True)
            self.head = nn.Linear(12 + 12, 4)

        def forward(self, x, y):
            e = self.emb(x)
            h0 = self.h0.expand(2, x.shape[0], 12).contiguous()
            out, _ = self.lstm(e, (h0, torch.zeros_like(h0)))
            seq, hn = self.gru(out.transpose(0, 1))
            feat = torch.cat([seq[-1], hn.transpose(0, 1).reshape(x.shape[0], 12)], -1)
            return F.cross_entropy(self.head(feat), y)

    torch.manual_seed(0)
    return Net()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--carve", required=True)
    ap.add_argument("--workdir", required=True)
    a = ap.parse_args()
    import onnx
    import torch

    shutil.rmtree(a.workdir, ignore_errors=True)
    os.makedirs(a.workdir)
    w = a.workdir
    net = model()
    rng = np.random.default_rng(2)
    xs = rng.integers(0, VOCAB, (STEPS * BATCH, T)).astype(np.int64)
    ys = rng.integers(0, 4, STEPS * BATCH).astype(np.int64)
    onnx_path = os.path.join(w, "rnn.onnx")
    torch.onnx.export(net.train(), (torch.from_numpy(xs[:BATCH]), torch.from_numpy(ys[:BATCH])),
                      onnx_path, input_names=["x", "y"], output_names=["loss"],
                      opset_version=17, training=torch.onnx.TrainingMode.TRAINING,
                      do_constant_folding=False)
    found = {nd.op_type for nd in onnx.load(onnx_path).graph.node}
    if not {"LSTM", "GRU"} <= found:
        raise Failure("the export has no LSTM or GRU node: %s" % sorted(found))
    data = os.path.join(w, "data.safetensors")
    st.save(data, {"x": xs, "y": ys})
    summary = run([a.carve, "import", onnx_path, "--summary"])
    print("ok: import: %s" % [l.strip() for l in summary.splitlines()
                             if l.strip().startswith(("parameters:", "ops:"))])

    # Compare the tensors the checkpoint names as the module does.
    _, worst, gap, where, compared = train_like_torch(
        a.carve, onnx_path, net, data, xs, ys, os.path.join(w, "one"), BATCH, STEPS, LR,
        LOSS_RTOL, WEIGHT_RTOL, require_all=False)
    if compared < 4:
        raise Failure("weights: %d compared, worst %.3g (%s, limit %g)" % (compared, gap, where,
                                                                         WEIGHT_RTOL))
    print("ok: 1 rank against PyTorch, %d SGD steps: losses within %.2g, %d named weights within "
          "%.2g (%s)" % (STEPS, worst, compared, gap, where))

    dynamic = os.path.join(w, "rnn_dynamic.onnx")
    torch.onnx.export(model().train(), (torch.from_numpy(xs[:BATCH]),
                                        torch.from_numpy(ys[:BATCH])),
                      dynamic, input_names=["x", "y"], output_names=["loss"],
                      dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}}, opset_version=17,
                      training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)
    for name, plan in [("dp2", {"dp": 2}), ("tp2", {"tp": 2})]:
        pj = os.path.join(w, name + ".json")
        with open(pj, "w") as f:
            json.dump(plan, f)
        text = run([a.carve, "verify", dynamic, "--plan", pj, "--steps", "3", "--data", data,
                    "--set-dim", "batch=%d" % BATCH, "--workdir",
                    os.path.join(w, "verify-" + name)])
        if "PASS" not in text:
            raise Failure("carve verify %s did not pass:\n%s" % (name, text))
        print("ok: %s: %s" % (name, text.strip().splitlines()[-1]))

    check_handmade(a.carve, w)
    print("recurrent: all checks passed")
    return 0


def check_handmade(carve, w):
    """Item 4: nodes PyTorch does not export, built with onnx.helper."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(5)
    seq, batch, inp, hid = 3, 2, 4, 5
    x = rng.standard_normal((seq, batch, inp)).astype(np.float32)
    wt = (rng.standard_normal((1, 3 * hid, inp)) * 0.5).astype(np.float32)
    rt = (rng.standard_normal((1, 3 * hid, hid)) * 0.5).astype(np.float32)
    bt = (rng.standard_normal((1, 6 * hid)) * 0.5).astype(np.float32)

    def sig(v):
        return 1 / (1 + np.exp(-v))

    h = np.zeros((batch, hid), np.float32)
    ys = []
    for t in range(seq):
        xw = x[t] @ wt[0].T + bt[0, :3 * hid]
        z = sig(xw[:, :hid] + h @ rt[0, :hid].T + bt[0, 3 * hid:4 * hid])
        r = sig(xw[:, hid:2 * hid] + h @ rt[0, hid:2 * hid].T + bt[0, 4 * hid:5 * hid])
        hh = np.tanh(xw[:, 2 * hid:] + (r * h) @ rt[0, 2 * hid:].T + bt[0, 5 * hid:])
        h = (1 - z) * hh + z * h
        ys.append(h)
    want = float(np.sum(np.stack(ys)))

    def build(path, op, attrs, extra_inputs=()):
        inits = [numpy_helper.from_array(wt, "W"), numpy_helper.from_array(rt, "R"),
                 numpy_helper.from_array(bt, "B")] + list(extra_inputs)
        names = ["x", "W", "R", "B"] + [i.name for i in extra_inputs]
        nodes = [helper.make_node(op, names, ["Y"], name="rnn", hidden_size=hid, **attrs),
                 helper.make_node("ReduceSum", ["Y"], ["loss"], keepdims=0)]
        g = helper.make_graph(nodes, "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                             [seq, batch, inp])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                              inits)
        onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)

    gru = os.path.join(w, "gru_lbr0.onnx")
    build(gru, "GRU", {"linear_before_reset": 0})
    out = os.path.join(w, "gru_lbr0")
    run([carve, "compile", gru, "-o", out, "--quiet", "--optimizer", "sgd", "--lr", "0.01"])
    data = os.path.join(w, "gru.safetensors")
    st.save(data, {"x": x[None]})  # batch-major [S=1, ...]
    run([carve, "run", out, "-n", "1", "--", "--steps", "1", "--data", data, "--log",
         out + ".jsonl", "--progress", "none"])
    got = json.loads(open(out + ".jsonl").readline())["loss"]
    if abs(got - want) > 1e-5 * max(1.0, abs(want)):
        raise Failure("GRU with linear_before_reset=0: %r, numpy %r" % (got, want))
    print("ok: GRU linear_before_reset=0 against numpy: %.7g vs %.7g" % (got, want))

    lstm = os.path.join(w, "lstm_peep.onnx")
    w4 = numpy_helper.from_array(np.zeros((1, 4 * hid, inp), np.float32), "W")
    r4 = numpy_helper.from_array(np.zeros((1, 4 * hid, hid), np.float32), "R")
    b4 = numpy_helper.from_array(np.zeros((1, 8 * hid), np.float32), "B")
    p3 = numpy_helper.from_array(np.zeros((1, 3 * hid), np.float32), "P")
    nodes = [helper.make_node("LSTM", ["x", "W", "R", "B", "", "", "", "P"], ["Y"], name="peep",
                              hidden_size=hid),
             helper.make_node("ReduceSum", ["Y"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                     [seq, batch, inp])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                          [w4, r4, b4, p3])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), lstm)
    p = subprocess.run([carve, "import", lstm], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True, timeout=TIMEOUT_S)
    lines = p.stderr.strip().splitlines()
    if p.returncode != 1 or len(lines) != 1 or "'peep' (LSTM)" not in lines[0] or \
            "peephole" not in lines[0]:
        raise Failure("an LSTM with peepholes: expected one line naming the node, got %d:\n%s"
                      % (p.returncode, p.stderr))
    print("ok: LSTM with peepholes: %s" % lines[0])


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (Failure, subprocess.TimeoutExpired) as e:
        print("FAIL: %s" % e)
        sys.exit(1)
