#!/usr/bin/env python3
"""Bad plans, launches, data and checkpoints for compile/run/train: each must fail cleanly."""

# Every failure case must end, within its time limit, with a non-zero exit
# status and an error line that names the thing at fault (a file, a field, a
# tensor, a rank) and the cause; no crash, hang or backtrace. A case run
# directly (not through mpirun) must print exactly that one line on stderr.
# Each case points its outputs (`-o OUT`, `--log`, `--save`) at files that
# already exist, and they must be left as they were. A rank that dies must
# take the whole job down within FAULT_LIMIT_S, leaving no process behind.
# Positive controls show that the same programs and data train when nothing
# is wrong. A case whose program could not be compiled fails; nothing is
# skipped.

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import data_gen  # noqa: E402
import st  # noqa: E402

TIMEOUT_S = 60
COMPILE_TIMEOUT_S = 600
FAULT_LIMIT_S = 20
FORBIDDEN = ("Segmentation", "Assertion", "terminate called", "Stack dump", "core dumped",
             "Traceback", "PLEASE submit")
SENTINEL = b"pre-existing output: a run that fails must not touch this file\n"
# Open MPI refuses to start as root unless told, and refuses more ranks than
# cores unless oversubscribed; the case that calls mpirun itself needs both on
# CI hosts (`carve run` must manage on its own).
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1"}


class Case:
    """One command and what its outcome must be.

    `expect` is a list of groups; some line of the output must contain at
    least one string of every group (wording may vary, the facts may not).
    """

    def __init__(self, name, cmd, expect=(), exit_zero=False, guarded=(), env=None,
                 one_line=True, limit=TIMEOUT_S, needs=(), after=None):
        self.name = name
        self.cmd = cmd
        self.expect = [[g] if isinstance(g, str) else list(g) for g in expect]
        self.exit_zero = exit_zero    # a positive control
        self.guarded = list(guarded)  # existing files that must stay byte-identical
        self.env = env or {}
        self.one_line = one_line      # exactly one stderr line (not through mpirun)
        self.limit = limit
        self.needs = list(needs)      # setup steps that must have succeeded
        self.after = after            # extra check: function() -> None or reason
        self.seconds = None           # how long the command ran
        self.output = ""              # its stdout and stderr


# --- Processes ----------------------------------------------------------------

def run_cmd(cmd, timeout, env=None):
    """Runs `cmd` in its own process group, killing the group on timeout.
    Returns (exit code or None on timeout, stdout, stderr, seconds)."""
    full_env = dict(os.environ, **(env or {}))
    start = time.time()
    try:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             start_new_session=True, env=full_env)
    except OSError as e:
        return 127, "", "cannot start %s: %s\n" % (cmd[0], e), 0.0
    try:
        out, err = p.communicate(timeout=timeout)
        code = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        code = None
    return (code, out.decode(errors="replace"), err.decode(errors="replace"),
            time.time() - start)


def processes_mentioning(text):
    """Pids of live processes whose command line contains `text`."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            pids.append(int(entry))
    return pids


def reap(pids):
    """Kills processes this test started (found by processes_mentioning)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def describe_exit(code):
    if code is None:
        return "timeout"
    if code < 0:
        try:
            return "%d (%s)" % (code, signal.Signals(-code).name)
        except ValueError:
            pass
    return str(code)


# --- Setup ----------------------------------------------------------------------

