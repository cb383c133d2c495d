"""kvarn-vllm-ladder: the quality ladder of KV-cache formats through vLLM,
for any model it serves (docs/eval.md "Through vLLM").

    python -m kvarn_vllm.ladder --model DIR --text FILE
        [--kv-cache-dtype all|LIST] [--ctx 2048] [--windows 4] [--decode 256]
        [--budget 16GiB] [--max-num-seqs N] [--max-num-batched-tokens 4096]
        [--dtype float32] [--engine-kv 1GiB] [--token-ids FILE]
        [--json FILE] [--plot FILE.png]

For every format, against vLLM's unquantized cache of the model (`auto`:
the model's dtype, the reference, named in the header):

  - capacity, as vLLM computes it for a KV budget of --budget bytes: bytes
    per token (vLLM's page bytes / block tokens, all layers), the KV tokens
    vLLM reports (its block count x block size, the plug-in's staging pool
    taken out first, as the plug-in's worker does; for an MLA record
    format its fp32 tail pool instead, below), that over the
    reference's, and how many requests of --ctx tokens fit (vLLM's blocks
    less its null block over the blocks one request holds, summed over the
    KV-cache groups as vLLM counts them: a model with local and global
    layers, Gemma-2's, has two groups drawing on one pool, and there KV
    tokens is vLLM's own group-aware figure, blocks / blocks per request x
    --ctx). The staging pool
    grows with max_num_seqs, so without --max-num-seqs each format gets the
    largest max_num_seqs N whose pool still leaves room for N such requests
    (the server sized for what it holds); with it, that N, and the fit is
    capped at it. The figures come from vLLM's own get_kv_cache_configs and
    the plug-in's staging_pool, called in the engine's process for --budget:
    nothing of that size is allocated (the measuring engine has a KV budget
    of --engine-kv, 1 GiB by default).
  - quality, over --windows windows of --ctx tokens of the text (the first
    windows * ctx tokens, the text tokenized once by the model's tokenizer,
    as `kvarn eval` does): each window is one prompt, and vLLM's prompt
    log-probabilities give each position's next-token distribution. The
    positions [0, ctx - decode) are the "prompt" columns (KLD mean, median,
    p99, top-1), the last --decode positions ("decode" columns: decode
    positions - 1 of them are scored, the last token has no next token)
    are the positions `kvarn eval` decodes one at a time. In vLLM with the
    plug-in every query reads the earlier tiles as committed records and
    its own tile as staged (docs/vllm.md "A step"), which is what `kvarn
    eval`'s decode column measures; vLLM's own caches also attend to the
    cache as stored. So the decode columns are the protocol of `kvarn eval
    --decode-tokens D` and comparable with it; the prompt columns are not
    `kvarn eval`'s chunked ones (there a chunk attends to its own K/V
    exactly). PPL over every scored position, and its delta to the
    reference's.
  - KLD: vLLM returns the top-k log-probabilities of a position, not the
    whole distribution. Where the vocabulary has at most EXACT_VOCAB
    entries every entry is asked for and KLD is exact; otherwise KLD is
    folded: the reference's top FOLD_TOP tokens that the format's top
    FORMAT_TOP also holds (both probabilities known), the rest of both
    distributions in one bucket. That is a partition of the vocabulary,
    and merging outcomes can only lower KL: a lower bound of the exact
    figure (looser where the format's top lacks some of the reference's;
    those positions are counted). Top-1 and PPL are exact either way (vLLM
    always returns the prompt token's own log-probability).

MLA models (DeepSeek-V2/V3, Kimi-K2: multi-head latent attention, decided
before any engine by vLLM's own rule on the model's config, model_uses_mla,
and checked against the reference's engine). vLLM's CPU MLA backend, and
the plug-in's MLA backend over it, run a prompt as MHA on the fresh latents
(chunked prefill and prefix caching are off for MLA), so no prompt position
reads the cache: prompt log-probabilities alone would give a KLD of ~0 for
every format. So each window is a prompt of ctx - decode tokens, then
decode - 1 decode steps one token at a time over the cache, each step's
token forced to the text's (teacher forcing: a vLLM v1 logits processor,
_forced_tokens_processor, passed as LLM(logits_processors=[...]), the
tokens in SamplingParams.extra_args; the returned log-probabilities come
from the raw logits before it, logprobs_mode "raw_logprobs"), for the
reference and every format alike; a step whose token is not the text's is
an error. The decode columns are the decoded positions; the prompt columns
stay the prompt's log-probabilities (with the prefill's last position, the
first step's), ~0 by construction for every format (the table's header
says so). The formats there: the plug-in's MLA records (kvarn_mla_*,
docs/mla.md; capacity with the plug-in's fp32 tail pool, one slot of G
tokens per sequence and MLA layer, mla_backend.tail_pool as the
worker's reserve_tail_pool takes it out of the budget) and vLLM's own
caches that its MLA backend holds (its supported_kv_cache_dtypes: auto on
CPU_MLA); the K/V formats (kvarn_k*v*, which the plug-in refuses on MLA)
and vLLM's other names are refused without an engine, as are kvarn_mla_*
names on a model without MLA. vLLM's own cache rows of an MLA model run
with attention_backend="CPU_MLA" unless the weights are bfloat16 (--dtype,
or the config's dtype for --dtype auto): on a CPU with AMX tiles vLLM 0.32
picks AMX_MLA, which takes bf16 weights only (and blocks of a multiple of
32), so the reference at the default --dtype float32 could not run there;
with bf16 weights vLLM's choice stands. The rows name the attention
backends their engines ran (JSON attention_backends).

Formats (--kv-cache-dtype all): on a model without MLA, vLLM's auto,
bfloat16, fp8_e4m3 and fp8_e5m2, the four KVarN presets and their
mean-centred variants, kvarn_k4v2_g128 with each other staging, and
refused rows for kvarn eval's per-token names and one for every
kvarn_mla_* name; on an MLA model auto, the six ALL_MLA formats
(kvarn_mla_k{4,2,8}_g{128,64}, RoPE key at 8 bits; the r8 / r16 names run
when named), and refused rows for vLLM's names its MLA backend does not
hold, the presets and the per-token names, each with its reason in one
line. Named explicitly, a name refused without an engine is a usage error.

Each format runs in an engine of its own, in a process forked from this one
(which imports vLLM once and never the plug-in's backend: the plug-in reads
its settings at import and keeps a staging pool per process). A format may
carry plug-in settings after colons, e.g. kvarn_k4v2_g128:KVARN_STAGING=fp16
or kvarn_k4v2_g128:KVARN_SINK_TOKENS=16 (docs/vllm.md "Settings"); the MLA
record formats take none (a usage error).

For a model that adds a bias to its values (checks.has_value_bias: Qwen2's
family, attention_bias) the table ends with a line per plain KVarN format
run: which of it and its mean-centred variant (kvarn_X and kvarn_Xc, the
same settings) has the lower decode KLD, with the bytes per token of each,
or, where the centred one was not run, a line naming it. For a model that
mixes sliding-window and full layers (gpt-oss, Gemma-2/3/4) a line per
KVarN format run with the default KVARN_SLIDING_WINDOW (vllm: those layers
in vLLM's own cache) names the better of it and the same format with
KVARN_SLIDING_WINDOW=quantize, by KV tokens and KLD, or names the latter
to add (sliding_window_notes).

Output: a progress line on stderr (formats and windows), the table on
stdout, --json FILE the same numbers for machines, --plot FILE.png the
decode KLD (log) against capacity (matplotlib; labels placed so that none
overlaps another). Exit 0; 2 on a usage error
(a bad option, model, text or format name: nothing is run); 1 when the
reference cannot be served, or a format named in --kv-cache-dtype (not
through `all`) is refused at engine start (its row says why).
"""
import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
import traceback
import typing

from . import _proc

PROG = "kvarn-vllm-ladder"
REFERENCE = "auto"
EXACT_VOCAB = 4096     # vocabularies up to this: every entry asked for, exact KLD
FOLD_TOP = 20          # otherwise: the reference's top 20 folded ...
FORMAT_TOP = 100       # ... against the format's top 100
# `all`: vLLM's own unquantized and fp8 caches, the plug-in's presets, the
# default preset with each other staging, and the kvarn names the plug-in
# or vLLM may refuse (a row each, saying why); on an MLA model vLLM's names
# its MLA backend lists, the MLA record formats ALL_MLA, and the presets
# and the rest as refused rows
ALL_VLLM = ("auto", "bfloat16", "fp8_e4m3", "fp8_e5m2")
ALL_PRESETS = ("kvarn_k4v2_g128", "kvarn_k4v2_g64", "kvarn_k4v4_g128", "kvarn_k4v4_g64")
ALL_STAGINGS = ("fp16", "fp8_e4m3", "int4")   # besides the default (int8 on CPU)
ALL_KVARN_PER_TOKEN = ("fp16", "bf16", "int8", "int4")   # kvarn eval's names vLLM lacks
ALL_MLA = ("kvarn_mla_k4_g128", "kvarn_mla_k4_g64", "kvarn_mla_k2_g128", "kvarn_mla_k2_g64",
           "kvarn_mla_k8_g128", "kvarn_mla_k8_g64")   # RoPE key at the default 8 bits
MLA_NAMES = "kvarn_mla_k{2,4,8}[r{8,16}]_g{64,128}"
FORCE_ARG = "kvarn_ladder_forced_tokens"   # SamplingParams.extra_args key (MLA decode)
ENGINE_TIMEOUT_S = 3600


