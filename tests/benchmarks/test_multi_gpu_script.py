"""benchmarks/multi_gpu.py's runner: a part whose command cannot start fails alone, and the
EP timing part (torchrun through this interpreter) runs on the CPU over gloo."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")


@pytest.fixture
def multi_gpu(monkeypatch):
    monkeypatch.syspath_prepend(BENCH)  # the script imports its sibling model_shapes
    import multi_gpu

    return multi_gpu


def test_missing_command_fails_the_part_only(multi_gpu):
    assert multi_gpu.run(["tandem-no-such-command-xyz"], limit=10) is False


def test_ep_timing_command_runs_without_torchrun_on_path(multi_gpu, tmp_path):
    out = str(tmp_path / "ep.json")
    cmd = multi_gpu.ep_timing_cmd(out)
    assert cmd[0] == sys.executable  # not a bare "torchrun", which PATH may lack
    env = {**os.environ, "PATH": "/usr/bin:/bin"}
    subprocess.run([*cmd, "--tokens", "4", "--iters", "1"], check=True, timeout=300, env=env)
    rows = json.load(open(out))["rows"]
    assert [r["tokens_per_rank"] for r in rows] == [4] and rows[0]["ep_size"] == 2
