"""What the kvarn cache does to a model's next-token distributions, worked
out independently of vLLM: transformers runs the model in fp32 with an
attention function that takes K and V through the C library's own codec
(kvarn_encode + kvarn_decode, libkvarn.so, one record per 128-token tile and
KV head) and applies the plug-in's read rule (docs/vllm.md "A step"): a
query in tile t sees tiles [sink, t) as decoded records, the sink tiles
and its own tile t exact. Layers that the plug-in leaves in vLLM's own
cache (sliding-window layers unless KVARN_SLIDING_WINDOW=quantize) are not
quantized here either.

logprobs(model_dir, ids, quantize, ...) returns the fp32 log-probabilities
of every prompt position, the cache exact or through the codec (by default
FORMAT with the spec's min/max RTN range, what the plug-in stores; fmt and
rtn_range pick another format or kvarn_codec_opts.rtn_range, codec any
tile round trip, for bench/centred_families.py); kl_rows(exact, codec)
gives KL(P_exact || P_codec) over the whole vocabulary per position;
staging="int8" (or "fp8_e4m3", "int4") adds the plug-in's staging as token
records of that per-token format (RecordStaging): the sink tiles and each
query's own tile are read staged; the records are encoded from the exact
K/V (prefill_exact True, the default: the plug-in's CPU path commits a
prefill chunk's whole tiles from the chunk's exact K/V, and the prompt
here is one chunk) or from the staged copy (prefill_exact False: tiles
filled across chunks or by decoding, or KVARN_PREFILL_COMMIT=staged; the
tokens rounded twice). Not emulated: fp16 staging's rounding of the tiles
it keeps unquantized (relative error 2^-11, far below the 4-/2-bit
codec's).
"""
import ctypes

import numpy as np
import torch

from kvarn_vllm import _lib

FORMAT = "kvarn_k4v2_g128"
SINK_TILES = 1
RTN_MINMAX, RTN_MSE, RTN_MSE_V = 0, 1, 2   # kvarn.h KVARN_RTN_*
DECODE_ROTATED = 1                          # kvarn.h KVARN_DECODE_ROTATED


class CodecOpts(ctypes.Structure):
    """include/kvarn/kvarn.h: kvarn_codec_opts."""
    _fields_ = [("balance_iters", ctypes.c_int), ("prerotated", ctypes.c_int),
                ("rtn_range", ctypes.c_int)]


def _codec_lib():
    """libkvarn with the signatures of the codec calls the emulation makes
    (kvarn_encode / kvarn_decode / kvarn_encode_workspace_bytes, kvarn.h;
    kvarn_hadamard_rows, src/codec/hadamard.h)."""
    L = _lib.lib()
    P, I, Z = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    pf = ctypes.POINTER(_lib.Format)
    L.kvarn_encode_workspace_bytes.restype = Z
    L.kvarn_encode_workspace_bytes.argtypes = [pf, I]
    L.kvarn_encode.restype = I
    L.kvarn_encode.argtypes = [pf, I, P, P, P, Z, P, Z, ctypes.POINTER(CodecOpts)]
    L.kvarn_decode.restype = I
    L.kvarn_decode.argtypes = [pf, I, P, Z, P, P, ctypes.c_uint]
    L.kvarn_hadamard_rows.restype = None
    L.kvarn_hadamard_rows.argtypes = [P, I, I]
    return L


