#!/usr/bin/env python3
"""Training started by a plain launcher (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT).

What must hold:

1. A dp=2 program started as two plain processes with the launcher variables
   (the TCP world, runtime/src/comm_tcp_*.cpp; the way srun or a torchrun-style launcher
   starts ranks without MPI) trains 6 steps with the same losses as under
   `carve run -n 2` (mpirun): within 1e-6 relative (two-rank sums are the
   same either way; only the order of the final division could differ).
2. A tp=2 program does the same (its collectives go through the same world), and
   so does a pp=2 program of 4 micro-batches whose transfers share one message tag
   over all micro-batches (CARVE_TEST_TAG_WINDOW=1): the TCP world matches equal
   tags from one rank in the order posted, as MPI does.
3. docs/nccl.md's torchrun line, run as written with Debian's torchrun
   (its flags' spellings; 2 processes instead of 8, a free port for the
   agent's store and CARVE_MASTER_PORT for the TCP world), trains the dp=2
   program with the same losses. Skipped, saying so, where torchrun is not
   installed.
4. Malformed variables (a WORLD_SIZE that is not the plan's, a RANK outside
   it, a missing MASTER_PORT) and a rank that never starts stop every started
   rank with one line and a non-zero exit, within --collective-timeout (5 s;
   the check allows 60 s on a loaded machine), never a hang.
"""

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import harness  # noqa: E402

STEPS = 6
RTOL = 1e-6
TIMEOUT_S = 120


Failure = harness.Failure


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def plain(binary, ranks, args, env_extra=None, world=None):
    port = free_port()
    procs = []
    for r in range(ranks):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world or ranks),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(r))
        for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"):
            env.pop(k, None)
        env.update(env_extra or {})
        env = {k: v for k, v in env.items() if v is not None}
        procs.append(subprocess.Popen([binary] + args, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=env))
    outs = []
    for p in procs:
        try:
            so, se = p.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise Failure("a plainly launched rank hung (%s)" % " ".join(args))
        outs.append((p.returncode, so, se))
    return outs


def losses(log):
    return [json.loads(l)["loss"] for l in open(log)]


