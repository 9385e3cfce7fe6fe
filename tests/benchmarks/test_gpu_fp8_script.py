"""benchmarks/gpu_fp8.py's driver without a GPU: the variants run alternated and repeated
per --max-num-seqs, and the table gives medians, spreads, ratios to bf16 and FP8 floors."""

from __future__ import annotations

import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")


@pytest.fixture
def gpu_fp8(monkeypatch):
    monkeypatch.syspath_prepend(BENCH)  # the script imports its sibling model_shapes
    import gpu_fp8

    return gpu_fp8


def test_alternated_runs_and_table(gpu_fp8, tmp_path, monkeypatch, capsys):
    calls = []
    rps = {"bf16": [10.0, 12.0], "fp8": [14.0, 16.0], "fp8-kv": [15.0, 17.0]}

    def fake_run(cfg_dir, out, variant, seqs, rep, num_prompts):
        calls.append((variant, seqs, rep))
        return {"requests_per_s": rps[variant][rep] * seqs / 256, "output_tokens_per_s": 1.0,
                "decode_step_ms_at_max_batch": 5.0, "max_decode_batch": seqs, "max_batch_context_tokens": 1000}

    monkeypatch.setattr(gpu_fp8, "run", fake_run)
    monkeypatch.setattr("sys.argv", ["gpu_fp8.py", "--out", str(tmp_path), "--max-num-seqs", "256", "512"])
    gpu_fp8.main()
    assert calls[:6] == [("bf16", 256, 0), ("fp8", 256, 0), ("fp8-kv", 256, 0),
                         ("fp8-kv", 256, 1), ("fp8", 256, 1), ("bf16", 256, 1)]
    assert len(calls) == 12
    out = capsys.readouterr().out
    assert "| fp8 | 256 | 15.00 (14.00-16.00) | 1.364x |" in out
    assert "| fp8-kv | 512 | 32.00 (30.00-34.00) | 1.455x |" in out
    saved = json.loads((tmp_path / "gpu_fp8.json").read_text())
    assert len(saved["fp8"]["512"]) == 2


def test_fp8_floors(gpu_fp8):
    r = {"max_batch_context_tokens": 0, "max_decode_batch": 1}
    hbm, compute = gpu_fp8.floors_ms(r, fp8_kv=True)
    # 8B shape without KV: ~6.98e9 FP8 layer weights + 2 x 0.525e9 bf16 LM head bytes at 4.8 TB/s
    assert 1.6 < hbm < 1.75 and compute < 0.01
    kv = {"max_batch_context_tokens": 100_000, "max_decode_batch": 256}
    assert gpu_fp8.floors_ms(kv, fp8_kv=False)[0] - gpu_fp8.floors_ms(kv, fp8_kv=True)[0] > 1.0


def test_unfused_variant_runs_fp8_with_the_separate_quantization(gpu_fp8, tmp_path, monkeypatch):
    """``fp8-unfused``: the ``fp8`` command with TANDEM_FP8_FUSED_QUANT=off in its environment."""
    seen = []
    monkeypatch.setattr(sys.modules[gpu_fp8.seed_workload_command.__module__], "tokenizer_dir", lambda: "tok")
    monkeypatch.setattr(gpu_fp8.subprocess, "run", lambda cmd, check, env: seen.append((cmd, env)))
    monkeypatch.setattr(gpu_fp8.json, "load", lambda f: {})
    for variant in ("fp8", "fp8-unfused"):
        path = tmp_path / f"{variant}_seqs256_rep0.json"
        path.write_text("{}")
        gpu_fp8.run("cfg", str(tmp_path), variant, 256, 0, 10)
    (fused_cmd, fused_env), (unfused_cmd, unfused_env) = seen
    assert fused_cmd[fused_cmd.index("--quantization") + 1] == "fp8" and "--kv-cache-dtype" not in fused_cmd
    assert [a for a in unfused_cmd if "unfused" not in a] == [a for a in fused_cmd if "fp8_seqs" not in a]
    assert unfused_env["TANDEM_FP8_FUSED_QUANT"] == "off" and "TANDEM_FP8_FUSED_QUANT" not in fused_env