# the plug-in's settings a --kv-cache-dtype entry may carry (docs/vllm.md):
# any other KVARN_ name (a typo) would run the defaults under its label
SETTINGS = ("KVARN_STAGING", "KVARN_SINK_TOKENS", "KVARN_SINK_TILES", "KVARN_SLIDING_WINDOW",
            "KVARN_ATTN_THREADS", "KVARN_PREFILL_COMMIT")


class UsageError(Exception):
    """A bad option, model, text or format: reported with exit status 2.
    .short: the reason alone, without the list of what is accepted (the
    "refused" rows of `all`)."""

    def __init__(self, msg: str, short: str = ""):
        super().__init__(msg)
        self.short = short or msg


def parse_size(text: str) -> int:
    """Bytes from "16GiB", "512MiB", "1GB", "65536" (K/M/G/T with i: powers
    of 1024, without: of 1000). Raises UsageError on anything else or a
    size <= 0."""
    s = text.strip()
    units = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
             "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
    i = len(s)
    while i > 0 and s[i - 1].isalpha():
        i -= 1
    num, unit = s[:i], s[i:].lower()
    try:
        val = float(num) * units[unit]
    except (ValueError, KeyError):
        raise UsageError(f"--budget/--engine-kv: {text!r} is not a size (e.g. 16GiB, 512MiB, "
                         f"1e9)") from None
    if val < 1:
        raise UsageError(f"--budget/--engine-kv: {text!r} must be positive")
    return int(val)


class Job:
    """One format to measure: label (as given), cache dtype name, plug-in
    settings (environment), whether it was named explicitly."""

    def __init__(self, label: str, name: str, env: dict, explicit: bool):
        self.label, self.name, self.env, self.explicit = label, name, env, explicit


class ModelFacts:
    """What the format checks and the engines need to know of the model
    before any engine runs: its directory; mla, whether vLLM runs it with
    multi-head latent attention (vLLM's own rule on the model's config,
    model_uses_mla); for an MLA model the latent and RoPE-key widths
    (kv_lora_rank, qk_rope_head_dim) and the MLA attention backend of
    vLLM's own cache rows (vllm_mla_backend)."""

    def __init__(self, model: str, mla: bool, latent: int = 0, rope: int = 0,
                 dtype: str = "float32"):
        self.model, self.mla, self.latent, self.rope = model, mla, latent, rope
        self.dtype = dtype
        self.backend_asked, self.backend = vllm_mla_backend(dtype) if mla else (None, None)

    def mla_shape(self) -> str:
        """The model's attention in words, for the refusals' reasons."""
        return (f"multi-head latent attention (MLA: per token one {self.latent}-wide latent "
                f"and one {self.rope}-wide RoPE key, shared by its query heads)")


def model_uses_mla(model: str) -> tuple:
    """(mla, kv_lora_rank, qk_rope_head_dim, the config's dtype name): mla
    as vLLM 0.32 decides it (ModelConfig.use_mla: VLLM_MLA_DISABLE unset,
    a causal model, and its model-architecture convertor's is_deepseek_mla
    on the config vLLM reads, get_config). The reference's engine reports
    vLLM's own use_mla, which the ladder checks against this (a warning
    where they differ)."""
    import vllm.config  # noqa: F401  (vllm.transformers_utils imports it half-way otherwise)
    import vllm.envs as envs
    from vllm.transformers_utils.config import get_config, get_hf_text_config
    from vllm.transformers_utils.model_arch_config_convertor import \
        ModelArchConfigConvertorBase
    try:
        hf = get_config(model, trust_remote_code=False)
        text = get_hf_text_config(hf)
    except Exception as e:   # vLLM cannot read it: its engine will say why
        raise UsageError(f"--model {model}: vLLM cannot read its config ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})") from None
    dtype = str(getattr(text, "dtype", None) or getattr(hf, "dtype", None) or "float32")
    dtype = dtype.replace("torch.", "")
    mla = (not envs.VLLM_MLA_DISABLE and getattr(text, "is_causal", True)
           and ModelArchConfigConvertorBase(hf, text).is_deepseek_mla())
    return (bool(mla), int(getattr(text, "kv_lora_rank", 0) or 0),
            int(getattr(text, "qk_rope_head_dim", 0) or 0), dtype)


def vllm_mla_backend(dtype: str) -> tuple:
    """(the attention_backend the ladder asks for, or None; the backend
    vLLM's own MLA cache then runs) for model weights of this dtype (a
    torch dtype name; --dtype with "auto" resolved to the config's). vLLM
    0.32's CPU platform picks AMX_MLA for an MLA model where the CPU has AMX
    tiles, and AMX_MLA takes bf16 weights only (and blocks of a multiple of
    32, where the CPU build's CPU_MLA takes 16): for any other dtype the
    ladder asks for CPU_MLA (LLM(attention_backend="CPU_MLA"), which
    platforms/cpu.py honours in get_attn_backend_cls and
    check_and_update_config); for bf16 weights vLLM's choice stands."""
    if dtype in ("bfloat16", "bf16"):
        import torch
        return None, "AMX_MLA" if torch.cpu._is_amx_tile_supported() else "CPU_MLA"
    return "CPU_MLA", "CPU_MLA"


