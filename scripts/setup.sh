#!/usr/bin/env bash
# setup.sh -- install what kvarn needs on a fresh Debian 12 machine.
#   scripts/setup.sh --deps    Debian build/test packages and the Python test packages
#   scripts/setup.sh --model   also the evaluation model and text (docs/model-setup.md)
#   scripts/setup.sh --vllm    also vLLM's CPU build in .venv-vllm, the kvarn_vllm
#                              plug-in (python/) and the model converted for vLLM
#                              (needs the model and build/libkvarn.so; docs/vllm.md)
# Re-running it does nothing when everything is in place.
set -euo pipefail
cd "$(dirname "$0")/.."

want_model=0
want_vllm=0
for a in "$@"; do
  case "$a" in
    --deps) ;;
    --model) want_model=1 ;;
    --vllm) want_model=1; want_vllm=1 ;;
    *) echo "usage: scripts/setup.sh [--deps] [--model] [--vllm]" >&2; exit 2 ;;
  esac
done

# libxsmm-dev: only bench_attn --products links it (bench/attn_products.h)
DEB_PKGS="build-essential cmake pkg-config libcmocka-dev libopenblas-dev libpcre2-dev zlib1g-dev libcjson-dev libdnnl-dev libxsmm-dev"
missing=""
for p in $DEB_PKGS; do
  dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"
done
if [ -n "$missing" ]; then
  echo "setup: installing Debian packages:$missing" >&2
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing >/dev/null
fi

PY_PKGS="numpy gguf pytest pytest-xdist tokenizers"
if ! python3 -c "import numpy, gguf, pytest, xdist, tokenizers" >/dev/null 2>&1; then
  echo "setup: installing Python packages: $PY_PKGS" >&2
  python3 -m pip install -q $PY_PKGS
fi

if [ "$want_model" = 1 ]; then
  bash scripts/get_model.sh
fi

if [ "$want_vllm" = 1 ]; then
  bash scripts/setup_vllm.sh
fi
