#!/usr/bin/env python3
"""`carve import builtin:...` against `carve import` of the same model exported from PyTorch.

What must hold:

1. For GPT (tied, untied, tanh GELU, and its causal mask added to the scores
   as Hugging Face builds it: 0 and finfo(float32).min) and Llama (grouped-query and plain
   multi-head attention, its own norm_eps / rope_theta) at two or more small
   configurations each, exported with models/export.py (opset 17), the IR that
   `carve import builtin:FAMILY:...` prints is the IR that `carve import
   MODEL.onnx` prints, character for character, with one allowance: the
   values of Llama's rope tables (resource blobs) may differ by at most
   ROPE_ATOL, because PyTorch's vectorized float32 cos/sin and the
   generator's correctly rounded ones differ by an ulp at times. The blob
   names, sizes and every other byte must match. One case also passes
   --frozen to both.
2. Bad specs (an unknown key, a missing key, a non-integer, zero or negative
   sizes, hidden not divisible by heads, heads not divisible by kv_heads, an
   out-of-range dropout, an unknown family) exit 1 with one stderr line that
   names the spec and the key, and print nothing on stdout.
3. A GPT with 128 layers, hidden 25600, 160 heads, seq 2048 and vocab 51200
   builds with `--summary` in under BIG_LIMIT_S seconds, with the parameter
   count of the formula.
4. `dropout=P` adds `carve.dropout = P : f64` to the module, to every
   attention op and to the ops PyTorch would pass through hidden dropout (one
   embedding op, and each block's attention and MLP output projections), and
   changes nothing else.

5. Every op has the node name (the NameLoc of its location) that the import
   gives it: the pipeline splitter finds layers from these names and plan
   globs match them. Compared when `carve import --mlir-print-debuginfo`
   prints locations; the test says when it cannot.
"""

import argparse
import os
import re
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.dont_write_bytecode = True  # models/ is source; leave no __pycache__ there
sys.path.insert(0, os.path.join(ROOT, "models"))
import export  # noqa: E402
import reference  # noqa: E402

ROPE_ATOL = 1e-6
BIG_LIMIT_S = 10.0
TIMEOUT_S = 120

# (exported model, batch, seq, reference config, builtin spec)
CASES = [
    ("gpt", 4, 16, {}, "gpt:layers=2,hidden=32,heads=2,seq=16,vocab=64,batch=4"),
    ("gpt", 2, 80, {"n_layer": 3, "n_embd": 48, "n_head": 4, "vocab_size": 100},
     "gpt:layers=3,hidden=48,heads=4,seq=80,vocab=100,batch=2"),
    ("gpt_untied", 3, 12, {"n_layer": 1, "n_embd": 16, "n_head": 2, "vocab_size": 30},
     "gpt:layers=1,hidden=16,heads=2,seq=12,block_size=16,vocab=30,batch=3,tied=0"),
    ("gpt_untied", 1, 70, {"n_layer": 2, "n_embd": 24, "n_head": 3, "vocab_size": 50},
     "gpt:layers=2,hidden=24,heads=3,seq=70,vocab=50,tied=0"),
    ("gpt_tanh", 4, 16, {}, "gpt:layers=2,hidden=32,heads=2,seq=16,vocab=64,batch=4,gelu_tanh=1"),
    # Hugging Face's additive causal mask (0 and finfo.min, added to the
    # scores) raises to the causal attention masked_fill's -inf gives.
    ("gpt_hfmask", 4, 16, {}, "gpt:layers=2,hidden=32,heads=2,seq=16,vocab=64,batch=4"),
    ("gpt_tanh", 2, 72, {"n_layer": 3, "n_embd": 4, "n_head": 1, "vocab_size": 70},
     "gpt:layers=3,hidden=4,heads=1,seq=72,vocab=70,batch=2,gelu_tanh=1"),
    ("llama", 4, 16, {},
     "llama:layers=2,hidden=32,heads=4,kv_heads=2,ffn=64,seq=16,vocab=64,batch=4"),
    ("llama", 2, 80, {"n_layer": 3, "dim": 48, "n_heads": 6, "n_kv_heads": 2, "hidden_dim": 96,
                      "vocab_size": 100},
     "llama:layers=3,hidden=48,heads=6,kv_heads=2,ffn=96,seq=80,vocab=100,batch=2"),
    ("llama", 2, 16, {"n_layer": 1, "dim": 32, "n_heads": 4, "n_kv_heads": 4, "hidden_dim": 40,
                      "vocab_size": 50},
     "llama:layers=1,hidden=32,heads=4,ffn=40,seq=16,vocab=50,batch=2"),
    ("llama", 3, 12, {"n_layer": 2, "dim": 64, "n_heads": 8, "n_kv_heads": 1, "hidden_dim": 24,
                      "vocab_size": 30, "norm_eps": 1e-6, "rope_theta": 500000.0},
     "llama:layers=2,hidden=64,heads=8,kv_heads=1,ffn=24,seq=12,block_size=16,vocab=30,batch=3,"
     "norm_eps=1e-6,rope_theta=500000"),
]
# Flags given to both imports of the case with this index.
FLAGS = {1: ["--frozen", "wte.*", "--frozen", "h.0.ln_*"]}

