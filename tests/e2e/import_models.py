#!/usr/bin/env python3
"""End-to-end import checks of the reference models: every model at every exported
opset imports, its trainable parameters (names, count, elements) equal PyTorch's,
the high-level ops are recognized, and the carve-opt round trip is byte-exact."""
import argparse
import json
import os
import re
import sys

import onnx
import harness  # noqa: E402

MODELS = ["mlp", "gpt", "llama", "bert", "resnet18"]
# Ops carve-raise must produce for each model: (pattern, count).
RAISED = {
    "mlp": [(r"carve\.cross_entropy", 1), (r"carve\.matmul", 3)],
    "gpt": [(r"carve\.attention .*causal = true", 2), (r"carve\.layer_norm .*scale .*bias", 5),
            (r"carve\.gelu %\S+ :", 2), (r"carve\.cross_entropy", 1)],
    "gpt_tanh": [(r'carve\.gelu %\S+ \{approximate = "tanh"\}', 2)],
    "gpt_untied": [(r"carve\.attention .*causal = true", 2)],
    "llama": [(r"carve\.attention .*causal = true", 2), (r"carve\.rms_norm .*scale", 5),
              (r"carve\.silu", 2), (r"carve\.cross_entropy", 1)],
    "bert": [(r"carve\.attention .* mask ", 2), (r"carve\.layer_norm .*scale .*bias", 6),
             (r"carve\.gelu", 3), (r"carve\.cross_entropy", 1)],
    "resnet18": [(r"carve\.conv2d", 20), (r"carve\.batch_norm .*training = true", 20),
                 (r"carve\.max_pool2d", 1), (r"carve\.cross_entropy", 1)],
}
# Leftovers of the exporter's decompositions that must not survive raising.
FORBIDDEN = {
    "gpt": ["carve.softmax", "carve.erf", "carve.sqrt", "carve.where", "carve.reduce_mean"],
    "llama": ["carve.softmax", "carve.sigmoid", "carve.sqrt", "carve.where", "carve.reduce_mean"],
    "bert": ["carve.softmax", "carve.erf", "carve.sqrt", "carve.reduce_mean"],
}
ARG_RE = re.compile(r"%arg\d+: tensor<((?:\d+x)*)([a-z]+\d*)> \{([^}]*)\}")

results = []


def check(name, ok, why=""):
    results.append(ok)
    print(("PASS " if ok else "FAIL ") + name + ("" if ok else ": " + why), flush=True)
    return ok


def run(cmd):
    return harness.run(cmd, timeout=300)


def signature(ir):
    """(trainable names, trainable elements, frozen names, inputs) from @forward's args."""
    trainable, frozen, inputs, elems = [], [], {}, 0
    header = ir[ir.index("func.func @forward"):ir.index("{\n", ir.index("func.func @forward"))]
    for dims, elt, attrs in ARG_RE.findall(header):
        shape = [int(d) for d in dims.rstrip("x").split("x")] if dims else []
        n = 1
        for d in shape:
            n *= d
        m = re.search(r'carve\.(param|input|buffer) = "([^"]+)"', attrs)
        kind, name = m.group(1), m.group(2)
        if kind == "param" and "carve.trainable" in attrs:
            trainable.append(name)
            elems += n
        elif kind == "param":
            frozen.append(name)
        elif kind == "input":
            inputs[name] = shape
    return trainable, elems, frozen, inputs


