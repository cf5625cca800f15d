#!/usr/bin/env python3
"""The PyTorch oracle: trains a reference model from an ONNX file's weights as carve flags say."""

# Given MODEL.onnx and its reference model name (models/reference.py), this
# builds the PyTorch module with the config the export used, copies every
# parameter and buffer from the ONNX initializers by name (so both sides start
# from identical weights), reads the same data file as `OUT/bin/train --data`
# (formats in data_gen.py) and trains S steps with the optimizer, schedule and
# clipping that the carve flags describe. It writes one JSON line per step,
# {"step", "loss", "lr"} (+ "grad_norm", the norm before clipping, when
# clipping), and the final parameters by their PyTorch names as F32
# safetensors, like `train --save DIR` writes DIR/model.safetensors.

import argparse
import dataclasses
import fnmatch
import json
import math
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "models"))
import data_gen  # noqa: E402
import st  # noqa: E402

PARAMETERS_KEY = "carve.parameters"
BUFFERS_KEY = "carve.buffers"


class OracleError(RuntimeError):
    """The oracle cannot reproduce the carve run; the message says why."""


@dataclasses.dataclass
class Hyper:
    """Optimizer, schedule and clipping; field names and defaults are those of
    the `carve compile` flags (which are PyTorch's defaults)."""

    optimizer: str = "adamw"
    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = None  # None: 0.01 for AdamW, 0 for SGD
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    clip_grad_norm: float = None
    warmup_steps: int = 0
    decay_steps: int = 0
    min_lr_ratio: float = 0.0

    def decay(self):
        if self.weight_decay is not None:
            return self.weight_decay
        return 0.01 if self.optimizer == "adamw" else 0.0

    def lr_factor(self, t):
        """lr_t / lr at 0-based step t: linear warmup, cosine decay, then the floor."""
        if t < self.warmup_steps:
            return (t + 1) / self.warmup_steps
        if self.decay_steps <= 0:
            return 1.0
        d = t - self.warmup_steps
        if d < self.decay_steps:
            r = self.min_lr_ratio
            return r + (1 - r) * 0.5 * (1 + math.cos(math.pi * d / self.decay_steps))
        return self.min_lr_ratio

    def has_schedule(self):
        return self.warmup_steps > 0 or self.decay_steps > 0

    def carve_flags(self):
        """The `carve compile` flags that request these settings (only the
        non-default ones, so that the defaults are exercised too)."""
        flags = []
        default = Hyper()
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value == getattr(default, f.name) or value is None:
                continue
            flag = "--" + f.name.replace("_", "-")
            if isinstance(value, bool):
                flags.append(flag)
            else:
                flags += [flag, repr(value) if isinstance(value, float) else str(value)]
        return flags


def add_hyper_args(ap):
    for f in dataclasses.fields(Hyper):
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool" or f.type is bool:
            ap.add_argument(flag, action="store_true")
        elif f.name == "optimizer":
            ap.add_argument(flag, choices=["adamw", "sgd"], default="adamw")
        else:
            kind = int if f.name.endswith("_steps") else float
            ap.add_argument(flag, type=kind, default=f.default)


def hyper_from_args(args):
    return Hyper(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Hyper)})


# --- Model --------------------------------------------------------------------