def _vllm_mla_refusal(name: str, backend: str) -> str:
    """Why vLLM's MLA backend (by name) cannot hold vLLM's cache dtype
    name, or "" where it can (the backend's supports_kv_cache_dtype: vLLM
    0.32 does not check it for MLA on CPU at start-up; CPU_MLA lists auto
    alone, and its first step with bfloat16 or fp8_e4m3 under fp32 weights
    fails with "expected scalar type Float", measured)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    cls = AttentionBackendEnum[backend].get_class()
    if cls.supports_kv_cache_dtype(name):
        return ""
    return (f"vLLM's MLA backend here ({backend}) holds kv_cache_dtype "
            f"{', '.join(cls.supported_kv_cache_dtypes)} only (its supported_kv_cache_dtypes; "
            f"vLLM 0.32's CPU build does not check it at start-up: with bfloat16 or fp8_e4m3 "
            f"its first step fails)")


def _vllm_cache_dtypes() -> tuple:
    """vLLM's own --kv-cache-dtype names (the CacheDType Literal of this
    build, before the plug-in extends it)."""
    import vllm.config.cache as cc
    return tuple(a for a in typing.get_args(cc.CacheDType) if not str(a).startswith("kvarn_"))


def _check_format(label: str, vllm_names: tuple, model: ModelFacts = None) -> Job:
    """A --kv-cache-dtype entry NAME[:KVARN_X=V...] checked without an
    engine: vLLM's names as its CacheDType lists them, kvarn_* by the
    plug-in's own check (the C library's parse, the plug-in's refusals),
    the settings by the plug-in's parsers. With model (None: the checks
    that depend on the model are skipped): on an MLA model the K/V formats
    (kvarn_k*v*, which the plug-in refuses there), vLLM's names its MLA
    backend does not hold, and an MLA name whose record cannot hold the
    model's latent / RoPE widths; on any other model the MLA names. Raises
    UsageError saying what is accepted (.short: the reason alone)."""
    from . import _lib
    from .patches import validate_name as _validate_name
    parts = label.split(":")
    name, env = parts[0], {}
    for kv in parts[1:]:
        if "=" not in kv or not kv.startswith("KVARN_"):
            raise UsageError(f"{label}: a setting after ':' is KVARN_NAME=VALUE (e.g. "
                             f"kvarn_k4v2_g128:KVARN_STAGING=fp16), got {kv!r}")
        k, v = kv.split("=", 1)
        if k not in SETTINGS:
            raise UsageError(f"{label}: {k} is not a setting of the plug-in; one of "
                             f"{', '.join(SETTINGS)}")
        env[k] = v
    kinds = (f"the plug-in's kvarn_k{{2,4,8}}v{{2,4,8}}_g{{32,64,128}} (K/V tiles), its "
             f"{MLA_NAMES} (MLA records) and vLLM's own {', '.join(vllm_names)}")
    if _lib.is_mla_dtype(name):
        try:
            _validate_name(name)
        except ValueError as e:
            raise UsageError(f"{e} (through vLLM: {kinds})", str(e)) from None
        if env:
            raise UsageError(f"{label}: the MLA record formats take none of the plug-in's "
                             f"settings ({', '.join(SETTINGS)}: a tile not yet full stays "
                             f"fp32 in the MLA tail pool, docs/mla.md); give {name} alone")
        if model is not None and not model.mla:
            why = (f"{name} stores MLA latent records (DeepSeek-V2/V3-style multi-head latent "
                   f"attention); {model.model} has no MLA layers (vLLM runs it without MLA)")
            raise UsageError(f"{why}: use a kvarn format of K/V tiles such as kvarn_k4v2_g128",
                             why)
        if model is not None:
            try:
                _lib.mla_parse(name, model.latent, model.rope)
            except ValueError as e:
                why = f"{model.model} uses {model.mla_shape()}, which {name} cannot hold ({e})"
                raise UsageError(f"{why}; measure vLLM's own cache (auto)", why) from None
        return Job(label, name, env, True)
    if _lib.is_kvarn_dtype(name):
        try:
            _validate_name(name)
        except ValueError as e:
            raise UsageError(f"{e} (through vLLM: {kinds})", str(e)) from None
        if "KVARN_STAGING" in env:
            try:
                _lib.parse_staging(env["KVARN_STAGING"])
            except ValueError as e:
                raise UsageError(f"{label}: {e}") from None
        if "KVARN_SLIDING_WINDOW" in env:
            from .settings import SLIDING_ENV, Settings
            old_env = os.environ.get(SLIDING_ENV)
            os.environ[SLIDING_ENV] = env["KVARN_SLIDING_WINDOW"]
            try:
                Settings.from_env()
            except ValueError as e:
                raise UsageError(f"{label}: {e}") from None
            finally:
                if old_env is None:
                    os.environ.pop(SLIDING_ENV, None)
                else:
                    os.environ[SLIDING_ENV] = old_env
        if env.get("KVARN_PREFILL_COMMIT", "exact") not in ("exact", "staged"):
            raise UsageError(f"{label}: KVARN_PREFILL_COMMIT must be exact or staged, got "
                             f"{env['KVARN_PREFILL_COMMIT']!r}")
        for k in ("KVARN_SINK_TOKENS", "KVARN_SINK_TILES", "KVARN_ATTN_THREADS"):
            if k in env and not (env[k].isdigit()):
                raise UsageError(f"{label}: {k} must be a whole number >= 0, got {env[k]!r}")
        if model is not None and model.mla:
            why = (f"{model.model} uses {model.mla_shape()}; {name} stores K and V tiles per KV "
                   f"head, which an MLA layer does not have (the plug-in refuses it there)")
            raise UsageError(f"{why}: use an MLA record format ({', '.join(ALL_MLA[:2])}, "
                             f"... {MLA_NAMES}) or vLLM's own cache (auto)", why)
        return Job(label, name, env, True)
    if env:
        raise UsageError(f"{label}: KVARN_* settings apply to the plug-in's kvarn_* formats "
                         f"only, not to vLLM's {name}")
    if name in vllm_names:
        if model is not None and model.mla:
            why = _vllm_mla_refusal(name, model.backend)
            if why:
                raise UsageError(f"{name} on {model.model}: {why}; measure auto or an MLA record "
                                 f"format ({MLA_NAMES})", why)
        return Job(label, name, env, True)
    accepted = (f"accepted: vLLM's own {', '.join(vllm_names)} (this build), the plug-in's "
                f"kvarn_k{{2,4,8}}v{{2,4,8}}_g{{32,64,128}} (e.g. kvarn_k4v2_g128) and, for "
                f"an MLA model, {MLA_NAMES} (e.g. kvarn_mla_k4_g128), or all")
    try:
        _lib.parse_format(name)
    except ValueError:
        raise UsageError(f"unknown --kv-cache-dtype {name!r}; {accepted}") from None
    why = (f"{name} is a per-token format of the kvarn library (`kvarn eval` measures it); "
           f"vLLM has no such cache dtype and the plug-in serves the KVarN formats only")
    raise UsageError(f"{why}; {accepted}", why)


def _all_names(vllm_names: tuple, model: ModelFacts) -> tuple:
    """(names to run, [label, reason] refused) of `all` for this model
    (module docstring "Formats"): each candidate through _check_format, a
    refused row where it says no."""
    names, refused = [], []
    mla = model is not None and model.mla
    refused += [[n, f"not a cache dtype of this vLLM build ({', '.join(vllm_names)})"]
                for n in ALL_VLLM if n not in vllm_names]
    cands = [n for n in ALL_VLLM if n in vllm_names]
    if mla:
        cands += list(ALL_MLA) + list(ALL_PRESETS) + list(ALL_KVARN_PER_TOKEN)
    else:
        cands += list(ALL_PRESETS)
        cands += [f"{ALL_PRESETS[0]}:KVARN_STAGING={s}" for s in ALL_STAGINGS]
        cands += [p + "c" for p in ALL_PRESETS] + list(ALL_KVARN_PER_TOKEN)
    for cand in cands:
        try:
            _check_format(cand, vllm_names, model)
            names.append(cand)
        except UsageError as err:
            refused.append([cand, err.short])
    if model is not None and not mla:   # one line for the 18 MLA names
        try:
            _check_format(ALL_MLA[0], vllm_names, model)
        except UsageError as err:
            refused.append(["kvarn_mla_*", err.short.replace(ALL_MLA[0], f"{MLA_NAMES}")])
    return names, refused


def expand_formats(arg: str, vllm_names: tuple, model: ModelFacts = None) -> tuple:
    """(jobs, refused): the engines to run, reference first, and the
    [label, reason] of `all`'s names that this build or the model refuses
    without an engine. An explicit bad name raises UsageError. model: as
    _check_format (None: no check that depends on the model)."""
    jobs, refused, seen = [], [], set()
    entries = [e.strip() for e in arg.split(",") if e.strip()]
    if not entries:
        raise UsageError("--kv-cache-dtype: empty list")
    for e in entries:
        if e == "all":
            names, why = _all_names(vllm_names, model)
            refused += why
            for n in names:
                if n not in seen:
                    j = _check_format(n, vllm_names, model)
                    j.explicit = False
                    jobs.append(j)
                    seen.add(n)
        elif e not in seen:
            jobs.append(_check_format(e, vllm_names, model))
            seen.add(e)
    ref = [j for j in jobs if j.name == REFERENCE and not j.env]
    rest = [j for j in jobs if not (j.name == REFERENCE and not j.env)]
    ref = ref[:1] or [Job(REFERENCE, REFERENCE, {}, False)]
    return ref + rest, [r for r in refused if r[0] not in seen]


def coverage_warnings(jobs: list, ctx: int, decode: int) -> list:
    """Columns that would measure nothing quantized (`kvarn eval`'s rule,
    docs/eval.md "Columns that measure nothing quantized", for the
    plug-in's read rule): a query in tile t of a KVarN format (tile G, sink
    S tokens: KVARN_SINK_TOKENS, else KVARN_SINK_TILES x G, default G)
    reads records only from t > S // G on, so positions j < (S // G + 1) G
    see the staged sink and their own staged tile alone. An MLA record
    format (kvarn_mla_*, tile G, no sink) is read by decoded positions
    alone, from j = G - 1 on (that token completes the first tile, which
    is encoded before its query attends); its prompt columns read no cache
    whatever the format (the table's header says so; no warning). One
    warning per column (prompt: j < ctx - decode; decode: ctx - decode <=
    j <= ctx - 2) whose positions all lie below that, naming the formats
    and the --ctx that would measure them. vLLM's own formats quantize
    every token and get none."""
    from . import _lib
    first, mla = {}, set()
    for j in jobs:
        if _lib.is_mla_dtype(j.name):
            first[j.label] = _lib.mla_parse(j.name).tile_tokens - 1
            mla.add(j.label)
            continue
        if not _lib.is_kvarn_dtype(j.name):
            continue
        G = _lib.parse_format(j.name).tile_tokens
        if "KVARN_SINK_TOKENS" in j.env:
            S = int(j.env["KVARN_SINK_TOKENS"])
        else:
            S = int(j.env.get("KVARN_SINK_TILES", 1)) * G
        first[j.label] = (S // G + 1) * G
    out = []
    for col, last, need in (("prompt", ctx - decode - 1, lambda f: f + decode + 1),
                            ("decode", ctx - 2, lambda f: f + 2)):
        if last < 0:
            continue
        blind = [lab for lab, f in first.items() if last < f and not (col == "prompt"
                                                                     and lab in mla)]
        if blind:
            out.append(f"the {col} columns of {', '.join(blind)} read no quantized tile "
                       f"(positions up to {last}; the first that reads one is "
                       f"{min(first[b] for b in blind)}): their KLD reads about 0 whatever the "
                       f"format; --ctx {max(need(first[b]) for b in blind)} or more measures them")
    return out


# ---------------------------------------------------------------- the engine's process


def _blocks_per_request(vllm_config, groups, ctx: int) -> int:
    """Blocks one request of ctx tokens holds, summed over the KV-cache
    groups (each group's block table draws on the one pool), as vLLM 0.32's
    get_max_concurrency_for_kv_cache_config counts them with max_model_len
    ctx: a full-attention group ceil(ctx / its block size), a
    sliding-window group the blocks its window and a step's tokens span."""
    mc = vllm_config.model_config
    old = mc.max_model_len
    try:
        mc.max_model_len = ctx
        return sum(-(-g.kv_cache_spec.max_memory_usage_bytes(vllm_config)
                     // g.kv_cache_spec.page_size_bytes) for g in groups)
    finally:
        mc.max_model_len = old


def _capacity(orig, vllm_config, specs, job_cfg) -> dict:
    """What vLLM computes for a KV budget of job_cfg["budget"] bytes, in
    the engine's process (called from get_kv_cache_configs, with the
    model's KV cache specs): bytes per token, block size, and per
    max_num_seqs n the blocks that vLLM's own get_kv_cache_configs gives
    for the budget less the plug-in's pool for n sequences, what the
    plug-in's worker takes out: the staging pool of the K/V formats
    (layout.staging_pool), the fp32 tail pool of the MLA record formats
    (mla_backend.tail_pool at n, as reserve_tail_pool sizes it)."""
    from . import _lib
    cc, sc = vllm_config.cache_config, vllm_config.scheduler_config
    kvarn = _lib.is_kvarn_dtype(cc.cache_dtype)
    mla = kvarn and _lib.is_mla_dtype(cc.cache_dtype)
    layer_specs = list(specs[0].values())
    bpt = sum(s.page_size_bytes / s.block_size for s in layer_specs)

    ctx, budget = job_cfg["ctx"], job_cfg["budget"]

    def blocks(n: int, budget: int) -> tuple:
        """(blocks, pool bytes, block size, blocks a request of ctx tokens
        holds, KV-cache groups, refusal) at max_num_seqs n."""
        old = sc.max_num_seqs
        try:
            sc.max_num_seqs = n
            pool = 0
            if mla:
                from .mla_backend import tail_pool
                pool = tail_pool(vllm_config)["bytes"]
            elif kvarn:
                from .layout import staging_pool
                pool = staging_pool(vllm_config, budget, "cpu")["bytes"]
            if pool >= budget:
                what = "MLA tail pool" if mla else "staging pool"
                return 0, pool, None, None, 0, (f"the {what} for max_num_seqs={n} "
                                                f"({pool} bytes) fills the budget")
            try:
                cfgs = orig(vllm_config, specs, [budget - pool] * len(specs))
            except ValueError as e:    # vLLM: not enough for one max_model_len request
                return 0, pool, None, None, 0, str(e).split("\n")[0]
            nb = min(c.num_blocks for c in cfgs)
            groups = cfgs[0].kv_cache_groups
            bs = min(g.kv_cache_spec.block_size for g in groups)
            return nb, pool, bs, _blocks_per_request(vllm_config, groups, ctx), len(groups), None
        finally:
            sc.max_num_seqs = old

    def fit(n: int) -> tuple:
        nb, pool, bs, per_req, ng, why = blocks(n, budget)
        if not nb:
            return 0, nb, pool, bs, per_req, ng, why
        return max(0, nb - 1) // per_req, nb, pool, bs, per_req, ng, why   # one null block

    want = job_cfg.get("max_num_seqs")
    if want:
        n = want
    else:   # the largest n whose pool leaves room for n requests
        hi = fit(1)[0]
        lo, n = 1, 1 if hi >= 1 else 0
        while lo <= hi:
            mid = (lo + hi) // 2
            if fit(mid)[0] >= mid:
                n, lo = mid, mid + 1
            else:
                hi = mid - 1
    f, nb, pool, bs, per_req, ng, why = fit(max(n, 1))
    if bs is None:
        kv_tokens = None
    elif ng <= 1:
        kv_tokens = nb * bs
    else:     # several groups share the blocks: vLLM's own figure at ctx
        kv_tokens = nb * ctx // per_req
    out = dict(bytes_per_token=bpt, budget_blocks=nb, block_size=bs,
               max_num_batched_tokens=sc.max_num_batched_tokens, kv_cache_groups=ng,
               blocks_per_request=per_req, kv_tokens=kv_tokens, pool_bytes=pool,
               max_num_seqs=n, requests_fit=min(f, n),
               capped=bool(want) and f > want, refusal=why)
    # the engine's own budget and max_num_seqs, to check against what the
    # engine then reports
    out["engine_blocks_predicted"] = blocks(sc.max_num_seqs, job_cfg["engine_kv"])[0]
    return out


def _forced_tokens_processor():
    """The class of a vLLM v1 logits processor (vllm.v1.sample.logits_processor
    .LogitsProcessor, given to LLM(logits_processors=[...])) that forces
    each decode step's token: a request whose SamplingParams.extra_args
    hold FORCE_ARG: [t_0, t_1, ...] gets, at the step after its k-th
    output token, every logit but t_k's set to -inf and t_k's to 0, so that
    greedy sampling picks t_k (a request without it is left alone; past the
    list, nothing is forced). It is not argmax-invariant, so vLLM's sampler
    applies it before sampling and after it has taken the log-probabilities
    it returns from the raw logits (logprobs_mode "raw_logprobs", vLLM
    0.32's default, which the ladder also passes): the returned
    distributions are the model's, untouched by the forcing."""
    import torch
    from vllm.v1.sample.logits_processor import LogitsProcessor
    from vllm.v1.sample.logits_processor.builtin import process_dict_updates

    class ForcedTokens(LogitsProcessor):
        @classmethod
        def validate_params(cls, params):
            f = (params.extra_args or {}).get(FORCE_ARG)
            if f is not None and not (isinstance(f, list)
                                      and all(isinstance(t, int) and t >= 0 for t in f)):
                raise ValueError(f"extra_args[{FORCE_ARG!r}]: a list of token ids expected")

        def __init__(self, vllm_config, device, is_pin_memory):
            self.req = {}      # batch row -> (forced ids, the request's output ids so far)

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update) -> None:
            def new(params, _prompt, out):
                f = (params.extra_args or {}).get(FORCE_ARG)
                return None if f is None else (f, out)
            process_dict_updates(self.req, batch_update, new)

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            for row, (forced, out) in self.req.items():
                k = len(out)
                if k < len(forced):
                    logits[row].fill_(float("-inf"))
                    logits[row, forced[k]] = 0.0
            return logits
    return ForcedTokens


def _flat_rows(fl, skip: int, n: int, K: int, first: list, what: str) -> dict:
    """A window's part from vLLM's FlatLogprobs fl (flat_logprobs=True):
    positions skip .. skip + n - 1 of it, each K + 1 entries (the scored
    token, then the top K by rank; the positions before skip hold none).
    first: the token each position's entry 0 must be (the next token of the
    text). Returns actual_lp float32 [n], top_ids int32 [n, K], top_lps
    float32 [n, K]. RuntimeError on any other layout."""
    import numpy as np
    if n == 0:
        return dict(actual_lp=np.zeros(0, np.float32), top_ids=np.zeros((0, K), np.int32),
                    top_lps=np.zeros((0, K), np.float32))
    starts, ends = np.asarray(fl.start_indices), np.asarray(fl.end_indices)
    if len(starts) != skip + n or not np.all(ends[skip:] - starts[skip:] == K + 1) \
            or starts[skip] != 0:
        raise RuntimeError(f"unexpected {what} layout from vLLM (positions {len(starts)}, "
                           f"expected {skip + n}, the last {n} of {K + 1} entries)")
    tid = np.asarray(fl.token_ids, dtype=np.int32).reshape(n, K + 1)
    lp = np.asarray(fl.logprobs, dtype=np.float32).reshape(n, K + 1)
    if not np.array_equal(tid[:, 0], np.asarray(first, dtype=np.int32)):
        raise RuntimeError(f"vLLM's {what} do not start with the text's tokens")
    return dict(actual_lp=lp[:, 0].copy(), top_ids=tid[:, 1:].copy(),
                top_lps=lp[:, 1:].copy())


def _attention_backends(vllm_config) -> list:
    """The names of the attention backends the engine's layers run
    (get_name() of each layer's attn_backend: CPU_ATTN, CPU_MLA, AMX_MLA,
    KVARN, KVARN_MLA, ...)."""
    out = set()
    for layer in vllm_config.compilation_config.static_forward_context.values():
        b = getattr(layer, "attn_backend", None)
        if b is not None:
            try:
                out.add(b.get_name())
            except Exception:
                out.add(getattr(b, "__name__", str(b)))
    return sorted(out)


def _measure(job: Job, cfg: dict, send) -> dict:
    """In the engine's process: start the engine, read vLLM's capacity
    figures, run the windows, each one done told through send(text).
    Returns the result dict (no metrics: the parent scores against the
    reference).

    A window of ctx tokens gives ctx - 1 positions (row j: the distribution
    after token j). On a model without MLA it is one prompt, every row from
    vLLM's prompt log-probabilities. On an MLA model (cfg["mla"]) with
    decode > 0 it is a prompt of P = ctx - decode tokens (rows 0 .. P - 2
    from its prompt log-probabilities) and decode steps forced to the
    text's next tokens (_forced_tokens_processor; rows P - 1 .. ctx - 2
    from the steps' log-probabilities, row P - 1 the prefill's own last
    position); RuntimeError if a decoded token is not the text's."""
    import numpy as np
    import vllm.v1.engine.core as core
    cap = {}
    orig = core.get_kv_cache_configs

    def get_kv_cache_configs(vllm_config, specs, avail):
        try:
            cap.update(_capacity(orig, vllm_config, specs, cfg))
        except Exception as e:  # reported in the row, the measurement goes on
            cap["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        return orig(vllm_config, specs, avail)
    core.get_kv_cache_configs = get_kv_cache_configs
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from . import _lib
    K = cfg["top"]
    decode = cfg["decode"]
    forced = cfg["mla"] and decode > 0
    kw = dict(model=cfg["model"], dtype=cfg["dtype"], seed=0, enforce_eager=True,
              kv_cache_dtype=job.name, max_num_seqs=1, max_model_len=cfg["ctx"] + 1,
              enable_prefix_caching=False, max_logprobs=K,
              max_num_batched_tokens=cfg["max_num_batched_tokens"],
              kv_cache_memory_bytes=cfg["engine_kv"])
    if _lib.is_mla_dtype(job.name):
        kw["block_size"] = _lib.mla_parse(job.name).tile_tokens
    elif _lib.is_kvarn_dtype(job.name):
        kw["block_size"] = _lib.parse_format(job.name).tile_tokens
    elif cfg["mla"] and cfg.get("attention_backend"):
        kw["attention_backend"] = cfg["attention_backend"]   # vllm_mla_backend
    if forced:
        kw.update(logits_processors=[_forced_tokens_processor()], logprobs_mode="raw_logprobs")
    t0 = time.perf_counter()
    llm = LLM(**kw)
    t_start = time.perf_counter() - t0
    vc = llm.llm_engine.vllm_config
    mc, cc = vc.model_config, vc.cache_config
    windows = []
    for w, ids in enumerate(cfg["windows"]):
        if not forced:
            sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=K,
                                detokenize=False, flat_logprobs=True)
            out = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
            windows.append(_flat_rows(out.prompt_logprobs, 1, len(ids) - 1, K, ids[1:],
                                      "prompt_logprobs"))
        else:
            P = len(ids) - decode
            sp = SamplingParams(temperature=0, max_tokens=decode, logprobs=K,
                                prompt_logprobs=K, detokenize=False, flat_logprobs=True,
                                ignore_eos=True, extra_args={FORCE_ARG: list(ids[P:])})
            out = llm.generate([TokensPrompt(prompt_token_ids=ids[:P])], sp,
                               use_tqdm=False)[0]
            got = list(out.outputs[0].token_ids)
            if got != list(ids[P:]):
                bad = next((i for i, (a, b) in enumerate(zip(got, ids[P:])) if a != b),
                           min(len(got), decode))
                raise RuntimeError(f"the forced decode of window {w + 1} left the text at "
                                   f"step {bad} ({len(got)} of {decode} tokens decoded)")
            pre = _flat_rows(out.prompt_logprobs, 1, P - 1, K, ids[1:P], "prompt_logprobs")
            dec = _flat_rows(out.outputs[0].logprobs, 0, decode, K, ids[P:], "logprobs")
            windows.append({k: np.concatenate([pre[k], dec[k]]) for k in pre})
        send(str(w + 1))
    from .checks import has_value_bias
    res = dict(windows=windows, capacity=cap, start_s=t_start,
               run_s=time.perf_counter() - t0,
               engine_blocks=cc.num_gpu_blocks, engine_block_size=cc.block_size,
               model_dtype=str(mc.dtype).replace("torch.", ""),
               vocab=mc.get_vocab_size(), head_dim=mc.get_head_size(),
               value_bias=has_value_bias(mc.hf_text_config),
               sliding_layers=_sliding_layers(mc),
               use_mla=bool(getattr(mc, "use_mla", False)),
               attention_backends=_attention_backends(vc), forced_decode=forced)
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    return res


def _engine_process(job: Job, cfg: dict, send) -> dict:
    """The forked process of one format (_proc.run: vLLM's output in its
    log): the result of _measure, or the error it raised, as a dict;
    progress (windows done) through send."""
    # the engine core in this process (one import of torch and vLLM,
    # inherited); the KV budget is kv_cache_memory_bytes alone
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    os.environ.update(job.env)
    try:
        return _measure(job, cfg, send)
    except BaseException as e:
        traceback.print_exc()
        msg = str(e).strip()
        return {"error": f"{type(e).__name__}: {msg}" if msg else type(e).__name__}


class Progress:
    """The progress line on stderr: rewritten in place on a terminal, one
    line per event otherwise."""

    def __init__(self, n_formats: int, n_windows: int):
        self.nf, self.nw = n_formats, n_windows
        self.tty = sys.stderr.isatty()
        self.open = False

    def show(self, i: int, label: str, what: str) -> None:
        line = f"{PROG}: [{i}/{self.nf}] {label}: {what}"
        if self.tty:
            sys.stderr.write("\r\x1b[K" + line)
            self.open = True
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def end(self) -> None:
        if self.open:
            sys.stderr.write("\n")
            sys.stderr.flush()
        self.open = False


def run_job(job: Job, cfg: dict, tmp: str, idx: int, progress: Progress) -> dict:
    """Fork the format's engine process (_proc.run, ENGINE_TIMEOUT_S),
    follow its progress (progress.show), return its result ({"error": ...}
    if it failed; "log" names vLLM's output)."""
    log_path = os.path.join(tmp, f"job{idx}.log")
    progress.show(idx, job.label, "starting the engine")

    def on_line(line: str) -> None:
        progress.show(idx, job.label, f"window {int(line)}/{len(cfg['windows'])} done")
    try:
        res = _proc.run(lambda send: _engine_process(job, cfg, send), log_path,
                        timeout=ENGINE_TIMEOUT_S, on_line=on_line,
                        what="the engine's process").value_or_raise()
    except _proc.ChildError as e:
        res = {"error": e.reason}
    res["log"] = log_path
    return res


# ---------------------------------------------------------------- scoring


def _stats(kl: list) -> dict:
    """mean, median, p99 (nearest rank), max of per-position KLDs, as
    tools/eval_stats.c computes them; None where there is none."""
    if not kl:
        return dict(mean=None, median=None, p99=None, max=None)
    s = sorted(kl)
    n = len(s)
    med = s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])
    r = math.ceil(0.99 * n)
    return dict(mean=sum(s) / n, median=med, p99=s[(r or 1) - 1], max=s[-1])


def score(ref: dict, fmt: dict, ctx: int, decode: int, exact: bool) -> dict:
    """A format's windows against the reference's: per position j (the
    distribution after token j, predicting j + 1; j < ctx - decode: prompt
    columns, else decode columns) KL(reference || format) in nats, exact
    over the whole vocabulary or folded (module docstring), top-1
    agreement, NLL.

    ref, fmt: {"windows": [...]}, one dict per window, as the engine's
    process returns them, with n = ctx - 1 positions: top_ids int32 [n, K]
    and top_lps float32 [n, K] (the K most likely tokens by rank and their
    log-probabilities; K = the vocabulary in exact mode, and every row
    then a permutation of it), actual_lp float32 [n] (the next token's
    log-probability). Folded mode needs K >= FOLD_TOP. Returns kld_mean,
    kld_median, kld_p99, kld_max, top1 (a fraction), prompt_positions,
    kld_partial, the same with decode_ for the decode columns (None where
    a column has no position), ppl over all positions and positions."""
    import numpy as np
    cols = {"prompt": dict(kl=[], top1=0, n=0, partial=0),
            "decode": dict(kl=[], top1=0, n=0, partial=0)}
    nll, npos = 0.0, 0
    for rw, fw in zip(ref["windows"], fmt["windows"]):
        n = len(rw["actual_lp"])
        nll -= float(np.sum(fw["actual_lp"], dtype=np.float64))
        npos += n
        agree = rw["top_ids"][:, 0] == fw["top_ids"][:, 0]
        if exact:
            V = rw["top_ids"].shape[1]
            P = np.empty((n, V))
            Q = np.empty((n, V))
            rows = np.arange(n)[:, None]
            P[rows, rw["top_ids"]] = rw["top_lps"]
            Q[rows, fw["top_ids"]] = fw["top_lps"]
            kl = np.maximum(0.0, np.sum(np.exp(P) * (P - Q), axis=1)).tolist()
            ok = [True] * n
        else:
            kl, ok = [], []
            for j in range(n):
                # the reference's top FOLD_TOP tokens that the format's top
                # FORMAT_TOP holds (both masses known), the rest one bucket:
                # a partition of the vocabulary, so a lower bound of the
                # exact KL whatever the format's top lacks (ok: lacks none)
                q = dict(zip(fw["top_ids"][j].tolist(), fw["top_lps"][j].tolist()))
                top = rw["top_ids"][j, :FOLD_TOP].tolist()
                lps = rw["top_lps"][j, :FOLD_TOP].tolist()
                both = [(lp_, q[t]) for t, lp_ in zip(top, lps) if t in q]
                pm = np.exp(np.array([a for a, _ in both], dtype=np.float64))
                qm = np.exp(np.array([b for _, b in both], dtype=np.float64))
                pr, qr = max(1e-12, 1 - pm.sum()), max(1e-12, 1 - qm.sum())
                k = float(np.sum(pm * np.log(pm / qm)) + pr * math.log(pr / qr))
                kl.append(max(0.0, k))
                ok.append(len(both) == len(top))
        for j in range(n):
            c = cols["prompt" if j < ctx - decode else "decode"]
            c["n"] += 1
            c["top1"] += int(agree[j])
            c["kl"].append(kl[j])
            c["partial"] += int(not ok[j])
    out = dict(ppl=math.exp(nll / npos) if npos else None, positions=npos)
    for name, c in cols.items():
        pre = "" if name == "prompt" else "decode_"
        st = _stats(c["kl"])
        out.update({pre + "kld_mean": st["mean"], pre + "kld_median": st["median"],
                    pre + "kld_p99": st["p99"], pre + "kld_max": st["max"],
                    pre + "top1": c["top1"] / c["n"] if c["n"] else None,
                    name + "_positions": c["n"], pre + "kld_partial": c["partial"]})
    return out


def ref_ppl(ref: dict) -> float:
    import numpy as np
    nll = -sum(float(np.sum(w["actual_lp"], dtype=np.float64)) for w in ref["windows"])
    n = sum(len(w["actual_lp"]) for w in ref["windows"])
    return math.exp(nll / n)


# ---------------------------------------------------------------- report


def _f(v, fmt: str, none: str = "-") -> str:
    return none if v is None else format(v, fmt)


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.2f}%"


