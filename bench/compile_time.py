#!/usr/bin/env python3
"""How long the C++ compiler takes on carve's generated CPU programs.

    /usr/bin/python3 bench/compile_time.py [--carve build/bin/carve]
        [--workdir build/bench-compile] [--models gpt,llama,mixtral,bert,resnet18]
        [--baseline REV] [--reps 2]

Exports each reference model of models/reference.py (its default config,
batch 4, sequence 16), compiles it for 1 rank with `carve compile`, then
times the compiler on the generated source, src/program0.cpp, with the flags
`carve compile` uses (build/lib/carve-runtime.txt), the median of --reps runs
(user + system CPU seconds of the compiler, which the machine's other load
moves less than the wall clock).

With --baseline REV, the same source is also compiled against the runtime
headers of git revision REV (`git archive`), with the CARVE_GLUE_BEGIN and
CARVE_GLUE_END lines taken out when REV's headers lack them: what the
program cost to compile before the change, side by side in one run. (The
generated source must still be valid against REV's headers: the calls of
fused chains and kernels are the same.)

Prints a markdown table for docs/performance.md: per model the source's
size, its fused chains and kernel calls, the seconds now and at REV, and
the ratio.
"""

import argparse
import datetime
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def runtime_config(build):
    cfg = {}
    with open(os.path.join(build, "lib", "carve-runtime.txt")) as f:
        for line in f:
            if "=" in line:
                k, v = line.rstrip("\n").split("=", 1)
                cfg[k] = v
    return cfg


def cpu_seconds(cmd):
    """Runs cmd; the user + system seconds of its children."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run(cmd, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        sys.exit("compile failed: %s\n%s" % (" ".join(cmd), r.stderr[-3000:]))
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--carve", default=os.path.join(ROOT, "build", "bin", "carve"))
    ap.add_argument("--workdir", default=os.path.join(ROOT, "build", "bench-compile"))
    ap.add_argument("--models", default="gpt,llama,mixtral,bert,resnet18")
    ap.add_argument("--baseline", help="a git revision whose runtime headers to compare with")
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    build = os.path.dirname(os.path.dirname(os.path.abspath(a.carve)))
    cfg = runtime_config(build)
    flags = cfg["cxxflags"].split()
    w = os.path.abspath(a.workdir)
    os.makedirs(w, exist_ok=True)

    base_inc = None
    if a.baseline:
        base_inc = tempfile.mkdtemp(prefix="carve-baseline-")
        archive = subprocess.run(["git", "-C", ROOT, "archive", a.baseline, "runtime/include"],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", base_inc], input=archive, check=True)
        base_inc = os.path.join(base_inc, "runtime", "include")
        with open(os.path.join(base_inc, "carve", "rt", "program.h")) as f:
            base_has_glue = "CARVE_GLUE_BEGIN" in f.read()

    rows = []
    for model in a.models.split(","):
        onnx = os.path.join(w, model + ".onnx")
        if not os.path.exists(onnx):
            subprocess.run([sys.executable, os.path.join(ROOT, "models", "export.py"), model,
                            "--out", w], check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
        out = os.path.join(w, model)
        shutil.rmtree(out, ignore_errors=True)
        subprocess.run([a.carve, "compile", onnx, "-o", out, "--quiet"], check=True)
        src = os.path.join(out, "src", "program0.cpp")
        with open(src) as f:
            text = f.read()
        chains = len(re.findall(r"^struct Fused\d+ \{", text, re.M))
        calls = int(re.search(r"// (\d+) kernel calls", text).group(1))
        obj = os.path.join(w, model + ".o")
        now_cmd = [cfg["cxx"]] + flags + ["-I" + cfg["include"], "-c", src, "-o", obj]
        runs = {"now": []}
        base_cmd = None
        if base_inc:
            bsrc = src
            if not base_has_glue:
                bsrc = os.path.join(w, model + "-baseline.cpp")
                with open(bsrc, "w") as f:
                    f.write(re.sub(r"^CARVE_GLUE_(BEGIN|END)\n", "", text, flags=re.M))
            base_cmd = [cfg["cxx"]] + flags + ["-I" + base_inc, "-c", bsrc, "-o", obj]
            runs["baseline"] = []
        for _ in range(a.reps):  # alternating, so that both see the same load
            runs["now"].append(cpu_seconds(now_cmd))
            if base_cmd:
                runs["baseline"].append(cpu_seconds(base_cmd))
        row = {"model": model, "kib": len(text) / 1024, "chains": chains, "calls": calls,
               "now": statistics.median(runs["now"])}
        if base_cmd:
            row["baseline"] = statistics.median(runs["baseline"])
        rows.append(row)
        print("%s: %.1f s%s" % (model, row["now"], " (baseline %.1f s)" % row["baseline"]
                                if base_cmd else ""), file=sys.stderr, flush=True)

    print("## Compiling the generated programs (%s, %s, %d cores)\n" %
          (datetime.date.today().isoformat(), platform.node() or "?", os.cpu_count() or 1))
    print("`%s`, CPU seconds of one `%s` run on src/program0.cpp (median of %d)%s.\n" %
          (" ".join(flags), os.path.basename(cfg["cxx"]), a.reps,
           "; baseline: the runtime headers of " + a.baseline if a.baseline else ""))
    head = "| Model | source KiB | fused chains | kernel calls | s now |"
    rule = "|---|---|---|---|---|"
    if a.baseline:
        head += " s at %s | ratio |" % a.baseline
        rule += "---|---|"
    print(head)
    print(rule)
    for r in rows:
        line = "| %s | %.0f | %d | %d | %.1f |" % (r["model"], r["kib"], r["chains"], r["calls"],
                                                  r["now"])
        if a.baseline:
            line += " %.1f | %.2fx |" % (r["baseline"], r["baseline"] / r["now"])
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