def read_onnx(model_path):
    """(parameter names, buffer names, initializers name -> numpy) of an export."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(model_path)
    meta = {p.key: p.value for p in model.metadata_props}
    if PARAMETERS_KEY not in meta:
        raise OracleError(f"{model_path}: no '{PARAMETERS_KEY}' metadata; export it with "
                          "models/export.py")
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    return (json.loads(meta[PARAMETERS_KEY]), json.loads(meta.get(BUFFERS_KEY, "[]")),
            inits)


def build_model(model_path, name, config=None, set_dims=None):
    """Returns (module with the ONNX weights, graph inputs [(name, dtype, shape)])."""
    import torch
    import reference

    inputs = data_gen.graph_inputs(model_path, set_dims)
    token = data_gen.is_token_model(inputs)
    batch = inputs[0][2][0]
    seq = inputs[0][2][1] if token else 16
    model, _, input_names = reference.build(name, batch=batch, seq=seq, seed=0,
                                            config=config)
    if list(input_names) != [n for n, _, _ in inputs]:
        raise OracleError(f"{model_path}: graph inputs {[n for n, _, _ in inputs]} are "
                          f"not those of reference model '{name}' {input_names}")

    params, buffers, inits = read_onnx(model_path)
    own_params = dict(model.named_parameters())
    if list(own_params) != params:
        def some(names):
            return ", ".join(names[:6]) + (f" (+{len(names) - 6})" if len(names) > 6 else "")
        only_file = [p for p in params if p not in own_params]
        only_module = [p for p in own_params if p not in params]
        raise OracleError(
            f"{model_path}: its parameters are not those of reference model '{name}' "
            f"with config {config or {}}: only in the file: {some(only_file) or '-'}; "
            f"only in the module: {some(only_module) or '-'} (order differs if both "
            "are empty); pass the model name and --config the export used")
    own_buffers = dict(model.named_buffers())
    with torch.no_grad():
        for pname in params:
            copy_initializer(model_path, pname, own_params[pname], inits, config)
        for bname in buffers:
            if bname in inits and bname in own_buffers:
                copy_initializer(model_path, bname, own_buffers[bname], inits, config)
    return model, inputs


def copy_initializer(model_path, name, tensor, inits, config):
    import torch

    if name not in inits:
        raise OracleError(f"{model_path}: parameter '{name}' has no initializer")
    value = inits[name]
    if tuple(value.shape) != tuple(tensor.shape):
        raise OracleError(
            f"{model_path}: '{name}' is {list(value.shape)} in the ONNX file but "
            f"{list(tensor.shape)} in the reference module (config {config or {}}); "
            "pass the --config the export used")
    tensor.copy_(torch.from_numpy(np.array(value, copy=True)).to(tensor.dtype))


# --- Data ---------------------------------------------------------------------

class Batches:
    """Yields the inputs of step k in graph-input order, as `train --data` reads them."""

    def __init__(self, path, inputs, data_dtype="int32"):
        self.inputs = inputs
        self.token = data_gen.is_token_model(inputs)
        if self.token:
            self.tokens = data_gen.read_tokens(path, data_dtype)
            self.batch, self.seq = inputs[0][2]
            if len(self.tokens) < self.seq + 2:
                raise OracleError(f"{path}: {len(self.tokens)} tokens are fewer than "
                                  f"seq + 2 = {self.seq + 2}")
        else:
            self.tensors = data_gen.read_tensors(path)
            for name, dtype, shape in inputs:
                t = self.tensors.get(name)
                if t is None:
                    raise OracleError(f"{path}: no tensor '{name}'")
                if list(t.shape[1:]) != list(shape) or t.dtype != dtype:
                    raise OracleError(f"{path}: '{name}' is {t.dtype}{list(t.shape)}, "
                                      f"expected {dtype}[S, {', '.join(map(str, shape))}]")

    def __call__(self, k):
        if self.token:
            return data_gen.token_batch(self.tokens, k, self.batch, self.seq)
        step = data_gen.tensor_batch(self.tensors, k)
        return tuple(step[name] for name, _, _ in self.inputs)


# --- Training -----------------------------------------------------------------

def train(model_path, name, data_path, steps, hyper, data_dtype="int32", config=None,
          set_dims=None, frozen=(), threads=1, float64=False, log_path=None,
          save_path=None, autocast=None):
    """Trains and returns (records, final parameters name -> float32 numpy).
    autocast "bf16": the forward runs under torch.autocast("cpu", bfloat16)."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    model, inputs = build_model(model_path, name, config, set_dims)
    batches = Batches(data_path, inputs, data_dtype)
    if float64:
        model = model.double()
    model.train()

    named = list(model.named_parameters())
    for pname, p in named:
        p.requires_grad_(not any(fnmatch.fnmatchcase(pname, g) for g in frozen))
    params = [p for _, p in named if p.requires_grad]
    if not params:
        raise OracleError(f"--frozen {list(frozen)} freezes every parameter")
    if hyper.optimizer == "adamw":
        opt = torch.optim.AdamW(params, lr=hyper.lr, betas=(hyper.beta1, hyper.beta2),
                                eps=hyper.eps, weight_decay=hyper.decay())
    elif hyper.optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=hyper.lr, momentum=hyper.momentum,
                              dampening=hyper.dampening, nesterov=hyper.nesterov,
                              weight_decay=hyper.decay())
    else:
        raise OracleError(f"unknown optimizer '{hyper.optimizer}'")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, hyper.lr_factor)

    records = []
    log = open(log_path, "w") if log_path else None
    for k in range(steps):
        feeds = []
        for array in batches(k):
            t = torch.from_numpy(np.ascontiguousarray(array))
            feeds.append(t.double() if float64 and t.is_floating_point() else t)
        lr = opt.param_groups[0]["lr"]
        opt.zero_grad(set_to_none=True)
        if autocast == "bf16":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(*feeds)
        else:
            loss = model(*feeds)
        loss.float().backward()
        rec = {"step": k + 1, "loss": float(loss.item()), "lr": float(lr)}  # numbered as carve logs
        if hyper.clip_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, hyper.clip_grad_norm)
            rec["grad_norm"] = float(norm)
        opt.step()
        sched.step()
        records.append(rec)
        if log:
            log.write(json.dumps(rec) + "\n")
    if log:
        log.close()

    final = {pname: p.detach().to(torch.float32).numpy().copy()
             for pname, p in model.named_parameters()}
    if save_path:
        st.save(save_path, final)
    return records, final


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model", help="MODEL.onnx written by models/export.py")
    ap.add_argument("--name", required=True, help="reference model name (mlp, gpt, ...)")
    ap.add_argument("--config", type=json.loads, default=None, metavar="JSON",
                    help="the config overrides the export used (export.py --config)")
    ap.add_argument("--data", required=True)
    ap.add_argument("--data-dtype", choices=sorted(data_gen.TOKEN_DTYPES), default="int32")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--log", help="JSONL output, one record per step")
    ap.add_argument("--save", help="final parameters, safetensors")
    ap.add_argument("--set-dim", action="append", metavar="NAME=N")
    ap.add_argument("--frozen", action="append", default=[], metavar="GLOB")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--float64", action="store_true",
                    help="train in float64 (to tell float32 noise from a real difference)")
    add_hyper_args(ap)
    args = ap.parse_args(argv)
    try:
        records, _ = train(args.model, args.name, args.data, args.steps,
                           hyper_from_args(args), args.data_dtype, args.config,
                           data_gen.parse_set_dims(args.set_dim), args.frozen,
                           args.threads, args.float64, args.log, args.save)
    except (OracleError, ValueError, OSError) as e:
        print(f"torch_ref: error: {e}", file=sys.stderr)
        return 1
    if not args.log:
        for rec in records:
            print(json.dumps(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
