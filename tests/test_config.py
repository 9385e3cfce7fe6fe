"""EngineConfig rejects inconsistent simulated-EP settings with errors naming the field."""

from __future__ import annotations

import pytest

from tandem.config import EngineConfig


def test_simulated_ep_fields_are_checked():
    with pytest.raises(ValueError, match="simulated_ep_rank_experts"):
        EngineConfig(model="m", simulated_ep_rank_experts=True)
    with pytest.raises(ValueError, match="simulated_ep_size"):
        EngineConfig(model="m", all2all_backend="simulated", simulated_ep_size=0)
    cfg = EngineConfig(model="m", all2all_backend="simulated", simulated_ep_rank_experts=True)
    assert cfg.dbo_measure_split  # split decode graphs only where measured faster, by default


def test_cli_flags_reach_the_config():
    import argparse

    from tandem.entrypoints.cli import add_engine_args, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    cfg = engine_config_from_args(p.parse_args(["--model", "m", "--all2all-backend", "simulated",
                                                "--simulated-ep-rank-experts", "--no-dbo-measure-split"]))
    assert cfg.simulated_ep_rank_experts and not cfg.dbo_measure_split


@pytest.mark.parametrize("kw, field", [
    (dict(max_model_len=0), "max_model_len"),
    (dict(max_num_batched_tokens=-1), "max_num_batched_tokens"),
    (dict(num_kv_blocks=1), "num_kv_blocks"),
    (dict(kv_cache_memory_gib=0), "kv_cache_memory_gib"),
    (dict(master_port=70000), "master_port"),
    (dict(device="tpu"), "device"),
    (dict(device="cuda:99"), "cuda"),
    (dict(generation_config="/nonexistent"), "generation_config"),
])
def test_values_are_checked_when_the_config_is_made(kw, field):
    """Every entry point (LLM, the CLI, the server) builds an EngineConfig before loading."""
    with pytest.raises(ValueError, match=field):
        EngineConfig(model="m", **kw)


def test_device_cuda_without_cuda_says_what_to_do(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--device cpu"):
        EngineConfig(model="m", device="cuda")


def test_fp8_fields_are_checked_and_reach_the_config():
    import argparse

    import torch

    from tandem.entrypoints.cli import add_engine_args, engine_config_from_args

    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(model="m", quantization="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(model="m", kv_cache_dtype="fp16")
    assert EngineConfig(model="m", device="cpu").kv_cache_torch_dtype == torch.float32
    p = argparse.ArgumentParser()
    add_engine_args(p)
    cfg = engine_config_from_args(p.parse_args(["--model", "m", "--quantization", "fp8", "--kv-cache-dtype", "fp8"]))
    assert cfg.quantization == "fp8" and cfg.kv_cache_torch_dtype == torch.float8_e4m3fn
