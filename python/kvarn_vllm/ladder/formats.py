"""The --kv-cache-dtype entries checked without an engine: vLLM's own
names, the plug-in's kvarn_* names with their KVARN_* settings, what `all`
expands to on a model with or without MLA (and what it refuses, with the
reason), and the columns that would read no quantized tile."""
import os
import typing

from .common import REFERENCE, UsageError

# `all`: vLLM's own unquantized and fp8 caches, the plug-in's presets, the
# default preset with each other staging, and the kvarn names the plug-in
# or vLLM may refuse (a row each, saying why); on an MLA model vLLM's names
# its MLA backend lists, the MLA record formats ALL_MLA, and the presets
# and the rest as refused rows
ALL_VLLM = ("auto", "bfloat16", "fp8_e4m3", "fp8_e5m2")
ALL_PRESETS = ("kvarn_k4v2_g128", "kvarn_k4v2_g64", "kvarn_k4v4_g128", "kvarn_k4v4_g64")
ALL_STAGINGS = ("fp16", "fp8_e4m3", "int4")   # besides the default (int8 on CPU)
# The plug-in's per-token formats (_lib.PER_TOKEN_DTYPES), in the staircase's
# order after vLLM's own fp8: kvarn's fp8 (data-derived scales), int8, int4
ALL_PER_TOKEN = ("kvarn_fp8_e4m3", "kvarn_fp8_e5m2", "kvarn_int8", "kvarn_int4")
# kvarn eval's per-token names: served through vLLM under these names
PER_TOKEN_VLLM = {"int8": "kvarn_int8", "int4": "kvarn_int4", "fp8_e4m3": "kvarn_fp8_e4m3",
                  "fp8_e5m2": "kvarn_fp8_e5m2", "fp8": "kvarn_fp8_e4m3",
                  "fp16": "auto", "bf16": "bfloat16"}
# The settings a per-token format takes (it has no staging, sink or commit)
PER_TOKEN_SETTINGS = ("KVARN_SLIDING_WINDOW", "KVARN_ATTN_THREADS")
ALL_MLA = ("kvarn_mla_k4_g128", "kvarn_mla_k4_g64", "kvarn_mla_k2_g128", "kvarn_mla_k2_g64",
           "kvarn_mla_k8_g128", "kvarn_mla_k8_g64")   # RoPE key at the default 8 bits
MLA_NAMES = "kvarn_mla_k{2,4,8}[r{8,16}]_g{64,128}"


# the plug-in's settings a --kv-cache-dtype entry may carry (docs/vllm.md):
# any other KVARN_ name (a typo) would run the defaults under its label
SETTINGS = ("KVARN_STAGING", "KVARN_SINK_TOKENS", "KVARN_SINK_TILES", "KVARN_SLIDING_WINDOW",
            "KVARN_ATTN_THREADS", "KVARN_PREFILL_COMMIT")


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
    from .. import _lib
    from ..patches import validate_name as _validate_name
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
             f"per-token {', '.join(ALL_PER_TOKEN)}, its {MLA_NAMES} (MLA records) and "
             f"vLLM's own {', '.join(vllm_names)}")
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
        extra = [k for k in env if k not in PER_TOKEN_SETTINGS]
        if _lib.is_per_token_dtype(name) and extra:
            raise UsageError(f"{label}: {name} stores each token's record at once (no staging "
                             f"pool, sink or commit), so {', '.join(extra)} does not apply; it "
                             f"takes {' and '.join(PER_TOKEN_SETTINGS)} only")
        if "KVARN_STAGING" in env:
            try:
                _lib.parse_staging(env["KVARN_STAGING"])
            except ValueError as e:
                raise UsageError(f"{label}: {e}") from None
        if "KVARN_SLIDING_WINDOW" in env:
            from ..settings import SLIDING_ENV, Settings
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
            what = "K and V records" if _lib.is_per_token_dtype(name) else "K and V tiles"
            why = (f"{model.model} uses {model.mla_shape()}; {name} stores {what} per KV "
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
                f"kvarn_k{{2,4,8}}v{{2,4,8}}_g{{32,64,128}} (e.g. kvarn_k4v2_g128), its "
                f"per-token {', '.join(ALL_PER_TOKEN)} and, for an MLA model, {MLA_NAMES} "
                f"(e.g. kvarn_mla_k4_g128), or all")
    try:
        _lib.parse_format(name)
    except ValueError:
        raise UsageError(f"unknown --kv-cache-dtype {name!r}; {accepted}") from None
    served = PER_TOKEN_VLLM.get(name)
    why = (f"{name} is kvarn eval's name of a per-token format; through vLLM it is "
           f"{served or 'not served'}")
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
        cands += list(ALL_MLA) + list(ALL_PER_TOKEN) + list(ALL_PRESETS)
    else:     # the staircase: vLLM's fp8, kvarn's fp8, int8, int4, then KVarN
        cands += list(ALL_PER_TOKEN) + list(ALL_PRESETS)
        cands += [f"{ALL_PRESETS[0]}:KVARN_STAGING={s}" for s in ALL_STAGINGS]
        cands += [p + "c" for p in ALL_PRESETS]
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
    from .. import _lib
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


