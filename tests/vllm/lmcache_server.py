"""An `lmcache server` (LMCache 0.5.6's multiprocess server) on loopback
for tests/vllm/test_lmcache.py and bench/offload_ttft.py --lmcache: free
ports, its own process group, its /status read over HTTP."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

ENV = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "LMCACHE_DISABLE_BANNER": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """An `lmcache server` of this venv in a process group of its own."""

    def __init__(self, log_path: str, chunk: int = 128):
        self.port, self.http = free_port(), free_port()
        exe = os.path.join(os.path.dirname(sys.executable), "lmcache")
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [exe, "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--chunk-size", str(chunk), "--l1-size-gb", "1", "--eviction-policy", "LRU",
             "--supported-transfer-mode", "auto", "--http-host", "127.0.0.1",
             "--http-port", str(self.http), "--disable-observability"],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, env={**os.environ, **ENV})
        deadline = time.time() + 180
        while True:
            try:
                if self.status()["is_healthy"]:
                    break
            except OSError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise AssertionError(f"lmcache server did not start:\n{self.tail()}")
            time.sleep(1)

    def status(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/status", timeout=10) as r:
            return json.loads(r.read())

    def l1(self) -> dict:
        return self.status()["storage_manager"]["l1_managers"]["_default"]

    def tail(self) -> str:
        with open(self.log_path) as f:
            return f.read()[-4000:]

    def ktc(self, stock: bool = False) -> dict:
        mod, cls = (("lmcache.integration.vllm.lmcache_mp_connector", "LMCacheMPConnector")
                    if stock else ("kvarn_vllm.lmcache_mp", "KvarnLMCacheMPConnector"))
        return {"kv_connector": cls, "kv_connector_module_path": mod, "kv_role": "kv_both",
                "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1",
                                              "lmcache.mp.port": self.port}}

    def stop(self):
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=20)
        except ProcessLookupError:
            pass
        self.log.close()