def table(report: dict) -> str:
    """The plain table printed on stdout (the header lines, then one row per
    format; refused formats last, with the reason)."""
    r = report
    lines = []
    kld = ("exact (every vocabulary entry)" if r["kld_mode"] == "exact" else
           f"folded: the reference's top {FOLD_TOP} tokens (those in the format's top "
           f"{FORMAT_TOP}), the rest one bucket (vLLM returns top-k log-probs only; a lower "
           f"bound of the exact KLD)")
    lines.append(f"{PROG}: {r['model']} ({r['model_dtype']}, vocabulary {r['vocab']}) | text "
                 f"{r['text']} | {r['windows']} window(s) x "
                 f"{r['ctx']} tokens, prompt positions [0, {r['ctx'] - r['decode']}), the last "
                 f"{r['decode']} as decoded | vLLM {r['vllm_version']}")
    lines.append(f"reference: auto, vLLM's unquantized cache ({r['model_dtype']}); KLD {kld}")
    pool = "MLA tail pool" if r.get("mla") else "staging pool"
    if r.get("mla"):
        by = {}
        for f in r["formats"]:
            for b in f.get("attention_backends") or []:
                by.setdefault(b, []).append(f["label"])
        used = "; ".join(f"{b}: {', '.join(labs)}" for b, labs in sorted(by.items()))
        how = (f"the last {r['decode']} tokens of each window decoded one step at a time, "
               f"each step's token forced to the text's (raw log-probabilities)"
               if r.get("decode_mode") == "forced" else "no position decoded (--decode 0)")
        lines.append(f"MLA model: vLLM runs a prompt as MHA on the fresh latents, so the prompt "
                     f"columns read no cache (KLD ~0 for every format); {how}; attention "
                     f"backends: {used or '-'}")
    mns = (f"max_num_seqs {r['max_num_seqs']}" if r["max_num_seqs"] else
           f"max_num_seqs per format: the most {r['ctx']}-token requests that fit with the "
           f"{pool} sized for them")
    lines.append(f"capacity: vLLM's figures for a KV budget of {r['budget_bytes'] / 2**30:.2f} "
                 f"GiB ({pool} counted), {mns}, max_num_batched_tokens "
                 f"{r['max_num_batched_tokens']}; 'fit': requests of {r['ctx']} tokens")
    hdr = ["format", "B/token", "KV tokens", "x ref", "fit", "KLD mean", "median", "p99",
           "top-1", "dec KLD", "dec med", "dec p99", "dec top-1", "PPL (delta)", "s"]
    rows = []
    for f in r["formats"]:
        if f["status"] == "refused":
            continue
        ref = f["status"] == "reference"
        rows.append([
            f["label"] + (" (ref)" if ref else ""),
            _f(f["bytes_per_token"], ".0f"), _f(f["kv_tokens"], "d"), _f(f["x_ref"], ".2f"),
            (_f(f["requests_fit"], "d") + ("+" if f.get("capped") else "")),
            "-" if ref else _f(f["kld_mean"], ".5f"), "-" if ref else _f(f["kld_median"], ".5f"),
            "-" if ref else _f(f["kld_p99"], ".5f"),
            "-" if ref else _pct(f["top1"]),
            "-" if ref else _f(f["decode_kld_mean"], ".5f"),
            "-" if ref else _f(f["decode_kld_median"], ".5f"),
            "-" if ref else _f(f["decode_kld_p99"], ".5f"),
            "-" if ref else _pct(f["decode_top1"]),
            _f(f["ppl"], ".4f") + ("" if ref else f" ({f['ppl_delta']:+.4f})"),
            _f(f["seconds"], ".0f")])
    w = [max(len(h), *(len(x[i]) for x in rows)) for i, h in enumerate(hdr)]
    lines.append("  ".join(h.ljust(w[i]) if i == 0 else h.rjust(w[i]) for i, h in enumerate(hdr)))
    for x in rows:
        lines.append("  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i])
                               for i, c in enumerate(x)))
    refused = [f for f in r["formats"] if f["status"] == "refused"]
    if refused:
        lines.append("refused on this build (no numbers):")
        for f in refused:
            lines.append(f"  {f['label']}: {f['reason']}")
    if any(f.get("capped") for f in r["formats"]):
        lines.append("+: more would fit; --max-num-seqs caps the requests held")
    partial = [f for f in r["formats"] if f.get("kld_partial") or f.get("decode_kld_partial")]
    for f in partial:
        lines.append(f"{f['label']}: at {f['kld_partial']} prompt and {f['decode_kld_partial']} "
                     f"decode positions the format's top {FORMAT_TOP} lacks some of the "
                     f"reference's top {FOLD_TOP} (folded into the bucket there: a looser bound)")
    lines += r.get("value_bias_notes", [])
    lines += r.get("sliding_window_notes", [])
    return "\n".join(lines)


