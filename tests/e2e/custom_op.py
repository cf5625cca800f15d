#!/usr/bin/env python3
"""A user-defined op (rules file + C++ kernels) trained on 1 rank vs PyTorch and at tp=2 vs 1 rank."""

# What must hold (the rules-file issue's acceptance criteria), on the example
# of models/custom/: a Llama-style model whose MLP gate silu(a) * b is the
# custom ONNX op carve.example::SwiGLU, described by swiglu.json and computed
# by swiglu.cpp. The test exports the model into its work folder.
#
# (a) 1 rank, `carve compile --rules`, 10 SGD steps (lr 0.05, momentum 0.9)
#     against the same model run eagerly in PyTorch (the op's forward and
#     backward are its torch.autograd.Function, tests/e2e/torch_ref.py's
#     loop): every step's loss within LOSS_RTOL and the final weights within
#     WEIGHT_RTOL (||delta|| / ||w||), train_vs_torch.py's float32 limits.
#     Both sides compute in float32 in different orders (OpenBLAS GEMMs vs
#     PyTorch's, carve's exp in the kernel vs torch.sigmoid), a few ulp per op;
#     SGD carries these forward linearly, so the limits are as loose as there.
# (b) plan {"tp": 2}, launched with `carve run OUT -n 2`: every step's loss
#     within TP_LOSS_RTOL of the 1-rank run's and every final weight within
#     TP_WEIGHT_RTOL of its tensor's largest entry (tests/e2e/parallel.py's
#     limits: tensor parallelism changes only the order of float32 sums).
#     The partitioned IR (`--emit-mlir`) must show every custom op and its
#     gradient op split over tp ("dist.choice" not "tp: replicate"), and the
#     generated program must hand the kernels their local shapes (the hidden
#     dimension halved). Then the same with an override in the rules file that
#     forbids splitting the op's last dimension: now it is replicated, and the
#     run still equals 1 rank.
# (c) Bad input: each of BAD_CASES makes `carve compile` exit 1 with exactly
#     one line on stderr, `carve: error: ...`, that names the op or field, and
#     leaves no output directory.
#
# A run that cannot happen (export, compile or launch failure, a missing log
# or checkpoint) is a failure, never a skip.

import argparse
import copy
import json
import os
import re
import shutil
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CUSTOM = os.path.join(ROOT, "models", "custom")
sys.path.insert(0, HERE)
sys.path.insert(0, CUSTOM)
import data_gen  # noqa: E402
import st  # noqa: E402
import torch_ref  # noqa: E402
import harness  # noqa: E402

STEPS = 10
OPTIMIZER = ["--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9"]
HYPER = torch_ref.Hyper(optimizer="sgd", lr=0.05, momentum=0.9)
LOSS_RTOL = 1e-4
WEIGHT_RTOL = 1e-3
TP_LOSS_RTOL = 1e-5
TP_WEIGHT_RTOL = 1e-4
TIMEOUT_S = 600

SWIGLU_NODE = "/layers.0/feed_forward/SwiGLU"
HIDDEN = 64  # LlamaConfig.hidden_dim: the SwiGLU's last dimension


Failure = harness.Failure


def run(cmd, timeout=TIMEOUT_S):
    return harness.run(cmd, timeout=timeout)


def must(cmd):
    code, out, err = run(cmd)
    if code != 0:
        raise Failure(f"`{' '.join(cmd)}` exited {code}:\n{out[-1500:]}{err[-1500:]}")
    return out


def write_json(path, value):
    with open(path, "w") as f:
        json.dump(value, f, indent=2)
    return path


def base_rules():
    with open(os.path.join(CUSTOM, "swiglu.json")) as f:
        rules = json.load(f)
    # Copies of the rules live in the work folder: name the kernel by its full path.
    rules["ops"][0]["cpu"]["sources"] = [os.path.join(CUSTOM, "swiglu.cpp")]
    rules["ops"][0]["cuda"]["sources"] = [os.path.join(CUSTOM, "swiglu.cu")]
    return rules


