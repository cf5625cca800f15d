#!/usr/bin/env python3
"""The runtime headers that generated programs load precompiled (cmake/CarvePch.cmake).

What must hold:

1. The precompiled headers the build made are valid for the flags carve
   compiles programs with: the C++ target's (carve-runtime.txt: cxxflags,
   the runtime's include folder, program_flags) and, with --emulated, the
   emulated CUDA target's (carve-runtime-emu.txt: cuda_emu_program_flags).
   GCC's -H marks a precompiled header it loads with '!' and one it found but
   could not use with 'x'; each must show '!' and its program_pch path. (An
   unusable one is no error to GCC, only a slower build: this is where it
   shows.)
2. A stale one is never used: a configuration whose program_pch lists a
   header newer than itself (its .deps file) builds the program without
   program_flags (whose header here stops the compile with #error) and says
   so once, naming the header; the same configuration with the header older
   than the precompiled file uses program_flags (the #error stops the build,
   and carve compile fails naming the compiler's error line).
"""

import argparse
import os
import shutil
import subprocess
import sys
import time

MODEL = "builtin:gpt:layers=1,hidden=32,heads=2,seq=8,vocab=64,batch=2"
TIMEOUT_S = 300
FAILURES = []


def config(path):
    cfg = {}
    with open(path) as f:
        for line in f:
            if "=" in line:
                k, v = line.rstrip("\n").split("=", 1)
                cfg[k] = v
    return cfg


def check(name, ok, detail=""):
    print("%s: %s%s" % ("ok" if ok else "FAIL", name, "" if ok else ": " + detail), flush=True)
    if not ok:
        FAILURES.append(name)


def loads_precompiled(name, argv, source, gch):
    """Runs the compiler with -H on `source`; checks that it loaded `gch`."""
    p = subprocess.run(argv + ["-H", "-fsyntax-only", "-"], input=source, text=True,
                       capture_output=True, timeout=TIMEOUT_S)
    marks = [l for l in p.stderr.splitlines() if l.startswith(("! ", "x "))]
    check(name, p.returncode == 0 and ("! " + gch) in marks,
          "rc %d, GCC's precompiled-header lines %s (want '! %s')\n%s" %
          (p.returncode, marks, gch, p.stderr[-2000:]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--carve", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--emulated", help="build/lib/carve-runtime-emu.txt")
    a = ap.parse_args()
    build = os.path.dirname(os.path.dirname(os.path.abspath(a.carve)))
    cfg_path = os.path.join(build, "lib", "carve-runtime.txt")
    cfg = config(cfg_path)
    w = os.path.abspath(a.workdir)
    shutil.rmtree(w, ignore_errors=True)
    os.makedirs(w)

    # 1. Valid for the flags programs are built with.
    base = [cfg["cxx"]] + cfg["cxxflags"].split() + ["-I" + cfg["include"]]
    if "program_pch" not in cfg:
        check("carve-runtime.txt names program_pch", False, "keys: %s" % sorted(cfg))
    else:
        loads_precompiled("the C++ target's precompiled headers load",
                          base + cfg["program_flags"].split() + ["-x", "c++"],
                          '#include "carve/rt/program.h"\n', cfg["program_pch"])
    if a.emulated:
        emu = config(a.emulated)
        if "cuda_emu_program_pch" not in emu:
            check("carve-runtime-emu.txt names cuda_emu_program_pch", False, "keys: %s" % sorted(emu))
        else:
            loads_precompiled("the emulated CUDA target's precompiled headers load",
                              base + emu["cuda_emu_program_flags"].split(),
                              '#include "carve/rt/gpu.h"\n', emu["cuda_emu_program_pch"])

    # 2. Stale: not used, and said; fresh: used.
    fake = os.path.join(w, "pch")
    os.makedirs(fake)
    wrapper = os.path.join(fake, "prelude.h")
    with open(wrapper, "w") as f:
        f.write("#error this test's stand-in for the precompiled headers was used\n")
    gch = wrapper + ".gch"
    header = os.path.join(fake, "held.h")
    for p in (gch, header):
        open(p, "w").close()
    with open(gch + ".deps", "w") as f:
        f.write("%s: %s \\\n %s\n" % (gch, wrapper, header))
    fake_cfg = os.path.join(w, "carve-runtime.txt")
    with open(fake_cfg, "w") as f:
        for k, v in cfg.items():
            if k == "program_flags":
                v = "-include " + wrapper
            elif k == "program_pch":
                v = gch
            f.write("%s=%s\n" % (k, v))
    env = dict(os.environ, CARVE_RUNTIME_CONFIG=fake_cfg)
    now = time.time()

    os.utime(gch, (now - 100, now - 100))
    os.utime(wrapper, (now - 200, now - 200))
    os.utime(header, (now, now))
    out = os.path.join(w, "stale")
    p = subprocess.run([a.carve, "compile", MODEL, "-o", out, "--quiet"], capture_output=True,
                       text=True, env=env, timeout=TIMEOUT_S)
    notes = [l for l in p.stderr.splitlines() if "precompiled runtime headers" in l]
    check("a stale precompiled header is not used, and carve says why",
          p.returncode == 0 and os.path.exists(os.path.join(out, "bin", "train")) and
          len(notes) == 1 and (header + " changed after it was built") in notes[0],
          "rc %d, stderr:\n%s" % (p.returncode, p.stderr[-2000:]))

    os.utime(header, (now - 300, now - 300))
    out = os.path.join(w, "fresh")
    p = subprocess.run([a.carve, "compile", MODEL, "-o", out, "--quiet"], capture_output=True,
                       text=True, env=env, timeout=TIMEOUT_S)
    check("a fresh precompiled header is used (program_flags on the command line)",
          p.returncode != 0 and "this test's stand-in for the precompiled headers was used" in
          p.stderr and "precompiled runtime headers" not in p.stderr and not os.path.exists(out),
          "rc %d, stderr:\n%s" % (p.returncode, p.stderr[-2000:]))

    print("%d failed" % len(FAILURES) if FAILURES else "all passed")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
