#!/usr/bin/env python3
"""Runs one carve libFuzzer target the way ctest does (tests/fuzz/CMakeLists.txt):

1. replays every committed reproducer in tests/fuzz/regressions/TARGET/ (each
   must now be handled without a crash; where FILE.expected exists, each of its
   lines must appear in the printed error), and the deeply nested inputs
   written at test time (too large to commit);
2. builds the seed corpus (committed seeds, plus ONNX models exported by the
   `models` fixture and small generated ones for the importer, and generated
   files for the safetensors reader);
3. fuzzes for --seconds from those seeds and fails on any crash, hang, leak or
   sanitizer report, naming the saved reproducer.

docs/fuzzing.md has the long run and how to turn a crash into a regression."""
import argparse
import os
import re
import shutil
import struct
import subprocess
import sys
import json

ONNX_SEED_LIMIT = 256 * 1024  # bytes; larger models slow every mutation down


DEEP = 200000  # nesting levels: enough to overflow the stack of a recursive reader


def deep_inputs(target, folder, source):
    """Reproducers written at test time (binary inputs are never committed):
    the importer's ONNX reproducers, and JSON nested
    DEEP levels, which overflowed the stack of nlohmann::json's dump() and
    copies and of llvm::json's parser before the readers refused nesting
    beyond 64 levels. Returns {path: expected error text}."""
    nest = "[" * DEEP + "]" * DEEP
    made = {}

    def put(name, data, expected):
        path = os.path.join(folder, name)
        with open(path, "wb") as f:
            f.write(data if isinstance(data, bytes) else data.encode())
        made[path] = expected

    if target == "plan":
        put("deep-nesting.json", '{"dp": %s}' % nest, "plan.json: nested deeper than 64 levels")
    elif target == "rules":
        put("deep-nesting.json", '{"ops": %s}' % nest, "rules.json: nested deeper than 64 levels")
    elif target == "planner":
        put("deep-nesting.json", '{"memory_headroom": %s}' % nest,
            "constraints.json: nested deeper than 64 levels")
    elif target == "safetensors":
        def nested(levels):
            header = ('{"w": {"dtype": "F32", "shape": [%s], "data_offsets": [0, 0]}}' %
                      ("[" * levels + "]" * levels)).encode()
            header += b" " * (-len(header) % 8)
            return struct.pack("<Q", len(header)) + header
        put("deep-nesting.safetensors", nested(DEEP), "header nests deeper than 64 levels")
        # Just past the limit (the smallest input the nesting check refuses).
        put("nested-70.safetensors", nested(70), "header nests deeper than 64 levels")
    elif target == "checkpoint":
        seed = os.path.join(source, "seeds", "checkpoint", "manifest.json")
        manifest = json.load(open(seed, encoding="utf-8"))
        manifest["model"] = "NEST"
        put("deep-nesting.json", json.dumps(manifest).replace('"NEST"', nest),
            "manifest.json: nested deeper than 64 levels")
    elif target == "importer":
        import onnx
        from onnx import TensorProto, helper
        g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
        m = helper.make_model(g, opset_imports=[helper.make_operatorsetid("", 17)])
        m.ir_version = 8
        prop = m.metadata_props.add()
        prop.key, prop.value = "carve.parameters", nest
        put("deep-nesting.onnx", m.SerializeToString(),
            "metadata 'carve.parameters' is not a JSON list of names")
        # The same model with metadata nested three levels deep.
        prop.value = "[[[]]]"
        put("metadata-nested.onnx", m.SerializeToString(),
            "metadata 'carve.parameters' is not a JSON list of names")
        # A Constant node without outputs: its error label read output(0)
        # past the end of the node's output list.
        one = helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0])
        g = helper.make_graph([helper.make_node("Constant", [], [], name="c", value=one),
                               helper.make_node("Relu", ["x"], ["y"], name="relu")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
        m = helper.make_model(g, opset_imports=[helper.make_operatorsetid("", 17)])
        m.ir_version = 8
        put("constant-without-output.onnx", m.SerializeToString(), "")
        # Reshape to [2^41 + 4, 5 * 2^40]: the product of the known target
        # dimensions overflowed int64.
        shape = helper.make_tensor("shape", TensorProto.INT64, [2],
                                   [2199023255556, 5497558138880])
        g = helper.make_graph([helper.make_node("Reshape", ["x", "shape"], ["r"]),
                               helper.make_node("Softmax", ["r"], ["y"], axis=-1)], "reshape",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
                              [shape])
        m = helper.make_model(g, opset_imports=[helper.make_operatorsetid("", 17)])
        m.ir_version = 8
        put("reshape-overflow.onnx", m.SerializeToString(),
            "node 'Reshape_0' (Reshape): shape [2199023255556, 5497558138880] has more elements "
            "than fit in 64 bits")
        # Where with a float X and an int64 Y, both constant: folding it read
        # Y's (empty) float storage (UBSan: reference binding to null).
        cond = helper.make_tensor("cond", TensorProto.BOOL, [2], [1, 0])
        xa = helper.make_tensor("xa", TensorProto.FLOAT, [2], [1.0, 2.0])
        yb = helper.make_tensor("yb", TensorProto.INT64, [2], [3, 4])
        g = helper.make_graph([helper.make_node("Constant", [], ["c"], value=cond),
                               helper.make_node("Constant", [], ["a"], value=xa),
                               helper.make_node("Constant", [], ["b"], value=yb),
                               helper.make_node("Where", ["c", "a", "b"], ["w"]),
                               helper.make_node("Add", ["x", "w"], ["y"])], "where",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
        m = helper.make_model(g, opset_imports=[helper.make_operatorsetid("", 17)])
        m.ir_version = 8
        put("where-mixed-types.onnx", m.SerializeToString(),
            "Where's X and Y have different element types")
        # Concat of a float and an int64 constant: folding it read the int64
        # part's (empty) integer storage as the output's (UBSan: reference
        # binding to null, in hostConcat), found by the fuzzer on a mutated GPT.
        ia = helper.make_tensor("ia", TensorProto.INT64, [2], [3, 4])
        g = helper.make_graph([helper.make_node("Constant", [], ["a"], value=xa),
                               helper.make_node("Constant", [], ["b"], value=ia),
                               helper.make_node("Concat", ["b", "a"], ["c"], axis=0),
                               helper.make_node("Add", ["x", "c"], ["y"])], "concat",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
        m = helper.make_model(g, opset_imports=[helper.make_operatorsetid("", 17)])
        m.ir_version = 8
        put("concat-mixed-types.onnx", m.SerializeToString(),
            "Concat's inputs have different element types (INT64 and FLOAT)")
        # An initializer stored externally at offset 2^63 - 8: the bound check
        # computed offset + bytes in int64 and overflowed (UBSan).
        with open(os.path.join(folder, "w.bin"), "wb") as f:
            f.write(b"\0" * 64)
        w = helper.make_tensor("w", TensorProto.FLOAT, [2], [0.0, 0.0])
        w.ClearField("float_data")
        w.data_location = TensorProto.EXTERNAL
        for key, value in (("location", "w.bin"), ("offset", str(2**63 - 8)), ("length", "8")):
            e = w.external_data.add()
            e.key, e.value = key, value
        g = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "external",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])], [w])
        m = helper.make_model(g, opset_imports=[helper.make_operatorsetid("", 17)])
        m.ir_version = 8
        put("external-offset-overflow.onnx", m.SerializeToString(),
            "external data file '%s' is too short (64 bytes, need 8 from offset %d)"
            % (os.path.join(folder, "w.bin"), 2**63 - 8))
    return made


