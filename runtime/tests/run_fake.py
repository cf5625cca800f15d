#!/usr/bin/env python3
"""End-to-end tests of the training executable's main() with fake_program.cpp.

usage: run_fake.py PATH/TO/carve-fake-train

Lays the executable out as `carve compile` would (OUT/bin/train beside
OUT/init.safetensors) and checks, against float64 references written here
from the specification (not from the C++):

  - training on one rank and on two ranks under mpirun gives the reference
    losses (JSONL log) and final weights (model.safetensors, read with a plain
    safetensors parser), for tensor data and for int32 / uint16 token data;
  - a run resumed with --load continues exactly where the saved one stopped;
  - a dp x tp plan with tensors split over tp and partitioned by ZeRO (the
    shard model) loads full tensors, holds exactly its pieces (its step
    checks them) and saves back full checkpoints equal to its input, on
    1, 2 and 4 ranks; rank 0 reports every rank's memory;
  - every start-up error is one `carve: error:` line with exit status 1 and
    writes nothing: bad arguments, wrong rank count, bad data, bad
    checkpoints, unwritable --save / --log;
  - a kernel error on one rank and CARVE_FAULT_RANK/STEP (SIGKILL) bring
    every rank down within seconds, and mpirun names the rank.

Only the Python standard library is used.
"""

import itertools
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time

FAILURES = []
MPIRUN = shutil.which("mpirun")


def check(cond, what, detail=""):
    if cond:
        print(f"ok    {what}")
    else:
        print(f"FAIL  {what}" + (f"\n      {detail}" if detail else ""))
        FAILURES.append(what)


# --- safetensors, straight from the format description ----------------------

FORMATS = {"F32": "f", "F64": "d", "I64": "q", "I32": "i", "U16": "H"}
SIZES = {"F32": 4, "F64": 8, "I64": 8, "I32": 4, "U16": 2}


