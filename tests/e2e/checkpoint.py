#!/usr/bin/env python3
"""Sharded checkpoints: exact resume, any plan into any plan, merge, inspect,
bad checkpoints, and a run killed (SIGKILL) while it saves.

What must hold (docs/checkpoints.md):

1. Exact resume. S steps in one go and S/2 + S/2 (`--save`, then a new process
   with `--load`) give bit-identical losses, final weights and optimizer state
   under the same plan: 1 rank (SGD with momentum, and AdamW, whose update
   depends on its step count), dp2 x tp2 with ZeRO-1, and pp2 with 2
   micro-batches. The lr schedule (warm-up then cosine decay) is active on
   every step, so a resumed run that lost its place in it would differ.
2. Any plan into any plan. A checkpoint saved at step S/2 under one plan and
   loaded under another (dp2 -> tp2, dp2 x tp2 ZeRO-1 -> pp2, pp2 -> 1 rank,
   dp2 ZeRO-3 -> dp2 ZeRO-0) continues within the parallel tests' tolerances
   of the uninterrupted 1-rank run: every loss within LOSS_RTOL relative, the
   final weights within WEIGHT_RTOL of each tensor's largest entry.
3. Every rank writes its own shards: the dp2 x tp2 ZeRO-1 checkpoint has one
   file per rank, every rank holds optimizer state, tp-split tensors have
   their pieces on both tp ranks, and every tensor is covered exactly once
   (st.load_checkpoint checks the cover independently of the C++ reader).
4. `carve ckpt merge` writes the full model by its original names: the MLP's
   merged file loads into reference.MLP with load_state_dict(strict=True),
   and PyTorch's loss on the next batch equals the loss the carve program logs
   for that step after --load (within TORCH_RTOL).
   With --model, the exported GPT's and Llama's merged files hold every key
   of the module's state_dict (tied weights, buffers the programs fold) and
   load with strict=True, PyTorch's next loss equal to carve's; --dtype bf16
   writes each tensor rounded to bf16.
5. `carve ckpt inspect` prints the plan, the step and every tensor with its
   shards per rank, matching the manifest.
6. Bad checkpoints (truncated rank file, missing rank file, missing or corrupt
   manifest, a tensor missing from the manifest, a model that does not match,
   `latest` naming a missing folder, a data position that is not the step)
   stop the run with exit status 1 and one
   error line naming the file and the cause, and nothing is written.
7. --save-every/--keep and SIGKILL at random moments during saves (the
   test-only CARVE_TEST_SAVE_DELAY_MS widens every stage of a save): after each
   kill, `latest` names a complete step folder, every listed step folder
   loads, and a run resumed from it logs exactly the uninterrupted run's loss
   for its step (so the checkpoint is that step's, complete and uncorrupted).

Tolerances: a different plan changes only the order of float32 sums
(parallel.py measures 2e-7 relative on losses and 6e-7 on weights after 10
steps); LOSS_RTOL = 1e-5 and WEIGHT_RTOL = 1e-4 are the parallel tests'. SGD
with momentum as in parallel.py: AdamW turns rounding noise in zero gradients
into +-lr steps, which is no checkpoint's fault. PyTorch's forward against
carve's: different float32 kernels over 64-wide dot products, measured
~1e-7; TORCH_RTOL = 1e-5.
"""

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.dont_write_bytecode = True
sys.path.insert(0, os.path.join(ROOT, "models"))
import data_gen  # noqa: E402
import st  # noqa: E402
import harness  # noqa: E402

GPT = "builtin:gpt:layers=2,hidden=64,heads=4,seq=16,vocab=128,batch=8"
OTHER_GPT = "builtin:gpt:layers=2,hidden=32,heads=4,seq=16,vocab=128,batch=8"
SGD = ["--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9", "--clip-grad-norm", "0.5",
       "--warmup-steps", "2", "--decay-steps", "6"]