def replay(args, env):
    folder = os.path.join(args.source, "regressions", args.target)
    files = sorted(os.path.join(folder, f) for f in os.listdir(folder)
                   if not f.endswith((".expected", ".md"))) if os.path.isdir(folder) else []
    generated = os.path.join(args.workdir, "generated")
    shutil.rmtree(generated, ignore_errors=True)
    os.makedirs(generated)
    made = deep_inputs(args.target, generated, args.source)
    # The importer resolves external data against the generated folder here.
    env = dict(env, CARVE_FUZZ_ONNX_DATA=generated)
    files += sorted(made)
    failures = 0
    for path in files:
        name = os.path.relpath(path, folder) if path.startswith(folder) else \
            "generated/" + os.path.basename(path)
        r = subprocess.run([args.fuzzer, path], env=env, capture_output=True, text=True,
                           errors="replace", timeout=120)
        out = r.stdout + r.stderr
        problem = None
        if r.returncode != 0:
            problem = f"exit status {r.returncode}"
        else:
            exp = path + ".expected"
            lines = [made[path]] if path in made else \
                open(exp, encoding="utf-8").read().splitlines() if os.path.exists(exp) else []
            for line in lines:
                if line.strip() and line not in out:
                    problem = f"expected error text not printed: {line!r}"
                    break
        if problem:
            failures += 1
            print(f"FAIL regression {args.target}/{name}: {problem}\n{out[-4000:]}")
        else:
            print(f"ok   regression {args.target}/{name}")
    print(f"{len(files) - failures}/{len(files)} regression inputs pass")
    return failures == 0


