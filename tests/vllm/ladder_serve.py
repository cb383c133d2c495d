"""kvarn-vllm-ladder for a test session: one process that imports torch,
vLLM and the console script's entry-point function once (the
kvarn-vllm-ladder entry point the installed package declares:
kvarn_vllm.ladder:main), then runs it with argv for each request in a
child forked from it, as `kvarn-vllm-ladder ARGV` would run, without each
run's own import of torch and vLLM (10-25 s on 2 shared cores).
test_ladder.py runs the family ladders through it.

    python ladder_serve.py        # then one JSON line per run on stdin:
                                  # {"argv": [...], "out": PREFIX}

Per run: the child's stdout goes to PREFIX.out, its stderr to PREFIX.err
(the ladder's engines, forked from the child, keep their logs as the
ladder does); the reply is one JSON line on stdout, {"rc": the exit
status}. The first line, once the imports are done, is {"ready": true}. EOF
on stdin ends it."""
import json
import os
import sys
import traceback


def entry_point():
    """The kvarn-vllm-ladder console script's function, loaded through the
    installed package's entry point (scripts/setup.sh --vllm installs it)."""
    import importlib.metadata
    eps = importlib.metadata.entry_points(group="console_scripts", name="kvarn-vllm-ladder")
    if not eps:
        sys.exit("ladder_serve.py: no kvarn-vllm-ladder entry point installed: run "
                 "scripts/setup.sh --vllm")
    return next(iter(eps)).load()


def _run(main_fn, argv: list, prefix: str) -> None:
    """In the forked child: main_fn(argv) with stdout and stderr to
    PREFIX.out and PREFIX.err. Never returns."""
    rc = 1
    try:
        for fd, ext in ((1, ".out"), (2, ".err")):
            f = os.open(prefix + ext, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(f, fd)
            os.close(f)
        rc = main_fn(argv)
    except SystemExit as e:      # argparse's usage errors
        rc = e.code if isinstance(e.code, int) else 2
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)


def main() -> None:
    import vllm  # noqa: F401  (imported once, inherited by every run)
    from vllm import LLM  # noqa: F401
    main_fn = entry_point()
    print(json.dumps({"ready": True, "main": f"{main_fn.__module__}:{main_fn.__name__}",
                      "file": sys.modules[main_fn.__module__].__file__}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _run(main_fn, req["argv"], req["out"])
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    main()
