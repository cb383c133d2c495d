"""pin_worker: the CPUs of a pytest-xdist worker, for tests/cli and
tests/vllm (their conftest.py pytest_configure; scripts/test.sh runs both
with `-n N --dist loadfile`, one worker per core)."""
import os


def pin_worker() -> list:
    """Under pytest-xdist, worker i of n keeps to every n-th CPU this
    process may use from the i-th on (sched_setaffinity, inherited by every
    process the worker starts), and OpenMP's and OpenBLAS's thread counts
    follow (both would otherwise start a thread per core of the machine,
    which the other worker's runs already use). Returns the worker's CPUs;
    [] outside xdist or with one worker (nothing changed). Results do not
    depend on these counts (the C tests' configuration matrix,
    docs/testing.md)."""
    wid = os.environ.get("PYTEST_XDIST_WORKER", "")
    n = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if not wid.startswith("gw") or n < 2:
        return []
    cpus = sorted(os.sched_getaffinity(0))
    mine = cpus[int(wid[2:]) % n::n] or cpus
    os.sched_setaffinity(0, mine)
    os.environ["OMP_NUM_THREADS"] = os.environ["OPENBLAS_NUM_THREADS"] = str(len(mine))
    return mine
