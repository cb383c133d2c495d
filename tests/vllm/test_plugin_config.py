"""Registration and flag parsing: the kvarn names reach vLLM's CLI and
EngineArgs, an unknown kvarn name gets the C library's own error (which
lists what is accepted), vLLM's own names keep working, and another vLLM
version is refused at load."""
import importlib.metadata
import subprocess
import sys

import pytest

import kvarn_vllm
from kvarn_vllm import checks, layout, plugin
from kvarn_vllm.settings import Settings
from conftest import ROOT

PRESETS = ["kvarn_k4v2_g128", "kvarn_k4v2_g64", "kvarn_k4v4_g128", "kvarn_k4v4_g64"]


def test_entry_points_are_installed():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert any(ep.value == "kvarn_vllm.plugin:register" for ep in eps)
    eps = importlib.metadata.entry_points(group="vllm.platform_plugins")
    assert any(ep.value == "kvarn_vllm.platform:platform_plugin" for ep in eps)


def test_kvarn_platform_is_vllms_with_kvarn_methods():
    """vLLM's current platform is the kvarn subclass of the one vLLM itself
    would pick here, and stays vLLM's own for vLLM's cache dtypes."""
    from vllm.platforms import current_platform
    from kvarn_vllm.platform import _builtin_choice, is_active
    import vllm.platforms.cpu as cpu
    assert is_active()
    base = _builtin_choice()
    assert base is not None and base.rsplit(".", 1)[1] in [c.__name__ for c in
                                                          type(current_platform).__mro__]
    assert isinstance(current_platform, cpu.CpuPlatform)


def test_settings_are_recorded_in_the_config(hf_model, monkeypatch):
    """The settings are read once, when the config is made, and travel in
    additional_config: a later change of the environment does not reach
    an engine already configured."""
    from vllm.engine.arg_utils import EngineArgs
    plugin.register()
    monkeypatch.setenv("KVARN_STAGING", "fp16")
    monkeypatch.setenv("KVARN_SINK_TOKENS", "130")
    cfg = EngineArgs(model=hf_model, kv_cache_dtype="kvarn_k4v2_g128",
                     block_size=128).create_engine_config()
    monkeypatch.setenv("KVARN_STAGING", "int4")
    monkeypatch.delenv("KVARN_SINK_TOKENS")
    s = Settings.of(cfg)
    assert s.staging_kind("cpu") == 0 and s.sink(128) == (1, 2)
    assert cfg.parallel_config.worker_cls == "kvarn_vllm.worker.KvarnCPUWorker"
    assert cfg.scheduler_config.scheduler_cls == "kvarn_vllm.scheduler.KvarnScheduler"
    own = EngineArgs(model=hf_model, block_size=128).create_engine_config()
    assert "kvarn" not in own.additional_config
    assert own.parallel_config.worker_cls == "vllm.v1.worker.cpu_worker.CPUWorker"
    assert own.scheduler_config.scheduler_cls is None


def test_bad_settings_refused_at_configuration(hf_model, monkeypatch):
    from vllm.engine.arg_utils import EngineArgs
    plugin.register()
    for var, val, msg in (("KVARN_SINK_TILES", "x", "KVARN_SINK_TILES must be an integer"),
                          ("KVARN_SINK_TOKENS", "-3", "KVARN_SINK_TOKENS must be an integer"),
                          ("KVARN_SLIDING_WINDOW", "all", "KVARN_SLIDING_WINDOW must be"),
                          ("KVARN_STAGING", "fp6", "KVARN_STAGING must be one of")):
        monkeypatch.setenv(var, val)
        with pytest.raises(ValueError, match=msg) as e:
            EngineArgs(model=hf_model, kv_cache_dtype="kvarn_k4v2_g128",
                       block_size=128).create_engine_config()
        # the platform's own error, not vLLM's pydantic wrapping of it
        assert type(e.value) is ValueError and str(e.value).startswith("kvarn: "), str(e.value)
        monkeypatch.delenv(var)


def _parser():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    plugin.register()
    return EngineArgs.add_cli_args(FlexibleArgumentParser())


@pytest.mark.parametrize("name", PRESETS + ["kvarn_k8v8_g32", "kvarn_k2v2_g64", "kvarn_k4v2_g128c",
                                            "kvarn_k4v4_g64c"])
