"""Small random-weight models of the families users serve, built from
transformers configs (no download): per-layer shapes as in the real
checkpoints (head_dim, GQA ratio, biases, q/k norms, sliding windows, soft
caps, learned sinks), few layers and a small vocabulary so that a CPU run takes seconds.

    python make_models.py OUT_DIR [family ...]    # default: every family

Each family is written to OUT_DIR/<family> (save_pretrained, fp32) with
SmolLM2's tokenizer beside it (models/SmolLM2-135M-Instruct-hf): the
vocabulary is VOCAB = 2048 ids, all of them ids of that tokenizer, so vLLM
can detokenize whatever the model emits; the tests feed token ids.

Weights: transformers' own initialisation (normal, std initializer_range =
0.02, norms at 1), seeded per family, then three changes so that the cache
format matters as it does in a trained model (with std 0.02 everywhere the
attention scores have std ~0.4, attention is nearly uniform and averages
the codec's error away, and the next-token distribution is nearly flat):
  - q_proj and k_proj weights x QK_GAIN (scores of std ~ 3, peaked attention);
  - lm_head x HEAD_GAIN (logits of std ~ 3: a peaked next-token distribution);
  - embed_tokens x EMBED_GAIN (std 1: the residual stream a few times one
    layer's attention output, as in a trained model, rather than dominated
    by it). Gemma-2 ties the two matrices (a large embedding would make every
    token predict itself) and scales the embedding by sqrt(hidden) itself,
    with a norm after each attention: there the embedding keeps its std and
    the head's gain goes on the final norm (scale 1 + weight = HEAD_GAIN);
  - Qwen2: q/k/v biases N(0, BIAS_STD^2) (real Qwen2 checkpoints have k/v
    bias entries of a few units, which are most of the key's magnitude);
    Qwen3: q/k norm weights log-normal around 1 (real ones are not all 1);
  - gpt-oss: learned sink logits N(SINK_MEAN, SINK_STD^2) per query head
    (transformers' N(0, 0.02^2) is e^-10 of the softmax's denominator,
    whose log is ~10.8 here at 256-400 tokens: a sink that never mattered);
    around the denominator, each sink takes from a few percent to most of
    its head's attention.
Deterministic: the same files for the same transformers/torch versions.
"""
import math
import os
import shutil
import sys

VOCAB = 2048
QK_GAIN = 3.0
HEAD_GAIN = 5.0
EMBED_GAIN = 50.0
BIAS_STD = 2.0
SINK_MEAN, SINK_STD = 10.0, 2.0
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TOKENIZER_DIR = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct-hf")

# family -> (transformers config class name, config kwargs). Shapes per layer
# as in the named checkpoint; hidden size, layers and vocabulary cut down.
COMMON = dict(vocab_size=VOCAB, max_position_embeddings=4096, tie_word_embeddings=False,
              initializer_range=0.02, bos_token_id=1, eos_token_id=2, pad_token_id=None)