def torchrun_as_documented(out, data):
    """Part 3: the torchrun command docs/nccl.md gives, with Debian's torchrun."""
    torchrun = shutil.which("torchrun")
    if not torchrun:
        print("skipped: torchrun is not installed (python3-torch): docs/nccl.md's line unchecked")
        return 0
    doc = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs", "nccl.md")
    text = open(doc).read().replace("\\\n", " ")
    line = next((l for l in text.splitlines() if " torchrun " in l and "OUT/bin/train" in l),
                None)
    if line is None:
        raise Failure("docs/nccl.md has no torchrun line starting OUT/bin/train")
    words = line.split()
    flags = words[words.index("torchrun") + 1:words.index("OUT/bin/train")]
    # 2 processes on this machine instead of the line's 8.
    flags = ["2" if i > 0 and flags[i - 1].startswith("--nproc") else f
             for i, f in enumerate(flags)]
    env = dict(os.environ, CARVE_MASTER_PORT=str(free_port()))
    # Debian 12's torchrun (1.13 on Python 3.11) parses these flags and then
    # fails before starting any process (its Std.from_str returns None under
    # 3.11's enums: AttributeError in to_map). Probe with /bin/true: the
    # flags must parse either way; training is checked where it can start.
    probe = subprocess.run([torchrun, *flags, "--master_port", str(free_port()), "/bin/true"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                           timeout=TIMEOUT_S)
    if "unrecognized arguments" in probe.stderr or "usage:" in probe.stderr:
        raise Failure("torchrun rejects docs/nccl.md's flags (%s):\n%s" % (
            " ".join(flags), probe.stderr[-2000:]))
    if probe.returncode != 0:
        if "'NoneType' object has no attribute 'get'" in probe.stderr:
            print("skipped: docs/nccl.md's torchrun flags (%s) parse, but this torchrun cannot "
                  "start any program (Debian 12's 1.13 on Python 3.11: AttributeError in "
                  "to_map); training under torchrun is unchecked here" % " ".join(flags))
            return 0
        raise Failure("torchrun %s /bin/true failed (%d):\n%s" % (
            " ".join(flags), probe.returncode, probe.stderr[-2000:]))
    log = out + "-torchrun.jsonl"
    p = subprocess.run([torchrun, *flags, "--master_port", str(free_port()),
                        os.path.join(out, "bin", "train"), "--steps", str(STEPS), "--data", data,
                        "--log", log, "--quiet"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                       timeout=TIMEOUT_S)
    if p.returncode != 0:
        raise Failure("docs/nccl.md's torchrun line (%s) failed (%d):\n%s%s" % (
            " ".join(flags), p.returncode, p.stdout[-2000:], p.stderr[-2000:]))
    m, q = losses(out + "-mpi.jsonl"), losses(log)
    worst = max(abs(x - y) / abs(x) for x, y in zip(m, q))
    if len(q) != STEPS or worst > RTOL:
        raise Failure("torchrun losses %s, mpirun %s" % (q, m))
    print("ok: docs/nccl.md's torchrun line (torchrun %s) trains dp2 within %.2g of mpirun" % (
        " ".join(flags), worst))
    return 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--carve", required=True)
    ap.add_argument("--models", required=True)
    ap.add_argument("--workdir", required=True)
    a = ap.parse_args()
    shutil.rmtree(a.workdir, ignore_errors=True)
    os.makedirs(a.workdir)
    w = a.workdir
    onnx = os.path.join(a.models, "opset17", "gpt.onnx")
    data = os.path.join(w, "tokens.bin")
    data_gen = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data_gen.py")
    subprocess.run([sys.executable, data_gen, "tokens", "--model", onnx, "--tokens", "8192",
                    data], check=True, stdout=subprocess.DEVNULL)
    checks = 0
    # pp2-shared-tags: a pipeline whose micro-batches share each transfer's message tag
    # (CARVE_TEST_TAG_WINDOW=1, docs/pipeline.md), so the TCP world must match equal tags
    # from one rank in the order they were posted, as MPI does.
    for name, plan, env in [("dp2", {"dp": 2}, None), ("tp2", {"tp": 2}, None),
                            ("pp2-shared-tags", {"pp": 2, "num_micro_batches": 4},
                             {"CARVE_TEST_TAG_WINDOW": "1"})]:
        out = os.path.join(w, name)
        with open(out + ".json", "w") as f:
            json.dump(plan, f)
        subprocess.run([a.carve, "compile", onnx, "--plan", out + ".json", "-o", out, "--quiet"],
                       check=True, env=dict(os.environ, **(env or {})))
        if env:
            src = open(os.path.join(out, "src", "program0.cpp")).read()
            if "ppComm->sendAsync(" not in src or " + mb" in src:
                raise Failure("%s: the transfers do not share their tags over micro-batches"
                              % name)
        p = subprocess.run([a.carve, "run", out, "-n", "2", "--", "--steps", str(STEPS),
                            "--data", data, "--log", out + "-mpi.jsonl", "--quiet"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           timeout=TIMEOUT_S)
        if p.returncode != 0:
            raise Failure("%s under mpirun failed:\n%s" % (name, p.stderr))
        res = plain(os.path.join(out, "bin", "train"), 2,
                    ["--steps", str(STEPS), "--data", data, "--log", out + "-plain.jsonl",
                     "--quiet"])
        for r, (rc, so, se) in enumerate(res):
            if rc != 0:
                raise Failure("%s: plainly launched rank %d failed (%d):\n%s%s" %
                              (name, r, rc, so, se))
        m, q = losses(out + "-mpi.jsonl"), losses(out + "-plain.jsonl")
        worst = max(abs(x - y) / abs(x) for x, y in zip(m, q))
        if len(m) != STEPS or len(q) != STEPS or worst > RTOL:
            raise Failure("%s: plain launcher losses %s, mpirun %s" % (name, q, m))
        print("ok: %s from a plain launcher (TCP world) within %.2g of mpirun over %d steps" %
              (name, worst, STEPS))
        checks += 1

    checks += torchrun_as_documented(os.path.join(w, "dp2"), data)

    binary = os.path.join(w, "dp2", "bin", "train")
    args = ["--steps", "1", "--data", data, "--collective-timeout", "5"]
    for what, ranks, world, extra, needle in [
            ("WORLD_SIZE 3 for a 2-rank plan", 3, 3, None, "rank"),
            ("RANK outside WORLD_SIZE", 1, 1, {"RANK": "5"}, "RANK"),
            ("no MASTER_PORT", 2, 2, {"MASTER_PORT": None}, "MASTER_PORT"),
            ("rank 1 never starts (--collective-timeout 5)", 1, 2, None, "rank")]:
        began = time.time()
        res = plain(binary, ranks, args, extra, world)
        took = time.time() - began
        if took > 60:
            raise Failure("%s: the ranks took %.0f s to give up (--collective-timeout 5)" %
                          (what, took))
        bad = [r for r in res if r[0] != 0]
        lines = [l for r in res for l in r[2].splitlines() if "error" in l]
        if len(bad) != len(res) or not lines or not any(needle in l for l in lines):
            raise Failure("%s: expected every rank to fail with a line about %r, got %s" %
                          (what, needle, [(r[0], r[2]) for r in res]))
        print("ok: %s: %s" % (what, lines[0].strip()))
        checks += 1
    print("launcher: %d checks passed" % checks)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Failure as e:
        print("FAIL: %s" % e)
        sys.exit(1)
