#!/bin/sh
# no_cpuid.sh LIBRARY COMPILER_ID -- fails if the library's objects hold a
# CPUID instruction. The SIMD level is asked once per Hadamard rotation
# (src/common/cpu.c), ~720 times per decoded SmolLM2 token; in this
# project's Firecracker VMs a CPUID traps to the hypervisor (8.2 us), which
# cost a KVarN cache 5.9 ms per token. GCC builds read the feature bits
# libgcc stored at start-up; clang 14 builds keep one CPUID (cpu.c), so
# they are skipped (77). Needs objdump (binutils, installed with gcc).
lib=$1
cc_id=$2
[ "$cc_id" = "GNU" ] || { echo "no_cpuid: compiler $cc_id keeps CPUID in cpu.c; skipped"; exit 77; }
command -v objdump >/dev/null || { echo "no_cpuid: objdump not found (binutils)"; exit 1; }
out=$(objdump -d --no-show-raw-insn "$lib") || { echo "no_cpuid: objdump failed on $lib"; exit 1; }
hits=$(printf '%s\n' "$out" | awk '/^[0-9a-f]+ <.*>:$/ { fn = $2 } /\tcpuid/ { print "  " fn }')
if [ -n "$hits" ]; then
    echo "no_cpuid: CPUID in $lib, in:"
    printf '%s\n' "$hits"
    exit 1
fi
echo "no_cpuid: no CPUID in $lib"
