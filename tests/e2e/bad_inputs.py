"""Feeds `carve import` broken and unsupported inputs; each must fail with one clear error line."""

# Every case must end with exit status 1, nothing on stdout, and exactly one
# stderr line `carve: error: <path>: <cause>` that names the input and a
# case-specific detail; no crash, hang or backtrace. Each run also points `-o`
# at a pre-existing file, which must be left untouched with no temporary files
# beside it. Positive controls show that the harness accepts a good import.

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys

import numpy as np
from onnx import TensorProto, helper, numpy_helper

TIMEOUT_S = 10
EXPORT_TIMEOUT_S = 300
FORBIDDEN = ("Segmentation", "Assertion", "terminate", "Stack dump", "LLVM ERROR",
             "PLEASE submit")
SENTINEL = b"// pre-existing output: an import that fails must not touch this file\n"


class Case:
    """One invocation of `carve import` and what its outcome must be."""

    def __init__(self, name, model, expect=(), flags=(), forbid=(), exit_code=1,
                 path_in_error=None, setup_error=None):
        self.name = name
        self.model = model            # path given to carve (also expected in the error)
        self.expect = list(expect)    # substrings the error line must contain
        self.flags = list(flags)
        self.forbid = list(forbid)    # substrings the error line must not contain
        self.exit_code = exit_code    # 0 marks a positive control
        self.path_in_error = model if path_in_error is None else path_in_error
        self.setup_error = setup_error  # why the input could not be generated


# --- Building inputs ---------------------------------------------------------

def write_model(path, nodes, inputs, outputs, initializers=(), opset=17, extra_opsets=()):
    """Serializes a hand-built graph without running the ONNX checker, so
    deliberately broken graphs survive."""
    graph = helper.make_graph(nodes, "bad_input", inputs, outputs, list(initializers))
    opsets = [helper.make_opsetid("", opset)] + list(extra_opsets)
    model = helper.make_model(graph, opset_imports=opsets, producer_name="bad_inputs")
    with open(path, "wb") as f:
        f.write(model.SerializeToString())
    return path


