"""The engine launcher of these tests (conftest.run_llm, run_llm.py
--serve): each engine runs in a process of its own forked from a parent
that has only imported torch and vLLM; an engine that fails or hangs does
not take the launcher, or the engines after it, down with it."""
import os
import subprocess

import pytest

import conftest
from conftest import run_llm


def test_each_engine_is_a_fresh_process_and_failures_stay_in_it(hf_model):
    if os.environ.get("KVARN_TEST_FRESH_PROCESS") == "1":
        pytest.skip("KVARN_TEST_FRESH_PROCESS=1: no launcher")
    res, err = run_llm(dict(kv_cache_dtype="no_such_format", prompts=["Hi"], max_tokens=1),
                       expect_ok=False)
    assert res is None and "no_such_format" in err, err[-2000:]
    # a run that outlives its time limit is killed with its process group
    # and reported as subprocess's timeout; the launcher serves on
    with pytest.raises(subprocess.TimeoutExpired):
        run_llm(dict(kv_cache_dtype="kvarn_k4v2_g128", prompts=["Hi"], max_tokens=1), timeout=1)
    launcher = conftest._LAUNCHER
    assert launcher is not None and launcher.proc.poll() is None
    a, _ = run_llm(dict(kv_cache_dtype="kvarn_k4v2_g128", prompts=["Hi"], max_tokens=2))
    b, _ = run_llm(dict(kv_cache_dtype="kvarn_k4v2_g128", prompts=["Hi"], max_tokens=2))
    # two engines in turn, the same launcher, the same greedy tokens
    assert conftest._LAUNCHER is launcher
    assert a["outputs"][0]["token_ids"] == b["outputs"][0]["token_ids"]
    assert len(a["outputs"][0]["token_ids"]) == 2


def test_the_callers_environment_reaches_the_engine(hf_model, monkeypatch):
    """An engine sees os.environ as it is at the call (as a one-shot
    process would), not as it was when the launcher started."""
    run_llm(dict(kv_cache_dtype="kvarn_k4v2_g128", prompts=["Hi"], max_tokens=1))  # launcher up
    monkeypatch.setenv("KVARN_STAGING", "fp6")
    res, err = run_llm(dict(kv_cache_dtype="kvarn_k4v2_g128", prompts=["Hi"], max_tokens=1),
                       expect_ok=False)
    assert res is None and "KVARN_STAGING must be one of" in err, err[-2000:]
