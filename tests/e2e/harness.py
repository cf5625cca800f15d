"""What the end-to-end scripts share: running a command, and failing clearly.

Every script in tests/e2e runs carve (or a program it built) as a subprocess
and checks what comes back. `run` is the one way they do it:

    r = run([carve, "compile", ...], timeout=600)
    r.code, r.out, r.err          # exit status, stdout, stderr
    code, out, err = r            # the same, unpacked
    r = run(cmd, merge=True)      # stderr into stdout: code, out = r

`run_ok` raises Failure, naming the command and the tails of its output,
when the command exits non-zero. A command that does not exit within its
timeout, or cannot start, is a Failure too (never a hang, never a skip).
Failure is the one exception the scripts raise for a check that did not
hold; parallel.py and the others re-export it.
"""

import subprocess


class Failure(Exception):
    """A check that did not hold; the message says which and why."""


class Result:
    """A finished command: its exit status and output.

    Also readable as subprocess.CompletedProcess (returncode, stdout,
    stderr) and unpacked as (code, out, err), or (code, out) when stderr was
    merged into stdout."""

    def __init__(self, cmd, code, out, err, merged):
        self.cmd, self.code, self.out, self.err, self.merged = cmd, code, out, err, merged

    returncode = property(lambda self: self.code)
    stdout = property(lambda self: self.out)
    stderr = property(lambda self: self.err)

    @property
    def text(self):
        """stdout, then stderr."""
        return self.out + self.err

    def __iter__(self):
        return iter((self.code, self.out) if self.merged else (self.code, self.out, self.err))

    def __getitem__(self, i):
        return tuple(self)[i]

    def __len__(self):
        return 2 if self.merged else 3


def command_line(cmd):
    return " ".join(str(c) for c in cmd)


def run(cmd, timeout=600, env=None, merge=False):
    """Runs `cmd` (a list) to completion; `env` replaces the environment
    when given; `merge` sends stderr into stdout."""
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT if merge else subprocess.PIPE, text=True,
                           timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise Failure(f"`{command_line(cmd)}` did not exit within {timeout} s") from None
    except OSError as e:
        raise Failure(f"cannot start `{command_line(cmd)}`: {e}") from None
    return Result(cmd, p.returncode, p.stdout, p.stderr or "", merge)


def run_ok(cmd, timeout=600, env=None, merge=False, tail=2000):
    """run(), raising Failure with the last `tail` characters of stdout and
    of stderr (all of them when `tail` is None) when the command exits
    non-zero."""
    r = run(cmd, timeout=timeout, env=env, merge=merge)
    if r.code != 0:
        cut = slice(None) if tail is None else slice(-tail, None)
        raise Failure(f"`{command_line(cmd)}` exited {r.code}:\n{r.out[cut]}{r.err[cut]}")
    return r
