"""The engine of one format, in a process of its own forked from the
ladder's (_proc.run): vLLM started on the format, its capacity figures
read, the windows run (prompt log-probabilities, or on an MLA model
decode steps forced to the text's tokens); the raw rows passed back for
the ladder to score."""
import os
import time
import traceback

from .. import _proc
from .capacity import _capacity
from .formats import Job
from .progress import Progress

FORCE_ARG = "kvarn_ladder_forced_tokens"   # SamplingParams.extra_args key (MLA decode)
ENGINE_TIMEOUT_S = 3600


def _forced_tokens_processor():
    """The class of a vLLM v1 logits processor (vllm.v1.sample.logits_processor
    .LogitsProcessor, given to LLM(logits_processors=[...])) that forces
    each decode step's token: a request whose SamplingParams.extra_args
    hold FORCE_ARG: [t_0, t_1, ...] gets, at the step after its k-th
    output token, every logit but t_k's set to -inf and t_k's to 0, so that
    greedy sampling picks t_k (a request without it is left alone; past the
    list, nothing is forced). It is not argmax-invariant, so vLLM's sampler
    applies it before sampling and after it has taken the log-probabilities
    it returns from the raw logits (logprobs_mode "raw_logprobs", vLLM
    0.32's default, which the ladder also passes): the returned
    distributions are the model's, untouched by the forcing."""
    import torch
    from vllm.v1.sample.logits_processor import LogitsProcessor
    from vllm.v1.sample.logits_processor.builtin import process_dict_updates

    class ForcedTokens(LogitsProcessor):
        @classmethod
        def validate_params(cls, params):
            f = (params.extra_args or {}).get(FORCE_ARG)
            if f is not None and not (isinstance(f, list)
                                      and all(isinstance(t, int) and t >= 0 for t in f)):
                raise ValueError(f"extra_args[{FORCE_ARG!r}]: a list of token ids expected")

        def __init__(self, vllm_config, device, is_pin_memory):
            self.req = {}      # batch row -> (forced ids, the request's output ids so far)

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update) -> None:
            def new(params, _prompt, out):
                f = (params.extra_args or {}).get(FORCE_ARG)
                return None if f is None else (f, out)
            process_dict_updates(self.req, batch_update, new)

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            for row, (forced, out) in self.req.items():
                k = len(out)
                if k < len(forced):
                    logits[row].fill_(float("-inf"))
                    logits[row, forced[k]] = 0.0
            return logits
    return ForcedTokens


def _flat_rows(fl, skip: int, n: int, K: int, first: list, what: str) -> dict:
    """A window's part from vLLM's FlatLogprobs fl (flat_logprobs=True):
    positions skip .. skip + n - 1 of it, each K + 1 entries (the scored
    token, then the top K by rank; the positions before skip hold none).
    first: the token each position's entry 0 must be (the next token of the
    text). Returns actual_lp float32 [n], top_ids int32 [n, K], top_lps
    float32 [n, K]. RuntimeError on any other layout."""
    import numpy as np
    if n == 0:
        return dict(actual_lp=np.zeros(0, np.float32), top_ids=np.zeros((0, K), np.int32),
                    top_lps=np.zeros((0, K), np.float32))
    starts, ends = np.asarray(fl.start_indices), np.asarray(fl.end_indices)
    if len(starts) != skip + n or not np.all(ends[skip:] - starts[skip:] == K + 1) \
            or starts[skip] != 0:
        raise RuntimeError(f"unexpected {what} layout from vLLM (positions {len(starts)}, "
                           f"expected {skip + n}, the last {n} of {K + 1} entries)")
    tid = np.asarray(fl.token_ids, dtype=np.int32).reshape(n, K + 1)
    lp = np.asarray(fl.logprobs, dtype=np.float32).reshape(n, K + 1)
    if not np.array_equal(tid[:, 0], np.asarray(first, dtype=np.int32)):
        raise RuntimeError(f"vLLM's {what} do not start with the text's tokens")
    return dict(actual_lp=lp[:, 0].copy(), top_ids=tid[:, 1:].copy(),
                top_lps=lp[:, 1:].copy())


