#!/usr/bin/env python3
"""Runs docs/tutorial.md, so that the tutorial cannot rot.

The tutorial's fenced blocks follow one convention:

- ```sh            commands: run in order with bash (-e -u -o pipefail) in one
                   temporary folder, with `carve` and `python3` (the build's
                   carve, /usr/bin/python3) first on PATH;
- ```LANG file=NAME a file the reader saves as NAME: written before the next
                   commands run;
- ```text           what the commands of the last ```sh block before it print:
                   checked against their output. Each line of the block must
                   match a line of the output, in order (other output lines
                   may come between), with runs of spaces counted as one;
                   a number matches within NUMBER_RTOL relative (the same
                   model trains the same up to summation order on another
                   machine); "~" before a number (a time, a throughput, a
                   rounding difference) matches any number, and "…" any text
                   (a temporary folder, this machine's cores).
- anything else is not run.

A block that exits non-zero fails the test, naming the block's first line
and showing the end of its output. So does a tutorial with fewer than
MIN_COMMAND_BLOCKS command blocks or without the commands it promises
(carve compile / run / --load / verify / plan), which would mean the
convention broke and nothing was run. Each block's output is kept in
WORKDIR/block-NN.log.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import time

MIN_COMMAND_BLOCKS = 6
NUMBER_RTOL = 1e-4
NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
PROMISED = ["carve compile", "carve run", "--load", "carve verify", "carve plan"]
TIMEOUT_S = 300


def blocks(text):
    """[(info string, body, line number)] of the fenced blocks, in order."""
    out = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^```(.*)$", lines[i])
        if not m:
            i += 1
            continue
        info, start = m.group(1).strip(), i + 1
        j = start
        while j < len(lines) and lines[j] != "```":
            j += 1
        if j == len(lines):
            raise SystemExit("tutorial: error: the block at line %d is not closed" % (i + 1))
        out.append((info, "\n".join(lines[start:j]) + "\n", i + 1))
        i = j + 1
    return out


def normalize(line):
    return re.sub(r"\s+", " ", line.strip())


def line_matcher(doc_line):
    """(regex, expected numbers: a float, or None for ~) of one printed line."""
    parts = re.split("(…|~" + NUMBER + "|" + NUMBER + ")", normalize(doc_line))
    regex, expected = "", []
    for i, p in enumerate(parts):
        if i % 2 == 0:
            regex += re.escape(p)
        elif p == "…":
            regex += ".*?"
        else:
            regex += "(" + NUMBER + ")"
            expected.append(None if p.startswith("~") else float(p))
    return re.compile(regex), expected


def matches(doc_line, out_line):
    regex, expected = line_matcher(doc_line)
    m = regex.fullmatch(normalize(out_line))
    if not m:
        return False
    for want, got in zip(expected, m.groups()):
        if want is not None and abs(float(got) - want) > NUMBER_RTOL * max(abs(want),
                                                                           abs(float(got))):
            return False
    return True


def check_printed(doc, output):
    """None when every line of `doc` matches a line of `output` in order;
    else the first line that does not, and the output."""
    lines = output.splitlines()
    at = 0
    for d in doc.splitlines():
        if not d.strip():
            continue
        while at < len(lines) and not matches(d, lines[at]):
            at += 1
        if at == len(lines):
            return d
        at += 1
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--carve", required=True)
    ap.add_argument("--tutorial", required=True)
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    work = os.path.abspath(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    run_dir = os.path.join(work, "run")
    bin_dir = os.path.join(work, "bin")
    os.makedirs(run_dir)
    os.makedirs(bin_dir)
    os.symlink(os.path.abspath(args.carve), os.path.join(bin_dir, "carve"))
    os.symlink("/usr/bin/python3", os.path.join(bin_dir, "python3"))
    env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""),
               PYTHONDONTWRITEBYTECODE="1")

    with open(args.tutorial) as f:
        found = blocks(f.read())
    commands = [b for b in found if b[0] == "sh"]
    text = "".join(b[1] for b in commands)
    missing = [p for p in PROMISED if p not in text]
    if len(commands) < MIN_COMMAND_BLOCKS or missing:
        print("FAIL: %d command blocks (at least %d expected), missing %s: has the block "
              "convention changed?" % (len(commands), MIN_COMMAND_BLOCKS, missing))
        return 1

    n = 0
    last_log, checked = None, 0
    for info, body, line in found:
        if info == "text":
            if last_log is None:
                print("FAIL line %d: a ```text block before any command block" % line)
                return 1
            with open(last_log) as f:
                printed = f.read()
            bad = check_printed(body, printed)
            if bad is not None:
                print("FAIL line %d: the tutorial shows\n  %s\nwhich the commands' output "
                      "(%s) does not print (numbers within %g; ~ any number, … any text):\n%s"
                      % (line, bad, os.path.basename(last_log), NUMBER_RTOL, printed[-3000:]))
                return 1
            checked += 1
            continue
        m = re.match(r"^\w+\s+file=(\S+)$", info)
        if m:
            name = m.group(1)
            if os.path.isabs(name) or ".." in name.split("/"):
                print("FAIL line %d: file=%s must be a relative name" % (line, name))
                return 1
            with open(os.path.join(run_dir, name), "w") as f:
                f.write(body)
            print("wrote %-24s (line %d)" % (name, line))
            continue
        if info != "sh":
            continue
        n += 1
        log = os.path.join(work, "block-%02d.log" % n)
        first = body.strip().splitlines()[0]
        t0 = time.time()
        try:
            with open(log, "w") as out:
                p = subprocess.run(["bash", "-euo", "pipefail", "-c", body], cwd=run_dir, env=env,
                                   stdout=out, stderr=subprocess.STDOUT, timeout=TIMEOUT_S)
            rc = p.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout after %d s" % TIMEOUT_S
        took = time.time() - t0
        if rc != 0:
            with open(log) as f:
                tail = f.read()[-3000:]
            print("FAIL line %d: `%s` exited %s:\n%s" % (line, first, rc, tail))
            return 1
        last_log = log
        print("ok   %-60s %5.1f s" % (first[:60], took))
        sys.stdout.flush()
    print("%d command blocks of %s ran; %d printed outputs match" % (
        n, os.path.basename(args.tutorial), checked))
    return 0


if __name__ == "__main__":
    sys.exit(main())