ADAMW = ["--optimizer", "adamw", "--lr", "0.01", "--warmup-steps", "2", "--decay-steps", "6"]
STEPS = 8
HALF = STEPS // 2
LOSS_RTOL = 1e-5
WEIGHT_RTOL = 1e-4
TORCH_RTOL = 1e-5
PLANS = {
    "one": None,
    "dp2": {"dp": 2},
    "tp2": {"tp": 2},
    "dp2tp2z1": {"dp": 2, "tp": 2, "zero": 1},
    "pp2": {"pp": 2, "num_micro_batches": 2},
    "dp2z3": {"dp": 2, "zero": 3},
}
ALL_ROLES = ("parameter", "buffer", "optimizer_state")


Failure = harness.Failure


def ranks_of(plan):
    plan = plan or {}
    return plan.get("dp", 1) * plan.get("tp", 1) * plan.get("pp", 1)


def run(cmd, timeout=300, env=None):
    return harness.run_ok(cmd, timeout=timeout, env=env).out


def read_log(path, first, count):
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    steps = [r["step"] for r in rows]
    if steps != list(range(first + 1, first + count + 1)):  # steps are numbered from 1
        raise Failure("%s: logged steps %s, expected %d..%d" % (path, steps, first + 1,
                                                                first + count))
    return [r["loss"] for r in rows]


def compare_weights(a, b, what):
    """Worst per-tensor difference relative to the tensor's largest entry."""
    if sorted(a) != sorted(b):
        raise Failure("%s: tensors %s vs %s" % (what, sorted(a), sorted(b)))
    worst, name = 0.0, ""
    for k in a:
        if a[k].shape != b[k].shape:
            raise Failure("%s: %s has shape %s vs %s" % (what, k, a[k].shape, b[k].shape))
        d = float(np.max(np.abs(a[k] - b[k])) / max(float(np.max(np.abs(b[k]))), 1e-30))
        if d > worst:
            worst, name = d, k
    return worst, name


def identical(a, b, what):
    if sorted(a) != sorted(b):
        raise Failure("%s: tensors differ: %s vs %s" % (what, sorted(a), sorted(b)))
    for k in a:
        if a[k].shape != b[k].shape or not np.array_equal(a[k], b[k]):
            raise Failure("%s: tensor %s is not bit-identical" % (what, k))


class Env:
    def __init__(self, carve, work):
        self.carve, self.work = carve, work
        self.data = os.path.join(work, "tokens.bin")
        data_gen.write_tokens(self.data, data_gen.make_tokens(4000, 128, seed=3), "int32")
        self.programs = {}

    def compile(self, name, plan, model=GPT, optimizer=SGD):
        out = os.path.join(self.work, name)
        cmd = [self.carve, "compile", model, "-o", out, "--quiet", *optimizer]
        if plan:
            with open(out + ".plan.json", "w") as f:
                json.dump(plan, f)
            cmd += ["--plan", out + ".plan.json"]
        run(cmd)
        self.programs[name] = (out, ranks_of(plan))
        return out

    def train(self, name, tag, steps, extra=(), env=None):
        """Runs program `name`; returns the log path."""
        out, ranks = self.programs[name]
        log = os.path.join(self.work, tag + ".jsonl")
        run([self.carve, "run", out, "-n", str(ranks), "--", "--steps", str(steps), "--data",
             self.data, "--log", log, "--quiet", *extra], env=env)
        return log


def check_exact_resume(e, name):
    """S in one go against S/2 + S/2 under the same plan: bit-identical."""
    full = os.path.join(e.work, name + "-full")
    first = os.path.join(e.work, name + "-first")
    second = os.path.join(e.work, name + "-second")
    log_full = e.train(name, name + "-full", STEPS, ["--save", full])
    log_a = e.train(name, name + "-first", HALF, ["--save", first])
    log_b = e.train(name, name + "-second", STEPS - HALF, ["--load", first, "--save", second])
    losses = read_log(log_a, 0, HALF) + read_log(log_b, HALF, STEPS - HALF)
    base = read_log(log_full, 0, STEPS)
    if losses != base:
        raise Failure("losses differ: resumed %s vs one go %s" % (losses, base))
    identical(st.load_checkpoint(second, ALL_ROLES), st.load_checkpoint(full, ALL_ROLES),
              name + " final weights and optimizer state")
    with open(os.path.join(st.checkpoint_folder(second), "manifest.json")) as f:
        m = json.load(f)
    for key, want in (("step", STEPS), ("optimizer", STEPS), ("lr_schedule", STEPS),
                      ("data", STEPS)):
        got = m[key] if key == "step" else m[key]["step"]
        if got != want:
            raise Failure("manifest %s step is %s, expected %d" % (key, got, want))
    return base, full


