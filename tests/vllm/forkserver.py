"""The JSON-line protocol of the tests' fork servers, both sides: run_llm.py
--serve (one engine per request, conftest.run_llm) and ladder_serve.py
(one kvarn-vllm-ladder run per request, test_ladder.py). A server imports
torch and vLLM once, prints {"ready": true, ...}, then for each request
line on stdin ({..., "out": PREFIX, "timeout": S}) runs a child forked
from it (kvarn_vllm._proc.run: its own process group, stdout and stderr
in PREFIX.out / PREFIX.err, killed with its group after S seconds) and
answers one line {"rc": N, "timed_out": bool}.

    serve(child_of, ready)             # the server's loop (child_of(req): the
                                       # function the child runs)
    c = Client(script, args, env=..., keep=False)
    rc, out, err = c.run({"cfg": ...}, timeout)   # TimeoutExpired on a timeout
    c.close()
"""
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
READY_S = 600        # a server's imports (torch, vLLM) on shared cores
REPLY_MARGIN_S = 300  # past a request's timeout: the server's kill and reply


def serve(child_of, ready: dict = None) -> None:
    """The server's side: the ready line (with ready's keys), then one
    child per request line on stdin until EOF. An interrupt, or this
    process's parent gone, kills the running child's group and ends it."""
    from kvarn_vllm import _proc
    parent = os.getppid()
    print(json.dumps(dict(ready or {}, ready=True)), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        try:
            done = _proc.run(child_of(req), req["out"] + ".out", err=req["out"] + ".err",
                             timeout=float(req.get("timeout", 900)), parent=parent)
            reply = {"rc": done.rc, "timed_out": False}
        except _proc.Timeout as e:
            reply = {"rc": e.rc, "timed_out": True}
        print(json.dumps(reply), flush=True)


class Client:
    """The caller's side: the server script with args (under this python,
    in the repository's root, with env), started on first use and again after it
    died. Each run's PREFIX.out / .err under tmp (default: a directory of
    its own, removed at close), deleted once read unless keep. .proc: the
    server's process; .ready: its ready line."""

    def __init__(self, script: str, args: tuple = (), tmp: str = None, env: dict = None,
                 keep: bool = False):
        self.script, self.args, self.env, self.keep = script, list(args), env, keep
        self.own_dir = tmp is None
        self.dir = tempfile.mkdtemp(prefix="kvarn_forkserver_") if tmp is None else tmp
        self.proc, self.n, self.ready, self.buf = None, 0, {}, b""
        self.name = os.path.basename(script)

    def run(self, req: dict, timeout: float) -> tuple:
        """(rc, stdout, stderr) of one request; subprocess.TimeoutExpired
        where the server killed it at timeout (rc -9 alone may be the OOM
        killer)."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.n += 1
        prefix = os.path.join(self.dir, f"run{self.n}")
        self.proc.stdin.write((json.dumps(dict(req, out=prefix, timeout=timeout)) + "\n")
                              .encode())
        self.proc.stdin.flush()
        reply = self._reply(timeout + REPLY_MARGIN_S)
        out, err = (self._read(prefix + ext) for ext in (".out", ".err"))
        if reply.get("timed_out"):
            raise subprocess.TimeoutExpired([self.name, prefix], timeout, out, err)
        return reply["rc"], out, err

    def _read(self, path: str) -> str:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        if not self.keep:
            os.unlink(path)
        return text

    def _start(self) -> None:
        if self.proc is not None:   # a server that died: its pipes
            self.proc.stdin.close()
            self.proc.stdout.close()
        self.buf = b""
        self.proc = subprocess.Popen([sys.executable, self.script, *self.args], cwd=ROOT,
                                     env=self.env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.ready = self._reply(READY_S)
        assert self.ready.get("ready"), f"{self.name} did not start: {self.ready}"

    def _reply(self, limit: float) -> dict:
        """The server's next JSON line (anything a library printed to its
        stdout at import is skipped), within limit seconds."""
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + limit
        while True:
            while b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                if line.startswith(b"{"):
                    return json.loads(line)
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            assert ready, f"{self.name}: no reply in {limit:.0f} s"
            chunk = os.read(fd, 65536)
            if not chunk:
                raise AssertionError(f"{self.name} died (rc {self.proc.wait()})")
            self.buf += chunk

    def close(self) -> None:
        try:
            if self.proc is not None:
                self.proc.stdin.close()  # EOF: the server leaves
                try:
                    self.proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    self.proc.terminate()  # kills its running child first
                    try:
                        self.proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        self.proc.kill()
                        self.proc.wait()
                self.proc.stdout.close()
        finally:
            if self.own_dir:
                shutil.rmtree(self.dir, ignore_errors=True)
