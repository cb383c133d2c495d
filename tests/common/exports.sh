#!/bin/sh
# exports.sh LIBRARY HEADER_DIR -- the shared library exports the public
# API and nothing else (src/libkvarn.map): fails on a defined dynamic
# symbol outside kvarn_[a-z0-9]*, and on a function declared in a public
# header (a line "kvarn_... kvarn_name(" outside a static inline body)
# that the library does not export (cuda.h is libkvarn_cuda.so's). Needs nm
# (binutils, installed with gcc).
lib=$1
inc=$2
command -v nm >/dev/null || { echo "exports: nm not found (binutils)"; exit 1; }
syms=$(nm -D --defined-only "$lib" | awk '$2 ~ /^[TDBRVW]$/ { print $3 }') ||
    { echo "exports: nm failed on $lib"; exit 1; }
[ -n "$syms" ] || { echo "exports: $lib exports nothing"; exit 1; }
bad=$(printf '%s\n' "$syms" | grep -v '^kvarn_[a-z0-9]' | grep -v '^_init$\|^_fini$')
if [ -n "$bad" ]; then
    echo "exports: $lib exports names outside the public API:"
    printf '  %s\n' $bad
    exit 1
fi
# Declared functions: an identifier kvarn_x followed by "(" at the start of
# a declaration line (return type before it), not a static inline one.
missing=""
for f in $(grep -hoE '^[a-z_][a-z0-9_ *]* \**kvarn_[a-z0-9][a-z0-9_]*\(' $(ls "$inc"/kvarn/*.h | grep -v '/cuda\.h$') |
           grep -v 'static\|KVARN_PAGED_FN\|#define' | grep -oE 'kvarn_[a-z0-9_]+\($' | tr -d '('); do
    printf '%s\n' "$syms" | grep -qx "$f" || missing="$missing $f"
done
if [ -n "$missing" ]; then
    echo "exports: declared in $inc/kvarn but not exported by $lib:$missing"
    exit 1
fi
echo "exports: $(printf '%s\n' "$syms" | wc -l) public symbols, nothing else"
