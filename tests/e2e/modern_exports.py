#!/usr/bin/env python3
"""What a current PyTorch (2.x) exports, carve imports and trains as PyTorch does.

Every other test exports with Debian's torch 1.13 and its TorchScript-based
exporter. This one hands the exporting and the PyTorch side of the comparison
to another interpreter (--python, a virtual environment with torch 2.x, onnx
and onnxscript; `--worker` is how this file runs there) and crosses

  cases      the reference models of models/reference.py (mlp, gpt, llama,
             bert, resnet18, vit); training losses built from PyTorch's own
             modules: nn.MultiheadAttention (mha), nn.TransformerEncoderLayer
             (encoder_layer), F.scaled_dot_product_attention (sdpa),
             nn.Conv2d + nn.BatchNorm2d (conv_bn); and a Hugging-Face-style
             decoder written plainly (hf_decoder: RMSNorm in float32, rotary
             tables computed in forward, grouped-query SDPA, SwiGLU MLP)
  exporters  torchscript     export_for_carve (models/export.py) with
                             dynamo=False, opset 17
             dynamo          export_for_carve around torch.onnx.export(
                             dynamo=True, optimize=False) at the exporter's
                             default opset, each tied parameter's initializer
                             renamed to its first named_parameters() name
             dynamo-optimized  dynamo, then the optimizer dynamo=True runs by
                             default (onnxscript.optimizer.optimize) with the
                             parameters held as graph inputs without values
                             meanwhile, so that it neither folds, merges nor
                             simplifies by their initial values
             dynamo-default  torch.onnx.export(dynamo=True) with every default
                             (optimize=True), no carve metadata: what a user
                             who does not know export_for_carve writes

What must hold, for every case and exporter:
1. The export succeeds; the file's opsets, local functions, op types, element
   types and what of them docs/onnx-ops.md does not list are printed.
2. `carve compile FILE -o OUT --quiet` (with --set-dim for every symbolic input
   dim, bound to the example's size) exits 0; else its `carve: error:` line is
   the result.
3. OUT/bin/train, STEPS plain SGD steps (lr LR, no clipping) on data the
   worker wrote, has every step's loss within LOSS_RTOL of the same module
   trained by the new torch from the same weights on the same batches; with
   carve metadata, its final weights within WEIGHT_RTOL of each tensor's
   largest entry.

Prints one "ok:" or "FAIL:" line per stage, then the table, and exits 1 when
any cell fails (--json FILE also writes the table).

    /usr/bin/python3 tests/e2e/modern_exports.py --carve build/bin/carve \
        --workdir /tmp/modern --python build/venv-modern/bin/python
"""

import argparse
import copy
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "models"))

STEPS = 3
LR = 0.1
# Three float32 SGD steps from identical weights: both sides differ only in
# the order of their sums (a few ulp per op), ~1e-6 relative in the loss; a
# wrong gradient moves step 1's loss by 1e-3 or more at this learning rate.
LOSS_RTOL = 1e-4
NOISE_FACTOR = 4
WEIGHT_RTOL = 1e-3
BATCH = 4
SEQ = 16

EXPORTERS = ["torchscript", "dynamo", "dynamo-optimized", "dynamo-default"]
REFERENCE_CASES = ["mlp", "gpt", "llama", "bert", "resnet18", "vit"]
TORCH_CASES = ["mha", "encoder_layer", "sdpa", "conv_bn"]
CASES = REFERENCE_CASES + TORCH_CASES + ["hf_decoder"]

WORKER_TIMEOUT_S = 600
COMPILE_TIMEOUT_S = 600
TRAIN_TIMEOUT_S = 300
RELINK_TRIES = 6

# carve's element types (docs/onnx-ops.md, "Element types"), by ONNX TensorProto number.
CARVE_DTYPES = {1: "f32", 11: "f64", 10: "f16", 16: "bf16", 7: "i64", 6: "i32", 3: "i8",
                2: "u8", 9: "bool"}


# --- The worker: runs under --python, with the new torch ---------------------