FAMILIES = {
    # Llama-3-8B: 32 q heads, 8 KV heads (GQA 4:1), head_dim 128, rope 5e5
    "llama3": ("LlamaConfig", dict(hidden_size=1024, intermediate_size=2048,
                                   num_hidden_layers=3, num_attention_heads=8,
                                   num_key_value_heads=2, head_dim=128, rope_theta=500000.0,
                                   rms_norm_eps=1e-5)),
    # Qwen2-7B: head_dim 128, GQA 7:1, q/k/v biases
    "qwen2": ("Qwen2Config", dict(hidden_size=896, intermediate_size=2048,
                                  num_hidden_layers=3, num_attention_heads=7,
                                  num_key_value_heads=1, rope_theta=1000000.0,
                                  rms_norm_eps=1e-6, use_sliding_window=False)),
    # Qwen3-8B: head_dim 128 (not hidden / heads), q/k RMS norms, no biases
    "qwen3": ("Qwen3Config", dict(hidden_size=512, intermediate_size=1536,
                                  num_hidden_layers=3, num_attention_heads=8,
                                  num_key_value_heads=2, head_dim=128, rope_theta=1000000.0,
                                  rms_norm_eps=1e-6, use_sliding_window=False)),
    # Mistral-7B-v0.1: a sliding window on every layer (4096 there; 256 here,
    # so that the test prompts are longer than it), head_dim 128, GQA 4:1
    "mistral": ("MistralConfig", dict(hidden_size=1024, intermediate_size=2048,
                                      num_hidden_layers=3, num_attention_heads=8,
                                      num_key_value_heads=2, head_dim=128,
                                      sliding_window=256, rope_theta=10000.0)),
    # Gemma-2-2B: head_dim 256, attention logit soft-capping 50, final 30,
    # local (sliding 4096) and global layers alternating
    "gemma2": ("Gemma2Config", dict(hidden_size=512, intermediate_size=1024,
                                    num_hidden_layers=4, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=256,
                                    query_pre_attn_scalar=256, sliding_window=256,
                                    attn_logit_softcapping=50.0,
                                    final_logit_softcapping=30.0,
                                    tie_word_embeddings=True)),
    # the same without attention soft-capping: the hybrid (local + global)
    # path; the final logit cap is not attention's and stays
    "gemma2_nocap": ("Gemma2Config", dict(hidden_size=512, intermediate_size=1024,
                                          num_hidden_layers=4, num_attention_heads=4,
                                          num_key_value_heads=2, head_dim=256,
                                          query_pre_attn_scalar=256, sliding_window=256,
                                          attn_logit_softcapping=None,
                                          final_logit_softcapping=30.0,
                                          tie_word_embeddings=True)),
    # Gemma-3-1B: 5 local (sliding 512 there; 256 here) : 1 global layer,
    # head_dim 256, GQA 4:1, q/k RMS norms, no soft-capping
    "gemma3": ("Gemma3TextConfig", dict(hidden_size=512, intermediate_size=1024,
                                        num_hidden_layers=6, num_attention_heads=4,
                                        num_key_value_heads=1, head_dim=256,
                                        query_pre_attn_scalar=256, sliding_window=256,
                                        final_logit_softcapping=None,
                                        attn_logit_softcapping=None,
                                        tie_word_embeddings=True)),
    # Gemma-4 (transformers' Gemma4TextConfig defaults, whose docstring names
    # gemma-4-e2b-it): 5 local layers at head_dim 256 (sliding 512
    # there; 256 here) : 1 global layer at head_dim 512 (global_head_dim,
    # partial RoPE), q/k/v RMS norms, attention scale 1; no per-layer input
    # embeddings (their size 0: not attention)
    "gemma4": ("Gemma4TextConfig", dict(hidden_size=512, intermediate_size=1024,
                                        num_hidden_layers=6, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=256,
                                        global_head_dim=512, sliding_window=256,
                                        hidden_size_per_layer_input=0,
                                        vocab_size_per_layer_input=VOCAB,
                                        final_logit_softcapping=None,
                                        tie_word_embeddings=True)),
    # Phi-3-mini: head_dim 96 (3072 / 32), fused qkv
    "phi3": ("Phi3Config", dict(hidden_size=768, intermediate_size=2048,
                                num_hidden_layers=2, num_attention_heads=8,
                                num_key_value_heads=8, rope_theta=10000.0,
                                sliding_window=None)),
    # gpt-oss-20b: head_dim 64, GQA 8:1, q/k/v/o biases, a learned sink
    # logit per query head, sliding-window (128) and full layers alternating,
    # a mixture of experts (32 experts, top 4 there; 4, top 2 here, stored
    # unquantized in fp32: no mxfp4)
    "gpt_oss": ("GptOssConfig", dict(hidden_size=512, intermediate_size=256,
                                     num_hidden_layers=4, num_attention_heads=16,
                                     num_key_value_heads=2, head_dim=64,
                                     sliding_window=128, num_local_experts=4,
                                     num_experts_per_tok=2, rope_theta=150000.0,
                                     rope_scaling=None, rms_norm_eps=1e-5)),
    # Qwen3-Next-80B-A3B: 3 Gated DeltaNet (linear-attention) layers : 1
    # full-attention layer (layer_types, full every 4th); the full layers
    # gated (q_proj also gives a sigmoid output gate), head_dim 256, GQA 8:1,
    # q/k RMS norms (scale 1 + weight), partial RoPE (1/4); linear layers 16
    # key / 32 value heads of 128 there (2 / 4 here); a mixture of 512
    # experts, top 10, and a shared expert (4, top 2 here)
    "qwen3_next": ("Qwen3NextConfig", dict(hidden_size=512, intermediate_size=1024,
                                           num_hidden_layers=4, num_attention_heads=8,
                                           num_key_value_heads=1, head_dim=256,
                                           linear_num_key_heads=2, linear_num_value_heads=4,
                                           linear_key_head_dim=128, linear_value_head_dim=128,
                                           linear_conv_kernel_dim=4,
                                           num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=256,
                                           shared_expert_intermediate_size=256,
                                           rms_norm_eps=1e-6)),
    # DeepSeek-V3 / R1 attention (multi-head latent attention, MLA; Kimi-K2
    # has the same shape): per token one kv_lora_rank 512 latent c_kv (RMS
    # normed) and one 64-wide RoPE key, shared by every head; queries through
    # a 1536 q_lora_rank, per head 128 no-RoPE + 64 RoPE channels, values 128.
    # Heads, layers and hidden cut down; layer 0 dense, layer 1 a mixture of
    # 4 routed experts (top 2, one group, sigmoid scores with the correction
    # bias as V3 routes: topk_method noaux_tc) and a shared one (256, top 8
    # there)
    "deepseek_v3": ("DeepseekV3Config", dict(hidden_size=512, intermediate_size=1024,
                                             num_hidden_layers=2, num_attention_heads=8,
                                             num_key_value_heads=8, kv_lora_rank=512,
                                             q_lora_rank=1536, qk_rope_head_dim=64,
                                             qk_nope_head_dim=128, v_head_dim=128,
                                             first_k_dense_replace=1, n_routed_experts=4,
                                             num_experts_per_tok=2, n_shared_experts=1,
                                             moe_intermediate_size=256, n_group=1,
                                             topk_group=1, routed_scaling_factor=1.0,
                                             topk_method="noaux_tc", scoring_func="sigmoid",
                                             rms_norm_eps=1e-6)),
}


