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


def test_all_reduce_timing_runs_on_the_cpu_and_checks_the_sum(multi_gpu, tmp_path):
    """tp_all_reduce.py over gloo: the all-reduce is checked against the exact sum, the
    symmetric-memory primitives record why they cannot run, and the fastest is named."""
    out = str(tmp_path / "ar.json")
    cmd = multi_gpu.all_reduce_timing_cmd(out)
    subprocess.run([*cmd, "--tokens", "1,4", "--hidden", "64", "--reps", "1", "--iters", "1"], check=True,
                   timeout=300)
    got = json.load(open(out))
    assert got["world_size"] == 2 and got["backend"] == "gloo"
    for row in got["rows"]:
        assert row["nccl"]["max_abs_err"] == 0.0 and row["nccl"]["us"] > 0
        assert "needs CUDA" in row["symm_one_shot"]["error"] and "needs CUDA" in row["symm_two_shot"]["error"]
        assert row["fastest_all_reduce"] == "nccl" and len(row["per_rank_us"]["nccl"]) == 2
    assert [r["bytes"] for r in got["rows"]] == [1 * 64 * 4, 4 * 64 * 4]  # fp32 on the CPU


def test_tp_bench_runs_tp1_and_tp2_side_by_side(multi_gpu, tmp_path, monkeypatch):
    """TP=1 on one visible GPU and TP=2, at 256 and at the defaults, with their ratio."""
    calls = []

    def fake_run(cmd, limit, env=None):
        calls.append((cmd, env))
        out = cmd[cmd.index("--output-json") + 1]
        json.dump({"requests_per_s": 2.0 if "--tensor-parallel-size" in cmd else 1.0, "output_tokens_per_s": 1},
                  open(out, "w"))
        return True

    monkeypatch.setattr(multi_gpu, "run", fake_run)
    import model_shapes

    # The seed workload's tokenizer package is a GPU-machine dependency.
    monkeypatch.setattr(model_shapes, "tokenizer_dir", lambda: "tok")
    got = multi_gpu.tp_bench(str(tmp_path), "llama", 10)
    assert got["256"]["ratio"] == got["defaults"]["ratio"] == 2.0
    (one, env1), (two, env2), (one_d, _), (two_d, _) = calls
    assert env1 == {"CUDA_VISIBLE_DEVICES": "0"} and env2 is None
    assert "--max-num-seqs" in one and "--max-num-seqs" in two
    assert "--max-num-seqs" not in one_d and "--max-num-seqs" not in two_d


def test_pp_bench_runs_one_gpu_pp2_both_ways_and_tp2_side_by_side(multi_gpu, tmp_path, monkeypatch):
    """One GPU, PP=2 (batches in flight, then one at a time) and TP=2 at the defaults, with
    each run's ratio to one GPU and the stages' idle fractions kept."""
    calls = []

    def fake_run(cmd, limit, env=None):
        calls.append((cmd, env))
        out = cmd[cmd.index("--output-json") + 1]
        parallel = "--pipeline-parallel-size" in cmd or "--tensor-parallel-size" in cmd
        json.dump({"requests_per_s": 3.0 if parallel else 2.0, "output_tokens_per_s": 1,
                   "pp_stage_idle_fractions": [0.1, 0.2] if "--pipeline-parallel-size" in cmd else None},
                  open(out, "w"))
        return True

    monkeypatch.setattr(multi_gpu, "run", fake_run)
    import model_shapes

    monkeypatch.setattr(model_shapes, "tokenizer_dir", lambda: "tok")
    got = multi_gpu.pp_bench(str(tmp_path), "llama", 10)
    assert got["ratio_to_gpu1"] == {"pp2": 1.5, "pp2_one_batch": 1.5, "tp2": 1.5}
    assert got["pp2"]["pp_stage_idle_fractions"] == [0.1, 0.2]
    (one, env1), (pp2, env2), (pp2_sync, _), (tp2, _) = calls
    assert env1 == {"CUDA_VISIBLE_DEVICES": "0"} and env2 is None
    assert "--no-async-output-proc" in pp2_sync and "--no-async-output-proc" not in pp2
    assert all("--max-num-seqs" not in c for c, _ in calls)


def test_data_parallel_size_reaches_every_deepseek_part(multi_gpu, tmp_path, monkeypatch):
    """``--data-parallel-size 8``: both parity runs, the DBO off / on seed workload pair and
    the EP timing get 8 ranks (nothing is run: ``run`` records the commands)."""
    cmds = []
    monkeypatch.setattr(multi_gpu, "run", lambda cmd, limit, env=None: cmds.append(cmd) or False)
    # The seed workload's tokenizer package is a GPU-machine dependency.
    monkeypatch.setattr(multi_gpu, "seed_workload_command",
                        lambda model, out, *extra, max_num_seqs: ["tandem", "bench", *extra])
    multi_gpu.main(["--out", str(tmp_path), "--data-parallel-size", "8", "--ep-tokens", "1,8",
                    "--parts", "ds_parity,ds_parity_dbo,ds_bench,ep_timing"])
    ref, par, ref_dbo, par_dbo, off, on, timing = cmds
    assert json.loads(ref[-1]) == {} and json.loads(ref_dbo[-1]) == {}
    engine = json.loads(par[-1])
    assert (engine["data_parallel_size"], engine["enable_expert_parallel"], engine["all2all_backend"]) == \
        (8, True, "all_to_all")
    assert json.loads(par_dbo[-1]) == {**engine, "enable_dbo": True, "dbo_decode_token_threshold": 2,
                                       "dbo_prefill_token_threshold": 8, "dbo_measure_split": False}
    flags = ["--data-parallel-size", "8", "--enable-expert-parallel", "--all2all-backend", "all_to_all"]
    assert off[2:] == flags and on[2:] == [*flags, "--enable-dbo"]
    assert timing[timing.index("--nproc-per-node") + 1] == "8" and timing[-2:] == ["--tokens", "1,8"]
    saved = json.load(open(tmp_path / "multi_gpu_dp8.json"))
    assert saved["data_parallel_size"] == 8 and saved["ds_parity"]["ran"] is False
    # A later call with other parts keeps the earlier parts' results.
    multi_gpu.main(["--out", str(tmp_path), "--data-parallel-size", "8", "--parts", "ep_timing"])
    assert set(json.load(open(tmp_path / "multi_gpu_dp8.json"))) >= {"ds_parity", "ds_bench", "ep_timing"}


@pytest.mark.parametrize("argv,match", [
    (["--data-parallel-size", "3"], "invalid choice"),
    (["--parts", "ds_bench,nope"], "unknown part"),
    (["--data-parallel-size", "4", "--parts", "tp_bench,ep_timing"], "need 4 GPUs; 2 visible"),
])
def test_bad_arguments_stop_before_any_part(multi_gpu, tmp_path, monkeypatch, capsys, argv, match):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(multi_gpu, "run", lambda *a, **k: pytest.fail("a part ran"))
    with pytest.raises(SystemExit):
        multi_gpu.main(["--out", str(tmp_path), *argv])
    assert match in capsys.readouterr().err
    # Two GPUs are enough for the TP parts and DP=2.
    multi_gpu.parse_args(["--out", str(tmp_path), "--parts", "tp_parity,ds_parity"])