def _sliding_layers(mc) -> list:
    """[sliding-window layers, attention layers] of vLLM model config mc:
    hf_text_config.layer_types where the config has them (Gemma-2/3/4,
    gpt-oss), else every layer or none by model_config.get_sliding_window()
    (Mistral)."""
    n = mc.get_total_num_hidden_layers()
    types = getattr(mc.hf_text_config, "layer_types", None) or []
    if mc.get_sliding_window() is None:
        return [0, n]
    if len(types) == n:
        return [sum(t == "sliding_attention" for t in types), n]
    return [n, n]


def sliding_window_notes(report: dict) -> list:
    """Lines for a model that mixes sliding-window and full attention
    layers (report["sliding_layers"], read in the reference's engine), one
    per KVarN row run without a KVARN_SLIDING_WINDOW setting (the default,
    "vllm": the sliding-window layers keep vLLM's own cache): where the same
    format with KVARN_SLIDING_WINDOW=quantize (every layer in records) was
    run too, the KV tokens over the reference's and the KLD (decode column;
    the prompt column where --decode is 0) of both, naming the one that
    holds more unless its KLD is more than twice the other's (the tests'
    rule for one codec on two hosts: beyond it the difference is the
    format's, not noise), then the other; where it was not run, a line
    naming it. Nothing for other models. Returns the lines."""
    ns, n = (report.get("sliding_layers") or [0, 0])[:2]
    if not (0 < ns < n):
        return []
    from . import _lib
    rows = [f for f in report["formats"] if f["status"] == "ok"]
    model = os.path.basename(os.path.normpath(report["model"]))
    head = f"sliding windows: {model} has {ns} sliding-window layers of {n}"
    out = []
    for p in rows:
        if not _lib.is_kvarn_dtype(p["name"]) or _lib.is_mla_dtype(p["name"]) \
                or "KVARN_SLIDING_WINDOW" in p["env"]:
            continue
        env = dict(p["env"], KVARN_SLIDING_WINDOW="quantize")
        qlabel = ":".join([p["name"]] + [f"{k}={v}" for k, v in env.items()])
        q = next((f for f in rows if f["name"] == p["name"] and f["env"] == env), None)
        if q is None:
            out.append(f"{head}, which {p['label']} keeps in vLLM's own cache "
                       f"({_f(p.get('x_ref'), '.2f')}x the reference's KV tokens); "
                       f"{qlabel} stores them as records too: add it to --kv-cache-dtype to "
                       f"see what it holds and costs")
            continue
        kp, col = _kld_of(p)
        kq, _ = _kld_of(q)
        xp, xq = p.get("x_ref"), q.get("x_ref")
        if None in (kp, kq, xp, xq):
            continue
        both = (f"{q['label']} {xq:.2f}x the reference's KV tokens at {col} {kq:.5f}, "
                f"{p['label']} (sliding-window layers in vLLM's cache) {xp:.2f}x at {kp:.5f}")
        if xq > xp and kq <= 2 * kp:
            out.append(f"{head}; better: {q['label']}: {both}")
        elif xq > xp:
            out.append(f"{head}; better: {p['label']}: {q['label']} holds more but its KLD is "
                       f"more than twice: {both}")
        else:
            out.append(f"{head}; better: {p['label']}: {both}")
    return out