def _attention_backends(vllm_config) -> list:
    """The names of the attention backends the engine's layers run
    (get_name() of each layer's attn_backend: CPU_ATTN, CPU_MLA, AMX_MLA,
    KVARN, KVARN_MLA, ...)."""
    out = set()
    for layer in vllm_config.compilation_config.static_forward_context.values():
        b = getattr(layer, "attn_backend", None)
        if b is not None:
            try:
                out.add(b.get_name())
            except Exception:
                out.add(getattr(b, "__name__", str(b)))
    return sorted(out)


def _measure(job: Job, cfg: dict, send) -> dict:
    """In the engine's process: start the engine, read vLLM's capacity
    figures, run the windows, each one done told through send(text).
    Returns the result dict (no metrics: the parent scores against the
    reference).

    A window of ctx tokens gives ctx - 1 positions (row j: the distribution
    after token j). On a model without MLA it is one prompt, every row from
    vLLM's prompt log-probabilities. On an MLA model (cfg["mla"]) with
    decode > 0 it is a prompt of P = ctx - decode tokens (rows 0 .. P - 2
    from its prompt log-probabilities) and decode steps forced to the
    text's next tokens (_forced_tokens_processor; rows P - 1 .. ctx - 2
    from the steps' log-probabilities, row P - 1 the prefill's own last
    position); RuntimeError if a decoded token is not the text's."""
    import numpy as np
    import vllm.v1.engine.core as core
    cap = {}
    orig = core.get_kv_cache_configs

    def get_kv_cache_configs(vllm_config, specs, avail):
        try:
            cap.update(_capacity(orig, vllm_config, specs, cfg))
        except Exception as e:  # reported in the row, the measurement goes on
            cap["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        return orig(vllm_config, specs, avail)
    core.get_kv_cache_configs = get_kv_cache_configs
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from .. import _lib
    K = cfg["top"]
    decode = cfg["decode"]
    forced = cfg["mla"] and decode > 0
    kw = dict(model=cfg["model"], dtype=cfg["dtype"], seed=0, enforce_eager=True,
              kv_cache_dtype=job.name, max_num_seqs=1, max_model_len=cfg["ctx"] + 1,
              enable_prefix_caching=False, max_logprobs=K,
              max_num_batched_tokens=cfg["max_num_batched_tokens"],
              kv_cache_memory_bytes=cfg["engine_kv"])
    if _lib.is_mla_dtype(job.name):
        kw["block_size"] = _lib.mla_parse(job.name).tile_tokens
    elif _lib.is_kvarn_dtype(job.name) and not _lib.is_per_token_dtype(job.name):
        kw["block_size"] = _lib.parse_format(job.name).tile_tokens   # a page is a tile
    elif cfg["mla"] and cfg.get("attention_backend"):
        kw["attention_backend"] = cfg["attention_backend"]   # vllm_mla_backend
    if forced:
        kw.update(logits_processors=[_forced_tokens_processor()], logprobs_mode="raw_logprobs")
    t0 = time.perf_counter()
    llm = LLM(**kw)
    t_start = time.perf_counter() - t0
    vc = llm.llm_engine.vllm_config
    mc, cc = vc.model_config, vc.cache_config
    windows = []
    for w, ids in enumerate(cfg["windows"]):
        if not forced:
            sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=K,
                                detokenize=False, flat_logprobs=True)
            out = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
            windows.append(_flat_rows(out.prompt_logprobs, 1, len(ids) - 1, K, ids[1:],
                                      "prompt_logprobs"))
        else:
            P = len(ids) - decode
            sp = SamplingParams(temperature=0, max_tokens=decode, logprobs=K,
                                prompt_logprobs=K, detokenize=False, flat_logprobs=True,
                                ignore_eos=True, extra_args={FORCE_ARG: list(ids[P:])})
            out = llm.generate([TokensPrompt(prompt_token_ids=ids[:P])], sp,
                               use_tqdm=False)[0]
            got = list(out.outputs[0].token_ids)
            if got != list(ids[P:]):
                bad = next((i for i, (a, b) in enumerate(zip(got, ids[P:])) if a != b),
                           min(len(got), decode))
                raise RuntimeError(f"the forced decode of window {w + 1} left the text at "
                                   f"step {bad} ({len(got)} of {decode} tokens decoded)")
            pre = _flat_rows(out.prompt_logprobs, 1, P - 1, K, ids[1:P], "prompt_logprobs")
            dec = _flat_rows(out.outputs[0].logprobs, 0, decode, K, ids[P:], "logprobs")
            windows.append({k: np.concatenate([pre[k], dec[k]]) for k in pre})
        send(str(w + 1))
    from ..checks import has_value_bias
    res = dict(windows=windows, capacity=cap, start_s=t_start,
               run_s=time.perf_counter() - t0,
               engine_blocks=cc.num_gpu_blocks, engine_block_size=cc.block_size,
               model_dtype=str(mc.dtype).replace("torch.", ""),
               vocab=mc.get_vocab_size(), head_dim=mc.get_head_size(),
               value_bias=has_value_bias(mc.hf_text_config),
               sliding_layers=_sliding_layers(mc),
               use_mla=bool(getattr(mc, "use_mla", False)),
               attention_backends=_attention_backends(vc), forced_decode=forced)
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    return res