def tiny_onnx_models(out):
    """A few small graphs built with onnx.helper: ops and shapes the exported
    models do not reach, in files of a few hundred bytes."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    def save(name, nodes, inputs, outputs, inits, opset=17):
        g = helper.make_graph(nodes, name, inputs, outputs, inits)
        m = helper.make_model(g, opset_imports=[helper.make_operatorsetid("", opset)])
        m.ir_version = 8
        onnx.save(m, os.path.join(out, f"tiny-{name}.onnx"))

    f32 = TensorProto.FLOAT
    w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(4, 3) / 10, "w")
    b = numpy_helper.from_array(np.ones(3, dtype=np.float32), "b")
    x = helper.make_tensor_value_info("x", f32, [2, 4])
    save("mlp", [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
                 helper.make_node("Add", ["h", "b"], ["a"], name="add"),
                 helper.make_node("Relu", ["a"], ["y"], name="relu")],
         [x], [helper.make_tensor_value_info("y", f32, [2, 3])], [w, b])
    shape = numpy_helper.from_array(np.array([4, 2], dtype=np.int64), "shape")
    save("reshape", [helper.make_node("Reshape", ["x", "shape"], ["r"]),
                     helper.make_node("Transpose", ["r"], ["t"], perm=[1, 0]),
                     helper.make_node("Softmax", ["t"], ["y"], axis=-1)],
         [x], [helper.make_tensor_value_info("y", f32, [2, 4])], [shape])
    table = numpy_helper.from_array(np.zeros((8, 4), dtype=np.float32), "table")
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", 3])
    save("gather", [helper.make_node("Gather", ["table", "ids"], ["e"]),
                    helper.make_node("ReduceMean", ["e"], ["y"], axes=[-1], keepdims=0)],
         [ids], [helper.make_tensor_value_info("y", f32, ["batch", 3])], [table], opset=13)
    g = numpy_helper.from_array(np.ones(4, dtype=np.float32), "g")
    save("layernorm", [helper.make_node("LayerNormalization", ["x", "g", "g"], ["n"], axis=-1),
                       helper.make_node("Concat", ["n", "x"], ["c"], axis=0),
                       helper.make_node("Tanh", ["c"], ["y"])],
         [x], [helper.make_tensor_value_info("y", f32, [4, 4])], [g])


def onnx_seeds(args, seeds, data):
    """Exported reference models (the `models` fixture) up to ONNX_SEED_LIMIT,
    their external data files in `data`, plus tiny generated models."""
    count = 0
    for root, _, names in sorted(os.walk(args.models)):
        for name in sorted(names):
            path = os.path.join(root, name)
            if name.endswith(".onnx.data"):
                shutil.copy(path, os.path.join(data, name))
            elif name.endswith(".onnx") and os.path.getsize(path) <= ONNX_SEED_LIMIT:
                sub = os.path.basename(root)
                shutil.copy(path, os.path.join(seeds, f"{sub}-{name}"))
                count += 1
    if count == 0:
        print(f"error: no exported ONNX models under {args.models} (the `models` fixture "
              "exports them: ctest -R 'export-models|fuzz-importer')")
        return False
    tiny_onnx_models(seeds)
    return True


def safetensors_file(tensors, metadata=None, pad=True):
    header, blob = {}, b""
    for name, dtype, shape, payload in tensors:
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(blob), len(blob) + len(payload)]}
        blob += payload
    if metadata is not None:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + blob


def safetensors_seeds(seeds):
    files = {
        "two-f32": safetensors_file(
            [("w", "F32", [2, 3], struct.pack("<6f", *range(6))),
             ("b", "F32", [3], struct.pack("<3f", 1, 2, 3))], {"format": "pt"}),
        "dtypes": safetensors_file(
            [("h", "BF16", [2], b"\x80\x3f\x00\x40"), ("i", "I64", [1], struct.pack("<q", 7)),
             ("m", "BOOL", [3], b"\x01\x00\x01"), ("d", "F16", [1, 1], b"\x00\x3c")]),
        "scalar-empty": safetensors_file(
            [("s", "F32", [], struct.pack("<f", 0.5)), ("e", "F32", [0, 4], b"")]),
        "no-tensors": safetensors_file([], {"step": "10"}, pad=False),
    }
    for name, blob in files.items():
        with open(os.path.join(seeds, f"{name}.safetensors"), "wb") as f:
            f.write(blob)


def fuzz(args, env):
    work = args.workdir
    seeds, corpus, data = (os.path.join(work, d) for d in ("seeds", "corpus", "onnx-data"))
    artifacts = os.path.join(work, "artifacts") + os.sep
    for d in (seeds, corpus, data, artifacts):
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
    committed = os.path.join(args.source, "seeds", args.target)
    if os.path.isdir(committed):
        for name in sorted(os.listdir(committed)):
            shutil.copy(os.path.join(committed, name), seeds)
    if args.target == "importer":
        if not onnx_seeds(args, seeds, data):
            return False
        env["CARVE_FUZZ_ONNX_DATA"] = data
    elif args.target == "safetensors":
        safetensors_seeds(seeds)
    nseeds = len(os.listdir(seeds))
    cmd = [args.fuzzer, f"-max_total_time={args.seconds}", "-timeout=20", "-rss_limit_mb=2048",
           "-print_final_stats=1", f"-artifact_prefix={artifacts}", corpus, seeds]
    print("running:", " ".join(cmd))
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, errors="replace",
                       timeout=args.seconds + 240)
    out = r.stdout + r.stderr
    runs = re.search(r"stat::number_of_executed_units:\s*(\d+)", out)
    cov = re.findall(r"\bcov: (\d+)", out)
    found = sorted(os.listdir(artifacts))
    if r.returncode != 0 or found or not runs:
        print(out[-12000:])
        print(f"FAIL: {args.target} fuzzer exit status {r.returncode}; reproducers: "
              f"{[os.path.join(artifacts, f) for f in found]}")
        print("replay one with: " + f"{args.fuzzer} FILE; docs/fuzzing.md says how to keep it "
              "as a regression input")
        return False
    if int(runs.group(1)) <= nseeds:
        print(out[-4000:])
        print(f"FAIL: the fuzzer ran only {runs.group(1)} inputs (seeds: {nseeds})")
        return False
    print(f"ok   {args.target}: {runs.group(1)} inputs in {args.seconds} s from {nseeds} seeds, "
          f"coverage {cov[-1] if cov else '?'} edges, corpus {len(os.listdir(corpus))} new "
          "files, no crash")
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fuzzer", required=True, help="the fuzz target binary")
    ap.add_argument("--target", required=True,
                    help="importer, plan, planner, rules, safetensors or checkpoint")
    ap.add_argument("--source", required=True, help="tests/fuzz in the source tree")
    ap.add_argument("--models", help="exported models (build/test-models), for the importer")
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--seconds", type=int, default=15)
    ap.add_argument("--replay-only", action="store_true")
    args = ap.parse_args()
    if not os.access(args.fuzzer, os.X_OK):
        print(f"error: fuzz target {args.fuzzer} is not built (ninja builds it; needs clang "
              "and libclang-rt-14-dev)")
        return 1
    env = dict(os.environ, CARVE_FUZZ_PRINT="1")
    # Leak checks on: a parser that leaks on bad input fails the test.
    env.setdefault("ASAN_OPTIONS", "detect_leaks=1")
    ok = replay(args, env)
    if not args.replay_only:
        env.pop("CARVE_FUZZ_PRINT")
        ok = fuzz(args, env) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
