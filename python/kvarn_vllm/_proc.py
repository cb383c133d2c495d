"""The one process launcher of the package and its tests: run a function in
a forked child with a deadline, as kvarn-vllm-ladder runs each format's
engine (ladder/engine.py) and the vLLM tests run each engine
(tests/vllm/run_llm.py --serve) and each ladder (tests/vllm/ladder_serve.py).

    from kvarn_vllm import _proc
    done = _proc.run(fn, log="job.log", timeout=3600, on_line=show)
    value = done.value_or_raise()        # fn's return value

The child:
  - is the leader of a process group of its own, set on both sides of the
    fork (in the child, and in the parent, so that a kill right after the
    fork already finds the group): a timeout or an interrupt kills what it
    started too (an engine's ranks, a ladder's engine);
  - dies with its parent (PR_SET_PDEATHSIG, Linux): a launcher killed with
    its own group does not leave its child's group running;
  - reads /dev/null, writes stdout to log and stderr to err (or to log too);
  - runs fn() (fn(send) with on_line: send(text) hands the parent one line,
    which it gives to on_line(text) as it comes), and passes fn's return
    value back pickled (so numpy arrays travel) in log + ".result";
  - exits 0 when fn returns; on SystemExit as sys.exit would (None 0, an
    int that status, anything else printed, 1); on any other exception
    with its traceback in err and status 1.

The parent waits for the child, past timeout (seconds; None: no limit)
kills the child's group with SIGKILL and raises Timeout; on an interrupt
(KeyboardInterrupt, or the parent's own parent gone where parent is given)
it kills the group and re-raises. After the child exits, what is left of
its group is killed (helpers the child started and did not stop).
"""
import os
import pickle
import select
import signal
import sys
import time
import traceback

POLL_S = 0.05


class ChildError(RuntimeError):
    """The child gave no result. .reason: why in a few words ("timed out
    after 3600 s", "the child process died (exit status 1)"); .log: its
    output; .rc: its exit status (-9 after a timeout's kill)."""

    def __init__(self, reason: str, log: str, rc: int):
        super().__init__(f"{reason} (its output: {log})")
        self.reason, self.log, self.rc = reason, log, rc


class Timeout(ChildError):
    """The child outlived its deadline and was killed with its group."""


class Done:
    """A child that exited on its own: rc, its exit status; returned, whether
    fn returned (value: what it returned)."""

    def __init__(self, rc: int, returned: bool, value, log: str, what: str):
        self.rc, self.returned, self.value, self.log, self.what = rc, returned, value, log, what

    def value_or_raise(self):
        """fn's return value, or ChildError where the child left none."""
        if not self.returned:
            raise ChildError(f"{self.what} died (exit status {self.rc})", self.log, self.rc)
        return self.value


def _die_with_parent() -> None:
    """SIGKILL to this process when the thread that forked it ends (Linux
    prctl PR_SET_PDEATHSIG; elsewhere nothing)."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)    # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _exit_status(e: SystemExit) -> int:
    """The status sys.exit(e.code) gives: None 0, an int itself, anything
    else printed to stderr and 1."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _child(fn, log: str, err: str, result: str, wfd: int, parent: int) -> None:
    """The forked side of run(). Never returns."""
    rc = 1
    try:
        os.setpgid(0, 0)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _die_with_parent()
        if os.getppid() != parent:     # the parent died before the line above
            os._exit(1)
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        if err is None:
            os.dup2(out, 2)
        else:
            e = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(e, 2)
            os.close(e)
        os.close(out)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        if wfd >= 0:
            def send(text: str) -> None:
                os.write(wfd, text.encode() + b"\n")
            value = fn(send)
        else:
            value = fn()
        with open(result + ".tmp", "wb") as f:
            pickle.dump(value, f)
        os.replace(result + ".tmp", result)
        rc = 0
    except SystemExit as e:
        rc = _exit_status(e)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _reap(pid: int) -> int:
    """Wait for the child, then kill what is left of its group."""
    try:
        _, status = os.waitpid(pid, 0)
        rc = os.waitstatus_to_exitcode(status)
    except ChildProcessError:
        rc = -9
    _killpg(pid)
    return rc


def run(fn, log: str, err: str = None, timeout: float = None, on_line=None,
        parent: int = None, what: str = "the child process") -> Done:
    """Run fn in a forked child (module docstring); returns Done once it
    exits, raises Timeout past timeout seconds. err: the file of its stderr
    (None: log). on_line: called with each line the child sends. parent: a
    pid whose loss (this process re-parented) counts as an interrupt. what:
    the child in the error messages."""
    result = log + ".result"
    for p in (result, result + ".tmp"):
        if os.path.exists(p):
            os.unlink(p)
    r, w = os.pipe() if on_line is not None else (-1, -1)
    me = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        if r >= 0:
            os.close(r)
        _child(fn, log, err, result, w, me)
    if w >= 0:
        os.close(w)
    try:
        os.setpgid(pid, pid)   # also here: a kill right after fork finds the group
    except OSError:
        pass                   # the child did it first (or has exited)
    deadline = None if timeout is None else time.monotonic() + timeout
    buf = b""

    def read_lines(wait: float) -> None:
        nonlocal buf, r
        while r >= 0:
            ready, _, _ = select.select([r], [], [], wait)
            if not ready:
                return
            chunk = os.read(r, 4096)
            if not chunk:      # every writer gone
                os.close(r)
                r = -1
                return
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                on_line(line.decode(errors="replace"))
            wait = 0

    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                rc = os.waitstatus_to_exitcode(status)
                _killpg(pid)
                break
            if parent is not None and os.getppid() != parent:
                raise KeyboardInterrupt    # whoever started this process is gone
            if deadline is not None and time.monotonic() > deadline:
                _killpg(pid)
                rc = _reap(pid)
                raise Timeout(f"timed out after {timeout:g} s", log, rc)
            if r >= 0:
                read_lines(POLL_S)
            else:
                time.sleep(POLL_S)
        read_lines(0)          # what the child sent last
    except Timeout:
        raise
    except BaseException:      # interrupted: the child's group goes too
        _killpg(pid)
        _reap(pid)
        raise
    finally:
        if r >= 0:
            os.close(r)
    returned = os.path.exists(result)
    value = None
    if returned:
        with open(result, "rb") as f:
            value = pickle.load(f)
        os.unlink(result)
    return Done(rc, returned, value, log, what)