def guard(path):
    """Creates `path` (a file) holding SENTINEL, with its folder."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(SENTINEL)
    return path


def setup(carve, models, root):
    """Compiles the programs and writes the data the cases share.
    Returns (paths, errors): errors maps a setup step to why it failed."""
    d = lambda *p: os.path.join(root, *p)
    mlp = os.path.join(models, "mlp.onnx")
    gpt = os.path.join(models, "gpt.onnx")
    paths, errors = {"mlp": mlp, "gpt": gpt}, {}

    os.makedirs(d("data"))
    mlp_inputs = data_gen.graph_inputs(mlp)
    tensors = data_gen.make_tensors(mlp_inputs, 5, data_gen.class_counts("mlp"))
    paths["mlp_data"] = d("data", "mlp.safetensors")
    data_gen.write_tensors(paths["mlp_data"], tensors)
    paths["mlp_missing_input"] = d("data", "mlp_no_targets.safetensors")
    data_gen.write_tensors(paths["mlp_missing_input"], {"x": tensors["x"]})
    paths["mlp_wrong_shape"] = d("data", "mlp_x_31.safetensors")
    data_gen.write_tensors(paths["mlp_wrong_shape"],
                           {"x": tensors["x"][:, :, :31].copy(), "targets": tensors["targets"]})
    vocab = data_gen.vocab_size(gpt)
    seq = data_gen.graph_inputs(gpt)[0][2][1]
    paths["tokens"] = d("data", "tokens.i32")
    data_gen.write_tokens(paths["tokens"], data_gen.make_tokens(2000, vocab))
    paths["short_tokens"] = d("data", "short.i32")
    data_gen.write_tokens(paths["short_tokens"], data_gen.make_tokens(seq + 1, vocab))
    paths["short_count"] = seq + 1
    # One id outside the vocabulary, at token 37 of the file.
    bad = data_gen.make_tokens(2000, vocab)
    bad[37] = vocab
    paths["bad_id_tokens"] = d("data", "bad_id.i32")
    data_gen.write_tokens(paths["bad_id_tokens"], bad)
    paths["vocab"] = vocab

    for key, model, plan, extra in (("mlp1", mlp, None, []), ("mlp2", mlp, {"dp": 2}, []),
                                    ("gpt1", gpt, None, []),
                                    ("mlp1nw", mlp, None, ["--no-weights"])):
        out = d("programs", key)
        cmd = [carve, "compile", model, "-o", out] + extra
        if plan:
            plan_path = d("programs", key + ".plan.json")
            os.makedirs(os.path.dirname(plan_path), exist_ok=True)
            with open(plan_path, "w") as f:
                json.dump(plan, f)
            cmd[3:3] = ["--plan", plan_path]
        code, out_text, err, _ = run_cmd(cmd, COMPILE_TIMEOUT_S)
        train = os.path.join(out, "bin", "train")
        if code != 0 or not os.access(train, os.X_OK):
            errors[key] = "setup compile failed (exit %s): %s: %s" % (
                describe_exit(code), " ".join(cmd), (err or out_text).strip()[-300:])
        if key == "mlp1nw" and os.path.exists(os.path.join(out, "init.safetensors")):
            errors[key] = "carve compile --no-weights wrote %s/init.safetensors" % out
        paths[key] = out

    # A good checkpoint from a positive run of the single-rank MLP, then two
    # broken copies of it.
    if "mlp1" not in errors:
        good = d("ckpt", "good")
        cmd = [os.path.join(paths["mlp1"], "bin", "train"), "--steps", "2",
               "--data", paths["mlp_data"], "--save", good, "--quiet"]
        code, out_text, err, _ = run_cmd(cmd, TIMEOUT_S)
        if code != 0 or not os.path.isfile(os.path.join(good, "latest")):
            errors["ckpt"] = "setup checkpoint failed (exit %s): %s: %s" % (
                describe_exit(code), " ".join(cmd), (err or out_text).strip()[-300:])
        else:
            # Broken copies in the older full format, which --load still reads.
            weights = st.load_checkpoint(good)
            state = st.load_checkpoint(good, roles=("optimizer_state",))
            for key, edit in (("ckpt_wrong_name", "name"), ("ckpt_wrong_shape", "shape")):
                bad = d("ckpt", key)
                os.makedirs(bad)
                if state:
                    st.save(os.path.join(bad, "optimizer.safetensors"), state, {"step": "2"})
                w = dict(weights)
                if edit == "name":
                    w["fc1.wieght"] = w.pop("fc1.weight")
                else:
                    w["fc1.weight"] = np.zeros((64, 31), np.float32)
                st.save(os.path.join(bad, "model.safetensors"), w, {"step": "2"})
                paths[key] = bad
    else:
        errors["ckpt"] = "no single-rank MLP program to write a checkpoint with"
    return paths, errors


# --- Cases ------------------------------------------------------------------------

def build_cases(carve, root, p, errors):
    d = lambda *parts: os.path.join(root, *parts)
    cases = []

    def plan_file(name, text):
        path = d("plans", name + ".json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
        return path

    def compile_case(name, plan_text, expect, model="mlp", names_plan=True, flags=()):
        """-o names a program compiled before, which a failed compile must keep."""
        plan = plan_file(name, plan_text)
        out = d("out", name)
        if "mlp1" not in errors:
            shutil.copytree(p["mlp1"], out, symlinks=True)
        cases.append(Case(name, [carve, "compile", p[model], "--plan", plan, "-o", out, *flags],
                          expect=([plan] if names_plan else []) + expect, guarded=[out, plan],
                          needs=["mlp1"]))

    # Plans. The MLP's batch is 4.
    compile_case("plan_dp_not_dividing", '{"dp": 3}\n', ["dp", "3", "4"])
    compile_case("plan_unknown_field", '{"dp": 1, "dpp": 2}\n',
                 ["dpp", ("unknown", "unrecognized", "unexpected", "not a plan field")])
    compile_case("plan_recompute_unknown", '{"dp": 1, "recompute": "partial"}\n',
                 ["recompute", "partial", "selective"])
    compile_case("plan_recompute_no_layer", '{"recompute": ["h.*"]}\n',
                 ["recompute_layers", "h.*", "names no layer"], names_plan=False)
    compile_case("plan_prefetch_negative", '{"dp": 2, "zero": 3, "zero3_prefetch_layers": -1}\n',
                 ["zero3_prefetch_layers", "-1", ">= 0"])
    compile_case("plan_prefetch_without_zero3", '{"dp": 2, "zero": 1, "zero3_prefetch_layers": 1}\n',
                 ["zero3_prefetch_layers", "\"zero\": 3"])
    compile_case("bucket_bytes_zero", '{"dp": 2, "zero": 2}\n',
                 ["bucket-bytes", "positive", "0"], names_plan=False, flags=["--bucket-bytes", "0"])
    # Sharding. The GPT has 2 heads, width 32, hidden 128, vocabulary 64.
    compile_case("plan_tp_not_dividing_heads", '{"tp": 4}\n',
                 ["attention", "tp=4", "2 attention heads", "/h.0/attn/"], model="gpt",
                 names_plan=False)
    compile_case("plan_tp_not_dividing_vocab", '{"tp": 3}\n',
                 ["tp=3", "does not divide", "/wte/Gather", "vocab", "64"], model="gpt",
                 names_plan=False)
    compile_case("plan_tp_not_dividing_hidden",
                 '{"tp": 3, "ops": {"/wte/Gather": "replicate"}}\n',
                 ["tp=3", "does not divide", "/h.0/attn/c_attn/MatMul", "96"], model="gpt",
                 names_plan=False)
    compile_case("plan_tp_zero", '{"tp": 0}\n', ["tp", "positive integer"])
    compile_case("plan_zero_stage", '{"dp": 2, "zero": 4}\n', ["zero", "0, 1, 2 or 3"])
    # {"zero": 1} with dp = 1 is valid: ZeRO over one replica, compiled as zero 0 (the
    # planner test plans it).
    compile_case("plan_sp_without_tp", '{"sequence_parallel": true}\n',
                 ["sequence_parallel", "tp"])
    compile_case("plan_ops_no_match", '{"tp": 2, "ops": {"/nowhere/*": "replicate"}}\n',
                 ["ops", "/nowhere/*", "matches no op"], model="gpt")
    compile_case("plan_ops_bad_dim", '{"tp": 2, "ops": {"/h.0/mlp/c_fc/MatMul": {"tp": "q"}}}\n',
                 ["ops", "/h.0/mlp/c_fc/MatMul", "'q'", "does not have"], model="gpt",
                 names_plan=False)
    compile_case("plan_ops_malformed", '{"tp": 2, "ops": {"/h.0/*": {"tp": 3}}}\n',
                 ["ops", "/h.0/*", "replicate"], model="gpt")
    compile_case("plan_malformed_json", '{"dp": 2,\n',
                 [("JSON", "json", "parse", "syntax")])

    def train_args(name, data, extra=()):
        """--data/--log/--save pointing at guarded pre-existing outputs."""
        log = guard(d("out", name, "log.jsonl"))
        save = d("out", name, "save")
        saved = guard(os.path.join(save, "latest"))
        return (["--steps", "3", "--data", data, "--log", log, "--save", save, "--quiet",
                 *extra], [log, saved])

    mlp1_train = os.path.join(p["mlp1"], "bin", "train")
    mlp2_train = os.path.join(p["mlp2"], "bin", "train")
    gpt1_train = os.path.join(p["gpt1"], "bin", "train")

    # Positive controls: the programs and data below are good.
    args, _ = train_args("control_train", p["mlp_data"])
    cases.append(Case("control_train", [mlp1_train, *args], exit_zero=True,
                      needs=["mlp1"], after=log_has(d("out", "control_train", "log.jsonl"), 3)))
    args, _ = train_args("control_tokens", p["tokens"])
    cases.append(Case("control_tokens", [gpt1_train, *args], exit_zero=True, needs=["gpt1"],
                      after=log_has(d("out", "control_tokens", "log.jsonl"), 3)))
    args, _ = train_args("control_run_dp2", p["mlp_data"])
    cases.append(Case("control_run_dp2", [carve, "run", p["mlp2"], "-n", "2", "--", *args],
                      exit_zero=True, needs=["mlp2"], one_line=False,
                      after=log_has(d("out", "control_run_dp2", "log.jsonl"), 3)))
    args, _ = train_args("control_load", p["mlp_data"], ["--load", d("ckpt", "good")])
    cases.append(Case("control_load", [mlp1_train, *args], exit_zero=True,
                      needs=["mlp1", "ckpt"]))

    # A program compiled with --no-weights trains from --load, and without it
    # says where the weights come from.
    nw_train = os.path.join(p["mlp1nw"], "bin", "train")
    args, _ = train_args("control_no_weights_load", p["mlp_data"], ["--load", d("ckpt", "good")])
    cases.append(Case("control_no_weights_load", [nw_train, *args], exit_zero=True,
                      needs=["mlp1nw", "ckpt"]))
    args, guarded = train_args("no_weights", p["mlp_data"])
    cases.append(Case("no_weights", [nw_train, *args],
                      expect=["init.safetensors", "--no-weights", "--load"], guarded=guarded,
                      needs=["mlp1nw"]))

    # Launches with the wrong number of ranks for a dp=2 program.
    args, guarded = train_args("run_rank_mismatch", p["mlp_data"])
    cases.append(Case("run_rank_mismatch", [carve, "run", p["mlp2"], "-n", "3", "--", *args],
                      expect=["3", "2", ("rank", "dp", "process")], guarded=guarded,
                      needs=["mlp2"]))
    # A start-up error under mpirun is one line: mpirun's notices that only
    # repeat that a rank failed are dropped once the rank said why.
    cases.append(Case("run_missing_data_dp2", [carve, "run", p["mlp2"], "-n", "2", "--",
                                               "--steps", "1"],
                      expect=["--data"], needs=["mlp2"]))
    # A training flag given to carve run without the -- before it.
    args, guarded = train_args("run_without_separator", p["mlp_data"])
    cases.append(Case("run_without_separator", [carve, "run", p["mlp2"], "-n", "2", *args],
                      expect=["'--steps'", "put it after --"], guarded=guarded,
                      needs=["mlp2"]))
    args, guarded = train_args("mpirun_rank_mismatch", p["mlp_data"])
    cases.append(Case("mpirun_rank_mismatch", ["mpirun", "-n", "3", mlp2_train, *args],
                      expect=["3", "2", ("rank", "dp", "process")], guarded=guarded,
                      env=MPI_ENV, needs=["mlp2"], one_line=False))

    # --cuda-graph is for CUDA programs; it takes no value.
    args, guarded = train_args("cuda_graph_cpu", p["mlp_data"], ["--cuda-graph"])
    cases.append(Case("cuda_graph_cpu", [mlp1_train, *args],
                      expect=["--cuda-graph", "cuda", "CPU"], guarded=guarded, needs=["mlp1"]))
    args, guarded = train_args("cuda_graph_value", p["mlp_data"], ["--cuda-graph=yes"])
    cases.append(Case("cuda_graph_value", [mlp1_train, *args],
                      expect=["--cuda-graph", "no value"], guarded=guarded, needs=["mlp1"]))
    args, guarded = train_args("no_cuda_graph_value", p["mlp_data"], ["--no-cuda-graph=1"])
    cases.append(Case("no_cuda_graph_value", [mlp1_train, *args],
                      expect=["--no-cuda-graph", "no value"], guarded=guarded, needs=["mlp1"]))
    # Both: the run cannot know which was meant.
    args, guarded = train_args("cuda_graph_both", p["mlp_data"],
                               ["--cuda-graph", "--no-cuda-graph"])
    cases.append(Case("cuda_graph_both", [mlp1_train, *args],
                      expect=["--cuda-graph", "--no-cuda-graph", "contradict"], guarded=guarded,
                      needs=["mlp1"]))

    # Data files.
    missing = d("data", "does_not_exist.bin")
    args, guarded = train_args("missing_data", missing)
    cases.append(Case("missing_data", [mlp1_train, *args],
                      expect=[missing, ("No such file", "cannot open", "cannot read",
                                        "not found", "does not exist")],
                      guarded=guarded, needs=["mlp1"]))
    args, guarded = train_args("short_token_file", p["short_tokens"])
    cases.append(Case("short_token_file", [gpt1_train, *args],
                      expect=[p["short_tokens"], str(p["short_count"]), "token"],
                      guarded=guarded, needs=["gpt1"]))
    args, guarded = train_args("token_outside_vocab", p["bad_id_tokens"])
    cases.append(Case("token_outside_vocab", [gpt1_train, *args],
                      expect=[p["bad_id_tokens"], "token 37", str(p["vocab"]), "vocabulary"],
                      guarded=guarded, needs=["gpt1"]))
    # train --check-data: the same check over the whole file, nothing trained or written.
    args, guarded = train_args("check_data_bad_id", p["bad_id_tokens"], ["--check-data"])
    cases.append(Case("check_data_bad_id", [gpt1_train, *args],
                      expect=[p["bad_id_tokens"], "token 37", str(p["vocab"])],
                      guarded=guarded, needs=["gpt1"]))
    args, guarded = train_args("check_data_good", p["tokens"], ["--check-data"])
    good = Case("check_data_good", [gpt1_train, *args], exit_zero=True, guarded=guarded,
                needs=["gpt1"])
    want = "every token id is below the vocabulary of %d" % p["vocab"]
    good.after = lambda: None if want in good.output else "stdout does not say '%s'" % want
    cases.append(good)
    args, guarded = train_args("tensors_missing_input", p["mlp_missing_input"])
    cases.append(Case("tensors_missing_input", [mlp1_train, *args],
                      expect=[p["mlp_missing_input"], "targets"], guarded=guarded,
                      needs=["mlp1"]))
    args, guarded = train_args("tensors_wrong_shape", p["mlp_wrong_shape"])
    cases.append(Case("tensors_wrong_shape", [mlp1_train, *args],
                      expect=[p["mlp_wrong_shape"], "x", "31", "32"], guarded=guarded,
                      needs=["mlp1"]))

    # Checkpoints.
    for key, expect in (("ckpt_wrong_name", [("fc1.weight", "fc1.wieght")]),
                        ("ckpt_wrong_shape", ["fc1.weight", "31", "32"])):
        ckpt = p.get(key, d("ckpt", key))
        args, guarded = train_args("load_" + key[5:], p["mlp_data"], ["--load", ckpt])
        cases.append(Case("load_" + key[5:], [mlp1_train, *args],
                          expect=[ckpt] + expect, guarded=guarded, needs=["mlp1", "ckpt"]))

    # A rank dies at step 3 of 1000: the job must end, non-zero, naming it.
    args, _ = train_args("rank_dies", p["mlp_data"])
    args[args.index("--steps") + 1] = "1000"
    cases.append(Case("rank_dies", [carve, "run", p["mlp2"], "-n", "2", "--", *args],
                      expect=["rank 1"], env={"CARVE_FAULT_RANK": "1", "CARVE_FAULT_STEP": "3"},
                      one_line=False, limit=FAULT_LIMIT_S, needs=["mlp2"]))
    return cases


def log_has(path, steps):
    def check():
        try:
            with open(path) as f:
                records = [json.loads(line) for line in f if line.strip()]
        except (OSError, ValueError) as e:
            return "cannot read the log %s: %s" % (path, e)
        got = [r.get("step") for r in records]
        return None if got == list(range(1, steps + 1)) else "log steps %s, expected 1..%d" % (
            got, steps)
    return check


# --- Checking -------------------------------------------------------------------

def snapshot(path):
    """relative path -> (mode, content digest) of a file or of every entry under a folder."""
    def entry(full):
        st_ = os.lstat(full)
        if os.path.islink(full):
            return (st_.st_mode, os.readlink(full))
        if os.path.isdir(full):
            return (st_.st_mode, None)
        with open(full, "rb") as f:
            return (st_.st_mode, hashlib.sha256(f.read()).hexdigest())

    if not os.path.lexists(path):
        return {}
    if not os.path.isdir(path):
        return {".": entry(path)}
    out = {}
    for folder, dirs, files in os.walk(path):
        for name in dirs + files:
            full = os.path.join(folder, name)
            out[os.path.relpath(full, path)] = entry(full)
    return out


def mentions(line, text, paths):
    """Whether `line` mentions `text`; a number counts only as a whole number
    outside the command's own paths (which may hold digits)."""
    if not text.isdigit():
        return text in line
    for path in paths:
        line = line.replace(path, "<path>")
    return re.search(r"(?<![\d.])%s(?!\d)" % text, line) is not None


