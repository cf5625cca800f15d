#!/usr/bin/env python3
"""Failure handling of training programs: dying and stopped ranks, NaN/Inf, progress display."""

# A tiny builtin GPT is compiled for 1 rank, dp=2, tp=2, pp=2 (2 micro-batches),
# dp=2 with ZeRO-2 and ZeRO-3, and bf16 (16-bit gradients) dp=2 and dp=2 with
# ZeRO-2, then:
#
# 1. A rank killed with SIGKILL (by the fault injection at a step's start, and
#    from outside while it trains) or crashing with SIGSEGV must take every
#    rank down within
#    FAULT_LIMIT_S, exit non-zero, and `carve run` must name the rank and the
#    signal. No process of the job may be left.
# 2. A rank stopped with SIGSTOP must make the others give up after
#    --collective-timeout (not before it, and within TIMEOUT_MARGIN_S after it),
#    naming the operation, the group, the step and the suspect rank.
# 3. --on-nan stop (the default): a NaN planted in a gradient (or the loss, or a
#    weight of init.safetensors) stops the run with exit 1 and one message that
#    names the step and the first tensor at fault, on 1 rank and on several
#    (poisoned on one rank only, so the ranks must agree).
# 4. --on-nan skip: the poisoned step's update is skipped on every rank. Under
#    every plan, a run of K+1 steps whose step K+1 (steps numbered from 1, as
#    the log numbers them) is poisoned must end with the weights and optimizer
#    state of the K-step run bit for bit (nothing of step K+1 applied), and
#    report the skip on stdout and in the log. A control run
#    without poison must differ (the comparison can fail).
# 5. The progress display in lines mode has every field, shows the first 10
#    steps and the last, honours --progress-every; bar mode rewrites one line;
#    auto gives lines when stdout is a pipe, also under mpirun; none prints no
#    progress; bad values of the new flags are one-line errors.
#
# Every command runs in its own process group with a time limit and the group
# is killed when it overruns, so a broken build cannot hang the test.

import argparse
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
import harness  # noqa: E402

MODEL = "builtin:gpt:layers=2,hidden=64,heads=4,seq=16,vocab=128,batch=8"
PLANS = {
    "1rank": (None, 1),
    "dp2": ({"dp": 2}, 2),
    "tp2": ({"tp": 2}, 2),
    "pp2": ({"pp": 2, "num_micro_batches": 2}, 2),
    "zero2": ({"dp": 2, "zero": 2}, 2),
    "zero3": ({"dp": 2, "zero": 3}, 2),
    # 16-bit gradients (carve-store-grads16): the NaN is planted, and looked
    # for, in 16 bits; whole under dp, this rank's chunk under ZeRO-2.
    "bf16-dp2": ({"dp": 2, "precision": "bf16"}, 2),
    "bf16-zero2": ({"dp": 2, "zero": 2, "precision": "bf16"}, 2),
}
RUN_LIMIT_S = 60
COMPILE_LIMIT_S = 300
# Open MPI notices a dead rank and kills the rest within about a second; the
# margin covers a loaded 2-core CI machine.
FAULT_LIMIT_S = 20
TIMEOUT_S = 3            # --collective-timeout of the SIGSTOP cases
TIMEOUT_MARGIN_S = 12    # polling granularity, MPI_Abort and the launcher's exit
SKIP_STEP = 3            # the clean steps before the poisoned one (step 4) of the skip cases
POISON = "h.0.mlp.c_fc.weight"
POISON_PP = "h.1.mlp.c_fc.weight"  # on pipeline rank 1
FORBIDDEN = ("Segmentation", "Assertion", "terminate called", "Traceback", "core dumped")


Failure = harness.Failure


class Result:
    def __init__(self, rc, out, err, seconds):
        self.rc, self.out, self.err, self.seconds = rc, out, err, seconds

    def show(self):
        return "rc=%s after %.1fs\n--- stdout\n%s\n--- stderr\n%s" % (
            self.rc, self.seconds, self.out[-1500:], self.err[-2500:])


def start(cmd, env=None):
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, env=dict(os.environ, **(env or {})))


def finish(p, began, limit):
    """Waits for `p` up to `limit` seconds from `began`; kills its process
    group when it overruns (rc None)."""
    try:
        out, err = p.communicate(timeout=max(0.1, limit - (time.time() - began)))
        rc = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        rc = None
    return Result(rc, out.decode(errors="replace"), err.decode(errors="replace"),
                  time.time() - began)


