#!/usr/bin/env python3
"""Writes and reads the data files of compiled carve programs (token and tensor files)."""

# Two formats, exactly as `OUT/bin/train --data FILE` reads them:
#
# (a) Token file, for models whose inputs are `input_ids` and `targets`, both
#     int64 [B, T]: a flat array of token ids, int32 little-endian (or uint16
#     with --data-dtype uint16). With N tokens, sequence j of step k starts at
#     o = ((k*B + j)*T) mod (N - T - 1); its inputs are tokens[o:o+T] and its
#     targets tokens[o+1:o+T+1].
# (b) Tensor file, for any other model: a safetensors file with one tensor per
#     graph input, named after it, of shape [S, B, ...]; step k reads index
#     k mod S.
#
# The generated data is learnable, so that losses fall and a wrong gradient
# shows: tokens follow a seeded Markov chain, and a class is the argmax of a
# fixed random projection of the features.

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st  # noqa: E402

TOKEN_DTYPES = {"int32": np.dtype("<i4"), "uint16": np.dtype("<u2")}
TOKEN_INPUTS = ("input_ids", "targets")

# ONNX TensorProto element types of graph inputs -> numpy.
_ONNX_DTYPES = {1: np.float32, 6: np.int32, 7: np.int64, 9: np.bool_, 11: np.float64}


# --- Reading the model ---------------------------------------------------------

def graph_inputs(model_path, set_dims=None):
    """Returns [(name, numpy dtype, shape)] of the graph inputs that are not
    initializers; symbolic dims are bound from `set_dims` (name -> int)."""
    import onnx

    model = onnx.load(model_path, load_external_data=False)
    inits = {t.name for t in model.graph.initializer}
    out = []
    for value in model.graph.input:
        if value.name in inits:
            continue
        ttype = value.type.tensor_type
        shape = []
        for d in ttype.shape.dim:
            if d.HasField("dim_value"):
                shape.append(d.dim_value)
            elif set_dims and d.dim_param in set_dims:
                shape.append(set_dims[d.dim_param])
            else:
                raise ValueError(f"{model_path}: input '{value.name}' has the symbolic "
                                 f"dim '{d.dim_param}'; bind it with --set-dim")
        if ttype.elem_type not in _ONNX_DTYPES:
            raise ValueError(f"{model_path}: input '{value.name}' has ONNX element "
                             f"type {ttype.elem_type}, which data_gen does not generate")
        out.append((value.name, np.dtype(_ONNX_DTYPES[ttype.elem_type]), shape))
    return out


def is_token_model(inputs):
    """True when the model reads format (a): exactly input_ids and targets, int64 [B, T]."""
    return (tuple(n for n, _, _ in inputs) == TOKEN_INPUTS
            and all(dt == np.int64 and len(s) == 2 for _, dt, s in inputs)
            and inputs[0][2] == inputs[1][2])


def vocab_size(model_path):
    """The row count of the table that `input_ids` indexes (the token embedding)."""
    import onnx

    model = onnx.load(model_path, load_external_data=False)
    inits = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        if (node.op_type == "Gather" and len(node.input) == 2
                and node.input[1] == "input_ids" and node.input[0] in inits):
            return int(inits[node.input[0]].dims[0])
    raise ValueError(f"{model_path}: no Gather reads 'input_ids' from an initializer, "
                     "so the vocabulary size is unknown; pass --vocab")


def class_counts(model_name):
    """name -> number of classes of the integer inputs of a reference model."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                    "..", "..", "models"))
    import reference

    return {s.name: s.high for s in reference.MODELS[model_name][1] if s.kind == "index"}


def mask_inputs(model_name):
    """The names of a reference model's attention-mask inputs (kind "mask")."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                    "..", "..", "models"))
    import reference

    return {s.name for s in reference.MODELS[model_name][1] if s.kind == "mask"}


# --- Format (a): tokens -------------------------------------------------------

def make_tokens(n, vocab, seed=0):
    """n token ids from a seeded Markov chain: each token has four likely
    successors (probabilities .5, .25, .15, .1), with 5% uniform noise."""
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, vocab, size=(vocab, 4))
    pick = rng.choice(4, size=n, p=[0.5, 0.25, 0.15, 0.1])
    noise = rng.random(n) < 0.05
    uniform = rng.integers(0, vocab, size=n)
    out = np.empty(n, np.int64)
    t = int(uniform[0])
    for i in range(n):
        out[i] = t
        t = int(uniform[i]) if noise[i] else int(successors[t, pick[i]])
    return out


def write_tokens(path, tokens, dtype="int32"):
    dt = TOKEN_DTYPES[dtype]
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(dt).max):
        raise ValueError(f"token ids {tokens.min()}..{tokens.max()} do not fit {dtype}")
    tokens.astype(dt).tofile(path)