def _engine_process(job: Job, cfg: dict, send) -> dict:
    """The forked process of one format (_proc.run: vLLM's output in its
    log): the result of _measure, or the error it raised, as a dict;
    progress (windows done) through send."""
    # the engine core in this process (one import of torch and vLLM,
    # inherited); the KV budget is kv_cache_memory_bytes alone
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    from .. import _lib
    if _lib.is_per_token_dtype(job.name):
        # the tile formats' settings, where the caller's environment has
        # them, are for the KVarN rows: a per-token engine refuses them
        from ..settings import TILE_SETTINGS
        for k in TILE_SETTINGS:
            os.environ.pop(k, None)
    os.environ.update(job.env)
    try:
        return _measure(job, cfg, send)
    except BaseException as e:
        traceback.print_exc()
        msg = str(e).strip()
        return {"error": f"{type(e).__name__}: {msg}" if msg else type(e).__name__}


def run_job(job: Job, cfg: dict, tmp: str, idx: int, progress: Progress) -> dict:
    """Fork the format's engine process (_proc.run, ENGINE_TIMEOUT_S),
    follow its progress (progress.show), return its result ({"error": ...}
    if it failed; "log" names vLLM's output)."""
    log_path = os.path.join(tmp, f"job{idx}.log")
    progress.show(idx, job.label, "starting the engine")

    def on_line(line: str) -> None:
        progress.show(idx, job.label, f"window {int(line)}/{len(cfg['windows'])} done")
    try:
        res = _proc.run(lambda send: _engine_process(job, cfg, send), log_path,
                        timeout=ENGINE_TIMEOUT_S, on_line=on_line,
                        what="the engine's process").value_or_raise()
    except _proc.ChildError as e:
        res = {"error": e.reason}
    res["log"] = log_path
    return res


def _sliding_layers(mc) -> list:
    """[sliding-window layers, attention layers] of vLLM model config mc:
    hf_text_config.layer_types where the config has them (Gemma-2/3/4,
    gpt-oss), else every layer or none by model_config.get_sliding_window()
    (Mistral)."""
    n = mc.get_total_num_hidden_layers()
    types = getattr(mc.hf_text_config, "layer_types", None) or []
    if mc.get_sliding_window() is None:
        return [0, n]
    if len(types) == n:
        return [sum(t == "sliding_attention" for t in types), n]
    return [n, n]