class Codec:
    """One tile's round trip through libkvarn: format name, head_dim D,
    rtn_range (RTN_MINMAX, RTN_MSE or RTN_MSE_V); .G tokens a tile."""

    def __init__(self, name: str, head_dim: int, rtn_range: int = RTN_MINMAX):
        L = _codec_lib()
        self.L, self.D = L, head_dim
        self.fmt = _lib.parse_format(name, head_dim)
        self.G = self.fmt.tile_tokens
        self.rb = _lib.record_bytes(self.fmt, head_dim)
        self.rec = np.zeros(self.rb, dtype=np.uint8)
        wsb = L.kvarn_encode_workspace_bytes(ctypes.byref(self.fmt), head_dim)
        self.ws = np.zeros(wsb + 16, dtype=np.uint8)
        self.wsb = wsb
        self.opts = CodecOpts(8, 0, rtn_range)

    def encode(self, k: np.ndarray, v: np.ndarray) -> None:
        """k, v fp32 [G, D] -> the record, in .rec."""
        k = np.ascontiguousarray(k, dtype=np.float32)
        v = np.ascontiguousarray(v, dtype=np.float32)
        a = self.ws.ctypes.data
        ws = a + (-a) % 16
        _lib.check(self.L.kvarn_encode(ctypes.byref(self.fmt), self.D, k.ctypes.data,
                                       v.ctypes.data, self.rec.ctypes.data, self.rb, ws,
                                       self.wsb, ctypes.byref(self.opts)), "kvarn_encode")

    def decode(self, rotated: bool = False):
        """.rec -> its K, V fp32 [G, D] (in the rotated basis if rotated:
        KVARN_DECODE_ROTATED)."""
        ko = np.empty((self.G, self.D), dtype=np.float32)
        vo = np.empty_like(ko)
        _lib.check(self.L.kvarn_decode(ctypes.byref(self.fmt), self.D, self.rec.ctypes.data,
                                       self.rb, ko.ctypes.data, vo.ctypes.data,
                                       DECODE_ROTATED if rotated else 0), "kvarn_decode")
        return ko, vo

    def roundtrip(self, k: np.ndarray, v: np.ndarray):
        """k, v fp32 [G, D] -> the decoded record's K, V."""
        self.encode(k, v)
        return self.decode()


class TokenRecords:
    """A per-token format served as the whole cache (kvarn_int8, ...;
    docs/vllm.md "Per-token formats"): each token-head's K and V through
    that format's codec (kvarn_encode/decode of `name`: int8, int4,
    fp8_e4m3, fp8_e5m2), in the model's basis (no rotation): what
    attention reads for every token, its own included."""

    def __init__(self, name: str, head_dim: int):
        self.L, self.D, self.name = _codec_lib(), head_dim, name
        self.fmt = _lib.parse_format(name, head_dim)
        assert not self.fmt.per_tile, name
        self.rb = _lib.record_bytes(self.fmt, head_dim)
        self.rec = np.zeros(self.rb, dtype=np.uint8)

    def _codec(self, k: np.ndarray, v: np.ndarray):
        """k, v fp32 C-contiguous [n, D] -> each token's record decoded."""
        ko, vo = np.empty_like(k), np.empty_like(v)
        L, f, D = self.L, ctypes.byref(self.fmt), self.D
        for t in range(k.shape[0]):
            _lib.check(L.kvarn_encode(f, D, k[t].ctypes.data, v[t].ctypes.data,
                                      self.rec.ctypes.data, self.rb, None, 0, None),
                       f"{self.name} encode")
            _lib.check(L.kvarn_decode(f, D, self.rec.ctypes.data, self.rb, ko[t].ctypes.data,
                                      vo[t].ctypes.data, 0), f"{self.name} decode")
        return ko, vo

    def roundtrip(self, k: np.ndarray, v: np.ndarray):
        """k, v fp32 [n, D] -> the decoded records' K, V, [n, D] each."""
        return self._codec(np.array(k, dtype=np.float32, order="C"),
                           np.array(v, dtype=np.float32, order="C"))