def f32(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def export(script, name, out_dir, extra):
    """Exports a reference model; returns (path, None) or (None, why)."""
    cmd = [sys.executable, script, name, "--out", out_dir] + extra
    try:
        p = subprocess.run(cmd, capture_output=True, timeout=EXPORT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, "export timed out: " + " ".join(cmd)
    path = os.path.join(out_dir, name + ".onnx")
    if p.returncode != 0 or not os.path.isfile(path):
        tail = p.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["?"]
        return None, "export failed (%s): %s" % (" ".join(extra) or "plain", tail[0])
    return path, None


def build_cases(root, export_script):
    """Writes every input under `root` and returns the cases."""
    cases = []
    d = lambda *p: os.path.join(root, *p)

    exported = {}
    for key, extra in (("plain", []), ("dynamic", ["--dynamic-batch"]),
                       ("external", ["--external-data"])):
        exported[key] = export(export_script, "mlp", d("export", key), extra)
    plain, plain_err = exported["plain"]
    dynamic, dynamic_err = exported["dynamic"]
    external, external_err = exported["external"]

    # Positive controls: the same harness accepts good imports.
    cases.append(Case("control_mlp", plain, exit_code=0, setup_error=plain_err))
    cases.append(Case("control_set_dim", dynamic, flags=["--set-dim", "batch=4"],
                      exit_code=0, setup_error=dynamic_err))
    cases.append(Case("control_external_data", external, exit_code=0,
                      setup_error=external_err))

    # Files that are not models at all.
    cases.append(Case("missing_file", d("does_not_exist.onnx"),
                      expect=["cannot read", "No such file"]))
    os.makedirs(d("a_directory.onnx"))
    cases.append(Case("directory", d("a_directory.onnx"), expect=["directory"]))
    open(d("empty.onnx"), "wb").close()
    cases.append(Case("empty_file", d("empty.onnx"), expect=["empty"]))
    if plain:
        data = open(plain, "rb").read()
        with open(d("truncated.onnx"), "wb") as f:
            f.write(data[: len(data) // 2])
    cases.append(Case("truncated_model", d("truncated.onnx"),
                      expect=["not an ONNX model", "truncated or corrupt"],
                      setup_error=plain_err))
    for seed in range(5):
        path = d("random_%d.onnx" % seed)
        with open(path, "wb") as f:
            f.write(random.Random(seed).randbytes(1024))
        cases.append(Case("random_bytes_seed%d" % seed, path, expect=["not an ONNX model"]))
    with open(d("tensor_proto.onnx"), "wb") as f:
        f.write(numpy_helper.from_array(np.zeros((2, 3), np.float32), "w")
                .SerializeToString())
    cases.append(Case("tensor_proto", d("tensor_proto.onnx"), expect=["not an ONNX model"]))
    # A NodeProto's string fields line up with ModelProto's: it parses, but has
    # no ir_version.
    with open(d("node_proto.onnx"), "wb") as f:
        f.write(helper.make_node("Relu", ["x"], ["y"], name="n").SerializeToString())
    cases.append(Case("node_proto", d("node_proto.onnx"),
                      expect=["not an ONNX model", "ir_version"]))

    # Well-formed models that carve does not support or that are inconsistent.
    x4 = [f32("x", [4])]
    y4 = [f32("y", [4])]
    write_model(d("unsupported_op.onnx"),
                [helper.make_node("Softsign", ["x"], ["y"], name="my_node")], x4,
                [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    cases.append(Case("unsupported_op", d("unsupported_op.onnx"),
                      expect=["Softsign", "'my_node'", "opset 17", "docs/onnx-ops.md"]))
    write_model(d("unsupported_op_unnamed.onnx"),
                [helper.make_node("Relu", ["x"], ["r"], name="relu"),
                 helper.make_node("Softsign", ["r"], ["v"])],
                x4, [f32("v", [4])])
    # Exporters may leave node names empty: the error must still point at the node.
    cases.append(Case("unsupported_op_unnamed", d("unsupported_op_unnamed.onnx"),
                      expect=["Softsign", "docs/onnx-ops.md"], forbid=["node ''"]))
    write_model(d("unknown_domain.onnx"),
                [helper.make_node("FusedThing", ["x"], ["y"], name="custom_node",
                                  domain="com.example")],
                x4, y4, extra_opsets=[helper.make_opsetid("com.example", 1)])
    cases.append(Case("unknown_domain", d("unknown_domain.onnx"),
                      expect=["com.example", "custom_node"]))
    write_model(d("missing_initializer.onnx"),
                [helper.make_node("Add", ["x", "w_missing"], ["y"], name="add_w")], x4, y4)
    cases.append(Case("missing_initializer", d("missing_initializer.onnx"),
                      expect=["w_missing", "add_w", "not produced"]))
    write_model(d("out_of_order.onnx"),
                [helper.make_node("Relu", ["h"], ["y"], name="second"),
                 helper.make_node("Relu", ["x"], ["h"], name="first")], x4, y4)
    cases.append(Case("nodes_out_of_order", d("out_of_order.onnx"),
                      expect=["'h'", "second", "topological"]))
    write_model(d("add_shapes.onnx"),
                [helper.make_node("Add", ["a", "b"], ["y"], name="bad_add")],
                [f32("a", [2, 3]), f32("b", [4, 5])], [f32("y", None)])
    cases.append(Case("add_inconsistent_shapes", d("add_shapes.onnx"),
                      expect=["bad_add", "Add", "[2, 3]", "[4, 5]", "broadcast"]))
    # Operands of two element types (ONNX gives Add one type T): on the
    # graph, and between constants the importer folds on the host (where
    # the sum once came out as a float stored in int64).
    wi = numpy_helper.from_array(np.ones(4, np.int64), "wi")
    write_model(d("add_mixed_types.onnx"),
                [helper.make_node("Add", ["x", "wi"], ["y"], name="mixed_add")], x4, y4, [wi])
    cases.append(Case("add_mixed_element_types", d("add_mixed_types.onnx"),
                      expect=["mixed_add", "Add", "element types differ", "f32", "i64"]))
    write_model(d("add_mixed_constants.onnx"),
                [helper.make_node("Constant", [], ["ci"], name="const_i", value=wi),
                 helper.make_node("Constant", [], ["cf"], name="const_f",
                                  value=numpy_helper.from_array(np.full(4, 0.5, np.float32))),
                 helper.make_node("Add", ["ci", "cf"], ["c"], name="mixed_constants"),
                 helper.make_node("Cast", ["c"], ["cc"], name="to_float", to=TensorProto.FLOAT),
                 helper.make_node("Add", ["x", "cc"], ["y"], name="add_c")], x4, y4)
    cases.append(Case("add_mixed_constant_types", d("add_mixed_constants.onnx"),
                      expect=["mixed_constants", "Add", "element types differ", "INT64",
                              "FLOAT"]))
    write_model(d("matmul_shapes.onnx"),
                [helper.make_node("MatMul", ["a", "b"], ["y"], name="bad_matmul")],
                [f32("a", [2, 3]), f32("b", [4, 5])], [f32("y", None)])
    cases.append(Case("matmul_inconsistent_shapes", d("matmul_shapes.onnx"),
                      expect=["bad_matmul", "MatMul", "[2, 3]", "[4, 5]"]))
    write_model(d("no_outputs.onnx"),
                [helper.make_node("Relu", ["x"], ["y"], name="r")], x4, [])
    cases.append(Case("graph_without_outputs", d("no_outputs.onnx"), expect=["no outputs"]))
    write_model(d("opset11.onnx"),
                [helper.make_node("Relu", ["x"], ["y"], name="r")], x4, y4, opset=11)
    cases.append(Case("opset_11", d("opset11.onnx"),
                      expect=["opset 11", "not supported", "13"]))
    bad_raw = TensorProto()
    bad_raw.name, bad_raw.data_type = "w", TensorProto.FLOAT
    bad_raw.dims.extend([2, 3])
    bad_raw.raw_data = bytes(20)
    write_model(d("raw_data_length.onnx"),
                [helper.make_node("Add", ["x", "w"], ["y"], name="add_w")],
                [f32("x", [2, 3])], [f32("y", [2, 3])], [bad_raw])
    cases.append(Case("initializer_raw_data_length", d("raw_data_length.onnx"),
                      expect=["'w'", "20 bytes", "[2, 3]", "24"]))
    dup = numpy_helper.from_array(np.ones(4, np.float32), "w")
    write_model(d("duplicate_initializer.onnx"),
                [helper.make_node("Add", ["x", "w"], ["y"], name="add_w")], x4, y4, [dup, dup])
    cases.append(Case("duplicate_initializer", d("duplicate_initializer.onnx"),
                      expect=["'w'", "twice"]))
    write_model(d("string_input.onnx"),
                [helper.make_node("Identity", ["s"], ["y"], name="id")],
                [helper.make_tensor_value_info("s", TensorProto.STRING, [4])],
                [helper.make_tensor_value_info("y", TensorProto.STRING, [4])])
    cases.append(Case("unsupported_element_type", d("string_input.onnx"),
                      expect=["'s'", "STRING", "not support"]))

    # Malformed nodes: each must be rejected with the node named, never crash.
    write_model(d("too_few_inputs.onnx"),
                [helper.make_node("Add", ["x"], ["y"], name="add_one")], x4, y4)
    cases.append(Case("node_too_few_inputs", d("too_few_inputs.onnx"),
                      expect=["add_one", "Add", "input"]))
    write_model(d("split_no_outputs.onnx"),
                [helper.make_node("Split", ["x"], [], name="split_none"),
                 helper.make_node("Relu", ["x"], ["y"], name="r")], x4, y4)
    cases.append(Case("split_without_outputs", d("split_no_outputs.onnx"),
                      expect=["split_none", "Split"]))
    for case, node_name, dims in (("constant_of_shape_negative", "cos_neg", [-3]),
                                  ("constant_of_shape_overflow", "cos_big", [2**32, 2**32])):
        write_model(d(case + ".onnx"),
                    [helper.make_node("ConstantOfShape", ["s"], ["y"], name=node_name)],
                    [], [f32("y", None)], [numpy_helper.from_array(np.array(dims, np.int64), "s")])
        cases.append(Case(case, d(case + ".onnx"),
                          expect=[node_name, "ConstantOfShape", str(dims[0])]))
    write_model(d("range_too_large.onnx"),
                [helper.make_node("Range", ["start", "limit", "delta"], ["y"], name="range_big")],
                [], [helper.make_tensor_value_info("y", TensorProto.INT64, None)],
                [numpy_helper.from_array(np.array(v, np.int64), n)
                 for n, v in (("start", 0), ("limit", 2**40), ("delta", 1))])
    cases.append(Case("range_too_large", d("range_too_large.onnx"),
                      expect=["range_big", "Range"]))

    # Symbolic dimensions and command-line flags.
    cases.append(Case("symbolic_dim_unbound", dynamic, expect=["'batch'", "--set-dim batch="],
                      setup_error=dynamic_err))
    cases.append(Case("set_dim_unknown_name", dynamic,
                      flags=["--set-dim", "batch=4", "--set-dim", "nosuchdim=3"],
                      expect=["nosuchdim", "no symbolic dimension", "batch"],
                      setup_error=dynamic_err))
    cases.append(Case("set_dim_malformed", dynamic, flags=["--set-dim", "batch=abc"],
                      expect=["--set-dim", "batch=abc"], setup_error=dynamic_err))
    cases.append(Case("set_dim_zero", dynamic, flags=["--set-dim", "batch=0"],
                      expect=["--set-dim", "batch=0", "positive"], setup_error=dynamic_err))
    cases.append(Case("frozen_matches_nothing", plain, flags=["--frozen", "no_such_param*"],
                      expect=["--frozen", "no_such_param*", "matches no parameter"],
                      setup_error=plain_err))
    cases.append(Case("frozen_invalid_glob", plain, flags=["--frozen", "fc1.[weight"],
                      expect=["--frozen", "fc1.[weight", "not a valid glob"],
                      setup_error=plain_err))

    # External data: the .data file deleted, cut short, or outside the folder.
    for case, mutate, expect in (
            ("external_data_missing", "delete", ["mlp.onnx.data", "does not exist"]),
            ("external_data_truncated", "truncate", ["mlp.onnx.data", "too short"])):
        model = d(case, "mlp.onnx")
        if external:
            shutil.copytree(os.path.dirname(external), d(case))
            data_path = d(case, "mlp.onnx.data")
            if mutate == "delete":
                os.remove(data_path)
            else:
                data = open(data_path, "rb").read()
                with open(data_path, "wb") as f:
                    f.write(data[: len(data) // 2])
        cases.append(Case(case, model, expect=expect, setup_error=external_err))
    # A parameter [4] of FLOAT (16 bytes) stored in a hand-written external file.
    with open(d("outside.data"), "wb") as f:
        f.write(bytes(16))
    for case, location, length, expect in (
            ("external_data_outside_folder", "../outside.data", "16",
             ["'w'", "../outside.data", "relative path inside"]),
            ("external_data_length_mismatch", "w.data", "12", ["'w'", "length 12", "16"])):
        tensor = numpy_helper.from_array(np.ones(4, np.float32), "w")
        tensor.ClearField("raw_data")
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", location), ("offset", "0"), ("length", length)):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        os.makedirs(d(case))
        with open(d(case, "w.data"), "wb") as f:
            f.write(bytes(16))
        write_model(d(case, "model.onnx"),
                    [helper.make_node("Add", ["x", "w"], ["y"], name="add_w")], x4, y4, [tensor])
        cases.append(Case(case, d(case, "model.onnx"), expect=expect))
    return cases


# --- Running and checking ----------------------------------------------------

def describe_exit(code):
    if code is not None and code < 0:
        try:
            return "%d (%s)" % (code, signal.Signals(-code).name)
        except ValueError:
            pass
    return str(code)


def check(carve, case, out_dir):
    """Runs one case; returns None on success, else (reason, exit status, stderr)."""
    if case.setup_error:
        return case.setup_error, None, ""
    os.makedirs(out_dir)
    out_path = os.path.join(out_dir, "existing.mlir")
    with open(out_path, "wb") as f:
        f.write(SENTINEL)
    cmd = [carve, "import", case.model] + case.flags + ["-o", out_path]
    try:
        p = subprocess.run(cmd, capture_output=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return "hang (no exit within %d s)" % TIMEOUT_S, "timeout", ""
    stdout = p.stdout.decode(errors="replace")
    stderr = p.stderr.decode(errors="replace")
    exit_desc = describe_exit(p.returncode)
    reason = lambda why: (why, exit_desc, stderr)

    for word in FORBIDDEN:
        if word in stdout or word in stderr:
            return reason("output contains %r" % word)
    if p.returncode != case.exit_code:
        return reason("expected exit %d" % case.exit_code)
    if stdout:
        return reason("unexpected stdout %r" % stdout[:200])
    leftovers = sorted(set(os.listdir(out_dir)) - {"existing.mlir"})
    if leftovers:
        return reason("files left beside the output: %s" % ", ".join(leftovers))
    written = open(out_path, "rb").read()

    if case.exit_code == 0:
        if stderr:
            return reason("a successful import printed to stderr")
        if written == SENTINEL or b"func.func @forward" not in written:
            return reason("-o does not hold the imported IR")
        return None

    if written != SENTINEL:
        return reason("a failed import modified the pre-existing -o file")
    if not stderr.endswith("\n") or stderr.count("\n") != 1:
        return reason("stderr is not exactly one line")
    line = stderr[:-1]
    if not line.startswith("carve: error: "):
        return reason("stderr does not start with 'carve: error: '")
    if case.path_in_error not in line:
        return reason("the error does not name the input %r" % case.path_in_error)
    for text in case.expect:
        if text not in line:
            return reason("the error does not mention %r" % text)
    for text in case.forbid:
        if text in line:
            return reason("the error contains %r" % text)
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--carve", required=True, help="path to the carve binary")
    parser.add_argument("--export", required=True, help="path to models/export.py")
    parser.add_argument("--workdir", required=True, help="scratch folder (recreated)")
    args = parser.parse_args()

    carve = os.path.abspath(args.carve)
    root = os.path.join(os.path.abspath(args.workdir), "bad_inputs")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    cases = build_cases(root, os.path.abspath(args.export))

    names = [c.name for c in cases]
    assert len(names) == len(set(names)), "duplicate case names"
    passed = failed = 0
    for case in cases:
        result = check(carve, case, os.path.join(root, "out", case.name))
        if result is None:
            passed += 1
            print("PASS %s" % case.name)
        else:
            failed += 1
            why, exit_desc, stderr = result
            print("FAIL %s: %s (exit=%s, stderr=%r)" % (case.name, why, exit_desc,
                                                        stderr[:400]))
        sys.stdout.flush()
    print("%d passed, %d failed" % (passed, failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
