"""Convert the project's GGUF model into a Hugging Face directory vLLM loads.

vLLM's CPU build cannot load the Q4_1 GGUF. transformers (with the `gguf`
package) dequantizes it; `save_pretrained` refuses a GGUF-quantized model,
so a plain LlamaForCausalLM is built from the config, given the
dequantized state dict, and saved in fp32 with the tokenizer.

    python -m kvarn_vllm.convert_gguf MODEL.gguf OUT_DIR

Re-running with an existing OUT_DIR/config.json does nothing.
"""
import os
import sys


def convert(gguf_path: str, out_dir: str) -> None:
    if os.path.exists(os.path.join(out_dir, "config.json")):
        return
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    folder, name = os.path.split(os.path.abspath(gguf_path))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    src = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                               dtype=torch.float32)
    config = src.config
    config.torch_dtype = "float32"
    for key in ("quantization_config",):
        if hasattr(config, key):
            delattr(config, key)
    dst = LlamaForCausalLM(config)
    missing, unexpected = dst.load_state_dict(src.state_dict(), strict=False)
    # Tied embeddings: lm_head.weight may be absent from the source dict.
    if [m for m in missing if m != "lm_head.weight"] or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {missing}, "
                           f"unexpected {unexpected}")
    tmp = out_dir + ".tmp"
    dst.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    os.replace(tmp, out_dir)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m kvarn_vllm.convert_gguf MODEL.gguf OUT_DIR")
    convert(sys.argv[1], sys.argv[2])
