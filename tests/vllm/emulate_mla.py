"""What a DeepSeek-shaped (MLA) model's next-token distributions are,
worked out independently of vLLM: transformers runs the model in fp32
(DeepseekV3Attention: per token the RMS-normed kv_lora_rank latent c_kv and
the RoPE key k_pe, expanded per head by kv_b_proj), teacher-forced on a
whole token sequence (prompt + the tokens a run generated), so that the
distribution at every position, prompt or decoded, can be set beside what
vLLM returned for it.

With roundtrip (a callable taking one tile's latent [G, kv_lora_rank] and
RoPE key [G, qk_rope_head_dim], fp32, and returning what a cache record of
them decodes to), the cache is taken through that codec with the read rule
of an MLA cache that commits a tile once its G tokens are stored (vLLM's
CPU MLA path: the prompt runs as MHA on the fresh, exact latents; each
decoded token is stored before its query attends, absorbed, over the
cache): the query at decode position p (p >= prompt_len) sees the tokens
j < G * floor((p + 1) / G) as decoded records and the rest exact; prompt
positions see everything exact.

RoPE as vLLM 0.32's CPU build applies it (vllm_rope, the default): its
MLA layer (model_executor/layers/mla.py) hands two strided views to the
in-place CPU rotary_embedding kernel, q_pe = q[..., qk_nope_head_dim:] of q
[tokens, heads, qk_head_dim] and k_pe = kv_lora[:, kv_lora_rank:]
.unsqueeze(1) of the fused [tokens, q_lora_rank + kv_lora_rank +
qk_rope_head_dim] projection, and the kernel takes each view's stride(-2)
(qk_head_dim for q_pe, qk_rope_head_dim for k_pe) as the stride between
tokens: it rotates the rope-wide pieces i = 0, 1, ... (i < the step's
token count) at that stride from the view's start by positions[i] and no
others (measured against RotaryEmbedding.forward_native:
test_mla.py test_vllm_cpu_rope_strided_views). Query (t, h) is piece
t * heads + h; token t's key is piece t * W / qk_rope_head_dim, W the fused
row's width. So in the prompt's step (the whole prompt at once: chunked
prefill is off for MLA on CPU) query (t, h) is rotated by position
t * heads + h and key t by position t * W / qk_rope_head_dim where that is
below the prompt's length, and the others not at all (the pieces rotated
in between lie in the projection's q_lora / latent part, read before);
in each decode step (one token, position p) head 0's query and the key
are rotated by p, the other heads' queries not at all. vllm_rope=False
rotates as transformers does (the model as trained).

logprobs(model_dir, ids, prompt_len, roundtrip=None, G=128) returns fp32
log-probabilities [len(ids), vocab]; row j is the distribution of token j + 1.
"""
import numpy as np
import torch

_STATE = {"roundtrip": None, "G": 128, "prompt_len": 0, "vllm_rope": True, "key_piece": 0}


def _rope_interleaved(x, cos, sin):
    """DeepSeek's RoPE on interleaved pairs (x0, x1), (x2, x3), ...: pair k
    rotated by the angle whose cos / sin are cos[..., k], sin[..., k] (the
    first half of transformers' cat(freqs, freqs) tables), output laid out
    [even results, odd results] as transformers' apply_rotary_pos_emb_interleave
    lays it out (q and k alike, so q . k is unchanged by that layout)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _rope_positions(S: int, H: int, P: int, key_piece: int):
    """(query [H, S], key [S]) int64: the position each query (head h,
    token t) and each token's key is rotated by under vLLM 0.32's CPU
    kernel (module docstring), -1 for none; P prompt tokens, key_piece =
    W / qk_rope_head_dim."""
    t = torch.arange(S)[None, :].expand(H, S)
    h = torch.arange(H)[:, None].expand(H, S)
    none = torch.full_like(t, -1)
    qflat = t * H + h
    q = torch.where(t < P, torch.where(qflat < P, qflat, none), torch.where(h == 0, t, none))
    tk = torch.arange(S)
    kflat = tk * key_piece
    k = torch.where(tk < P, torch.where(kflat < P, kflat, torch.full_like(tk, -1)), tk)
    return q, k


def _rotate_at(x, c, s_, pos):
    """x [B, H, S, d] rotated per (head, token) by the angles of position
    pos [H, S] (-1: not rotated) from the tables c, s_ [B, S, d/2]."""
    idx = pos.clamp(min=0)
    on = (pos >= 0)[None, :, :, None]
    cq = torch.where(on, c[:, idx], torch.ones_like(c[:, idx]))
    sq = torch.where(on, s_[:, idx], torch.zeros_like(s_[:, idx]))
    return _rope_interleaved(x, cq, sq)


def _apply_rope(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Stands in for transformers' apply_rotary_pos_emb_interleave (q
    [B, H, S, d], k [B, 1, S, d], cos / sin [B, S, d] for positions 0..S-1):
    both as _STATE["vllm_rope"] says."""
    half = cos.shape[-1] // 2
    c, s_ = cos[..., :half], sin[..., :half]          # [B, S, d/2]
    if not _STATE["vllm_rope"]:
        return (_rope_interleaved(q, c.unsqueeze(1), s_.unsqueeze(1)),
                _rope_interleaved(k, c.unsqueeze(1), s_.unsqueeze(1)))
    B, H, S, _ = q.shape
    qpos, kpos = _rope_positions(S, H, _STATE["prompt_len"], _STATE["key_piece"])
    return _rotate_at(q, c, s_, qpos), _rotate_at(k, c, s_, kpos[None, :])