class RecordStaging(TokenRecords):
    """The plug-in's staging as token records of the per-token format
    `name` (KVARN_STAGING=int8, its CPU default, or fp8_e4m3, int4): each
    token-head's K and V rotated (kvarn_hadamard, x H / sqrt(D), its own
    inverse), through that format's token codec (TokenRecords) and rotated
    back: what attention reads for a staged token, and what a commit
    encodes."""

    def __init__(self, name: str, head_dim: int):
        assert name in _lib.STAGING_NAMES and name != "fp16", name
        super().__init__(name, head_dim)

    def _rotate(self, x: np.ndarray) -> None:
        self.L.kvarn_hadamard_rows(x.ctypes.data, x.shape[0], self.D)

    def roundtrip(self, k: np.ndarray, v: np.ndarray):
        """k, v fp32 [n, D] -> what the staging holds, [n, D] each."""
        k = np.array(k, dtype=np.float32, order="C")
        v = np.array(v, dtype=np.float32, order="C")
        self._rotate(k)
        self._rotate(v)
        ko, vo = self._codec(k, v)
        self._rotate(ko)
        self._rotate(vo)
        return ko, vo


_STATE = {"quantized": None, "codec": None, "staging": None, "prefill_exact": True,
          "per_token": None}


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
               softcap=None, **kw):
    """transformers attention function (query [B, Hq, S, D], key/value
    [B, Hk, S, D], post-RoPE and post-norm) with the codec applied; s_aux
    (in kw: gpt-oss's learned sinks, [Hq]) joins each softmax."""
    assert softcap is None, "soft-capping is refused by the plug-in; not emulated"
    B, Hq, S, D = query.shape
    Hk = key.shape[1]
    if scaling is None:
        scaling = D ** -0.5
    rep = Hq // Hk
    if _STATE["per_token"] is not None:
        if _STATE["quantized"](module):
            # every token read from its record (per-token formats)
            key, value = key.clone(), value.clone()
            for b in range(B):
                for h in range(Hk):
                    ks, vs = _STATE["per_token"](D).roundtrip(key[b, h].numpy(),
                                                              value[b, h].numpy())
                    key[b, h], value[b, h] = torch.from_numpy(ks), torch.from_numpy(vs)
        quant = False
        codec = None
    else:
        # the codec is made only where it quantizes (an exact run of a
        # head_dim the tile formats refuse, Phi-3's 96, needs none)
        quant = _STATE["quantized"](module)
        codec = _STATE["codec"](D) if quant else None
        quant = quant and getattr(codec, "layer_quantized", lambda layer: True)(module.layer_idx)
    # what the records are encoded from: the exact K/V (a prefill chunk's
    # whole tiles), or, below, the staged copy
    rec_key, rec_value = key, value
    if quant and _STATE["staging"] is not None:
        # every token is staged first: the sink and own tile are read from
        # there (and tiles commit from it unless prefill_exact)
        key, value = key.clone(), value.clone()
        for b in range(B):
            for h in range(Hk):
                ks, vs = _STATE["staging"](D).roundtrip(key[b, h].numpy(),
                                                        value[b, h].numpy())
                key[b, h], value[b, h] = torch.from_numpy(ks), torch.from_numpy(vs)
        if not _STATE["prefill_exact"]:
            rec_key, rec_value = key, value
    k = key.repeat_interleave(rep, dim=1)
    v = value.repeat_interleave(rep, dim=1)
    scores = torch.matmul(query, k.transpose(2, 3)) * scaling
    if quant:
        G = codec.G
        kq, vq = key.clone(), value.clone()
        for b in range(B):
            for h in range(Hk):
                for t in range(SINK_TILES, S // G):
                    sl = slice(t * G, (t + 1) * G)
                    codec.where = (module.layer_idx, h)   # for codecs that vary by layer/head
                    ko, vo = codec.roundtrip(rec_key[b, h, sl].numpy(),
                                             rec_value[b, h, sl].numpy())
                    kq[b, h, sl] = torch.from_numpy(ko)
                    vq[b, h, sl] = torch.from_numpy(vo)
        kq = kq.repeat_interleave(rep, dim=1)
        vq = vq.repeat_interleave(rep, dim=1)
        tile = torch.arange(S) // G
        use_rec = (tile[None, :] < tile[:, None]) & (tile[None, :] >= SINK_TILES)  # [Sq, Sk]
        scores_q = torch.matmul(query, kq.transpose(2, 3)) * scaling
        scores = torch.where(use_rec, scores_q, scores)
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        else:
            scores = scores + attention_mask
    s_aux = kw.get("s_aux")
    if s_aux is not None:
        # learned sinks (gpt-oss): one more logit per query head in each
        # softmax, with no value (attn.h kvarn_attn_opts.sinks)
        sink = s_aux.float().reshape(1, Hq, 1, 1).expand(B, Hq, scores.shape[2], 1)
        p = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=torch.float32)
        p = p[..., :-1]
    else:
        p = torch.softmax(scores, dim=-1, dtype=torch.float32)
    if quant:
        out = torch.matmul(p * use_rec, vq) + torch.matmul(p * ~use_rec, v)
    else:
        out = torch.matmul(p, v)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    AttentionInterface.register("kvarn_emu", _attention)
    AttentionMaskInterface.register("kvarn_emu", AttentionMaskInterface._global_mapping["eager"])


