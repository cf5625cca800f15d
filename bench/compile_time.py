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

    /usr/bin/python3 bench/compile_time.py --layers 12,48 [--width 256]

instead measures how the program grows with depth: the GPT of
models/reference.py at each number of layers (width 256, 4 heads, batch 4,
sequence 16), its generated source's lines, `carve compile --no-build`'s
wall seconds and the C++ compiler's CPU seconds on it, each as a ratio to
the first depth's (the aim: one function per repeated layer, so that 48
layers print less than 1.6x the lines of 12 and compile in less than 2x
the time).
"""

import argparse
import datetime
import json
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


def depth_scaling(a, cfg, flags, w):
    """--layers: the GPT at each depth; lines and seconds against the first depth's."""
    import time
    rows = []
    for n in [int(x) for x in a.layers.split(",")]:
        d = os.path.join(w, "gpt-%d" % n)
        os.makedirs(d, exist_ok=True)
        onnx = os.path.join(d, "gpt.onnx")
        if not os.path.exists(onnx):
            config = {"n_layer": n, "n_embd": a.width, "n_head": 4, "block_size": 16}
            subprocess.run([sys.executable, os.path.join(ROOT, "models", "export.py"), "gpt",
                            "--out", d, "--config", json.dumps(config)], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        out = os.path.join(d, "out")
        shutil.rmtree(out, ignore_errors=True)
        began = time.time()
        subprocess.run([a.carve, "compile", onnx, "-o", out, "--quiet", "--no-build"], check=True)
        carve_s = time.time() - began
        src = os.path.join(out, "src", "program0.cpp")
        with open(src) as f:
            lines = sum(1 for _ in f)
        obj = os.path.join(d, "program0.o")
        cmd = [cfg["cxx"]] + flags + ["-I" + cfg["include"], "-c", src, "-o", obj]
        cxx_s = statistics.median(cpu_seconds(cmd) for _ in range(a.reps))
        rows.append((n, lines, carve_s, cxx_s))
        print("%d layers: %d lines, carve %.1f s, c++ %.1f s" % (n, lines, carve_s, cxx_s),
              file=sys.stderr, flush=True)
    print("## Program size and compile time against depth (%s, %s, %d cores)\n" %
          (datetime.date.today().isoformat(), platform.node() or "?", os.cpu_count() or 1))
    print("GPT of models/reference.py, width %d, 1 rank; `carve compile --no-build` wall "
          "seconds, then CPU seconds of `%s %s` on src/program0.cpp (median of %d).\n" %
          (a.width, os.path.basename(cfg["cxx"]), " ".join(flags), a.reps))
    print("| Layers | lines | ratio | carve compile s | ratio | C++ s | ratio |")
    print("|---|---|---|---|---|---|---|")
    n0, l0, c0, x0 = rows[0]
    for n, lines, carve_s, cxx_s in rows:
        print("| %d | %d | %.2fx | %.1f | %.2fx | %.1f | %.2fx |" %
              (n, lines, lines / l0, carve_s, carve_s / c0, cxx_s, cxx_s / x0))
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--carve", default=os.path.join(ROOT, "build", "bin", "carve"))
    ap.add_argument("--workdir", default=os.path.join(ROOT, "build", "bench-compile"))
    ap.add_argument("--models", default="gpt,llama,mixtral,bert,resnet18")
    ap.add_argument("--baseline", help="a git revision whose runtime headers to compare with")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--layers", help="GPT depths to compare (e.g. 12,48) instead of --models")
    ap.add_argument("--width", type=int, default=256)
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

    if a.layers:
        return depth_scaling(a, cfg, flags, w)

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
        # The runtime headers precompiled, as carve compile builds (program_flags).
        pch_cmd = None
        if cfg.get("program_flags") and os.path.exists(cfg.get("program_pch", "")):
            pch_cmd = now_cmd[:-4] + cfg["program_flags"].split() + now_cmd[-4:]
            runs["pch"] = []
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
            if pch_cmd:
                runs["pch"].append(cpu_seconds(pch_cmd))
            if base_cmd:
                runs["baseline"].append(cpu_seconds(base_cmd))
        row = {"model": model, "kib": len(text) / 1024, "chains": chains, "calls": calls,
               "now": statistics.median(runs["now"])}
        if base_cmd:
            row["baseline"] = statistics.median(runs["baseline"])
        if pch_cmd:
            row["pch"] = statistics.median(runs["pch"])
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
    with_pch = all("pch" in r for r in rows)
    if with_pch:
        head += " s now, headers precompiled |"
        rule += "---|"
    if a.baseline:
        head += " s at %s | ratio |" % a.baseline
        rule += "---|---|"
        if with_pch:
            head += " ratio, precompiled |"
            rule += "---|"
    print(head)
    print(rule)
    for r in rows:
        line = "| %s | %.0f | %d | %d | %.1f |" % (r["model"], r["kib"], r["chains"], r["calls"],
                                                  r["now"])
        if with_pch:
            line += " %.1f |" % r["pch"]
        if a.baseline:
            line += " %.1f | %.2fx |" % (r["baseline"], r["baseline"] / r["now"])
            if with_pch:
                line += " %.2fx |" % (r["baseline"] / r["pch"])
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