# --- Training ------------------------------------------------------------------

def read_log(path):
    try:
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError) as e:
        raise Failure(f"{path}: cannot read the training log: {e}") from None
    if [r.get("step") for r in rows] != list(range(1, STEPS + 1)):
        raise Failure(f"{path}: {len(rows)} records, expected steps 1..{STEPS}")
    return [r["loss"] for r in rows]


def read_weights(path):
    try:
        return st.load_checkpoint(path)
    except (OSError, ValueError) as e:
        raise Failure(f"{path}: cannot read the saved weights: {e}") from None


def compile_and_train(carve, onnx_path, rules_path, data, out, plan=None):
    cmd = [carve, "compile", onnx_path, "--rules", rules_path, *OPTIMIZER, "-o", out,
           "--emit-mlir", out + ".mlir", "--quiet"]
    ranks = 1
    if plan:
        cmd += ["--plan", write_json(out + ".plan.json", plan)]
        ranks = plan.get("tp", 1) * plan.get("dp", 1)
    must(cmd)
    must([carve, "run", out, "-n", str(ranks), "--", "--steps", str(STEPS), "--data", data,
          "--log", out + ".jsonl", "--save", out + ".ckpt", "--quiet"])
    return read_log(out + ".jsonl"), read_weights(out + ".ckpt")


def torch_train(onnx_path, data, float64=False):
    """The oracle: models/custom/swiglu.py's model with the ONNX file's weights,
    trained eagerly on the same batches with torch.optim.SGD (in float64 when
    asked, to show that the float32 comparison is well posed)."""
    import torch
    import swiglu

    torch.set_num_threads(1)
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    inputs = data_gen.graph_inputs(onnx_path)
    batch, seq = inputs[0][2]
    model, _, _ = swiglu.build(batch=batch, seq=seq)
    if not any(isinstance(m, swiglu.FusedSwiGLU) for m in model.modules()):
        raise Failure("the oracle does not run the SwiGLU Function")
    params, buffers, inits = torch_ref.read_onnx(onnx_path)
    own = dict(model.named_parameters())
    if list(own) != params:
        raise Failure(f"{onnx_path}: parameters {params} are not the model's {list(own)}")
    own_buffers = dict(model.named_buffers())
    with torch.no_grad():
        for name in params:
            torch_ref.copy_initializer(onnx_path, name, own[name], inits, None)
        for name in buffers:
            if name in inits and name in own_buffers:
                torch_ref.copy_initializer(onnx_path, name, own_buffers[name], inits, None)
    batches = torch_ref.Batches(data, inputs)
    if float64:
        model = model.double()
    opt = torch.optim.SGD(model.parameters(), lr=HYPER.lr, momentum=HYPER.momentum)
    model.train()
    losses = []
    for k in range(STEPS):
        feeds = [torch.from_numpy(np.ascontiguousarray(a)) for a in batches(k)]
        feeds = [f.double() if float64 and f.is_floating_point() else f for f in feeds]
        opt.zero_grad(set_to_none=True)
        loss = model(*feeds)
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))
    final = {n: p.detach().float().numpy().copy() for n, p in model.named_parameters()}
    return losses, final


def rel(a, b):
    return abs(a - b) / abs(b) if b != 0 else abs(a - b)


def compare_losses(mine, ref, ref_name, tol):
    print(f"  {'step':>4}  {'carve loss':>12}  {ref_name + ' loss':>14}  {'rel diff':>8}")
    for k, (a, b) in enumerate(zip(mine, ref)):
        print(f"  {k:>4}  {a:>12.8f}  {b:>14.8f}  {rel(a, b):>8.1e}"
              + ("  <-- over" if rel(a, b) > tol else ""))
    worst = max(rel(a, b) for a, b in zip(mine, ref))
    print(f"  max loss rel diff {worst:.2e} (limit {tol:.0e})")
    if worst > tol:
        raise Failure(f"loss differs from {ref_name} by {worst:.2e} relative (limit {tol:.0e})")