def check_cross_plan(e, src, dst, base_losses, base_weights):
    ck = os.path.join(e.work, "%s-half" % src)
    if not os.path.isdir(ck):
        e.train(src, "%s-half" % src, HALF, ["--save", ck])
    tag = "%s-to-%s" % (src, dst)
    out = os.path.join(e.work, tag)
    log = e.train(dst, tag, STEPS - HALF, ["--load", ck, "--save", out])
    losses = read_log(log, HALF, STEPS - HALF)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, base_losses[HALF:]))
    if worst > LOSS_RTOL:
        raise Failure("loss differs by %.3g relative (limit %g): %s vs %s" %
                      (worst, LOSS_RTOL, losses, base_losses[HALF:]))
    wworst, wname = compare_weights(st.load_checkpoint(out), base_weights, tag)
    if wworst > WEIGHT_RTOL:
        raise Failure("final weight %s differs by %.3g of its largest entry (limit %g)" %
                      (wname, wworst, WEIGHT_RTOL))
    return "loss %.1e weights %.1e" % (worst, wworst)


def check_shards(e):
    """dp2 x tp2 ZeRO-1: one file per rank, each rank's own shards, exact cover."""
    ck = st.checkpoint_folder(os.path.join(e.work, "dp2tp2z1-full"))
    with open(os.path.join(ck, "manifest.json")) as f:
        m = json.load(f)
    if m["plan"] != {"world_size": 4, "dp": 2, "tp": 2, "pp": 1, "zero": 1,
                     "micro_batches": 1}:
        raise Failure("manifest plan is %s" % m["plan"])
    files = sorted(x for x in os.listdir(ck) if x.startswith("rank-"))
    if files != ["rank-%05d.safetensors" % r for r in range(4)]:
        raise Failure("rank files %s" % files)
    state_ranks = set()
    for t in m["tensors"]:
        for s in t["shards"]:
            if s["file"] != "rank-%05d.safetensors" % s["rank"]:
                raise Failure("%s: shard of rank %d in %s" % (t["name"], s["rank"], s["file"]))
        if t["role"] == "optimizer_state":
            state_ranks |= {s["rank"] for s in t["shards"]}
    if state_ranks != {0, 1, 2, 3}:
        raise Failure("optimizer state shards only on ranks %s (ZeRO-1 splits it over dp)" %
                      sorted(state_ranks))
    by = {t["name"]: t for t in m["tensors"]}
    qkv = by["h.0.attn.c_attn.weight"]
    # Column-parallel fused QKV: each tp rank holds 1/2 of each of the 3 sections.
    want = sorted((r, o) for r in (0, 1) for o in (r * 32, 64 + r * 32, 128 + r * 32))
    got = sorted((s["rank"], s["offsets"][0]) for s in qkv["shards"])
    if got != want or any(s["shape"] != [32, 64] for s in qkv["shards"]):
        raise Failure("c_attn.weight shards %s, expected (rank, row) %s of [32, 64]" %
                      ([(s["rank"], s["offsets"], s["shape"]) for s in qkv["shards"]], want))
    # Every element once, optimizer state included (raises otherwise).
    st.load_checkpoint(ck, ALL_ROLES)
    return "%d tensors, %d shards" % (len(m["tensors"]),
                                      sum(len(t["shards"]) for t in m["tensors"]))


