"""Speculative decoding with a kvarn cache: which proposers are served, and
how many draft tokens a step can bring (they size the staging pool)."""
from ._lib import is_kvarn_dtype


def draft_tokens(vllm_config) -> int:
    """The most speculative (draft) tokens a step proposes per sequence, 0
    without speculative decoding: sizes the staging pool (staging.py)."""
    sc = getattr(vllm_config, "speculative_config", None)
    if sc is None:
        return 0
    k = int(sc.num_speculative_tokens or 0)
    for entry in sc.num_speculative_tokens_per_batch_size or ():
        k = max(k, int(entry[2]))
    return k


SPEC_METHODS = ("ngram",)   # proposers that run no model of their own
# Proposers that run a model of their own, served with the target in kvarn
# and the proposer's layers in vLLM's own cache (speculative_config
# kv_cache_dtype, which checks.check_model sets to "auto" where the user
# left it unset): their passes never reach this backend
# (docs/vllm-models.md "Model-based speculation").
SPEC_MODEL_METHODS = ("draft_model", "eagle", "eagle3", "mtp")


def check_speculative(vllm_config) -> None:
    """Refuse a speculative method the kvarn cache cannot serve; vllm_config:
    the target's, or the proposer's (vLLM builds the proposer's layers under
    a copy whose cache_dtype is speculative_config.kv_cache_dtype). Accepted:
    'ngram' (no model), and SPEC_MODEL_METHODS when the proposer's layers
    keep one of vLLM's own cache dtypes (speculative_config.kv_cache_dtype
    set and not a kvarn name): those layers then attend through vLLM's CPU
    backend in passes of their own, which the per-step staging plan (built
    from the target's metadata) never sees. Raises NotImplementedError with
    the reason and what works otherwise: a proposer's layers in kvarn (their
    passes run over positions the target has not verified, outside the
    plan), or another method (not run with a kvarn cache)."""
    sc = getattr(vllm_config, "speculative_config", None)
    if sc is None or sc.method in SPEC_METHODS:
        return
    if sc.method in SPEC_MODEL_METHODS:
        kd = sc.kv_cache_dtype
        if kd is not None and not is_kvarn_dtype(kd):
            return
        raise NotImplementedError(
            f"kvarn backend: speculative method '{sc.method}' with the proposer's layers in a "
            f"kvarn cache ({kd or 'inherited from --kv-cache-dtype'}) is not supported (they "
            f"would attend in passes of their own over unverified positions, which the "
            f"staging plan does not follow); "
            f"leave speculative_config kv_cache_dtype unset (the plug-in gives the proposer "
            f"vLLM's own cache) or set one of vLLM's own dtypes, e.g. 'auto'")
    raise NotImplementedError(
        f"kvarn backend: speculative decoding with method '{sc.method}' is not supported "
        f"with a kvarn KV cache (the plug-in has not been run with it); use 'ngram', "
        f"{', '.join(repr(m) for m in SPEC_MODEL_METHODS)}, or vLLM's own --kv-cache-dtype")