def _torch_cases():
    """name -> (module constructor, [(input name, shape, kind, high)]) of the
    PyTorch-module and hf_decoder cases; kind as reference.InputSpec's."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    width, heads, classes, t = 16, 2, 4, 8

    class MHA(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
            self.head = nn.Linear(width, classes)

        def forward(self, x, targets):
            y, _ = self.attn(x, x, x)
            return F.cross_entropy(self.head(y.mean(dim=1)), targets)

    class EncoderLayer(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.TransformerEncoderLayer(width, heads, dim_feedforward=32,
                                                    dropout=0.0, batch_first=True)
            self.head = nn.Linear(width, classes)

        def forward(self, x, targets):
            return F.cross_entropy(self.head(self.layer(x).mean(dim=1)), targets)

    class SDPA(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(width, 3 * width)
            self.proj = nn.Linear(width, width)
            self.head = nn.Linear(width, classes)

        def forward(self, x, targets):
            b, n, c = x.shape
            q, k, v = self.qkv(x).view(b, n, 3, heads, c // heads).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            y = self.proj(y.transpose(1, 2).reshape(b, n, c))
            return F.cross_entropy(self.head(y).reshape(b * n, classes), targets.reshape(-1))

    class ConvBN(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
            self.bn1 = nn.BatchNorm2d(8)
            self.conv2 = nn.Conv2d(8, 8, 3, stride=2, padding=1)
            self.bn2 = nn.BatchNorm2d(8)
            self.head = nn.Linear(8, classes)

        def forward(self, images, targets):
            h = F.relu(self.bn1(self.conv1(images)))
            h = F.relu(self.bn2(self.conv2(h)))
            return F.cross_entropy(self.head(h.mean(dim=(2, 3))), targets)

    # A Hugging-Face-style decoder (LlamaForCausalLM's structure), written plainly.
    vocab, dim, n_heads, n_kv, hidden, layers = 64, 32, 4, 2, 64, 2
    head_dim = dim // n_heads

    class RMSNorm(nn.Module):
        def __init__(self, eps=1e-6):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(dim))
            self.eps = eps

        def forward(self, x):
            dtype = x.dtype
            x = x.to(torch.float32)
            variance = x.pow(2).mean(-1, keepdim=True)
            x = x * torch.rsqrt(variance + self.eps)
            return self.weight * x.to(dtype)

    class Rotary(nn.Module):
        def __init__(self, base=10000.0):
            super().__init__()
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
            self.register_buffer("inv_freq", inv_freq, persistent=False)

        def forward(self, x, position_ids):
            inv = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
            pos = position_ids[:, None, :].float()
            freqs = (inv @ pos).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def rotate_half(x):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat((-x2, x1), dim=-1)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = nn.Linear(dim, n_heads * head_dim, bias=False)
            self.k_proj = nn.Linear(dim, n_kv * head_dim, bias=False)
            self.v_proj = nn.Linear(dim, n_kv * head_dim, bias=False)
            self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=False)

        def forward(self, x, cos, sin):
            b, n, _ = x.shape
            q = self.q_proj(x).view(b, n, n_heads, head_dim).transpose(1, 2)
            k = self.k_proj(x).view(b, n, n_kv, head_dim).transpose(1, 2)
            v = self.v_proj(x).view(b, n, n_kv, head_dim).transpose(1, 2)
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            rep = n_heads // n_kv
            k = k[:, :, None].expand(b, n_kv, rep, n, head_dim).reshape(b, n_heads, n, head_dim)
            v = v[:, :, None].expand(b, n_kv, rep, n, head_dim).reshape(b, n_heads, n, head_dim)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o_proj(y.transpose(1, 2).reshape(b, n, -1))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj = nn.Linear(dim, hidden, bias=False)
            self.up_proj = nn.Linear(dim, hidden, bias=False)
            self.down_proj = nn.Linear(hidden, dim, bias=False)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class DecoderLayer(nn.Module):
        def __init__(self):
            super().__init__()
            self.input_layernorm = RMSNorm()
            self.self_attn = Attention()
            self.post_attention_layernorm = RMSNorm()
            self.mlp = MLP()

        def forward(self, x, cos, sin):
            x = x + self.self_attn(self.input_layernorm(x), cos, sin)
            return x + self.mlp(self.post_attention_layernorm(x))

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(vocab, dim)
            self.layers = nn.ModuleList(DecoderLayer() for _ in range(layers))
            self.norm = RMSNorm()
            self.rotary_emb = Rotary()
            self.lm_head = nn.Linear(dim, vocab, bias=False)

        def forward(self, input_ids, targets):
            b, n = input_ids.shape
            position_ids = torch.arange(n, device=input_ids.device).unsqueeze(0).expand(b, -1)
            x = self.embed_tokens(input_ids)
            cos, sin = self.rotary_emb(x, position_ids)
            for layer in self.layers:
                x = layer(x, cos, sin)
            logits = self.lm_head(self.norm(x))
            return F.cross_entropy(logits.view(-1, vocab), targets.view(-1))

    x_spec = [("x", (BATCH, t, width), "float", 0), ("targets", (BATCH,), "index", classes)]
    return {
        "mha": (MHA, x_spec),
        "encoder_layer": (EncoderLayer, x_spec),
        "sdpa": (SDPA, [("x", (BATCH, t, width), "float", 0),
                        ("targets", (BATCH, t), "index", classes)]),
        "conv_bn": (ConvBN, [("images", (BATCH, 3, 16, 16), "float", 0),
                             ("targets", (BATCH,), "index", classes)]),
        "hf_decoder": (Decoder, [("input_ids", (BATCH, SEQ), "index", vocab),
                                 ("targets", (BATCH, SEQ), "index", vocab)]),
    }


def _build(case):
    """(module, example inputs, input specs [(name, shape, kind, high)])."""
    import torch
    import reference

    if case in reference.MODELS:
        model, inputs, _ = reference.build(case, batch=BATCH, seq=SEQ, seed=0)
        _, specs = reference.MODELS[case]
        specs = [(s.name, tuple(x.shape), s.kind, s.high) for s, x in zip(specs, inputs)]
        return model, inputs, specs
    ctor, specs = _torch_cases()[case]
    torch.manual_seed(0)
    model = ctor()
    gen = torch.Generator().manual_seed(1)
    return model, tuple(_example(s, gen) for s in specs), specs


def _example(spec, gen):
    import torch

    _, shape, kind, high = spec
    if kind == "float":
        return torch.randn(shape, generator=gen)
    if kind == "mask":
        m = torch.ones(shape, dtype=torch.int64)
        m[::2, shape[1] * 3 // 4:] = 0
        return m
    return torch.randint(0, high, shape, generator=gen, dtype=torch.int64)


def _tied_aliases(model):
    """{other name: first name} of every parameter or buffer reachable by two names."""
    first, alias = {}, {}
    named = list(model.named_parameters(remove_duplicate=False)) + list(
        model.named_buffers(remove_duplicate=False))
    for name, t in named:
        first.setdefault(id(t), name)
        if first[id(t)] != name:
            alias[name] = first[id(t)]
    return alias


def _rename_initializers(path, renames):
    import onnx

    proto = onnx.load(path)
    have = {t.name for t in proto.graph.initializer}
    renames = {a: b for a, b in renames.items() if a in have and b not in have}
    if not renames:
        return
    for t in proto.graph.initializer:
        t.name = renames.get(t.name, t.name)
    for node in proto.graph.node:
        for i, name in enumerate(node.input):
            if name in renames:
                node.input[i] = renames[name]
    onnx.save(proto, path)


def _export(case, exporter, model, inputs, specs, path):
    """Exports with `exporter`; returns the warnings export_for_carve caught."""
    import torch
    import export

    names = [s[0] for s in specs]
    if exporter == "dynamo-default":
        torch.onnx.export(model, inputs, path, input_names=names, output_names=["loss"],
                          dynamo=True, external_data=False)
        return []
    original = torch.onnx.export
    dynamo = exporter in ("dynamo", "dynamo-optimized")

    def patched(m, args, f, training=None, do_constant_folding=None, **kw):
        kw.pop("dynamo", None)  # export_for_carve asks for the TorchScript exporter
        if not dynamo:
            return original(m, args, f, dynamo=False, training=training,
                            do_constant_folding=do_constant_folding, **kw)
        # training and do_constant_folding are TorchScript-only: the module's
        # own mode is exported, and optimize=False keeps weights unfolded.
        original(m, args, f, dynamo=True, optimize=False, external_data=False, **kw)
        _rename_initializers(f, _tied_aliases(m))
        return None

    torch.onnx.export = patched
    try:
        info = export.export_for_carve(model, inputs, path, input_names=names,
                                       opset=None if dynamo else 17)
    finally:
        torch.onnx.export = original
    if exporter == "dynamo-optimized":
        _optimize_keeping_parameters(path)
    return info["warnings"]


def _optimize_keeping_parameters(path):
    """Runs the optimizer that dynamo=True runs by default (onnxscript's), with
    every carve.parameters initializer made a graph input meanwhile: the
    optimizer folds and merges initializers as constants, but not graph inputs."""
    import onnx
    import onnx_ir as ir
    import onnxscript

    proto = onnx.load(path)
    meta = {p.key: p.value for p in proto.metadata_props}
    keep = set(json.loads(meta["carve.parameters"]))
    model = ir.serde.deserialize_model(proto)
    graph = model.graph
    protected = [(v, v.const_value) for name, v in graph.initializers.items() if name in keep]
    for v, _ in protected:
        # Its value hidden too: the optimizer drops e.g. a Gemm's bias that is
        # all zeros at initialization (nn.MultiheadAttention's out_proj.bias).
        graph.initializers.pop(v.name)
        v.const_value = None
        graph.inputs.append(v)
    onnxscript.optimizer.optimize(model)
    for v, value in protected:
        graph.inputs.remove(v)
        v.const_value = value
        graph.register_initializer(v)
    onnx.save(ir.serde.serialize_model(model), path)


def _supported_ops():
    """The op types docs/onnx-ops.md's op table lists."""
    ops, in_table = set(), False
    with open(os.path.join(ROOT, "docs", "onnx-ops.md")) as f:
        for line in f:
            if line.startswith("| ONNX op |"):
                in_table = True
                continue
            if in_table and not line.startswith("|"):
                break
            m = re.match(r"\|\s*([A-Z][A-Za-z0-9]*)\s*\|", line)
            if in_table and m:
                ops.add(m.group(1))
    return ops


def _analyze(path):
    """What the file holds that matters to carve's importer."""
    import onnx

    proto = onnx.load(path)
    opsets = {(o.domain or "ai.onnx"): o.version for o in proto.opset_import}
    functions = ["%s::%s" % (f.domain, f.name) for f in proto.functions]
    function_keys = {(f.domain, f.name) for f in proto.functions}
    supported = _supported_ops()
    ops, lacking, dtypes = {}, {}, set()

    def walk(graph, where):
        for t in graph.initializer:
            dtypes.add(t.data_type)
        for v in list(graph.input) + list(graph.output) + list(graph.value_info):
            if v.type.HasField("tensor_type"):
                dtypes.add(v.type.tensor_type.elem_type)
        for node in graph.node:
            key = (node.domain + "::" if node.domain not in ("", "ai.onnx") else "") + node.op_type
            ops[key] = ops.get(key, 0) + 1
            if (node.domain, node.op_type) in function_keys:
                lacking.setdefault("local function %s" % key, node.name)
            elif node.domain not in ("", "ai.onnx"):
                lacking.setdefault("op %s of domain %s" % (node.op_type, node.domain), node.name)
            elif node.op_type not in supported:
                lacking.setdefault("op %s at opset %d" % (node.op_type, opsets.get("ai.onnx", 0)),
                                   node.name)
            for a in node.attribute:
                if a.name == "to" and node.op_type == "Cast":
                    dtypes.add(a.i)
                if a.type == onnx.AttributeProto.TENSOR:
                    dtypes.add(a.t.data_type)
                if a.type == onnx.AttributeProto.GRAPH:
                    lacking.setdefault("subgraph (%s.%s)" % (node.op_type, a.name), node.name)
                    walk(a.g, where)

    walk(proto.graph, "graph")
    for f in proto.functions:
        for node in f.node:
            key = (node.domain + "::" if node.domain else "") + node.op_type
            ops["(in functions) " + key] = ops.get("(in functions) " + key, 0) + 1
    for dt in sorted(dtypes):
        if dt and dt not in CARVE_DTYPES:
            lacking.setdefault("element type %s" % onnx.TensorProto.DataType.Name(dt), "")
    inits = {t.name for t in proto.graph.initializer}
    symbols = {}
    for v in proto.graph.input:
        if v.name in inits:
            continue
        for d in v.type.tensor_type.shape.dim:
            if d.dim_param:
                symbols[d.dim_param] = None
    meta = {p.key for p in proto.metadata_props}
    return {
        "ir_version": proto.ir_version,
        "opsets": opsets,
        "functions": functions,
        "ops": ops,
        "lacking": [("%s (node %s)" % (k, n)) if n else k for k, n in lacking.items()],
        "dtypes": sorted(onnx.TensorProto.DataType.Name(d) for d in dtypes if d),
        "symbols": sorted(symbols),
        "metadata": "carve.parameters" in meta,
        "initializers": len(inits),
        "initializer_names": sorted(inits),
        "outputs": [o.name for o in proto.graph.output],
    }


def _batches(specs, steps, seed=100):
    """STEPS batches [{name: numpy}] of the specs' shapes."""
    import torch

    out = []
    for k in range(steps):
        gen = torch.Generator().manual_seed(seed + k)
        out.append({s[0]: _example(s, gen).numpy() for s in specs})
    return out


def _write_data(specs, workdir):
    """Writes the training data; returns (path, [{name: numpy}] per step)."""
    import numpy as np
    import data_gen
    import st

    names = [s[0] for s in specs]
    if names == ["input_ids", "targets"]:
        vocab = specs[0][3]
        tokens = data_gen.make_tokens(2000, vocab, seed=0)
        path = os.path.join(workdir, "tokens.i32")
        data_gen.write_tokens(path, tokens, "int32")
        _, (b, t), _, _ = specs[0]
        steps = []
        for k in range(STEPS):
            ids, tgt = data_gen.token_batch(tokens, k, b, t)
            steps.append({"input_ids": ids, "targets": tgt})
        return path, steps
    steps = _batches(specs, STEPS)
    path = os.path.join(workdir, "data.safetensors")
    st.save(path, {n: np.stack([s[n] for s in steps]) for n in names})
    return path, steps


def _train_torch(model, specs, steps, frozen_bn=False):
    """Losses of STEPS SGD steps, and the final parameters by name. With
    frozen_bn, every batch norm normalizes by its running statistics and leaves
    them alone (its module in eval mode), as an inference-mode export computes."""
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model.train()
    if frozen_bn:
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.eval()
    losses = []
    for batch in steps:
        opt.zero_grad()
        loss = model(*(torch.from_numpy(batch[s[0]]) for s in specs))
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))
    return losses, {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def worker(case, exporter, workdir):
    """Exports `case`, trains it with torch, writes workdir/result.json."""
    import torch
    import onnx
    import st

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    result = {"torch": torch.__version__, "onnx": onnx.__version__}
    try:
        import onnxscript
        result["onnxscript"] = onnxscript.__version__
    except ImportError:
        pass
    model, inputs, specs = _build(case)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    path = os.path.join(workdir, "model.onnx")
    start = time.time()
    try:
        warnings = _export(case, exporter, model, inputs, specs, path)
        result["export"] = {"ok": True, "seconds": round(time.time() - start, 1),
                            "warnings": warnings}
    except Exception as e:  # the export failing is a result of the survey
        lines = [line for line in str(e).strip().splitlines() if line.strip()]
        result["export"] = {"ok": False, "error": "%s: %s" % (
            type(e).__name__, lines[0] if lines else "")[:600]}
    if result["export"]["ok"]:
        result["analysis"] = an = _analyze(path)
        # What became of the module's parameters: without carve metadata carve
        # trains every float initializer, so a folded or merged weight trains
        # differently.
        params = [n for n, _ in model.named_parameters()]
        known = set(params) | {n for n, _ in model.named_buffers()}
        inits = set(an["initializer_names"])
        an["params_missing"] = [n for n in params if n not in inits]
        an["other_initializers"] = sorted(inits - known)
        result["sizes"] = {s[0]: list(s[1]) for s in specs}
    model.load_state_dict(state)
    data, steps = _write_data(specs, workdir)
    result["data"] = data
    exact = copy.deepcopy(model).double()
    losses, final = _train_torch(model, specs, steps)
    result["torch_losses"] = losses
    result["torch_losses_f64"], final64 = _train_torch(exact, specs, [
        {k: v.astype("float64") if v.dtype.kind == "f" else v for k, v in b.items()}
        for b in steps])
    if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        # What an export that writes its batch norms in inference mode computes:
        # the same model with frozen statistics, trained from the same weights.
        frozen = copy.deepcopy(exact).float()
        frozen.load_state_dict(state)
        frozen64 = copy.deepcopy(frozen).double()
        result["torch_losses_frozen_bn"], _ = _train_torch(frozen, specs, steps, frozen_bn=True)
        result["torch_losses_frozen_bn_f64"], _ = _train_torch(frozen64, specs, [
            {k: v.astype("float64") if v.dtype.kind == "f" else v for k, v in b.items()}
            for b in steps], frozen_bn=True)
    st.save(os.path.join(workdir, "torch_final.safetensors"), final)
    st.save(os.path.join(workdir, "torch_final_f64.safetensors"),
            {k: v.astype("float32") for k, v in final64.items()})
    with open(os.path.join(workdir, "result.json"), "w") as f:
        json.dump(result, f, indent=1)


# --- The driver: any Python with numpy ---------------------------------------

class Cell:
    """One case x exporter: what each stage gave."""

    def __init__(self, case, exporter):
        self.case, self.exporter = case, exporter
        self.export = "-"      # "ok", or the error line
        self.opset = "-"
        self.functions = 0
        self.lacking = []
        self.compile = "-"     # "ok", or carve's error line
        self.train = "-"       # "ok (max rel diff)", or what differed
        self.ok = False

    def row(self):
        return [self.case, self.exporter, self.export, self.opset, brief(self.compile),
                self.train]


def run_cmd(cmd, timeout):
    """(exit code or None on timeout, stdout + stderr)."""
    for attempt in range(RELINK_TRIES):
        try:
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 start_new_session=True)
            break
        except OSError as e:
            # A build beside this run relinks carve: missing or not executable a moment.
            if attempt == RELINK_TRIES - 1:
                return 127, "cannot start %s: %s" % (cmd[0], e)
            time.sleep(30)
    try:
        out, _ = p.communicate(timeout=timeout)
        return p.returncode, out.decode(errors="replace")
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        return None, out.decode(errors="replace")


