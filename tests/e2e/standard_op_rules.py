#!/usr/bin/env python3
"""A rules file supplies the kernels of a standard ONNX op carve lacks.

carve has no kernel for ONNX's Selu (what nn.SELU exports). A rules-file
entry of domain "ai.onnx" supplies one with the custom-op ABI
(runtime/include/carve/rt/custom.h, docs/custom-ops.md): the kernels below
are written into the work folder, as a user would write them.

What must hold:
1. Without the rules file the import fails naming the node and the op.
2. With it, the 1-rank program trains STEPS plain SGD steps against PyTorch
   (nn.SELU) on the same weights and data: every loss within LOSS_RTOL and
   the final weights within WEIGHT_RTOL of the largest entry (float32 in
   both, different summation orders: common_ops.py's limits).
3. `carve verify --rules` of dp=2 and tp=2 (the op's elementwise annotation
   lets tp split it) against 1 rank passes.
4. A rule of domain "ai.onnx" for an op carve implements (Relu) is refused
   with one line naming the rule and the cause, and nothing is written.
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
TIMEOUT_S = 300

KERNELS = r'''// ONNX Selu (alpha and gamma at their defaults), for selu.json.
#include "carve/rt/custom.h"

#include <cmath>

namespace {
const float kAlpha = 1.67326319217681884765625f, kGamma = 1.05070102214813232421875f;
}

extern "C" void selu_forward(const CarveTensor *in, int, CarveTensor *out, int) {
  const float *x = static_cast<const float *>(in[0].data);
  float *y = static_cast<float *>(out[0].data);
  for (int64_t i = 0, n = carve_numel(&out[0]); i < n; ++i)
    y[i] = x[i] > 0 ? kGamma * x[i] : kGamma * (kAlpha * std::expm1(x[i]));
}

extern "C" void selu_backward(const CarveTensor *in, int, const CarveTensor *outGrad, int,
                              CarveTensor *inGrad) {
  const float *x = static_cast<const float *>(in[0].data);
  const float *g = static_cast<const float *>(outGrad[0].data);
  float *dx = static_cast<float *>(inGrad[0].data);
  for (int64_t i = 0, n = carve_numel(&in[0]); i < n; ++i)
    dx[i] = x[i] > 0 ? g[i] * kGamma : g[i] * (kGamma * kAlpha * std::exp(x[i]));
}
'''


def rules(op):
    return {"ops": [{
        "comment": "kernels for a standard ONNX op carve lacks",
        "domain": "ai.onnx", "type": op, "annotation": "a b -> a b",
        "outputs": [{"shape": ["in0[0]", "in0[1]"], "dtype": "in0"}],
        "cpu": {"sources": ["selu.cpp"], "forward": "selu_forward",
                "backward": "selu_backward"}}]}


def model():
    import torch.nn as nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(16, 32)
            self.act = nn.SELU()
            self.fc2 = nn.Linear(32, 10)

        def forward(self, x, y):
            return nn.functional.cross_entropy(self.fc2(self.act(self.fc1(x))), y)

    return Net()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--carve", required=True)
    ap.add_argument("--workdir", required=True)
    a = ap.parse_args()
    import onnx
    import torch

    torch.manual_seed(0)
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
    if "Selu" not in {n.op_type for n in onnx.load(onnx_path).graph.node}:
        raise Failure("the export has no Selu node")
    data = os.path.join(w, "data.safetensors")
    st.save(data, {"x": xs, "y": ys})
    with open(os.path.join(w, "selu.cpp"), "w") as f:
        f.write(KERNELS)
    rules_path = os.path.join(w, "selu.json")
    with open(rules_path, "w") as f:
        json.dump(rules("Selu"), f, indent=1)

    # 1. Without the rules file.
    p = subprocess.run([a.carve, "import", onnx_path], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, timeout=TIMEOUT_S)
    if p.returncode == 0 or "unsupported op 'Selu'" not in p.stderr:
        raise Failure("without rules: expected the import to fail on Selu, got %d:\n%s" %
                      (p.returncode, p.stderr))
    print("ok: without the rules file: %s" % p.stderr.strip().splitlines()[-1])

    # 2. Against PyTorch.
    _, worst, gap, where, _ = train_like_torch(
        a.carve, onnx_path, net, data, xs, ys, os.path.join(w, "one"), BATCH, STEPS, LR,
        LOSS_RTOL, WEIGHT_RTOL, flags=["--rules", rules_path])
    print("ok: Selu from the rules file, 1 rank against PyTorch, %d SGD steps: losses within "
          "%.2g, weights within %.2g (%s)" % (STEPS, worst, gap, where))

    # 3. Plans against 1 rank.
    for name, plan in [("dp2", {"dp": 2}), ("tp2", {"tp": 2})]:
        pj = os.path.join(w, name + ".json")
        with open(pj, "w") as f:
            json.dump(plan, f)
        text = run([a.carve, "verify", onnx_path, "--rules", rules_path, "--plan", pj,
                    "--steps", "3", "--data", data, "--workdir", os.path.join(w, "v-" + name)])
        if "PASS" not in text:
            raise Failure("carve verify %s did not pass:\n%s" % (name, text))
        print("ok: %s: %s" % (name, text.strip().splitlines()[-1]))

    # 4. A rule for an op carve implements.
    bad = os.path.join(w, "relu.json")
    with open(bad, "w") as f:
        json.dump(rules("Relu"), f)
    never = os.path.join(w, "never")
    p = subprocess.run([a.carve, "compile", onnx_path, "--rules", bad, "-o", never],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       timeout=TIMEOUT_S)
    lines = [ln for ln in p.stderr.splitlines() if "error:" in ln]
    if p.returncode != 1 or len(lines) != 1 or "ai.onnx::Relu" not in lines[0] or \
            "carve implements the standard op 'Relu'" not in lines[0] or os.path.exists(never):
        raise Failure("a rule for Relu: expected exit 1, one line naming it, nothing written; "
                      "got %d:\n%s" % (p.returncode, p.stderr))
    print("ok: a rule for a standard op carve implements: %s" % lines[0])
    print("standard-op-rules: all passed")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Failure as e:
        print("FAIL: %s" % e)
        sys.exit(1)
