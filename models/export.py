"""Export PyTorch models to ONNX files that carve can import (library and CLI)."""

import argparse
import json
import os
import sys
import tempfile
import warnings

import onnx
from onnx import numpy_helper
import torch

PARAMETERS_KEY = "carve.parameters"
BUFFERS_KEY = "carve.buffers"
STATE_DICT_KEY = "carve.state_dict"


class ExportError(RuntimeError):
    """The exported graph does not meet carve's contract (see export_for_carve)."""


def _unique_names(named_tensors):
    seen, names = set(), []
    for name, _ in named_tensors:
        if name not in seen:
            seen.add(name)
            names.append(name)
    return names


def _state_dict_sources(model):
    """[[key, tensor]] for every key of model.state_dict(), in its order: the
    parameter or buffer name (as in carve.parameters / carve.buffers) that holds
    the key's tensor. A tied weight (lm_head.weight is wte.weight) is one tensor
    under two keys; `carve ckpt merge --model` writes it under both."""
    owner = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        owner.setdefault(id(t), name)
    return [[key, owner.get(id(t), key)] for key, t in model.state_dict(keep_vars=True).items()]


def _restore_initializers(proto, buffers):
    """Gives buffer initializers the values `buffers` held before export.

    The exporter reads the module's tensors after tracing, so batch-norm running
    statistics would otherwise arrive already updated by the traced step.
    """
    for i, init in enumerate(proto.graph.initializer):
        if init.name not in buffers:
            continue
        want = buffers[init.name].cpu().numpy()
        have = numpy_helper.to_array(init)
        if have.shape == want.shape and have.dtype == want.dtype and (have != want).any():
            proto.graph.initializer[i].CopyFrom(numpy_helper.from_array(want, init.name))


def _torchscript_exporter():
    """torch 2.x's export defaults to the dynamo-based exporter, whose default optimizer
    folds and merges weights by their initial values and which writes a training-mode
    batch norm in inference mode (docs/onnx-ops.md, "Exports from a current PyTorch"):
    ask for the TorchScript-based one where the argument exists (torch 1.13 has only it)."""
    import inspect
    try:
        return {"dynamo": False} if "dynamo" in inspect.signature(torch.onnx.export).parameters \
            else {}
    except (TypeError, ValueError):
        return {}


def export_for_carve(
    model,
    example_inputs,
    path,
    input_names=None,
    output_name="loss",
    opset=17,
    dynamic_axes=None,
    external_data=False,
    training=torch.onnx.TrainingMode.TRAINING,
):
    """Exports `model(*example_inputs)` (a scalar loss) to the ONNX file `path`.

    Parameters keep their `named_parameters()` names as initializer names, and the
    file records which initializers are trainable parameters (metadata key
    "carve.parameters") and which are buffers ("carve.buffers"), each as a JSON list,
    and every key of `model.state_dict()` with the parameter or buffer that holds it
    ("carve.state_dict": [[key, name]], tied weights included), which
    `carve ckpt merge --model` writes back under every key.

    model          torch.nn.Module whose forward returns a scalar loss.
    example_inputs tuple of tensors passed to forward; their shapes become the
                   graph's input shapes (except the axes named in dynamic_axes).
    input_names    graph input names, one per example input ("input0", ... if None).
    dynamic_axes   {input name: {dim index: symbol}}, e.g. {"x": {0: "batch"}}.
    external_data  store all initializers in `path + ".data"` next to the model.
    training       keep TRAINING: batch norm then uses batch statistics, and the
                   exporter neither merges initializers of equal value (e.g. two
                   zero-initialized biases) nor folds batch norm into convolutions,
                   both of which it does in eval mode, losing parameter names.

    Returns a summary dict (see `_summary`). Raises ExportError when forward does
    not return one scalar, or a parameter did not survive as an initializer of
    the same name.
    """
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    if input_names is None:
        input_names = [f"input{i}" for i in range(len(example_inputs))]

    # Tracing in training mode updates batch-norm running statistics in place;
    # export the model as it was, and leave it as it was.
    saved = {k: v.detach().clone() for k, v in model.named_buffers()}
    with warnings.catch_warnings(record=True) as caught, \
            tempfile.TemporaryDirectory() as tmp:
        warnings.simplefilter("always")
        # A scratch file rather than memory: over 2 GiB the exporter writes
        # external data next to its output, which onnx.load reads back.
        tmp_path = os.path.join(tmp, "model.onnx")
        try:
            torch.onnx.export(
                model,
                example_inputs,
                tmp_path,
                **_torchscript_exporter(),
                export_params=True,
                # Folding would rewrite e.g. a tied, transposed weight into a new
                # initializer called "onnx::MatMul_123"; carve needs every
                # initializer to keep its parameter name.
                do_constant_folding=False,
                keep_initializers_as_inputs=False,
                opset_version=opset,
                training=training,
                input_names=list(input_names),
                output_names=[output_name],
                dynamic_axes=dynamic_axes,
            )
        finally:
            with torch.no_grad():
                for name, buf in model.named_buffers():
                    buf.copy_(saved[name])
        proto = onnx.load_model(tmp_path)
    _restore_initializers(proto, saved)

    outputs = proto.graph.output
    if len(outputs) != 1 or len(outputs[0].type.tensor_type.shape.dim) != 0:
        shapes = [[d.dim_value or d.dim_param for d in o.type.tensor_type.shape.dim]
                  for o in outputs]
        raise ExportError(
            f"{path}: forward must return one scalar loss; the graph has outputs "
            + ", ".join(f"{o.name} {s}" for o, s in zip(outputs, shapes))
        )

    params = _unique_names(model.named_parameters())
    buffers = _unique_names(model.named_buffers())
    initializers = {t.name for t in proto.graph.initializer}
    missing = [p for p in params if p not in initializers]
    if missing:
        raise ExportError(
            f"{path}: parameters not exported as initializers of the same name: "
            f"{', '.join(missing)}; the exporter drops parameters that forward does "
            f"not use, and outside training mode it also merges initializers of equal "
            f"value and folds batch norm into convolutions "
            f"(initializers: {', '.join(sorted(initializers))})"
        )

    del proto.metadata_props[:]
    for key, value in ((PARAMETERS_KEY, params), (BUFFERS_KEY, buffers),
                       (STATE_DICT_KEY, _state_dict_sources(model))):
        entry = proto.metadata_props.add()
        entry.key = key
        entry.value = json.dumps(value)

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if external_data:
        location = os.path.basename(path) + ".data"
        data_path = os.path.join(os.path.dirname(os.path.abspath(path)), location)
        if os.path.exists(data_path):
            # The external-data writer appends to an existing file.
            os.remove(data_path)
        onnx.save_model(
            proto,
            path,
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=location,
            size_threshold=0,
        )
    elif proto.ByteSize() >= 2**31:
        raise ExportError(f"{path}: over the 2 GiB protobuf limit; use external data")
    else:
        onnx.save_model(proto, path)
    onnx.checker.check_model(path)

    return _summary(model, proto, path, example_inputs, input_names, dynamic_axes,
                    opset, buffers, initializers, caught)