def read_tokens(path, dtype="int32"):
    return np.fromfile(path, dtype=TOKEN_DTYPES[dtype]).astype(np.int64)


def token_batch(tokens, step, batch, seq):
    """(inputs, targets), each int64 [batch, seq], of 0-based step `step`."""
    n = len(tokens)
    if n < seq + 2:
        raise ValueError(f"{n} tokens are fewer than seq + 2 = {seq + 2}")
    span = n - seq - 1
    starts = [((step * batch + j) * seq) % span for j in range(batch)]
    inputs = np.stack([tokens[o:o + seq] for o in starts])
    targets = np.stack([tokens[o + 1:o + seq + 1] for o in starts])
    return inputs, targets


# --- Format (b): tensors ------------------------------------------------------

def make_tensors(inputs, steps, classes=None, seed=0, masks=()):
    """name -> array [steps, *shape] for every graph input.

    Float inputs are standard normal. An integer input with a known class count
    is the argmax of a fixed random projection of the first float input (so
    the task is learnable), or uniform when there is no float input. A mask
    input (`masks`: an attention mask of 1s and 0s, [batch, tokens]) is ones
    with a padded tail of a quarter of the tokens on every other row, as the
    reference models' examples have it, so that the mask matters.
    """
    rng = np.random.default_rng(seed)
    classes = classes or {}
    out = {}
    for name, dt, shape in inputs:
        if dt.kind == "f":
            out[name] = rng.standard_normal((steps, *shape)).astype(dt)
    features = next(iter(out.values()), None)
    for name, dt, shape in inputs:
        if dt.kind == "f":
            continue
        if dt.kind == "b":
            out[name] = np.ones((steps, *shape), dt)
            continue
        if name in masks:
            m = np.ones((steps, *shape), dt)
            if len(shape) == 2:
                m[:, ::2, shape[1] * 3 // 4:] = 0
            out[name] = m
            continue
        if name not in classes:
            raise ValueError(f"input '{name}' is an integer input with no known class "
                             "count")
        high = classes[name]
        if features is not None and shape == list(features.shape[1:2]):
            flat = features.reshape(features.shape[0], features.shape[1], -1)
            proj = rng.standard_normal((flat.shape[-1], high))
            out[name] = np.argmax(flat @ proj, axis=-1).astype(dt)
        else:
            out[name] = rng.integers(0, high, size=(steps, *shape)).astype(dt)
    return {name: out[name] for name, _, _ in inputs}


def write_tensors(path, tensors):
    st.save(path, tensors)


def read_tensors(path):
    return st.load(path)


def tensor_batch(tensors, step):
    """name -> array of 0-based step `step` (index step mod S)."""
    return {name: t[step % t.shape[0]] for name, t in tensors.items()}


# --- CLI ----------------------------------------------------------------------

def parse_set_dims(items):
    dims = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep or not value.isdigit():
            raise SystemExit(f"data_gen: error: --set-dim '{item}' is not NAME=N")
        dims[name] = int(value)
    return dims


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    sub = ap.add_subparsers(dest="kind", required=True)
    tok = sub.add_parser("tokens", help="format (a): a flat token file")
    tok.add_argument("out")
    src = tok.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="MODEL.onnx whose token embedding sets the vocabulary")
    src.add_argument("--vocab", type=int)
    tok.add_argument("--tokens", type=int, default=4096, help="number of tokens (4096)")
    tok.add_argument("--dtype", choices=sorted(TOKEN_DTYPES), default="int32")
    tok.add_argument("--seed", type=int, default=0)
    ten = sub.add_parser("tensors", help="format (b): one safetensors tensor per input")
    ten.add_argument("out")
    ten.add_argument("--model", required=True, help="MODEL.onnx")
    ten.add_argument("--name", required=True,
                     help="reference model name (mlp, resnet18, ...), for class counts")
    ten.add_argument("--steps", type=int, default=8, help="S, the leading dim (8)")
    ten.add_argument("--set-dim", action="append", metavar="NAME=N")
    ten.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    if args.kind == "tokens":
        vocab = args.vocab or vocab_size(args.model)
        write_tokens(args.out, make_tokens(args.tokens, vocab, args.seed), args.dtype)
        print(f"{args.out}: {args.tokens} tokens, vocab {vocab}, {args.dtype}")
    else:
        inputs = graph_inputs(args.model, parse_set_dims(args.set_dim))
        tensors = make_tensors(inputs, args.steps, class_counts(args.name), args.seed,
                               mask_inputs(args.name))
        write_tensors(args.out, tensors)
        print(f"{args.out}: " + ", ".join(
            f"{n} {st.dtype_name(t)}{list(t.shape)}" for n, t in tensors.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