def check(case, errors, program_dirs):
    """Runs one case; returns None on success, else (reason, exit, output)."""
    missing = [errors[n] for n in case.needs if n in errors]
    if missing:
        return missing[0], "not run", ""
    before = {path: snapshot(path) for path in case.guarded}
    code, out, err, case.seconds = run_cmd(case.cmd, case.limit, case.env)
    both = case.output = out + err
    reason = lambda why: (why, describe_exit(code), both)

    # Whatever happened, no process of ours may outlive the command (give
    # processes that are being signalled a moment to go).
    for _ in range(20):
        left = [pid for d in program_dirs for pid in processes_mentioning(d)]
        if not left:
            break
        time.sleep(0.1)
    if left:
        reap(left)
    if code is None:
        return reason("did not end within %d s%s" % (
            case.limit, "; killed the processes left behind: pids %s" % left if left else ""))
    if left:
        return reason("processes still running after the command ended: pids %s" % left)
    for word in FORBIDDEN:
        if word in both:
            return reason("output contains %r" % word)
    for path, was in before.items():
        now = snapshot(path)
        if now != was:
            changed = sorted(k for k in set(was) | set(now) if was.get(k) != now.get(k))
            return reason("the pre-existing %s was modified: %s" % (
                path, ", ".join(changed[:5]) or "removed"))
    if case.after:
        why = case.after()
        if why:
            return reason(why)
    if case.exit_zero:
        return None if code == 0 else reason("a positive control failed")
    if code == 0:
        return reason("expected a non-zero exit")
    lines = [line for line in err.splitlines() if line.strip()]
    if case.one_line and len(lines) != 1:
        return reason("stderr has %d lines, expected one error line" % len(lines))
    candidates = lines if case.one_line else [l for l in both.splitlines() if l.strip()]
    paths = sorted((a for a in case.cmd if os.path.isabs(a)), key=len, reverse=True)
    for line in candidates:
        if all(any(mentions(line, s, paths) for s in group) for group in case.expect):
            return None
    return reason("no error line mentions all of %s" % " and ".join(
        "/".join(repr(s) for s in g) for g in case.expect))


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--carve", required=True, help="path to the carve binary")
    ap.add_argument("--models", required=True,
                    help="exported models (build/test-models); uses opset17/{mlp,gpt}.onnx")
    ap.add_argument("--workdir", required=True, help="scratch folder (recreated)")
    ap.add_argument("--verbose", action="store_true",
                    help="also print the output of the cases that pass")
    args = ap.parse_args()

    carve = os.path.abspath(args.carve)
    models = os.path.join(os.path.abspath(args.models), "opset17")
    root = os.path.join(os.path.abspath(args.workdir), "train_bad_inputs")
    if not os.access(carve, os.X_OK):
        print("FAIL: the carve binary %s is missing or not executable" % carve)
        return 1
    for name in ("mlp", "gpt"):
        if not os.path.isfile(os.path.join(models, name + ".onnx")):
            print("FAIL: %s/%s.onnx is missing (run the export-models test)" % (models, name))
            return 1
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)

    paths, errors = setup(carve, models, root)
    for step, why in sorted(errors.items()):
        print("SETUP FAILED %s: %s" % (step, why))
    cases = build_cases(carve, root, paths, errors)
    names = [c.name for c in cases]
    assert len(names) == len(set(names)), "duplicate case names"
    program_dirs = [paths[k] for k in ("mlp1", "mlp2", "gpt1")]

    passed = failed = 0
    for case in cases:
        result = check(case, errors, program_dirs)
        if result is None:
            passed += 1
            print("PASS %s (%.1f s)" % (case.name, case.seconds))
            if args.verbose:
                for line in case.output.strip().splitlines():
                    print("  | " + line)
        else:
            failed += 1
            why, exit_desc, output = result
            print("FAIL %s: %s (exit=%s)\n  command: %s\n  output: %r" % (
                case.name, why, exit_desc, " ".join(case.cmd), output[-600:]))
        sys.stdout.flush()
    print("%d passed, %d failed" % (passed, failed))
    return 1 if failed or errors else 0


if __name__ == "__main__":
    sys.exit(main())