GOOD = "layers=1,hidden=16,heads=2,seq=8,vocab=30"
# (spec, word the error must contain)
BAD = [
    (f"builtin:gpt:{GOOD},foo=1", "'foo'"),
    ("builtin:gpt:hidden=16,heads=2,seq=8,vocab=30", "'layers'"),
    (f"builtin:gpt:{GOOD.replace('layers=1', 'layers=1.5')}", "'layers'"),
    (f"builtin:gpt:{GOOD.replace('layers=1', 'layers=0')}", "'layers'"),
    (f"builtin:gpt:{GOOD.replace('vocab=30', 'vocab=-3')}", "'vocab'"),
    (f"builtin:gpt:{GOOD.replace('seq=8', 'seq=abc')}", "'seq'"),
    (f"builtin:gpt:{GOOD.replace('heads=2', 'heads=3')}", "'heads'"),
    (f"builtin:llama:{GOOD.replace('heads=2', 'heads=4')},kv_heads=3", "'kv_heads'"),
    (f"builtin:gpt:{GOOD},dropout=1", "'dropout'"),
    (f"builtin:gpt:{GOOD},tied=2", "'tied'"),
    (f"builtin:gpt:{GOOD},layers=2", "'layers'"),
    (f"builtin:gpt:{GOOD},batch", "'batch'"),
    (f"builtin:bert:{GOOD}", "'bert'"),
]

failures = []


def check(what, ok, detail=""):
    print(("ok    " if ok else "FAIL  ") + what + ("" if ok else ": " + detail))
    if not ok:
        failures.append(what)


def carve(binary, *args):
    p = subprocess.run([binary, "import", *args], capture_output=True, text=True,
                       timeout=TIMEOUT_S)
    return p.returncode, p.stdout, p.stderr


BLOB = re.compile(r'^\s*"([^"]+)": "0x([0-9A-F]+)",?$', re.M)


def split_blobs(ir):
    """The IR with each resource blob's hex replaced by its name, and the blobs."""
    blobs = {m.group(1): m.group(2) for m in BLOB.finditer(ir)}
    return BLOB.sub(lambda m: f'  "{m.group(1)}": <blob>', ir), blobs


def blob_floats(hexstr):
    raw = bytes.fromhex(hexstr)
    return np.frombuffer(raw[4:], dtype=np.float32)  # after the 4-byte alignment


def compare(tag, onnx_ir, builtin_ir, rope_ulps):
    if onnx_ir == builtin_ir:
        check(f"{tag}: identical IR ({onnx_ir.count(chr(10))} lines)", True)
        return
    a_text, a_blobs = split_blobs(onnx_ir)
    b_text, b_blobs = split_blobs(builtin_ir)
    if a_text != b_text:
        diff = [(x, y) for x, y in zip(a_text.splitlines(), b_text.splitlines()) if x != y]
        first = diff[0] if diff else ("(lengths differ)", "")
        check(f"{tag}: identical IR outside blob values", False,
              f"\n  onnx:    {first[0][:300]}\n  builtin: {first[1][:300]}")
        return
    ok = sorted(a_blobs) == sorted(b_blobs)
    detail = f"blob names {sorted(a_blobs)} vs {sorted(b_blobs)}"
    for name in a_blobs if ok else []:
        if a_blobs[name] == b_blobs[name]:
            continue
        x, y = blob_floats(a_blobs[name]), blob_floats(b_blobs[name])
        if not name.startswith("/Slice") or x.shape != y.shape:
            ok, detail = False, f"blob {name} differs"
            break
        err = float(np.abs(x - y).max())
        rope_ulps[0] += int((x != y).sum())
        rope_ulps[1] += x.size
        if err > ROPE_ATOL:
            ok, detail = False, f"rope table {name} differs by {err}"
            break
    check(f"{tag}: identical IR, rope tables within {ROPE_ATOL}", ok, detail)


LOC_ALIAS = re.compile(r'^(#loc\d*) = loc\((.*)\)$', re.M)
OP_LOC = re.compile(r'^\s+(?:%\S+ = )?(carve\.\w+|func\.return) .* loc\((.*)\)$', re.M)


def node_names(ir):
    """(op, node name) for every op of IR printed with locations."""
    aliases = dict(LOC_ALIAS.findall(ir))

    def name(loc):
        while loc.startswith("#loc"):
            loc = aliases.get(loc, "")
        m = re.match(r'"([^"]*)"\(', loc)
        return m.group(1) if m else ""

    return [(op, name(loc)) for op, loc in OP_LOC.findall(ir)]


def compare_names(tag, onnx_ir, builtin_ir):
    a, b = node_names(onnx_ir), node_names(builtin_ir)
    diff = next(((x, y) for x, y in zip(a, b) if x != y), None)
    check(f"{tag}: the same node name on each of {len(a)} ops", a and a == b,
          f"{len(a)} vs {len(b)} ops, first difference {diff}")