def short_list(names, n=6):
    return ", ".join(names[:n]) + (" (+%d)" % (len(names) - n) if len(names) > n else "")


def carve_error(out):
    """The first `carve: error:` line of carve's output, or its last line."""
    lines = [line for line in out.strip().splitlines() if line.strip()]
    for line in lines:
        if "error:" in line:
            return line.strip()
    return lines[-1].strip() if lines else "(no output)"


def brief(error):
    """A carve error line without the file's path and the pointer to the docs."""
    error = re.sub(r"^carve: error: \S+\.onnx: ", "", error)
    return error.replace("; the supported ops are listed in docs/onnx-ops.md", "")


def survey(cell, args, workdir):
    """Runs the stages of one cell; prints ok:/FAIL: lines."""
    import numpy as np
    import st

    label = "%s/%s" % (cell.case, cell.exporter)
    os.makedirs(workdir)
    code, out = run_cmd([args.python, os.path.abspath(__file__), "--worker", cell.case,
                         cell.exporter, workdir], WORKER_TIMEOUT_S)
    result_path = os.path.join(workdir, "result.json")
    if code != 0 or not os.path.exists(result_path):
        cell.export = "worker failed (%s): %s" % (
            "timeout" if code is None else "exit %s" % code, carve_error(out))
        print("FAIL: %s: %s" % (label, cell.export))
        return
    with open(result_path) as f:
        res = json.load(f)
    if not res["export"]["ok"]:
        cell.export = res["export"]["error"]
        print("FAIL: %s: export: %s" % (label, cell.export))
        return
    an = res["analysis"]
    cell.export = "ok"
    cell.opset = ",".join("%s:%d" % (d, v) if d != "ai.onnx" else str(v)
                          for d, v in sorted(an["opsets"].items()))
    cell.functions = len(an["functions"])
    cell.lacking = an["lacking"]
    print("ok: %s: exported in %.1f s (torch %s): IR %d, opsets %s, %d local functions, "
          "%d initializers, metadata %s, element types %s" % (
              label, res["export"]["seconds"], res["torch"], an["ir_version"], an["opsets"],
              cell.functions, an["initializers"], "yes" if an["metadata"] else "no",
              " ".join(an["dtypes"])))
    print("    ops: " + " ".join("%s×%d" % kv for kv in sorted(an["ops"].items())))
    if an["lacking"]:
        print("    not in docs/onnx-ops.md: " + "; ".join(an["lacking"]))
    if an["params_missing"]:
        print("    %d of the module's parameters are no initializer (%s); other initializers: %s"
              % (len(an["params_missing"]), short_list(an["params_missing"]),
                 short_list(an["other_initializers"])))

    model = os.path.join(workdir, "model.onnx")
    out_dir = os.path.join(workdir, "out")
    cmd = [args.carve, "compile", model, "-o", out_dir, "--quiet", "--optimizer", "sgd",
           "--lr", str(LR), "--clip-grad-norm", "0"]
    sizes = res["sizes"]
    for sym in an["symbols"]:
        # The exporters name a free dim after the input; bind it to the example's size.
        size = next((dims[0] for dims in sizes.values()), BATCH)
        cmd[3:3] = ["--set-dim", "%s=%d" % (sym, size)]
    start = time.time()
    code, out = run_cmd(cmd, COMPILE_TIMEOUT_S)
    # The dynamo exporter writes a training-mode batch norm in inference mode; carve cannot
    # tell it from a frozen one and must say so (a note), not train silently apart.
    inference_bn = "BatchNormalization node" in out and "running statistics" in out
    if code != 0:
        cell.compile = carve_error(out) if code is not None else "timeout"
        print("FAIL: %s: carve compile: %s" % (label, cell.compile))
        return
    cell.compile = "ok"
    print("ok: %s: carve compile in %.1f s" % (label, time.time() - start))

    log, ckpt = os.path.join(workdir, "log.jsonl"), os.path.join(workdir, "ckpt")
    code, out = run_cmd([os.path.join(out_dir, "bin", "train"), "--steps", str(STEPS),
                         "--data", res["data"], "--log", log, "--save", ckpt, "--quiet"],
                        TRAIN_TIMEOUT_S)
    if code != 0:
        cell.train = "train: " + carve_error(out)
        print("FAIL: %s: %s" % (label, cell.train))
        return
    with open(log) as f:
        mine = [json.loads(line)["loss"] for line in f if line.strip()]
    ref = res["torch_losses"]
    gaps = [abs(a - b) / abs(b) for a, b in zip(mine, ref)]
    worst = max(gaps) if gaps else float("inf")
    # A deep net with batch norm over a batch of 4 (resnet18) amplifies
    # rounding: float32 PyTorch itself ends up 7e-4 from float64 by step 2.
    # Within NOISE_FACTOR times that gap, carve's difference is rounding too.
    noise = max(abs(a - b) / abs(b) for a, b in zip(ref, res["torch_losses_f64"]))
    limit = max(LOSS_RTOL, NOISE_FACTOR * noise)
    if len(mine) != len(ref) or worst > limit:
        cell.train = "losses differ by %.2g (limit %.1g; carve %s, torch %s)" % (
            worst, limit, " ".join("%.6f" % x for x in mine), " ".join("%.6f" % x for x in ref))
        frozen = res.get("torch_losses_frozen_bn")
        if (inference_bn and exporter_writes_inference_bn(cell.exporter) and frozen and
                len(mine) == len(frozen)):
            # carve must then compute what the export says: the model with its batch
            # norms frozen, which torch trains too. Compared like the losses above.
            fgap = max(abs(a - b) / abs(b) for a, b in zip(mine, frozen))
            fnoise = max(abs(a - b) / abs(b)
                         for a, b in zip(frozen, res["torch_losses_frozen_bn_f64"]))
            flimit = max(LOSS_RTOL, NOISE_FACTOR * fnoise)
            if fgap <= flimit:
                cell.train = ("ok as exported (batch norm in inference mode, noted): %.1e from "
                              "torch with frozen batch norms" % fgap)
                cell.ok = True
                print("ok: %s: the exporter wrote its batch norm in inference mode and carve's "
                      "compile said so; losses within %.2g (limit %.1g) of torch training the "
                      "model with frozen batch norms (%.2g from torch's training mode)" % (
                          label, fgap, flimit, worst))
                return
            cell.train = ("batch norm in inference mode (noted), yet %.2g from torch with "
                          "frozen batch norms (limit %.1g; carve %s, torch %s)" % (
                              fgap, flimit, " ".join("%.6f" % x for x in mine),
                              " ".join("%.6f" % x for x in frozen)))
        print("FAIL: %s: %s" % (label, cell.train))
        return
    weights = ""
    if an["metadata"]:
        final = st.load(os.path.join(workdir, "torch_final.safetensors"))
        exact = st.load(os.path.join(workdir, "torch_final_f64.safetensors"))
        saved = st.load_checkpoint(ckpt)

        def rel_gap(a, t):
            # The floor: a tensor whose entries stay below it, such as a key
            # bias (its gradient is zero in exact arithmetic), holds rounding noise.
            return float(np.max(np.abs(a - t)) / max(float(np.max(np.abs(t))), 1e-3))

        # Weights are compared only where float32 itself is well posed: PyTorch's own
        # float32 run within WEIGHT_RTOL of its float64 run on every tensor. A deep net
        # with batch norm over a batch of 4 is not (resnet18: its near-zero batch-norm
        # biases part by tens of percent within 3 steps); its losses are still compared.
        posed_gap, posed_at = max((rel_gap(t, exact[name]), name) for name, t in final.items())
        if posed_gap > WEIGHT_RTOL:
            cell.train = ("ok (%.1e; weights not compared: torch's float32 run is %.2g from its "
                          "float64 run at %s)" % (worst, posed_gap, posed_at))
            cell.ok = True
            print("ok: %s: %d SGD steps, losses within %.2g of torch's (limit %.1g); weights not "
                  "compared: not well posed in float32 (torch's own float32 run is %.2g from "
                  "its float64 run at %s)" % (label, STEPS, worst, limit, posed_gap, posed_at))
            return
        gap, where, limit_w = 0.0, "", WEIGHT_RTOL
        for name, t in final.items():
            if name not in saved:
                cell.train = "the checkpoint lacks %s" % name
                print("FAIL: %s: %s" % (label, cell.train))
                return
            # As for the losses: within NOISE_FACTOR times float32 PyTorch's
            # own distance from float64 on this tensor.
            g = rel_gap(saved[name], t) / max(WEIGHT_RTOL, NOISE_FACTOR * rel_gap(t, exact[name]))
            if g > gap:
                gap, where = g, name
        if gap > 1:
            cell.train = "weights differ by %.2g of their limit at %s" % (gap, where)
            print("FAIL: %s: %s" % (label, cell.train))
            return
        weights = ", weights %.2f of limit" % gap
    cell.train = "ok (%.1e%s)" % (worst, weights)
    cell.ok = True
    print("ok: %s: %d SGD steps, losses within %.2g of torch's (limit %.1g)%s" % (
        label, STEPS, worst, limit, weights))