def _expand_kv_with_codec(module, orig):
    """module.expand_kv wrapped: the exact K/V as transformers makes them,
    and, kept on the module for _attention, the K/V expanded from the
    latent and RoPE key after the tile round trip (whole tiles only)."""
    def expand_kv(kv_nope, k_rot):
        key, value = orig(kv_nope, k_rot)
        rt = _STATE["roundtrip"]
        module._kvarn_q = None
        if rt is not None:
            G = _STATE["G"]
            B, _, S, _ = kv_nope.shape
            assert B == 1
            c, r = kv_nope.clone(), k_rot.clone()
            for t in range(S // G):
                sl = slice(t * G, (t + 1) * G)
                cq, rq = rt(c[0, 0, sl].numpy().astype(np.float32),
                            r[0, 0, sl].numpy().astype(np.float32))
                c[0, 0, sl] = torch.from_numpy(np.asarray(cq, dtype=np.float32))
                r[0, 0, sl] = torch.from_numpy(np.asarray(rq, dtype=np.float32))
            module._kvarn_q = orig(c, r)
        return key, value
    return expand_kv


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    """transformers attention function (query, key [B, H, S, qk_head_dim],
    value [B, H, S, v_head_dim]) with the read rule of the module docstring."""
    S = query.shape[2]
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    quant = getattr(module, "_kvarn_q", None)
    if quant is not None:
        kq, vq = quant
        G, P = _STATE["G"], _STATE["prompt_len"]
        pos = torch.arange(S)
        limit = torch.where(pos >= P, G * ((pos + 1) // G), torch.zeros_like(pos))
        use_rec = pos[None, :] < limit[:, None]            # [Sq, Sk]
        scores = torch.where(use_rec, torch.matmul(query, kq.transpose(2, 3)) * scaling,
                             scores)
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        else:
            scores = scores + attention_mask
    p = torch.softmax(scores, dim=-1, dtype=torch.float32)
    if quant is not None:
        out = torch.matmul(p * use_rec, vq) + torch.matmul(p * ~use_rec, value)
    else:
        out = torch.matmul(p, value)
    return out.transpose(1, 2).contiguous(), None


def logprobs(model_dir: str, ids: list, prompt_len: int, roundtrip=None, G: int = 128,
             vllm_rope: bool = True):
    """Module docstring. ids: the whole sequence (prompt, then generated)."""
    from transformers import AttentionInterface, AttentionMaskInterface, AutoModelForCausalLM
    from transformers.models.deepseek_v3 import modeling_deepseek_v3
    modeling_deepseek_v3.apply_rotary_pos_emb_interleave = _apply_rope
    AttentionInterface.register("kvarn_mla_emu", _attention)
    AttentionMaskInterface.register("kvarn_mla_emu",
                                    AttentionMaskInterface._global_mapping["eager"])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="kvarn_mla_emu")
    model.eval()
    for m in model.modules():
        if hasattr(m, "expand_kv") and hasattr(m, "kv_a_layernorm"):
            m.expand_kv = _expand_kv_with_codec(m, m.expand_kv)
    assert model.config.rope_interleave, "DeepSeek's interleaved RoPE expected"
    c = model.config
    W = c.q_lora_rank + c.kv_lora_rank + c.qk_rope_head_dim
    assert W % c.qk_rope_head_dim == 0, "key pieces off the RoPE key: not emulated"
    _STATE.update(roundtrip=roundtrip, G=G, prompt_len=prompt_len, vllm_rope=vllm_rope,
                  key_piece=W // c.qk_rope_head_dim)
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=False)
    return torch.log_softmax(out.logits[0].float(), dim=-1).numpy()


def kl_rows(lp_p: np.ndarray, lp_q: np.ndarray) -> np.ndarray:
    """KL(P || Q) per row of two log-probability matrices."""
    return np.sum(np.exp(lp_p) * (lp_p - lp_q), axis=-1)


class MlaCodec:
    """One tile's round trip through libkvarn's MLA record (include/kvarn/
    mla.h: kvarn_mla_encode, then kvarn_mla_decode): format name, latent
    and rope widths; usable as logprobs' roundtrip. .G tokens a tile."""

    def __init__(self, name: str, latent_dim: int, rope_dim: int):
        from kvarn_vllm import _lib
        self.lib = _lib
        self.fmt = _lib.mla_parse(name, latent_dim, rope_dim)
        self.D, self.R, self.G = latent_dim, rope_dim, self.fmt.tile_tokens
        self.rec = np.zeros(_lib.mla_record_bytes(self.fmt, latent_dim, rope_dim), np.uint8)
        self.ws = np.zeros(_lib.mla_workspace_bytes(self.fmt, latent_dim, rope_dim), np.uint8)

    def __call__(self, latent: np.ndarray, rope: np.ndarray):
        L = self.lib
        lat = np.ascontiguousarray(latent, dtype=np.float32)
        rp = np.ascontiguousarray(rope, dtype=np.float32)
        assert lat.shape == (self.G, self.D) and rp.shape == (self.G, self.R)
        L.mla_encode(self.fmt, self.D, self.R, lat.ctypes.data, rp.ctypes.data,
                     self.ws.ctypes.data, self.rec.ctypes.data)
        lo, ro = np.empty_like(lat), np.empty_like(rp)
        L.mla_decode(self.fmt, self.D, self.R, self.rec.ctypes.data, lo.ctypes.data,
                     ro.ctypes.data)
        return lo, ro
