"""Decode KLD of each MLA record format on the DeepSeek-V3-shaped random
model of tests/vllm/make_models.py, worked out by the emulator
(tests/vllm/emulate_mla.py: transformers fp32, each committed tile's latent
and RoPE key round-tripped through kvarn_mla_encode / kvarn_mla_decode), to
choose the RoPE part's width by measured KLD (issue 34 part 4; docs/mla.md
"Rope at 8 or 16 bits"). Prints one row per format: mean and max KL(exact ||
codec) over the decoded positions, and bytes per token per layer.

    .venv-vllm/bin/python bench/mla_format_kld.py [--tokens 1024] [--prompt 128] [--seed 11]

Positions from --prompt on read records of every tile completed before them
(the read rule of the plug-in's MLA backend); RoPE as the model was trained
(vllm_rope=False) and as vLLM 0.32's CPU kernel applies it (True)."""
import argparse
import os
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "tests", "vllm"), os.path.join(HERE, "..", "python")]

FORMATS = ["kvarn_mla_k8r16_g128", "kvarn_mla_k8r8_g128", "kvarn_mla_k4r16_g128",
           "kvarn_mla_k4r8_g128", "kvarn_mla_k2r16_g128", "kvarn_mla_k2r8_g128"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--seed", type=int, default=11)
    a = ap.parse_args()
    import emulate_mla
    import make_models
    from kvarn_vllm import _lib
    with tempfile.TemporaryDirectory() as d:
        model = make_models.make("deepseek_v3", d)
        import json
        with open(os.path.join(model, "config.json")) as f:
            c = json.load(f)
        latent, rope = c["kv_lora_rank"], c["qk_rope_head_dim"]
        ids = [int(x) for x in np.random.default_rng(a.seed).integers(3, c["vocab_size"], a.tokens)]
        dec = slice(a.prompt - 1, None)
        print(f"{a.tokens} tokens, decoded positions from {a.prompt}: "
              f"{a.tokens - a.prompt + 1} rows; latent {latent}, rope {rope}")
        print("| format | bytes/token/layer | KLD (trained RoPE) mean / max | KLD (vLLM CPU RoPE) mean / max |")
        print("|---|---|---|---|")
        exact = {v: emulate_mla.logprobs(model, ids, a.prompt, vllm_rope=v) for v in (False, True)}
        for name in FORMATS:
            fmt = _lib.mla_parse(name, latent, rope)
            rb = _lib.mla_record_bytes(fmt, latent, rope)
            cells = []
            for v in (False, True):
                codec = emulate_mla.logprobs(model, ids, a.prompt, vllm_rope=v,
                                             roundtrip=emulate_mla.MlaCodec(name, latent, rope))
                k = emulate_mla.kl_rows(exact[v], codec)[dec]
                cells.append(f"{k.mean():.5f} / {k.max():.5f}")
            print(f"| `{name}` | {rb / 128:.0f} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