def _kld_of(row: dict) -> tuple:
    """(the KLD a comparison uses, its column's name): the decode column's
    mean, or the prompt column's where no position was decoded."""
    if row.get("decode_kld_mean") is not None:
        return row["decode_kld_mean"], "decode KLD"
    return row.get("kld_mean"), "KLD"


def value_bias_notes(report: dict) -> list:
    """Lines for a model that adds a bias to its values (report
    ["value_bias"]: checks.has_value_bias of the model's text config, read
    in the reference's engine), one per plain KVarN row run (status ok):
    where its mean-centred variant (the same name with a trailing c, the
    same settings) was run too, which of the two has the lower KLD (decode
    column; the prompt column where --decode is 0) and the bytes per token
    of each (the centred record carries the value means: a few percent
    more); where it was not, a line naming the centred format to run (its
    bytes from the C library's record size at the model's head_dim).
    Nothing for a model without value biases. Returns the lines."""
    if not report.get("value_bias"):
        return []
    from . import _lib
    rows = [f for f in report["formats"] if f["status"] == "ok"]
    model = os.path.basename(os.path.normpath(report["model"]))
    out = []
    for p in rows:
        if not _lib.is_kvarn_dtype(p["name"]) or _lib.is_mla_dtype(p["name"]) \
                or _lib.parse_format(p["name"]).centred:
            continue
        cname = p["name"] + "c"
        c = next((f for f in rows if f["name"] == cname and f["env"] == p["env"]), None)
        clabel = ":".join([cname] + [f"{k}={v}" for k, v in p["env"].items()])
        if c is None:
            d = report.get("head_dim")
            more = ""
            if d:
                rp = _lib.record_bytes(_lib.parse_format(p["name"], d), d)
                rc = _lib.record_bytes(_lib.parse_format(cname, d), d)
                more = f" ({100 * (rc - rp) / rp:+.1f}% bytes per token)"
            out.append(f"value biases: {model} adds a bias to its values, which {p['label']} "
                       f"quantizes with the rest; its mean-centred variant {clabel} stores each "
                       f"tile's value means apart{more}: add it to --kv-cache-dtype to see "
                       f"which wins")
            continue
        kp, col = _kld_of(p)
        kc, _ = _kld_of(c)
        if kp is None or kc is None:
            continue
        bp, bc = p["bytes_per_token"], c["bytes_per_token"]
        size = (f"{bc:.0f} B/token against {bp:.0f} ({100 * (bc - bp) / bp:+.1f}%)"
                if bp and bc else "bytes per token unknown")
        if kc < kp:
            ratio = f"{kp / kc:.1f}x lower" if kc > 0 else "lower"
            out.append(f"value biases: {model} adds a bias to its values; the centred "
                       f"{c['label']} wins over {p['label']}: {col} {kc:.5f} against "
                       f"{kp:.5f} ({ratio}), {size}")
        else:
            out.append(f"value biases: {model} adds a bias to its values, yet the plain "
                       f"{p['label']} wins over the centred {c['label']}: {col} {kp:.5f} "
                       f"against {kc:.5f}, and the centred costs {size}")
    return out


def pareto(points: list) -> list:
    """Indices of the points (capacity, kld) no other point beats: none has
    capacity >= and KLD <= with one of them strict."""
    front = []
    for i, (c, k) in enumerate(points):
        if not any((c2 >= c and k2 <= k) and (c2 > c or k2 < k)
                   for j, (c2, k2) in enumerate(points) if j != i):
            front.append(i)
    return front