def compare_weights(mine, ref, ref_name, tol, per_max):
    """per_max: max |delta| / max |w| per tensor; else ||delta|| / ||w||."""
    if sorted(mine) != sorted(ref):
        raise Failure(f"checkpoint tensors {sorted(mine)} differ from {ref_name}'s {sorted(ref)}")
    worst, worst_name = 0.0, None
    for name, w in ref.items():
        a, b = mine[name].astype(np.float64), w.astype(np.float64)
        if a.shape != b.shape:
            raise Failure(f"'{name}' is {list(a.shape)}, {ref_name}'s is {list(b.shape)}")
        if per_max:
            d = float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
        else:
            d = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
        if d > worst or worst_name is None:
            worst, worst_name = d, name
    what = "max |delta| / max |w|" if per_max else "||delta|| / ||w||"
    print(f"  final weights vs {ref_name}: worst {what} {worst:.2e} at {worst_name} "
          f"(limit {tol:.0e})")
    if worst > tol:
        raise Failure(f"final weight '{worst_name}' differs from {ref_name} by {worst:.2e} "
                      f"(limit {tol:.0e})")


def custom_choices(mlir_path):
    """[(op name, SSA name, tp choice, annotation used)] of every custom op of the
    partitioned @train_step."""
    text = open(mlir_path).read()
    if "func.func @train_step" not in text:
        raise Failure(f"{mlir_path}: no @train_step")
    out = []
    for line in text[text.index("func.func @train_step"):].splitlines():
        m = re.search(r"(%[\w:]+) = (carve\.custom(?:_grad)?) ", line)
        if not m:
            continue
        choice = re.search(r'dist\.choice = "tp: ([^"]*)"', line)
        annotation = re.search(r'dist\.annotation = "([^"]*)"', line)
        out.append((m.group(2), m.group(1), choice.group(1) if choice else None,
                    annotation.group(1) if annotation else None))
    return out


def kernel_shapes(program):
    """The dims the generated program passes to the SwiGLU kernels."""
    text = open(program).read()
    return re.findall(r"CARVE_F32, 3, \{(\d+), (\d+), (\d+)\}", text)


# --- The checks ------------------------------------------------------------------

def check_against_torch(carve, onnx_path, rules_path, data, work, results):
    out = os.path.join(work, "1rank")
    mine, weights = compile_and_train(carve, onnx_path, rules_path, data, out)
    results["1rank"] = (mine, weights)
    src = open(os.path.join(out, "src", "program0.cpp")).read()
    for fn in ("swiglu_forward", "swiglu_backward"):
        if f"::{fn}(" not in src:
            raise Failure(f"{out}/src/program0.cpp never calls {fn}")
    if not os.path.isfile(os.path.join(out, "src", "custom", "swiglu.cpp")):
        raise Failure(f"{out}/src/custom/swiglu.cpp: the kernel source was not copied")
    ref, ref_weights = torch_train(onnx_path, data)
    # Well posed first: PyTorch's own float32 run within the limits of its float64 run.
    exact, exact_weights = torch_train(onnx_path, data, float64=True)
    print("  well posed? PyTorch float32 against float64:")
    try:
        compare_losses(ref, exact, "float64 torch", LOSS_RTOL)
        compare_weights(ref_weights, exact_weights, "float64 torch", WEIGHT_RTOL, per_max=False)
    except Failure as e:
        raise Failure(f"not well posed in float32: {e}; choose the batch, the learning rate or "
                      "the steps so that it is")
    compare_losses(mine, ref, "torch", LOSS_RTOL)
    compare_weights(weights, ref_weights, "torch", WEIGHT_RTOL, per_max=False)


