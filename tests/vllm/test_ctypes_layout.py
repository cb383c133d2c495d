"""The plug-in's ctypes mirrors of the C structs (python/kvarn_vllm/_lib.py)
have the C compiler's layout: every field's offset and each struct's size,
read from a small C program built against include/kvarn. A field added to
paged.h without its mirror fails here, not as wild memory in a server; so
does a kvarn_staging value or name that differs from its mirror, and a
kvarn_attn_arith value (_lib.ARITH_NAMES)."""
import ctypes
import os
import subprocess

import pytest

from kvarn_vllm import _lib
from conftest import ROOT

STRUCTS = {"kvarn_format": _lib.Format, "kvarn_paged_kv": _lib.PagedKV,
           "kvarn_seq_view": _lib.SeqView, "kvarn_attn_opts": _lib.AttnOpts,
           "kvarn_attn_kernel_info": _lib.AttnKernelInfo,
           "kvarn_cache_opts": _lib.CacheOpts, "kvarn_cache_info": _lib.CacheInfo,
           "kvarn_cuda_attn_shape": _lib.CudaAttnShape,
           "kvarn_cuda_attn_plan": _lib.CudaAttnPlan,
           "kvarn_cuda_attn_args": _lib.CudaAttnArgs,
           "kvarn_mla_format": _lib.MlaFormat}


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory):
    d = tmp_path_factory.mktemp("layout")
    lines = ['#include <stdio.h>', '#include <stddef.h>', '#include "kvarn/paged.h"',
             '#include "kvarn/attn.h"', '#include "kvarn/cuda.h"', '#include "kvarn/cache.h"', '#include "kvarn/mla.h"',
             'int main(void) {']
    for cname, py in STRUCTS.items():
        lines.append(f'printf("{cname} size %zu\\n", sizeof({cname}));')
        for f, _ in py._fields_:
            lines.append(f'printf("{cname} {f} %zu\\n", offsetof({cname}, {f}));')
    for name, v in _lib.STAGING_NAMES.items():
        c = "KVARN_STAGING_" + name.upper()
        lines.append(f'printf("staging {name} %d\\n", (int){c});')
    for v, name in _lib.ARITH_NAMES.items():
        c = "KVARN_ATTN_ARITH_" + name.upper()
        lines.append(f'printf("arith {name} %d\\n", (int){c});')
    lines += ['return 0;', '}']
    src = d / "layout.c"
    src.write_text("\n".join(lines))
    exe = d / "layout"
    subprocess.run(["cc", "-std=c11", "-I", os.path.join(ROOT, "include"), str(src), "-o",
                    str(exe)], check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    return {tuple(l.split()[:2]): int(l.split()[2]) for l in out.splitlines()}


@pytest.mark.parametrize("cname", list(STRUCTS))
def test_struct_matches_c(c_layout, cname):
    py = STRUCTS[cname]
    assert ctypes.sizeof(py) == c_layout[(cname, "size")]
    for f, _ in py._fields_:
        assert getattr(py, f).offset == c_layout[(cname, f)], f


def test_staging_values_match_c(c_layout):
    """_lib.STAGING_NAMES: the enum's values (paged.h kvarn_staging) and the
    library's names for them (kvarn_cache_staging_name), nothing more."""
    for name, v in _lib.STAGING_NAMES.items():
        assert c_layout[("staging", name)] == v, name
        assert _lib.lib().kvarn_cache_staging_name(v).decode() == name
    assert _lib.lib().kvarn_cache_staging_name(len(_lib.STAGING_NAMES)) is None


def test_arith_values_match_c(c_layout):
    """_lib.ARITH_NAMES: attn.h's kvarn_attn_arith values, by name."""
    for v, name in _lib.ARITH_NAMES.items():
        assert c_layout[("arith", name)] == v, name