def import_and_check(bindir, path, workdir, tag, model, extra=()):
    out = os.path.join(workdir, tag + ".mlir")
    r = run([os.path.join(bindir, "carve"), "import", path, "-o", out, *extra])
    if not check(f"{tag}: import", r.returncode == 0 and not r.stderr, r.stderr.strip()):
        return None
    ir = open(out).read()
    rt = os.path.join(workdir, tag + ".roundtrip.mlir")
    r = run([os.path.join(bindir, "carve-opt"), out, "-o", rt])
    check(f"{tag}: carve-opt round trip is exact",
          r.returncode == 0 and open(rt).read() == ir, r.stderr.strip() or "output differs")
    return ir


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--bin", required=True)
    ap.add_argument("--models", required=True)
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)

    for opset in range(13, 18):
        folder = os.path.join(args.models, f"opset{opset}")
        names = MODELS + (["gpt_tanh", "gpt_untied"] if opset == 17 else [])
        for model in names:
            path = os.path.join(folder, model + ".onnx")
            tag = f"{model}@{opset}"
            ir = import_and_check(args.bin, path, args.workdir, tag, model)
            if ir is None:
                continue
            expected = json.load(open(os.path.join(folder, model + ".expected.json")))
            meta = {p.key: p.value for p in onnx.load(path, load_external_data=False).metadata_props}
            torch_names = json.loads(meta["carve.parameters"])
            trainable, elems, _, inputs = signature(ir)
            check(f"{tag}: trainable parameter names equal named_parameters()",
                  trainable == torch_names, f"{trainable} vs {torch_names}")
            check(f"{tag}: {expected['trainable_params']} trainable parameters",
                  len(trainable) == expected["trainable_params"], str(len(trainable)))
            check(f"{tag}: {expected['trainable_elements']} trainable elements",
                  elems == expected["trainable_elements"], str(elems))
            check(f"{tag}: input shapes", inputs == expected["inputs"], f"{inputs}")
            for pattern, count in RAISED.get(model, []):
                found = len(re.findall(pattern, ir))
                check(f"{tag}: {count} x /{pattern}/", found == count, f"found {found}")
            for op in FORBIDDEN.get(model, []):
                check(f"{tag}: no {op} left", op + " " not in ir, "found " + op)

    # Symbolic batch bound on the command line.
    for model in ["gpt", "llama"]:
        path = os.path.join(args.models, "dynamic", model + ".onnx")
        ir = import_and_check(args.bin, path, args.workdir, f"{model}-dynamic", model,
                              ["--set-dim", "batch=3"])
        if ir is not None:
            _, _, _, inputs = signature(ir)
            check(f"{model}-dynamic: batch bound to 3",
                  all(s[0] == 3 for s in inputs.values()), str(inputs))
            check(f"{model}-dynamic: still raises attention",
                  len(re.findall(r"carve\.attention .*causal = true", ir)) == 2)

    # Initializers in an external data file.
    for model in ["mlp", "gpt"]:
        path = os.path.join(args.models, "external", model + ".onnx")
        check(f"{model}-external: data file exists", os.path.exists(path + ".data"))
        ir = import_and_check(args.bin, path, args.workdir, f"{model}-external", model)
        if ir is not None:
            expected = json.load(open(os.path.join(args.models, "external",
                                                   model + ".expected.json")))
            trainable, elems, _, _ = signature(ir)
            check(f"{model}-external: parameters", len(trainable) == expected["trainable_params"]
                  and elems == expected["trainable_elements"], f"{len(trainable)} / {elems}")

    # --frozen removes parameters from training but keeps them as named arguments.
    path = os.path.join(args.models, "opset17", "gpt.onnx")
    ir = import_and_check(args.bin, path, args.workdir, "gpt-frozen", "gpt",
                          ["--frozen", "wte.*", "--frozen", "h.0.*"])
    if ir is not None:
        trainable, elems, frozen, _ = signature(ir)
        want = ["wte.weight"] + [n for n in json.loads(
            {p.key: p.value for p in onnx.load(path).metadata_props}["carve.parameters"])
            if n.startswith("h.0.")]
        check("gpt-frozen: frozen set", sorted(frozen) == sorted(want), f"{frozen}")
        check("gpt-frozen: the rest stays trainable", len(trainable) + len(frozen) == 28,
              f"{len(trainable)} + {len(frozen)}")

    # --no-raise keeps the exporter's chains (and they still verify and round-trip).
    path = os.path.join(args.models, "opset13", "gpt.onnx")
    ir = import_and_check(args.bin, path, args.workdir, "gpt-noraise", "gpt", ["--no-raise"])
    if ir is not None:
        check("gpt-noraise: softmax and erf kept", "carve.softmax" in ir and "carve.erf" in ir)
        check("gpt-noraise: no attention", "carve.attention" not in ir)

    # The summary counts the same parameters.
    r = run([os.path.join(args.bin, "carve"), "import", path, "--summary"])
    check("gpt summary", r.returncode == 0 and "parameters: 28 trainable, 28032 elements"
          in r.stdout, r.stdout[:200] + r.stderr)

    passed = sum(results)
    print(f"{passed} passed, {len(results) - passed} failed")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
