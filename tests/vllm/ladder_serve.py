"""kvarn-vllm-ladder for a test session: one process that imports torch,
vLLM and kvarn_vllm.ladder once, then runs the ladder's main(argv) for each
request in a child forked from it, as `python -m kvarn_vllm.ladder ARGV`
would run, without each run's own import of torch and vLLM (10-25 s on 2
shared cores). test_ladder.py runs the family ladders through it.

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


def _run(argv: list, prefix: str) -> None:
    """In the forked child: main(argv) with stdout and stderr to PREFIX.out
    and PREFIX.err. Never returns."""
    rc = 1
    try:
        for fd, ext in ((1, ".out"), (2, ".err")):
            f = os.open(prefix + ext, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(f, fd)
            os.close(f)
        from kvarn_vllm import ladder
        rc = ladder.main(argv)
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
    from kvarn_vllm import ladder  # noqa: F401
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _run(req["argv"], req["out"])
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    main()