def check_tp(carve, onnx_path, rules_path, data, work, results, name, split):
    """tp=2 against the 1-rank run; `split`: whether the forward op must be split."""
    out = os.path.join(work, name)
    mine, weights = compile_and_train(carve, onnx_path, rules_path, data, out, {"tp": 2})
    ops = custom_choices(out + ".mlir")
    fwd = [o for o in ops if o[0] == "carve.custom"]
    grads = [o for o in ops if o[0] == "carve.custom_grad"]
    print("  custom ops in the partitioned IR:")
    for op, ssa, choice, annotation in ops:
        print(f"    {ssa:6} = {op:18} '{annotation}' -> tp: {choice}")
    if len(fwd) != 2 or len(grads) != 2:
        raise Failure(f"{out}.mlir: {len(fwd)} carve.custom and {len(grads)} "
                      "carve.custom_grad ops, expected 2 of each (one per layer)")
    # Split: the op and its gradient op follow the column-parallel gate and up
    # projections. With the override both stay whole: the gradient op's
    # annotation is derived from the overriding one.
    for op, ssa, choice, _ in fwd + grads:
        if split and choice in (None, "replicate"):
            raise Failure(f"{out}.mlir: {ssa} = {op} is not split over tp (dist.choice "
                          f"'tp: {choice}')")
        if not split and choice != "replicate":
            raise Failure(f"{out}.mlir: {ssa} = {op} is split ('tp: {choice}') although "
                          "the override forbids it")
    shapes = {tuple(map(int, s)) for s in kernel_shapes(os.path.join(out, "src",
                                                                     "program0.cpp"))}
    local = (4, 16, HIDDEN // 2)
    if (split and shapes != {local}) or (not split and (4, 16, HIDDEN) not in shapes):
        raise Failure(f"the generated program hands the kernels the shapes {sorted(shapes)}; "
                      f"expected {'only ' + str(list(local)) if split else [4, 16, HIDDEN]}")
    if "1rank" not in results:
        raise Failure("the 1-rank run it is compared with did not complete")
    base, base_weights = results["1rank"]
    compare_losses(mine, base, "1 rank", TP_LOSS_RTOL)
    compare_weights(weights, base_weights, "1 rank", TP_WEIGHT_RTOL, per_max=True)


class Bad:
    """A rules file (or flags) that must make `carve compile` fail."""

    def __init__(self, name, expect, edit=None, rules=True, plan=None, files=None):
        self.name = name
        self.expect = expect  # substrings of the one error line
        self.edit = edit      # function(rules dict, work folder) -> None, edits in place
        self.rules = rules    # False: compile without --rules
        self.plan = plan
        self.files = files or {}  # extra files to write: name -> text


def op0(rules):
    return rules["ops"][0]


def _set(path, value):
    def edit(rules, work):
        target = op0(rules)
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return edit


BAD_CASES = [
    Bad("no-rules", [SWIGLU_NODE, "carve.example::SwiGLU", "--rules"], rules=False),
    Bad("malformed-annotation",
        ["ops[0]", "carve.example::SwiGLU", '"annotation"', "no results"],
        _set(["annotation"], "a b -> ")),
    Bad("annotation-operand-count",
        [SWIGLU_NODE, "ops[0]", '"annotation"', "1 operand(s)", "2 input(s)"],
        _set(["annotation"], "a b c -> a b c")),
    Bad("annotation-rank",
        [SWIGLU_NODE, "ops[0]", '"annotation"', "2 dimension(s)", "[4, 16, 64]"],
        lambda rules, work: op0(rules).update(
            annotation="a b, a b -> a b", outputs=[{"shape": ["in0[0]", "in0[1]"]}])),
    Bad("outputs-rank", ["ops[0]", "outputs[0].shape", "2 dimension(s)", "has 3"],
        _set(["outputs", 0, "shape"], ["in0[0]", "in0[1]"])),
    Bad("bad-shape-expression",
        ["ops[0]", "carve.example::SwiGLU", "outputs[0].shape[2]", "in0[2] *"],
        _set(["outputs", 0, "shape", 2], "in0[2] *")),
    Bad("shape-input-out-of-range",
        ["ops[0]", "outputs[0].shape[0]", "in2"],
        _set(["outputs", 0, "shape", 0], "in2[0]")),
    Bad("inexact-division",
        [SWIGLU_NODE, "outputs[0].shape[1]", "not exact"],
        _set(["outputs", 0, "shape", 1], "in0[1] / 3")),
    Bad("missing-source", ["ops[0]", "cpu.sources", "nope.cpp", "does not exist"],
        _set(["cpu", "sources"], ["nope.cpp"])),
    Bad("missing-cuda-source", ["ops[0]", "cuda.sources", "nope.cu", "does not exist"],
        _set(["cuda", "sources"], ["nope.cu"])),
    Bad("cuda-not-an-object", ["ops[0]", '"cuda"', "must be an object"],
        _set(["cuda"], "swiglu.cu")),
    Bad("cuda-without-backward", ["ops[0]", '"cuda"', 'no "backward" kernel', "both targets"],
        lambda rules, work: op0(rules)["cuda"].pop("backward")),
    Bad("cuda-only-backward", ["ops[0]", '"cuda.backward"', '"cpu" has none'],
        lambda rules, work: op0(rules)["cpu"].pop("backward")),
    Bad("cuda-kernel-not-identifier", ["ops[0]", "cuda.forward", "not a C identifier"],
        _set(["cuda", "forward"], "swiglu forward")),
    Bad("unknown-field", ["ops[0]", "carve.example::SwiGLU", 'unknown field "outputz"'],
        lambda rules, work: op0(rules).update(outputz=[])),
    Bad("duplicate-rule", ["ops[1]", "carve.example::SwiGLU", "second rule", "ops[0]"],
        lambda rules, work: rules["ops"].append(copy.deepcopy(op0(rules)))),
    Bad("kernel-not-identifier", ["ops[0]", "cpu.forward", "not a C identifier"],
        _set(["cpu", "forward"], "swiglu-forward")),
    Bad("no-backward-kernel",
        ["/feed_forward/SwiGLU", "carve.example::SwiGLU", "no backward kernel", '"backward"'],
        lambda rules, work: (op0(rules)["cpu"].pop("backward"),
                             op0(rules)["cuda"].pop("backward"))),
    Bad("kernel-compile-error", ["broken.cpp", "C++ compiler failed", "full log"],
        _set(["cpu", "sources"], ["broken.cpp"]),
        files={"broken.cpp": '#include "carve/rt/custom.h"\n'
                             'extern "C" void swiglu_forward(const CarveTensor *in) {\n'
                             '  return 1 +;\n}\n'}),
    Bad("kernel-undefined", ["undefined reference", "swiglu_fwd", "extern \"C\""],
        _set(["cpu", "forward"], "swiglu_fwd")),
    Bad("override-matches-nothing", ["ops[1]", '"match"', "/no/such/MatMul", "matches no op"],
        lambda rules, work: rules["ops"].append(
            {"match": "/no/such/MatMul", "annotation": "a b, b c -> a c"})),
    Bad("override-malformed", ["ops[1]", "carve.matmul", '"annotation"', "->"],
        lambda rules, work: rules["ops"].append(
            {"match": "carve.matmul", "annotation": "a b, b c"})),
    # Rank 2 for a [4, 16, 32] x [32, 64] matmul: only the partitioner binds
    # overrides to shapes, so this needs tp > 1.
    Bad("override-wrong-shapes",
        ["/layers.0/feed_forward/w1/MatMul", "ops[1]", "annotation 'a b, b c -> a c'",
         "dimension(s)"],
        lambda rules, work: rules["ops"].append(
            {"match": "/layers.0/feed_forward/w1/MatMul", "annotation": "a b, b c -> a c"}),
        plan={"tp": 2}),
]


def check_bad(carve, onnx_path, work, case):
    d = os.path.join(work, "bad", case.name)
    os.makedirs(d)
    for name, text in case.files.items():
        with open(os.path.join(d, name), "w") as f:
            f.write(text)
    out = os.path.join(d, "out")
    cmd = [carve, "compile", onnx_path, "-o", out, "--quiet"]
    if case.rules:
        rules = base_rules()
        if case.edit:
            case.edit(rules, d)
        cmd += ["--rules", write_json(os.path.join(d, "rules.json"), rules)]
    if case.plan:
        cmd += ["--plan", write_json(os.path.join(d, "plan.json"), case.plan)]
    code, stdout, stderr = run(cmd)
    lines = stderr.strip().splitlines()
    line = lines[0] if lines else ""
    print(f"  {case.name}: exit {code}: {line}")
    problems = []
    if code != 1:
        problems.append(f"exit {code}, expected 1")
    if len(lines) != 1 or not line.startswith("carve: error: "):
        problems.append(f"stderr is not one 'carve: error: ' line: {stderr.strip()[:600]!r}")
    if stdout.strip():
        problems.append(f"printed to stdout: {stdout.strip()[:200]!r}")
    missing = [s for s in case.expect if s not in line]
    if missing:
        problems.append(f"the error does not mention {missing}")
    if os.path.exists(out):
        problems.append(f"{out} was created")
    if problems:
        raise Failure(f"bad input '{case.name}': " + "; ".join(problems))


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--carve", required=True, help="path to the carve binary")
    ap.add_argument("--workdir", required=True, help="scratch folder (recreated)")
    ap.add_argument("--only", choices=["torch", "tp", "bad"], action="append",
                    help="run only these parts (tp needs the 1-rank run of 'torch')")
    args = ap.parse_args()
    carve = os.path.abspath(args.carve)
    work = os.path.abspath(args.workdir)
    if not os.access(carve, os.X_OK):
        print(f"FAIL: the carve binary {carve} is missing or not executable")
        return 1
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    parts = args.only or ["torch", "tp", "bad"]

    try:
        import swiglu
        onnx_path = swiglu.export(work)
    except Exception as e:  # the export is a precondition of every check
        print(f"FAIL: exporting models/custom/swiglu.py: {e}")
        return 1
    data = os.path.join(work, "tokens.i32")
    data_gen.write_tokens(data, data_gen.make_tokens(1000, data_gen.vocab_size(onnx_path),
                                                     seed=0), "int32")
    rules_path = write_json(os.path.join(work, "swiglu.json"), base_rules())
    no_split = base_rules()
    no_split["ops"].append({"match": "/layers.*/feed_forward/SwiGLU",
                            "annotation": "a b c^, a b c^ -> a b c^"})
    no_split_path = write_json(os.path.join(work, "swiglu-no-split.json"), no_split)

    checks = []
    if "torch" in parts or "tp" in parts:
        checks.append(("(a) 1 rank vs PyTorch, 10 SGD steps",
                       lambda r: check_against_torch(carve, onnx_path, rules_path, data, work, r)))
    if "tp" in parts:
        checks.append(("(b) tp=2 vs 1 rank, the custom op split",
                       lambda r: check_tp(carve, onnx_path, rules_path, data, work, r, "tp2",
                                          True)))
        checks.append(("(b) tp=2 vs 1 rank, an override forbids splitting the custom op",
                       lambda r: check_tp(carve, onnx_path, no_split_path, data, work, r,
                                          "tp2-no-split", False)))
    if "bad" in parts:
        for case in BAD_CASES:
            checks.append((f"(c) bad input: {case.name}",
                           lambda r, c=case: check_bad(carve, onnx_path, work, c)))

    results, failed = {}, []
    for title, check in checks:
        print(f"== {title}")
        sys.stdout.flush()
        try:
            check(results)
            print("  PASS")
        except Failure as e:
            print(f"  FAIL: {e}")
            failed.append(title)
        sys.stdout.flush()
    print(f"{len(checks) - len(failed)} passed, {len(failed)} failed"
          + "".join(f"\n  {t}" for t in failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
