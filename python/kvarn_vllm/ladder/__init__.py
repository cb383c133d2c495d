"""kvarn-vllm-ladder: the quality ladder of KV-cache formats through vLLM,
for any model it serves (docs/eval.md "Through vLLM").

    python -m kvarn_vllm.ladder --model DIR --text FILE
        [--kv-cache-dtype all|LIST] [--ctx 2048] [--windows 4] [--decode 256]
        [--budget 16GiB] [--max-num-seqs N] [--max-num-batched-tokens 4096]
        [--dtype float32] [--engine-kv 1GiB] [--token-ids FILE]
        [--json FILE] [--plot FILE.png]

For every format, against vLLM's unquantized cache of the model (`auto`:
the model's dtype, the reference, named in the header):

  - capacity, as vLLM computes it for a KV budget of --budget bytes: bytes
    per token (vLLM's page bytes / block tokens, all layers), the KV tokens
    vLLM reports (its block count x block size, the plug-in's staging pool
    taken out first, as the plug-in's worker does; for an MLA record
    format its fp32 tail pool instead, below), that over the
    reference's, and how many requests of --ctx tokens fit (vLLM's blocks
    less its null block over the blocks one request holds, summed over the
    KV-cache groups as vLLM counts them: a model with local and global
    layers, Gemma-2's, has two groups drawing on one pool, and there KV
    tokens is vLLM's own group-aware figure, blocks / blocks per request x
    --ctx). The staging pool
    grows with max_num_seqs, so without --max-num-seqs each format gets the
    largest max_num_seqs N whose pool still leaves room for N such requests
    (the server sized for what it holds); with it, that N, and the fit is
    capped at it. The figures come from vLLM's own get_kv_cache_configs and
    the plug-in's staging_pool, called in the engine's process for --budget:
    nothing of that size is allocated (the measuring engine has a KV budget
    of --engine-kv, 1 GiB by default).
  - quality, over --windows windows of --ctx tokens of the text (the first
    windows * ctx tokens, the text tokenized once by the model's tokenizer,
    as `kvarn eval` does): each window is one prompt, and vLLM's prompt
    log-probabilities give each position's next-token distribution. The
    positions [0, ctx - decode) are the "prompt" columns (KLD mean, median,
    p99, top-1), the last --decode positions ("decode" columns: decode
    positions - 1 of them are scored, the last token has no next token)
    are the positions `kvarn eval` decodes one at a time. In vLLM with the
    plug-in every query reads the earlier tiles as committed records and
    its own tile as staged (docs/vllm.md "A step"), which is what `kvarn
    eval`'s decode column measures; vLLM's own caches also attend to the
    cache as stored. So the decode columns are the protocol of `kvarn eval
    --decode-tokens D` and comparable with it; the prompt columns are not
    `kvarn eval`'s chunked ones (there a chunk attends to its own K/V
    exactly). PPL over every scored position, and its delta to the
    reference's.
  - KLD: vLLM returns the top-k log-probabilities of a position, not the
    whole distribution. Where the vocabulary has at most EXACT_VOCAB
    entries every entry is asked for and KLD is exact; otherwise KLD is
    folded: the reference's top FOLD_TOP tokens that the format's top
    FORMAT_TOP also holds (both probabilities known), the rest of both
    distributions in one bucket. That is a partition of the vocabulary,
    and merging outcomes can only lower KL: a lower bound of the exact
    figure (looser where the format's top lacks some of the reference's;
    those positions are counted). Top-1 and PPL are exact either way (vLLM
    always returns the prompt token's own log-probability).

MLA models (DeepSeek-V2/V3, Kimi-K2: multi-head latent attention, decided
before any engine by vLLM's own rule on the model's config, model_uses_mla,
and checked against the reference's engine). vLLM's CPU MLA backend, and
the plug-in's MLA backend over it, run a prompt as MHA on the fresh latents
(chunked prefill and prefix caching are off for MLA), so no prompt position
reads the cache: prompt log-probabilities alone would give a KLD of ~0 for
every format. So each window is a prompt of ctx - decode tokens, then
decode - 1 decode steps one token at a time over the cache, each step's
token forced to the text's (teacher forcing: a vLLM v1 logits processor,
_forced_tokens_processor, passed as LLM(logits_processors=[...]), the
tokens in SamplingParams.extra_args; the returned log-probabilities come
from the raw logits before it, logprobs_mode "raw_logprobs"), for the
reference and every format alike; a step whose token is not the text's is
an error. The decode columns are the decoded positions; the prompt columns
stay the prompt's log-probabilities (with the prefill's last position, the
first step's), ~0 by construction for every format (the table's header
says so). The formats there: the plug-in's MLA records (kvarn_mla_*,
docs/mla.md; capacity with the plug-in's fp32 tail pool, one slot of G
tokens per sequence and MLA layer, mla_backend.tail_pool as the
worker's reserve_tail_pool takes it out of the budget) and vLLM's own
caches that its MLA backend holds (its supported_kv_cache_dtypes: auto on
CPU_MLA); the K/V formats (kvarn_k*v*, which the plug-in refuses on MLA)
and vLLM's other names are refused without an engine, as are kvarn_mla_*
names on a model without MLA. vLLM's own cache rows of an MLA model run
with attention_backend="CPU_MLA" unless the weights are bfloat16 (--dtype,
or the config's dtype for --dtype auto): on a CPU with AMX tiles vLLM 0.32
picks AMX_MLA, which takes bf16 weights only (and blocks of a multiple of
32), so the reference at the default --dtype float32 could not run there;
with bf16 weights vLLM's choice stands. The rows name the attention
backends their engines ran (JSON attention_backends).

Formats (--kv-cache-dtype all), in the staircase's order: on a model
without MLA, vLLM's auto, bfloat16, fp8_e4m3 and fp8_e5m2, the plug-in's
per-token kvarn_fp8_e4m3, kvarn_fp8_e5m2, kvarn_int8 and kvarn_int4
(data-derived scales), the four KVarN presets and their mean-centred
variants, kvarn_k4v2_g128 with each other staging, and one refused row
for every kvarn_mla_* name; on an MLA model auto, the six ALL_MLA formats
(kvarn_mla_k{4,2,8}_g{128,64}, RoPE key at 8 bits; the r8 / r16 names run
when named), and refused rows for vLLM's names its MLA backend does not
hold, the per-token formats and the presets, each with its reason in one
line. Named explicitly, a name refused without an engine is a usage error.

Each format runs in an engine of its own, in a process forked from this one
(which imports vLLM once and never the plug-in's backend: the plug-in reads
its settings at import and keeps a staging pool per process). A format may
carry plug-in settings after colons, e.g. kvarn_k4v2_g128:KVARN_STAGING=fp16
or kvarn_k4v2_g128:KVARN_SINK_TOKENS=16 (docs/vllm.md "Settings"); the MLA
record formats take none (a usage error).

For a model that adds a bias to its values (checks.has_value_bias: Qwen2's
family, attention_bias) the table ends with a line per plain KVarN format
run: which of it and its mean-centred variant (kvarn_X and kvarn_Xc, the
same settings) has the lower decode KLD, with the bytes per token of each,
or, where the centred one was not run, a line naming it. For a model that
mixes sliding-window and full layers (gpt-oss, Gemma-2/3/4) a line per
KVarN format run with the default KVARN_SLIDING_WINDOW (vllm: those layers
in vLLM's own cache) names the better of it and the same format with
KVARN_SLIDING_WINDOW=quantize, by KV tokens and KLD, or names the latter
to add (sliding_window_notes).

Output: a progress line on stderr (formats and windows), the table on
stdout, --json FILE the same numbers for machines, --plot FILE.png the
decode KLD (log) against capacity (matplotlib; labels placed so that none
overlaps another). Exit 0; 2 on a usage error
(a bad option, model, text or format name: nothing is run); 1 when the
reference cannot be served, or a format named in --kv-cache-dtype (not
through `all`) is refused at engine start (its row says why).

The package, one job a module: cli (options, windows of the text, the run
and its report), formats (the names checked without an engine, what `all`
holds), engine (each format's engine in a forked process, through
kvarn_vllm._proc), capacity (vLLM's figures for --budget, in that
process), score (KLD, top-1, PPL against the reference), report (the
table and the notes), plot (--plot), progress (the line on stderr). None
of it is imported by the plug-in (kvarn_vllm.plugin:register), and
nothing here imports vLLM, torch or numpy before a function needs it.
"""
from .cli import main
from .common import UsageError
from .formats import (ALL_PER_TOKEN, ALL_MLA, ALL_PRESETS, Job, ModelFacts,
                      coverage_warnings, expand_formats, model_uses_mla, vllm_mla_backend)
from .plot import PLOT_DPI, figure, pareto, plot
from .report import sliding_window_notes, value_bias_notes
from .score import score

__all__ = ["ALL_PER_TOKEN", "ALL_MLA", "ALL_PRESETS", "Job", "ModelFacts",
           "PLOT_DPI", "UsageError", "coverage_warnings",
           "expand_formats", "figure", "main", "model_uses_mla", "pareto", "plot", "score",
           "sliding_window_notes", "value_bias_notes", "vllm_mla_backend"]