def test_cli_accepts_every_kvarn_name(name):
    args = _parser().parse_args(["--kv-cache-dtype", name])
    assert args.kv_cache_dtype == name


@pytest.mark.parametrize("name", ["auto", "fp8", "fp8_e5m2", "bfloat16"])
def test_cli_keeps_vllm_names(name):
    assert _parser().parse_args(["--kv-cache-dtype", name]).kv_cache_dtype == name


def _parse_in_subprocess(value: str):
    """argparse exits on a bad value, its message on stderr: parse in a child."""
    code = ("from vllm.engine.arg_utils import EngineArgs;"
            "from vllm.utils.argparse_utils import FlexibleArgumentParser;"
            "import kvarn_vllm.plugin as p; p.register();"
            "EngineArgs.add_cli_args(FlexibleArgumentParser())"
            f".parse_args(['--kv-cache-dtype', {value!r}])")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)


def test_cli_unknown_kvarn_name_gets_library_error():
    r = _parse_in_subprocess("kvarn_k3v2_g128")
    assert r.returncode != 0
    assert "unknown cache format 'kvarn_k3v2_g128'" in r.stderr
    assert "kvarn_k4v2_g128" in r.stderr and "accepted" in r.stderr


def test_cli_rejects_garbage_non_kvarn_name():
    r = _parse_in_subprocess("int3")
    assert r.returncode != 0 and "int3" in r.stderr


def test_engine_args_and_cache_config(hf_model):
    from vllm.config import CacheConfig
    from vllm.engine.arg_utils import EngineArgs
    plugin.register()
    assert CacheConfig(cache_dtype="kvarn_k4v2_g128").cache_dtype == "kvarn_k4v2_g128"
    with pytest.raises(ValueError, match="accepted"):
        EngineArgs(model=hf_model, kv_cache_dtype="kvarn_k4v3_g128").create_engine_config()
    cfg = EngineArgs(model=hf_model, kv_cache_dtype="kvarn_k4v2_g128",
                     block_size=128).create_engine_config()
    assert cfg.cache_config.cache_dtype == "kvarn_k4v2_g128"


def test_other_vllm_version_is_refused(monkeypatch):
    import vllm
    monkeypatch.setattr(vllm, "__version__", "0.31.1")
    monkeypatch.setattr(plugin, "_done", False)
    with pytest.raises(RuntimeError, match=kvarn_vllm.SUPPORTED_VLLM.replace(".", r"\.")):
        plugin.register()


def staging_config(device_type):
    return Settings.from_env().staging_kind(device_type)


def prefill_commit_config(device_type):
    return Settings.from_env().exact_commit(device_type)


@pytest.mark.parametrize("name,want", [("fp16", 0), ("int8", 1), ("fp8_e4m3", 2), ("fp8", 2),
                                       ("int4", 3)])
def test_staging_names_on_cpu(monkeypatch, name, want):
    """KVARN_STAGING takes every staging the library names (paged.h
    kvarn_staging; fp8 is the format table's alias of fp8_e4m3) on CPU."""
    from kvarn_vllm import _lib
    monkeypatch.setenv("KVARN_STAGING", name)
    assert staging_config("cpu") == want
    assert _lib.staging_name(want) == ("fp8_e4m3" if name == "fp8" else name)


def test_staging_defaults_and_refusals(monkeypatch):
    """Unset: int8 on CPU, fp16 on CUDA. A record staging on CUDA (its
    kernels stage fp16 only) and an unknown name are refused with a
    message naming what is accepted."""
    monkeypatch.delenv("KVARN_STAGING", raising=False)
    assert staging_config("cpu") == 1 and staging_config("cuda") == 0
    for name in ("int8", "fp8_e4m3", "int4"):
        monkeypatch.setenv("KVARN_STAGING", name)
        with pytest.raises(ValueError, match=f"KVARN_STAGING={name} is served by the CPU"):
            staging_config("cuda")
    monkeypatch.setenv("KVARN_STAGING", "fp16")
    assert staging_config("cuda") == 0
    for bad in ("fp6", "fp8_e5m2", "bf16", "auto", "INT8"):
        monkeypatch.setenv("KVARN_STAGING", bad)
        with pytest.raises(ValueError, match="KVARN_STAGING must be one of fp16, int8, "
                                             "fp8_e4m3, int4"):
            staging_config("cpu")


