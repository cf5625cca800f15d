#!/usr/bin/env python3
"""`carve verify`: passes on correct plans, fails on a wrong run, refuses bad input.

What must hold:

1. On a small builtin GPT, `carve verify MODEL --plan P` exits 0 and prints
   PASS for dp=2, tp=2 and pp=2 (two micro-batches): its table has one row per
   step with both losses, and the losses it prints are the ones the two runs
   logged (read here from --workdir's .jsonl files, not from verify's output),
   within verify's default 1e-5 relative tolerance.
2. A wrong planned run fails. CARVE_VERIFY_PERTURB=TENSOR (documented fault
   injection, docs/verify.md) scales one tensor of the planned program's
   initial weights by 1.01; verify must exit 1, print FAIL naming that tensor,
   and report a weight difference of about 1e-2 of the tensor's largest entry
   (the perturbation itself; two SGD steps at lr 0.05 move it by less than
   half of that). A correct plan checked with --tolerance-weights 1e-12 must
   fail too: float32 sums in another order leave differences near 1e-7, so
   this shows the comparison really reads both checkpoints.
3. A bf16 plan (dp=2) passes against a bf16 1-rank program: the reference
   plan keeps the plan's precision (and tf32), and the default tolerances
   follow it (losses 1e-4, weights 2^-6: four roundings to bf16, each at
   most 2^-8 of a tensor's largest step).
4. Bad input (missing model or plan, an unknown plan field, a plan that does
   not divide the batch, --steps 0, a --workdir that is not verify's, a
   missing --data file) exits 2 with one 'carve: error: ' line naming the
   thing and the cause, and leaves no temporary folder behind.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import harness  # noqa: E402

MODEL = "builtin:gpt:layers=2,hidden=64,heads=4,seq=16,vocab=128,batch=8"
STEPS = 3
LOSS_RTOL = 1e-5  # verify's default; the test re-checks the logged losses against it
TIMEOUT_S = 300


Failure = harness.Failure


def run(carve, args, env=None):
    full = dict(os.environ, **(env or {}))
    return harness.run([carve, "verify", MODEL] + args, timeout=TIMEOUT_S, env=full)


def table(stdout):
    """[(step, loss 1 rank, loss plan, loss rel, weight rel, tensor)] from verify's output."""
    rows = []
    for m in re.finditer(r"^\s+(\d+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)", stdout, re.M):
        try:
            rows.append((int(m.group(1)), float(m.group(2)), float(m.group(3)),
                         float(m.group(4)), float(m.group(5)), m.group(6)))
        except ValueError:
            continue
    return rows


def losses(path):
    with open(path) as f:
        return [json.loads(line)["loss"] for line in f if line.strip()]


def write_plan(d, name, plan):
    path = os.path.join(d, name + ".json")
    with open(path, "w") as f:
        json.dump(plan, f)
    return path


def check_pass(carve, d, name, plan):
    work = os.path.join(d, "work-" + name)
    rc, out, err = run(carve, ["--plan", write_plan(d, name, plan), "--steps", str(STEPS),
                               "--workdir", work])
    if rc != 0 or "\nPASS: " not in out:
        raise Failure("exit %d, expected 0 and PASS:\n%s%s" % (rc, out, err))
    rows = table(out)
    if [r[0] for r in rows] != list(range(1, STEPS + 1)):
        raise Failure("expected rows for steps 1..%d:\n%s" % (STEPS, out))
    ref = losses(os.path.join(work, "reference.jsonl"))
    got = losses(os.path.join(work, "planned.jsonl"))
    if len(ref) != STEPS or len(got) != STEPS:
        raise Failure("the runs logged %d and %d steps, expected %d" % (len(ref), len(got), STEPS))
    worst = 0.0
    for (k, a, b, _, wrel, _), x, y in zip(rows, ref, got):
        # verify prints 8 decimals: the logged losses must round to them.
        if abs(a - x) > 1e-8 or abs(b - y) > 1e-8:
            raise Failure("step %d: verify printed losses %r, %r; the logs say %r, %r" %
                          (k, a, b, x, y))
        worst = max(worst, abs(x - y) / abs(x))
        if wrel > 1e-4:
            raise Failure("step %d: weight difference %g over 1e-4 yet PASS" % (k, wrel))
    if worst > LOSS_RTOL:
        raise Failure("logged losses differ by %.1e (> %g) yet verify passed" % (worst, LOSS_RTOL))
    return "losses %.1e, weights %.1e" % (worst, max(r[4] for r in rows))


def check_perturbed(carve, d):
    tensor = "h.1.mlp.c_fc.weight"
    rc, out, err = run(carve, ["--plan", write_plan(d, "tp2", {"tp": 2}), "--steps", "2"],
                       env={"CARVE_VERIFY_PERTURB": tensor})
    if rc != 1:
        raise Failure("exit %d, expected 1:\n%s%s" % (rc, out, err))
    fail = [ln for ln in out.splitlines() if ln.startswith("FAIL: ")]
    if len(fail) != 1 or "'%s'" % tensor not in fail[0]:
        raise Failure("expected one FAIL line naming '%s':\n%s" % (tensor, out))
    rows = table(out)
    if len(rows) != 2 or rows[0][5] != tensor or not 5e-3 <= rows[0][4] <= 2e-2:
        raise Failure("step 1 should show '%s' off by ~1e-2:\n%s" % (tensor, out))
    return "FAIL names %s (%.1e)" % (tensor, rows[0][4])


