"""benchmarks/batch_invariance.py: its arguments, the prompts every process rebuilds alike,
and the comparison of runs with the probe alone."""

from __future__ import annotations

import os

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")


@pytest.fixture
def bi(monkeypatch):
    monkeypatch.syspath_prepend(BENCH)
    import batch_invariance

    return batch_invariance


def test_arguments(bi):
    a = bi.parse_args(["--out", "d"])
    assert a.modes == ["default", "deterministic"] and a.batches == [4, 16, 64, 128, 256, 512]
    assert (a.shape, a.probe_len, a.shared_prefix, a.max_tokens, a.engine_args) == ("llama-3.1-8b", 100, 64, 32, {})
    assert bi.parse_args(["--out", "d", "--engine-args", '{"enable_dbo": true}']).engine_args == {"enable_dbo": True}
    for bad in (["--modes", "fast"], ["--batches", "0"], ["--shared-prefix", "100"], ["--probe-len", "1"]):
        with pytest.raises(SystemExit):
            bi.parse_args(["--out", "d", *bad])


def test_prompts_are_the_same_in_every_process_and_share_the_prefix(bi):
    a = bi.parse_args(["--out", "d", "--batches", "4,16", "--probe-len", "40", "--shared-prefix", "16"])
    probe, batches, sharer = bi.prompts(a, 5000)
    assert (probe, batches, sharer) == bi.prompts(a, 5000)
    assert len(probe) == 40 and sharer[:16] == probe[:16] and sharer[16:] != probe[16:36]
    for n, (at, others) in batches.items():
        assert len(others) == n - 1 and 0 <= at < n and all(20 <= len(o) <= 120 for o in others)


def test_compare_names_the_first_differing_token_and_the_gap_before_it(bi):
    ref = {"token_ids": [5, 6, 7], "logprobs": [-0.5, -1.0, -2.0]}
    runs = {"alone": ref, "same": dict(ref), "last bits": {"token_ids": [5, 6, 7], "logprobs": [-0.5, -1.0 + 2**-20, -2.0]},
            "other token": {"token_ids": [5, 9, 7], "logprobs": [-0.25, -3.0, -2.0]}}
    rows = {r["run"]: r for r in bi.compare(runs)}
    assert rows["same"] == dict(run="same", same_token_ids=True, first_diff_token=None, same_logprobs=True,
                                max_logprob_gap=0.0)
    assert rows["last bits"]["same_token_ids"] and not rows["last bits"]["same_logprobs"]
    assert rows["last bits"]["max_logprob_gap"] == 2**-20
    assert rows["other token"]["first_diff_token"] == 1 and rows["other token"]["max_logprob_gap"] == 0.25