def run(cmd, env=None, limit=RUN_LIMIT_S):
    began = time.time()
    try:
        p = start(cmd, env)
    except OSError as e:
        return Result(127, "", "cannot start %s: %s" % (cmd[0], e), 0.0)
    return finish(p, began, limit)


def job_processes(out_dir):
    """Pids of live processes running OUT/bin/train."""
    exe = os.path.join(out_dir, "bin", "train")
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and cmdline and os.path.abspath(cmdline[0].decode(errors="replace")) == exe:
            pids.append(int(entry))
    return pids


def rank_pid(out_dir, rank):
    """The pid of world rank `rank` of a job of OUT/bin/train, or None."""
    for pid in job_processes(out_dir):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if b"OMPI_COMM_WORLD_RANK=%d" % rank in env:
            return pid
    return None


def reap(out_dir):
    """Kills what is left of a job; returns how many processes were left."""
    left = job_processes(out_dir)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return len(left)


def read_log(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class Suite:
    def __init__(self, args):
        self.carve = args.carve
        self.work = args.workdir
        self.failures = []
        self.passed = 0

    def check(self, ok, what, detail=""):
        if ok:
            self.passed += 1
            print("ok    " + what)
        else:
            self.failures.append(what)
            print("FAIL  " + what + ("\n" + detail if detail else ""))
        sys.stdout.flush()

    def path(self, *parts):
        return os.path.join(self.work, *parts)

    def train(self, plan, args, env=None, limit=RUN_LIMIT_S):
        ranks = PLANS[plan][1]
        return run([self.carve, "run", self.path(plan), "-n", str(ranks), "--",
                    "--data", self.data, *args], env=env, limit=limit)

    def no_crash(self, res):
        return not any(f in res.out + res.err for f in FORBIDDEN)

    # --- Setup -------------------------------------------------------------------

    def setup(self):
        if os.path.isdir(self.work):
            shutil.rmtree(self.work)
        os.makedirs(self.work)
        self.data = self.path("tokens.bin")
        data_gen.write_tokens(self.data, data_gen.make_tokens(20000, 128, seed=3))
        for name, (plan, _) in PLANS.items():
            cmd = [self.carve, "compile", MODEL, "-o", self.path(name), "--quiet"]
            if plan:
                with open(self.path(name + ".json"), "w") as f:
                    json.dump(plan, f)
                cmd += ["--plan", self.path(name + ".json")]
            res = run(cmd, limit=COMPILE_LIMIT_S)
            if res.rc != 0:
                raise Failure("cannot compile %s:\n%s" % (name, res.show()))

    # --- 1. Dead ranks -----------------------------------------------------------

    def killed_by_fault(self):
        res = self.train("dp2", ["--steps", "100000", "--progress", "lines"],
                         env={"CARVE_FAULT_RANK": "1", "CARVE_FAULT_STEP": "4"},
                         limit=FAULT_LIMIT_S)
        left = reap(self.path("dp2"))
        summary = [ln for ln in res.err.splitlines() if ln.startswith("carve: error:")]
        self.check(res.rc not in (0, None) and left == 0 and res.seconds < FAULT_LIMIT_S and
                   any("rank 1" in ln and "SIGKILL" in ln for ln in summary) and
                   "step 3/" in res.out and "step 4/" not in res.out,
                   "dp2: rank 1 SIGKILLed at the start of step 4: job gone in %.1fs, rank and signal named"
                   % res.seconds, res.show() + "\nleft: %d" % left)

    def killed_alone(self):
        # One rank runs without mpirun; carve run still says how it ended.
        res = self.train("1rank", ["--steps", "100000", "--progress", "none"],
                         env={"CARVE_FAULT_RANK": "0", "CARVE_FAULT_STEP": "2"},
                         limit=FAULT_LIMIT_S)
        left = reap(self.path("1rank"))
        lines = res.err.strip().splitlines()
        self.check(res.rc == 128 + 9 and left == 0 and len(lines) == 1 and
                   lines[0].startswith("carve: error: rank 0 ") and "SIGKILL" in lines[0],
                   "1rank: the only rank SIGKILLed: %s" % (lines[0] if lines else "no message"),
                   res.show())

    def crashed(self):
        res = self.train("pp2", ["--steps", "100000", "--progress", "none"],
                         env={"CARVE_FAULT_RANK": "1", "CARVE_FAULT_STEP": "2",
                              "CARVE_FAULT_SIGNAL": "SEGV"}, limit=FAULT_LIMIT_S)
        left = reap(self.path("pp2"))
        summary = [ln for ln in res.err.splitlines() if ln.startswith("carve: error:")]
        self.check(res.rc not in (0, None) and left == 0 and
                   any("rank 1" in ln and "SIGSEGV" in ln for ln in summary),
                   "pp2: rank 1 crashes (SIGSEGV) at step 2: job gone in %.1fs, rank and signal "
                   "named" % res.seconds, res.show() + "\nleft: %d" % left)

    def killed_from_outside(self):
        out = self.path("tp2")
        log = self.path("outside.jsonl")
        began = time.time()
        try:
            p = start([self.carve, "run", out, "-n", "2", "--", "--data", self.data, "--steps",
                       "100000", "--log", log, "--progress", "none"])
        except OSError as e:
            self.check(False, "tp2: rank 1 killed from outside mid-run", str(e))
            return
        victim = None
        while time.time() - began < RUN_LIMIT_S and p.poll() is None:
            if os.path.exists(log) and len(open(log).readlines()) >= 3:
                victim = rank_pid(out, 1)
                if victim:
                    break
            time.sleep(0.05)
        if victim:
            os.kill(victim, signal.SIGKILL)
        killed = time.time()
        res = finish(p, killed, FAULT_LIMIT_S)
        left = reap(out)
        self.check(victim is not None and res.rc not in (0, None) and left == 0 and
                   "rank 1" in res.err and "SIGKILL" in res.err,
                   "tp2: rank 1 killed from outside mid-run: job gone in %.1fs, rank named"
                   % res.seconds, res.show() + "\nvictim %s, left %d" % (victim, left))

    # --- 2. Stopped ranks --------------------------------------------------------

    def stopped(self, plan, expect_op):
        res = self.train(plan, ["--steps", "100000", "--collective-timeout", str(TIMEOUT_S),
                                "--progress", "none"],
                         env={"CARVE_FAULT_RANK": "1", "CARVE_FAULT_STEP": "4",
                              "CARVE_FAULT_SIGNAL": "STOP"},
                         limit=TIMEOUT_S + TIMEOUT_MARGIN_S + 10)
        left = reap(self.path(plan))
        line = next((ln for ln in res.err.splitlines() if "did not complete in" in ln), "")
        ok = (res.rc not in (0, None) and left == 0 and
              TIMEOUT_S <= res.seconds < TIMEOUT_S + TIMEOUT_MARGIN_S and
              line.startswith("carve: rank 0: ") and any(op in line for op in expect_op) and
              "(step 4" not in line and ", step 4)" in line and
              "did not complete in %d s" % TIMEOUT_S in line and "rank" in line.split(";")[-1] and
              "1" in line.split(";")[-1] and self.no_crash(res))
        self.check(ok, "%s: rank 1 SIGSTOPped: rank 0 gives up after %.1fs naming '%s'"
                   % (plan, res.seconds, expect_op), res.show() + "\nleft: %d" % left)

    # --- 3. --on-nan stop -----------------------------------------------------------

    def nan_stop(self, plan, tensor, expect, rank=None):
        log = self.path("stop-%s-%s.jsonl" % (plan, tensor))
        env = {"CARVE_FAULT_NAN_STEP": "3", "CARVE_FAULT_NAN_TENSOR": tensor}
        if rank is not None:
            env["CARVE_FAULT_NAN_RANK"] = str(rank)
        res = self.train(plan, ["--steps", "6", "--log", log, "--progress", "lines"], env=env)
        errors = [ln for ln in res.err.splitlines() if "carve: error:" in ln]
        try:
            records = read_log(log)
        except (OSError, ValueError) as e:
            records = [str(e)]
        ok = (res.rc == 1 and len(errors) == 1 and "step 3:" in errors[0] and
              all(e in errors[0] for e in expect) and "step 3/" in res.out and
              "step 4/" not in res.out and [r.get("step") for r in records] == [1, 2, 3] and
              records[2].get("skipped") is False and self.no_crash(res))
        self.check(ok, "%s: NaN in %s at step 3%s stops the run: %s" % (
            plan, tensor, "" if rank is None else " (rank %d only)" % rank,
            errors[0] if errors else "no error"), res.show() + "\nlog: %s" % records)

    def nan_weight(self):
        # A NaN planted in the initial weights: the first step's loss is NaN and
        # the message names the parameter.
        src, dst = self.path("1rank"), self.path("1rank-nan")
        shutil.copytree(src, dst)
        init = os.path.join(dst, "init.safetensors")
        tensors, meta = st.load(init, with_metadata=True)
        tensors["wpe.weight"][3, 5] = np.nan
        st.save(init, tensors, meta)
        res = run([self.carve, "run", dst, "-n", "1", "--", "--data", self.data, "--steps", "4"])
        errors = [ln for ln in res.err.splitlines() if "carve: error:" in ln]
        self.check(res.rc == 1 and len(errors) == 1 and "step 1:" in errors[0] and
                   "the loss is nan" in errors[0] and "'wpe.weight'" in errors[0],
                   "NaN planted in init.safetensors' wpe.weight: stop at step 1 naming the loss "
                   "and the weight", res.show())

    # --- 4. --on-nan skip ------------------------------------------------------------

    def nan_skip(self, plan):
        k = SKIP_STEP
        poison = POISON_PP if plan == "pp2" else POISON
        before, skipped = self.path("ck-%s-before" % plan), self.path("ck-%s-skip" % plan)
        log = self.path("skip-%s.jsonl" % plan)
        a = self.train(plan, ["--steps", str(k), "--save", before, "--progress", "none"])
        env = {"CARVE_FAULT_NAN_STEP": str(k + 1), "CARVE_FAULT_NAN_TENSOR": poison}
        if plan != "1rank":
            env["CARVE_FAULT_NAN_RANK"] = "1"  # one rank only: the ranks must agree
        b = self.train(plan, ["--steps", str(k + 1), "--save", skipped, "--log", log,
                              "--on-nan", "skip", "--progress", "lines"], env=env)
        if a.rc != 0 or b.rc != 0:
            self.check(False, "%s: --on-nan skip runs" % plan, a.show() + "\n" + b.show())
            return
        roles = ("parameter", "buffer", "optimizer_state")
        wa = st.load_checkpoint(before, roles)
        wb = st.load_checkpoint(skipped, roles)
        differ = sorted(n for n in wa if n not in wb or wa[n].tobytes() != wb[n].tobytes())
        records = read_log(log)
        last = records[-1] if records else {}
        reported = re.search(r"carve: step %d: non-finite gradient of '%s'.*update skipped on "
                             r"every rank" % (k + 1, re.escape(poison)), b.out)
        self.check(not differ and len(wa) == len(wb) and len(wa) > 0 and reported is not None and
                   "1 update skipped" in b.out and last.get("step") == k + 1 and
                   last.get("skipped") is True and last.get("nonfinite") == poison and
                   last.get("skipped_steps") == 1,
                   "%s: step %d poisoned on %s, --on-nan skip: weights and optimizer state equal "
                   "the %d-step run's (%d tensors), skip reported" % (
                       plan, k + 1, "rank 1" if plan != "1rank" else "the only rank", k, len(wa)),
                   "differ: %s\nlog: %s\n%s" % (differ[:5], records[-2:], b.show()))
        if plan == "1rank":
            control = self.path("ck-control")
            c = self.train(plan, ["--steps", str(k + 1), "--save", control, "--progress", "none"])
            wc = st.load_checkpoint(control, roles) if c.rc == 0 else {}
            changed = [n for n in wa if n in wc and wa[n].tobytes() != wc[n].tobytes()]
            self.check(c.rc == 0 and len(changed) == len(wa),
                       "control: without poison step %d changes all %d tensors" % (k + 1, len(wa)),
                       c.show())

    # --- 5. Progress and flags ---------------------------------------------------

    def progress(self):
        line_re = re.compile(r"^step (\d+)/15  loss \d+\.\d+  \d+ tokens/s  elapsed \d+\.\d+s  "
                             r"eta \d+\.\ds  peak rss \d+\.\d [kMG]B$")
        res = self.train("1rank", ["--steps", "15", "--progress", "lines"])
        shown = [int(m.group(1)) for m in map(line_re.match, res.out.splitlines()) if m]
        summary = re.search(r"^carve: trained steps 1 to 15 in \S+ \(\d+ tokens/s on average\); "
                            r"peak rss \d+\.\d [kMG]B \(rank 0\)$", res.out, re.M)
        self.check(res.rc == 0 and shown == list(range(1, 11)) + [15] and summary is not None,
                   "lines: every field, steps 1-10 and 15 shown (%s), summary line" % shown,
                   res.show())
        res = self.train("1rank", ["--steps", "15", "--progress", "lines",
                                   "--progress-every", "4"])
        shown = [int(m.group(1)) for m in map(line_re.match, res.out.splitlines()) if m]
        self.check(res.rc == 0 and shown == list(range(1, 11)) + [12, 15],
                   "lines with --progress-every 4: steps %s" % shown, res.show())
        res = self.train("1rank", ["--steps", "15", "--progress", "bar"])
        bar = [ln for ln in res.out.split("\n") if "\r" in ln]
        self.check(res.rc == 0 and len(bar) == 1 and bar[0].count("\rstep ") >= 2 and
                   bar[0].endswith("\033[K") and "\rstep 15/15  loss " in bar[0],
                   "bar: one line rewritten in place, ending with step 15/15", repr(res.out[-600:]))
        # Under mpirun a rank's stdout is a pseudo-terminal even when ours is a
        # pipe: auto must still choose lines.
        res = self.train("dp2", ["--steps", "3"])
        self.check(res.rc == 0 and "\r" not in res.out and "\nstep 3/3  loss " in res.out,
                   "auto under mpirun with stdout a pipe: plain lines", repr(res.out[-600:]))
        res = self.train("1rank", ["--steps", "3", "--progress", "none"])
        self.check(res.rc == 0 and "step " not in res.out and "trained steps 1 to 3" in res.out,
                   "none: no progress lines, the summary stays", res.show())

    def bad_flags(self):
        for args, expect in ((["--on-nan", "ignore"], "--on-nan is stop or skip, not 'ignore'"),
                             (["--collective-timeout", "-1"],
                              "--collective-timeout needs a number of seconds >= 0, not '-1'"),
                             (["--collective-timeout", "soon"], "not 'soon'"),
                             (["--progress", "fancy"], "--progress is auto, bar, lines or none"),
                             (["--progress-every", "0"], "--progress-every needs a positive")):
            res = self.train("1rank", ["--steps", "2", *args])
            lines = res.err.strip().splitlines()
            self.check(res.rc == 1 and len(lines) == 1 and expect in lines[0] and
                       "step " not in res.out,
                       "bad flag %s: %s" % (" ".join(args), lines[0] if lines else ""), res.show())
        env = {"CARVE_FAULT_NAN_STEP": "1", "CARVE_FAULT_NAN_TENSOR": "no.such.weight"}
        res = self.train("1rank", ["--steps", "2"], env=env)
        self.check(res.rc == 1 and "CARVE_FAULT_NAN_TENSOR" in res.err and
                   "no.such.weight" in res.err, "NaN injection of an unknown tensor is refused",
                   res.show())


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--carve", required=True)
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    if shutil.which("mpirun") is None:
        print("FAIL  mpirun is not installed (Debian package openmpi-bin): the multi-rank "
              "cases cannot run")
        return 1
    suite = Suite(args)
    began = time.time()
    try:
        suite.setup()
    except Failure as e:
        print("FAIL  setup: %s" % e)
        return 1
    suite.killed_by_fault()
    suite.killed_from_outside()
    suite.crashed()
    suite.killed_alone()
    suite.stopped("dp2", ["all-reduce over dp"])
    # Rank 0 waits either for its activations' send or for the gradients' receive.
    suite.stopped("pp2", ["receive from rank 1 over pp", "send to rank 1 over pp"])
    suite.nan_stop("1rank", POISON, ["non-finite gradient of '%s'" % POISON])
    suite.nan_stop("1rank", "loss", ["the loss is nan"])
    suite.nan_stop("tp2", POISON, ["non-finite gradient of '%s'" % POISON], rank=1)
    suite.nan_stop("pp2", "loss", ["the loss is not finite"], rank=1)
    suite.nan_weight()
    for plan in PLANS:
        suite.nan_skip(plan)
    suite.progress()
    suite.bad_flags()
    print("%d passed, %d failed in %.0fs" % (suite.passed, len(suite.failures),
                                            time.time() - began))
    for f in suite.failures:
        print("  failed: " + f)
    return 1 if suite.failures else 0


if __name__ == "__main__":
    sys.exit(main())
