"""The plug-in's settings, read once from the environment when an engine's
configuration is made (platform.py, check_and_update_config, in the process
that calls LLM(...) or starts the server), checked there, and carried to
every worker inside vLLM's own configuration: VllmConfig.additional_config
["kvarn"], the field vLLM keeps for a platform's settings (pickled with the
configuration into the worker processes, and part of its hash). Nothing
here is read at import.

  KVARN_SINK_TILES     whole fp16 sink tiles per sequence (default 1, the
                       spec's: ../shared/spec/KVARN.md "Sink")
  KVARN_SINK_TOKENS    S: the first S tokens in fp16 instead (S // G whole
                       tiles and S % G tokens of the next, paged.h)
  KVARN_STAGING        fp16 | int8 | fp8_e4m3 | int4: how the staging pool
                       holds tokens not yet committed (default by device:
                       STAGING_DEFAULT)
  KVARN_PREFILL_COMMIT exact | staged: whole prefill tiles encoded from the
                       chunk's exact K/V, or from their staged copy
                       (default exact on CPU, staged on CUDA)
  KVARN_SLIDING_WINDOW vllm | quantize: sliding-window layers in vLLM's own
                       cache (default, as upstream KVarN) or in the kvarn
                       format too
"""
import os
from dataclasses import asdict, dataclass

KEY = "kvarn"                      # the entry of VllmConfig.additional_config
SLIDING_ENV = "KVARN_SLIDING_WINDOW"
# The settings of the tile formats' staging pool, sink and commit: a
# per-token format (kvarn_int8, ...) writes each token's record at once and
# has none of these, so an engine of one refuses them (checks.check_model)
TILE_SETTINGS = ("KVARN_SINK_TILES", "KVARN_SINK_TOKENS", "KVARN_STAGING",
                 "KVARN_PREFILL_COMMIT")


def tile_settings_set(env=None) -> list:
    """The TILE_SETTINGS that environment env (default os.environ) sets to
    a non-empty value, as "NAME=value" strings, in TILE_SETTINGS' order."""
    env = os.environ if env is None else env
    return [f"{k}={env[k]}" for k in TILE_SETTINGS if env.get(k, "")]

# The default staging by device (docs/vllm.md "Staging"): int8 where the
# kernels read it (CPU; SmolLM2 decode KLD 0.97x of fp16 staging with the
# AVX2 kernels, 1.06x with AVX-512's; fp8_e4m3 1.49x, int4 6.3x; about
# half the pool's bytes), fp16 on CUDA (its kernels stage fp16 only).
STAGING_DEFAULT = {"cpu": "int8", "cuda": "fp16"}


@dataclass(frozen=True)
class Settings:
    sink_tiles: int = 1
    sink_tokens: int = -1          # -1: unset (KVARN_SINK_TILES applies)
    staging: str = ""              # "": STAGING_DEFAULT for the device
    prefill_commit: str = ""       # "": exact on CPU, staged on CUDA
    sliding_window: str = "vllm"

    @classmethod
    def from_env(cls, env=None) -> "Settings":
        """The settings of environment env (default os.environ), checked:
        ValueError naming the variable and what it takes for a value it
        does not (an unknown staging name is the C library's error)."""
        env = os.environ if env is None else env

        def integer(name, default, low):
            raw = env.get(name, "")
            if raw == "":
                return default
            try:
                v = int(raw)
            except ValueError:
                v = None
            if v is None or v < low:
                raise ValueError(f"kvarn: {name} must be an integer >= {low} (got {raw!r})")
            return v
        s = cls(sink_tiles=integer("KVARN_SINK_TILES", 1, 0),
                sink_tokens=integer("KVARN_SINK_TOKENS", -1, 0),
                staging=env.get("KVARN_STAGING", ""),
                prefill_commit=env.get("KVARN_PREFILL_COMMIT", ""),
                sliding_window=env.get(SLIDING_ENV, "") or "vllm")
        if s.sliding_window not in ("vllm", "quantize"):
            raise ValueError(
                f"kvarn: {SLIDING_ENV} must be 'vllm' (default: sliding-window layers keep "
                f"vLLM's own cache) or 'quantize' (store them as kvarn records too); got "
                f"{s.sliding_window!r}")
        if s.prefill_commit not in ("", "exact", "staged"):
            raise ValueError(f"kvarn: KVARN_PREFILL_COMMIT must be exact or staged (got "
                             f"{s.prefill_commit!r})")
        if s.staging:
            from . import _lib
            _lib.parse_staging(s.staging)   # ValueError with the library's list
        return s

    @classmethod
    def of(cls, vllm_config) -> "Settings":
        """The settings an engine was configured with (record() put them in
        vllm_config.additional_config); the environment's where none were
        recorded (a configuration built without the kvarn platform)."""
        extra = getattr(vllm_config, "additional_config", None)
        d = extra.get(KEY) if isinstance(extra, dict) else None
        return cls(**d) if isinstance(d, dict) else cls.from_env()

    def record(self, vllm_config) -> None:
        """Store these settings in vllm_config.additional_config[KEY]."""
        if not isinstance(vllm_config.additional_config, dict):
            raise ValueError("kvarn: additional_config is not a dict; the kvarn plug-in keeps "
                             "its settings there")
        vllm_config.additional_config[KEY] = asdict(self)

    def sink(self, tile: int) -> tuple:
        """(sink_tiles, sink_partial) for tiles of `tile` tokens: with
        KVARN_SINK_TOKENS=S, S // tile whole tiles and S % tile tokens of
        the next (include/kvarn/paged.h); else KVARN_SINK_TILES tiles."""
        if self.sink_tokens < 0:
            return self.sink_tiles, 0
        return self.sink_tokens // tile, self.sink_tokens % tile

    def staging_kind(self, device_type: str = "cpu") -> int:
        """The staging (_lib.STAGING_*) on device_type ("cuda", else CPU):
        KVARN_STAGING or STAGING_DEFAULT. A per-token record staging on
        CUDA raises ValueError: its kernels stage fp16 only."""
        from . import _lib
        dev = "cuda" if device_type == "cuda" else "cpu"
        name = self.staging or STAGING_DEFAULT[dev]
        st = _lib.parse_staging(name)
        if st != _lib.STAGING_FP16 and dev == "cuda":
            raise ValueError(f"kvarn: KVARN_STAGING={name} is served by the CPU kernels only; "
                             "the CUDA kernels stage fp16 (unset KVARN_STAGING or set fp16)")
        return st

    def exact_commit(self, device_type: str = "cpu") -> bool:
        """Whether a prefill chunk's whole tiles are committed from the
        chunk's exact K/V (True) or from their staged copy. "exact" on CUDA
        raises ValueError: its kernels commit from fp16 pages only."""
        if device_type == "cuda":
            if self.prefill_commit == "exact":
                raise ValueError("kvarn: KVARN_PREFILL_COMMIT=exact is served by the CPU "
                                 "kernels only; the CUDA kernels commit from the staged fp16 "
                                 "pages (unset it or set staged)")
            return False
        return self.prefill_commit != "staged"