def st_write(path, tensors, meta=None):
    """tensors: list of (name, dtype, shape, flat values)."""
    header, blobs, offset = {}, [], 0
    if meta:
        header["__metadata__"] = meta
    for name, dtype, shape, values in tensors:
        blob = struct.pack(f"<{len(values)}{FORMATS[dtype]}", *values)
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def st_read(path):
    """Returns ({name: (dtype, shape, values)}, metadata)."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0, "header not padded to 8"
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", {})
    data = raw[8 + n:]
    out = {}
    for name, e in header.items():
        b, end = e["data_offsets"]
        count = (end - b) // SIZES[e["dtype"]]
        out[name] = (e["dtype"], e["shape"],
                     list(struct.unpack(f"<{count}{FORMATS[e['dtype']]}", data[b:end])))
    return out, meta


def ck_read(path):
    """The latest checkpoint of a --save folder (docs/checkpoints.md), reassembled
    from its shards: (parameters and buffers, optimizer state, manifest), the
    tensors as st_read gives them."""
    with open(os.path.join(path, "latest")) as f:
        folder = os.path.join(path, f.read().strip())
    with open(os.path.join(folder, "manifest.json")) as f:
        manifest = json.load(f)
    files, model, opt = {}, {}, {}
    for t in manifest["tensors"]:
        shape = t["shape"]
        strides = [1] * len(shape)
        for d in range(len(shape) - 2, -1, -1):
            strides[d] = strides[d + 1] * shape[d + 1]
        values = [None] * math.prod(shape)
        for s in t["shards"]:
            if s["file"] not in files:
                files[s["file"]] = st_read(os.path.join(folder, s["file"]))[0]
            data = files[s["file"]][s["key"]][2]
            block = itertools.product(*[range(o, o + n) for o, n in zip(s["offsets"],
                                                                         s["shape"])])
            for i, idx in enumerate(block):
                values[sum(a * b for a, b in zip(idx, strides))] = data[i]
        (opt if t["role"] == "optimizer_state" else model)[t["name"]] = (t["dtype"], shape,
                                                                          values)
    return model, opt, manifest


def f32(values):
    return list(struct.unpack(f"<{len(values)}f", struct.pack(f"<{len(values)}f", *values)))


# --- the two fake models, in float64 ------------------------------------------

B_LIN, FEAT, S_LIN = 8, 3, 4
INIT_LIN = {"linear.weight": [0.5, -0.25, 0.1], "linear.bias": [0.2]}


def linreg_data():
    x = f32([math.sin(0.37 * i + 0.1) for i in range(S_LIN * B_LIN * FEAT)])
    y = []
    for r in range(S_LIN * B_LIN):
        row = x[r * FEAT:(r + 1) * FEAT]
        y.append(row[0] - 2 * row[1] + 0.5 * row[2] + 0.3 + 0.05 * math.cos(r))
    return x, f32(y)


def linreg_reference(steps, x, y):
    w, b = list(INIT_LIN["linear.weight"]), INIT_LIN["linear.bias"][0]
    mw, mb = [0.0] * FEAT, 0.0
    losses = []
    for k in range(steps):
        s = k % S_LIN
        loss, gw, gb = 0.0, [0.0] * FEAT, 0.0
        for i in range(B_LIN):
            row = x[(s * B_LIN + i) * FEAT:(s * B_LIN + i + 1) * FEAT]
            r = sum(a * c for a, c in zip(row, w)) + b - y[s * B_LIN + i]
            loss += r * r / B_LIN
            gw = [g + 2 * r / B_LIN * a for g, a in zip(gw, row)]
            gb += 2 * r / B_LIN
        losses.append(loss)
        mw = [0.9 * m + g for m, g in zip(mw, gw)]
        mb = 0.9 * mb + gb
        w = [p - 0.05 * m for p, m in zip(w, mw)]
        b -= 0.05 * mb
    return losses, w + [b]


B_TOK, T_TOK, VOCAB, N_TOK = 4, 8, 64, 200
INIT_TOK = [0.01 * v - 0.2 for v in range(VOCAB)]


def token_stream():
    return [(i * 7 + i // 3) % VOCAB for i in range(N_TOK)]


def tokens_reference(steps, toks):
    w = list(f32(INIT_TOK))
    m, v = [0.0] * VOCAB, [0.0] * VOCAB
    losses, n = [], B_TOK * T_TOK
    for k in range(steps):
        loss, g = 0.0, [0.0] * VOCAB
        for j in range(B_TOK):
            o = ((k * B_TOK + j) * T_TOK) % (N_TOK - T_TOK - 1)
            for t in range(T_TOK):
                idx, tgt = toks[o + t], toks[o + t + 1]
                r = w[idx] - tgt / VOCAB
                loss += r * r / n
                g[idx] += 2 * r / n
        losses.append(loss)
        lr, t = 0.1, k + 1
        for i in range(VOCAB):
            w[i] *= 1 - lr * 0.01
            m[i] = 0.9 * m[i] + 0.1 * g[i]
            v[i] = 0.999 * v[i] + 0.001 * g[i] * g[i]
            denom = math.sqrt(v[i]) / math.sqrt(1 - 0.999 ** t) + 1e-8
            w[i] -= lr / (1 - 0.9 ** t) * m[i] / denom
    return losses, w


# The shard model (fake_program.cpp): name, dtype, global shape, id, trainable.
SHARD = [("attn.qkv.weight", "F32", [12, 5], 1, True), ("mlp.fc.weight", "F32", [3, 8], 2, True),
         ("ln.bias", "F32", [5], 3, True), ("pos.count", "I64", [8], 4, False)]


def shard_model():
    return [(name, dt, shape, [1000 * i + g for g in range(math.prod(shape))])
            for name, dt, shape, i, _ in SHARD]


def shard_state(zero):
    out = []
    for name, _, shape, i, trainable in SHARD:
        for k, suffix in enumerate(["exp_avg", "exp_avg_sq"]):
            if trainable:
                out.append((f"{name}.{suffix}", "F32", shape,
                            [0.0 if zero else 1000 * i + g + 0.25 * (k + 1)
                             for g in range(math.prod(shape))]))
    return out


def as_dict(tensors):
    return {name: (dt, shape, list(values)) for name, dt, shape, values in tensors}


def close(a, b, rel=2e-4, abs_=1e-6):
    return len(a) == len(b) and all(abs(p - q) <= abs_ + rel * abs(q) for p, q in zip(a, b))


# --- running the executable ------------------------------------------------------


class Result:
    def __init__(self, rc, out, err, seconds):
        self.rc, self.out, self.err, self.seconds = rc, out, err, seconds

    def error_lines(self):
        return [l for l in self.err.splitlines() if "carve: error:" in l]


def run(exe, args, model="linreg", world=1, ranks=None, env=None, timeout=60, mpmd=None):
    """Runs exe with args: alone, on `ranks` ranks under mpirun, or, with
    `mpmd` (one argument list per rank), with different arguments per rank."""
    e = dict(os.environ, CARVE_FAKE_MODEL=model, CARVE_FAKE_WORLD=str(world),
             OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1",
             OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1")
    for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"):
        e.pop(k, None)
    e.update(env or {})
    cmd = [exe] + args
    launcher = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none"]
    if ranks is not None:
        cmd = launcher + ["-n", str(ranks)] + cmd
    if mpmd is not None:
        cmd = launcher
        for i, rank_args in enumerate(mpmd):
            cmd += ([":"] if i else []) + ["-n", "1", exe] + rank_args
    start = time.monotonic()
    try:
        p = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as t:
        return Result(None, t.stdout or "", t.stderr or "", timeout)
    return Result(p.returncode, p.stdout, p.stderr, time.monotonic() - start)


def read_log(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def expect_error(what, res, needle, ranks=None):
    lines = res.error_lines()
    ok = res.rc == 1 and len(lines) == 1 and needle in lines[0]
    check(ok, what, f"rc={res.rc} stderr={res.err.strip()[:600]!r}")
    if ok:
        print(f"      {lines[0]}")


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    tmp = tempfile.mkdtemp(prefix="carve-runtime-train-")
    try:
        tests(os.path.abspath(sys.argv[1]), tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if FAILURES:
        print(f"{len(FAILURES)} check(s) failed: " + "; ".join(FAILURES))
        sys.exit(1)
    print("all checks passed")


def layout(tmp, exe, name, init_tensors):
    """OUT/bin/train and OUT/init.safetensors, as carve compile writes them."""
    out = os.path.join(tmp, name)
    os.makedirs(os.path.join(out, "bin"))
    train = os.path.join(out, "bin", "train")
    shutil.copy(exe, train)
    st_write(os.path.join(out, "init.safetensors"), init_tensors)
    return out, train


def tests(exe, tmp):
    P = lambda *p: os.path.join(tmp, *p)
    lin_out, lin = layout(tmp, exe, "lin", [
        ("linear.weight", "F32", [FEAT], INIT_LIN["linear.weight"]),
        ("linear.bias", "F32", [1], INIT_LIN["linear.bias"]),
        ("steps_seen", "I64", [1], [0])])
    tok_out, tok = layout(tmp, exe, "tok", [("table.weight", "F32", [VOCAB], INIT_TOK)])

    x, y = linreg_data()
    data = P("lin.safetensors")
    st_write(data, [("x", "F32", [S_LIN, B_LIN, FEAT], x), ("y", "F32", [S_LIN, B_LIN], y)])
    ref_losses, ref_weights = linreg_reference(6, x, y)

    # --- linreg, one rank ------------------------------------------------------
    res = run(lin, ["--steps", "6", "--data", data, "--log", P("l1.jsonl"), "--save", P("ck1")])
    check(res.rc == 0, "linreg 1 rank runs", res.err)
    if res.rc == 0:
        log = read_log(P("l1.jsonl"))
        check([r["step"] for r in log] == list(range(1, 7)), "log has steps 1..6")
        check(close([r["loss"] for r in log], ref_losses), "1-rank losses match the reference",
              f"{[r['loss'] for r in log]} vs {ref_losses}")
        # Batch-major data is read in passes of its S batches: "epoch" is k div S.
        check(all(set(r) == {"step", "loss", "lr", "grad_norm", "time_s", "samples_per_s",
                             "epoch"} for r in log), "log fields", str(log[0]))
        check("step 6/6  loss " in res.out and "samples/s" in res.out, "progress line",
              res.out)
        model, opt, meta = ck_read(P("ck1"))
        check(meta["step"] == 6 and meta["format"] == "carve-checkpoint-2" and
              meta["optimizer"]["step"] == 6 and meta["data"]["step"] == 6,
              "checkpoint manifest", str(meta)[:400])
        check(close(model["linear.weight"][2] + model["linear.bias"][2], ref_weights),
              "saved weights match the reference")
        check(model["steps_seen"] == ("I64", [1], [6]), "I64 buffer saved",
              str(model["steps_seen"]))
        check(sorted(opt) == ["linear.bias.momentum_buffer", "linear.weight.momentum_buffer"],
              "optimizer state names", str(sorted(opt)))
        check(not [f for f in os.listdir(P("ck1")) + os.listdir(P("ck1", "step-00000006"))
                   if ".tmp" in f], "no temporary files left")

    # --- resume: 3 steps, save, 3 more from the checkpoint --------------------------
    run(lin, ["--steps", "3", "--data", data, "--save", P("ck3"), "--quiet"])
    res = run(lin, ["--steps", "3", "--data", data, "--load", P("ck3"), "--log", P("l3.jsonl"),
                    "--quiet"])
    check(res.rc == 0 and res.out == "", "resumed run, quiet", res.err + res.out)
    if res.rc == 0:
        log = read_log(P("l3.jsonl"))
        check([r["step"] for r in log] == [4, 5, 6] and
              close([r["loss"] for r in log], ref_losses[3:], rel=1e-6),
              "resumed losses continue the 6-step run", str(log))

    # --- two ranks under mpirun -------------------------------------------------------
    if MPIRUN:
        res = run(lin, ["--steps", "6", "--data", data, "--log", P("l2.jsonl"),
                        "--save", P("ck2")], world=2, ranks=2)
        check(res.rc == 0, "linreg 2 ranks under mpirun", res.err)
        if res.rc == 0:
            log = read_log(P("l2.jsonl"))
            check(close([r["loss"] for r in log], ref_losses),
                  "2-rank losses match the reference", str([r["loss"] for r in log]))
            check(res.out.count("step 6/6") == 1, "only rank 0 prints progress")
            model, _, _ = ck_read(P("ck2"))
            check(close(model["linear.weight"][2] + model["linear.bias"][2], ref_weights),
                  "2-rank saved weights match")
        res = run(lin, ["--steps", "5", "--data", data, "--log", P("l4.jsonl")], model="comm",
                  world=4, ranks=4)
        check(res.rc == 0 and close([r["loss"] for r in read_log(P("l4.jsonl"))],
                                    ref_losses[:5]),
              "4 ranks: every Communicator operation, and dp=4 losses", res.err[-800:])
    else:
        print("skip  mpirun not found: multi-rank checks not run")

    # --- tensor parallelism and ZeRO: full tensors in, pieces held, full tensors out -------
    shard_out, shard = layout(tmp, exe, "shard", shard_model())
    load = P("shard-load")
    os.makedirs(load)
    st_write(os.path.join(load, "model.safetensors"), shard_model(), {"step": "5"})
    st_write(os.path.join(load, "optimizer.safetensors"), shard_state(False), {"step": "5"})
    meshes = [(1, 1)] + ([(2, 1), (2, 2), (4, 2)] if MPIRUN else [])
    for world, dp in meshes:
        what = f"shard dp={dp} tp={world // dp}"
        ranks = world if world > 1 else None
        ck = P(f"sck-{world}-{dp}")
        res = run(shard, ["--steps", "1", "--data", data, "--save", ck], model="shard",
                  world=world, ranks=ranks, env={"CARVE_FAKE_DP": str(dp)})
        check(res.rc == 0, what + ": every rank holds its pieces of the initial weights",
              res.err[-800:])
        if res.rc == 0:
            model, opt, _ = ck_read(ck)
            check(model == as_dict(shard_model()), what + ": saved model equals init.safetensors",
                  str(model)[:600])
            check(opt == as_dict(shard_state(True)), what + ": saved optimizer state is zero, "
                  "full shapes", str(opt)[:600])
            lines = [l for l in res.out.splitlines() if l.startswith("carve: memory")]
            tp = world // dp

            def held(numel, split, zero3):
                # fake_program.cpp's shard tensors: this rank's tp piece, or its
                # ZeRO-3 chunk (rounded up to 4 elements there).
                local = numel // tp if split else numel
                return ((local + dp - 1) // dp + 3) // 4 * 4 if zero3 else local

            elements = held(60, True, True) + held(24, True, False) + held(5, False, False) + \
                held(8, True, True)
            want = [f"carve: memory rank {r} (dp {r // tp}, tp {r % tp}): "
                    f"parameters {1000 + r} bytes ({elements} elements), gradients {2000 + r} "
                    f"bytes, optimizer state {3000 + r} bytes" for r in range(world)]
            check(lines == want, what + ": memory report of every rank, in rank order",
                  "\n".join(lines))
        ck = P(f"sck2-{world}-{dp}")
        res = run(shard, ["--steps", "1", "--data", data, "--load", load, "--save", ck,
                          "--quiet"], model="shard", world=world, ranks=ranks,
                  env={"CARVE_FAKE_DP": str(dp), "CARVE_FAKE_EXPECT_STATE": "1"})
        check(res.rc == 0 and res.out == "",
              what + ": every rank holds its pieces of a checkpoint's weights and state",
              res.err[-800:] + res.out)
        if res.rc == 0:
            model, opt, meta = ck_read(ck)
            check(model == as_dict(shard_model()) and opt == as_dict(shard_state(False)) and
                  meta["step"] == 6, what + ": checkpoint round trip", str(meta)[:400])
    if MPIRUN:
        expect_error("shard: program tp does not match the plan",
                     run(shard, ["--steps", "1", "--data", data], model="shard", world=4,
                         ranks=4, env={"CARVE_FAKE_DP": "2", "CARVE_FAKE_TP": "4"}),
                     "has dp=2, tp=4, pp=1, which does not make its plan's 4 ranks")
    expect_error("shard: wrong rank count names tp",
                 run(shard, ["--steps", "1", "--data", data], model="shard", world=4,
                     env={"CARVE_FAKE_DP": "2"}),
                 "compiled for 4 ranks (plan dp=2, tp=2), launched on 1")
    _, shard_bad = layout(tmp, exe, "shard-bad", [
        (n, dt, [6, 5] if n == "attn.qkv.weight" else shape, v[:30] if n == "attn.qkv.weight"
         else v) for n, dt, shape, v in shard_model()])
    expect_error("shard: init.safetensors must hold the global shape",
                 run(shard_bad, ["--steps", "1", "--data", data], model="shard", world=1),
                 "tensor 'attn.qkv.weight' is F32 [6, 5], expected F32 [12, 5]")

    # --- token data: int32 and uint16, 1 and 2 ranks -------------------------------------
    toks = token_stream()
    with open(P("tok32.bin"), "wb") as f:
        f.write(struct.pack(f"<{N_TOK}i", *toks))
    with open(P("tok16.bin"), "wb") as f:
        f.write(struct.pack(f"<{N_TOK}H", *toks))
    tref_losses, tref_w = tokens_reference(8, toks)
    runs = [("int32", 1, None), ("uint16", 1, None)]
    if MPIRUN:
        runs.append(("int32", 2, 2))
    for dtype, world, ranks in runs:
        f = P("tok32.bin" if dtype == "int32" else "tok16.bin")
        what = f"tokens {dtype}, {world} rank(s)"
        log = P(f"t-{dtype}-{world}.jsonl")
        ck = P(f"tck-{dtype}-{world}")
        res = run(tok, ["--steps", "8", "--data", f, "--data-dtype", dtype, "--log", log,
                        "--save", ck], model="tokens", world=world, ranks=ranks)
        check(res.rc == 0, what + " runs", res.err)
        if res.rc != 0:
            continue
        losses = [r["loss"] for r in read_log(log)]
        check(close(losses, tref_losses), what + ": losses match the reference",
              f"{losses} vs {tref_losses}")
        check("tokens/s" in res.out and "tokens_per_s" in read_log(log)[0],
              what + ": tokens/s reported")
        model, opt, _ = ck_read(ck)
        check(close(model["table.weight"][2], tref_w), what + ": weights match")
        check(sorted(opt) == ["table.weight.exp_avg", "table.weight.exp_avg_sq"],
              what + ": AdamW state names", str(sorted(opt)))

    # --- start-up errors: one line, exit 1, nothing written ------------------------------
    expect_error("missing --steps", run(lin, ["--data", data]), "--steps is required")
    expect_error("unknown flag", run(lin, ["--steps", "1", "--data", data, "--bogus"]),
                 "unknown argument '--bogus'")
    expect_error("bad --steps", run(lin, ["--steps", "x", "--data", data]), "positive integer")
    expect_error("bad --data-dtype", run(tok, ["--steps", "1", "--data", data, "--data-dtype",
                                               "int8"], model="tokens"), "int32, uint16 or int64")
    res = run(lin, ["--help"])
    check(res.rc == 0 and "--data-dtype" in res.out, "--help")
    expect_error("wrong rank count", run(lin, ["--steps", "1", "--data", data], world=2),
                 "compiled for 2 ranks (plan dp=2), launched on 1")
    expect_error("missing data", run(lin, ["--steps", "1", "--data", P("nope.bin")]),
                 "nope.bin: cannot open")

    open(P("empty.bin"), "wb").close()
    expect_error("empty token file", run(tok, ["--steps", "1", "--data", P("empty.bin")],
                                         model="tokens"), "empty.bin: empty file")
    with open(P("odd.bin"), "wb") as f:
        f.write(b"\0" * 10)
    expect_error("token file of odd size",
                 run(tok, ["--steps", "1", "--data", P("odd.bin")], model="tokens"),
                 "10 bytes is not a whole number of int32 tokens")
    with open(P("short.bin"), "wb") as f:
        f.write(struct.pack("<9i", *range(9)))
    expect_error("token file too short",
                 run(tok, ["--steps", "1", "--data", P("short.bin")], model="tokens"),
                 "9 int32 tokens is too short for sequence length 8 (needs at least 10")

    st_write(P("noy.safetensors"), [("x", "F32", [S_LIN, B_LIN, FEAT], x)])
    expect_error("data without an input", run(lin, ["--steps", "1", "--data",
                                                    P("noy.safetensors")]), "no tensor 'y'")
    st_write(P("f64.safetensors"), [("x", "F64", [S_LIN, B_LIN, FEAT], x),
                                    ("y", "F32", [S_LIN, B_LIN], y)])
    expect_error("data of the wrong dtype", run(lin, ["--steps", "1", "--data",
                                                      P("f64.safetensors")]),
                 "tensor 'x' is F64, the model input needs F32")
    st_write(P("shape.safetensors"), [("x", "F32", [S_LIN * 2, B_LIN // 2, FEAT], x),
                                      ("y", "F32", [S_LIN, B_LIN], y)])
    expect_error("data of the wrong shape", run(lin, ["--steps", "1", "--data",
                                                      P("shape.safetensors")]),
                 "tensor 'x' has shape [8, 4, 3], expected [S, 8, 3]")
    with open(P("junk.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", 16) + b"{not json}      ")
    expect_error("data that is not JSON", run(lin, ["--steps", "1", "--data",
                                                    P("junk.safetensors")]),
                 "header is not valid JSON")

    # Bad checkpoints; the --save folder's existing files must survive.
    os.makedirs(P("keep"))
    with open(P("keep", "model.safetensors"), "w") as f:
        f.write("precious")

    def bad_checkpoint(name, tensors, meta=None):
        d = P(name)
        os.makedirs(d)
        st_write(os.path.join(d, "model.safetensors"), tensors, meta)
        st_write(os.path.join(d, "optimizer.safetensors"), [
            ("linear.weight.momentum_buffer", "F32", [FEAT], [0.0] * FEAT),
            ("linear.bias.momentum_buffer", "F32", [1], [0.0])], meta)
        return run(lin, ["--steps", "1", "--data", data, "--load", d, "--save", P("keep"),
                         "--log", P("keep", "log.jsonl")])

    good = [("linear.weight", "F32", [FEAT], [0.0] * FEAT), ("linear.bias", "F32", [1], [0.0]),
            ("steps_seen", "I64", [1], [0])]
    expect_error("checkpoint with a wrong shape",
                 bad_checkpoint("ckshape", [("linear.weight", "F32", [4], [0.0] * 4)] + good[1:],
                                {"step": "1"}),
                 "tensor 'linear.weight' is F32 [4], expected F32 [3]")
    expect_error("checkpoint with a missing tensor",
                 bad_checkpoint("ckmiss", good[:2], {"step": "1"}),
                 "no tensor 'steps_seen' (expected I64 [1])")
    expect_error("checkpoint with an extra tensor",
                 bad_checkpoint("ckextra", good + [("other", "F32", [1], [0.0])], {"step": "1"}),
                 "tensor 'other' is not in the compiled model")
    expect_error("checkpoint without a step", bad_checkpoint("cknostep", good),
                 "no valid \"step\"")
    os.makedirs(P("ckopt"))
    st_write(P("ckopt", "model.safetensors"), good, {"step": "2"})
    expect_error("checkpoint without optimizer state",
                 run(lin, ["--steps", "1", "--data", data, "--load", P("ckopt")]),
                 "optimizer.safetensors: cannot open")
    with open(P("keep", "model.safetensors")) as f:
        check(f.read() == "precious" and sorted(os.listdir(P("keep"))) == ["model.safetensors"],
              "nothing written on a start-up error")

    with open(P("lin", "init.safetensors"), "r+b") as f:
        f.truncate(40)
    expect_error("truncated init.safetensors", run(lin, ["--steps", "1", "--data", data]),
                 "init.safetensors: header length")
    expect_error("--save on a file", run(tok, ["--steps", "1", "--data", P("tok32.bin"),
                                               "--save", P("tok32.bin")], model="tokens"),
                 "--save needs a folder")
    expect_error("--log in a missing folder",
                 run(tok, ["--steps", "1", "--data", P("tok32.bin"), "--log",
                           P("no", "dir", "l.jsonl")], model="tokens"), "cannot create the log")
    expect_error("half-set fault injection",
                 run(tok, ["--steps", "1", "--data", P("tok32.bin")], model="tokens",
                     env={"CARVE_FAULT_RANK": "0"}), "CARVE_FAULT_STEP")

    # --- several ranks: errors, kernel failures, fault injection -------------------------
    if not MPIRUN:
        return
    tokargs = ["--data", P("tok32.bin")]
    res = run(tok, ["--steps", "1"] + tokargs, model="tokens", world=1, ranks=2)
    expect_error("2 ranks for a 1-rank plan", res, "compiled for 1 rank (plan dp=1), "
                 "launched on 2")
    res = run(tok, ["--steps", "1", "--data", P("nope.bin")], model="tokens", world=2, ranks=2)
    expect_error("missing data under mpirun: reported once", res, "[rank 0] carve: error: ")

    # Ranks that disagree (possible with an MPMD launch) still all stop.
    res = run(tok, [], model="tokens", world=2, mpmd=[
        ["--steps", "1"] + tokargs, ["--steps", "1", "--data", P("nope.bin")]])
    expect_error("only rank 1's data missing", res, "[rank 1] carve: error: token file ")
    res = run(tok, [], model="tokens", world=2, mpmd=[
        ["--steps", "1"] + tokargs, ["--steps", "1", "--bogus"] + tokargs])
    expect_error("only rank 1's arguments wrong", res, "[rank 1] carve: error: unknown argument")
    res = run(tok, [], model="tokens", world=2, mpmd=[["--steps", "1"] + tokargs, ["--help"]])
    check(res.rc == 0 and res.out.count("usage:") == 1, "--help on one rank")

    # A token outside the vocabulary that only rank 1 reads, at step 1 (global
    # sequence 2 starts at token 48).
    bad = list(toks)
    bad[50] = 1000
    with open(P("bad.bin"), "wb") as f:
        f.write(struct.pack(f"<{N_TOK}i", *bad))
    res = run(tok, ["--steps", "1000", "--data", P("bad.bin")], model="tokens", world=2,
              ranks=2, timeout=30)
    check(res.rc not in (0, None) and "carve: error:" in res.err and
          "fake tokens model: token 1000" in res.err and res.seconds < 15,
          f"kernel error on rank 1 ends every rank ({res.seconds:.1f}s)",
          f"rc={res.rc} {res.err[-800:]}")

    res = run(tok, ["--steps", "100000"] + tokargs, model="tokens", world=2, ranks=2,
              env={"CARVE_FAULT_RANK": "1", "CARVE_FAULT_STEP": "4"}, timeout=30)
    check(res.rc not in (0, None) and "rank 1" in res.err and "signal 9" in res.err and
          res.seconds < 15 and "step 3/" in res.out and "step 4/" not in res.out,
          f"fault injection: rank 1 killed at the start of step 4, all ranks gone ({res.seconds:.1f}s)",
          f"rc={res.rc} out={res.out[-300:]} err={res.err[-800:]}")


if __name__ == "__main__":
    main()