LABEL_PT = 8        # label font size, points
PLOT_DPI = 120      # the figure's dots per inch, which the PNG keeps


def _label_offsets() -> list:
    """Where a label may go, in order of preference: (dx, dy) in points
    from its point, horizontal and vertical alignment, whether a leader
    line joins it to the point. Beside the point first (right, left, above,
    below), then in rings farther out, up and down, right and left."""
    near = [(6, 2, "left", "bottom"), (6, -2, "left", "top"),
            (-6, 2, "right", "bottom"), (-6, -2, "right", "top"),
            (0, 7, "center", "bottom"), (0, -7, "center", "top")]
    out = [(dx, dy, ha, va, False) for dx, dy, ha, va in near]
    for ring in range(1, 25):
        for dx in (16, 48):
            for sx, ha in ((1, "left"), (-1, "right")):
                for sy, va in ((1, "bottom"), (-1, "top")):
                    out.append((sx * dx, sy * (2 + 9 * ring), ha, va, True))
    return out


def _place_labels(fig, ax, pts: list, labels: list, order: list) -> list:
    """Annotate each point with its label where the label's box meets no
    other label's, no marker, no legend, and lies inside the axes: the first
    free place of _label_offsets() (a leader line to the far ones), labels
    placed in the given order. Where no place is free (more labels than
    room), the one overlapping least. Call after the axes' limits and
    layout are final: boxes are measured in the figure's pixels. Returns
    the annotations, one per point."""
    from matplotlib.transforms import Bbox
    fig.canvas.draw()
    rend = fig.canvas.get_renderer()
    axbox = ax.get_window_extent(rend)
    px = [ax.transData.transform(p) for p in pts]
    m = 4 * fig.dpi / 72            # a marker's half width, pixels
    taken = [Bbox.from_extents(x - m, y - m, x + m, y + m) for x, y in px]
    leg = ax.get_legend()
    if leg is not None:
        taken.append(leg.get_window_extent(rend))
    sizes = []
    for lab in labels:               # each label's box, pixels
        t = ax.text(0, 0, lab, fontsize=LABEL_PT)
        bb = t.get_window_extent(rend)
        sizes.append((bb.width, bb.height))
        t.remove()
    k = fig.dpi / 72
    anns = [None] * len(pts)
    for i in order:
        (x, y), (w, h) = px[i], sizes[i]
        best, best_cost = None, None
        for dx, dy, ha, va, lead in _label_offsets():
            ax0 = x + dx * k - {"left": 0, "right": w, "center": w / 2}[ha]
            ay0 = y + dy * k - {"bottom": 0, "top": h}[va]
            bb = Bbox.from_bounds(ax0 - 1, ay0 - 1, w + 2, h + 2)
            inside = (bb.x0 >= axbox.x0 and bb.x1 <= axbox.x1 and bb.y0 >= axbox.y0
                      and bb.y1 <= axbox.y1)
            over = sum(max(0, min(bb.x1, o.x1) - max(bb.x0, o.x0))
                       * max(0, min(bb.y1, o.y1) - max(bb.y0, o.y0)) for o in taken)
            cost = over + (0 if inside else w * h)
            if best_cost is None or cost < best_cost:
                best, best_cost = (dx, dy, ha, va, lead, bb), cost
            if cost == 0:
                break
        dx, dy, ha, va, lead, bb = best
        taken.append(bb)
        anns[i] = ax.annotate(labels[i], pts[i], xytext=(dx, dy), textcoords="offset points",
                              ha=ha, va=va, fontsize=LABEL_PT,
                              arrowprops=dict(arrowstyle="-", color="0.55", lw=0.6,
                                              shrinkA=0, shrinkB=3) if lead else None)
    return anns


def figure(report: dict, plt):
    """The ladder's figure (matplotlib, PLOT_DPI dots per inch): each
    measured format's decode KLD mean (log) against its capacity (KV tokens
    x the reference's at --budget), labelled with no two labels' boxes
    overlapping (_place_labels); the Pareto front joined and marked.
    Formats with no positive KLD (the reference) cannot sit on a log axis
    and are left out. Returns the figure; its axes' texts are the labels."""
    pts, labels = [], []
    for f in report["formats"]:
        if f["status"] == "ok" and f["x_ref"] and f["decode_kld_mean"]:
            pts.append((f["x_ref"], f["decode_kld_mean"]))
            labels.append(f["label"])
    fig, ax = plt.subplots(figsize=(9, 6), dpi=PLOT_DPI)
    front = set(pareto(pts))
    for i, (c, k) in enumerate(pts):
        on = i in front
        ax.scatter([c], [k], marker="o" if on else "x", s=50 if on else 30,
                   color="C3" if on else "C0", zorder=3)
    fr = sorted(pts[i] for i in front)
    if fr:
        ax.plot([p[0] for p in fr], [p[1] for p in fr], color="C3", lw=1, ls="--",
                label="Pareto front (no format holds more with a lower KLD)")
        ax.legend(loc="lower left", fontsize=8)
    ax.set_yscale("log")
    ax.margins(x=0.2, y=0.25)        # room for the labels beside the outer points
    pool = "MLA tail pool" if report.get("mla") else "staging pool"
    ax.set_xlabel(f"capacity: KV tokens x auto's at {report['budget_bytes'] / 2**30:.2f} GiB "
                  f"({pool} counted)")
    ax.set_ylabel(f"decode KLD mean to auto (last {report['decode']} positions"
                  + (", folded top-20)" if report["kld_mode"] != "exact" else ")"))
    ax.set_title(f"{os.path.basename(os.path.normpath(report['model']))}: {report['windows']} x "
                 f"{report['ctx']} tokens, vLLM {report['vllm_version']} (reference: auto)",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    ax.set_xlim(ax.get_xlim())       # the limits fixed before the labels are measured
    ax.set_ylim(ax.get_ylim())
    # the front first (the formats worth naming plainly), then by capacity
    order = sorted(range(len(pts)), key=lambda i: (i not in front, -pts[i][0]))
    _place_labels(fig, ax, pts, labels, order)
    return fig


def plot(report: dict, path: str, plt) -> None:
    """Write figure(report) to path as a PNG at PLOT_DPI."""
    fig = figure(report, plt)
    try:
        fig.savefig(path, dpi=PLOT_DPI)
    finally:
        plt.close(fig)


# ---------------------------------------------------------------- main


def _windows(args, tokenizer_dir: str, warnings: list) -> tuple:
    """(windows of token ids, tokens read, ctx, n windows): the text
    tokenized once by the model's tokenizer (special tokens as it adds them,
    as kvarn eval adds BOS where the tokenizer does), windows of ctx tokens
    from its start; --ctx and --windows lowered to what the text holds, with
    a warning each (kvarn eval's rule). Only a prefix of a long text is
    tokenized, one that holds windows * ctx + 64 tokens or more (its last
    tokens may differ from the whole text's; the windows do not reach them)."""
    if args.token_ids:
        with open(args.token_ids, encoding="utf-8") as f:
            ids = json.load(f)
        if not isinstance(ids, list) or not all(isinstance(x, int) and x >= 0 for x in ids):
            raise UsageError(f"--token-ids {args.token_ids}: a JSON list of token ids (ints "
                             f">= 0) is expected")
    else:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        with open(args.text, encoding="utf-8", errors="replace") as f:
            text = f.read()
        need = args.ctx * args.windows
        # tokenize a prefix long enough (the last few tokens of a cut
        # prefix may differ from the whole text's; a margin is kept)
        chars, ids = max(4096, need * 8), []
        while True:
            ids = tok(text[:chars])["input_ids"]
            if chars >= len(text) or len(ids) >= need + 64:
                break
            chars *= 2
    n = len(ids)
    if n < 2:
        raise UsageError(f"the text holds {n} token(s); at least 2 are needed")
    ctx = args.ctx
    if ctx > n:
        warnings.append(f"the text holds {n} tokens: --ctx lowered to {n}")
        ctx = n
    nw = args.windows
    if nw > n // ctx:
        warnings.append(f"the text holds {n} tokens: --windows lowered to {n // ctx} "
                        f"(windows of {ctx})")
        nw = n // ctx
    return [ids[w * ctx:(w + 1) * ctx] for w in range(nw)], n, ctx, nw


def _model_config(model: str) -> dict:
    """The model directory's config.json, or UsageError saying what is
    needed."""
    if os.path.isfile(model):
        hint = (" (vLLM's CPU build cannot load this project's GGUF; convert it with "
                "`python -m kvarn_vllm.convert_gguf FILE.gguf OUT_DIR`, as "
                "scripts/setup.sh --vllm does for models/SmolLM2-135M-Instruct-hf)"
                if model.endswith(".gguf") else "")
        raise UsageError(f"--model {model}: a file; a Hugging Face model directory (with "
                         f"config.json) is needed{hint}")
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        raise UsageError(f"--model {model}: no config.json there; a Hugging Face model "
                         f"directory is needed (e.g. models/SmolLM2-135M-Instruct-hf, made by "
                         f"scripts/setup.sh --vllm)")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=PROG, description="The quality ladder of KV-cache formats through vLLM: capacity "
        "at a KV budget and KLD/top-1/PPL to the unquantized cache, per format (docs/eval.md).")
    ap.add_argument("--model", required=True, help="Hugging Face model directory vLLM serves")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="text file; windows of its tokens are measured")
    src.add_argument("--token-ids", help="JSON list of token ids instead of --text (a model "
                     "whose tokenizer does not fit the text)")
    ap.add_argument("--kv-cache-dtype", default="all",
                    help="all, or a comma list of vLLM's names and kvarn_* names, each "
                    "optionally with :KVARN_X=V settings (default all)")
    ap.add_argument("--ctx", type=int, default=2048, help="tokens per window (default 2048)")
    ap.add_argument("--windows", type=int, default=4, help="windows of the text (default 4)")
    ap.add_argument("--decode", type=int, default=256,
                    help="last positions of each window scored as decoded (default 256)")
    ap.add_argument("--budget", default="16GiB",
                    help="KV budget the capacity columns are computed for (default 16GiB)")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="the server's max_num_seqs for the capacity columns (default: per "
                    "format, the most --ctx requests that fit)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096,
                    help="the server's and the engines' max_num_batched_tokens (default 4096, "
                    "vLLM 0.32's for LLM(...) on CPU; sizes the plug-in's scratch)")
    ap.add_argument("--dtype", default="float32",
                    help="the model's dtype in vLLM (default float32)")
    ap.add_argument("--engine-kv", default="1GiB",
                    help="KV budget of each measuring engine (default 1GiB)")
    ap.add_argument("--json", help="write the report as JSON to this file ('-': stdout, "
                    "instead of the table)")
    ap.add_argument("--plot", help="write a PNG of decode KLD (log) vs capacity (matplotlib)")
    return ap


