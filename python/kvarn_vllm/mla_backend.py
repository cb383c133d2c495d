"""MLA models (DeepSeek-V2/V3/R1, Kimi-K2, GLM-4.5: multi-head latent
attention) and the kvarn cache dtypes.

An MLA layer caches, per token, one kv_lora_rank-wide latent c_kv (RMS
normed) and one qk_rope_head_dim-wide RoPE key k_pe, shared by all its
query heads (DeepSeek-V2, arXiv:2405.04434, section 2.1); vLLM 0.32 gives
such layers an MLA backend (on the CPU build CPU_MLA, or AMX_MLA where the
CPU has AMX tiles) with a page of [block, kv_lora_rank + qk_rope_head_dim]
elements. The kvarn formats (kvarn_k*v*_g*) store K and V tiles per KV
head, which such a layer has none of; a KVarN record of the latent, read
by attention in the absorbed form, is not served by this plug-in yet, so
check_mla_model refuses a kvarn dtype on an MLA model at start-up, with
the reason and what to do (docs/vllm-models.md "MLA").
"""


def mla_dims(model_config) -> tuple:
    """(kv_lora_rank, qk_rope_head_dim, query heads) of an MLA model's text
    config; fields missing from a config read 0."""
    hf = model_config.hf_text_config
    return (int(getattr(hf, "kv_lora_rank", 0) or 0),
            int(getattr(hf, "qk_rope_head_dim", 0) or 0),
            int(getattr(hf, "num_attention_heads", 0) or 0))


def check_mla_model(vllm_config) -> None:
    """Called by plugin.check_model for a model that vLLM runs with MLA
    (model_config.use_mla) and a kvarn --kv-cache-dtype: raises ValueError
    naming the model's latent shape, why the kvarn formats do not apply and
    what to serve it with."""
    mc = vllm_config.model_config
    name = vllm_config.cache_config.cache_dtype
    latent, rope, heads = mla_dims(mc)
    raise ValueError(
        f"kvarn: {mc.model} uses multi-head latent attention (MLA: per token one "
        f"{latent}-wide latent and one {rope}-wide RoPE key, shared by its {heads} query "
        f"heads; vLLM's cache holds their {latent + rope} values per token and layer); "
        f"{name} stores K and V tiles per KV head, which an MLA layer does not have, and "
        f"a KVarN record of the latent read by absorbed attention is not served by the "
        f"kvarn plug-in yet (docs/vllm-models.md \"MLA\"); serve it with vLLM's own cache: "
        f"--kv-cache-dtype auto")