def check_inspect(e):
    ck = os.path.join(e.work, "dp2tp2z1-full")
    text = run([e.carve, "ckpt", "inspect", ck])
    folder = st.checkpoint_folder(ck)
    with open(os.path.join(folder, "manifest.json")) as f:
        m = json.load(f)
    for want in ("plan: 4 ranks, dp=2 tp=2 pp=1 zero=1 micro_batches=1",
                 "step: %d (optimizer sgd step %d" % (STEPS, STEPS)):
        if want not in text:
            raise Failure("inspect output lacks %r:\n%s" % (want, text[:1500]))
    lines = text.splitlines()
    for t in m["tensors"]:
        head = "%s %s %s [%s]" % (t["name"], t["role"], t["dtype"],
                                  ", ".join(str(d) for d in t["shape"]))
        if head not in lines:
            raise Failure("inspect does not list %r" % head)
        i = lines.index(head) + 1
        for s in t["shards"]:
            rng = ", ".join("%d:%d" % (o, o + n) for o, n in zip(s["offsets"], s["shape"]))
            want = "  rank %d [%s] %s:%s" % (s["rank"], rng, s["file"], s["key"])
            if want not in lines[i:i + len(t["shards"])]:
                raise Failure("inspect lacks shard line %r for %s" % (want, t["name"]))
    return "%d lines" % len(lines)


def check_merge_torch(e, models):
    import torch
    import reference
    mlp = os.path.join(models, "opset17", "mlp.onnx")
    out = e.compile("mlp", None, model=mlp, optimizer=SGD)
    inputs = data_gen.graph_inputs(mlp)
    tensors = data_gen.make_tensors(inputs, 16, {"targets": 10}, seed=5)
    data = os.path.join(e.work, "mlp.safetensors")
    data_gen.write_tensors(data, tensors)
    ck = os.path.join(e.work, "mlp-ck")
    run([os.path.join(out, "bin", "train"), "--steps", "3", "--data", data, "--save", ck,
         "--quiet"])
    log = os.path.join(e.work, "mlp-next.jsonl")
    run([os.path.join(out, "bin", "train"), "--steps", "1", "--data", data, "--load", ck,
         "--log", log, "--quiet"])
    next_loss = read_log(log, 3, 1)[0]
    merged = os.path.join(e.work, "mlp-full.safetensors")
    run([e.carve, "ckpt", "merge", ck, "-o", merged])
    weights = st.load(merged)
    model = reference.MLP()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=True)
    batch = data_gen.tensor_batch(tensors, 3)
    with torch.no_grad():
        loss = float(model(torch.from_numpy(batch["x"]), torch.from_numpy(batch["targets"])))
    if abs(loss - next_loss) > TORCH_RTOL * abs(next_loss):
        raise Failure("PyTorch's loss on step 3 with the merged weights is %r, carve's %r" %
                      (loss, next_loss))
    # The GPT's merge: the same tensors as the Python reassembly.
    gmerged = os.path.join(e.work, "gpt-full.safetensors")
    run([e.carve, "ckpt", "merge", os.path.join(e.work, "dp2tp2z1-full"), "-o", gmerged])
    identical(st.load(gmerged), st.load_checkpoint(os.path.join(e.work, "dp2tp2z1-full")),
              "merged dp2tp2z1 checkpoint")
    return "strict load, loss %.8g vs %.8g" % (loss, next_loss)