def main(argv=None) -> int:
    t_wall = time.perf_counter()
    args = build_parser().parse_args(argv)
    try:
        return _main(args, t_wall)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted (the running engine was stopped)", file=sys.stderr)
        return 130


def _main(args, t_wall: float) -> int:
    for opt, v, lo in (("--ctx", args.ctx, 2), ("--windows", args.windows, 1),
                       ("--decode", args.decode, 0)):
        if v < lo:
            raise UsageError(f"{opt} must be >= {lo} (got {v})")
    if args.max_num_batched_tokens < 1:
        raise UsageError(f"--max-num-batched-tokens must be >= 1 (got "
                         f"{args.max_num_batched_tokens})")
    if args.max_num_seqs is not None and args.max_num_seqs < 1:
        raise UsageError(f"--max-num-seqs must be >= 1 (got {args.max_num_seqs})")
    budget, engine_kv = parse_size(args.budget), parse_size(args.engine_kv)
    hf = _model_config(args.model)
    if args.text is not None:
        if not os.path.isfile(args.text):
            raise UsageError(f"--text {args.text}: no such file")
        if os.path.getsize(args.text) == 0:
            raise UsageError(f"--text {args.text}: empty, nothing to measure")
    elif not os.path.isfile(args.token_ids):
        raise UsageError(f"--token-ids {args.token_ids}: no such file")
    for opt, path in (("--json", args.json), ("--plot", args.plot)):
        # checked before the run, which may take hours: not at its end
        d = os.path.dirname(os.path.abspath(path)) if path and path != "-" else None
        if d is not None and not (os.path.isdir(d) and os.access(d, os.W_OK)):
            raise UsageError(f"{opt} {path}: its directory {d} does not exist or is not "
                             f"writable")
    plt = None
    if args.plot:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise UsageError(f"--plot needs matplotlib, which {sys.executable} lacks: "
                             f"`{sys.executable} -m pip install matplotlib` (scripts/setup.sh "
                             f"--vllm installs it)") from None
    vllm_names = _vllm_cache_dtypes()
    mla, latent, rope, conf_dtype = model_uses_mla(args.model)
    dtype = {"auto": conf_dtype, "half": "float16", "float": "float32"}.get(args.dtype,
                                                                            args.dtype)
    facts = ModelFacts(args.model, mla, latent, rope, dtype)
    jobs, refused = expand_formats(args.kv_cache_dtype, vllm_names, facts)
    warnings = []
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")   # the engines are forked
    windows, n_tokens, ctx, nw = _windows(args, args.model, warnings)
    vocab = hf.get("vocab_size") or hf.get("text_config", {}).get("vocab_size")
    if vocab and max(max(w) for w in windows) >= vocab:
        raise UsageError(f"the text's token ids reach {max(max(w) for w in windows)}, beyond "
                         f"the model's vocabulary of {vocab} (a tokenizer that does not fit "
                         f"the model: give --token-ids)")
    decode = args.decode
    if decode > ctx - 1:
        warnings.append(f"--decode {decode} lowered to {ctx - 1} (--ctx - 1)")
        decode = ctx - 1
    warnings += coverage_warnings(jobs, ctx, decode)
    for wmsg in warnings:     # before the run, as kvarn eval warns
        print(f"{PROG}: warning: {wmsg}", file=sys.stderr)
    exact = bool(vocab) and vocab <= EXACT_VOCAB
    top = vocab if exact else FORMAT_TOP
    n_warned = len(warnings)
    import vllm
    from vllm import LLM, SamplingParams  # noqa: F401  (imported once, inherited by every engine)
    cfg = dict(model=args.model, dtype=args.dtype, ctx=ctx, windows=windows, top=top,
               budget=budget, engine_kv=engine_kv, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens, decode=decode, mla=mla,
               attention_backend=facts.backend_asked)
    progress = Progress(len(jobs), nw)
    tmp = tempfile.mkdtemp(prefix="kvarn_ladder_")
    results, keep_logs = [], False
    try:
        for i, job in enumerate(jobs, 1):
            res = run_job(job, cfg, tmp, i, progress)
            if "error" in res:
                keep_logs = True
            results.append(res)
            if i == 1 and "error" in res:
                break
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        progress.end()
    ref = results[0]
    if "error" in ref:
        print(f"{PROG}: error: vLLM cannot serve {args.model} with its own cache (auto): "
              f"{ref['error']} (vLLM's output: {ref['log']})", file=sys.stderr)
        return 1
    report = dict(model=args.model, text=args.text or args.token_ids, text_tokens=n_tokens,
                  ctx=ctx, windows=nw, decode=decode, budget_bytes=budget,
                  engine_kv_bytes=engine_kv, max_num_seqs=args.max_num_seqs,
                  dtype=args.dtype, model_dtype=ref["model_dtype"], vocab=ref["vocab"],
                  head_dim=ref["head_dim"], value_bias=ref["value_bias"],
                  sliding_layers=ref.get("sliding_layers"),
                  vllm_version=vllm.__version__,
                  kld_mode="exact" if exact else f"folded_top{FOLD_TOP}_vs_top{FORMAT_TOP}",
                  mla=mla, decode_mode="forced" if mla and decode > 0 else "prompt_logprobs",
                  warnings=warnings, formats=[])
    if ref.get("use_mla") != mla:
        warnings.append(f"vLLM runs {args.model} {'with' if ref.get('use_mla') else 'without'} "
                        f"MLA, which the ladder read otherwise from its config: its format "
                        f"checks and its decode columns do not fit this model")
    ref_cap = ref["capacity"]
    report["max_num_batched_tokens"] = ref_cap.get("max_num_batched_tokens")
    rppl = ref_ppl(ref)
    status = 0
    for job, res in zip(jobs, results):
        row = dict(label=job.label, name=job.name, env=job.env,
                   status="reference" if res is ref else "ok")
        if "error" in res:
            row.update(status="refused", reason=res["error"].split("\n")[0], log=res["log"])
            if job.explicit:
                status = 1
            report["formats"].append(row)
            continue
        cap = res["capacity"]
        if "error" in cap:
            warnings.append(f"{job.label}: capacity not computed: {cap['error']}")
        elif cap["engine_blocks_predicted"] != res["engine_blocks"]:
            warnings.append(f"{job.label}: the capacity computation gives "
                            f"{cap['engine_blocks_predicted']} blocks for the measuring engine, "
                            f"which vLLM gave {res['engine_blocks']}: its --budget figures are "
                            f"not vLLM's")
        kv = cap.get("kv_tokens")
        rkv = ref_cap.get("kv_tokens")
        row.update(bytes_per_token=cap.get("bytes_per_token"), block_size=cap.get("block_size"),
                   kv_tokens=kv, x_ref=kv / rkv if kv and rkv else None,
                   pool_bytes=cap.get("pool_bytes"), max_num_seqs=cap.get("max_num_seqs"),
                   kv_cache_groups=cap.get("kv_cache_groups"),
                   blocks_per_request=cap.get("blocks_per_request"),
                   requests_fit=cap.get("requests_fit"), capped=cap.get("capped"),
                   capacity_refusal=cap.get("refusal"),
                   attention_backends=res.get("attention_backends"),
                   engine_seconds_start=res["start_s"], seconds=res["run_s"])
        if res is ref:
            row.update(ppl=rppl, positions=sum(len(w["actual_lp"]) for w in ref["windows"]))
        else:
            row.update(score(ref, res, ctx, decode, exact))
            row["ppl_delta"] = row["ppl"] - rppl
        report["formats"].append(row)
    for label, why in refused:
        report["formats"].append(dict(label=label, name=label.split(":")[0], env={},
                                      status="refused", reason=why))
    report["value_bias_notes"] = value_bias_notes(report)
    report["sliding_window_notes"] = sliding_window_notes(report)
    report["wall_s"] = time.perf_counter() - t_wall
    if args.json == "-":
        json.dump(report, sys.stdout, indent=1)
        print()
    else:
        print(table(report))
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(report, f, indent=1)
    if plt is not None:
        plot(report, args.plot, plt)
    for wmsg in warnings[n_warned:]:
        print(f"{PROG}: warning: {wmsg}", file=sys.stderr)
    print(f"{PROG}: {len(jobs)} engine(s), wall time {report['wall_s']:.0f} s"
          + (f"; vLLM's output of the failed ones kept in {tmp}" if keep_logs else ""),
          file=sys.stderr)
    if not keep_logs:
        shutil.rmtree(tmp, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
