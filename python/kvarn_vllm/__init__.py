"""kvarn_vllm: kvarn's KV-cache formats inside vLLM, one flag
(--kv-cache-dtype kvarn_k4v2_g128). See docs/vllm.md."""
SUPPORTED_VLLM = "0.32.0"
