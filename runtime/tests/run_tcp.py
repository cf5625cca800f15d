#!/usr/bin/env python3
"""Tests of the TCP world (runtime/src/comm_tcp_*.cpp) with processes started as a plain
launcher starts them: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.

usage: run_tcp.py PATH/TO/carve-runtime-tcp-test

Checks:
  - every collective, split and point-to-point message on 1, 2 and 3 ranks
    (the binary checks the values; here, that every rank exits 0);
  - a rank killed by SIGKILL: the others exit non-zero within seconds, each
    with one `carve: rank R:` line, and the hub's names the killed rank;
  - a rank that stops answering: the others time out with the MPI backend's
    "did not complete in N s" line;
  - start-up errors: unset variables (no world, no error), malformed ones, a
    port in use, a hub nobody joins, a worker with no hub, an unknown host.

Only the Python standard library is used.
"""

import os
import socket
import subprocess
import sys
import time

FAILURES = []


def check(cond, what, detail=""):
    if cond:
        print(f"ok    {what}")
    else:
        print(f"FAIL  {what}" + (f"\n      {detail}" if detail else ""))
        FAILURES.append(what)


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(timeout):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    env["CARVE_TEST_TIMEOUT"] = str(timeout)
    return env


def start(binary, mode, rank, size, port, timeout, addr="127.0.0.1", extra=None):
    env = base_env(timeout)
    env.update(RANK=str(rank), WORLD_SIZE=str(size))
    if size > 1:
        env.update(MASTER_ADDR=addr, MASTER_PORT=str(port))
    env.update(extra or {})
    return subprocess.Popen([binary, mode], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(procs, limit):
    """Waits for every process (killing the rest at `limit` seconds);
    returns [(returncode, stdout, stderr)] and the seconds it took."""
    begin = time.monotonic()
    out = []
    for p in procs:
        left = max(0.1, limit - (time.monotonic() - begin))
        try:
            o, e = p.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            p.kill()
            o, e = p.communicate()
            e += "\n(killed by run_tcp.py: still running)"
        out.append((p.returncode, o, e))
    return out, time.monotonic() - begin


def carve_lines(text):
    return [line for line in text.splitlines() if line.startswith("carve: rank")]


def test_all(binary):
    for size in (1, 2, 3):
        port = free_port()
        procs = [start(binary, "all", r, size, port, 20) for r in range(size)]
        results, _ = finish(procs, 25)
        for r, (rc, o, e) in enumerate(results):
            check(rc == 0 and "0 failed" in o,
                  f"every collective, split and message on {size} rank(s): rank {r}",
                  f"exit {rc}\n{o}{e}")


def test_dead_peer(binary, mode, size):
    port = free_port()
    procs = [start(binary, mode, r, size, port, 20) for r in range(size)]
    results, took = finish(procs, 15)
    dead = size - 1
    check(results[dead][0] == -9, f"{mode}: rank {dead} was killed",
          f"exit {results[dead][0]}")
    for r in range(size - 1):
        rc, o, e = results[r]
        lines = carve_lines(e)
        check(rc != 0 and len(lines) == 1, f"{mode}: rank {r} fails with one line",
              f"exit {rc}\n{e}")
    rc, o, e = results[0]
    lines = carve_lines(e)
    want = "receive from rank" if mode == "die-p2p" else "all-reduce over world"
    check(bool(lines) and f"rank {dead} closed its connection" in lines[0] and want in lines[0]
          and "step 7" in lines[0],
          f"{mode}: rank 0 names the operation, the step and the dead rank", e)
    check(took < 10, f"{mode}: no hang (all exited in {took:.1f} s)")


def test_stall(binary):
    size, port = 3, free_port()
    procs = [start(binary, "stall", r, size, port, 2) for r in range(size)]
    results, took = finish(procs[:-1], 15)
    procs[-1].kill()
    procs[-1].communicate()
    rc, o, e = results[0]
    lines = carve_lines(e)
    check(rc != 0 and len(lines) == 1 and "did not complete in 2 s" in lines[0]
          and "rank(s) 1, 2 of that group may be dead or stuck" in lines[0],
          "stall: rank 0 times out naming the group's other ranks", e)
    rc, o, e = results[1]
    check(rc != 0 and len(carve_lines(e)) == 1, "stall: rank 1 fails with one line", e)
    check(took < 10, f"stall: bounded by the timeout ({took:.1f} s)")


def run_init(binary, env_vars, timeout=2):
    env = base_env(timeout)
    env.update(env_vars)
    p = subprocess.run([binary, "init"], env=env, capture_output=True, text=True, timeout=20)
    return p.returncode, p.stdout.strip()


def test_init(binary):
    rc, out = run_init(binary, {})
    check(rc == 3 and out == "world: none", "no RANK/WORLD_SIZE: no world and no error", out)
    rc, out = run_init(binary, {"RANK": "0", "WORLD_SIZE": "1"})
    check(rc == 0 and out == "world: rank 0 of 1", "WORLD_SIZE=1 needs no MASTER_*", out)
    cases = [
        ({"RANK": "abc", "WORLD_SIZE": "2"}, "RANK=abc is not a rank in 0..1"),
        ({"RANK": "0"}, "WORLD_SIZE=(unset)"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0 is not a positive number"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is not a rank in 0..1"),
        ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "1234"}, "needs MASTER_ADDR"),
        ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "70000"},
         "MASTER_PORT=70000 is not a port number"),
    ]
    for env_vars, want in cases:
        rc, out = run_init(binary, env_vars)
        check(rc == 2 and want in out and "\n" not in out,
              f"malformed variables {env_vars}: one line with '{want}'", out)

    port = free_port()
    rc, out = run_init(binary, {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
                                "MASTER_PORT": str(port)})
    check(rc == 2 and "rank(s) 1, 2 did not connect to port" in out,
          "a hub nobody joins names the missing ranks after the timeout", out)

    rc, out = run_init(binary, {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                "MASTER_PORT": str(free_port())})
    check(rc == 2 and "rank 1 could not connect to rank 0 at 127.0.0.1:" in out
          and "Connection refused" in out, "a worker with no hub gives up after the timeout", out)

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen(1)
        taken = busy.getsockname()[1]
        rc, out = run_init(binary, {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                    "MASTER_PORT": str(taken)})
    check(rc == 2 and f"rank 0 cannot listen on port {taken}" in out
          and "CARVE_MASTER_PORT" in out, "a port in use is rank 0's error", out)

    # CARVE_MASTER_PORT wins over MASTER_PORT (torchrun's agent holds the latter).
    port = free_port()
    both = {"MASTER_PORT": "1", "CARVE_MASTER_PORT": str(port)}
    hub = start(binary, "init", 0, 2, port, 5, extra=both)
    worker = start(binary, "init", 1, 2, port, 5, extra=both)
    results, _ = finish([hub, worker], 15)
    check(all(rc == 0 for rc, _, _ in results), "CARVE_MASTER_PORT overrides MASTER_PORT",
          str(results))

    begin = time.monotonic()
    rc, out = run_init(binary, {"RANK": "1", "WORLD_SIZE": "2",
                                "MASTER_ADDR": "no-such-host.invalid", "MASTER_PORT": "29500"})
    check(rc == 2 and "MASTER_ADDR=no-such-host.invalid does not resolve" in out,
          f"an unknown MASTER_ADDR ({time.monotonic() - begin:.1f} s)", out)

    # A size mismatch between the ranks is rank 0's error.
    port = free_port()
    hub = start(binary, "init", 0, 2, port, 5)
    worker = start(binary, "init", 1, 3, port, 5)
    (rc0, o0, _), (rc1, o1, _) = finish([hub, worker], 15)[0]
    check(rc0 == 2 and "rank 1 has WORLD_SIZE=3 but rank 0 has 2" in o0 and rc1 == 2,
          "WORLD_SIZE differs between ranks", o0 + o1)


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: run_tcp.py PATH/TO/carve-runtime-tcp-test")
    binary = sys.argv[1]
    begin = time.monotonic()
    test_all(binary)
    test_dead_peer(binary, "die", 3)
    test_dead_peer(binary, "die-p2p", 2)
    test_stall(binary)
    test_init(binary)
    print(f"{len(FAILURES)} failure(s) in {time.monotonic() - begin:.1f} s")
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
