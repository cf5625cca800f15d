#!/usr/bin/env python3
"""No source file of carve over 1,000 lines (the layering rule of docs/architecture.md).

Counts the lines of every C++, CUDA and header file under compiler/, runtime/,
tools/ and dialects/ (generated files live in the build folder, not here) and
fails naming each file over the limit, so that a file that outgrows it is
split by concern when it does, not later.
"""

import os
import sys

LIMIT = 1000
DIRS = ("compiler", "runtime", "tools", "dialects")
SUFFIXES = (".cpp", ".cu", ".h", ".cuh", ".hpp", ".cc")


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.getcwd()
    over, counted = [], 0
    for d in DIRS:
        for dirpath, _, files in os.walk(os.path.join(root, d)):
            for f in sorted(files):
                if not f.endswith(SUFFIXES):
                    continue
                path = os.path.join(dirpath, f)
                with open(path, encoding="utf-8", errors="replace") as fh:
                    n = sum(1 for _ in fh)
                counted += 1
                if n > LIMIT:
                    over.append((n, os.path.relpath(path, root)))
    if counted == 0:
        print(f"FAIL: no source file found under {root}")
        sys.exit(1)
    for n, path in sorted(over, reverse=True):
        print(f"FAIL: {path}: {n} lines, over {LIMIT}: split it by concern")
    print(f"{counted} source files, {len(over)} over {LIMIT} lines")
    print(f"{counted - len(over)} passed, {len(over)} failed")
    sys.exit(1 if over else 0)


if __name__ == "__main__":
    main()
