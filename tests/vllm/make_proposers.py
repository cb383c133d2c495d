"""Small proposers for model-based speculative decoding, built here (there
is no published one for these targets and the tests download nothing):
EAGLE and EAGLE-3 draft heads for SmolLM2-135M-Instruct
(models/SmolLM2-135M-Instruct-hf), and a Qwen3-Next-style MTP layer for
make_models.py's random "qwen3_next" model (make_mtp, below).

    python make_proposers.py OUT_DIR [eagle|eagle3 ...]    # default: both

Each head is one Llama decoder layer of SmolLM2's shapes (hidden 576, 9
query heads, 3 KV heads, head_dim 64, MLP 1536) written to OUT_DIR/<kind>
as config.json + model.safetensors, without embed_tokens or lm_head: vLLM
then shares the target's (llm_base_proposer.py _maybe_share_embeddings,
_maybe_share_lm_head). The keys and shapes are those vLLM's loaders read
(vllm/model_executor/models/llama_eagle.py, llama_eagle3.py):
  - eagle (EagleLlamaForCausalLM): fc [576, 2 * 576] over (token embedding,
    the target's hidden state), layers.0.* with the input norm left out;
  - eagle3 (Eagle3LlamaForCausalLM, architectures LlamaForCausalLMEagle3):
    fc [576, n_aux * 576] over the target's auxiliary hidden states
    (eagle_aux_hidden_state_layer_ids), midlayer.* with q/k/v over the
    concatenated (normed embedding, normed hidden) [2 * 576], hidden_norm,
    and the head's final norm.

Weights are random (N(0, 0.02^2), seeded) except for what makes a head
propose something the target may accept, so that acceptance is not zero by
construction: fc passes the target's hidden state through (EAGLE: the
identity on its hidden-state half; EAGLE-3: on the one auxiliary state, the
input of the target's last layer, with the target's final-norm weights as
the head's norm), and the layer's o_proj and down_proj are x SMALL, so the
layer adds little to it. The head then predicts about what the target's
last hidden state predicts: the token just sampled, again (EAGLE), or
the target's next token as its last layer's input reads it (EAGLE-3). Its
attention still runs and its KV is cached (the proposer's passes are what
the tests exercise); only its weight on the output is small.
Deterministic for the same torch version.
"""
import json
import os
import shutil
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TARGET = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct-hf")
STD = 0.02
SMALL = 0.05
KINDS = ("eagle", "eagle3")


def _layer(prefix: str, cfg: dict, qkv_in: int, gen) -> dict:
    import torch
    H, hq, hk, d, f = (cfg["hidden_size"], cfg["num_attention_heads"],
                       cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"])

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * (STD * scale)
    return {f"{prefix}.self_attn.q_proj.weight": rnd(hq * d, qkv_in),
            f"{prefix}.self_attn.k_proj.weight": rnd(hk * d, qkv_in),
            f"{prefix}.self_attn.v_proj.weight": rnd(hk * d, qkv_in),
            f"{prefix}.self_attn.o_proj.weight": rnd(H, hq * d, scale=SMALL),
            f"{prefix}.mlp.gate_proj.weight": rnd(f, H),
            f"{prefix}.mlp.up_proj.weight": rnd(f, H),
            f"{prefix}.mlp.down_proj.weight": rnd(H, f, scale=SMALL),
            f"{prefix}.post_attention_layernorm.weight": torch.ones(H)}


def make(kind: str, out_dir: str) -> str:
    """Write OUT_DIR/<kind> unless it is there; returns its path."""
    import torch
    from safetensors.torch import load_file, save_file
    path = os.path.join(out_dir, kind)
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    cfg = json.load(open(os.path.join(TARGET, "config.json")))
    n_target = cfg["num_hidden_layers"]
    H = cfg["hidden_size"]
    cfg["num_hidden_layers"] = 1
    cfg["tie_word_embeddings"] = False
    gen = torch.Generator().manual_seed(sum(map(ord, kind)))
    if kind == "eagle":
        cfg["architectures"] = ["LlamaForCausalLM"]
        w = _layer("layers.0", cfg, H, gen)
        w["fc.weight"] = torch.cat([torch.zeros(H, H), torch.eye(H)], dim=1)
    elif kind == "eagle3":
        aux = [n_target - 1]          # the input of the target's last layer
        cfg["architectures"] = ["LlamaForCausalLMEagle3"]
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux,
                               "use_aux_hidden_state": True}
        cfg["draft_vocab_size"] = cfg["vocab_size"]
        cfg["target_hidden_size"] = H
        w = _layer("midlayer", cfg, 2 * H, gen)
        w["midlayer.input_layernorm.weight"] = torch.ones(H)
        w["midlayer.hidden_norm.weight"] = torch.ones(H)
        w["fc.weight"] = torch.eye(H).repeat(1, len(aux))
        target = load_file(os.path.join(TARGET, "model.safetensors"))
        w["norm.weight"] = target["model.norm.weight"].float().clone()
    else:
        raise ValueError(f"make_eagle: unknown kind {kind!r} (known: {', '.join(KINDS)})")
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file({k: v.contiguous() for k, v in w.items()}, os.path.join(tmp, "model.safetensors"))
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    os.replace(tmp, path)
    return path


def make_mtp(target_dir: str, out_dir: str) -> str:
    """OUT_DIR/qwen3_next_mtp unless it is there: the make_models.py model at
    target_dir with one MTP layer added, as Qwen3-Next checkpoints carry it
    (config num_nextn_predict_layers = 1; weights mtp.*, the keys vLLM's
    Qwen3NextMTP loads, vllm/model_executor/models/qwen3_next_mtp.py): its
    decoder layer a copy of the target's full-attention layer with o_proj
    and every down_proj x SMALL, fc [H, 2H] the identity on the embedding
    half (the MTP layer sees the token it drafts after, and the target's
    hidden state not at all), its norms (scale 1 + weight) at weight 0. The
    random target's residual stream is mostly its token embedding
    (make_models.py EMBED_GAIN), so lm_head(norm(embedding)) is about the
    target's own next token after that token: the layer drafts the
    target's bigram guess, which the target often takes. Returns its
    path."""
    import torch
    from safetensors.torch import load_file, save_file
    path = os.path.join(out_dir, "qwen3_next_mtp")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    cfg = json.load(open(os.path.join(target_dir, "config.json")))
    H = cfg["hidden_size"]
    full = cfg["layer_types"].index("full_attention")
    w = load_file(os.path.join(target_dir, "model.safetensors"))
    src = f"model.layers.{full}."
    for k in [k for k in w if k.startswith(src)]:
        v = w[k].clone()
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            v = v * SMALL
        w["mtp.layers.0." + k[len(src):]] = v
    w["mtp.fc.weight"] = torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1).to(
        w["model.norm.weight"].dtype)
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        w[f"mtp.{n}.weight"] = torch.zeros_like(w["model.norm.weight"])
    cfg["num_nextn_predict_layers"] = 1
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(target_dir, tmp)
    save_file({k: v.contiguous() for k, v in w.items()}, os.path.join(tmp, "model.safetensors"))
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    os.replace(tmp, path)
    return path


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    for kind in sys.argv[2:] or list(KINDS):
        print(make(kind, out))


if __name__ == "__main__":
    main()
