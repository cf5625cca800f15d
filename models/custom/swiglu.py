"""A Llama-style model whose MLP gate is one custom ONNX op, carve.example::SwiGLU (export and oracle)."""

# The reference Llama (models/reference.py) computes its MLP as
# w2(silu(w1(x)) * w3(x)). Here silu(a) * b is a torch.autograd.Function with
# a `symbolic` method, so torch.onnx.export writes it as one node of the
# custom domain "carve.example" instead of Sigmoid/Mul/Mul. carve learns the
# op from swiglu.json (annotation, output shape) and runs the kernels in
# swiglu.cpp; run eagerly, the Function is the PyTorch oracle of the same op.
#
#   python3 models/custom/swiglu.py --out /tmp/swiglu
#   carve compile /tmp/swiglu/llama_swiglu.onnx --rules models/custom/swiglu.json -o /tmp/out
#
# docs/custom-ops.md walks through it.

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import reference  # noqa: E402
from export import export_for_carve  # noqa: E402

DOMAIN = "carve.example"
NAME = "llama_swiglu"


class SwiGLUFunction(torch.autograd.Function):
    """silu(a) * b, elementwise; exported as the node carve.example::SwiGLU(a, b)."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return F.silu(a) * b

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        s = torch.sigmoid(a)
        # d silu(a) / da = s * (1 + a * (1 - s))
        return grad * b * s * (1 + a * (1 - s)), grad * a * s

    @staticmethod
    def symbolic(g, a, b):
        out = g.op(DOMAIN + "::SwiGLU", a, b)
        out.setType(a.type())
        return out


class FusedSwiGLU(reference.SwiGLU):
    """reference.SwiGLU (the same parameters w1, w2, w3), with the gate as one op."""

    def forward(self, x):
        return self.w2(SwiGLUFunction.apply(self.w1(x), self.w3(x)))


def build(batch=4, seq=16, seed=0, config=None):
    """(model, example inputs, input names): reference.build("llama", ...) with
    every block's MLP computing its gate through SwiGLUFunction. The weights are
    those of the reference model with the same seed and config."""
    model, inputs, names = reference.build("llama", batch=batch, seq=seq, seed=seed,
                                           config=config)
    for layer in model.layers:
        # Same parameters, only forward differs: switch the class in place.
        layer.feed_forward.__class__ = FusedSwiGLU
    return model, inputs, names


def export(out_dir, batch=4, seq=16, seed=0, config=None):
    """Writes OUT_DIR/llama_swiglu.onnx; returns its path."""
    model, inputs, names = build(batch, seq, seed, config)
    path = os.path.join(out_dir, NAME + ".onnx")
    # torch.onnx.export lists the custom domain in the model's opset_import at
    # version 1 (its default for custom_opsets); carve reads only the default
    # domain's opset and takes the custom op from the rules file.
    info = export_for_carve(model, inputs, path, input_names=names)
    if DOMAIN + "::SwiGLU" not in info["op_types"]:
        raise RuntimeError(f"{path}: the export has no {DOMAIN}::SwiGLU node "
                           f"(ops: {', '.join(info['op_types'])})")
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=".", help="output folder (default: .)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(export(args.out, args.batch, args.seq, args.seed))


if __name__ == "__main__":
    main()