def _scale_weights(model, family: str, gen) -> None:
    import torch
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(QK_GAIN)
            elif name.endswith("qkv_proj.weight"):  # Phi-3: q, k, v stacked
                c = model.config
                d = c.hidden_size // c.num_attention_heads
                nq, nk = c.num_attention_heads * d, c.num_key_value_heads * d
                p[: nq + nk].mul_(QK_GAIN)
            elif name == "lm_head.weight":
                p.mul_(HEAD_GAIN)
            elif name.endswith("embed_tokens.weight") and not model.config.tie_word_embeddings:
                p.mul_(EMBED_GAIN)
            elif name == "model.norm.weight" and model.config.tie_word_embeddings:
                # Gemma-2/3/4 (tied, as vLLM loads it): the head's gain on
                # the final norm, whose scale is 1 + weight (Gemma-4: weight)
                p.fill_(HEAD_GAIN if family == "gemma4" else HEAD_GAIN - 1)
            elif family == "qwen2" and name.endswith(("q_proj.bias", "k_proj.bias",
                                                      "v_proj.bias")):
                p.copy_(torch.randn(p.shape, generator=gen) * BIAS_STD)
            elif family == "qwen3" and name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(torch.exp(torch.randn(p.shape, generator=gen) * 0.5))
            elif family == "gpt_oss" and name.endswith("self_attn.sinks"):
                p.copy_(SINK_MEAN + SINK_STD * torch.randn(p.shape, generator=gen))
            elif family == "deepseek_v3" and name.endswith(
                    ("q_b_proj.weight", "kv_b_proj.weight", "kv_a_proj_with_mqa.weight")):
                # MLA: the scores are q_nope . (W_UK c) + q_pe . k_pe, c the
                # RMS-normed latent; the gain on both sides of each product:
                # q_b_proj (q_nope, q_pe), kv_b_proj's K rows (per head
                # qk_nope_head_dim K rows, then v_head_dim V rows), the RoPE
                # key's rows of kv_a_proj_with_mqa (after the kv_lora_rank
                # latent rows, whose gain the norm would undo)
                c = model.config
                if name.endswith("q_b_proj.weight"):
                    p.mul_(QK_GAIN)
                elif name.endswith("kv_b_proj.weight"):
                    w = p.view(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, -1)
                    w[:, : c.qk_nope_head_dim].mul_(QK_GAIN)
                else:
                    p[c.kv_lora_rank:].mul_(QK_GAIN)
            elif family == "deepseek_v3" and name.endswith("kv_a_layernorm.weight"):
                # the latent's norm weights log-normal around 1 (real ones
                # are not all 1): channels of different scales in c_kv
                p.copy_(torch.exp(torch.randn(p.shape, generator=gen) * 0.5))
            elif family in ("gemma3", "gemma4", "qwen3_next") and name.endswith(
                    ("q_norm.weight", "k_norm.weight")):
                # q and k are RMS-normed, so the projections' gain is gone:
                # the norms' scale w sets the scores' std, w^2 sqrt(D) times
                # the softmax scale (Gemma-3: 1 / sqrt(D), w = 1 + weight;
                # Gemma-4: 1, w = weight); w^2 = QK_GAIN, jittered
                D = p.shape[-1]
                # (Qwen3-Next as Gemma-3: 1 / sqrt(D), w = 1 + weight)
                one_plus = family in ("gemma3", "qwen3_next")
                w = math.sqrt(QK_GAIN * (1.0 if one_plus else D ** -0.5))
                w = w * torch.exp(torch.randn(p.shape, generator=gen) * 0.25)
                p.copy_(w - 1 if one_plus else w)


def make(family: str, out_dir: str) -> str:
    """Write OUT_DIR/<family> unless it is there; returns its path."""
    import torch
    import transformers
    path = os.path.join(out_dir, family)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    cls_name, kw = FAMILIES[family]
    cfg = getattr(transformers, cls_name)(**dict(COMMON, **kw))
    seed = sum(map(ord, family))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _scale_weights(model, family, torch.Generator().manual_seed(seed + 1))
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for f in os.listdir(TOKENIZER_DIR):
        if f.startswith(("tokenizer", "special_tokens")) or f == "chat_template.jinja":
            shutil.copy(os.path.join(TOKENIZER_DIR, f), os.path.join(tmp, f))
    os.replace(tmp, path)
    return path


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    for fam in sys.argv[2:] or list(FAMILIES):
        if fam not in FAMILIES:
            sys.exit(f"make_models: unknown family {fam!r} (known: {', '.join(FAMILIES)})")
        print(make(fam, out))


if __name__ == "__main__":
    main()