def _summary(model, proto, path, example_inputs, input_names, dynamic_axes, opset,
             buffers, initializers, caught):
    trainable = [p for _, p in model.named_parameters() if p.requires_grad]
    shapes = {}
    for name, tensor in zip(input_names, example_inputs):
        dims = list(tensor.shape)
        for dim, symbol in (dynamic_axes or {}).get(name, {}).items():
            dims[dim] = symbol
        shapes[name] = dims
    return {
        "path": path,
        "trainable_params": len(trainable),
        "trainable_elements": sum(p.numel() for p in trainable),
        "inputs": shapes,
        "opset": opset,
        "initializers": len(initializers),
        "buffers_not_exported": [b for b in buffers if b not in initializers],
        "op_types": sorted(
            {(n.domain + "::" if n.domain else "") + n.op_type for n in proto.graph.node}
        ),
        "warnings": sorted({f"{w.category.__name__}: {w.message}" for w in caught}),
    }


def main(argv=None):
    # The reference models live next to this file; a user's own code only needs
    # export_for_carve and does not import them.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import reference

    parser = argparse.ArgumentParser(
        description="Export reference models to ONNX for carve.")
    parser.add_argument("model", choices=sorted(reference.MODELS) + ["all"])
    parser.add_argument("--out", default=".", help="output folder (default: .)")
    parser.add_argument("--opset", type=int, default=17, help="ONNX opset (13..17)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=16,
                        help="sequence length of the token models")
    parser.add_argument("--dynamic-batch", action="store_true",
                        help='make dim 0 of every input the symbol "batch"')
    parser.add_argument("--external-data", action="store_true",
                        help="store initializers in MODEL.onnx.data")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", type=json.loads, default=None, metavar="JSON",
                        help='override model config fields, e.g. \'{"n_layer": 4}\'')
    parser.add_argument("--verbose", action="store_true",
                        help="print the op types and export warnings")
    args = parser.parse_args(argv)

    names = reference.DEFAULT_MODELS if args.model == "all" else [args.model]
    for name in names:
        model, inputs, input_names = reference.build(
            name, batch=args.batch, seq=args.seq, seed=args.seed, config=args.config)
        dynamic = {n: {0: "batch"} for n in input_names} if args.dynamic_batch else None
        path = os.path.join(args.out, f"{name}.onnx")
        info = export_for_carve(model, inputs, path, input_names=input_names,
                                opset=args.opset, dynamic_axes=dynamic,
                                external_data=args.external_data)
        expected_path = os.path.join(args.out, f"{name}.expected.json")
        with open(expected_path, "w") as f:
            json.dump({k: info[k] for k in
                       ("trainable_params", "trainable_elements", "inputs", "opset")},
                      f, indent=2)
            f.write("\n")
        print(path)
        if args.external_data:
            print(path + ".data")
        print(expected_path)
        if args.verbose:
            print("  ops:", " ".join(info["op_types"]))
            for w in info["warnings"]:
                print("  warning:", w)
        elif info["warnings"]:
            print(f"{path}: {len(info['warnings'])} export warnings (--verbose lists them)",
                  file=sys.stderr)


if __name__ == "__main__":
    main()