def check_merge_strict(e, models):
    """`carve ckpt merge --model`: every key of the module's state_dict (the
    GPT's tied lm_head.weight and its causal-mask buffers, the Llama's rope
    and mask buffers, which the programs fold away): the exported reference
    models trained under dp2 x tp2 load the merged file with strict=True and
    PyTorch's loss on the next batch equals carve's (TORCH_RTOL); --dtype bf16
    writes BF16 tensors, each the fp32 merge rounded to nearest even."""
    import torch
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch_ref
    out_lines = []
    for name in ("gpt", "llama"):
        onnx = os.path.join(models, "opset17", name + ".onnx")
        prog = e.compile(name + "-merge", {"dp": 2, "tp": 2}, model=onnx, optimizer=SGD)
        data = os.path.join(e.work, name + "-merge.tokens")
        data_gen.write_tokens(data, data_gen.make_tokens(4000, data_gen.vocab_size(onnx), seed=3))
        ck = os.path.join(e.work, name + "-merge-ck")
        log = os.path.join(e.work, name + "-merge-b.jsonl")
        for extra in (["--steps", "3", "--save", ck],
                      ["--steps", "1", "--load", ck, "--log", log]):
            run([e.carve, "run", prog, "-n", "4", "--", "--data", data, "--quiet"] + extra)
        next_loss = read_log(log, 3, 1)[0]
        merged = os.path.join(e.work, name + "-strict.safetensors")
        so = run([e.carve, "ckpt", "merge", ck, "-o", merged, "--model", onnx])
        module, inputs = torch_ref.build_model(onnx, name)
        weights = st.load(merged)
        missing = sorted(set(module.state_dict()) - set(weights))
        extra = sorted(set(weights) - set(module.state_dict()))
        if missing or extra:
            raise Failure("%s: merged keys differ from state_dict(): missing %s, extra %s (%s)"
                          % (name, missing, extra, so))
        module.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=True)
        batch = torch_ref.Batches(data, inputs)(3)
        with torch.no_grad():
            loss = float(module(*[torch.from_numpy(np.asarray(x)) for x in batch]))
        if abs(loss - next_loss) > TORCH_RTOL * abs(next_loss):
            raise Failure("%s: PyTorch's loss on step 3 with the strict-loaded merge is %r, "
                          "carve's %r" % (name, loss, next_loss))
        half = os.path.join(e.work, name + "-strict-bf16.safetensors")
        run([e.carve, "ckpt", "merge", ck, "-o", half, "--model", onnx, "--dtype", "bf16"])
        header, _, start = st.read_header(half)
        dtypes = {v["dtype"] for v in header.values()}
        if dtypes != {"BF16"} or sorted(header) != sorted(weights):
            raise Failure("%s: --dtype bf16 wrote dtypes %s, tensors %s" % (name, dtypes,
                                                                          sorted(header)))
        raw = open(half, "rb").read()
        for k, v in header.items():
            b, f = v["data_offsets"]
            bits = np.frombuffer(raw[start + b:start + f], "<u2").astype("<u4") << 16
            got = bits.view("<f4").reshape(v["shape"])
            want = torch.from_numpy(weights[k]).to(torch.bfloat16).float().numpy()
            if not np.array_equal(got, want):
                raise Failure("%s: --dtype bf16 tensor %s is not the fp32 merge rounded" % (
                    name, k))
        out_lines.append("%s %d keys, loss %.8g vs %.8g" % (name, len(weights), loss, next_loss))
    # Bad input: one line naming the cause, exit 1, nothing written.
    never = os.path.join(e.work, "never.safetensors")
    for extra, message in [(["--dtype", "fp8"], "--dtype is fp32, bf16 or fp16, not 'fp8'"),
                           (["--model", os.path.join(e.work, "missing.onnx")],
                            "missing.onnx: cannot read the model")]:
        p = subprocess.run([e.carve, "ckpt", "merge", ck, "-o", never] + extra,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines = [l for l in p.stderr.splitlines() if l.strip()]
        if p.returncode != 1 or len(lines) != 1 or message not in lines[0] or \
                os.path.exists(never):
            raise Failure("merge %s: expected exit 1 with one line '%s', got %d:\n%s%s" % (
                extra, message, p.returncode, p.stdout, p.stderr))
    return "; ".join(out_lines)


def check_bad(e):
    """Each broken checkpoint: exit 1, one error line naming the file and cause, nothing written."""
    good = st.checkpoint_folder(os.path.join(e.work, "dp2tp2z1-full"))
    bad_root = os.path.join(e.work, "bad")
    os.makedirs(bad_root)
    e.compile("other", None, model=OTHER_GPT)

    def copy(name):
        d = os.path.join(bad_root, name)
        shutil.copytree(good, d)
        return d

    def edit_manifest(d, fn):
        p = os.path.join(d, "manifest.json")
        with open(p) as f:
            m = json.load(f)
        fn(m)
        with open(p, "w") as f:
            json.dump(m, f)

    cases = []
    d = copy("truncated")
    f = os.path.join(d, "rank-00001.safetensors")
    os.truncate(f, os.path.getsize(f) // 2)
    cases.append(("truncated rank file", "one", d, [f]))
    d = copy("missing_rank")
    os.remove(os.path.join(d, "rank-00002.safetensors"))
    cases.append(("missing rank file", "one", d, [os.path.join(d, "rank-00002.safetensors")]))
    d = copy("no_manifest")
    os.remove(os.path.join(d, "manifest.json"))
    cases.append(("missing manifest", "one", d, [d, "manifest.json"]))
    d = copy("corrupt_manifest")
    p = os.path.join(d, "manifest.json")
    with open(p, "r+") as fh:
        fh.truncate(os.path.getsize(p) // 2)
    cases.append(("truncated manifest", "one", d, [p, "JSON"]))
    d = copy("tensor_missing")
    edit_manifest(d, lambda m: m.update(tensors=[t for t in m["tensors"]
                                                 if t["name"] != "h.1.mlp.c_fc.weight"]))
    cases.append(("tensor missing", "dp2", d, [os.path.join(d, "manifest.json"),
                                                "h.1.mlp.c_fc.weight"]))
    d = copy("positions")
    edit_manifest(d, lambda m: m["data"].update(step=3))
    cases.append(("data position is not the step", "one", d,
                  [os.path.join(d, "manifest.json"), "positions", "(8, 8, 3)"]))
    cases.append(("wrong model", "other", good, [good, "wte.weight", "[128, 64]", "[128, 32]"]))
    d = os.path.join(bad_root, "latest_dangling")
    os.makedirs(d)
    with open(os.path.join(d, "latest"), "w") as fh:
        fh.write("step-00000099\n")
    cases.append(("latest names a missing folder", "one", d, [os.path.join(d, "latest"),
                                                              "step-00000099"]))
    results = []
    for what, prog, path, expect in cases:
        out, ranks = e.programs[prog]
        save = os.path.join(bad_root, "save-" + what.replace(" ", "_"))
        log = save + ".jsonl"
        p = subprocess.run([e.carve, "run", out, "-n", str(ranks), "--", "--steps", "2",
                            "--data", e.data, "--load", path, "--save", save, "--log", log],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           timeout=120)
        errors = [l for l in p.stderr.splitlines() if "error" in l]
        if p.returncode != 1:
            raise Failure("%s: exit %d, expected 1:\n%s" % (what, p.returncode, p.stderr))
        if len(errors) != 1:
            raise Failure("%s: expected one error line, got:\n%s" % (what, p.stderr))
        for word in expect:
            if word not in errors[0]:
                raise Failure("%s: the error does not name %r: %s" % (what, word, errors[0]))
        if os.path.exists(save) or os.path.exists(log):
            raise Failure("%s: wrote %s or %s" % (what, save, log))
        results.append(errors[0])
    return results


def complete_steps(d):
    out = []
    for name in os.listdir(d):
        if name.startswith("step-") and os.path.isfile(os.path.join(d, name, "manifest.json")):
            out.append(int(name[5:]))
    return sorted(out)


def kill_session(sid):
    """SIGKILL every process of session `sid` (mpirun gives each rank its own
    process group, so killpg would miss them) and wait until none runs."""
    deadline = time.monotonic() + 20
    while True:
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open("/proc/%s/stat" % entry) as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":  # state, ppid, pgrp, session
                pids.append(int(entry))
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise Failure("processes %s of the killed run do not end" % pids)
        time.sleep(0.05)


def check_kill(e, name, kills, seed):
    """SIGKILL at random moments of --save-every 1 runs; the folder always loads."""
    out, ranks = e.programs[name]
    total = 30
    # One step more: a kill that lands after the last save resumes from step `total`.
    ref_log = e.train(name, name + "-kill-ref", total + 1)
    ref = read_log(ref_log, 0, total + 1)
    d = os.path.join(e.work, name + "-kill")
    rnd = random.Random(seed)
    env = dict(os.environ, CARVE_TEST_SAVE_DELAY_MS="15")
    # How long a whole run takes, to spread the kills over it.
    t0 = time.monotonic()
    e.train(name, name + "-kill-timing", total, ["--save", d, "--save-every", "1", "--keep",
                                                 "3"], env=env)
    span = time.monotonic() - t0
    if complete_steps(d) != [total - 2, total - 1, total]:
        raise Failure("--keep 3 left steps %s, expected the last 3" % complete_steps(d))
    shutil.rmtree(d)
    seen = set()
    for i in range(kills):
        # Every run starts from scratch into the same folder: later runs
        # replace step folders of earlier ones.
        p = subprocess.Popen([e.carve, "run", out, "-n", str(ranks), "--", "--steps", str(total),
                              "--data", e.data, "--save", d, "--save-every", "1", "--keep", "3",
                              "--quiet"], env=env, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rnd.uniform(0.25, 0.9) * span)
        kill_session(p.pid)
        p.wait()
        steps = complete_steps(d)
        if not os.path.exists(os.path.join(d, "latest")):
            if steps:
                raise Failure("kill %d: no latest, but complete steps %s" % (i, steps))
            continue
        with open(os.path.join(d, "latest")) as fh:
            latest = fh.read().strip()
        if not os.path.isfile(os.path.join(d, latest, "manifest.json")):
            raise Failure("kill %d: latest names %s, which is not complete" % (i, latest))
        step = int(latest[5:])
        seen.add(step)
        for s in steps:  # every complete folder reassembles
            st.load_checkpoint(os.path.join(d, "step-%08d" % s), ALL_ROLES)
        log = e.train(name, "%s-kill-resume-%d" % (name, i), 1, ["--load", d])
        got = read_log(log, step, 1)[0]
        if got != ref[step]:
            raise Failure("kill %d: resumed from %s, loss %r, the uninterrupted run's %r" %
                          (i, latest, got, ref[step]))
    if not seen:
        raise Failure("no kill landed after the first save")
    return "%d kills, resumed from steps %s" % (kills, sorted(seen))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--carve", required=True)
    ap.add_argument("--models", required=True, help="exported test models (build/test-models)")
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    # One OpenMP thread per rank: up to 4 ranks share the test machine's cores,
    # and spinning thread pools would slow every run several times over.
    os.environ["OMP_NUM_THREADS"] = "1"
    e = Env(os.path.abspath(args.carve), args.workdir)
    failures = []
    start = time.monotonic()

    def check(label, fn, *a):
        t = time.monotonic()
        try:
            detail = fn(*a)
            print("ok   %-34s %s (%.1f s)" % (label, detail if isinstance(detail, str) else "",
                                              time.monotonic() - t), flush=True)
            return detail
        except (Failure, OSError, ValueError, KeyError, subprocess.SubprocessError) as ex:
            failures.append(label)
            print("FAIL %s: %s" % (label, ex), flush=True)
            return None

    try:
        for name, plan in PLANS.items():
            e.compile(name, plan)
        e.compile("one-adamw", None, optimizer=ADAMW)
    except Failure as ex:
        print("FAIL compile: %s" % ex)
        return 1
    base = check("exact resume one (sgd)", check_exact_resume, e, "one")
    check("exact resume one (adamw)", lambda: check_exact_resume(e, "one-adamw") and "")
    check("exact resume dp2tp2z1", lambda: check_exact_resume(e, "dp2tp2z1") and "")
    check("exact resume pp2", lambda: check_exact_resume(e, "pp2") and "")
    if base:
        base_losses, base_ck = base
        base_weights = st.load_checkpoint(base_ck)
        for src, dst in (("dp2", "tp2"), ("dp2tp2z1", "pp2"), ("pp2", "one"), ("dp2z3", "dp2")):
            check("%s -> %s" % (src, dst), check_cross_plan, e, src, dst, base_losses,
                  base_weights)
    else:
        failures.append("cross-plan (no 1-rank baseline)")
    check("own shards per rank", check_shards, e)
    check("inspect", check_inspect, e)
    check("merge into PyTorch", check_merge_torch, e, os.path.abspath(args.models))
    check("merge --model: strict state_dict", check_merge_strict, e,
          os.path.abspath(args.models))
    bad = check("bad checkpoints", check_bad, e)
    for line in bad or []:
        print("       " + line)
    check("kill -9 during saves (1 rank)", check_kill, e, "one", 5, 11)
    check("kill -9 during saves (dp2)", check_kill, e, "dp2", 3, 12)
    print("%s in %.0f s" % ("%d failed: %s" % (len(failures), ", ".join(failures)) if failures
                            else "all checkpoint checks passed", time.monotonic() - start))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
