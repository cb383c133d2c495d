"""kvarn-vllm-ladder for a test session: one process that imports torch,
vLLM and the console script's entry-point function once (the
kvarn-vllm-ladder entry point the installed package declares:
kvarn_vllm.ladder:main), then runs it with argv for each request in a
child forked from it (kvarn_vllm._proc.run, the package's one launcher),
as `kvarn-vllm-ladder ARGV` would run, without each run's own import of
torch and vLLM (10-25 s on 2 shared cores). test_ladder.py runs the
family ladders through it (forkserver.py's protocol).

    python ladder_serve.py        # then one JSON line per run on stdin:
                                  # {"argv": [...], "out": PREFIX, "timeout": S}

Per run: the child's stdout goes to PREFIX.out, its stderr to PREFIX.err
(the ladder's engines, forked from the child, keep their logs as the
ladder does); the reply is one JSON line on stdout, {"rc": the exit
status, "timed_out": bool} (timed out: killed with its process group, and
the ladder's engine with it, after S seconds, default 900). The first
line, once the imports are done, is {"ready": true, "main": the
function's module:name, "file": its file}. EOF on stdin ends it."""
import sys


def entry_point():
    """The kvarn-vllm-ladder console script's function, loaded through the
    installed package's entry point (scripts/setup.sh --vllm installs it)."""
    import importlib.metadata
    eps = importlib.metadata.entry_points(group="console_scripts", name="kvarn-vllm-ladder")
    if not eps:
        sys.exit("ladder_serve.py: no kvarn-vllm-ladder entry point installed: run "
                 "scripts/setup.sh --vllm")
    return next(iter(eps)).load()


def main() -> None:
    import vllm  # noqa: F401  (imported once, inherited by every run)
    from vllm import LLM  # noqa: F401
    from forkserver import serve
    main_fn = entry_point()
    serve(lambda req: lambda: sys.exit(main_fn(req["argv"])),
          {"main": f"{main_fn.__module__}:{main_fn.__name__}",
           "file": sys.modules[main_fn.__module__].__file__})


if __name__ == "__main__":
    main()