def compare_exports(binary, workdir, debuginfo):
    rope = [0, 0]
    for k, (name, batch, seq, config, spec) in enumerate(CASES):
        out = os.path.join(workdir, f"case{k}")
        model, inputs, names = reference.build(name, batch=batch, seq=seq, config=config)
        path = os.path.join(out, name + ".onnx")
        export.export_for_carve(model, inputs, path, input_names=names)
        flags = FLAGS.get(k, [])
        tag = f"builtin:{spec}" + (" " + " ".join(flags) if flags else "") + f" vs {name}.onnx"
        rc1, onnx_ir, err1 = carve(binary, path, *flags)
        rc2, builtin_ir, err2 = carve(binary, "builtin:" + spec, *flags)
        if rc1 != 0 or rc2 != 0:
            check(f"{tag}: both imports succeed", False, (err1 + err2).strip())
            continue
        compare(tag, onnx_ir, builtin_ir, rope)
        if debuginfo:
            _, onnx_ir, _ = carve(debuginfo, path, *flags, "--mlir-print-debuginfo")
            _, builtin_ir, _ = carve(debuginfo, "builtin:" + spec, *flags, "--mlir-print-debuginfo")
            compare_names(tag, onnx_ir, builtin_ir)
    print(f"      rope tables: {rope[0]} of {rope[1]} values differ from PyTorch's "
          f"(by at most {ROPE_ATOL})")


def bad_specs(binary):
    for spec, word in BAD:
        rc, out, err = carve(binary, spec)
        lines = err.strip().splitlines()
        ok = rc == 1 and not out and len(lines) == 1 and spec in lines[0] and word in lines[0]
        check(f"bad spec names {word}: {lines[0] if lines else '(no error)'}", ok,
              f"exit {rc}, stdout {len(out)} chars, stderr {err!r}")


def big_model(binary):
    L, H, heads, T, V = 128, 25600, 160, 2048, 51200
    spec = f"builtin:gpt:layers={L},hidden={H},heads={heads},seq={T},vocab={V}"
    start = time.monotonic()
    rc, out, err = carve(binary, spec, "--summary")
    secs = time.monotonic() - start
    params = L * (12 * H * H + 13 * H) + V * H + T * H + 2 * H
    m = re.search(r"parameters: (\d+) trainable, (\d+) elements", out)
    check(f"{spec} --summary builds in {secs:.2f} s (limit {BIG_LIMIT_S} s)",
          rc == 0 and secs < BIG_LIMIT_S, err.strip())
    check(f"  {params} parameter elements (12 L H^2 + 13 L H + V H + T H + 2 H)",
          bool(m) and int(m.group(2)) == params, m.group(0) if m else out[:200])


def dropout(binary):
    for family, layers, annotated in (("gpt", 2, r"carve\.(add|attention)"),
                                      ("llama", 2, r"carve\.(gather|matmul|attention)")):
        spec = f"builtin:{family}:layers={layers},hidden=16,heads=2,seq=8,vocab=30"
        rc0, plain, _ = carve(binary, spec)
        rc1, marked, err = carve(binary, spec + ",dropout=0.1")
        attr = "carve.dropout = 1.000000e-01 : f64"
        module_ok = f"module @torch_jit attributes {{{attr}}} {{" in marked
        ops = [ln for ln in marked.splitlines() if attr in ln and "module" not in ln]
        kinds_ok = all(re.search(annotated, ln) for ln in ops)
        attention = sum("carve.attention" in ln for ln in ops)
        unmarked = marked.replace(f" attributes {{{attr}}}", "")
        unmarked = unmarked.replace(f"{{{attr}}} ", "").replace(f"{attr}, ", "")
        unmarked = unmarked.replace(f", {attr}", "")
        check(f"{spec},dropout=0.1: module attribute, {1 + 3 * layers} ops marked "
              f"({layers} attention), the rest unchanged",
              rc0 == 0 and rc1 == 0 and module_ok and len(ops) == 1 + 3 * layers and kinds_ok
              and attention == layers and unmarked == plain,
              f"{len(ops)} marked, {attention} attention, module {module_ok}, "
              f"unchanged {unmarked == plain} {err.strip()}")


def debuginfo_binary(binary, override):
    """The binary whose `import --mlir-print-debuginfo` prints locations, or None."""
    candidate = override or binary
    rc, out, err = carve(candidate, f"builtin:gpt:{GOOD}", "--mlir-print-debuginfo")
    if rc == 0 and node_names(out):
        return candidate
    print("skip  node names (locations) not compared: carve import does not print "
          "locations (--mlir-print-debuginfo: " + (err.strip().splitlines() or ["?"])[0] + ")")
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--carve", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--debuginfo-carve", default=None,
                    help="a driver whose `import --mlir-print-debuginfo` prints locations "
                         "(default: --carve, when it does)")
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    start = time.monotonic()
    compare_exports(args.carve, args.workdir, debuginfo_binary(args.carve, args.debuginfo_carve))
    bad_specs(args.carve)
    big_model(args.carve)
    dropout(args.carve)
    print(f"{len(failures)} failure(s) in {time.monotonic() - start:.1f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