def check_bf16(carve, d):
    """A bf16 plan against a bf16 1-rank program (its reference plan keeps the
    precision) under the bf16 tolerances (losses 1e-4, weights 2^-6)."""
    work = os.path.join(d, "work-dp2-bf16")
    rc, out, err = run(carve, ["--plan", write_plan(d, "dp2-bf16", {"dp": 2, "precision": "bf16"}),
                               "--steps", str(STEPS), "--workdir", work])
    if rc != 0 or "\nPASS: losses within 1.0e-04" not in out or "weights within 1.6e-02" not in out:
        raise Failure("exit %d, expected 0 and PASS at the bf16 tolerances:\n%s%s" % (rc, out, err))
    with open(os.path.join(work, "reference-plan.json")) as f:
        ref = json.load(f)
    if ref.get("precision") != "bf16":
        raise Failure("the reference plan %s does not keep the plan's precision" % ref)
    ref_losses = losses(os.path.join(work, "reference.jsonl"))
    got = losses(os.path.join(work, "planned.jsonl"))
    # Step 1's loss is the forward of the same bf16 weights and batch.
    if abs(ref_losses[0] - got[0]) > 1e-4 * abs(ref_losses[0]):
        raise Failure("step 1's losses %r and %r differ" % (ref_losses[0], got[0]))
    return out.strip().splitlines()[-1]


def check_zero_tolerance(carve, d):
    rc, out, err = run(carve, ["--plan", write_plan(d, "dp2", {"dp": 2}), "--steps", "1",
                               "--tolerance-weights", "1e-12"])
    if rc != 1 or "\nFAIL: step 1: the weights of '" not in out:
        raise Failure("exit %d, expected 1 and a FAIL on the weights:\n%s%s" % (rc, out, err))
    return "rounding-level differences fail a 1e-12 tolerance"


BAD = [
    # name, arguments after MODEL (or with MODEL replaced), expected substrings
    ("missing model", ["--model", "nosuch.onnx", "--plan", "{dp2}"], ["nosuch.onnx", "no such"]),
    ("missing plan", ["--plan", "nosuch.json"], ["nosuch.json", "no such plan file"]),
    ("unknown plan field", ["--plan", "{bad}"], ["unknown field \"dq\""]),
    ("dp does not divide the batch", ["--plan", "{dp3}"],
     ["compiling the planned program failed", "dp=3 does not divide the global batch of 8"]),
    ("steps 0", ["--plan", "{dp2}", "--steps", "0"], ["--steps must be at least 1"]),
    ("foreign workdir", ["--plan", "{dp2}", "--workdir", "{foreign}"],
     ["not a carve verify folder", "refusing"]),
    ("missing data", ["--plan", "{dp2}", "--data", "nosuch.bin"], ["nosuch.bin", "no such"]),
]


def check_bad(carve, d, tmp):
    plans = {"{dp2}": write_plan(d, "dp2", {"dp": 2}), "{dp3}": write_plan(d, "dp3", {"dp": 3}),
             "{bad}": write_plan(d, "bad", {"dq": 3})}
    foreign = os.path.join(d, "foreign")
    os.makedirs(foreign, exist_ok=True)
    with open(os.path.join(foreign, "notes.txt"), "w") as f:
        f.write("not verify's\n")
    plans["{foreign}"] = foreign
    problems = []
    for name, args, expect in BAD:
        args = [plans.get(a, a) for a in args]
        model = MODEL
        if args[0] == "--model":
            model, args = args[1], args[2:]
        p = subprocess.run([carve, "verify", model] + args, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, timeout=TIMEOUT_S,
                           env=dict(os.environ, TMPDIR=tmp))
        lines = p.stderr.strip().splitlines()
        why = []
        if p.returncode != 2:
            why.append("exit %d, expected 2" % p.returncode)
        if len(lines) != 1 or not lines[0].startswith("carve: error: "):
            why.append("stderr is not one 'carve: error: ' line: %r" % p.stderr[:500])
        why += ["does not say %r" % e for e in expect if e not in p.stderr]
        if os.listdir(tmp):
            why.append("left %s in the temporary folder" % os.listdir(tmp))
            for x in os.listdir(tmp):
                shutil.rmtree(os.path.join(tmp, x), ignore_errors=True)
        if why:
            problems.append("%s: %s" % (name, "; ".join(why)))
        else:
            print("  ok   %-30s %s" % (name, lines[0]))
    if sorted(os.listdir(foreign)) != ["notes.txt"]:
        problems.append("the foreign --workdir was written into: %s" % os.listdir(foreign))
    if problems:
        raise Failure("\n  ".join(problems))
    return "%d bad inputs refused" % len(BAD)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--carve", required=True)
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    carve = os.path.abspath(args.carve)
    d = os.path.abspath(args.workdir)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    tmp = tempfile.mkdtemp(prefix="tmp-", dir=d)
    checks = [
        ("dp=2 passes", lambda: check_pass(carve, d, "dp2", {"dp": 2})),
        ("tp=2 passes", lambda: check_pass(carve, d, "tp2", {"tp": 2})),
        ("pp=2 passes", lambda: check_pass(carve, d, "pp2", {"pp": 2, "num_micro_batches": 2})),
        ("a bf16 plan against bf16", lambda: check_bf16(carve, d)),
        ("a perturbed planned run fails", lambda: check_perturbed(carve, d)),
        ("a zero tolerance fails", lambda: check_zero_tolerance(carve, d)),
        ("bad input", lambda: check_bad(carve, d, tmp)),
    ]
    failed = []
    for name, fn in checks:
        try:
            print("ok   %-32s %s" % (name, fn()))
        except (Failure, subprocess.TimeoutExpired, OSError) as e:
            failed.append(name)
            print("FAIL %-32s %s" % (name, e))
        sys.stdout.flush()
    print("%d of %d verify checks passed" % (len(checks) - len(failed), len(checks)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