def exporter_writes_inference_bn(exporter):
    """The dynamo exporters write a training-mode batch norm in inference mode
    (onnxscript's torch_lib): an exporter fault carve can only point out."""
    return exporter.startswith("dynamo")


def print_table(cells):
    head = ["model", "exporter", "export", "opset", "carve compile", "3 steps vs torch"]
    rows = [head] + [c.row() for c in cells]
    width = [min(max(len(r[i]) for r in rows), 40) for i in range(len(head))]
    for i, r in enumerate(rows):
        print("  " + "  ".join(x.ljust(w) for x, w in zip(r, width)).rstrip())
        if i == 0:
            print("  " + "  ".join("-" * w for w in width))


def main():
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:5])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--carve", required=True, help="build/bin/carve")
    ap.add_argument("--workdir", required=True, help="scratch folder (emptied first)")
    ap.add_argument("--python", required=True,
                    help="an interpreter with torch 2.x, onnx and onnxscript")
    ap.add_argument("--cases", default=",".join(CASES),
                    help="comma-separated subset of " + ",".join(CASES))
    ap.add_argument("--exporters", default=",".join(EXPORTERS),
                    help="comma-separated subset of " + ",".join(EXPORTERS))
    ap.add_argument("--json", help="also write the table here")
    a = ap.parse_args()
    cases, exporters = a.cases.split(","), a.exporters.split(",")
    for name in cases:
        if name not in CASES:
            ap.error("unknown case '%s'" % name)
    for name in exporters:
        if name not in EXPORTERS:
            ap.error("unknown exporter '%s'" % name)
    a.carve = os.path.abspath(a.carve)
    shutil.rmtree(a.workdir, ignore_errors=True)
    os.makedirs(a.workdir)

    start = time.time()
    cells = []
    for case in cases:
        for exporter in exporters:
            cell = Cell(case, exporter)
            cells.append(cell)
            survey(cell, a, os.path.join(a.workdir, "%s-%s" % (case, exporter)))
    print()
    print_table(cells)
    failures = sorted({re.sub(r"node '[^']*' ", "", brief(c.compile))
                       for c in cells if c.compile not in ("ok", "-")})
    if failures:
        print("\ndistinct carve compile errors:")
        for line in failures:
            print("  " + line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump([dict(vars(c)) for c in cells], f, indent=1)
    bad = [c for c in cells if not c.ok]
    print("\nmodern-exports: %d of %d cells ok in %.0f s" % (
        len(cells) - len(bad), len(cells), time.time() - start))
    if bad:
        print("FAIL: %s" % ", ".join("%s/%s" % (c.case, c.exporter) for c in bad))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