def _is_sliding(config, layer_idx: int) -> bool:
    lt = getattr(config, "layer_types", None)
    if lt:
        return lt[layer_idx] == "sliding_attention" and config.sliding_window is not None
    return getattr(config, "sliding_window", None) is not None


def logprobs(model_dir: str, ids: list, quantize: bool, quantize_sliding: bool = False,
             fmt: str = FORMAT, rtn_range: int = RTN_MINMAX, codec=None,
             staging: str = "fp16", prefill_exact: bool = True, per_token: str = None):
    """fp32 log-probabilities [len(ids), vocab] of the model on ids, the
    cache exact (quantize False) or through the codec as the plug-in would
    hold it: format fmt, kvarn_codec_opts.rtn_range rtn_range, or, when
    codec is given, codec(head_dim) (an object with .G and .roundtrip(k, v)
    as Codec's; .where is set to (layer, KV head) before each tile's round
    trip, and a method .layer_quantized(layer) returning False keeps that
    layer exact) in place of Codec(fmt, head_dim, rtn_range); staging
    "int8", "fp8_e4m3" or "int4" takes every token through RecordStaging of
    that format first (KVARN_STAGING=int8, ...), "fp16" keeps staged tokens
    exact; prefill_exact: records encoded from the exact K/V (True, the
    plug-in's CPU path for a prompt in one chunk) or from the staged copy
    (False, the plug-in before the direct commit, or tiles built by
    decoding); per_token "int8", "int4", "fp8_e4m3" or "fp8_e5m2" (with
    quantize) instead holds every token of the quantized layers as a
    record of that per-token format (TokenRecords: kvarn_int8, ...), no
    tiles, no staging."""
    from transformers import AutoModelForCausalLM
    _register()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="kvarn_emu")
    model.eval()
    cfg = model.config.get_text_config()
    # one codec (and staging) per head_dim, made at the first layer that
    # has it (Gemma-4's layers differ: 256 local, 512 global)
    codecs, stagings = {}, {}

    def codec_of(d: int):
        if d not in codecs:
            codecs[d] = codec(d) if codec else Codec(fmt, d, rtn_range)
        return codecs[d]

    def staging_of(d: int):
        if d not in stagings:
            stagings[d] = RecordStaging(staging, d)
        return stagings[d]
    per_token_of = {}

    def records_of(d: int):
        if d not in per_token_of:
            per_token_of[d] = TokenRecords(per_token, d)
        return per_token_of[d]
    _STATE["per_token"] = records_of if (quantize and per_token) else None
    _STATE["codec"] = codec_of
    _STATE["staging"] = staging_of if staging != "fp16" else None
    _STATE["prefill_exact"] = prefill_exact
    _STATE["quantized"] = lambda m: quantize and (
        quantize_sliding or not _is_sliding(cfg, m.layer_idx))
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=False)
    return torch.log_softmax(out.logits[0].float(), dim=-1).numpy()


def kl_rows(lp_p: np.ndarray, lp_q: np.ndarray) -> np.ndarray:
    """KL(P || Q) per row of two log-probability matrices."""
    return np.sum(np.exp(lp_p) * (lp_p - lp_q), axis=-1)
