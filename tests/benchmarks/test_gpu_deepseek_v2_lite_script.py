"""benchmarks/gpu_deepseek_v2_lite.py's driver without a GPU: ``--mla-prefill auto,torch``
runs each variant once per MLA prefill path (the environment variable set per run), passes
the batch limits on, and prints the ratio."""

from __future__ import annotations

import json
import os

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")


@pytest.fixture
def script(monkeypatch):
    monkeypatch.syspath_prepend(BENCH)  # the script imports its sibling model_shapes
    import gpu_deepseek_v2_lite
    import model_shapes

    monkeypatch.setattr(model_shapes, "tokenizer_dir", lambda: "/tokenizer")
    return gpu_deepseek_v2_lite


def test_mla_prefill_paths_side_by_side(script, tmp_path, monkeypatch, capsys):
    calls = []

    def fake_run(cmd, check, env):
        calls.append((cmd, env["TANDEM_MLA_PREFILL"]))
        rps = {"auto": 80.0, "torch": 40.0}[env["TANDEM_MLA_PREFILL"]]
        with open(cmd[cmd.index("--output-json") + 1], "w") as f:
            json.dump({"requests_per_s": rps, "output_tokens_per_s": 1.0, "prefill_steps_s": 100 / rps}, f)

    monkeypatch.setattr(script.subprocess, "run", fake_run)
    monkeypatch.setattr("sys.argv", ["gpu_deepseek_v2_lite.py", "--out", str(tmp_path), "--runs", "local",
                                     "--max-num-seqs", "default", "--max-num-batched-tokens", "16384",
                                     "--mla-prefill", "auto,torch"])
    script.main()
    assert [mode for _, mode in calls] == ["auto", "torch"]
    cmd = calls[0][0]
    assert "--max-num-seqs" not in cmd and cmd[cmd.index("--max-num-batched-tokens") + 1] == "16384"
    out = capsys.readouterr().out
    assert "| local_prefill_auto | 80.00 |" in out and "| local_prefill_torch | 40.00 |" in out
    assert "local: TANDEM_MLA_PREFILL auto / torch: 2.000x requests/s; steps with prefill 1.25 s vs 2.50 s" in out