def test_prefill_commit_defaults_and_refusals(monkeypatch):
    """KVARN_PREFILL_COMMIT: unset, a prefill chunk's whole tiles commit
    from the exact K/V on CPU and from the staged pages on CUDA (its
    kernels have no direct commit); `staged` works on both, `exact` on CUDA
    and an unknown value are refused naming what is accepted."""
    monkeypatch.delenv("KVARN_PREFILL_COMMIT", raising=False)
    assert prefill_commit_config("cpu") is True and prefill_commit_config("cuda") is False
    monkeypatch.setenv("KVARN_PREFILL_COMMIT", "staged")
    assert prefill_commit_config("cpu") is False and prefill_commit_config("cuda") is False
    monkeypatch.setenv("KVARN_PREFILL_COMMIT", "exact")
    assert prefill_commit_config("cpu") is True
    with pytest.raises(ValueError, match="KVARN_PREFILL_COMMIT=exact is served by the CPU"):
        prefill_commit_config("cuda")
    for bad in ("EXACT", "direct", "1"):
        monkeypatch.setenv("KVARN_PREFILL_COMMIT", bad)
        with pytest.raises(ValueError, match="KVARN_PREFILL_COMMIT must be exact or staged"):
            prefill_commit_config("cpu")


def _front_end_config(hf_model, name, device_type="cpu"):
    """The engine config LLM(...) builds for SmolLM2 with `name`, its device
    type then set as a CUDA build's would be (the CPU build cannot make a
    CUDA config itself)."""
    from vllm.engine.arg_utils import EngineArgs
    plugin.register()
    cfg = EngineArgs(model=hf_model, kv_cache_dtype=name, block_size=128).create_engine_config()
    cfg.device_config.device_type = device_type
    return cfg


def test_centred_format_refused_on_cuda_only(hf_model):
    """kvarn_*_c is served on CPU; on a CUDA device the front-end check
    refuses it, naming the plain format (the CUDA backend does not build it)."""
    checks.check_model(_front_end_config(hf_model, "kvarn_k4v2_g128c"))
    with pytest.raises(ValueError, match="CPU kernels only.*use kvarn_k4v2_g128$"):
        checks.check_model(_front_end_config(hf_model, "kvarn_k4v2_g128c", "cuda"))
    checks.check_model(_front_end_config(hf_model, "kvarn_k4v2_g128", "cuda"))


def test_value_bias_detection():
    """checks.has_value_bias: an attention_bias setting, or the Qwen2 family
    (q/k/v biases by construction); none for Llama's and Qwen3's defaults."""
    import transformers
    assert checks.has_value_bias(transformers.Qwen2Config())
    assert checks.has_value_bias(transformers.LlamaConfig(attention_bias=True))
    assert not checks.has_value_bias(transformers.LlamaConfig())
    assert not checks.has_value_bias(transformers.Qwen3Config())
    # what check_model passes: the text config (Qwen2-VL's is qwen2_vl_text)
    from vllm.transformers_utils.config import get_hf_text_config
    for cfg in (transformers.Qwen2VLConfig(), transformers.Qwen2_5_VLConfig()):
        assert checks.has_value_bias(get_hf_text_config(cfg)), cfg.model_type


@pytest.mark.parametrize("kv_tok,own_tok,k", [
    (114, 1024, 9),    # gpt-oss's shape (D 64, 2 KV heads): 9 x 114 = 1026 >= 1024
    (256, 2048, 1),    # Gemma-3's test shape (D 256): 8 x 256 divides, vLLM scales it
    (1024, 4096, 1),   # Gemma-4's global layers (D 512) beside its local ones: 4 x
    (228, 1024, 5),    # a record share that is not a power of two: 5 x 228 = 1140
    (1024, 1024, 1),   # no smaller than vLLM's page: nothing to align
    (2048, 1024, 1),
])
def test_page_alignment(kv_tok, own_tok, k):
    """layout.page_alignment: the fewest tiles whose page holds a tile of
    vLLM's tokens where the pages do not divide (else 1); the aligned
    kvarn page is at least vLLM's page of one tile and less than one more
    kvarn tile above it (never padding more than a tile's records)."""
    got = layout.page_alignment(128, kv_tok, own_tok)
    assert got == k
    if got > 1:
        assert own_tok <= got * kv_tok < own_tok + kv_tok
